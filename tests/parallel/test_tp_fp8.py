"""fp8 weights under tensor parallelism (parallel.tp, issue 24) on simulated devices against one device:
each split fp8 layer of the tiny fixture on the same activations, the host layout of the weights, and
the engine's greedy tokens under TP2 and TP4 x DCP2 (split from tests/parallel/test_tp.py: each file runs
in its own 16-device subprocess, tests/parallel/conftest.py)."""

import numpy as np
import pytest

from tests.parallel.test_model_cp import BS


@pytest.fixture(scope="module")
def tiny_fp8_dir(tmp_path_factory, small_model):
    """The fp8 fixture checkpoint (tests/fixtures/make_fp8_fixture.py) of the session's 2-layer model."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "fixtures" / "make_fp8_fixture.py"
    spec = importlib.util.spec_from_file_location("make_fp8_fixture", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    script.write(out, model=small_model)
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
    moe = cfg.mlp_layer_types.index("sparse")  # the first MoE layer
    attn, mlp, shared = model.layers[0].self_attn, model.layers[0].mlp, model.layers[moe].mlp.shared_experts
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
                jax.lax.psum(m.layers[moe].mlp.moe.shared_experts(x_d), ax))

    for tp, dcp in ((2, 1), (4, 1), (8, 8)):
        mesh = make_mesh(**tp_ops.mesh_sizes(tp, dcp))
        state = tp_ops.place_state(c.state, cfg, mesh, True)
        hp = tp_ops.padded(h, tp)
        x_pad = np.pad(x_o, ((0, 0), (0, (hp - h) * cfg.v_head_dim)))  # padded heads' outputs are zeros
        # jitted: one program per mesh (run eagerly, every op of the body compiled on its own)
        o, q, kv_b, y, s = jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=(tp_ops.state_specs(state, True), P(None, ax), P(), P()),
            out_specs=(P(), P(ax), P(ax), P(), P()), check_vma=False))(state, x_pad, x_d, x_q)
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
