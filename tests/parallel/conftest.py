"""Multi-device tests on simulated CPU devices, robust to a test process that already has one device.

The number of CPU devices is fixed when JAX initialises, and the main suite initialises it with one. Tests
marked `@pytest.mark.multidevice` therefore run in one pytest subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=16 (meshes of 1, 2, 4, 8 and 16 devices are cut from
those 16): the first such test in a session starts the subprocess for every multidevice test selected in
this session (under pytest-xdist's loadfile, the README's, in the one worker that runs tests/parallel,
one unit of work there (tests/conftest.py); under other modes, one subprocess per test file, in the worker
that runs the file), and each test then reports the outcome (and failure text) its twin had there. Where
this process already has >= 16 devices, the tests run here directly:

    XLA_FLAGS=--xla_force_host_platform_device_count=16 python -m pytest -q tests/parallel

Multidevice tests must build their meshes inside the test body (fixtures run in this process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from experiments.common import with_fast_compile

DEVICES = 16
# It bounds a hung subprocess, not a slow one: the subprocess runs every multidevice test of the session
# (docs/testing.md has its time), and a busy 2-core machine stretches that up to 1.6x.
CHILD_TIMEOUT_S = 2400
ENV_CHILD = "PARALLEL_TESTS_SUBPROCESS"
ENV_REPORT = "PARALLEL_TESTS_REPORT"
ENV_PARENT = "PARALLEL_TESTS_PARENT_PID"
REPO = Path(__file__).resolve().parents[2]

_selected: list[str] = []
_child_results: dict | None = None
_child: tuple | None = None  # (Popen, temporary directory, start time) of the running subprocess
_child_file: str | None = None  # in an xdist worker: the one test file the subprocess runs


def pytest_configure(config):
    config.addinivalue_line("markers", f"multidevice: needs {DEVICES} simulated CPU devices (run in a subprocess "
                                       "when this process has fewer; see tests/parallel/conftest.py)")
    if _in_child():
        _watch_parent()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    _selected[:] = [item.nodeid for item in items if item.get_closest_marker("multidevice")]
    # early start, beside the suite; not for --collect-only, nor in an xdist worker (each would start a
    # whole subprocess: there the first multidevice test starts it)
    if config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if _selected and not _in_child() and not _enough_devices_here():
        _start_child()


def _watch_parent() -> None:
    """In the subprocess: exit when the parent pytest is gone (killed without running its cleanup) or
    the deadline passes, so a killed CI job never leaves it running."""
    import threading

    parent, deadline = int(os.environ[ENV_PARENT]), time.monotonic() + CHILD_TIMEOUT_S

    def watch():
        while True:
            time.sleep(2)
            try:
                os.kill(parent, 0)
            except OSError:
                os._exit(3)
            if time.monotonic() > deadline:
                os._exit(4)

    threading.Thread(target=watch, daemon=True).start()


def _enough_devices_here() -> bool:
    import jax

    return jax.device_count() >= DEVICES


def _in_child() -> bool:
    return os.environ.get(ENV_CHILD) == "1"


def pytest_runtest_logreport(report):
    """In the subprocess: record each phase's outcome and seconds for the parent."""
    path = os.environ.get(ENV_REPORT)
    if not (_in_child() and path):
        return
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "text": report.longreprtext, "duration": report.duration}) + "\n")


def _start_child(nodeids: list[str] | None = None) -> None:
    """Start the subprocess that runs `nodeids` (default: every selected multidevice test); its report
    goes to a temp file."""
    global _child
    tmp = tempfile.TemporaryDirectory(prefix="parallel_tests_")
    env = dict(os.environ)
    env[ENV_CHILD] = "1"
    env[ENV_REPORT] = str(Path(tmp.name) / "report.jsonl")
    env[ENV_PARENT] = str(os.getpid())
    # The programs are tiny: compile time dominates, and LLVM's optimisation level 0 halves it.
    env["XLA_FLAGS"] = with_fast_compile(f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(_selected if nodeids is None else nodeids)]
    # output to a file: a pipe nobody reads until the first multidevice test could fill and stall it
    with open(Path(tmp.name) / "output.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _child = (proc, tmp, time.monotonic())


def _collect_child() -> dict:
    """Wait for the subprocess (killed, with its process group, CHILD_TIMEOUT_S after it started)
    -> {nodeid: (outcome, text, seconds of its phases there)}."""
    proc, tmp, started = _child
    killed = ""
    try:
        proc.wait(timeout=max(CHILD_TIMEOUT_S - (time.monotonic() - started), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = f"\n[killed after {CHILD_TIMEOUT_S} s]"
    output = (Path(tmp.name) / "output.txt").read_text(errors="replace") + killed
    report = Path(tmp.name) / "report.jsonl"
    results: dict = {}
    if report.exists():
        for line in report.read_text().splitlines():
            r = json.loads(line)
            prev = results.get(r["nodeid"], ("passed", "", 0.0))
            outcome, text = (r["outcome"], r["text"]) if prev[0] == "passed" else prev[:2]  # a failure or skip wins
            results[r["nodeid"]] = (outcome, text, prev[2] + r["duration"])
    tmp.cleanup()
    results["__output__"] = ("", output, 0.0)
    return results


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A multidevice test's call phase reports its twin's seconds in the subprocess (all its phases), not
    this process's wait: `--durations` and tests/durations.json then show each multidevice test's cost
    instead of charging the whole subprocess to the first test that waits for it."""
    outcome = yield
    if call.when == "call" and _child_results is not None and item.get_closest_marker("multidevice"):
        twin = _child_results.get(item.nodeid)
        if twin is not None:
            outcome.get_result().duration = twin[2]


def pytest_unconfigure(config):
    """A session that ends before collecting the subprocess (interrupted, -x) kills it."""
    if _child is not None and _child[0].poll() is None:
        os.killpg(_child[0].pid, signal.SIGKILL)
        _child[0].wait()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    global _child_results, _child_file
    if not pyfuncitem.get_closest_marker("multidevice") or _in_child():
        return None
    file = pyfuncitem.nodeid.split("::")[0]
    if (os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("GLM53_MULTIDEVICE_ONE_WORKER")
            and _child_file != file):
        # In an xdist worker that runs only the files sent to it (a --dist mode other than the README's
        # loadfile): one subprocess per test file, for that file's selected tests, so that no two workers
        # both run every multidevice test. Under --dist loadfile all of tests/parallel is one unit of work
        # (tests/conftest.py): one subprocess for all of them in this worker, as without xdist.
        if _enough_devices_here():
            return None
        _start_child([n for n in _selected if n.split("::")[0] == file])
        _child_file, _child_results = file, None
    elif _child is None:
        if _enough_devices_here():
            return None  # enough devices here: run the test in this process
        _start_child()
    if _child_results is None:
        _child_results = _collect_child()
    outcome, text, _ = _child_results.get(pyfuncitem.nodeid, (None, "", 0.0))
    if outcome == "passed":
        return True
    if outcome == "skipped":
        pytest.skip(f"skipped in the {DEVICES}-device subprocess: {text}")
    if outcome is None:
        pytest.fail(f"no result from the {DEVICES}-device subprocess; its output:\n"
                    f"{_child_results['__output__'][1][-6000:]}", pytrace=False)
    pytest.fail(f"failed in the {DEVICES}-device subprocess:\n{text}", pytrace=False)


# ------------------------------------------------------------------------------------------- test data
DIMS = {"H": 4, "R": 16, "P": 8, "HI": 2, "DI": 8}  # tiny attention dims: 4 heads (fewer than 8 ranks), latent 16, rope 8


def random_inputs(seed: int, q_lead: tuple, s_lead: tuple, *, ties: bool = False, **dims):
    """Random float32 attention inputs. Queries [*q_lead, ...]: q_lat [H,R], q_pe [H,P], indexer qi [HI,DI]
    and w [HI]; cache rows [*s_lead, R+P] and indexer keys [*s_lead, DI].

    ties=True draws qi and keys from {-1, 0, 1} and w from {-1, -1/2, 1/2, 1, 2}: every index score is then
    an exact small binary fraction, whatever the summation order, with many exact ties (zeros from the
    ReLU among them)."""
    import numpy as np

    d = {**DIMS, **dims}
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = {"q_lat": normal(*q_lead, d["H"], d["R"]), "q_pe": normal(*q_lead, d["H"], d["P"]),
           "rows": normal(*s_lead, d["R"] + d["P"])}
    if ties:
        out["qi"] = rng.integers(-1, 2, (*q_lead, d["HI"], d["DI"])).astype(np.float32)
        out["w"] = rng.choice(np.array([-1, -0.5, 0.5, 1, 2], np.float32), (*q_lead, d["HI"]))
        out["keys"] = rng.integers(-1, 2, (*s_lead, d["DI"])).astype(np.float32)
    else:
        out["qi"], out["w"], out["keys"] = normal(*q_lead, d["HI"], d["DI"]), normal(*q_lead, d["HI"]), normal(*s_lead, d["DI"])
    return out


@pytest.fixture
def inputs():
    """`random_inputs` (a plain function: safe for multidevice tests, whose fixtures run in this process)."""
    return random_inputs
