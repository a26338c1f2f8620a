"""Expert-parallel MoE (padded all-to-all dispatch in two rounds) against the single-device `glm53.layers.MoE`.

Tolerance: 1e-6 of the largest output (float32; only the order of the top-k sum differs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm53.config import get_preset
from glm53.layers import Fp8Experts, MoE
from parallel import ep
from parallel.mesh import make_mesh


@functools.lru_cache(maxsize=1)
def _layer_and_reference():
    """A tiny-config MoE with 16 experts, random weights (std 0.3, far from the init's 0.02, and a non-zero
    correction bias so the chosen experts differ from the unbiased scores' choice), 48 tokens and the
    single-device output. Built without eager JAX ops (each would compile)."""
    cfg = get_preset("tiny").replace(n_routed_experts=16)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)))
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(state)
    state = jax.tree.unflatten(treedef, [(0.3 * rng.standard_normal(a.shape)).astype(np.float32) for a in leaves])
    layer = nnx.merge(graphdef, state)
    x = rng.standard_normal((48, cfg.hidden_size)).astype(np.float32)
    want = np.asarray(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x[None])[0])(state, x))
    return layer, x, want


@pytest.mark.multidevice
@pytest.mark.parametrize("dp,cp", [(1, 8), (2, 8)])
def test_expert_parallel_moe_equals_one_device(dp, cp):
    """16 experts over the 8-rank context axis (2 per rank), and over dp x cp = 16 ranks (1 per rank)."""
    layer, x, want = _layer_and_reference()
    axis = ("dp", "cp") if dp > 1 else "cp"
    got = np.asarray(ep.moe(make_mesh(dp=dp, cp=cp), layer, x, axis=axis))
    np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max(), rtol=0)


@pytest.mark.multidevice
def test_expert_parallel_fp8_experts_equal_one_device():
    """fp8 experts (glm53.layers.Fp8Experts: weights and block scales split on the expert axis) under EP
    equal the single-device fp8 layer: each token's activations quantise the same on any rank."""
    layer, x, _ = _layer_and_reference()
    layer = nnx.merge(*nnx.split(layer))  # a copy: the cached layer stays float
    layer.experts = Fp8Experts.from_experts(layer.experts)
    graphdef, state = nnx.split(layer)
    want = np.asarray(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x[None])[0])(state, x))
    got = np.asarray(ep.moe(make_mesh(cp=8), layer, x, axis="cp"))
    np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max(), rtol=0)


@functools.lru_cache(maxsize=1)
def _top4_layer():
    """16 experts, top-4, random expert weights (std 0.3) and 48 tokens; the routing is set per case through
    the router's weights and correction bias (arrays of the state: every case reuses one compiled program)."""
    cfg = get_preset("tiny").replace(n_routed_experts=16, num_experts_per_tok=4)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)))
    rng = np.random.default_rng(1)
    leaves, treedef = jax.tree.flatten(state)
    state = jax.tree.unflatten(treedef, [(0.3 * rng.standard_normal(a.shape)).astype(np.float32) for a in leaves])
    x = rng.standard_normal((48, cfg.hidden_size)).astype(np.float32)
    return cfg, graphdef, state, x


def _adversarial_routings(cfg):
    """{name: (router weight [D, E], correction bias [E])} that pile the assignments onto few ranks."""
    d, e, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    zero_w = np.zeros((d, e), np.float32)
    first, last = np.zeros(e, np.float32), np.zeros(e, np.float32)
    first[:k], last[-k:] = 1, 1
    # x[:, 0] > 0: experts 0..k-1 score above 1/2 (sigmoid), experts E-k..E-1 below, the rest 1/2; x[:, 0] < 0:
    # the reverse. Unequal scores, so the combine weights differ per token and per expert.
    by_sign = zero_w.copy()
    by_sign[0, :k], by_sign[0, -k:] = np.arange(1, k + 1), -np.arange(1, k + 1)
    return {"all tokens to experts 0..k-1": (zero_w, first), "all tokens to experts E-k..E-1": (zero_w, last),
            "half to the first experts, half to the last": (by_sign, np.zeros(e, np.float32))}


def _with_router(state, weight, bias):
    """The state with the router's weight [D, E] and correction bias [E] replaced."""
    def put(path, a):
        keys = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        if keys[0] == "gate":
            return {"weight": weight, "e_score_correction_bias": bias}[keys[1]]
        return a

    return jax.tree_util.tree_map_with_path(put, state)


@pytest.mark.multidevice
def test_dispatch_capacity_never_overflows():
    """Routings that fill a destination's dispatch buffer as far as any routing can (every token sends
    min(k, E/N) assignments to one rank) run through the real padded all-to-all dispatch, past its first
    round into the second: nothing is dropped or overwritten, so the output equals one device's. 16 experts, top-4, over 2 ranks (8 experts each: all
    4 of a token's experts on one rank), 8 (2 each) and dp x cp = 16 (1 each)."""
    cfg, graphdef, state, x = _top4_layer()
    reference = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x[None])[0])
    route = jax.jit(lambda st, x: nnx.merge(graphdef, st).gate(x)[0])
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    second_round = False
    for dp, cp in ((1, 2), (1, 8), (2, 8)):
        mesh, axis, ranks = make_mesh(dp=dp, cp=cp), ("dp", "cp") if dp > 1 else "cp", dp * cp
        e_local, n_local = e // ranks, x.shape[0] // ranks
        fullest = 0
        for name, (w, bias) in _adversarial_routings(cfg).items():
            st = _with_router(state, w, bias)
            layer = nnx.merge(graphdef, st)
            idx = np.asarray(route(st, x))
            # brute force: assignments each source rank sends to each destination rank
            sent = np.zeros((ranks, ranks), int)
            for t, experts in enumerate(idx):
                for ex in experts:
                    sent[t // n_local, ex // e_local] += 1
            assert sent.max() <= ep.dispatch_capacity(n_local, k, e_local), (name, ranks)
            fullest = max(fullest, sent.max())
            want = np.asarray(reference(st, x))
            got = np.asarray(ep.moe(mesh, layer, x, axis=axis))
            np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max(), rtol=0,
                                       err_msg=f"{name}, {ranks} ranks")
        # some routing sent a destination as many assignments as any routing can: min(k, E/N) per token,
        # more than the first dispatch round holds (where it does not hold it all), so the second round
        # (lax.cond) ran and lost nothing
        assert fullest == n_local * min(k, e_local), ranks
        second_round |= fullest > ep.first_round_capacity(n_local, k, e_local, ranks)
    assert second_round


def test_first_round_capacity():
    """The mean load per destination plus four square roots of it, within [1, the never-overflowing
    capacity]."""
    assert ep.first_round_capacity(2048, 8, 32, 8) == 2230  # PCP8 prefill rank: 2,048 + 4 x 45.25
    assert ep.first_round_capacity(16, 8, 32, 8) == 32  # a DP8 decode rank's 16 tokens: 16 + 4 x 4, of 128
    assert ep.first_round_capacity(24, 4, 8, 2) == 76 and ep.first_round_capacity(6, 4, 2, 8) == 10
    assert ep.first_round_capacity(4, 4, 8, 2) == 16 == ep.dispatch_capacity(4, 4, 8)  # 8 + 4 x 2.83: all of it
    assert ep.first_round_capacity(3, 4, 1, 16) == 3 == ep.dispatch_capacity(3, 4, 1)  # one round
    assert ep.first_round_capacity(8, 1, 1, 2, sigmas=0.0) == 4 and ep.first_round_capacity(1, 1, 1, 2) == 1


@pytest.mark.multidevice
def test_padding_tokens_are_not_dispatched():
    """Tokens marked invalid (padding: all alike, so all routed to the same experts, which would pile them
    onto a few ranks) get the shared expert only and take no dispatch slot; the others are unchanged."""
    from jax.sharding import PartitionSpec as P

    layer, x, want = _layer_and_reference()
    valid = np.ones(48, bool)
    valid[5::6] = False  # one padding token per rank, all the same row
    x = np.where(valid[:, None], x, x[0])
    graphdef, state = nnx.split(layer)
    mesh = make_mesh(cp=8)

    @jax.jit
    def run(state, x, valid):
        body = lambda st, x, v: ep.moe_local(nnx.merge(graphdef, st), x, axis="cp", valid_N=v)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(ep.state_specs(state, "cp"), P("cp"), P("cp")),
                             out_specs=P("cp"), check_vma=False)(state, x, valid)

    got = np.asarray(run(state, x, valid))
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-6 * np.abs(want).max(), rtol=0)
    shared = np.asarray(jax.jit(lambda st, x: nnx.merge(graphdef, st).shared_experts(x))(state, x[~valid]))
    np.testing.assert_allclose(got[~valid], shared, atol=1e-6 * np.abs(shared).max(), rtol=0)


def _abstract(cfg):
    """The layer's structure with shapes only (the argument checks need no weights)."""
    return nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32))


def test_expert_parallel_rejects_unknown_axis():
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match="axis 'ep' is not in the mesh"):
        ep.moe(make_mesh(cp=1), _abstract(cfg), np.zeros((4, cfg.hidden_size)), axis="ep")


@pytest.mark.multidevice
def test_expert_parallel_checks_sizes():
    cfg = get_preset("tiny").replace(n_routed_experts=6)
    with pytest.raises(ValueError, match="n_routed_experts"):
        ep.moe(make_mesh(cp=4), _abstract(cfg), np.zeros((8, cfg.hidden_size), np.float32))
    layer = _abstract(get_preset("tiny"))
    with pytest.raises(ValueError, match="number of tokens"):
        ep.moe(make_mesh(cp=4), layer, np.zeros((10, cfg.hidden_size), np.float32))
