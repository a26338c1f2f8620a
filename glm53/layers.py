"""GLM-5.3 building blocks in flax.nnx: norms, interleaved RoPE, MLA with the lightning indexer, MoE.

Conventions
- Shape suffixes: B batch (requests), T query tokens, S cache positions, K selected rows (top-k),
  D hidden, H heads, R kv_lora_rank (latent width), P qk_rope_head_dim, N qk_nope_head_dim,
  V v_head_dim, E experts, F expert / MLP width.
- Weights are stored [in, out] (HF stores nn.Linear weights [out, in]; weights.py transposes) and named as
  in HF so that a parameter path maps to an HF tensor name by joining with dots.
- Positions are request-relative token positions; -1 marks a padding token (its KV is not written and
  its output is garbage that callers ignore).
- The KV cache is behind the `kvcache.base.KVCache` interface: layers write their new rows and read rows
  by position; they never see how the cache is laid out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention import dense_mla
from attention.common import gpu_shaped
from attention import fp8_matmul as fp8
from glm53.config import ModelConfig
from kvcache.base import KVCache

Array = jax.Array


# ---------------------------------------------------------------------------------------------- primitives
class Linear(nnx.Module):
    """y = x @ weight, weight [in, out], no bias."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs, dtype, std: float = 0.02):
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (din, dout), jnp.float32).astype(dtype))

    def __call__(self, x: Array) -> Array:
        return x @ self.weight[...]

    def matrix(self) -> Array:
        """The weight [in, out] as a float array (for products that are not `x @ W`, e.g. absorbed MLA)."""
        return self.weight[...]


class Fp8Linear(nnx.Module):
    """y = x @ W with W block-quantised (a checkpoint's fp8 linear layer): weight [in, out] float8_e4m3fn,
    weight_scale_inv [ceil(in/128), ceil(out/128)] float32, W ~= weight * the scale of its 128 x 128 block.

    The product quantises x per token and group of 128 and accumulates in float32
    (attention.fp8_matmul); the output is cast to x's dtype. `dtype` is the model's activation dtype,
    the dtype `matrix()` dequantises to; `impl` the fp8 matmul implementation ("auto", "reference",
    "dequant")."""

    def __init__(self, blocks: fp8.BlockFp8, *, dtype, impl: str = "auto"):
        if blocks.q.ndim != 2:
            raise ValueError(f"Fp8Linear takes a 2-D weight, got shape {list(blocks.q.shape)}")
        fp8.resolve_impl(impl)
        self.weight = nnx.Param(blocks.q)
        self.weight_scale_inv = nnx.Param(blocks.scale)
        self.dtype = dtype
        self.impl = impl

    @classmethod
    def from_linear(cls, linear: Linear, *, dtype, impl: str = "auto") -> Fp8Linear:
        """Quantise a float Linear's weight in 128 x 128 blocks (fp8_matmul.quantize_blocks)."""
        return cls(fp8.quantize_blocks(linear.weight[...]), dtype=dtype, impl=impl)

    def blocks(self) -> fp8.BlockFp8:
        return fp8.BlockFp8(self.weight[...], self.weight_scale_inv[...])

    def __call__(self, x: Array) -> Array:
        return fp8.matmul(x, self.blocks(), impl=self.impl).astype(x.dtype)

    def matrix(self) -> Array:
        """The weight dequantised per block to the model dtype (inside the jitted step: memory keeps fp8)."""
        return self.blocks().dequantize(self.dtype)


class RMSNorm(nnx.Module):
    """HF GlmMoeDsaRMSNorm: normalise in float32, cast back, then scale (in that order)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with bias (the indexer's k_norm), computed in float32."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope_angles(pos: Array, rope_dim: int, theta: float) -> tuple[Array, Array]:
    """cos, sin [..., rope_dim // 2] (float32) for integer positions [...]; pair j uses theta^(-2j/rope_dim)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))
    ang = pos.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope_interleaved(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate pairs (x[2j], x[2j+1]) by angle j; x [..., P], cos/sin broadcastable to [..., P/2].

    The output keeps pair order. HF returns the same values in half-split order (all even outputs first);
    both orders give the same dot products, so only cached rope bytes differ (BRIEF §1).
    """
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


# ------------------------------------------------------------------------------------------------- indexer
class Indexer(nnx.Module):
    """DSA lightning indexer of one full layer: I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s]).

    q_I = (qr Wq_b).view(heads, dim); k_I = LayerNorm(x Wk) (one key per token); interleaved RoPE on the
    first qk_rope_head_dim dims of both; w = (x W_proj) * heads^-0.5 * dim^-0.5. Scores are float32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype):
        self.cfg = cfg
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, hi * di, rngs=rngs, dtype=dtype)
        self.wk = Linear(cfg.hidden_size, di, rngs=rngs, dtype=dtype)
        self.k_norm = LayerNorm(di, cfg.indexer_norm_eps, dtype=dtype)
        # HF keeps weights_proj in float32 even in a bf16 model (_keep_in_fp32_modules).
        self.weights_proj = Linear(cfg.hidden_size, hi, rngs=rngs, dtype=jnp.float32)

    def key(self, x_BTD, cos, sin):
        """-> k_BTI [B,T,DI] (model dtype): each token's index key, roped; cos/sin [B,T,P/2]."""
        p = self.cfg.qk_rope_head_dim
        k = self.k_norm(self.wk(x_BTD))
        return jnp.concatenate([apply_rope_interleaved(k[..., :p], cos, sin), k[..., p:]], -1)

    def queries(self, x_BTD, qr_BTQ, cos, sin):
        """-> q_BTHI [B,T,HI,DI] f32, w_BTH [B,T,HI] f32 (scales folded in) for the query tokens."""
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        p = cfg.qk_rope_head_dim
        q = self.wq_b(qr_BTQ).reshape(b, t, cfg.index_n_heads, cfg.index_head_dim)
        q = jnp.concatenate([apply_rope_interleaved(q[..., :p], cos[:, :, None], sin[:, :, None]), q[..., p:]], -1)
        scale = cfg.index_n_heads ** -0.5 * cfg.index_head_dim ** -0.5
        w = self.weights_proj(x_BTD.astype(jnp.float32)) * scale
        return q.astype(jnp.float32), w


def take_rows(a_BT, rows_BR):
    """a [B,T,...] -> a [B,R,...]: for each batch row b, the tokens rows_BR[b] (indices into T)."""
    return jnp.take_along_axis(a_BT, rows_BR.reshape(rows_BR.shape + (1,) * (a_BT.ndim - 2)), axis=1)


# ----------------------------------------------------------------------------------------------------- MLA
class MLAttention(nnx.Module):
    """Multi-head latent attention with DSA sparse selection (one decoder layer's self_attn).

    Cache rows per token: the 512-wide (kv_lora_rank) normalised latent c_kv and the 64-wide roped k_pe.
    `form="mqa"`: absorbed form (query folded through kv_b's key part into latent space; attends the
    selected latent rows; the path sparse kernels take). `form="mha"`: un-absorbed form (every cached row
    expanded to per-head keys/values, masked dense attention). Both give the same result.
    """

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype):
        self.cfg = cfg
        self.layer = layer
        h = cfg.num_attention_heads
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, rngs=rngs, dtype=dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype=dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, rngs=rngs, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, rngs=rngs, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), rngs=rngs, dtype=dtype)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.indexer = Indexer(cfg, rngs=rngs, dtype=dtype) if cfg.layer_indexer_type(layer) == "full" else None

    def _kv_b(self):
        """kv_b split per head: w_uk [R, H, N] (key part), w_uv [R, H, V] (value part)."""
        cfg = self.cfg
        # Absorbed into the query and applied to latent rows, kv_b is a weight operand rather than a
        # product with activations: an fp8 kv_b is dequantised per block here (vLLM dequantises it once
        # at load; we keep memory in fp8).
        w = self.kv_b_proj.matrix().reshape(cfg.kv_lora_rank, cfg.num_attention_heads, -1)
        return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim :]

    def __call__(self, x_BTD: Array, pos_BT: Array, cache: KVCache, topk_BTK: Array | None, *, window: int,
                 form: str = "mqa", impl: str = "auto", rows_BR: Array | None = None):
        """x [B,T,D] (already input-normed) -> (out [B,T,D], cache, topk_BTK [B,T,K] int32 positions, -1 = none).

        `window` (static): every query position in this call is < window <= cache capacity, so only cache
        positions [0, window) are read. `topk_BTK` is the selection of the nearest earlier full layer;
        required for shared layers and ignored by full layers, which compute their own. `impl` picks the
        attention ops' implementation ("auto", "reference", "pallas"; see attention.common).
        `rows_BR` [B,R] int32 (optional): only these tokens (indices into T) are queries; every token's
        KV and index key is still written. The output and the selection are then [B,R,...].
        """
        cfg = self.cfg
        h, n, p, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        cos, sin = rope_angles(pos_BT, p, cfg.rope_theta)  # [B,T,P/2]

        kv_BTX = self.kv_a_proj_with_mqa(x_BTD)
        latent_BTR = self.kv_a_layernorm(kv_BTX[..., :r])
        k_pe_BTP = apply_rope_interleaved(kv_BTX[..., r:], cos, sin)
        cache = cache.write_mla(self.layer, latent_BTR, k_pe_BTP, pos_BT)
        if self.indexer is not None:
            cache = cache.write_index_keys(self.layer, self.indexer.key(x_BTD, cos, sin), pos_BT)

        if rows_BR is not None:  # from here on T means the query tokens
            x_BTD, pos_BT, cos, sin = (take_rows(a, rows_BR) for a in (x_BTD, pos_BT, cos, sin))
            if self.indexer is None and topk_BTK is not None:
                topk_BTK = take_rows(topk_BTK, rows_BR)
        b, t, _ = x_BTD.shape
        qr_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTD))
        q_BTHQ = self.q_b_proj(qr_BTQ).reshape(b, t, h, n + p)
        q_nope_BTHN = q_BTHQ[..., :n]
        q_pe_BTHP = apply_rope_interleaved(q_BTHQ[..., n:], cos[:, :, None], sin[:, :, None])

        if self.indexer is not None:
            q_idx, w_idx = self.indexer.queries(x_BTD, qr_BTQ, cos, sin)
            topk_BTK, cache = cache.select(self.layer, q_idx, w_idx, pos_BT, cfg.index_topk, window=window,
                                           impl=impl)
        elif topk_BTK is None:
            raise ValueError(f"layer {self.layer} shares top-k indices but no earlier full layer provided them")

        w_uk_RHN, w_uv_RHV = self._kv_b()
        scale = cfg.softmax_scale
        if form == "mqa":
            q_lat_BTHR = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, w_uk_RHN)
            o_lat_BTHR, cache = cache.attend(self.layer, q_lat_BTHR, q_pe_BTHP, topk_BTK, scale, window=window,
                                             full=self.indexer is not None, impl=impl)
            o_BTHV = jnp.einsum("bthr,rhv->bthv", o_lat_BTHR.astype(x_BTD.dtype), w_uv_RHV)
        elif form == "mha":
            lat_BWR, pe_BWP = cache.mla_rows(self.layer, window)
            k_nope_BWHN = jnp.einsum("bwr,rhn->bwhn", lat_BWR, w_uk_RHN)
            v_BWHV = jnp.einsum("bwr,rhv->bwhv", lat_BWR, w_uv_RHV)
            mask_BTW = dense_mla.topk_mask(topk_BTK, window)
            o_BTHV, _ = dense_mla.mha(q_nope_BTHN, q_pe_BTHP, k_nope_BWHN, pe_BWP, v_BWHV, mask_BTW, scale)
            o_BTHV = o_BTHV.astype(x_BTD.dtype)
        else:
            raise ValueError(f"form must be 'mqa' or 'mha', got {form!r}")
        return self.o_proj(o_BTHV.reshape(b, t, h * cfg.v_head_dim)), cache, topk_BTK


# ------------------------------------------------------------------------------------------------ MLP / MoE
class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, din: int, width: int, *, rngs: nnx.Rngs, dtype):
        self.gate_proj = Linear(din, width, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(din, width, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(width, din, rngs=rngs, dtype=dtype)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
    """Sigmoid router with a correction bias used only to choose experts (DeepSeek-V3 / GLM-5.3)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.hidden_size, cfg.n_routed_experts)))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.n_routed_experts,), jnp.float32))

    def __call__(self, x_ND: Array) -> tuple[Array, Array]:
        """x [N,D] -> (expert ids [N,k] int32, weights [N,k] f32)."""
        cfg = self.cfg
        scores_NE = jax.nn.sigmoid(x_ND.astype(jnp.float32) @ self.weight[...].astype(jnp.float32))
        choice_NE = scores_NE + self.e_score_correction_bias[...]
        if cfg.n_group > 1:
            # A group's score is the sum of its two best biased expert scores; only the best topk_group
            # groups are eligible.
            n = choice_NE.shape[0]
            grouped = choice_NE.reshape(n, cfg.n_group, -1)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            choice_NE = jnp.where(jnp.repeat(keep, grouped.shape[-1], axis=1), choice_NE, -jnp.inf)
        _, idx_NK = jax.lax.top_k(choice_NE, cfg.num_experts_per_tok)
        w_NK = jnp.take_along_axis(scores_NE, idx_NK, axis=1)
        if cfg.norm_topk_prob:
            w_NK = w_NK / (jnp.sum(w_NK, axis=-1, keepdims=True) + 1e-20)
        return idx_NK.astype(jnp.int32), w_NK * cfg.routed_scaling_factor


class Experts(nnx.Module):
    """Routed experts: gate_up_proj [E, D, 2F] (gate half first), down_proj [E, F, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype):
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, d, 2 * f)).astype(dtype))
        self.down_proj = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, f, d)).astype(dtype))

    def weights(self):
        """(gate_up [E, D, 2F], down [E, F, D]): what `grouped_experts` multiplies by."""
        return self.gate_up_proj[...], self.down_proj[...]

    def __call__(self, x_ND: Array, idx_NK: Array, w_NK: Array) -> Array:
        return grouped_experts(x_ND, idx_NK, w_NK, *self.weights())


class Fp8Experts(nnx.Module):
    """Routed experts with block-quantised weights (a checkpoint's fp8 experts):
    gate_up_proj [E, D, 2F] float8_e4m3fn with gate_up_proj_scale_inv [E, ceil(D/128), 2 ceil(F/128)],
    down_proj [E, F, D] with down_proj_scale_inv [E, ceil(F/128), ceil(D/128)] (float32).

    Gate and up are quantised as two matrices, each in its own 128 x 128 blocks (the released per-expert
    tensors `gate_proj` / `up_proj`): the first ceil(F/128) scale columns are the gate's. When F is a
    multiple of 128 this is the same as blocking the stacked [D, 2F] matrix."""

    def __init__(self, gate_up: fp8.BlockFp8, down: fp8.BlockFp8, *, impl: str = "auto"):
        if gate_up.parts != 2 or down.parts != 1:
            raise ValueError(f"Fp8Experts takes gate_up with parts=2 ([gate | up]) and down with parts=1, got "
                             f"{gate_up.parts} and {down.parts}")
        fp8.resolve_impl(impl)
        self.gate_up_proj = nnx.Param(gate_up.q)
        self.gate_up_proj_scale_inv = nnx.Param(gate_up.scale)
        self.down_proj = nnx.Param(down.q)
        self.down_proj_scale_inv = nnx.Param(down.scale)
        self.impl = impl

    @classmethod
    def from_experts(cls, experts: Experts, *, impl: str = "auto") -> Fp8Experts:
        return cls(fp8.quantize_blocks(experts.gate_up_proj[...], parts=2), fp8.quantize_blocks(experts.down_proj[...]),
                   impl=impl)

    def weights(self):
        """(gate_up, down) as fp8_matmul.BlockFp8 [E, ...]: what `grouped_experts` multiplies by."""
        return (fp8.BlockFp8(self.gate_up_proj[...], self.gate_up_proj_scale_inv[...], parts=2),
                fp8.BlockFp8(self.down_proj[...], self.down_proj_scale_inv[...]))

    def __call__(self, x_ND: Array, idx_NK: Array, w_NK: Array) -> Array:
        return grouped_experts(x_ND, idx_NK, w_NK, *self.weights(), fp8_impl=self.impl)


def _expert_products(w_gate_up, w_down, impl: str):
    """One expert's (gate_up, down) weights -> (x -> (gate, up), h -> down(h)). Float weights multiply as
    they are; fp8 ones (BlockFp8) quantise the activations per token (fp8_matmul) against weights
    prepared once per expert, outside the loop over its row blocks."""
    if not isinstance(w_gate_up, fp8.BlockFp8):
        return (lambda x: tuple(jnp.split(x @ w_gate_up, 2, axis=-1))), (lambda h: h @ w_down)
    gate_up_w, down_w = fp8.prepare(w_gate_up, impl), fp8.prepare(w_down, impl)
    return ((lambda x: tuple(jnp.split(fp8.apply(x, gate_up_w).astype(x.dtype), 2, axis=-1))),
            (lambda h: fp8.apply(h, down_w).astype(h.dtype)))


def grouped_experts(x_ND, idx_NK, w_NK, w_gate_up_EDF2, w_down_EFD, block: int = 64, *, fp8_impl: str = "auto"):
    """Exact token-choice MoE: sum_k w[n,k] * expert_{idx[n,k]}(x[n]) without computing unused experts.

    Static shapes, no token dropping. The N*k (token, expert) assignments are sorted by expert and laid
    out in blocks of b = min(block, N) rows, each block owned by one expert (an expert's segment is padded
    to a block multiple, so at most ceil(N*k/b) + E blocks). An outer loop visits the experts that have
    assignments (a dynamic trip count) and an inner loop that expert's blocks, so each used expert's
    weights are sliced once per call and unused experts and the all-padding tail cost nothing. Why once:
    on XLA:CPU a dynamic slice of the weights is a copy (1.5 MB per expert on the mid config), so slicing
    per block costs more (timings: docs/model.md). With b = N (decode) a used expert is
    one block holding all its tokens, unless it appears more than once per token (expert parallelism
    routes other ranks' assignments to local expert 0 with weight 0), which only adds blocks.

    The weights are float arrays or fp8_matmul.BlockFp8 (fp8 experts: gate and up blocked separately,
    see `Fp8Experts`; `fp8_impl` picks the fp8 matmul implementation: "pallas", which "auto" is on a
    GPU, runs `ragged_experts` over the fp8 blocks, every expert in one grouped kernel).
    """
    if isinstance(w_gate_up_EDF2, fp8.BlockFp8) and fp8.resolve_impl(fp8_impl) == "pallas":
        return ragged_experts(x_ND, idx_NK, w_NK, w_gate_up_EDF2, w_down_EFD, fp8_impl="pallas")
    if gpu_shaped() and not isinstance(w_gate_up_EDF2, fp8.BlockFp8):
        return ragged_experts(x_ND, idx_NK, w_NK, w_gate_up_EDF2, w_down_EFD)
    n, d = x_ND.shape
    e = w_gate_up_EDF2.shape[0]
    k = idx_NK.shape[1]
    a = n * k
    block = max(1, min(block, n))
    flat_e = idx_NK.reshape(a)
    order = jnp.argsort(flat_e, stable=True)
    se = flat_e[order]
    st = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)[order]
    sw = w_NK.reshape(a)[order]
    counts = jnp.bincount(flat_e, length=e)
    start = jnp.cumsum(counts) - counts
    blocks_E = (counts + block - 1) // block
    first_E = jnp.cumsum(blocks_E) - blocks_E  # first block of each expert
    dest = first_E[se] * block + (jnp.arange(a) - start[se])  # row of each sorted assignment
    num_blocks = -(-a // block) + e
    rows_tok = jnp.full((num_blocks * block,), n, jnp.int32).at[dest].set(st)  # n = zero pad row
    rows_w = jnp.zeros((num_blocks * block,), sw.dtype).at[dest].set(sw)
    used_E = jnp.nonzero(counts > 0, size=e, fill_value=0)[0]
    x_pad = jnp.concatenate([x_ND, jnp.zeros((1, d), x_ND.dtype)], axis=0)
    xb = x_pad[rows_tok].reshape(num_blocks, block, d)

    def one_expert(u, yb):
        ex = used_E[u]
        gate_up, down = _expert_products(w_gate_up_EDF2[ex], w_down_EFD[ex], fp8_impl)

        def one_block(j, yb):
            gate, up = gate_up(xb[j])
            return yb.at[j].set(down(jax.nn.silu(gate) * up))

        return jax.lax.fori_loop(first_E[ex], first_E[ex] + blocks_E[ex], one_block, yb)

    yb = jax.lax.fori_loop(0, jnp.sum(counts > 0), one_expert, jnp.zeros_like(xb))
    yb = yb * rows_w.reshape(num_blocks, block, 1).astype(yb.dtype)
    out = jnp.zeros((n + 1, d), yb.dtype).at[rows_tok].add(yb.reshape(-1, d))
    return out[:n].astype(x_ND.dtype)


def ragged_experts(x_ND, idx_NK, w_NK, w_gate_up_EDF2, w_down_EFD, *, fp8_impl: str = "auto"):
    """`grouped_experts` as a GPU runs it: the N*k assignments sorted by expert and each projection one
    grouped GEMM over the expert segments, no loop over experts: `lax.ragged_dot` for float weights,
    `fp8_matmul.ragged_matmul` (impl `fp8_impl`; "pallas": one block-scaled fp8 kernel) for BlockFp8 ones,
    whose products are cast to x's dtype as the expert loop's are. The same result up to float summation
    order; what `grouped_experts` does where code is shaped for a GPU (`attention.common.gpu_shaped`)."""
    n, d = x_ND.shape
    e, k = w_gate_up_EDF2.shape[0], idx_NK.shape[1]
    flat_e = idx_NK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok_A = (jnp.arange(n * k, dtype=jnp.int32) // k)[order]  # token of each expert-sorted assignment
    sizes_E = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    if isinstance(w_gate_up_EDF2, fp8.BlockFp8):
        def product(x, w):
            return fp8.ragged_matmul(x, w, sizes_E, impl=fp8_impl).astype(x.dtype)
    else:
        def product(x, w):
            return jax.lax.ragged_dot(x, w, sizes_E)
    gate_up_AF2 = product(x_ND[tok_A], w_gate_up_EDF2)
    gate, up = jnp.split(gate_up_AF2, 2, axis=-1)
    y_AD = product(jax.nn.silu(gate) * up, w_down_EFD)
    y_AD = y_AD * w_NK.reshape(-1)[order][:, None].astype(y_AD.dtype)
    return jnp.zeros((n, d), y_AD.dtype).at[tok_A].add(y_AD).astype(x_ND.dtype)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, rngs=rngs, dtype=dtype)
            if cfg.n_shared_experts else None
        )

    def __call__(self, x_BTD: Array) -> Array:
        shape = x_BTD.shape
        x_ND = x_BTD.reshape(-1, shape[-1])
        idx, w = self.gate(x_ND)
        y = self.experts(x_ND, idx, w)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_ND)
        return y.reshape(shape)


# --------------------------------------------------------------------------------------------- decoder layer
class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype):
        self.self_attn = MLAttention(cfg, layer, rngs=rngs, dtype=dtype)
        if cfg.layer_mlp_type(layer) == "sparse":
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x_BTD, pos_BT, cache, topk_BTK, *, window, form="mqa", impl="auto", rows_BR=None):
        """-> (x [B,T,D], cache, topk); with `rows_BR` (MLAttention) x and topk are those rows' only."""
        a, cache, topk_BTK = self.self_attn(self.input_layernorm(x_BTD), pos_BT, cache, topk_BTK, window=window,
                                            form=form, impl=impl, rows_BR=rows_BR)
        if rows_BR is not None:
            x_BTD = take_rows(x_BTD, rows_BR)
        x_BTD = x_BTD + a
        x_BTD = x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD, cache, topk_BTK


class SharedHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class MTPLayer(DecoderLayer):
    """One multi-token-prediction layer (DeepSeek-V3 / GLM-5.3 "nextn"), stored at HF layer index
    num_hidden_layers + j.

    h = DecoderLayer(eh_proj([enorm(embed(token_{t+1})) ; hnorm(h_t)])), logits = lm_head(shared_head.norm(h)),
    where h_t is the main model's final (normed) hidden state at position t (vLLM's convention), so the
    layer at position t predicts token t+2. The embedding and lm_head are shared with the main model.
    """

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype):
        super().__init__(cfg, layer, rngs=rngs, dtype=dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.shared_head = SharedHead(cfg, dtype=dtype)

    def mtp(self, emb_next_BTD, h_prev_BTD, pos_BT, cache, *, window, form="mqa", impl="auto"):
        """-> (hidden [B,T,D] after shared_head.norm, cache)."""
        # vLLM zeroes the embedding at position 0 (no previous token pairs with it); keep that convention.
        emb_next_BTD = jnp.where((pos_BT == 0)[..., None], 0, emb_next_BTD)
        x = self.eh_proj(jnp.concatenate([self.enorm(emb_next_BTD), self.hnorm(h_prev_BTD)], axis=-1))
        x, cache, _ = self(x, pos_BT, cache, None, window=window, form=form, impl=impl)
        return self.shared_head.norm(x), cache
