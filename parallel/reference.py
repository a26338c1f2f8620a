"""Single-device references for what the parallel schemes compute (the specification they must match).

Built only from the attention references (`attention.indexer.topk_reference`,
`attention.sparse_mla.sparse_mqa_reference`); numpy in, numpy out. Positions are request-relative and
row s of a cache holds position s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention import indexer, sparse_mla


@functools.partial(jax.jit, static_argnames=("scale",))
def _sparse_attention(q_lat_BTHR, q_pe_BTHP, rows_BSX, sel_BTK, scale):
    r = q_lat_BTHR.shape[-1]
    valid = sel_BTK >= 0
    g = jnp.take_along_axis(rows_BSX[:, None].astype(jnp.float32), jnp.where(valid, sel_BTK, 0)[..., None], axis=2)
    return sparse_mla.sparse_mqa_reference(q_lat_BTHR, q_pe_BTHP, g[..., :r], g[..., r:], valid, scale)


_topk = jax.jit(indexer.topk_reference, static_argnames=("topk",))


def sparse_attention(q_lat_BTHR, q_pe_BTHP, rows_BSX, sel_BTK, scale: float):
    """Attend the selected positions sel [B,T,K] (-1 = none) of rows [B,S,R+P] -> (out [B,T,H,R], lse [B,T,H])."""
    out, lse = _sparse_attention(q_lat_BTHR, q_pe_BTHP, rows_BSX, np.asarray(sel_BTK, np.int32), scale=scale)
    return np.asarray(out), np.asarray(lse)


def prefill(q_lat_THR, q_pe_THP, qi_THI, w_TH, rows_SX, keys_SI, pos_T, *, topk: int, scale: float):
    """One request's prefill layer on one device: the cache rows [S,R+P] / keys [S,DI] already hold every
    position the queries may see (the prompt's own rows included) -> (out [T,H,R], lse [T,H],
    topk [T, min(topk, S)])."""
    sel = np.asarray(_topk(qi_THI[None], w_TH[None], keys_SI[None], np.asarray(pos_T, np.int32)[None], topk=topk))
    out, lse = sparse_attention(q_lat_THR[None], q_pe_THP[None], rows_SX[None], sel, scale)
    return out[0], lse[0], sel[0]


def decode(q_lat_BTHR, q_pe_BTHP, q_pos_BT, rows_BSX, *, scale: float, index=None, topk_BTK=None):
    """Decode attention on one device for a batch of requests whose caches are rows [B,S,R+P].

    Dense (index and topk_BTK None): every position <= q_pos. index = (qi [B,T,HI,DI], w [B,T,HI],
    keys [B,S,DI], topk): the indexer's top-k. topk_BTK: given selections.
    -> (out [B,T,H,R], lse [B,T,H], topk [B,T,K] or None).
    """
    q_pos_BT = np.asarray(q_pos_BT, np.int32)
    if index is not None:
        qi, w, keys, topk = index
        topk_BTK = np.asarray(_topk(qi, w, keys, q_pos_BT, topk=topk))
    if topk_BTK is None:
        pos = np.arange(rows_BSX.shape[1], dtype=np.int32)
        dense = np.where(pos[None, None, :] <= q_pos_BT[..., None], pos[None, None, :], -1)
        out, lse = sparse_attention(q_lat_BTHR, q_pe_BTHP, rows_BSX, dense, scale)
        return out, lse, None
    out, lse = sparse_attention(q_lat_BTHR, q_pe_BTHP, rows_BSX, topk_BTK, scale)
    return out, lse, np.asarray(topk_BTK)
