"""This codebase's GPU path on one H200, timed row by row beside the performance model's price (issue 45).

    python -m experiments.bench_gpu --out DIR [--slice] [--dry-run] [--deadline-s S] [--resume]
    python -m experiments.bench_gpu --report DIR                 # DIR/README.md from DIR/results.json
    python -m experiments.bench_gpu --plan [--slice] [--dry-run] # the rows and their estimated device time

Each row is timed alone: warm-up calls (compile and run) until one compiles nothing, then the median of
`--repeats` (>= 20) calls, each ended by `block_until_ready`. Activations are bfloat16, weights fp8 blocks, KV fp8 (fp8_ds_mla rows,
fp8 indexer keys), all generated at random directly in their stored format on the device. Rows, in
priority order (`plan_rows`; the op names and shape keys are glm53.perfmodel.measured's):

1. the slice's decode step at batch 64 over 64K cached tokens (with --slice);
2. sparse MLA decode (the Pallas kernel), batch 32 and 64, 64 heads and TP8's 8, top-k 2,048, 64K context;
   at batch 64 x 64 heads every tile candidate of `attention.sparse_mla.CANDIDATES`;
3. the indexer's decode scores (Pallas) and top-k, batch 64 over 64K fp8 keys, every candidate;
4. the routed experts of an MoE layer with fp8 block-scaled weights (glm53.layers.grouped_experts): EP8's
   32 local experts at 512 and 4,096 tokens, all 256 at 4,096;
5. each fp8 linear layer of an attention layer and of the dense MLP at 64 and 8,192 tokens;
6. the rest: sparse MLA decode at batch 1, 8, 128 (64K) and 8 over 1M; sparse MLA prefill chunks of 2K and
   8K over 64K cached; the indexer over an 8K chunk with 8K and 64K keys; the HiSparse resolver at
   GLM-5.3's sizes (every candidate of the kernel, and the reference `impl="auto"` runs); the slice's other
   rows (decode at batch 8, 32, 64 over 16K, 64K, 128K; one 8,192-token prefill chunk over 0 and 64K).

The slice: the full-size preset cut to its first four layers (glm53.perfmodel.measured.slice_config; three
dense layers with their own indexers, one MoE layer on an IndexShare layer; embeddings and LM head kept),
random fp8 weights, the real `ModelRunner` with impl="auto", its paged fp8 cache filled with random rows
for the cached context (no prefill runs to reach it), one `runner.execute(plan)` per step. Each slice row
is priced by `step_cost` of the same StepPlan on the sliced model. The pool holds the largest row that
fits the device (`slice_memory`: weights, pool and a workspace bound from byte counts); a row that would
not fit is recorded as skipped.

DIR/results.json is rewritten after every row (so it always parses): {"date", "device", "git_revision",
"complete", "kernels": [rows], "slice": {"layers", "rows"}, ...}; "complete" turns true only once every
planned row is in (timed, failed or skipped). `--deadline-s`: a row whose estimated device time
(`estimate_s`) would end past the deadline is not started, and the run stops there ("complete": false;
`--resume` runs the missing rows, and those that failed, later into the same file). Kernel rows: "op",
"shape", "block_sizes", "default" (the default tile sizes or a candidate), "impl", "measured_s",
"priced_s" (glm53.perfmodel.HARDWARE["h200"]), "ratio" = measured / priced, "tflops", "gbps",
"peak_tflops", "peak_fraction" (glm53.perfmodel.measured.rates); slice rows: "kind", "batch", "context",
"chunk", "measured_s", "priced_s", "ratio". A row that fails records its "error" and the run goes on.

--dry-run runs every row (and the slice) at tiny shapes on the CPU (the tiny preset, Pallas in interpret
mode, 3 timed calls; a minute or two, mostly compiles): the same code path, so the script cannot rot
(tests/experiments/test_bench_gpu.py). Its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

K = 1024
REPEATS = 20
DRY_REPEATS = 3
BLOCK_SIZE = 64  # tokens per page, as the GLM-5.3 configs run (configs/paper)
DRY_BLOCK_SIZE = 32
# dry run: each size of the full run -> a tiny one of the tiny preset (top-k 16, 8 experts, width 64)
DRY = {"batch": {1: 1, 8: 2, 32: 3, 64: 4, 128: 5},
       "context": {0: 0, 8 * K: 32, 16 * K: 32, 64 * K: 64, 128 * K: 128, 1024 * K: 256},
       "chunk": {1: 1, 2 * K: 16, 8 * K: 32}, "tokens": {64: 4, 512: 16, 4096: 32, 8192: 48},
       # the slice's steps all within the smallest attention window (64), so a dry run compiles three
       # programs (two decode row buckets, one prefill width) rather than one per row
       "slice_context": {0: 0, 16 * K: 40, 64 * K: 48, 128 * K: 56}, "slice_chunk": {1: 1, 8 * K: 16}}
SLICE_DECODE = ((8, 16 * K), (8, 64 * K), (8, 128 * K), (32, 16 * K), (32, 64 * K), (32, 128 * K),
                (64, 16 * K), (64, 64 * K), (64, 128 * K))
SLICE_PREFILL = ((8 * K, 0), (8 * K, 64 * K))  # (chunk, cached context)
# The fp8 linear layers of a decoder layer, by module name (`linear_dims`: their in and out widths).
LINEARS = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "indexer.wq_b", "indexer.wk", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# The fp8 GEMM rows are timed in both forms: the Pallas kernels (attention.fp8_gemm) and "auto", which
# stays XLA's dequantised dot on a GPU until the kernels are checked there (NOT_YET_CHECKED_ON_GPU).
FP8_IMPLS = ("pallas", "auto")


def linear_dims(cfg, name: str) -> tuple[int, int]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    return {"q_a_proj": (d, cfg.q_lora_rank), "kv_a_proj_with_mqa": (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "q_b_proj": (cfg.q_lora_rank, h * cfg.qk_head_dim), "o_proj": (h * cfg.v_head_dim, d),
            "indexer.wq_b": (cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim),
            "indexer.wk": (d, cfg.index_head_dim), "mlp.gate_proj": (d, cfg.intermediate_size),
            "mlp.up_proj": (d, cfg.intermediate_size), "mlp.down_proj": (cfg.intermediate_size, d)}[name]


@dataclasses.dataclass(frozen=True)
class Row:
    """One planned measurement. op: a glm53.perfmodel.measured op or "slice"; shape: its contract keys
    (slice: kind, batch, context, chunk); block_sizes: the kernel's BlockSizes (None: not a Pallas
    kernel); default: True for the kernel's default tile sizes, False for another candidate (None: no
    tile sizes); impl: "pallas" (the kernel; for fp8 GEMMs and the MoE, attention.fp8_gemm's kernels
    at their default sizes), "auto" (fp8 GEMMs, MoE: `fp8_matmul`'s impl="auto", which is what the model
    runs: the kernels once checked on a GPU, XLA's dequantised dot before and elsewhere), "reference" or
    "engine" (the slice)."""

    priority: int
    op: str
    shape: dict
    block_sizes: object = None
    default: bool | None = None
    impl: str = "pallas"

    @property
    def sizes(self) -> dict:
        return dataclasses.asdict(self.block_sizes) if self.block_sizes is not None else {}

    def key(self) -> str:
        """Identity of the row in a results file (`--resume` skips rows already there)."""
        return json.dumps([self.op, self.shape, self.sizes, self.impl], sort_keys=True)


def _sizer(dry_run: bool):
    def size(kind: str, v: int) -> int:
        return DRY[kind][v] if dry_run else v
    return size


def plan_rows(cfg, *, dry_run: bool = False, with_slice: bool = False) -> list[Row]:
    """Every row of a run, in priority order (module docstring); sizes mapped to tiny ones under dry_run."""
    from attention import hisparse, indexer, sparse_mla

    n = _sizer(dry_run)
    h, h8, k, hi = cfg.num_attention_heads, max(1, cfg.num_attention_heads // 8), cfg.index_topk, cfg.index_n_heads
    rows: list[Row] = []

    def sparse(priority, batch, heads, context, candidates=False):
        shape = dict(batch=n("batch", batch), heads=heads, context=n("context", context), topk=k,
                     kv_format="fp8_ds_mla")
        if candidates:
            rows.extend(Row(priority, "sparse_mla_decode", shape, c, i == 0) for i, c in enumerate(sparse_mla.CANDIDATES))
        else:
            rows.append(Row(priority, "sparse_mla_decode", shape, sparse_mla.BlockSizes(), True))

    def slice_row(priority, kind, batch, context, chunk):
        rows.append(Row(priority, "slice", dict(kind=kind, batch=n("batch", batch), context=n("slice_context", context),
                                                chunk=n("slice_chunk", chunk)), impl="engine"))

    if with_slice:
        slice_row(1, "decode", 64, 64 * K, 1)
    for batch in (32, 64):
        for heads in (h, h8):
            sparse(2, batch, heads, 64 * K, candidates=(batch == 64 and heads == h))
    shape = dict(batch=n("batch", 64), keys=n("context", 64 * K), index_heads=hi, topk=k, key_format="fp8")
    rows.extend(Row(3, "indexer_decode", shape, c, i == 0) for i, c in enumerate(indexer.CANDIDATES))
    e = cfg.n_routed_experts
    for tokens, local in ((512, e // 8), (4096, e // 8), (4096, e)):
        for impl in FP8_IMPLS:
            rows.append(Row(4, "moe", dict(tokens=n("tokens", tokens), experts_local=max(1, local),
                                           topk=cfg.num_experts_per_tok), impl=impl))
    for tokens in (64, 8192):
        for name in LINEARS:
            din, dout = linear_dims(cfg, name)
            for impl in FP8_IMPLS:
                rows.append(Row(5, "linear", {"tokens": n("tokens", tokens), "in": din, "out": dout,
                                              "name": name}, impl=impl))
    for batch, context in ((1, 64 * K), (8, 64 * K), (128, 64 * K), (8, 1024 * K)):
        sparse(6, batch, h, context)
    for chunk in (2 * K, 8 * K):
        rows.append(Row(6, "sparse_mla_prefill", dict(chunk=n("chunk", chunk), heads=h, context=n("context", 64 * K),
                                                      topk=k), sparse_mla.BlockSizes(), True))
    for keys in (8 * K, 64 * K):
        rows.append(Row(6, "indexer_prefill", dict(chunk=n("chunk", 8 * K), keys=n("context", keys), index_heads=hi,
                                                   topk=k, key_format="fp8"), indexer.BlockSizes(), True))
    shape = dict(rows=n("batch", 64), topk=k, hot_rows=2 * k)
    rows.extend(Row(6, "hisparse_resolve", shape, c, i == 0) for i, c in enumerate(hisparse.CANDIDATES))
    rows.append(Row(6, "hisparse_resolve", shape, impl="reference"))
    if with_slice:
        for batch, context in SLICE_DECODE:
            if (batch, context) != (64, 64 * K):
                slice_row(6, "decode", batch, context, 1)
        for chunk, context in SLICE_PREFILL:
            slice_row(6, "prefill", 1, context, chunk)
    return rows


# ---------------------------------------------------------------------------------------- estimates
# Pessimistic fractions of peak for the device-time estimate of a row, about half what the 2026-12-04
# H200 run measured where one exists (sparse MLA ~1% of the bf16 peak, the indexer ~0.8% of the fp8 one,
# results/device_check_2026-12-04b); the fp8 GEMMs and grouped experts (attention.fp8_gemm, not yet run
# on a GPU) are guesses. Compile times are guesses too: each row records its first call (`first_call_s`), so
# the next run can replace them.
ESTIMATE_FRACTION = {"sparse_mla_decode": 0.005, "sparse_mla_prefill": 0.005, "indexer_decode": 0.003,
                     "indexer_prefill": 0.003, "moe": 0.02, "linear": 0.05}
ESTIMATE_COMPILE_S = {"slice": 40.0, "moe": 8.0, "linear": 2.0}
KERNEL_COMPILE_S = 4.0
RESOLVER_CALL_S = 10e-3  # 5.5 ms measured at batch 4 (one program per request): a batch fills more SMs
SLICE_SLOWDOWN = 20.0  # slice steps: this many times the price (the kernels measured 6-10x, the fp8 GEMMs dequantise)
CALL_OVERHEAD_S = 50e-6


def estimate_s(row: Row, cfg, repeats: int, hw=None) -> float:
    """Pessimistic device seconds of one row: compile, data generation (at 500 GB/s) and 1 + repeats calls
    at a small fraction of peak (ESTIMATE_FRACTION) or, for the slice, SLICE_SLOWDOWN times its price."""
    from glm53.perfmodel import HARDWARE
    from glm53.perfmodel import measured as M

    hw = hw or HARDWARE["h200"]
    compile_s = ESTIMATE_COMPILE_S.get(row.op, KERNEL_COMPILE_S)
    if row.op == "slice":
        s = row.shape
        call = SLICE_SLOWDOWN * M.slice_cost(M.slice_config(cfg), hw, M.slice_plan(s["kind"], s["batch"], s["context"],
                                                                                    s["chunk"]))
        return compile_s + (1 + repeats) * call
    data = input_bytes(row, cfg) / 500e9
    if row.op == "hisparse_resolve":
        return compile_s + data + (1 + repeats) * RESOLVER_CALL_S
    c = M.kernel_cost(cfg, hw, row.op, row.shape)
    f = ESTIMATE_FRACTION[row.op]
    peak = hw.peak_flops(M.PEAK_DTYPE[row.op])
    call = max(c.flops / (peak * f), c.hbm_bytes / (hw.hbm_bandwidth * f)) + CALL_OVERHEAD_S
    return compile_s + data + (1 + repeats) * call


def input_bytes(row: Row, cfg) -> int:
    """Device bytes a kernel row's inputs take (its pool or weights dominate)."""
    s = row.shape
    mla_row, key_row = 4 * _mla_words(cfg), 4 * _key_words(cfg)
    if row.op == "sparse_mla_decode":
        return s["batch"] * (s["context"] + 1) * mla_row
    if row.op == "sparse_mla_prefill":
        return (s["context"] + s["chunk"]) * mla_row + s["chunk"] * s["topk"] * 4
    if row.op == "indexer_decode":
        return s["batch"] * s["keys"] * key_row
    if row.op == "indexer_prefill":
        return s["keys"] * key_row
    if row.op == "moe":
        return s["experts_local"] * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    if row.op == "linear":
        return s["in"] * s["out"] + s["tokens"] * (s["in"] + s["out"]) * 2
    return 0


def _mla_words(cfg) -> int:
    from attention.formats import MLARowFormat

    return MLARowFormat("fp8_ds_mla", cfg.kv_lora_rank, cfg.qk_rope_head_dim).width


def _key_words(cfg) -> int:
    from attention.formats import IndexKeyFormat

    return IndexKeyFormat("fp8", cfg.index_head_dim).width


# ------------------------------------------------------------------------- random data in stored formats
def random_mla_rows(key, n: int, cfg):
    """[n, words] uint32: fp8_ds_mla rows of random finite values. Latent bytes are random e4m3 codes with
    the lowest exponent bit cleared (never the NaN code S.1111.111), the four scales 1/64, the rope halves
    random bf16 codes with the top exponent bit cleared (|value| < 2)."""
    r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    lat = jax.random.bits(key, (n, r // 4), jnp.uint32) & jnp.uint32(0xF7F7F7F7)
    scale = jnp.full((n, -(-r // 128)), np.float32(1 / 64).view(np.uint32), jnp.uint32)
    rope = jax.random.bits(jax.random.fold_in(key, 1), (n, p // 2), jnp.uint32) & jnp.uint32(0xBFFFBFFF)
    return jnp.concatenate([lat, scale, rope], axis=1)


def random_index_keys(key, n: int, cfg):
    """[n, words] uint32: fp8 indexer keys (random e4m3 codes, no NaN) with the scale 1/64."""
    words = jax.random.bits(key, (n, cfg.index_head_dim // 4), jnp.uint32) & jnp.uint32(0xF7F7F7F7)
    return jnp.concatenate([words, jnp.full((n, 1), np.float32(1 / 64).view(np.uint32), jnp.uint32)], axis=1)


def random_fp8(key, shape):
    """float8_e4m3fn values of random codes with the top exponent bit cleared: |value| <= 1.875, no NaN."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8) & jnp.uint8(0xBF), jnp.float8_e4m3fn)


def _normal(key, shape, dtype, std=1.0):
    return (std * jax.random.normal(key, shape)).astype(dtype)


def random_model(cfg, dtype: str = "bfloat16", seed: int = 0):
    """A GLM53 of `cfg` holding fp8 block weights where an fp8 checkpoint has them (the rest `dtype`), every
    array generated on the device in its stored format: fp8 codes (`random_fp8`) with block scales 0.02,
    matrices ~ N(0, 0.02^2), norm weights 1, biases 0. No float copy of the fp8 weights ever exists."""
    from flax import nnx

    from experiments.memory_plan import abstract_fp8_model

    graphdef, state = nnx.split(abstract_fp8_model(cfg, dtype))
    paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    key = jax.random.key(seed)
    out = []
    for i, (path, sds) in enumerate(paths):
        name, k = jax.tree_util.keystr(path), jax.random.fold_in(key, i)
        shape, dt = tuple(sds.shape), jnp.dtype(sds.dtype)
        if dt == jnp.float8_e4m3fn:
            out.append(jax.jit(random_fp8, static_argnums=1)(k, shape))
        elif "scale_inv" in name:
            out.append(jnp.full(shape, 0.02, dt))
        elif "bias" in name:
            out.append(jnp.zeros(shape, dt))
        elif len(shape) == 1:
            out.append(jnp.ones(shape, dt))
        else:
            out.append(jax.jit(_normal, static_argnums=(1, 2, 3))(k, shape, dt, 0.02))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out))


def _jit_static(*static):
    return functools.partial(jax.jit, static_argnums=static)


@_jit_static(1, 2, 3, 4, 5, 6, 7)
def _sparse_inputs(key, cfg, batch: int, queries: int, heads: int, context: int, topk: int, block_size: int):
    """Inputs of the sparse MLA kernel, made on the device in one program: `batch` requests on shuffled
    pages of one pool of random fp8_ds_mla rows, queries at positions context .. context + queries - 1, each
    over min(topk, position + 1) random positions (distinct for a decode query; a prefill chunk's queries
    draw theirs independently) as slots -> (q_lat, q_pe bf16, rows, slots)."""
    from attention.common import slot_mapping

    ks = jax.random.split(key, 6)
    pages = -(-(context + queries) // block_size)
    table = jax.random.permutation(ks[0], batch * pages).reshape(batch, pages).astype(jnp.int32)
    rows = random_mla_rows(ks[1], batch * pages * block_size, cfg)
    if queries == 1:  # n distinct positions of [0, context]: a sorted draw from [0, context + 1 - n] plus 0..n-1
        n = min(topk, context + 1)
        draw = jnp.sort(jax.random.randint(ks[2], (batch, n), 0, context + 2 - n, jnp.int32), axis=-1)
        pos = jnp.full((batch, 1, topk), -1, jnp.int32).at[:, 0, :n].set(draw + jnp.arange(n, dtype=jnp.int32))
    else:
        p = context + jnp.arange(queries, dtype=jnp.int32)
        pos = jax.random.randint(ks[2], (batch, queries, topk), 0, p[None, :, None] + 1, jnp.int32)
        pos = jnp.where(jnp.arange(topk)[None, None, :] <= p[None, :, None], pos, -1)
    slots = slot_mapping(table, pos, block_size)
    q_lat = _normal(ks[3], (batch, queries, heads, cfg.kv_lora_rank), jnp.bfloat16)
    q_pe = _normal(ks[4], (batch, queries, heads, cfg.qk_rope_head_dim), jnp.bfloat16)
    return q_lat, q_pe, rows, slots


@_jit_static(1, 2, 3, 4, 5, 6)
def _indexer_inputs(key, cfg, batch: int, queries: int, heads: int, keys: int, block_size: int):
    """Inputs of the indexer op: `batch` requests with `keys` random fp8 keys each on shuffled pages,
    queries at positions keys - queries .. keys - 1 -> (q, w float32, key rows, page table, positions)."""
    ks = jax.random.split(key, 4)
    pages = -(-keys // block_size)
    table = jax.random.permutation(ks[0], batch * pages).reshape(batch, pages).astype(jnp.int32)
    rows = random_index_keys(ks[1], batch * pages * block_size, cfg)
    q = _normal(ks[2], (batch, queries, heads, cfg.index_head_dim), jnp.float32)
    w = _normal(ks[3], (batch, queries, heads), jnp.float32)
    q_pos = jnp.broadcast_to(keys - queries + jnp.arange(queries, dtype=jnp.int32), (batch, queries))
    return q, w, rows, table, q_pos


@_jit_static(1, 2, 3, 6)
def _moe_inputs(key, cfg, tokens: int, experts: int, tok, idx, weight: float):
    """(x [A, D] bf16: the tokens of the rank's A assignments, idx [A, 1], w [A, 1], then gate_up and down
    as fp8 blocks with scales 0.02) for `experts` local experts."""
    ks = jax.random.split(key, 3)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    x = _normal(ks[0], (tokens, d), jnp.bfloat16)[tok]
    gq, dq = random_fp8(ks[1], (experts, d, 2 * f)), random_fp8(ks[2], (experts, f, d))
    gs = jnp.full((experts, -(-d // 128), 2 * -(-f // 128)), 0.02, jnp.float32)
    ds = jnp.full((experts, -(-f // 128), -(-d // 128)), 0.02, jnp.float32)
    return x, idx, jnp.full(idx.shape, weight, jnp.float32), gq, gs, dq, ds


@_jit_static(1, 2, 3)
def _linear_inputs(key, tokens: int, din: int, dout: int):
    """(x [tokens, in] bf16, fp8 weight [in, out], its block scales 0.02)."""
    ks = jax.random.split(key)
    return (_normal(ks[0], (tokens, din), jnp.bfloat16), random_fp8(ks[1], (din, dout)),
            jnp.full((-(-din // 128), -(-dout // 128)), 0.02, jnp.float32))


# ------------------------------------------------------------------------------------------ timing
def time_call(fn, args, repeats: int, max_warmups: int = 3) -> dict:
    """Warm-up calls (compile and run) until one compiles nothing (at most `max_warmups`), then `repeats`
    calls, each ended by block_until_ready -> {"measured_s": median, "first_call_s", "warmups", "min_s",
    "max_s", "repeats", "timed_compiles": XLA compilations during the timed calls (0 unless a call traced
    a new program: then the median may include one)}."""
    from glm53.engine.runner import CompileCounter

    first, warmups = None, 0
    while warmups < max_warmups:
        with CompileCounter() as c:
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
        first = time.perf_counter() - t if first is None else first
        warmups += 1
        if c.count == 0:
            break
    times = []
    with CompileCounter() as compiles:
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
    return {"measured_s": float(np.median(times)), "first_call_s": first, "warmups": warmups,
            "min_s": float(min(times)), "max_s": float(max(times)), "repeats": repeats,
            "timed_compiles": compiles.count}


class Bench:
    """Runs rows: builds each row's inputs on the device, times it, prices it. Holds the slice (weights,
    runner, filled pool) between slice rows."""

    def __init__(self, cfg, *, dry_run: bool, repeats: int, seed: int = 0, hbm_bytes: float | None = None):
        from glm53.perfmodel import HARDWARE

        self.cfg, self.dry_run, self.repeats = cfg, dry_run, repeats
        self.hw = HARDWARE["h200"]
        self.key = jax.random.key(seed)
        self.block_size = DRY_BLOCK_SIZE if dry_run else BLOCK_SIZE
        self.hbm_bytes = hbm_bytes
        self._slice = None
        self._inputs = None  # (op and shape, inputs) of the last kernel row
        self._count = 0

    def _k(self):
        self._count += 1
        return jax.random.fold_in(self.key, self._count)

    # -------------------------------------------------------------------------------- kernel rows
    def run_kernel(self, row: Row) -> dict:
        from glm53.perfmodel import measured as M

        out = {"op": row.op, "shape": row.shape, "block_sizes": row.sizes, "impl": row.impl, "priority": row.priority}
        if row.default is not None:
            out["default"] = row.default
        key = json.dumps([row.op, row.shape], sort_keys=True)
        if self._inputs is None or self._inputs[0] != key:  # a shape's tile candidates share their inputs
            self._inputs = None
            self.collect()
            self._inputs = (key, getattr(self, f"_inputs_{row.op}")(row.shape))
        out.update(time_call(getattr(self, f"_fn_{row.op}")(row), self._inputs[1], self.repeats))
        cost = M.kernel_cost(self.cfg, self.hw, row.op, row.shape)
        if cost is None:  # the resolver: not priced; its rates from the bytes it must move
            s = row.shape
            nbytes = M.resolver_bytes(s["rows"], s["topk"], s["hot_rows"], self._resolver_pages())
            out.update({"priced_s": None, "ratio": None, **M.rates(row.op, self.hw, out["measured_s"], 0.0, nbytes)})
        else:
            out.update({"priced_s": cost.time_s, "ratio": out["measured_s"] / cost.time_s,
                        **M.rates(row.op, self.hw, out["measured_s"], cost.useful_flops, cost.hbm_bytes)})
        return out

    def release_inputs(self) -> None:
        self._inputs = None
        self.collect()

    def collect(self) -> None:
        """Free device buffers held only by reference cycles (a failed row's traceback) before the next
        row allocates. Not in a dry run: its buffers are kilobytes, while a full collection walks every
        object JAX's caches hold, once per row (docs/testing.md)."""
        if not self.dry_run:
            gc.collect()

    def _fmt(self):
        from attention.formats import IndexKeyFormat, MLARowFormat

        return (MLARowFormat("fp8_ds_mla", self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim),
                IndexKeyFormat("fp8", self.cfg.index_head_dim))

    def _inputs_sparse_mla_decode(self, s: dict):
        return _sparse_inputs(self._k(), self.cfg, s["batch"], 1, s["heads"], s["context"], s["topk"], self.block_size)

    def _inputs_sparse_mla_prefill(self, s: dict):
        return _sparse_inputs(self._k(), self.cfg, 1, s["chunk"], s["heads"], s["context"], s["topk"], self.block_size)

    def _fn_sparse_mla_decode(self, row: Row):

        from attention import sparse_mla

        fmt, bsz, scale = self._fmt()[0], row.block_sizes, self.cfg.softmax_scale

        def fn(q_lat, q_pe, rows, slots):
            return sparse_mla.sparse_mqa_pallas(q_lat, q_pe, sparse_mla.SlotRows(rows, slots, fmt), scale,
                                                block_sizes=bsz)

        return jax.jit(fn)

    _fn_sparse_mla_prefill = _fn_sparse_mla_decode

    def _inputs_indexer_decode(self, s: dict):
        return _indexer_inputs(self._k(), self.cfg, s["batch"], 1, s["index_heads"], s["keys"], self.block_size)

    def _inputs_indexer_prefill(self, s: dict):
        return _indexer_inputs(self._k(), self.cfg, 1, s["chunk"], s["index_heads"], s["keys"], self.block_size)

    def _fn_indexer_decode(self, row: Row):
        """The indexer op as the model calls it (scores kernel, then the top-k; float32 q and head weights)."""
        from attention import indexer

        fmt, bs, bsz = self._fmt()[1], self.block_size, row.block_sizes
        topk, window = row.shape["topk"], row.shape["keys"]

        def fn(q, w, rows, table, q_pos):
            return indexer.topk(q, w, indexer.PagedKeys(rows, table, bs, fmt), q_pos, topk, window=window,
                                impl="pallas", block_sizes=bsz)

        return jax.jit(fn)

    _fn_indexer_prefill = _fn_indexer_decode

    def _inputs_moe(self, s: dict):
        """The assignments balanced routing sends one rank holding `experts_local` experts: token n picks
        experts (n k + j) mod E, j < k; the rank's are those below experts_local, one row each, as expert
        parallelism's dispatch delivers them; the rank's experts as fp8 blocks."""
        e, k, el = self.cfg.n_routed_experts, s["topk"], s["experts_local"]
        choice = (np.arange(s["tokens"])[:, None] * k + np.arange(k)[None, :]) % e  # [N, k]
        tok, _ = np.nonzero(choice < el)
        idx = choice[choice < el].astype(np.int32)[:, None]
        return _moe_inputs(self._k(), self.cfg, s["tokens"], el, tok.astype(np.int32), idx, 1.0 / k)

    def _fn_moe(self, row: Row):
        """The routed experts as glm53.layers.Fp8Experts runs them (grouped_experts over fp8 blocks)."""
        from attention.fp8_matmul import BlockFp8
        from glm53.layers import grouped_experts

        def fn(x, idx, w, gq, gs, dq, ds):
            return grouped_experts(x, idx, w, BlockFp8(gq, gs, 2), BlockFp8(dq, ds), fp8_impl=row.impl)

        return jax.jit(fn)

    def _inputs_linear(self, s: dict):
        return _linear_inputs(self._k(), s["tokens"], s["in"], s["out"])

    def _fn_linear(self, row: Row):
        """One fp8 linear layer as glm53.layers.Fp8Linear runs it: bf16 activations [tokens, in] times fp8
        blocks [in, out] (fp8_matmul.matmul at the row's impl), the output cast back to bf16."""
        from attention import fp8_matmul

        def fn(x, q, scale):
            return fp8_matmul.matmul(x, fp8_matmul.BlockFp8(q, scale), impl=row.impl).astype(x.dtype)

        return jax.jit(fn)

    def _resolver_pages(self) -> int:
        """Pages per request of the resolver rows: a 128K context (tiny under a dry run)."""
        return _sizer(self.dry_run)("context", 128 * K) // self.block_size

    def _inputs_hisparse_resolve(self, s: dict):
        """A decode batch over half-resident 128K contexts with a warm hot buffer (as
        experiments.check_hisparse_copy times the resolver); small, so made on the host."""
        from attention.hisparse import HotBuffer

        b, k, hot, m, bs = s["rows"], s["topk"], s["hot_rows"], self._resolver_pages(), self.block_size
        rng = np.random.default_rng(self._count)
        dev = np.where(rng.random((b, m)) < 0.5, rng.integers(0, b * m, (b, m)), -1).astype(np.int32)
        host = rng.integers(0, b * m, (b, m)).astype(np.int32)
        sel = np.stack([rng.choice(m * bs, k, replace=False) for _ in range(b)]).astype(np.int32)
        pos = np.stack([rng.choice(m * bs, hot, replace=False) for _ in range(b)]).astype(np.int32)
        buf = HotBuffer(jnp.asarray(pos), jnp.asarray(rng.integers(0, 100, (b, hot)).astype(np.int32)),
                        jnp.asarray((np.arange(b * hot) + 10_000).reshape(b, hot).astype(np.int32)))
        return jnp.asarray(sel), jnp.asarray(dev), jnp.asarray(host), buf

    def _fn_hisparse_resolve(self, row: Row):
        """The Pallas resolver with the row's tile sizes, or the reference (what impl="auto" runs on a GPU)."""
        from attention.hisparse import resolve_pallas, resolve_reference

        bs, bsz = self.block_size, row.block_sizes

        def fn(sel, dev, host, buf):
            if bsz is None:
                return resolve_reference(sel, dev, host, bs, buf, 100)
            return resolve_pallas(sel, dev, host, bs, buf, 100, block_sizes=bsz)

        return jax.jit(fn)

    # ---------------------------------------------------------------------------------------- slice
    def slice_rows_memory(self, rows: list[Row]) -> dict:
        from glm53.perfmodel.measured import slice_config

        return slice_memory(slice_config(self.cfg), [r.shape for r in rows if r.op == "slice"], self.block_size,
                            self.hbm_bytes)

    def build_slice(self, memory: dict):
        """The sliced model with random fp8 weights, a ModelRunner (impl "auto") whose pool holds the
        largest row that fits, and that pool filled with random rows."""
        from glm53.engine.config import DeployConfig
        from glm53.engine.runner import ModelRunner
        from glm53.perfmodel.measured import slice_config

        cfg = slice_config(self.cfg)
        fits = [s for s, ok in zip(memory["rows"], memory["fits"]) if ok]
        positions = max(s["context"] + s["chunk"] for s in fits)
        deploy = DeployConfig(kv_cache_dtype="fp8_ds_mla", block_size=self.block_size,
                              max_model_len=-(-(positions) // self.block_size) * self.block_size,
                              max_num_batched_tokens=max(s["chunk"] for s in fits),
                              max_num_seqs=max(s["batch"] for s in fits), num_gpu_blocks=memory["pool_blocks"],
                              attention_impl="auto", enable_prefix_caching=False)
        model = random_model(cfg, "bfloat16", seed=1)
        runner = ModelRunner(model, deploy, deploy.kv_sizes(cfg, "bfloat16"))
        cache = runner.cache
        fill_mla = jax.jit(lambda a, k: random_mla_rows(k, a.shape[0], cfg), donate_argnums=0)
        fill_idx = jax.jit(lambda a, k: random_index_keys(k, a.shape[0], cfg), donate_argnums=0)
        filled = dataclasses.replace(cache, mla=tuple(fill_mla(a, self._k()) for a in cache.mla),
                                     index=tuple(fill_idx(a, self._k()) for a in cache.index))
        runner.cache = jax.block_until_ready(jax.device_put(filled, runner.devices[0]))  # committed, as the runner's
        self._slice = {"cfg": cfg, "runner": runner, "deploy": deploy}

    def slice_plan(self, shape: dict):
        """The StepPlan of one slice row: `batch` requests, each on its own shuffled pages (the MLA rows and
        the indexer keys of a request share block ids: two arrays, one table), at `context` cached tokens."""
        from glm53.engine.plan import PlanRow, StepPlan
        from glm53.engine.request import SamplingParams

        runner, bs = self._slice["runner"], self.block_size
        tokens = 1 if shape["kind"] == "decode" else shape["chunk"]
        pages = -(-(shape["context"] + tokens) // bs)
        rng = np.random.default_rng(shape["batch"] * 7 + shape["context"])
        ids = rng.permutation(runner.num_blocks)[: shape["batch"] * pages].reshape(shape["batch"], pages)
        tables = tuple(tuple(int(i) for i in r) for r in ids)
        rows = tuple(PlanRow(f"r{b}", shape["context"], rng.integers(0, self.cfg.vocab_size, tokens).astype(np.int32),
                             True, SamplingParams(), 0) for b in range(shape["batch"]))
        return StepPlan(0, rows, {"mla": tables, "indexer": tables}, None, ())

    def run_slice(self, row: Row) -> dict:

        from glm53.engine.runner import forward_groups
        from glm53.perfmodel.measured import slice_cost

        runner = self._slice["runner"]
        plan = self.slice_plan(row.shape)
        out = dict(row.shape, priority=row.priority)
        out["window"] = forward_groups(plan.rows, runner.max_tokens, runner.capacity)[0][3]
        dev = jax.devices()[0]
        out.update(time_call(runner.execute, (plan,), self.repeats))
        stats = dev.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            out["peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
        out["priced_s"] = slice_cost(self._slice["cfg"], self.hw, plan)
        out["ratio"] = out["measured_s"] / out["priced_s"]
        return out


# ----------------------------------------------------------------------------------------- memory
def slice_workspace_bytes(cfg, shape: dict) -> int:
    """An upper bound on the device bytes one slice step needs beyond weights and pool, from its largest
    arrays (float32 unless the model keeps them in bf16): index scores and the top-k's copy of them for the
    window (a prefill chunk tiles them to attention.indexer.MAX_SCORE_BYTES, a tile's peak a few times
    that), the absorbed queries and the sparse kernel's split outputs, the dense MLP's activations, the
    expert loop's dequantised weights and token blocks, an fp8 linear's dequantised weight, the logits;
    times two for XLA's temporaries. The run records the allocator's peak beside it."""
    from attention import sparse_mla
    from attention.indexer import MAX_SCORE_BYTES

    b = shape["batch"]
    t = 1 if shape["kind"] == "decode" else shape["chunk"]
    window = shape["context"] + t
    d, h = cfg.hidden_size, cfg.num_attention_heads
    scores = min(b * t * window * 4 * 2, 4 * MAX_SCORE_BYTES)
    bs = sparse_mla.BlockSizes()
    splits = sparse_mla.default_splits(b * t * -(-h // bs.head_block), -(-cfg.index_topk // bs.row_block))
    attn = b * t * h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * 2 + b * t * splits * h * cfg.kv_lora_rank * 4
    mlp = b * t * cfg.intermediate_size * 4 * 3
    experts = 3 * d * cfg.moe_intermediate_size * 4 * 2 + b * t * cfg.num_experts_per_tok * d * 4 * 3
    weight = max(d * cfg.intermediate_size, cfg.q_lora_rank * h * cfg.qk_head_dim) * 4
    logits = b * cfg.vocab_size * 4 * 2
    return 2 * (scores + attn + mlp + experts + weight + logits)


def slice_memory(cfg, shapes: list[dict], block_size: int, hbm_bytes: float | None = None,
                 fraction: float = 0.9) -> dict:
    """Whether each slice row fits one device, from byte counts alone (nothing is allocated): the sliced
    model's weights (eval_shape of the fp8 model), a pool of pages for the largest row that fits (the MLA
    rows of every layer and the keys of every full indexer layer: eval_shape of the runner's cache) and
    `slice_workspace_bytes`, against `fraction` of `hbm_bytes` (default: the H200's 141 GB). Rows are
    tried largest pool first; a row whose own pool, weights and workspace do not fit is marked not to fit.
    -> {"weights_bytes", "pool_blocks", "pool_bytes", "limit_bytes", "rows", "fits", "row_bytes"}."""
    from flax import nnx

    from experiments.memory_plan import abstract_fp8_model
    from glm53.perfmodel import HARDWARE
    from kvcache.paged import PagedKVCache

    limit = fraction * (hbm_bytes or HARDWARE["h200"].hbm_capacity_bytes)
    state = nnx.state(abstract_fp8_model(cfg, "bfloat16"))
    weights = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))

    def pool_bytes(blocks: int) -> int:
        cache = jax.eval_shape(lambda: PagedKVCache.create(cfg, blocks, block_size, np.zeros((1, 1), np.int32),
                                                           kv_cache_dtype="fp8_ds_mla", include_mtp=False))
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in (*cache.mla, *cache.index))

    def blocks(s: dict) -> int:
        return s["batch"] * -(-(s["context"] + (1 if s["kind"] == "decode" else s["chunk"])) // block_size)

    per_block = pool_bytes(1)
    need = [weights + blocks(s) * per_block + slice_workspace_bytes(cfg, s) for s in shapes]
    fits = [n <= limit for n in need]
    pool = max((blocks(s) for s, ok in zip(shapes, fits) if ok), default=1)
    # every fitting row's workspace beside the largest pool
    fits = [ok and weights + pool * per_block + slice_workspace_bytes(cfg, s) <= limit for s, ok in zip(shapes, fits)]
    return {"weights_bytes": weights, "pool_blocks": pool, "pool_bytes": pool * per_block, "limit_bytes": limit,
            "rows": shapes, "fits": fits, "row_bytes": need}


# ----------------------------------------------------------------------------------------- the run
def _device() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform})"


def _write(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)  # the file always parses, whenever the run stops


def run(out: Path, *, with_slice: bool, dry_run: bool, deadline_s: float | None, resume: bool,
        repeats: int | None = None, only: tuple[str, ...] = ()) -> dict:
    """Run the rows into out/results.json (module docstring) and write out/README.md -> the results."""
    from experiments.common import git_revision
    from glm53.config import get_preset
    from glm53.perfmodel.measured import slice_config

    t0 = time.monotonic()
    preset = "tiny" if dry_run else "glm-5.3"
    cfg = get_preset(preset)
    repeats = repeats or (DRY_REPEATS if dry_run else REPEATS)
    if not dry_run and repeats < REPEATS:
        raise ValueError(f"--repeats must be >= {REPEATS} outside --dry-run (the median of >= 20 runs), got {repeats}")
    plan = plan_rows(cfg, dry_run=dry_run, with_slice=with_slice)
    rows = [r for r in plan if not only or r.op in only]  # what this run may run; "complete" means all of plan
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if resume and path.exists() else None
    if results is not None and (results.get("preset"), results.get("dry_run")) != (preset, dry_run):
        raise ValueError(f"--resume: {path} is a run of preset {results.get('preset')!r} (dry_run "
                         f"{results.get('dry_run')}), not {preset!r} (dry_run {dry_run})")
    stats = jax.devices()[0].memory_stats() or {}
    bench = Bench(cfg, dry_run=dry_run, repeats=repeats, hbm_bytes=stats.get("bytes_limit"))
    sliced = slice_config(cfg)
    layers = [{"index": i, "mlp": "dense" if sliced.layer_mlp_type(i) == "dense" else "moe",
               "indexer": sliced.layer_indexer_type(i)} for i in range(sliced.num_hidden_layers)]
    if results is None:
        results = {"benchmark": "bench_gpu", "date": time.strftime("%Y-%m-%d"), "device": _device(),
                   "git_revision": git_revision(), "complete": False, "preset": preset, "dry_run": dry_run,
                   "repeats": repeats, "hardware_priced": bench.hw.name, "kernels": [],
                   "slice": {"layers": layers, "rows": []}}
    results.update(complete=False, deadline_s=deadline_s, planned_rows=len(plan))
    results.setdefault("runs", []).append({"git_revision": git_revision(), "device": _device(),
                                           "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    # a row that failed before runs again (a transient failure may pass; its old record is replaced)
    results["kernels"] = [r for r in results["kernels"] if not r.get("error")]
    results["slice"]["rows"] = [r for r in results["slice"]["rows"] if not r.get("error")]
    done = {_row_key(r, kernel=True) for r in results["kernels"]} | {_row_key(r, kernel=False)
                                                                      for r in results["slice"]["rows"]}
    memory = bench.slice_rows_memory(rows) if with_slice else None
    if memory is not None:
        results["slice"]["memory"] = {k: memory[k] for k in ("weights_bytes", "pool_blocks", "pool_bytes",
                                                              "limit_bytes")}
    fit_of = {json.dumps(s, sort_keys=True): ok for s, ok in zip(memory["rows"], memory["fits"])} if memory else {}
    _write(path, results)
    stopped = None
    seqs = {r.key(): i for i, r in enumerate(plan)}
    for row in rows:
        seq = seqs[row.key()]
        if row.key() in done:
            continue
        est = estimate_s(row, cfg, repeats)
        elapsed = time.monotonic() - t0
        if deadline_s is not None and elapsed + est > deadline_s:
            stopped = {"row": row.key(), "elapsed_s": elapsed, "estimate_s": est}
            print(f"[bench_gpu] deadline: {row.op} {row.shape} would end at ~{elapsed + est:.0f} s "
                  f"> {deadline_s:.0f} s; stopping", flush=True)
            break
        print(f"[bench_gpu] {row.op} {row.shape} {row.sizes or ''} (est {est:.1f} s)", flush=True)
        try:
            if row.op == "slice":
                if not fit_of[json.dumps(row.shape, sort_keys=True)]:
                    rec = dict(row.shape, priority=row.priority, measured_s=None,
                               skipped=f"does not fit {memory['limit_bytes'] / 1e9:.0f} GB with the sliced weights "
                                       "and the pool (slice_memory)")
                else:
                    if bench._slice is None:
                        bench.release_inputs()
                        bench.build_slice(memory)
                    rec = bench.run_slice(row)
            else:
                rec = bench.run_kernel(row)
        except Exception as exc:  # noqa: BLE001 - one failing row is recorded; the others still run
            rec = {"op": row.op, "shape": row.shape, "block_sizes": row.sizes, "impl": row.impl,
                   "priority": row.priority, "measured_s": None, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            if row.op == "slice":
                rec = dict(row.shape, priority=row.priority, measured_s=None, error=rec["error"])
        rec.update(seq=seq, estimate_s=est)  # seq: the row's place in the planned (priority) order
        (results["slice"]["rows"] if row.op == "slice" else results["kernels"]).append(rec)
        _write(path, results)
        bench.collect()
    keys = {_row_key(r, kernel=True) for r in results["kernels"]} | {_row_key(r, kernel=False)
                                                                      for r in results["slice"]["rows"]}
    results["complete"] = stopped is None and all(r.key() in keys for r in plan)
    results["stopped"] = stopped
    results["runs"][-1]["elapsed_s"] = time.monotonic() - t0
    _write(path, results)
    (out / "README.md").write_text(report(results))
    return results


def _row_key(rec: dict, *, kernel: bool) -> str:
    if kernel:
        return json.dumps([rec["op"], rec["shape"], rec.get("block_sizes", {}), rec.get("impl", "pallas")],
                          sort_keys=True)
    return json.dumps(["slice", {k: rec[k] for k in ("kind", "batch", "context", "chunk")}, {}, "engine"],
                      sort_keys=True)


# ---------------------------------------------------------------------------------------- the report
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _shape(op: str, s: dict) -> str:
    if op.startswith("sparse_mla"):
        return (f"batch {s['batch']}, " if "batch" in s else f"chunk {s['chunk']}, ") + \
            f"{s['heads']} heads, context {s['context']}, top-k {s['topk']}"
    if op.startswith("indexer"):
        return (f"batch {s['batch']}, " if "batch" in s else f"chunk {s['chunk']}, ") + \
            f"{s['keys']} keys, {s['index_heads']} heads, top-k {s['topk']}"
    if op == "moe":
        return f"{s['tokens']} tokens, {s['experts_local']} local experts, top-{s['topk']}"
    if op == "linear":
        return f"{s['name']} [{s['in']} -> {s['out']}], {s['tokens']} tokens"
    return ", ".join(f"{k} {v}" for k, v in s.items())


def report(results: dict) -> str:
    """README.md of a run: what ran, then one table of kernel rows and one of slice rows (generated)."""
    lines = [f"# {'Dry run (CPU, tiny shapes: times mean nothing)' if results.get('dry_run') else 'H200 speed'}"
             f" of this codebase's GPU path, {results['date']}", "",
             f"Device {results['device']}, code {results['git_revision']}, preset {results['preset']}, median of "
             f"{results['repeats']} calls after a warm-up. Complete: **{results['complete']}**"
             + (f" (stopped before {results['stopped']['row']})" if results.get("stopped") else "") + ".",
             "Generated by `python -m experiments.bench_gpu` (`--report DIR` redraws it); how to read it: "
             "docs/kernels.md, \"The H200 bench\". `priced`: glm53.perfmodel on "
             f"{results.get('hardware_priced')}; ratio = measured / priced; peak = "
             "max(TFLOP/s / the op's tensor-core peak, GB/s / 4,800).", "",
             "| prio | op | shape | tiles | impl | measured ms | priced ms | ratio | TFLOP/s | GB/s | peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["kernels"]:
        tiles = ("default" if r.get("default") else "candidate") + " " + json.dumps(r.get("block_sizes") or {}) \
            if r.get("block_sizes") else "-"
        if r.get("error") or r.get("skipped"):
            lines.append(f"| {r.get('priority', '')} | {r['op']} | {_shape(r['op'], r['shape'])} | {tiles} | "
                         f"{r.get('impl', '')} | {r.get('error') or r.get('skipped')} | | | | | |")
            continue
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r.get('priority', '')} | {r['op']} | {_shape(r['op'], r['shape'])} | {tiles} | "
                     f"{r.get('impl', '')} | {_ms(r['measured_s'])} | {_ms(r.get('priced_s'))} | {ratio} | "
                     f"{r['tflops']:.2f} | {r['gbps']:.1f} | {r['peak_fraction']:.2%} |")
    s = results["slice"]
    lines += ["", "The slice: " + ", ".join(f"layer {x['index']} {x['mlp']} ({x['indexer']} indexer)"
                                           for x in s["layers"]) + "; priced by `step_cost` of the same plan.", "",
              "| prio | kind | batch | context | chunk | window | measured ms | priced ms | ratio | first call s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        if r.get("error") or r.get("skipped"):
            lines.append(f"| {r.get('priority', '')} | {r['kind']} | {r['batch']} | {r['context']} | {r['chunk']} | | "
                         f"{r.get('error') or r.get('skipped')} | | | |")
            continue
        lines.append(f"| {r.get('priority', '')} | {r['kind']} | {r['batch']} | {r['context']} | {r['chunk']} | "
                     f"{r.get('window', '')} | {_ms(r['measured_s'])} | {_ms(r['priced_s'])} | {r['ratio']:.2f} | "
                     f"{r['first_call_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for results.json and README.md (e.g. results/gpu_speed/YYYY-MM-DD)")
    ap.add_argument("--slice", action="store_true", help="also the four-layer slice through the ModelRunner")
    ap.add_argument("--dry-run", action="store_true", help="every row at tiny shapes on the CPU (times mean nothing)")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop before a row that would end past this")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in OUT/results.json, run the rest")
    ap.add_argument("--repeats", type=int, default=None, help=f"timed calls per row (default {REPEATS}; dry run "
                                                               f"{DRY_REPEATS})")
    ap.add_argument("--only", default="", help="comma-separated ops (and 'slice') to run")
    ap.add_argument("--report", metavar="DIR", help="write DIR/README.md from DIR/results.json and exit")
    ap.add_argument("--plan", action="store_true", help="print the rows with their estimated device seconds")
    args = ap.parse_args(argv)
    if args.report:
        d = Path(args.report)
        res = json.loads((d / "results.json").read_text())
        (d / "README.md").write_text(report(res))
        print(f"wrote {d / 'README.md'}")
        return res
    if args.plan:
        from glm53.config import get_preset

        cfg = get_preset("tiny" if args.dry_run else "glm-5.3")
        repeats = args.repeats or (DRY_REPEATS if args.dry_run else REPEATS)
        total_s, rows = 0.0, plan_rows(cfg, dry_run=args.dry_run, with_slice=args.slice)
        for r in rows:
            est = estimate_s(r, cfg, repeats)
            total_s += est
            print(f"{r.priority} {r.op:18s} {json.dumps(r.shape):90s} {json.dumps(r.sizes):60s} {est:7.1f} s "
                  f"(cumulative {total_s:7.1f} s)")
        return {"rows": len(rows), "estimate_s": total_s}
    if not args.out:
        ap.error("--out is required (or --report DIR / --plan)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = tuple(s for s in args.only.split(",") if s)
    res = run(out, with_slice=args.slice, dry_run=args.dry_run, deadline_s=args.deadline_s, resume=args.resume,
              repeats=args.repeats, only=only)
    n_ok = sum(1 for r in res["kernels"] + res["slice"]["rows"] if r.get("measured_s"))
    print(f"[bench_gpu] {n_ok} rows timed, complete={res['complete']}; wrote {out / 'results.json'} and "
          f"{out / 'README.md'}")
    return res


if __name__ == "__main__":
    main()
