"""A contiguous KV cache: one dense [B, S, ...] array per layer and cache group, row index = position.

The simplest implementation of `kvcache.base.KVCache`: used by `glm53.score`, `glm53.generate` and the
parity tests. The serving engine uses the paged cache instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention.formats import IndexKeyFormat
from attention.indexer import PagedKeys
from attention.sparse_mla import SlotRows
from kvcache.base import default_attend, default_select, replace_layer_array
from kvcache.paged import write_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousKVCache:
    """mla[i]: [B, S, R + P] rows of attention layer `mla_layers[i]` (latent then rope);
    index[j]: [B, S, DI] keys of full indexer layer `index_layers[j]`."""

    mla: tuple[jax.Array, ...]
    index: tuple[jax.Array, ...]
    mla_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    index_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(cls, cfg, batch: int, capacity: int, dtype, *, include_mtp: bool = True) -> ContiguousKVCache:
        """Zero-filled cache for `batch` requests of up to `capacity` positions (layers of `cfg`)."""
        n_layers = cfg.num_layers_with_mtp if include_mtp else cfg.num_hidden_layers
        mla_layers = tuple(range(n_layers))
        index_layers = tuple(i for i in cfg.full_indexer_layers if i < n_layers)
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return cls(
            mla=tuple(jnp.zeros((batch, capacity, width), dtype) for _ in mla_layers),
            index=tuple(jnp.zeros((batch, capacity, cfg.index_head_dim), dtype) for _ in index_layers),
            mla_layers=mla_layers, index_layers=index_layers, kv_lora_rank=cfg.kv_lora_rank,
        )

    @property
    def capacity(self) -> int:
        return self.mla[0].shape[1]

    @staticmethod
    def _scatter(buf_BSX, rows_BTX, pos_BT):
        b, s, x = buf_BSX.shape
        slots = jnp.where((pos_BT >= 0) & (pos_BT < s), pos_BT + s * jnp.arange(b, dtype=pos_BT.dtype)[:, None], -1)
        return write_slots(buf_BSX.reshape(b * s, x), rows_BTX, slots).reshape(b, s, x)

    def _replace(self, group: str, layer: int, value):
        return replace_layer_array(self, group, layer, value)

    def write_mla(self, layer, latent_BTR, rope_BTP, pos_BT):
        buf = self.mla[self.mla_layers.index(layer)]
        rows = jnp.concatenate([latent_BTR.astype(buf.dtype), rope_BTP.astype(buf.dtype)], axis=-1)
        return self._replace("mla", layer, self._scatter(buf, rows, pos_BT))

    def write_index_keys(self, layer, keys_BTI, pos_BT):
        buf = self.index[self.index_layers.index(layer)]
        return self._replace("index", layer, self._scatter(buf, keys_BTI, pos_BT))

    def index_key_pages(self, layer):
        # One page per request, of the whole capacity: the paged view of a contiguous cache.
        buf = self.index[self.index_layers.index(layer)]
        b, s, d = buf.shape
        return PagedKeys(buf.reshape(b * s, d), jnp.arange(b, dtype=jnp.int32)[:, None], s,
                         IndexKeyFormat(jnp.dtype(buf.dtype).name, d))

    def mla_rows(self, layer, num_positions):
        buf = self.mla[self.mla_layers.index(layer)][:, :num_positions]
        return buf[..., : self.kv_lora_rank], buf[..., self.kv_lora_rank :]

    def mla_slots(self, layer, pos_BTK):
        buf = self.mla[self.mla_layers.index(layer)]
        b, s, width = buf.shape
        slots = jnp.where(pos_BTK >= 0, pos_BTK + s * jnp.arange(b, dtype=pos_BTK.dtype)[:, None, None], -1)
        return SlotRows.plain(buf.reshape(b * s, width), slots, self.kv_lora_rank)

    def sparse_slots(self, layer, pos_BTK, full, *, impl="auto"):
        return self.mla_slots(layer, pos_BTK), self

    select = default_select
    attend = default_attend
