"""Dense MLA in un-absorbed (MHA) form: every cached latent row expanded to per-head keys and values.

Cheap for short contexts; with a top-k mask it computes exactly what sparse MLA computes. While a
request's whole visible context is no longer than top-k, DSA selects every position anyway, so this
dense path replaces the sparse one (`use_dense_mha`); `force_mqa=True` disables it so that every
prefill takes the sparse path (DeployConfig.sparse_mla_force_mqa, vLLM's option of the same purpose).
On XLA:CPU a prefill chunk also takes it while its window is a few times top-k: there the dense
products beat gathering each query's selected rows (see `use_dense_mha`).
The dense path has no Pallas kernel: it is large batched matmuls, which XLA already does well; `mha`
tiles them so that causally masked tiles are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention.common import gpu_shaped, masked_softmax_weights, pad_to, resolve_impl

# XLA:CPU only: a step of at least DENSE_PREFILL_MIN_QUERIES query tokens per request takes the dense form
# while its window is at most DENSE_PREFILL_TOPK_RATIO x top-k: up to there the dense products beat
# gathering each query's selected rows, beyond it they cost more (timings: docs/model.md). Fewer queries
# do not pay for expanding every row of the window through kv_b (a decode or MTP-verify step keeps the
# absorbed form). On GPU the sparse kernels are the point, so the dense form is kept to windows <= top-k
# there (vLLM's rule).
DENSE_PREFILL_TOPK_RATIO = 4
DENSE_PREFILL_MIN_QUERIES = 128


def use_dense_mha(window: int, index_topk: int, *, num_queries: int = 1, force_mqa: bool = False,
                  backend: str | None = None) -> bool:
    """Whether a step whose attention window is `window` positions, with `num_queries` query tokens per
    request, takes the dense MHA path. Both paths compute the same attention (the dense one masks to the
    top-k selection); this only picks the faster one for the backend (default: "gpu" where code is shaped
    for a GPU, `attention.common.gpu_shaped`, else "cpu": the code shape decides, not the machine, so
    `shaped_for("cpu")` on a GPU picks what XLA:CPU would)."""
    if force_mqa:
        return False
    if window <= index_topk:
        return True
    on_cpu = (backend or ("gpu" if gpu_shaped() else "cpu")) == "cpu"
    return on_cpu and num_queries >= DENSE_PREFILL_MIN_QUERIES and window <= DENSE_PREFILL_TOPK_RATIO * index_topk


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
    # One product over [nope | rope] and heads-major [B,H,T,S] scores / [B,H,T,V] outputs: the layout
    # XLA:CPU's einsum runs fastest (docs/model.md, XLA:CPU notes).
    q_BTHD = jnp.concatenate([q_nope_BTHN, q_pe_BTHP.astype(q_nope_BTHN.dtype)], -1).astype(f32)
    k_pe_BSHP = jnp.broadcast_to(k_pe_BSP[:, :, None, :], k_nope_BSHN.shape[:3] + k_pe_BSP.shape[-1:])
    k_BSHD = jnp.concatenate([k_nope_BSHN, k_pe_BSHP.astype(k_nope_BSHN.dtype)], -1).astype(f32)
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD) * scale
    p_BHTS, lse_BHT = masked_softmax_weights(s_BHTS, mask_BTS[:, None, :, :])
    o_BHTV = jnp.einsum("bhts,bshv->bhtv", p_BHTS, v_BSHV.astype(f32))
    return jnp.swapaxes(o_BHTV, 1, 2), jnp.swapaxes(lse_BHT, 1, 2)


MHA_BLOCK = 256  # query and key tile of `mha`, the fastest on XLA:CPU for an [8, 1024] prefill (docs/model.md)


def mha(q_nope_BTHN, q_pe_BTHP, k_nope_BSHN, k_pe_BSP, v_BSHV, mask_BTS, scale: float, *, impl: str = "auto",
        block: int = MHA_BLOCK):
    """The dense MHA op: (out [B,T,H,V] f32, lse [B,T,H]), `mha_reference`'s result up to float rounding.

    Tiled with an online softmax: query tile i visits key tiles 0 .. the last one any of its queries may
    see (a dynamic trip count read off the mask), so the causally masked upper triangle of a prefill
    chunk is skipped, and no [B,H,T,S] score array exists (timings: docs/model.md). No Pallas kernel
    (module docstring).
    A single tile (T and S <= block) runs `mha_reference` itself: the tiled form divides by the softmax
    sum after the value product, which rounds differently, and exact top-k comparisons between forms
    downstream (tests/glm53) would see near-ties flip.
    The (row, query tile) items run one after the other (`lax.map`: cache locality on XLA:CPU) or, where
    code is shaped for a GPU (`attention.common.gpu_shaped`), vectorised (`vmap`: every item's tiles in
    one batched product per key step; an item past its last key tile keeps its carry, so the values are
    the same)."""
    resolve_impl(impl)
    f32 = jnp.float32
    b, t, h, _ = q_nope_BTHN.shape
    s_len = k_nope_BSHN.shape[1]
    if t <= block and s_len <= block:  # one tile: nothing to skip, and the reference's exact rounding
        return mha_reference(q_nope_BTHN, q_pe_BTHP, k_nope_BSHN, k_pe_BSP, v_BSHV, mask_BTS, scale)
    q = jnp.concatenate([q_nope_BTHN, q_pe_BTHP.astype(q_nope_BTHN.dtype)], -1).astype(f32)
    k_pe_BSHP = jnp.broadcast_to(k_pe_BSP[:, :, None, :], k_nope_BSHN.shape[:3] + k_pe_BSP.shape[-1:])
    k = jnp.concatenate([k_nope_BSHN, k_pe_BSHP.astype(k_nope_BSHN.dtype)], -1).astype(f32)
    bq, bk = min(block, t), min(block, s_len)
    nq, nk = -(-t // bq), -(-s_len // bk)
    # One loop item per (batch row, query tile), row-major so that consecutive items read the same
    # row's keys: a [H, bq, bk] score tile of one row stays in cache, where a tile of all B rows does
    # not (docs/model.md, cache locality). Heads-major keys and values are laid out once
    # outside the loop, so a key tile is a contiguous slice and the products need no transpose.
    q_IQHD = pad_to(q, 1, nq * bq).reshape(b * nq, bq, h, -1)
    mask_IQS = pad_to(pad_to(mask_BTS, 1, nq * bq), 2, nk * bk).reshape(b * nq, bq, nk * bk)
    k_BHSD = jnp.swapaxes(pad_to(k, 1, nk * bk), 1, 2)
    v_BHSV = jnp.swapaxes(pad_to(v_BSHV.astype(f32), 1, nk * bk), 1, 2)
    last_I = jnp.max(jnp.where(jnp.any(mask_IQS, axis=1), jnp.arange(nk * bk), -1), axis=1)
    trips_I = jnp.where(last_I >= 0, last_I // bk + 1, 0)  # key tiles item i visits
    row_I = jnp.repeat(jnp.arange(b, dtype=jnp.int32), nq)
    dv = v_BHSV.shape[-1]

    def item(args):
        q_QHD, m_QS, trips, row = args
        q_HQD = jnp.swapaxes(q_QHD, 0, 1)

        def visit(j, carry):  # online softmax over key tile j
            mx_HQ, l_HQ, acc_HQV = carry
            k_HKD = jax.lax.dynamic_slice(k_BHSD, (row, 0, j * bk, 0), (1, h, bk, k_BHSD.shape[-1]))[0]
            v_HKV = jax.lax.dynamic_slice(v_BHSV, (row, 0, j * bk, 0), (1, h, bk, dv))[0]
            m_QK = jax.lax.dynamic_slice_in_dim(m_QS, j * bk, bk, 1)
            s_HQK = jnp.where(m_QK[None], jnp.einsum("hqd,hkd->hqk", q_HQD, k_HKD) * scale, -jnp.inf)
            mx_new = jnp.maximum(mx_HQ, jnp.max(s_HQK, -1))
            base = jnp.where(jnp.isfinite(mx_new), mx_new, 0.0)
            rescale = jnp.exp(jnp.where(jnp.isfinite(mx_HQ), mx_HQ - base, -jnp.inf))
            e_HQK = jnp.exp(s_HQK - base[..., None])  # masked entries: exp(-inf) = 0
            return (mx_new, l_HQ * rescale + jnp.sum(e_HQK, -1),
                    acc_HQV * rescale[..., None] + jnp.einsum("hqk,hkv->hqv", e_HQK, v_HKV))

        init = (jnp.full((h, bq), -jnp.inf, f32), jnp.zeros((h, bq), f32), jnp.zeros((h, bq, dv), f32))
        mx, l_HQ, acc = jax.lax.fori_loop(0, trips, visit, init)
        out = acc / jnp.where(l_HQ > 0, l_HQ, 1.0)[..., None]
        lse = jnp.where(l_HQ > 0, jnp.log(jnp.maximum(l_HQ, 1e-30)) + jnp.where(jnp.isfinite(mx), mx, 0.0), -jnp.inf)
        return jnp.swapaxes(out, 0, 1), jnp.swapaxes(lse, 0, 1)  # [bq, H, V], [bq, H]

    loop = jax.vmap(item) if gpu_shaped() else functools.partial(jax.lax.map, item)
    out_IQHV, lse_IQH = loop((q_IQHD, mask_IQS, trips_I, row_I))
    return out_IQHV.reshape(b, nq * bq, h, dv)[:, :t], lse_IQH.reshape(b, nq * bq, h)[:, :t]
