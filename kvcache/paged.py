"""The paged KV cache: fixed-size blocks of slots in one flat device array per layer and cache group.

Request b's token at position p lives in slot `block_table[b, p // B] * B + p % B` (B = block_size) of
every layer's array: the MLA rows of each attention layer in an `MLARowFormat` (fp8_ds_mla: 656 bytes
held as 164 uint32 words; or bf16/fp32 values), the keys of each full indexer layer in an
`IndexKeyFormat` (fp8: 132 bytes as 33 words; or floats). Blocks are allocated by the caller (the
engine's block pool); this module only stores, writes and gathers. Block-table entries past a request's
allocation are -1: reads there return junk rows that the causal mask removes, writes there are dropped.

Implements `kvcache.base.KVCache`, so the model's chunked prefill and decode run on it unchanged, for a
batch of requests of different lengths (each row of the block table is one request).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention.common import slot_mapping
from attention.formats import IndexKeyFormat, MLARowFormat
from kvcache.views import HiSparseView, StagingView
from attention.indexer import PagedKeys
from attention.sparse_mla import SlotRows
from kvcache.base import default_attend, default_select, replace_layer_array
from kvcache.layout import DEFAULT_INDEX_FORMAT



def write_slots(buf_NX, rows_X, slots):
    """Scatter rows [..., X] into buf [N, X] at slots [...] (-1 = skip). -1 must not reach `.at[]`: it
    would write the last slot (JAX notes), so it is mapped past the end and dropped."""
    n = buf_NX.shape[0]
    s = jnp.where((slots >= 0) & (slots < n), slots, n).reshape(-1)
    return buf_NX.at[s].set(rows_X.reshape(-1, rows_X.shape[-1]).astype(buf_NX.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """mla[i]: [num_blocks * B, mla_format.width] rows of attention layer `mla_layers[i]`; index[j]:
    [num_blocks * B', index_format.width] keys of full layer `index_layers[j]` (B' = index_block_size or
    B); block_table [batch, M] int32 page ids (-1 = none) of the MLA group; index_block_table
    [batch, M' >= M * B / B']: the indexer group's (the block pool allocates the two groups separately),
    or None when both groups share one table (B' = B). capacity = M * B positions per request.
    A block id names a page in both groups' arrays; each group uses only its own pages, so with B' > B
    the arrays over-provision (the pool's block count is the budget; docs/engine.md)."""

    mla: tuple[jax.Array, ...]
    index: tuple[jax.Array, ...]
    block_table: jax.Array
    index_block_table: jax.Array | None  # the indexer group's own table; None = the same as block_table
    mla_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    index_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    mla_format: MLARowFormat = dataclasses.field(metadata=dict(static=True))
    index_format: IndexKeyFormat = dataclasses.field(metadata=dict(static=True))
    # HiSparse decode steps only: host pool, host page table and hot buffers (kvcache.views)
    hisparse: HiSparseView | None = None
    # slots per indexer-key page (0: block_size); index arrays hold num_blocks pages of this size
    index_block_size: int = dataclasses.field(default=0, metadata=dict(static=True))
    # HiSparse prefill steps over host-only pages: the host pool and per-tile staging (kvcache.views)
    staging: StagingView | None = None

    @classmethod
    def create(cls, cfg, num_blocks: int, block_size: int, block_table, *, kv_cache_dtype: str = "fp8_ds_mla",
               index_cache_dtype: str | None = None, include_mtp: bool = True,
               index_block_size: int | None = None, index_block_table=None) -> PagedKVCache:
        """Zero-filled pool of `num_blocks` blocks of `block_size` slots for every layer of `cfg`, with the
        given block table [batch, max_blocks_per_request] (page ids < num_blocks, -1 = none)."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        mla_format = MLARowFormat(kv_cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        index_name = index_cache_dtype or DEFAULT_INDEX_FORMAT[kv_cache_dtype]
        index_format = IndexKeyFormat(index_name, cfg.index_head_dim)
        n_layers = cfg.num_layers_with_mtp if include_mtp else cfg.num_hidden_layers
        mla_layers = tuple(range(n_layers))
        index_layers = tuple(i for i in cfg.full_indexer_layers if i < n_layers)
        ibs = index_block_size or block_size
        if ibs % block_size:
            raise ValueError(f"index_block_size={ibs} must be a multiple of block_size={block_size}")
        n = num_blocks * block_size
        cache = cls(
            mla=tuple(jnp.zeros((n, mla_format.width), mla_format.storage_dtype) for _ in mla_layers),
            index=tuple(jnp.zeros((num_blocks * ibs, index_format.width), index_format.storage_dtype)
                        for _ in index_layers),
            block_table=cls._checked_table(block_table, num_blocks), index_block_table=None,
            mla_layers=mla_layers, index_layers=index_layers, block_size=block_size,
            mla_format=mla_format, index_format=index_format, index_block_size=0 if ibs == block_size else ibs,
        )
        if index_block_table is not None or ibs != block_size:
            cache = cache.with_block_table(block_table, index_block_table)
        return cache

    @staticmethod
    def _checked_table(block_table, num_blocks: int):
        bt = np.asarray(block_table)
        if bt.ndim != 2 or not np.issubdtype(bt.dtype, np.integer):
            raise ValueError(f"block_table must be a 2-D integer array [batch, max_blocks], got {bt.dtype} {bt.shape}")
        if bt.size and (bt.min() < -1 or bt.max() >= num_blocks):
            raise ValueError(f"block_table entries must be page ids in [0, {num_blocks}) or -1, "
                             f"got range [{bt.min()}, {bt.max()}]")
        return jnp.asarray(bt, jnp.int32)

    def with_block_table(self, block_table, index_block_table=None) -> PagedKVCache:
        """The same pool under new block tables (e.g. the next step's batch); the indexer group uses
        `index_block_table` if given, else `block_table`."""
        bt = self._checked_table(block_table, self.num_blocks)
        if index_block_table is None and self.index_block_size:
            raise ValueError("indexer pages differ in size from MLA pages: give index_block_table")
        ibt = None if index_block_table is None else self._checked_table(index_block_table, self.num_blocks)
        if ibt is not None and (ibt.shape[0] != bt.shape[0] or ibt.shape[1] * self._ibs < bt.shape[1] * self.block_size):
            raise ValueError(f"index_block_table shape {ibt.shape} does not cover block_table {bt.shape}'s "
                             f"{bt.shape[1] * self.block_size} positions in pages of {self._ibs}")
        return dataclasses.replace(self, block_table=bt, index_block_table=ibt)

    @property
    def num_blocks(self) -> int:
        return self.mla[0].shape[0] // self.block_size

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def slots(self, pos):
        return slot_mapping(self.block_table, pos, self.block_size)

    def _replace(self, group: str, layer: int, value):
        return replace_layer_array(self, group, layer, value)

    def write_mla(self, layer, latent_BTR, rope_BTP, pos_BT):
        return self.write_packed("mla", layer, self.mla_format.pack(latent_BTR, rope_BTP), pos_BT)

    def write_packed(self, group: str, layer: int, rows_BTX, pos_BT) -> PagedKVCache:
        """Store rows [B,T,width] already in the group's storage format ("mla": mla_format, "index":
        index_format) at positions pos [B,T] (-1 = skip)."""
        if group == "mla":
            buf, slots = self.mla[self.mla_layers.index(layer)], self.slots(pos_BT)
        else:
            buf = self.index[self.index_layers.index(layer)]
            slots = slot_mapping(self._index_table, pos_BT, self._ibs)
        return self._replace(group, layer, write_slots(buf, rows_BTX, slots))

    @property
    def _index_table(self):
        return self.block_table if self.index_block_table is None else self.index_block_table

    @property
    def _ibs(self) -> int:
        return self.index_block_size or self.block_size

    def write_index_keys(self, layer, keys_BTI, pos_BT):
        return self.write_packed("index", layer, self.index_format.pack(keys_BTI), pos_BT)

    def index_key_pages(self, layer):
        return PagedKeys(self.index[self.index_layers.index(layer)], self._index_table, self._ibs,
                         self.index_format)

    def mla_rows(self, layer, num_positions):
        buf = self.mla[self.mla_layers.index(layer)]
        pos = jnp.broadcast_to(jnp.arange(num_positions, dtype=jnp.int32), (self.block_table.shape[0], num_positions))
        rows = self.mla_format.unpack(jnp.take(buf, jnp.maximum(self.slots(pos), 0), axis=0))
        r = self.mla_format.kv_lora_rank
        return rows[..., :r], rows[..., r:]

    def mla_slots(self, layer, pos_BTK):
        return SlotRows(self.mla[self.mla_layers.index(layer)], self.slots(pos_BTK), self.mla_format)

    def sparse_slots(self, layer, pos_BTK, full: bool, *, impl: str = "auto"):
        """Where sparse MLA reads the selected positions [B, T, K] of `layer` -> (SlotRows, cache).

        Without HiSparse (or for prefill chunks, whose pages the host side keeps on the device) this is
        `mla_slots`. In a HiSparse decode step (T = 1) the block table holds -1 for host-only pages: a
        full indexer layer (`full`) resolves its selection against residency and the hot buffers, and it
        and the shared layers after it copy the plan's missing rows from their host tables into their
        own device tables before reading (one row copy per miss per layer of the group). A batched MTP
        verify step (T = 1 + k queries per row) resolves one plan per group for all its positions: the
        union of their selections, each position counted once (`union_selections`; the view's plan is
        [R, T * K] and the hot buffer must hold T x K rows), and every query reads its own selection from
        the rows that plan placed."""
        hs = self.hisparse
        if hs is None:
            return self.mla_slots(layer, pos_BTK), self
        b, t, k = pos_BTK.shape
        sel, inverse = (pos_BTK[:, 0], None) if t == 1 else union_selections(pos_BTK.reshape(b, t * k))
        i = self.mla_layers.index(layer)
        if full:
            group = sum(1 for f in self.index_layers if f <= layer) - 1
            hs = hs.resolve(group, sel, self.block_table, self.block_size, impl=impl)
        hs, table = hs.copy_rows(i, self.mla[i])
        cache = dataclasses.replace(self._replace("mla", layer, table), hisparse=hs)
        rows = hs.plan_rows if inverse is None else jnp.take_along_axis(hs.plan_rows, inverse, axis=1)
        return SlotRows(table, rows.reshape(b, t, k), self.mla_format), cache

    select = default_select

    def attend(self, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, *, window, full, impl):
        """`KVCache.attend`. In a HiSparse prefill step over host-only pages (`staging`), the block table
        holds -1 for those pages and the selected rows found there are staged from the host pool per tile
        of queries (kvcache.views.StagingView.attend, whose op is attention.staging); otherwise `default_attend`."""
        st = self.staging
        if st is None:
            return default_attend(self, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, window=window, full=full,
                                  impl=impl)
        i = self.mla_layers.index(layer)
        group = sum(1 for f in self.index_layers if f <= layer) - 1
        out, st = st.attend(i, self.mla[i], self.slots(pos_BTK), pos_BTK, q_lat_BTHR, q_pe_BTHP, scale,
                            self.mla_format, self.block_size, group=group, full=full, impl=impl)
        return out, dataclasses.replace(self, staging=st)


def union_selections(sel_BN):
    """The union of a row's selections [B, N] int32 (-1 = none; duplicates across the queries of one step)
    -> (unique [B, N]: each selected position once, in increasing order, -1 elsewhere; inverse [B, N]: for
    each entry of `sel_BN` the index in `unique` holding its position, or of a -1 entry for a -1 one).
    One resolver plan over `unique` serves every query: rows = take_along_axis(plan.rows, inverse)."""
    n = sel_BN.shape[1]
    order = jnp.argsort(sel_BN, axis=1, stable=True)
    s = jnp.take_along_axis(sel_BN, order, axis=1)
    idx = jnp.arange(n)
    first = (idx == 0) | (s != jnp.roll(s, 1, axis=1))
    unique = jnp.where(first & (s >= 0), s, -1)
    run_start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)  # the first entry of each run of equal values
    inverse = jnp.zeros_like(order).at[jnp.arange(sel_BN.shape[0])[:, None], order].set(run_start)
    return unique, inverse
