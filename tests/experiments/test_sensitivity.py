"""experiments.sensitivity on a tiny window: each knob reaches the point it sweeps, the results take the
issue's form, the default point is shared, and a rerun resumes instead of running again."""

import dataclasses
import json

import pytest

from experiments import sensitivity as S

ISSUE_KEYS = {"value", "figure", "concurrency", "kv_policy", "running_requests_mean", "throughput_tok_s_per_gpu",
              "interactivity_tok_s_user"}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Part 1 at 142K, HiSparse only, the default and each knob's last value, over 20 simulated seconds."""
    out = tmp_path_factory.mktemp("sensitivity")
    figures = dict(S.FIGURES, part1=dataclasses.replace(S.FIGURES["part1"], policies=("hisparse",)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "FIGURES", figures)
        res = S.run(out, ["part1"], list(S.KNOBS), window_s=20.0, quick=True, log=lambda *_: None)
    return out, res, figures


def test_each_knob_reaches_its_point(swept):
    out, res, _ = swept
    k = res["knobs"]
    assert set(k) == {"hisparse_miss_fraction", "step_overhead_s", "kv_budget", "expert_skew", "host_copy_overlap"}
    assert res["complete"] and not res["missing"] and res["window_s"] == 20.0 and res["windows"] == {"part1": [0.0, 20.0]}
    for rows in k.values():
        assert all(ISSUE_KEYS <= set(r) for r in rows)
        assert all(r["steady_window_s"] == [0.0, 20.0] for r in rows)  # every point cut to the window
    by = {knob: {r["default"]: r for r in rows} for knob, rows in k.items() if rows}
    miss = by["hisparse_miss_fraction"]
    assert (miss[True]["value"], miss[False]["value"]) == (0.1, 0.3)
    assert (miss[True]["assumed_hisparse_miss_fraction"], miss[False]["assumed_hisparse_miss_fraction"]) == (0.1, 0.3)
    over = by["step_overhead_s"]
    assert (over[True]["value"], over[False]["value"]) == (0.0, S.CITED_STEP_OVERHEAD_S)
    # 4 ms more per step: each decode token of the same requests waits that much longer
    assert over[False]["tpot_mean_s"] > over[True]["tpot_mean_s"] + 3e-3
    copies = by["host_copy_overlap"]
    assert (copies[True]["value"], copies[False]["value"]) == (0.0, 1.0)
    assert copies[False]["assumed_host_copy_overlap"] == 1.0
    # HiSparse's pre-copies hidden behind the forwards: the same requests' steps are shorter
    assert copies[False]["tpot_mean_s"] < copies[True]["tpot_mean_s"]
    kv = by["kv_budget"]
    assert kv[True]["value"] > 23 << 30 and kv[False]["value"] == 15 << 30  # the memory plan's (default), BRIEF's
    for r in kv.values():  # the pool takes the budget, to within a block
        assert 0 <= r["value"] - r["device_kv_budget_bytes_per_gpu"] < r["value"] / r["num_gpu_blocks"]
    assert kv[True]["num_gpu_blocks"] > kv[False]["num_gpu_blocks"]
    assert k["expert_skew"] == [] and "TP8" in res["not_run"]["expert_skew"]  # Part 1: no EP
    # one run serves every knob's default point
    defaults = [r for rows in k.values() for r in rows if r["default"] and r["figure"] == "part1"]
    assert len({json.dumps({x: r[x] for x in ISSUE_KEYS - {"value"}}) for r in defaults}) == 1
    assert all((out / f"{knob}.png").is_file()
               for knob in ("hisparse_miss_fraction", "step_overhead_s", "kv_budget", "host_copy_overlap"))
    assert json.loads((out / "results.json").read_text())["knobs"] == json.loads(json.dumps(k))


def test_a_rerun_resumes_and_a_cut_run_lists_what_is_missing(swept, monkeypatch):
    out, res, figures = swept
    monkeypatch.setattr(S, "FIGURES", figures)

    def boom(*a, **k):
        raise AssertionError("a point already in results.json ran again")

    monkeypatch.setattr(S, "run_point", boom)
    again = S.run(out, ["part1"], list(S.KNOBS), window_s=20.0, quick=True, log=lambda *_: None)
    assert again["knobs"] == res["knobs"]
    cut = S.run(out / "other", ["part1"], ["step_overhead_s"], window_s=20.0, quick=True, budget_s=-1.0)
    assert not cut["complete"] and len(cut["missing"]) == 2 and cut["knobs"]["step_overhead_s"] == []


def test_part2_is_measured_over_its_published_hour_and_a_run_over_another_window_is_run_again(swept, monkeypatch):
    # Part 2's points take its config's steady window (600 s warm-up, then the hour), not window_s; --quick cuts it
    assert S.window(S.FIGURES["part2"], 300.0, False) == (600.0, 3600.0)
    assert S.window(S.FIGURES["part2"], 60.0, True) == (0.0, 60.0)
    assert S.window(S.FIGURES["part1"], 300.0, False) == (0.0, 300.0)
    cfg = S.base_config(S.FIGURES["part2"], "pcp_dcp+hisparse", 300.0)
    assert (cfg.sweep.measure, cfg.sweep.window_warmup_s, cfg.sweep.window_s) == ("steady", 600.0, 3600.0)
    # a stored run whose measured window is not its figure's current one is not reused
    out, res, figures = swept
    moved = out / "moved"
    moved.mkdir()
    stored = json.loads((out / "results.json").read_text())
    stale = "part1|hisparse|step_overhead_s=0.004"
    stored["runs"][stale]["steady_window_s"] = [0.0, 300.0]
    (moved / "results.json").write_text(json.dumps(stored))
    monkeypatch.setattr(S, "FIGURES", figures)
    ran = []
    monkeypatch.setattr(S, "run_point", lambda *a, **k: ran.append(a[:4]) or res["knobs"]["step_overhead_s"][1])
    S.run(moved, ["part1"], list(S.KNOBS), window_s=20.0, quick=True, log=lambda *_: None)
    assert ran == [("part1", "hisparse", "step_overhead_s", S.CITED_STEP_OVERHEAD_S)]


def test_knobs_act_only_where_they_can():
    p1, p2 = S.FIGURES["part1"], S.FIGURES["part2"]
    assert not S.applies("hisparse_miss_fraction", p1, "offload") and S.applies("hisparse_miss_fraction", p1, "hisparse")
    assert not S.applies("expert_skew", p1, "hisparse") and S.applies("expert_skew", p2, "pcp_dcp+hisparse")
    with pytest.raises(ValueError, match="knob 'nope'"):
        S.run(None, ["part1"], ["nope"])
