"""Lower GLM-5.3's serving steps for an abstract 8 x H200 mesh and list their kernels and collectives.

    python -m experiments.check_step_lowering --out results/step_lowering            # full size, all layers
    python -m experiments.check_step_lowering --preset tiny --out /tmp/steps         # seconds (CI test)

Each step is the forward the model runner executes (`parallel.model.forward`: the unchanged model inside
one `jax.shard_map`), traced and lowered for the "cuda" platform on a machine without a GPU: the mesh is
a `jax.sharding.AbstractMesh` of 8 "NVIDIA H200" devices (`attention.gpu_aot.abstract_mesh`), weights,
KV pool and block tables are `jax.ShapeDtypeStruct`s carrying their shardings, nothing is allocated,
compiled or run. Under `attention.gpu_aot.gpu_lowering` the ops and forms are the GPU-shaped ones
(`attention.common.gpu_shaped`) and Pallas kernels lower through Triton, as on the GPU.

Steps (BRIEF §3's deployments, as far as `parallel/` builds them):
- `tp8_decode`: TP8 (heads and MLP widths split over 8 ranks, EP8 over the TP ranks for the routed
  experts, latent KV and indexer replicated; `parallel.tp`), one token per request. Weights in bfloat16: TP of
  block-quantised fp8 weights is built since (`parallel.tp`; at TP8 each rank's slice is whole 128-blocks,
  so the step would keep its two all-reduces per layer; on the tiny preset straddling blocks add an
  all-gather of activation maxima per row-split fp8 layer), but this step has not been switched to fp8.
- `tp8_prefill`: Part 1's prefill, one chunk of max_num_batched_tokens ending at the window on the TP8
  layout (the indexer replicated, as in vLLM, so every rank scores the whole chunk).
- `tp8_hisparse_decode`: Part 1's HiSparse decode on the TP8 layout: requests in mixed residency read
  through their hot buffers (`kvcache.views.HiSparseView`: the resolver, at impl="pallas" its kernel
  `hisparse_resolve`, and the row copy from the host pool), the host pool in pinned host memory shared
  by the TP ranks (its rows split over "tp", each copied row assembled by an all-reduce over them).
- `tp8_dcp8_decode`: TP8 with DCP8 reusing the TP ranks (`parallel.tp.mesh_sizes(8, 8)`): heads split
  over the 8 ranks, the latent KV round-robin over the same 8, each rank's queries gathered to every KV
  shard and the partial outputs merged back to their heads (Part 1's DCP ablation).
- `dcp8_ep8_decode`: the decode step of the same 8 ranks: KV split round-robin (DCP), queries
  replicated, the top-k merged across ranks and the partial attention outputs merged by LSE
  (`parallel.dcp`, ag_rs), the routed experts split over the ranks (one all-reduce per MoE layer).
- `pcp8_dcp8_ep8_prefill`: one prefill chunk on `make_mesh(cp=8)`: tokens split 2N-chunk (PCP), KV split
  round-robin over the same ranks (DCP), routed experts split over them with all-to-all dispatch (EP);
  weights fp8 (128 x 128 blocks, as the checkpoint) where `glm53.fp8` quantises them.
- `dp8_ep8_decode`, `dp8_ep8_prefill`: Part 2's DP ranks on `make_mesh(dp=8)` (`parallel.model.forward_dp`):
  each rank its own requests (16 decode rows, or one prefill chunk) on its own pool, attention local,
  the routed experts split over the 8 ranks with all-to-all dispatch; fp8 weights as above. The engine
  does not run this layout yet (its DP replicas are independent, each holding every expert).
Each at impl="auto" (what a GPU runs: the Pallas kernels since `PALLAS_VERIFIED_ON_GPU` was set after the
H200 run of 2026-12-04, but the HiSparse resolver's reference, measured faster there), impl="reference"
(the GPU-shaped references) and impl="pallas" (every kernel).

Reported per step (OUT/results.json, OUT/README.md): the custom calls of the lowered module (the Pallas
Triton kernels by name; other targets are sharding / host annotations), and the collectives from the
traced program (`parallel.comm.jaxpr_collectives`: kind, count, bytes per rank) beside the collective ops
counted in the lowered StableHLO. What this does not show: collectives XLA's SPMD partitioner would add
at compile time where an operand's sharding differs from what the shard_map expects (the abstract
arguments carry the runner's shardings, so none are expected), and anything about speed.

Exits 1 if a step fails to lower or lacks its deployment's expected collectives (TP: all-reduces;
PCP/DCP/EP: all-gathers, reduce-scatters or all-to-alls) or, where it runs the kernels (impl="pallas", or
"auto" once verified), its kernels; or where it runs the references, any kernel. Steps with fp8 weights
run the fp8 GEMM kernels (`attention.fp8_gemm`) at every attention impl once those are checked on a GPU
(`attention.common.NOT_YET_CHECKED_ON_GPU`): the fp8 modules keep their own impl, "auto".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention import common as attention_common
from attention import fp8_matmul, gpu_aot
from experiments.bench_model import run_metadata
from glm53 import fp8 as fp8_model
from glm53.config import get_preset
from glm53.model import attention_form
from glm53.weights import abstract_model
from kvcache.paged import PagedKVCache
from parallel import comm
from parallel import model as parallel_model
from parallel import tp as parallel_tp
from parallel.cp_cache import CpKVCache
from parallel.mesh import AXES
from parallel.pcp import PcpSplit

# StableHLO collective ops -> the kinds parallel.comm counts ("psum" is an all-reduce)
HLO_COLLECTIVES = {"all_reduce": "psum", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                   "all_to_all": "all_to_all", "collective_permute": "collective_permute"}
_HLO_OP = re.compile(r'"?stablehlo\.(' + "|".join(HLO_COLLECTIVES) + r')"?[ (]')


@dataclasses.dataclass(frozen=True)
class Step:
    """One step to lower: a deployment on the 8-GPU mesh and the batch shape it runs."""

    name: str
    mesh: dict  # make_mesh sizes {"dp", "tp", "cp"}
    tensor_parallel: bool
    expert_parallel: bool
    pcp: bool  # prefill tokens split over "cp" (PCP)
    dcp: bool  # KV split over "cp" (DCP)
    rows: int  # requests in the batch
    tokens: int  # tokens per request
    window: int  # attention window (positions)
    num_blocks: int  # pool blocks per KV rank
    fp8_weights: bool
    expected: tuple  # collective kinds the step must contain
    hisparse: bool = False  # HiSparse decode: rows in mixed residency, read through hot buffers
    dp: bool = False  # data-parallel ranks over "dp" sharing their experts (rows, pool: per rank)


def steps(cfg, *, decode_rows: int, window: int, prefill_tokens: int, block_size: int) -> list[Step]:
    pages = -(-window // block_size)
    return [
        # 2 requests at 128K fill ~15 GiB of fp8 KV per GPU under TP8 (BRIEF §2's budget)
        Step("tp8_decode", {"tp": 8}, True, True, False, False, decode_rows, 1, window, decode_rows * pages + 1,
             False, ("psum",)),
        # Part 1's prefill: one chunk of max_num_batched_tokens at the window, heads split, KV replicated
        Step("tp8_prefill", {"tp": 8}, True, True, False, False, 1, prefill_tokens, window, pages + 1,
             False, ("psum",)),
        # Part 1's HiSparse decode under TP8: 16 requests at 128K in mixed residency, each keeping 8 newest
        # pages and a hot buffer of 2 x top-k rows on the device, the rest in one host pool shared by the
        # TP ranks (pinned host memory, split by rows over "tp")
        Step("tp8_hisparse_decode", {"tp": 8}, True, True, False, False, 16, 1, window,
             16 * (8 + -(-2 * cfg.index_topk // block_size)) + 1, False, ("psum",), hisparse=True),
        # TP8 with DCP8 reusing the TP ranks (vLLM's DCP; Part 1's DCP ablation): heads split over the 8
        # ranks and the KV round-robin over the same 8, the queries gathered to every KV shard
        Step("tp8_dcp8_decode", {"tp": 1, "cp": 8}, True, True, False, True, 16, 1, window,
             -(-16 * pages // 8) + 1, False, ("all_gather", "psum")),
        # the decode step of the same ranks (PCP8 x DCP8 x EP8 serves decode too): KV split round-robin,
        # queries replicated; 16 requests at 128K hold 2/8 of 16 x 2048 pages per rank
        Step("dcp8_ep8_decode", {"cp": 8}, False, True, False, True, 16, 1, window, -(-16 * pages // 8) + 1,
             True, ("all_gather", "reduce_scatter", "psum")),
        # one chunk of max_num_batched_tokens ending at the window; each rank holds 1/8 of the KV
        Step("pcp8_dcp8_ep8_prefill", {"cp": 8}, False, True, True, True, 1, prefill_tokens, window,
             -(-pages // 8) + 1, True, ("all_gather", "all_to_all")),
        # Part 2's decode ranks: DP8 with EP8 (`parallel.model.forward_dp`), each rank 16 requests at the
        # window on its own pool, the routed experts split over the 8 ranks (all-to-all dispatch)
        Step("dp8_ep8_decode", {"dp": 8}, False, True, False, False, 16, 1, window, 16 * pages + 1, True,
             ("all_to_all",), dp=True),
        # Part 2's DP prefill ranks with EP8: one chunk per rank ending at the window
        Step("dp8_ep8_prefill", {"dp": 8}, False, True, False, False, 1, prefill_tokens, window, pages + 1, True,
             ("all_to_all",), dp=True),
    ]


def _sds(tree, specs, mesh):
    """Abstract arrays of `tree` carrying NamedShardings of `specs` on `mesh`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                        tree, specs, is_leaf=lambda x: isinstance(x, P))


def _abstract_hisparse_view(cfg, step: Step, block_size: int, pages: int):
    """HiSparse's decode view of `step.rows` requests (kvcache.views.HiSparseView, abstract): every page in
    a host pool of rows x pages blocks shared by the TP ranks, a hot buffer of 2 x top-k rows per request
    (kvcache.policies.hisparse.hot_buffer_rows without MTP), hot state per IndexShare group."""
    from kvcache.policies.hisparse import hot_buffer_rows
    from kvcache.views import HiSparseView

    r, groups = step.rows, len(cfg.full_indexer_layers)
    hot = hot_buffer_rows(None, 0, cfg.index_topk)
    table = np.full((r, pages), -1, np.int32)
    host = jax.eval_shape(lambda: PagedKVCache.create(cfg, r * pages, block_size, table, include_mtp=False)).mla

    def make():
        return HiSparseView.create([jnp.zeros(a.shape, a.dtype) for a in host], jnp.zeros((r, pages), jnp.int32),
                                   jnp.arange(r, dtype=jnp.int32), jnp.full((r, groups, hot), -1, jnp.int32),
                                   jnp.zeros((r, groups, hot), jnp.int32), jnp.zeros((r, hot), jnp.int32), 1,
                                   min(cfg.index_topk, step.window), host_axis="tp")

    return jax.eval_shape(make)


def abstract_step(cfg, step: Step, mesh, *, block_size: int, impl: str):
    """-> (fn, abstract args) of the step as the model runner would run it (glm53.engine.runner)."""
    paths = fp8_model.eligible_modules(abstract_model(cfg, "bfloat16")) if step.fp8_weights else ()
    graphdef, state = nnx.split(abstract_model(cfg, "bfloat16", fp8_modules=paths))
    n_cp = step.mesh.get("cp", 1)
    if step.dp:
        return _abstract_dp_step(cfg, step, mesh, graphdef, state, block_size=block_size, impl=impl)
    if step.tensor_parallel:
        tp = 8
        state = jax.eval_shape(lambda s: parallel_tp.prepare_state(s, cfg, tp, step.expert_parallel), state)
        specs = parallel_tp.state_specs(state, step.expert_parallel)
    else:
        specs = parallel_model.state_specs(state, "cp", step.expert_parallel)
    state = _sds(state, specs, mesh)

    kv_ranks = n_cp if step.dcp else 1
    pages = -(-step.window // block_size)
    table = np.full((step.rows, pages), -1, np.int32)
    local = jax.eval_shape(lambda: PagedKVCache.create(cfg, step.num_blocks * kv_ranks, block_size, table,
                                                       index_block_table=table, include_mtp=False))
    if step.hisparse:
        local = dataclasses.replace(local, hisparse=_abstract_hisparse_view(cfg, step, block_size, pages))
    cache = CpKVCache(local, "cp", n_cp, tokens_split=step.pcp, dcp=step.dcp, heads_split=step.tensor_parallel,
                      gather_queries=step.tensor_parallel)
    cache = _sds(cache, parallel_model.cache_specs(cache), mesh)
    if step.hisparse:  # the host pool lives in pinned host memory, its rows split over the TP ranks
        view = cache.local.hisparse
        host = NamedSharding(mesh, P(view.host_axis), memory_kind="pinned_host")
        view = dataclasses.replace(view, host_mla=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host)
                                                        for a in view.host_mla))
        cache = dataclasses.replace(cache, local=dataclasses.replace(cache.local, hisparse=view))
    width = PcpSplit(step.tokens, n_cp).tokens_per_rank * n_cp if step.pcp else step.tokens
    tok_spec = P(None, "cp") if step.pcp else P()
    tokens = jax.ShapeDtypeStruct((step.rows, width), jnp.int32, sharding=NamedSharding(mesh, tok_spec))
    form = attention_form("auto", step.window, cfg.index_topk, step.tokens)

    def fn(state, tokens, positions, cache):
        return parallel_model.forward(state, tokens, positions, cache, None, graphdef=graphdef, mesh=mesh,
                                      window=step.window, form=form, impl=impl,
                                      expert_parallel=step.expert_parallel, tensor_parallel=step.tensor_parallel)

    return fn, (state, tokens, tokens, cache), form


def _abstract_dp_step(cfg, step: Step, mesh, graphdef, state, *, block_size: int, impl: str):
    """`abstract_step` for data-parallel ranks sharing their experts: every rank's rows, tokens and pool
    stacked rank-major and split over "dp" (`parallel.model.dp_cache_specs`)."""
    n = step.mesh["dp"]
    state = _sds(state, parallel_model.state_specs(state, "dp", True), mesh)
    table = np.full((n * step.rows, -(-step.window // block_size)), -1, np.int32)
    cache = jax.eval_shape(lambda: PagedKVCache.create(cfg, n * step.num_blocks, block_size, table,
                                                       index_block_table=table, include_mtp=False))
    cache = _sds(cache, parallel_model.dp_cache_specs(cache), mesh)
    tokens = jax.ShapeDtypeStruct((n * step.rows, step.tokens), jnp.int32, sharding=NamedSharding(mesh, P("dp")))
    form = attention_form("auto", step.window, cfg.index_topk, step.tokens)

    def fn(state, tokens, positions, cache):
        return parallel_model.forward_dp(state, tokens, positions, cache, graphdef=graphdef, mesh=mesh,
                                         window=step.window, form=form, impl=impl)

    return fn, (state, tokens, tokens, cache), form


def lower_step(cfg, step: Step, *, block_size: int, impl: str) -> dict:
    mesh = gpu_aot.abstract_mesh(tuple(step.mesh.get(a, 1) for a in AXES), AXES)
    rec = {"step": step.name, "impl": impl, "mesh": {a: step.mesh.get(a, 1) for a in AXES},
           "rows": step.rows, "tokens_per_row": step.tokens, "window": step.window,
           "pool_blocks_per_kv_rank": step.num_blocks, "block_size": block_size,
           "weights": "fp8 blocks (128 x 128) where quantised, else bfloat16" if step.fp8_weights else "bfloat16",
           "tensor_parallel": step.tensor_parallel, "expert_parallel": step.expert_parallel,
           "pcp": step.pcp, "dcp": step.dcp, "dp": step.dp, "layers": cfg.num_hidden_layers}
    try:
        with gpu_aot.gpu_lowering(mesh=mesh):
            fn, args, form = abstract_step(cfg, step, mesh, block_size=block_size, impl=impl)
            rec["form"] = form
            t0 = time.perf_counter()
            traced = jax.jit(fn).trace(*args)
            rec["trace_s"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            lowered = traced.lower(lowering_platforms=("cuda",))
            rec["lower_s"] = round(time.perf_counter() - t0, 1)
            found = comm.jaxpr_collectives(traced.jaxpr, axis_sizes=dict(zip(AXES, mesh.axis_sizes)))
            calls = gpu_aot.custom_calls(lowered)
            text = lowered.as_text()
            hlo_ops = Counter(HLO_COLLECTIVES[m.group(1)] for m in _HLO_OP.finditer(text))
            # the MoE's GPU form (glm53.layers.ragged_experts); "#chlo.ragged_dot<" is its attribute, not an op
            rec["grouped_gemms"] = len(re.findall(r"(?<!#)chlo\.ragged_dot\b(?!<)", text))
    except Exception as e:  # noqa: BLE001 - every step is reported
        rec.update(lowered=False, error=f"{type(e).__name__}: {str(e)[:3000]}")
        return rec
    rec["lowered"] = True
    rec["kernels"] = dict(Counter(name for target, name in calls if target == gpu_aot.TRITON_CALL))
    rec["other_custom_calls"] = dict(Counter(target for target, _ in calls if target != gpu_aot.TRITON_CALL))
    colls = {}
    for c in found:  # every step runs the unconditional ones; a lax.cond branch's only when taken
        e = colls.setdefault(c.kind, {"count": 0, "ranks": set(), "operand_bytes_per_rank": 0, "sent_bytes_per_rank": 0.0,
                                      "sizes": Counter(), "conditional_count": 0, "conditional_sent_bytes_per_rank": 0.0})
        e["ranks"].add(c.ranks)
        if c.conditional:
            e["conditional_count"] += 1
            e["conditional_sent_bytes_per_rank"] += c.sent_bytes
            continue
        e["count"] += 1
        e["operand_bytes_per_rank"] += c.operand_bytes
        e["sent_bytes_per_rank"] += c.sent_bytes
        e["sizes"][c.operand_bytes] += 1
    rec["collectives"] = {k: {"count": e["count"], "ranks": sorted(e["ranks"]),
                              "operand_bytes_per_rank": e["operand_bytes_per_rank"],
                              "sent_bytes_per_rank": round(e["sent_bytes_per_rank"]),
                              "operand_sizes_bytes": {str(s): n for s, n in sorted(e["sizes"].items())},
                              "conditional_count": e["conditional_count"],
                              "conditional_sent_bytes_per_rank": round(e["conditional_sent_bytes_per_rank"])}
                          for k, e in sorted(colls.items())}
    rec["collective_ops_in_stablehlo"] = dict(sorted(hlo_ops.items()))
    rec["sent_bytes_per_rank_total"] = round(sum(c.sent_bytes for c in found if not c.conditional))
    return rec


def check(rec: dict, step: Step) -> list[str]:
    """Why a step's record fails the check (empty: it passes)."""
    if not rec["lowered"]:
        return [f"{rec['step']} impl={rec['impl']}: lowering failed"]
    out = []
    for kind in step.expected:
        if not rec["collectives"].get(kind, {}).get("count"):
            out.append(f"{rec['step']} impl={rec['impl']}: no {kind} (expected for this deployment)")
    # the step's kernels, each where `resolve_impl` (as under gpu_lowering) runs it, and no other; the PCP
    # indexer is a causal tiled jnp loop with no kernel yet (attention.indexer.topk_causal_blocked)
    ops = ({"sparse_mqa"} if rec.get("form") == "mqa" else set()) | (set() if step.pcp else {"index_scores"}) | (
        {"hisparse_resolve"} if step.hisparse else set())
    # the fp8 GEMM kernels follow the fp8 modules' own impl ("auto", whatever the step's attention impl)
    fp8_ops = {"fp8_gemm", "fp8_grouped_gemm"} if step.fp8_weights else set()
    with gpu_aot.gpu_lowering():
        want = {k for k in ops if attention_common.resolve_impl(rec["impl"], k) == "pallas"}
        want |= {k for k in fp8_ops if fp8_matmul.resolve_impl("auto") == "pallas"}
    missing, extra = want - set(rec["kernels"]), set(rec["kernels"]) - want
    if missing:
        out.append(f"{rec['step']} impl={rec['impl']}: kernels {sorted(missing)} not in the lowered module")
    if extra:
        out.append(f"{rec['step']} impl={rec['impl']}: Pallas kernels {sorted(extra)} where the references run")
    return out


def _gb(n) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def markdown(results: dict) -> str:
    lines = [f"# Step lowering for an abstract 8 x H200 mesh ({results['date']}, {results['git_commit'][:12]})", "",
             f"Preset `{results['preset']}`, {results['layers']} decoder layers; machine: "
             f"{results['machine']['cpu']} ({results['machine']['cores']} cores), jax {results['versions']['jax']}. "
             f"Command: `{results['command']}`.", "",
             "Collectives: from the traced program (`parallel.comm`), bytes one rank sends per step (sum over "
             "layers); \"if taken\": in a branch a step may skip (EP's second dispatch round, run only when some "
             "rank overflows the first; HiSparse's row copy, the largest of its sizes); `hlo` = collective ops "
             "in the lowered StableHLO (every branch). Kernels: Pallas Triton custom calls. "
             "Grouped GEMMs: `chlo.ragged_dot` ops (the MoE's GPU form with float expert weights; fp8 experts "
             "keep the expert loop until `fp8_grouped_gemm` is checked on a GPU, then run it, listed with the "
             "kernels).", "",
             "| step | impl | form | lowered | trace / lower s | kernels | grouped GEMMs | collectives (count, sent per rank) | hlo ops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["steps"]:
        if not r["lowered"]:
            lines.append(f"| {r['step']} | {r['impl']} | - | **no** | - | - | - | {r['error'][:120]} | - |")
            continue
        kern = ", ".join(f"{k} x{n}" for k, n in r["kernels"].items()) or "none"
        coll = "; ".join(f"{k} x{e['count']} {_gb(e['sent_bytes_per_rank'])}" + (
            f" (+x{e['conditional_count']} {_gb(e['conditional_sent_bytes_per_rank'])} if taken)"
            if e.get("conditional_count") else "") for k, e in r["collectives"].items())
        hlo = ", ".join(f"{k} {n}" for k, n in r["collective_ops_in_stablehlo"].items())
        lines.append(f"| {r['step']} | {r['impl']} | {r['form']} | yes | {r['trace_s']} / {r['lower_s']} | {kern} | "
                     f"{r['grouped_gemms']} | "
                     f"{coll} | {hlo} |")
    lines += ["", "Shapes: " + "; ".join(
        f"{r['step']}: {r['rows']} rows x {r['tokens_per_row']} tokens, window {r['window']}, mesh "
        f"{r['mesh']}, weights {r['weights']}" for r in results["steps"] if r["impl"] == "auto"), ""]
    if results["failures"]:
        lines += ["Failures:", ""] + [f"- {f}" for f in results["failures"]] + [""]
    lines += [results["notes"], ""]
    return "\n".join(lines)


NOTES = ("Lowered, not compiled or run: this proves the sharded steps trace and lower for CUDA at these "
         "shapes with these kernels and collectives, not their values or speed on an H200. impl=auto runs "
         "the Pallas kernels (PALLAS_VERIFIED_ON_GPU, set after the kernel tests passed on an H200, "
         "results/device_check_2026-12-04b) except the HiSparse resolver's, measured slower there than its "
         "reference; impl=reference the GPU-shaped references; impl=pallas every kernel. Collective bytes are per rank per step, summed over layers; an all-reduce (psum) of B bytes "
         "counts 2 (n-1)/n B sent (ring), as parallel.comm / glm53.perfmodel.traffic account it. The traced "
         "count is per operand: a collective of several operands is one StableHLO op (hence fewer hlo ops).")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="glm-5.3")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    ap.add_argument("--decode-rows", type=int, default=2)
    ap.add_argument("--window", type=int, default=131072)
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--impls", default="auto,reference,pallas")
    ap.add_argument("--steps", default=None, help="comma-separated step names (default: all)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = get_preset(args.preset)
    if args.layers is not None:
        cfg = cfg.first_layers(args.layers)
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)  # the main model's step (MTP not in the runner)
    todo = steps(cfg, decode_rows=args.decode_rows, window=args.window, prefill_tokens=args.prefill_tokens,
                 block_size=args.block_size)
    if args.steps:
        names = args.steps.split(",")
        todo = [s for s in todo if s.name in names]
    records, failures = [], []
    for step in todo:
        for impl in args.impls.split(","):
            t0 = time.perf_counter()
            rec = lower_step(cfg, step, block_size=args.block_size, impl=impl)
            failures += check(rec, step)
            records.append(rec)
            print(f"{step.name:24s} impl={impl:9s} {'ok' if rec['lowered'] else 'FAILED'} "
                  f"({time.perf_counter() - t0:.0f} s) kernels={rec.get('kernels')} "
                  f"collectives={ {k: e['count'] for k, e in rec.get('collectives', {}).items()} }", flush=True)
            if not rec["lowered"]:
                print(rec["error"][:2000])
    results = {**run_metadata("check_step_lowering"), "preset": args.preset, "layers": cfg.num_hidden_layers,
               "command": "python -m experiments.check_step_lowering " + " ".join(argv if argv is not None else sys.argv[1:]),
               "target": {"device_kind": gpu_aot.H200, "devices": 8, "platform": "cuda"},
               "steps": records, "failures": failures, "notes": NOTES}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(markdown(results))
    print(f"{len(records)} lowerings, {len(failures)} failures; wrote {out / 'results.json'}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
