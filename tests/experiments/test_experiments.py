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


def test_bench_attention_writes_results(tmp_path):
    from experiments import bench_attention

    res = bench_attention.main(["--out", str(tmp_path), "--contexts", "2048", "4096", "--batch", "1", "--repeats", "1",
                                "--dense-max-context", "2048"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["context"] for r in saved["contexts"]] == [2048, 4096] and saved["impl"] == "reference"
    assert all(r["sparse_attn_s"] > 0 and r["indexer_s"] > 0 for r in saved["contexts"])
    assert "dense_attn_s" in saved["contexts"][0] and "dense_attn_s" not in saved["contexts"][1]
    assert saved["contexts"][0]["sparse_bytes"] == 2048 * 656 + 64 * (512 + 64 + 512) * 2
    assert (tmp_path / "bench_attention.png").stat().st_size > 0 and res["batch"] == 1


def test_kv_cache_error_measures_formats(tmp_path):
    from experiments import kv_cache_error

    rows = kv_cache_error.measure(["tiny"], formats=[("float32", None), ("fp8_ds_mla", None)])
    assert rows[0]["max_abs_err_rel"] <= 1e-4 and rows[0]["top1_agreement"] == 1.0
    assert 0 < rows[1]["max_abs_err_rel"] and rows[1]["top1_agreement"] > 0.5


def test_hisparse_copy_check_is_exact_on_cpu(tmp_path):
    from experiments import check_hisparse_copy

    res = check_hisparse_copy.main(["--host-pool-mb", "2", "--out", str(tmp_path)])
    assert res["times_meaningful"] is False and res["copy"]["host_pool_bytes"] >= (2 << 20) - 656
    assert [r["exact"] for r in res["copy"]["rows"]] == [True] * len(res["copy"]["rows"])
    assert res["resolver"]["mismatched_ints"] == 0
    assert json.loads((tmp_path / "results.json").read_text())["copy"]["rows"][0]["rows"] == 128
