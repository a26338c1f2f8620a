"""experiments.reproduce: the manifest is well formed, and a run writes a report that lists what it ran,
what it redrew from committed results, and what is not built (with the issue it waits for)."""

import json
from pathlib import Path

import pytest

from experiments import reproduce

REPO = Path(__file__).resolve().parents[2]


def test_the_manifest_names_real_files_and_says_what_is_missing():
    ids = [e.id for e in reproduce.MANIFEST]
    assert len(ids) == len(set(ids))
    for e in reproduce.MANIFEST:
        assert e.kind in ("analytic", "real", "real_heavy", "sim", "not_built"), e.id
        if e.kind == "not_built":
            assert e.waits_for.startswith("issue"), e.id
            continue
        assert (REPO / "experiments" / f"{e.experiment}.py").exists(), e.id
        if e.config:
            assert (REPO / e.config).exists(), e.id
        if e.kind == "real_heavy":
            assert (REPO / e.committed / "results.json").exists(), e.id
        if e.doc:
            assert (REPO / e.doc).exists(), (e.id, e.doc)
    kinds = {e.kind for e in reproduce.MANIFEST}
    assert kinds == {"analytic", "real", "real_heavy", "sim", "not_built"}


def test_a_quick_run_reports_every_entry_it_was_given(tmp_path):
    only = ["dcp8_prefill_overhead", "hisparse_vs_offload", "ablation_dcp_backend_a2a", "part2_pd_laptop",
            "part2_pd_1m", "ablation_mtp_topk_reuse"]  # in MANIFEST order
    res = reproduce.main(["--out", str(tmp_path), "--quick", "--only", ",".join(only)])
    status = {f["id"]: f["status"] for f in res["figures"]}
    assert list(status) == only
    assert status["dcp8_prefill_overhead"] == "ran"
    assert status["hisparse_vs_offload"].startswith("redrawn from committed results/hisparse_vs_offload")
    assert status["part2_pd_laptop"].startswith("redrawn from committed results/paper/part2_laptop")
    assert status["ablation_dcp_backend_a2a"] == status["part2_pd_1m"] == "ran (short window)"
    assert status["ablation_mtp_topk_reuse"] == "not built"
    assert (tmp_path / "dcp8_prefill_overhead" / "dcp8_prefill_overhead.png").stat().st_size > 0
    assert (tmp_path / "hisparse_vs_offload" / "running_requests_vs_concurrency.png").stat().st_size > 0
    assert (tmp_path / "part2_pd_laptop" / "pd_http.png").stat().st_size > 0
    p1m = json.loads((tmp_path / "part2_pd_1m" / "results.json").read_text())
    assert p1m["max_model_len"] == 1_048_576 and p1m["prefill_deployment"] == "DP1 TP1 PCP8 DCP8 EP"
    sim = json.loads((tmp_path / "ablation_dcp_backend_a2a" / "results.json").read_text())
    assert sim["runs"][0]["runner"] == "sim" and sim["runs"][0]["deployment"] == "DP1 TP8 PCP1 DCP8"
    assert sim["workload"]["sessions"] == 8 and sim["config"]["deploy"]["dcp_comm_backend"] == "a2a"
    report = (tmp_path / "report.md").read_text()
    for i in only:
        assert f"## {i}" in report
    assert "issue 21" in report and json.loads((tmp_path / "reproduce.json").read_text())["quick"] is True


def test_an_unknown_figure_id_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        reproduce.main(["--out", str(tmp_path), "--only", "no_such_figure"])
