"""Prefill context parallelism (PCP): a prompt's tokens split over the ranks of a mesh axis.

Split (`PcpSplit`): pad the prompt of T tokens to T_pad = 2N * C (C = ceil(T / 2N), or a larger bucket
`min_chunk`), cut it into 2N chunks of C tokens, and give rank g chunks g and 2N-1-g ("balanced",
arXiv 2411.01783). Under causal attention the queries of chunk c score c C^2 + C (C + 1) / 2 (query, key)
pairs, so every rank scores exactly 2N C^2 + C pairs (before padding is dropped), whatever g. The
"naive" split (rank g takes tokens [2gC, 2(g+1)C)) is kept for comparison: its last rank does
(4NC - 2C + 1) / (2NC + 1), about 2 - 1/N, times the mean.
Each rank's tokens sit in one [2C] row of a [N, 2C] layout (`positions`); `shard` permutes a
per-token array into that layout (rank-major, padded with zeros), `unshard` restores the original order.

Per layer, on every rank (`prefill_layer_local`, inside `jax.shard_map`):
1. the new latent KV rows and indexer keys of the rank's own tokens are all-gathered over the axis and
   written into the rank's copy of the cache (positions come from the split, known to every rank);
2. the rank runs the lightning indexer for its own queries only (`causal_topk_blocked`), over the whole
   context, with an exact top-k in the total order (score descending, position ascending);
3. the rank's queries attend their selected rows with all heads (`attention.sparse_mla.sparse_mqa`).
Attention outputs stay in the split layout until the caller restores the order (`PcpSplit.unshard`).

Work counters: every rank returns how many (query, key) pairs its indexer scored (causal pairs, and the
pairs of the key blocks its loop visited, the padded work a tiled kernel does) and how many selected rows
its sparse attention attended. The benchmark's load balance is measured from these counters.
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

SPLITS = ("balanced", "naive")
COUNTERS = ("indexer_pairs_causal", "indexer_pairs_computed", "mla_rows_attended")  # per-rank work counters


@dataclasses.dataclass(frozen=True)
class PcpSplit:
    """How a prompt of `length` tokens is split over `n` ranks ("balanced" or "naive").

    Invariants: every rank holds `tokens_per_rank` = 2C slots; the slots hold each position of
    [0, length) exactly once, the rest (padded_length - length of them) are padding (position -1).
    """

    length: int
    n: int
    kind: str = "balanced"
    min_chunk: int = 1  # chunk size floor: bucket prompt lengths so that they share one compiled program

    def __post_init__(self):
        for name in ("length", "n", "min_chunk"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PcpSplit.{name} must be a positive int, got {v!r}")
        if self.kind not in SPLITS:
            raise ValueError(f"PcpSplit.kind must be one of {SPLITS}, got {self.kind!r}")

    @property
    def chunk(self) -> int:
        """C: tokens per chunk (2N chunks): max(ceil(length / 2N), min_chunk)."""
        return max(-(-self.length // (2 * self.n)), self.min_chunk)

    @property
    def tokens_per_rank(self) -> int:
        return 2 * self.chunk

    @property
    def padded_length(self) -> int:
        return 2 * self.n * self.chunk

    def positions(self, start: int = 0) -> np.ndarray:
        """int32 [n, 2C]: the position (start + prompt index) each rank's slot holds, -1 = padding."""
        n, c = self.n, self.chunk
        g = np.arange(n)[:, None]
        j = np.arange(c)[None, :]
        if self.kind == "balanced":
            idx = np.concatenate([g * c + j, (2 * n - 1 - g) * c + j], axis=1)
        else:
            idx = g * 2 * c + np.arange(2 * c)[None, :]
        return np.where(idx < self.length, idx + start, -1).astype(np.int32)

    def shard(self, x_T):
        """x [T, ...] (numpy or jax) in prompt order -> [n * 2C, ...] in split order (rank-major), zeros at
        padding slots. Shard the result's first axis over the context axis to give each rank its tokens."""
        if x_T.shape[0] != self.length:
            raise ValueError(f"expected {self.length} tokens on axis 0, got shape {x_T.shape}")
        xp = np if isinstance(x_T, np.ndarray) else jnp
        pos = self.positions().reshape(-1)
        x_pad = xp.concatenate([x_T, xp.zeros((1,) + x_T.shape[1:], x_T.dtype)])
        return x_pad[np.where(pos >= 0, pos, self.length)]

    def unshard(self, y_L):
        """y [n * 2C, ...] in split order -> [T, ...] in prompt order (padding dropped)."""
        if y_L.shape[0] != self.n * self.tokens_per_rank:
            raise ValueError(f"expected {self.n * self.tokens_per_rank} slots on axis 0, got shape {y_L.shape}")
        pos = self.positions().reshape(-1)
        slot_of = np.empty(self.length, np.int64)
        slot_of[pos[pos >= 0]] = np.nonzero(pos >= 0)[0]
        return y_L[slot_of]


# ------------------------------------------------------------------------------------------- per-rank parts
def _varying_like(tree, *refs):
    """`tree` typed to vary over every mesh axis any of `refs` varies over, values unchanged.

    Inside `jax.shard_map` a loop carry must keep its type, and a constant initial carry is invariant while
    the loop body's result varies with the inputs. Adding a zero computed from the refs gives the constant
    the refs' type (values are unchanged: x + 0 for finite or infinite x; the zero is `isnan(ref) & False`); outside shard_map it is a no-op.
    """
    zero = jnp.zeros((), jnp.int32)
    for r in refs:
        if r.size:
            zero = zero + (jnp.isnan(jnp.ravel(r)[0]) & False).astype(jnp.int32)
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), tree)


def causal_topk_blocked(q_THI, w_TH, keys_SI, pos_T, topk: int, *, block: int):
    """The lightning indexer for a rank's own queries, tiled and causal: exact top-k in the total order.

    q [T,HI,DI] f32, w [T,HI] f32, keys [S,DI] (key row s = position s), pos [T] int32 (-1 = padding)
    -> (topk [T, min(topk, S)] int32 positions, -1 = none; counters: dict of int32 [tiles] per query tile).

    Queries are processed in tiles of `block`; a tile visits key blocks 0 .. max(pos in tile) // block
    only (a dynamic trip count: the causal work of this rank, not of the whole prompt) and keeps a running
    top-k. Candidates are ordered [running, new block], and every new block's positions exceed every
    running position, so `lax.top_k`'s lowest-index tie break keeps the total order (score desc, position
    asc): the result equals `attention.indexer.topk_reference` on the whole row. Block scores come from
    `attention.indexer.index_scores_reference` (positions shifted by the block start).
    """
    t, s = q_THI.shape[0], keys_SI.shape[0]
    k = min(topk, s)
    nq, nk = -(-t // block), -(-s // block)
    pad_q = nq * block - t
    q = jnp.pad(q_THI.astype(jnp.float32), ((0, pad_q), (0, 0), (0, 0)))
    w = jnp.pad(w_TH.astype(jnp.float32), ((0, pad_q), (0, 0)))
    pos = jnp.pad(pos_T.astype(jnp.int32), (0, pad_q), constant_values=-1)
    keys = jnp.pad(keys_SI, ((0, nk * block - s), (0, 0)))
    block_pos = jnp.arange(block, dtype=jnp.int32)

    def tile(args):
        q_BHI, w_BH, pos_B = args
        last = jnp.max(pos_B)
        trips = jnp.where(last >= 0, jnp.minimum(last // block + 1, nk), 0)

        def visit(j, carry):
            run_s, run_p, computed, causal = carry
            s0 = j * block
            keys_blk = jax.lax.dynamic_slice_in_dim(keys, s0, block)
            sc_BK = indexer_ops.index_scores_reference(q_BHI[None], w_BH[None], keys_blk[None], (pos_B - s0)[None])[0]
            cand_s = jnp.concatenate([run_s, sc_BK], axis=1)
            cand_p = jnp.concatenate([run_p, jnp.broadcast_to(s0 + block_pos, sc_BK.shape)], axis=1)
            vals, idx = jax.lax.top_k(cand_s, k)
            return (vals, jnp.take_along_axis(cand_p, idx, axis=1), computed + block * block,
                    causal + jnp.sum(jnp.isfinite(sc_BK), dtype=jnp.int32))

        init = _varying_like((jnp.full((block, k), -jnp.inf, jnp.float32), jnp.full((block, k), -1, jnp.int32),
                              jnp.int32(0), jnp.int32(0)), q_BHI, w_BH, pos_B, keys)
        run_s, run_p, computed, causal = jax.lax.fori_loop(0, trips, visit, init)
        return jnp.where(run_s == -jnp.inf, -1, run_p), computed, causal

    sel, computed, causal = jax.lax.map(tile, (q.reshape(nq, block, *q.shape[1:]), w.reshape(nq, block, -1),
                                               pos.reshape(nq, block)))
    sel_TK = sel.reshape(nq * block, k)[:t]
    return sel_TK, {"indexer_pairs_causal": causal, "indexer_pairs_computed": computed}


def attend_own_queries(q_lat_THR, q_pe_THP, qi_THI, w_TH, pos_T, rows_SX, keys_SI, *, topk: int, scale: float,
                       block: int):
    """One rank's sparse MLA for its own queries against a full-context copy of the cache.

    q_lat [T,H,R], q_pe [T,H,P], indexer qi [T,HI,DI], w [T,HI], pos [T] (-1 = padding), rows [S, R+P]
    and keys [S,DI] in position order -> (out [T,H,R] f32, lse [T,H] f32, topk [T, min(topk,S)] int32,
    counters {name: int32 [tiles]}).
    """
    sel_TK, counters = causal_topk_blocked(qi_THI, w_TH, keys_SI, pos_T, topk, block=block)
    rows = sparse_mla.SlotRows.plain(rows_SX, sel_TK[None], q_lat_THR.shape[-1])
    out, lse = sparse_mla.sparse_mqa(q_lat_THR[None], q_pe_THP[None], rows, scale)
    counters = dict(counters, mla_rows_attended=jnp.sum(sel_TK >= 0, dtype=jnp.int32)[None])
    return out[0], lse[0], sel_TK, counters


def write_rows(cache_SX, rows_TX, pos_T):
    """cache [S, X] with rows [T, X] written at positions pos [T] (-1 = skip: mapped out of range, never to
    the last row)."""
    s = cache_SX.shape[0]
    return cache_SX.at[jnp.where(pos_T >= 0, pos_T, s)].set(rows_TX.astype(cache_SX.dtype), mode="drop")


def prefill_layer_local(q_lat_CHR, q_pe_CHP, qi_CHI, w_CH, rows_new_CX, keys_new_CI, pos_all_L, cache_rows_SX,
                        cache_keys_SI, *, axis, topk: int, scale: float, block: int):
    """One PCP layer on one rank (call inside `jax.shard_map` over `axis`).

    Own tokens (C = 2 * chunk slots): q_lat [C,H,R], q_pe [C,H,P], indexer qi [C,HI,DI], w [C,HI], new cache
    rows [C,R+P] and new indexer keys [C,DI]; pos_all [N*C] int32: the positions of every rank's slots
    (the split is known to all ranks; -1 = padding); the rank's full cache copy rows [S,R+P], keys [S,DI]
    (identical on all ranks) -> (out [C,H,R], lse [C,H], topk [C,K], cache_rows, cache_keys, counters).

    The two all-gathers (new rows, new keys) are the only communication; the updated cache is identical on
    every rank (it is typed invariant over `axis`).
    """
    c = q_lat_CHR.shape[0]
    rank = jax.lax.axis_index(axis)
    pos_C = jax.lax.dynamic_slice_in_dim(pos_all_L, rank * c, c)
    rows_all = jax.lax.all_gather(rows_new_CX, axis, tiled=True, to="invarying")
    keys_all = jax.lax.all_gather(keys_new_CI, axis, tiled=True, to="invarying")
    cache_rows_SX = write_rows(cache_rows_SX, rows_all, pos_all_L)
    cache_keys_SI = write_rows(cache_keys_SI, keys_all, pos_all_L)
    out, lse, sel, counters = attend_own_queries(q_lat_CHR, q_pe_CHP, qi_CHI, w_CH, pos_C, cache_rows_SX,
                                                 cache_keys_SI, topk=topk, scale=scale, block=block)
    return out, lse, sel, cache_rows_SX, cache_keys_SI, counters


# ------------------------------------------------------------------------------------------- global wrapper
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """Outputs of `prefill_layer`, in prompt order: out [T,H,R], lse [T,H], topk [T,K] (global positions),
    the updated (replicated) cache rows [S,R+P] and keys [S,DI], and the raw work counters {name: int32
    [N * parts]} (`counters_per_rank` sums them per rank)."""

    out: jax.Array
    lse: jax.Array
    topk: jax.Array
    cache_rows: jax.Array
    cache_keys: jax.Array
    counters: dict


def counters_per_rank(counters: dict, n: int) -> dict:
    """Raw counters {name: int [N * parts]} (rank-major, as a shard_map over N ranks returns them) ->
    {name: np.int64 [N]}: each rank's total (summed in int64, so long prompts do not overflow)."""
    return {k: np.asarray(v).reshape(n, -1).astype(np.int64).sum(axis=1) for k, v in counters.items()}


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "topk", "scale", "block"))
def _prefill_jit(q_lat, q_pe, qi, w, rows_new, keys_new, pos_all, cache_rows, cache_keys, *, mesh, axis, topk,
                 scale, block):
    body = functools.partial(prefill_layer_local, axis=axis, topk=topk, scale=scale, block=block)
    tok = P(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, tok, tok, P(), P(), P()),
                         out_specs=(tok, tok, tok, P(), P(), P(axis)))(
        q_lat, q_pe, qi, w, rows_new, keys_new, pos_all, cache_rows, cache_keys)


def prefill_layer(mesh, split: PcpSplit, q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI, cache_rows_SX,
                  cache_keys_SI, *, start: int = 0, topk: int, scale: float, block: int = 64,
                  axis: str = "cp") -> PrefillResult:
    """PCP for one attention layer of a prompt whose T tokens occupy positions [start, start + T).

    Inputs in prompt order (per token: q_lat [T,H,R], q_pe [T,H,P], indexer qi [T,HI,DI] and w [T,HI], new
    cache rows [T,R+P] and keys [T,DI]); cache rows [S,R+P] and keys [S,DI] hold positions < start (S >=
    start + split.padded_length). Splits the tokens with `split` over mesh axis `axis`, runs
    `prefill_layer_local` on every rank and restores the prompt order.
    """
    n = mesh.shape[axis]
    if split.n != n:
        raise ValueError(f"split.n ({split.n}) must equal the size of mesh axis {axis!r} ({n})")
    if split.length != q_lat_THR.shape[0]:
        raise ValueError(f"split.length ({split.length}) must equal the number of tokens ({q_lat_THR.shape[0]})")
    if cache_rows_SX.shape[0] < start + split.padded_length:
        raise ValueError(f"cache capacity {cache_rows_SX.shape[0]} < start + padded prompt = "
                         f"{start + split.padded_length}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    pos_all = jnp.asarray(split.positions(start).reshape(-1))
    # Host-side permutation for numpy inputs; the jitted step sees only split-layout shapes, so prompts of
    # one chunk bucket share its compiled program.
    args = [split.shard(a) for a in (q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_new_TX, keys_new_TI)]
    out, lse, sel, rows, keys, counters = _prefill_jit(*args, pos_all, cache_rows_SX, cache_keys_SI, mesh=mesh,
                                                       axis=axis, topk=topk, scale=scale, block=block)
    return PrefillResult(split.unshard(out), split.unshard(lse), split.unshard(sel), rows, keys, counters)
