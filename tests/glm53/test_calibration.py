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
