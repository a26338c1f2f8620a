"""The secondary-tier interface's types (vLLM's four methods; see kvcache.tiers): lookup answers and their
context, jobs, their results, a tier's counters and the `SecondaryTier` protocol."""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol


class Lookup(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


class LookupContext:
    """What a lookup belongs to (vLLM's ReqContext): the request, and the chunk keys its prefix lookup may
    ask, in walk order, the asked key among them. `keys` is computed on first use (a callable is given),
    so a tier that answers from local state pays nothing for it, and a tier that must ask a remote party
    sends them all in one round trip instead of one per admission attempt. `peer`: the "host:port" of the
    peer tier the request's KV is to come from (a P/D consumer's producer, from the request's
    kv_transfer_params); a peer tier asks that one alone, if its operator listed it (`producers`; else
    nobody), and tiers that are not peers ignore it.
    `lease`: that producer's lease on the request's chunks (its `remote_lease`, 0: none), which the
    peer tier's lookup hands over to its own pin so that the fetch frees them. `remote`: where that
    producer's pages span other tokens than ours, its `RemoteSource` (kvcache.tiers.remote.RelayoutTier
    asks for the producer's chunks and assembles ours from them); None: the same chunks on both sides.
    `tokens`: the request's (token ids, extra keys, leading tokens whose KV may be taken), what a tier
    needs to name the chunks of writers of other page spans (RelayoutTier's `also`); None: not given."""

    __slots__ = ("req_id", "_keys", "_make", "peer", "lease", "remote", "tokens")

    def __init__(self, req_id: str, keys: Sequence[bytes] | Callable[[], Sequence[bytes]] = (), *,
                 peer: str | None = None, lease: int = 0, remote: RemoteSource | None = None,
                 tokens: tuple[Sequence[int], tuple, int] | None = None):
        self.req_id, self.peer, self.lease, self.remote, self.tokens = req_id, peer, lease, remote, tokens
        self._make, self._keys = (keys, None) if callable(keys) else (None, tuple(keys))

    @property
    def keys(self) -> tuple[bytes, ...]:
        if self._keys is None:
            self._keys = tuple(self._make())
        return self._keys


@dataclasses.dataclass(frozen=True)
class PageSpans:
    """How an engine cuts a request into chunks (what a chunk key depends on besides the tokens and salt):
    its layout fingerprint (kvcache.tiers.layout_fingerprint plus the weights), the tokens of one chained
    hash block (block_size x DCP size: kvcache.block_pool.KVCacheManager.tokens_per_block) and, per cache
    group, the tokens of one page (a multiple of hash_block_tokens). A P/D producer announces its own in
    kv_transfer_params, so a consumer whose pages span other tokens can name the producer's chunks."""

    fingerprint: str
    hash_block_tokens: int
    page_tokens: tuple[tuple[str, int], ...]  # (group, tokens per page), in the engine's group order

    def __post_init__(self):
        if not isinstance(self.hash_block_tokens, int) or self.hash_block_tokens < 1:
            raise ValueError(f"PageSpans.hash_block_tokens must be an int >= 1, got {self.hash_block_tokens!r}")
        for g, n in self.page_tokens:
            if not isinstance(n, int) or n < 1 or n % self.hash_block_tokens:
                raise ValueError(f"PageSpans.page_tokens[{g!r}] must be a multiple of hash_block_tokens "
                                 f"({self.hash_block_tokens}), got {n!r}")

    def tokens(self, group: str) -> int:
        return dict(self.page_tokens)[group]

    def describe(self) -> str:
        """The spans as an error message names them: "mla 16, indexer 16 tokens per page"."""
        return ", ".join(f"{g} {n}" for g, n in self.page_tokens) + " tokens per page"


@dataclasses.dataclass(frozen=True)
class RemoteSource:
    """A request's KV as a producer of other page spans holds it: the producer's `spans`, and the request's
    tokens and extra keys (salt) the chained hashes cover, and how many leading tokens' KV may be taken
    (`num_tokens`: all but the last, since a prefix hit leaves one token to compute)."""

    spans: PageSpans
    tokens: Sequence[int]
    extra_keys: tuple
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class StoreJob:
    """Write chunks: payloads[i] (a buffer: bytes, memoryview or a contiguous numpy array) under keys[i]."""

    job_id: int
    keys: tuple[bytes, ...]
    payloads: tuple


@dataclasses.dataclass(frozen=True)
class LoadJob:
    """Read chunks keys[i], each of sizes[i] bytes."""

    job_id: int
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class JobResult:
    """A finished job. status per key: "ok", "miss" (gone) or "corrupt" (failed verification; the tier
    dropped it) for loads, "ok" or "failed" (not written: full disk, an error) for stores. payloads: a
    load's bytes per key (None where not "ok"); () for stores."""

    job_id: int
    kind: str  # "store" | "load"
    status: tuple[str, ...]
    payloads: tuple = ()


# seconds; the upper bounds of LatencyHistogram's buckets (vLLM's kv_offload lookup-delay range, to 10 s)
LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


@dataclasses.dataclass
class LatencyHistogram:
    """Job times in fixed buckets (LATENCY_BUCKETS_S), kept by the tier itself so that kvcache needs no
    metrics library; glm53.engine.prometheus renders it. Not thread-safe: tiers observe under their lock."""

    counts: list = dataclasses.field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))  # last: > 10 s
    sum: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS_S) if seconds <= b), len(LATENCY_BUCKETS_S))
        self.counts[i] += 1
        self.sum += seconds
        self.count += 1

    def prometheus_buckets(self) -> list[tuple[str, int]]:
        """Cumulative (upper bound, count) pairs ending at "+Inf", as Prometheus histograms expose them."""
        out, total = [], 0
        for b, n in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), self.counts):
            total += n
            out.append((b, total))
        return out


@dataclasses.dataclass
class TierStats:
    """A tier's own counters (chunks and bytes it moved; the policy counts hits and misses) and the wall
    time of each store and load job, from its submission to its completion."""

    stored_chunks: int = 0
    store_failed: int = 0
    store_bytes: int = 0
    loaded_chunks: int = 0
    load_bytes: int = 0
    corrupt: int = 0  # chunks that failed verification on load (and were deleted)
    evicted_chunks: int = 0
    deadline_misses: int = 0  # loads answered "miss" by their deadline (TierBookkeeping); fs: writes a store never began by its own
    store_latency: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    load_latency: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)


class SecondaryTier(Protocol):
    name: str  # the tier's metrics key: "fs", "obj", "p2p" (a custom tier names itself)
    stats: TierStats

    def lookup(self, key: bytes, ctx: LookupContext | None = None) -> Lookup: ...

    def submit_store(self, job: StoreJob) -> None: ...

    def submit_load(self, job: LoadJob) -> None: ...

    def get_finished_jobs(self) -> list[JobResult]: ...

    def shutdown(self, wait: bool = True) -> None:
        """Finish (wait=True) or drop pending jobs and stop the tier's threads; idempotent."""


class TierBookkeeping:
    """What the tiers built here share: a lock, the queue of finished jobs `get_finished_jobs` hands out,
    the log of removed chunks for KV events (`log_removals` turns it on, `take_removed` empties it;
    a tier records a removal with `_note_removed_key` under its lock), and load deadlines.

    Load deadlines: a tier that cannot interrupt its own I/O (a read blocked in the kernel on a hung
    network filesystem, a body that arrives a byte at a time) registers each load with `_load_due`;
    `get_finished_jobs` answers a load still out at its deadline with "miss" for every key (counted in
    `stats.deadline_misses`), so a request waits at most that long and recomputes; the tier's own result,
    when it comes, goes through `_finish_load` and is dropped."""

    def __init__(self):
        self._lock = threading.Lock()
        self._finished: collections.deque[JobResult] = collections.deque()
        self._removed: list[bytes] | None = None  # None: nobody asked (no events), so nothing is kept
        self._due: dict[int, tuple[float, int]] = {}  # load job -> (monotonic deadline, keys)
        self._abandoned: set[int] = set()  # load jobs answered by their deadline, their result still to come

    def get_finished_jobs(self) -> list[JobResult]:
        with self._lock:
            if self._due:
                now = time.monotonic()
                for job, (deadline, n) in [(j, d) for j, d in self._due.items() if d[0] <= now]:
                    del self._due[job]
                    self._abandoned.add(job)
                    self.stats.deadline_misses += 1
                    self._finished.append(JobResult(job, "load", ("miss",) * n, (None,) * n))
            out = list(self._finished)
            self._finished.clear()
        return out

    def _load_due(self, job: LoadJob, seconds: float) -> None:
        """Answer `job` with misses if it has not finished `seconds` from now."""
        with self._lock:
            self._due[job.job_id] = (time.monotonic() + seconds, len(job.keys))

    def _finish_load(self, result: JobResult) -> None:
        """Under the lock: queue a finished load, unless its deadline answered it already."""
        if result.job_id in self._abandoned:
            self._abandoned.discard(result.job_id)
            return
        self._due.pop(result.job_id, None)
        self._finished.append(result)

    def log_removals(self) -> None:
        """From now on note the key of every chunk this tier deletes or finds gone, for `take_removed`."""
        with self._lock:
            if self._removed is None:
                self._removed = []

    def take_removed(self) -> list[bytes]:
        with self._lock:
            out, self._removed = (self._removed or []), ([] if self._removed is not None else None)
        return out

    def _note_removed_key(self, key: bytes) -> None:
        """Under the lock: chunk `key` is gone."""
        if self._removed is not None:
            self._removed.append(key)
