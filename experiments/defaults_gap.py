"""Where `DeployConfig()`'s gap to a tuned deployment comes from, on bench_engine's workload (the mid
preset, 8 prompts of about 1,000 tokens, 30 greedy tokens each).

    python -m experiments.defaults_gap --out results/defaults_gap [--rounds 4]

Four deployments on one model object (compiled programs shared): "tuned" (max_model_len 1,056,
max_num_seqs 8: bench_engine's), "tuned_big_pool" (the same limits with the defaults' pool size),
"default_window_small_pool" (the defaults' max_model_len, so the decode window bucket is 2,048
positions, on the tuned pool size), and "default" (`DeployConfig()`).

1. Work per program: XLA's cost analysis (FLOPs) of each compiled step program the deployments ran.
   (Its "bytes accessed" counts a scatter's whole operand, the pool, so it is reported but does not
   say what moves.)
2. Time per step: the deployments take turns over `--rounds` rounds, each round a fresh batch on the
   same engines (a first round warms them up and is not counted); the prefill step and the median
   decode step of every round are recorded.
3. Time on a fresh engine, as bench_engine measures it: a new engine per deployment per round, the
   whole `generate` timed.

Writes OUT/results.json. A benchmark: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from experiments.common import cpu_name, git_revision


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.defaults_gap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/defaults_gap")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import dataclasses

    import jax

    import glm53
    from glm53 import DeployConfig, Engine, SamplingParams

    model = glm53.init("mid", seed=0)
    default = DeployConfig().resolved(model.cfg)
    tuned = dict(max_model_len=1056, max_num_seqs=8, max_num_batched_tokens=8192)
    deploys = {"tuned": DeployConfig(**tuned),
               "tuned_big_pool": DeployConfig(**tuned, num_gpu_blocks=default.num_gpu_blocks),
               "default_window_small_pool": DeployConfig(max_num_seqs=8, max_num_batched_tokens=8192,
                                                         num_gpu_blocks=DeployConfig(**tuned).resolved(
                                                             model.cfg).num_gpu_blocks),
               "default": DeployConfig()}
    rng = np.random.default_rng(0)

    def batch():
        return [rng.integers(0, model.cfg.vocab_size, 1000) for _ in range(8)]

    # 1 and 2: reused engines, each program's cost analysis captured once
    engines, programs = {}, {}
    for name, d in deploys.items():
        eng = engines[name] = Engine(model, d)
        forward, seen = eng.runner.c.forward, {}

        def capture(state, tok, pos, cache, _f=forward, _seen=seen, **kw):
            key = (*tok.shape, kw["window"])
            if key not in _seen:
                _seen[key] = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape")
                                           else a, (state, tok, pos, cache)), kw)
            return _f(state, tok, pos, cache, **kw)

        eng.runner.c = dataclasses.replace(eng.runner.c, forward=capture)
        programs[name] = (forward, seen)
    steps = {name: {"prefill_s": [], "decode_median_s": []} for name in deploys}
    for r in range(args.rounds + 1):
        prompts = batch()
        for name, eng in engines.items():
            for p in prompts:
                eng.add_request(p, SamplingParams(30))
            t0 = time.perf_counter()
            eng.step()  # the whole batch's prefill (8,192 tokens fit every budget)
            prefill = time.perf_counter() - t0
            dec = []
            while eng.has_unfinished():
                t0 = time.perf_counter()
                eng.step()
                dec.append(time.perf_counter() - t0)
            if r:
                steps[name]["prefill_s"].append(prefill)
                steps[name]["decode_median_s"].append(float(np.median(dec)))
    costs = {}
    for name, (forward, seen) in programs.items():
        costs[name] = []
        for (rows, width, window), (a, kw) in sorted(seen.items()):
            ca = forward.lower(*a, **kw).compile().cost_analysis()
            ca = ca[0] if isinstance(ca, list) else ca
            costs[name].append({"rows": rows, "width": width, "window": window, "gflop": ca.get("flops", 0) / 1e9,
                                "gb_accessed_by_xla_count": ca.get("bytes accessed", 0) / 1e9})
    del engines
    # 3: fresh engines, as bench_engine times them
    fresh = {name: [] for name in deploys}
    for r in range(args.rounds):
        prompts = batch()
        for name, d in deploys.items():
            eng = Engine(model, d)
            t0 = time.perf_counter()
            eng.generate(prompts, max_new_tokens=30)
            fresh[name].append(time.perf_counter() - t0)
            del eng
    result = {"benchmark": "defaults_gap", "date": time.strftime("%Y-%m-%d"), "git_commit": git_revision(),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count()}, "rounds": args.rounds,
              "deployments": {name: {"num_gpu_blocks": d.resolved(model.cfg).num_gpu_blocks,
                                     "max_model_len": d.resolved(model.cfg).max_model_len,
                                     "programs": costs[name],
                                     "reused_prefill_s_median": float(np.median(steps[name]["prefill_s"])),
                                     "reused_decode_step_s_median": float(np.median(steps[name]["decode_median_s"])),
                                     "reused_prefill_s": steps[name]["prefill_s"],
                                     "reused_decode_step_s_medians": steps[name]["decode_median_s"],
                                     "fresh_generate_s": fresh[name],
                                     "fresh_generate_s_min": min(fresh[name])}
                              for name, d in deploys.items()}}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    for name, v in result["deployments"].items():
        print(f"{name:26s} prefill {v['reused_prefill_s_median']:.2f} s, decode step "
              f"{v['reused_decode_step_s_median'] * 1e3:.1f} ms (reused); fresh generate min {v['fresh_generate_s_min']:.2f} s; "
              + ", ".join(f"{p['rows']}x{p['width']}@{p['window']}: {p['gflop']:.2f} GFLOP" for p in v["programs"]))
    return result


if __name__ == "__main__":
    main()
