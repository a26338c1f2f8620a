"""This codebase's own GPU path, measured: the performance model's price of each row `experiments.bench_gpu`
times on an H200, and the fit of the `h200_measured` spec on those rows.

The rows (`results/gpu_speed/<date>/results.json`; `op` and its `shape` keys are a contract):

- `sparse_mla_decode` {batch, heads, context, topk, kv_format}: one query per request at position
  `context`, over min(topk, context + 1) selected rows; priced as `step_cost` prices decode rows (the fp8
  decode kernel, heads padded to the kernel's granularity).
- `sparse_mla_prefill` {chunk, heads, context, topk}: `chunk` queries after `context` cached tokens, each
  over min(topk, its visible positions) rows, fp8_ds_mla rows; priced on the kernel `step_cost` picks for
  prefill rows (`step.sparse_prefill_kernel`; 64 heads: vLLM's up-convert plus the bf16 prefill kernel).
- `indexer_decode` {batch, keys, index_heads, topk, key_format}: one query per request scoring `keys`
  keys, then the top-k; `indexer_prefill` {chunk, keys, index_heads, topk, key_format}: a chunk that is
  the last `chunk` of `keys` positions (causal: a query scores the keys up to its own).
- `moe` {tokens, experts_local, topk}: the routed experts of one rank holding `experts_local` of the
  model's experts (EP = n_routed_experts / experts_local) for `tokens` tokens routed over all of them,
  balanced; `ops.moe_routed_gemms`.
- `linear` {tokens, in, out, name}: one fp8 block-quantised linear layer (`name`: the model's module).
- `hisparse_resolve` {rows, topk, hot_rows}: not priced (the model has no cost for the resolver: the
  simulator takes HiSparse's misses as a given fraction), so its rows carry no price or ratio.

`fit_measured` fits, on the kernel rows, the spec fields the kernels' models read (`FAMILIES`) by the
same grid fit as the published-table calibration (`calibration.fit_roofline`), and validates the result
on the held-out slice rows: `step_cost` of the same plans on the fitted spec against the measured steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from glm53.config import ModelConfig
from glm53.perfmodel.calibration import fit_roofline
from glm53.perfmodel.cost import Cost, _kernel, total
from glm53.perfmodel.hardware import FP8_WEIGHT_BYTES, FP32, INDEX_BYTES, HardwareSpec
from glm53.perfmodel.ops import _matmuls, indexer_scores, moe_routed_gemms, sparse_mla, sparse_mla_upconvert
from glm53.perfmodel.step import StepLayout, _mean_rows, sparse_prefill_kernel, step_cost

OPS = ("sparse_mla_decode", "sparse_mla_prefill", "indexer_decode", "indexer_prefill", "moe", "linear",
       "hisparse_resolve")
SHAPE_KEYS = {"sparse_mla_decode": ("batch", "heads", "context", "topk", "kv_format"),
              "sparse_mla_prefill": ("chunk", "heads", "context", "topk"),
              "indexer_decode": ("batch", "keys", "index_heads", "topk", "key_format"),
              "indexer_prefill": ("chunk", "keys", "index_heads", "topk", "key_format"),
              "moe": ("tokens", "experts_local", "topk"), "linear": ("tokens", "in", "out", "name"),
              "hisparse_resolve": ("rows", "topk", "hot_rows")}
# the tensor-core rate each op runs at in the serving stack the model prices (bf16 MMA for sparse MLA, fp8
# MMA for the indexer's logits and the fp8 GEMMs); the resolver does no matrix work
PEAK_DTYPE = {"sparse_mla_decode": "bf16", "sparse_mla_prefill": "bf16", "indexer_decode": "fp8",
              "indexer_prefill": "fp8", "moe": "fp8", "linear": "fp8", "hisparse_resolve": None}


def _check(op: str, shape: dict) -> None:
    if op not in SHAPE_KEYS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    missing = [k for k in SHAPE_KEYS[op] if k not in shape]
    if missing:
        raise ValueError(f"{op} shape lacks {missing} (keys: {SHAPE_KEYS[op]})")


def kernel_parts(cfg: ModelConfig, hw: HardwareSpec, op: str, shape: dict) -> tuple[Cost, ...]:
    """The Costs the performance model prices for one bench row on `hw` (one GPU), in order; () for an op
    it does not price. `cfg` gives the model's widths (kv_lora_rank, rope, hidden, expert widths); the
    shape gives the rest."""
    _check(op, shape)
    s = shape
    if op == "sparse_mla_decode":
        return (sparse_mla(cfg, hw, s["batch"], min(s["topk"], s["context"] + 1), s["heads"],
                           mla_format=s["kv_format"], pad_heads=True, name="sparse_mla_decode"),)
    if op == "sparse_mla_prefill":
        kernel = sparse_prefill_kernel("fp8_ds_mla", s["heads"])
        rows = _mean_rows(s["topk"], s["context"] + 1, s["chunk"])
        parts = []
        if hw.flashmla_kernels and kernel == "prefill":
            parts.append(sparse_mla_upconvert(cfg, hw, s["context"] + s["chunk"]))
        parts.append(sparse_mla(cfg, hw, s["chunk"], rows, s["heads"], kernel=kernel, name="sparse_mla_prefill"))
        return tuple(parts)
    if op in ("indexer_decode", "indexer_prefill"):
        icfg = cfg.replace(index_n_heads=s["index_heads"], index_topk=s["topk"])
        if op == "indexer_decode":
            q, per_query, read = s["batch"], s["keys"], s["batch"] * s["keys"]
        else:  # the chunk's queries see the cached keys and the chunk's causal part
            q, read = s["chunk"], s["keys"]
            per_query = s["keys"] - s["chunk"] + (s["chunk"] + 1) / 2
        scores = indexer_scores(icfg, hw, q, per_query, keys_read=read, index_format=s["key_format"])
        topk = _kernel("indexer_topk", hw, flops=0.0,
                       hbm_bytes=q * per_query * FP32 + q * min(s["topk"], per_query) * INDEX_BYTES)
        return scores, topk
    if op == "moe":
        ep = cfg.n_routed_experts // s["experts_local"]
        if ep * s["experts_local"] != cfg.n_routed_experts:
            raise ValueError(f"moe shape: experts_local={s['experts_local']} must divide the model's "
                             f"{cfg.n_routed_experts} experts")
        mcfg = cfg.replace(num_experts_per_tok=s["topk"])
        return moe_routed_gemms(mcfg, hw, s["tokens"] / ep, ep)
    if op == "linear":
        return (_matmuls("linear", hw, s["tokens"], [(s["in"], s["out"], FP8_WEIGHT_BYTES, 1)]),)
    return ()


def kernel_cost(cfg: ModelConfig, hw: HardwareSpec, op: str, shape: dict) -> Cost | None:
    """The priced Cost of one bench row (`kernel_parts` summed), or None for an op the model does not price."""
    parts = kernel_parts(cfg, hw, op, shape)
    return total(parts, op) if parts else None


def resolver_bytes(rows: int, topk: int, hot_rows: int, pages: int) -> int:
    """HBM bytes the HiSparse resolver must at least move for `rows` requests: the selections [rows, K],
    both page tables [rows, M] and the hot buffer's three [rows, H] arrays in, the plan's three [rows, K]
    arrays, its counts and the hot buffer's two updated arrays out (int32 each)."""
    return 4 * rows * (topk + 2 * pages + 3 * hot_rows + 3 * topk + 4 + 2 * hot_rows)


def rates(op: str, hw: HardwareSpec, measured_s: float, useful_flops: float, hbm_bytes: float) -> dict:
    """A row's achieved rates: tflops (useful FLOPs / s / 1e12), gbps (HBM bytes / s / 1e9), peak_tflops
    (the op's tensor-core peak, `PEAK_DTYPE`; None without matrix work) and peak_fraction = max(tflops /
    peak_tflops, gbps / HBM peak in GB/s)."""
    tflops = useful_flops / measured_s / 1e12
    gbps = hbm_bytes / measured_s / 1e9
    dtype = PEAK_DTYPE[op]
    peak = hw.peak_flops(dtype) / 1e12 if dtype else None
    frac = max(tflops / peak if peak else 0.0, gbps / (hw.hbm_bandwidth / 1e9))
    return {"tflops": tflops, "gbps": gbps, "peak_tflops": peak, "peak_fraction": frac}


# ------------------------------------------------------------------------------------------------ the slice
SLICE_LAYERS = 4


def slice_config(cfg: ModelConfig, layers: int = SLICE_LAYERS) -> ModelConfig:
    """`cfg` cut to its first `layers` decoder layers (their own indexer and MLP kinds; GLM-5.3's first four:
    three dense layers with their own indexers, then an MoE layer that shares layer 2's top-k), no MTP layer;
    embeddings and LM head kept."""
    return cfg.replace(num_hidden_layers=layers, indexer_types=cfg.indexer_types[:layers],
                       mlp_layer_types=cfg.mlp_layer_types[:layers], num_nextn_predict_layers=0)


@dataclasses.dataclass(frozen=True)
class SliceRow:
    """What `step_cost` reads of a plan row (a glm53.engine.plan.PlanRow has the same fields)."""

    start: int
    num_tokens: int
    num_draft_tokens: int = 0
    sample: bool = True


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    rows: tuple[SliceRow, ...]


def slice_plan(kind: str, batch: int, context: int, chunk: int) -> SlicePlan:
    """The rows of one slice step: `batch` decode rows of one token at position `context` ("decode"), or
    `batch` prefill chunks of `chunk` tokens after `context` cached ones ("prefill"); every row samples."""
    if kind not in ("decode", "prefill"):
        raise ValueError(f"slice row kind must be 'decode' or 'prefill', got {kind!r}")
    n = 1 if kind == "decode" else chunk
    return SlicePlan(tuple(SliceRow(context, n) for _ in range(batch)))


def slice_cost(cfg: ModelConfig, hw: HardwareSpec, plan, dep: StepLayout | None = None) -> float:
    """Seconds `step_cost` prices for one step of `plan` (a StepPlan, or `slice_plan`'s) on the sliced model
    `cfg` (`slice_config`) on one GPU: fp8_ds_mla rows, fp8 keys and weights (the default StepLayout)."""
    return step_cost(cfg, hw, dep or StepLayout(), plan).time_s()


# -------------------------------------------------------------------------------------------------- the fit
# Per family: the ops whose rows fit it, the Cost parts whose time depends on the fitted fields, and the
# fields: the compute efficiency, the memory efficiency (None: the spec's hbm_efficiency, not fitted) and
# the fixed time per part (None: the model has none).
FAMILIES = {
    "sparse_mla_decode": dict(ops=("sparse_mla_decode",), parts=("sparse_mla_decode",),
                              compute="sparse_decode_efficiency", memory=None, latency="sparse_decode_latency_s"),
    "sparse_mla_prefill": dict(ops=("sparse_mla_prefill",), parts=("sparse_mla_prefill",),
                               compute="sparse_attention_efficiency", memory=None, latency=None),
    "indexer": dict(ops=("indexer_decode", "indexer_prefill"), parts=("indexer_scores",),
                    compute="indexer_efficiency", memory=None, latency="indexer_latency_s"),
    "gemm": dict(ops=("linear", "moe"), parts=("linear", "moe_experts"), compute="gemm_efficiency",
                 memory="gemm_memory_efficiency", latency="gemm_latency_s"),
}
# Grids of the measured fits: efficiencies from 0.1% to 100% of the model's ideal in steps of about 3%
# (this codebase's kernels may run far below the published ones), fixed times in 0.5 us steps up to
# 0.5 ms for the attention kernels (launch, split merge) and 1 us steps up to 0.1 ms for the GEMMs.
MEASURED_EFFICIENCIES = np.unique([float(f"{x:.3g}") for x in np.geomspace(1e-3, 1.0, 241)])
MEASURED_LATENCIES_S = np.arange(0, 1001) * 0.5e-6
MEASURED_GEMM_LATENCIES_S = np.arange(0, 101) * 1e-6


def fit_rows(results: dict) -> list[dict]:
    """The kernel rows of a bench run that a fit may use: timed (no error, not skipped), priced, and the
    default tile sizes where several candidates were timed."""
    return [r for r in results.get("kernels", [])
            if r.get("measured_s") and r.get("priced_s") and not r.get("error") and not r.get("skipped")
            and r.get("default", True) and r["op"] != "hisparse_resolve"]


# the "gemm" family's fields price the routed experts too (its ops include "moe"): a measured spec drops the
# published grouped-GEMM fit (HardwareSpec.moe_gemm_*) so that one fit covers both
_NO_GROUPED_FIT = dict(moe_gemm_efficiency=None, moe_gemm_memory_efficiency=None, moe_gemm_latency_s=None,
                       moe_gemm_exposed_fraction=None)


def _unit_spec(base: HardwareSpec) -> HardwareSpec:
    """`base` with every fitted efficiency at 1 and every fitted fixed time at 0."""
    fields = dict(_NO_GROUPED_FIT)
    for fam in FAMILIES.values():
        fields[fam["compute"]] = 1.0
        if fam["memory"]:
            fields[fam["memory"]] = 1.0
        if fam["latency"]:
            fields[fam["latency"]] = 0.0
    return dataclasses.replace(base, **fields)


def fit_family(cfg: ModelConfig, rows: list[dict], family: str, base: HardwareSpec) -> dict:
    """Fit one family's fields on its rows (`calibration.fit_roofline`): each row's fitted parts as compute
    and memory seconds at unit efficiency, its other parts as fixed seconds on `base`."""
    fam = FAMILIES[family]
    unit = _unit_spec(base)
    comp, mem, launches, fixed, meas = [], [], [], [], []
    for r in rows:
        parts_unit = kernel_parts(cfg, unit, r["op"], r["shape"])
        parts_base = kernel_parts(cfg, base, r["op"], r["shape"])
        fitted = [p for p in parts_unit if p.name in fam["parts"]]
        comp.append([p.compute_s for p in fitted])
        mem.append([p.memory_s for p in fitted])
        launches.append(len(fitted))
        fixed.append(sum(p.time_s for p in parts_base if p.name not in fam["parts"]))
        meas.append(r["measured_s"])
    g = max(len(c) for c in comp)

    def pad(xs):  # rows of fewer parts: a part of zero work adds nothing
        return [x + [0.0] * (g - len(x)) for x in xs]

    lat_grid = ([0.0] if fam["latency"] is None else
                MEASURED_GEMM_LATENCIES_S if family == "gemm" else MEASURED_LATENCIES_S)
    c, m, t, err = fit_roofline(meas, pad(comp), 1.0, pad(mem), 1.0, compute_effs=MEASURED_EFFICIENCIES,
                                memory_effs=MEASURED_EFFICIENCIES if fam["memory"] else [1.0],
                                latencies=lat_grid, launches=launches, fixed_s=fixed)
    fields = {fam["compute"]: c}
    if fam["memory"]:
        fields[fam["memory"]] = m
    if fam["latency"]:
        fields[fam["latency"]] = t
    return {"fields": fields, "rows": len(rows), "mean_abs_log_error": err}


def fit_measured(results: dict, cfg: ModelConfig, base: HardwareSpec) -> dict:
    """Fit `h200_measured` on a bench run's kernel rows (`fit_rows`) and check it on the held-out slice rows.

    -> {"fields": the fitted HardwareSpec fields, "families": per family its fields, rows and fit error (or
    "not fitted: no rows", keeping `base`'s values), "kernel_rows": every fitted row's measured and
    predicted seconds, "validation": the slice rows' measured seconds, the price on the fitted spec and on
    `base`, and their rel_error = predicted / measured - 1 (with mean and max |rel_error|)}. `cfg`: the
    preset the run measured (the slice is `slice_config(cfg)`)."""
    rows = fit_rows(results)
    fields, families = {}, {}
    for name, fam in FAMILIES.items():
        mine = [r for r in rows if r["op"] in fam["ops"]]
        if not mine:
            families[name] = {"status": "not fitted: no rows"}
            continue
        fit = fit_family(cfg, mine, name, base)
        families[name] = {"status": "fitted", **fit}
        fields.update(fit["fields"])
    spec = dataclasses.replace(base, name="H200 SXM (measured: this codebase's kernels)", **_NO_GROUPED_FIT, **fields)
    kernel_rows = []
    for r in rows:
        pred = kernel_cost(cfg, spec, r["op"], r["shape"]).time_s
        kernel_rows.append({"op": r["op"], "shape": r["shape"], "measured_s": r["measured_s"], "predicted_s": pred,
                            "rel_error": pred / r["measured_s"] - 1})
    sliced = slice_config(cfg)
    val = []
    for r in results.get("slice", {}).get("rows", []):
        if not r.get("measured_s") or r.get("error") or r.get("skipped"):
            continue
        plan = slice_plan(r["kind"], r["batch"], r["context"], r["chunk"])
        pred, before = slice_cost(sliced, spec, plan), slice_cost(sliced, base, plan)
        val.append({k: r[k] for k in ("kind", "batch", "context", "chunk", "measured_s")}
                   | {"predicted_s": pred, "rel_error": pred / r["measured_s"] - 1, "base_predicted_s": before,
                      "base_rel_error": before / r["measured_s"] - 1})
    errs = [abs(v["rel_error"]) for v in val]
    return {"fields": fields, "families": families, "kernel_rows": kernel_rows,
            "validation": {"rows": val, "mean_abs_rel_error": sum(errs) / len(errs) if errs else None,
                           "max_abs_rel_error": max(errs) if errs else None},
            "spec": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}}
