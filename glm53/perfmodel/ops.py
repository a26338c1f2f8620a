"""Op costs of GLM-5.3 on one GPU: KV bytes, sparse MLA, the indexer, the GEMMs and MoE, dense MHA, the
PCP / DCP communication, HiSparse row copies."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from glm53.config import ModelConfig
from glm53.perfmodel import traffic
from glm53.perfmodel.cost import DCP_GATHER, Cost, _gemm, _grouped_gemm, _kernel, all_reduce, all_to_all, collective, host_copy, total
from glm53.perfmodel.hardware import BF16, FP8_WEIGHT_BYTES, FP32, H200, INDEX_BYTES, HardwareSpec
from kvcache.layout import cache_groups, index_key_bytes, kv_bytes_per_token, mla_row_bytes


def hisparse_row_copy(cfg: ModelConfig, hw: HardwareSpec, rows: float, *, layers: int = 1,
                      mla_format: str = "fp8_ds_mla") -> Cost:
    """HiSparse misses: `rows` latent rows per layer copied host -> device for `layers` layers, by one fused
    gather kernel per step (one transfer call)."""
    row = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)
    return host_copy(hw, rows * layers * row, transfers=1, name="hisparse_row_copy")


# --------------------------------------------------------------------------------------------- KV bytes
def kv_bytes_by_component(cfg: ModelConfig, mla_format: str = "fp8_ds_mla", index_format: str = "fp8") -> dict:
    """Bytes per token of each KV component (main-model MLA rows, main indexer keys, MTP MLA rows, MTP
    indexer keys), from `kvcache.layout.cache_groups`. Sums to `kv_bytes_per_token`."""
    out = {}
    for g in cache_groups(cfg, mla_format, index_format):
        main = sum(1 for i in g.layers if i < cfg.num_hidden_layers)
        mtp = len(g.layers) - main
        out[f"{g.name}_main"] = main * g.bytes_per_token
        out[f"{g.name}_mtp"] = mtp * g.bytes_per_token
    return out


def kv_bytes_per_gpu(cfg: ModelConfig, context_tokens: int, dcp: int = 1, **fmt) -> float:
    """KV bytes one GPU holds for a context of `context_tokens` when the cache is sharded round-robin by
    token over `dcp` ranks (dcp = 1: every GPU holds the whole cache, as under TP or PCP alone)."""
    return math.ceil(context_tokens / dcp) * kv_bytes_per_token(cfg, **fmt)


def max_context_tokens(cfg: ModelConfig, budget_bytes: float, dcp: int = 1, *, block_size: int = 1, **fmt) -> int:
    """Longest context whose KV fits `budget_bytes` per GPU with DCP `dcp` (whole blocks of `block_size`
    tokens per rank; block_size=1 ignores block rounding)."""
    per_rank = int(budget_bytes // kv_bytes_per_token(cfg, **fmt)) // block_size * block_size
    return per_rank * dcp


# ------------------------------------------------------------------------------------------- sparse MLA
def sparse_mla_flops_per_row_head(cfg: ModelConfig) -> int:
    """Absorbed-MQA FLOPs per selected row per head: QK over kv_lora + rope dims, PV over kv_lora dims
    (2,176 for GLM-5.3)."""
    return 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.kv_lora_rank


def sparse_mla_qo_bytes_per_head(cfg: ModelConfig) -> int:
    """HBM bytes per query token per head: bf16 query (kv_lora + rope) and bf16 output (kv_lora): 2,176 B."""
    return BF16 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + BF16 * cfg.kv_lora_rank


def padded_heads(heads: int, hw: HardwareSpec = H200) -> int:
    """Heads a FlashMLA-style fp8 kernel executes: `heads` rounded up to a multiple of hw.head_granularity."""
    g = hw.head_granularity
    return -(-heads // g) * g


# FlashMLA's Hopper sparse kernels (deepseek-ai/FlashMLA csrc/sm90): a CTA serves 64 query heads of one query
# token and walks its selected rows in blocks of 64 (BLOCK_M / B_H = 64, TOPK_BLOCK_SIZE / B_TOPK = 64)
FLASHMLA_ROW_BLOCK = 64
SPARSE_KERNELS = ("auto", "decode", "prefill")


def sparse_mla(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, rows_per_query: float, heads: int, *,
               mla_format: str = "fp8_ds_mla", pad_heads: bool = False, dequant: bool = True,
               heads_per_dequant: int | None = None, kernel: str = "auto", tokens_per_request: int = 1,
               name: str = "sparse_mla") -> Cost:
    """Sparse MLA (absorbed MQA) over `rows_per_query` selected latent rows for each of `q_tokens` query
    tokens with `heads` query heads on this GPU; decode and prefill alike (prefill: many query tokens).

    useful FLOPs = q * rows * heads * flops_per_row_head. Two cost models, chosen by the spec:

    Roofline (`hw.flashmla_kernels` False, the datasheet spec): executed FLOPs use the padded head count
    when `pad_heads`. HBM = q * rows * (row bytes + 4 B index) + q * executed heads * 2,176 B of bf16 q/out
    (each query reads its own rows: selections differ per query). Compute time = MMA time at
    sparse_attention_efficiency + (fp8 formats, `dequant`) the dequantisation of every row once per
    `heads_per_dequant` heads (added, or overlapped if hw.dequant_overlap). `kernel` is ignored.

    FlashMLA kernel model (calibrated specs; `_flashmla_sparse`): the Hopper kernels vLLM's FLASHMLA_SPARSE
    backend calls, which always run whole 64-head CTAs (heads padded to 64 or 128, whatever `pad_heads`):
    `kernel="decode"` is the fp8 decode kernel (flash_mla_with_kvcache; `tokens_per_request` query tokens
    per request, FlashMLA's s_q), `"prefill"` the bf16 sparse prefill kernel (flash_mla_sparse_fwd, rows
    read from a bf16 workspace: `sparse_mla_upconvert` prices filling it from an fp8 cache); `"auto"`: the
    decode kernel for fp8_ds_mla rows, the prefill kernel for 16-bit rows.
    """
    if kernel not in SPARSE_KERNELS:
        raise ValueError(f"sparse_mla kernel must be one of {SPARSE_KERNELS}, got {kernel!r}")
    if hw.flashmla_kernels:
        return _flashmla_sparse(cfg, hw, q_tokens, rows_per_query, heads, mla_format=mla_format, dequant=dequant,
                                heads_per_dequant=heads_per_dequant, kernel=kernel,
                                tokens_per_request=tokens_per_request, name=name)
    h_exec = padded_heads(heads, hw) if pad_heads else heads
    fpr = sparse_mla_flops_per_row_head(cfg)
    row = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)
    pairs = q_tokens * rows_per_query
    flops = pairs * h_exec * fpr
    hbm = pairs * (row + INDEX_BYTES) + q_tokens * h_exec * sparse_mla_qo_bytes_per_head(cfg)
    mma_s = flops / (hw.bf16_flops * hw.sparse_attention_efficiency)
    deq_s = 0.0
    if dequant and mla_format == "fp8_ds_mla":
        hpd = heads_per_dequant or hw.heads_per_dequant
        deq_s = pairs * math.ceil(h_exec / hpd) * cfg.kv_lora_rank / hw.dequant_values_per_s
    compute_s = max(mma_s, deq_s) if hw.dequant_overlap else mma_s + deq_s
    memory_s = hbm / (hw.hbm_bandwidth * hw.hbm_efficiency)
    return Cost(name=name, flops=flops, useful_flops=pairs * heads * fpr, hbm_bytes=hbm, compute_s=compute_s,
                memory_s=memory_s, time_s=max(compute_s, memory_s))


def sparse_decode_units(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, rows_per_query: float, heads: int, *,
                        tokens_per_request: int = 1) -> tuple[float, int]:
    """(64-row blocks each SM part of FlashMLA's fp8 decode kernel walks, SM parts) for one call.

    csrc/api/sparse_decode.h (Decode_Sm90_Impl::get_meta): the requests' work is split evenly over
    num_sm_parts = sm_count / s_q / (h_q / 64) parts (each part runs one CTA per query token of a request and
    per 64-head block, so the grid fills the GPU once), counting every request's blocks of 64 rows plus
    `fixed_overhead_num_blocks` (hw.sparse_decode_overhead_blocks = 5) for its prologue and epilogue."""
    s_q = max(1, int(tokens_per_request))
    g = math.ceil(heads / hw.head_granularity)
    parts = max(hw.sm_count // (s_q * g), 1)
    requests = q_tokens / s_q
    units = requests * (rows_per_query / FLASHMLA_ROW_BLOCK + hw.sparse_decode_overhead_blocks)
    return math.ceil(units / parts - 1e-9), parts


def _flashmla_sparse(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, rows_per_query: float, heads: int, *,
                     mla_format: str, dequant: bool, heads_per_dequant: int | None, kernel: str,
                     tokens_per_request: int, name: str) -> Cost:
    """The FlashMLA kernel model of `sparse_mla` (docs/perfmodel.md "Sparse MLA and the indexer").

    Per 64-row block a 64-head CTA spends 64 x 64 x 2,176 / 4,096 = 2,176 tensor-core cycles, and the fp8
    decode kernel also dequantises the block's 64 rows: 64 x 512 x hw.dequant_cycles_per_value = 3,200 cycles,
    shared by the two CTAs of a 128-head cluster ("crossover"; FlashMLA's deep dive; heads_per_dequant=64
    turns the sharing off, the previous kernel). Decode: time = blocks per SM part (`sparse_decode_units`)
    x cycles per block / (clock x sparse_decode_efficiency) + sparse_decode_latency_s. Prefill (bf16 rows):
    one CTA per (query token, 64-head block) in waves over the SMs, each walking its rows' blocks of MMA
    cycles at sparse_attention_efficiency. Either way the time is at least the HBM bytes at hbm_efficiency.
    """
    if kernel == "auto":
        kernel = "decode" if mla_format == "fp8_ds_mla" else "prefill"
    g = math.ceil(heads / hw.head_granularity)
    h_exec = g * hw.head_granularity
    fpr = sparse_mla_flops_per_row_head(cfg)
    pairs = q_tokens * rows_per_query
    flops = pairs * h_exec * fpr
    mma_cycles = FLASHMLA_ROW_BLOCK * hw.head_granularity * fpr / hw.tensor_flops_per_sm_clock
    qo = q_tokens * h_exec * sparse_mla_qo_bytes_per_head(cfg)
    if kernel == "decode":
        share = 1
        if g == 2:  # a 128-head cluster shares each dequantised block between its two CTAs
            share = 2 if heads_per_dequant is None else max(1, min(g, heads_per_dequant // hw.head_granularity))
        fp8 = dequant and mla_format == "fp8_ds_mla"
        deq_cycles = FLASHMLA_ROW_BLOCK * cfg.kv_lora_rank * hw.dequant_cycles_per_value / share if fp8 else 0.0
        blocks, _ = sparse_decode_units(cfg, hw, q_tokens, rows_per_query, heads, tokens_per_request=tokens_per_request)
        compute_s = blocks * (mma_cycles + deq_cycles) / (hw.clock_hz * hw.sparse_decode_efficiency)
        row = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)
        hbm = pairs * (row + INDEX_BYTES) * g / share + qo  # each CTA of a head block loads its share of the rows
        latency = hw.sparse_decode_latency_s
    else:  # bf16 rows (the cache itself, or the workspace an fp8 cache was up-converted into)
        waves = math.ceil(q_tokens * g / hw.sm_count - 1e-9)
        compute_s = (waves * rows_per_query / FLASHMLA_ROW_BLOCK * mma_cycles
                     / (hw.clock_hz * hw.sparse_attention_efficiency))
        hbm = pairs * (BF16 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + INDEX_BYTES) * g + qo
        latency = 0.0
    memory_s = hbm / (hw.hbm_bandwidth * hw.hbm_efficiency)
    return Cost(name=name, flops=flops, useful_flops=pairs * heads * fpr, hbm_bytes=hbm, compute_s=compute_s,
                memory_s=memory_s, latency_s=latency, time_s=max(compute_s, memory_s) + latency)


def sparse_mla_upconvert(cfg: ModelConfig, hw: HardwareSpec, context_rows: float, *, mla_format: str = "fp8_ds_mla",
                         name: str = "sparse_mla_upconvert") -> Cost:
    """vLLM's separate prefill path with an fp8 cache (FLASHMLA_SPARSE, heads per GPU >= 32, HiSparse or PCP x
    DCP): before the bf16 prefill kernel, every prefill request's whole context (`context_rows` rows, cached +
    new) is dequantised from the cache into a bf16 workspace: reads the rows, writes 576 bf16 values each.
    Memory bound; nothing for 16-bit caches (the prefill kernel reads the cache)."""
    if mla_format != "fp8_ds_mla" or context_rows <= 0:
        return Cost(name)
    row = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)
    hbm = context_rows * (row + BF16 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    return _kernel(name, hw, flops=0.0, hbm_bytes=hbm)


def sparse_mla_intensity(cfg: ModelConfig, heads: int, *, hw: HardwareSpec = H200, pad_heads: bool = False,
                         rows: int | None = None) -> dict:
    """Arithmetic intensity of sparse MLA for ONE query token over `rows` (default index_topk) rows.

    BRIEF §3: 2,048 rows x 660 B + heads x 2,176 B; 2,176 FLOPs per row per head. Returns useful and
    executed FLOPs, HBM bytes, and FLOP/byte for both.
    """
    roofline = dataclasses.replace(hw, sparse_decode_efficiency=None)  # BRIEF §3's count, whatever the spec
    c = sparse_mla(cfg, roofline, 1, cfg.index_topk if rows is None else rows, heads, pad_heads=pad_heads)
    return {"heads": heads, "executed_heads": padded_heads(heads, hw) if pad_heads else heads,
            "useful_flops": c.useful_flops, "flops": c.flops, "hbm_bytes": c.hbm_bytes,
            "useful_flop_per_byte": c.useful_flops / c.hbm_bytes, "executed_flop_per_byte": c.flops / c.hbm_bytes}


# ---------------------------------------------------------------------------------------------- indexer
def indexer_pair_flops(cfg: ModelConfig) -> int:
    """FLOPs per (query, key) score: index_n_heads dot products of index_head_dim, then the head-weighted
    sum (one multiply-add per head); ReLU is not counted. 8,256 for GLM-5.3."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads


def indexer_scores(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, keys_per_query: float, *,
                   keys_read: float | None = None, index_format: str = "fp8", name: str = "indexer_scores") -> Cost:
    """Lightning-indexer scores for `q_tokens` queries, each against `keys_per_query` keys (causal keys
    only). FLOPs = q * keys * indexer_pair_flops, at the fp8 GEMM rate (DeepGEMM fp8 MQA logits).
    HBM: keys read once per step (`keys_read`, default keys_per_query: one request), fp8 queries and fp32
    head weights read, fp32 scores written (the scores go to HBM for the separate top-k pass)."""
    keys_read = keys_per_query if keys_read is None else keys_read
    flops = q_tokens * keys_per_query * indexer_pair_flops(cfg)
    hbm = (keys_read * index_key_bytes(cfg.index_head_dim, index_format)
           + q_tokens * cfg.index_n_heads * (cfg.index_head_dim + FP32)
           + q_tokens * keys_per_query * FP32)
    if hw.indexer_efficiency is None:
        return _kernel(name, hw, flops=flops, hbm_bytes=hbm, dtype="fp8")
    c = _kernel(name, hw, flops=flops, hbm_bytes=hbm, dtype="fp8", efficiency=hw.indexer_efficiency)
    lat = hw.indexer_latency_s
    return Cost(name, c.kind, c.layer, c.flops, c.useful_flops, c.hbm_bytes, compute_s=c.compute_s,
                memory_s=c.memory_s, latency_s=lat, time_s=c.time_s + lat)


def indexer_topk(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, keys_per_query: float, *,
                 name: str = "indexer_topk") -> Cost:
    """Top-k over each query's fp32 scores: memory bound, reads the scores and writes index_topk int32
    indices per query (comparisons are not counted as FLOPs)."""
    k = min(cfg.index_topk, keys_per_query)
    return _kernel(name, hw, flops=0.0, hbm_bytes=q_tokens * keys_per_query * FP32 + q_tokens * k * INDEX_BYTES)


# ------------------------------------------------------------------------------------ matmuls and MLPs
def _matmuls(name: str, hw: HardwareSpec, tokens: float, shapes: Iterable[tuple[int, int, float, float]]) -> Cost:
    """A sequence of GEMMs, each (din, dout, weight bytes per param, shards): y[tokens, dout/shards] =
    x[tokens, din] @ W. FLOPs 2 * tokens * din * dout / shards; HBM = weights + bf16 input and output.
    fp8 weights run at the fp8 rate, others at bf16. Time = sum of the GEMMs' times (`_gemm`)."""
    parts = []
    for din, dout, wbytes, shards in shapes:
        params = din * dout / shards
        hbm = params * wbytes + tokens * BF16 * (din + dout / shards)
        dtype = "fp8" if wbytes < BF16 else "bf16"
        parts.append(_gemm(name, hw, flops=2 * tokens * params, hbm_bytes=hbm, dtype=dtype))
    return dataclasses.replace(total(parts, name), kind="kernel")


def mla_projections(cfg: ModelConfig, hw: HardwareSpec, tokens: float, layer: int, *, tp: int = 1,
                    weight_bytes: float = FP8_WEIGHT_BYTES) -> Cost:
    """The per-token GEMMs of one attention layer in absorbed form, for `tokens` tokens on this GPU:
    q_a, kv_a (replicated), q_b, the kv_b absorption (W_uk into the query, W_uv on the output) and o_proj
    (split over `tp` by heads); on full layers the indexer's wq_b, wk (replicated) and its fp32
    weights_proj. MTP layers add eh_proj [2H -> H]."""
    h, d = cfg.num_attention_heads, cfg.hidden_size
    shapes = [
        (d, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, weight_bytes, 1),  # fused q_a + kv_a
        (cfg.q_lora_rank, h * cfg.qk_head_dim, weight_bytes, tp),
        (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), weight_bytes, tp),  # W_uk and W_uv
        (h * cfg.v_head_dim, d, weight_bytes, tp),
    ]
    if cfg.layer_indexer_type(layer) == "full":
        shapes += [(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, weight_bytes, 1),
                   (d, cfg.index_head_dim, weight_bytes, 1), (d, cfg.index_n_heads, FP32, 1)]
    if layer >= cfg.num_hidden_layers:
        shapes.append((2 * d, d, weight_bytes, 1))
    return _matmuls("mla_proj", hw, tokens, shapes).at_layer(layer)


def dense_mlp(cfg: ModelConfig, hw: HardwareSpec, tokens: float, *, tp: int = 1,
              weight_bytes: float = FP8_WEIGHT_BYTES) -> Cost:
    """SwiGLU MLP of intermediate_size (GLM-5.3's first dense layers) for `tokens` tokens; weights split
    over `tp` (tp = 1: replicated, as under PCP or DP)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    return _matmuls("dense_mlp", hw, tokens, [(d, 2 * f, weight_bytes, tp), (f, d, weight_bytes, tp)])


def lm_head(cfg: ModelConfig, hw: HardwareSpec, tokens: float, *, shards: int = 1) -> Cost:
    """Final logits for `tokens` tokens, bf16 weights split over `shards` (vocab parallel)."""
    return _matmuls("lm_head", hw, tokens, [(cfg.hidden_size, cfg.vocab_size, BF16, shards)])


def expected_touched_experts(cfg: ModelConfig, tokens: float, ep: int = 1) -> float:
    """Expected routed experts of one EP rank (n_routed_experts / ep of them) that at least one of `tokens`
    tokens selects, with balanced routing (each token picks each expert with probability k / E, the
    aim of the correction bias): E/ep * (1 - (1 - k/E)^tokens)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e / ep * (1 - (1 - k / e) ** tokens)


def expected_remote_ranks(cfg: ModelConfig, ep: int) -> float:
    """Expected number of other EP ranks a token's k experts live on (a token goes once to each rank that
    holds any of its experts, DeepEP-style): (ep - 1) * (1 - C(E - E/ep, k) / C(E, k))."""
    if ep <= 1:
        return 0.0
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    miss = math.comb(e - e // ep, k) / math.comb(e, k)
    return (ep - 1) * (1 - miss)


def moe_routed_gemms(cfg: ModelConfig, hw: HardwareSpec, tokens_per_rank: float, ep: int, *,
                     replicated_tokens: bool = False, weight_bytes: float = FP8_WEIGHT_BYTES,
                     load_imbalance: float = 1.0) -> tuple[Cost, Cost]:
    """The routed experts of one EP rank (n_routed_experts / ep of them) as two grouped GEMMs over the
    touched experts: gate + up [hidden -> 2 x moe_intermediate], then down; `moe` below sums them. The
    rank computes its share of the group's assignments (tokens x top-k / ep x `load_imbalance`) and reads
    every touched local expert's weights once (`expected_touched_experts` of those assignments).
    load_imbalance >= 1: the busiest rank's assignments over the mean (1: balanced routing); the step
    waits for that rank, so it is the one priced. Each GEMM is `cost._grouped_gemm`."""
    if not load_imbalance >= 1:
        raise ValueError(f"moe_routed_gemms: load_imbalance must be >= 1 (the busiest rank over the mean), "
                         f"got {load_imbalance!r}")
    d, f, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    group_tokens = tokens_per_rank if replicated_tokens else tokens_per_rank * ep
    assignments = group_tokens * k / ep * load_imbalance
    touched = expected_touched_experts(cfg, group_tokens * load_imbalance, ep)
    dt = "fp8" if weight_bytes < BF16 else "bf16"
    return tuple(_grouped_gemm("moe_experts", hw, flops=2 * assignments * din * dout, dtype=dt,
                               hbm_bytes=touched * din * dout * weight_bytes + assignments * BF16 * (din + dout))
                 for din, dout in ((d, 2 * f), (f, d)))


def moe(cfg: ModelConfig, hw: HardwareSpec, tokens_per_rank: float, ep: int, *, replicated_tokens: bool = False,
        weight_bytes: float = FP8_WEIGHT_BYTES, dispatch_bytes_per_value: float = 1 + FP32 / 128,
        combine_bytes_per_value: float = BF16, layer: int = -1, load_imbalance: float = 1.0) -> tuple[Cost, ...]:
    """One MoE layer with expert parallelism over `ep` ranks (each holds n_routed_experts / ep experts).

    `replicated_tokens=False` (PCP or DP attention): every rank has its own `tokens_per_rank` tokens; the
    EP group routes tokens_per_rank * ep tokens; dispatch and combine are all-to-alls (fp8 dispatch with
    one fp32 scale per 128 values, bf16 combine) to the expected remote ranks per token; the shared
    expert is replicated and runs on the rank's own tokens.
    `replicated_tokens=True` (TP attention): every rank has the same `tokens_per_rank` tokens, runs its
    local experts on them and the TP-split shared expert, then one bf16 all-reduce of the output.

    Routed-expert weights are read once per step for every *touched* local expert
    (`expected_touched_experts`): at small batch the layer is bound by these reads, not by FLOPs.
    load_imbalance: the busiest EP rank's routed tokens over the mean (`moe_routed_gemms`); it receives and
    returns that many times the mean all-to-all bytes too.
    Returns (router, routed experts, shared expert, dispatch, combine) Costs, tagged with `layer`.
    """
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    routed = total(moe_routed_gemms(cfg, hw, tokens_per_rank, ep, replicated_tokens=replicated_tokens,
                                    weight_bytes=weight_bytes, load_imbalance=load_imbalance), "moe_experts")
    routed = dataclasses.replace(routed, kind="kernel")
    router = _kernel("moe_router", hw, flops=2 * tokens_per_rank * d * e,
                     hbm_bytes=d * e * FP32 + tokens_per_rank * (BF16 * d + FP32 * e))
    shared_f = f * cfg.n_shared_experts
    split = ep if replicated_tokens else 1
    shared = (_matmuls("moe_shared", hw, tokens_per_rank, [(d, 2 * shared_f, weight_bytes, split),
                                                           (shared_f, d, weight_bytes, split)])
              if shared_f else Cost("moe_shared"))
    if replicated_tokens:
        dispatch = Cost("moe_dispatch", kind="collective")
        combine = all_reduce(hw, tokens_per_rank * d * BF16, ep, name="moe_combine")
    else:
        remote = tokens_per_rank * expected_remote_ranks(cfg, ep) * load_imbalance
        dispatch = all_to_all(hw, remote * d * dispatch_bytes_per_value, ep, name="moe_dispatch")
        combine = all_to_all(hw, remote * d * combine_bytes_per_value, ep, name="moe_combine")
    return tuple(c.at_layer(layer) for c in (router, routed, shared, dispatch, combine))


def dense_mha_prefill(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, keys_per_query: float, keys: float,
                      heads: int, *, mla_format: str = "fp8_ds_mla", q_tile: int = 128) -> Cost:
    """Un-absorbed (MHA-form) attention: expand the `keys` cached latent rows into per-head k_nope and v
    with W_kv_b (GEMM at matmul_efficiency), then dense attention of `q_tokens` queries over
    `keys_per_query` keys each with `heads` heads (at dense_attention_efficiency). HBM: latent rows read,
    expanded bf16 K/V written once and read once per tile of `q_tile` queries, bf16 q and output."""
    nope, rope, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    expand_flops = 2 * keys * r * heads * (nope + v)
    attn_flops = q_tokens * keys_per_query * heads * (2 * (nope + rope) + 2 * v)
    kv_bytes = keys * (heads * (nope + v) + rope) * BF16
    hbm = (keys * mla_row_bytes(r, rope, mla_format) + kv_bytes * (1 + math.ceil(q_tokens / q_tile))
           + q_tokens * heads * BF16 * (nope + rope + v))
    compute_s = (expand_flops / (hw.bf16_flops * hw.matmul_efficiency)
                 + attn_flops / (hw.bf16_flops * hw.dense_attention_efficiency))
    memory_s = hbm / (hw.hbm_bandwidth * hw.hbm_efficiency)
    return Cost("dense_mha", flops=expand_flops + attn_flops, useful_flops=expand_flops + attn_flops, hbm_bytes=hbm,
                compute_s=compute_s, memory_s=memory_s, time_s=max(compute_s, memory_s))


# ------------------------------------------------------------------------------------- PCP / DCP comms
def _layer_kv_row_bytes(cfg: ModelConfig, layer: int, mla_format: str = "fp8_ds_mla", index_format: str = "fp8"):
    """KV bytes one token adds in `layer`: its MLA row, plus its indexer key on full layers."""
    b = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)
    if cfg.layer_indexer_type(layer) == "full":
        b += index_key_bytes(cfg.index_head_dim, index_format)
    return b


def pcp_kv_allgather(cfg: ModelConfig, hw: HardwareSpec, chunk_tokens: float, pcp: int, layer: int,
                     mla_format: str = "fp8_ds_mla", index_format: str = "fp8") -> Cost:
    """PCP: all-gather the new chunk's KV of `layer` (MLA rows + indexer keys on full layers, cache
    format, each with its int32 position) so every rank's queries see every new key: chunk_tokens / pcp
    tokens per rank (`traffic.pcp_prefill_bytes`)."""
    row = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)
    key = index_key_bytes(cfg.index_head_dim, index_format) if cfg.layer_indexer_type(layer) == "full" else 0
    sent = traffic.pcp_prefill_bytes(n=pcp, new_tokens=chunk_tokens, row_bytes=row, key_bytes=key)
    return collective(hw, "all_gather", sent, pcp, "pcp_kv_gather").at_layer(layer)


# What a PCP x DCP prefill all-gathers per layer to attend over the whole context (`dcp_context_allgather`):
# "fp8_rows", the cached context's cache rows as stored (MLA rows + indexer keys on full layers), what this
# project's engine gathers (`parallel.dcp.full_copy`); "bf16_shard", vLLM's FLASHMLA_SPARSE path: each rank
# first up-converts its own shard of the request (cached + new tokens) to bf16, then all-gathers that
# (576 bf16 values a token, no indexer keys: vLLM's indexer scores the rank's key shard and merges top-k)
DCP_PREFILL_GATHERS = ("fp8_rows", "bf16_shard")


def dcp_context_allgather(cfg: ModelConfig, hw: HardwareSpec, context_tokens: float, dcp: int, layer: int,
                          mla_format: str = "fp8_ds_mla", index_format: str = "fp8", *,
                          form: str = "fp8_rows") -> Cost:
    """Prefill inside a PCP x DCP engine: all-gather the `layer` shards of `context_tokens` tokens (1/dcp
    of them on each rank, round-robin, ceil(context_tokens / dcp) slots) into a temporary full copy:
    receives (dcp-1) x that many rows per GPU (`traffic.dcp_full_copy_bytes`). form (DCP_PREFILL_GATHERS):
    "fp8_rows" gathers cache rows (+ indexer keys on full layers; context_tokens = the cached context),
    "bf16_shard" up-converted bf16 rows of kv_lora + rope values (context_tokens = cached + new tokens)."""
    if form not in DCP_PREFILL_GATHERS:
        raise ValueError(f"dcp prefill gather form must be one of {DCP_PREFILL_GATHERS}, got {form!r}")
    row = (BF16 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) if form == "bf16_shard"
           else _layer_kv_row_bytes(cfg, layer, mla_format, index_format))
    sent = traffic.dcp_full_copy_bytes(n=dcp, local_slots=math.ceil(context_tokens / dcp), row_bytes=row)
    return collective(hw, "all_gather", sent, dcp, DCP_GATHER).at_layer(layer)


def dcp_topk_merge(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, dcp: int, layer: int = -1,
                   local_k: float | None = None) -> tuple[Cost, ...]:
    """Exact global top-k under DCP: all-gather every rank's local top-k (fp32 score + int32 position)
    per query (`traffic.dcp_topk_merge_bytes`; local_k: candidates per rank, default index_topk: a
    context of at least top-k tokens per rank), then a top-k over dcp * local_k candidates."""
    k = cfg.index_topk if local_k is None else local_k
    sent = traffic.dcp_topk_merge_bytes(n=dcp, tokens=q_tokens, local_k=k, score_bytes=FP32, pos_bytes=INDEX_BYTES)
    gather = collective(hw, "all_gather", sent, dcp, "dcp_topk_gather")
    merge = _kernel("dcp_topk_merge", hw, flops=0.0,
                    hbm_bytes=q_tokens * dcp * k * (FP32 + INDEX_BYTES) + q_tokens * cfg.index_topk * INDEX_BYTES)
    return tuple(c.at_layer(layer) for c in (gather, merge))


def dcp_decode_merge(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, dcp: int, heads_total: int, *,
                     backend: str = "ag_rs", layer: int = -1) -> tuple[Cost, ...]:
    """DCP decode communication of one layer: send the query to the KV, merge partial outputs with LSE
    (`traffic.dcp_decode_bytes`; heads padded to a multiple of dcp).

    Every rank serves heads_total / dcp heads (the TP heads); attention runs all heads over the rank's
    KV shard, so first the absorbed queries (kv_lora + rope, bf16) are all-gathered. Then
    - "ag_rs": all-gather the fp32 LSEs, correct the bf16 outputs locally, reduce-scatter them by head
      (3 collectives);
    - "a2a": one all-to-all of packed outputs + LSEs to the head owners, then a local combine of dcp
      partials (2 collectives).
    """
    if backend not in ("ag_rs", "a2a"):
        raise ValueError(f"dcp backend must be 'ag_rs' or 'a2a', got {backend!r}")
    r = cfg.kv_lora_rank
    sent = traffic.dcp_decode_bytes(backend, n=dcp, tokens=q_tokens, heads=heads_total, kv_lora=r,
                                    rope=cfg.qk_rope_head_dim, q_bytes=BF16, out_bytes=BF16, lse_bytes=FP32)
    hp = traffic.padded_heads(heads_total, dcp)
    out_bytes = q_tokens * hp * r * BF16
    qg = collective(hw, "all_gather", sent["query_all_gather"], dcp, "dcp_q_gather")
    if backend == "ag_rs":
        lse = collective(hw, "all_gather", sent["lse_all_gather"], dcp, "dcp_lse_gather")
        fix = _kernel("dcp_lse_correct", hw, flops=0.0, hbm_bytes=2 * out_bytes + dcp * q_tokens * hp * FP32)
        rs = collective(hw, "reduce_scatter", sent["output_reduce_scatter"], dcp, "dcp_out_reduce_scatter")
        parts = (qg, lse, fix, rs)
    else:
        a2a = collective(hw, "all_to_all", sent["output_all_to_all"], dcp, "dcp_out_all_to_all")
        comb = _kernel("dcp_lse_combine", hw, flops=0.0,
                       hbm_bytes=q_tokens * hp * (r * BF16 + FP32) + q_tokens * hp / dcp * r * BF16)
        parts = (qg, a2a, comb)
    return tuple(c.at_layer(layer) for c in parts)


def _layers(cfg: ModelConfig, include_mtp: bool) -> range:
    return range(cfg.num_layers_with_mtp if include_mtp else cfg.num_hidden_layers)

