"""Calibration of per-op efficiencies against cited public measurements (`published.json`).

Each op family gets a small physical model whose few parameters are fitted on some rows of a published
table and checked on the others (never on an end-to-end serving figure). So far: FP8 GEMMs (DeepGEMM's
H800 table: dense, grouped-contiguous and grouped-masked shapes of DeepSeek-V3 inference).

Every comparison reports rel_error = predicted time / measured time - 1 (for a bandwidth or FLOP rate:
measured rate / predicted rate - 1). `calibrated_fields()` collects the fitted values that
`hardware.H200_CALIBRATED` holds. Collectives: link efficiency per family from intranode NVLink4 bus
bandwidths. Checks without a fit: FlashMLA's sparse decode rows, published host-link bandwidths.

GEMM model, for `groups` GEMMs of [m, k] x [k, n] with fp8 operands and bf16 output:
    time = max(flops / (fp8_peak x compute_eff), bytes / (hbm_bandwidth x memory_eff)) + launch_s
    flops = 2 groups m n k,  bytes = groups (n k + m k + 2 m n)
(the block scales add < 1% and are left out). Measured times are the table's FLOPs over its TFLOPS.
Efficiencies are fractions of the datasheet peak, so they carry over to an H200 (same SMs and tensor
cores as an H800 / H100, more HBM bandwidth); `launch_s` is per kernel.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

PUBLISHED = Path(__file__).with_name("published.json")
H800_FP8_FLOPS = 1979e12  # dense FP8 tensor-core peak (H800 SXM5 = H100 SXM compute)
H800_HBM_BYTES_PER_S = 3.35e12  # HBM3 (the H200 has 4.8e12)


def load_published(path: Path | str = PUBLISHED) -> dict:
    return json.loads(Path(path).read_text())


@dataclasses.dataclass(frozen=True)
class GemmRow:
    kind: str
    groups: int
    m: int
    n: int
    k: int
    measured_s: float
    excerpt: str

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k

    @property
    def bytes(self) -> float:
        return self.groups * (self.n * self.k + self.m * self.k + 2 * self.m * self.n)


def gemm_rows(published: dict | None = None) -> list[GemmRow]:
    """The FP8 GEMM rows of the published table, each with its measured time (s)."""
    out = []
    for r in (published or load_published())["gemm"]:
        if r["dtype"] != "fp8" or not r.get("tflops"):
            continue
        g = r["groups"] or 1
        row = GemmRow(r["kind"], g, r["m"], r["n"], r["k"], 0.0, r["excerpt"])
        out.append(dataclasses.replace(row, measured_s=row.flops / (r["tflops"] * 1e12)))
    return out


@dataclasses.dataclass(frozen=True)
class GemmFit:
    compute_eff: float
    memory_eff: float
    launch_s: float

    def time_s(self, row: GemmRow, flops_peak: float = H800_FP8_FLOPS, hbm: float = H800_HBM_BYTES_PER_S) -> float:
        return max(row.flops / (flops_peak * self.compute_eff), row.bytes / (hbm * self.memory_eff)) + self.launch_s


def _log_err(fit: GemmFit, rows) -> float:
    return sum(abs(math.log(fit.time_s(r) / r.measured_s)) for r in rows) / len(rows)


def fit_gemm(rows: list[GemmRow]) -> GemmFit:
    """Least mean |log(predicted / measured)| over a grid (efficiencies in steps of 0.01, launch time in
    steps of 0.5 us): deterministic, no optimiser to tune; ties go to the smallest values."""
    effs = np.arange(30, 101) / 100
    launches = np.arange(0, 21) * 0.5e-6
    flops = np.array([r.flops for r in rows])
    nbytes = np.array([r.bytes for r in rows])
    measured = np.array([r.measured_s for r in rows])
    c, m, t = np.meshgrid(effs, effs, launches, indexing="ij")  # [C, M, T], lexicographic order
    pred = (np.maximum(flops / (H800_FP8_FLOPS * c[..., None]), nbytes / (H800_HBM_BYTES_PER_S * m[..., None]))
            + t[..., None])
    err = np.abs(np.log(pred / measured)).mean(-1)
    i, j, k = np.unravel_index(int(np.argmin(err)), err.shape)  # the first minimum in (c, m, t) order
    return GemmFit(float(effs[i]), float(effs[j]), float(launches[k]))


def calibrate_gemm(published: dict | None = None) -> dict:
    """Fit on the even rows of the table (in its order), report the error on the odd ones."""
    rows = gemm_rows(published)
    train, test = rows[0::2], rows[1::2]
    fit = fit_gemm(train)

    def report(rs):
        return [{"kind": r.kind, "groups": r.groups, "m": r.m, "n": r.n, "k": r.k, "measured_us": r.measured_s * 1e6,
                 "predicted_us": fit.time_s(r) * 1e6, "rel_error": fit.time_s(r) / r.measured_s - 1} for r in rs]

    held = report(test)
    return {"model": "max(flops / (fp8_peak x compute_eff), bytes / (hbm x memory_eff)) + launch_s",
            "hardware": "H800 SXM5 (DeepGEMM README at commit 327ec92)",
            "fit": dataclasses.asdict(fit), "train_rows": report(train), "holdout_rows": held,
            "holdout_mean_abs_rel_error": sum(abs(r["rel_error"]) for r in held) / len(held),
            "holdout_max_abs_rel_error": max(abs(r["rel_error"]) for r in held)}


# ------------------------------------------------------------------------------------------ collectives
NVLINK4_ONE_WAY = 450e9  # B/s per GPU per direction on an NVLink4 / NVSwitch node (H100, H200, H20)
_COLLECTIVE_FAMILY = {"ep_dispatch": "all_to_all", "ep_combine": "all_to_all", "all_gather": "all_gather",
                      "all_reduce": "all_reduce"}


def collective_rows(published: dict | None = None) -> list[dict]:
    """Intranode rows on full-bandwidth NVLink4 / NVSwitch nodes of 8 GPUs (H800's reduced NVLink and the
    RDMA rows are left out: another interconnect), each with its bus bandwidth (B/s) and model family.
    A row that reports only algbw is converted with nccl-tests' factor for its op (all-reduce 2(n-1)/n)."""
    out = []
    for r in (published or load_published())["collectives"]:
        fam = _COLLECTIVE_FAMILY.get(r["op"])
        if fam is None or r["ranks"] != 8 or not r["interconnect"].startswith("NVLink4/NVSwitch"):
            continue
        n = r["ranks"]
        bus = r["busbw_gbps"]
        if bus is None and r.get("algbw_gbps") and fam == "all_reduce":
            bus = r["algbw_gbps"] * 2 * (n - 1) / n
        if bus:
            out.append({"source": r["source"], "op": r["op"], "family": fam, "interconnect": r["interconnect"],
                        "busbw_gbps": bus, "measured": r.get("measured", True), "excerpt": r["excerpt"]})
    return out


def calibrate_collectives(published: dict | None = None) -> dict:
    """Per family, link efficiency = median bus bandwidth of its even rows / 450 GB/s (rounded to 0.01,
    capped at 1: the model's link bound), checked on its odd rows (time error = measured bandwidth /
    predicted - 1, since the model's link bytes follow nccl-tests' bus-bandwidth convention)."""
    rows = collective_rows(published)
    fams = {}
    for fam in dict.fromkeys(r["family"] for r in rows):
        rs = [r for r in rows if r["family"] == fam]
        train, test = rs[0::2], rs[1::2]
        raw = float(np.median([r["busbw_gbps"] for r in train])) * 1e9 / NVLINK4_ONE_WAY
        eff = min(1.0, round(raw, 2))
        pred = eff * NVLINK4_ONE_WAY / 1e9
        held = [{**{k: r[k] for k in ("source", "op", "busbw_gbps", "measured")}, "predicted_busbw_gbps": pred,
                 "rel_error": r["busbw_gbps"] / pred - 1} for r in test]
        fams[fam] = {"efficiency": eff, "efficiency_uncapped": raw, "train_rows": [
            {k: r[k] for k in ("source", "op", "busbw_gbps", "measured")} for r in train], "holdout_rows": held,
            "holdout_max_abs_rel_error": max((abs(h["rel_error"]) for h in held), default=None)}
    return {"model": "link time = bus bytes / (450 GB/s x efficiency) + latency (latency not calibrated)",
            "families": fams}


# ------------------------------------------------------------------------------------ checks, no fit
def check_sparse_mla(published: dict | None = None) -> dict:
    """FlashMLA's sparse decode rows against the model (not fitted: sparse_attention_efficiency is the
    sparse *prefill* kernel's 640 TFLOPS and the dequantisation cost is FlashMLA's published cycle
    arithmetic; the decode rows are held out). Shapes: DeepSeek-V3.2's 128 heads, batch 128 x s_q 2,
    top-k 2048, fp8 rows, on H800 (3.35 TB/s). A row without its configuration is skipped."""
    from glm53.config import get_preset
    from glm53.perfmodel.hardware import H200
    from glm53.perfmodel.ops import sparse_mla

    pub = published or load_published()
    h800 = dataclasses.replace(H200, name="H800 SXM5", hbm_bandwidth=H800_HBM_BYTES_PER_S)
    cfg = get_preset("glm-5.3").replace(num_attention_heads=128)  # same MLA dims as DeepSeek-V3.2
    out = []
    for r in pub["sparse_mla"]:
        if r["phase"] != "decode" or r["dense_or_sparse"] != "sparse" or not r.get("tflops"):
            continue
        crossover = "without crossover" not in r.get("note", "")
        if r.get("heads") is None and crossover:
            continue  # a peak claim without its shapes
        c = sparse_mla(cfg, h800, 128 * 2, 2048, 128, heads_per_dequant=128 if crossover else 64)
        pred = c.useful_flops / c.time_s / 1e12
        out.append({"source": r["source"], "kernel": "crossover (128 heads per dequant)" if crossover else
                    "no crossover (64 heads per dequant)", "measured_tflops": r["tflops"], "predicted_tflops": pred,
                    "rel_error": r["tflops"] / pred - 1, "excerpt": r["excerpt"]})
    return {"model": "glm53.perfmodel.sparse_mla: MMA at 640/989 of bf16 peak + fp8 dequantisation (added)",
            "train": "FlashMLA sparse prefill 640 TFLOPS (bf16 KV) -> sparse_attention_efficiency",
            "holdout_rows": out, "holdout_max_abs_rel_error": max(abs(r["rel_error"]) for r in out)}


def check_host_copy(published: dict | None = None, link_bytes_per_s: float = 50e9) -> dict:
    """Published host <-> device bandwidths against the model's host link (50 GB/s one way, itself vLLM's
    measured figure). The model runs a step's loads and stores one after the other (as the runners
    do), so a concurrent read + write row is compared with 50 GB/s in total: the model leaves the
    duplex overlap on the table."""
    out = []
    for r in (published or load_published())["host_copy"]:
        model = link_bytes_per_s / 1e9
        out.append({"source": r["source"], "direction": r["direction"], "method": r["method"],
                    "measured_gbps": r["gbps"], "model_gbps": model, "rel_error": r["gbps"] / model - 1})
    return {"model": "time = bytes / (50 GB/s) + 10 us per call", "rows": out,
            "max_abs_rel_error": max(abs(r["rel_error"]) for r in out)}


def calibrated_fields(published: dict | None = None) -> dict:
    """The HardwareSpec fields the fits give (what `hardware.H200_CALIBRATED` must hold)."""
    g = calibrate_gemm(published)["fit"]
    fams = calibrate_collectives(published)["families"]
    return {"gemm_efficiency": g["compute_eff"], "gemm_memory_efficiency": g["memory_eff"],
            "gemm_latency_s": g["launch_s"], "all_to_all_efficiency": fams["all_to_all"]["efficiency"],
            "nvlink_efficiency": fams["all_gather"]["efficiency"],
            "all_reduce_efficiency": fams["all_reduce"]["efficiency"]}
