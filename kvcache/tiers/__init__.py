"""Secondary KV tiers behind the host tier (BRIEF §7; vLLM's tiering offloading spec): storage that keeps
host-tier chunks after the host evicts them and gives them back to a later prefix lookup.

A tier implements vLLM's four non-blocking methods (`SecondaryTier`):

    lookup(key, ctx) -> Lookup.HIT | MISS | RETRY     # RETRY: ask again later (e.g. a store in flight)
    submit_store(job: StoreJob)                        # write chunks; returns at once
    submit_load(job: LoadJob)                          # read chunks; returns at once
    get_finished_jobs() -> [JobResult]                 # what completed since the last call

Who calls what. The host tier (kvcache.host_tier, the scheduler side, under the offload and the
HiSparse policies) asks `lookup` during a prefix lookup and plans loads and stores as transfer
operations (kvcache.transfer.TierLoad / TierStore); the runner's host side (kvcache.host.HostMemory,
which holds the host pools' arrays) executes them: it gathers a stored page's bytes out of the host
pool into a StoreJob and writes a loaded page's bytes into the host page the policy reserved, and
reports finished loads in its StepResult (`tier_loads`), which the policy reads in the next `update`.
A store passes every chunk the host tier stores to every tier (write-through), so a chunk the host
tier evicts is still in the secondary tiers.

Keys. `chunk_key(fingerprint, group, block_hash)`: SHA-256 of the deployment's layout fingerprint
(`layout_fingerprint`: model, tokens and bytes per page, KV dtype), the cache group and the chained block
hash (which covers the tokens and the request's salt). Not the DCP layout: chunks are stored in a
canonical layout (every layer's rows in token order; kvcache.relayout.canonical_rows), so engines whose
pages cover the same tokens share chunks whatever their DCP size and interleave. An engine whose pages
span other tokens can still read them when it knows the writer's spans (`PageSpans`: a P/D producer
announces them): kvcache.tiers.remote.RelayoutTier names the writer's chunks and assembles its own pages.
A storage tier shared by engines of other spans lists them in its spec: `read_page_tokens`, a list of
{cache group: tokens per page} (`read_page_tokens(spec)`), tried in order where our own key misses.

Payloads. A chunk is one page of one cache group (every layer, every DCP rank), in the canonical
layout. A StoreJob's payloads are the runner's snapshot of the host pages (one gather out of the host
pool, made when the store is planned): the host page may be reused by the next store while a tier is
still writing, so a tier gets its own buffer rather than a view of the live pool.

Tiers: "fs" (kvcache.tiers.fs.FileTier: one file per chunk), "obj" (kvcache.tiers.obj.ObjectTier: one
object per chunk in an S3-compatible bucket, same names and blobs; lookups answer from a local index of
the bucket, so the scheduler never waits on the network, and a server that stops answering turns into
misses after a bounded wait), "p2p" (kvcache.tiers.p2p.PeerTier: an in-memory store served to peer
engines over ZMQ control and TCP bulk sockets, and fetches from the peers it lists, with pins and
deadlines), "custom" (any class by `module_path`). The simulator replaces every tier with a simulated one
(kvcache.tiers.sim.SimTier: keys and sizes, jobs finishing after a modelled time on an injected clock). Tiers that store blobs share one format and one check
(kvcache.tiers.format). Trust (docs/engine.md "Trust model"): with a shared secret (a tier's `secret_file`,
or $GLM53_KV_SECRET_FILE) every chunk carries an HMAC-SHA256 of its key and bytes and every peer message
one of its body (kvcache.tiers.auth), so nobody without the secret can put KV under a name; a peer tier
dials only the producers its operator listed.

Lookup context. `lookup(key, ctx)` gets a `LookupContext`: the request and the chunk keys its prefix walk
may ask, in order. A tier that answers from local state ignores it; the peer tier asks its peers for all
of them at once (one message per peer and request), so a long prefix costs one round trip, not one per
admission attempt. A lookup without one (e.g. the KV-event check of a finished store) must not start
anything.

KV events (kvcache.events; `TierSet.attach_events`): `poll` reports each finished store to the recorder
(a chunk counts as stored if the store says "ok" and the tier's `lookup` still answers HIT), and a tier
that can tell which chunks it deleted (optional methods `log_removals()`, then `take_removed() ->
[key]`; FileTier does) has them reported as removed. Optional attributes `kv_event_medium` (default
"STORAGE"), `kv_event_locality` and `kv_event_ownership` say how its events name it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from collections.abc import Sequence

from kvcache.block_pool import tail_hash
from kvcache.tiers.base import (JobResult, LoadJob, Lookup, LookupContext, PageSpans, RemoteSource, SecondaryTier,
                                StoreJob, TierStats)

__all__ = ["JobResult", "LoadJob", "Lookup", "LookupContext", "PageSpans", "RemoteSource", "SecondaryTier", "StoreJob",
           "TierSet", "TierStats",
           "chunk_key", "check_tier_specs", "tail_chunk", "layout_fingerprint", "make_tier", "read_page_tokens"]

TIER_TYPES = ("fs", "obj", "p2p", "custom")
READ_PAGE_TOKENS = "read_page_tokens"  # a spec key of every tier type: other writers' page spans to read


def read_page_tokens(spec: dict) -> list[dict[str, int]]:
    """A tier spec's `read_page_tokens`: the page spans of other engines writing the same storage that
    this engine reads too, each {cache group: tokens per page} ([] when absent). ValueError naming the
    key for anything else, and for a peer tier. The engine turns each into its PageSpans (the fingerprint
    an engine of this model, weights and KV dtype with those pages writes under), opens the storage a
    second time under that fingerprint (`make_tier`, unbounded: a reader never evicts the writer's
    chunks) and wraps the tier in RelayoutTier."""
    listed = spec.get(READ_PAGE_TOKENS, [])
    if not isinstance(listed, (list, tuple)):
        raise ValueError(f"secondary tier {spec.get('type')!r}: {READ_PAGE_TOKENS} must be a list of "
                         f"{{cache group: tokens per page}}, got {listed!r}")
    for i, entry in enumerate(listed):
        if (not isinstance(entry, dict) or not entry
                or not all(isinstance(g, str) and isinstance(n, int) and not isinstance(n, bool) and n > 0
                           for g, n in entry.items())):
            raise ValueError(f"secondary tier {spec.get('type')!r}: {READ_PAGE_TOKENS}[{i}] must map each cache "
                             f"group to its tokens per page (positive ints), got {entry!r}")
    if listed and spec.get("type") == "p2p":  # peers hold chunks of any spans and name them per request (P/D)
        raise ValueError(f"secondary tier 'p2p': {READ_PAGE_TOKENS} is for storage tiers (fs, obj, custom), whose "
                         "writers' chunks sit under each writer's fingerprint")
    return [dict(e) for e in listed]


def layout_fingerprint(model_cfg: dict, *, group_tokens: dict, page_bytes: dict, kv_cache_dtype: str) -> str:
    """Hex SHA-256 of everything a chunk's bytes depend on besides its tokens: the model (its config), the
    tokens and bytes of a page per cache group, and the KV dtype. Chunks are kept in the canonical layout
    (kvcache.host.HostMemory.read_host_pages: every layer's rows in token order, whatever the DCP size
    and interleave), so the DCP layout is not part of it: engines whose pages cover the same tokens share
    chunks across parallel layouts (DCP2 with block_size 8 and one device with block_size 16, say)."""
    spec = {"format": 2, "model": model_cfg, "group_tokens": group_tokens, "page_bytes": page_bytes,
            "kv_cache_dtype": kv_cache_dtype}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


@functools.lru_cache(maxsize=1 << 18)  # a page is keyed at its store, each lookup and each P/D hand-off (~200 B each)
def chunk_key(fingerprint: str, group: str, block_hash: bytes) -> bytes:
    """The 32-byte key of one chunk (one page of `group` ending at the hash block `block_hash`):
    SHA-256 of fingerprint, NUL, group, NUL, block hash."""
    h = _key_prefix(fingerprint, group).copy()  # the prefix hashed once: P/D and tier lookups key every page
    h.update(block_hash)
    return h.digest()


def tail_chunk(fingerprint: str, group: str, page_tokens: int, hash_block_tokens: int, token_ids: Sequence[int],
               extra_keys: Sequence[str | int], num_tokens: int, hashes: Sequence[bytes]) -> tuple[int, bytes] | None:
    """The chunk of a request's first `num_tokens` tokens that its last page holds when that page is not
    full: (its first token, its key), None when `num_tokens` ends on a page boundary. A P/D producer
    stores it (kvcache.host_tier.HostTier.store_tail) so that a consumer of finer pages gets every full
    page of its own below `num_tokens`, not only those within the producer's full pages
    (kvcache.tiers.remote.key_plan). Its key is `chunk_key` of `kvcache.block_pool.tail_hash` over the
    chained hash at the page's first token (`hashes`: the request's block hashes, hash blocks of
    `hash_block_tokens`, at least that far) and the page's tokens below `num_tokens`: named from the
    tokens and salt alone, as every chunk is, and never a full page's key. The chunk is a whole page in
    the canonical layout whose rows past `num_tokens` are not part of it."""
    start = num_tokens // page_tokens * page_tokens
    if start == num_tokens:
        return None
    parent = hashes[start // hash_block_tokens - 1] if start else None
    return start, chunk_key(fingerprint, group, tail_hash(parent, token_ids[start:num_tokens], extra_keys))


@functools.lru_cache(maxsize=64)
def _key_prefix(fingerprint: str, group: str):
    return hashlib.sha256(fingerprint.encode() + b"\0" + group.encode() + b"\0")


def make_tier(spec: dict, fingerprint: str, replica: int = 0) -> SecondaryTier:
    """A tier from one entry of kv_connector_extra_config's secondary_tiers, for data-parallel replica
    `replica` (a peer tier binds port + replica, as vLLM's does)."""
    check_tier_specs([spec])
    spec = {k: v for k, v in spec.items() if k != READ_PAGE_TOKENS}  # the engine's (RelayoutTier), not the tier's
    kind = spec.get("type")
    if kind == "fs":
        from kvcache.tiers.fs import FileTier

        opts = {k: v for k, v in spec.items() if k != "type"}
        return FileTier(fingerprint=fingerprint, **opts)
    if kind == "obj":
        from kvcache.tiers.obj import ObjectTier

        return ObjectTier(fingerprint=fingerprint, **{k: v for k, v in spec.items() if k != "type"})
    if kind == "p2p":
        from kvcache.tiers.p2p import PeerTier

        opts = {k: v for k, v in spec.items() if k != "type"}
        if replica and opts["port"]:
            opts["port"] += replica
        return PeerTier(fingerprint=fingerprint, **opts)
    if kind == "custom":
        path = spec.get("module_path")
        if not isinstance(path, str) or not path:
            raise ValueError("secondary tier {'type': 'custom'} needs module_path ('package.module' defining "
                             "make_tier(spec, fingerprint), or 'package.module:Class')")
        module, _, attr = path.partition(":")
        factory = getattr(importlib.import_module(module), attr or "make_tier")
        return factory(spec, fingerprint) if not attr else factory(fingerprint=fingerprint, **{
            k: v for k, v in spec.items() if k not in ("type", "module_path")})
    raise ValueError(f"secondary tier type must be one of {TIER_TYPES}, got {kind!r}")


def check_tier_specs(specs) -> None:
    """Validate secondary_tiers entries without building them (DeployConfig does this)."""
    if not isinstance(specs, (list, tuple)):
        raise ValueError(f"kv_connector_extra_config secondary_tiers must be a list, got {type(specs).__name__}")
    for s in specs:
        if not isinstance(s, dict) or s.get("type") not in TIER_TYPES:
            raise ValueError(f"secondary tier type must be one of {TIER_TYPES} (a dict with 'type'), got {s!r}")
        read_page_tokens(s)
        s = {k: v for k, v in s.items() if k != READ_PAGE_TOKENS}
        if s["type"] == "fs":
            from kvcache.tiers.fs import check_options

            check_options({k: v for k, v in s.items() if k != "type"})
        elif s["type"] == "obj":
            from kvcache.tiers.obj import check_options as check_obj

            check_obj({k: v for k, v in s.items() if k != "type"})
        elif s["type"] == "p2p":
            from kvcache.tiers.p2p import check_options as check_p2p

            check_p2p({k: v for k, v in s.items() if k != "type"})
        elif s["type"] == "custom" and not isinstance(s.get("module_path"), str):
            raise ValueError(f"secondary tier {s!r}: 'custom' needs module_path")


class TierSet:
    """The configured secondary tiers of one replica, in lookup order, and job ids. Shared by the policy
    (lookups) and the runner's host side (stores, loads, polling)."""

    def __init__(self, tiers: Sequence[SecondaryTier]):
        self.tiers = list(tiers)
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"secondary tiers need distinct names, got {names}")
        self._next_job = 0
        self.pending_loads: dict[int, int] = {}  # job -> tier index
        self._closed = False
        self.events = None  # the KV event sink (kvcache.events.KVEventRecorder), None: events off
        self._store_keys: dict[int, tuple[bytes, ...]] = {}  # store job -> its keys (events on)

    def attach_events(self, sink) -> None:
        """Report finished stores and the tiers' deletions to `sink` from the next `poll` on."""
        self.events = sink
        for t in self.tiers:
            log = getattr(t, "log_removals", None)
            if log is not None:
                log()

    def __len__(self) -> int:
        return len(self.tiers)

    def version(self) -> object:
        """A value that moves whenever a lookup of some key might answer differently: each tier's
        `version` (a counter a tier moves on every store landing, eviction or loss) where every tier has
        one, else a fresh object (never equal: a tier that cannot tell, such as a directory or a bucket
        other processes write to, makes the scheduler try a waiting request's admission again)."""
        versions = tuple(getattr(t, "version", None) for t in self.tiers)
        return versions if None not in versions else object()

    def new_job(self) -> int:
        self._next_job += 1
        return self._next_job

    def lookup(self, key: bytes, ctx: LookupContext | None = None) -> tuple[int, Lookup]:
        """(index of the first tier that holds or will soon hold `key`, HIT / RETRY), or (-1, MISS)."""
        for i, t in enumerate(self.tiers):
            r = t.lookup(key, ctx)
            if r is not Lookup.MISS:
                return i, r
        return -1, Lookup.MISS

    def store(self, keys: Sequence[bytes], payloads: Sequence) -> None:
        for t in self.tiers:
            job = self.new_job()
            if self.events is not None:
                self._store_keys[job] = tuple(keys)
            t.submit_store(StoreJob(job, tuple(keys), tuple(payloads)))

    def load(self, tier: int, job: int, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        self.tiers[tier].submit_load(LoadJob(job, tuple(keys), tuple(sizes)))
        self.pending_loads[job] = tier  # only once submitted: a pending load is one a poll will report

    def poll(self) -> list[JobResult]:
        """Finished loads of every tier (finished stores are consumed here: their counts are in each
        tier's stats)."""
        out = []
        for t in self.tiers:
            for r in t.get_finished_jobs():
                if r.kind == "load":
                    self.pending_loads.pop(r.job_id, None)
                    out.append(r)
                elif self.events is not None and r.job_id in self._store_keys:
                    for key, status in zip(self._store_keys.pop(r.job_id), r.status):
                        # a chunk the tier evicted again before this poll is not announced; a deletion
                        # noted after this lookup is reported below or by the next poll, after it
                        self.events.tier_store_finished(t, key, status == "ok" and t.lookup(key) is Lookup.HIT)
            take = getattr(t, "take_removed", None) if self.events is not None else None
            if take is not None:
                self.events.tier_removed(t, take())
        return out

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self.tiers:
            t.shutdown(wait=wait)
