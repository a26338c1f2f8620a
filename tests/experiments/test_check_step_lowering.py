"""experiments/check_step_lowering on the tiny preset's first 4 layers: the TP8 decode and prefill, TP8 HiSparse decode,
TP8 x DCP8 decode, DCP8 x EP8 decode, PCP8 x DCP8 x EP8 prefill and DP8 x EP8 decode and prefill steps lower for an abstract 8 x H200 mesh on this CPU machine, with the collectives their deployments need
and, at impl="auto" (the kernels, verified on an H200), their Pallas kernels; and the check fails when a step does not lower or lacks
what it must have. (The full-size run is committed under results/step_lowering.)"""

import json

import pytest

from experiments import check_step_lowering as csl

# the tiny preset's first 4 layers: full and shared indexer layers, dense and MoE MLPs, at half the lowering time
TINY = ["--preset", "tiny", "--layers", "4", "--window", "256", "--prefill-tokens", "64"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("steps")
    rc = csl.main(TINY + ["--out", str(out)])
    return rc, json.loads((out / "results.json").read_text()), (out / "README.md").read_text()


def test_steps_lower_with_their_collectives_and_kernels(report):
    rc, res, md = report
    assert rc == 0 and res["failures"] == []
    by = {(r["step"], r["impl"]): r for r in res["steps"]}
    assert set(by) == {(s, i) for s in ("tp8_decode", "tp8_prefill", "tp8_hisparse_decode", "tp8_dcp8_decode", "dcp8_ep8_decode",
                                        "pcp8_dcp8_ep8_prefill", "dp8_ep8_decode", "dp8_ep8_prefill")
                       for i in ("auto", "reference", "pallas")}
    assert all(r["lowered"] for r in by.values())
    layers = res["layers"]
    # TP8 decode: exactly two all-reduces per decoder layer (o_proj, then the MLP or MoE), over 8 ranks,
    # each of one [rows, 1, hidden] activation; nothing else crosses the mesh
    dec = by["tp8_decode", "auto"]
    assert set(dec["collectives"]) == {"psum"}
    assert dec["collectives"]["psum"]["count"] == 2 * layers and dec["collectives"]["psum"]["ranks"] == [8]
    assert dec["collective_ops_in_stablehlo"] == {"psum": 2 * layers}
    # its MoE layers (float weights) run as two grouped GEMMs each; the fp8-weight steps keep XLA's
    # dequantised loop while the fp8 kernels wait for their GPU check (attention.common.NOT_YET_CHECKED_ON_GPU;
    # their lowering "once checked" is tests/attention/test_fp8_gpu_lowering.py's)
    from glm53.config import get_preset

    moe_layers = get_preset("tiny").mlp_layer_types[:layers].count("sparse")
    assert moe_layers > 0 and dec["grouped_gemms"] == 2 * moe_layers
    assert by["pcp8_dcp8_ep8_prefill", "auto"]["grouped_gemms"] == 0
    for impl in ("auto", "reference", "pallas"):
        for step in ("pcp8_dcp8_ep8_prefill", "dp8_ep8_decode"):
            assert not {"fp8_gemm", "fp8_grouped_gemm"} & set(by[step, impl]["kernels"])
    # TP8 prefill: the same two all-reduces per layer, now of a [1, chunk, hidden] activation
    pre_tp = by["tp8_prefill", "auto"]
    assert pre_tp["collectives"]["psum"]["count"] == 2 * layers and set(pre_tp["collectives"]) == {"psum"}
    assert pre_tp["collectives"]["psum"]["operand_bytes_per_rank"] > dec["collectives"]["psum"]["operand_bytes_per_rank"]
    # TP8 HiSparse decode: TP's two all-reduces per layer, and per layer the rows it copies from the host
    # pool the TP ranks share (each holds 1/8 of its rows: an all-reduce of the copied rows, in each of the
    # three static copy sizes, one of which runs in a step); the pool's placement on the host annotated
    hs = by["tp8_hisparse_decode", "auto"]
    # (the copy sizes and "no copy" are the branches of a lax.switch: the largest copy counts, conditional)
    hs_psum = hs["collectives"]["psum"]
    assert set(hs["collectives"]) == {"psum"} and (hs_psum["count"], hs_psum["conditional_count"]) == (2 * layers, layers)
    assert hs["other_custom_calls"].get("annotate_device_placement", 0) > 0
    # "auto" keeps the resolver's reference (its kernel is slower on the H200); "pallas" runs the kernel
    assert set(by["tp8_hisparse_decode", "auto"]["kernels"]) == {"sparse_mqa", "index_scores"}
    assert set(by["tp8_hisparse_decode", "pallas"]["kernels"]) == {"sparse_mqa", "index_scores", "hisparse_resolve"}
    # TP8 x DCP8: DCP's query gathers and LSE merge over the 8 ranks beside TP's all-reduces
    tp_dcp = by["tp8_dcp8_decode", "auto"]["collectives"]
    assert set(tp_dcp) == {"all_gather", "reduce_scatter", "psum"} and tp_dcp["psum"]["count"] == 2 * layers
    assert all(e["ranks"] == [8] for e in tp_dcp.values())
    # DCP decode: the top-k merge's all-gathers, the LSE merge's reduce-scatter (ag_rs), EP's all-reduce
    assert set(by["dcp8_ep8_decode", "auto"]["collectives"]) == {"all_gather", "reduce_scatter", "psum"}
    # PCP x DCP x EP prefill: KV all-gathers and the MoE's all-to-all dispatch
    pre = by["pcp8_dcp8_ep8_prefill", "auto"]
    assert {"all_gather", "all_to_all"} <= set(pre["collectives"])
    # DP8 x EP8 ranks: attention local, only the MoE crosses the mesh, over all 8 ranks: per layer the
    # first dispatch round's three all-to-alls (rows and expert ids out, results back), the overflow
    # flag's all-reduce, and the second round's three if taken; the decode step's messages are smaller
    dp_dec, dp_pre = by["dp8_ep8_decode", "auto"]["collectives"], by["dp8_ep8_prefill", "auto"]["collectives"]
    assert set(dp_dec) == set(dp_pre) == {"all_to_all", "psum"} and dp_dec["psum"]["count"] == moe_layers
    a2a = dp_dec["all_to_all"]
    assert a2a["count"] == a2a["conditional_count"] == 3 * moe_layers and a2a["ranks"] == [8]
    assert a2a["sent_bytes_per_rank"] < dp_pre["all_to_all"]["sent_bytes_per_rank"]
    # the first round carries the mean load + 4 square roots of it, the second the rest of the never-
    # overflowing capacity (tokens x min(top-k, experts per rank)); every message scales with its slots
    from parallel import ep

    for rec, tokens in ((dp_dec, 16), (dp_pre, 64)):
        a2a, cap = rec["all_to_all"], ep.dispatch_capacity(tokens, 2, 1)
        cap1 = ep.first_round_capacity(tokens, 2, 1, 8)
        assert 0 < cap1 < cap and a2a["conditional_sent_bytes_per_rank"] > 0
        assert abs(a2a["sent_bytes_per_rank"] * (cap - cap1) - a2a["conditional_sent_bytes_per_rank"] * cap1) <= (
            1e-6 * a2a["sent_bytes_per_rank"] * cap)
    # impl="auto" lowers the (verified) Pallas kernels through Triton; impl="reference" runs none
    assert by["tp8_decode", "reference"]["kernels"] == {} and by["pcp8_dcp8_ep8_prefill", "reference"]["kernels"] == {}
    assert set(by["tp8_decode", "auto"]["kernels"]) == {"sparse_mqa", "index_scores"}
    assert "sparse_mqa" in pre["kernels"]
    assert "| tp8_decode | auto |" in md and "| tp8_decode | reference |" in md


def test_the_check_fails_without_an_expected_collective(tmp_path, monkeypatch):
    orig = csl.steps

    def wrong(cfg, **kw):  # claim TP decode must reduce-scatter: it does not, so the check must fail
        return [csl.dataclasses.replace(s, expected=("reduce_scatter",)) for s in orig(cfg, **kw)]

    monkeypatch.setattr(csl, "steps", wrong)
    rc = csl.main(TINY + ["--steps", "tp8_decode", "--impls", "auto", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert rc == 1 and res["failures"] == ["tp8_decode impl=auto: no reduce_scatter (expected for this deployment)"]


def test_the_check_fails_when_a_step_does_not_lower(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("injected lowering failure")

    monkeypatch.setattr(csl.parallel_model, "forward", broken)
    rc = csl.main(TINY + ["--steps", "tp8_decode", "--impls", "auto", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert rc == 1 and not res["steps"][0]["lowered"] and "injected" in res["steps"][0]["error"]
    assert "**no**" in (tmp_path / "README.md").read_text()


def test_the_check_fails_on_kernels_where_the_references_run(monkeypatch):
    # a record of a TP8 decode step that lowered with its all-reduces and one kernel
    rec = {"step": "tp8_decode", "lowered": True, "form": "mqa", "kernels": {"sparse_mqa": 78},
           "collectives": {"psum": {"count": 156}}}
    tp8 = next(s for s in csl.steps(csl.get_preset("tiny"), decode_rows=2, window=256, prefill_tokens=64,
                                    block_size=64) if s.name == "tp8_decode")
    assert csl.check({**rec, "impl": "reference"}, tp8) == [
        "tp8_decode impl=reference: Pallas kernels ['sparse_mqa'] where the references run"]
    # "auto" follows the verification flag: the kernels it must have, or none
    assert csl.check({**rec, "impl": "auto"}, tp8) == ["tp8_decode impl=auto: kernels ['index_scores'] not in the lowered module"]
    monkeypatch.setattr(csl.attention_common, "PALLAS_VERIFIED_ON_GPU", False)
    assert csl.check({**rec, "impl": "auto"}, tp8) == [
        "tp8_decode impl=auto: Pallas kernels ['sparse_mqa'] where the references run"]
