"""PCP: the 2N-chunk split, and one prefill layer on N simulated devices against one device.

Exactness: the indexer's top-k positions must be identical (integers); attention outputs and LSEs agree
within 1e-5 absolute (float32, values of order 1; the per-query sums run in a different order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel import layers, pcp, reference
from parallel.cp_cache import COUNTERS, counter_totals
from parallel.mesh import make_mesh

TOL = 1e-5
SCALE = 0.25
TOPK = 8


# ---------------------------------------------------------------------------------------- the split (host)
@settings(deadline=None, max_examples=60)
@given(length=st.integers(1, 300), n=st.sampled_from([1, 2, 3, 4, 8, 16]), kind=st.sampled_from(pcp.SPLITS))
def test_split_is_a_padded_permutation_and_round_trips(length, n, kind):
    split = pcp.PcpSplit(length, n, kind)
    pos = split.positions()
    assert pos.shape == (n, split.tokens_per_rank) and split.padded_length % (2 * n) == 0
    assert split.padded_length - 2 * n < length <= split.padded_length
    real = np.sort(pos[pos >= 0])
    np.testing.assert_array_equal(real, np.arange(length))  # each position exactly once
    x = np.arange(length * 3, dtype=np.float32).reshape(length, 3)
    np.testing.assert_array_equal(split.unshard(split.shard(x)), x)
    assert np.all(split.shard(x)[pos.reshape(-1) < 0] == 0)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_balanced_split_gives_every_rank_chunks_g_and_2n_minus_1_minus_g(n):
    c = 5
    split = pcp.PcpSplit(2 * n * c, n)
    pos = split.positions()
    for g in range(n):
        np.testing.assert_array_equal(pos[g, :c], np.arange(g * c, (g + 1) * c))
        np.testing.assert_array_equal(pos[g, c:], np.arange((2 * n - 1 - g) * c, (2 * n - g) * c))
    causal_pairs = (pos + 1).sum(axis=1)  # query t scores t + 1 keys
    assert np.all(causal_pairs == 2 * n * c * c + c)  # identical on every rank
    naive = (pcp.PcpSplit(2 * n * c, n, "naive").positions() + 1).sum(axis=1)
    # rank g of the naive split scores 4 g c^2 + c (2c + 1) pairs: the last one (4nc - 2c + 1) / (2nc + 1) x the mean
    assert naive.max() / naive.mean() == pytest.approx((4 * n * c - 2 * c + 1) / (2 * n * c + 1), rel=1e-12)


def test_split_rejects_bad_fields():
    with pytest.raises(ValueError, match="PcpSplit.n"):
        pcp.PcpSplit(10, 0)
    with pytest.raises(ValueError, match="PcpSplit.length"):
        pcp.PcpSplit(0, 2)
    with pytest.raises(ValueError, match="PcpSplit.kind"):
        pcp.PcpSplit(10, 2, "zigzag")
    with pytest.raises(ValueError, match="expected 10 tokens"):
        pcp.PcpSplit(10, 2).shard(np.zeros((9, 2)))


def test_blocked_indexer_equals_reference_on_one_device(inputs):
    """The tiled causal indexer alone (no mesh), over paged keys of a batch of two requests: exact top-k,
    including ties, padding queries, a top-k larger than the context and tiles that straddle pages."""
    from attention.formats import IndexKeyFormat
    from attention.indexer import PagedKeys, topk_causal_blocked

    blocked = jax.jit(topk_causal_blocked, static_argnames=("topk", "window", "block"))
    for ties in (False, True):
        d = inputs(3, (2, 23), (2, 32), ties=ties)
        pos = np.stack([np.concatenate([np.arange(20), [-1, 3, 28]]), np.arange(9, 32)]).astype(np.int32)
        # request 1's pages in reverse order, 8 positions each: block table [[0..3], [7..4]]
        table = np.concatenate([d["keys"][0], d["keys"][1].reshape(4, 8, -1)[::-1].reshape(32, -1)])
        keys = PagedKeys(jnp.asarray(table), jnp.asarray([[0, 1, 2, 3], [7, 6, 5, 4]], jnp.int32), 8,
                         IndexKeyFormat("float32", table.shape[-1]))
        for topk in (5, 40):
            got, counters = blocked(d["qi"], d["w"], keys, pos, topk=topk, window=32, block=4)
            for b in range(2):
                want = reference.prefill(d["q_lat"][b], d["q_pe"][b], d["qi"][b], d["w"][b], d["rows"][b],
                                         d["keys"][b], pos[b], topk=topk, scale=SCALE)[2]
                np.testing.assert_array_equal(np.asarray(got[b]), want)
            assert int(np.sum(counters["indexer_pairs_causal"])) == int(np.sum(pos[pos >= 0] + 1))
            # tiles of 4 queries visit key blocks up to their last position: 4 x 4 pairs per visit
            tiles = np.pad(pos, ((0, 0), (0, 1)), constant_values=-1).reshape(2, 6, 4).max(axis=2)
            assert int(np.sum(counters["indexer_pairs_computed"])) == 16 * int(np.sum(np.where(tiles >= 0, tiles // 4 + 1, 0)))


def test_work_counters_are_exact_past_int32():
    """The (hi, lo) int32 counters add Python ints and arrays of parts exactly, far past 2^31."""
    from parallel.cp_cache import _add, _pair, zero_counters

    acc = zero_counters(1)["mla_rows_attended"]
    parts = np.full((3, 700), 2**31 - 1, np.int32)  # 2100 parts: more than one row of 1024
    want = 0
    for v in (jnp.asarray(parts), 5 * 2**40 + 12345, jnp.asarray(np.arange(70000, dtype=np.int32)), 65535):
        acc = jax.jit(_add)(acc, _pair(v))
        want += int(np.sum(np.asarray(v, np.int64))) if not isinstance(v, int) else v
        assert int(counter_totals({"x": acc})["x"][0]) == want and 0 <= int(acc[0, 1]) < 2**16


# ------------------------------------------------------------------------------------ PCP on a device mesh
def _check_prefill(n, length, start, capacity, *, kind="balanced", ties=False, topk=TOPK, seed=0, inputs=None,
                   min_chunk=1):
    split = pcp.PcpSplit(length, n, kind, min_chunk=min_chunk)
    d = inputs(seed, (length,), (capacity,), ties=ties)
    cache_rows, cache_keys = d["rows"].copy(), d["keys"].copy()
    cache_rows[start:], cache_keys[start:] = 0, 0  # positions >= start are not cached yet
    new_rows, new_keys = d["rows"][start:start + length], d["keys"][start:start + length]
    res = layers.prefill_layer(make_mesh(cp=n), split, d["q_lat"], d["q_pe"], d["qi"], d["w"], new_rows, new_keys,
                               jnp.asarray(cache_rows), jnp.asarray(cache_keys), start=start, topk=topk, scale=SCALE,
                               block=4)
    full_rows, full_keys = cache_rows.copy(), cache_keys.copy()
    full_rows[start:start + length], full_keys[start:start + length] = new_rows, new_keys
    # The reference sees queries padded to the split's bucket (padding queries have position -1), so the
    # prompts of one bucket share its compiled program too.
    pad = split.padded_length - length
    pos = np.concatenate([np.arange(start, start + length), np.full(pad, -1)]).astype(np.int32)
    q = {k: np.concatenate([d[k], np.zeros((pad,) + d[k].shape[1:], np.float32)]) for k in ("q_lat", "q_pe", "qi", "w")}
    out, lse, sel = (a[:length] for a in reference.prefill(q["q_lat"], q["q_pe"], q["qi"], q["w"], full_rows, full_keys,
                                                           pos, topk=topk, scale=SCALE))
    np.testing.assert_array_equal(np.asarray(res.topk), sel)
    np.testing.assert_allclose(np.asarray(res.out), out, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(res.cache_rows), full_rows)  # every rank's copy (replicated)
    np.testing.assert_array_equal(np.asarray(res.cache_keys), full_keys)
    return res, split


@pytest.mark.multidevice
@pytest.mark.parametrize("length,start,kind,ties", [
    (64, 0, "balanced", False),   # 2N chunks of 4, no padding
    (53, 0, "balanced", False),   # not a multiple of 2N: padded to 64
    (50, 7, "balanced", False),   # after a cached prefix of 7 tokens
    (53, 0, "naive", False),
    (64, 0, "balanced", True),    # tie-heavy index scores
])
def test_prefill_on_8_devices_equals_one_device(length, start, kind, ties, inputs):
    _check_prefill(8, length, start, 80, kind=kind, ties=ties, inputs=inputs, min_chunk=4)


@pytest.mark.multidevice
def test_prefill_short_prompt_and_topk_beyond_context(inputs):
    """5 tokens on 8 ranks: most ranks hold only padding, and top-k (8) exceeds every query's context
    (chunks bucketed to 4 tokens, the other 8-rank tests' program)."""
    _, split = _check_prefill(8, 5, 0, 80, inputs=inputs, min_chunk=4)
    assert split.padded_length == 64 and (split.positions() >= 0).sum() == 5


@pytest.mark.multidevice
def test_prefill_on_16_devices(inputs):
    """37 tokens (padded to 64) after a 3-token prefix, tie-heavy scores."""
    _check_prefill(16, 37, 3, 3 + 64, ties=True, inputs=inputs)


@pytest.mark.multidevice
def test_work_counters_balanced_vs_naive(inputs):
    """Counters measured on the implementation: the balanced split gives every rank the same indexer and
    attention work (64 tokens, 8 ranks, chunks of 4 = one key block); the naive split does not."""
    res, _ = _check_prefill(8, 64, 0, 80, inputs=inputs, min_chunk=4)
    per_rank = counter_totals(res.counters)
    assert set(per_rank) == set(COUNTERS)
    assert np.all(per_rank["indexer_pairs_causal"] == 2 * 8 * 4 * 4 + 4)
    assert per_rank["indexer_pairs_causal"].sum() == 64 * 65 // 2
    assert np.ptp(per_rank["indexer_pairs_computed"]) == 0
    res, _ = _check_prefill(8, 64, 0, 80, kind="naive", inputs=inputs, min_chunk=4)
    naive = counter_totals(res.counters)["indexer_pairs_causal"]
    assert naive.max() / naive.mean() > 1.7


@pytest.mark.multidevice
def test_prefill_checks_its_arguments(inputs):
    d = inputs(0, (10,), (20,))
    with pytest.raises(ValueError, match="split.n"):
        layers.prefill_layer(make_mesh(cp=4), pcp.PcpSplit(10, 2), d["q_lat"], d["q_pe"], d["qi"], d["w"],
                             d["rows"][:10], d["keys"][:10], d["rows"], d["keys"], topk=4, scale=1.0)
    with pytest.raises(ValueError, match="capacity"):
        layers.prefill_layer(make_mesh(cp=2), pcp.PcpSplit(10, 2), d["q_lat"], d["q_pe"], d["qi"], d["w"],
                             d["rows"][:10], d["keys"][:10], d["rows"][:11], d["keys"][:11], start=3, topk=4, scale=1.0)
    assert jax.device_count() >= 16
