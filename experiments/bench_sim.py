"""Speed of the simulator (issue 19 item 8, issue 53 item 1): wall and CPU seconds per simulated hour of
the published figures' simulations, measured over one full simulated hour (not extrapolated), with
simulated steps per wall second and where a step's wall time goes (scheduling, update, the runner's
execute, or execute_ranks for DP x EP ranks: pricing and its synthetic tokens, and the rest: the
engine's, the P/D pair's and the client's bookkeeping).

    python -m experiments.bench_sim --out results/bench_sim                      # both figures (an hour each run)
    python -m experiments.bench_sim --figure part2 --config.sweep.concurrency='(32,)' --out DIR
    python -m experiments.bench_sim --figure part2 --horizon-s 300 --profile --out DIR   # where the time goes
    python -m experiments.bench_sim --figure part2 --horizon-s 2400 --profile --profile-from-s 1800 --out DIR

Figures (`FIGURES`): "part1" is configs/paper/part1.py at concurrency 32 under HiSparse and offload, with
enough conversations that the closed loop is still full after an hour; "part2" is configs/paper/part2.py
at concurrency 64 (its heaviest points) for its three P/D deployments, with eight sessions per user.
Each run serves its closed loop until the simulated clock passes `--horizon-s` (3,600 s) and stops
there; `full_hour` says whether it got there (else the workload ran out first). The issue's target is
one simulated hour of Part 2 in under 300 wall seconds on 2 cores. `trace_sha256` hashes the
simulated clock after every step and each replica's priced seconds (by op), assumed misses, staged rows
and scheduler counters: a change meant only to make the simulator faster leaves it equal (compare two
checkouts' runs over the same --horizon-s). Writes OUT/results.json (`runs`: one
per (figure, policy, concurrency) with `figure`, `simulated_s`, `wall_s_per_simulated_hour` and
`cpu_s_per_simulated_hour`) and OUT/table.md. A benchmark: it asserts nothing; wall times depend on what
else the machine runs, so the CPU seconds of the process are reported beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import json
import os
import pstats
import time

from experiments import serve
from experiments.common import REPO, cpu_name, git_revision, load_config

HORIZON_S = 3600.0
# figure -> (config, overrides that make its closed loop last an hour at the benchmarked concurrency)
FIGURES = {
    "part1": ("configs/paper/part1.py", ("--config.sweep.concurrency=(32,)", "--config.workload.sessions=512")),
    "part2": ("configs/paper/part2.py", ("--config.sweep.concurrency=(64,)", "--config.sweep.sessions_per_user=8",
                                         "--config.workload.sessions=512")),
}


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


class _Horizon(Exception):
    """The simulated clock passed the horizon: the run stops there."""


def _write_profile(prof: cProfile.Profile, path: str) -> None:
    """The run's profile as text: the 40 functions with the most time of their own, then the 40 with the
    most time including their callees (cProfile's own overhead inflates small, often-called functions);
    the raw stats beside it (path + ".prof", for pstats' callers and callees)."""
    prof.dump_stats(path + ".prof")
    with open(path, "w") as f:
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=f).strip_dirs().sort_stats(key).print_stats(40)


def run(cfg, policy: str, concurrency: int, horizon_s: float = HORIZON_S, profile: str | None = None,
        profile_from_s: float = 0.0) -> dict:
    """One simulated run of `cfg` under `policy` at `concurrency`, its scheduler and runners timed, until
    the simulated clock passes `horizon_s` (or the workload ends). profile: also run it under cProfile
    and write the profile's text there (its times are then the profiled run's), from the first step that
    ends at or after `profile_from_s` simulated seconds (a steady state's profile, without the warm-up)."""
    from glm53.engine.sim import fewer_collections

    totals = {"schedule_s": 0.0, "update_s": 0.0, "price_s": 0.0}
    model, _ = serve._model(cfg.model, weights=False)
    eng = serve._engine(model, cfg, policy, "unused")
    engines = (eng.prefill, eng.decode) if hasattr(eng, "prefill") else (eng,)  # a P/D pair: both engines
    for rep in (rep for e in engines for rep in e.replicas):
        _Timed(rep.scheduler, "schedule", totals, "schedule_s")
        _Timed(rep.scheduler, "update", totals, "update_s")
        _Timed(rep.runner, "execute", totals, "price_s")
        if hasattr(rep.runner, "execute_ranks"):  # DP x EP: the engine prices a lock-step on rank 0's runner
            _Timed(rep.runner, "execute_ranks", totals, "price_s")
    client = serve.make_client(eng, cfg, serve.point_sessions(cfg, concurrency), concurrency)
    steps = 0
    trace = hashlib.sha256()  # the simulated clock after every step: a speed change must leave it alone

    def on_step(e):
        nonlocal steps, profiling
        steps += 1
        trace.update(repr(e.clock.now()).encode())
        if e.clock.now() >= horizon_s:
            raise _Horizon
        if prof is not None and not profiling and e.clock.now() >= profile_from_s:
            prof.enable()
            profiling = True

    prof, profiling = (cProfile.Profile() if profile else None), False
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        if prof is not None and profile_from_s <= 0:
            prof.enable()
            profiling = True
        with fewer_collections():  # as experiments.serve runs the simulator
            client.run(on_step=on_step)
    except _Horizon:
        pass
    finally:
        if prof is not None:
            prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if profiling:
        _write_profile(prof, profile)
    simulated = eng.clock.now()
    for rep in (rep for e in engines for rep in e.replicas):  # and what each replica priced and counted
        r = rep.runner
        trace.update(repr((r.busy_s, r.hot_miss_rows, r.staged_rows, sorted(r.time_by_op.items()),
                           dataclasses.astuple(rep.scheduler.stats))).encode())
    eng.shutdown()
    per_step = {k.replace("_s", "_ms_per_step"): 1e3 * v / max(steps, 1) for k, v in totals.items()}
    per_step["other_ms_per_step"] = 1e3 * (wall - sum(totals.values())) / max(steps, 1)
    return {"kv_policy": policy, "concurrency": concurrency, "horizon_s": horizon_s, "simulated_s": simulated,
            "full_hour": simulated >= horizon_s, "engine_steps": steps, "wall_s": wall, "cpu_s": cpu,
            "steps_per_wall_s": steps / wall, "wall_s_per_simulated_hour": wall / simulated * 3600,
            "cpu_s_per_simulated_hour": cpu / simulated * 3600, "trace_sha256": trace.hexdigest(), **per_step}


def table(res: dict) -> str:
    lines = ["# Simulator speed", "",
             f"{res['date']}, commit {res['git_revision']}, {res['machine']['cpu']} x {res['machine']['cpu_count']}, "
             f"load average {res['machine']['load_average_at_start']} at the start. `{res['command']}`. Each run "
             "over one simulated hour; target: Part 2 under 300 wall s per simulated hour on 2 cores. Wall seconds "
             "depend on what else the machine ran; CPU seconds are the process's own.", "",
             "| figure | deployment | c | steps | simulated s | wall s | CPU s | wall s per simulated hour | "
             "CPU s per simulated hour | schedule ms/step | update ms/step | execute ms/step | other ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['figure']} | {r['kv_policy']} | {r['concurrency']} | {r['engine_steps']} | "
                     f"{r['simulated_s']:.0f}{'' if r['full_hour'] else ' (workload ended)'} | {r['wall_s']:.0f} | "
                     f"{r['cpu_s']:.0f} | {r['wall_s_per_simulated_hour']:.0f} | {r['cpu_s_per_simulated_hour']:.0f} | "
                     f"{r['schedule_ms_per_step']:.2f} | {r['update_ms_per_step']:.2f} | {r['price_ms_per_step']:.2f} | "
                     f"{r['other_ms_per_step']:.2f} |")
    if res.get("previous"):  # a rerun of the same runs on newer code (merged by hand, as the command says)
        p = res["previous"]
        lines += ["", f"The same runs at {p['git_revision'][:7]} ({p['date']}), wall s per simulated hour: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in p["wall_s_per_simulated_hour"].items())
                  + f"; every run's trace equal to this one's: {'yes' if p['trace_sha256_equal'] else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--figure", action="append", choices=sorted(FIGURES), help="repeatable (default: every figure)")
    ap.add_argument("--horizon-s", type=float, default=HORIZON_S, help="simulated seconds per run")
    ap.add_argument("--out", default="out/bench_sim")
    ap.add_argument("--profile", action="store_true",
                    help="run under cProfile and write OUT/profile_<figure>_<policy>_c<concurrency>.txt (slower)")
    ap.add_argument("--profile-from-s", type=float, default=0.0,
                    help="with --profile: profile from this simulated second on (skip the warm-up)")
    args, overrides = ap.parse_known_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    runs = []
    for figure in args.figure or sorted(FIGURES):
        path, defaults = FIGURES[figure]
        cfg = load_config(str(REPO / path), [*defaults, *overrides])
        if not serve.simulated(cfg):
            raise ValueError(f"{path}: bench_sim needs a simulated config (runner.kind='sim')")
        for policy in cfg.sweep.kv_policy:
            for conc in cfg.sweep.concurrency:
                prof = os.path.join(out, f"profile_{figure}_{policy}_c{conc}.txt") if args.profile else None
                r = {"figure": figure, "config": path,
                     **run(cfg, policy, conc, args.horizon_s, prof, args.profile_from_s), "profiled": bool(args.profile)}
                runs.append(r)
                print(f"[bench_sim] {figure} {policy} c={conc}: {r['engine_steps']} steps, {r['simulated_s']:.0f} "
                      f"simulated s in {r['wall_s']:.0f} wall s / {r['cpu_s']:.0f} CPU s "
                      f"({r['wall_s_per_simulated_hour']:.0f} wall s, {r['cpu_s_per_simulated_hour']:.0f} CPU s per "
                      "simulated hour)", flush=True)
    res = {"benchmark": "bench_sim", "date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
           "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "load_average_at_start": round(load, 2)},
           "command": "python -m experiments.bench_sim " + " ".join(argv if argv is not None else os.sys.argv[1:]),
           "figures": {f: {"config": FIGURES[f][0], "overrides": list(FIGURES[f][1])} for f in FIGURES},
           "overrides": overrides, "runs": runs}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(res))
    print(table(res))
    return res


if __name__ == "__main__":
    main()
