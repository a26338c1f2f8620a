"""The KV cache one rank sees inside a context-parallel forward (`jax.shard_map` over the context axis).

`CpKVCache` implements `kvcache.base.KVCache` around `local`, a `kvcache.paged.PagedKVCache` whose arrays
are this rank's: the model's layers run unchanged and the cache does the communication. Two independent
switches (BRIEF §4-5):

- `tokens_split` (PCP: a prefill chunk's tokens are split over the ranks by `parallel.pcp.PcpSplit`, each
  rank holding its own queries): every write first all-gathers the new tokens' packed rows (and their
  positions), so each rank can store what it needs.
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
runs the same computation on every rank.

Positions are global (request-relative) everywhere outside this class; `capacity` is in global positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention import indexer as indexer_ops
from attention import sparse_mla
from attention.indexer import PagedKeys
from attention.sparse_mla import SlotRows
from kvcache.base import default_attend, default_select
from kvcache.paged import PagedKVCache
from parallel import dcp as dcp_ops


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CpKVCache:
    """local: this rank's PagedKVCache (inside shard_map; block tables are the same on every rank).
    axis: the context mesh axis; size: its number of ranks; tokens_split: PCP layout of this call's tokens;
    dcp: the KV is sharded round-robin with `interleave` consecutive tokens per rank (False: replicated);
    backend: DCP's LSE-merge communication ("ag_rs" or "a2a")."""

    local: PagedKVCache
    axis: str = dataclasses.field(metadata=dict(static=True))
    size: int = dataclasses.field(metadata=dict(static=True))
    tokens_split: bool = dataclasses.field(default=False, metadata=dict(static=True))
    dcp: bool = dataclasses.field(default=False, metadata=dict(static=True))
    interleave: int = dataclasses.field(default=1, metadata=dict(static=True))
    backend: str = dataclasses.field(default="ag_rs", metadata=dict(static=True))

    def __post_init__(self):
        if self.local.hisparse is not None:
            raise NotImplementedError("HiSparse residency under context parallelism is not built")
        dcp_ops.check_backend(self.backend)

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

    def _owned(self, group: str, pos):
        """Global positions -> this rank's local positions (-1 where another rank owns it, or padding)."""
        if not self.dcp:
            return pos
        lay = self.layout(group)
        return jnp.where((pos >= 0) & (lay.owner(pos) == self._rank()), lay.local_position(pos), -1)

    def _write(self, group: str, layer: int, rows_BTX, pos_BT) -> CpKVCache:
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
        return self._write("mla", layer, self.local.mla_format.pack(latent_BTR, rope_BTP), pos_BT)

    def write_index_keys(self, layer, keys_BTI, pos_BT):
        return self._write("index", layer, self.local.index_format.pack(keys_BTI), pos_BT)

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
        if not self.dcp:
            return default_select(self.local, layer, q_BTHI, w_BTH, pos_BT, topk, window=window, impl=impl)
        if self.tokens_split:
            return indexer_ops.topk(q_BTHI, w_BTH, self._full_pages(layer, window), pos_BT, topk, window=window,
                                    impl=impl)
        lay, rank = self.layout("index"), self._rank()
        limit_BT = dcp_ops.local_causal_limit(pos_BT, lay, rank)
        scores = indexer_ops.index_scores(q_BTHI, w_BTH, self.local.index_key_pages(layer), limit_BT,
                                          window=dcp_ops.local_window(window, lay), impl=impl)
        cand_s, cand_p = dcp_ops.local_candidates(scores, lay, rank, topk)
        return dcp_ops.global_topk(cand_s, cand_p, min(topk, window), axis=self.axis)

    def attend(self, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, *, window, full, impl):
        if not self.dcp:
            out, local = default_attend(self.local, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, window=window,
                                        full=full, impl=impl)
            return out, self._with(local)
        if self.tokens_split:
            rows = self._full_rows(layer, pos_BTK, window)
            return sparse_mla.sparse_mqa(q_lat_BTHR, q_pe_BTHP, rows, scale, impl=impl)[0], self
        rows = self.local.mla_slots(layer, self._owned("mla", pos_BTK))  # the selected rows this rank owns
        out, lse = sparse_mla.sparse_mqa(q_lat_BTHR, q_pe_BTHP, rows, scale, impl=impl)
        out, _ = dcp_ops.combine_all_heads(out, lse, axis=self.axis, backend=self.backend)
        return out, self

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

    def sparse_slots(self, layer, pos_BTK, full):
        if not self.dcp:
            rows, local = self.local.sparse_slots(layer, pos_BTK, full)
            return rows, self._with(local)
        return self._full_rows(layer, pos_BTK, self.capacity), self
