"""Model benchmark on CPU: `glm53.score` prefill tokens/s and decode ms/step, beside HF transformers.

    python -m experiments.bench_model --out results/bench_model \
        --hf-python /path/to/python3.11   # a Python with torch==2.13.0 and transformers==5.23.0

For each config ("tiny" preset and the "mid" preset: hidden 512, 8 layers, 8 heads, kv_lora 128, rope 32,
nope 64, v 64, q_lora 256, 16 experts top-2, indexer 4 x 64, top-k 256, IndexShare freq 4 / offset 3;
our choices for what that list leaves open: vocab 4096, dense MLP 1024 in the first layer, expert width
256, one shared expert) it
1. builds random float32 weights (seed 0) and writes them as an HF checkpoint, so both sides run the
   same weights;
2. times our `glm53.score` on random prompts of each length: one call to compile, then the best of
   --repeats calls (steady state; the compile time is reported apart);
3. times decode: `glm53.generate` after a prompt of --decode-context tokens, ms per new token;
4. runs experiments/hf_reference.py under --hf-python (torch with --threads threads, eager attention,
   float32) on the same checkpoint and lengths.
Writes OUT/results.json (units in key names) and OUT/bench_model.png. Without --hf-python the HF columns
are null and the JSON says so. This is a benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import glm53
from experiments.common import REPO, cpu_name, git_revision, run_json_subprocess  # noqa: F401 (re-exported)
from experiments.hf_reference import HF_ATTN_CHOICES

DEFAULT_LENGTHS = {"tiny": [256, 1024], "mid": [1024, 4096, 8192]}
SPEED_TARGETS = {"mid": {1024: 2.0, 8192: 5.0}}  # issue 2: >= 2x HF at 1K tokens, >= 5x at 8K


def run_metadata(benchmark: str) -> dict:
    """The header every results.json starts with: what ran, when, where, with which code."""
    return {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "jax_device": str(jax.devices()[0])},
        "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
        "git_commit": git_revision(),
    }


def time_score(model, length: int, repeats: int) -> dict:
    ids = np.random.default_rng(length).integers(0, model.cfg.vocab_size, length)
    t0 = time.perf_counter()
    glm53.score(model, ids)
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        glm53.score(model, ids)
        best = min(best, time.perf_counter() - t0)
    return {"tokens": length, "ours_s": best, "ours_first_call_incl_compile_s": first,
            "ours_tokens_per_s": length / best}


def time_decode(model, context: int, steps: int) -> float:
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, context)
    glm53.generate(model, ids, steps + 1)  # compile every window bucket the timed run will touch
    out = glm53.generate(model, ids, steps + 1)
    return out.decode_s / steps * 1e3


def run_hf(hf_python: str, ckpt: Path, lengths, threads: int, decode_context: int, steps: int, repeats: int,
           attn: str) -> dict:
    return run_json_subprocess(
        [hf_python, str(REPO / "experiments" / "hf_reference.py"), "--checkpoint", str(ckpt),
         "--lengths", *map(str, [decode_context] + [n for n in lengths if n != decode_context]),
         "--threads", str(threads), "--decode-steps", str(steps), "--repeats", str(repeats), "--attn", attn],
        threads=threads)


def bench_config(name: str, args, tmp: Path) -> dict:
    model = glm53.init(name, seed=0)
    lengths = args.lengths or DEFAULT_LENGTHS.get(name, [256, 1024])
    print(f"[{name}] score at {lengths} tokens", flush=True)
    rows = []
    for n in tqdm(lengths, desc=f"{name}: glm53.score", unit="length", leave=False):
        rows.append(time_score(model, n, args.repeats))
        tqdm.write(f"  ours {n:6d} tokens: {rows[-1]['ours_s']:.3f} s ({rows[-1]['ours_tokens_per_s']:.0f} tokens/s; "
                   f"first call {rows[-1]['ours_first_call_incl_compile_s']:.1f} s)")
    decode_ms = time_decode(model, args.decode_context, args.decode_steps)
    print(f"  ours decode: {decode_ms:.2f} ms/step at {args.decode_context} tokens of context", flush=True)
    result = {"config": glm53.config.to_hf_config(model.cfg), "prefill": rows,
              "decode_context_tokens": args.decode_context, "ours_decode_ms_per_step": decode_ms,
              "hf_decode_ms_per_step": None}
    if args.hf_python:
        ckpt = tmp / name
        glm53.save_pretrained(model, ckpt)
        print(f"  running HF transformers ({args.hf_python})", flush=True)
        hf = run_hf(args.hf_python, ckpt, lengths, args.threads, args.decode_context, args.decode_steps, args.repeats,
                    args.hf_attn)
        hf_s = {p["tokens"]: p["seconds"] for p in hf["prefill"]}
        for r in rows:
            r["hf_s"] = hf_s[r["tokens"]]
            r["hf_tokens_per_s"] = r["tokens"] / r["hf_s"]
            r["speedup_vs_hf"] = r["hf_s"] / r["ours_s"]
            target = SPEED_TARGETS.get(name, {}).get(r["tokens"])
            if target is not None:
                r["target_speedup"] = target
                r["target_met"] = r["speedup_vs_hf"] >= target
            print(f"  HF   {r['tokens']:6d} tokens: {r['hf_s']:.3f} s -> ours is {r['speedup_vs_hf']:.2f}x", flush=True)
        result["hf_decode_ms_per_step"] = hf["decode_ms_per_step"]
        result["hf_versions"] = {k: hf[k] for k in ("torch", "transformers", "threads", "attn_implementation")}
        print(f"  HF decode: {hf['decode_ms_per_step']:.2f} ms/step", flush=True)
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["configs"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = results["configs"][name]["prefill"]
        n = [r["tokens"] for r in rows]
        ax.plot(n, [r["ours_tokens_per_s"] for r in rows], "o-", label="glm53.score (JAX)")
        if all("hf_tokens_per_s" in r for r in rows):
            ax.plot(n, [r["hf_tokens_per_s"] for r in rows], "s--", label="HF transformers (eager)")
            for r in rows:
                ax.annotate(f"{r['speedup_vs_hf']:.1f}x", (r["tokens"], r["ours_tokens_per_s"]),
                            textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tokens/s")
        ax.set_title(f"{name}: prefill on CPU ({results['machine']['cores']} cores)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="+", default=["tiny", "mid"])
    ap.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default per config)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--hf-python", help="Python with torch and transformers for the HF columns")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for HF")
    ap.add_argument("--hf-attn", default="sdpa", choices=HF_ATTN_CHOICES,
                    help="HF attention implementation (sdpa: HF's default for this model)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        **run_metadata("bench_model"),
        "what": "prefill = glm53.score (all logits, chunked prefill over a contiguous cache), steady state after "
                "one compiling call; decode = glm53.generate ms per new token; HF = GlmMoeDsaForCausalLM float32 "
                "forward without cache, attention implementation and torch threads as in hf_versions",
        "hf_ran": bool(args.hf_python),
        "configs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            results["configs"][name] = bench_config(name, args, Path(tmp))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "bench_model.png")
    print(f"wrote {out / 'results.json'} and {out / 'bench_model.png'}")
    return results


if __name__ == "__main__":
    main()
