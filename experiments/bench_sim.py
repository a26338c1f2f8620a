"""Speed of the simulator (issue 19, item 8): simulated steps per wall second, wall time per simulated
hour, and where a step's wall time goes (scheduling, pricing, the rest: the engine's and the client's
bookkeeping), for each KV policy of a serve config.

    python -m experiments.bench_sim --out results/bench_sim                     # Part 1 at concurrency 32
    python -m experiments.bench_sim --config configs/paper/part1.py --config.workload.turns=2 --out DIR

Default: configs/paper/part1.py at concurrency 32 with 32 sessions of 3 turns (the part of the sweep
where the scheduler works hardest: the most running requests). The issue's target is one simulated hour
in under 5 minutes of wall time on 2 cores. Writes OUT/results.json and OUT/table.md. A benchmark: it
asserts nothing; the wall times depend on what else the machine runs (say so when you commit one).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from experiments import serve
from experiments.common import REPO, cpu_name, git_revision, load_config

DEFAULTS = ("--config.sweep.concurrency=(32,)", "--config.workload.sessions=32", "--config.workload.turns=3")


class _Timed:
    """Accumulates the wall time of a method of `obj` in `totals[key]`."""

    def __init__(self, obj, name: str, totals: dict, key: str):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[key] += time.perf_counter() - t0

        setattr(obj, name, timed)


def run(cfg, policy: str, concurrency: int) -> dict:
    """One simulated run of `cfg` under `policy` with its scheduler and runner timed."""
    totals = {"schedule_s": 0.0, "update_s": 0.0, "price_s": 0.0}
    make = serve._engine

    def engine(*a, **k):
        eng = make(*a, **k)
        engines = (eng.prefill, eng.decode) if hasattr(eng, "prefill") else (eng,)  # a P/D pair: both engines
        for rep in (rep for e in engines for rep in e.replicas):
            _Timed(rep.scheduler, "schedule", totals, "schedule_s")
            _Timed(rep.scheduler, "update", totals, "update_s")
            _Timed(rep.runner, "execute", totals, "price_s")
        return eng

    model, _ = serve._model(cfg.model, weights=False)
    serve._engine = engine
    try:
        t0 = time.perf_counter()
        m = serve.run_one(model, cfg, policy, concurrency, progress=False)
        wall = time.perf_counter() - t0
    finally:
        serve._engine = make
    steps = m["engine_steps"]
    per_step = {k.replace("_s", "_ms_per_step"): 1e3 * v / max(steps, 1) for k, v in totals.items()}
    per_step["other_ms_per_step"] = 1e3 * (wall - sum(totals.values())) / max(steps, 1)
    return {"kv_policy": policy, "concurrency": concurrency, "wall_s": wall, "simulated_s": m["simulated_s"],
            "engine_steps": steps, "steps_per_wall_s": steps / wall,
            "wall_s_per_simulated_hour": wall / m["simulated_s"] * 3600, **per_step,
            "throughput_tok_s_per_gpu": m["throughput_tok_s_per_gpu"],
            "running_requests_mean": m["running_requests_mean"]}


def table(res: dict) -> str:
    lines = ["# Simulator speed", "",
             f"{res['date']}, commit {res['git_revision']}, {res['machine']['cpu']} x {res['machine']['cpu_count']}. "
             f"`python -m experiments.bench_sim {' '.join(res['argv'])}`. Target: one simulated hour in under 300 s.", "",
             "| policy | c | steps | simulated s | wall s | steps / wall s | wall s per simulated hour | "
             "schedule ms/step | update ms/step | price ms/step | other ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['kv_policy']} | {r['concurrency']} | {r['engine_steps']} | {r['simulated_s']:.0f} | "
                     f"{r['wall_s']:.1f} | {r['steps_per_wall_s']:.0f} | {r['wall_s_per_simulated_hour']:.0f} | "
                     f"{r['schedule_ms_per_step']:.3f} | {r['update_ms_per_step']:.3f} | {r['price_ms_per_step']:.3f} | "
                     f"{r['other_ms_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "paper" / "part1.py"))
    ap.add_argument("--out", default="out/bench_sim")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, [*DEFAULTS, *overrides])
    if not serve.simulated(cfg):
        raise ValueError(f"{args.config}: bench_sim needs a simulated config (runner.kind='sim')")
    out = args.out
    os.makedirs(out, exist_ok=True)
    runs = []
    for policy in cfg.sweep.kv_policy:
        for conc in cfg.sweep.concurrency:
            runs.append(run(cfg, policy, conc))
            r = runs[-1]
            print(f"[bench_sim] {policy} c={conc}: {r['engine_steps']} steps, {r['simulated_s']:.0f} simulated s in "
                  f"{r['wall_s']:.1f} s ({r['steps_per_wall_s']:.0f} steps/s; {r['wall_s_per_simulated_hour']:.0f} s "
                  "per simulated hour)", flush=True)
    res = {"benchmark": "bench_sim", "date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
           "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count()}, "config": args.config,
           "argv": [f"--config {os.path.relpath(args.config, REPO)}", *DEFAULTS, *overrides], "runs": runs}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(res))
    print(table(res))
    return res


if __name__ == "__main__":
    main()
