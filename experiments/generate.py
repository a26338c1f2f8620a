"""Generate text for one prompt with a GLM-5.3 model and report prefill and decode speed (the main job is
now experiments.serve: the engine on a workload).

    python -m experiments.generate                      # built-in tiny model, random weights
    python -m experiments.generate --checkpoint DIR     # an HF glm_moe_dsa checkpoint (token-id prompt)

Runs the prompt once to compile, then times a second identical run: prefill tokens/s and decode tokens/s
(steady state, compilation excluded). With --out DIR it also writes DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax

import glm53
from glm53.tokenizer import ByteTokenizer


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model preset with random weights (default: tiny)")
    ap.add_argument("--checkpoint", help="HF checkpoint directory (overrides --preset)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default="The lightning indexer picks the rows that matter. ")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", help="directory for results.json")
    args = ap.parse_args(argv)

    if args.checkpoint:
        model = glm53.from_pretrained(args.checkpoint, dtype=args.dtype)
        source = args.checkpoint
    else:
        model = glm53.init(args.preset, seed=args.seed, dtype=args.dtype, std=0.1)
        source = f"preset {args.preset} (random weights, seed {args.seed})"
    tok = ByteTokenizer()
    prompt_ids = tok.encode(args.prompt)
    if max(prompt_ids) >= model.cfg.vocab_size:
        raise SystemExit(f"the byte-level prompt needs vocab >= 256; this model has {model.cfg.vocab_size}")

    t0 = time.perf_counter()
    glm53.generate(model, prompt_ids, args.max_new_tokens)  # compiles the prefill and decode programs
    compile_s = time.perf_counter() - t0
    out = glm53.generate(model, prompt_ids, args.max_new_tokens)

    results = {
        "model": source,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(out.token_ids),
        "first_run_incl_compile_s": compile_s,
        "prefill_s": out.prefill_s,
        "prefill_tokens_per_s": len(prompt_ids) / out.prefill_s,
        "decode_tokens_per_s": out.decode_tokens_per_s,
        "decode_ms_per_step": 1e3 / out.decode_tokens_per_s,
        "device": str(jax.devices()[0]),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"model: {source}")
    print(f"prompt: {args.prompt!r}")
    print(f"generated: {tok.decode(out.token_ids)!r}")
    print(f"token ids: {out.token_ids.tolist()}")
    print(f"prefill: {results['prefill_tokens_per_s']:.1f} tokens/s   decode: {results['decode_tokens_per_s']:.1f} "
          f"tokens/s ({results['decode_ms_per_step']:.2f} ms/step)   first run incl. compile: {compile_s:.1f} s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
