import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention.common import masked_softmax_weights
from attention.merge import merge, merge_two


def _attend(s_QS, v_SD, mask_QS):
    p, lse = masked_softmax_weights(s_QS, mask_QS)
    return p @ v_SD, lse


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_merge_of_disjoint_parts_equals_whole(parts):
    rng = np.random.default_rng(parts)
    q, s, d = 6, 23, 8
    scores = jnp.asarray(rng.normal(size=(q, s)) * 3, jnp.float32)
    v = jnp.asarray(rng.normal(size=(s, d)), jnp.float32)
    mask = jnp.asarray(rng.random((q, s)) < 0.7).at[0].set(False)  # query 0 has no row at all
    owner = rng.integers(0, parts, size=s)  # rows split among parts; a part may own nothing for a query
    outs, lses = zip(*[_attend(scores, v, mask & jnp.asarray(owner == i)[None]) for i in range(parts)])
    out, lse = merge(jnp.stack(outs), jnp.stack(lses))
    want_out, want_lse = _attend(scores, v, mask)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[1:], want_lse[1:], rtol=1e-6)
    assert lse[0] == -np.inf and np.all(out[0] == 0)


def test_empty_part_is_ignored_even_if_its_output_is_nan():
    out = jnp.array([[1.0, 2.0], [jnp.nan, jnp.nan]])
    lse = jnp.array([0.5, -jnp.inf])
    o, l = merge(out, lse)
    np.testing.assert_array_equal(o, [1.0, 2.0])
    assert l == 0.5


def test_merge_along_other_axis_and_pairwise():
    rng = np.random.default_rng(0)
    out = jnp.asarray(rng.normal(size=(3, 4, 5, 7)), jnp.float32)  # [B, N, H, D]
    lse = jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32)
    o_ax, l_ax = merge(out, lse, axis=1)
    o0, _ = merge(jnp.moveaxis(out, 1, 0), jnp.moveaxis(lse, 1, 0))
    np.testing.assert_allclose(o_ax, o0, rtol=1e-6)
    acc_o, acc_l = out[:, 0], lse[:, 0]
    for i in range(1, 4):
        acc_o, acc_l = merge_two(acc_o, acc_l, out[:, i], lse[:, i])
    np.testing.assert_allclose(acc_o, o_ax, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc_l, l_ax, rtol=1e-6)


def test_merge_is_jittable_and_large_lse_is_stable():
    out = jnp.ones((2, 3, 4))
    lse = jnp.array([[1000.0, -1000.0, 5.0], [999.0, -jnp.inf, 5.0]])
    o, l = jax.jit(merge)(out, lse)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(l))
    np.testing.assert_allclose(l[0], 1000.0 + np.log1p(np.exp(-1.0)), rtol=1e-6)
