"""The attention references against brute-force numpy, and against each other."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention import dense_mla, indexer, sparse_mla
from attention.common import masked_softmax_weights
from attention.formats import MLARowFormat


def test_index_scores_match_brute_force():
    rng = np.random.default_rng(0)
    b, t, h, d, s = 2, 5, 3, 8, 11
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    w = rng.normal(size=(b, t, h)).astype(np.float32)
    k = rng.normal(size=(b, s, d)).astype(np.float32)
    pos = np.array([[3, 4, 5, 6, -1], [0, 1, 9, 10, 2]], np.int32)
    got = np.asarray(indexer.index_scores_reference(q, w, k, pos))
    for bi in range(b):
        for ti in range(t):
            for si in range(s):
                if pos[bi, ti] < 0 or si > pos[bi, ti]:
                    assert got[bi, ti, si] == -np.inf
                else:
                    want = sum(w[bi, ti, hh] * max(0.0, q[bi, ti, hh] @ k[bi, si]) for hh in range(h))
                    assert abs(got[bi, ti, si] - want) < 1e-5


def test_topk_total_order_on_ties():
    # ReLU makes exact zero ties common: ties must go to the lower position, -inf picks become -1.
    scores = jnp.asarray([[[0.0, 2.0, 0.0, 2.0, 0.0, -jnp.inf, -jnp.inf]]])
    np.testing.assert_array_equal(np.asarray(indexer.select_topk(scores, 4)), [[[1, 3, 0, 2]]])
    np.testing.assert_array_equal(np.asarray(indexer.select_topk(scores, 7)), [[[1, 3, 0, 2, 4, -1, -1]]])
    assert indexer.select_topk(scores, 100).shape == (1, 1, 7)  # k is capped at the row length


def test_top_k_on_int_keys_equals_lax_top_k():
    """attention.common.top_k (int32 keys on CPU) against lax.top_k on floats: ties, signed zeros, -inf,
    +inf, subnormals, jitted and not."""
    import jax

    from attention.common import top_k

    rng = np.random.default_rng(0)
    pool = np.array([0.0, -0.0, 1.0, -1.0, 2.5, -np.inf, np.inf, 1e-42, -1e-42, 3.0e38], np.float32)
    x = jnp.asarray(np.concatenate([rng.choice(pool, (6, 40)), rng.standard_normal((6, 40)).astype(np.float32)]))
    for k in (1, 7, 40):
        want_v, want_i = jax.lax.top_k(x, k)
        for fn in (top_k, jax.jit(top_k, static_argnums=1)):
            got_v, got_i = fn(x, k)
            np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
            np.testing.assert_array_equal(np.asarray(got_v).view(np.int32), np.asarray(want_v).view(np.int32))


def test_top_k_uses_int_keys_only_on_short_rows():
    """On XLA:CPU `top_k` sorts int32 keys for rows up to INT32_TOPK_MAX_WIDTH and leaves wider rows to
    the float top-k (faster there); both give lax.top_k's result."""
    import jax

    from attention.common import INT32_TOPK_MAX_WIDTH, top_k

    def topk_operand_dtypes(width):
        x = jax.ShapeDtypeStruct((2, width), np.float32)
        eqns = jax.make_jaxpr(lambda a: top_k(a, 4))(x).jaxpr.eqns
        return [str(e.invars[0].aval.dtype) for e in eqns if e.primitive.name == "top_k"]

    assert topk_operand_dtypes(INT32_TOPK_MAX_WIDTH) == ["int32"]
    assert topk_operand_dtypes(INT32_TOPK_MAX_WIDTH + 1) == ["float32"]
    x = jnp.asarray(np.random.default_rng(1).choice(np.array([0.0, -0.0, 1.0, -np.inf], np.float32),
                                                     (3, INT32_TOPK_MAX_WIDTH + 1)))
    got_v, got_i = top_k(x, 300)
    want_v, want_i = jax.lax.top_k(x, 300)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.int32), np.asarray(want_v).view(np.int32))


def test_masked_softmax_empty_row_is_zero_not_nan():
    p, lse = masked_softmax_weights(jnp.ones((2, 3)), jnp.asarray([[True, False, True], [False, False, False]]))
    np.testing.assert_allclose(np.asarray(p), [[0.5, 0, 0.5], [0, 0, 0]])
    assert np.isfinite(lse[0]) and lse[1] == -np.inf


@pytest.mark.parametrize("k", [1, 5, 12])
def test_sparse_mqa_equals_dense_mha_with_absorbed_weights(k):
    """Absorbed sparse attention over selected rows == un-absorbed attention masked to the same rows."""
    rng = np.random.default_rng(k)
    b, t, h, r, p, n, v, s = 2, 3, 4, 16, 8, 6, 5, 12
    lat = rng.normal(size=(b, s, r)).astype(np.float32)
    pe = rng.normal(size=(b, s, p)).astype(np.float32)
    w_uk = rng.normal(size=(r, h, n)).astype(np.float32)
    w_uv = rng.normal(size=(r, h, v)).astype(np.float32)
    q_nope = rng.normal(size=(b, t, h, n)).astype(np.float32)
    q_pe = rng.normal(size=(b, t, h, p)).astype(np.float32)
    sel = np.stack([[np.sort(rng.permutation(s)[:k]) for _ in range(t)] for _ in range(b)]).astype(np.int32)
    sel[0, 0, -1] = -1  # padding entry
    valid = sel >= 0
    g = np.where(valid, sel, 0)
    lat_sel = np.take_along_axis(lat[:, None], g[..., None], axis=2)
    pe_sel = np.take_along_axis(pe[:, None], g[..., None], axis=2)
    q_lat = np.einsum("bthn,rhn->bthr", q_nope, w_uk)
    o_lat, lse_s = sparse_mla.sparse_mqa_reference(q_lat, q_pe, lat_sel, pe_sel, valid, 0.3)
    o_sparse = np.einsum("bthr,rhv->bthv", np.asarray(o_lat), w_uv)
    k_nope = np.einsum("bsr,rhn->bshn", lat, w_uk)
    vv = np.einsum("bsr,rhv->bshv", lat, w_uv)
    mask = dense_mla.topk_mask(jnp.asarray(sel), s)
    o_dense, lse_d = dense_mla.mha_reference(q_nope, q_pe, k_nope, pe, vv, mask, 0.3)
    np.testing.assert_allclose(o_sparse, np.asarray(o_dense), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse_s), np.asarray(lse_d), rtol=1e-5, atol=1e-5)
    if k == 1:  # the only entry of row (0, 0) is padding: no valid row, zero output, lse -inf
        assert np.all(np.asarray(lse_s)[0, 0] == -np.inf) and np.all(o_sparse[0, 0] == 0)


def test_use_dense_mha_rule():
    """The form rule: dense while window <= top-k (any backend, any step); on CPU also for steps of >= 128
    queries per row over windows <= 4 x top-k; never with force_mqa."""
    assert dense_mla.use_dense_mha(256, 256) and dense_mla.use_dense_mha(64, 256, backend="gpu")
    assert not dense_mla.use_dense_mha(256, 256, force_mqa=True)
    assert dense_mla.use_dense_mha(1024, 256, num_queries=128, backend="cpu")
    assert not dense_mla.use_dense_mha(1024, 256, num_queries=127, backend="cpu")
    assert not dense_mla.use_dense_mha(2048, 256, num_queries=1024, backend="cpu")
    assert not dense_mla.use_dense_mha(1024, 256, num_queries=1024, backend="gpu")


@pytest.mark.parametrize("t,s,block", [(37, 45, 16), (64, 64, 16), (5, 70, 32), (20, 20, 256), (300, 300, 256)])
def test_tiled_mha_equals_reference(t, s, block):
    """dense_mla.mha (tiles, online softmax, masked tiles skipped) against mha_reference: ragged tiles,
    padding queries (no valid key: output 0, lse -inf), a causal top-k mask, queries after a prefix,
    rows of different lengths (each (row, query tile) has its own trip count)."""
    rng = np.random.default_rng(t + s)
    b, h = 2, 3
    f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
    q_nope, q_pe, k_nope, pe, vv = f(b, t, h, 8), f(b, t, h, 4), f(b, s, h, 8), f(b, s, 4), f(b, s, h, 6)
    pos = np.broadcast_to(np.arange(s - t, s), (b, t)).copy()
    pos[1, -max(3, t // 3):] = -1  # padding queries (for t=300 a whole query tile of row 1: no key tile visited)
    scores = np.where(np.arange(s)[None, None] <= pos[:, :, None], rng.normal(size=(b, t, s)), -np.inf)
    mask = dense_mla.topk_mask(indexer.select_topk(jnp.asarray(scores, jnp.float32), 9), s)
    want_o, want_l = dense_mla.mha_reference(q_nope, q_pe, k_nope, pe, vv, mask, 0.3)
    got_o, got_l = dense_mla.mha(q_nope, q_pe, k_nope, pe, vv, mask, 0.3, block=block)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got_l), np.asarray(want_l), atol=1e-5, rtol=0)
    assert np.all(np.asarray(got_o)[1, -3:] == 0) and np.all(np.asarray(got_l)[1, -3:] == -np.inf)


def test_topk_mask_ignores_padding():
    m = np.asarray(dense_mla.topk_mask(jnp.asarray([[[2, -1, 0]]]), 4))
    np.testing.assert_array_equal(m, [[[True, False, True, False]]])


@pytest.mark.parametrize("t, block", [(1, 4), (7, 4), (9, 2), (5, 16)])
def test_sparse_mqa_by_slot_equals_reference(t, block):
    rng = np.random.default_rng(t)
    b, h, r, p, k, n = 2, 3, 16, 8, 6, 40
    table = rng.normal(size=(n, r + p)).astype(np.float32)
    slots = rng.integers(-1, n, size=(b, t, k)).astype(np.int32)
    slots[0, 0] = -1  # a query with no valid row at all
    q_lat = rng.normal(size=(b, t, h, r)).astype(np.float32)
    q_pe = rng.normal(size=(b, t, h, p)).astype(np.float32)
    rows_by_slot = sparse_mla.SlotRows(jnp.asarray(table), jnp.asarray(slots), MLARowFormat("float32", r, p))
    out, lse = sparse_mla.sparse_mqa(q_lat, q_pe, rows_by_slot, 0.2, query_block=block)
    rows = np.where((slots >= 0)[..., None], table[np.maximum(slots, 0)], 0)
    ref_out, ref_lse = sparse_mla.sparse_mqa_reference(q_lat, q_pe, rows[..., :r], rows[..., r:], slots >= 0, 0.2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(lse)[0, 0] == -np.inf) and np.all(np.asarray(out)[0, 0] == 0)


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl"):
        indexer.index_scores(jnp.zeros((1, 1, 1, 4)), jnp.zeros((1, 1, 1)), None, jnp.zeros((1, 1), jnp.int32),
                             window=4, impl="triton")
