"""Tensor parallelism (parallel.tp) on simulated devices against one device.

Model level (`parallel.model.forward(tensor_parallel=True)`): the prompts of
tests/parallel/test_model_cp (37 tokens: longer than the tiny model's top-k 16; 10 tokens: shorter) are
prefilled in one padded row each, then one decode step runs; every real token's logits must match one
device's within 1e-5 of the largest logit, each device holding 1/tp of the split weights and 1/dcp of
the KV. TP4 (the tiny model's 4 heads, one per rank), TP4 x DCP2 and TP8 x DCP8 (heads padded 4 -> 8),
with both DCP backends and both ways of splitting the routed experts (whole experts, EP; or each
expert's width). Engine level: TP4 x DCP2, TP4 x DP2 and TP8 x DCP8 give one device's greedy tokens, and every
logit the engine samples from matches one device's within 1e-5 of the largest. The mid preset
(8 heads; cut to 2 layers) runs TP4, TP4 x DCP2 and TP8 x DCP8 at model level and TP4 x DP2 in the
engine (slow).
"""

import numpy as np
import pytest

# the prompts, batch and one-device reference of the context-parallel model tests
from tests.parallel.test_model_cp import BS, TOL, WINDOW, _batch, _prompts, _single_device


def _tensor_parallel(model, prompts, tp, dcp=1, *, backend="ag_rs", interleave=1, ep=False, form="mqa"):
    """-> (prefill logits [B, WIDTH, V], decode logits [B, V], KV bytes of MLA layer 0 per device,
    {device: weight bytes})."""
    import jax.numpy as jnp

    from glm53.model import compiled
    from kvcache.paged import PagedKVCache
    from parallel import model as pmodel
    from parallel import tp as tp_ops
    from parallel.cp_cache import CpKVCache
    from parallel.mesh import make_mesh

    c = compiled(model)
    mesh = make_mesh(**tp_ops.mesh_sizes(tp, dcp))
    state = tp_ops.place_state(c.state, model.cfg, mesh, ep)
    b, m = len(prompts), -(-WINDOW // (BS * dcp))
    local = PagedKVCache.create(model.cfg, b * m * dcp, BS, np.arange(b * m).reshape(b, m), kv_cache_dtype="float32",
                                include_mtp=False)
    cache = pmodel.place(CpKVCache(local, "cp", dcp, dcp=dcp > 1, interleave=interleave, backend=backend,
                                   heads_split=True, gather_queries=True), mesh)
    tok, pos, nxt, pos1 = _batch(prompts)
    run = dict(graphdef=c.graphdef, mesh=mesh, window=WINDOW, impl="auto", expert_parallel=ep, tensor_parallel=True)
    h, cache = pmodel.forward(state, jnp.asarray(tok), jnp.asarray(pos), cache, form=form, **run)
    prefill = np.asarray(c.logits(c.state, h))
    h, cache = pmodel.forward(state, jnp.asarray(nxt), jnp.asarray(pos1), cache, form="mqa", **run)
    kv = {s.data.nbytes for s in cache.local.mla[0].addressable_shards}
    assert len(kv) == 1 and len(cache.local.mla[0].sharding.device_set) == tp
    return prefill, np.asarray(c.logits(c.state, h))[:, 0], kv.pop(), tp_ops.bytes_on_each_device(state)


def _split_bytes(state) -> tuple[int, int]:
    """(all weight bytes, bytes of the weights TP splits) of an unpadded state."""
    import jax

    from parallel.tp import _kind

    leaves = jax.tree_util.tree_leaves_with_path(state)
    return sum(x.nbytes for _, x in leaves), sum(x.nbytes for p, x in leaves if _kind(p))


def _check(model, cases):
    from glm53.model import compiled
    from parallel import tp as tp_ops

    prompts = _prompts(model.cfg.vocab_size)
    want_prefill, want_decode, single_kv = _single_device(model, prompts, "float32")
    total, split = _split_bytes(compiled(model).state)
    for kw in cases:
        prefill, decode, kv, weights = _tensor_parallel(model, prompts, **kw)
        for i, p in enumerate(prompts):
            scale = np.abs(want_prefill[i, : p.size]).max()
            err = np.abs(prefill[i, : p.size] - want_prefill[i, : p.size]).max() / scale
            assert err <= TOL, (kw, "prefill", p.size, err)
        err = np.abs(decode - want_decode).max() / np.abs(want_decode).max()
        assert err <= TOL, (kw, "decode", err)
        # every device holds the replicated weights and 1/tp of the split ones (padded ones included)
        tp, dcp = kw["tp"], kw.get("dcp", 1)
        assert len(weights) == tp and len(set(weights.values())) == 1, kw
        per_device = weights.popitem()[1]
        assert per_device == tp_ops.bytes_per_device(compiled(model).state, model.cfg, tp, kw.get("ep", False))
        if model.cfg.num_attention_heads % tp == 0 and model.cfg.n_routed_experts % tp == 0:  # nothing padded
            assert per_device == total - split + split // tp, kw
        assert kv == single_kv // dcp, kw  # the latent KV: replicated over tp, split over the DCP sub-group


@pytest.mark.multidevice
def test_small_model_tp_and_tp_dcp_match_one_device(small_model):
    _check(small_model, [
        dict(tp=4, form="mha"),  # TP4, each expert's width split; prefill in the dense form
        dict(tp=4, dcp=2, backend="a2a", interleave=2, ep=True),  # TP4 x DCP2 (mesh tp2 x cp2), EP4
        dict(tp=8, dcp=8, backend="ag_rs", ep=True),  # TP8 x DCP8: 4 heads padded to 8, one expert per rank
    ])


@pytest.mark.multidevice
@pytest.mark.slow
def test_mid_model_tp_and_tp_dcp_match_one_device(small_mid_model):
    """The mid preset's 8 heads (its 2-layer cut, tests/conftest.py): two per rank under TP4 (the split
    that the tiny model's 4 heads never give: a rank's heads are a slice, not one head) and TP4 x DCP2,
    one per rank under TP8 x DCP8 (nothing padded); its 16 experts whole (EP4) or their widths split."""
    _check(small_mid_model, [
        dict(tp=4, form="mha"),
        dict(tp=4, dcp=2, backend="ag_rs", interleave=2, ep=True),
        dict(tp=8, dcp=8, backend="a2a"),
    ])


def _record_logits(engine) -> dict:
    """Wraps the sampler's input of every replica's runner: -> {(req_id, num_generated): logits [V]}, the
    logits each greedy token of `engine.generate` is picked from, filled as the engine runs."""
    seen = {}
    for rep in engine.replicas:
        pick = rep.runner._pick

        def record(logits_RV, rows, idx, pick=pick):
            host = np.asarray(logits_RV)
            for i, row in zip(idx, rows):
                seen[row.req_id, row.num_generated] = host[i].copy()
            return pick(logits_RV, rows, idx)

        rep.runner._pick = record
    return seen


def _assert_logits_match(got: dict, got_ids: list, want: dict, want_ids: list) -> None:
    """Each request's logits at each generated position (`_record_logits`) within TOL of the largest
    |logit| of one device's; requests paired by their order in generate's output (`want` may hold more
    requests than were paired)."""
    pair = dict(zip(got_ids, want_ids))
    assert {(pair[r], n) for r, n in got} == {k for k in want if k[0] in pair.values()}
    for (r, n), logits in got.items():
        ref = want[pair[r], n]
        err = np.abs(logits - ref).max() / np.abs(ref).max()
        assert err <= TOL, (r, n, err)


@pytest.mark.multidevice
def test_engine_tp_dcp_and_tp_dp_greedy_tokens_equal_one_device(small_model):
    """glm53.Engine under DeployConfig(tensor_parallel_size=4, decode_context_parallel_size=2,
    enable_expert_parallel=True) with a swapping KV policy, under tensor_parallel_size=4 x
    data_parallel_size=2 on 8 devices, and under tensor_parallel_size=8 x decode_context_parallel_size=8
    (heads padded): the same greedy tokens as one device, sampled from the same logits (within 1e-5 of
    the largest, every generated position of every request); each device holds 1/tp of the split
    weights (engine.metrics()["weights_bytes_per_device"])."""
    from jax.sharding import PartitionSpec

    from glm53 import DeployConfig, Engine
    from glm53.model import compiled
    from parallel import tp as tp_ops

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, small_model.cfg.vocab_size, n).astype(np.int32) for n in (30, 29)]
    base = dict(block_size=BS, index_block_size=2 * BS, max_model_len=96, max_num_batched_tokens=32, max_num_seqs=2,
                kv_cache_dtype="float32")
    one = Engine(small_model, DeployConfig(**base))
    want_logits = _record_logits(one)
    want = one.generate(prompts + prompts[:1], max_new_tokens=4, greedy=True)
    want_ids = [w.req_id for w in want]
    assert len(want_logits) == 3 * 4  # every generated token of the three requests
    want = want[:2]
    total, split = _split_bytes(compiled(small_model).state)
    assert one.metrics()["weights_bytes_per_device"] == total

    # TP4 x DCP2: an MLA block id covers 4 x 2 tokens, an indexer-key one 16; 12 blocks hold both prompts
    # (4 + 2 each), then both need a fifth MLA block at position 32 and one request is swapped to the
    # host pool (the shards of both DCP ranks) and back
    eng = Engine(small_model, DeployConfig(**base, tensor_parallel_size=4, decode_context_parallel_size=2,
                                          enable_expert_parallel=True, num_gpu_blocks=12, kv_policy="swap",
                                          cpu_offload_bytes=1 << 24))
    logits = _record_logits(eng)
    got = eng.generate(prompts, max_new_tokens=4, greedy=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    _assert_logits_match(logits, [g.req_id for g in got], want_logits, want_ids[:2])
    assert eng.scheduler.stats.offloads >= 1 and eng.scheduler.stats.recomputed_tokens == 0
    assert eng.num_devices == 4 and eng.metrics()["weights_bytes_per_device"] == total - split + split // 4
    kv = eng.runner.cache.mla[0]
    assert len(kv.sharding.device_set) == 4 and kv.sharding.spec == PartitionSpec("cp")

    dp = Engine(small_model, DeployConfig(**base, tensor_parallel_size=4, data_parallel_size=2))
    logits = _record_logits(dp)
    got = dp.generate(prompts + prompts[:1], max_new_tokens=4, greedy=True)
    for g, w in zip(got, want + want[:1]):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    _assert_logits_match(logits, [g.req_id for g in got], want_logits, want_ids)
    assert [dp.replica_of(o.req_id) for o in got] == [0, 1, 0] and dp.num_devices == 8
    assert [sorted(d.id for d in r.runner.cache.mla[0].devices()) for r in dp.replicas] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp.metrics()["weights_bytes_per_device"] == total - split + split // 4
    # the step workspace a GPU's pool leaves out (vLLM's profile run) is per device: a TP4 rank's is smaller
    # (compared on the whole token budget's chunk, one of the programs the profile takes the most over)
    chunk = [(1, 32, 64)]
    assert chunk[0] in one.runner.workspace_shapes() == dp.replicas[1].runner.workspace_shapes()
    assert 0 < dp.replicas[1].runner.step_workspace_bytes(chunk) < one.runner.step_workspace_bytes(chunk)

    # TP8 x DCP8 on the same 8 devices: the tiny model's 4 heads padded to 8 (one per rank), the latent KV
    # round-robin over the same 8 ranks, whole experts per rank (EP8)
    wide = Engine(small_model, DeployConfig(**base, tensor_parallel_size=8, decode_context_parallel_size=8,
                                           enable_expert_parallel=True))
    logits = _record_logits(wide)
    got = wide.generate(prompts, max_new_tokens=4, greedy=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    _assert_logits_match(logits, [g.req_id for g in got], want_logits, want_ids[:2])
    kv = wide.runner.cache.mla[0]
    assert wide.num_devices == 8 and len(kv.sharding.device_set) == 8 and kv.sharding.spec == PartitionSpec("cp")
    assert wide.metrics()["weights_bytes_per_device"] == tp_ops.bytes_per_device(
        compiled(small_model).state, small_model.cfg, 8, True)


@pytest.mark.multidevice
@pytest.mark.slow
def test_engine_tp4_dp2_on_the_mid_model_equals_one_device(small_mid_model):
    """TP4 x DP2 on the mid preset (its 2-layer cut; 8 heads: two per TP rank, the head split the tiny
    model never gives): two replicas of TP4 on devices 0-3 and 4-7, one request each, give one device's
    greedy tokens from the same logits (within 1e-5 of the largest at every generated position)."""
    from glm53 import DeployConfig, Engine

    model = small_mid_model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).astype(np.int32) for n in (21, 30)]
    base = dict(block_size=BS, max_model_len=48, max_num_batched_tokens=32, max_num_seqs=1, kv_cache_dtype="float32")
    one = Engine(model, DeployConfig(**base))
    want_logits = _record_logits(one)
    want = one.generate(prompts, max_new_tokens=3, greedy=True)
    dp = Engine(model, DeployConfig(**base, tensor_parallel_size=4, data_parallel_size=2))
    logits = _record_logits(dp)
    got = dp.generate(prompts, max_new_tokens=3, greedy=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    _assert_logits_match(logits, [g.req_id for g in got], want_logits, [w.req_id for w in want])
    assert [dp.replica_of(o.req_id) for o in got] == [0, 1] and dp.num_devices == 8


def _by_path(tree, is_leaf=None) -> dict:
    import jax

    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def test_tp_layout_pads_heads_and_interleaves_expert_columns(small_model):
    """One device, no mesh: the global TP layout of the tiny model's weights for 8 ranks. Heads 4 -> 8
    (zero columns of q_b / kv_b, zero rows of o_proj), and the routed experts' [gate | up] columns
    interleaved per rank so that rank r's slice is [gate_r | up_r]."""
    from jax.sharding import PartitionSpec

    from glm53.model import compiled
    from parallel import tp as tp_ops

    cfg = small_model.cfg
    state = compiled(small_model).state
    out = tp_ops.prepare_state(state, cfg, 8, expert_parallel=False)
    before, after = _by_path(state), _by_path(out)
    attn = "['layers'][0]['self_attn']"
    q_b = np.asarray(after[f"{attn}['q_b_proj']['weight'].value"]).reshape(cfg.q_lora_rank, 8, cfg.qk_head_dim)
    q_b0 = np.asarray(before[f"{attn}['q_b_proj']['weight'].value"]).reshape(cfg.q_lora_rank, 4, cfg.qk_head_dim)
    np.testing.assert_array_equal(q_b[:, :4], q_b0)
    assert not q_b[:, 4:].any()
    assert not np.asarray(after[f"{attn}['o_proj']['weight'].value"]).reshape(8, cfg.v_head_dim, -1)[4:].any()
    moe = f"['layers'][{cfg.mlp_layer_types.index('sparse')}]['mlp']"
    experts = f"{moe}['experts']['gate_up_proj'].value"
    gu0 = np.asarray(before[experts])  # [E, D, 2F]
    gu = np.asarray(after[experts]).reshape(*gu0.shape[:2], 8, 2, -1)
    f = cfg.moe_intermediate_size
    np.testing.assert_array_equal(gu[:, :, 3, 0], gu0[:, :, 3 * f // 8: 4 * f // 8])  # rank 3's gate columns
    np.testing.assert_array_equal(gu[:, :, 3, 1], gu0[:, :, f + 3 * f // 8: f + 4 * f // 8])  # ... and up columns
    specs = _by_path(tp_ops.state_specs(out, expert_parallel=True), is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert specs[f"{attn}['indexer']['wq_b']['weight'].value"] == PartitionSpec()  # the indexer: replicated
    assert specs[f"{attn}['kv_a_proj_with_mqa']['weight'].value"] == PartitionSpec()  # the latent: replicated
    assert specs[f"{attn}['kv_b_proj']['weight'].value"] == PartitionSpec(None, ("tp", "cp"))
    assert specs[f"{moe}['experts']['down_proj'].value"] == PartitionSpec(("tp", "cp"))
    shared = f"{moe}['shared_experts']['down_proj']['weight'].value"
    assert specs[shared] == PartitionSpec(("tp", "cp"), None)
