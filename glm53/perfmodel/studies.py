"""Studies on the model's shapes: the indexer-vs-sparse-MLA FLOP crossover, parameter counts and weight
bytes per GPU."""

from __future__ import annotations

import math

from glm53.config import ModelConfig
from glm53.perfmodel.hardware import BF16, FP8_WEIGHT_BYTES, FP32, H200, HardwareSpec
from glm53.perfmodel.ops import _layers, indexer_pair_flops, padded_heads, sparse_mla_flops_per_row_head


def causal_pairs(prompt_len: float) -> float:
    """(query, key) pairs of a causal prompt of `prompt_len` tokens, each query seeing itself: L(L+1)/2."""
    return prompt_len * (prompt_len + 1) / 2


def sparse_rows_total(prompt_len: float, topk: int) -> float:
    """Selected rows summed over a prompt: sum_{t=1..L} min(k, t) = L(L+1)/2 for L <= k, else
    k(k+1)/2 + k(L - k)."""
    if prompt_len <= topk:
        return causal_pairs(prompt_len)
    return topk * (topk + 1) / 2 + topk * (prompt_len - topk)


def _crossover_coefficients(cfg: ModelConfig, layout: str, n: int, padded: bool, include_mtp: bool,
                            hw: HardwareSpec) -> tuple[float, float]:
    """(a, b): per-GPU indexer FLOPs = a * causal_pairs(L); per-GPU sparse-MLA FLOPs = b * rows_total(L)."""
    layers = _layers(cfg, include_mtp)
    n_full = sum(1 for i in layers if cfg.layer_indexer_type(i) == "full")
    a = n_full * indexer_pair_flops(cfg)
    heads = cfg.num_attention_heads
    if layout == "tp":  # indexer repeated on every GPU; heads split
        h_gpu = heads // n
        b = len(layers) * (padded_heads(h_gpu, hw) if padded else h_gpu) * sparse_mla_flops_per_row_head(cfg)
    elif layout == "pcp":  # each GPU: 1/n of the queries (balanced causal split), all heads
        a /= n
        b = len(layers) * (padded_heads(heads, hw) if padded else heads) * sparse_mla_flops_per_row_head(cfg) / n
    else:
        raise ValueError(f"layout must be 'tp' or 'pcp', got {layout!r}")
    return a, b


def prefill_flops_per_gpu(cfg: ModelConfig, prompt_len: float, layout: str, n: int = 8, *, padded: bool = False,
                          include_mtp: bool = True, hw: HardwareSpec = H200) -> tuple[float, float]:
    """(indexer FLOPs, sparse-MLA FLOPs) one GPU spends on a whole prompt of `prompt_len` tokens under
    TP-n ("tp": indexer repeated on every GPU, heads / n per GPU) or PCP-n ("pcp": 1/n of the query
    tokens with all heads). Useful FLOPs unless `padded` (heads per GPU padded to the kernel's 64)."""
    a, b = _crossover_coefficients(cfg, layout, n, padded, include_mtp, hw)
    return a * causal_pairs(prompt_len), b * sparse_rows_total(prompt_len, cfg.index_topk)


def crossover_prompt_len(cfg: ModelConfig, layout: str, n: int = 8, *, padded: bool = False,
                         include_mtp: bool = True, hw: HardwareSpec = H200) -> float:
    """Prompt length (tokens) at which the whole prompt's per-GPU indexer FLOPs equal its per-GPU
    sparse-MLA FLOPs: solve a L(L+1)/2 = b [k(k+1)/2 + k(L-k)] for L > k, i.e.
    (a/2) L^2 + (a/2 - b k) L + b k (k-1)/2 = 0, larger root. (Below k both are quadratic with ratio a/b;
    if a >= b the indexer already dominates from the first token and 0 is returned.)"""
    a, b = _crossover_coefficients(cfg, layout, n, padded, include_mtp, hw)
    k = cfg.index_topk
    if a >= b:
        return 0.0
    qa, qb, qc = a / 2, a / 2 - b * k, b * k * (k - 1) / 2
    return (-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa)


# ------------------------------------------------------------------------------------ parameter counts
def param_counts(cfg: ModelConfig, *, include_mtp: bool = True) -> dict[str, int]:
    """Parameters by component, from the shapes in glm53/layers.py (checked against weights.param_count
    in the tests): attention, indexer, dense_mlp, routed_experts, shared_experts, router, norms,
    embed, lm_head, mtp_extra (enorm, hnorm, eh_proj, shared_head.norm)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    attn = (d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
            + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
            + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d)
    idx = (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim
           + 2 * cfg.index_head_dim + d * cfg.index_n_heads)
    out = dict.fromkeys(("attention", "indexer", "dense_mlp", "routed_experts", "shared_experts", "router", "norms",
                         "embed", "lm_head", "mtp_extra"), 0)
    for layer in _layers(cfg, include_mtp):
        out["attention"] += attn
        out["norms"] += 2 * d
        if cfg.layer_indexer_type(layer) == "full":
            out["indexer"] += idx
        if cfg.layer_mlp_type(layer) == "dense":
            out["dense_mlp"] += 3 * d * cfg.intermediate_size
        else:
            out["routed_experts"] += cfg.n_routed_experts * 3 * d * cfg.moe_intermediate_size
            out["shared_experts"] += 3 * d * cfg.moe_intermediate_size * cfg.n_shared_experts
            out["router"] += d * cfg.n_routed_experts + cfg.n_routed_experts
        if layer >= cfg.num_hidden_layers:
            out["mtp_extra"] += 2 * d + 2 * d * d + d
    out["embed"] = cfg.vocab_size * d
    out["lm_head"] = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    out["norms"] += d  # final norm
    return out


def weight_bytes_per_gpu(cfg: ModelConfig, *, tp: int = 1, ep: int = 1, include_mtp: bool = True) -> float:
    """FP8-checkpoint weight bytes on one GPU: matmul weights fp8 (+ block scales), embed / lm_head bf16,
    norms and router fp32. Routed experts split over `ep`; q_b / kv_b / o_proj, dense MLP, shared expert,
    embed and lm_head split over `tp`; q_a / kv_a and the indexer replicated (as vLLM shards them)."""
    c = param_counts(cfg, include_mtp=include_mtp)
    n_layers = len(_layers(cfg, include_mtp))
    replicated_attn = n_layers * cfg.hidden_size * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    split_attn = c["attention"] - replicated_attn
    return (FP8_WEIGHT_BYTES * (replicated_attn + c["indexer"] + c["mtp_extra"])
            + FP8_WEIGHT_BYTES * (split_attn + c["dense_mlp"] + c["shared_experts"]) / tp
            + FP8_WEIGHT_BYTES * c["routed_experts"] / ep
            + BF16 * (c["embed"] + c["lm_head"]) / tp + FP32 * (c["norms"] + c["router"]))
