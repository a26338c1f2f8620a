"""glm53.perfmodel.measured: the fit of h200_measured on this codebase's kernel rows, checked on rows the
model itself generates from a known spec (no H200 run exists yet): the fit recovers that spec, reports
the held-out slice rows' error, ignores candidate and failed rows, and keeps the base where a family has
no rows. Also: h200_measured exists only once a committed run registered it."""

import dataclasses
import json

import pytest

from glm53.config import get_preset
from glm53.perfmodel import HARDWARE, H200_CALIBRATED, hardware_spec
from glm53.perfmodel import hardware as hw_mod
from glm53.perfmodel import measured as M

CFG = get_preset("glm-5.3")
E, L, LG = M.MEASURED_EFFICIENCIES, M.MEASURED_LATENCIES_S, M.MEASURED_GEMM_LATENCIES_S
# a spec far from the published one, on the fit's grids: what an H200 might say of these kernels
TRUE = dict(sparse_decode_efficiency=float(E[60]), sparse_decode_latency_s=float(L[61]),
            sparse_attention_efficiency=float(E[90]), indexer_efficiency=float(E[40]),
            indexer_latency_s=float(L[17]), gemm_efficiency=float(E[150]), gemm_memory_efficiency=float(E[200]),
            gemm_latency_s=float(LG[9]))
K = 1024
KERNELS = (
    [("sparse_mla_decode", dict(batch=b, heads=h, context=64 * K, topk=2048, kv_format="fp8_ds_mla"))
     for b in (1, 8, 32, 64, 128) for h in (64, 8)]
    + [("sparse_mla_prefill", dict(chunk=c, heads=64, context=64 * K, topk=2048)) for c in (2 * K, 8 * K)]
    + [("indexer_decode", dict(batch=b, keys=64 * K, index_heads=32, topk=2048, key_format="fp8")) for b in (8, 64)]
    + [("indexer_prefill", dict(chunk=8 * K, keys=k, index_heads=32, topk=2048, key_format="fp8"))
       for k in (8 * K, 64 * K)]
    + [("moe", dict(tokens=t, experts_local=e, topk=8)) for t, e in ((512, 32), (4096, 32), (4096, 256))]
    + [("linear", {"tokens": t, "in": i, "out": o, "name": n}) for t in (64, 8192)
       for n, i, o in (("q_a_proj", 6144, 2048), ("o_proj", 16384, 6144), ("mlp.gate_proj", 6144, 12288),
                       ("indexer.wk", 6144, 128))]
)
SLICE = [("decode", b, c, 1) for b in (8, 64) for c in (16 * K, 128 * K)] + [("prefill", 1, 64 * K, 8 * K)]


def results(spec, *, slice_scale=1.0, extra=()):
    """A bench run whose every row takes exactly what `spec` prices (slice rows x slice_scale)."""
    sliced = M.slice_config(CFG)
    kernels = [{"op": op, "shape": s, "default": True, "measured_s": M.kernel_cost(CFG, spec, op, s).time_s,
                "priced_s": M.kernel_cost(CFG, H200_CALIBRATED, op, s).time_s} for op, s in KERNELS]
    rows = [{"kind": k, "batch": b, "context": c, "chunk": n,
             "measured_s": slice_scale * M.slice_cost(sliced, spec, M.slice_plan(k, b, c, n))} for k, b, c, n in SLICE]
    return {"preset": "glm-5.3", "complete": True, "kernels": kernels + list(extra), "slice": {"rows": rows}}


@pytest.fixture(scope="module")
def true_spec():  # a measured spec prices the experts with its one GEMM fit (no published grouped fit)
    return dataclasses.replace(H200_CALIBRATED, **M._NO_GROUPED_FIT, **TRUE)


@pytest.fixture(scope="module")
def fit(true_spec):
    return M.fit_measured(results(true_spec), CFG, H200_CALIBRATED)


def test_the_fit_recovers_the_spec_that_priced_the_rows(fit):
    assert fit["fields"] == pytest.approx(TRUE, rel=1e-12)
    assert all(f["status"] == "fitted" and f["mean_abs_log_error"] < 1e-9 for f in fit["families"].values())
    assert fit["families"]["gemm"]["rows"] == 3 + 8 and fit["families"]["indexer"]["rows"] == 4
    assert all(abs(r["rel_error"]) < 1e-9 for r in fit["kernel_rows"])
    assert fit["spec"]["sparse_decode_efficiency"] == TRUE["sparse_decode_efficiency"]
    assert fit["spec"]["all_to_all_efficiency"] == H200_CALIBRATED.all_to_all_efficiency  # not measured: kept


def test_the_held_out_slice_rows_report_their_error(fit, true_spec):
    """The slice rows play no part in the fit: priced by step_cost on the fitted spec they match the rows the
    true spec made (error 0), the base spec's price does not; 25% slower slice steps show as -20%."""
    v = fit["validation"]
    assert len(v["rows"]) == len(SLICE) and v["max_abs_rel_error"] < 1e-9
    assert all(abs(r["base_rel_error"]) > 0.05 for r in v["rows"])
    slow = M.fit_measured(results(true_spec, slice_scale=1.25), CFG, H200_CALIBRATED)
    assert slow["fields"] == fit["fields"]
    assert [r["rel_error"] for r in slow["validation"]["rows"]] == pytest.approx([1 / 1.25 - 1] * len(SLICE))
    assert slow["validation"]["mean_abs_rel_error"] == pytest.approx(0.2)


def test_candidates_failures_and_unpriced_rows_do_not_enter_the_fit(fit, true_spec):
    op, s = KERNELS[0]
    noise = [{"op": op, "shape": s, "default": False, "measured_s": 1.0, "priced_s": 1e-5},  # a slow tile candidate
             {"op": op, "shape": s, "measured_s": None, "priced_s": 1e-5, "error": "RuntimeError: boom"},
             {"op": "hisparse_resolve", "shape": dict(rows=64, topk=2048, hot_rows=4096), "default": True,
              "measured_s": 5e-3, "priced_s": None}]
    again = M.fit_measured(results(true_spec, extra=noise), CFG, H200_CALIBRATED)
    assert again["fields"] == fit["fields"] and len(again["kernel_rows"]) == len(KERNELS)
    assert len(M.fit_rows(results(true_spec, extra=noise))) == len(KERNELS)


def test_a_family_without_rows_keeps_the_base_values(true_spec):
    res = results(true_spec)
    res["kernels"] = [r for r in res["kernels"] if r["op"] not in ("linear", "moe")]
    got = M.fit_measured(res, CFG, H200_CALIBRATED)
    assert got["families"]["gemm"] == {"status": "not fitted: no rows"}
    assert "gemm_efficiency" not in got["fields"] and got["spec"]["gemm_efficiency"] == H200_CALIBRATED.gemm_efficiency
    assert got["fields"]["indexer_efficiency"] == pytest.approx(TRUE["indexer_efficiency"])


def test_h200_measured_exists_only_from_a_committed_run():
    """The issue's check: the registered constants equal a refit of the committed run they name. Before a
    device run is committed there is no h200_measured, and asking for it says what it waits for."""
    if not hw_mod.MEASURED_SPEC.exists():
        assert "h200_measured" not in HARDWARE and hw_mod.H200_MEASURED is None
        with pytest.raises(ValueError, match="waits for a device run.*bench_gpu.*results/gpu_speed"):
            hardware_spec("h200_measured")
        return
    from experiments.common import REPO

    reg = json.loads(hw_mod.MEASURED_SPEC.read_text())
    run = json.loads((REPO / reg["source"] / "results.json").read_text())
    assert run["complete"] and not run.get("dry_run")
    refit = M.fit_measured(run, get_preset(run["preset"]), H200_CALIBRATED)
    assert reg["fields"] == refit["fields"]
    assert all(getattr(HARDWARE["h200_measured"], k) == v for k, v in reg["fields"].items())


def test_a_registered_spec_is_the_calibrated_one_with_the_fitted_fields(tmp_path):
    """... less the published grouped-GEMM fit: the measured GEMM fit prices the experts (fit_measured)."""
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"source": "results/gpu_speed/x", "fields": TRUE}))
    spec = hw_mod._measured_spec(path)
    assert dataclasses.replace(spec, name=H200_CALIBRATED.name) == dataclasses.replace(
        H200_CALIBRATED, **M._NO_GROUPED_FIT, **TRUE)
    assert hw_mod._measured_spec(tmp_path / "absent.json") is None
    with pytest.raises(ValueError, match="hardware must be one of"):
        hardware_spec("h100")
