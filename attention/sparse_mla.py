"""Sparse MLA in absorbed (MQA) form over selected latent rows.

Each query token attends only the rows its indexer selected. Scores are computed over the full latent
row (kv_lora latent + rope part), values are the latent part; the per-head value projection (kv_b's value
half) and o_proj are applied by the caller.

Two entry points:
- `sparse_mqa_reference`: the specification, over rows already gathered per query.
- `sparse_mqa`: the op the model calls. Rows are addressed by *slot* in a flat row table (`SlotRows`: a
  paged cache's global slot `block_table[req, pos // B] * B + pos % B`, or `req * S + pos` for a
  contiguous cache), -1 = none, stored in the cache's `MLARowFormat` (fp8_ds_mla words or plain floats).
  impl="reference": jnp that gathers, unpacks and attends a few queries at a time, so the [T, K, 576]
  gathered rows never exist at once (the faster form on XLA:CPU, whose gathers are slow: docs/model.md).
  impl="pallas": `sparse_mqa_pallas`, one kernel that gathers, decodes and attends with an online
  softmax. Decode (T = 1 per request) and prefill (many query tokens) are the same call.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from attention.common import (
    H200_SMS,
    MIN_DOT_K,
    gpu_shaped,
    kernel_compute_dtype,
    kernel_dot,
    masked_softmax_weights,
    pad_to,
    pallas_interpret,
    resolve_impl,
)
from attention.formats import FP8, MLARowFormat
from attention.merge import merge


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table", "slots"], meta_fields=["fmt"])
@dataclasses.dataclass(frozen=True)
class SlotRows:
    """MLA rows addressed by slot. table [N, fmt.width] in the cache's storage format (R + P floats, or
    164 uint32 words = 656 bytes of fp8_ds_mla for GLM-5.3); slots [B, T, K] int32, -1 = none."""

    table: jax.Array
    slots: jax.Array
    fmt: MLARowFormat

    def unpack(self, rows):
        """Gathered stored rows [..., width] -> float32 [..., R + P] (latent then rope)."""
        return self.fmt.unpack(rows)

    @classmethod
    def plain(cls, table, slots, kv_lora_rank: int) -> "SlotRows":
        """Rows stored as plain floats [N, R + P] (the format named by the table's dtype)."""
        fmt = MLARowFormat(jnp.dtype(table.dtype).name, kv_lora_rank, table.shape[-1] - kv_lora_rank)
        return cls(table, slots, fmt)

QUERY_BLOCK = 4  # queries per step of the blocked jnp path (tuned on XLA:CPU: docs/model.md)


def sparse_mqa_reference(q_lat_BTHR, q_pe_BTHP, lat_BTKR, pe_BTKP, valid_BTK, scale: float):
    """q_lat [B,T,H,R] (query folded into latent space), q_pe [B,T,H,P], selected rows lat [B,T,K,R] and
    pe [B,T,K,P], valid [B,T,K] bool -> (out [B,T,H,R] f32, lse [B,T,H] f32, natural log; -inf and a zero
    output for a query with no valid row)."""
    f32 = jnp.float32
    s_BTHK = (jnp.einsum("bthr,btkr->bthk", q_lat_BTHR.astype(f32), lat_BTKR.astype(f32))
              + jnp.einsum("bthp,btkp->bthk", q_pe_BTHP.astype(f32), pe_BTKP.astype(f32))) * scale
    p_BTHK, lse_BTH = masked_softmax_weights(s_BTHK, valid_BTK[:, :, None, :])
    return jnp.einsum("bthk,btkr->bthr", p_BTHK, lat_BTKR.astype(f32)), lse_BTH


def sparse_mqa(q_lat_BTHR, q_pe_BTHP, rows: SlotRows, scale: float, *, impl: str = "auto",
               query_block: int | None = None):
    """Sparse MQA reading rows by slot -> (out [B,T,H,R] f32, lse [B,T,H] f32). Equals
    `sparse_mqa_reference` on the gathered, unpacked rows.

    The reference runs `query_block` queries per loop step (default: QUERY_BLOCK on XLA:CPU, whose
    gathers are slow; every query in one batched gather where code is shaped for a GPU,
    `attention.common.gpu_shaped`, which has the memory for [B*T, K, 576] rows and no use for a loop)."""
    if resolve_impl(impl, "sparse_mqa") == "pallas":
        return sparse_mqa_pallas(q_lat_BTHR, q_pe_BTHP, rows, scale)
    rows_NX, slots_BTK = rows.table, rows.slots
    b, t, h, r = q_lat_BTHR.shape
    k = slots_BTK.shape[-1]
    n = b * t
    if query_block is None:
        query_block = n if gpu_shaped() else QUERY_BLOCK
    nb = -(-n // query_block)
    pad = nb * query_block - n
    q = jnp.concatenate([q_lat_BTHR, q_pe_BTHP.astype(q_lat_BTHR.dtype)], -1).reshape(n, h, -1)
    slots = slots_BTK.reshape(n, k)
    if pad:
        q = jnp.concatenate([q, jnp.zeros((pad,) + q.shape[1:], q.dtype)])
        slots = jnp.concatenate([slots, jnp.full((pad, k), -1, slots.dtype)])

    def block(args):
        q_QHX, s_QK = args
        valid_QK = s_QK >= 0
        rows_QKX = rows.unpack(jnp.take(rows_NX, jnp.where(valid_QK, s_QK, 0), axis=0))
        rows_QKX = jnp.where(valid_QK[..., None], rows_QKX, 0.0)
        s_QHK = jnp.einsum("qhx,qkx->qhk", q_QHX.astype(jnp.float32), rows_QKX) * scale
        p_QHK, lse_QH = masked_softmax_weights(s_QHK, valid_QK[:, None, :])
        return jnp.einsum("qhk,qkr->qhr", p_QHK, rows_QKX[..., :r]), lse_QH

    q_IQHX, s_IQK = q.reshape(nb, query_block, h, -1), slots.reshape(nb, query_block, k)
    if nb == 1:  # one batched gather and product over every query, no loop
        out, lse = jax.tree.map(lambda a: a[None], block((q_IQHX[0], s_IQK[0])))
    else:
        out, lse = jax.lax.map(block, (q_IQHX, s_IQK))
    out = out.reshape(nb * query_block, h, r)[:n].reshape(b, t, h, r)
    return out, lse.reshape(nb * query_block, h)[:n].reshape(b, t, h)


# ------------------------------------------------------------------------------------------ Pallas kernel
def _pow2(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
        raise ValueError(f"BlockSizes.{name} must be a positive power of two (a Triton block side), got {v!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The tunables of `sparse_mqa_pallas`, in one place: what the kernel compiles with.

    head_block: query heads per program (a tl.dot needs M >= MIN_DOT_K = 16, so fewer heads are padded).
    row_block: most selected rows per inner step with 16-bit matmul operands; row_block_f32: the same with
      float32 operands. A step takes min(cap, the top-k rounded up to a power of two), at least 16 (the
      P.V dot contracts over the step's rows).
    num_warps: warps per program.
    splits: most programs that share one (query, head block)'s rows, flash-decoding style (their partial
      (out, lse) merged exactly by `attention.merge`); None: `default_splits`.
    Every side is a power of two (Triton loads power-of-two blocks). Why the defaults: on 4 warps the
    kernel sits at sm_90's 255-register cap and spills at GLM-5.3's widths, and float32 64-row steps
    spill even on 8 warps (ptxas via experiments/check_gpu_lowering.py; docs/kernels.md). `CANDIDATES`
    are the alternatives experiments.bench_gpu times beside them on an H200."""

    head_block: int = 16
    row_block: int = 64
    row_block_f32: int = 32
    num_warps: int = 8
    splits: int | None = None

    def __post_init__(self):
        for name in ("head_block", "row_block", "row_block_f32", "num_warps"):
            _pow2(name, getattr(self, name))
        for name in ("head_block", "row_block", "row_block_f32"):
            if getattr(self, name) < MIN_DOT_K:
                raise ValueError(f"BlockSizes.{name} must be >= {MIN_DOT_K} (a tl.dot side), got {getattr(self, name)}")
        s = self.splits
        if s is not None and (not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 1):
            raise ValueError(f"BlockSizes.splits must be a positive int or None, got {s!r}")


# The defaults and at most five alternatives, each changing one tunable (head blocks that load each row
# for more heads, shorter and longer row steps, fewer warps), timed side by side by experiments.bench_gpu.
CANDIDATES = (BlockSizes(), BlockSizes(head_block=32), BlockSizes(head_block=64), BlockSizes(row_block=32),
              BlockSizes(row_block=128), BlockSizes(num_warps=4))


def default_splits(programs: int, blocks: int, sms: int = H200_SMS, max_splits: int = 64) -> int:
    """How many splits of a query's `blocks` row blocks to run, given `programs` (query, head block)
    pairs: the count that minimises waves x (blocks per program + 1), i.e. the step time if every
    program takes an SM to itself (with fp8_ds_mla rows at GLM-5.3's widths two programs' registers do
    not fit in one SM's 64K; bf16 rows need fewer: docs/kernels.md) and costs one block's worth
    besides (writing its [16, R] float32 partial, 32 KB, is about a 64-row block of fp8 rows, 41 KB);
    ties go to fewer splits (less merging). Only counts with no empty split are considered, and a grid
    that fills a wave unsplit is not split (the merge would only add traffic). GLM-5.3 decode, batch 4:
    16 programs, 32 blocks -> 8 (128 programs, one wave of 4 blocks each); a 64-query prefill chunk:
    256 programs -> 1. A model to re-tune once a GPU can time it."""
    if programs >= sms:
        return 1
    counts = {-(-blocks // -(-blocks // s)) for s in range(1, min(blocks, max_splits) + 1)}
    return min(counts, key=lambda s: (-(-programs * s // sms) * (-(-blocks // s) + 1), s))


def _planes(fmt: MLARowFormat):
    """How a row is split into power-of-two blocks: (latent planes, rope planes). fp8_ds_mla: the 4
    byte-planes of the R/4 latent words and the 2 half-word planes of the P/2 rope words; plain: one
    latent block of R and one rope block of P values."""
    return (4, 2) if fmt.fp8 else (1, 1)


def sparse_mqa_pallas(q_lat_BTHR, q_pe_BTHP, rows: SlotRows, scale: float, *, block_sizes: BlockSizes | None = None,
                      compute_dtype=None):
    """Pallas (Triton-style) sparse MQA: gather the selected rows by slot, decode them, and attend with an
    online softmax. -> (out [B,T,H,R] f32, lse [B,T,H] f32), equal to the reference.

    Grid (query token, head block, split): each program keeps its [head_block, R] output accumulator and
    walks its split's share of the query's K slots a row step at a time (slots padded with -1); the
    tunables are `block_sizes` (default `BlockSizes()`). With more than one split, the partial (out, lse)
    of the splits are combined by the exact LSE merge (`attention.merge`), as flash-decoding does. Why
    split: a decode batch of 4 at 64 heads is only 16 (query, head block) programs for an H200's 132 SMs.
    By default (`BlockSizes.splits=None`, `default_splits`) the split count is the smallest whose last
    wave of programs is well filled (8 splits of 256 rows there: 128 programs, one wave; prefill chunks
    get 1). An explicit count is an upper bound (row blocks are dealt ceil(blocks / splits) per split, so
    no split is empty). The merge costs a write and a read of [splits, H, R] float32 partials per query
    (1 MB at 8 splits and 64 heads, against the 1.3 MB of fp8 rows the query reads).

    Backend: written for the Triton lowering (jax 0.11's default GPU backend for pallas_call). Every
    loaded block is power-of-two sized, which a 576-value or 656-byte row is not, so the row is read as
    separate blocks: plain caches as the 512 latent and the 64 rope values; fp8_ds_mla rows (uint32
    words) as the latent words [KB, R/4], the scale word of each word's group (a gather with a column
    index, so no in-kernel reshape) and the rope words [KB, P/2]. Bytes and half-words come out with
    shifts and same-width bitcasts (Triton cannot bitcast between widths). The query is split into the
    matching planes outside the kernel (dims j, j+4, ... for latent plane j; even/odd rope dims), and
    the output planes are interleaved back afterwards. Heads are padded to a multiple of head_block. A slot of -1
    reads row 0 and is masked to -inf; a query with no valid slot gets lse -inf and a zero output.

    Numerics: the matmul operands are `compute_dtype` (`attention.common.kernel_compute_dtype`: the
    cache's float dtype, bfloat16 for fp8_ds_mla; rows are decoded and scaled in float32, then cast),
    with float32 accumulation and a float32 softmax; the probabilities are cast to it for P.V.
    compute_dtype=float32 reproduces the reference up to float32 rounding; bfloat16 adds ~2^-9 relative
    rounding (measured errors: docs/kernels.md).

    Checked against the reference on an H200 (`attention.common.PALLAS_VERIFIED_ON_GPU`; docs/kernels.md),
    and lowered and compiled for sm_90 without a GPU (experiments/check_gpu_lowering.py).
    """
    fmt = rows.fmt
    b, t, h, r = q_lat_BTHR.shape
    p = q_pe_BTHP.shape[-1]
    if (r, p) != (fmt.kv_lora_rank, fmt.rope_dim):
        raise ValueError(f"query widths (R={r}, P={p}) do not match the cache rows {fmt}")
    k = rows.slots.shape[-1]
    cdt = kernel_compute_dtype(fmt.storage_dtype, fmt.fp8, compute_dtype)
    bsz = block_sizes or BlockSizes()
    cap = bsz.row_block_f32 if cdt == jnp.float32 else bsz.row_block
    kb = min(cap, max(MIN_DOT_K, 1 << max(k - 1, 0).bit_length()))
    hb = bsz.head_block
    hp = -(-h // hb) * hb
    nq = b * t
    chunks = -(-k // kb)
    splits = default_splits(nq * (hp // hb), chunks) if bsz.splits is None else bsz.splits
    per_split = -(-chunks // int(splits))  # row blocks per split
    splits = -(-chunks // per_split)  # at most the requested count, none without rows
    kp = splits * per_split * kb
    nl, np_ = _planes(fmt)
    rl, pl_ = r // nl, p // np_
    # q planes [NQ, planes, HP, width]: plane j holds dims j, j + planes, ...
    q_lat = pad_to(q_lat_BTHR.astype(cdt).reshape(nq, h, r), 1, hp)
    q_lat = q_lat.reshape(nq, hp, rl, nl).transpose(0, 3, 1, 2)
    q_pe = pad_to(q_pe_BTHP.astype(cdt).reshape(nq, h, p), 1, hp)
    q_pe = q_pe.reshape(nq, hp, pl_, np_).transpose(0, 3, 1, 2)
    slots = pad_to(rows.slots.astype(jnp.int32).reshape(nq, k), 1, kp, value=-1)
    rope_col = r // 4 + -(-r // 128) if fmt.fp8 else r  # first rope word / value of a row

    def load_planes(tab_ref, s_K):
        """Rows at slots s_K -> ([latent planes [KB, RL]], [rope planes [KB, PL]]) in the compute dtype."""
        if not fmt.fp8:
            lat = tab_ref[s_K, pl.ds(0, r)].astype(cdt)
            pe = tab_ref[s_K, pl.ds(r, p)].astype(cdt)
            return [lat], [pe]
        words_KW = tab_ref[s_K, pl.ds(0, rl)]  # [KB, R/4]: value 4w + j is byte j of word w
        # value 4w + j lies in scale group (4w + j) // 128 = w // 32
        group_W = r // 4 + jax.lax.broadcasted_iota(jnp.int32, (rl,), 0) // 32
        scale_KW = jax.lax.bitcast_convert_type(tab_ref[s_K[:, None], group_W[None, :]], jnp.float32)
        lat = [(jax.lax.bitcast_convert_type(((words_KW >> (8 * j)) & 0xFF).astype(jnp.uint8), FP8)
                .astype(jnp.float32) * scale_KW).astype(cdt) for j in range(4)]
        rope_KW = tab_ref[s_K, pl.ds(rope_col, pl_)]  # [KB, P/2]: rope 2i low half, 2i + 1 high half
        pe = [jax.lax.bitcast_convert_type(((rope_KW >> (16 * j)) & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)
              .astype(cdt) for j in range(2)]
        return lat, pe

    def kernel(q_lat_ref, q_pe_ref, slots_ref, tab_ref, o_ref, lse_ref):
        i, first = pl.program_id(0), pl.program_id(2) * per_split
        q_l = [q_lat_ref[0, j] for j in range(nl)]
        q_p = [q_pe_ref[0, j] for j in range(np_)]

        def step(c, carry):
            m, l, acc = carry
            s_K = slots_ref[i, pl.ds((first + c) * kb, kb)]
            valid_K = s_K >= 0
            lat, pe = load_planes(tab_ref, jnp.maximum(s_K, 0))
            s_HK = sum(kernel_dot(qj, xj, (1, 1), cdt) for qj, xj in zip(q_l + q_p, lat + pe)) * scale
            s_HK = jnp.where(valid_K[None, :], s_HK, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s_HK, axis=1))  # m starts finite, so never -inf - -inf
            alpha = jnp.exp(m - m_new)
            p_HK = jnp.where(valid_K[None, :], jnp.exp(s_HK - m_new[:, None]), 0.0)
            l = l * alpha + jnp.sum(p_HK, axis=1)
            acc = tuple(a * alpha[:, None] + kernel_dot(p_HK, x, (1, 0), cdt) for a, x in zip(acc, lat))
            return m_new, l, acc

        init = (jnp.full((hb,), -1e30, jnp.float32), jnp.zeros((hb,), jnp.float32),
                tuple(jnp.zeros((hb, rl), jnp.float32) for _ in range(nl)))
        m, l, acc = jax.lax.fori_loop(0, per_split, step, init)
        has_rows = l > 0
        inv = jnp.where(has_rows, 1.0 / jnp.where(has_rows, l, 1.0), 0.0)
        for j in range(nl):
            o_ref[0, 0, j] = acc[j] * inv[:, None]
        lse_ref[0, 0, :] = jnp.where(has_rows, m + jnp.log(jnp.where(has_rows, l, 1.0)), -jnp.inf)

    out, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((nq, splits, nl, hp, rl), jnp.float32),
                   jax.ShapeDtypeStruct((nq, splits, hp), jnp.float32)),
        grid=(nq, hp // hb, splits),
        in_specs=[pl.BlockSpec((1, nl, hb, rl), lambda i, g, sp: (i, 0, g, 0)),
                  pl.BlockSpec((1, np_, hb, pl_), lambda i, g, sp: (i, 0, g, 0)),
                  pl.BlockSpec(), pl.BlockSpec()],
        out_specs=(pl.BlockSpec((1, 1, nl, hb, rl), lambda i, g, sp: (i, sp, 0, g, 0)),
                   pl.BlockSpec((1, 1, hb), lambda i, g, sp: (i, sp, g))),
        name="sparse_mqa",  # the kernel's name in GPU profiles
        compiler_params=pltriton.CompilerParams(num_warps=bsz.num_warps),
        interpret=pallas_interpret(),
    )(q_lat, q_pe, slots, rows.table)
    out = out.transpose(0, 1, 3, 4, 2).reshape(nq, splits, hp, r)[:, :, :h]  # interleave the planes back
    lse = lse[:, :, :h]
    out, lse = merge(out, lse, axis=1) if splits > 1 else (out[:, 0], lse[:, 0])
    return out.reshape(b, t, h, r), lse.reshape(b, t, h)
