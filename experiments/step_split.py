"""Where a served step's time goes on this machine, and how steady this machine's speed is: the measurements
behind how the laptop validation prices a step (docs/simulator.md, "Where the simulator's TTFT goes low").

    python -m experiments.step_split --out results/validate_sim/step_split.json [--point serve_default:preempt:1 ...]

Each `--point NAME:POLICY:CONCURRENCY` (NAME: validate_sim's serve_default or a HELD_OUT config, one device)
is served twice after a compiling pass, as experiments.validate_sim serves it:
- as served (nothing waited for beyond what the engine waits for), each engine step split on the host's
  clock where its first forward is dispatched (`ModelRunner._forward`'s first call) and where its sampled
  tokens reach the host (`ModelRunner._pick` returns): "before_dispatch_s", "dispatch_to_tokens_s",
  "after_tokens_s" (of which "update_s": after the runner's `execute` returned);
- with each forward waited for: "forward_s" (dispatch to the forward's result) and "sampling_s" (from
  there to the tokens on the host: the sampling program and its transfer).
Medians per step kind ("decode_only" and "with_prefill", steps that sample). Then `--drift-s` seconds of
the same four forward programs timed over and over (3 rounds a pass): each pass's time over the median
pass, the median over the programs ("common_factor": what moves every program at once: this machine's
speed, which a fit's rates cannot follow); and the decode program timed right after each of the others
and after the grid's largest forward, against itself repeated ("decode_after_ms": a forward's time
depends on what ran before it, which neither the grid's timing nor the simulator represents).

Writes one JSON file (`--out`); asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from experiments.common import load_config

DRIFT_SHAPES = ((1, 1, 1024), (1, 16, 1024), (1, 128, 1024), (4, 16, 1024))  # (rows, width, window)
PREFILL_SHAPE = (1, 1024, 8192)  # the grid's largest forward


def _config(name: str, concurrency: int):
    from experiments import serve, validate_sim as vs

    paths = {name: (path, overrides) for name, path, overrides in (vs.TRAIN, *vs.HELD_OUT)}
    path, overrides = paths[name]
    return load_config(path, [*overrides, f"--config.sweep.concurrency=({concurrency},)"], default=serve.default_config)


def split_point(name: str, policy: str, concurrency: int) -> dict:
    """One point served as measured above -> {"as_served": {kind: medians}, "waited": {kind: medians}}."""
    import jax

    from experiments import serve
    from glm53.engine.runner import ModelRunner

    cfg = _config(name, concurrency)
    model, _ = serve._model(cfg.model)
    serve.run_one(model, cfg, policy, concurrency, progress=False)  # compiles
    out = {}
    forward, pick, execute = ModelRunner._forward, ModelRunner._pick, ModelRunner.execute
    for mode in ("as_served", "waited"):
        steps, cur = [], {}

        def timed_forward(self, *a, **k):
            cur.setdefault("dispatch", time.perf_counter())
            res = forward(self, *a, **k)
            if mode == "waited":
                jax.block_until_ready(res)
                cur["forward_done"] = time.perf_counter()
            return res

        def timed_pick(self, *a, **k):
            res = pick(self, *a, **k)
            cur["tokens"] = time.perf_counter()
            return res

        def timed_execute(self, plan):
            res = execute(self, plan)
            cur["executed"] = time.perf_counter()
            cur["prefill"] = any(r.num_tokens != 1 + r.num_draft_tokens for r in plan.rows)
            return res

        make = serve._engine

        def engine(*a, **k):
            e = make(*a, **k)
            step = e.step

            def timed_step():
                cur.clear()
                cur["start"] = time.perf_counter()
                res = step()
                cur["end"] = time.perf_counter()
                if "tokens" in cur:  # a step that sampled
                    steps.append(dict(cur))
                return res

            e.step = timed_step
            return e

        ModelRunner._forward, ModelRunner._pick, ModelRunner.execute = timed_forward, timed_pick, timed_execute
        serve._engine = engine
        try:
            serve.run_one(model, cfg, policy, concurrency, progress=False)
        finally:
            ModelRunner._forward, ModelRunner._pick, ModelRunner.execute = forward, pick, execute
            serve._engine = make
        parts = {"before_dispatch_s": ("start", "dispatch"), "dispatch_to_tokens_s": ("dispatch", "tokens"),
                 "after_tokens_s": ("tokens", "end"), "update_s": ("executed", "end"), "step_s": ("start", "end")}
        if mode == "waited":
            parts = {"forward_s": ("dispatch", "forward_done"), "sampling_s": ("forward_done", "tokens"),
                     "step_s": ("start", "end")}
        out[mode] = {}
        for kind, prefill in (("decode_only", False), ("with_prefill", True)):
            got = [s for s in steps if s["prefill"] == prefill]
            if got:
                out[mode][kind] = {"steps": len(got), **{k: statistics.median(s[b] - s[a] for s in got)
                                                         for k, (a, b) in parts.items()}}
    return out


def drift(seconds: float) -> dict:
    """The four DRIFT_SHAPES forward programs of the serve default timed in passes for `seconds` ->
    {"pass_t_s": [...], "common_factor": [...], "per_shape_ms": {shape: [...]}}."""
    from experiments import serve, validate_sim as vs

    cfg = _config("serve_default", 1)
    model, _ = serve._model(cfg.model)
    runner = vs.grid_runner(model, serve._deploy(cfg, "preempt"), rows=(4,), widths=(1024,), windows=(8192,))
    args = {shape: vs.grid_args(runner, *shape) for shape in DRIFT_SHAPES}

    def run(shape) -> float:
        return vs.time_forward(runner, args[shape])

    for shape in args:
        run(shape)  # compiles
    t_start, passes, when = time.perf_counter(), [], []
    while time.perf_counter() - t_start < seconds:
        times = {shape: [] for shape in args}
        for _ in range(3):
            for shape in args:
                times[shape].append(run(shape))
        passes.append({shape: statistics.median(t) for shape, t in times.items()})
        when.append(time.perf_counter() - t_start)
    med = {shape: statistics.median(p[shape] for p in passes) for shape in args}
    factor = [statistics.median(p[shape] / med[shape] for shape in args) for p in passes]
    # the decode program right after another program (15 pairs each), against itself repeated
    decode = DRIFT_SHAPES[0]
    after = {"itself": statistics.median(run(decode) for _ in range(30))}
    for shape in DRIFT_SHAPES[1:] + (PREFILL_SHAPE,):
        if shape not in args:
            args[shape] = vs.grid_args(runner, *shape)
            run(shape)
        pairs = []
        for _ in range(15):
            run(shape)
            pairs.append(run(decode))
        after["%dx%d@%d" % shape] = statistics.median(pairs)
    return {"pass_t_s": when, "common_factor": factor,
            "common_factor_range": [min(factor), max(factor)],
            "per_shape_ms": {f"{r}x{w}@{win}": [1e3 * p[(r, w, win)] for p in passes] for r, w, win in args
                             if (r, w, win) in DRIFT_SHAPES},
            "decode_after_ms": {k: 1e3 * v for k, v in after.items()}}


def main(argv=None) -> dict:
    from experiments import serve, validate_sim as vs

    ap = argparse.ArgumentParser(prog="python -m experiments.step_split", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/step_split.json")
    ap.add_argument("--point", action="append", default=[], metavar="NAME:POLICY:CONCURRENCY",
                    help="a one-device point (default: serve_default:preempt:1 and :4, "
                         "preempt_vs_offload:offload:4)")
    ap.add_argument("--drift-s", type=float, default=100.0, help="seconds of the drift measurement (0: none)")
    args = ap.parse_args(argv)
    serve._enable_compile_cache(str(serve.REPO / ".cache" / "jax"))
    points = args.point or ["serve_default:preempt:1", "serve_default:preempt:4", "preempt_vs_offload:offload:4"]
    res = {**vs._stamp("step_split"), "points": {}}
    for p in points:
        name, policy, conc = p.split(":")
        res["points"][p] = split_point(name, policy, int(conc))
        print(f"[step_split] {p}: {json.dumps(res['points'][p])}", flush=True)
    if args.drift_s > 0:
        res["drift"] = drift(args.drift_s)
        print(f"[step_split] drift: common factor {res['drift']['common_factor_range']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
