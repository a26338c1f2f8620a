"""Calibration of per-op efficiencies against cited public measurements (`published.json`).

Each op family gets a small physical model whose few parameters are fitted on some rows of a published
table and checked on the others (never on an end-to-end serving figure). So far: FP8 GEMMs (DeepGEMM's
H800 table: dense, grouped-contiguous and grouped-masked shapes of DeepSeek-V3 inference).

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
