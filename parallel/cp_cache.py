"""The KV cache one rank sees inside a context-parallel forward (`jax.shard_map` over the context axis).

`CpKVCache` implements `kvcache.base.KVCache` around `local`, a `kvcache.paged.PagedKVCache` whose arrays
are this rank's: the model's layers run unchanged and the cache does the communication. Two independent
switches (BRIEF §4-5):

- `tokens_split` (PCP: a prefill chunk's tokens are split over the ranks by `parallel.pcp.PcpSplit`, each
  rank holding its own queries): every write first all-gathers the new tokens' packed rows (and their
  positions), so each rank can store what it needs. The indexer of a rank's own queries is the causal
  tiled loop (`attention.indexer.topk_causal_blocked`): its work is those queries' causal work, which
  is what the balanced split evens out.
- `dcp` (DCP: the KV is sharded round-robin, `parallel.dcp.DcpLayout`; block tables are shared and a
  block id is `block_size` slots on every rank): a rank stores only the positions it owns, at their local
  positions, which makes its shard an ordinary paged cache over local positions. Reads:
  - tokens replicated (decode, or prefill without PCP): "send the query to the KV". The indexer scores
    the rank's own keys with the single-device op (the global causal mask becomes a local one,
    `dcp.local_causal_limit`), takes a local top-k and merges all ranks' candidates exactly
    (`dcp.global_topk`); sparse MLA attends the selected rows the rank owns and the partial results merge
    with the log-sum-exp (`dcp.combine_all_heads`, backend `ag_rs` or `a2a`);
  - tokens split (PCP x DCP prefill): per layer, the shards are all-gathered into a temporary full-context
    copy of the batch's rows (`dcp.full_copy`), read like a single-device cache, and dropped after the
    layer (a temporary inside the jitted step).
Without DCP every rank holds the whole cache (replicated): PCP alone needs no other change, and decode
runs the same computation on every rank. So does HiSparse under TP alone (`local.hisparse` /
`local.staging`, replicated views): every rank selects the same rows, resolves the same plan against the
same hot state and copies the same host rows into its replica of the pool.

`heads_split`: the attention output stays split by head (each rank its H/N heads, as under tensor
parallelism, where o_proj is row-parallel); otherwise it is all-gathered so every rank holds all heads
(the engine's replicated projections). `gather_queries` (with heads_split; `parallel.tp`): the queries
arrive with this rank's heads only (tensor parallelism, this axis being the inner DCP part of the TP
group): DCP attention all-gathers the group's heads over the axis first, and the merge hands each rank
its own heads back; without DCP attention is local to the rank's heads. `counters` (optional, {name:
int32 [1, 2]} per rank): each rank's work, accumulated over the layers, measured where it is done:
(query, key) pairs its indexer scored (causal ones, and all pairs of the key range computed) and
selected MLA rows its attention read (`COUNTERS`; exact (hi, lo) int32 pairs, `counter_totals`). The
layer-level entry points of `parallel.layers` are this class run on one layer, so what the benchmarks
count is what the engine runs.

Positions are global (request-relative) everywhere outside this class; `capacity` is in global positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention import indexer as indexer_ops
from attention import sparse_mla
from attention.formats import IndexKeyFormat, MLARowFormat
from attention.indexer import PagedKeys
from attention.sparse_mla import SlotRows
from kvcache.base import default_select, sparse_attend
from kvcache.paged import PagedKVCache
from parallel import dcp as dcp_ops

COUNTERS = indexer_ops.COUNTERS + ("mla_rows_attended",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CpKVCache:
    """local: this rank's PagedKVCache (inside shard_map; block tables are the same on every rank).
    axis: the context mesh axis; size: its number of ranks; tokens_split: PCP layout of this call's tokens;
    dcp: the KV is sharded round-robin with `interleave` consecutive tokens per rank (False: replicated);
    backend: DCP's LSE-merge communication ("ag_rs" or "a2a"); heads_split: attention outputs keep
    this rank's heads only (H/N); gather_queries: queries hold this rank's heads only (TP), so DCP
    attention all-gathers them first; index_block: query and key tile of the PCP indexer; counters:
    None, or this rank's work counters {name in COUNTERS: int32 [1, 2]} (see the module docstring)."""

    local: PagedKVCache
    axis: str = dataclasses.field(metadata=dict(static=True))
    size: int = dataclasses.field(metadata=dict(static=True))
    tokens_split: bool = dataclasses.field(default=False, metadata=dict(static=True))
    dcp: bool = dataclasses.field(default=False, metadata=dict(static=True))
    interleave: int = dataclasses.field(default=1, metadata=dict(static=True))
    backend: str = dataclasses.field(default="ag_rs", metadata=dict(static=True))
    heads_split: bool = dataclasses.field(default=False, metadata=dict(static=True))
    gather_queries: bool = dataclasses.field(default=False, metadata=dict(static=True))
    index_block: int = dataclasses.field(default=64, metadata=dict(static=True))
    counters: dict | None = None

    def __post_init__(self):
        if (self.local.hisparse is not None or self.local.staging is not None) and (self.dcp or self.tokens_split):
            raise NotImplementedError("HiSparse residency under DCP or PCP is not built (under tensor parallelism "
                                      "alone the cache is replicated and every rank resolves the same plan)")
        dcp_ops.check_backend(self.backend)
        if self.heads_split and self.tokens_split:
            raise NotImplementedError("heads_split with tokens_split: a rank holds only its own tokens, so "
                                      "the other heads of those tokens would be lost")
        if self.gather_queries and not self.heads_split:
            raise ValueError("gather_queries needs heads_split: a rank whose queries hold its own heads keeps "
                             "its own heads of the output")

    # ------------------------------------------------------------------------------------------- layout
    def layout(self, group: str) -> dcp_ops.DcpLayout:
        """The round-robin layout of a cache group ("mla" or "index": its page size differs)."""
        bs = self.local.block_size if group == "mla" else self.local._ibs
        return dcp_ops.DcpLayout(self.size, bs, self.interleave)

    @property
    def capacity(self) -> int:
        return self.local.capacity * (self.size if self.dcp else 1)

    def _rank(self):
        return jax.lax.axis_index(self.axis)

    def _with(self, local: PagedKVCache) -> CpKVCache:
        return dataclasses.replace(self, local=local)

    def _count(self, **work) -> CpKVCache:
        """Add work: each value a Python int or an int32 array of non-negative parts (summed exactly)."""
        if self.counters is None:
            return self
        return dataclasses.replace(self, counters={k: _add(v, _pair(work[k])) if k in work else v
                                                   for k, v in self.counters.items()})

    def _owned(self, group: str, pos):
        """Global positions -> this rank's local positions (-1 where another rank owns it, or padding)."""
        if not self.dcp:
            return pos
        lay = self.layout(group)
        return jnp.where((pos >= 0) & (lay.owner(pos) == self._rank()), lay.local_position(pos), -1)

    def write_packed(self, group: str, layer: int, rows_BTX, pos_BT) -> CpKVCache:
        """Store rows [B,T,width] already in the group's storage format ("mla" or "index") at global
        positions pos [B,T] (-1 = skip); under PCP they are this rank's tokens."""
        if self.tokens_split:  # PCP: every rank receives every new token's (packed) rows
            rows_BTX = jax.lax.all_gather(rows_BTX, self.axis, axis=1, tiled=True)
            pos_BT = jax.lax.all_gather(pos_BT, self.axis, axis=1, tiled=True)
        return self._with(self.local.write_packed(group, layer, rows_BTX, self._owned(group, pos_BT)))

    def _full_copy(self, group: str, layer: int, window: int):
        """PCP x DCP: every request's rows of global positions [0, window) -> table [B * window, width]."""
        loc = self.local
        if group == "mla":
            table, bt = loc.mla[loc.mla_layers.index(layer)], loc.block_table
        else:
            table, bt = loc.index[loc.index_layers.index(layer)], loc._index_table
        full = dcp_ops.full_copy(table, bt, self.layout(group), axis=self.axis, num_positions=window)
        return full.reshape(-1, full.shape[-1])

    # ------------------------------------------------------------------------------------------- writes
    def write_mla(self, layer, latent_BTR, rope_BTP, pos_BT):
        return self.write_packed("mla", layer, self.local.mla_format.pack(latent_BTR, rope_BTP), pos_BT)

    def write_index_keys(self, layer, keys_BTI, pos_BT):
        return self.write_packed("index", layer, self.local.index_format.pack(keys_BTI), pos_BT)

    # -------------------------------------------------------------------------------------------- reads
    def index_key_pages(self, layer):
        """Replicated: the rank's pages. DCP: a full-context copy of the whole capacity, an all-gather of
        every request's entire context (the layers never call this: they read keys through `select`,
        which scores the shards in place or copies only the window). The same holds for `mla_slots` and
        `sparse_slots` under DCP; they exist so the cache honours the whole KVCache protocol."""
        if not self.dcp:
            return self.local.index_key_pages(layer)
        return self._full_pages(layer, self.capacity)

    def _full_pages(self, layer: int, window: int) -> PagedKeys:
        b = self.local.block_table.shape[0]
        return PagedKeys(self._full_copy("index", layer, window), jnp.arange(b, dtype=jnp.int32)[:, None], window,
                         self.local.index_format)

    def select(self, layer, q_BTHI, w_BTH, pos_BT, topk, *, window, impl):
        if self.tokens_split:  # PCP: this rank's queries, causal tiles over the whole context (or its copy)
            keys = self._full_pages(layer, window) if self.dcp else self.local.index_key_pages(layer)
            sel, work = indexer_ops.topk_causal_blocked(q_BTHI, w_BTH, keys, pos_BT, topk, window=window,
                                                        block=self.index_block)
            return sel, self._count(**work)
        if not self.dcp:
            sel, _ = default_select(self.local, layer, q_BTHI, w_BTH, pos_BT, topk, window=window, impl=impl)
            return sel, self._count(indexer_pairs_computed=pos_BT.size * window,
                                    indexer_pairs_causal=jnp.clip(pos_BT + 1, 0, window))
        lay, rank = self.layout("index"), self._rank()
        limit_BT = dcp_ops.local_causal_limit(pos_BT, lay, rank)
        scores = indexer_ops.index_scores(q_BTHI, w_BTH, self.local.index_key_pages(layer), limit_BT,
                                          window=dcp_ops.local_window(window, lay), impl=impl)
        cand_s, cand_p = dcp_ops.local_candidates(scores, lay, rank, topk)
        sel = dcp_ops.global_topk(cand_s, cand_p, min(topk, window), axis=self.axis)
        return sel, self._count(indexer_pairs_computed=scores.size,
                                indexer_pairs_causal=jnp.sum(jnp.isfinite(scores), axis=-1, dtype=jnp.int32))

    def attend(self, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, *, window, full, impl):
        if self.local.staging is not None:  # HiSparse prefill over host-only pages (TP alone: replicated)
            out, local = self.local.attend(layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, window=window, full=full,
                                           impl=impl)
            if self.heads_split and not self.gather_queries:
                out = self._own_heads(out)
            return out, self._with(local)._count(mla_rows_attended=jnp.sum(pos_BTK >= 0, axis=-1, dtype=jnp.int32))
        out, _, cache = self.attend_lse(layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, window=window, full=full,
                                        impl=impl)
        return out, cache

    def attend_lse(self, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, *, window, full, impl):
        """`attend` with the log-sum-exp -> (out [B,T,H',R] f32, lse [B,T,H'] f32, cache); H' = H, or
        this rank's padded H/N heads when `heads_split`. Not with a staging view (HiSparse prefill staging
        reads through `attend`, which needs no log-sum-exp without DCP)."""
        if self.local.staging is not None:
            raise NotImplementedError("CpKVCache.attend_lse with HiSparse's staging view: use attend")
        if self.dcp and not self.tokens_split:  # the selected rows this rank owns, merged over the ranks
            if self.gather_queries:  # TP: the DCP group's heads (one message for both parts)
                r = q_lat_BTHR.shape[-1]
                q = jnp.concatenate([q_lat_BTHR, q_pe_BTHP.astype(q_lat_BTHR.dtype)], axis=-1)
                q = jax.lax.all_gather(q, self.axis, axis=2, tiled=True)
                q_lat_BTHR, q_pe_BTHP = q[..., :r], q[..., r:]
            owned = self._owned("mla", pos_BTK)
            out, lse = sparse_mla.sparse_mqa(q_lat_BTHR, q_pe_BTHP, self.local.mla_slots(layer, owned), scale,
                                             impl=impl)
            merge = dcp_ops.combine if self.heads_split else dcp_ops.combine_all_heads
            if self.heads_split:
                out, lse = dcp_ops.pad_heads(out, self.size), dcp_ops.pad_heads(lse, self.size)
            out, lse = merge(out, lse, axis=self.axis, backend=self.backend)
            return out, lse, self._count(mla_rows_attended=jnp.sum(owned >= 0, axis=-1, dtype=jnp.int32))
        if self.dcp:  # PCP x DCP: this rank's queries over the temporary full copy
            rows = self._full_rows(layer, pos_BTK, window)
            out, lse = sparse_mla.sparse_mqa(q_lat_BTHR, q_pe_BTHP, rows, scale, impl=impl)
            cache = self
        else:
            out, lse, local = sparse_attend(self.local, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, full=full,
                                            impl=impl)
            cache = self._with(local)
        if self.heads_split and not self.gather_queries:
            out, lse = self._own_heads(out), self._own_heads(lse)
        return out, lse, cache._count(mla_rows_attended=jnp.sum(pos_BTK >= 0, axis=-1, dtype=jnp.int32))

    def _own_heads(self, x_BTH_):
        """This rank's slice of the (zero-padded) heads, axis 2."""
        x = dcp_ops.pad_heads(x_BTH_, self.size)
        hl = x.shape[2] // self.size
        return jax.lax.dynamic_slice_in_dim(x, self._rank() * hl, hl, axis=2)

    def _full_rows(self, layer: int, pos_BTK, window: int) -> SlotRows:
        """Slot addressing of the selected positions (all < window) into a full copy of [0, window)."""
        b = pos_BTK.shape[0]
        slots = jnp.where(pos_BTK >= 0, pos_BTK + window * jnp.arange(b, dtype=jnp.int32)[:, None, None], -1)
        return SlotRows(self._full_copy("mla", layer, window), slots, self.local.mla_format)

    def mla_rows(self, layer, num_positions):
        if not self.dcp:
            return self.local.mla_rows(layer, num_positions)
        rows = self.local.mla_format.unpack(self._full_copy("mla", layer, num_positions))
        rows = rows.reshape(self.local.block_table.shape[0], num_positions, -1)
        r = self.local.mla_format.kv_lora_rank
        return rows[..., :r], rows[..., r:]

    def mla_slots(self, layer, pos_BTK):
        if not self.dcp:
            return self.local.mla_slots(layer, pos_BTK)
        return self._full_rows(layer, pos_BTK, self.capacity)

    def sparse_slots(self, layer, pos_BTK, full, *, impl="auto"):
        if not self.dcp:
            rows, local = self.local.sparse_slots(layer, pos_BTK, full, impl=impl)
            return rows, self._with(local)
        return self._full_rows(layer, pos_BTK, self.capacity), self


# ------------------------------------------------------------------------------------------ work counters
# A count is an int32 pair (hi, lo) = hi * 2^16 + lo with 0 <= lo < 2^16: exact up to 2^47 (JAX runs
# without int64 by default, and one layer of a 16K-token PCP rank over a 1M context scores 1.6e10 pairs).
_LO = 16


def zero_counters(n: int) -> dict:
    """{name in COUNTERS: int32 [n, 2]}: each rank's (hi, lo) pair (split the first axis over the ranks)."""
    return {k: jnp.zeros((n, 2), jnp.int32) for k in COUNTERS}


def counter_totals(counters: dict) -> dict:
    """Counters {name: int [N, 2] (hi, lo)} -> {name: np.int64 [N]}."""
    import numpy as np

    return {k: np.asarray(v, np.int64)[:, 0] * (1 << _LO) + np.asarray(v, np.int64)[:, 1]
            for k, v in counters.items()}


def _pair(v) -> jax.Array:
    """The exact sum of a Python int or of an int32 array of non-negative parts (each < 2^31, at most
    2^25 of them) as a (hi, lo) pair int32 [2]."""
    if isinstance(v, int):
        return jnp.asarray([v >> _LO, v & ((1 << _LO) - 1)], jnp.int32)
    v = v.astype(jnp.int32).reshape(-1)
    v = jnp.pad(v, (0, -v.size % 1024)).reshape(-1, 1024)
    lo = jnp.sum(v & ((1 << _LO) - 1), axis=1)  # < 2^26 per row of 1024 parts
    hi = jnp.sum(v >> _LO) + jnp.sum(lo >> _LO)
    return jnp.stack([hi, jnp.sum(lo & ((1 << _LO) - 1))])


def _add(acc, pair) -> jax.Array:
    """acc [..., 2] + pair [2], carried so that lo stays < 2^16."""
    lo = acc[..., 1] + pair[1]
    return jnp.stack([acc[..., 0] + pair[0] + (lo >> _LO), lo & ((1 << _LO) - 1)], axis=-1)


def plain_cache(rows_LX, keys_LI, block_table_BM, block_size: int, kv_lora_rank: int) -> PagedKVCache:
    """A one-layer PagedKVCache over plain float32 tables (rows [L, R+P] latent then rope, keys [L, DI] or
    None) under block_table [B, M]: what the layer-level entry points of `parallel.layers` wrap in a
    CpKVCache (layer 0 is both its MLA layer and its full indexer layer)."""
    fmt = MLARowFormat("float32", kv_lora_rank, rows_LX.shape[-1] - kv_lora_rank)
    index = () if keys_LI is None else (keys_LI,)
    return PagedKVCache(mla=(rows_LX,), index=index, block_table=block_table_BM, index_block_table=None,
                        mla_layers=(0,), index_layers=(0,) if index else (), block_size=block_size, mla_format=fmt,
                        index_format=IndexKeyFormat("float32", 1 if keys_LI is None else keys_LI.shape[-1]))
