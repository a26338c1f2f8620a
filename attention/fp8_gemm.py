"""Pallas (Triton) kernels for the block-scaled fp8 GEMMs of fp8 checkpoints: projections and routed experts.

Both compute `attention.fp8_matmul`'s product (its module docstring: weights W ~= q * the float32 scale
of its 128 x 128 block, activations quantised per token and group of 128 to e4m3):

    y[m, n] = sum_g  xs[m, g] * ws[g, col(n)] * sum_{k in group g} xq[m, k] * wq[k, n]

- `gemm`: xq [M, K] times one weight [K, N] (a linear layer).
- `grouped_gemm`: the rows of xq sorted by expert, `group_sizes` [E] rows per expert in order (what
  `lax.ragged_dot` takes), each row multiplied by its expert's weight [E, K, N] (the routed experts).
  Rows past sum(group_sizes) come out zero.

One program computes a tile of `block_m` rows (all of one expert) by `block_n` columns. It walks the
contraction in steps of exactly one 128-value group: it loads the activations' e4m3 tile [block_m, 128]
and the weight's [128, block_n], converts both to bfloat16 in registers (every e4m3 value is exact in
bfloat16), runs one bfloat16 tensor-core dot with float32 accumulation, and adds that group's partial
product times the activation scales (one per row) and the weight scales (one per column's block). No
float copy of a weight exists in memory, and the scaling happens per group in float32 exactly as the
reference orders it (DeepSeek-V3's and DeepGEMM's promotion of each group's fp8 partial sums): the kernel
equals `fp8_matmul.matmul_reference` up to float32 summation order inside a group's dot (products of two
e4m3 values are exact in float32). Why bfloat16 MMA and not fp8 MMA: it keeps the reference's exact
per-group products with Triton's portable dot; fp8 MMA would double the tensor-core rate, which these
memory-bound shapes (decode) do not need first.

Grouped tiles: each expert's rows are cut into ceil(rows / block_m) tiles (its last one partial), so a
tile never spans two experts and every output row is written by exactly one program (no atomics, no
padded copy of the activations). The grid has a static ceil(M / block_m) + E + 1 tiles, the most any
routing needs (`group_tiles`); tiles past the used ones do nothing. Edges (M, K, N not multiples of the
tile) are masked loads (zeros) and masked stores, so weights of any shape are read in place. A small grid
(a decode batch's one row tile) splits K over programs (`BlockSizes.splits`), their float32 partial
products summed after the kernel.

Backend: written for Pallas' Triton lowering (jax 0.11's default GPU backend of `pallas_call`), as the
attention kernels are: every block side a power of two, tl.dot sides >= 16, whole-array refs with
explicit masked `load`/`store`. Off a GPU the kernels run in interpret mode (semantics only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from attention.common import H200_SMS, MIN_DOT_K, pallas_interpret, pow2_at_least
from attention.formats import FP8, GROUP, num_groups


def _pow2(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
        raise ValueError(f"BlockSizes.{name} must be a positive power of two (a Triton block side), got {v!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The tunables of `gemm` and `grouped_gemm`, in one place: what the kernels compile with.

    block_m: rows per program; None: the rows per expert on average (all M for `gemm`) rounded up to a
      power of two, within [16, max_block_m] (a decode batch wastes no tensor-core rows on padding).
    block_n: output columns per program.
    num_warps: warps per program; num_stages: Triton's software-pipelining depth of the loop over the
      128-value groups (loads of the next groups overlap the current dot).
    splits: programs that share one output tile, each summing its own run of K's groups (split-K; their
      float32 partial products are added after the kernel); None: 1 for `grouped_gemm`, and for `gemm`
      the fewest that give the grid a wave of `H200_SMS` programs, at most `max_splits`, the group count,
      and K / (32 M), so that the partials (written and read back: 8 M N bytes per split) stay within a
      quarter of the weight's K N bytes. Why split: a decode batch is one row tile, so a 2,048-wide
      projection is 16 programs for 132 SMs, and a program streams its weight columns at a fraction of
      the HBM rate.
    Every block size is a power of two, block sides >= 16 (tl.dot). `CANDIDATES` are the alternatives
    experiments.bench_gpu may time on an H200."""

    block_m: int | None = None
    max_block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    splits: int | None = None
    max_splits: int = 16

    def __post_init__(self):
        for name in ("block_m", "max_block_m", "block_n", "num_warps"):
            v = getattr(self, name)
            if v is None and name == "block_m":
                continue
            _pow2(name, v)
        for name in ("num_stages", "splits", "max_splits"):
            s = getattr(self, name)
            if s is None and name == "splits":
                continue
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {s!r}")
        for name in ("block_m", "max_block_m", "block_n"):
            v = getattr(self, name)
            if v is not None and v < MIN_DOT_K:
                raise ValueError(f"BlockSizes.{name} must be >= {MIN_DOT_K} (a tl.dot side), got {v}")

    def rows(self, rows_per_group: int) -> int:
        """block_m for tiles of (on average) `rows_per_group` rows."""
        if self.block_m is not None:
            return self.block_m
        return min(max(pow2_at_least(rows_per_group), MIN_DOT_K), self.max_block_m)

    def split_count(self, programs: int, groups: int, cap: int) -> int:
        """splits for a grid of `programs` output tiles over `groups` 128-value groups (`gemm`), at most
        `cap` unless set explicitly."""
        if self.splits is not None:
            return min(self.splits, groups)
        want = max(1, min(-(-H200_SMS // programs), self.max_splits, groups, cap))
        return -(-groups // -(-groups // want))  # as many groups in each split as in the first: none empty


# The default and alternatives: narrower column tiles (more programs for a small decode batch, which
# otherwise leaves most of the 132 SMs idle), no split-K (no partials' bytes), taller row tiles for
# prefill, more warps (the default sits at the register cap on sm_90), deeper pipelines.
CANDIDATES = (BlockSizes(), BlockSizes(block_n=64), BlockSizes(splits=1), BlockSizes(max_block_m=128),
              BlockSizes(num_warps=8), BlockSizes(num_stages=4))


def scale_columns(n: int, parts: int) -> jax.Array:
    """int32 [N]: the weight-scale column of each of N output columns when N is `parts` separately
    quantised equal parts (`fp8_matmul.BlockFp8.parts`)."""
    width = n // parts
    col = jnp.arange(n, dtype=jnp.int32)
    return (col // width) * num_groups(width) + (col % width) // GROUP


def _check(xq_MK, xs_MG, wq, ws, parts: int):
    m, k = xq_MK.shape
    if wq.shape[-2] != k:
        raise ValueError(f"x has {k} values per row but the weight has {wq.shape[-2]} rows")
    if xs_MG.shape != (m, num_groups(k)):
        raise ValueError(f"activation scales have shape {list(xs_MG.shape)}, expected {[m, num_groups(k)]}")
    n = wq.shape[-1]
    if n % parts or ws.shape[-2:] != (num_groups(k), parts * num_groups(n // parts)):
        raise ValueError(f"weight scales have shape {list(ws.shape)} for a weight {list(wq.shape)} in {parts} parts")


_FP8_ZERO = np.zeros((), FP8)  # masked-off loads of e4m3 tiles (an fp8 literal: Triton casts no int to fp8)


def _kernel(m_total, k, n, bm, bn, splits, tile_ref, xq_ref, xs_ref, wq_ref, ws_ref, sc_ref, o_ref):
    """One (tile, column block, split) program. tile_ref [3, T] int32: per tile its expert, first row and
    rows (`group_tiles`; a negative count: that many rows of zeros). o_ref [M, N], or [splits, M, N]
    partial sums when split."""
    t, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    per_split = -(-num_groups(k) // splits)  # static: Triton pipelines loops of a static trip count
    expert, row0, count = tile_ref[0, t], tile_ref[1, t], tile_ref[2, t]

    def out_tile(ref):  # one indexer (Triton lowers no chained ones)
        if splits > 1:
            return ref.at[sp, pl.ds(row0, bm), pl.ds(j * bn, bn)]
        return ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)]

    rows_M = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
    row_ok = (rows_M < jnp.abs(count)) & (row0 + rows_M < m_total)
    cols_N = j * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    col_ok = cols_N < n
    sc_N = sc_ref[jnp.minimum(cols_N, n - 1)]  # each column's weight-scale column
    lanes = jax.lax.broadcasted_iota(jnp.int32, (GROUP,), 0)

    @pl.when(count > 0)
    def _():
        def group(i, acc_MN):
            g = sp * per_split + i  # past the last group (the last split's tail): masked to zeros
            k_ok = g * GROUP + lanes < k
            xq = pltriton.load(xq_ref.at[pl.ds(row0, bm), pl.ds(g * GROUP, GROUP)],
                               mask=row_ok[:, None] & k_ok[None, :], other=_FP8_ZERO)
            wq = pltriton.load(wq_ref.at[expert, pl.ds(g * GROUP, GROUP), pl.ds(j * bn, bn)],
                               mask=k_ok[:, None] & col_ok[None, :], other=_FP8_ZERO)
            part = jax.lax.dot_general(xq.astype(jnp.bfloat16), wq.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            xs_M = pltriton.load(xs_ref.at[pl.ds(row0, bm), jnp.minimum(g, num_groups(k) - 1)],
                                 mask=row_ok & (g < num_groups(k)), other=0.0)
            ws_N = ws_ref[expert, jnp.minimum(g, num_groups(k) - 1), sc_N]
            return acc_MN + part * xs_M[:, None] * ws_N[None, :]

        acc = jax.lax.fori_loop(0, per_split, group, jnp.zeros((bm, bn), jnp.float32))
        pltriton.store(out_tile(o_ref), acc.astype(o_ref.dtype),
                       mask=row_ok[:, None] & col_ok[None, :])

    @pl.when(count < 0)
    def _():
        pltriton.store(out_tile(o_ref), jnp.zeros((bm, bn), o_ref.dtype),
                       mask=row_ok[:, None] & col_ok[None, :])


def _call(tiles_3T, xq_MK, xs_MG, wq_EKN, ws_EGH, parts: int, bm: int, splits: int, bsz: BlockSizes, out_dtype,
          name: str):
    m, k = xq_MK.shape
    n = wq_EKN.shape[-1]
    bn = bsz.block_n
    whole = pl.BlockSpec()
    kernel = functools.partial(_kernel, m, k, n, bm, bn, splits)
    out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32) if splits > 1 else jax.ShapeDtypeStruct((m, n), out_dtype)
    y = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(tiles_3T.shape[1], pl.cdiv(n, bn), splits),
        in_specs=[whole] * 6,
        out_specs=whole,
        name=name,  # the kernel's name in GPU profiles
        compiler_params=pltriton.CompilerParams(num_warps=bsz.num_warps, num_stages=bsz.num_stages),
        interpret=pallas_interpret(),
    )(tiles_3T, xq_MK, xs_MG.astype(jnp.float32), wq_EKN, ws_EGH.astype(jnp.float32), scale_columns(n, parts))
    return jnp.sum(y, axis=0).astype(out_dtype) if splits > 1 else y


def gemm(xq_MK, xs_MG, wq_KN, ws_GH, *, parts: int = 1, block_sizes: BlockSizes | None = None,
         out_dtype=jnp.float32) -> jax.Array:
    """xq [M, K] float8_e4m3fn with scales xs [M, ceil(K/128)] times wq [K, N] float8_e4m3fn with block
    scales ws [ceil(K/128), parts * ceil(N/parts/128)] -> [M, N] `out_dtype` (module docstring)."""
    _check(xq_MK, xs_MG, wq_KN, ws_GH, parts)
    m = xq_MK.shape[0]
    bsz = block_sizes or BlockSizes()
    bm = bsz.rows(m)
    tiles = pl.cdiv(m, bm)
    start = jnp.arange(tiles, dtype=jnp.int32) * bm
    tiles_3T = jnp.stack([jnp.zeros_like(start), start, jnp.minimum(m - start, bm)])
    k = xq_MK.shape[1]
    splits = bsz.split_count(tiles * pl.cdiv(wq_KN.shape[-1], bsz.block_n), num_groups(k), k // (32 * m))
    return _call(tiles_3T, xq_MK, xs_MG, wq_KN[None], ws_GH[None], parts, bm, splits, bsz, out_dtype, "fp8_gemm")


def group_tiles(group_sizes_E, rows: int, bm: int) -> jax.Array:
    """int32 [3, ceil(rows / bm) + E + 1]: (expert, first row, rows) of each tile of at most `bm` rows when
    `rows` rows are sorted by expert with group_sizes_E [E] rows per expert. Each expert's rows are cut into
    tiles of its own; then the rows past sum(group_sizes) get tiles with a negative count (-rows: write
    zeros); the remaining tiles have count 0 (do nothing). Groups past `rows` in total are cut at `rows`.
    Why the static count suffices: sum_e ceil(s_e / bm) <= total / bm + E, plus ceil((rows - total) / bm)."""
    e = group_sizes_E.shape[0]
    sizes = group_sizes_E.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    per_E = (sizes + bm - 1) // bm
    first_E = jnp.cumsum(per_E) - per_E  # first tile of each expert
    t = jnp.arange(pl.cdiv(rows, bm) + e + 1, dtype=jnp.int32)
    # compare_all: E x tiles comparisons, no loop (a binary search lowers to a `while`)
    expert = jnp.searchsorted(first_E + per_E, t, side="right", method="compare_all")
    expert = jnp.clip(expert, 0, e - 1).astype(jnp.int32)
    local = t - first_E[expert]
    used = t < jnp.sum(per_E)
    total = ends[-1]
    zero_start = total + (t - jnp.sum(per_E)) * bm  # tiles after the used ones: the uncovered tail
    start = jnp.where(used, starts[expert] + local * bm, jnp.minimum(zero_start, rows))
    count = jnp.where(used, jnp.minimum(sizes[expert] - local * bm, bm), -jnp.clip(rows - zero_start, 0, bm))
    return jnp.stack([expert, start, count]).astype(jnp.int32)


def grouped_gemm(xq_MK, xs_MG, wq_EKN, ws_EGH, group_sizes_E, *, parts: int = 1,
                 block_sizes: BlockSizes | None = None, out_dtype=jnp.float32) -> jax.Array:
    """Rows xq [M, K] e4m3fn (scales xs [M, ceil(K/128)]) sorted by expert, group_sizes_E [E] int rows per
    expert, times each row's expert weight wq [E, K, N] e4m3fn (block scales ws [E, ceil(K/128),
    parts * ceil(N/parts/128)]) -> [M, N] `out_dtype`; rows past sum(group_sizes) are zero."""
    _check(xq_MK, xs_MG, wq_EKN, ws_EGH, parts)
    e = wq_EKN.shape[0]
    if group_sizes_E.shape != (e,):
        raise ValueError(f"group_sizes has shape {list(group_sizes_E.shape)}, expected [{e}] (one per expert)")
    m = xq_MK.shape[0]
    bsz = block_sizes or BlockSizes()
    bm = bsz.rows(-(-m // e))
    tiles_3T = group_tiles(group_sizes_E, m, bm)
    splits = min(bsz.splits or 1, num_groups(xq_MK.shape[1]))
    return _call(tiles_3T, xq_MK, xs_MG, wq_EKN, ws_EGH, parts, bm, splits, bsz, out_dtype, "fp8_grouped_gemm")
