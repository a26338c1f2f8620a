import jax.numpy as jnp
import numpy as np

import glm53
from kvcache.contiguous import ContiguousKVCache
from kvcache.layout import index_key_bytes, mla_row_bytes


def test_row_bytes():
    assert mla_row_bytes(512, 64) == 656  # 512 e4m3 + 4 fp32 scales + 64 bf16
    assert index_key_bytes(128) == 132
    assert mla_row_bytes(512, 64, "bfloat16") == 1152


def _cache():
    cfg = glm53.get_preset("tiny")
    return cfg, ContiguousKVCache.create(cfg, batch=2, capacity=8, dtype=jnp.float32)


def test_padding_slot_is_skipped_not_written_to_the_last_row():
    # JAX trap: .at[-1].set(mode="drop") writes the last row. Position -1 must write nothing.
    cfg, cache = _cache()
    lat = jnp.ones((2, 3, cfg.kv_lora_rank))
    rope = jnp.ones((2, 3, cfg.qk_rope_head_dim)) * 2
    pos = jnp.asarray([[0, 1, -1], [-1, 7, 8]])  # 8 is past the capacity: also dropped
    cache = cache.write_mla(0, lat, rope, pos)
    lat_all, rope_all = cache.mla_rows(0, 8)
    written = np.asarray(lat_all[..., 0]) == 1
    np.testing.assert_array_equal(written, [[1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1]])
    assert np.all(np.asarray(rope_all)[written] == 2)
    # other layers untouched
    assert np.all(np.asarray(cache.mla_rows(1, 8)[0]) == 0)


def test_slots_address_rows_by_position_with_padding():
    cfg, cache = _cache()
    keys = jnp.arange(2 * 8, dtype=jnp.float32).reshape(2, 8, 1) * jnp.ones((1, 1, cfg.kv_lora_rank))
    cache = cache.write_mla(2, keys, jnp.zeros((2, 8, cfg.qk_rope_head_dim)), jnp.tile(jnp.arange(8), (2, 1)))
    rows = cache.mla_slots(2, jnp.asarray([[[3, -1]], [[0, 7]]]))
    assert rows.table.shape == (2 * 8, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    np.testing.assert_array_equal(np.asarray(rows.slots), [[[3, -1]], [[8, 15]]])
    got = np.asarray(rows.unpack(rows.table[jnp.maximum(rows.slots, 0)]))[..., 0]
    np.testing.assert_array_equal(np.where(np.asarray(rows.slots) >= 0, got, -1), [[[3, -1]], [[8, 15]]])


def test_index_keys_only_for_full_layers():
    cfg, cache = _cache()
    assert cache.index_layers == cfg.full_indexer_layers
    cache = cache.write_index_keys(6, jnp.ones((2, 1, cfg.index_head_dim)), jnp.asarray([[5], [-1]]))
    k = np.asarray(cache.index_key_pages(6).gather(8))
    assert k[0, 5].sum() == cfg.index_head_dim and k.sum() == cfg.index_head_dim


def test_slots_match_the_dense_view():
    cfg, cache = _cache()
    rows = jnp.arange(2 * 8 * cache.mla[0].shape[-1], dtype=jnp.float32).reshape(2, 8, -1)
    cache = cache.write_mla(1, rows[..., : cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank:], jnp.tile(jnp.arange(8), (2, 1)))
    pos = jnp.asarray([[[3, -1, 7]], [[0, 5, -1]]])
    sr = cache.mla_slots(1, pos)
    lat, rope = cache.mla_rows(1, 8)
    dense = np.concatenate([np.asarray(lat), np.asarray(rope)], -1)  # [B, S, R+P]
    for b in range(2):
        for k in range(3):
            p = int(pos[b, 0, k])
            if p >= 0:
                np.testing.assert_array_equal(np.asarray(sr.table[sr.slots[b, 0, k]]), dense[b, p])
    np.testing.assert_array_equal(np.asarray(sr.slots < 0), np.asarray(pos < 0))
