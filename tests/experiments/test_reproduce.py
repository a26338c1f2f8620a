"""experiments.reproduce: every entry of the manifest can run as listed, and a run reports what it ran, what
it redrew from committed results (showing those results), and what is not built (with the issue it waits
for)."""

import importlib
import json
from pathlib import Path

import pytest

from experiments import common, reproduce, serve
from experiments.common import git_revision, load_config
from glm53 import perfmodel as pm
from glm53.config import get_preset
from tests.experiments.figures import assert_drawn

REPO = Path(__file__).resolve().parents[2]
KINDS = ("analytic", "real", "real_heavy", "sim", "not_built")


def test_every_entry_can_run_as_listed():
    """Each buildable entry's command would start: its experiment has a `main`; its config loads with the
    entry's overrides and --quick's (load_config refuses a key the config does not have) and runs the
    simulator exactly when the entry says "sim"; a real_heavy entry's committed results fill every column
    of its report table (P/D's tokens_equal: true at concurrency 1, its only comparison); the doc it names
    is there. A not-built entry names the issue it waits for."""
    ids = [e.id for e in reproduce.MANIFEST]
    assert len(ids) == len(set(ids))
    assert {e.kind for e in reproduce.MANIFEST} == set(KINDS)
    for e in reproduce.MANIFEST:
        assert e.kind in KINDS, e.id
        if e.kind == "not_built":
            assert e.waits_for.startswith("issue") and not e.experiment, e.id
            continue
        assert callable(importlib.import_module(f"experiments.{e.experiment}").main), e.id
        if e.config:
            quick = [*(reproduce.QUICK_SIM if e.kind == "sim" else ()), *e.quick]
            cfg = load_config(str(REPO / e.config), [*e.overrides, *quick])
            if e.experiment == "serve":
                assert serve.simulated(cfg) == (e.kind == "sim"), e.id
        if e.kind == "real_heavy" and e.experiment != "memory_plan":
            runs = reproduce._runs(json.loads((REPO / e.committed / "results.json").read_text()), e)
            assert runs, e.id
            for r in runs:  # pd_http compares the deployments' tokens at concurrency 1 only: equal there
                assert all(v is not None for k, v in r.items() if k != "tokens_equal"), (e.id, r)
                if "tokens_equal" in r:
                    assert r["tokens_equal"] is (True if r["concurrency"] == 1 else None), (e.id, r)
        if e.doc:
            assert (REPO / e.doc).is_file(), (e.id, e.doc)


def test_a_quick_run_reports_every_entry_it_was_given(tmp_path):
    only = ["dcp8_prefill_overhead", "hisparse_vs_offload", "ablation_dcp_backend_a2a", "part2_pd_laptop",
            "part2_pd_1m", "ablation_mtp_topk_reuse"]  # in MANIFEST order
    res = reproduce.main(["--out", str(tmp_path), "--quick", "--only", ",".join(only)])
    figures = {f["id"]: f for f in res["figures"]}
    status = {i: f["status"] for i, f in figures.items()}
    assert list(status) == only
    assert status["dcp8_prefill_overhead"] == "ran"
    assert status["hisparse_vs_offload"].startswith("redrawn from committed results/hisparse_vs_offload")
    assert status["part2_pd_laptop"].startswith("redrawn from committed results/paper/part2_laptop")
    assert status["ablation_dcp_backend_a2a"] == status["part2_pd_1m"] == "ran (short window)"
    assert status["ablation_mtp_topk_reuse"] == "not built"
    # what ran is the model's figure (each GPU gathers the 7/8 of the context it does not hold, 54,728 B a
    # token; a 2,048-token PCP8 chunk over 8K cached tokens); what was redrawn shows the committed runs
    rows = figures["dcp8_prefill_overhead"]["metrics"]["dcp8_prefill_overhead"]
    assert [r["dcp_gather_nvlink_bytes_per_gpu"] for r in rows] == [r["cached_context"] * 7 // 8 * 54_728 for r in rows]
    step = pm.prefill_step(get_preset("glm-5.3"), pm.H200_CALIBRATED, 2048, 8192, pcp=8)
    assert rows[0]["cached_context"] == 8192 and rows[0]["step_s_without_dcp"] == step.time_s()
    by_id = {e.id: e for e in reproduce.MANIFEST}
    for i in ("hisparse_vs_offload", "part2_pd_laptop"):
        e = by_id[i]
        committed = json.loads((REPO / e.committed / "results.json").read_text())
        assert figures[i]["runs"] == json.loads(json.dumps(reproduce._runs(committed, e))), i
    assert_drawn(tmp_path / "dcp8_prefill_overhead" / "dcp8_prefill_overhead.png", (11, 4.5), 120, ("C0", "C3"))
    assert_drawn(tmp_path / "hisparse_vs_offload" / "running_requests_vs_concurrency.png", (6, 4.2), 120,
                 ("C0", "C1"))
    assert_drawn(tmp_path / "part2_pd_laptop" / "pd_http.png", (12, 3.5), 110, ("C0", "C1"))
    p1m = json.loads((tmp_path / "part2_pd_1m" / "results.json").read_text())
    assert p1m["max_model_len"] == 1_048_576 and p1m["prefill_deployment"] == "DP1 TP1 PCP8 DCP8 EP"
    sim = json.loads((tmp_path / "ablation_dcp_backend_a2a" / "results.json").read_text())
    assert sim["runs"][0]["runner"] == "sim" and sim["runs"][0]["deployment"] == "DP1 TP8 PCP1 DCP8"
    assert sim["workload"]["sessions"] == 8 and sim["config"]["deploy"]["dcp_comm_backend"] == "a2a"
    # every entry records the revision the run started from (pinned: experiments.common.pin_revision), and
    # the pin ends with the run
    assert sim["git_revision"] == sim["runs"][0]["git_revision"] == res["git_revision"]
    assert common._PINNED_REVISION is None and res["git_revision"].startswith(git_revision()[:40])
    report = (tmp_path / "report.md").read_text()
    for i in only:
        assert f"## {i}" in report
    assert "![running_requests_vs_concurrency](hisparse_vs_offload/running_requests_vs_concurrency.png)" in report
    assert "issue 21" in report and json.loads((tmp_path / "reproduce.json").read_text())["quick"] is True


def test_an_unknown_figure_id_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        reproduce.main(["--out", str(tmp_path), "--only", "no_such_figure"])
    assert "unknown figure ids ['no_such_figure']" in capsys.readouterr().err


def _quick_status(e: reproduce.Entry) -> str:
    """The status --quick gives an entry of this kind (reproduce._run_entry)."""
    return {"not_built": "not built", "real_heavy": "redrawn from committed" if e.experiment != "memory_plan"
            else "ran (step programs' memory analyses reused", "sim": "ran (short window)"}.get(e.kind, "ran")


def test_the_committed_quick_report_matches_the_manifest():
    """results/reproduce_quick is the manifest as it is: the same entries in the same order with the same
    kinds, a not-built entry reported not built and every built one run (or redrawn) as --quick runs its
    kind, nothing failed; report.md's table says the same as reproduce.json. Adding, building or
    retiring an entry without rerunning `python -m experiments.reproduce --out results/reproduce_quick
    --quick` fails here."""
    committed = json.loads((REPO / "results/reproduce_quick/reproduce.json").read_text())
    assert committed["quick"] is True
    figures = committed["figures"]
    assert [(f["id"], f["kind"]) for f in figures] == [(e.id, e.kind) for e in reproduce.MANIFEST]
    rows = {}
    for line in (REPO / "results/reproduce_quick/report.md").read_text().splitlines():
        if line.startswith("| [") and "](#" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].split("]")[0][1:]] = (cells[1], cells[2])
    assert list(rows) == [e.id for e in reproduce.MANIFEST]
    for e, f in zip(reproduce.MANIFEST, figures):
        assert f["status"].startswith(_quick_status(e)), (e.id, e.kind, f["status"])
        assert rows[e.id] == (e.kind, f["status"]), e.id
        if e.kind == "not_built":
            assert f["waits_for"] == e.waits_for, e.id
        elif e.kind == "sim" and e.experiment == "sensitivity":  # its knob's points (their own windows)
            assert f["runs"] and all(set(r) == set(e.compare) for r in f["runs"]), e.id
        elif e.kind == "sim":  # what ran is the entry's config with its overrides and --quick's
            assert f["argv"][:2] == ["--config", e.config] and f["runs"], e.id
            assert f["argv"][-len(e.quick or reproduce.QUICK_SIM):] == list(e.quick or reproduce.QUICK_SIM), e.id


def test_windows_and_workloads_of_the_published_parts():
    """Part 1 serves the published workload whole (128 conversations of 13 turns: 74,160 first-turn
    tokens, 753 later, 220 out; the window is those conversations), at 142K and at 1M alike; the
    conversations that grow toward 1M are the separately labelled part1_1m_growing; each Part 2 point is
    an hour of steady state after a warm-up; --quick keeps one c32 point of each part."""
    by_id = {e.id: e for e in reproduce.MANIFEST}

    def cfg(e, quick=False):
        extra = [*reproduce.QUICK_SIM, *e.quick] if quick else []
        return load_config(str(REPO / e.config), [*e.overrides, *extra])

    p1, p1m, grow = cfg(by_id["part1_142k"]), cfg(by_id["part1_1m"]), cfg(by_id["part1_1m_growing"])
    sessions = serve.build_sessions(p1.workload, p1.deploy.max_model_len)
    assert len(sessions) == 128 and p1.sweep.measure == "full" and p1.sweep.sessions_per_user == 0
    assert {tuple((t.input_tokens, t.output_tokens) for t in s.turns) for s in sessions} == {
        ((74_160, 220),) + ((753, 220),) * 12}
    assert p1m.deploy.max_model_len == grow.deploy.max_model_len == 1_048_576
    assert serve.build_sessions(p1m.workload, p1m.deploy.max_model_len) == sessions
    grown = serve.build_sessions(grow.workload, grow.deploy.max_model_len)
    assert len(grown) == 128 and {len(s.turns) for s in grown} == {13}
    assert 1_048_576 - 64 * 12 < max(s.max_context_tokens() for s in grown) <= 1_048_576
    for i in ("part2_pd_142k", "part2_pd_1m"):
        c = cfg(by_id[i])
        assert (c.sweep.measure, c.sweep.window_s, c.sweep.window_warmup_s) == ("steady", 3600.0, 600.0), i
    for i in ("part1_142k", "part2_pd_142k"):
        assert tuple(cfg(by_id[i], quick=True).sweep.concurrency) == (32,), i
