"""KV-cache storage formats: pack new rows into the cache's bytes, unpack gathered rows to float32.

fp8_ds_mla (one MLA row per token per layer; 656 bytes for GLM-5.3, contiguous per token):

    bytes [0, R)              R x float8_e4m3fn    latent, quantised in groups of 128 values
    bytes [R, R + 4G)         G x float32          one scale per group (G = ceil(R / 128))
    bytes [R + 4G, +2P)       P x bfloat16         rope part (not quantised)

fp8 indexer keys (one key per token per full indexer layer; 132 bytes for GLM-5.3):

    bytes [0, D)              D x float8_e4m3fn    the key, one group per 128 values
    bytes [D, D + 4G)         G x float32          scales (optionally rounded up to a power of two)

vLLM stores an indexer page as all keys first, then all scales; we keep each token's key and scale
together (the same bytes per token), so one gathered row is self-contained.

Quantisation (per group of 128 values): scale = max(amax, 1e-4) / 448, optionally rounded up to a power
of two; q = clip(x / scale, -448, 448) cast to float8_e4m3fn (out-of-range casts give NaN, not 448, hence
the clip); x ~= q * scale. Relative error per value is at most 2^-4 of the group's amax (3 mantissa bits;
half an ulp at the top binade is 2^-4 of the value).

Multi-byte fields are little-endian (the byte order of every platform JAX runs on); tests assert the
offsets on raw bytes. In a cache (`MLARowFormat`, `IndexKeyFormat`) the fp8 rows are held as the same
bytes viewed as uint32 words (164 words per MLA row, 33 per indexer key): a GPU kernel can then load
power-of-two blocks of whole words and decode bytes with shifts (Triton bitcasts only between types of
one width), and no per-step byte <-> word conversion of the whole cache is needed. The plain formats
("bfloat16", "float32", "float16") store [latent | rope] values as is.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4
GROUP = 128  # values per fp32 scale

MLA_FORMATS = ("fp8_ds_mla", "bfloat16", "float32", "float16")
INDEX_FORMATS = ("fp8", "bfloat16", "float32", "float16")
_PLAIN = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def num_groups(dim: int) -> int:
    return math.ceil(dim / GROUP)


def quantize_fp8(x, *, pow2_scale: bool = False):
    """x [..., D] -> (q float8_e4m3fn [..., D], scale float32 [..., ceil(D/128)]): one scale per 128 values
    (the last group may be shorter)."""
    x = x.astype(jnp.float32)
    d = x.shape[-1]
    g = num_groups(d)
    xg = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, g * GROUP - d)]).reshape(x.shape[:-1] + (g, GROUP))
    scale = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), SCALE_FLOOR) / FP8_MAX
    if pow2_scale:
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    q = jnp.clip(x / _per_value(scale, d), -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale


def dequantize_fp8(q, scale):
    """q float8_e4m3fn [..., D], scale [..., ceil(D/128)] -> float32 [..., D]."""
    return q.astype(jnp.float32) * _per_value(scale.astype(jnp.float32), q.shape[-1])


def _per_value(scale_G, d: int):
    return jnp.repeat(scale_G, GROUP, axis=-1)[..., :d]


def _to_bytes(x):
    """[..., n] of a w-byte dtype -> uint8 [..., n * w] (little-endian)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(x.shape[:-1] + (-1,)) if b.ndim > x.ndim else b


def _from_bytes(b, dtype):
    """uint8 [..., n * w] -> [..., n] of the w-byte `dtype`."""
    w = jnp.dtype(dtype).itemsize
    if w == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(b.shape[:-1] + (-1, w)), dtype)


def bytes_to_words(b):
    """uint8 [..., 4n] -> uint32 [..., n] (little-endian words)."""
    return _from_bytes(b, jnp.uint32)


def words_to_bytes(w):
    """uint32 [..., n] -> uint8 [..., 4n]."""
    return _to_bytes(w)


def fp8_ds_mla_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    return kv_lora_rank + 4 * num_groups(kv_lora_rank) + 2 * rope_dim


def pack_fp8_ds_mla(latent, rope):
    """latent [..., R], rope [..., P] -> uint8 [..., R + 4*ceil(R/128) + 2P] (656 for R=512, P=64)."""
    q, scale = quantize_fp8(latent)
    return jnp.concatenate([_to_bytes(q), _to_bytes(scale), _to_bytes(rope.astype(jnp.bfloat16))], axis=-1)


def unpack_fp8_ds_mla(rows, rope_dim: int = 64):
    """uint8 rows [..., X] -> (latent float32 [..., R], rope float32 [..., P]); R follows from X and P."""
    r = _latent_width(rows.shape[-1], rope_dim)
    g = num_groups(r)
    latent = dequantize_fp8(_from_bytes(rows[..., :r], FP8), _from_bytes(rows[..., r : r + 4 * g], jnp.float32))
    rope = _from_bytes(rows[..., r + 4 * g :], jnp.bfloat16).astype(jnp.float32)
    return latent, rope


def _latent_width(row_bytes: int, rope_dim: int) -> int:
    rest = row_bytes - 2 * rope_dim
    for r in range(max(rest - 4 * num_groups(rest), 1), rest + 1):
        if r + 4 * num_groups(r) == rest:
            return r
    raise ValueError(f"{row_bytes}-byte rows are not fp8_ds_mla rows with rope_dim={rope_dim}")


def fp8_index_key_bytes(dim: int) -> int:
    return dim + 4 * num_groups(dim)


def pack_fp8_index_keys(keys, *, pow2_scale: bool = False):
    """keys [..., D] -> uint8 [..., D + 4*ceil(D/128)] (132 for D=128)."""
    q, scale = quantize_fp8(keys, pow2_scale=pow2_scale)
    return jnp.concatenate([_to_bytes(q), _to_bytes(scale)], axis=-1)


def unpack_fp8_index_keys(rows, dim: int):
    """uint8 rows [..., D + 4G] -> float32 keys [..., D]."""
    return dequantize_fp8(_from_bytes(rows[..., :dim], FP8), _from_bytes(rows[..., dim:], jnp.float32))


# ----------------------------------------------------------------------------------- cache row formats
@dataclasses.dataclass(frozen=True)
class MLARowFormat:
    """How one MLA row (latent [R] + rope [P]) is stored: `width` elements of `storage_dtype` per row."""

    name: str
    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self):
        if self.name not in MLA_FORMATS:
            raise ValueError(f"kv_cache_dtype must be one of {MLA_FORMATS}, got {self.name!r}")
        if self.name == "fp8_ds_mla" and (self.kv_lora_rank % 4 or self.rope_dim % 2):
            raise ValueError("fp8_ds_mla rows need kv_lora_rank % 4 == 0 and an even rope_dim (uint32 words), "
                             f"got {self.kv_lora_rank} and {self.rope_dim}")

    @property
    def fp8(self) -> bool:
        return self.name == "fp8_ds_mla"

    @property
    def storage_dtype(self):
        return jnp.uint32 if self.fp8 else _PLAIN[self.name]

    @property
    def row_bytes(self) -> int:
        r, p = self.kv_lora_rank, self.rope_dim
        return fp8_ds_mla_bytes(r, p) if self.fp8 else (r + p) * jnp.dtype(self.storage_dtype).itemsize

    @property
    def width(self) -> int:
        """Stored elements per row."""
        return self.row_bytes // jnp.dtype(self.storage_dtype).itemsize

    def pack(self, latent, rope):
        """latent [..., R], rope [..., P] -> stored rows [..., width]."""
        if self.fp8:
            return bytes_to_words(pack_fp8_ds_mla(latent, rope))
        dt = self.storage_dtype
        return jnp.concatenate([latent.astype(dt), rope.astype(dt)], axis=-1)

    def unpack(self, rows):
        """stored rows [..., width] -> float32 [..., R + P] (latent then rope)."""
        if self.fp8:
            return jnp.concatenate(unpack_fp8_ds_mla(words_to_bytes(rows), self.rope_dim), axis=-1)
        return rows.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class IndexKeyFormat:
    """How one indexer key [D] is stored: `width` elements of `storage_dtype` per key."""

    name: str
    dim: int
    pow2_scale: bool = False

    def __post_init__(self):
        if self.name not in INDEX_FORMATS:
            raise ValueError(f"index cache format must be one of {INDEX_FORMATS}, got {self.name!r}")
        if self.name == "fp8" and self.dim % 4:
            raise ValueError(f"fp8 indexer keys need index_head_dim % 4 == 0 (uint32 words), got {self.dim}")

    @property
    def fp8(self) -> bool:
        return self.name == "fp8"

    @property
    def storage_dtype(self):
        return jnp.uint32 if self.fp8 else _PLAIN[self.name]

    @property
    def row_bytes(self) -> int:
        return fp8_index_key_bytes(self.dim) if self.fp8 else self.dim * jnp.dtype(self.storage_dtype).itemsize

    @property
    def width(self) -> int:
        """Stored elements per key."""
        return self.row_bytes // jnp.dtype(self.storage_dtype).itemsize

    def pack(self, keys):
        """keys [..., D] -> stored keys [..., width]."""
        if self.fp8:
            return bytes_to_words(pack_fp8_index_keys(keys, pow2_scale=self.pow2_scale))
        return keys.astype(self.storage_dtype)

    def unpack(self, rows):
        """stored keys [..., width] -> float32 [..., D]."""
        if self.fp8:
            return unpack_fp8_index_keys(words_to_bytes(rows), self.dim)
        return rows.astype(jnp.float32)
