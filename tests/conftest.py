"""Test setup: full-precision float32 matmuls (JAX uses TF32 on GPU by default) before any test runs.

Test directories mirror the packages (tests/glm53, tests/attention, ...); pytest runs in importlib mode so
they do not shadow the packages they test. Shared helpers are fixtures here.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache per test session. Tests build their own model objects, each with its
# own jitted functions, so the same programs would compile again and again (seconds each on CPU); with
# the on-disk cache a repeat is a load. It is fresh per session: nothing stale crosses runs. Under
# pytest-xdist the workers share their controller's (named by its pid; the controller empties it at
# start and removes it at exit): a program one worker compiled is a load for the other. A size bound
# turns on JAX's file lock, which makes concurrent writers and readers of one entry safe.
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
_COMPILE_CACHE = os.path.join(tempfile.gettempdir(), f"glm53-test-jax-cache-{os.getppid() if _WORKER else os.getpid()}")
if not _WORKER:
    shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)
    atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
os.makedirs(_COMPILE_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_compilation_cache_max_size", 16 << 30)

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


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Four prompts (37, 5, 70 and 20 tokens) and the tiny model's 5 greedy tokens for each, one prompt
    at a time with no engine: what every engine configuration must reproduce."""
    import numpy as np

    import glm53

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]
    return prompts, [glm53.generate(tiny_model, p, 5).token_ids.tolist() for p in prompts]
