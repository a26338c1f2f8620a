"""The KV-cache interface the model layers use.

A cache is an immutable pytree: writes return a new cache (under jit with the cache donated, XLA updates
the buffers in place). Layers address rows by *request-relative position*; how positions map to storage
(one dense array per request, or pages through a block table) is the cache's business, so a paged cache
with fp8 rows slots in without touching the layers.

Per token the cache holds, for every attention layer (main and MTP), the kv_lora-wide normalised latent
and the rope-wide roped key (MLA rows), and for every full indexer layer one index key.

Invariant the layers rely on: when a query at position p runs, every position < p of its request has
been written (chunked prefill and decode fill a request's positions in order).
"""

from __future__ import annotations

from typing import Protocol

import jax

from attention import indexer as indexer_ops
from attention import sparse_mla
from attention.indexer import PagedKeys
from attention.sparse_mla import SlotRows


class KVCache(Protocol):
    @property
    def capacity(self) -> int:
        """Positions per request the cache can hold (static)."""

    def write_mla(self, layer: int, latent_BTR: jax.Array, rope_BTP: jax.Array, pos_BT: jax.Array) -> KVCache:
        """Store the MLA rows of new tokens at their positions; pos -1 = padding token, not written."""

    def write_index_keys(self, layer: int, keys_BTI: jax.Array, pos_BT: jax.Array) -> KVCache:
        """Store the indexer keys of new tokens (full indexer layers only); pos -1 = skip."""

    def index_key_pages(self, layer: int) -> PagedKeys:
        """The layer's indexer keys as pages (table, block table, format): what the single-device indexer
        op reads (`default_select`; the layers go through `select`).
        `.gather(W)` gives the dense float32 view [B, W, index_head_dim] of positions 0..W-1; rows past a
        request's length are junk that the causal mask removes."""

    def mla_rows(self, layer: int, num_positions: int) -> tuple[jax.Array, jax.Array]:
        """MLA rows of positions 0..W-1: (latent [B, W, R], rope [B, W, P])."""

    def mla_slots(self, layer: int, pos_BTK: jax.Array) -> SlotRows:
        """Slot addressing for sparse kernels: table row slots[b, t, k] holds position pos[b, t, k] of
        request b (-1 -> -1), in the cache's storage format with the unpack that reads it."""

    def sparse_slots(self, layer: int, pos_BTK: jax.Array, full: bool, *, impl: str = "auto") -> tuple[SlotRows, KVCache]:
        """What sparse MLA reads for `layer` -> (rows, cache). A cache whose rows may live elsewhere
        (HiSparse: the host pool) brings the selected ones in first; `full`: the layer computed the
        selection itself (IndexShare's shared layers replay its plan); `impl`: the attention ops'
        implementation, which the HiSparse resolver follows too. Plain caches: (mla_slots, self)."""

    def select(self, layer: int, q_BTHI, w_BTH, pos_BT, topk: int, *, window: int,
               impl: str) -> tuple[jax.Array, KVCache]:
        """The indexer's selection for full layer `layer` -> (positions [B,T,min(topk, window)] int32 (-1 =
        none) in the total order, cache). Plain caches: `default_select` on their key pages; a cache
        sharded over devices (parallel.cp_cache) merges per-rank candidates and may count its work (hence
        the returned cache)."""

    def attend(self, layer: int, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale: float, *, window: int, full: bool,
               impl: str) -> tuple[jax.Array, KVCache]:
        """Sparse MQA of the queries over the selected positions (all < window) -> (out [B,T,H,R] f32,
        cache). Plain caches: `default_attend` (sparse_slots, then attention.sparse_mla.sparse_mqa)."""


def default_select(cache: KVCache, layer: int, q_BTHI, w_BTH, pos_BT, topk: int, *, window: int, impl: str):
    """`KVCache.select` of a cache whose key pages hold every position (the single-device case)."""
    return indexer_ops.topk(q_BTHI, w_BTH, cache.index_key_pages(layer), pos_BT, topk, window=window,
                            impl=impl), cache


def sparse_attend(cache: KVCache, layer: int, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale: float, *, full: bool,
                  impl: str):
    """Sparse MQA over the rows `sparse_slots` reaches -> (out [B,T,H,R] f32, lse [B,T,H] f32, cache)."""
    rows, cache = cache.sparse_slots(layer, pos_BTK, full=full, impl=impl)
    out, lse = sparse_mla.sparse_mqa(q_lat_BTHR, q_pe_BTHP, rows, scale, impl=impl)
    return out, lse, cache


def default_attend(cache: KVCache, layer: int, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale: float, *, window: int,
                   full: bool, impl: str):
    """`KVCache.attend` of a cache whose `sparse_slots` reach every selected row (the single-device case)."""
    out, _, cache = sparse_attend(cache, layer, q_lat_BTHR, q_pe_BTHP, pos_BTK, scale, full=full, impl=impl)
    return out, cache


def replace_layer_array(cache, group: str, layer: int, value):
    """A copy of a dataclass cache whose `group` ("mla" or "index") array of `layer` is `value` (the
    cache lists the layers of each group in `mla_layers` / `index_layers`)."""
    import dataclasses

    layers = cache.mla_layers if group == "mla" else cache.index_layers
    arrays = list(getattr(cache, group))
    arrays[layers.index(layer)] = value
    return dataclasses.replace(cache, **{group: tuple(arrays)})
