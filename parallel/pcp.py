"""Prefill context parallelism (PCP): a prompt's tokens split over the ranks of a mesh axis.

Split (`PcpSplit`): pad the prompt of T tokens to T_pad = 2N * C (C = ceil(T / 2N), or a larger bucket
`min_chunk`), cut it into 2N chunks of C tokens, and give rank g chunks g and 2N-1-g ("balanced",
arXiv 2411.01783). Under causal attention the queries of chunk c score c C^2 + C (C + 1) / 2 (query, key)
pairs, so every rank scores exactly 2N C^2 + C pairs (before padding is dropped), whatever g. The
"naive" split (rank g takes tokens [2gC, 2(g+1)C)) is kept for comparison: its last rank does
(4NC - 2C + 1) / (2NC + 1), about 2 - 1/N, times the mean.
Each rank's tokens sit in one [2C] row of a [N, 2C] layout (`positions`); `shard` permutes a
per-token array into that layout (rank-major, padded with zeros), `unshard` restores the original order.

One layer (`prefill_layer`): the tokens run on the ranks of the axis inside `jax.shard_map`, through
`parallel.cp_cache.CpKVCache` (tokens_split), the cache the engine's PCP steps use, so this entry point
runs the engine's code on one layer:
1. the new latent KV rows and indexer keys of each rank's tokens (and their positions) are all-gathered
   over the axis and written into every rank's copy of the cache;
2. each rank runs the lightning indexer for its own queries only, causal tiles over the whole context
   (`attention.indexer.topk_causal_blocked`), with an exact top-k in the total order (score
   descending, position ascending);
3. each rank's queries attend their selected rows with all heads (`attention.sparse_mla.sparse_mqa`).
Outputs come back in the split layout and are restored to prompt order (`PcpSplit.unshard`).

Work counters (`CpKVCache.counters`): the (query, key) pairs each rank's indexer scored (causal pairs,
and the pairs of the key blocks its loop visited, the padded work of a tiled kernel) and the selected
rows its sparse attention read. The benchmark's load balance is measured from these counters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

SPLITS = ("balanced", "naive")


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


# ------------------------------------------------------------------------------------------- global wrapper
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
    from parallel.cp_cache import CpKVCache, plain_cache, zero_counters

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
