"""Context-parallelism benchmark: PCP load balance measured on the implementation, and bytes moved per layer.

    python -m experiments.bench_parallel --out results            # the committed run (about 4-7 min on 2 cores)
    python -m experiments.bench_parallel --out /tmp/b --ns 2 --lengths 256 --block 32 --contexts 4096

1. Load balance. For each rank count N (--ns), prompt length (--lengths) and split ("naive": rank g
   takes tokens [2gC, 2(g+1)C); "balanced": chunks g and 2N-1-g), one PCP prefill layer
   (`parallel.layers.prefill_layer`) runs on N simulated CPU devices with small attention widths (the
   work counts do not depend on widths). Each rank's counters come from the implementation itself: the
   (query, key) pairs its indexer scored (causal pairs, and the pairs of the key blocks its tiled loop
   visited) and the selected rows its sparse MLA attended. Reported per rank and as
   `load_balance_max_over_mean` (1.0 = perfect balance; the slowest rank sets the step time).
2. Communication. Bytes one rank sends per layer, from `parallel.comm`'s formulas with GLM-5.3's
   dimensions (64 heads, latent 512, rope 64, top-k 2048, 656 B fp8_ds_mla rows, 132 B indexer keys,
   bf16 queries and outputs, fp32 LSE) as the context grows: DCP decode per token (ag_rs, a2a), the
   sparse top-k candidate merge, and PCP x DCP prefill (the all-gather of the new tokens' rows and the
   all-gather of the shards into the temporary full copy). The formulas are first checked against the
   collectives of the traced implementation at small widths ("formula_check").
3. The engine ("engine_load_balance"): the serving engine on the tiny model with
   prefill_context_parallel_size=N prefills one prompt of --engine-length tokens in one chunk (the
   prefill step only: decode runs replicated under PCP alone); the per-rank counters come from `Engine.metrics()` (`cp_*_per_rank`), counted by
   the same cache code (`parallel.cp_cache.CpKVCache`) that item 1 runs on one layer, here over every
   layer of a real model step, with the engine's own padding to its bucket shapes.
Writes OUT/bench_parallel.json (units in key names; date, machine, git commit) and OUT/bench_parallel.png.
This is a benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from experiments.common import cpu_name, git_revision

DIMS = {"heads": 2, "kv_lora": 16, "rope": 8, "index_heads": 1, "index_dim": 16}  # load-balance runs only


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.bench_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--ns", type=_ints, default=[2, 4, 8], help="PCP rank counts (simulated CPU devices)")
    p.add_argument("--lengths", type=_ints, default=[4096, 16384, 65536], help="prompt lengths (tokens)")
    p.add_argument("--block", type=int, default=1024,
                   help="indexer tile (queries x keys per loop step); capped at the chunk size C = T / 2N")
    p.add_argument("--topk", type=int, default=256,
                   help="indexer top-k of the load-balance runs (GLM-5.3's 2048 makes the exact running top-k "
                        "about 7x slower on CPU; only the attended-rows counter depends on it)")
    p.add_argument("--dcp-ns", type=_ints, default=[8, 16], help="DCP rank counts of the communication table")
    p.add_argument("--contexts", type=_ints, default=[8192, 32768, 131072, 524288, 1048576],
                   help="context lengths (tokens) of the communication table")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="new tokens per PCP x DCP prefill step")
    p.add_argument("--decode-tokens", type=int, default=1, help="query tokens per decode step (batch x (1 + MTP))")
    p.add_argument("--engine-n", type=int, default=8, help="PCP size of the engine run (0: skip it)")
    p.add_argument("--engine-length", type=int, default=8192, help="prompt tokens of the engine run")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- load balance
def load_balance_run(n: int, length: int, kind: str, *, block: int, topk: int, seed: int = 0) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from parallel import layers, pcp
    from parallel.cp_cache import counter_totals
    from parallel.mesh import make_mesh

    rng = np.random.default_rng(seed)
    d = DIMS
    split = pcp.PcpSplit(length, n, kind)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    s = split.padded_length
    block = min(block, split.chunk)  # a tile inside one chunk: the computed-pairs counter then balances too
    t0 = time.perf_counter()
    res = layers.prefill_layer(make_mesh(cp=n), split, normal(length, d["heads"], d["kv_lora"]),
                               normal(length, d["heads"], d["rope"]), normal(length, d["index_heads"], d["index_dim"]),
                               normal(length, d["index_heads"]), normal(length, d["kv_lora"] + d["rope"]),
                               normal(length, d["index_dim"]), jnp.zeros((s, d["kv_lora"] + d["rope"])),
                               jnp.zeros((s, d["index_dim"])), topk=topk, scale=0.1, block=block)
    per_rank = counter_totals(res.counters)
    wall = time.perf_counter() - t0
    return {
        "n": n, "length": length, "split": kind, "padded_length": split.padded_length, "block": block,
        "topk": topk, "per_rank": {k: v.tolist() for k, v in per_rank.items()},
        "load_balance_max_over_mean": {k: float(v.max() / v.mean()) if v.mean() > 0 else 1.0
                                       for k, v in per_rank.items()},
        "wall_s_incl_compile": wall,
    }


def engine_load_balance(n: int, length: int) -> dict:
    """The engine's own per-rank work for one prompt under PCP n (tiny model, one prefill chunk)."""
    import numpy as np

    import glm53
    from glm53 import DeployConfig, Engine

    model = glm53.init("tiny", seed=0)
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, length).astype(np.int32)
    deploy = DeployConfig(prefill_context_parallel_size=n, max_model_len=length + 16, max_num_seqs=1,
                          max_num_batched_tokens=length, kv_cache_dtype="float32")
    eng = Engine(model, deploy)
    t0 = time.perf_counter()
    eng.generate([prompt], max_new_tokens=1)  # the prefill step only (decode runs replicated under PCP)
    m = eng.metrics()
    keys = [k for k in m if k.startswith("cp_")]
    return {"n": n, "length": length, "split": "balanced (engine)", "model": "tiny",
            "max_num_batched_tokens": length, "wall_s_incl_compile": time.perf_counter() - t0,
            "per_rank": {k[3:-len("_per_rank")]: m[k] for k in keys if k.endswith("_per_rank")},
            "load_balance_max_over_mean": {k[3:-len("_max_over_mean")]: m[k] for k in keys
                                           if k.endswith("_max_over_mean")}}


# -------------------------------------------------------------------------------------------- comm bytes
def formula_check() -> list[dict]:
    """The formulas against the implementation's traced collectives (float32, small widths, N = 8)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, AxisType

    from parallel import comm, dcp, layers, pcp
    from parallel.mesh import AXES

    n, h, r, p, hi, di, b, t, blocks, bs, topk = 8, 4, 16, 8, 2, 8, 3, 2, 3, 4, 16
    mesh = AbstractMesh((1, 1, n), AXES, axis_types=(AxisType.Auto,) * 3)
    z = jnp.zeros
    layout = dcp.DcpLayout(n, bs)
    local = (b * blocks + 1) * bs
    rows = []
    for backend in dcp.BACKENDS:
        measured = comm.collective_bytes(
            lambda *a, backend=backend: layers.decode(mesh, *a[:5], layout=layout, scale=1.0, backend=backend,
                                                      index=(*a[5:], topk)),
            z((b, t, h, r)), z((b, t, h, p)), z((b, t), jnp.int32), z((b, blocks), jnp.int32), z((n * local, r + p)),
            z((b, t, hi, di)), z((b, t, hi)), z((n * local, di)), axis_sizes=mesh.shape)["total"]
        formula = (comm.dcp_decode_bytes(backend, n=n, tokens=b * t, heads=h, kv_lora=r, rope=p, q_bytes=4,
                                         out_bytes=4)["total"]
                   + comm.dcp_topk_merge_bytes(n=n, tokens=b * t, local_k=min(topk, blocks * bs)))
        rows.append({"what": f"sparse decode {backend}", "measured_bytes": measured, "formula_bytes": formula})
    split = pcp.PcpSplit(37, n)
    s = split.padded_length
    measured = comm.collective_bytes(
        lambda *a: layers.prefill_layer(mesh, split, *a, topk=4, scale=1.0, block=4),
        z((37, h, r)), z((37, h, p)), z((37, hi, di)), z((37, hi)), z((37, r + p)), z((37, di)), z((s, r + p)),
        z((s, di)), axis_sizes=mesh.shape)["total"]
    formula = comm.pcp_prefill_bytes(n=n, new_tokens=s, row_bytes=(r + p) * 4, key_bytes=di * 4)
    rows.append({"what": "PCP prefill all-gather", "measured_bytes": measured, "formula_bytes": formula})
    blocks = -(-s // layout.virtual_block)
    local = (blocks + 1) * bs
    measured = comm.collective_bytes(
        lambda *a: layers.pcp_dcp_prefill(mesh, split, *a, layout=layout, start=0, topk=4, scale=1.0, block=4),
        z((37, h, r)), z((37, h, p)), z((37, hi, di)), z((37, hi)), z((37, r + p)), z((37, di)),
        np.arange(blocks, dtype=np.int32), z((n * local, r + p)), z((n * local, di)), axis_sizes=mesh.shape)["total"]
    # the full copy gathers the request's own blocks (blocks x bs local slots), not the whole table
    formula += comm.dcp_full_copy_bytes(n=n, local_slots=blocks * bs, row_bytes=(r + p) * 4, key_bytes=di * 4)
    rows.append({"what": "PCP x DCP prefill all-gathers", "measured_bytes": measured, "formula_bytes": formula})
    return rows


def comm_table(dcp_ns, contexts, prefill_chunk: int, decode_tokens: int) -> list[dict]:
    from glm53.config import get_preset
    from kvcache.layout import index_key_bytes, mla_row_bytes
    from parallel import comm

    cfg = get_preset("glm-5.3")
    row_b = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)  # 656
    key_b = index_key_bytes(cfg.index_head_dim)  # 132
    out = []
    for n in dcp_ns:
        dec = {b: comm.dcp_decode_bytes(b, n=n, tokens=decode_tokens, heads=cfg.num_attention_heads,
                                        kv_lora=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim)["total"]
               for b in ("ag_rs", "a2a")}
        chunk = -(-prefill_chunk // (2 * n)) * 2 * n
        for ctx in contexts:
            local_slots = -(-ctx // (64 * n)) * 64  # blocks of 64 on each rank
            local_k = min(cfg.index_topk, local_slots)
            pcp_full = comm.pcp_prefill_bytes(n=n, new_tokens=chunk, row_bytes=row_b, key_bytes=key_b)
            pcp_shared = comm.pcp_prefill_bytes(n=n, new_tokens=chunk, row_bytes=row_b)
            copy_full = comm.dcp_full_copy_bytes(n=n, local_slots=local_slots, row_bytes=row_b, key_bytes=key_b)
            copy_shared = comm.dcp_full_copy_bytes(n=n, local_slots=local_slots, row_bytes=row_b)
            out.append({
                "n": n, "context_tokens": ctx, "decode_tokens": decode_tokens, "prefill_chunk_tokens": chunk,
                "decode_ag_rs_bytes_per_layer": dec["ag_rs"],
                "decode_a2a_bytes_per_layer": dec["a2a"],
                "decode_topk_merge_bytes_per_full_layer": comm.dcp_topk_merge_bytes(n=n, tokens=decode_tokens,
                                                                                    local_k=local_k),
                "prefill_new_rows_allgather_bytes_per_full_layer": pcp_full,
                "prefill_new_rows_allgather_bytes_per_shared_layer": pcp_shared,
                "prefill_full_copy_allgather_bytes_per_full_layer": copy_full,
                "prefill_full_copy_allgather_bytes_per_shared_layer": copy_shared,
                "prefill_allgather_bytes_per_forward": (
                    len(cfg.full_indexer_layers) * (pcp_full + copy_full)
                    + (cfg.num_layers_with_mtp - len(cfg.full_indexer_layers)) * (pcp_shared + copy_shared)),
            })
    return out


# ----------------------------------------------------------------------------------------------- report
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run_n in enumerate(sorted({r["n"] for r in result["load_balance"]})):
        for kind, style in (("naive", "--"), ("balanced", "-")):
            rs = sorted((r for r in result["load_balance"] if r["n"] == run_n and r["split"] == kind),
                        key=lambda r: r["length"])
            ax1.plot([r["length"] for r in rs],
                     [r["load_balance_max_over_mean"]["indexer_pairs_computed"] for r in rs], style, marker="o",
                     color=f"C{i}", label=f"N={run_n} {kind}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("indexer work: max / mean over ranks")
    ax1.set_title("PCP load balance (measured counters)")
    ax1.legend(fontsize=7)
    for i, n in enumerate(sorted({r["n"] for r in result["comm"]})):
        rs = [r for r in result["comm"] if r["n"] == n]
        ctx = [r["context_tokens"] for r in rs]
        ax2.plot(ctx, [r["prefill_full_copy_allgather_bytes_per_full_layer"] for r in rs], "-", marker="o",
                 color=f"C{i}", label=f"DCP{n} prefill: full-copy all-gather")
        ax2.plot(ctx, [r["prefill_new_rows_allgather_bytes_per_full_layer"] for r in rs], "-.", color=f"C{i}",
                 label=f"DCP{n} prefill: new-rows all-gather ({rs[0]['prefill_chunk_tokens']} tokens)")
        ax2.plot(ctx, [r["decode_topk_merge_bytes_per_full_layer"] for r in rs], ":", marker="x", color=f"C{i}",
                 label=f"DCP{n} decode: top-k merge (per token)")
        ax2.plot(ctx, [r["decode_ag_rs_bytes_per_layer"] for r in rs], ":", color=f"C{i}",
                 label=f"DCP{n} decode: ag_rs (per token)")
        ax2.plot(ctx, [r["decode_a2a_bytes_per_layer"] for r in rs], "--", color=f"C{i}",
                 label=f"DCP{n} decode: a2a (per token)")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("context tokens")
    ax2.set_ylabel("bytes sent per rank per layer")
    ax2.set_title("GLM-5.3 communication per layer (full indexer layer)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from parallel.mesh import set_cpu_device_count

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        set_cpu_device_count(max(args.ns + [args.engine_n]))  # before any JAX computation
    import jax
    from tqdm import tqdm

    jax.config.update("jax_default_matmul_precision", "highest")
    runs = [(n, length, kind) for n in args.ns for length in args.lengths for kind in ("naive", "balanced")]
    load_balance = [load_balance_run(n, length, kind, block=args.block, topk=args.topk)
                    for n, length, kind in tqdm(runs, desc="load balance", disable=None)]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "devices": f"{jax.device_count()} x {jax.devices()[0].platform}"},
        "git_commit": git_revision(),
        "command": "python -m experiments.bench_parallel " + " ".join(sys.argv[1:] if argv is None else argv),
        "load_balance_dims": DIMS,
        "load_balance": load_balance,
        "engine_load_balance": engine_load_balance(args.engine_n, args.engine_length) if args.engine_n > 1 else None,
        "formula_check": formula_check(),
        "comm": comm_table(args.dcp_ns, args.contexts, args.prefill_chunk, args.decode_tokens),
        "comm_units": "bytes one rank sends per layer (all-gather (N-1)s, reduce-scatter and all-to-all (N-1)/N s)",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_parallel.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "bench_parallel.png")
    for r in load_balance:
        lb = r["load_balance_max_over_mean"]
        print(f"N={r['n']:2d} T={r['length']:6d} {r['split']:8s} max/mean: indexer computed "
              f"{lb['indexer_pairs_computed']:.3f} causal {lb['indexer_pairs_causal']:.3f} "
              f"mla rows {lb['mla_rows_attended']:.3f}")
    if result["engine_load_balance"]:
        e = result["engine_load_balance"]
        print(f"engine PCP{e['n']} T={e['length']}: max/mean {e['load_balance_max_over_mean']}")
    return result


if __name__ == "__main__":
    main()
