"""Calibration on published tables: the fit is reproducible, it is checked on rows it was not fitted on,
and the committed result is what the code computes today."""

import json
import math
from pathlib import Path

import pytest

from glm53.perfmodel import calibration as cal

REPO = Path(__file__).resolve().parents[2]


def test_every_published_row_cites_a_source_with_an_excerpt():
    pub = cal.load_published()
    for cat, rows in pub.items():
        if isinstance(rows, list):
            for r in rows:
                assert r["source"] in pub["sources"] and r["excerpt"], (cat, r)
    assert len(cal.gemm_rows(pub)) == 28


def test_gemm_rows_are_timed_from_the_tables_tflops():
    row = cal.gemm_rows()[0]  # DeepGEMM: M=64, N=2112, K=7168 at 206 TFLOPS
    assert (row.m, row.n, row.k) == (64, 2112, 7168)
    assert row.measured_s == pytest.approx(2 * 64 * 2112 * 7168 / 206e12)


def test_the_fit_is_the_best_on_its_grid_and_holds_out_half_the_rows():
    res = cal.calibrate_gemm()
    rows = cal.gemm_rows()
    fit = cal.GemmFit(**res["fit"])
    train = rows[0::2]
    for d in ((0.01, 0, 0), (-0.01, 0, 0), (0, 0, 0.5e-6), (0, 0, -0.5e-6)):
        other = cal.GemmFit(fit.compute_eff + d[0], min(1.0, fit.memory_eff + d[1]), max(0.0, fit.launch_s + d[2]))
        assert cal._log_err(fit, train) <= cal._log_err(other, train)
    assert len(res["holdout_rows"]) == len(rows) - len(train) == 14
    errs = [fit.time_s(r) / r.measured_s - 1 for r in rows[1::2]]
    assert res["holdout_mean_abs_rel_error"] == pytest.approx(sum(map(abs, errs)) / len(errs))
    assert all(math.isfinite(e) for e in errs)


def test_the_committed_calibration_is_current():
    committed = json.loads((REPO / "results/calibration/gemm.json").read_text())
    now = cal.calibrate_gemm()
    assert committed["fit"] == now["fit"]
    assert committed["holdout_mean_abs_rel_error"] == pytest.approx(now["holdout_mean_abs_rel_error"])


def test_the_calibrated_h200_holds_what_the_fits_give():
    from glm53.perfmodel import H200_CALIBRATED, HARDWARE

    fields = cal.calibrated_fields()
    assert {k: getattr(H200_CALIBRATED, k) for k in fields} == fields
    assert HARDWARE["h200"] is H200_CALIBRATED  # what the simulator's configs name


def test_collective_efficiency_is_the_median_of_the_even_intranode_rows():
    rows = cal.collective_rows()
    assert rows and all(r["interconnect"].startswith("NVLink4/NVSwitch") for r in rows)  # no H800, no RDMA
    fams = cal.calibrate_collectives()["families"]
    a2a = [r["busbw_gbps"] for r in rows if r["family"] == "all_to_all"]
    assert len(a2a) == 5
    assert fams["all_to_all"]["efficiency"] == round(sorted(a2a[0::2])[1] * 1e9 / cal.NVLINK4_ONE_WAY, 2)
    held = fams["all_to_all"]["holdout_rows"]
    assert [h["busbw_gbps"] for h in held] == a2a[1::2]
    assert all(h["rel_error"] == pytest.approx(h["busbw_gbps"] / h["predicted_busbw_gbps"] - 1) for h in held)
    assert fams["all_reduce"]["efficiency"] == 1.0 < fams["all_reduce"]["efficiency_uncapped"]  # NVLS beats the ring bound


def test_the_checks_compare_against_every_usable_row():
    mla = cal.check_sparse_mla()
    assert [r["measured_tflops"] for r in mla["holdout_rows"]] == [410.0, 250.0]
    assert all(-0.3 < r["rel_error"] < 0 for r in mla["holdout_rows"])  # the model is optimistic, by < 30%
    host = cal.check_host_copy()
    assert len(host["rows"]) == len(cal.load_published()["host_copy"])


def test_the_datasheet_spec_prices_gemms_as_before():
    """The datasheet H200 has no GEMM fields: a GEMM is the plain roofline at matmul_efficiency."""
    from glm53.perfmodel import H200, H200_CALIBRATED
    from glm53.perfmodel.cost import _gemm, _kernel

    a = _gemm("g", H200, flops=2e12, hbm_bytes=1e9, dtype="fp8")
    b = _kernel("g", H200, flops=2e12, hbm_bytes=1e9, dtype="fp8")
    assert a.time_s == b.time_s and a.latency_s == 0
    c = _gemm("g", H200_CALIBRATED, flops=2e12, hbm_bytes=1e9, dtype="fp8")
    assert c.time_s == pytest.approx(2e12 / (H200.fp8_flops * 0.68) + 4.5e-6)


@pytest.mark.parametrize("name", ["collectives", "sparse_mla", "host_copy", "calibrated_spec"])
def test_the_other_committed_calibrations_are_current(name):
    committed = json.loads((REPO / f"results/calibration/{name}.json").read_text())
    now = {"collectives": cal.calibrate_collectives, "sparse_mla": cal.check_sparse_mla,
           "host_copy": cal.check_host_copy, "calibrated_spec": lambda: {"fields": cal.calibrated_fields()}}[name]()
    key = {"collectives": "families", "sparse_mla": "holdout_rows", "host_copy": "rows", "calibrated_spec": "fields"}[name]
    assert json.loads(json.dumps(now[key])) == committed[key]


def test_the_nvme_medium_is_the_published_storage_rows():
    """glm53.perfmodel.NVME_GEN4 (the simulated filesystem tier's drive) takes its bandwidths from the
    cited datasheet rows, a measured chunk-sized read reaches within 6% of the read rating, and the
    assumed fixed time per chunk stays under what that measurement leaves beside the transfer."""
    from glm53.perfmodel import NVME_GEN4

    rows = cal.load_published()["storage"]
    sheet = {r["direction"]: r["gbps"] for r in rows if r["source"] == "servethehome_micron7450"}
    assert NVME_GEN4.read_bandwidth == sheet["read"] * 1e9 and NVME_GEN4.write_bandwidth == sheet["write"] * 1e9
    (fio,) = [r for r in rows if r["measured"]]
    assert abs(fio["gbps"] * 1e9 / NVME_GEN4.read_bandwidth - 1) < 0.06
    bound_s = fio["latency_us_min"] * 1e-6 - fio["chunk_bytes"] / (fio["gbps"] * 1e9)
    assert NVME_GEN4.read_latency_s <= bound_s and NVME_GEN4.write_latency_s <= bound_s
