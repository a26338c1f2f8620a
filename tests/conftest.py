"""Test setup: full-precision float32 matmuls (JAX uses TF32 on GPU by default) before any test runs.

Test directories mirror the packages (tests/glm53, tests/attention, ...); pytest runs in importlib mode so
they do not shadow the packages they test. Shared helpers are fixtures here.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from experiments.common import bound_memory_maps, with_fast_compile

# Before JAX starts its backend: the suite compiles thousands of tiny programs, and compilation dominates
# its time; the tests' own subprocesses (servers, peers, benchmarks, the multidevice run) inherit it.
os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# No persistent compilation cache in the test processes themselves (three clean-clone CI runs,
# 2026-12-02, crashed in its writes: the memory-map limit below, hit there first). Server and peer
# processes the tests start (tests/glm53/test_serve.py, tests/kvcache/test_tiers*.py) and the MTP runs of
# tests/engine/test_recompilation.py compile the same programs each, so they share one on-disk cache per session, named by $GLM53_TEST_COMPILE_CACHE: the controller creates it,
# empties it at start and removes it at exit; xdist workers inherit the variable.
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if not _WORKER and "GLM53_TEST_COMPILE_CACHE" not in os.environ:
    _cache = os.path.join(tempfile.gettempdir(), f"glm53-test-jax-cache-{os.getpid()}")
    shutil.rmtree(_cache, ignore_errors=True)
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["GLM53_TEST_COMPILE_CACHE"] = _cache
if os.environ.get("GLM53_TEST_COMPILE_CACHE"):
    os.makedirs(os.environ["GLM53_TEST_COMPILE_CACHE"], exist_ok=True)

REPO = Path(__file__).resolve().parents[1]

@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    # a long-lived test process (an xdist worker) crosses vm.max_map_count unless JAX's caches are dropped
    # now and then (tests share compiled shapes until then): experiments.common.bound_memory_maps
    yield
    bound_memory_maps()


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
