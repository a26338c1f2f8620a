"""Smoke test of `python -m experiments.roofline`: the required keys, their values and the PNGs."""

import itertools
import json

import numpy as np
import pytest

from experiments import roofline
from glm53.config import get_preset


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline")
    roofline.main(["--out", str(out)])
    return out, json.loads((out / "roofline.json").read_text())


def test_writes_required_keys_and_pngs(run):
    out, res = run
    for key in ("date", "machine", "git_commit", "hardware", "kv_bytes_per_token", "kv_bytes_per_token_by_component",
                "kv_gib_per_gpu_vs_context", "max_context_tokens", "sparse_mla_intensity", "ridge_point_flop_per_byte",
                "crossover_prompt_len_tp8", "crossover_prompt_len_pcp8", "crossover_prompt_len_tp8_padded",
                "crossover_prompt_len_pcp8_padded", "dcp8_prefill_overhead"):
        assert key in res, key
    for png in ("kv_bytes_by_component", "kv_per_gpu_vs_context", "sparse_mla_intensity", "indexer_vs_mla_flops",
                "dcp8_prefill_overhead"):
        assert (out / f"{png}.png").stat().st_size > 0


def _crossover_by_brute_force(heads_per_gpu: int, query_share: int) -> int:
    """First prompt length L at which the whole prompt's per-GPU indexer FLOPs reach its per-GPU sparse-MLA
    FLOPs, summed query by query (query t scores t keys, attends min(2048, t) rows), from BRIEF §1's
    shapes: 22 indexer layers (21 full layers + the MTP layer's own indexer) at 32 heads x 128 dims, 2 x 32
    x 128 + 2 x 32 (head-weighted sum) = 8,256 FLOPs per score; 79 attention layers (78 + MTP) at 2,176
    FLOPs per row per head (BRIEF §3). `query_share`: 1 (TP8: every GPU runs every query's indexer) or 8
    (PCP8: each GPU 1/8 of the queries)."""
    t = np.arange(1, 400_001, dtype=np.float64)
    indexer = np.cumsum(22 * 8256 * t) / query_share
    mla = np.cumsum(79 * heads_per_gpu * 2176 * np.minimum(2048, t)) / query_share
    return int(t[np.argmax(indexer >= mla)])


def test_values_come_from_the_model(run):
    _, res = run
    cfg = get_preset("glm-5.3")
    assert res["kv_bytes_per_token"] == 54_728
    # the closed-form root lies within one token of the brute-force crossing
    for key, heads, share in (("tp8", 8, 1), ("pcp8", 64, 8)):
        first = _crossover_by_brute_force(heads, share)
        assert first - 1 < res[f"crossover_prompt_len_{key}"] <= first, key
    assert res["crossover_prompt_len_pcp8"] > res["crossover_prompt_len_tp8"] > cfg.index_topk
    rows = res["dcp8_prefill_overhead"]
    assert rows[0]["cached_context"] == 8192 and rows[-1]["cached_context"] == 1_048_576
    assert set(rows[0]) >= {"cached_context", "overhead_frac"}
    assert all(a["overhead_frac"] < b["overhead_frac"] for a, b in itertools.pairwise(rows))
    # the longest context whose busiest rank (ceil(T / N) tokens of a round-robin shard) fits the budget:
    # 15 GiB / 54,728 B = 294,294.1 tokens per GPU
    budget = res["kv_budget_gib_per_gpu"] * 2**30
    assert res["max_context_tokens"]["dcp1"] == 294_294
    for name, tokens in res["max_context_tokens"].items():
        n = int(name.removeprefix("dcp"))
        assert -(-tokens // n) * 54_728 <= budget < -(-(tokens + 1) // n) * 54_728, name
    assert {c["heads"] for c in res["sparse_mla_intensity"]["curve"]} >= {8, 64}


def test_time_crossover_balances_indexer_and_mla_time(run):
    """At the time crossover the whole-prompt prefill spends as long in the indexer as in sparse MLA
    (0.1% bisection), the indexer is cheaper just below it, and it sits right of the FLOP crossover (a
    sparse-MLA FLOP costs more time: bf16 rate plus fp8 dequantisation, vs the indexer's fp8 GEMM)."""
    from glm53 import perfmodel as pm

    _, res = run
    cfg = get_preset("glm-5.3")
    for key, layout, pad in (("tp8", "tp", False), ("tp8_padded", "tp", True), ("pcp8", "pcp", False)):
        x = res[f"crossover_prompt_len_{key}_time"]
        idx, mla = roofline._indexer_and_mla_s(cfg, pm.H200_CALIBRATED, x, layout, pad)
        assert idx == pytest.approx(mla, rel=5e-3), key
        idx, mla = roofline._indexer_and_mla_s(cfg, pm.H200_CALIBRATED, 0.9 * x, layout, pad)
        assert idx < mla, key
        assert x > res[f"crossover_prompt_len_{key}"]
    assert res["hardware"]["name"] == pm.H200_CALIBRATED.name
    old = res["datasheet_spec"]
    assert old["hardware"] == pm.H200.name
    assert [r["cached_context"] for r in old["dcp8_prefill_overhead"]] == [r["cached_context"] for r in res["dcp8_prefill_overhead"]]
    assert old["dcp8_prefill_overhead"][0]["step_s_without_dcp"] != res["dcp8_prefill_overhead"][0]["step_s_without_dcp"]
