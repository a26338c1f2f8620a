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

# No persistent compilation cache in the test processes themselves (three clean-clone CI runs,
# 2026-12-02, crashed in its writes: the memory-map limit below, hit there first). Server and peer
# processes the tests start (tests/glm53/test_serve.py, tests/kvcache/test_tiers*.py) compile the same
# few programs each, so they share one on-disk cache per session, named by $GLM53_TEST_COMPILE_CACHE: the controller creates it,
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

# XLA:CPU maps about 6 memory regions per loaded executable and keeps them while JAX's caches hold it; a
# long-lived test process (an xdist worker) compiles tens of thousands of programs and crosses the
# kernel's vm.max_map_count (65,530 here), after which XLA segfaults or aborts inside a compile or an
# executable's serialization (docs/testing.md). Between tests, once the process holds more than
# MAX_MAPS mappings, JAX's caches are dropped (tests share compiled shapes until then).
MAX_MAPS = 20_000


def _num_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    yield
    if _num_maps() > MAX_MAPS:
        import gc

        jax.clear_caches()
        gc.collect()


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
