"""The HiSparse resolver: where each row sparse MLA selects lives, on device, with static shapes.

A request in mixed residency keeps its newest pages on the device and the rest only in the host pool;
rows the indexer selects from host-only pages are served from a per-request **hot buffer** of H device
rows (leased from the same block pool, so one row-id space covers resident and hot data). Per decode
step and per IndexShare group (the full layer resolves, its shared layers replay the plan):

- a selected position whose page is on the device is read in place;
- else, if a hot slot holds it, it is a **hit** and the slot becomes most recently used;
- else it is a **miss**: it takes the least-recently-used hot slot not hit in this step (empty slots
  first, then oldest, ties to the lowest slot) and that one row is copied from the host pool.

Everything is jnp over fixed shapes, so the resolver runs inside the jitted decode step with no host
decision. Because H >= K (top-k) and the K selected positions are distinct, a step's misses always find
free slots, and a miss never evicts a row hit or filled in the same step. BRIEF §6 recommends H = 2K
(with exactly K slots the LRU has no slack and thrashes). `resolve_reference` is the specification;
`resolve_pallas` computes the same plan in a Pallas kernel without a sort; `resolve(..., impl=)` picks.

The rows a plan copies move through kvcache.host (the one room where KV crosses the device/host link);
the decode step's view that carries hot buffers and plans between layers is kvcache.views.HiSparseView.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from attention.common import pad_to, pallas_interpret, pow2_at_least, resolve_impl

NEVER_USED = jnp.iinfo(jnp.int32).min  # last_use of an empty slot: older than any step
_LAST = jnp.iinfo(jnp.int32).max  # LRU key of a slot a miss may not take (hit this step, or padding)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pos", "last_use", "rows"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HotBuffer:
    """Hot slots of B requests. pos [B, H] int32: request-relative position a slot holds (-1 empty);
    last_use [B, H] int32: step of its last hit or fill; rows [B, H] int32: the device row (global slot)
    each hot slot occupies, fixed for the lease (-1: slot not leased, never used)."""

    pos: jax.Array
    last_use: jax.Array
    rows: jax.Array

    @staticmethod
    def create(rows_BH) -> HotBuffer:
        rows_BH = jnp.asarray(rows_BH, jnp.int32)
        return HotBuffer(jnp.full(rows_BH.shape, -1, jnp.int32), jnp.full(rows_BH.shape, NEVER_USED, jnp.int32), rows_BH)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["rows", "copy_src", "copy_dst", "hits", "misses", "resident", "lost"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ResolvePlan:
    """rows [B, K]: the device row sparse MLA reads for each selected position (-1 where the selection
    is -1); copy_src / copy_dst [B, K]: host row -> device row copies to make first (-1 = none);
    hits, misses, resident [B]: per-request counts; lost [B]: selected positions found neither on the
    device nor on the host (a bookkeeping bug upstream; their rows are -1, never a stale row)."""

    rows: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    hits: jax.Array
    misses: jax.Array
    resident: jax.Array
    lost: jax.Array

    @property
    def copied_rows(self) -> jax.Array:
        """Rows this plan copies host->device per layer of its group (int32 scalar)."""
        return jnp.sum(self.copy_src >= 0)


def resolve_reference(sel_BK, device_pages_BM, host_pages_BM, block_size: int, hot: HotBuffer, step):
    """Resolve selected positions against residency and the hot buffer.

    sel_BK int32 [B, K]: selected request-relative positions, distinct per row, -1 = none.
    device_pages_BM int32 [B, M]: device block of each page, -1 where the page is not on the device
        (host-only, or released and since reused by another request: the host side clears it then).
    host_pages_BM int32 [B, M]: host-pool block of each page, -1 where the host has no copy.
    step: int32 scalar, the LRU clock (increasing across calls).
    -> (ResolvePlan, updated HotBuffer).
    """
    b, k = sel_BK.shape
    h = hot.pos.shape[1]
    if h < k:
        raise ValueError(f"the hot buffer needs at least top-k = {k} slots per request, got {h}")
    step = jnp.asarray(step, jnp.int32)

    def one(sel_K, dev_M, host_M, hpos_H, hlast_H, hrows_H):
        valid = sel_K >= 0
        page = jnp.where(valid, sel_K // block_size, 0)
        off = sel_K % block_size
        dev_blk, host_blk = dev_M[page], host_M[page]
        resident = valid & (dev_blk >= 0)
        need = valid & ~resident
        match_KH = (hpos_H[None, :] == sel_K[:, None]) & need[:, None]
        hit = match_KH.any(1)
        miss = need & ~hit
        lost = miss & (host_blk < 0)
        miss = miss & ~lost
        # LRU order over the slots no hit claimed this step; a hit slot sorts last and is never taken
        key_H = jnp.where(match_KH.any(0), jnp.iinfo(jnp.int32).max, hlast_H)
        order_H = jnp.argsort(key_H, stable=True)
        miss_slot = order_H[jnp.clip(jnp.cumsum(miss) - 1, 0, h - 1)]
        slot_K = jnp.where(hit, jnp.argmax(match_KH, 1), jnp.where(miss, miss_slot, -1))
        hot_row = hrows_H[jnp.maximum(slot_K, 0)]
        rows = jnp.where(resident, dev_blk * block_size + off, jnp.where(hit | miss, hot_row, -1))
        src = jnp.where(miss, host_blk * block_size + off, -1)
        dst = jnp.where(miss, hot_row, -1)
        used = jnp.where(hit | miss, slot_K, h)  # h: out of range, dropped
        hpos_H = hpos_H.at[jnp.where(miss, slot_K, h)].set(sel_K, mode="drop")
        hlast_H = hlast_H.at[used].set(step, mode="drop")
        counts = [jnp.sum(x).astype(jnp.int32) for x in (hit, miss, resident, lost)]
        return rows, src, dst, *counts, hpos_H, hlast_H

    rows, src, dst, hits, misses, resident, lost, hpos, hlast = jax.vmap(one)(
        sel_BK, device_pages_BM, host_pages_BM, hot.pos, hot.last_use, hot.rows)
    return ResolvePlan(rows, src, dst, hits, misses, resident, lost), HotBuffer(hpos, hlast, hot.rows)


def resolve(sel_BK, device_pages_BM, host_pages_BM, block_size: int, hot: HotBuffer, step, *, impl: str = "auto"):
    """The resolver op: `resolve_reference` or `resolve_pallas` (same result) per
    `attention.common.resolve_impl`; "auto" runs the reference, even on a GPU: the kernel is verified
    there but measured 16x slower (`attention.common.SLOWER_THAN_REFERENCE_ON_GPU`)."""
    if resolve_impl(impl, "hisparse_resolve") == "pallas":
        return resolve_pallas(sel_BK, device_pages_BM, host_pages_BM, block_size, hot, step)
    return resolve_reference(sel_BK, device_pages_BM, host_pages_BM, block_size, hot, step)


# ------------------------------------------------------------------------------------------ Pallas kernel
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The tunables of `resolve_pallas`, in one place: what the kernel compiles with.

    tile_elems: most values of one pairwise comparison tile ([chunk, max(K, H)]); chunk: rows or columns
    per tile, None: the largest power of two with at most tile_elems values (at most K padded).
    num_warps: warps per program. Powers of two (Triton blocks). Why the defaults: at GLM-5.3's K = 2048,
    H = 4096, 16K-value tiles (chunk 4) on 8 warps keep sm_90's register spills to a few bytes, where
    larger tiles on 4 warps spill kilobytes (ptxas via experiments/check_gpu_lowering.py; docs/kernels.md).
    `CANDIDATES` are the alternatives experiments.bench_gpu times on an H200."""

    tile_elems: int = 1 << 14
    chunk: int | None = None
    num_warps: int = 8

    def __post_init__(self):
        for name in ("tile_elems", "chunk", "num_warps"):
            v = getattr(self, name)
            if v is None and name == "chunk":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name} must be a positive power of two (a Triton block side), got {v!r}")


# The defaults and alternatives: smaller and larger comparison tiles, fewer warps.
CANDIDATES = (BlockSizes(), BlockSizes(tile_elems=1 << 12), BlockSizes(tile_elems=1 << 13),
              BlockSizes(tile_elems=1 << 15), BlockSizes(num_warps=4), BlockSizes(tile_elems=1 << 13, num_warps=4))


def resolve_pallas(sel_BK, device_pages_BM, host_pages_BM, block_size: int, hot: HotBuffer, step, *,
                   interpret: bool | None = None, block_sizes: BlockSizes | None = None):
    """Pallas kernel for `resolve_reference`: same inputs, same (ResolvePlan, HotBuffer), bit for bit.

    Grid (request,): one program resolves one request's K selections against its H hot slots. There is
    no sort in a kernel, so the LRU order is computed by counting:
    - hit: a needed selection k hits the first slot whose position equals it ([K, H] comparison);
    - miss number: n_k = misses at k' < k (a [K, K] strictly-lower-triangular count);
    - LRU rank of a slot: the number of slots with a smaller (key, slot index), key = last_use, or
      int32 max for a slot hit this step ([H, H] comparison). Ranks are a permutation of 0..H-1 in the
      stable-argsort order of the reference, so "the miss numbered n takes the slot of rank n" (clipped
      to H - 1 as the reference does) is a one-hot [K, H] comparison, and reads, copies and the new
      positions / last uses are sums and maxima over that one-hot.
    The pairwise comparisons are built `chunk` rows or columns at a time (`block_sizes`, default
    `BlockSizes()`; fori_loops over slot chunks and selection chunks), so no tile exceeds
    chunk x max(K, H) elements; each pass only reads the input
    refs and writes disjoint output blocks, never reading back what it wrote. The residency of each
    selection is a gather from the page tables by page index (page clamped to M - 1 like the reference's
    jnp gather; selections must lie below M x block_size).

    Backend: written for the Triton lowering (jax's default GPU backend for pallas_call), which needs
    every block and every in-kernel array to have power-of-two sides and at most 2^20 elements. So K and
    H are padded here to powers of two and the tiles are chunk x max(K, H) with chunk a power of two
    (default: the largest with at most tile_elems elements; GLM-5.3's K = 2048, H = 4096 gives 4).
    The padding changes nothing: padded selections are -1 (not valid: never counted, matched or
    copied; their outputs are sliced off); padded slots hold position -1 (a valid selection is >= 0, so
    never a hit) and get the key int32 max with an index above every real slot, so each real slot's
    rank is unchanged and the largest rank a miss can take (H - 1) is a real slot's. The page tables
    are read whole (gathers, no block), so M needs no padding. Tested in interpret mode and on an H200
    (docs/kernels.md), and lowered and compiled for sm_90 without a GPU (experiments/check_gpu_lowering.py).

    Why it is slow on a GPU (`attention.common.SLOWER_THAN_REFERENCE_ON_GPU`): the grid has one program
    per request, so a decode batch of 4 keeps 4 SMs busy with ~3 K x H comparisons each (25M at
    GLM-5.3's sizes); splitting H across programs needs a cross-program reduction of the ranks.
    """
    sel = jnp.asarray(sel_BK, jnp.int32)
    dev = jnp.asarray(device_pages_BM, jnp.int32)
    host = jnp.asarray(host_pages_BM, jnp.int32)
    if sel.ndim != 2 or sel.shape[1] < 1:
        raise ValueError(f"sel must be [B, K] with K >= 1, got shape {sel.shape}")
    b, k = sel.shape
    if dev.ndim != 2 or dev.shape != host.shape or dev.shape[0] != b or dev.shape[1] < 1:
        raise ValueError(f"device/host page tables must both be [B={b}, M >= 1], got {dev.shape} / {host.shape}")
    m = dev.shape[1]
    h = hot.pos.shape[-1]
    if any(x.shape != (b, h) for x in (hot.pos, hot.last_use, hot.rows)):
        raise ValueError(f"hot buffer fields must be [B={b}, H], got {hot.pos.shape}, {hot.last_use.shape}, "
                         f"{hot.rows.shape}")
    if h < k:
        raise ValueError(f"the hot buffer needs at least top-k = {k} slots per request, got {h}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    bsz = block_sizes or BlockSizes()
    kp, hp = pow2_at_least(k), pow2_at_least(h)
    ch = bsz.chunk or min(kp, max(1, bsz.tile_elems // hp))
    if ch > kp:
        raise ValueError(f"BlockSizes.chunk must be <= {kp} (K padded to a power of two), got {ch}")
    sel = pad_to(sel, 1, kp, value=-1)
    pos = pad_to(jnp.asarray(hot.pos, jnp.int32), 1, hp, value=-1)
    last = pad_to(jnp.asarray(hot.last_use, jnp.int32), 1, hp, value=_LAST)
    hrows = pad_to(jnp.asarray(hot.rows, jnp.int32), 1, hp, value=-1)
    step = jnp.asarray(step, jnp.int32).reshape(1)
    i32 = jnp.int32

    def iota(n, start=0):
        return start + jax.lax.broadcasted_iota(i32, (n,), 0)

    def kernel(sel_ref, dev_ref, host_ref, pos_ref, last_ref, hrows_ref, step_ref,
               rows_ref, src_ref, dst_ref, cnt_ref, npos_ref, nlast_ref):
        i = pl.program_id(0)

        def lookup(s):
            """Selections -> (offset in page, device block, host block, resident, needs a hot slot)."""
            valid = s >= 0
            s0 = jnp.where(valid, s, 0)
            page = jnp.minimum(s0 // block_size, m - 1)
            dev_blk, host_blk = dev_ref[i, page], host_ref[i, page]
            resident = valid & (dev_blk >= 0)
            return s0 % block_size, dev_blk, host_blk, resident, valid & ~resident

        sel_K = sel_ref[0, :]
        kidx_K = iota(kp)
        off_K, dev_K, host_K, res_K, need_K = lookup(sel_K)

        def match(s_X, need_X, pos_Y):  # [X, Y]: needed selection x is held by slot y
            return (pos_Y[None, :] == s_X[:, None]) & need_X[:, None]

        # pass 1, slot chunks: the first slot holding each needed selection (hp: none)
        def first_slot(c, first_K):
            idx_C = iota(ch, c * ch)
            m_KC = match(sel_K, need_K, pos_ref[0, pl.ds(c * ch, ch)])
            return jnp.minimum(first_K, jnp.min(jnp.where(m_KC, idx_C[None, :], hp), axis=1))

        first_K = jax.lax.fori_loop(0, hp // ch, first_slot, jnp.full((kp,), hp, i32))
        hit_K = first_K < hp
        lost_K = need_K & ~hit_K & (host_K < 0)
        miss_K = need_K & ~hit_K & ~lost_K

        # pass 2, selection chunks: the slots hit this step, and how many misses precede each selection
        pos_H = pos_ref[0, :]

        def hits_and_counts(j, carry):
            hit_H, missno_K = carry
            s_C = sel_ref[0, pl.ds(j * ch, ch)]
            _, _, host_C, _, need_C = lookup(s_C)
            m_CH = match(s_C, need_C, pos_H).astype(i32)
            hit_H = jnp.maximum(hit_H, jnp.max(m_CH, axis=0))
            miss_C = need_C & (jnp.max(m_CH, axis=1) == 0) & (host_C >= 0)
            before_KC = (iota(ch, j * ch)[None, :] < kidx_K[:, None]) & miss_C[None, :]
            return hit_H, missno_K + jnp.sum(before_KC.astype(i32), axis=1)

        hit_H, missno_K = jax.lax.fori_loop(0, kp // ch, hits_and_counts,
                                            (jnp.zeros((hp,), i32), jnp.zeros((kp,), i32)))
        hidx_H = iota(hp)
        key_H = jnp.where((hit_H > 0) | (hidx_H >= h), _LAST, last_ref[0, :])
        target_K = jnp.minimum(missno_K, h - 1)
        now = step_ref[0]

        # pass 3, slot chunks: LRU rank of each slot, the miss that takes it, the slot updates
        def fill(c, hot_row_K):
            cs = pl.ds(c * ch, ch)
            idx_C, pos_C, last_C, hrows_C = iota(ch, c * ch), pos_ref[0, cs], last_ref[0, cs], hrows_ref[0, cs]
            hit_C = jnp.max(match(sel_K, need_K, pos_C).astype(i32), axis=0) > 0
            key_C = jnp.where(hit_C | (idx_C >= h), _LAST, last_C)
            before_CH = (key_H[None, :] < key_C[:, None]) | (
                (key_H[None, :] == key_C[:, None]) & (hidx_H[None, :] < idx_C[:, None]))
            rank_C = jnp.sum(before_CH.astype(i32), axis=1)
            fill_KC = (rank_C[None, :] == target_K[:, None]) & miss_K[:, None]
            take_KC = fill_KC | ((first_K[:, None] == idx_C[None, :]) & hit_K[:, None])
            filled_C = jnp.max(fill_KC.astype(i32), axis=0) > 0
            taken_C = jnp.max(take_KC.astype(i32), axis=0) > 0
            npos_ref[0, cs] = jnp.where(filled_C, jnp.sum(jnp.where(fill_KC, sel_K[:, None], 0), axis=0), pos_C)
            nlast_ref[0, cs] = jnp.where(taken_C, now, last_C)
            return hot_row_K + jnp.sum(jnp.where(take_KC, hrows_C[None, :], 0), axis=1)

        hot_row_K = jax.lax.fori_loop(0, hp // ch, fill, jnp.zeros((kp,), i32))
        served_K = hit_K | miss_K
        rows_ref[0, :] = jnp.where(res_K, dev_K * block_size + off_K, jnp.where(served_K, hot_row_K, -1))
        src_ref[0, :] = jnp.where(miss_K, host_K * block_size + off_K, -1)
        dst_ref[0, :] = jnp.where(miss_K, hot_row_K, -1)
        counts = [jnp.sum(x.astype(i32)) for x in (hit_K, miss_K, res_K, lost_K)]
        lane = iota(4)
        cnt_ref[0, :] = jnp.where(lane == 0, counts[0], jnp.where(lane == 1, counts[1],
                                                                   jnp.where(lane == 2, counts[2], counts[3])))

    whole = pl.BlockSpec()
    per_k = pl.BlockSpec((1, kp), lambda r: (r, 0))
    per_h = pl.BlockSpec((1, hp), lambda r: (r, 0))
    sds = jax.ShapeDtypeStruct
    rows, src, dst, cnt, npos, nlast = pl.pallas_call(
        kernel,
        out_shape=(sds((b, kp), i32), sds((b, kp), i32), sds((b, kp), i32), sds((b, 4), i32),
                   sds((b, hp), i32), sds((b, hp), i32)),
        grid=(b,),
        in_specs=[per_k, whole, whole, per_h, per_h, per_h, whole],
        out_specs=(per_k, per_k, per_k, pl.BlockSpec((1, 4), lambda r: (r, 0)), per_h, per_h),
        name="hisparse_resolve",  # the kernel's name in GPU profiles
        interpret=pallas_interpret() if interpret is None else interpret,
        compiler_params=pltriton.CompilerParams(num_warps=bsz.num_warps),
    )(sel, dev, host, pos, last, hrows, step)
    plan = ResolvePlan(rows[:, :k], src[:, :k], dst[:, :k], cnt[:, 0], cnt[:, 1], cnt[:, 2], cnt[:, 3])
    return plan, HotBuffer(npos[:, :h], nlast[:, :h], hot.rows)
