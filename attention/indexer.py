"""DSA lightning indexer: index scores and top-k selection (reference implementation).

I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) for cached positions s <= pos[t], -inf elsewhere, in
float32; the selection is the top-k of I[t, :] in the total order (score descending, then position
ascending), which is exactly what `lax.top_k` does on a position-indexed row. Selected positions that
are not valid come back as -1.

Positions are request-relative: row s of `keys_BSI` holds the key of the request's token at position s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention.common import resolve_impl


def index_scores_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT):
    """q [B,T,HI,DI] f32, w [B,T,HI] f32 (all scales folded in), keys [B,S,DI], q_pos [B,T] int32
    -> scores [B,T,S] float32, -inf where s > q_pos[t] or q_pos[t] < 0 (padding query)."""
    q_BTHI, w_BTH, keys_BSI = (a.astype(jnp.float32) for a in (q_BTHI, w_BTH, keys_BSI))
    # One head at a time, accumulating: XLA:CPU fuses ReLU, weight and sum into each head's product and
    # never materialises [B,T,H,S] (2x faster than one einsum over all heads).
    scores_BTS = jnp.zeros(q_BTHI.shape[:2] + keys_BSI.shape[1:2], jnp.float32)
    for h in range(q_BTHI.shape[2]):
        logits_BTS = jnp.einsum("bti,bsi->bts", q_BTHI[:, :, h], keys_BSI)
        scores_BTS = scores_BTS + jax.nn.relu(logits_BTS) * w_BTH[:, :, h, None]
    s_pos = jnp.arange(keys_BSI.shape[1], dtype=jnp.int32)
    causal_BTS = s_pos[None, None, :] <= q_pos_BT[:, :, None]
    return jnp.where(causal_BTS, scores_BTS, -jnp.inf)


def select_topk(scores_BTS, topk: int):
    """-> positions [B,T,min(topk, S)] int32 in the total order (score desc, position asc), -1 = none."""
    k = min(topk, scores_BTS.shape[-1])
    vals, idx = jax.lax.top_k(scores_BTS, k)
    return jnp.where(vals == -jnp.inf, -1, idx).astype(jnp.int32)


def topk_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT, topk: int):
    """Index scores then top-k: [B,T,min(topk,S)] int32 request-relative positions, -1 padded."""
    return select_topk(index_scores_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT), topk)


def topk(q_BTHI, w_BTH, keys_BSI, q_pos_BT, topk: int, *, impl: str = "auto"):
    """The indexer op: selected positions [B,T,min(topk,S)] int32 (see `topk_reference`)."""
    resolve_impl(impl)
    return topk_reference(q_BTHI, w_BTH, keys_BSI, q_pos_BT, topk)
