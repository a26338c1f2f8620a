"""MTP speculative decoding under PCP and DCP (issue 21 item 5) and TP (issue 24): the MTP layer's KV and
indexer keys live in the same CpKVCache as every layer's (under DCP sharded round-robin over the ranks),
a prefill chunk's forward is split over the PCP ranks and its hidden states come back in token order,
and the verify step, the MTP pass and the draft passes run in shard_maps over the mesh with the tokens
replicated (parallel.model.verify / mtp_forward; under TP over the split weights, the MTP layer's heads
and MLP split like every layer's: TP2 x DCP2, DCP reusing the two TP ranks). Against one
device: greedy tokens equal non-speculative decoding with the MTP layer's own drafts and with oracle
drafts that stand 0..K at a time, the drafts equal a one-device MTP engine's, and a warm engine compiles
nothing more."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

K = 3
_ONE_DEVICE: dict = {}  # one device's greedy tokens and MTP drafts, shared by the layouts
BASE = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, block_size=8, num_gpu_blocks=24)


def _test_mtp():
    """tests/engine/test_mtp.py as a module (its oracle-drafts helper)."""
    path = Path(__file__).resolve().parents[1] / "engine" / "test_mtp.py"
    spec = importlib.util.spec_from_file_location("_engine_test_mtp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record_drafts(eng) -> dict:
    """Every step's drafts per request, in order: {req_id: [drafts, ...]}."""
    execute, seen = eng.runner.execute, {}

    def run(plan):
        res = execute(plan)
        for rid, d in res.drafts.items():
            seen.setdefault(rid, []).append(tuple(d))
        return res

    eng.runner.execute = run
    return seen


@pytest.mark.multidevice
# PCP2 x DCP2 covers what MTP adds under PCP (hidden states back in token order) and under DCP (the MTP
# layer's KV sharded); PCP alone and DCP alone are the model tests' (test_model_cp, test_pcp, test_dcp).
# TP2 x DCP2 splits the MTP layer's heads and MLP over the two TP ranks as TP2 alone does; TP2 alone
# with MTP is tests/parallel/test_tp_hisparse.py's tp2_mtp3 case (each layout compiles its own engine).
@pytest.mark.parametrize("layout", [dict(prefill_context_parallel_size=2, decode_context_parallel_size=2),
                                    dict(tensor_parallel_size=2, decode_context_parallel_size=2)],
                         ids=["pcp2_dcp2", "tp2_dcp2"])
def test_mtp_on_a_mesh_equals_one_device(small_model, layout):
    import jax

    import glm53
    from glm53 import DeployConfig, Engine, SamplingParams
    from glm53.engine.runner import CompileCounter

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 40, 20)]
    if not _ONE_DEVICE:  # the layouts share one device's reference (computed once per process)
        _ONE_DEVICE["want"] = [glm53.generate(small_model, p, 12).token_ids.tolist() for p in prompts]
    want = _ONE_DEVICE["want"]
    engines = {"dcp": Engine(small_model, DeployConfig(**BASE, num_speculative_tokens=K, **layout),
                             devices=jax.devices()[:2])}
    dcp = engines["dcp"]
    assert dcp.runner.mesh is not None and dcp.runner.kv_ranks == layout.get("decode_context_parallel_size", 1)
    if "one" not in _ONE_DEVICE:
        engines["one"] = Engine(small_model, DeployConfig(**BASE, num_speculative_tokens=K))
    # the MTP layer's own drafts (random weights: almost all rejected): the reference tokens, and the
    # drafts of a one-device MTP engine (the MTP layer's KV sharded like every layer's)
    drafts = {}
    for name, eng in engines.items():
        seen = _record_drafts(eng)
        outs = eng.generate(prompts, max_new_tokens=5)
        assert [o.token_ids.tolist() for o in outs] == [w[:5] for w in want], name
        drafts[name] = [seen[o.req_id] for o in outs]
        del eng.runner.execute  # the class method again
    _ONE_DEVICE.setdefault("one", drafts.get("one"))
    assert drafts["dcp"] == _ONE_DEVICE["one"]
    assert dcp.metrics()["spec_num_drafts"] > 0
    # oracle drafts that stand 0..K at a time (poison off: under DCP a block's slots are spread over the
    # ranks), on a warm engine: the same tokens, and no compilation
    ids = [dcp.add_request(p, SamplingParams(12)) for p in prompts]
    log = _test_mtp().with_oracle_drafts(dcp, dict(zip(ids, want)), poison=False)
    with CompileCounter() as compiles:
        while dcp.has_unfinished():
            dcp.step()
    assert [dcp.output(r).token_ids.tolist() for r in ids] == want
    assert {len(t) - 1 for step in log for nd, t in step.values() if nd and t} == set(range(K + 1))
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
