"""Smoke tests of the experiment entry points (the benchmark's numbers are not asserted)."""

import json

from experiments import bench_model, generate


def test_main_job_generates_and_reports_speed(tmp_path, capsys):
    res = generate.main(["--max-new-tokens", "8", "--out", str(tmp_path)])
    assert res["new_tokens"] == 8 and res["decode_tokens_per_s"] > 0 and res["prefill_tokens_per_s"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["new_tokens"] == 8
    assert "tokens/s" in capsys.readouterr().out


def test_bench_model_writes_results_without_hf(tmp_path):
    res = bench_model.main(["--out", str(tmp_path), "--configs", "tiny", "--lengths", "64", "--repeats", "1",
                            "--decode-context", "32", "--decode-steps", "2"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["hf_ran"] is False and saved["configs"]["tiny"]["prefill"][0]["tokens"] == 64
    assert saved["configs"]["tiny"]["ours_decode_ms_per_step"] > 0
    assert (tmp_path / "bench_model.png").stat().st_size > 0
    assert res["configs"]["tiny"]["hf_decode_ms_per_step"] is None
