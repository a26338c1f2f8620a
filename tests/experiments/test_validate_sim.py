"""experiments.validate_sim's CPU-spec fit recovers a known spec from forward and step times it generated
itself (the real-engine comparison is a benchmark and asserts nothing)."""

import types

import pytest

import glm53
from experiments import validate_sim as vs
from glm53.engine import sim
from glm53.engine.config import DeployConfig


def test_the_fit_recovers_the_spec_that_priced_the_forwards():
    cfg = glm53.get_preset("tiny")
    deploy = DeployConfig(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=64,
                          kv_cache_dtype="float32").resolved(cfg, "float32")
    dep = sim.step_layout(deploy, "float32", vs.WEIGHT_BYTES)
    true = vs.cpu_spec(1e10, 1e10, 4e-3)
    shapes = [(r, w, win) for r in (1, 4) for w in (1, 16, 64) for win in (64, 256, 512)]
    forwards = [(i, *k, sim.forward_cost(cfg, true, dep, *k).time_s()) for i, k in enumerate(shapes)]
    # one forward per step, 0.5 ms of host time before it and 1.5 ms after it, 0.2 ms between steps
    steps = [(None, 0, 0, 0, f[-1] + 2e-3) for f in forwards]
    times = {k: f[-1] for k, f in zip(shapes, forwards)}
    log = types.SimpleNamespace(forwards=forwards, steps=steps, before_forwards={i: 5e-4 for i in range(len(steps))},
                                gaps=[2e-4] * (len(steps) - 1))
    f = vs.fit(cfg, deploy, times, [log])
    assert (f["flops"], f["bandwidth"]) == pytest.approx((1e10, 1e10))
    assert f["forward_latency_s"] == pytest.approx(4e-3, rel=1e-6)
    # the simulator's host part before dispatch is the step's own and the serving loop's gap before it
    assert (f["step_before_forward_s"], f["step_gap_s"]) == pytest.approx((5e-4, 2e-4), rel=1e-6)
    assert (f["step_overhead_s"], f["host_overlap_s"]) == pytest.approx((7e-4, 1.5e-3), rel=1e-6)
    assert f["forward_abs_rel_error_mean"] < 1e-6 and f["shapes"] == len(shapes)


def test_devices_that_share_the_host_take_its_time_times_their_number():
    """DP8 and PCP8 x DCP8 run 8 simulated devices on this host's cores: each device is priced at 1/8 of
    the fitted host, so a forward of one device costs 8 times the host's and so do its host parts."""
    cfg = glm53.get_preset("tiny")
    deploy = DeployConfig(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=64,
                          kv_cache_dtype="float32").resolved(cfg, "float32")
    dep = sim.step_layout(deploy, "float32", vs.WEIGHT_BYTES)
    host = vs.cpu_spec(1e10, 3e10, 4e-3)
    assert vs.shared_host(host, 5e-4, 2e-3, 1) == (host, 5e-4, 2e-3)
    one, before, beside = vs.shared_host(host, 5e-4, 2e-3, 8)
    assert (before, beside) == pytest.approx((4e-3, 1.6e-2))
    for shape in ((1, 1, 64), (4, 1, 512), (1, 64, 512), (4, 16, 256)):  # compute- and memory-bound shapes
        assert sim.forward_cost(cfg, one, dep, *shape).time_s() == pytest.approx(
            8 * sim.forward_cost(cfg, host, dep, *shape).time_s())
    # one replica over a mesh of 8 devices (PCP x DCP): its devices share the cores, its one loop does not
    mesh, before, after = vs.shared_host(host, 5e-4, 2e-3, 8, replicas=1)
    assert mesh == one and (before, after) == (5e-4, 2e-3)
    # the serving loop's gap between engine steps (part of the overhead) comes once per step, DP or not
    _, before, _ = vs.shared_host(host, 5e-4, 2e-3, 8, gap=1e-4)
    assert before == pytest.approx(8 * 4e-4 + 1e-4)


def test_a_dp_ep_layout_is_priced_on_the_lock_step_fit():
    """DP8 x EP8 runs every rank's rows in one program over the 8 devices (their computations overlap on
    the host's cores) and samples once per step: with a lock-step fit, a forward costs what that fit
    prices per rank and the host parts are the fit's, not one device's rates / 8 and host parts x 8."""
    cfg = glm53.get_preset("tiny")
    deploy = DeployConfig(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=2, num_gpu_blocks=64,
                          kv_cache_dtype="float32", data_parallel_size=8, enable_expert_parallel=True
                          ).resolved(cfg, "float32")
    dep = sim.step_layout(deploy, "float32", vs.WEIGHT_BYTES)
    host = vs.cpu_spec(1e10, 3e10, 4e-3)
    lock = vs.cpu_spec(10 ** 9.5, 1e10, 2e-2)  # rates on the fit's grid
    fit = {"flops": 10 ** 9.5, "bandwidth": 1e10, "forward_latency_s": 2e-2, "step_overhead_s": 1e-3,
           "host_overlap_s": 3e-3, "devices": 8}
    spec, before, beside = vs.shared_host(host, 5e-4, 2e-3, 8, fit)
    assert (before, beside) == (1e-3, 3e-3) and spec.host_link_bandwidth == host.host_link_bandwidth / 8
    for shape in ((1, 1, 64), (2, 1, 512), (1, 64, 512), (2, 16, 256)):
        assert sim.forward_cost(cfg, spec, dep, *shape).time_s() == pytest.approx(
            sim.forward_cost(cfg, lock, dep, *shape).time_s())
    with pytest.raises(ValueError, match="8 ranks, not 4"):
        vs.shared_host(host, 5e-4, 2e-3, 4, fit)
    # the fit recovers it from DP x EP forward times (rows per rank), as it does one device's
    shapes = [(r, w, win) for r in (1, 2) for w in (1, 16, 64) for win in (64, 256, 512)]
    times = {k: sim.forward_cost(cfg, lock, dep, *k).time_s() for k in shapes}
    got = vs.fit(cfg, deploy, times)
    assert (got["flops"], got["bandwidth"]) == pytest.approx((10 ** 9.5, 1e10))
    assert got["forward_latency_s"] == pytest.approx(2e-2, rel=1e-6)


def _point(role, errors, equal=True, config="smoke"):
    return {"role": role, "config": config, "kv_policy": "preempt", "concurrency": 1, "bound": "decode-bound",
            "rel_error": dict(zip(vs.METRICS, errors)), "counts_equal": equal, "counts_real": {}, "counts_sim": {}}


def test_summary_is_the_mean_absolute_error_of_the_held_out_points():
    points = [_point("fit", (0.9, 0.9, 0.9, 0.0)),  # in-sample: not in the mape
              _point("held out", (-0.1, 0.2, 0.05, 0.0)), _point("held out", (0.3, -0.4, -0.15, 0.0))]
    got = vs.summary(points)
    assert got["mape"] == pytest.approx({"ttft_median_s": 0.2, "tpot_mean_s": 0.3, "throughput_tok_s_per_device": 0.1})
    assert got["counts_equal"]
    assert not vs.summary(points + [_point("fit", (0, 0, 0, 0), equal=False)])["counts_equal"]


def _run(errors=(0.1, 0.1, 0.1, 0.0), equal=True, skip=()):
    """A hand-made results.json: a fit point and one held-out point per HELD_OUT config (but `skip`), each
    with `errors`, its summary fields from `summary`."""
    points = [_point("fit", errors, config=vs.TRAIN[0]), _point("fit", errors, config=vs.TRAIN_LOCKSTEP[0])]
    points += [_point("held out", errors, equal, name) for name, *_ in vs.HELD_OUT if name not in skip]
    return {"points": points, **vs.summary(points)}


def test_the_pd_http_twins_need_a_spec_fitted_at_the_servers_compile_flags():
    """`pd_http_comparison` refuses a spec fitted under other XLA flags than the real servers compiled
    with; a pd_http run without `xla_flags` compiled at -O0; the device count is not a compile flag."""
    from experiments.common import FAST_COMPILE_XLA_FLAGS

    assert vs.pd_http_flags({}) == FAST_COMPILE_XLA_FLAGS
    assert vs.pd_http_flags({"xla_flags": "--xla_force_host_platform_device_count=8 --a=1"}) == "--a=1"
    with pytest.raises(ValueError, match="fit it with fit_compiled_with"):
        vs.pd_http_comparison({"xla_flags": "", "runs": [{}]}, {"t": {"xla_flags": FAST_COMPILE_XLA_FLAGS}})


def test_a_metric_undefined_both_ways_is_left_out_and_one_side_only_is_an_error():
    """TPOT of one-token outputs is nan on both sides (tiered_scaling): out of the mape; nan on one side
    only is a divergence (inf), which no bound passes."""
    nan = float("nan")
    assert vs.rel_error(1.5, 1.0) == pytest.approx(0.5) and vs.rel_error(nan, 2.0) == float("inf")
    points = [_point("held out", (0.1, vs.rel_error(nan, nan), 0.2, 0.0)), _point("held out", (0.3, 0.2, 0.0, 0.0))]
    assert vs.summary(points)["mape"] == pytest.approx({"ttft_median_s": 0.2, "tpot_mean_s": 0.2,
                                                       "throughput_tok_s_per_device": 0.1})
    points[0]["rel_error"]["tpot_mean_s"] = vs.rel_error(0.01, nan)
    assert vs.summary(points)["mape"]["tpot_mean_s"] == float("inf")
    assert "nan" not in vs.table({**_run(), "points": points, "date": "d", "git_revision": "r", "machine": {
        "cpu": "c", "cpu_count": 2}, "cpu_spec_fit": dict.fromkeys(("shapes", "steps", "flops", "bandwidth",
        "forward_latency_s", "step_overhead_s", "host_overlap_s", "forward_abs_rel_error_mean"), 1.0)})


def test_check_fails_a_run_above_the_bound_with_unequal_counts_or_partial():
    assert vs.check(_run()) == []
    assert vs.check(_run((0.1, 0.1, 0.26, 0.0))) == ["mape throughput_tok_s_per_device = 0.26 > 0.25"]
    assert vs.check(_run((0.1, -0.3, 0.1, 0.0)))[0].startswith("mape tpot_mean_s")
    assert vs.check(_run((float("nan"),) * 4))  # a nan MAPE does not pass
    unequal = vs.check(_run(equal=False))
    assert len(unequal) == len(vs.HELD_OUT) and all(p.startswith("counts differ") for p in unequal)
    assert vs.check(_run(skip=("dp8",))) == ["not run: dp8"]
    reduced = _run()
    reduced["points"][-1]["overrides"] = ["--config.sweep.concurrency=(2,)"]
    reduced.update(vs.summary(reduced["points"]))
    assert vs.check(reduced) == [f"not run: {vs.HELD_OUT[-1][0]}",
                                 f"not run: {vs.HELD_OUT[-1][0]} (with ['--config.sweep.concurrency=(2,)'])"]
    stale = {**_run(), "counts_equal": False}  # summary fields that are not its points'
    assert len(vs.check(stale)) == 1 and "are not its points'" in vs.check(stale)[0]


def test_merge_adds_points_of_runs_with_the_same_spec_only():
    a = {**_run(skip=("dp8",)), "cpu_spec_fit": {"flops": 1.0}, "date": "d", "git_revision": "r"}
    b = {**_run(), "cpu_spec_fit": {"flops": 1.0}, "date": "d", "git_revision": "r"}
    b["points"] = [p for p in b["points"] if p["config"] == "dp8"]
    m = vs.merge(a, b, "b")
    m.update(vs.summary(m["points"]))
    assert vs.check(m) == [] and len(m["points"]) == len(vs.HELD_OUT) + 2  # and the two fits' points
    assert len(vs.merge(m, b)["points"]) == len(m["points"])  # a point run again replaces the old one
    with pytest.raises(ValueError, match="cpu_spec_fit"):
        vs.merge(a, {**b, "cpu_spec_fit": {"flops": 2.0}})


def test_the_committed_validation_is_complete_within_25_percent_with_equal_counts():
    """results/validate_sim: the simulator against real laptop runs, every HELD_OUT config run, each
    metric's MAPE at most 0.25, every count equal, its summary fields those of its points."""
    import json

    res = json.loads((vs.serve.REPO / "results/validate_sim/results.json").read_text())
    assert vs.check(res) == []
    # P/D over HTTP's timings are in it: every point of the committed run, each priced on its own fit
    real = json.loads((vs.serve.REPO / vs.PD_HTTP_REAL / "results.json").read_text())
    assert len(vs.pd_http_errors(res["pd_http"])) == len(real["runs"]) == 6


@pytest.mark.parametrize("run, problems", [("rerun_78ba069", ["mape tpot_mean_s"]), ("rerun_a6a02ec", []),
                                          ("rerun_01182cc", []), ("rerun_28c4202", ["mape tpot_mean_s"])])
def test_each_committed_rerun_is_recorded_as_it_came_out(run, problems):
    """results/validate_sim/rerun_*: the same command rerun at later commits on the same machine, kept
    beside the first run whether or not they pass. `check` says what docs/simulator.md says of each: its
    summary fields are its points' (not hand-made), and it misses the bound on `problems` and nothing else."""
    import json

    res = json.loads((vs.serve.REPO / "results/validate_sim" / run / "results.json").read_text())
    assert [c.split(" = ")[0] for c in vs.check(res)] == problems


@pytest.mark.parametrize("run", ["", "rerun_78ba069", "rerun_a6a02ec", "rerun_01182cc", "rerun_28c4202"])
def test_each_committed_runs_simulated_side_is_what_the_simulator_prices_now(run):
    """Every point of each committed validation run, priced again on its run's own fit by the simulator as
    it is now (`reprice`), gives its committed simulated figures and counts: no committed run is stale
    (a change to the pricing fails here; `--summarize DIR --reprice` brings a run up to date)."""
    import json

    res = json.loads((vs.serve.REPO / "results/validate_sim" / run / "results.json").read_text())
    again = vs.reprice(res)
    assert json.dumps(again["points"], sort_keys=True) == json.dumps(res["points"], sort_keys=True)  # NaN == NaN
    assert {k: again[k] for k in ("mape", "counts_equal")} == {k: res[k] for k in ("mape", "counts_equal")}


def test_grid_spread_reads_each_shapes_move_net_of_the_common_one(monkeypatch):
    """`grid_spread`: a second timing twice as slow on every shape moves no shape on its own; one shape 4x
    slower among them moves by log 2, whatever the protocol passed on to `time_forward_grid`."""
    import math

    timings, seen = iter([{"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 2.0, "b": 2.0, "c": 4.0}] * 2), []

    def fake(model, deploy, runs, in_rounds):
        seen.append((runs, in_rounds))
        return next(timings)

    monkeypatch.setattr(vs, "time_forward_grid", fake)
    got = vs.grid_spread((("p", 5, False), ("q", 7, True)))
    assert seen == [(5, False), (5, False), (7, True), (7, True)]
    assert got["p"]["common_ratio"] == pytest.approx(2.0)
    assert got["p"]["log_ratio_abs_mean"] == pytest.approx(math.log(2) / 3)
    assert got["q"]["log_ratio_abs_max"] == pytest.approx(math.log(2))


def test_every_held_out_config_loads():
    from experiments.common import load_config

    for name, path, overrides in vs.HELD_OUT:
        cfg = load_config(path, list(overrides), default=vs.serve.default_config)
        for policy in cfg.sweep.kv_policy:
            d = vs.serve._deploy(cfg, policy, "unused")
            if name.startswith("mtp3_"):
                assert d.speculative.verify == name.split("_")[1]


def test_the_committed_pd_http_comparison_is_the_twins_of_its_real_run():
    """results/validate_sim's `pd_http` (P/D over HTTP, timings only) is what `pd_http_comparison` makes of
    the committed pd_http run on its committed specs, each fitted under the flags the real servers compiled
    with: its concurrency-1 points priced again equal, and its mape and bracket fractions are its points'.
    Not stale, and not a hand-made figure."""
    import json

    import numpy as np

    from experiments import pd_http
    from experiments.common import REPO

    res = json.loads((REPO / "results/validate_sim/results.json").read_text())
    pd = res["pd_http"]
    real = json.loads((REPO / pd["real"]["dir"] / "results.json").read_text())
    assert (pd["real"]["git_revision"], pd["real"]["date"]) == (real["git_revision"], real["date"])
    assert sorted((p["deployment"], p["concurrency"]) for p in pd["points"]) == sorted(
        (r["kv_policy"], r["concurrency"]) for r in real["runs"])
    sessions = pd_http.sessions_of(real)
    specs = pd_http.deployments(real["deploy"], real["decode_layout"])
    fits = pd["cpu_spec_fits"]
    assert fits and {f["xla_flags"] for f in fits.values()} == {vs.pd_http_flags(real)}
    for p in (p for p in pd["points"] if p["concurrency"] == 1):
        r = next(r for r in real["runs"] if (r["kv_policy"], r["concurrency"]) == (p["deployment"], 1))
        for w, fit in fits.items():
            m = pd_http.twin(specs[p["deployment"]], sessions, 1, preset=real["preset"], deploy=real["deploy"],
                             host_specs=vs.host_specs(r["cpu_spec_fit"] if fit.get("per_point") else fit),
                             host="contended")
            assert {k: m[k] for k in vs.MAPE_METRICS} == pytest.approx(p["sim"][w]["contended"], rel=1e-9)
    for p in pd["points"]:
        r = next(r for r in real["runs"] if (r["kv_policy"], r["concurrency"]) == (p["deployment"], p["concurrency"]))
        assert p["real"] == {k: r[k] for k in vs.MAPE_METRICS}
        assert p["rel_error"] == {w: {h: {k: vs.rel_error(p["sim"][w][h][k], r[k]) for k in vs.MAPE_METRICS}
                                      for h in pd_http.HOST_SHARING} for w in fits}
    assert pd["mape"] == {w: {h: {k: pytest.approx(float(np.mean([abs(p["rel_error"][w][h][k]) for p in pd["points"]])))
                                  for k in vs.MAPE_METRICS} for h in pd_http.HOST_SHARING} for w in fits}
    for w in fits:
        pairs = [(min(p["sim"][w]["alone"][k], p["sim"][w]["shared"][k]) <= p["real"][k]
                  <= max(p["sim"][w]["alone"][k], p["sim"][w]["shared"][k])) for p in pd["points"] for k in vs.MAPE_METRICS]
        assert pd["between"][w] == pytest.approx(sum(pairs) / len(pairs))


def test_a_pd_http_run_that_fitted_before_each_point_prices_each_point_on_its_own_fit():
    """pd_http --fit-each-point keeps a fit per run (`cpu_spec_fit`): `pd_http_fits` then takes those
    (and fits nothing), and `pd_http_comparison` prices each point on its own fit: the committed run's
    concurrency-1 points, made with different fits, each equal to pricing that run alone on its fit."""
    import json

    from experiments.common import REPO

    res = json.loads((REPO / "results/validate_sim/results.json").read_text())
    real = json.loads((REPO / vs.PD_HTTP_REAL / "results.json").read_text())
    c1 = [r for r in real["runs"] if r["concurrency"] == 1]
    own = {**real, "runs": c1}
    assert vs.pd_http_fits(own) == {vs.EACH_POINT: {"per_point": True, "xla_flags": vs.pd_http_flags(real)}}
    got = vs.pd_http_comparison(own, vs.pd_http_fits(own))
    for r, p in zip(c1, got["points"]):
        one = vs.pd_http_comparison({**real, "runs": [r]}, {"f": r["cpu_spec_fit"]})["points"][0]
        assert p["sim"][vs.EACH_POINT] == one["sim"]["f"]
    keys = ("flops", "bandwidth", "forward_latency_s", "step_overhead_s", "host_overlap_s")
    assert [c1[0]["cpu_spec_fit"][k] for k in keys] != [c1[1]["cpu_spec_fit"][k] for k in keys]
    assert got["points"][0]["sim"] != vs.pd_http_comparison(
        {**real, "runs": [{**c1[0], "cpu_spec_fit": c1[1]["cpu_spec_fit"]}]}, vs.pd_http_fits(own))["points"][0]["sim"]
    assert "Fitted before each point" in vs.table({**res, "pd_http": got})


def test_pd_http_counts_in_the_mape_only_when_each_point_was_priced_on_its_own_fit():
    """`mape` averages the held-out points with P/D over HTTP's contended twins where each point had its own
    fit (EACH_POINT); a comparison on fits made once counts for nothing; `check` bounds the mean of both."""
    points = [_point("held out", (0.1, 0.1, 0.1, 0.0)), _point("held out", (-0.1, 0.1, 0.1, 0.0))]

    def pd(fit: str, err: float) -> dict:
        e = {h: dict.fromkeys(vs.MAPE_METRICS, err if h == "contended" else 9.0) for h in ("contended", "alone", "shared")}
        return {"cpu_spec_fits": {fit: {}}, "points": [{"rel_error": {fit: e}}] * 2}

    assert vs.summary(points, pd(vs.EACH_POINT, -0.5))["mape"] == pytest.approx(dict.fromkeys(vs.MAPE_METRICS, 0.3))
    assert vs.summary(points, pd("2026-12-07T00:57Z", -0.5))["mape"] == vs.summary(points)["mape"]
    run = _run()
    n = len(vs.HELD_OUT)
    run["pd_http"] = pd(vs.EACH_POINT, (0.26 * (n + 2) - 0.1 * n) / 2)  # the mean of both: 0.26
    assert "are not its points'" in vs.check(run)[0]  # its mape was summarized without P/D
    run.update(vs.summary(run["points"], run["pd_http"]))
    assert [c.split(" = ")[0] for c in vs.check(run)] == [f"mape {k}" for k in vs.MAPE_METRICS]


def test_steplog_gaps_are_between_steps_that_both_ran_plans():
    """StepLog.gaps (the fit's step_gap_s): the host time from one step's return to the next one's call,
    only where both steps ran a plan; a step without one (nothing to run) breaks the chain."""
    import time

    class Runner:
        def execute(self, plan):
            return types.SimpleNamespace(d2h_bytes=0, h2d_bytes=0)

    runner = Runner()
    plans = iter([object(), object(), None, object(), object()])

    def step():
        plan = next(plans)
        if plan is not None:
            runner.execute(types.SimpleNamespace(transfers=()))

    eng = types.SimpleNamespace(replicas=[types.SimpleNamespace(runner=runner)], _lockstep=False, step=step)
    log = vs.StepLog(eng)
    for _ in range(5):
        eng.step()
        time.sleep(0.01)
    assert len(log.steps) == 4 and len(log.gaps) == 2  # steps 0-1 and 3-4; none across the empty step 2
    assert all(0.009 < g < 1.0 for g in log.gaps)
