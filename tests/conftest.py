"""Test setup: full-precision float32 matmuls (JAX uses TF32 on GPU by default) before any test runs.

Test directories mirror the packages (tests/glm53, tests/attention, ...); pytest runs in importlib mode so
they do not shadow the packages they test. Shared helpers are fixtures here.
"""

import atexit
import json
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

# One on-disk JAX compilation cache per session, named by $GLM53_TEST_COMPILE_CACHE: the controller
# creates it, empties it at start and removes it at exit; the xdist workers, the multidevice subprocess and
# the server and peer processes the tests start inherit the variable. Programs of the same shapes recur
# across files and processes (every engine of a deployment on the 2-layer model compiles the same
# programs, whichever model object or process it is in), and after bound_memory_maps drops JAX's in-memory
# caches a worker reloads what it had compiled. Programs that compile in under 0.2 s are not written
# (the eager ops: their entries would cost more than they save). A program loaded from it still counts as
# a compilation (glm53.engine.runner.CompileCounter; tested), so the zero-compilation checks stay strict.
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if not _WORKER and "GLM53_TEST_COMPILE_CACHE" not in os.environ:
    _cache = os.path.join(tempfile.gettempdir(), f"glm53-test-jax-cache-{os.getpid()}")
    shutil.rmtree(_cache, ignore_errors=True)
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["GLM53_TEST_COMPILE_CACHE"] = _cache
if os.environ.get("GLM53_TEST_COMPILE_CACHE"):
    os.makedirs(os.environ["GLM53_TEST_COMPILE_CACHE"], exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.environ["GLM53_TEST_COMPILE_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

REPO = Path(__file__).resolve().parents[1]
DURATIONS = REPO / "tests" / "durations.json"
_file_seconds: dict[str, float] = {}


# Under xdist, every tests/parallel file is one unit of work (the multidevice tests all live there): its
# worker runs them all in one 16-device subprocess that compiles each program once for all of them
# (tests/parallel/conftest.py reads this variable in the worker).
MULTIDEVICE_GROUP = "tests/parallel"
TEST_MAX_MAPS = 30_000
ONE_WORKER_ENV = "GLM53_MULTIDEVICE_ONE_WORKER"


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true",
                     help=f"write each test file's seconds (setup + call + teardown) into {DURATIONS.relative_to(REPO)}")


def pytest_configure(config):
    # in the controller, before it starts the workers (they inherit the environment)
    if not _WORKER and config.getoption("dist", "no") == "loadfile" and config.getoption("numprocesses", None):
        os.environ[ONE_WORKER_ENV] = "1"


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit_of(nodeid: str) -> str:
    """The unit of work xdist hands to one worker: a test file, or all of tests/parallel."""
    f = _file_of(nodeid)
    return MULTIDEVICE_GROUP if f.startswith(MULTIDEVICE_GROUP + "/") else f


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with tests/parallel as one unit (xdist's loadgroup would do it with a marker, but
    with pytest 9.2 it no longer groups: it renames `item._nodeid`, which pytest's node ids stopped
    reading)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Units of work (`_unit_of`) ordered longest first (tests/durations.json, seconds per file from a
    `-n 2 --write-durations` run; a file not listed counts as 0 s), each file's tests in their own order:
    with the README's `--no-loadscope-reorder` xdist hands the units to the two workers in this order, so
    the last unit to start is a short one and neither worker idles at the end while the other runs a long
    one."""
    try:
        seconds = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        seconds = {}
    unit_seconds: dict[str, float] = {}
    for f in {_file_of(item.nodeid) for item in items}:
        unit_seconds[_unit_of(f)] = unit_seconds.get(_unit_of(f), 0.0) + seconds.get(f, 0.0)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_unit_of(item.nodeid), i)
    items.sort(key=lambda item: (-unit_seconds[_unit_of(item.nodeid)], first[_unit_of(item.nodeid)]))


def pytest_runtest_logreport(report):
    # in the controller under xdist (workers' reports come to it) or in a run without workers
    if not _WORKER:
        _file_seconds[_file_of(report.nodeid)] = _file_seconds.get(_file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    # the files this run measured replace their entries; the other files keep theirs
    if not _WORKER and session.config.getoption("--write-durations") and _file_seconds:
        try:
            seconds = json.loads(DURATIONS.read_text())
        except FileNotFoundError:
            seconds = {}
        seconds.update({f: round(s, 1) for f, s in _file_seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(seconds.items(), key=lambda x: -x[1])), indent=0) + "\n")


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    # a long-lived test process (an xdist worker) crosses vm.max_map_count unless JAX's caches are dropped
    # now and then (tests share compiled shapes until then): experiments.common.bound_memory_maps. Each
    # drop makes the next tests compile what they shared again, so the bound leaves one test room for
    # 35,000 more mappings below the kernel's 65,530 (the most one test adds is about 13,000: docs/testing.md)
    yield
    bound_memory_maps(TEST_MAX_MAPS)


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
def small_model():
    """The tiny preset cut to 2 layers (tests/models.py) and its MTP layer: for the engine and parallel tests
    whose subject is a policy, a layout or the runner's programs rather than the model's depth, at about
    half the tiny model's compile time (glm53.init("tiny") is the model's own tests' subject)."""
    from tests.models import small_model

    return small_model()


@pytest.fixture(scope="session")
def small_mid_model():
    """The mid preset cut to 2 layers (tests/models.py): its 8 heads and 16 experts (the head and expert
    splits of tensor parallelism that the tiny model's 4 heads and 8 experts never give) without its depth."""
    import glm53
    from tests.models import two_layers

    return glm53.init(two_layers("mid"), seed=0, std=0.05)


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Four prompts (37, 5, 70 and 20 tokens) and the tiny model's 5 greedy tokens for each, one prompt
    at a time with no engine: what every engine configuration must reproduce."""
    import numpy as np

    import glm53

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]
    return prompts, [glm53.generate(tiny_model, p, 5).token_ids.tolist() for p in prompts]


@pytest.fixture(scope="session")
def small_reference(small_model):
    """`reference`'s four prompts and the 2-layer model's 5 greedy tokens for each, one prompt at a time
    with no engine: what the engine and host-tier tests on that model must reproduce."""
    import numpy as np

    import glm53

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]
    return prompts, [glm53.generate(small_model, p, 5).token_ids.tolist() for p in prompts]
