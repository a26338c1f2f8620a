"""experiments.step_split runs (the benchmark itself asserts nothing): on the smoke config served once, each
step's parts on the host's clock come back for both kinds of step, and the waited forward fits in its
step."""

from experiments import step_split


def test_step_split_splits_a_served_step_and_times_the_drift(tmp_path, monkeypatch):
    monkeypatch.setattr(step_split, "DRIFT_SHAPES", ((1, 1, 64), (1, 16, 64)))  # small programs: seconds
    monkeypatch.setattr(step_split, "PREFILL_SHAPE", (1, 64, 128))
    res = step_split.main(["--out", str(tmp_path / "s.json"), "--point", "smoke:preempt:1", "--drift-s", "0.2"])
    point = res["points"]["smoke:preempt:1"]
    for kind in ("decode_only", "with_prefill"):
        served, waited = point["as_served"][kind], point["waited"][kind]
        assert served["steps"] == waited["steps"] > 0  # the same schedule both ways
        assert 0 < served["update_s"] <= served["after_tokens_s"] < served["step_s"]
        assert 0 < waited["forward_s"] + waited["sampling_s"] < waited["step_s"]
    drift = res["drift"]
    assert len(drift["common_factor"]) == len(drift["pass_t_s"]) >= 1
    assert set(drift["decode_after_ms"]) == {"itself", "1x16@64", "1x64@128"}
    assert all(0 < v < 1e4 for v in drift["decode_after_ms"].values())  # milliseconds of a small program
