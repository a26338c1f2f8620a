"""Tensor parallelism (parallel.tp) on simulated devices against one device.

Model level (`parallel.model.forward(tensor_parallel=True)`): the prompts of
tests/parallel/test_model_cp (37 tokens: longer than the tiny model's top-k 16; 10 tokens: shorter) are
prefilled in one padded row each, then one decode step runs; every real token's logits must match one
device's within 1e-5 of the largest logit, each device holding 1/tp of the split weights and 1/dcp of
the KV. TP4 (the tiny model's 4 heads, one per rank), TP4 x DCP2 and TP8 x DCP8 (heads padded 4 -> 8),
with both DCP backends and both ways of splitting the routed experts (whole experts, EP; or each
expert's width). Engine level: TP4 x DCP2 and TP4 x DP2 give one device's greedy tokens. The mid preset
(8 heads) runs TP8 x DCP8 (slow).
"""

import dataclasses

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
def test_tiny_model_tp_and_tp_dcp_match_one_device(tiny_model):
    _check(tiny_model, [
        dict(tp=4, form="mha"),  # TP4, each expert's width split; prefill in the dense form
        dict(tp=4, dcp=2, backend="a2a", interleave=2, ep=True),  # TP4 x DCP2 (mesh tp2 x cp2), EP4
        dict(tp=8, dcp=8, backend="ag_rs", ep=True),  # TP8 x DCP8: 4 heads padded to 8, one expert per rank
    ])


@pytest.mark.multidevice
@pytest.mark.slow
def test_mid_model_tp8_matches_one_device():
    """The mid preset's 8 heads, one per rank (nothing padded), under TP8 x DCP8 (its 16 experts'
    widths split)."""
    import glm53

    _check(glm53.init("mid", seed=0, std=0.05), [dict(tp=8, dcp=8, backend="a2a")])


@pytest.mark.multidevice
def test_engine_tp4_dcp2_and_tp4_dp2_greedy_tokens_equal_one_device(tiny_model):
    """glm53.Engine under DeployConfig(tensor_parallel_size=4, decode_context_parallel_size=2,
    enable_expert_parallel=True) with a swapping KV policy, and under tensor_parallel_size=4 x
    data_parallel_size=2 on 8 devices: the same greedy tokens as one device; each device holds 1/4 of
    the split weights (engine.metrics()["weights_bytes_per_device"])."""
    from jax.sharding import PartitionSpec

    from glm53 import DeployConfig, Engine
    from glm53.model import compiled

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tiny_model.cfg.vocab_size, n).astype(np.int32) for n in (30, 29)]
    base = dict(block_size=BS, index_block_size=2 * BS, max_model_len=96, max_num_batched_tokens=32, max_num_seqs=2,
                kv_cache_dtype="float32")
    one = Engine(tiny_model, DeployConfig(**base))
    want = one.generate(prompts, max_new_tokens=4, greedy=True)
    total, split = _split_bytes(compiled(tiny_model).state)
    assert one.metrics()["weights_bytes_per_device"] == total

    # TP4 x DCP2: an MLA block id covers 4 x 2 tokens, an indexer-key one 16; 12 blocks hold both prompts
    # (4 + 2 each), then both need a fifth MLA block at position 32 and one request is swapped to the
    # host pool (the shards of both DCP ranks) and back
    eng = Engine(tiny_model, DeployConfig(**base, tensor_parallel_size=4, decode_context_parallel_size=2,
                                          enable_expert_parallel=True, num_gpu_blocks=12, kv_policy="swap",
                                          cpu_offload_bytes=1 << 24))
    got = eng.generate(prompts, max_new_tokens=4, greedy=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    assert eng.scheduler.stats.offloads >= 1 and eng.scheduler.stats.recomputed_tokens == 0
    assert eng.num_devices == 4 and eng.metrics()["weights_bytes_per_device"] == total - split + split // 4
    kv = eng.runner.cache.mla[0]
    assert len(kv.sharding.device_set) == 4 and kv.sharding.spec == PartitionSpec("cp")

    dp = Engine(tiny_model, DeployConfig(**base, tensor_parallel_size=4, data_parallel_size=2))
    got = dp.generate(prompts + prompts[:1], max_new_tokens=4, greedy=True)
    for g, w in zip(got, want + want[:1]):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    assert [dp.replica_of(o.req_id) for o in got] == [0, 1, 0] and dp.num_devices == 8
    assert [sorted(d.id for d in r.runner.cache.mla[0].devices()) for r in dp.replicas] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp.metrics()["weights_bytes_per_device"] == total - split + split // 4


def _by_path(tree, is_leaf=None) -> dict:
    import jax

    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def test_tp_layout_pads_heads_and_interleaves_expert_columns(tiny_model):
    """One device, no mesh: the global TP layout of the tiny model's weights for 8 ranks. Heads 4 -> 8
    (zero columns of q_b / kv_b, zero rows of o_proj), and the routed experts' [gate | up] columns
    interleaved per rank so that rank r's slice is [gate_r | up_r]."""
    from jax.sharding import PartitionSpec

    from glm53.model import compiled
    from parallel import tp as tp_ops

    cfg = tiny_model.cfg
    state = compiled(tiny_model).state
    out = tp_ops.prepare_state(state, cfg, 8, expert_parallel=False)
    before, after = _by_path(state), _by_path(out)
    attn = "['layers'][0]['self_attn']"
    q_b = np.asarray(after[f"{attn}['q_b_proj']['weight'].value"]).reshape(cfg.q_lora_rank, 8, cfg.qk_head_dim)
    q_b0 = np.asarray(before[f"{attn}['q_b_proj']['weight'].value"]).reshape(cfg.q_lora_rank, 4, cfg.qk_head_dim)
    np.testing.assert_array_equal(q_b[:, :4], q_b0)
    assert not q_b[:, 4:].any()
    assert not np.asarray(after[f"{attn}['o_proj']['weight'].value"]).reshape(8, cfg.v_head_dim, -1)[4:].any()
    experts = "['layers'][3]['mlp']['experts']['gate_up_proj'].value"
    gu0 = np.asarray(before[experts])  # [E, D, 2F]
    gu = np.asarray(after[experts]).reshape(*gu0.shape[:2], 8, 2, -1)
    f = cfg.moe_intermediate_size
    np.testing.assert_array_equal(gu[:, :, 3, 0], gu0[:, :, 3 * f // 8: 4 * f // 8])  # rank 3's gate columns
    np.testing.assert_array_equal(gu[:, :, 3, 1], gu0[:, :, f + 3 * f // 8: f + 4 * f // 8])  # ... and up columns
    specs = _by_path(tp_ops.state_specs(out, expert_parallel=True), is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert specs[f"{attn}['indexer']['wq_b']['weight'].value"] == PartitionSpec()  # the indexer: replicated
    assert specs[f"{attn}['kv_a_proj_with_mqa']['weight'].value"] == PartitionSpec()  # the latent: replicated
    assert specs[f"{attn}['kv_b_proj']['weight'].value"] == PartitionSpec(None, ("tp", "cp"))
    assert specs["['layers'][3]['mlp']['experts']['down_proj'].value"] == PartitionSpec(("tp", "cp"))
    shared = "['layers'][3]['mlp']['shared_experts']['down_proj']['weight'].value"
    assert specs[shared] == PartitionSpec(("tp", "cp"), None)


# ------------------------------------------------------------------------------------ fp8 weights under TP
@pytest.fixture(scope="module")
def tiny_fp8_dir(tmp_path_factory, tiny_model):
    """The tiny fp8 fixture checkpoint (tests/fixtures/make_fp8_fixture.py, from the session's tiny model)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "fixtures" / "make_fp8_fixture.py"
    spec = importlib.util.spec_from_file_location("make_fp8_fixture", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    script.write(out, model=tiny_model)
    return out


@pytest.fixture(scope="module")
def tiny_fp8(tiny_fp8_dir):
    """The tiny fp8 fixture loaded with quantization="fp8": every quantised layer narrower than 128, so at
    TP2 and TP4 the 128 x 128 blocks of q_b, o_proj, the dense MLPs and the shared experts straddle the
    ranks."""
    import glm53

    return glm53.from_pretrained(tiny_fp8_dir, quantization="fp8")


@pytest.mark.multidevice
def test_fp8_layers_split_over_tp_ranks_match_one_device(tiny_fp8):
    """Each split fp8 layer of the tiny fixture on TP2, TP4 and TP8 x DCP8 (heads padded 4 -> 8) against the
    same layer on one device, on the same activations: the column-split q_b (96 of 192 columns per rank at
    TP2: fine scale blocks) and kv_b (its absorbed matrix) bit for bit; the row-split o_proj (64 of 128
    rows: an activation group straddles the ranks, its scale from the all-gathered maxima), the dense MLP
    and the shared expert, all-reduced, within float32 summation error (1e-6)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from glm53.model import compiled
    from parallel import tp as tp_ops
    from parallel.mesh import make_mesh

    model, c = tiny_fp8, compiled(tiny_fp8)
    cfg, h = tiny_fp8.cfg, tiny_fp8.cfg.num_attention_heads
    attn, mlp, shared = model.layers[0].self_attn, model.layers[0].mlp, model.layers[3].mlp.shared_experts
    rng = np.random.default_rng(0)
    x_o = rng.standard_normal((5, h * cfg.v_head_dim)).astype(np.float32)
    x_d = rng.standard_normal((5, cfg.hidden_size)).astype(np.float32)
    x_q = rng.standard_normal((5, cfg.q_lora_rank)).astype(np.float32)
    want = [np.asarray(a) for a in (attn.o_proj(jnp.asarray(x_o)), attn.q_b_proj(jnp.asarray(x_q)),
                                    attn.kv_b_proj.matrix(), mlp(jnp.asarray(x_d)), shared(jnp.asarray(x_d)))]
    ax = tp_ops.AXES

    def body(state, x_o, x_d, x_q):
        m = tp_ops.local_modules(nnx.merge(c.graphdef, state), expert_parallel=True)
        a = m.layers[0].self_attn
        return (a.o_proj(x_o), a.q_b_proj(x_q)[None], a.kv_b_proj.matrix()[None], m.layers[0].mlp(x_d),
                jax.lax.psum(m.layers[3].mlp.moe.shared_experts(x_d), ax))

    for tp, dcp in ((2, 1), (4, 1), (8, 8)):
        mesh = make_mesh(**tp_ops.mesh_sizes(tp, dcp))
        state = tp_ops.place_state(c.state, cfg, mesh, True)
        hp = tp_ops.padded(h, tp)
        x_pad = np.pad(x_o, ((0, 0), (0, (hp - h) * cfg.v_head_dim)))  # padded heads' outputs are zeros
        o, q, kv_b, y, s = jax.shard_map(
            body, mesh=mesh, in_specs=(tp_ops.state_specs(state, True), P(None, ax), P(), P()),
            out_specs=(P(), P(ax), P(ax), P(), P()), check_vma=False)(state, x_pad, x_d, x_q)
        heads = lambda a, lead: np.moveaxis(np.asarray(a), 0, -2).reshape(lead + (hp, -1))[..., :h, :]  # noqa: E731
        np.testing.assert_array_equal(heads(q, (5,)), want[1].reshape(5, h, -1))
        np.testing.assert_array_equal(heads(kv_b, (cfg.kv_lora_rank,)), want[2].reshape(cfg.kv_lora_rank, h, -1))
        for got, w, name in ((o, want[0], "o_proj"), (y, want[3], "mlp"), (s, want[4], "shared expert")):
            assert np.abs(np.asarray(got) - w).max() <= 1e-6 * np.abs(w).max(), (tp, dcp, name)


def test_host_weights_are_laid_out_on_the_host_as_on_a_device(tiny_fp8):
    """`prepare_state` of host (numpy) weights gives numpy arrays, equal to the layout of the same weights
    on a device, for float and fp8 leaves (what lets a model larger than one device reach each rank as
    its shard alone: `from_pretrained(on_host=True)`)."""
    import jax

    from glm53.model import compiled
    from parallel import tp as tp_ops

    state = compiled(tiny_fp8).state
    host = jax.tree.map(np.asarray, state)
    for tp, ep in ((2, True), (4, True), (8, True)):
        got, want = tp_ops.prepare_state(host, tiny_fp8.cfg, tp, ep), tp_ops.prepare_state(state, tiny_fp8.cfg, tp, ep)
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(got))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g.astype(np.float32), np.asarray(w).astype(np.float32))


@pytest.mark.multidevice
def test_engine_fp8_tp_greedy_tokens_equal_one_device(tiny_fp8, tiny_fp8_dir):
    """glm53.Engine with the tiny fp8 fixture under TP2 and TP4 x DCP2 (EP over the TP ranks): one device's
    greedy tokens, each device holding the fp8 bytes of its slice (values, fine scales, replicated
    weights: `parallel.tp.bytes_per_device`); the same under TP2 with the checkpoint loaded into host
    memory (`from_pretrained(on_host=True)`)."""
    import jax
    from flax.nnx import state as nnx_state

    from glm53 import DeployConfig, Engine
    from glm53.model import compiled
    from parallel import tp as tp_ops

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tiny_fp8.cfg.vocab_size, n).astype(np.int32) for n in (30, 29)]
    base = dict(block_size=BS, index_block_size=2 * BS, max_model_len=96, max_num_batched_tokens=32, max_num_seqs=2,
                kv_cache_dtype="float32")
    want = Engine(tiny_fp8, DeployConfig(**base)).generate(prompts, max_new_tokens=4, greedy=True)
    state = compiled(tiny_fp8).state
    for tp, dcp in ((2, 1), (4, 2)):
        eng = Engine(tiny_fp8, DeployConfig(**base, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                            enable_expert_parallel=True))
        got = eng.generate(prompts, max_new_tokens=4, greedy=True)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.token_ids, w.token_ids)
        per_device = eng.metrics()["weights_bytes_per_device"]
        assert per_device == tp_ops.bytes_per_device(state, tiny_fp8.cfg, tp, True), tp
        assert any("float8" in str(x.dtype) for x in jax.tree.leaves(eng.runner.state))  # kept in fp8
    # loaded into host memory: each device receives its shard only, and the tokens are the same
    import glm53

    on_host = glm53.from_pretrained(tiny_fp8_dir, quantization="fp8", on_host=True)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(nnx_state(on_host)))
    eng = Engine(on_host, DeployConfig(**base, tensor_parallel_size=2, enable_expert_parallel=True))
    for g, w in zip(eng.generate(prompts, max_new_tokens=4, greedy=True), want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    assert eng.metrics()["weights_bytes_per_device"] == tp_ops.bytes_per_device(state, tiny_fp8.cfg, 2, True)


def test_fp8_tp_refuses_expert_widths_that_straddle_blocks(tiny_fp8):
    """fp8 routed experts split by width need whole 128 x 128 blocks per rank (moe_intermediate_size 32
    cannot): a clear error naming the sizes, from shapes alone; under EP they split whole."""
    from glm53.model import compiled
    from parallel import tp as tp_ops

    state = compiled(tiny_fp8).state
    with pytest.raises(NotImplementedError, match="moe_intermediate_size 32 over 2 ranks.*enable_expert_parallel"):
        tp_ops.check_weights(state, tiny_fp8.cfg, 2, expert_parallel=False)
    tp_ops.check_weights(state, tiny_fp8.cfg, 2, expert_parallel=True)



def _two_turns(model, deploy, first, extra, *, reset: bool):
    """Two turns of the conversations `first` under `deploy`: turn 2 continues each with its outputs and
    `extra[i]` new tokens; `reset`: the device prefix cache is dropped between the turns (turn 2 then finds
    its prefixes in HiSparse's host pools only). -> (tokens per turn, the engine)."""
    from glm53 import Engine

    eng = Engine(model, deploy)
    eng.scheduler.resolve.log = []
    out1 = [o.token_ids.tolist() for o in eng.generate(first, max_new_tokens=10)]
    if reset:
        eng.scheduler.kv.pool.reset_prefix_cache()
    second = [np.concatenate([p, o, e]).astype(np.int32) for p, o, e in zip(first, out1, extra)]
    return (out1, [o.token_ids.tolist() for o in eng.generate(second, max_new_tokens=10)]), eng


_TP2_FULL = {}  # the TP2 full-residency reference, shared by both cases


@pytest.mark.multidevice
@pytest.mark.parametrize("mtp", [False, True])
def test_engine_hisparse_under_tp2_equals_full_residency(tiny_model, mtp):
    """HiSparse under tensor parallelism (issue 24 item 1): on a two-turn workload, a TP2 HiSparse engine
    whose pool is small enough that pages are released, decode steps read host rows through the hot
    buffers and turn 2's chunks stage host rows gives the greedy tokens of a TP2 engine whose pool holds
    everything (the reference is TP2 too: TP's all-reduces round differently from one device, which can
    flip a top-k choice or a near-tied token over 20 tokens, and HiSparse must not change anything
    beyond that). With MTP (3 drafts of the model's MTP layer, sequential verify: non-speculative greedy
    tokens) the verify step, the MTP pass and the draft passes resolve through the view on the mesh
    too. Rows copied = misses x layers of each IndexShare group, per resolve. The two ranks share one host
    pool: each holds half of its pages (kvcache.host.HostMemory(shared=), docs/parallel.md)."""
    from glm53 import DeployConfig

    rng = np.random.default_rng(1)
    first = [rng.integers(0, 512, n).astype(np.int32) for n in (71, 55, 79, 45)]
    extra = [rng.integers(0, 512, n).astype(np.int32) for n in (0, 5, 0, 5)]
    base = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8, tensor_parallel_size=2)
    if not _TP2_FULL:
        _TP2_FULL["tokens"], full = _two_turns(tiny_model, DeployConfig(**base), first, extra, reset=False)
        assert full.scheduler.stats.preemptions == 0
    cfg = tiny_model.cfg
    hs = dict(base, index_block_size=16, kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26,
              cpu_offload_bytes=1 << 24, num_gpu_blocks=48)
    if mtp:
        hs.update(num_gpu_blocks=36, hisparse_device_buffer_size=2 * cfg.index_topk,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3, "verify": "sequential"})
    got, eng = _two_turns(tiny_model, DeployConfig(**hs), first, extra, reset=True)
    assert got == _TP2_FULL["tokens"]
    pol, res = eng.scheduler.policy, eng.scheduler.resolve
    assert pol.stats.released_pages > 0 and pol.stats.residency_steps["mixed"] > 0
    assert res.hot_hits > 0 and res.hot_misses > 0 and res.staged_rows > 0
    layers = cfg.num_layers_with_mtp if mtp else cfg.num_hidden_layers
    per_group = np.diff([i for i in cfg.full_indexer_layers if i < layers] + [layers])
    for rec in res.log:
        np.testing.assert_array_equal(rec.copied, rec.misses @ per_group)
    if mtp:
        assert eng.scheduler.spec.num_drafts > 0 and any(rec.misses[:, -1].any() for rec in res.log)
    eng.scheduler.kv.check()
    pol.host_mla.check()
    host = eng.runner.host.host_tables["mla"][0]
    assert host.sharding.memory_kind == "pinned_host" and len(host.sharding.device_set) == 2
    # one pool shared by the two ranks: each holds half of its pages (the misses gathered where they live)
    assert [x.data.shape[0] for x in host.addressable_shards] == [host.shape[0] // 2] * 2
    pools = sum(t.nbytes for tables in eng.runner.host.host_tables.values() for t in tables)
    assert eng.metrics()["host_pool_bytes_per_device"] == pools // 2
    assert eng.num_devices == 2


@pytest.mark.multidevice
def test_hisparse_staging_under_tp2_reads_what_the_device_holds(tiny_model):
    """A prefill chunk over host-only pages under TP2 (`CpKVCache.attend` with a replicated StagingView):
    its logits equal the same chunk's with every page on the device, bitwise, on one device and under TP2,
    with the same rows staged per layer (each rank stages the same rows), whether each rank holds the
    whole host pool or half of it (one pool shared by the ranks: `kvcache.host.take_shared_rows`)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm53.model import compiled
    from kvcache.host import StagingView
    from kvcache.paged import PagedKVCache
    from parallel import model as pmodel
    from parallel import tp as tp_ops
    from parallel.cp_cache import CpKVCache
    from parallel.mesh import make_mesh

    cfg, c = tiny_model.cfg, compiled(tiny_model)
    prompts = _prompts(cfg.vocab_size)
    tok, pos, _, _ = _batch(prompts)
    b, m = len(prompts), WINDOW // BS
    rng = np.random.default_rng(3)
    tok2 = rng.integers(0, cfg.vocab_size, (b, 8)).astype(np.int32)  # a chunk of 8 after each prompt
    pos2 = np.stack([np.arange(p.size, p.size + 8) for p in prompts]).astype(np.int32)
    table = np.arange(b * m, dtype=np.int32).reshape(b, m)
    host_only = np.where(np.arange(m) < 2, -1, table)  # each row's first 2 pages (8 tokens) on the host only
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(np.asarray(x)), tree)  # noqa: E731

    def run(tp, shared=False):
        local = PagedKVCache.create(cfg, b * m, BS, table, kv_cache_dtype="float32", include_mtp=False)
        if tp > 1:
            mesh = make_mesh(**tp_ops.mesh_sizes(tp, 1))
            state = tp_ops.place_state(c.state, cfg, mesh, False)
            wrap = lambda loc: CpKVCache(loc, "cp", 1, heads_split=True, gather_queries=True)  # noqa: E731
            fwd = lambda t, p, cache: pmodel.forward(  # noqa: E731
                state, jnp.asarray(t), jnp.asarray(p), cache, graphdef=c.graphdef, mesh=mesh, window=WINDOW,
                form="mqa", impl="auto", tensor_parallel=True)
            host = NamedSharding(mesh, P("tp") if shared else P(), memory_kind="pinned_host")
            local = pmodel.place(wrap(local), mesh).local
        else:
            wrap = lambda loc: loc  # noqa: E731
            fwd = lambda t, p, cache: c.forward(c.state, jnp.asarray(t), jnp.asarray(p), cache, window=WINDOW,  # noqa: E731
                                                form="mqa")[:2]
            host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        _, cache = fwd(tok, pos, wrap(local))
        loc = cache.local if tp > 1 else cache
        want, _ = fwd(tok2, pos2, wrap(copy(loc)))
        pools = tuple(jax.device_put(np.asarray(a), host) for a in loc.mla)  # every page has a host copy
        staged = dataclasses.replace(copy(loc).with_block_table(host_only, table),
                                     staging=StagingView.create(pools, table, tile=4, groups=len(cfg.full_indexer_layers),
                                                                host_axis="tp" if shared else None))
        got, out = fwd(tok2, pos2, wrap(staged))
        view = (out.local if tp > 1 else out).staging
        assert view.host_mla[0].sharding.memory_kind == "pinned_host"
        assert {x.data.shape[0] for x in view.host_mla[0].addressable_shards} == {b * m * BS // (2 if shared else 1)}
        return np.asarray(c.logits(c.state, want)), np.asarray(c.logits(c.state, got)), np.asarray(view.staged)

    results = {tp: run(tp) for tp in (1, 2)}
    results["2 shared"] = run(2, shared=True)
    for tp, (want, got, staged) in results.items():
        np.testing.assert_array_equal(got, want)
        assert staged[:, 0].min() > 0
    np.testing.assert_array_equal(results[2][2], results[1][2])
    np.testing.assert_array_equal(results["2 shared"][1], results[2][1])
    np.testing.assert_array_equal(results["2 shared"][2], results[2][2])
    assert np.abs(results[2][0] - results[1][0]).max() <= TOL * np.abs(results[1][0]).max()


@pytest.mark.multidevice
def test_host_pools_shared_by_tp_ranks_hold_one_copy_and_move_the_same_bytes(tiny_model):
    """HostMemory on a TP2 x DCP2 mesh: host pools shared by the TP ranks (each device 1/4 of a pool:
    its DCP shard, halved) against pools replicated over them (1/2 each). The same page copies both
    ways, tier reads and writes give the same device cache and the same canonical page bytes; a pool of
    5 pages is padded to 6 so that both TP ranks hold whole pages."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvcache.host import HostMemory
    from kvcache.paged import PagedKVCache
    from kvcache.transfer import PageCopy
    from parallel.mesh import make_mesh

    cfg, nb, ibs = tiny_model.cfg, 8, 2 * BS
    mesh = make_mesh(tp=2, cp=2)
    rng = np.random.default_rng(0)
    local = PagedKVCache.create(cfg, 2 * nb, BS, np.full((1, 4), -1, np.int32), kv_cache_dtype="float32",
                                include_mtp=False, index_block_size=ibs, index_block_table=np.full((1, 2), -1, np.int32))
    on = lambda a, kind="device": jax.device_put(a, NamedSharding(mesh, P("cp"), memory_kind=kind))  # noqa: E731
    fill = lambda arrays: tuple(on(rng.standard_normal(a.shape).astype(np.float32)) for a in arrays)  # noqa: E731
    cache = dataclasses.replace(local, mla=fill(local.mla), index=fill(local.index))

    def memory(shared):
        return HostMemory(cache, page_rows={"mla": BS, "indexer": ibs}, kv_ranks=2, num_blocks=nb,
                          host=NamedSharding(mesh, P("cp"), memory_kind="pinned_host"),
                          device=NamedSharding(mesh, P("cp"), memory_kind="device"),
                          host_blocks={"mla": 5, "indexer": 3}, shared=("tp", 2) if shared else None)

    results = []
    for shared in (False, True):
        mem = memory(shared)
        assert mem.host_blocks == ({"mla": 6, "indexer": 4} if shared else {"mla": 5, "indexer": 3})
        tables = mem.host_tables["mla"][0]
        assert tables.sharding.memory_kind == "pinned_host"
        assert {x.data.shape[0] for x in tables.addressable_shards} == {2 * mem.host_blocks["mla"] * BS // (4 if shared else 2)}
        c = jax.tree.map(jnp.copy, cache)  # the copies donate the arrays they update
        ops = (PageCopy("mla", "d2h", (1, 6, 3, 7), (4, 0, 1, 2)), PageCopy("indexer", "d2h", (0, 5), (2, 0)))
        c, d2h, _ = mem.apply(ops, c)
        pages = {g: mem.read_host_pages(g, b) for g, b in (("mla", (0, 1, 2, 4)), ("indexer", (0, 2)))}
        mem.write_host_pages("mla", (3,), [pages["mla"][0]])  # a tier load into another host page
        c, _, h2d = mem.apply((PageCopy("mla", "h2d", (3, 4, 1), (0, 2, 5)), PageCopy("indexer", "h2d", (2,), (7,))), c)
        results.append((pages, [np.asarray(a) for a in c.mla + c.index], d2h, h2d, mem.host_bytes_per_device))
    (p0, c0, d0, h0, b0), (p1, c1, d1, h1, b1) = results
    for g in p0:
        for x, y in zip(p0[g], p1[g]):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(c0, c1):
        np.testing.assert_array_equal(x, y)
    assert (d0, h0) == (d1, h1) and d0 > 0 and h0 > 0
    whole = sum(n * mem.page_bytes[g] for g, n in {"mla": 5, "indexer": 3}.items())  # one pool, both DCP ranks
    assert b0 == whole // 2 and b1 == sum(n * mem.page_bytes[g] for g, n in {"mla": 6, "indexer": 4}.items()) // 4
