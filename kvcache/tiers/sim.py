"""A simulated secondary tier: vLLM's four methods on an injected clock, holding keys and sizes, no bytes.

The simulator (glm53.engine.sim) runs the offload policy with secondary tiers by putting one of these
where a filesystem (or any) tier would be. It answers lookups from the keys it holds, and finishes each
store and load after a modelled time measured on `clock` (the engine's virtual clock, as the runner
sees it), so an admission that waits on a tier (RETRY, or a load in flight) waits simulated time.

Semantics (the filesystem tier's, kvcache.tiers.fs, less the bytes):
- lookup(key): RETRY while a store of `key` is in flight, HIT if it holds `key`, MISS otherwise; it does
  not touch the key's recency (a stat of the file does not either).
- submit_store(job): a chunk it already holds is not written again (it becomes the most recently used
  and is "ok" at once); every other chunk is written, in submission order, on the write channel: it
  starts when the channel is free, occupies it for size / write_bytes_per_s, and lands (becomes a HIT,
  the most recently used) write_latency_s after that. A job's result arrives when its last chunk lands.
  job.payloads give each chunk's size: an int (bytes) or anything with nbytes.
- submit_load(job): each chunk it holds at submission is read on the read channel the same way
  (read_bytes_per_s, read_latency_s); the job finishes when its last chunk is read, and each chunk is
  "ok" if the tier still holds it then (it becomes the most recently used), else "miss" (evicted
  meanwhile). A chunk it does not hold costs nothing and is a "miss".
- Capacity: past `max_bytes` (None: unbounded) the least recently used chunks are dropped as a store
  lands, never the one that just landed nor one a holder holds (fs: LRU over the files it knows).
- put(chunks, holder): chunks someone else wrote (a P/D producer's, which the consumer's peer tier reads)
  become HITs at once. With a holder (the request they were handed over for) they are held until
  `release(holder)` and then dropped, unless another holder still holds them or this tier's own store
  (or a put without a holder) wrote them too: what a producer leases for a request stays until that
  request takes it, and any lookup may hit it meanwhile (as the real producer answers any lookup), but
  not after (vLLM's producer frees a request's blocks once its consumer has read them).
- get_finished_jobs(): the jobs finished by clock(), in completion order.

The cost model: one write channel and one read channel (the filesystem tier's separate writer and
reader pools); each moves one chunk at a time at its full bandwidth, in order (a FIFO; the bandwidth
is the device's, so concurrent requests share it), and the per-chunk latency overlaps other chunks'
transfers (an NVMe device keeps many commands in flight). Reads do not wait for writes: a device whose
reads and writes share its flash is busier than this model says, so `busy_s` reports each channel's
occupied seconds (their sum over the run's seconds says how far from that the run was). Costs come from
the caller (glm53.perfmodel.hardware.StorageSpec; docs/perfmodel_sources.md); the default costs nothing:
every job finishes at its submission time.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable

from kvcache.tiers.base import JobResult, LoadJob, Lookup, StoreJob, TierStats


@dataclasses.dataclass(frozen=True)
class TierCosts:
    """A simulated tier's device: bytes per second and fixed seconds per chunk, each direction."""

    read_bytes_per_s: float = math.inf
    write_bytes_per_s: float = math.inf
    read_latency_s: float = 0.0
    write_latency_s: float = 0.0

    def __post_init__(self):
        for f in ("read_bytes_per_s", "write_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"TierCosts.{f} must be > 0, got {getattr(self, f)!r}")
        for f in ("read_latency_s", "write_latency_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"TierCosts.{f} must be >= 0, got {getattr(self, f)!r}")


INSTANT = TierCosts()


def _size(payload) -> int:
    if isinstance(payload, int):
        return payload
    return int(payload.nbytes) if hasattr(payload, "nbytes") else memoryview(payload).nbytes


class _Channel:
    """One direction of the device: a FIFO of chunk transfers at `bytes_per_s`, each landing `latency_s`
    after its transfer ends."""

    def __init__(self, bytes_per_s: float, latency_s: float):
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self.free_s = -math.inf  # when the channel is next free
        self.busy_s = 0.0

    def schedule(self, now: float, nbytes: int) -> float:
        """-> when a chunk of `nbytes` submitted at `now` lands."""
        start = max(now, self.free_s)
        took = nbytes / self.bytes_per_s
        self.free_s = start + took
        self.busy_s += took
        return self.free_s + self.latency_s


class SimTier:
    """A kvcache.tiers.SecondaryTier on simulated time. See the module docstring.

    clock: () -> seconds now (the runner's view of the engine's virtual clock).
    costs: the device (TierCosts; default INSTANT: everything finishes when submitted).
    max_bytes: capacity in bytes (None, or the filesystem tier's "auto", which a simulated device has no
    free space to size: unbounded).
    """

    def __init__(self, *, clock: Callable[[], float], costs: TierCosts = INSTANT, max_bytes: int | str | None = None,
                 name: str = "fs"):
        max_bytes = None if max_bytes == "auto" else max_bytes
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0):
            raise ValueError(f"simulated tier {name!r}: max_bytes must be a positive int or None, got {max_bytes!r}")
        self.name, self.clock, self.costs, self.max_bytes = name, clock, costs, max_bytes
        self.stats = TierStats()
        self.writes = _Channel(costs.write_bytes_per_s, costs.write_latency_s)
        self.reads = _Channel(costs.read_bytes_per_s, costs.read_latency_s)
        self._held: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> bytes, LRU first
        self._bytes = 0
        self._holds: dict[object, list[bytes]] = {}  # holder -> the keys put for it (`put`), until released
        self._pinned: collections.Counter[bytes] = collections.Counter()  # key -> holders holding it
        self._kept: set[bytes] = set()  # keys held whatever the holders: stored here, or put with no holder
        self._inflight: collections.Counter[bytes] = collections.Counter()  # keys being written
        # (time, seq, kind, data): chunk landings ("land": (key, size)) and job completions ("store" /
        # "load": (job, submitted at, sizes)), processed in time order as the clock passes them
        self._events: list = []
        self._seq = itertools.count()
        self._finished: collections.deque[JobResult] = collections.deque()
        self._closed = False
        self._version = 0  # moves whenever a lookup's answer may change (TierSet.version)

    # ---------------------------------------------------------------------------------- the interface
    def lookup(self, key: bytes, ctx: object = None) -> Lookup:
        self._advance()
        if self._inflight[key]:
            return Lookup.RETRY
        return Lookup.HIT if key in self._held else Lookup.MISS

    def submit_store(self, job: StoreJob) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        now = self._advance()
        done = now
        for key, payload in zip(job.keys, job.payloads):
            if key in self._held and not self._inflight[key]:  # held: not written again (the fs tier's check)
                self._held.move_to_end(key)
                self._kept.add(key)  # but now its own, whatever a holder releases
                continue
            size = _size(payload)
            lands = self.writes.schedule(now, size)
            self._inflight[key] += 1
            self._version += 1  # its lookups answer RETRY now
            self._push(lands, "land", (key, size))
            done = max(done, lands)
        self._push(done, "store", (job.job_id, now, len(job.keys)))

    def submit_load(self, job: LoadJob) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        now = self._advance()
        done = now
        # a held chunk is read at the bytes it was held at: the page's own, or for a P/D consumer's page
        # assembled from a producer's pages of another span, the producer bytes read for it (`put`)
        chunks = tuple((key, self._held.get(key, size)) for key, size in zip(job.keys, job.sizes))
        for key, size in chunks:
            if key in self._held:
                done = max(done, self.reads.schedule(now, size))
        self._push(done, "load", (job.job_id, now, chunks))

    def get_finished_jobs(self) -> list[JobResult]:
        self._advance()
        out = list(self._finished)
        self._finished.clear()
        return out

    def shutdown(self, wait: bool = True) -> None:
        """wait: every pending job finishes now, whatever the clock says (an engine that shuts down waits for
        its stores; its clock stands still); else they are dropped. Idempotent."""
        if not self._closed:
            self._closed = True
            if wait:
                self._advance(math.inf)
            else:
                self._events.clear()
                self._inflight.clear()

    # ----------------------------------------------------------------------------- for the simulator
    def next_event_s(self) -> float | None:
        """When the next pending store or load finishes (None: nothing pending): what an engine whose only
        waiting requests wait on this tier waits for."""
        return min((t for t, _, kind, _ in self._events if kind != "land"), default=None)

    def next_load_s(self) -> float | None:
        return min((t for t, _, kind, _ in self._events if kind == "load"), default=None)

    @property
    def version(self) -> int:
        self._advance()
        return self._version

    def discard(self, key: bytes) -> bool:
        """Drop a held chunk now, as if something else deleted it (fault injection: a chunk gone between a
        lookup that answered HIT and its load) -> whether it was held."""
        self._advance()
        n = self._held.pop(key, None)
        if n is None:
            return False
        self._kept.discard(key)
        self._bytes -= n
        self._version += 1
        return True

    def put(self, chunks, holder=None) -> None:
        """Hold `chunks` ((key, bytes) pairs) now, written by someone else: a P/D producer's chunks, which
        this tier (the consumer's peer tier) then reads on its read channel. Each becomes a HIT at once,
        the most recently used; capacity as for a landing store. holder: hold them only until
        `release(holder)` (the module docstring); None: for good."""
        self._advance()
        held, added = self._held, 0
        chunks = list(chunks)
        for key, size in chunks:
            if key in held:
                held.move_to_end(key)
            else:  # (a new key is the most recent already)
                held[key] = size
                added += size
        if holder is None:
            self._kept.update(key for key, _ in chunks)
        else:
            keys = [key for key, _ in chunks]
            self._holds.setdefault(holder, []).extend(keys)
            self._pinned.update(keys)
        self._bytes += added
        self._version += 1
        self._evict()

    def release(self, holder) -> int:
        """`holder` no longer needs what was put for it: each of those chunks no other holder holds and
        nothing else wrote is dropped now -> the chunks dropped."""
        self._advance()
        dropped = 0
        for key in self._holds.pop(holder, ()):
            self._pinned[key] -= 1
            if self._pinned[key]:
                continue
            del self._pinned[key]
            if key not in self._kept and (n := self._held.pop(key, None)) is not None:
                self._bytes -= n
                dropped += 1
        if dropped:
            self._version += 1
        self._evict()  # what the holder kept from eviction may now go
        return dropped

    @property
    def holders(self) -> int:
        """Holders whose chunks are held (`put` with a holder, not yet released)."""
        return len(self._holds)

    def keys(self) -> list[bytes]:
        self._advance()
        return list(self._held)

    @property
    def held_bytes(self) -> int:
        self._advance()
        return self._bytes

    def __contains__(self, key: bytes) -> bool:
        self._advance()
        return key in self._held

    def held_now(self):
        """The keys held at clock() (a live, read-only view: valid while neither the clock nor the tier
        moves). For a caller that tests many keys at one instant (`in` advances the clock per key)."""
        self._advance()
        return self._held.keys()

    # ---------------------------------------------------------------------------------------- inside
    def _evict(self) -> None:
        """Past max_bytes, drop the least recently used chunks that no holder holds, never the most recent."""
        if self.max_bytes is None or self._bytes <= self.max_bytes:
            return
        held, pinned = self._held, self._pinned
        victims = []
        over = self._bytes - self.max_bytes
        for key in itertools.islice(held, len(held) - 1):  # LRU first, the most recent spared
            if over <= 0:
                break
            if not pinned[key]:
                victims.append(key)
                over -= held[key]
        for key in victims:
            self._bytes -= held.pop(key)
            self._kept.discard(key)
            self.stats.evicted_chunks += 1

    def _push(self, t: float, kind: str, data) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def _advance(self, until: float | None = None) -> float:
        """Apply every landing and completion up to clock() (or `until`) -> that time."""
        now = self.clock() if until is None else until
        ev = self._events
        while ev and ev[0][0] <= now:
            t, _, kind, data = heapq.heappop(ev)
            if kind == "land":
                key, size = data
                self._version += 1  # a landing (and any eviction it causes) changes lookups' answers
                self._inflight[key] -= 1
                if not self._inflight[key]:
                    del self._inflight[key]
                if key not in self._held:
                    self._held[key] = size
                    self._bytes += size
                    self.stats.stored_chunks += 1
                    self.stats.store_bytes += size
                self._held.move_to_end(key)
                self._kept.add(key)
                self._evict()
            elif kind == "store":
                job_id, submitted, n = data
                self.stats.store_latency.observe(t - submitted)
                self._finished.append(JobResult(job_id, "store", ("ok",) * n))
            else:
                job_id, submitted, chunks = data
                status = []
                for key, size in chunks:
                    if key in self._held:
                        self._held.move_to_end(key)
                        self.stats.loaded_chunks += 1
                        self.stats.load_bytes += size
                        status.append("ok")
                    else:
                        status.append("miss")
                self.stats.load_latency.observe(t - submitted)
                self._finished.append(JobResult(job_id, "load", tuple(status), (None,) * len(status)))
        return now
