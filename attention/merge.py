"""Exact log-sum-exp merge of partial attention outputs.

Attention over a set of rows split into disjoint parts (DCP shards, KV chunks) can be computed part by
part: each part yields its normalised output o_i and the natural-log LSE of its scores, lse_i. The
attention over the union is then

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * o_i

exactly (up to float rounding). A part with no valid row has lse_i = -inf and weight 0, whatever its
o_i holds (even NaN is ignored, since it is masked rather than multiplied); if every part is empty the
merged output is 0 and its lse -inf, never NaN.
"""

from __future__ import annotations

import jax.numpy as jnp


def merge(out_N_D, lse_N, axis: int = 0):
    """Merge partial results stacked along `axis`.

    out [..., N, ..., D] (any float dtype; D = value width, always the last axis), lse [..., N, ...]
    float32 (same shape as `out` without D) -> (out [..., D] float32, lse [...] float32), with `axis`
    removed from both.
    """
    axis = axis % lse_N.ndim
    lse_N = lse_N.astype(jnp.float32)
    m = jnp.max(lse_N, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_N = jnp.where(jnp.isfinite(lse_N), jnp.exp(lse_N - m), 0.0)
    total = jnp.sum(w_N, axis=axis, keepdims=True)
    safe_total = jnp.where(total > 0, total, 1.0)
    weighted = jnp.where(w_N[..., None] > 0, out_N_D.astype(jnp.float32), 0.0) * w_N[..., None]
    out = jnp.sum(weighted, axis=axis) / jnp.squeeze(safe_total, axis)[..., None]
    lse = jnp.where(total > 0, jnp.log(safe_total) + m, -jnp.inf)
    return out, jnp.squeeze(lse, axis)


def merge_two(out_a, lse_a, out_b, lse_b):
    """Merge two partial results: out [..., D], lse [...] each -> (out [..., D] f32, lse [...] f32)."""
    return merge(jnp.stack([out_a.astype(jnp.float32), out_b.astype(jnp.float32)]),
                 jnp.stack([lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)]))
