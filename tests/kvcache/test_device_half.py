"""The device half of a KV policy (kvcache.policies.device): each registered policy's half (built by its
spec's `device_half`), and which width groups HiSparse's half serves with a view (a decode group only when some
row holds a hot buffer, a prefill group only when some row has host-only pages), and HiSparse's half as the
one owner of its hot buffers: it makes them and runs `ResetLease` on them, the host memory knows neither.
The views' numbers are tests/kvcache/test_host.py's and tests/engine/test_hisparse.py's; only the lease
reset compiles here."""

import types

import jax
import numpy as np
import pytest

import glm53
from kvcache.host import HostMemory
from kvcache.paged import PagedKVCache
from kvcache.transfer import ResetLease

from kvcache.policies import policy_spec
from kvcache.policies.device import DeviceHalf, SavedCopies
from kvcache.policies.hisparse import HiSparseRow
from kvcache.policies.hisparse.device import HiSparseDevice

DEPLOY = types.SimpleNamespace(num_speculative_tokens=0, hisparse_stages_rows=True, hisparse_prefill_tile_tokens=64,
                               max_blocks_per_seq=7, max_index_blocks_per_seq=3)
SIZES = types.SimpleNamespace(max_leases=4, hot_rows=96)


@pytest.mark.parametrize("name,kind", [("preempt", DeviceHalf), ("offload", DeviceHalf), ("swap", SavedCopies),
                                       ("hisparse", HiSparseDevice)])
def test_each_policy_name_maps_to_its_device_half(name, kind):
    half = policy_spec(name).device_half(DEPLOY, SIZES, index_topk=32)
    assert type(half) is kind
    blocks = {"mla": 7, "indexer": 3} if name == "swap" else {}
    assert half.warmup_blocks() == blocks


def test_a_half_without_device_state_serves_no_group_and_records_nothing():
    half = DeviceHalf()
    cache = object()
    assert half.group_views([HiSparseRow((0,), 1)], decode=True, tables_mla=[(0,)], padded=1) is None
    assert half.empty_views(4, decode=True) is None
    assert half.attach(cache, None) is cache and half.detach(cache) is cache
    assert half.take_records(("a",)) == ((), (), 0)


def test_hisparse_views_only_the_groups_that_need_them():
    half = HiSparseDevice(max_leases=4, hot_rows=96, index_topk=32, k=0, stage_rows=True, tile=64)
    leased, unleased = HiSparseRow((3, -1), 0), HiSparseRow((-1, -1), -1)
    assert half.group_views(None, decode=True, tables_mla=[(1, 2)], padded=1) is None  # no policy rows
    assert half.group_views([unleased], decode=True, tables_mla=[(1, 2)], padded=1) is None
    assert callable(half.group_views([unleased, leased], decode=True, tables_mla=[(1, 2), (4, 5)], padded=2))
    # a prefill group stages only over host-only pages (-1 in its MLA table)
    assert half.group_views([leased], decode=False, tables_mla=[(1, 2)], padded=1) is None
    assert callable(half.group_views([leased], decode=False, tables_mla=[(-1, 2)], padded=1))
    assert callable(half.empty_views(2, decode=False)) and callable(half.empty_views(2, decode=True))
    plain = HiSparseDevice(max_leases=4, hot_rows=96, index_topk=32, k=0, stage_rows=False, tile=64)
    assert plain.group_views([leased], decode=False, tables_mla=[(-1, 2)], padded=1) is None
    assert plain.empty_views(2, decode=False) is None


def test_hisparse_half_owns_its_hot_buffers_and_runs_the_lease_reset():
    dev = jax.devices()[0]
    bs, nb = 4, 12
    cache = PagedKVCache.create(glm53.get_preset("tiny"), nb, bs, np.full((1, 4), -1, np.int32),
                                kv_cache_dtype="float32", include_mtp=False, index_block_size=8,
                                index_block_table=np.full((1, 2), -1, np.int32))
    host = HostMemory(cache, page_rows={"mla": bs, "indexer": 8}, kv_ranks=1, num_blocks=nb,
                      host=jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"),
                      device=jax.sharding.SingleDeviceSharding(dev, memory_kind="device"), host_blocks={"mla": 2})
    assert not hasattr(host, "hot_state")
    half = HiSparseDevice(max_leases=2, hot_rows=8, index_topk=4, k=0, stage_rows=True, tile=64)
    half.bind(host, None, index_groups=len(cache.index))
    pos, last, rows = half.hot_state
    assert pos.shape == last.shape == (2, len(cache.index), 8) and rows.shape == (2, 8)
    assert all(x.sharding.memory_kind == "device" for x in half.hot_state)  # committed: no extra compile later
    dirty = (pos.at[1].set(3), last.at[1].set(7), rows)
    half.hot_state = dirty
    # the reset runs in plan order among the host's own operations, on the half's state
    _, d2h, h2d = host.apply((ResetLease(1, (6, 2)),), cache, others=half.transfer)
    pos, last, rows = (np.asarray(x) for x in half.hot_state)
    assert (d2h, h2d) == (0, 0)
    assert rows[1].tolist() == [24, 25, 26, 27, 8, 9, 10, 11] and (rows[0] == -1).all()  # block b: slots 4b..4b+3
    assert (pos == -1).all() and (last == np.iinfo(np.int32).min).all()
    with pytest.raises(TypeError, match="ResetLease"):  # a host side alone runs no policy's operation
        host.apply((ResetLease(0, (1,)),), cache)
    with pytest.raises(TypeError, match="ResetLease"):  # nor does a policy without device state
        DeviceHalf().transfer(ResetLease(0, (1,)))


def test_the_host_only_share_memo_equals_a_fresh_count_and_stays_bounded(monkeypatch):
    """HiSparse's assumed misses read each MLA table's share of host-only pages (-1) through a memo keyed
    by the immutable snapshot: a tuple's share, a list's (never memoised) and a new tuple's are each the
    fresh count, and the memo is cleared before it holds more table entries than its bound."""
    from kvcache.policies.hisparse import spec

    monkeypatch.setattr(spec, "_HOST_ONLY", {})
    monkeypatch.setattr(spec, "_HOST_ONLY_HELD", [0])
    monkeypatch.setattr(spec, "HOST_ONLY_MAX_HELD", 25)
    tables = [tuple([-1] * k + [7] * (10 - k)) for k in range(4)]
    for t in tables[:2]:
        assert spec._host_only_share(t) == t.count(-1) / 10
    assert spec._host_only_share(tables[1]) == 0.1 and len(spec._HOST_ONLY) == 2
    assert spec._host_only_share(list(tables[3])) == 0.3 and len(spec._HOST_ONLY) == 2
    assert spec._host_only_share(tables[2]) == 0.2  # 30 entries would exceed 25: cleared, then this one
    assert list(spec._HOST_ONLY) == [id(tables[2])] and spec._HOST_ONLY_HELD == [10]
