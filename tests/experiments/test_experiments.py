"""The experiment entry points: what they compute and that their timers fit inside the run (the
benchmarks' speeds themselves are not asserted)."""

import json
import time

from experiments import bench_model, generate
from tests.experiments.figures import assert_drawn


def _timed(main, argv):
    """main(argv) -> (its result, the wall seconds the call took)."""
    t0 = time.perf_counter()
    res = main(argv)
    return res, time.perf_counter() - t0


def _saved(path, res) -> bool:
    """Whether results.json at `path` holds `res` (as JSON writes it: tuples become lists)."""
    return json.loads(path.read_text()) == json.loads(json.dumps(res))


def test_main_job_generates_and_reports_speed(tmp_path, capsys):
    """The compiling run, then the timed run's prefill and decode: one after the other, inside the call."""
    res, wall = _timed(generate.main, ["--max-new-tokens", "8", "--out", str(tmp_path)])
    assert res["new_tokens"] == 8
    decode_s = (res["new_tokens"] - 1) / res["decode_tokens_per_s"]  # the first token comes out of the prefill
    parts = (res["first_run_incl_compile_s"], res["prefill_s"], decode_s)
    assert min(parts) > 0 and sum(parts) <= wall
    assert _saved(tmp_path / "results.json", res)
    out = capsys.readouterr().out
    ids = json.loads(out.split("token ids: ")[1].splitlines()[0])
    assert len(ids) == res["new_tokens"]  # it prints the ids it timed


def test_bench_model_writes_results_without_hf(tmp_path):
    """Per length, the compiling call and the best of the repeats, then decode's two generate runs: the
    timed parts fit in the call's wall time; without --hf-python the HF columns are empty."""
    res, wall = _timed(bench_model.main, ["--out", str(tmp_path), "--configs", "tiny", "--lengths", "64", "--repeats",
                                          "1", "--decode-context", "32", "--decode-steps", "2"])
    tiny = res["configs"]["tiny"]
    (row,) = tiny["prefill"]
    assert row["tokens"] == 64
    decode_s = 2 * tiny["ours_decode_ms_per_step"] / 1e3  # the timed one of decode's two generate runs
    parts = (row["ours_first_call_incl_compile_s"], row["ours_s"], decode_s)
    assert min(parts) > 0 and sum(parts) <= wall
    assert res["hf_ran"] is False and tiny["hf_decode_ms_per_step"] is None and "hf_s" not in row
    assert _saved(tmp_path / "results.json", res)
    assert_drawn(tmp_path / "bench_model.png", (5.5, 4), 120, ("C0",), min_pixels=5)


def test_bench_attention_writes_results(tmp_path):
    """Per context one timed call (repeats 1) of sparse MLA, the indexer and, up to --dense-max-context,
    dense MLA: all inside the call's wall time; the sparse step's bytes are 2,048 fp8 rows of 656 B and
    each head's bf16 query (512 + 64) and output (512)."""
    from experiments import bench_attention

    res, wall = _timed(bench_attention.main, ["--out", str(tmp_path), "--contexts", "2048", "4096", "--batch", "1",
                                              "--repeats", "1", "--dense-max-context", "2048"])
    rows = res["contexts"]
    assert [r["context"] for r in rows] == [2048, 4096] and res["impl"] == "reference"
    timers = [r[k] for r in rows for k in ("sparse_attn_s", "indexer_s", "dense_attn_s") if k in r]
    assert len(timers) == 5 and min(timers) > 0 and sum(timers) <= wall  # dense at 2048 only
    assert "dense_attn_s" in rows[0] and "dense_attn_s" not in rows[1]
    assert all(r["sparse_bytes"] == 2048 * 656 + 64 * (512 + 64 + 512) * 2 for r in rows)
    assert _saved(tmp_path / "results.json", res)
    assert_drawn(tmp_path / "bench_attention.png", (6.4, 4.2), 120, ("C0", "C1", "C2"), min_pixels=5)


def test_kv_cache_error_measures_formats(tmp_path):
    """A float32 cache reproduces the reference; the fp8 cache's error is its quantisation's, bounded (the
    committed results/kv_cache_error: 0.22 and 91% top-1 on the tiny preset)."""
    from experiments import kv_cache_error

    rows = kv_cache_error.measure(["tiny"], formats=[("float32", None), ("fp8_ds_mla", None)])
    assert rows[0]["max_abs_err_rel"] <= 1e-4 and rows[0]["top1_agreement"] == 1.0
    assert 1e-2 < rows[1]["max_abs_err_rel"] < 0.3 and rows[1]["top1_agreement"] >= 0.85


def test_hisparse_copy_check_is_exact_on_cpu(tmp_path):
    from experiments import check_hisparse_copy

    res = check_hisparse_copy.main(["--host-pool-mb", "2", "--out", str(tmp_path)])
    assert res["times_meaningful"] is False and res["copy"]["host_pool_bytes"] >= (2 << 20) - 656
    assert [r["exact"] for r in res["copy"]["rows"]] == [True] * len(res["copy"]["rows"])
    assert res["resolver"]["mismatched_ints"] == 0
    assert json.loads((tmp_path / "results.json").read_text())["copy"]["rows"][0]["rows"] == 128
