"""Dense MLA in un-absorbed (MHA) form: every cached latent row expanded to per-head keys and values.

Cheap for short contexts; with a top-k mask it computes exactly what sparse MLA computes. While a
request's whole visible context is no longer than top-k, DSA selects every position anyway, so this
dense path replaces the sparse one (`use_dense_mha`); `force_mqa=True` disables it so that every
prefill takes the sparse path (DeployConfig.sparse_mla_force_mqa, vLLM's option of the same purpose).
The dense path has no Pallas kernel: it is two large batched matmuls, which XLA already does well.
"""

from __future__ import annotations

import jax.numpy as jnp

from attention.common import masked_softmax_weights, resolve_impl


def use_dense_mha(window: int, index_topk: int, *, force_mqa: bool = False) -> bool:
    """Whether a step whose attention window is `window` positions takes the dense MHA path."""
    return not force_mqa and window <= index_topk


def topk_mask(topk_BTK, num_positions: int):
    """Selected positions [B,T,K] (-1 = none) -> boolean mask [B,T,S] over positions 0..S-1."""
    b, t, _ = topk_BTK.shape
    idx = jnp.where((topk_BTK >= 0) & (topk_BTK < num_positions), topk_BTK, num_positions)  # -1 -> dropped column
    mask = jnp.zeros((b, t, num_positions + 1), bool)
    mask = mask.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx].set(True)
    return mask[..., :num_positions]


def mha_reference(q_nope_BTHN, q_pe_BTHP, k_nope_BSHN, k_pe_BSP, v_BSHV, mask_BTS, scale: float):
    """Masked attention -> (out [B,T,H,V] f32, lse [B,T,H] f32). The rope key part is shared by all heads."""
    f32 = jnp.float32
    # One product over [nope | rope] and heads-major [B,H,T,S] scores / [B,H,T,V] outputs: on XLA:CPU
    # this runs 3-4x faster than two products into [B,T,H,S].
    q_BTHD = jnp.concatenate([q_nope_BTHN, q_pe_BTHP.astype(q_nope_BTHN.dtype)], -1).astype(f32)
    k_pe_BSHP = jnp.broadcast_to(k_pe_BSP[:, :, None, :], k_nope_BSHN.shape[:3] + k_pe_BSP.shape[-1:])
    k_BSHD = jnp.concatenate([k_nope_BSHN, k_pe_BSHP.astype(k_nope_BSHN.dtype)], -1).astype(f32)
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD) * scale
    p_BHTS, lse_BHT = masked_softmax_weights(s_BHTS, mask_BTS[:, None, :, :])
    o_BHTV = jnp.einsum("bhts,bshv->bhtv", p_BHTS, v_BSHV.astype(f32))
    return jnp.swapaxes(o_BHTV, 1, 2), jnp.swapaxes(lse_BHT, 1, 2)


def mha(q_nope_BTHN, q_pe_BTHP, k_nope_BSHN, k_pe_BSP, v_BSHV, mask_BTS, scale: float, *, impl: str = "auto"):
    """The dense MHA op: (out [B,T,H,V] f32, lse [B,T,H]) (see `mha_reference`). Every impl runs the
    reference (no kernel: see the module docstring)."""
    resolve_impl(impl)
    return mha_reference(q_nope_BTHN, q_pe_BTHP, k_nope_BSHN, k_pe_BSP, v_BSHV, mask_BTS, scale)
