"""`python -m experiments.roofline`: its figures against hand computations from BRIEF §2-§5's shapes, and
the figures drawn."""

import itertools
import json

import numpy as np
import pytest

from experiments import roofline
from glm53 import perfmodel as pm
from glm53.config import get_preset
from tests.experiments.figures import assert_drawn

GiB = 2**30
# BRIEF §2: a token's KV is a 656 B fp8_ds_mla row (512 fp8 + 4 x 4 B scales + 64 bf16 rope) in each of the
# 78 layers and the MTP layer, and a 132 B fp8 indexer key (128 + a 4 B scale) in each of the 21 full
# (IndexShare) layers and the MTP layer's own indexer
KV_BYTES = 656 * (78 + 1) + 132 * (21 + 1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline")
    roofline.main(["--out", str(out)])
    return out, json.loads((out / "roofline.json").read_text())


def test_kv_figures_are_the_hand_count(run):
    """54,728 B per token by component; the per-GPU KV of a 1M context, whole and over DCP8 (BRIEF §2: 53.4
    GiB and 6.7 GiB per GPU), at one point of the figure's curve too."""
    _, res = run
    assert res["kv_bytes_per_token"] == KV_BYTES == 54_728
    assert res["kv_bytes_per_token_by_component"] == {"mla_main": 656 * 78, "mla_mtp": 656, "indexer_main": 132 * 21,
                                                       "indexer_mtp": 132}
    assert res["kv_gib_for_1048576_tokens"] == 2**20 * KV_BYTES / GiB == pytest.approx(53.4, abs=0.05)
    assert res["kv_gib_per_gpu_1048576_tokens_dcp8"] == 2**17 * KV_BYTES / GiB == pytest.approx(6.7, abs=0.05)
    curve = res["kv_gib_per_gpu_vs_context"]
    at = curve["context_tokens"].index(65536)
    assert curve["dcp4"][at] == 16384 * KV_BYTES / GiB  # each of 4 ranks holds every 4th token


def test_sparse_mla_intensity_is_brief_section_3(run):
    """One query token over 2,048 selected rows: 2,176 FLOPs per row per head (2 x 576 QK + 2 x 512 PV) over
    2,048 x 660 B of rows + 2,176 B of bf16 query and output per head. BRIEF §3: about 26 FLOP/byte at 8
    heads, 191 at 64, against a 206 FLOP/byte ridge (989 TFLOPS bf16 / 4.8 TB/s)."""
    _, res = run
    si = res["sparse_mla_intensity"]
    for heads, published in ((8, 26), (64, 191)):
        hand = heads * 2048 * 2176 / (2048 * 660 + heads * 2176)
        assert si[f"heads_{heads}"]["useful_flop_per_byte"] == pytest.approx(hand, rel=1e-12)
        assert hand == pytest.approx(published, rel=0.005)
        (point,) = [c for c in si["curve"] if c["heads"] == heads]
        assert point["useful_flop_per_byte"] == pytest.approx(hand, rel=1e-12)
    # 8 heads padded to the fp8 kernel's 64: 64 heads' FLOPs over 8 heads' bytes, 8 heads' useful FLOPs
    padded = si["heads_8_padded_to_kernel"]
    assert padded["executed_flop_per_byte"] == pytest.approx(64 * 2048 * 2176 / (2048 * 660 + 64 * 2176), rel=1e-12)
    assert padded["useful_flop_per_byte"] == pytest.approx(8 * 2048 * 2176 / (2048 * 660 + 64 * 2176), rel=1e-12)
    assert res["ridge_point_flop_per_byte"] == pytest.approx(989e12 / 4.8e12, rel=1e-12) == pytest.approx(206, abs=0.1)


def test_the_figures_are_drawn(run):
    """Each PNG at its figure size (120 dpi) with every data series in it."""
    out, _ = run
    for name, size, series in (("kv_bytes_by_component", (6.5, 4), ("C0", "C1")),
                               ("kv_per_gpu_vs_context", (7, 4.5), ("C0", "C1", "C2", "C3", "C4")),
                               ("sparse_mla_intensity", (7, 4.5), ("C0",)),  # C1 is drawn translucent
                               ("indexer_vs_mla_flops", (11, 4.5), ("C0", "C1", "C2")),
                               ("dcp8_prefill_overhead", (11, 4.5), ("C0", "C3"))):
        assert_drawn(out / f"{name}.png", size, 120, series)


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
    # the closed-form root lies within one token of the brute-force crossing
    for key, heads, share in (("tp8", 8, 1), ("pcp8", 64, 8)):
        first = _crossover_by_brute_force(heads, share)
        assert first - 1 < res[f"crossover_prompt_len_{key}"] <= first, key
    assert res["crossover_prompt_len_pcp8"] > res["crossover_prompt_len_tp8"] > cfg.index_topk
    rows = res["dcp8_prefill_overhead"]
    assert [r["cached_context"] for r in rows] == [2**k for k in range(13, 21)]
    assert all(a["overhead_frac"] < b["overhead_frac"] for a, b in itertools.pairwise(rows))
    # DCP8's per-step gather: every GPU receives the 7/8 of the cached context it does not hold, a token's
    # whole KV (every layer's MLA row, every full layer's indexer key)
    for r in rows:
        assert r["dcp_gather_nvlink_bytes_per_gpu"] == r["cached_context"] * 7 // 8 * KV_BYTES
        # vLLM's: the 7 other shards of the whole request (cached + the 2,048-token chunk) as bf16 rows of
        # 512 + 64 values, in each of the 79 attention layers
        assert r["dcp_gather_nvlink_bytes_per_gpu_vllm"] == (r["cached_context"] + 2048) * 7 // 8 * 1152 * 79
    # vLLM's schedule overlaps nothing: its overhead rises with context, above the fp8_rows form's
    assert all(a["overhead_frac_vllm"] < b["overhead_frac_vllm"] for a, b in itertools.pairwise(rows))
    assert all(r["overhead_frac_vllm_dcp_prefetch"] < r["overhead_frac"] < r["overhead_frac_vllm"] for r in rows[-3:])
    # the longest context whose busiest rank (ceil(T / N) tokens of a round-robin shard) fits the budget:
    # 15 GiB / 54,728 B = 294,294.1 tokens per GPU
    budget = res["kv_budget_gib_per_gpu"] * 2**30
    assert res["max_context_tokens"]["dcp1"] == 294_294
    for name, tokens in res["max_context_tokens"].items():
        n = int(name.removeprefix("dcp"))
        assert -(-tokens // n) * 54_728 <= budget < -(-(tokens + 1) // n) * 54_728, name


def test_time_crossover_balances_indexer_and_mla_time(run):
    """At the time crossover the whole-prompt prefill spends as long in the indexer as in sparse MLA
    (0.1% bisection), the indexer is cheaper just below it, and it sits right of the FLOP crossover (a
    sparse-MLA FLOP costs more time: bf16 rate plus fp8 dequantisation, vs the indexer's fp8 GEMM). The
    datasheet section holds the same figures on the uncalibrated spec."""
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
    assert set(old) == {"hardware", *roofline.DATASHEET_KEYS}
    assert old["crossover_prompt_len_tp8_time"] == roofline.time_crossover(cfg, pm.H200, "tp")
    first = old["dcp8_prefill_overhead"][0]  # a 2,048-token PCP8 chunk over 8K cached tokens
    assert first["step_s_without_dcp"] == pm.prefill_step(cfg, pm.H200, 2048, 8192, pcp=8).time_s()
    assert first["step_s_with_dcp8"] == pm.prefill_step(cfg, pm.H200, 2048, 8192, pcp=8, dcp=8).time_s()
