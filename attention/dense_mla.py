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

import jax
import jax.numpy as jnp

from attention.common import masked_softmax_weights, pad_to, resolve_impl

# XLA:CPU only: a step of at least DENSE_PREFILL_MIN_QUERIES query tokens per request takes the dense form
# while its window is at most DENSE_PREFILL_TOPK_RATIO x top-k. Measured on 2 cores, mid config (top-k
# 256), 1,024-token chunks: window 1024: dense 0.76 s vs sparse 0.96 s for a whole 1K `score`; window
# 2048: dense slower by about 0.27 s per chunk. Fewer queries do not pay for expanding every row of the
# window through kv_b (a decode or MTP-verify step keeps the absorbed form). On GPU the sparse kernels
# are the point, so the dense form is kept to windows <= top-k there (vLLM's rule).
DENSE_PREFILL_TOPK_RATIO = 4
DENSE_PREFILL_MIN_QUERIES = 128


def use_dense_mha(window: int, index_topk: int, *, num_queries: int = 1, force_mqa: bool = False,
                  backend: str | None = None) -> bool:
    """Whether a step whose attention window is `window` positions, with `num_queries` query tokens per
    request, takes the dense MHA path. Both paths compute the same attention (the dense one masks to the
    top-k selection); this only picks the faster one for the backend (default: jax.default_backend())."""
    if force_mqa:
        return False
    if window <= index_topk:
        return True
    on_cpu = (backend or jax.default_backend()) == "cpu"
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
    # One product over [nope | rope] and heads-major [B,H,T,S] scores / [B,H,T,V] outputs: on XLA:CPU
    # this runs 3-4x faster than two products into [B,T,H,S].
    q_BTHD = jnp.concatenate([q_nope_BTHN, q_pe_BTHP.astype(q_nope_BTHN.dtype)], -1).astype(f32)
    k_pe_BSHP = jnp.broadcast_to(k_pe_BSP[:, :, None, :], k_nope_BSHN.shape[:3] + k_pe_BSP.shape[-1:])
    k_BSHD = jnp.concatenate([k_nope_BSHN, k_pe_BSHP.astype(k_nope_BSHN.dtype)], -1).astype(f32)
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD) * scale
    p_BHTS, lse_BHT = masked_softmax_weights(s_BHTS, mask_BTS[:, None, :, :])
    o_BHTV = jnp.einsum("bhts,bshv->bhtv", p_BHTS, v_BSHV.astype(f32))
    return jnp.swapaxes(o_BHTV, 1, 2), jnp.swapaxes(lse_BHT, 1, 2)


MHA_BLOCK = 256  # query and key tile of `mha` (XLA:CPU, [8, 1024] prefill: 256 beats 128 and the untiled form)


def mha(q_nope_BTHN, q_pe_BTHP, k_nope_BSHN, k_pe_BSP, v_BSHV, mask_BTS, scale: float, *, impl: str = "auto",
        block: int = MHA_BLOCK):
    """The dense MHA op: (out [B,T,H,V] f32, lse [B,T,H]), `mha_reference`'s result up to float rounding.

    Tiled with an online softmax: query tile i visits key tiles 0 .. the last one any of its queries may
    see (a dynamic trip count read off the mask), so the causally masked upper triangle of a prefill
    chunk is skipped: about 45% less time for an [8, 1024] chunk over a 1024 window on 2 CPU cores
    (0.31 s vs 0.57 s per layer), and no [B,H,T,S] score array. No Pallas kernel (module docstring).
    A single tile (T and S <= block) runs `mha_reference` itself: the tiled form divides by the softmax
    sum after the value product, which rounds differently, and exact top-k comparisons between forms
    downstream (tests/glm53) would see near-ties flip."""
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
    mask = pad_to(pad_to(mask_BTS, 1, nq * bq), 2, nk * bk)
    # heads-major layouts once, outside the loops: a key tile is then a contiguous slice and the
    # products need no per-tile transpose (those transposes were ~4% of the engine's prefill step)
    q_QBHTD = jnp.transpose(pad_to(q, 1, nq * bq).reshape(b, nq, bq, h, -1), (1, 0, 3, 2, 4))
    k_BHSD = jnp.swapaxes(pad_to(k, 1, nk * bk), 1, 2)
    v_BHSV = jnp.swapaxes(pad_to(v_BSHV.astype(f32), 1, nk * bk), 1, 2)
    mask_QBTS = jnp.swapaxes(mask.reshape(b, nq, bq, nk * bk), 0, 1)
    seen_QS = jnp.any(mask_QBTS, axis=(1, 2))
    last_Q = jnp.max(jnp.where(seen_QS, jnp.arange(nk * bk)[None], -1), axis=1)
    trips_Q = jnp.where(last_Q >= 0, last_Q // bk + 1, 0)

    def query_tile(args):
        q_BHQD, m_BQS, trips = args

        def visit(j, carry):  # online softmax over key tile j
            mx_BHQ, l_BHQ, acc_BHQV = carry
            k_BHKD = jax.lax.dynamic_slice_in_dim(k_BHSD, j * bk, bk, 2)
            v_BHKV = jax.lax.dynamic_slice_in_dim(v_BHSV, j * bk, bk, 2)
            m_BQK = jax.lax.dynamic_slice_in_dim(m_BQS, j * bk, bk, 2)
            s_BHQK = jnp.where(m_BQK[:, None], jnp.einsum("bhqd,bhkd->bhqk", q_BHQD, k_BHKD) * scale, -jnp.inf)
            mx_new = jnp.maximum(mx_BHQ, jnp.max(s_BHQK, -1))
            base = jnp.where(jnp.isfinite(mx_new), mx_new, 0.0)
            rescale = jnp.exp(jnp.where(jnp.isfinite(mx_BHQ), mx_BHQ - base, -jnp.inf))
            e_BHQK = jnp.exp(s_BHQK - base[..., None])  # masked entries: exp(-inf) = 0
            return (mx_new, l_BHQ * rescale + jnp.sum(e_BHQK, -1),
                    acc_BHQV * rescale[..., None] + jnp.einsum("bhqk,bhkv->bhqv", e_BHQK, v_BHKV))

        init = (jnp.full((b, h, bq), -jnp.inf, f32), jnp.zeros((b, h, bq), f32),
                jnp.zeros((b, h, bq, v_BHSV.shape[-1]), f32))
        mx, l_BHQ, acc = jax.lax.fori_loop(0, trips, visit, init)
        out = acc / jnp.where(l_BHQ > 0, l_BHQ, 1.0)[..., None]
        lse = jnp.where(l_BHQ > 0, jnp.log(jnp.maximum(l_BHQ, 1e-30)) + jnp.where(jnp.isfinite(mx), mx, 0.0),
                        -jnp.inf)
        return out, lse

    out_QBHTV, lse_QBHT = jax.lax.map(query_tile, (q_QBHTD, mask_QBTS, trips_Q))
    out = jnp.moveaxis(out_QBHTV, 0, 2).reshape(b, h, nq * bq, -1)[:, :, :t]  # -> [B, H, nq, bq, V]
    lse = jnp.moveaxis(lse_QBHT, 0, 2).reshape(b, h, nq * bq)[:, :, :t]
    return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)
