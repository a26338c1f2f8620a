"""Device check of the engine's memory budget: does the step workspace the compiler reports (the part of
a GPU's memory the KV pool leaves out, vLLM's profile run) cover what the device really uses at its
largest step?

    python -m experiments.check_engine_memory --out results/check_engine_memory     # on the GPU machine
    python -m experiments.check_engine_memory --out /tmp/check                       # CPU: no memory stats

It builds an `Engine` on the tiny model with the pool sized from device memory (no num_gpu_blocks; the
budget binds only if max_num_seqs x max_model_len needs more than it, which at these limits it does
not, so the pool here is what the limits need), then runs one prompt of the whole token budget and a
few decode steps, and reads the device's `memory_stats()` before and after: `measured_workspace_bytes`
= peak_bytes_in_use - bytes_in_use after start-up (weights, pool, tables; only if the serving steps
raised the process's peak, which JAX cannot reset), against XLA's memory analysis of the programs the
run used (`workspace_bytes_of_shapes_run`; the engine's `workspace_bytes_per_device`, the most over
every program it may run, is saved beside it). `covered` says whether the estimate holds; the figures
are saved either way. On a device that reports no memory (CPU) it saves
the runner's estimate alone and says so. Saves OUT/results.json with the date and the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

import glm53
from experiments.bench_model import run_metadata
from glm53 import DeployConfig, Engine
from glm53.engine.config import device_memory_bytes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    args = ap.parse_args(argv)

    device = jax.devices()[0]
    model = glm53.init(args.preset, seed=0, std=0.1)
    deploy = DeployConfig(max_model_len=args.max_model_len, max_num_batched_tokens=args.batched_tokens,
                          max_num_seqs=args.max_num_seqs, kv_cache_dtype="fp8_ds_mla")
    reports = device_memory_bytes(device) > 0
    if not reports:  # CPU: the pool comes from the 4 GiB default; the runner's own estimate still runs
        deploy = dataclasses.replace(deploy, num_gpu_blocks=64)
    eng = Engine(model, deploy)
    estimate = eng.workspace_bytes or eng.replicas[0].runner.step_workspace_bytes()
    before = device.memory_stats() or {}
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.batched_tokens - 1)
    eng.generate([prompt], max_new_tokens=4)
    jax.effects_barrier()
    after = device.memory_stats() or {}
    runner = eng.replicas[0].runner
    ran = sorted(runner.compiled_shapes)  # the programs this run used: the estimate to hold against the peak
    estimate_run = runner.step_workspace_bytes(ran)
    out = {**run_metadata("check_engine_memory"), "deploy": {k: getattr(eng.deploy, k) for k in (
        "max_model_len", "max_num_batched_tokens", "max_num_seqs", "num_gpu_blocks", "kv_cache_dtype")},
           "device_reports_memory": reports, "bytes_limit": device_memory_bytes(device),
           "weights_bytes_per_device": eng.replicas[0].runner.weights_bytes_per_device,
           "workspace_bytes_per_device": int(estimate), "workspace_from_engine_profile": bool(eng.workspace_bytes),
           "shapes_run": ran, "workspace_bytes_of_shapes_run": int(estimate_run)}
    if reports:
        in_use, peak0, peak = (int(x.get(k, 0)) for x, k in ((before, "bytes_in_use"), (before, "peak_bytes_in_use"),
                                                               (after, "peak_bytes_in_use")))
        out.update(bytes_in_use_after_start=in_use, peak_bytes_in_use_after_start=peak0, peak_bytes_in_use=peak)
        if peak > peak0:  # the serving steps set the process's peak: theirs is measurable
            out.update(measured_workspace_bytes=peak - in_use, covered=peak - in_use <= estimate_run)
        else:  # the peak is a process-lifetime figure and start-up (the profile run) set it
            out["note"] = "start-up set the device's peak, so the serving steps' own peak is not measurable"
    else:
        out["note"] = "this device reports no memory statistics: only the compiler's estimate is recorded"
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "results.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "versions")}, indent=1))
    return out


if __name__ == "__main__":
    main()
