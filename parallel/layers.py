"""One attention layer run through `parallel.cp_cache.CpKVCache` on a mesh: global arrays in and out.

The layer-level drivers of PCP and DCP, for tests, benchmarks and experiments. Each runs the cache the
engine's context-parallel steps use (`CpKVCache`, over plain float32 tables: `cp_cache.plain_cache`) on
one layer inside `jax.shard_map`, so what they measure (outputs, work counters, traced bytes) is the
engine's code. The primitives they are built from (layouts, slot mappings, merges) live in
`parallel.pcp` and `parallel.dcp`, which import nothing from `parallel.cp_cache`: this module sits above
all three.

PCP prefill (`prefill_layer`, `CpKVCache(tokens_split=True)`):
1. the new latent KV rows and indexer keys of each rank's tokens (and their positions) are all-gathered
   over the axis and written into every rank's copy of the cache;
2. each rank runs the lightning indexer for its own queries only, causal tiles over the whole context
   (`attention.indexer.topk_causal_blocked`), with an exact top-k in the total order (score
   descending, position ascending);
3. each rank's queries attend their selected rows with all heads (`attention.sparse_mla.sparse_mqa`).
Outputs come back in the split layout and are restored to prompt order (`PcpSplit.unshard`). Work
counters (`CpKVCache.counters`): the (query, key) pairs each rank's indexer scored (causal pairs, and the
pairs of the key blocks its loop visited, the padded work of a tiled kernel) and the selected rows its
sparse attention read. The benchmark's load balance is measured from these counters.

DCP decode (`decode`, `CpKVCache(dcp=True, heads_split=True)`): the query (heads split over the axis, as
under tensor parallelism) is all-gathered so the rank holds all heads; the rank attends its own rows
and the partials merge exactly by log-sum-exp (`parallel.dcp.combine`, backend "ag_rs" or "a2a"); sparse
decode merges the ranks' local top-k candidates exactly (`parallel.dcp.global_topk`).

PCP x DCP prefill (`pcp_dcp_prefill`): the new tokens' rows are all-gathered (PCP) and each rank
persists those it owns in its DCP shard; every rank all-gathers all shards into a temporary
full-context copy (`parallel.dcp.full_copy`), runs the PCP indexer and attention for its own queries,
and drops the copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from parallel.cp_cache import CpKVCache, plain_cache, zero_counters
from parallel.dcp import DcpLayout, _check_positive, check_backend, local_window, pad_heads
from parallel.pcp import PcpSplit


# ------------------------------------------------------------------------------------------ PCP prefill
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """Outputs of `prefill_layer`, in prompt order: out [T,H,R], lse [T,H], topk [T,K] (global positions),
    the updated cache tables (PCP: replicated rows [S,R+P] and keys [S,DI]; PCP x DCP: the rank-major DCP
    tables), and the work counters {name: int32 [N, 2]} (`parallel.cp_cache.counter_totals` -> int64 [N])."""

    out: jax.Array
    lse: jax.Array
    topk: jax.Array
    cache_rows: jax.Array
    cache_keys: jax.Array
    counters: dict


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "topk", "scale", "block", "layout"))
def prefill_jit(q_lat, q_pe, qi, w, rows_new, keys_new, pos, block_table, cache_rows, cache_keys, *, mesh, axis, topk,
                scale, block, layout=None):
    """One prefill layer through `CpKVCache` on `mesh` (inputs in split layout, rank-major on axis 0; pos
    [N * 2C] the slots' positions). layout None: PCP over a replicated cache of one request (rows [S, R+P]
    and keys [S, DI] in position order, block_table [1, 1] = one page); a `parallel.dcp.DcpLayout`: PCP x
    DCP over the rank-major DCP tables [N * L, ...] under block_table [1, M]. -> (out, lse, topk in split
    layout; the updated tables; counters {name: int32 [N]})."""
    n, r = mesh.shape[axis], q_lat.shape[-1]
    dcp = layout is not None
    block_size = layout.block_size if dcp else cache_rows.shape[0]
    window = block_table.shape[1] * block_size * (n if dcp else 1)

    def body(q_lat, q_pe, qi, w, rows_new, keys_new, pos, block_table, rows, keys, counters):
        cache = CpKVCache(plain_cache(rows, keys, block_table, block_size, r), axis, n, tokens_split=True, dcp=dcp,
                          interleave=layout.interleave if dcp else 1, index_block=block, counters=counters)
        pos = pos[None]
        cache = cache.write_packed("mla", 0, rows_new[None], pos).write_packed("index", 0, keys_new[None], pos)
        sel, cache = cache.select(0, qi[None], w[None], pos, topk, window=window, impl="auto")
        out, lse, cache = cache.attend_lse(0, q_lat[None], q_pe[None], sel, scale, window=window, full=True,
                                           impl="auto")
        return out[0], lse[0], sel[0], cache.local.mla[0], cache.local.index[0], cache.counters

    tok, kv = P(axis), (P(axis) if dcp else P())
    counters = zero_counters(n)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 7 + (P(), kv, kv, tok),
                         out_specs=(tok, tok, tok, kv, kv, tok), check_vma=False)(
        q_lat, q_pe, qi, w, rows_new, keys_new, pos, block_table, cache_rows, cache_keys, counters)


def prefill_layer(mesh, split: PcpSplit, q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI, cache_rows_SX,
                  cache_keys_SI, *, start: int = 0, topk: int, scale: float, block: int = 64,
                  axis: str = "cp") -> PrefillResult:
    """PCP for one attention layer of a prompt whose T tokens occupy positions [start, start + T).

    Inputs in prompt order (per token: q_lat [T,H,R], q_pe [T,H,P], indexer qi [T,HI,DI] and w [T,HI], new
    cache rows [T,R+P] and keys [T,DI]); cache rows [S,R+P] and keys [S,DI] (float32, position order)
    hold positions < start (S >= start + split.padded_length). Splits the tokens with `split` over mesh
    axis `axis`, runs the layer on every rank (`prefill_jit`) and restores the prompt order.
    """
    check_prefill_args(mesh, axis, split, q_lat_THR, block)
    if cache_rows_SX.shape[0] < start + split.padded_length:
        raise ValueError(f"cache capacity {cache_rows_SX.shape[0]} < start + padded prompt = "
                         f"{start + split.padded_length}")
    return run_split(split, start, (q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI),
                     np.zeros((1, 1), np.int32), cache_rows_SX, cache_keys_SI, mesh=mesh, axis=axis, topk=topk,
                     scale=scale, block=block)


def check_prefill_args(mesh, axis: str, split: PcpSplit, q_lat_THR, block) -> None:
    n = mesh.shape[axis]
    if split.n != n:
        raise ValueError(f"split.n ({split.n}) must equal the size of mesh axis {axis!r} ({n})")
    if split.length != q_lat_THR.shape[0]:
        raise ValueError(f"split.length ({split.length}) must equal the number of tokens ({q_lat_THR.shape[0]})")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def run_split(split: PcpSplit, start: int, per_token, block_table, rows, keys, **kw) -> PrefillResult:
    """Permute the per-token inputs into the split layout, run `prefill_jit`, restore the prompt order."""
    pos = jnp.asarray(split.positions(start).reshape(-1))
    # Host-side permutation for numpy inputs; the jitted step sees only split-layout shapes, so prompts of
    # one chunk bucket share its compiled program.
    args = [split.shard(a) for a in per_token]
    out, lse, sel, rows, keys, counters = prefill_jit(*args, pos, jnp.asarray(block_table, jnp.int32), rows, keys,
                                                      **kw)
    return PrefillResult(split.unshard(out), split.unshard(lse), split.unshard(sel), rows, keys, counters)


# ------------------------------------------------------------------------------------------- DCP decode
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


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "layout", "scale", "backend", "topk"))
def _decode_jit(q_lat, q_pe, q_pos, block_table, rows, qi, w, keys, topk_sel, *, mesh, axis, layout, scale, backend,
                topk):
    heads = P(None, None, axis, None)
    h, n, r = q_lat.shape[2], mesh.shape[axis], q_lat.shape[-1]
    q_lat, q_pe = pad_heads(q_lat, n), pad_heads(q_pe, n)
    window = block_table.shape[-1] * layout.virtual_block

    def body(q_lat, q_pe, q_pos, block_table, rows, qi, w, keys, topk_sel, counters):
        q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)  # one message, not two
        q = jax.lax.all_gather(q, axis, axis=2, tiled=True)  # heads split (as under TP) -> all heads
        cache = CpKVCache(plain_cache(rows, keys, block_table, layout.block_size, r), axis, n, dcp=True,
                          interleave=layout.interleave, backend=backend, heads_split=True, counters=counters)
        if keys is not None:
            sel, cache = cache.select(0, qi, w, q_pos, topk, window=window, impl="auto")
        elif topk_sel is None:  # dense: every position <= the query's, each rank over its own ones only
            lay = cache.layout("mla")
            g = lay.global_position(jnp.arange(local_window(window, lay), dtype=jnp.int32), cache._rank())
            sel = jnp.where(g <= q_pos[..., None], g, -1)
        else:
            sel = jnp.where(q_pos[..., None] >= 0, topk_sel, -1)
        out, lse, cache = cache.attend_lse(0, q[..., :r], q[..., r:], sel, scale, window=window, full=True,
                                           impl="auto")
        return out, lse, sel if keys is not None else None, cache.counters

    counters = zero_counters(n)
    out, lse, sel, counters = jax.shard_map(
        body, mesh=mesh, in_specs=(heads, heads, P(), P(), P(axis), P(), P(), P(axis), P(), P(axis)),
        out_specs=(heads, P(None, None, axis), P(), P(axis)), check_vma=False)(
        q_lat, q_pe, q_pos, block_table, rows, qi, w, keys, topk_sel, counters)
    return out[:, :, :h], lse[:, :, :h], sel if sel is not None else topk_sel, counters


def decode(mesh, q_lat_BTHR, q_pe_BTHP, q_pos_BT, block_table_BM, rows_NLX, *, layout: DcpLayout, scale: float,
           backend: str = "ag_rs", index=None, topk_BTK=None, axis: str = "cp") -> DecodeResult:
    """DCP decode attention over mesh axis `axis` (global arrays in, global arrays out).

    q_lat [B,T,H,R], q_pe [B,T,H,P] (all heads; sharded by head inside, zero-padded to a multiple of N),
    q_pos [B,T], block_table [B,M], rows [N*L, R+P] (rank r's table = rows r*L..(r+1)*L-1, e.g.
    `shard_cache(...).reshape(-1, X)`); index = (qi [B,T,HI,DI], w [B,T,HI], keys [N*L,DI], topk) for
    sparse decode, or topk_BTK [B,T,K] given (global positions, -1 = none; IndexShare layers); neither:
    dense decode over every cached position <= q_pos (-1 = padding query). Every rank all-gathers the
    query heads, attends the selected rows it owns and the partials merge by LSE (`backend`); the result
    stays split by head. See the module docstring and `parallel.dcp`'s.
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


# ------------------------------------------------------------------------------------ PCP x DCP prefill
def pcp_dcp_prefill(mesh, split: PcpSplit, q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI,
                    block_table_M, rows_NLX, keys_NLI, *, layout: DcpLayout, start: int, topk: int, scale: float,
                    block: int = 64, axis: str = "cp"):
    """Prefill of T new tokens at positions [start, start + T) of one request under PCP x DCP on `axis`.

    Per-token inputs in prompt order ([T, ...] as in `prefill_layer`); block_table [M] with room for
    start + split.padded_length positions; DCP tables rows [N*L,R+P], keys [N*L,DI] (rank-major) ->
    PrefillResult whose cache_rows / cache_keys are the updated DCP tables.
    """
    check_prefill_args(mesh, axis, split, q_lat_THR, block)
    if layout.size != split.n:
        raise ValueError(f"layout.size ({layout.size}) must equal the size of mesh axis {axis!r} ({split.n})")
    cap = jnp.shape(block_table_M)[-1] * layout.virtual_block
    if cap < start + split.padded_length:
        raise ValueError(f"block_table covers {cap} positions < start + padded prompt = {start + split.padded_length}")
    return run_split(split, start, (q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI),
                     _int32(block_table_M)[None], rows_NLX, keys_NLI, mesh=mesh, axis=axis, topk=topk, scale=scale,
                     block=block, layout=layout)
