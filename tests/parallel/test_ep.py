"""Expert-parallel MoE (padded all-to-all dispatch) against the single-device `glm53.layers.MoE`.

Tolerance: 1e-6 of the largest output (float32; only the order of the top-k sum differs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm53.config import get_preset
from glm53.layers import MoE
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


def test_dispatch_capacity_never_overflows():
    # a token's top-k experts are distinct, so one rank receives at most min(k, E/N) of its assignments
    assert ep.dispatch_capacity(10, 8, 32) == 80
    assert ep.dispatch_capacity(10, 8, 1) == 10


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
