"""`python -m experiments.calibrate --measured DIR`: the h200_measured fit of a bench_gpu run, written beside
the run and registered only for a complete device run; and experiments.reproduce's
part1_c32_h200_vs_measured, which waits for that spec and then runs Part 1 at c32 on both specs."""

import dataclasses
import json
from pathlib import Path

import pytest

from experiments import calibrate, reproduce
from glm53.perfmodel import H200_CALIBRATED
from glm53.perfmodel import hardware as hw_mod
from glm53.perfmodel.measured import _NO_GROUPED_FIT  # a measured spec prices the experts with its one GEMM fit
from tests.glm53.test_measured import TRUE, results  # a run whose rows a known spec priced


def _run_dir(tmp_path, **changes) -> Path:
    res = results(dataclasses.replace(H200_CALIBRATED, **_NO_GROUPED_FIT, **TRUE))
    res.update({"date": "2026-12-05", "git_revision": "abc", "dry_run": False, **changes})
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_a_complete_device_run_is_fitted_reported_and_registered(tmp_path):
    d = _run_dir(tmp_path)
    spec_path = tmp_path / "measured.json"
    rep = calibrate.fit_measured_run(d, spec_path=spec_path)
    assert rep["registered"] == str(spec_path)
    assert json.loads(spec_path.read_text())["fields"] == rep["fields"] == pytest.approx(TRUE, rel=1e-12)
    assert json.loads((d / "h200_measured.json").read_text())["fields"] == rep["fields"]
    md = (d / "h200_measured.md").read_text()
    assert md.count("| decode |") + md.count("| prefill |") == len(rep["validation"]["rows"])
    assert "Held-out |rel_error|: mean 0.0%" in md
    spec = hw_mod._measured_spec(spec_path)  # what glm53.perfmodel.hardware loads as HARDWARE["h200_measured"]
    assert spec.indexer_efficiency == TRUE["indexer_efficiency"]


@pytest.mark.parametrize("changes,why", [({"complete": False}, "incomplete"), ({"dry_run": True}, "dry run")])
def test_an_incomplete_or_dry_run_is_never_registered(tmp_path, changes, why):
    d = _run_dir(tmp_path, **changes)
    spec_path = tmp_path / "measured.json"
    rep = calibrate.fit_measured_run(d, spec_path=spec_path)
    assert not spec_path.exists() and why in rep["registered"]
    assert (d / "h200_measured.json").exists()  # the report is still written


def test_the_command_line_writes_the_report(tmp_path, monkeypatch):
    d = _run_dir(tmp_path)
    monkeypatch.setattr(hw_mod, "MEASURED_SPEC", tmp_path / "never.json")
    rep = calibrate.main(["--measured", str(d), "--no-register"])
    assert rep["registered"].startswith("not asked") and not (tmp_path / "never.json").exists()
    assert json.loads((d / "h200_measured.json").read_text())["source"] == str(d)


def test_the_reproduce_entry_waits_for_the_measured_spec_then_runs_both(tmp_path, monkeypatch):
    entry = reproduce.measured_entry()
    if "h200_measured" not in hw_mod.HARDWARE:
        assert entry.kind == "not_built" and entry.waits_for.startswith("issue 45")
        assert reproduce.MANIFEST[[e.id for e in reproduce.MANIFEST].index(reproduce.MEASURED_ID)] == entry
        r = reproduce._run_entry(entry, tmp_path / entry.id, True, {})
        assert r["status"] == "not built" and "issue 45" in r["waits_for"]
    monkeypatch.setitem(hw_mod.HARDWARE, "h200_measured",
                        dataclasses.replace(H200_CALIBRATED, **_NO_GROUPED_FIT, **TRUE))
    entry = reproduce.measured_entry()
    assert entry.kind == "sim" and entry.hardware == ("h200", "h200_measured")
    assert "--config.sweep.concurrency=(32,)" in entry.overrides
    calls = []

    def serve_main(argv):  # the simulator itself is tested elsewhere; here: one run per spec, labelled
        calls.append(argv)
        hw = argv[-1].split("=")[1]
        return {"runs": [{"kv_policy": "hisparse", "concurrency": 32, "throughput_tok_s_per_gpu": len(hw)}]}

    from experiments import serve

    monkeypatch.setattr(serve, "main", serve_main)
    r = reproduce._run_entry(entry, tmp_path / entry.id, False, {})
    assert [a[-1] for a in calls] == ["--config.runner.hardware=h200", "--config.runner.hardware=h200_measured"]
    assert [a[a.index("--out") + 1] for a in calls] == [str(tmp_path / entry.id / h) for h in entry.hardware]
    assert [(x["hardware"], x["throughput_tok_s_per_gpu"]) for x in r["runs"]] == [("h200", 4), ("h200_measured", 13)]


def test_a_simulated_run_names_its_hardware_and_is_told_what_h200_measured_waits_for():
    from experiments import serve

    assert serve._hardware("h200") is H200_CALIBRATED
    if "h200_measured" not in hw_mod.HARDWARE:
        with pytest.raises(ValueError, match=r"^runner\.hardware: hardware 'h200_measured' waits for a device run"):
            serve._hardware("h200_measured")
    with pytest.raises(ValueError, match=r"^runner\.hardware: hardware must be one of"):
        serve._hardware("b200")
