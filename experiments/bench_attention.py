"""Time per decode step of one GLM-5.3 attention layer: sparse MLA (+ the indexer, reported apart) vs dense
MLA, for a batch of requests whose whole context sits in a real paged cache.

    python -m experiments.bench_attention --out results/bench_attention [--contexts 4096 ... 131072]

Shapes: 64 heads, 512 latent + 64 rope, top-k 2048, 32 indexer heads x 128, batch 4, block size 64;
MLA rows in fp8_ds_mla (656 B) or bf16, indexer keys in fp8 (132 B). The pool holds every request's
context on shuffled pages. Timed regions (jitted, steady state, median of --repeats):
- sparse_attn: block-table lookup of the 2,048 selected positions, gather of those rows from the pool,
  decode (fp8 -> float), absorbed MQA with softmax over them;
- indexer: block-table gather of every cached key, index scores for all positions, top-k 2048;
- dense_attn: the same absorbed MQA over every cached row (block-table gather of all of them).
On CPU the ops run their jnp references (impl="reference"); on a GPU the script runs the Pallas
kernels (impl="pallas") and reports achieved bytes/s and FLOP/s against the H200 ceilings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from attention import indexer, sparse_mla
from attention.common import on_gpu, slot_mapping
from attention.formats import IndexKeyFormat, MLARowFormat
from experiments.bench_model import run_metadata

H, R, P, TOPK, HI, DI = 64, 512, 64, 2048, 32, 128
H200 = {"hbm_bytes_per_s": 4.8e12, "bf16_flop_per_s": 989e12}


def _pool(batch: int, context: int, block_size: int, fmt_rows: MLARowFormat, fmt_keys: IndexKeyFormat, seed: int):
    """A paged pool holding `context` positions of each request on shuffled pages. Rows are random (the
    speed does not depend on values); packed in chunks so the float rows never exist all at once."""
    pages = context // block_size
    n = batch * pages * block_size
    key = jax.random.key(seed)
    pack_rows = jax.jit(lambda k: fmt_rows.pack(jax.random.normal(k, (1 << 16, R)), jax.random.normal(k, (1 << 16, P))))
    pack_keys = jax.jit(lambda k: fmt_keys.pack(jax.random.normal(k, (1 << 16, DI))))
    chunks = max(1, n // (1 << 16))
    rows = jnp.concatenate([pack_rows(jax.random.fold_in(key, i)) for i in range(chunks)])[:n]
    keys = jnp.concatenate([pack_keys(jax.random.fold_in(key, 1000 + i)) for i in range(chunks)])[:n]
    table = np.random.default_rng(seed).permutation(batch * pages).reshape(batch, pages).astype(np.int32)
    return rows, keys, jnp.asarray(table)


def _median_s(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def bench_context(context: int, args, impl: str) -> dict:
    b, bs = args.batch, args.block_size
    fmt_rows = MLARowFormat(args.kv_cache_dtype, R, P)
    fmt_keys = IndexKeyFormat("fp8", DI)
    rows, keys, table = _pool(b, context, bs, fmt_rows, fmt_keys, context)
    rng = np.random.default_rng(0)
    q_lat = jnp.asarray(rng.normal(size=(b, 1, H, R)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(b, 1, H, P)), jnp.float32)
    q_idx = jnp.asarray(rng.normal(size=(b, 1, HI, DI)), jnp.float32)
    w_idx = jnp.asarray(rng.normal(size=(b, 1, HI)), jnp.float32)
    q_pos = jnp.full((b, 1), context - 1, jnp.int32)
    selected = jnp.asarray(np.sort(rng.choice(context, size=(b, 1, TOPK), replace=True), -1), jnp.int32)
    all_pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (b, 1, context))
    scale = (R + P) ** -0.5

    def attend(rows, table, pos, q_lat, q_pe):
        slots = slot_mapping(table, pos, bs)
        return sparse_mla.sparse_mqa(q_lat, q_pe, sparse_mla.SlotRows(rows, slots, fmt_rows), scale, impl=impl)

    def index(keys, table, q_idx, w_idx, q_pos):
        pk = indexer.PagedKeys(keys, table, bs, fmt_keys)
        return indexer.topk(q_idx, w_idx, pk, q_pos, TOPK, window=context, impl=impl)

    attend = jax.jit(attend)
    out = {"context": context}
    out["sparse_attn_s"] = _median_s(attend, (rows, table, selected, q_lat, q_pe), args.repeats)
    out["indexer_s"] = _median_s(jax.jit(index), (keys, table, q_idx, w_idx, q_pos), args.repeats)
    if context <= args.dense_max_context:
        out["dense_attn_s"] = _median_s(attend, (rows, table, all_pos, q_lat, q_pe), args.repeats)
    # Logical traffic and work of the sparse step (what a kernel must at least move and compute).
    out["sparse_bytes"] = b * TOPK * fmt_rows.row_bytes + b * H * (R + P + R) * 2
    out["sparse_flops"] = b * H * TOPK * 2 * (R + P + R)
    out["sparse_bytes_per_s"] = out["sparse_bytes"] / out["sparse_attn_s"]
    out["sparse_flop_per_s"] = out["sparse_flops"] / out["sparse_attn_s"]
    if on_gpu():
        out["sparse_hbm_frac"] = out["sparse_bytes_per_s"] / H200["hbm_bytes_per_s"]
        out["sparse_flop_frac"] = out["sparse_flop_per_s"] / H200["bf16_flop_per_s"]
    del rows, keys
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["contexts"]
    ctx = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(ctx, [1e3 * r["sparse_attn_s"] for r in rows], "o-", label="sparse MLA (top-2048)")
    ax.plot(ctx, [1e3 * r["indexer_s"] for r in rows], "s--", label="indexer (scores + top-k)")
    dense = [(r["context"], 1e3 * r["dense_attn_s"]) for r in rows if "dense_attn_s" in r]
    if dense:
        ax.plot(*zip(*dense), "^-", label="dense MLA (all rows)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"ms per decode step (one layer, batch {results['batch']})")
    ax.set_title(f"GLM-5.3 attention decode, {results['impl']} on {results['machine']['jax_device']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=["fp8_ds_mla", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dense-max-context", type=int, default=1 << 17, help="skip dense MLA beyond this context")
    ap.add_argument("--impl", default=None, choices=["reference", "pallas"],
                    help="default: pallas on a GPU, reference elsewhere")
    args = ap.parse_args(argv)
    for c in args.contexts:
        if c < TOPK or c % args.block_size:
            raise ValueError(f"contexts must be >= top-k ({TOPK}) and multiples of block_size, got {c}")
    impl = args.impl or ("pallas" if on_gpu() else "reference")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        **run_metadata("bench_attention"),
        "impl": impl, "batch": args.batch, "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype,
        "dims": {"heads": H, "kv_lora_rank": R, "rope_dim": P, "index_topk": TOPK, "index_heads": HI,
                 "index_head_dim": DI},
        "units": "seconds per decode step of one layer for the whole batch; bytes and FLOPs are the sparse step's "
                 "logical minimum",
        "contexts": [],
    }
    for c in tqdm(args.contexts, desc="contexts"):
        results["contexts"].append(bench_context(c, args, impl))
    rows = {r["context"]: r for r in results["contexts"]}
    if 8192 in rows and 131072 in rows:
        results["sparse_128k_over_8k"] = rows[131072]["sparse_attn_s"] / rows[8192]["sparse_attn_s"]
        if "dense_attn_s" in rows[131072]:
            results["dense_128k_over_8k"] = rows[131072]["dense_attn_s"] / rows[8192]["dense_attn_s"]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "bench_attention.png")
    print(json.dumps({k: v for k, v in results.items() if k.endswith("over_8k")}))
    print(f"wrote {out / 'results.json'} and {out / 'bench_attention.png'}")
    return results


if __name__ == "__main__":
    main()
