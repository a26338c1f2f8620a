"""Analytic performance model of GLM-5.3 serving on H200s: FLOPs, bytes and time of each step.

Everything is derived from a `ModelConfig` (the model's shapes), a `HardwareSpec` (datasheet peaks plus
named, documented achievable efficiencies that are the same for every figure) and a step's shapes.
Nothing is fitted to a published figure. docs/perfmodel.md lists the published values the model
reproduces or predicts and the formula behind each.

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
  says otherwise: `StepCost.time_s("none")` is their sum; `StepCost.time_s("dcp_prefetch")` hides each
  layer's DCP context all-gather behind the previous layer's kernels (a lower bound for any overlap
  scheme that prefetches one layer ahead).
- NVLink: the datasheet's 900 GB/s per GPU counts both directions; in a collective every GPU sends and
  receives at once, so a collective's link time uses one direction (450 GB/s). `nvlink_bytes` counts the
  bytes one GPU receives (for the symmetric collectives modelled here it also sends as many).
- The host link (pinned host memory <-> GPU) is counted one way: `host_bytes` in the copy's direction.
- KV formats default to the deployed ones: fp8_ds_mla rows (656 B) and fp8 indexer keys (132 B); byte
  counts come from `kvcache.layout`. Weights default to the FP8 checkpoint (1 byte per matmul weight).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from glm53.config import ModelConfig
from kvcache.layout import cache_groups, index_key_bytes, kv_bytes_per_token, mla_row_bytes

GiB = 2**30
BF16 = 2  # bytes
FP32 = 4
INDEX_BYTES = 4  # one int32 row index per selected row, read by the sparse kernel
FP8_WEIGHT_BYTES = 1 + 4 / (128 * 128)  # e4m3 weight + one fp32 scale per 128 x 128 block
# BRIEF §2: "An H200 has about 15 GiB left for KV after GLM-5.3's FP8 weights (TP8)". A published input
# (it depends on vLLM's memory profiling, not on shapes), used as the default budget of the figures.
PUBLISHED_KV_BUDGET_BYTES_TP8 = 15 * GiB
DCP_GATHER = "dcp_prefill_gather"  # name of the per-layer context all-gather of a PCP x DCP prefill
OVERLAPS = ("none", "dcp_prefetch")


# ---------------------------------------------------------------------------------------------- hardware
@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One GPU and its links. Peaks are datasheet values; efficiencies are achievable fractions.

    Peaks (H200 SXM defaults):
      bf16_flops, fp8_flops: dense tensor-core FLOP/s (989e12, 1979e12; the datasheet's larger numbers
        assume 2:4 sparsity). hbm_bandwidth: B/s (4.8e12). hbm_capacity_bytes: 141e9 B.
      nvlink_bandwidth_bidir: B/s per GPU, both directions together (900e9); one direction is half.
      host_link_bandwidth: B/s one way for pinned host <-> device copies (50e9; already an *achieved*
        figure: vLLM's offloading measurements over PCIe, BRIEF §3).
      sm_count, tensor_flops_per_sm_clock: 132 SMs x 4096 bf16 tensor FLOPs per clock; with bf16_flops
        they fix the clock (989e12 / 132 / 4096 = 1.83 GHz, FlashMLA's H800 arithmetic; H200 = same die).

    Achievable efficiencies (fractions of peak, the same for every figure, never fitted to one):
      matmul_efficiency = 790/989: bf16 matmul measured on one H200 (BRIEF §3). DeepGEMM's published fp8
        GEMM peak, 1550 of 1979 TFLOP/s on H800 (0.78), agrees, so it is used for fp8 GEMMs too, and for
        the indexer's fp8 MQA-logits GEMM.
      hbm_efficiency = 4.3/4.8: device-to-device copy measured on one H200 (BRIEF §3). FlashMLA's dense
        decode, 3000 GB/s of H800's 3.35 TB/s (0.90), agrees.
      sparse_attention_efficiency = 640/989: FlashMLA's token-level sparse prefill kernel (bf16 KV, no
        dequantisation), 640 TFLOP/s on H800 SXM5. Used for the tensor-core work of sparse MLA, decode and
        prefill; fp8 dequantisation is added as its own term (below), not folded into this number.
      dense_attention_efficiency = 0.63: the context-parallelism paper's FLOPS utilisation for a 1M-token
        prefill of Llama3 405B on H100 (arXiv 2411.01783), for dense (MHA-form) attention.
      nvlink_efficiency = 0.8: *assumption*: NCCL all-gather / all-to-all bus bandwidth of about 360 GB/s
        of the 450 GB/s per direction on an 8-GPU NVSwitch node (typical nccl-tests results; not measured
        here).
      host_link_efficiency = 1.0: host_link_bandwidth is already an achieved figure.

    fp8 KV dequantisation (FlashMLA's fp8 sparse decode deep dive): Hopper cannot convert e4m3 to bf16
    directly; one value costs fp8->half (1/64 cycle per SM), half->float (1/64), float->bf16 (1/16) and a
    scale multiply (1/256) on CUDA cores: `dequant_cycles_per_value`. Each CTA serves
    `heads_per_dequant` = 64 query heads and dequantises every row it reads, so a row read for h heads is
    dequantised ceil(h / 64) times. `dequant_overlap` = False: dequantisation and MMA do not overlap
    (time adds), the conservative reading of the published kernel numbers (docs/perfmodel.md compares).
    head_granularity = 64: FlashMLA's fp8 sparse kernels take 64 or 128 query heads, so fewer heads are
    padded up to a multiple of 64 when `pad_heads=True` (the hardware does the padded work).

    Latencies (*assumptions*, order of magnitude): collective_latency_s = 15 us per NCCL collective
    inside one NVSwitch node; host_copy_latency_s = 10 us per host<->device transfer call.
    """

    name: str = "H200 SXM"
    bf16_flops: float = 989e12
    fp8_flops: float = 1979e12
    hbm_bandwidth: float = 4.8e12
    hbm_capacity_bytes: float = 141e9
    nvlink_bandwidth_bidir: float = 900e9
    host_link_bandwidth: float = 50e9
    sm_count: int = 132
    tensor_flops_per_sm_clock: int = 4096
    matmul_efficiency: float = 790 / 989
    hbm_efficiency: float = 4.3 / 4.8
    sparse_attention_efficiency: float = 640 / 989
    dense_attention_efficiency: float = 0.63
    nvlink_efficiency: float = 0.8
    host_link_efficiency: float = 1.0
    dequant_cycles_per_value: float = 1 / 64 + 1 / 64 + 1 / 16 + 1 / 256
    heads_per_dequant: int = 64
    dequant_overlap: bool = False
    head_granularity: int = 64
    collective_latency_s: float = 15e-6
    host_copy_latency_s: float = 10e-6

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "dequant_overlap"):
                continue
            if f.name.endswith("latency_s"):
                if not v >= 0:
                    raise ValueError(f"HardwareSpec.{f.name} must be >= 0, got {v!r}")
            elif not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"HardwareSpec.{f.name} must be positive, got {v!r}")
            if f.name.endswith("efficiency") and v > 1:
                raise ValueError(f"HardwareSpec.{f.name} is a fraction of peak, must be <= 1, got {v!r}")

    @property
    def nvlink_bandwidth(self) -> float:
        """One direction, B/s (half the bidirectional datasheet figure)."""
        return self.nvlink_bandwidth_bidir / 2

    @property
    def clock_hz(self) -> float:
        """Tensor clock implied by the bf16 peak: bf16_flops / (sm_count * tensor_flops_per_sm_clock)."""
        return self.bf16_flops / (self.sm_count * self.tensor_flops_per_sm_clock)

    @property
    def dequant_values_per_s(self) -> float:
        """fp8 -> bf16 values dequantised per second by the whole GPU (CUDA cores)."""
        return self.sm_count * self.clock_hz / self.dequant_cycles_per_value

    def peak_flops(self, dtype: str = "bf16") -> float:
        if dtype == "bf16":
            return self.bf16_flops
        if dtype == "fp8":
            return self.fp8_flops
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")

    def ridge_point(self, dtype: str = "bf16", achievable: bool = False) -> float:
        """FLOP/byte above which a kernel is compute bound: peak FLOP/s / HBM B/s (optionally both derated)."""
        if achievable:
            return self.peak_flops(dtype) * self.matmul_efficiency / (self.hbm_bandwidth * self.hbm_efficiency)
        return self.peak_flops(dtype) / self.hbm_bandwidth


H200 = HardwareSpec()


# ------------------------------------------------------------------------------------------------ costs
@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs, bytes and time of one kernel, collective or copy on one GPU (or a sum of them).

    flops / useful_flops: FLOPs executed / FLOPs excluding padding. hbm_bytes: HBM bytes read + written.
    nvlink_bytes: bytes this GPU receives over NVLink. host_bytes: bytes over the host link (one way).
    compute_s, memory_s, link_s, latency_s: the roofline terms (seconds). time_s: seconds this Cost takes
    (for one kernel max(compute, memory, link) + latency; for a sum of Costs, the sum of their times).
    kind: "kernel" | "collective" | "copy" | "sum". layer: the decoder layer it belongs to (-1: none).
    """

    name: str
    kind: str = "kernel"
    layer: int = -1
    flops: float = 0.0
    useful_flops: float = 0.0
    hbm_bytes: float = 0.0
    nvlink_bytes: float = 0.0
    host_bytes: float = 0.0
    compute_s: float = 0.0
    memory_s: float = 0.0
    link_s: float = 0.0
    latency_s: float = 0.0
    time_s: float = 0.0

    @property
    def bound(self) -> str:
        """Which roofline term dominates: "compute" | "memory" | "link" | "latency"."""
        terms = {"compute": self.compute_s, "memory": self.memory_s, "link": self.link_s, "latency": self.latency_s}
        return max(terms, key=terms.get)

    @property
    def intensity(self) -> float:
        """Executed FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf

    def at_layer(self, layer: int) -> Cost:
        return dataclasses.replace(self, layer=layer)

    def scaled(self, factor: float) -> Cost:
        """The same work done `factor` times (every count and time multiplied)."""
        return dataclasses.replace(self, **{f: getattr(self, f) * factor for f in _ADDITIVE})


_ADDITIVE = ("flops", "useful_flops", "hbm_bytes", "nvlink_bytes", "host_bytes", "compute_s", "memory_s", "link_s",
             "latency_s", "time_s")


def total(costs: Iterable[Cost], name: str = "total") -> Cost:
    """Sum of Costs run one after another (every field adds, time included)."""
    sums = dict.fromkeys(_ADDITIVE, 0.0)
    for c in costs:
        for f in _ADDITIVE:
            sums[f] += getattr(c, f)
    return Cost(name=name, kind="sum", **sums)


def _kernel(name: str, hw: HardwareSpec, *, flops: float, hbm_bytes: float, dtype: str = "bf16",
            efficiency: float | None = None, useful_flops: float | None = None, extra_compute_s: float = 0.0) -> Cost:
    eff = hw.matmul_efficiency if efficiency is None else efficiency
    compute_s = flops / (hw.peak_flops(dtype) * eff) + extra_compute_s
    memory_s = hbm_bytes / (hw.hbm_bandwidth * hw.hbm_efficiency)
    return Cost(name=name, kind="kernel", flops=flops, useful_flops=flops if useful_flops is None else useful_flops,
                hbm_bytes=hbm_bytes, compute_s=compute_s, memory_s=memory_s, time_s=max(compute_s, memory_s))


def _collective(name: str, hw: HardwareSpec, *, recv_bytes: float, hbm_bytes: float, n: int) -> Cost:
    if n <= 1 or recv_bytes <= 0:
        return Cost(name=name, kind="collective")
    link_s = recv_bytes / (hw.nvlink_bandwidth * hw.nvlink_efficiency)
    memory_s = hbm_bytes / (hw.hbm_bandwidth * hw.hbm_efficiency)
    lat = hw.collective_latency_s
    return Cost(name=name, kind="collective", hbm_bytes=hbm_bytes, nvlink_bytes=recv_bytes, link_s=link_s,
                memory_s=memory_s, latency_s=lat, time_s=max(link_s, memory_s) + lat)


# ------------------------------------------------------------------------------------------ collectives
def all_gather(hw: HardwareSpec, bytes_per_rank: float, n: int, name: str = "all_gather") -> Cost:
    """Each of n ranks contributes `bytes_per_rank`; every rank ends with all n parts.
    Per GPU: receives (n-1) * bytes_per_rank over NVLink; HBM writes what it receives, reads its own part."""
    recv = (n - 1) * bytes_per_rank
    return _collective(name, hw, recv_bytes=recv, hbm_bytes=recv + bytes_per_rank, n=n)


def reduce_scatter(hw: HardwareSpec, total_bytes: float, n: int, name: str = "reduce_scatter") -> Cost:
    """Sum n buffers of `total_bytes` and leave 1/n of the sum on each rank.
    Per GPU: receives (n-1)/n * total_bytes of partial sums; HBM reads its buffer and the partials."""
    recv = (n - 1) / n * total_bytes
    return _collective(name, hw, recv_bytes=recv, hbm_bytes=total_bytes + recv, n=n)


def all_reduce(hw: HardwareSpec, total_bytes: float, n: int, name: str = "all_reduce") -> Cost:
    """Ring all-reduce (reduce-scatter + all-gather): receives 2 (n-1)/n * total_bytes per GPU."""
    recv = 2 * (n - 1) / n * total_bytes
    return _collective(name, hw, recv_bytes=recv, hbm_bytes=total_bytes + recv, n=n)


def all_to_all(hw: HardwareSpec, send_bytes: float, n: int, name: str = "all_to_all") -> Cost:
    """Each rank sends `send_bytes` in total to the other ranks and receives as many (balanced)."""
    return _collective(name, hw, recv_bytes=send_bytes, hbm_bytes=2 * send_bytes, n=n)


def host_copy(hw: HardwareSpec, nbytes: float, *, transfers: int = 1, name: str = "host_copy") -> Cost:
    """A host <-> device copy of `nbytes` over the pinned host link (one direction), in `transfers` calls.
    HBM sees the same bytes (far below its bandwidth). time = latency * transfers + max(link, HBM)."""
    if nbytes <= 0:
        return Cost(name=name, kind="copy")
    link_s = nbytes / (hw.host_link_bandwidth * hw.host_link_efficiency)
    memory_s = nbytes / (hw.hbm_bandwidth * hw.hbm_efficiency)
    lat = transfers * hw.host_copy_latency_s
    return Cost(name=name, kind="copy", hbm_bytes=nbytes, host_bytes=nbytes, link_s=link_s, memory_s=memory_s,
                latency_s=lat, time_s=max(link_s, memory_s) + lat)


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


def sparse_mla(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, rows_per_query: float, heads: int, *,
               mla_format: str = "fp8_ds_mla", pad_heads: bool = False, dequant: bool = True,
               heads_per_dequant: int | None = None, name: str = "sparse_mla") -> Cost:
    """Sparse MLA (absorbed MQA) over `rows_per_query` selected latent rows for each of `q_tokens` query
    tokens with `heads` query heads on this GPU; decode and prefill alike (prefill: many query tokens).

    useful FLOPs = q * rows * heads * flops_per_row_head; executed FLOPs use the padded head count when
    `pad_heads`. HBM = q * rows * (row bytes + 4 B index) + q * executed heads * 2,176 B of bf16 q/out
    (each query reads its own rows: selections differ per query). Compute time = MMA time at
    sparse_attention_efficiency + (fp8 formats, `dequant`) the dequantisation of every row once per
    `heads_per_dequant` heads (added, or overlapped if hw.dequant_overlap).
    """
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


def sparse_mla_intensity(cfg: ModelConfig, heads: int, *, hw: HardwareSpec = H200, pad_heads: bool = False,
                         rows: int | None = None) -> dict:
    """Arithmetic intensity of sparse MLA for ONE query token over `rows` (default index_topk) rows.

    BRIEF §3: 2,048 rows x 660 B + heads x 2,176 B; 2,176 FLOPs per row per head. Returns useful and
    executed FLOPs, HBM bytes, and FLOP/byte for both.
    """
    c = sparse_mla(cfg, hw, 1, cfg.index_topk if rows is None else rows, heads, pad_heads=pad_heads)
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
    return _kernel(name, hw, flops=flops, hbm_bytes=hbm, dtype="fp8")


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
    fp8 weights run at the fp8 rate, others at bf16. Time = sum of the GEMMs' roofline times."""
    parts = []
    for din, dout, wbytes, shards in shapes:
        params = din * dout / shards
        hbm = params * wbytes + tokens * BF16 * (din + dout / shards)
        dtype = "fp8" if wbytes < BF16 else "bf16"
        parts.append(_kernel(name, hw, flops=2 * tokens * params, hbm_bytes=hbm, dtype=dtype))
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


def moe(cfg: ModelConfig, hw: HardwareSpec, tokens_per_rank: float, ep: int, *, replicated_tokens: bool = False,
        weight_bytes: float = FP8_WEIGHT_BYTES, dispatch_bytes_per_value: float = 1 + FP32 / 128,
        combine_bytes_per_value: float = BF16, layer: int = -1) -> tuple[Cost, ...]:
    """One MoE layer with expert parallelism over `ep` ranks (each holds n_routed_experts / ep experts).

    `replicated_tokens=False` (PCP or DP attention): every rank has its own `tokens_per_rank` tokens; the
    EP group routes tokens_per_rank * ep tokens; dispatch and combine are all-to-alls (fp8 dispatch with
    one fp32 scale per 128 values, bf16 combine) to the expected remote ranks per token; the shared
    expert is replicated and runs on the rank's own tokens.
    `replicated_tokens=True` (TP attention): every rank has the same `tokens_per_rank` tokens, runs its
    local experts on them and the TP-split shared expert, then one bf16 all-reduce of the output.

    Routed-expert weights are read once per step for every *touched* local expert
    (`expected_touched_experts`): at small batch the layer is bound by these reads, not by FLOPs.
    Returns (router, routed experts, shared expert, dispatch, combine) Costs, tagged with `layer`.
    """
    d, f, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    group_tokens = tokens_per_rank if replicated_tokens else tokens_per_rank * ep
    assignments = group_tokens * k / ep
    touched = expected_touched_experts(cfg, group_tokens, ep)
    expert_params = 3 * d * f
    routed = _kernel("moe_experts", hw, flops=2 * assignments * expert_params, dtype="fp8" if weight_bytes < BF16 else "bf16",
                     hbm_bytes=touched * expert_params * weight_bytes + assignments * BF16 * (2 * d + 3 * f))
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
        remote = tokens_per_rank * expected_remote_ranks(cfg, ep)
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


def pcp_kv_allgather(cfg: ModelConfig, hw: HardwareSpec, chunk_tokens: float, pcp: int, layer: int) -> Cost:
    """PCP: all-gather the new chunk's KV of `layer` (MLA rows + indexer keys on full layers; cache
    format) so every rank's queries see every new key: chunk_tokens / pcp tokens per rank."""
    return all_gather(hw, chunk_tokens / pcp * _layer_kv_row_bytes(cfg, layer), pcp, name="pcp_kv_gather").at_layer(layer)


def dcp_context_allgather(cfg: ModelConfig, hw: HardwareSpec, context_tokens: float, dcp: int, layer: int) -> Cost:
    """Prefill inside a PCP x DCP engine: all-gather the `layer` shards of the cached context (1/dcp of
    it on each rank, round-robin) into a temporary full copy: receives (dcp-1)/dcp of it per GPU."""
    per_rank = math.ceil(context_tokens / dcp) * _layer_kv_row_bytes(cfg, layer)
    return all_gather(hw, per_rank, dcp, name=DCP_GATHER).at_layer(layer)


def dcp_topk_merge(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, dcp: int, layer: int = -1) -> tuple[Cost, ...]:
    """Exact global top-k under DCP: all-gather every rank's local top-k (fp32 score + int32 position)
    per query, then a top-k over dcp * k candidates."""
    k = cfg.index_topk
    gather = all_gather(hw, q_tokens * k * (FP32 + INDEX_BYTES), dcp, name="dcp_topk_gather")
    merge = _kernel("dcp_topk_merge", hw, flops=0.0, hbm_bytes=q_tokens * dcp * k * (FP32 + INDEX_BYTES) + q_tokens * k * INDEX_BYTES)
    return tuple(c.at_layer(layer) for c in (gather, merge))


def dcp_decode_merge(cfg: ModelConfig, hw: HardwareSpec, q_tokens: float, dcp: int, heads_total: int, *,
                     backend: str = "ag_rs", layer: int = -1) -> tuple[Cost, ...]:
    """DCP decode communication of one layer: send the query to the KV, merge partial outputs with LSE.

    Every rank serves heads_total / dcp heads (the TP heads); attention runs all heads over the rank's
    KV shard, so first the absorbed queries (kv_lora + rope, bf16) are all-gathered. Then
    - "ag_rs": all-gather the fp32 LSEs, correct the bf16 outputs locally, reduce-scatter them by head
      (3 collectives);
    - "a2a": one all-to-all of packed outputs + LSEs to the head owners, then a local combine of dcp
      partials (2 collectives).
    """
    if backend not in ("ag_rs", "a2a"):
        raise ValueError(f"dcp backend must be 'ag_rs' or 'a2a', got {backend!r}")
    h_local = heads_total / dcp
    r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out_bytes = q_tokens * heads_total * r * BF16
    qg = all_gather(hw, q_tokens * h_local * (r + p) * BF16, dcp, name="dcp_q_gather")
    if backend == "ag_rs":
        lse = all_gather(hw, q_tokens * heads_total * FP32, dcp, name="dcp_lse_gather")
        fix = _kernel("dcp_lse_correct", hw, flops=0.0, hbm_bytes=2 * out_bytes + dcp * q_tokens * heads_total * FP32)
        rs = reduce_scatter(hw, out_bytes, dcp, name="dcp_out_reduce_scatter")
        parts = (qg, lse, fix, rs)
    else:
        packed = q_tokens * heads_total * (r * BF16 + FP32)
        a2a = all_to_all(hw, (dcp - 1) / dcp * packed, dcp, name="dcp_out_all_to_all")
        comb = _kernel("dcp_lse_combine", hw, flops=0.0, hbm_bytes=packed + q_tokens * h_local * r * BF16)
        parts = (qg, a2a, comb)
    return tuple(c.at_layer(layer) for c in parts)


# ----------------------------------------------------------------------------------------------- steps
@dataclasses.dataclass(frozen=True)
class StepCost:
    """All Costs of one engine step on one GPU, in execution order, each tagged with its layer."""

    parts: tuple[Cost, ...]

    def total(self) -> Cost:
        return total(self.parts, "step")

    def by_name(self) -> dict[str, Cost]:
        """Costs summed by name (e.g. all layers' "sparse_mla")."""
        names = dict.fromkeys(c.name for c in self.parts)
        return {n: total((c for c in self.parts if c.name == n), n) for n in names}

    def time_s(self, overlap: str = "none") -> float:
        """Step time in seconds under an overlap assumption (see module docstring):
        "none": every Cost runs after the previous one (sum of times).
        "dcp_prefetch": layer l's DCP context all-gather runs during layer l-1's kernels, so only
        max(0, gather_l - kernels_{l-1}) of it shows (the first layer's gather is fully exposed)."""
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
        if overlap == "none":
            return sum(c.time_s for c in self.parts)
        kernels: dict[int, float] = {}
        gathers: dict[int, float] = {}
        rest = 0.0
        for c in self.parts:
            if c.name == DCP_GATHER:
                gathers[c.layer] = gathers.get(c.layer, 0.0) + c.time_s
            else:
                rest += c.time_s
                if c.kind == "kernel":
                    kernels[c.layer] = kernels.get(c.layer, 0.0) + c.time_s
        return rest + sum(max(0.0, g - kernels.get(layer - 1, 0.0)) for layer, g in gathers.items())


def _mean_rows(k: int, first_visible: float, count: float) -> float:
    """Mean of min(k, first_visible + i) over i = 0..count-1 (rows a query at each of `count` consecutive
    positions attends, the first seeing `first_visible` keys)."""
    n = int(count)
    if n <= 0:
        return 0.0
    a = int(first_visible)
    last = a + n - 1
    if last <= k:
        return (a + last) / 2
    if a >= k:
        return float(k)
    below = k - a  # positions with fewer than k visible keys: a .. k-1
    return ((a + k - 1) * below / 2 + k * (n - below)) / n


def _layers(cfg: ModelConfig, include_mtp: bool) -> range:
    return range(cfg.num_layers_with_mtp if include_mtp else cfg.num_hidden_layers)


def prefill_step(cfg: ModelConfig, hw: HardwareSpec, chunk_tokens: int, cached_context: int, *, pcp: int = 1,
                 tp: int = 1, dcp: int = 1, ep: int | None = None, include_mtp: bool = True, pad_heads: bool = False,
                 dequant: bool = True, weight_bytes: float = FP8_WEIGHT_BYTES) -> StepCost:
    """One prefill step of one request: `chunk_tokens` new tokens against `cached_context` cached tokens,
    on an engine of pcp * tp GPUs (one GPU's costs). Layers: the main model and (include_mtp) the MTP
    layer, which prefills the prompt too so its KV exists for drafting.

    - PCP (pcp > 1): each rank takes chunk_tokens / pcp query tokens (2N-chunk load balance, so each rank's
      mean causal key count equals the chunk's), all heads; attention weights replicated; the new KV of
      every layer is all-gathered. MoE: EP over all pcp * tp GPUs with all-to-all dispatch.
    - TP (tp > 1): every rank has all chunk tokens and heads / tp heads; the indexer is replicated (not
      split); o_proj, dense MLP and MoE outputs are all-reduced.
    - DCP (dcp > 1; dcp <= pcp * tp): the persistent cache is sharded, so each layer first all-gathers the
      cached context (`dcp_context_allgather`); the new chunk's KV arrives with the PCP gather.
    Per layer: projections, [TP all-reduce], [PCP KV gather], [DCP context gather], indexer scores and
    top-k on full layers, sparse MLA, dense MLP or MoE (+ its collectives); then the lm_head for the
    request's last token.
    """
    n_gpus = pcp * tp
    ep = n_gpus if ep is None else ep
    if min(pcp, tp, dcp, ep) < 1 or n_gpus % dcp or cfg.num_attention_heads % tp or (pcp > 1 and tp > 1):
        raise ValueError(f"need pcp, tp, dcp, ep >= 1, not both pcp and tp > 1, dcp dividing pcp*tp and tp "
                         f"dividing the heads; got pcp={pcp} tp={tp} dcp={dcp} ep={ep}")
    q = chunk_tokens / pcp
    heads = cfg.num_attention_heads // tp
    keys_per_query = cached_context + (chunk_tokens + 1) / 2
    rows = _mean_rows(cfg.index_topk, cached_context + 1, chunk_tokens)
    parts: list[Cost] = []
    for layer in _layers(cfg, include_mtp):
        parts.append(mla_projections(cfg, hw, q, layer, tp=tp, weight_bytes=weight_bytes))
        if tp > 1:
            parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        if pcp > 1:
            parts.append(pcp_kv_allgather(cfg, hw, chunk_tokens, pcp, layer))
        if dcp > 1 and cached_context > 0:
            parts.append(dcp_context_allgather(cfg, hw, cached_context, dcp, layer))
        if cfg.layer_indexer_type(layer) == "full":
            parts.append(indexer_scores(cfg, hw, q, keys_per_query, keys_read=cached_context + chunk_tokens).at_layer(layer))
            parts.append(indexer_topk(cfg, hw, q, keys_per_query).at_layer(layer))
        parts.append(sparse_mla(cfg, hw, q, rows, heads, pad_heads=pad_heads, dequant=dequant).at_layer(layer))
        if cfg.layer_mlp_type(layer) == "dense":
            parts.append(dense_mlp(cfg, hw, q, tp=tp, weight_bytes=weight_bytes).at_layer(layer))
            if tp > 1:
                parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        else:
            parts.extend(moe(cfg, hw, q, ep, replicated_tokens=tp > 1, weight_bytes=weight_bytes,
                             layer=layer))
    parts.append(lm_head(cfg, hw, 1, shards=n_gpus))
    return StepCost(tuple(p for p in parts if p.time_s > 0))


def decode_step(cfg: ModelConfig, hw: HardwareSpec, batch: int, context: int, *, tp: int = 1, dp: int = 1,
                dcp: int = 1, spec_tokens: int = 0, dcp_backend: str = "ag_rs", pad_heads: bool = True,
                dequant: bool = True, include_mtp: bool = False, weight_bytes: float = FP8_WEIGHT_BYTES) -> StepCost:
    """One decode (or MTP verification) step of the target model on one GPU: `batch` requests on this
    rank group, each with `context` cached tokens and 1 + spec_tokens query tokens.

    - TP (tp > 1): heads / tp per GPU (padded to 64 for the fp8 kernel when `pad_heads`), replicated
      indexer, all-reduces; MoE EP over the tp GPUs with replicated tokens.
    - DP (dp > 1, tp = 1): `batch` is per rank; attention is local; MoE EP over the dp ranks (all-to-all).
    - DCP (dcp > 1, dcp dividing tp): KV sharded by token; each rank scores its context/dcp local keys,
      local top-k, global top-k merge; attention runs (heads/tp) * dcp heads over about index_topk/dcp
      selected local rows per query; outputs merge with LSE (`dcp_backend`).
    `include_mtp` adds the MTP layer (a draft pass over the same query tokens; default off: the draft
    steps are separate).
    """
    if tp > 1 and dp > 1:
        raise ValueError("decode_step models TP or DP attention, not both (tp > 1 and dp > 1)")
    if tp % dcp or cfg.num_attention_heads % tp:
        raise ValueError(f"dcp ({dcp}) must divide tp ({tp}) and tp must divide the heads")
    q = batch * (1 + spec_tokens)
    heads = cfg.num_attention_heads // tp * dcp
    local_keys = math.ceil(context / dcp)
    rows = min(cfg.index_topk, context) / dcp
    ep = tp * dp
    parts: list[Cost] = []
    for layer in _layers(cfg, include_mtp):
        parts.append(mla_projections(cfg, hw, q, layer, tp=tp, weight_bytes=weight_bytes))
        if tp > 1:
            parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        if cfg.layer_indexer_type(layer) == "full":
            parts.append(indexer_scores(cfg, hw, q, local_keys, keys_read=batch * local_keys).at_layer(layer))
            parts.append(indexer_topk(cfg, hw, q, local_keys).at_layer(layer))
            if dcp > 1:
                parts.extend(dcp_topk_merge(cfg, hw, q, dcp, layer))
        parts.append(sparse_mla(cfg, hw, q, rows, heads, pad_heads=pad_heads, dequant=dequant).at_layer(layer))
        if dcp > 1:
            parts.extend(dcp_decode_merge(cfg, hw, q, dcp, heads, backend=dcp_backend, layer=layer))
        if cfg.layer_mlp_type(layer) == "dense":
            parts.append(dense_mlp(cfg, hw, q, tp=tp, weight_bytes=weight_bytes).at_layer(layer))
            if tp > 1:
                parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        else:
            parts.extend(moe(cfg, hw, q, ep, replicated_tokens=tp > 1, weight_bytes=weight_bytes, layer=layer))
    parts.append(lm_head(cfg, hw, q, shards=tp))
    return StepCost(tuple(p for p in parts if p.time_s > 0))


# ------------------------------------------------------------------------- indexer vs MLA: crossover
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
