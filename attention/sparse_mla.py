"""Sparse MLA in absorbed (MQA) form over selected latent rows.

Each query token attends only the rows its indexer selected. Scores are computed over the full latent
row (kv_lora latent + rope part), values are the latent part; the per-head value projection (kv_b's value
half) and o_proj are applied by the caller.

Two entry points:
- `sparse_mqa_reference`: the specification, over rows already gathered per query.
- `sparse_mqa`: the op the model calls. Rows are addressed by *slot* in a flat row table (`SlotRows`: a
  paged cache's global slot `block_table[req, pos // B] * B + pos % B`, or `req * S + pos` for a
  contiguous cache), -1 = none, stored in whatever format the cache uses (the cache supplies the unpack
  of a gathered row). The jnp implementation gathers and attends a few queries at a time, so the
  [T, K, 576] gathered rows never exist at once (on CPU ~4x faster than gathering everything first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from attention.common import masked_softmax_weights, resolve_impl


def _to_float32(rows):
    return rows.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SlotRows:
    """MLA rows addressed by slot. table [N, X]: rows in the cache's storage format (X = R + P values for
    plain float caches, 656 bytes for fp8_ds_mla); slots [B, T, K] int32, -1 = none; unpack: gathered
    raw rows [..., X] -> float32 [..., R + P] (latent then rope)."""

    table: jax.Array
    slots: jax.Array
    unpack: Callable[[jax.Array], jax.Array] = _to_float32

QUERY_BLOCK = 4  # queries per step of the blocked jnp path (measured best on XLA:CPU)


def sparse_mqa_reference(q_lat_BTHR, q_pe_BTHP, lat_BTKR, pe_BTKP, valid_BTK, scale: float):
    """q_lat [B,T,H,R] (query folded into latent space), q_pe [B,T,H,P], selected rows lat [B,T,K,R] and
    pe [B,T,K,P], valid [B,T,K] bool -> (out [B,T,H,R] f32, lse [B,T,H] f32, natural log; -inf and a zero
    output for a query with no valid row)."""
    f32 = jnp.float32
    s_BTHK = (jnp.einsum("bthr,btkr->bthk", q_lat_BTHR.astype(f32), lat_BTKR.astype(f32))
              + jnp.einsum("bthp,btkp->bthk", q_pe_BTHP.astype(f32), pe_BTKP.astype(f32))) * scale
    p_BTHK, lse_BTH = masked_softmax_weights(s_BTHK, valid_BTK[:, :, None, :])
    return jnp.einsum("bthk,btkr->bthr", p_BTHK, lat_BTKR.astype(f32)), lse_BTH


def sparse_mqa(q_lat_BTHR, q_pe_BTHP, rows: SlotRows, scale: float, *, impl: str = "auto",
               query_block: int = QUERY_BLOCK):
    """Sparse MQA reading rows by slot -> (out [B,T,H,R] f32, lse [B,T,H] f32). Equals
    `sparse_mqa_reference` on the gathered, unpacked rows."""
    resolve_impl(impl)
    rows_NX, slots_BTK = rows.table, rows.slots
    b, t, h, r = q_lat_BTHR.shape
    k = slots_BTK.shape[-1]
    n = b * t
    nb = -(-n // query_block)
    pad = nb * query_block - n
    q = jnp.concatenate([q_lat_BTHR, q_pe_BTHP.astype(q_lat_BTHR.dtype)], -1).reshape(n, h, -1)
    slots = slots_BTK.reshape(n, k)
    if pad:
        q = jnp.concatenate([q, jnp.zeros((pad,) + q.shape[1:], q.dtype)])
        slots = jnp.concatenate([slots, jnp.full((pad, k), -1, slots.dtype)])

    def block(args):
        q_QHX, s_QK = args
        valid_QK = s_QK >= 0
        rows_QKX = rows.unpack(jnp.take(rows_NX, jnp.where(valid_QK, s_QK, 0), axis=0))
        rows_QKX = jnp.where(valid_QK[..., None], rows_QKX, 0.0)
        s_QHK = jnp.einsum("qhx,qkx->qhk", q_QHX.astype(jnp.float32), rows_QKX) * scale
        p_QHK, lse_QH = masked_softmax_weights(s_QHK, valid_QK[:, None, :])
        return jnp.einsum("qhk,qkr->qhr", p_QHK, rows_QKX[..., :r]), lse_QH

    out, lse = jax.lax.map(block, (q.reshape(nb, query_block, h, -1), slots.reshape(nb, query_block, k)))
    out = out.reshape(nb * query_block, h, r)[:n].reshape(b, t, h, r)
    return out, lse.reshape(nb * query_block, h)[:n].reshape(b, t, h)
