"""Test setup: full-precision float32 matmuls (JAX uses TF32 on GPU by default) before any test runs.

Test directories mirror the packages (tests/glm53, tests/attention, ...); pytest runs in importlib mode so
they do not shadow the packages they test. Shared helpers are fixtures here.
"""

import os
from pathlib import Path

import jax
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
jax.config.update("jax_default_matmul_precision", "highest")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hf_fixtures() -> Path:
    """Directory of the committed HF golden fixtures (tests/fixtures/make_hf_golden.py)."""
    return REPO / "tests" / "fixtures" / "hf_golden"


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny preset with random weights large enough that logits are far from uniform."""
    import glm53

    return glm53.init("tiny", seed=0, std=0.1)
