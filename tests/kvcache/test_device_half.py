"""The device half of a KV policy (kvcache.policies.device): each registered policy's half (built by its
spec's `device_half`), and which width groups HiSparse's half serves with a view (a decode group only when some
row holds a hot buffer, a prefill group only when some row has host-only pages). The views' numbers are
tests/kvcache/test_host.py's and tests/engine/test_hisparse.py's; nothing here compiles."""

import types

import pytest

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
    assert half.hot_buffers(2) == ((4, 2, 96) if name == "hisparse" else None)


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
