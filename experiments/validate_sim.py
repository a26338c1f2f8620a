"""Validate the simulator against the real engine at laptop scale (issue 19, item 4).

    python -m experiments.validate_sim --out results/validate_sim             # ~15 minutes on 2 cores

1. Calibrate a CPU HardwareSpec on this machine from the real engine's own step timings: the built-in
   serve default (tiny model, 8 OpenHands sessions at 1/128 scale, concurrency 1, 2, 4) is served twice
   per point (the first pass compiles; the second is timed step by step). Each timed step's wall time
   (schedule + execute + update) is fitted as `step_overhead_s + step_cost(plan on the CPU spec)`, with
   the CPU's FLOP rate and memory bandwidth on a log grid (all efficiencies 1: the rates are achieved
   ones) and the overhead the median residual; the fit minimises mean |log(predicted / measured)|.
2. Re-run held-out configs both ways, real (warmed: compile time excluded) and simulated on the
   fitted spec (same deploy, float32 KV and weights, so the same pools and the same schedule): smoke,
   preempt_vs_offload (concurrency 1, 2, 4) and hisparse_vs_offload at concurrency 4 and 8 (its 16 and
   32 points take half an hour of real time). Per point: median TTFT, mean TPOT, throughput per
   device, running requests, and the counts that do not depend on time (preemptions, prefix hits,
   engine steps), which must be equal: without think time the schedule is a function of the requests.
   Each point is called prefill-bound or decode-bound by where its real step time went.

Writes OUT/results.json (the fitted spec, the fit's error on its own steps, every point with real,
simulated and relative error; rewritten after every point, `complete` says whether all ran) and
OUT/table.md (the validation table). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import numpy as np

from experiments import serve
from experiments.common import cpu_name, git_revision, out_dir_from_cli, load_config

METRICS = ("ttft_median_s", "tpot_mean_s", "throughput_tok_s_per_device", "running_requests_mean")
COUNTS = ("preemptions", "prefix_hit_rate", "engine_steps", "output_tokens")
TRAIN = ("serve_default", None, ())
HELD_OUT = (("smoke", "configs/smoke.py", ()),
            ("preempt_vs_offload", "configs/ablations/preempt_vs_offload.py", ()),
            ("hisparse_vs_offload", "configs/ablations/hisparse_vs_offload.py", ("--config.sweep.concurrency=(4, 8)",)))
WEIGHT_BYTES = 4  # float32 weights on CPU


def cpu_spec(flops: float, bandwidth: float):
    """A HardwareSpec for this CPU: achieved FLOP/s (every dtype) and memory bandwidth, efficiencies 1,
    the host link as fast as memory (pinned host memory is the same DRAM), no modelled latencies."""
    from glm53.perfmodel import H200

    return dataclasses.replace(
        H200, name=f"cpu ({cpu_name()}, {os.cpu_count()} cores, fitted)", bf16_flops=flops, fp8_flops=flops,
        hbm_bandwidth=bandwidth, host_link_bandwidth=bandwidth, matmul_efficiency=1.0, hbm_efficiency=1.0,
        sparse_attention_efficiency=1.0, dense_attention_efficiency=1.0, nvlink_efficiency=1.0,
        collective_latency_s=0.0, host_copy_latency_s=0.0, head_granularity=1)


class StepLog:
    """Wraps an engine so each step's plan, transfers and wall time are recorded."""

    def __init__(self, eng):
        self.steps: list[tuple] = []  # (plan, d2h bytes, h2d bytes, transfers, wall s)
        rep = eng.replicas[0]
        execute, step = rep.runner.execute, eng.step
        last: dict = {}

        def timed_execute(plan):
            res = execute(plan)
            last["plan"], last["res"] = plan, res
            return res

        def timed_step():
            last.clear()
            t0 = time.perf_counter()
            out = step()
            dt = time.perf_counter() - t0
            if "plan" in last:
                self.steps.append((last["plan"], last["res"].d2h_bytes, last["res"].h2d_bytes,
                                   len(last["plan"].transfers), dt))
            return out

        rep.runner.execute, eng.step = timed_execute, timed_step


def _real(cfg, model, policy: str, conc: int) -> tuple[dict, StepLog]:
    serve.run_one(model, cfg, policy, conc, progress=False)  # compiles (untimed)
    logs = []
    make = serve._engine

    def engine(*a, **k):
        e = make(*a, **k)
        logs.append(StepLog(e))
        return e

    serve._engine = engine
    try:
        m = serve.run_one(model, cfg, policy, conc, progress=False)
    finally:
        serve._engine = make
    return m, logs[0]


def _sim(cfg, policy: str, conc: int, hw, overhead: float) -> dict:
    from glm53.engine import sim

    sim_cfg, _ = serve._model(cfg.model, weights=False)
    make = serve._engine

    def engine(model, c, kv_policy):
        d = serve._deploy(c, kv_policy)
        d = dataclasses.replace(d, kv_cache_dtype="float32" if d.kv_cache_dtype == "auto" else d.kv_cache_dtype)
        return sim.build_engine(model, d, hw, step_overhead_s=overhead, weight_bytes=WEIGHT_BYTES,
                                hisparse_miss_fraction=0.0)

    serve._engine = engine
    try:
        return serve.run_one(sim_cfg, cfg, policy, conc, progress=False)
    finally:
        serve._engine = make


def _priced(cfg_model, deploy, steps, hw) -> np.ndarray:
    from glm53.engine.sim import deployment
    from glm53.perfmodel.step import step_cost

    dep = deployment(deploy, "float32", WEIGHT_BYTES)
    return np.array([step_cost(cfg_model, hw, dep, plan, d2h_bytes=d2h, h2d_bytes=h2d, host_transfers=n).time_s()
                     for plan, d2h, h2d, n, _ in steps])


def fit(cfg_model, deploy, steps, *, max_steps: int = 400) -> dict:
    """Grid fit of (FLOP/s, B/s) with the step overhead as the median residual (see module docstring)."""
    sample = steps[:: max(1, len(steps) // max_steps)]
    wall = np.array([s[-1] for s in sample])
    best = None
    for f in np.logspace(9, 12, 13):
        for b in np.logspace(9, 11.5, 11):
            kern = _priced(cfg_model, deploy, sample, cpu_spec(f, b))
            o = max(0.0, float(np.median(wall - kern)))
            err = float(np.mean(np.abs(np.log((kern + o) / wall))))
            if best is None or err < best["mean_abs_log_error"]:
                best = {"flops": float(f), "bandwidth": float(b), "step_overhead_s": o, "mean_abs_log_error": err}
    pred = _priced(cfg_model, deploy, steps, cpu_spec(best["flops"], best["bandwidth"])) + best["step_overhead_s"]
    all_wall = np.array([s[-1] for s in steps])
    rel = pred / all_wall - 1
    best.update(steps=len(steps), fitted_on_steps=len(sample), step_rel_error_median=float(np.median(rel)),
                step_abs_rel_error_mean=float(np.mean(np.abs(rel))),
                total_time_rel_error=float(pred.sum() / all_wall.sum() - 1))
    return best


def _bound(steps) -> str:
    pre = sum(s[-1] for s in steps if any(r.num_tokens > 1 + r.num_draft_tokens for r in s[0].rows))
    return "prefill-bound" if pre > 0.5 * sum(s[-1] for s in steps) else "decode-bound"


def table(res: dict) -> str:
    f = res["cpu_spec_fit"]
    lines = ["# The simulator against the real engine at laptop scale", "",
             f"{res['date']}, commit {res['git_revision']}, {res['machine']['cpu']} x {res['machine']['cpu_count']}. "
             "`python -m experiments.validate_sim`. CPU spec fitted on the timed steps of the serve default "
             f"({f['steps']} steps): {f['flops'] / 1e9:.0f} GFLOP/s, {f['bandwidth'] / 1e9:.0f} GB/s, step overhead "
             f"{f['step_overhead_s'] * 1e3:.2f} ms; per-step |error| mean {f['step_abs_rel_error_mean']:.1%}, "
             f"total time {f['total_time_rel_error']:+.1%}.", "",
             "rel error = simulated / real - 1. Counts must be equal (the schedule does not depend on time).", "",
             "| config | policy | c | bound | role | TTFT p50 | TPOT mean | throughput/device | running | counts equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["points"]:
        e = p["rel_error"]
        lines.append(f"| {p['config']} | {p['kv_policy']} | {p['concurrency']} | {p['bound']} | {p['role']} | "
                     + " | ".join(f"{e[k]:+.1%}" for k in METRICS) + f" | {'yes' if p['counts_equal'] else 'NO'} |")
    for bound in ("prefill-bound", "decode-bound"):
        pts = [p for p in res["points"] if p["bound"] == bound and p["role"] == "held out"]
        if pts:
            lines.append("")
            lines.append(f"{bound}, held out ({len(pts)} points): median |error| " + ", ".join(
                f"{k} {statistics.median(abs(p['rel_error'][k]) for p in pts):.1%}" for k in METRICS))
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    out = out_dir_from_cli(argv, "python -m experiments.validate_sim", __doc__, "out/validate_sim")
    serve._enable_compile_cache(str(serve.REPO / ".cache" / "jax"))

    def points(name, path, overrides, role):
        cfg = load_config(path, list(overrides), default=serve.default_config)
        model, _ = serve._model(cfg.model)
        for policy in cfg.sweep.kv_policy:
            for conc in cfg.sweep.concurrency:
                print(f"[validate_sim] {name} {policy} c={conc} (real)", flush=True)
                m, log = _real(cfg, model, policy, conc)
                yield cfg, policy, conc, m, log, role

    train_steps, train_points = [], []
    for cfg, policy, conc, m, log, role in points(*TRAIN, "fit"):
        train_steps += log.steps
        train_points.append((cfg, policy, conc, m, log, role))
    cfg0 = train_points[0][0]
    sim_model, _ = serve._model(cfg0.model, weights=False)
    deploy0 = serve._deploy(cfg0, cfg0.sweep.kv_policy[0]).resolved(sim_model, "float32")
    f = fit(sim_model, deploy0, train_steps)
    hw = cpu_spec(f["flops"], f["bandwidth"])
    print(f"[validate_sim] CPU spec: {f['flops'] / 1e9:.0f} GFLOP/s, {f['bandwidth'] / 1e9:.0f} GB/s, overhead "
          f"{f['step_overhead_s'] * 1e3:.2f} ms; step |error| {f['step_abs_rel_error_mean']:.1%}", flush=True)

    res_points = []
    meta = {"benchmark": "validate_sim", "date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
            "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count()}, "cpu_spec_fit": f,
            "cpu_spec": dataclasses.asdict(hw), "metrics": METRICS, "counts": COUNTS,
            "note": "real runs warmed (a first untimed pass compiles); HiSparse misses are exact in the real run "
                    "and 0 in the simulator (the sim's miss knob is off)"}

    def save(complete: bool) -> dict:
        """results.json and table.md after every point (atomically): a run that stops keeps what it measured."""
        res = {**meta, "points": res_points, "complete": complete}
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(res, indent=1, default=str))
        os.replace(tmp, out / "results.json")
        (out / "table.md").write_text(table(res))
        return res

    def compare(name, cfg, policy, conc, m, log, role):
        s = _sim(cfg, policy, conc, hw, f["step_overhead_s"])
        counts_real = {k: m.get(k) for k in COUNTS}
        counts_sim = {k: s.get(k) for k in COUNTS}
        res_points.append({
            "config": name, "kv_policy": policy, "concurrency": conc, "role": role, "bound": _bound(log.steps),
            "real": {k: m[k] for k in METRICS}, "sim": {k: s[k] for k in METRICS},
            "rel_error": {k: s[k] / m[k] - 1 for k in METRICS}, "counts_real": counts_real, "counts_sim": counts_sim,
            "counts_equal": counts_real == counts_sim, "real_wall_s": m["wall_s"]})
        print(f"[validate_sim] {name} {policy} c={conc}: " + ", ".join(
            f"{k} {res_points[-1]['rel_error'][k]:+.1%}" for k in METRICS) + f"; counts equal {counts_real == counts_sim}",
            flush=True)
        save(False)

    for cfg, policy, conc, m, log, role in train_points:
        compare(TRAIN[0], cfg, policy, conc, m, log, "fit")
    for name, path, overrides in HELD_OUT:
        for cfg, policy, conc, m, log, _ in points(name, path, overrides, "held out"):
            compare(name, cfg, policy, conc, m, log, "held out")
    res = save(True)
    print(table(res))
    return res


if __name__ == "__main__":
    main()
