"""experiments/bench_sim.py on a short horizon of Part 1: the timed parts of a step (scheduling, update,
the runner's execute) are disjoint, inside the run's wall time and once per engine step; a run stops at
the first step past its horizon; the files say what ran."""

import json
import pstats
import time

import pytest

from experiments import bench_sim, workloads

SMALL = ["--figure", "part1", "--config.workload.sessions=2", "--config.workload.turns=2",
         "--config.workload.scale=0.05", "--config.sweep.concurrency=(2,)"]


def test_bench_sim_times_every_part_of_a_step(tmp_path, monkeypatch):
    calls, runs, clocks = [], [], []  # (start, end, timer) of every timed call; (start, end) of every run

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

    run = workloads.ClosedLoopClient.run

    def timed_run(client, on_step=None, **k):
        def watched(e):
            clocks.append(e.clock.now())
            on_step(e)

        t0 = time.perf_counter()
        try:
            return run(client, on_step=watched, **k)
        finally:
            runs.append((t0, time.perf_counter()))

    monkeypatch.setattr(bench_sim, "_Timed", Recorded)
    monkeypatch.setattr(workloads.ClosedLoopClient, "run", timed_run)
    horizon = 0.5
    res = bench_sim.main(["--out", str(tmp_path), "--horizon-s", str(horizon), *SMALL])
    assert [(r["figure"], r["kv_policy"]) for r in res["runs"]] == [("part1", "hisparse"), ("part1", "offload")]
    assert len(runs) == 2
    calls.sort()
    for (_, end, _), (start, _, _) in zip(calls, calls[1:]):
        assert end <= start  # no timed call inside another: nothing counted twice
    # every timed call inside a run, whose wall time bench_sim measures around it
    assert sum(1 for c in calls for w0, w1 in runs if w0 <= c[0] and c[1] <= w1) == len(calls)
    for r, (w0, w1) in zip(res["runs"], runs):
        mine = [c for c in calls if w0 <= c[0] and c[1] <= w1]
        assert w1 - w0 <= r["wall_s"] and 0 < r["cpu_s"]
        # one schedule, one update and one execute per engine step (one replica); each timer's total is
        # what the timer saw
        for key in ("schedule", "update", "price"):
            spans = [e - s for s, e, k in mine if k == f"{key}_s"]
            assert len(spans) == r["engine_steps"], key
            assert 0 < r[f"{key}_ms_per_step"] * r["engine_steps"] / 1e3 <= sum(spans)
        parts = sum(r[f"{k}_ms_per_step"] for k in ("schedule", "update", "price", "other"))
        assert parts * r["engine_steps"] / 1e3 == pytest.approx(r["wall_s"])
        # the run stopped at the first step that passed the horizon
        assert r["full_hour"] and r["simulated_s"] >= horizon
        assert r["wall_s_per_simulated_hour"] == pytest.approx(r["wall_s"] / r["simulated_s"] * 3600)
    seen = [t for t in clocks if t >= horizon]
    assert len(seen) == 2 and all(t < horizon for t in clocks if t not in seen)
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == res["runs"]
    table = (tmp_path / "table.md").read_text().splitlines()
    for r in res["runs"]:  # the table's row of each run: figure, policy, concurrency, steps
        assert any(line.startswith(f"| part1 | {r['kv_policy']} | 2 | {r['engine_steps']} |") for line in table)
    # a workload that ends before the horizon says so
    short = bench_sim.main(["--out", str(tmp_path), "--horizon-s", "1e9", *SMALL, "--config.sweep.kv_policy=('offload',)"])
    assert [r["full_hour"] for r in short["runs"]] == [False]


def test_bench_sim_profile_names_where_the_time_went_and_the_trace_is_the_runs(tmp_path):
    """--profile writes each run's profile as text, naming the scheduler and the runner's execute among
    the functions the run spent its time in, and marks the run as profiled; --profile-from-s profiles the
    steps from that simulated second on. `trace_sha256` is the
    simulated run's, whatever the wall time: equal with and without the profiler, different over a
    shorter horizon."""
    def one(horizon, *extra):
        res = bench_sim.main(["--out", str(tmp_path / f"{horizon}{''.join(extra)}"), "--horizon-s", str(horizon),
                              *extra, *SMALL, "--config.sweep.kv_policy=('offload',)"])
        (r,) = res["runs"]
        return r

    r = one(3.0, "--profile")
    assert r["profiled"] is True
    text = (tmp_path / "3.0--profile" / "profile_part1_offload_c2.txt").read_text()
    assert "(schedule)" in text and "(execute)" in text and "tottime" in text
    raw = pstats.Stats(str(tmp_path / "3.0--profile" / "profile_part1_offload_c2.txt.prof"))  # the raw stats too
    assert any(name == "schedule" for _, _, name in raw.stats)
    plain = one(3.0)
    assert plain["profiled"] is False and plain["trace_sha256"] == r["trace_sha256"]
    # --profile-from-s: the steps from that simulated second on only (a steady state without the warm-up)
    late = one(3.0, "--profile", "--profile-from-s", "0.4")
    raw_late = pstats.Stats(str(tmp_path / "3.0--profile--profile-from-s0.4" / "profile_part1_offload_c2.txt.prof"))

    def schedules(st):
        return sum(v[1] for (_, _, name), v in st.stats.items() if name == "schedule")

    assert 0 < schedules(raw_late) < schedules(raw) == r["engine_steps"]
    assert late["trace_sha256"] == r["trace_sha256"]
    short = one(0.5)
    assert short["engine_steps"] < r["engine_steps"] and short["trace_sha256"] != r["trace_sha256"]
