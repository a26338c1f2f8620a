"""DSA lightning indexer: index scores and top-k selection, over dense or paged keys.

I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) for cached positions s <= pos[t], -inf elsewhere, in
float32; the selection is the top-k of I[t, :] in the total order (score descending, then position
ascending), which is exactly what `lax.top_k` does on a position-indexed row. Selected positions that
are not valid come back as -1.

Positions are request-relative. Keys live in a cache (`PagedKeys`): request b's key at position s is
row `block_table[b, s // block_size] * block_size + s % block_size` of a flat table, stored in an
`IndexKeyFormat` (fp8 with a per-128 scale, or plain floats). A contiguous cache is the special case of
one block per request.

Implementations behind `topk(..., impl=)`: the reference gathers the window's keys and scores them with
plain jnp; the Pallas kernel reads key blocks straight from the pages. Both hand the scores to XLA's
top-k (`select_topk`); a fused top-k is future work.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from attention.common import (
    MIN_DOT_K,
    gpu_shaped,
    kernel_compute_dtype,
    kernel_dot,
    pad_to,
    pallas_interpret,
    pow2_divisor,
    resolve_impl,
    slot_mapping,
    top_k,
)
from attention.formats import FP8, IndexKeyFormat


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table", "block_table"],
                   meta_fields=["block_size", "fmt"])
@dataclasses.dataclass(frozen=True)
class PagedKeys:
    """Indexer keys of a batch of requests. table [N, fmt.width] (fmt.storage_dtype), block_table [B, M]
    int32 page ids (-1 = not allocated), block_size (static): positions per page."""

    table: jax.Array
    block_table: jax.Array
    block_size: int
    fmt: IndexKeyFormat

    def slots(self, pos):
        """Request-relative positions [B, ...] -> table rows [B, ...] (-1 = none; see `slot_mapping`)."""
        return slot_mapping(self.block_table, pos, self.block_size)

    def gather(self, num_positions: int):
        """Keys of positions 0..W-1 of every request: float32 [B, W, D]. Positions without a page read
        row 0 (junk that the causal mask removes: a request's pages cover every position it has)."""
        pos = jnp.broadcast_to(jnp.arange(num_positions, dtype=jnp.int32), (self.block_table.shape[0], num_positions))
        slots = self.slots(pos)
        return self.fmt.unpack(jnp.take(self.table, jnp.maximum(slots, 0), axis=0))


def index_scores_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT):
    """q [B,T,HI,DI] f32, w [B,T,HI] f32 (all scales folded in), keys [B,S,DI], q_pos [B,T] int32
    -> scores [B,T,S] float32, -inf where s > q_pos[t] or q_pos[t] < 0 (padding query)."""
    q_BTHI, w_BTH, keys_BSI = (a.astype(jnp.float32) for a in (q_BTHI, w_BTH, keys_BSI))
    # One head at a time, accumulating: XLA:CPU fuses ReLU, weight and sum into each head's product and
    # never materialises [B,T,H,S], which one einsum over all heads does (docs/model.md).
    scores_BTS = jnp.zeros(q_BTHI.shape[:2] + keys_BSI.shape[1:2], jnp.float32)
    for h in range(q_BTHI.shape[2]):
        logits_BTS = jnp.einsum("bti,bsi->bts", q_BTHI[:, :, h], keys_BSI)
        scores_BTS = scores_BTS + jax.nn.relu(logits_BTS) * w_BTH[:, :, h, None]
    return causal_mask(scores_BTS, q_pos_BT)


def causal_mask(scores_BTS, q_pos_BT):
    s_pos = jnp.arange(scores_BTS.shape[-1], dtype=jnp.int32)
    return jnp.where(s_pos[None, None, :] <= q_pos_BT[:, :, None], scores_BTS, -jnp.inf)


def select_topk(scores_BTS, topk: int):
    """-> positions [B,T,min(topk, S)] int32 in the total order (score desc, position asc), -1 = none."""
    k = min(topk, scores_BTS.shape[-1])
    vals, idx = top_k(scores_BTS, k)
    return jnp.where(vals == -jnp.inf, -1, idx).astype(jnp.int32)


def topk_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT, topk: int):
    """Index scores then top-k over dense keys: [B,T,min(topk,S)] int32 request-relative positions."""
    return select_topk(index_scores_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT), topk)


def index_scores(q_BTHI, w_BTH, keys: PagedKeys, q_pos_BT, *, window: int, impl: str = "auto",
                 block_sizes: BlockSizes | None = None):
    """Scores over positions [0, window) of each request's paged keys: float32 [B, T, window].
    `block_sizes`: the kernel's tunables when it runs (default `BlockSizes()`)."""
    if resolve_impl(impl, "index_scores") == "pallas":
        return index_scores_pallas(q_BTHI, w_BTH, keys, q_pos_BT, window=window, block_sizes=block_sizes)
    return index_scores_reference(q_BTHI, w_BTH, keys.gather(window), q_pos_BT)


# Most bytes of float32 index scores one call of `topk` holds at once (per device). A prefill chunk's
# [B, T, window] scores grow with the chunk times the window: 17.3 GiB for a 32K-token chunk at a 142K
# window, and the top-k's working copy of them as much again. Above this, the queries are scored and
# selected in tiles (vLLM's indexer likewise bounds its prefill logits buffer); a tile's peak is a few
# times this (its scores, the top-k's copy, one head's logits on the reference path). Each query's
# selection depends on its own scores alone, so tiling changes no result. Not tiled: the DCP indexer of
# `parallel.cp_cache` (decode rows, or a chunk under DCP without PCP), which scores [B, T, window / DCP].
MAX_SCORE_BYTES = 1 << 30


def query_tile(rows: int, tokens: int, window: int) -> int:
    """Queries per tile so that rows x tile x window float32 scores stay within MAX_SCORE_BYTES: `tokens`
    when they fit, else the largest power of two that does (at least 1, which exceeds the bound only
    where one query's scores alone do)."""
    if rows * tokens * window * 4 <= MAX_SCORE_BYTES:
        return tokens
    tile = 1
    while tile * 2 < tokens and rows * tile * 2 * window * 4 <= MAX_SCORE_BYTES:
        tile *= 2
    return tile


def topk(q_BTHI, w_BTH, keys: PagedKeys, q_pos_BT, topk: int, *, window: int, impl: str = "auto",
         block_sizes: BlockSizes | None = None):
    """The indexer op: selected positions [B,T,min(topk, window)] int32 (-1 = none), every position
    < window (static; all query positions must be < window). Scores at most MAX_SCORE_BYTES at once:
    a longer chunk runs its queries in tiles of `query_tile` tokens, one after the other. `block_sizes`:
    the score kernel's tunables when it runs."""
    b, t = q_pos_BT.shape
    tile = query_tile(b, t, window)
    if tile < t:
        n = -(-t // tile)
        pad = ((0, 0), (0, n * tile - t))

        def tiles(x, fill=0):  # [B, T, ...] -> [n, B, tile, ...]
            x = jnp.pad(x, pad + ((0, 0),) * (x.ndim - 2), constant_values=fill)
            return jnp.moveaxis(x.reshape(b, n, tile, *x.shape[2:]), 1, 0)

        sel = jax.lax.map(lambda a: _topk_untiled(*a[:2], keys, a[2], topk, window=window, impl=impl,
                                                  block_sizes=block_sizes),
                          (tiles(q_BTHI), tiles(w_BTH), tiles(q_pos_BT, -1)))  # [n, B, tile, k]
        return jnp.moveaxis(sel, 0, 1).reshape(b, n * tile, -1)[:, :t]
    return _topk_untiled(q_BTHI, w_BTH, keys, q_pos_BT, topk, window=window, impl=impl, block_sizes=block_sizes)


def _topk_untiled(q_BTHI, w_BTH, keys: PagedKeys, q_pos_BT, topk: int, *, window: int, impl: str,
                  block_sizes: BlockSizes | None = None):
    b, t = q_pos_BT.shape
    if resolve_impl(impl, "index_scores") == "pallas" or b == 1 or t == 1 or gpu_shaped():
        return select_topk(index_scores(q_BTHI, w_BTH, keys, q_pos_BT, window=window, impl=impl,
                                        block_sizes=block_sizes), topk)
    # Several prefill rows on XLA:CPU: score and select one request row at a time, so that a row's
    # [T, window] scores stay in cache through the top-k (docs/model.md, cache locality). The same values
    # and selection as the batched form above, which code shaped for a GPU uses (one batched top-k).
    return jax.lax.map(lambda a: topk_reference(*(x[None] for x in a), topk)[0],
                       (q_BTHI, w_BTH, keys.gather(window), q_pos_BT))


COUNTERS = ("indexer_pairs_causal", "indexer_pairs_computed")  # work counters of `topk_causal_blocked`


def topk_causal_blocked(q_BTHI, w_BTH, keys: PagedKeys, q_pos_BT, topk: int, *, window: int, block: int):
    """`topk` as a causal tiled loop: the same selection, with work that follows causality.

    -> (positions [B,T,min(topk, window)] int32 (-1 = none), counters {name: int32 [tiles]} per query
    tile: the (query, key) pairs scored that the causal mask kept ("indexer_pairs_causal", padding
    queries excluded) and all pairs of the key blocks visited ("indexer_pairs_computed": the padded work
    of a tiled kernel)). A tile's counts are below window x block, so they fit int32 while that does;
    sum them in int64 (or as `parallel.cp_cache` does).

    Each request row's queries run in tiles of `block` tokens; a tile visits key blocks 0 .. max(pos in
    tile) // block only (a dynamic trip count) and keeps a running top-k. Candidates are ordered
    [running, new block], and every new block's positions exceed every running position, so
    `lax.top_k`'s lowest-index tie break keeps the total order (score desc, position asc): the result
    equals `topk` (scores from `index_scores_reference` on each block). This is what makes context
    parallelism's load-balanced split pay off: a rank's indexer work is its queries' causal work, not
    queries x window (`parallel.pcp`). A jnp loop; a Pallas kernel with the same block skipping is future
    work.
    """
    b, t = q_pos_BT.shape
    k = min(topk, window)
    nq, nk = -(-t // block), -(-window // block)
    pad = ((0, 0), (0, nq * block - t))
    q = jnp.pad(q_BTHI.astype(jnp.float32), pad + ((0, 0), (0, 0))).reshape(b * nq, block, *q_BTHI.shape[2:])
    w = jnp.pad(w_BTH.astype(jnp.float32), pad + ((0, 0),)).reshape(b * nq, block, -1)
    pos = jnp.pad(q_pos_BT.astype(jnp.int32), pad, constant_values=-1).reshape(b * nq, block)
    req = jnp.repeat(jnp.arange(b, dtype=jnp.int32), nq)
    block_pos = jnp.arange(block, dtype=jnp.int32)

    def tile(args):
        q_KHI, w_KH, pos_K, r = args
        last = jnp.max(pos_K)
        trips = jnp.where(last >= 0, jnp.minimum(last // block + 1, nk), 0)
        table_1M = jax.lax.dynamic_slice_in_dim(keys.block_table, r, 1)

        def visit(j, carry):
            run_s, run_p, computed, causal = carry
            kpos = j * block + block_pos
            slots = slot_mapping(table_1M, kpos[None], keys.block_size)[0]
            keys_KI = keys.fmt.unpack(jnp.take(keys.table, jnp.maximum(slots, 0), axis=0))
            sc_KK = index_scores_reference(q_KHI[None], w_KH[None], keys_KI[None], (pos_K - j * block)[None])[0]
            cand_s = jnp.concatenate([run_s, sc_KK], axis=1)
            cand_p = jnp.concatenate([run_p, jnp.broadcast_to(kpos, sc_KK.shape)], axis=1)
            vals, idx = top_k(cand_s, k)
            return (vals, jnp.take_along_axis(cand_p, idx, axis=1), computed + block * block,
                    causal + jnp.sum(jnp.isfinite(sc_KK), dtype=jnp.int32))

        init = (jnp.full((block, k), -jnp.inf, jnp.float32), jnp.full((block, k), -1, jnp.int32), jnp.int32(0),
                jnp.int32(0))
        run_s, run_p, computed, causal = jax.lax.fori_loop(0, trips, visit, init)
        return jnp.where(run_s == -jnp.inf, -1, run_p), computed, causal

    # XLA:CPU: one tile after the other; shaped for a GPU: all tiles vectorised (`vmap` turns the dynamic
    # trip count into a batched while loop in which a finished tile keeps its carry: the same result)
    loop = jax.vmap(tile) if gpu_shaped() else functools.partial(jax.lax.map, tile)
    sel, computed, causal = loop((q, w, pos, req))
    sel_BTK = sel.reshape(b, nq * block, k)[:, :t]
    return sel_BTK, {"indexer_pairs_causal": causal, "indexer_pairs_computed": computed}


# ------------------------------------------------------------------------------------------ Pallas kernel
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The tunables of `index_scores_pallas`, in one place: what the kernel compiles with.

    key_block: keys per program; None: the largest power of two that divides both the page
      (`PagedKeys.block_size`: a program's keys lie on one page, one contiguous run of rows) and the
      window, up to `max_key_block` (16-bit operands) or `max_key_block_f32` (float32 operands). An
      explicit value must divide both.
    num_warps: warps per program.
    Every size is a power of two (Triton blocks). Why float32 operands cap at 16 keys: 32 heads x 128
    dims in IEEE float32 spill sm_90's registers at 32-key blocks (experiments/check_gpu_lowering.py;
    docs/kernels.md). `CANDIDATES` are the alternatives experiments.bench_gpu times on an H200."""

    key_block: int | None = None
    max_key_block: int = 64
    max_key_block_f32: int = 16
    num_warps: int = 4

    def __post_init__(self):
        for name in ("key_block", "max_key_block", "max_key_block_f32", "num_warps"):
            v = getattr(self, name)
            if v is None and name == "key_block":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name} must be a positive power of two (a Triton block side), got {v!r}")


# The defaults and alternatives: shorter key blocks (more programs, each lighter) and more or fewer warps.
# A key block cannot exceed the page (64 tokens in the GLM-5.3 configs), so no longer ones.
CANDIDATES = (BlockSizes(), BlockSizes(key_block=32), BlockSizes(key_block=16), BlockSizes(num_warps=8),
              BlockSizes(num_warps=2), BlockSizes(key_block=32, num_warps=8))


def index_scores_pallas(q_BTHI, w_BTH, keys: PagedKeys, q_pos_BT, *, window: int,
                        block_sizes: BlockSizes | None = None, compute_dtype=None):
    """Pallas (Triton-style) kernel for `index_scores`: same result as the reference.

    Grid (query token, key block): one program scores one query against a key block of consecutive
    positions of its request, which lie on one page (the block divides block_size), so the program loads
    one contiguous run of rows. Per head, logits [HI, KB] = q_h . keys over DI, then ReLU, weight, sum.
    The tunables are `block_sizes` (default `BlockSizes()`).

    Backend: written for the Triton lowering (the default GPU backend of jax 0.11's pallas_call): every
    loaded block has power-of-two sides (the key block and DI/4 word columns), heads padded to 16 for
    tl.dot. fp8 keys (uint32 words: 4 e4m3 values each, then the fp32 scale word) are decoded in the
    kernel with shifts and same-width bitcasts, which is what Triton supports; the query is split into
    the matching 4 byte-planes outside the kernel, so no in-kernel reshape is needed.

    Numerics: q . k runs on `compute_dtype` operands (`attention.common.kernel_compute_dtype`: the keys'
    float dtype, bfloat16 for fp8 keys) with float32 accumulation. An fp8 key's scale is one per key, so
    it multiplies the [heads, keys] logits after the dot and the e4m3 values enter the dot exactly
    (they are exact in bfloat16); only q is rounded. compute_dtype=float32 reproduces the reference.

    Checked against the reference on an H200 (`attention.common.PALLAS_VERIFIED_ON_GPU`; docs/kernels.md),
    and lowered and compiled for sm_90 without a GPU (experiments/check_gpu_lowering.py).
    """
    b, t, hi, di = q_BTHI.shape
    fmt, bs = keys.fmt, keys.block_size
    if fmt.fp8 and di > 128:
        raise ValueError(f"the fp8 indexer kernel supports index_head_dim <= 128 (one scale), got {di}")
    cdt = kernel_compute_dtype(fmt.storage_dtype, fmt.fp8, compute_dtype)
    bsz = block_sizes or BlockSizes()
    cap = bsz.max_key_block_f32 if cdt == jnp.float32 else bsz.max_key_block
    kb = bsz.key_block or pow2_divisor(window, min(bs, cap))
    if bs % kb or window % kb:
        raise ValueError(f"BlockSizes.key_block={kb} must divide block_size={bs} and window={window}")
    hp = -(-hi // MIN_DOT_K) * MIN_DOT_K  # a tl.dot needs M >= 16: pad the heads (weight 0)
    nq = b * t
    planes = 4 if fmt.fp8 else 1
    # q [NQ, planes, HP, DI/planes]: plane j holds dims j, j+planes, ... (byte j of each key word).
    q = pad_to(q_BTHI.astype(cdt).reshape(nq, hi, di), 1, hp)
    q = q.reshape(nq, hp, di // planes, planes).transpose(0, 3, 1, 2)
    w = pad_to(w_BTH.astype(jnp.float32).reshape(nq, hi), 1, hp)
    qpos = q_pos_BT.astype(jnp.int32).reshape(nq)
    qreq = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    words = di // planes

    def kernel(q_ref, w_ref, qpos_ref, qreq_ref, bt_ref, tab_ref, o_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        s0 = j * kb
        page = jnp.maximum(bt_ref[qreq_ref[i], s0 // bs], 0)
        rows = pl.ds(page * bs + s0 % bs, kb)
        if fmt.fp8:
            w_KD = tab_ref[rows, pl.ds(0, words)]  # [KB, DI/4] uint32
            logits = sum(kernel_dot(q_ref[0, p], jax.lax.bitcast_convert_type(
                ((w_KD >> (8 * p)) & 0xFF).astype(jnp.uint8), FP8), (1, 1), cdt) for p in range(planes))
            scale_1K = jax.lax.bitcast_convert_type(tab_ref[rows, pl.ds(words, 1)], jnp.float32).T
            logits = logits * scale_1K  # [HP, KB] x [1, KB]: the per-key scale, after the dot
        else:
            logits = kernel_dot(q_ref[0, 0], tab_ref[rows, pl.ds(0, di)], (1, 1), cdt)
        score_K = jnp.sum(jnp.maximum(logits, 0.0) * w_ref[0][:, None], axis=0)
        pos_K = s0 + jax.lax.broadcasted_iota(jnp.int32, (kb,), 0)
        qp = qpos_ref[i]
        o_ref[0, :] = jnp.where(pos_K <= qp, score_K, -jnp.inf)

    whole = pl.BlockSpec()
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((nq, window), jnp.float32),
        grid=(nq, window // kb),
        in_specs=[pl.BlockSpec((1, planes, hp, words), lambda i, j: (i, 0, 0, 0)),
                  pl.BlockSpec((1, hp), lambda i, j: (i, 0)), whole, whole, whole, whole],
        out_specs=pl.BlockSpec((1, kb), lambda i, j: (i, j)),
        name="index_scores",  # the kernel's name in GPU profiles
        compiler_params=pltriton.CompilerParams(num_warps=bsz.num_warps),
        interpret=pallas_interpret(),
    )(q, w, qpos, qreq, keys.block_table.astype(jnp.int32), keys.table)
    return scores.reshape(b, t, window)
