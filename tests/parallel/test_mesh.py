"""Meshes, the multi-process launcher, and a real 2-process run over jax.distributed (gloo on loopback)."""

import concurrent.futures
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from experiments.common import FAST_COMPILE_XLA_FLAGS as FAST_COMPILE
from parallel import launch
from parallel import mesh as pmesh

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multihost_worker.py")


# ------------------------------------------------------------------------------------------------ meshes
@pytest.mark.multidevice
@pytest.mark.parametrize("dp,tp,cp", [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (1, 1, 16), (2, 1, 8), (1, 2, 4)])
def test_meshes_of_1_to_16_devices_run_a_collective(dp, tp, cp):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    m = pmesh.make_mesh(dp=dp, tp=tp, cp=cp)
    assert m.axis_names == pmesh.AXES and dict(m.shape) == {"dp": dp, "tp": tp, "cp": cp}
    assert all(t == AxisType.Auto for t in m.axis_types)
    # each cp rank holds one row; the all-gather over cp puts every row on every rank (no device_put first:
    # Auto axes accept unsharded inputs)
    x = np.arange(dp * cp * 3, dtype=np.float32).reshape(dp * cp, 3)
    f = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "cp", tiled=True).sum(0, keepdims=True), mesh=m,
                              in_specs=P(("dp", "cp")), out_specs=P(("dp", "cp"))))
    got = np.asarray(f(jnp.asarray(x)))
    want = np.repeat(x.reshape(dp, cp, 3).sum(1), cp, axis=0)
    np.testing.assert_array_equal(got, want)


def test_make_mesh_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs 32 devices"):
        pmesh.make_mesh(dp=2, cp=16)
    with pytest.raises(ValueError, match="MeshShape.cp"):
        pmesh.make_mesh(cp=0)
    with pytest.raises(ValueError, match="MeshShape.tp"):
        pmesh.MeshShape(tp=1.5)


def test_ep_axes_reuse_the_context_axis():
    m = AbstractMesh((2, 1, 8), pmesh.AXES, axis_types=(AxisType.Auto,) * 3)
    assert pmesh.ep_axes(m, 8) == ("cp",)  # PCP8 x DCP8 x EP8 on 8 devices
    assert pmesh.ep_axes(m, 16) == ("dp", "cp")
    assert pmesh.ep_axes(m, 1) == ()
    with pytest.raises(ValueError, match="ep=4"):
        pmesh.ep_axes(m, 4)
    assert pmesh.axis_size(m, ("dp", "cp")) == 16
    with pytest.raises(ValueError, match="not in the mesh"):
        pmesh.axis_size(m, "ep")


def test_init_distributed_needs_a_coordinator(monkeypatch):
    monkeypatch.delenv(pmesh.ENV_COORDINATOR, raising=False)
    with pytest.raises(ValueError, match="coordinator"):
        pmesh.init_distributed()
    with pytest.raises(ValueError, match="process_id"):
        pmesh.init_distributed("127.0.0.1:1", 2, 5)


# ---------------------------------------------------------------------------------------------- launcher
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_launch_runs_every_process_with_its_id():
    code = "import os; print(os.environ['PARALLEL_PROCESS_ID'], os.environ['PARALLEL_NUM_PROCESSES'], " \
           "os.environ['PARALLEL_COORDINATOR'].split(':')[0])"
    results = launch.launch(_py(code), num_processes=3, timeout_s=60)
    assert [r.stdout.split() for r in results] == [[str(i), "3", "127.0.0.1"] for i in range(3)]
    assert all(r.returncode == 0 for r in results)


def test_launch_kills_the_others_when_one_fails():
    code = "import os, sys, time\nif os.environ['PARALLEL_PROCESS_ID'] == '1': sys.exit(3)\ntime.sleep(120)"
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchError, match="process 1 exited with status 3") as e:
        launch.launch(_py(code), num_processes=2, timeout_s=100, grace_s=1)
    assert time.monotonic() - t0 < 30
    assert e.value.results[0].returncode is None and e.value.results[1].returncode == 3


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # a zombie waiting for its (re)parent to reap it: not running


def test_launch_timeout_kills_the_whole_process_group(tmp_path):
    """A hung process and a grandchild it started are both killed when the deadline passes."""
    pidfile = tmp_path / "grandchild.pid"
    code = (f"import subprocess, time\np = subprocess.Popen(['sleep', '300'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(300)")
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchError, match="timed out"):
        launch.launch(_py(code), num_processes=1, timeout_s=1.5, grace_s=1)
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 5
    while not _gone(int(pidfile.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(int(pidfile.read_text()))


def test_launch_checks_arguments():
    with pytest.raises(ValueError, match="num_processes"):
        launch.launch(["true"], num_processes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch.launch(["true"], num_processes=1, timeout_s=0)
    with pytest.raises(ValueError, match="argv"):
        launch.launch([], num_processes=1)


def test_launch_cli_returns_nonzero_on_failure(capsys):
    assert launch.main(["--processes", "2", "--timeout", "30", "--", sys.executable, "-c", "print('hi')"]) == 0
    assert capsys.readouterr().out.count("hi") == 2
    assert launch.main(["--processes", "1", "--timeout", "30", "--", sys.executable, "-c", "raise SystemExit(2)"]) == 1


# ------------------------------------------------------------------------------------- real multi-process
def _run_worker(out_dir: Path, processes: int, local_devices: int, *extra) -> list[launch.ProcessResult]:
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=FAST_COMPILE, TF_CPP_MIN_LOG_LEVEL="2")
    return launch.launch([sys.executable, str(WORKER), str(out_dir), *extra], num_processes=processes,
                         local_devices=local_devices, timeout_s=240, env=env, cwd=REPO)


def _check_worker_output(results, processes, devices):
    for r in results:
        line = [x for x in r.stdout.splitlines() if x.startswith("process ")]
        assert line, r.stdout + r.stderr
        assert f"of {processes} on dp1 x tp1 x cp{devices} ({devices} devices" in line[0]
        if "max error" in line[0]:
            assert float(line[0].rsplit(" ", 1)[1]) <= 1e-5, line[0]


def test_two_processes_of_4_devices_match_one_process_of_8(tmp_path):
    """jax.distributed over loopback (gloo): DCP decode (ag_rs, a2a) and PCP prefill on 2 x 4 CPU devices
    give the results of one process with 8 devices (which the other tests check against one device)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both runs at once: they overlap their waits
        multi = pool.submit(_run_worker, tmp_path / "multi", 2, 4)
        single = pool.submit(_run_worker, tmp_path / "single", 1, 8)
        _check_worker_output(multi.result(), 2, 8)
        _check_worker_output(single.result(), 1, 8)
    multi = np.load(tmp_path / "multi" / "results.npz")
    single = np.load(tmp_path / "single" / "results.npz")
    assert sorted(multi.files) == sorted(single.files) and len(multi.files) == 6
    for name in multi.files:
        if name.endswith("topk"):
            np.testing.assert_array_equal(multi[name], single[name], err_msg=name)
        else:
            np.testing.assert_allclose(multi[name], single[name], atol=1e-6, rtol=0, err_msg=name)


@pytest.mark.slow
def test_two_hosts_of_8_devices(tmp_path):
    """16 devices as 2 processes x 8 (the project's 2-node shape), checked against one device."""
    _check_worker_output(_run_worker(tmp_path, 2, 8, "--check-reference"), 2, 16)
