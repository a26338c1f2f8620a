"""Calibration of per-op efficiencies against cited public measurements (`published.json`).

Each op family gets a small physical model whose few parameters are fitted on some rows of a published
table and checked on the others (never on an end-to-end serving figure). So far: FP8 GEMMs (DeepGEMM's
H800 table: dense, grouped-contiguous and grouped-masked shapes of DeepSeek-V3 inference), and the
routed experts' grouped GEMMs on that table's grouped rows alone (`calibrate_moe_gemm`).

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


def fit_roofline(measured, compute_work, compute_rate, memory_work, memory_rate, *, compute_effs, memory_effs,
                 latencies, launches=None, fixed_s=None) -> tuple[float, float, float, float]:
    """The one grid fit every calibration here uses: rows whose time is a sum of roofline parts,

        predicted[r] = sum_g max(compute_work[r, g] / (compute_rate[r, g] x c),
                                 memory_work[r, g] / (memory_rate[r, g] x m)) + launches[r] x t + fixed_s[r]

    (work in FLOPs or bytes with rates in FLOP/s or B/s, or seconds at unit efficiency with rate 1; a part
    of zero work adds nothing), and the (c, m, t) of the grid `compute_effs` x `memory_effs` x
    `latencies` with the least mean |log(predicted / measured)| over the rows. Deterministic, no optimiser
    to tune; among equal errors the first in that lexicographic order (the grids ascending: the smallest
    values). -> (c, m, t, that mean |log| error). Arrays are [R] or [R, G]; launches default 1 (one
    kernel's fixed time per row), fixed_s 0."""
    meas = np.asarray(measured, float)

    def parts(x):  # [R] or [R, G] (a scalar rate: every part's) -> [R, G]
        a = np.asarray(x, float)
        return a[:, None] if a.ndim == 1 else a

    cw, mw = parts(compute_work), parts(memory_work)
    cr, mr = np.broadcast_to(parts(compute_rate), cw.shape), np.broadcast_to(parts(memory_rate), mw.shape)
    n = np.ones_like(meas) if launches is None else np.asarray(launches, float)
    fixed = np.zeros_like(meas) if fixed_s is None else np.asarray(fixed_s, float)
    ce, me, lat = (np.asarray(x, float) for x in (compute_effs, memory_effs, latencies))
    best = (math.inf, 0, 0, 0)
    for i, c in enumerate(ce):  # one compute efficiency at a time keeps the [M, T, R] block small
        comp = cw / (cr * c)  # [R, G]
        pred = np.maximum(comp[None], mw[None] / (mr[None] * me[:, None, None])).sum(-1)  # [M, R]
        pred = pred[:, None, :] + lat[None, :, None] * n + fixed  # [M, T, R]
        err = np.abs(np.log(pred / meas)).mean(-1)
        j, k = np.unravel_index(int(np.argmin(err)), err.shape)
        if err[j, k] < best[0]:
            best = (float(err[j, k]), i, j, k)
    _, i, j, k = best
    return float(ce[i]), float(me[j]), float(lat[k]), best[0]


GEMM_EFFICIENCIES = np.arange(30, 101) / 100
GEMM_LAUNCHES_S = np.arange(0, 21) * 0.5e-6


def fit_gemm(rows: list[GemmRow]) -> GemmFit:
    """Least mean |log(predicted / measured)| over a grid (efficiencies in steps of 0.01, launch time in
    steps of 0.5 us; `fit_roofline`): deterministic, no optimiser to tune; ties go to the smallest values."""
    c, m, t, _ = fit_roofline([r.measured_s for r in rows], [r.flops for r in rows], H800_FP8_FLOPS,
                              [r.bytes for r in rows], H800_HBM_BYTES_PER_S, compute_effs=GEMM_EFFICIENCIES,
                              memory_effs=GEMM_EFFICIENCIES, latencies=GEMM_LAUNCHES_S)
    return GemmFit(c, m, t)


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


# ------------------------------------------------------------------------------- grouped (MoE) GEMMs
MOE_EXPOSED = np.arange(0, 11) / 10
# the held-out grouped rows: the middle group count of each layout (masked 2 x 512, contiguous 8 x 4,096), so
# the fit sees both shapes (n 4,096 / k 7,168 and n 7,168 / k 2,048) and both ends of the group counts
MOE_HOLDOUT = (("grouped_masked", 2), ("grouped_contiguous", 8))


@dataclasses.dataclass(frozen=True)
class GroupedGemmFit:
    compute_eff: float
    memory_eff: float
    launch_s: float
    exposed: float

    def time_s(self, row: GemmRow, flops_peak: float = H800_FP8_FLOPS, hbm: float = H800_HBM_BYTES_PER_S) -> float:
        c, m = row.flops / (flops_peak * self.compute_eff), row.bytes / (hbm * self.memory_eff)
        return max(c, m) + self.exposed * min(c, m) + self.launch_s


def fit_grouped_gemm(rows: list[GemmRow]) -> GroupedGemmFit:
    """`cost._grouped_gemm`'s four constants, least mean |log(predicted / measured)| over the grid
    (efficiencies in steps of 0.01, exposed fraction in steps of 0.1, fixed time in steps of 0.5 us); ties
    go to the first in (compute, memory, exposed, fixed time) order, the grids ascending."""
    meas = np.array([r.measured_s for r in rows])
    flops = np.array([r.flops for r in rows]) / H800_FP8_FLOPS
    byts = np.array([r.bytes for r in rows]) / H800_HBM_BYTES_PER_S
    ce, me, ex, lat = GEMM_EFFICIENCIES, GEMM_EFFICIENCIES, MOE_EXPOSED, GEMM_LAUNCHES_S
    best = (math.inf, 0, 0, 0, 0)
    for i, c in enumerate(ce):
        comp = flops / c  # [R]
        mem = byts[None, :] / me[:, None]  # [M, R]
        hi, lo = np.maximum(comp[None], mem), np.minimum(comp[None], mem)
        pred = hi[:, None, None, :] + ex[None, :, None, None] * lo[:, None, None, :] + lat[None, None, :, None]
        err = np.abs(np.log(pred / meas)).mean(-1)  # [M, X, T]
        j, k, t = np.unravel_index(int(np.argmin(err)), err.shape)
        if err[j, k, t] < best[0]:
            best = (float(err[j, k, t]), i, j, k, t)
    _, i, j, k, t = best
    return GroupedGemmFit(float(ce[i]), float(me[j]), float(lat[t]), float(ex[k]))


def calibrate_moe_gemm(published: dict | None = None) -> dict:
    """The routed experts' grouped GEMMs fitted on DeepGEMM's grouped rows (contiguous and masked: the
    masked ones are MoE decode, a few tokens per expert), the `MOE_HOLDOUT` rows held out; beside it, what
    the dense fit (`calibrate_gemm`, which priced the experts before) gives on every grouped row."""
    rows = [r for r in gemm_rows(published) if r.kind != "dense"]
    test = [r for r in rows if (r.kind, r.groups) in MOE_HOLDOUT]
    train = [r for r in rows if (r.kind, r.groups) not in MOE_HOLDOUT]
    fit = fit_grouped_gemm(train)
    dense = GemmFit(**calibrate_gemm(published)["fit"])

    def report(rs):
        return [{"kind": r.kind, "groups": r.groups, "m": r.m, "n": r.n, "k": r.k, "measured_us": r.measured_s * 1e6,
                 "predicted_us": fit.time_s(r) * 1e6, "rel_error": fit.time_s(r) / r.measured_s - 1,
                 "dense_fit_rel_error": dense.time_s(r) / r.measured_s - 1} for r in rs]

    held = report(test)
    return {"model": "max(C, M) + exposed x min(C, M) + launch_s; C = flops / (fp8_peak x compute_eff), "
                     "M = bytes / (hbm x memory_eff)",
            "hardware": "H800 SXM5 (DeepGEMM README at commit 327ec92)", "fit": dataclasses.asdict(fit),
            "holdout": [f"{k} groups={g}" for k, g in MOE_HOLDOUT], "train_rows": report(train), "holdout_rows": held,
            "holdout_mean_abs_rel_error": sum(abs(r["rel_error"]) for r in held) / len(held),
            "holdout_max_abs_rel_error": max(abs(r["rel_error"]) for r in held),
            "dense_fit_mean_abs_rel_error_all_grouped_rows": float(np.mean(
                [abs(dense.time_s(r) / r.measured_s - 1) for r in rows]))}


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


# ------------------------------------------------------------------------------- sparse MLA (FlashMLA)
def _h800(spec):
    """`spec` with the H800 SXM5's HBM (3.35 TB/s); SMs, tensor cores and clock are the H200's."""
    return dataclasses.replace(spec, name="H800 SXM5", hbm_bandwidth=H800_HBM_BYTES_PER_S)


def sparse_mla_rows(published: dict | None = None) -> list[dict]:
    """FlashMLA sparse-decode rows with a usable shape, each as a kernel call: (gpu, heads, requests, s_q,
    top-k, heads per dequantisation, measured seconds, role). FlashMLA's deep dive gives its configuration
    (batch 128, 128 heads, s_q 2, top-k 2048, H800) for the 410 TFLOPS kernel; its 250 TFLOPS row (previous
    kernel, no dequantisation sharing) and its top-k 32,768 row (460, 'up to') do not restate it and are
    taken at the same configuration. Measured time = useful FLOPs / TFLOPS, or the row's time."""
    out = []
    for r in (published or load_published())["sparse_mla"]:
        if r["phase"] != "decode" or r["dense_or_sparse"] != "sparse":
            continue
        note = r.get("note", "")
        if r["source"] == "flashmla_fp8_sparse_blog":
            old = "without crossover" in note
            topk = r["topk"] or 2048
            row = dict(source=r["source"], gpu="H800", heads=128, requests=128, s_q=2, topk=topk,
                       heads_per_dequant=64 if old else None, excerpt=r["excerpt"], tflops=r["tflops"],
                       shape_assumed=r["heads"] is None)
            row["kernel"] = ("previous kernel, no crossover (64 heads per dequantisation)" if old else
                             f"crossover kernel, top-k {topk}")
            row["role"] = "fit" if (not old and topk == 2048) else "held out"
        elif r["source"] == "pegainfer_pr624":
            row = dict(source=r["source"], gpu="H200", heads=r["heads"], requests=r["batch"], s_q=r["s_q"],
                       topk=r["topk"], heads_per_dequant=None, excerpt=r["excerpt"], tflops=None,
                       shape_assumed=bool(r.get("s_q_assumed")), kernel="GLM-5.2 TP decode, heads padded to 64",
                       role="fit", time_s=r["time_us"] * 1e-6)
        else:
            continue  # the README's peak claims without a shape
        out.append(row)
    return out


def _sparse_call(row: dict, spec) -> tuple:
    from glm53.config import get_preset

    cfg = get_preset("glm-5.3").replace(num_attention_heads=row["heads"])  # DeepSeek-V3.2 / GLM MLA dims
    hw = _h800(spec) if row["gpu"] == "H800" else spec
    q = row["requests"] * row["s_q"]
    return cfg, hw, q


def sparse_mla_time(row: dict, spec) -> tuple[float, float]:
    """(predicted seconds, useful FLOPs) of a published row's kernel call on `spec` (a FlashMLA-model spec)."""
    from glm53.perfmodel.ops import sparse_mla

    cfg, hw, q = _sparse_call(row, spec)
    c = sparse_mla(cfg, hw, q, row["topk"], row["heads"], kernel="decode", tokens_per_request=row["s_q"],
                   heads_per_dequant=row["heads_per_dequant"])
    return c.time_s, c.useful_flops


def _measured_s(row: dict, spec) -> float:
    if row.get("time_s"):
        return row["time_s"]
    _, useful = sparse_mla_time(row, spec)
    return useful / (row["tflops"] * 1e12)


def fit_sparse_decode(rows: list[dict], base=None) -> dict:
    """Solve the two fit rows exactly for (sparse_decode_efficiency, sparse_decode_latency_s): time = A / eff +
    latency, A = blocks per SM part x cycles per block / clock (the kernel model at efficiency 1, no latency).
    Rounded to 0.001 and 0.1 us."""
    from glm53.perfmodel.hardware import H200

    base = base or H200
    unit = dataclasses.replace(base, sparse_decode_efficiency=1.0, sparse_decode_latency_s=0.0)
    (a, b) = [r for r in rows if r["role"] == "fit"]
    ta, tb = _measured_s(a, unit), _measured_s(b, unit)
    aa, ab = sparse_mla_time(a, unit)[0], sparse_mla_time(b, unit)[0]
    eff = (aa - ab) / (ta - tb)
    lat = tb - ab / eff
    return {"sparse_decode_efficiency": round(eff, 3), "sparse_decode_latency_s": round(lat * 1e7) / 1e7,
            "unrounded": {"efficiency": eff, "latency_s": lat}}


def calibrate_sparse_mla(published: dict | None = None) -> dict:
    """The FlashMLA kernel model (glm53.perfmodel.ops.sparse_mla on a calibrated spec): its two constants
    fitted on two decode rows (H800 batch 128 x 128 heads; H200 batch 8 x 64 padded heads), checked on the
    other published decode rows; the bf16 prefill kernel's efficiency is FlashMLA's 640 TFLOPS claim."""
    from glm53.perfmodel.hardware import H200

    rows = sparse_mla_rows(published)
    fit = fit_sparse_decode(rows)
    spec = dataclasses.replace(H200, sparse_decode_efficiency=fit["sparse_decode_efficiency"],
                               sparse_decode_latency_s=fit["sparse_decode_latency_s"])

    def report(r):
        measured = _measured_s(r, spec)
        pred, useful = sparse_mla_time(r, spec)
        return {k: r[k] for k in ("source", "gpu", "kernel", "heads", "requests", "s_q", "topk", "shape_assumed")} | {
            "measured_us": measured * 1e6, "predicted_us": pred * 1e6, "measured_tflops": useful / measured / 1e12,
            "predicted_tflops": useful / pred / 1e12, "rel_error": pred / measured - 1}

    train = [report(r) for r in rows if r["role"] == "fit"]
    held = [report(r) for r in rows if r["role"] != "fit"]
    prefill = [r for r in (published or load_published())["sparse_mla"]
               if r["phase"] == "prefill" and r["dense_or_sparse"] == "sparse" and r.get("tflops")]
    return {"model": "fp8 decode kernel: ceil(units / parts) x (2176 MMA + 3200 / share dequant cycles) / (clock x "
                     "efficiency) + latency; units = requests x (top-k / 64 + 5), parts = 132 / (s_q x heads / 64) "
                     "(FlashMLA csrc/api/sparse_decode.h); share = 2 for a 128-head cluster",
            "fit": {k: fit[k] for k in ("sparse_decode_efficiency", "sparse_decode_latency_s")},
            "fit_unrounded": fit["unrounded"], "train_rows": train, "holdout_rows": held,
            "holdout_max_abs_rel_error": max(abs(r["rel_error"]) for r in held),
            "prefill_kernel": {"sparse_attention_efficiency": spec.sparse_attention_efficiency,
                               "source_rows": [{k: r[k] for k in ("source", "tflops", "excerpt")} for r in prefill],
                               "note": "FlashMLA's 'up to 640 TFlops' bf16 sparse prefill on H800 (a peak claim, "
                                       "shape not stated): the whole fit, nothing held out"}}


# ---------------------------------------------------------------------------------------------- indexer
def indexer_rows(published: dict | None = None) -> list[dict]:
    """DeepGEMM fp8_mqa_logits rows with their (query, key) pairs from the test's key windows
    (tests/test_attention.py at v2.1.1.post3: CP=0 gives query i the keys [0, SKV - S + i); CP=1 the
    balanced 2-chunk windows of rank cp_id = (SKV / S) // 3)."""
    out = []
    for r in (published or load_published())["indexer"]:
        if r.get("kernel") != "fp8_mqa_logits" or not r.get("time_us"):
            continue
        s, skv = r["seq_len"], r["seq_len_kv"]
        if r["cp"]:
            chunk, cp_size = s // 2, skv // s
            cp_id = cp_size // 3
            pairs = sum(cp_id * chunk + i for i in range(chunk)) + sum(
                (2 * cp_size - 1 - cp_id) * chunk + i for i in range(chunk))
        else:
            pairs = sum(skv - s + i for i in range(s))
        out.append({**{k: r[k] for k in ("source", "gpu", "gpu_inferred", "seq_len", "seq_len_kv", "heads",
                                          "head_dim", "cp", "tflops", "excerpt")},
                    "pairs": pairs, "measured_s": r["time_us"] * 1e-6})
    return out


def indexer_cost(row: dict, spec):
    """The `indexer_scores` Cost of a published row's kernel call on `spec`."""
    from glm53.config import get_preset
    from glm53.perfmodel.ops import indexer_scores

    cfg = get_preset("glm-5.3").replace(index_n_heads=row["heads"], index_head_dim=row["head_dim"])
    q = row["seq_len"]
    return indexer_scores(cfg, spec, q, row["pairs"] / q, keys_read=row["seq_len_kv"])


def indexer_time(row: dict, spec) -> float:
    return indexer_cost(row, spec).time_s


INDEXER_EFFICIENCIES = np.arange(30, 101) / 100
INDEXER_LATENCIES_S = np.arange(0, 41) * 0.5e-6


def fit_indexer(rows: list[dict], base=None) -> dict:
    """Least mean |log(predicted / measured)| over a grid (efficiency in steps of 0.01, fixed time in steps of
    0.5 us; `fit_roofline` on each row's `indexer_scores` FLOPs at the fp8 peak and HBM bytes at the spec's
    HBM rate), like the GEMM fit; ties go to the smallest values."""
    from glm53.perfmodel.hardware import H200

    base = base or H200
    costs = [indexer_cost(r, base) for r in rows]
    e, _, lat, _ = fit_roofline([r["measured_s"] for r in rows], [c.flops for c in costs], base.fp8_flops,
                                [c.hbm_bytes for c in costs], base.hbm_bandwidth, compute_effs=INDEXER_EFFICIENCIES,
                                memory_effs=[base.hbm_efficiency], latencies=INDEXER_LATENCIES_S)
    return {"indexer_efficiency": e, "indexer_latency_s": lat}


def calibrate_indexer(published: dict | None = None) -> dict:
    """Fit on the CP=1 rows (the table's even rows), check on the CP=0 rows."""
    from glm53.perfmodel.hardware import H200

    rows = indexer_rows(published)
    train, test = rows[0::2], rows[1::2]
    fit = fit_indexer(train)
    spec = dataclasses.replace(H200, **fit)

    def report(rs):
        return [{k: r[k] for k in ("source", "seq_len", "seq_len_kv", "heads", "head_dim", "cp", "pairs")}
                | {"measured_us": r["measured_s"] * 1e6, "predicted_us": indexer_time(r, spec) * 1e6,
                   "rel_error": indexer_time(r, spec) / r["measured_s"] - 1} for r in rs]

    held = report(test)
    return {"model": "indexer_scores: max(q x keys x (2 H D + 2 H) / (fp8 peak x efficiency), HBM bytes / (4.8 TB/s x "
                     "0.9)) + fixed time",
            "hardware": "H200 (inferred; docs/perfmodel_sources.md)", "fit": fit, "train_rows": report(train),
            "holdout_rows": held, "holdout_mean_abs_rel_error": sum(abs(r["rel_error"]) for r in held) / len(held),
            "holdout_max_abs_rel_error": max(abs(r["rel_error"]) for r in held),
            "topk": "no public Hopper timing of the DSA top-k kernels found: memory bound at hbm_efficiency (assumed)"}


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
    mla = calibrate_sparse_mla(published)["fit"]
    idx = calibrate_indexer(published)["fit"]
    moe = calibrate_moe_gemm(published)["fit"]
    return {"moe_gemm_efficiency": moe["compute_eff"], "moe_gemm_memory_efficiency": moe["memory_eff"],
            "moe_gemm_latency_s": moe["launch_s"], "moe_gemm_exposed_fraction": moe["exposed"],"gemm_efficiency": g["compute_eff"], "gemm_memory_efficiency": g["memory_eff"],
            "gemm_latency_s": g["launch_s"], "all_to_all_efficiency": fams["all_to_all"]["efficiency"],
            "nvlink_efficiency": fams["all_gather"]["efficiency"],
            "all_reduce_efficiency": fams["all_reduce"]["efficiency"], **mla, **idx}
