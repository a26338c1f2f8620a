"""experiments/bench_sim.py on a short window of Part 1: the timed parts of a step (scheduling, update,
pricing) are disjoint and inside the wall time, and the files are written."""

import json

import pytest

from experiments import bench_sim, serve


def test_bench_sim_times_every_part_of_a_step(tmp_path):
    res = bench_sim.main(["--out", str(tmp_path), "--config.workload.sessions=2", "--config.workload.turns=2",
                          "--config.workload.scale=0.05", "--config.sweep.concurrency=(2,)"])
    assert [r["kv_policy"] for r in res["runs"]] == ["hisparse", "offload"]
    for r in res["runs"]:
        # nested or double-counted timers would add up to more than the wall time
        assert r["other_ms_per_step"] > 0
        assert min(r["schedule_ms_per_step"], r["update_ms_per_step"], r["price_ms_per_step"]) > 0
        assert r["simulated_s"] > 0 and r["engine_steps"] > 10
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == res["runs"]
    assert "| hisparse | 2 |" in (tmp_path / "table.md").read_text()
    with pytest.raises(ValueError, match="simulated"):
        bench_sim.main(["--config", str(serve.REPO / "configs/smoke.py"), "--out", str(tmp_path)])
