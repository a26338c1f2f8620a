import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attention import formats
from glm53.config import get_preset
from kvcache.layout import index_key_bytes, mla_row_bytes


def _rand(shape, seed, scale=1.0):
    return np.asarray(np.random.default_rng(seed).normal(size=shape) * scale, np.float32)


def test_fp8_ds_mla_row_is_656_bytes_with_fields_at_their_offsets():
    latent, rope = _rand((5, 512), 0, 3.0), _rand((5, 64), 1)
    rows = np.asarray(formats.pack_fp8_ds_mla(jnp.asarray(latent), jnp.asarray(rope)))
    assert rows.shape == (5, 656) and rows.dtype == np.uint8
    # Read each field back from raw bytes with numpy, independently of the unpack code.
    q = rows[:, :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = rows[:, 512:528].copy().view("<f4")
    rope_back = rows[:, 528:656].copy().view("<u2").astype(np.uint32) << 16
    np.testing.assert_array_equal(rope_back.view(np.float32), rope.astype(ml_dtypes.bfloat16).astype(np.float32))
    want_scales = np.maximum(np.abs(latent.reshape(5, 4, 128)).max(-1), 1e-4) / 448
    np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
    recon = (q.reshape(5, 4, 128) * scales[..., None]).reshape(5, 512)
    np.testing.assert_allclose(recon, latent, atol=float(want_scales.max()) * 448 * 2**-4)


@pytest.mark.parametrize("r,p", [(512, 64), (128, 16), (200, 8)])
def test_fp8_ds_mla_round_trip_error_bound(r, p):
    latent, rope = _rand((64, r), r, 5.0), _rand((64, p), p)
    latent[0] = 0.0  # an all-zero row: the scale floor keeps it finite
    latent[1, 0] = 1e6  # a huge outlier in one group: clipped scale, no NaN
    rows = formats.pack_fp8_ds_mla(jnp.asarray(latent), jnp.asarray(rope))
    assert rows.shape[-1] == formats.fp8_ds_mla_bytes(r, p) == mla_row_bytes(r, p, "fp8_ds_mla")
    lat, rp = (np.asarray(a) for a in formats.unpack_fp8_ds_mla(rows, p))
    assert np.all(np.isfinite(lat))
    scale = np.repeat(np.maximum(np.abs(np.pad(latent, ((0, 0), (0, -r % 128)))).reshape(64, -1, 128).max(-1),
                                 1e-4) / 448, 128, axis=1)[:, :r]
    # 3 mantissa bits: relative rounding error <= 2^-4; below the normal range the spacing is 2^-9 * scale.
    bound = 2**-4 * np.abs(latent) + 2**-10 * scale
    assert np.all(np.abs(lat - latent) <= bound * (1 + 1e-6))
    assert np.all(lat[0] == 0)
    np.testing.assert_allclose(rp, rope, rtol=2**-8)


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_index_keys_132_bytes_and_round_trip(pow2):
    keys = _rand((33, 128), 7, 2.0)
    rows = np.asarray(formats.pack_fp8_index_keys(jnp.asarray(keys), pow2_scale=pow2))
    assert rows.shape == (33, 132) == (33, index_key_bytes(128, "fp8"))
    scale = rows[:, 128:132].copy().view("<f4")[:, 0]
    if pow2:
        np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))
        assert np.all(scale >= np.abs(keys).max(-1) / 448)  # rounded up: no value clips
    back = np.asarray(formats.unpack_fp8_index_keys(jnp.asarray(rows), 128))
    assert np.all(np.abs(back - keys) <= 2**-4 * np.abs(keys) + 2**-10 * scale[:, None] * (1 + 1e-6))


def test_formats_for_the_glm53_shapes_match_the_byte_accounting():
    cfg = get_preset("glm-5.3")
    mla = formats.MLARowFormat("fp8_ds_mla", cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    idx = formats.IndexKeyFormat("fp8", cfg.index_head_dim)
    assert (mla.row_bytes, idx.row_bytes) == (656, 132)
    for name in ("bfloat16", "float32"):
        assert formats.MLARowFormat(name, 512, 64).row_bytes == mla_row_bytes(512, 64, name)
        assert formats.IndexKeyFormat(name, 128).row_bytes == index_key_bytes(128, name)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        formats.MLARowFormat("fp8_e5m2", 512, 64)
    with pytest.raises(ValueError, match="index cache format"):
        formats.IndexKeyFormat("int8", 128)


@pytest.mark.parametrize("name", formats.MLA_FORMATS)
def test_row_format_pack_unpack(name):
    f = formats.MLARowFormat(name, 128, 16)
    lat, rope = jnp.asarray(_rand((4, 3, 128), 1)), jnp.asarray(_rand((4, 3, 16), 2))
    rows = f.pack(lat, rope)
    assert rows.shape == (4, 3, f.width) and rows.dtype == f.storage_dtype
    back = f.unpack(rows)
    tol = {"float32": 0, "float16": 2**-10, "bfloat16": 2**-8, "fp8_ds_mla": 2**-4}[name]
    np.testing.assert_allclose(back, jnp.concatenate([lat, rope], -1), rtol=tol, atol=tol * 4)
