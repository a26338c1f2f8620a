"""DCP: round-robin slot mapping, decode (dense and sparse, both comm backends) and PCP x DCP prefill on
simulated devices against one device.

Exactness: selected top-k positions are identical (integers); outputs and LSEs agree within 1e-5 absolute
(float32, values of order 1: only the summation order differs). Padding queries give exactly 0 and -inf.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parallel import dcp, layers, pcp, reference
from parallel.cp_cache import counter_totals
from parallel.mesh import make_mesh

TOL = 1e-5
SCALE = 0.25
B, T = 3, 2  # requests, query tokens per request (e.g. MTP drafts)


# ---------------------------------------------------------------------------------------- slot mapping
@settings(deadline=None, max_examples=80)
@given(n=st.sampled_from([1, 2, 3, 4, 8, 16]), interleave=st.sampled_from([1, 2, 4]),
       blocks_of_i=st.integers(1, 4), seq=st.integers(1, 400), seed=st.integers(0, 10))
def test_slot_mapping_is_a_round_robin_bijection(n, interleave, blocks_of_i, seq, seed):
    bs = interleave * blocks_of_i
    layout = dcp.DcpLayout(n, bs, interleave)
    m = layout.blocks_per_rank(seq)
    table = np.random.default_rng(seed).permutation(m + 3)[:m][None]  # one request, shuffled physical blocks
    pos = np.arange(seq)
    owner, slot = layout.slot_mapping(pos[None], table)
    owner, slot = owner[0], slot[0]
    np.testing.assert_array_equal(owner, (pos // interleave) % n)
    assert np.all(slot >= 0)
    # every (rank, slot) is used once; a rank's positions are increasing in its local position
    assert len(set(zip(owner.tolist(), slot.tolist()))) == seq
    local = layout.local_position(pos)
    np.testing.assert_array_equal(layout.global_position(local, owner), pos)
    for r in range(n):
        mine = pos[owner == r]
        assert len(mine) == layout.local_length(seq, r)
        np.testing.assert_array_equal(local[owner == r], np.arange(len(mine)))
    # a virtual block of B*N tokens lands in one physical block of B slots on each rank
    vb = pos // (bs * n)
    for v in np.unique(vb):
        for r in range(n):
            blocks = np.unique(slot[(vb == v) & (owner == r)] // bs)
            assert len(blocks) <= 1 and (len(blocks) == 0 or blocks[0] == table[0, v])


def test_slot_mapping_marks_padding_and_missing_blocks():
    layout = dcp.DcpLayout(2, 4, 1)
    _, slot = layout.slot_mapping(np.array([[-1, 0, 9, 16]]), np.array([[5, -1]]))
    np.testing.assert_array_equal(slot, [[-1, 20, -1, -1]])  # pos 9: block -1; pos 16: beyond the table


def test_layout_and_backend_errors_name_the_field():
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        dcp.DcpLayout(2, 4, 0)
    with pytest.raises(ValueError, match="must divide block_size"):
        dcp.DcpLayout(2, 6, 4)
    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        dcp.DcpLayout(0)
    with pytest.raises(ValueError, match="dcp_comm_backend"):
        dcp.check_backend("allreduce")
    q = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="layout.size"):
        layers.decode(make_mesh(cp=1), q, q, np.zeros((1, 1)), np.zeros((1, 1)), jnp.zeros((8, 8)),
                      layout=dcp.DcpLayout(2, 4), scale=1.0)
    with pytest.raises(ValueError, match="dcp_comm_backend"):
        layers.decode(make_mesh(cp=1), q, q, np.zeros((1, 1)), np.zeros((1, 1)), jnp.zeros((8, 8)),
                      layout=dcp.DcpLayout(1, 4), scale=1.0, backend="ring")


def test_shard_cache_rejects_shared_blocks():
    with pytest.raises(ValueError, match="share physical blocks"):
        dcp.shard_cache(np.zeros((2, 8, 3)), [8, 8], np.array([[0, 1], [1, 2]]), dcp.DcpLayout(1, 4), 4)


# ------------------------------------------------------------------------------------------ top-k merge
def test_merge_topk_total_order_across_ranks():
    """Equal scores on different ranks: the lower global position wins, whichever rank sent it."""
    scores = np.array([[[1.0, 0.0, 0.0, -np.inf, 2.0, 0.0, 0.0, 1.0]]], np.float32)
    pos = np.array([[[9, 2, 6, -1, 11, 1, 5, 3]]], np.int32)  # rank 0 sent the first 4, rank 1 the rest
    got = np.asarray(dcp.merge_topk(jnp.asarray(scores), jnp.asarray(pos), 5))
    np.testing.assert_array_equal(got, [[[11, 3, 9, 1, 2]]])
    got = np.asarray(dcp.merge_topk(jnp.asarray(scores), jnp.asarray(pos), 8))
    np.testing.assert_array_equal(got, [[[11, 3, 9, 1, 2, 5, 6, -1]]])


def test_merge_topk_follows_lax_top_k_on_signed_zeros():
    """lax.top_k ranks +0.0 above -0.0 (the reference's order); the merge must do the same."""
    row = np.array([-0.0, 0.0, -0.0, 0.0, -1.0, 0.0], np.float32)
    want = np.asarray(jax.lax.top_k(jnp.asarray(row), 4)[1])
    perm = np.array([5, 2, 0, 4, 3, 1])  # candidates arrive in rank order, not position order
    got = np.asarray(dcp.merge_topk(jnp.asarray(row[perm][None, None]), jnp.asarray(perm[None, None], np.int32), 4))
    np.testing.assert_array_equal(got[0, 0], want)


# ------------------------------------------------------------------------------------------------ decode
def _decode_case(inputs, n, interleave, block_size, blocks, seq_lens, q_pos, *, ties=False, seed=0):
    layout = dcp.DcpLayout(n, block_size, interleave)
    cap = blocks * layout.virtual_block
    d = inputs(seed, (B, T), (B, cap), ties=ties)
    num_blocks = B * blocks + 1
    table = np.random.default_rng(seed).permutation(num_blocks)[:B * blocks].reshape(B, blocks).astype(np.int32)
    rows = dcp.shard_cache(d["rows"], seq_lens, table, layout, num_blocks)
    keys = dcp.shard_cache(d["keys"], seq_lens, table, layout, num_blocks)
    return layout, d, table, jnp.asarray(rows.reshape(-1, rows.shape[-1])), jnp.asarray(keys.reshape(-1, keys.shape[-1])), \
        np.asarray(q_pos, np.int32)


# 8 ranks, interleave 1, blocks of 4, 3 virtual blocks per request (96 positions): a full context, a
# context of 3 tokens (ranks 3..7 own none of it) beside a padding query, and a half context; top-k 16 is
# larger than a rank's 12 local slots and than the short context.
CASE8 = {"n": 8, "interleave": 1, "block_size": 4, "blocks": 3, "seq_lens": [96, 3, 49],
         "q_pos": [[94, 95], [-1, 2], [47, 48]]}


def _check_decode(res, want_out, want_lse, want_sel, q_pos):
    out, lse = np.asarray(res.out), np.asarray(res.lse)
    pad = np.asarray(q_pos) < 0
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    assert np.all(out[pad] == 0) and np.all(lse[pad] == -np.inf)
    np.testing.assert_allclose(out[~pad], want_out[~pad], atol=TOL, rtol=0)
    np.testing.assert_allclose(lse[~pad], want_lse[~pad], atol=TOL, rtol=0)
    if want_sel is not None:
        np.testing.assert_array_equal(np.asarray(res.topk), want_sel)


@pytest.mark.multidevice
@pytest.mark.parametrize("backend", dcp.BACKENDS)
@pytest.mark.parametrize("mode", ["dense", "sparse", "sparse_ties"])
def test_decode_on_8_devices_equals_one_device(backend, mode, inputs):
    layout, d, table, rows, keys, q_pos = _decode_case(inputs, ties=mode == "sparse_ties", **CASE8)
    index = (d["qi"], d["w"], keys, 16) if mode != "dense" else None
    res = layers.decode(make_mesh(cp=8), d["q_lat"], d["q_pe"], q_pos, table, rows, layout=layout, scale=SCALE,
                        backend=backend, index=index)
    ref_index = (d["qi"], d["w"], d["keys"], 16) if mode != "dense" else None
    want = reference.decode(d["q_lat"], d["q_pe"], q_pos, d["rows"], scale=SCALE, index=ref_index)
    _check_decode(res, *want, q_pos)
    attended = counter_totals(res.counters)["mla_rows_attended"]
    if mode == "dense":  # each rank attends exactly the cached positions it owns up to each query
        owned = [sum(int(np.sum((np.arange(p + 1) % 8) == r)) for p in np.ravel(q_pos) if p >= 0) for r in range(8)]
        np.testing.assert_array_equal(attended, owned)
    else:
        assert attended.sum() == int(np.sum(want[2] >= 0))  # every selected row attended once, by its owner


@pytest.mark.multidevice
@pytest.mark.parametrize("backend", dcp.BACKENDS)
def test_sparse_decode_ties_straddling_ranks(backend, inputs):
    """Every index score equal (identical keys), then every score exactly zero (ReLU): the global top-k
    must be the lowest positions, taken from all ranks, exactly as on one device."""
    layout, d, table, _, _, q_pos = _decode_case(inputs, **CASE8)
    mesh = make_mesh(cp=8)
    for keys_BSI, qi in ((np.ones_like(d["keys"]), np.abs(d["qi"])), (np.ones_like(d["keys"]), -np.abs(d["qi"]))):
        keys = dcp.shard_cache(keys_BSI, CASE8["seq_lens"], table, layout, B * 3 + 1)
        res = layers.decode(mesh, d["q_lat"], d["q_pe"], q_pos, table,
                            jnp.asarray(dcp.shard_cache(d["rows"], CASE8["seq_lens"], table, layout, B * 3 + 1)
                                        .reshape(-1, d["rows"].shape[-1])),
                            layout=layout, scale=SCALE, backend=backend,
                            index=(qi, d["w"], jnp.asarray(keys.reshape(-1, keys.shape[-1])), 16))
        want = reference.decode(d["q_lat"], d["q_pe"], q_pos, d["rows"], scale=SCALE,
                                index=(qi, d["w"], keys_BSI, 16))
        _check_decode(res, *want, q_pos)
        sel = np.asarray(res.topk)[0, 1]
        np.testing.assert_array_equal(np.sort(sel[sel >= 0]), np.arange(16))  # positions 0..15: all 8 ranks


@pytest.mark.multidevice
def test_decode_with_given_selection_indexshare(inputs):
    """Shared (IndexShare) layers reuse a full layer's selection: attend exactly those rows."""
    layout, d, table, rows, _, q_pos = _decode_case(inputs, **CASE8)
    sel = reference.decode(d["q_lat"], d["q_pe"], q_pos, d["rows"], scale=SCALE, index=(d["qi"], d["w"], d["keys"], 16))[2]
    res = layers.decode(make_mesh(cp=8), d["q_lat"], d["q_pe"], q_pos, table, rows, layout=layout, scale=SCALE,
                        backend="a2a", topk_BTK=sel)
    want = reference.decode(d["q_lat"], d["q_pe"], q_pos, d["rows"], scale=SCALE, topk_BTK=sel)
    _check_decode(res, *want, q_pos)


@pytest.mark.multidevice
@pytest.mark.parametrize("n,interleave,block_size,backend,mode", [
    (4, 2, 4, "ag_rs", "sparse_ties"),
    (4, 2, 4, "a2a", "dense"),
    (16, 1, 4, "a2a", "sparse_ties"),
])
def test_decode_other_sizes_and_interleaves(n, interleave, block_size, backend, mode, inputs):
    cap = 3 * block_size * n
    seq = [cap, 7, cap // 2 + 1]
    q_pos = [[cap - 2, cap - 1], [-1, 6], [cap // 2 - 1, cap // 2]]
    layout, d, table, rows, keys, q_pos = _decode_case(inputs, n, interleave, block_size, 3, seq, q_pos,
                                                       ties=mode == "sparse_ties")
    index = (d["qi"], d["w"], keys, 16) if mode != "dense" else None
    res = layers.decode(make_mesh(cp=n), d["q_lat"], d["q_pe"], q_pos, table, rows, layout=layout, scale=SCALE,
                        backend=backend, index=index)
    want = reference.decode(d["q_lat"], d["q_pe"], q_pos, d["rows"], scale=SCALE,
                            index=(d["qi"], d["w"], d["keys"], 16) if mode != "dense" else None)
    _check_decode(res, *want, q_pos)


@pytest.mark.multidevice
def test_per_device_kv_is_one_nth_plus_at_most_one_block():
    """Each device's shard (the real arrays on the mesh) holds exactly the rows of the positions its rank
    owns (counted by brute force from `DcpLayout.owner`), in position order, and is the fewest whole blocks
    that hold the busiest rank's rows: so per device 1/N of the context plus at most one block."""
    rng = np.random.default_rng(0)
    for n, seq, bs, interleave in ((8, 1000, 16, 1), (8, 1, 16, 1), (16, 4096, 64, 1), (4, 777, 8, 1),
                                   (8, 1000, 16, 4), (4, 777, 8, 8)):
        layout = dcp.DcpLayout(n, bs, interleave)
        rows = rng.standard_normal((1, seq, 24)).astype(np.float32) + 10  # no row is all zeros
        nb = layout.blocks_per_rank(seq)
        tables = dcp.shard_cache(rows, [seq], np.arange(nb)[None], layout, nb).reshape(-1, 24)
        mesh = make_mesh(cp=n)
        sharded = jax.device_put(tables, NamedSharding(mesh, P("cp")))
        owner = layout.owner(np.arange(seq))
        mine = [np.nonzero(owner == r)[0] for r in range(n)]  # positions each rank owns, ascending
        counts = np.array([len(m) for m in mine])
        assert counts.sum() == seq and counts.max() - counts.min() <= interleave  # round-robin turns
        assert len(sharded.addressable_shards) == n
        for shard in sharded.addressable_shards:
            slots = shard.data.shape[0]
            rank = shard.index[0].start // slots
            held = np.asarray(shard.data)
            np.testing.assert_array_equal(held[:counts[rank]], rows[0, mine[rank]])
            assert not held[counts[rank]:].any()
            # the fewest whole blocks for the busiest rank (block tables are shared: every rank has as many)
            assert slots == -(-counts.max() // bs) * bs, (n, seq, bs, interleave)
            # hence at most 1/N of a one-device cache (whole blocks of the context) plus one block
            assert shard.data.nbytes == slots * 24 * 4 <= -(-seq // bs) * bs * 24 * 4 / n + bs * 24 * 4


# ------------------------------------------------------------------------------------ PCP x DCP prefill
@pytest.mark.multidevice
@pytest.mark.parametrize("n,interleave,start,length", [(8, 1, 21, 37), (4, 2, 5, 30)])
def test_pcp_dcp_prefill_equals_one_device(n, interleave, start, length, inputs):
    """A request with `start` tokens already in the DCP shards prefills `length` more under PCP x DCP:
    same top-k and attention as one device, and the shards afterwards hold exactly the full context."""
    bs = 4
    layout = dcp.DcpLayout(n, bs, interleave)
    split = pcp.PcpSplit(length, n)
    blocks = -(-(start + split.padded_length) // layout.virtual_block)
    cap = blocks * layout.virtual_block
    d = inputs(1, (length,), (cap,), ties=True)
    table = np.random.default_rng(1).permutation(blocks + 2)[:blocks].astype(np.int32)
    num_blocks = blocks + 2
    prefix_rows = dcp.shard_cache(d["rows"][None], [start], table[None], layout, num_blocks)
    prefix_keys = dcp.shard_cache(d["keys"][None], [start], table[None], layout, num_blocks)
    x = prefix_rows.shape[-1]
    res = layers.pcp_dcp_prefill(make_mesh(cp=n), split, d["q_lat"], d["q_pe"], d["qi"], d["w"],
                                 d["rows"][start:start + length], d["keys"][start:start + length], table,
                                 jnp.asarray(prefix_rows.reshape(-1, x)), jnp.asarray(prefix_keys.reshape(-1, 8)),
                                 layout=layout, start=start, topk=8, scale=SCALE, block=4)
    end = start + length
    full_rows, full_keys = d["rows"].copy(), d["keys"].copy()
    full_rows[end:], full_keys[end:] = 0, 0
    out, lse, sel = reference.prefill(d["q_lat"], d["q_pe"], d["qi"], d["w"], full_rows, full_keys,
                                      np.arange(start, end), topk=8, scale=SCALE)
    np.testing.assert_array_equal(np.asarray(res.topk), sel)
    np.testing.assert_allclose(np.asarray(res.out), out, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=TOL, rtol=0)
    want_rows = dcp.shard_cache(d["rows"][None], [end], table[None], layout, num_blocks)
    want_keys = dcp.shard_cache(d["keys"][None], [end], table[None], layout, num_blocks)
    np.testing.assert_array_equal(np.asarray(res.cache_rows).reshape(want_rows.shape), want_rows)
    np.testing.assert_array_equal(np.asarray(res.cache_keys).reshape(want_keys.shape), want_keys)
