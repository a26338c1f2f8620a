"""Smoke test of `python -m experiments.roofline`: the required keys, their values and the PNGs."""

import itertools
import json

import pytest

from experiments import roofline
from glm53 import perfmodel as pm
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


def test_values_come_from_the_model(run):
    _, res = run
    cfg = get_preset("glm-5.3")
    assert res["kv_bytes_per_token"] == 54_728
    assert res["crossover_prompt_len_tp8"] == pytest.approx(pm.crossover_prompt_len(cfg, "tp", 8))
    assert res["crossover_prompt_len_pcp8"] > res["crossover_prompt_len_tp8"] > cfg.index_topk
    rows = res["dcp8_prefill_overhead"]
    assert rows[0]["cached_context"] == 8192 and rows[-1]["cached_context"] == 1_048_576
    assert set(rows[0]) >= {"cached_context", "overhead_frac"}
    assert all(a["overhead_frac"] < b["overhead_frac"] for a, b in itertools.pairwise(rows))
    assert res["max_context_tokens"]["dcp8"] == 8 * res["max_context_tokens"]["dcp1"]
    assert {c["heads"] for c in res["sparse_mla_intensity"]["curve"]} >= {8, 64}
