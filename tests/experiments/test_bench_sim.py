"""experiments/bench_sim.py on a short window of Part 1: the timed parts of a step (scheduling, update,
pricing) are disjoint, inside the run's wall time and once per engine step, and the files say what ran."""

import json
import time

import pytest

from experiments import bench_sim, serve


def test_bench_sim_times_every_part_of_a_step(tmp_path, monkeypatch):
    calls, runs = [], []  # (start, end, timer) of every timed call; (start, end) of every run

    class Recorded(bench_sim._Timed):
        """bench_sim's timer, itself timed from outside: each call's interval contains the timer's."""

        def __init__(self, obj, name, totals, key):
            super().__init__(obj, name, totals, key)
            inner = getattr(obj, name)

            def outer(*a, **k):
                t0 = time.perf_counter()
                try:
                    return inner(*a, **k)
                finally:
                    calls.append((t0, time.perf_counter(), key))

            setattr(obj, name, outer)

    run_one = serve.run_one

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        try:
            return run_one(*a, **k)
        finally:
            runs.append((t0, time.perf_counter()))

    monkeypatch.setattr(bench_sim, "_Timed", Recorded)
    monkeypatch.setattr(serve, "run_one", timed_run)
    res = bench_sim.main(["--out", str(tmp_path), "--config.workload.sessions=2", "--config.workload.turns=2",
                          "--config.workload.scale=0.05", "--config.sweep.concurrency=(2,)"])
    assert [r["kv_policy"] for r in res["runs"]] == ["hisparse", "offload"] and len(runs) == 2
    calls.sort()
    for (_, end, _), (start, _, _) in zip(calls, calls[1:]):
        assert end <= start  # no timed call inside another: nothing counted twice
    # every timed call inside a run, whose wall time bench_sim measures around it
    assert sum(1 for c in calls for w0, w1 in runs if w0 <= c[0] and c[1] <= w1) == len(calls)
    for r, (w0, w1) in zip(res["runs"], runs):
        mine = [c for c in calls if w0 <= c[0] and c[1] <= w1]
        assert w1 - w0 <= r["wall_s"]
        # one schedule, one update and one execute per engine step; each timer's total is what the timer saw
        for key in ("schedule", "update", "price"):
            spans = [e - s for s, e, k in mine if k == f"{key}_s"]
            assert len(spans) == r["engine_steps"], key
            assert 0 < r[f"{key}_ms_per_step"] * r["engine_steps"] / 1e3 <= sum(spans)
        parts = sum(r[f"{k}_ms_per_step"] for k in ("schedule", "update", "price", "other"))
        assert parts * r["engine_steps"] / 1e3 == pytest.approx(r["wall_s"])
        assert r["other_ms_per_step"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == res["runs"]
    table = (tmp_path / "table.md").read_text().splitlines()
    for r in res["runs"]:  # the table's row of each run: policy, concurrency, steps
        assert any(line.startswith(f"| {r['kv_policy']} | 2 | {r['engine_steps']} |") for line in table)
    with pytest.raises(ValueError, match="simulated"):
        bench_sim.main(["--config", str(serve.REPO / "configs/smoke.py"), "--out", str(tmp_path)])
