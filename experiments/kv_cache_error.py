"""End-to-end effect of the KV-cache format on the logits: each model scores its prompts on a paged cache
in each format (the first half of every prompt prefilled in chunks, the rest teacher-forced through
batched decode) and is compared with the float32 result.

    python -m experiments.kv_cache_error --out results/kv_cache_error

Models: the committed HF golden fixtures (reference: HF transformers' logits, tests/fixtures/hf_golden)
and the tiny preset (reference: glm53.score with a float32 contiguous cache). Per (model, cache format,
indexer-key format): `max_abs_err_rel` = max |logit - reference| / max |reference|, and
`top1_agreement` = fraction of positions whose argmax token matches the reference's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

import glm53
from experiments.bench_model import REPO, run_metadata

FORMATS = [("float32", None), ("bfloat16", None), ("fp8_ds_mla", None), ("fp8_ds_mla", "float32")]


def _cases(names):
    for name in names:
        if name.startswith("fixture:"):
            d = REPO / "tests" / "fixtures" / "hf_golden" / name.split(":", 1)[1]
            golden = np.load(d / "golden.npz")
            yield name, glm53.from_pretrained(d), [golden["input_ids"]], [golden["logits"]]
        else:  # "tiny" or "tiny:STD"
            std = float(name.split(":", 1)[1]) if ":" in name else None
            model = glm53.init("tiny", seed=0, std=std)
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, model.cfg.vocab_size, n) for n in (40, 64, 23)]
            yield name, model, prompts, [glm53.score(model, p) for p in prompts]


def measure(names, formats=FORMATS) -> list[dict]:
    rows = []
    for name, model, prompts, refs in _cases(names):
        for kv, idx in formats:
            got = glm53.score_batch(model, prompts, kv_cache_dtype=kv, index_cache_dtype=idx,
                                    prefill_lens=[max(1, len(p) // 2) for p in prompts], prefill_chunk=16)
            err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, refs))
            top1 = float(np.mean(np.concatenate([g.argmax(-1) == r.argmax(-1) for g, r in zip(got, refs)])))
            rows.append({"model": name, "kv_cache_dtype": kv, "index_cache_dtype": idx or "default",
                         "positions": int(sum(len(p) for p in prompts)), "max_abs_err_rel": err, "top1_agreement": top1})
            print(f"{name:18s} {kv:11s} keys={idx or 'default':8s} err={err:.4f} top1={top1:.3f}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["fixture:base", "fixture:grouped", "tiny", "tiny:0.1"])
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        **run_metadata("kv_cache_error"),
        "what": __doc__.split("\n\n")[0].strip(),
        "rows": measure(args.models),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
