"""Decode context parallelism (DCP): the KV cache split by token over the ranks of a mesh axis.

Slot mapping (`DcpLayout`, N ranks, interleave I = vLLM's `cp_kv_cache_interleave_size`, block size B,
I dividing B): position t lives on rank `owner(t) = (t // I) % N` at local position
`local(t) = (t // (I N)) * I + t % I`; conversely local position l of rank r holds global position
`(l // I) * I N + r I + l % I`. A virtual block of B N tokens (index t // (B N)) maps to one physical
block of B slots on every rank, so all ranks share one block table: the local slot of t is
`block_table[req, t // (B N)] * B + local(t) % B`. Each rank stores ceil(S / (B N)) blocks of a context
of S tokens: 1/N of one device's ceil(S / B), plus at most one block.

Decode (`decode_local`, one rank inside `jax.shard_map`): the query (heads split over the axis, as under
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

Sparse decode: each rank scores its own indexer keys (`attention.indexer.index_scores_reference`), takes
a local top-k with `lax.top_k` (position order = local order on a rank, so its ties follow the total
order), all-gathers (score, global position) candidates and merges them exactly (`merge_topk`): a token in
the global top-k is always in its owner's local top-k under the same total order. Each rank then attends
only the selected rows it owns.

Prefill inside PCP x DCP (`pcp_dcp_prefill_local`): each layer, the new tokens' rows are all-gathered
(PCP) and each rank persists those it owns; then every rank all-gathers all shards into a temporary
full-context copy, runs the PCP attention for its own queries, and drops the copy (it is a temporary
inside the jitted step, so XLA frees it after the layer): only the persistent cache is divided by N.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from attention import indexer as indexer_ops
from attention import sparse_mla
from attention.common import slot_mapping
from attention.merge import merge
from parallel import pcp

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


def write_local(table_LX, rows_BTX, pos_BT, block_table_BM, layout: DcpLayout, rank):
    """Write the rows this rank owns into its table [L, X]; other ranks' positions and padding are
    skipped (mapped out of range, never onto the last slot)."""
    owner, slot = layout.slot_mapping(pos_BT, block_table_BM)
    mine = (owner == rank) & (slot >= 0)
    idx = jnp.where(mine, slot, table_LX.shape[0]).reshape(-1)
    return table_LX.at[idx].set(rows_BTX.reshape(idx.shape[0], -1).astype(table_LX.dtype), mode="drop")


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
    vals, idx = jax.lax.top_k(scores_sorted, k)
    return jnp.where(vals == -jnp.inf, -1, jnp.take_along_axis(pos_sorted, idx, axis=-1)).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------- decode
def _local_view(q_pos_BT, block_table_BM, layout: DcpLayout, rank):
    """This rank's local positions 0..L-1 (L = M * block_size): global positions [L], slots [B,L] (-1 =
    unallocated) and the causal validity mask [B,T,L]."""
    m = block_table_BM.shape[-1]
    bs = layout.block_size
    lp = jnp.arange(m * bs, dtype=jnp.int32)
    g_L = layout.global_position(lp, rank)
    phys_BL = jnp.take(block_table_BM, lp // bs, axis=1)
    slot_BL = jnp.where(phys_BL >= 0, phys_BL * bs + lp % bs, -1)
    valid_BTL = (g_L[None, None, :] <= q_pos_BT[:, :, None]) & (slot_BL >= 0)[:, None, :]
    return g_L, slot_BL, valid_BTL


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
    vals, idx = jax.lax.top_k(scores_BTL, min(topk, scores_BTL.shape[-1]))
    return vals, jnp.where(vals == -jnp.inf, -1, layout.global_position(idx, rank)).astype(jnp.int32)


def global_topk(cand_s_BTC, cand_p_BTC, topk: int, *, axis):
    """All-gather every rank's local candidates (scores, global positions [B,T,k_l]) and merge them into the
    exact global top-k [B,T,min(topk, N k_l)] (`merge_topk`); the result is the same on every rank."""
    all_s = jax.lax.all_gather(cand_s_BTC, axis, axis=2, tiled=True, to="invarying")
    all_p = jax.lax.all_gather(cand_p_BTC, axis, axis=2, tiled=True, to="invarying")
    return merge_topk(all_s, all_p, topk)


def local_topk(qi_BTHI, w_BTH, keys_LI, q_pos_BT, block_table_BM, layout: DcpLayout, rank, topk: int):
    """One rank's indexer over its own keys: -> (scores [B,T,k_l] f32, global positions [B,T,k_l] int32,
    -1 / -inf = none; k_l = min(topk, L)) and the number of (query, key) pairs scored."""
    _, slot_BL, valid_BTL = _local_view(q_pos_BT, block_table_BM, layout, rank)
    keys_BLI = jnp.take(keys_LI, jnp.maximum(slot_BL, 0), axis=0)
    limit_BT = local_causal_limit(q_pos_BT, layout, rank)
    s_BTL = indexer_ops.index_scores_reference(qi_BTHI, w_BTH, keys_BLI, limit_BT)
    s_BTL = jnp.where((slot_BL >= 0)[:, None, :], s_BTL, -jnp.inf)
    vals, pos = local_candidates(s_BTL, layout, rank, topk)
    return vals, pos, jnp.sum(valid_BTL, dtype=jnp.int32)


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


def decode_local(q_lat_BTHR, q_pe_BTHP, q_pos_BT, block_table_BM, rows_LX, *, layout: DcpLayout, axis,
                 scale: float, backend: str, index=None, topk_BTK=None):
    """DCP attention for a decode batch on one rank (call inside `jax.shard_map` over `axis`).

    q_lat [B,T,Hl,R] and q_pe [B,T,Hl,P]: this rank's Hl = H/N heads; q_pos [B,T] (-1 = padding query);
    block_table [B,M] (same on every rank); rows [L,R+P]: this rank's table. Rows attended:
    - dense (index=None, topk_BTK=None): every cached position <= q_pos;
    - sparse with the indexer: index = (qi [B,T,HI,DI], w [B,T,HI], keys [L,DI], topk): local top-k,
      exact global merge, attend the selected rows this rank owns;
    - sparse with given selections topk_BTK [B,T,K] (global positions, -1 = none; IndexShare layers).
    -> (out [B,T,Hl,R] f32, lse [B,T,Hl] f32, topk [B,T,K] int32 or None, counters {name: int32 [1]}).
    """
    rank = jax.lax.axis_index(axis)
    r = q_lat_BTHR.shape[-1]
    q = jnp.concatenate([q_lat_BTHR, q_pe_BTHP.astype(q_lat_BTHR.dtype)], axis=-1)  # one message, not two
    q = jax.lax.all_gather(q, axis, axis=2, tiled=True)
    q_lat, q_pe = q[..., :r], q[..., r:]
    counters = {}
    if index is not None:
        qi, w, keys_LI, topk = index
        cand_s, cand_p, pairs = local_topk(qi, w, keys_LI, q_pos_BT, block_table_BM, layout, rank, topk)
        cap = block_table_BM.shape[-1] * layout.virtual_block
        topk_BTK = global_topk(cand_s, cand_p, min(topk, cap), axis=axis)
        counters["indexer_pairs"] = pairs[None]
    if topk_BTK is None:
        _, slot_BL, valid_BTL = _local_view(q_pos_BT, block_table_BM, layout, rank)
        slots = jnp.where(valid_BTL, slot_BL[:, None, :], -1)
    else:
        owner, slot = layout.slot_mapping(topk_BTK, block_table_BM[:, None, :])
        slots = jnp.where((owner == rank) & (slot >= 0) & (q_pos_BT[..., None] >= 0), slot, -1)
    counters["mla_rows_attended"] = jnp.sum(slots >= 0, dtype=jnp.int32)[None]
    out, lse = sparse_mla.sparse_mqa(q_lat, q_pe, sparse_mla.SlotRows.plain(rows_LX, slots, q_lat.shape[-1]), scale)
    out, lse = combine(out, lse, axis=axis, backend=backend)
    return out, lse, topk_BTK, counters


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """out [B,T,H,R] f32, lse [B,T,H] f32 (merged over ranks), topk [B,T,K] global positions (sparse
    decode) or None, counters {name: int32 [N]}: each rank's work."""

    out: jax.Array
    lse: jax.Array
    topk: jax.Array | None
    counters: dict


def _int32(x):
    """Index arrays as int32 whatever their source (numpy int64, lists), so every call hits one program."""
    return x.astype(jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32)


def pad_heads(x_BTH_, n: int):
    """Pad axis 2 (heads) with zeros to a multiple of n."""
    h = x_BTH_.shape[2]
    hp = -(-h // n) * n
    if hp == h:
        return x_BTH_
    return jnp.pad(x_BTH_, [(0, 0), (0, 0), (0, hp - h)] + [(0, 0)] * (x_BTH_.ndim - 3))


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "layout", "scale", "backend", "topk"))
def _decode_jit(q_lat, q_pe, q_pos, block_table, rows, qi, w, keys, topk_sel, *, mesh, axis, layout, scale, backend,
                topk):
    heads = P(None, None, axis, None)
    h, n = q_lat.shape[2], mesh.shape[axis]
    q_lat, q_pe = pad_heads(q_lat, n), pad_heads(q_pe, n)

    def body(q_lat, q_pe, q_pos, block_table, rows, qi, w, keys, topk_sel):
        idx = (qi, w, keys, topk) if keys is not None else None
        return decode_local(q_lat, q_pe, q_pos, block_table, rows, layout=layout, axis=axis, scale=scale,
                            backend=backend, index=idx, topk_BTK=topk_sel)

    out, lse, sel, counters = jax.shard_map(body, mesh=mesh,
                                            in_specs=(heads, heads, P(), P(), P(axis), P(), P(), P(axis), P()),
                                            out_specs=(heads, P(None, None, axis), P(), P(axis)))(
        q_lat, q_pe, q_pos, block_table, rows, qi, w, keys, topk_sel)
    return out[:, :, :h], lse[:, :, :h], sel, counters


def decode(mesh, q_lat_BTHR, q_pe_BTHP, q_pos_BT, block_table_BM, rows_NLX, *, layout: DcpLayout, scale: float,
           backend: str = "ag_rs", index=None, topk_BTK=None, axis: str = "cp") -> DecodeResult:
    """DCP decode attention over mesh axis `axis` (global arrays in, global arrays out).

    q_lat [B,T,H,R], q_pe [B,T,H,P] (all heads; sharded by head inside, zero-padded to a multiple of N),
    q_pos [B,T], block_table [B,M], rows [N*L, R+P] (rank r's table = rows r*L..(r+1)*L-1, e.g.
    `shard_cache(...).reshape(-1, X)`); index = (qi [B,T,HI,DI], w [B,T,HI], keys [N*L,DI], topk) for
    sparse decode, or topk_BTK [B,T,K] given. See `decode_local`.
    """
    check_backend(backend)
    n = mesh.shape[axis]
    if layout.size != n:
        raise ValueError(f"layout.size ({layout.size}) must equal the size of mesh axis {axis!r} ({n})")
    if rows_NLX.shape[0] % n:
        raise ValueError(f"rows has {rows_NLX.shape[0]} slots, not a multiple of the {n} ranks")
    if index is not None and topk_BTK is not None:
        raise ValueError("give either index (run the indexer) or topk_BTK (reuse selections), not both")
    qi = w = keys = None
    topk = 0
    if index is not None:
        qi, w, keys, topk = index
        _check_positive("topk", topk)
    out, lse, sel, counters = _decode_jit(
        q_lat_BTHR, q_pe_BTHP, _int32(q_pos_BT), _int32(block_table_BM), rows_NLX, qi, w, keys,
        None if topk_BTK is None else _int32(topk_BTK),
        mesh=mesh, axis=axis, layout=layout, scale=scale, backend=backend, topk=topk)
    return DecodeResult(out, lse, sel, counters)


# -------------------------------------------------------------------------------------- PCP x DCP prefill
def gather_full_copy(table_LX, block_table_M, layout: DcpLayout, *, axis):
    """`full_copy` of one request's whole block table [M] -> [M * B * N, X]."""
    cap = block_table_M.shape[-1] * layout.virtual_block
    return full_copy(table_LX, block_table_M[None], layout, axis=axis, num_positions=cap)[0]


def pcp_dcp_prefill_local(q_lat_CHR, q_pe_CHP, qi_CHI, w_CH, rows_new_CX, keys_new_CI, pos_all_L, block_table_M,
                          rows_LX, keys_LI, *, layout: DcpLayout, axis, topk: int, scale: float, block: int):
    """One prefill layer of one request under PCP x DCP on one rank (inside `jax.shard_map` over `axis`).

    Own PCP tokens (C slots): q_lat [C,H,R], q_pe [C,H,P], qi [C,HI,DI], w [C,HI], new rows [C,R+P], new
    keys [C,DI]; pos_all [N*C] positions of every rank's slots (-1 = padding); block_table [M]; this rank's
    DCP tables rows [L,R+P], keys [L,DI] -> (out [C,H,R], lse [C,H], topk [C,K], rows, keys updated,
    counters).
    """
    c = q_lat_CHR.shape[0]
    rank = jax.lax.axis_index(axis)
    pos_C = jax.lax.dynamic_slice_in_dim(pos_all_L, rank * c, c)
    new_rows = jax.lax.all_gather(rows_new_CX, axis, tiled=True)  # PCP: every rank sees every new row
    new_keys = jax.lax.all_gather(keys_new_CI, axis, tiled=True)
    rows_LX = write_local(rows_LX, new_rows[None], pos_all_L[None], block_table_M[None], layout, rank)
    keys_LI = write_local(keys_LI, new_keys[None], pos_all_L[None], block_table_M[None], layout, rank)
    full_rows = gather_full_copy(rows_LX, block_table_M, layout, axis=axis)
    full_keys = gather_full_copy(keys_LI, block_table_M, layout, axis=axis)
    out, lse, sel, counters = pcp.attend_own_queries(q_lat_CHR, q_pe_CHP, qi_CHI, w_CH, pos_C, full_rows, full_keys,
                                                     topk=topk, scale=scale, block=block)
    return out, lse, sel, rows_LX, keys_LI, counters


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "layout", "topk", "scale", "block"))
def _pcp_dcp_jit(q_lat, q_pe, qi, w, rows_new, keys_new, pos_all, block_table, rows, keys, *, mesh, axis, layout,
                 topk, scale, block):
    body = functools.partial(pcp_dcp_prefill_local, layout=layout, axis=axis, topk=topk, scale=scale, block=block)
    tok = P(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 6 + (P(), P(), tok, tok),
                         out_specs=(tok, tok, tok, tok, tok, tok))(
        q_lat, q_pe, qi, w, rows_new, keys_new, pos_all, block_table, rows, keys)


def pcp_dcp_prefill(mesh, split: pcp.PcpSplit, q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI,
                    block_table_M, rows_NLX, keys_NLI, *, layout: DcpLayout, start: int, topk: int, scale: float,
                    block: int = 64, axis: str = "cp"):
    """Prefill of T new tokens at positions [start, start + T) of one request under PCP x DCP on `axis`.

    Per-token inputs in prompt order ([T, ...] as in `pcp.prefill_layer`); block_table [M] with room for
    start + split.padded_length positions; DCP tables rows [N*L,R+P], keys [N*L,DI] (rank-major) ->
    pcp.PrefillResult whose cache_rows / cache_keys are the updated DCP tables.
    """
    n = mesh.shape[axis]
    for name, v in (("split.n", split.n), ("layout.size", layout.size)):
        if v != n:
            raise ValueError(f"{name} ({v}) must equal the size of mesh axis {axis!r} ({n})")
    if split.length != q_lat_THR.shape[0]:
        raise ValueError(f"split.length ({split.length}) must equal the number of tokens ({q_lat_THR.shape[0]})")
    cap = jnp.shape(block_table_M)[-1] * layout.virtual_block
    if cap < start + split.padded_length:
        raise ValueError(f"block_table covers {cap} positions < start + padded prompt = {start + split.padded_length}")
    pos_all = jnp.asarray(split.positions(start).reshape(-1))
    args = [split.shard(a) for a in (q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI)]
    out, lse, sel, rows, keys, counters = _pcp_dcp_jit(*args, pos_all, _int32(block_table_M), rows_NLX,
                                                       keys_NLI, mesh=mesh, axis=axis, layout=layout, topk=topk,
                                                       scale=scale, block=block)
    return pcp.PrefillResult(split.unshard(out), split.unshard(lse), split.unshard(sel), rows, keys, counters)
