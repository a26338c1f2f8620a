"""The hardware a step runs on: `HardwareSpec` (datasheet peaks, achievable efficiencies, latencies)
and the byte sizes every cost shares."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


GiB = 2**30
BF16 = 2  # bytes
FP32 = 4
INDEX_BYTES = 4  # one int32 row index per selected row, read by the sparse kernel
FP8_WEIGHT_BYTES = 1 + 4 / (128 * 128)  # e4m3 weight + one fp32 scale per 128 x 128 block
# BRIEF §2: "An H200 has about 15 GiB left for KV after GLM-5.3's FP8 weights (TP8)". A published input
# (it depends on vLLM's memory profiling, not on shapes), used as the default budget of the figures.
PUBLISHED_KV_BUDGET_BYTES_TP8 = 15 * GiB


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One GPU and its links. Peaks are datasheet values; efficiencies are achievable fractions.

    platform: what JAX would call the device ("gpu"; "cpu" for experiments/validate_sim.py's fitted spec):
    the runner's choices that depend on it (the MTP verify form, SpeculativeConfig.verify_mode) are priced
    as the runner on that platform makes them.

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
    forward_latency_s: fixed time of one forward program beyond its kernels' (dispatch of the compiled
    program and its inputs; 0 here: a GPU step is one CUDA graph, its launch inside the step overhead);
    the CPU spec of experiments/validate_sim.py fits it (milliseconds: XLA's CPU thunks per op).

    Calibrated terms (None: fall back to the general efficiency above, as this datasheet spec does;
    `H200_CALIBRATED` sets them from glm53.perfmodel.calibration's fits on published tables):
      gemm_efficiency / gemm_memory_efficiency: compute and HBM fractions of the projection, MLP and
        expert GEMMs (default matmul_efficiency / hbm_efficiency); gemm_latency_s: fixed time of each
        GEMM kernel (prologue, tail wave; default 0).
      all_to_all_efficiency, all_reduce_efficiency: link fractions of those collectives (default
        nvlink_efficiency, which then covers all-gather and reduce-scatter).
      sparse_decode_efficiency: switches sparse MLA from the roofline above to the FlashMLA kernel model
        (glm53.perfmodel.ops.sparse_mla, docs/perfmodel.md): the fraction of FlashMLA's published cycle counts
        (2,176 MMA cycles per 64 rows x 64 heads, 50 dequantisation cycles per fp8 row, shared by the two CTAs
        of a 128-head cluster) the fp8 decode kernel sustains; None keeps the roofline (datasheet spec).
        sparse_decode_latency_s: fixed time of one decode-kernel call (launch, tile-scheduler metadata kernel,
        split-KV combine). sparse_decode_overhead_blocks: FlashMLA's scheduler charges every request this
        many 64-row blocks on top of its rows (`fixed_overhead_num_blocks`, csrc/api/sparse_decode.h).
        The bf16 sparse prefill kernel runs at sparse_attention_efficiency in that model.
      indexer_efficiency / indexer_latency_s: fp8 MQA-logits (lightning indexer) compute fraction of the fp8
        peak and fixed time per call (default matmul_efficiency, 0).
      moe_gemm_efficiency / moe_gemm_memory_efficiency / moe_gemm_latency_s / moe_gemm_exposed_fraction: the
        routed experts' grouped GEMMs (`cost._grouped_gemm`), priced max(C, M) + exposed x min(C, M) +
        latency: a grouped kernel streams a weight matrix per group, and the fit on DeepGEMM's grouped rows
        finds part of the shorter of compute and weight streaming not hidden behind the other. None: the
        dense GEMM's roofline (gemm_eff, gemm_latency_s, nothing exposed).
    """

    name: str = "H200 SXM"
    platform: str = "gpu"
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
    forward_latency_s: float = 0.0
    gemm_efficiency: float | None = None
    gemm_memory_efficiency: float | None = None
    gemm_latency_s: float = 0.0
    all_to_all_efficiency: float | None = None
    all_reduce_efficiency: float | None = None
    sparse_decode_efficiency: float | None = None
    sparse_decode_latency_s: float = 0.0
    sparse_decode_overhead_blocks: int = 5
    indexer_efficiency: float | None = None
    indexer_latency_s: float = 0.0
    moe_gemm_efficiency: float | None = None
    moe_gemm_memory_efficiency: float | None = None
    moe_gemm_latency_s: float | None = None
    moe_gemm_exposed_fraction: float | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "platform", "dequant_overlap") or v is None and f.default is None:
                continue
            if f.name.endswith("latency_s"):
                if not v >= 0:
                    raise ValueError(f"HardwareSpec.{f.name} must be >= 0, got {v!r}")
            elif not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"HardwareSpec.{f.name} must be positive, got {v!r}")
            if (f.name.endswith("efficiency") or f.name.endswith("fraction")) and v > 1:
                raise ValueError(f"HardwareSpec.{f.name} is a fraction of peak, must be <= 1, got {v!r}")

    @property
    def flashmla_kernels(self) -> bool:
        """Whether sparse MLA is priced by the FlashMLA kernel model (calibrated specs) or the roofline."""
        return self.sparse_decode_efficiency is not None

    def gemm_eff(self) -> tuple[float, float]:
        """(compute, memory) efficiency of a GEMM kernel."""
        return (self.matmul_efficiency if self.gemm_efficiency is None else self.gemm_efficiency,
                self.hbm_efficiency if self.gemm_memory_efficiency is None else self.gemm_memory_efficiency)

    def moe_gemm(self) -> tuple[float, float, float, float]:
        """(compute efficiency, memory efficiency, fixed time s, exposed fraction) of a grouped expert GEMM."""
        if self.moe_gemm_efficiency is None:
            return (*self.gemm_eff(), self.gemm_latency_s, 0.0)
        return (self.moe_gemm_efficiency, self.moe_gemm_memory_efficiency, self.moe_gemm_latency_s or 0.0,
                self.moe_gemm_exposed_fraction or 0.0)

    def link_eff(self, collective: str) -> float:
        """Link efficiency of a collective: "all_to_all" | "all_reduce" | anything else (all-gather,
        reduce-scatter: nvlink_efficiency)."""
        own = {"all_to_all": self.all_to_all_efficiency, "all_reduce": self.all_reduce_efficiency}.get(collective)
        return self.nvlink_efficiency if own is None else own

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

# H200 with the efficiencies fitted on published tables (glm53/perfmodel/calibration.py; each value is
# what `calibration.calibrated_fields()` computes, checked by tests/glm53/test_calibration.py; sources
# in published.json and docs/perfmodel_sources.md):
# - GEMMs: roofline + fixed time fitted on half of DeepGEMM's H800 FP8 table (held-out error: see
#   results/calibration/gemm.json); the routed experts' grouped GEMMs: their own fit on DeepGEMM's grouped
#   rows (contiguous and masked), with part of the shorter of compute and weight streaming exposed
#   (results/calibration/moe_gemm.json);
# - all-to-all: DeepEP's intranode NVLink dispatch / combine bandwidths (H100, H20), median of half;
# - all-gather / reduce-scatter: the NCCL maintainer's expected ring bus bandwidth on 8 x H100 (370 GB/s);
# - all-reduce: NVLS bus bandwidth measured on 8 x H200 (475 GB/s) exceeds the ring model's link bound,
#   so its efficiency is capped at 1;
# - sparse MLA: the FlashMLA kernel model (ops.sparse_mla) with its two constants solved from FlashMLA's
#   H800 decode row (batch 128 x 128 heads, 410 TFLOPS) and a third party's H200 row at GLM's TP shape
#   (batch 8, heads padded to 64, 22.8 us); held out: FlashMLA's top-k 32,768 and previous-kernel rows;
# - indexer: DeepGEMM fp8_mqa_logits on an H200 (64 heads x 128, 2,048 queries, 4K-64K keys), fitted on the
#   context-parallel rows, checked on the contiguous ones.
# Top-k, host copies and collective / copy latencies keep the datasheet spec's values (host copies are
# checked against published bandwidths: calibrate.py).
H200_CALIBRATED = dataclasses.replace(
    H200, name="H200 SXM (calibrated)", gemm_efficiency=0.68, gemm_memory_efficiency=1.0, gemm_latency_s=4.5e-6,
    all_to_all_efficiency=0.73, nvlink_efficiency=0.82, all_reduce_efficiency=1.0,
    sparse_decode_efficiency=0.865, sparse_decode_latency_s=12.6e-6, indexer_efficiency=0.59, indexer_latency_s=13e-6,
    moe_gemm_efficiency=0.72, moe_gemm_memory_efficiency=1.0, moe_gemm_latency_s=6e-6, moe_gemm_exposed_fraction=0.4)

# H200 with the efficiencies of this codebase's own kernels, fitted on a committed H200 run of
# experiments.bench_gpu (glm53.perfmodel.measured.fit_measured; the kernel rows fit, the slice rows check).
# `python -m experiments.calibrate --measured results/gpu_speed/<date>` writes MEASURED_SPEC (the fitted
# fields and the run they come from) once a complete run is committed; until then there is no such spec.
MEASURED_SPEC = Path(__file__).with_name("measured.json")
MEASURED_PENDING = ("hardware 'h200_measured' waits for a device run: a complete `python -m experiments.bench_gpu "
                    "--slice` on an H200 committed under results/gpu_speed/<date>/, then `python -m "
                    "experiments.calibrate --measured results/gpu_speed/<date>`")


def _measured_spec(path: Path = MEASURED_SPEC) -> HardwareSpec | None:
    if not path.exists():
        return None
    # its one GEMM fit prices the routed experts too: the published grouped fit is dropped (measured.fit_measured)
    return dataclasses.replace(H200_CALIBRATED, name="H200 SXM (measured: this codebase's kernels)",
                               moe_gemm_efficiency=None, moe_gemm_memory_efficiency=None, moe_gemm_latency_s=None,
                               moe_gemm_exposed_fraction=None, **json.loads(path.read_text())["fields"])


H200_MEASURED = _measured_spec()

# the hardware specs configs name (experiments.serve's runner.hardware): "h200" is the calibrated one
HARDWARE = {"h200": H200_CALIBRATED, "h200_datasheet": H200,
            **({"h200_measured": H200_MEASURED} if H200_MEASURED is not None else {})}


def hardware_spec(name: str) -> HardwareSpec:
    """The spec `HARDWARE` names `name`; a clear error for an unknown name, and for "h200_measured" before a
    committed H200 run provides it (MEASURED_PENDING)."""
    if name in HARDWARE:
        return HARDWARE[name]
    if name == "h200_measured":
        raise ValueError(MEASURED_PENDING)
    raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class StorageSpec:
    """A storage medium behind the host tier (what a secondary tier writes to and reads from), one per
    replica: bytes per second each way and a fixed time per chunk (a chunk = one KV page of one cache
    group, 2.8-3.3 MB at GLM-5.3 scale). The simulator (glm53.engine.sim) turns it into the costs of a
    simulated tier (kvcache.tiers.sim.TierCosts): one chunk at a time per direction at full bandwidth,
    the fixed time overlapping other chunks' transfers."""

    name: str
    read_bandwidth: float  # B/s
    write_bandwidth: float  # B/s
    read_latency_s: float
    write_latency_s: float

    def __post_init__(self):
        if not (self.read_bandwidth > 0 and self.write_bandwidth > 0):
            raise ValueError(f"StorageSpec {self.name!r}: bandwidths must be > 0")
        if not (self.read_latency_s >= 0 and self.write_latency_s >= 0):
            raise ValueError(f"StorageSpec {self.name!r}: latencies must be >= 0")


# One local PCIe Gen4 data-centre NVMe SSD (the filesystem tier's medium in the tiered-offload scaling
# study; published.json "storage", docs/perfmodel_sources.md):
# - bandwidths: Micron 7450's datasheet figures as reported at launch (6.8 GB/s sequential read, 5.6 GB/s
#   write for the larger drives): *datasheet*, not measured; a measured fio run on a drive rated 6 GB/s
#   reads 2 MiB random chunks at 6.4 GB/s (16 threads), so chunk-sized reads reach the rating;
# - the fixed time per chunk (file open, rename, the NVMe command): *assumed* 0.2 ms; that fio run's
#   fastest 2 MiB read (566 us, less 326 us of transfer) bounds it at about 0.24 ms.
# One drive, not the 8-drive array of a DGX: the published study's tier is "a local NVMe" (BRIEF §7).
NVME_GEN4 = StorageSpec("one PCIe Gen4 NVMe SSD (Micron 7450 class)", read_bandwidth=6.8e9, write_bandwidth=5.6e9,
                        read_latency_s=0.2e-3, write_latency_s=0.2e-3)

# The P/D connector's medium (the peer tier, type "p2p", in the simulator): a decode rank reads a prefill
# engine's host memory over its own RDMA NIC, one 400 Gb/s ConnectX-7 per GPU as on HGX H200 systems.
# - bandwidth: 43 GB/s, DeepEP's measured internode RDMA bottleneck bandwidth at EP16 on H800 + CX7 400 Gb/s
#   IB (published.json "deepep_v1_legacy", "Internode | 16 | 43 GB/s (RDMA)"; the NIC's ~50 GB/s is the
#   ceiling): *measured* on another workload (all-to-all of 7 KB tokens; a KV page is 2.8-3.3 MB, so
#   large transfers reach at least this);
# - the fixed time per chunk: *assumed* 20 us (an RDMA read's round trip and the connector's bookkeeping).
RDMA_CX7 = StorageSpec("one 400 Gb/s RDMA NIC (ConnectX-7) per GPU", read_bandwidth=43e9, write_bandwidth=43e9,
                       read_latency_s=20e-6, write_latency_s=20e-6)

# the media the simulator gives each secondary tier type (configs name them by tier type)
STORAGE = {"fs": NVME_GEN4, "p2p": RDMA_CX7}
