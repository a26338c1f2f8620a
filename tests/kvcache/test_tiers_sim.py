"""The simulated secondary tier (kvcache.tiers.sim.SimTier): the four methods on a clock we move by hand,
keys and sizes only. Capacity and LRU order, when stores land and loads finish, RETRY while a chunk's
store is in flight."""

import math

import pytest

from kvcache.tiers import LoadJob, Lookup, StoreJob, TierSet
from kvcache.tiers.sim import SimTier, TierCosts


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _tier(clock, **costs):
    max_bytes = costs.pop("max_bytes", None)
    return SimTier(clock=clock, costs=TierCosts(**costs), max_bytes=max_bytes)


def test_stores_land_in_order_after_their_modelled_time_and_answer_retry_until_then():
    """Write channel: 100 B/s, 0.5 s per chunk beside the transfer. Two 100-byte chunks submitted at t=0
    land at 1.5 s and 2.5 s (one after the other at full bandwidth); the job finishes with the last."""
    clock = Clock()
    tier = _tier(clock, write_bytes_per_s=100.0, write_latency_s=0.5)
    tier.submit_store(StoreJob(7, (_key(0), _key(1)), (100, 100)))
    assert tier.lookup(_key(0)) is Lookup.RETRY and tier.lookup(_key(2)) is Lookup.MISS
    assert tier.next_event_s() == pytest.approx(2.5)
    clock.t = 1.49
    assert tier.lookup(_key(0)) is Lookup.RETRY and tier.get_finished_jobs() == []
    clock.t = 1.5
    assert tier.lookup(_key(0)) is Lookup.HIT and tier.lookup(_key(1)) is Lookup.RETRY
    assert tier.get_finished_jobs() == []
    clock.t = 2.5
    assert tier.lookup(_key(1)) is Lookup.HIT
    (res,) = tier.get_finished_jobs()
    assert (res.job_id, res.kind, res.status) == (7, "store", ("ok", "ok"))
    assert tier.stats.stored_chunks == 2 and tier.stats.store_bytes == 200 and tier.held_bytes == 200
    assert tier.stats.store_latency.sum == pytest.approx(2.5) and tier.next_event_s() is None
    # a second job queues behind the channel's work: submitted at 2.6, it starts at once (the channel is free)
    clock.t = 2.6
    tier.submit_store(StoreJob(8, (_key(2),), (50,)))
    assert tier.next_event_s() == pytest.approx(2.6 + 0.5 + 0.5)


def test_a_held_chunk_is_not_written_again():
    clock = Clock()
    tier = _tier(clock, write_bytes_per_s=10.0)
    tier.submit_store(StoreJob(1, (_key(0),), (100,)))
    clock.t = 10.0
    assert tier.lookup(_key(0)) is Lookup.HIT
    tier.submit_store(StoreJob(2, (_key(0),), (100,)))  # the fs tier's "another writer got there first"
    assert tier.lookup(_key(0)) is Lookup.HIT and [r.job_id for r in tier.get_finished_jobs()] == [1, 2]
    assert tier.writes.busy_s == pytest.approx(10.0) and tier.stats.stored_chunks == 1


def test_loads_finish_after_their_reads_and_miss_what_is_gone():
    """Read channel: 200 B/s, 0.1 s per chunk. Loads of held chunks queue on it; a chunk evicted before
    its load finishes is a "miss"; a chunk never held is a miss at once and costs nothing."""
    clock = Clock()
    tier = _tier(clock, read_bytes_per_s=200.0, read_latency_s=0.1, max_bytes=250)
    tier.submit_store(StoreJob(1, (_key(0), _key(1)), (100, 100)))  # instant writes
    clock.t = 1.0
    tier.get_finished_jobs()
    tier.submit_load(LoadJob(10, (_key(0),), (100,)))  # read 1.0 -> 1.5, done 1.6
    tier.submit_load(LoadJob(11, (_key(1),), (100,)))  # queued: 1.5 -> 2.0, done 2.1
    tier.submit_load(LoadJob(12, (_key(9),), (100,)))  # not held: done now
    assert [(r.job_id, r.status) for r in tier.get_finished_jobs()] == [(12, ("miss",))]
    clock.t = 1.6
    assert [(r.job_id, r.status) for r in tier.get_finished_jobs()] == [(10, ("ok",))]
    # key 0 is now the most recently used: a store past the capacity evicts key 1, whose load is in flight
    tier.submit_store(StoreJob(2, (_key(2),), (100,)))
    assert tier.lookup(_key(1)) is Lookup.MISS and tier.lookup(_key(0)) is Lookup.HIT
    clock.t = 2.1
    assert [(r.job_id, r.status) for r in tier.get_finished_jobs()] == [(2, ("ok",)), (11, ("miss",))]
    assert tier.stats.loaded_chunks == 1 and tier.stats.load_bytes == 100 and tier.stats.evicted_chunks == 1
    assert tier.stats.load_latency.count == 3 and tier.reads.busy_s == pytest.approx(1.0)


def test_capacity_evicts_least_recently_used_but_never_the_chunk_that_just_landed():
    clock = Clock()
    tier = _tier(clock, max_bytes=300)
    tier.submit_store(StoreJob(1, tuple(map(_key, range(3))), (100,) * 3))
    tier.submit_load(LoadJob(2, (_key(0),), (100,)))  # key 0 most recently used: LRU order 1, 2, 0
    tier.submit_store(StoreJob(3, (_key(3),), (100,)))
    assert [tier.lookup(_key(i)) for i in range(4)] == [Lookup.HIT, Lookup.MISS, Lookup.HIT, Lookup.HIT]
    tier.submit_store(StoreJob(4, (_key(4),), (1000,)))  # larger than the capacity: kept alone
    assert [k for k in map(_key, range(5)) if k in tier] == [_key(4)] and tier.held_bytes == 1000
    assert tier.stats.evicted_chunks == 4


def test_chunks_put_for_a_holder_stay_until_it_releases_them_unless_something_else_keeps_them():
    """A P/D producer's chunks put for a request are HITs until that request releases them; a chunk
    another holder still holds, or that the tier's own store or a put without a holder wrote, stays; a
    held chunk is never evicted, and once released it is evictable like any other."""
    clock = Clock()
    tier = _tier(clock, max_bytes=300)
    tier.put([(_key(0), 100), (_key(1), 100)], holder="a")
    tier.put([(_key(1), 100), (_key(2), 100)], holder="b")
    tier.submit_store(StoreJob(1, (_key(2),), (100,)))  # lands at once (INSTANT): the tier's own too
    assert tier.holders == 2 and tier.held_bytes == 300
    assert tier.release("a") == 1  # key 0 goes; key 1 is b's too
    assert tier.lookup(_key(0)) is Lookup.MISS and tier.lookup(_key(1)) is Lookup.HIT and tier.holders == 1
    # over capacity, only what no holder holds is evicted: key 3 (kept, unheld) goes before held key 1
    tier.put([(_key(3), 100)])
    tier.put([(_key(4), 100)])
    assert tier.lookup(_key(1)) is Lookup.HIT and tier.lookup(_key(3)) is Lookup.MISS
    assert tier.stats.evicted_chunks == 1
    assert tier.release("b") == 1  # key 1 goes; key 2 stays (its own store wrote it)
    assert sorted(tier.keys()) == [_key(2), _key(4)] and tier.held_bytes == 200 and tier.holders == 0
    assert tier.release("b") == 0  # nothing twice
    # a put without a holder keeps a chunk a holder had; a chunk discarded meanwhile is not dropped twice
    tier.put([(_key(5), 100)], holder="c")
    tier.put([(_key(5), 100), (_key(6), 100)], holder="d")
    tier.put([(_key(5), 100)])
    assert tier.discard(_key(6)) and tier.release("c") == 0 and tier.release("d") == 0
    assert _key(5) in tier and _key(6) not in tier and tier.held_bytes == 100 * len(tier.keys())


def test_shutdown_finishes_pending_stores_or_drops_them():
    clock = Clock()
    slow = _tier(clock, write_bytes_per_s=1.0)
    slow.submit_store(StoreJob(1, (_key(0),), (100,)))
    slow.shutdown(wait=True)
    assert slow.lookup(_key(0)) is Lookup.HIT and slow.stats.stored_chunks == 1
    with pytest.raises(RuntimeError, match="shut down"):
        slow.submit_store(StoreJob(2, (_key(1),), (1,)))
    dropped = _tier(clock, write_bytes_per_s=1.0)
    dropped.submit_store(StoreJob(1, (_key(0),), (100,)))
    dropped.shutdown(wait=False)
    clock.t = math.inf
    assert dropped.lookup(_key(0)) is Lookup.MISS and dropped.get_finished_jobs() == []


def test_behind_a_tier_set_and_costs_are_checked():
    clock = Clock()
    tiers = TierSet([_tier(clock), SimTier(clock=clock, name="slow", costs=TierCosts(read_bytes_per_s=1.0))])
    tiers.tiers[1].submit_store(StoreJob(1, (_key(0),), (10,)))
    assert tiers.lookup(_key(0)) == (1, Lookup.HIT)
    tiers.load(1, 5, (_key(0),), (10,))
    assert tiers.poll() == [] and tiers.pending_loads == {5: 1}
    clock.t = 10.0
    assert [(r.job_id, r.status) for r in tiers.poll()] == [(5, ("ok",))] and not tiers.pending_loads
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        TierCosts(read_bytes_per_s=0)
    with pytest.raises(ValueError, match="write_latency_s"):
        TierCosts(write_latency_s=-1)
    with pytest.raises(ValueError, match="max_bytes"):
        SimTier(clock=clock, max_bytes=0)
