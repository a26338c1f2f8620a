"""Shared pieces of the attention references."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_softmax_weights(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row-wise softmax over the last axis restricted to `mask`, with its natural-log LSE.

    scores [..., S] float32, mask [..., S] bool -> (p [..., S] f32, lse [...] f32). A row with no valid
    entry gets p = 0 and lse = -inf (weight 0 in an LSE merge), never NaN.
    """
    s = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, jnp.log(jnp.maximum(denom[..., 0], 1e-30)) + m[..., 0], -jnp.inf)
    return p, lse


IMPLS = ("auto", "reference")


def resolve_impl(impl: str) -> str:
    """Which implementation of an op to run. "auto" is the reference until the Pallas kernels land (the
    kernels issue adds "pallas", chosen by "auto" on GPU)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return "reference"
