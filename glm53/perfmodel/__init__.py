"""Analytic performance model of GLM-5.3 serving on H200s: FLOPs, bytes and time of each step.

The package, bottom up: `hardware` (HardwareSpec, byte sizes), `traffic` (the bytes each parallel
scheme's collectives send: the one source `parallel.comm` checks against traced programs), `cost` (the
Cost algebra, collectives, host copies, StepCost), `ops` (one op's cost: sparse MLA, indexer, GEMMs,
MoE, PCP / DCP comms), `step`
(a step's cost: one prefill chunk, one decode batch, or a scheduler's mixed plan), `studies` (FLOP
crossovers, parameter and weight counts). Everything public is re-exported here.

Everything is derived from a `ModelConfig` (the model's shapes), a `HardwareSpec` (datasheet peaks plus
named, documented achievable efficiencies that are the same for every figure) and a step's shapes.
`H200` is the datasheet spec; `H200_CALIBRATED` (`HARDWARE["h200"]`) has GEMM, collective, sparse-MLA
(FlashMLA kernel model) and indexer constants fitted on published kernel tables (`calibration`), never on
an end-to-end serving figure.
docs/perfmodel.md lists the published values the model reproduces or predicts and the formula behind each.

Conventions
- Every quantity is **per GPU** and per call (one kernel, one collective, one copy, one step) unless a
  name says otherwise. Units: FLOPs (one multiply-add = 2 FLOPs), bytes, seconds, bytes per second.
- `flops` are the FLOPs the hardware executes (padded heads included); `useful_flops` exclude padding.
- Time of one `Cost`: its resources overlap inside the kernel or collective (roofline), so
  `time_s = max(compute_s, memory_s, link_s) + latency_s`, with
  `compute_s = flops / (peak * efficiency)` (+ fp8 dequantisation time where modelled),
  `memory_s = hbm_bytes / (hbm_bandwidth * hbm_efficiency)`,
  `link_s = link bytes / (one-direction link bandwidth * link efficiency)`.
- Costs of one step run one after another (one stream, no overlap) unless the step's overlap option
  says otherwise: `StepCost.time_s("none")` is their sum, and vLLM's schedule (its DCP collectives block
  the compute stream); `StepCost.time_s("dcp_prefetch")` hides each layer's DCP context all-gather behind
  the previous layer's kernels (a lower bound for any overlap scheme that prefetches one layer ahead).
- NVLink: the datasheet's 900 GB/s per GPU counts both directions; in a collective every GPU sends and
  receives at once, so a collective's link time uses one direction (450 GB/s). `nvlink_bytes` counts the
  bytes one GPU receives (for the symmetric collectives modelled here it also sends as many).
- The host link (pinned host memory <-> GPU) is counted one way: `host_bytes` in the copy's direction.
- KV formats default to the deployed ones: fp8_ds_mla rows (656 B) and fp8 indexer keys (132 B); byte
  counts come from `kvcache.layout`. Weights default to the FP8 checkpoint (1 byte per matmul weight).
"""


from glm53.perfmodel.cost import (DCP_GATHER, OVERLAPS, Cost, StepCost, all_gather, all_reduce, all_to_all,
                                  host_copy, reduce_scatter, total)
from glm53.perfmodel.hardware import (BF16, FP8_WEIGHT_BYTES, FP32, H200, H200_CALIBRATED, INDEX_BYTES,
                                      PUBLISHED_KV_BUDGET_BYTES_TP8, HARDWARE, NVME_GEN4, STORAGE, GiB,
                                      HardwareSpec, StorageSpec, hardware_spec)
from glm53.perfmodel.ops import (DCP_PREFILL_GATHERS, dcp_context_allgather, dcp_decode_merge, dcp_topk_merge,
                                 dense_mha_prefill,
                                 dense_mlp, expected_remote_ranks, expected_touched_experts, hisparse_row_copy,
                                 indexer_pair_flops, indexer_scores, indexer_topk, kv_bytes_by_component,
                                 kv_bytes_per_gpu, lm_head, max_context_tokens, mla_projections, moe, moe_routed_gemms,
                                 padded_heads,
                                 pcp_kv_allgather, sparse_decode_units, sparse_mla, sparse_mla_flops_per_row_head,
                                 sparse_mla_intensity, sparse_mla_qo_bytes_per_head, sparse_mla_upconvert)
from glm53.perfmodel.step import decode_step, prefill_step, sparse_prefill_kernel
from glm53.perfmodel.studies import (causal_pairs, crossover_prompt_len, param_counts,
                                     prefill_flops_per_gpu, sparse_rows_total, weight_bytes_per_gpu)

__all__ = [
    "DCP_GATHER", "OVERLAPS", "Cost", "StepCost", "all_gather", "all_reduce", "all_to_all", "host_copy",
    "reduce_scatter", "total", "BF16", "FP8_WEIGHT_BYTES", "FP32", "H200", "INDEX_BYTES",
    "H200_CALIBRATED", "PUBLISHED_KV_BUDGET_BYTES_TP8", "HARDWARE", "NVME_GEN4", "STORAGE", "GiB", "HardwareSpec",
    "StorageSpec", "hardware_spec", "DCP_PREFILL_GATHERS", "dcp_context_allgather", "dcp_decode_merge",
    "dcp_topk_merge", "dense_mha_prefill", "dense_mlp", "expected_remote_ranks", "expected_touched_experts",
    "hisparse_row_copy", "indexer_pair_flops", "indexer_scores", "indexer_topk", "kv_bytes_by_component",
    "kv_bytes_per_gpu", "lm_head", "max_context_tokens", "mla_projections", "moe", "moe_routed_gemms", "padded_heads",
    "pcp_kv_allgather", "sparse_decode_units", "sparse_mla", "sparse_mla_flops_per_row_head", "sparse_mla_intensity",
    "sparse_mla_qo_bytes_per_head", "sparse_mla_upconvert", "decode_step", "prefill_step", "sparse_prefill_kernel",
    "causal_pairs",
    "crossover_prompt_len", "param_counts", "prefill_flops_per_gpu", "sparse_rows_total", "weight_bytes_per_gpu"
]
