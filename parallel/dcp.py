"""Decode context parallelism (DCP): the KV cache split by token over the ranks of a mesh axis.

Slot mapping (`DcpLayout`, N ranks, interleave I = vLLM's `cp_kv_cache_interleave_size`, block size B,
I dividing B): position t lives on rank `owner(t) = (t // I) % N` at local position
`local(t) = (t // (I N)) * I + t % I`; conversely local position l of rank r holds global position
`(l // I) * I N + r I + l % I`. A virtual block of B N tokens (index t // (B N)) maps to one physical
block of B slots on every rank, so all ranks share one block table: the local slot of t is
`block_table[req, t // (B N)] * B + local(t) % B`. Each rank stores ceil(S / (B N)) blocks of a context
of S tokens: 1/N of one device's ceil(S / B), plus at most one block.

This module holds the layout and the communication parts `parallel.cp_cache.CpKVCache` (the cache the
engine's DCP steps use) is built from, and imports nothing from `parallel.cp_cache`; the layer-level
entry points that run that class on one layer inside `jax.shard_map` (`decode`, `pcp_dcp_prefill`) are
in `parallel.layers`.

Decode (`parallel.layers.decode`): the query (heads split over the axis, as under
tensor parallelism) is all-gathered so the rank holds all heads; the rank attends its own rows and gets a
partial (out, lse) per head; the partials are combined exactly with the log-sum-exp merge, by one of two
communication backends (`BACKENDS`):
- "ag_rs": all-gather the LSEs, scale the own output by exp(lse_r - lse) (0 for lse_r = -inf), then a
  reduce-scatter over heads sums the scaled outputs and leaves each rank its own heads (3 collectives with
  the query all-gather);
- "a2a": one all-to-all of packed [out | lse] by head group, then `attention.merge.merge` on the N parts
  each rank receives for its heads (2 collectives with the query all-gather).
Heads are padded with zero queries to a multiple of N (a tiny model may have fewer heads than ranks).
A rank owning none of a query's rows has lse = -inf and weight 0 in both backends, never NaN.

Sparse decode: each rank scores its own indexer keys with the single-device op (the global causal mask
becomes a local one, `local_causal_limit`), takes a local top-k with `lax.top_k` (position order = local order on a rank, so its ties follow the total
order), all-gathers (score, global position) candidates and merges them exactly (`merge_topk`): a token in
the global top-k is always in its owner's local top-k under the same total order. Each rank then attends
only the selected rows it owns.

Prefill inside PCP x DCP (`parallel.layers.pcp_dcp_prefill`): each layer, the new tokens' rows are
all-gathered (PCP) and each rank persists those it owns; then every rank all-gathers all shards into a
temporary full-context copy (`full_copy`), runs the PCP indexer and attention for its own queries, and
drops the copy (it is a temporary inside the jitted step, so XLA frees it after the layer): only the
persistent cache is divided by N.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention.common import slot_mapping, top_k
from attention.merge import merge

BACKENDS = ("ag_rs", "a2a")


def _check_positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"dcp_comm_backend must be one of {BACKENDS}, got {backend!r}")
    return backend


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    """Round-robin KV placement over `size` ranks with `interleave` consecutive tokens per rank turn.

    All methods are elementwise integer arithmetic on numpy or jax int arrays (positions < 0 are padding:
    `owner` and `local_position` are meaningless for them, `slot_mapping` returns -1).
    """

    size: int
    block_size: int = 64
    interleave: int = 1

    def __post_init__(self):
        _check_positive("decode_context_parallel_size (DcpLayout.size)", self.size)
        _check_positive("block_size (DcpLayout.block_size)", self.block_size)
        _check_positive("cp_kv_cache_interleave_size (DcpLayout.interleave)", self.interleave)
        if self.block_size % self.interleave:
            raise ValueError(f"cp_kv_cache_interleave_size ({self.interleave}) must divide block_size "
                             f"({self.block_size}): a rank's run of interleaved tokens must not cross a block")

    @property
    def virtual_block(self) -> int:
        """Tokens per virtual block (B N): one physical block of B slots on each rank."""
        return self.block_size * self.size

    def owner(self, pos):
        return (pos // self.interleave) % self.size

    def local_position(self, pos):
        i = self.interleave
        return (pos // (i * self.size)) * i + pos % i

    def global_position(self, local, rank):
        i = self.interleave
        return (local // i) * (i * self.size) + rank * i + local % i

    def local_length(self, seq_len, rank):
        """How many of positions [0, seq_len) rank `rank` owns."""
        i, n = self.interleave, self.size
        full_rounds = seq_len // (i * n)
        rest = seq_len - full_rounds * i * n
        xp = jnp if isinstance(seq_len, jax.Array) else np
        return full_rounds * i + xp.clip(rest - rank * i, 0, i)

    def blocks_per_rank(self, seq_len: int) -> int:
        """Physical blocks each rank needs for a context of seq_len tokens: ceil(seq_len / (B N))."""
        return -(-seq_len // self.virtual_block)

    def slot_mapping(self, pos, block_table):
        """pos [..., T] int, block_table [..., M] int (virtual block -> physical block id on every rank,
        -1 = unallocated) -> (owner [..., T], local slot [..., T]); slot -1 where pos < 0 or no block."""
        xp = jnp if isinstance(pos, jax.Array) or isinstance(block_table, jax.Array) else np
        vb = xp.where(pos >= 0, pos // self.virtual_block, 0)
        vb = xp.clip(vb, 0, block_table.shape[-1] - 1)
        phys = xp.take_along_axis(block_table, vb, axis=-1)
        in_table = (pos >= 0) & (pos // self.virtual_block < block_table.shape[-1]) & (phys >= 0)
        slot = phys * self.block_size + self.local_position(pos) % self.block_size
        return self.owner(pos), xp.where(in_table, slot, -1)


def shard_cache(rows_BSX, seq_lens_B, block_table_BM, layout: DcpLayout, num_blocks: int) -> np.ndarray:
    """Distribute a single-device cache over the ranks (host side, for tests and re-layout).

    rows [B,S,X] (request b's position s), seq_lens [B], block_table [B,M] -> per-rank tables
    [N, num_blocks * block_size, X] (zeros where no token is stored).
    """
    rows_BSX = np.asarray(rows_BSX)
    b, s, x = rows_BSX.shape
    pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
    pos = np.where(pos < np.asarray(seq_lens_B)[:, None], pos, -1)
    owner, slot = layout.slot_mapping(pos, np.asarray(block_table_BM))
    out = np.zeros((layout.size, num_blocks * layout.block_size, x), rows_BSX.dtype)
    keep = slot >= 0
    if np.any(slot[keep] >= num_blocks * layout.block_size):
        raise ValueError(f"block_table refers to blocks >= num_blocks ({num_blocks})")
    flat = owner[keep] * num_blocks * layout.block_size + slot[keep]
    if np.unique(flat).size != flat.size:
        raise ValueError("block_table maps two tokens to one slot (requests must not share physical blocks)")
    out[owner[keep], slot[keep]] = rows_BSX[keep]
    return out


# ------------------------------------------------------------------------------------------------ combine
def combine_ag_rs(out_BTHR, lse_BTH, *, axis):
    """ag_rs: all-gather LSEs, scale own output by its merge weight, reduce-scatter over heads.

    out [B,T,H,R], lse [B,T,H] (this rank's partial, all H heads; H divisible by N) -> (out [B,T,H/N,R],
    lse [B,T,H/N]) merged over the ranks for this rank's heads. Weights are those of `merge`: a part with
    lse = -inf weighs 0; if every part is empty the output is 0 and the lse -inf.
    """
    n = jax.lax.axis_size(axis)
    h = lse_BTH.shape[-1]
    lse_NBTH = jax.lax.all_gather(lse_BTH, axis)
    m = jnp.max(lse_NBTH, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.where(jnp.isfinite(lse_NBTH), jnp.exp(lse_NBTH - m), 0.0), axis=0)
    safe_total = jnp.where(total > 0, total, 1.0)
    w_BTH = jnp.where(jnp.isfinite(lse_BTH), jnp.exp(lse_BTH - m), 0.0) / safe_total
    scaled = jnp.where(w_BTH[..., None] > 0, out_BTHR, 0.0) * w_BTH[..., None]
    out_local = jax.lax.psum_scatter(scaled, axis, scatter_dimension=2, tiled=True)
    lse_full = jnp.where(total > 0, jnp.log(safe_total) + m, -jnp.inf)
    rank = jax.lax.axis_index(axis)
    hl = h // n
    return out_local, jax.lax.dynamic_slice_in_dim(lse_full, rank * hl, hl, axis=2)


def combine_a2a(out_BTHR, lse_BTH, *, axis):
    """a2a: one all-to-all of packed [out | lse] by head group, then a local exact merge.

    Same shapes and result as `combine_ag_rs`.
    """
    n = jax.lax.axis_size(axis)
    b, t, h, r = out_BTHR.shape
    packed = jnp.concatenate([out_BTHR.astype(jnp.float32), lse_BTH[..., None].astype(jnp.float32)], axis=-1)
    packed_NBTHX = jnp.moveaxis(packed.reshape(b, t, n, h // n, r + 1), 2, 0)
    recv = jax.lax.all_to_all(packed_NBTHX, axis, 0, 0, tiled=True)  # [N (source rank), B, T, H/N, R+1]
    return merge(recv[..., :r], recv[..., r], axis=0)


def combine(out_BTHR, lse_BTH, *, axis, backend: str):
    check_backend(backend)
    return (combine_ag_rs if backend == "ag_rs" else combine_a2a)(out_BTHR, lse_BTH, axis=axis)


def combine_all_heads(out_BTHR, lse_BTH, *, axis, backend: str):
    """Exact merge when every rank holds all H heads (the engine runs attention projections replicated,
    not head-split): heads are zero-padded to a multiple of N, merged with `combine` (each rank gets its
    H/N heads), then all-gathered back -> (out [B,T,H,R], lse [B,T,H]), the same on every rank. The last
    all-gather is what replicated projections cost over vLLM's head-split (TP) layout, where each rank
    keeps its heads for a row-parallel o_proj."""
    n = jax.lax.axis_size(axis)
    h = lse_BTH.shape[-1]
    out, lse = combine(pad_heads(out_BTHR, n), pad_heads(lse_BTH, n), axis=axis, backend=backend)
    out = jax.lax.all_gather(out, axis, axis=2, tiled=True, to="invarying")
    lse = jax.lax.all_gather(lse, axis, axis=2, tiled=True, to="invarying")
    return out[:, :, :h], lse[:, :, :h]


# ------------------------------------------------------------------------------------------------- top-k
def merge_topk(scores_BTC, pos_BTC, topk: int):
    """Exact global top-k from per-rank candidates: scores [B,T,C] f32 (-inf = none), global positions
    [B,T,C] int32 (-1 = none; each valid position at most once) -> positions [B,T,min(topk, C)] int32 in
    the total order (score desc, position asc), -1 padded.

    The candidates are sorted by position first, so `lax.top_k` (ties -> lowest index) breaks score ties
    by position, exactly as `attention.indexer.select_topk` does on a position-indexed row (including its
    float order, where +0.0 ranks above -0.0).
    """
    pos_sorted, scores_sorted = jax.lax.sort((pos_BTC, scores_BTC), dimension=-1, num_keys=1)
    k = min(topk, scores_BTC.shape[-1])
    vals, idx = top_k(scores_sorted, k)
    return jnp.where(vals == -jnp.inf, -1, jnp.take_along_axis(pos_sorted, idx, axis=-1)).astype(jnp.int32)


# ------------------------------------------------------------------------------------------ local parts
def local_causal_limit(q_pos, layout: DcpLayout, rank):
    """The last local position of `rank` a query at global position q_pos may see: local position l holds
    global position g(l), increasing in l, so g(l) <= q_pos iff l < local_length(q_pos + 1). -> int32 like
    q_pos; -1 for a padding query (q_pos < 0) or when the rank owns no position <= q_pos. Passing this as
    the query position to a single-device indexer op applies the global causal mask on a local shard."""
    return jnp.where(q_pos >= 0, layout.local_length(q_pos + 1, rank) - 1, -1).astype(jnp.int32)


def local_window(window: int, layout: DcpLayout) -> int:
    """Local positions a rank must read to cover global positions [0, window): whole virtual blocks."""
    return layout.blocks_per_rank(window) * layout.block_size


def local_candidates(scores_BTL, layout: DcpLayout, rank, topk: int):
    """A rank's local top-k over its local positions 0..L-1: scores [B,T,L] f32 (-inf = not visible) ->
    (scores [B,T,k_l], global positions [B,T,k_l] int32; -inf / -1 = none; k_l = min(topk, L)). Local order
    is global order on one rank, so `lax.top_k`'s lowest-index tie break is the total order."""
    vals, idx = top_k(scores_BTL, min(topk, scores_BTL.shape[-1]))
    return vals, jnp.where(vals == -jnp.inf, -1, layout.global_position(idx, rank)).astype(jnp.int32)


def global_topk(cand_s_BTC, cand_p_BTC, topk: int, *, axis):
    """All-gather every rank's local candidates (scores, global positions [B,T,k_l]) and merge them into the
    exact global top-k [B,T,min(topk, N k_l)] (`merge_topk`); the result is the same on every rank."""
    all_s = jax.lax.all_gather(cand_s_BTC, axis, axis=2, tiled=True, to="invarying")
    all_p = jax.lax.all_gather(cand_p_BTC, axis, axis=2, tiled=True, to="invarying")
    return merge_topk(all_s, all_p, topk)


def full_copy(table_LX, block_table_BM, layout: DcpLayout, *, axis, num_positions: int):
    """The temporary full-context copy of PCP x DCP prefill: every rank gathers its rows of positions
    [0, num_positions) of each row of the batch (through the shared block table [B,M]), all ranks
    all-gather them, and each lays them out by global position -> [B, num_positions, X] in the table's
    storage format (zeros where no block is allocated). Each rank sends local_window(num_positions) rows
    per batch row: the batch's window, not the pool, but padding rows and rows shorter than the window
    are sent too (zeros / junk), so a padded engine batch moves B_pad x window, not the sum of the
    requests' contexts (`parallel.comm.dcp_full_copy_bytes` counts one request's blocks)."""
    bs = layout.block_size
    nl = local_window(num_positions, layout)
    lp = jnp.broadcast_to(jnp.arange(nl, dtype=jnp.int32), (block_table_BM.shape[0], nl))
    slots_BL = slot_mapping(block_table_BM, lp, bs)
    rows_BLX = jnp.where((slots_BL >= 0)[..., None], jnp.take(table_LX, jnp.maximum(slots_BL, 0), axis=0), 0)
    all_NBLX = jax.lax.all_gather(rows_BLX.astype(table_LX.dtype), axis, to="invarying")
    g = jnp.arange(num_positions, dtype=jnp.int32)
    return jnp.moveaxis(all_NBLX[layout.owner(g), :, layout.local_position(g)], 0, 1)  # [B, S, X]


def pad_heads(x_BTH_, n: int):
    """Pad axis 2 (heads) with zeros to a multiple of n."""
    h = x_BTH_.shape[2]
    hp = -(-h // n) * n
    if hp == h:
        return x_BTH_
    return jnp.pad(x_BTH_, [(0, 0), (0, 0), (0, hp - h)] + [(0, 0)] * (x_BTH_.ndim - 3))
