"""The host tier: host-memory pools keyed by (cache group, chained hash), with secondary tiers behind them
(BRIEF §7). One mechanism for both policies that keep KV in host memory: the offload host tier
(kvcache.policies.offload, `kv_policy="offload"`) and HiSparse (kvcache.policies.hisparse), each with its own pools and
budgets, so a deployment has one host-memory system whatever its policy.

What lives here (a `HostTier`, one per replica, owned by its policy):
- **Pools**, one `kvcache.block_pool.BlockPool` per cache group, used as prefix caches: a page is
  registered under (group, chained block hash), the hash the device prefix cache uses (tokens and salt).
  The policy decides who holds a page and when it is freed; a free registered page stays findable until
  the pool hands it out again (LRU order, or ARC with `ARCBlockPool`).
- **Write-through** (`copy_out`): a device -> host `PageCopy`, then a `TierStore` of the pages registered
  under their hash to every secondary tier (kvcache.tiers), so a page the host pool evicts is still in
  the tiers. Chunk keys are `kvcache.tiers.chunk_key(fingerprint, group, hash)`.
- **The prefix lookup** (`lookup_prefix`), device -> host -> tiers, page by page (a hash block counts when a
  page of every group ending there is found). Pages only a tier holds get host pages reserved for them
  and a `TierLoad` (asynchronous; the runner reports it in `StepResult.tier_loads`, `on_tier_results`),
  and the admission answers RETRY: the request keeps its place, others may run, and it is tried again
  once its loads are reported. A tier that answers RETRY itself (a store of that chunk in flight) is
  asked again next step. Loaded pages join the host pool, pinned for the request until its next
  admission (`tier_pins`, released with `release`); so are the host hits of a round that waits, so the
  loads just reserved cannot evict them. A chunk two requests need is loaded once (`inflight`). At most
  `max_tier_rounds` admissions of one request start loads, and `max_retry_rounds` wait on RETRY alone;
  after that it takes what the device and host hold. What one admission brings back is bounded by the
  host pages free for it (the host tier is the staging area); the rest is recomputed, counted (the
  tier's `unstaged`, at the admission that is taken) and logged once per host tier.
- **Load failures**: a load that fails (the chunk is gone, or fails verification) frees its host page:
  those tokens are recomputed (`kv_load_failure_policy="recompute"`), or ("fail") the requests waiting
  on it are reported to the scheduler, which finishes them with "error" while the engine serves on.
- **Abort** (`drop`): a waiting request's pins are released; loads it started finish for the other
  requests waiting on them, or land in the host pool unpinned. `has_loads` stays true until every
  started load is reported, so the engine keeps stepping for them.
- **Counts**: per secondary tier (`TierCounts`, `tier_metrics`), and the lookups an admission attempt
  moves (`admission_counts`: the scheduler replays them when it skips an identical retry).
- **KV events** (kvcache.events, `attach_events`): the pools report registrations and evictions under
  medium "CPU"; a planned tier store is registered with the recorder, which announces it as "STORAGE"
  once a tier reports it written (kvcache.tiers.TierSet.attach_events).

What stays with each policy: who holds host pages and when (the offload tier frees every page once
copied, HiSparse's running requests hold their pre-copied MLA pages), what a hit becomes on the device
(the offload tier and HiSparse's indexer pages are copied back at admission; HiSparse's MLA pages stay
host-resident), and its own counters.

`HostTierPolicy` is the mixin of the `kvcache.policies.base.KVPolicy` hooks such a policy delegates here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import operator
from collections.abc import Sequence

from kvcache.block_pool import ARCBlockPool, BlockInfo, BlockPool, KVCacheManager
from kvcache.tiers import Lookup, LookupContext, RemoteSource, TierSet, chunk_key, tail_chunk
from kvcache.transfer import PageCopy, TierLoad, TierStore

_log = logging.getLogger(__name__)

LOAD_FAILURE_POLICIES = ("recompute", "fail")
EVICTION_POLICIES = ("lru", "arc")


@dataclasses.dataclass
class TierCounts:
    """What the host tier saw of one secondary tier, in chunks (pages)."""

    hits: int = 0  # chunks it loaded into the host tier
    misses: int = 0  # lookups it answered MISS (a prefix lookup stops at the first chunk no tier holds)
    corrupt: int = 0  # loads that failed verification (the tier dropped the chunk; its tokens recomputed)
    lost: int = 0  # loads of a chunk that was gone by then (evicted between lookup and load)
    retries: int = 0  # lookups it answered RETRY
    # hash blocks an admission computed although the walk found them held, from the first page only this
    # tier held on: no host page was free to load that page into (the host tier is the staging area)
    unstaged: int = 0


def host_pools(blocks: dict[str, int], *, eviction: str = "lru", enable_prefix_caching: bool = True
               ) -> dict[str, BlockPool]:
    """One pool of `blocks[g]` pages per cache group, in `blocks`' order: LRU (a BlockPool's free queue) or
    ARC (kvcache.block_pool.ARCBlockPool, which always hashes)."""
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
    return {g: ARCBlockPool(n) if eviction == "arc" else BlockPool(n, enable_prefix_caching=enable_prefix_caching)
            for g, n in blocks.items()}


def _remote(req) -> RemoteSource | None:
    """The request's producer of other page spans (`kv_remote`, a PageSpans a P/D consumer's engine sets
    from kv_transfer_params) as a lookup context carries it, or None."""
    spans = getattr(req, "kv_remote", None)
    return None if spans is None else RemoteSource(spans, req.tokens, tuple(req.extra_keys), req.num_tokens - 1)


def _by_pool(pages: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
    """(group, host block) pairs -> per group its blocks, in the pairs' order (a pool's free and touch of
    a list are those of its blocks one at a time, in order; pools do not interact)."""
    out: dict[str, list[int]] = {}
    for g, b in pages:
        out.setdefault(g, []).append(b)
    return out


def _none(key) -> None:  # the lookup of a pool that does not hash its pages
    return None


class PrefixLookup:
    """The answer of `HostTier.lookup_prefix`.

    pages: per hash block from the device-pool hit on, the pages of every group ending there, as
        (group, "device" | "host", block); it ends on a page boundary of every group (a multiple of
        KVCacheManager.hit_multiple blocks). Empty when `retry`. Built on first use when the lookup gave
        `cut` (the admissions read `split`).
    blocks: len(pages), the hash blocks it covers.
    retry: tier loads are under way (or a tier answered RETRY): the admission must wait (`must_retry`).
    pins: host pages pinned for this request by earlier rounds; `release` them once the admission holds
        what it uses.
    cut: builds `split` (then `pages` is built from `build`, on first use).
    from_pools: `split` is the device and host pools' walk cut to `blocks` (given `cut`): a function of
        those pools' index entries of the request's hashes, the hash block it starts at, the request's
        token count and `blocks` alone, so a caller may remember what it derives from it in the request's
        PrefixWalk (kvcache.block_pool).
    """

    def __init__(self, pages: list | None, retry: bool = False, pins: list | None = None, *,
                 blocks: int | None = None, build=None, cut=None):
        self._pages, self._build, self._split, self._cut, self.columns = pages, build, None, cut, None
        self.retry, self.pins = retry, [] if pins is None else pins
        self.blocks = len(pages) if pages is not None else blocks
        self.from_pools = cut is not None

    @property
    def pages(self) -> list:
        if self._pages is None:
            self._pages = self._build()
        return self._pages

    def split(self) -> dict[str, tuple[list, list]]:
        """Per group with pages, its pages of `pages` in order as two lists: the device block of each (None
        where the device does not hold it), and the host blocks of those the device does not hold. One
        group's pages end every ratio-th hash block: the j-th of group g of ratio r ends at the first such
        block past the device hit, plus j x r."""
        if self._split is None:
            self._split = self._cut() if self._cut is not None else {
                g: ([b if where == "device" else None for _, where, b in col],
                    [b for _, where, b in col if where != "device"]) for g, col in self.by_group().items()}
        return self._split

    def by_group(self) -> dict[str, list]:
        """Per group, its (group, where, block) entries of `pages`, in order (`split`'s order)."""
        if self.columns is None:
            if self._split is not None or self._cut is not None:
                self.columns = {g: _entries(g, *col) for g, col in self.split().items()}
            else:
                cols: dict[str, list] = {}
                for pages in self.pages:
                    for p in pages:
                        cols.setdefault(p[0], []).append(p)
                self.columns = cols
        return self.columns


def _entries(g: str, dev: list, host: list) -> list:
    """A group's (group, where, block) entries from its `PrefixLookup.split` columns."""
    on_host = iter(host).__next__
    return [(g, "device", d) if d is not None else (g, "host", on_host()) for d in dev]


_IS_NONE = functools.partial(operator.is_, None)


class HostTier:
    """The host pools of one replica's policy and the secondary tiers behind them (see the module docstring).

    pools: per cache group, its host pool (`host_pools`); a group without one is never served from the
        host or the tiers.
    outbox: the policy's list of recorded transfers (kvcache.policies.base.Policy.outbox): page copies,
        tier stores and loads go there in decision order.
    tiers: the secondary tiers (kvcache.tiers.TierSet) or None; fingerprint: the deployment's layout
        fingerprint (chunk keys; required with tiers).
    peer_waits: the name of a tier (the P/D connector's peer tier) or None: a request whose lookup names a
        peer (a P/D consumer's, `LookupContext.peer`) waits, as a RETRY, while no host page is free to load
        its next page that only that tier holds, instead of computing what the tier holds (vLLM's decode
        waits for blocks); at most `max_retry_rounds` attempts, then it computes it (counted in `unstaged`
        like any other).
    """

    def __init__(self, pools: dict[str, BlockPool], *, outbox: list, tiers: TierSet | None = None,
                 fingerprint: str = "", load_failure_policy: str = "recompute", max_tier_rounds: int = 16,
                 max_retry_rounds: int = 512, peer_waits: str | None = None):
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, got {load_failure_policy!r}")
        if tiers is not None and len(tiers) and not fingerprint:
            raise ValueError("secondary tiers need the deployment's layout fingerprint (kvcache.tiers.layout_fingerprint)")
        self.pools = pools
        self.outbox = outbox
        self.tiers = tiers if tiers is not None and len(tiers) else None
        self.fingerprint = fingerprint
        self.load_failure_policy = load_failure_policy
        self.max_tier_rounds = max_tier_rounds
        self.max_retry_rounds = max_retry_rounds
        self.peer_waits = peer_waits
        self.tier_counts = {t.name: TierCounts() for t in self.tiers.tiers} if self.tiers else {}
        self.loaded_pages: collections.Counter[tuple[str, str]] = collections.Counter()  # (tier, group) -> pages loaded
        self.loading: dict[str, set[int]] = {}  # request -> its tier loads not yet reported
        self.jobs: dict[int, tuple[str, int, str, int, bytes]] = {}  # job -> (request, tier, group, host block, hash)
        self.tier_pins: dict[str, list[tuple[str, int]]] = {}  # request -> host pages pinned for its next admission
        # request -> (tier index, hash blocks) its last lookup left to compute for want of a free host page
        self._unstaged: dict[str, tuple[int, int]] = {}
        self.tier_rounds: dict[str, int] = {}  # request -> admissions that started tier loads
        self.retry_rounds: dict[str, int] = {}  # request -> admissions that waited on a tier's RETRY only
        self.inflight: dict[tuple[str, bytes], int] = {}  # (group, hash) -> the job loading it
        self.waiters: dict[int, set[str]] = {}  # job -> the requests waiting for it
        self._retry: set[str] = set()  # requests whose last admission answered RETRY
        self._unstaged_logged = False
        self.events = None  # the KV event sink (kvcache.events.KVEventRecorder), None: events off
        self._job_info: dict[int, BlockInfo] = {}  # tier load job -> its page's event payload (events on)

    # ---------------------------------------------------------------------------------------- pools
    def attach_events(self, sink) -> None:
        """Report the pools' registrations and evictions ("CPU") and the tier stores planned here."""
        self.events = sink
        for pool in self.pools.values():
            pool.attach_events(sink, "CPU")

    def reset_prefix_cache(self) -> None:
        """Drop every host page's hash (held pages stay held; a load in flight registers its page again)."""
        for pool in self.pools.values():
            pool.reset_prefix_cache()

    def lookup(self, group: str, h: bytes) -> int | None:
        """The host page registered under (group, h), or None. Takes no reference."""
        pool = self.pools.get(group)
        return pool.lookup(group, h) if pool is not None else None

    def key(self) -> tuple:
        """What an admission reads here, for KVPolicy.admission_key: the pools' versions and what the tiers
        would answer (TierSet.version)."""
        return tuple(p.version for p in self.pools.values()), self.tiers.version() if self.tiers is not None else None

    # ------------------------------------------------------------------------------------ storing
    def copy_out(self, group: str, src: Sequence[int], dst: Sequence[int], infos: Sequence[BlockInfo | None] = ()
                 ) -> None:
        """Plan the copy of device blocks `src` into host pages `dst` of `group` (one PageCopy), then the
        write-through of those of `dst` registered under a hash to every secondary tier (one TierStore,
        after the copy in plan order). A page not registered (its hash held by another page, or the pool
        not hashing) stays out of the tiers. infos: per dst page its event payload (events on)."""
        if not src:
            return
        self.outbox.append(PageCopy(group, "d2h", tuple(src), tuple(dst)))
        if self.tiers is None:
            return
        pool = self.pools[group]
        blocks, ckeys = [], []
        for k, hb in enumerate(dst):
            key = pool.block_key[hb]
            if key is None:
                continue
            ck = chunk_key(self.fingerprint, group, key[1])
            blocks.append(hb)
            ckeys.append(ck)
            if self.events is not None:
                self.events.tier_store_planned(ck, group, key[1], infos[k], len(self.tiers))
        if blocks:
            self.outbox.append(TierStore(group, tuple(blocks), tuple(ckeys)))

    def store_tail(self, kv: KVCacheManager, req) -> None:
        """A finishing P/D prefill leg (`req.kv_produce`: the leading tokens a consumer takes): plan, for each
        cache group whose page holding those tokens' end is partial, the copy of that device page into a
        host page and its store to every secondary tier under `kvcache.tiers.tail_chunk`'s key. A consumer
        whose pages are finer than ours then gets every full page of its own below kv_produce tokens
        (docs/engine.md, P/D "Layout"). The host page is not registered (no prefix lookup can hit a
        partial page) and is freed at once: the store snapshots it, in plan order, before anything later
        can write it. Nothing when the host pool has no free page (the consumer computes those tokens)."""
        n = getattr(req, "kv_produce", 0)
        if self.tiers is None or not n or req.num_computed_tokens < n:
            return
        rb = kv.requests[req.req_id]
        for g in kv.groups:
            pool = self.pools.get(g)
            page = kv.group_tokens_per_block[g]
            tail = tail_chunk(self.fingerprint, g, page, kv.tokens_per_block, req.tokens, req.extra_keys, n, rb.hashes)
            if pool is None or tail is None or pool.num_free == 0 or rb.tables[g][tail[0] // page] < 0:
                continue
            (hb,) = pool.allocate(1)
            self.outbox.append(PageCopy(group=g, direction="d2h", src=(rb.tables[g][tail[0] // page],), dst=(hb,)))
            self.outbox.append(TierStore(g, (hb,), (tail[1],)))
            pool.free([hb])

    # ---------------------------------------------------------------------------------- admission
    def lookup_prefix(self, kv: KVCacheManager, req, first: int) -> PrefixLookup:
        """The prefix of waiting `req` past its device-pool hit (`first` hash blocks, KVCacheManager.admit),
        page by page: device pool, host pool, then the secondary tiers in order. Takes no reference to
        what it returns (the caller touches the pages it uses), except on a retry: then the host hits are
        pinned for the next attempt and loads are planned for the tier-only pages."""
        rb = kv.requests[req.req_id]
        pins = self.tier_pins.pop(req.req_id, [])
        ask = (self.tiers is not None and self.tier_rounds.get(req.req_id, 0) < self.max_tier_rounds
               and self.retry_rounds.get(req.req_id, 0) < self.max_retry_rounds)
        max_hit = min((req.num_tokens - 1) // kv.tokens_per_block, len(rb.hashes))
        # per hash block past the device hit: [(group, where, block)] of the pages ending there; where:
        # "device", "host", or the index of the secondary tier that holds it (block None)
        found, retry = [], False
        # the keys this walk may ask the tiers, in order, computed only if a tier asks (a peer tier sends
        # them in one lookup message instead of one per admission attempt)
        ctx = LookupContext(req.req_id, lambda: [chunk_key(self.fingerprint, g, rb.hashes[c]) for c in range(first, max_hit)
                                                 for g in kv.groups if not (c + 1) % kv.ratio[g] and g in self.pools],
                            peer=getattr(req, "kv_peer", None), lease=getattr(req, "kv_lease", 0),
                            remote=_remote(req), tokens=(req.tokens, tuple(req.extra_keys), req.num_tokens - 1))
        dev = kv.pool.cached.get if kv.pool.enable_prefix_caching else _none
        host = {g: (p.cached.get if p.enable_prefix_caching else _none) for g, p in self.pools.items()}
        hashes, period = rb.hashes, kv.hit_multiple
        # per (c + 1) mod the period: the groups with a page ending at hash block c, in kv.groups order
        ending = [tuple(g for g in kv.groups if not r % kv.ratio[g]) for r in range(period)]
        tiered = None  # the first hash block (from `first`) with a page only a tier holds
        # the leading hash blocks whose pages the device or host pools all hold, by C-level lookups per
        # group (a long context walks thousands of blocks at each admission attempt): their pages are
        # `columns` (per group, `PrefixLookup.split`'s two lists), laid out per hash block only when asked
        # (`leading`); the loop below goes on from the first block with a page neither holds (into
        # `found`), so its tiers are asked exactly as before
        walk = functools.partial(self._pool_walk, kv, dev, host, hashes, first, max_hit)
        first_missing, columns = (walk() if rb.walk is None else
                                  rb.walk.memo("host tier", (first, max_hit), (kv.pool, *self.pools.values()), walk,
                                               kv.verify_walks))
        fast = max(first_missing - first, 0)

        def leading(n: int = fast) -> list:  # the pages of the walk's first n (<= fast) hash blocks
            take = {g: iter(_entries(g, *col)).__next__ for g, col in columns.items()}
            return [[take[g]() for g in ending[(c + 1) % period]] for c in range(first, first + n)]

        for c in range(first_missing, max_hit):
            h, pages = hashes[c], []
            for g in ending[(c + 1) % period]:
                key = (g, h)
                if (b := dev(key)) is not None:
                    pages.append((g, "device", b))
                elif g in host and (b := host[g](key)) is not None:
                    pages.append((g, "host", b))
                elif ask and g in self.pools and self._ask_tiers(g, h, pages, ctx):
                    if tiered is None:
                        tiered, tiered_by = fast + len(found), pages[-1][1]
                else:
                    retry |= bool(pages) and pages[-1] == "retry"
                    break
            else:
                found.append(pages)
                continue
            break
        if ask and (retry or tiered is not None):
            # the pool walk's leading pages are the device's and the host's: nothing to load there
            started, short = self._start_loads(kv, req, first + fast, found)
            waits = (not (started or retry) and ctx.peer is not None and self.peer_waits is not None
                     and self.tiers.tiers[tiered_by].name == self.peer_waits)
            # what it would compute, were this its last round (its rounds may run out): from the first
            # tier-only page this round found no host page for
            if waits:
                self._unstaged[req.req_id] = (tiered_by, fast + len(found) - tiered)
            elif started and short is not None:
                self._unstaged[req.req_id] = (short[0], first + fast + len(found) - short[1])
            elif started or retry:
                self._unstaged.pop(req.req_id, None)
            if started or retry or waits:
                rounds = self.tier_rounds if started else self.retry_rounds
                rounds[req.req_id] = rounds.get(req.req_id, 0) + 1
                self._retry.add(req.req_id)
                # what earlier rounds loaded and what this walk found on the host stay pinned for the next
                # attempt (else the loads just reserved could evict them, and the next round miss them):
                # per group, the host pages of its leading pages ending before block first + fast, then
                # those of `found`, in the walk's order (a pool's order is all that its touch and its
                # later `release` read)
                hits = []
                for g, (dev_col, host_col) in columns.items():
                    k = (first + fast) // kv.ratio[g] - first // kv.ratio[g]  # its pages ending in that span
                    hits.extend(zip(itertools.repeat(g), host_col[: dev_col[:k].count(None)]))
                hits.extend((g, b) for p in found for g, where, b in p if where == "host")
                if waits:  # a page is pinned once however many rounds the request waits (each pin is a reference)
                    held = set(pins)
                    hits = [p for p in hits if p not in held]
                for g, blocks in _by_pool(hits).items():  # one call per pool: each pool sees its pages in order
                    self.pools[g].touch(blocks)
                self.tier_pins.setdefault(req.req_id, [])[:0] = pins + hits
                return PrefixLookup([], True)
        if tiered is not None:  # no load started: no host page was free for the first tier-only page
            self._unstaged[req.req_id] = (tiered_by, fast + len(found) - tiered)
        elif ask:  # the tiers hold nothing past what the pools hold
            self._unstaged.pop(req.req_id, None)
        # (not asked: its rounds are spent, and what its last waiting round found it computes now)
        # what the device and the host hold: up to the first page that only a tier has
        cut = fast + len(found) if tiered is None else tiered
        keep = cut - cut % kv.hit_multiple  # a hit ends on a page boundary of every group
        # MTP: the hit gives back its last page (KVCacheManager.drop_last_hit). The walk began at the page
        # the device hit gave back, so dropping the walk's last page drops the whole hit's last page
        if kv.drop_last_hit and keep:
            keep -= kv.hit_multiple
        if keep <= fast:  # the pool walk's columns, cut to the pages ending before block first + keep
            def cut_columns() -> dict[str, tuple[list, list]]:
                cols = {}
                for g, (dev_col, host_col) in columns.items():
                    if cut := (first + keep) // kv.ratio[g] - first // kv.ratio[g]:
                        cols[g] = (dev_col := dev_col[:cut], host_col[: dev_col.count(None)])
                return cols

            return PrefixLookup(None, False, pins, blocks=keep, build=lambda: leading(keep), cut=cut_columns)
        return PrefixLookup((leading() + found)[:keep], False, pins)

    @staticmethod
    def _pool_walk(kv: KVCacheManager, dev, host: dict, hashes: Sequence[bytes], first: int, max_hit: int
                   ) -> tuple[int, dict[str, tuple[list, list]]]:
        """`lookup_prefix`'s walk over the device and host pools alone: -> (the first hash block in
        [first, max_hit) with a page that neither pool holds, else max_hit; per group its pages ending at
        the hash blocks before it, as `PrefixLookup.split` lists them: each page's device block or None,
        and the host blocks of those the device does not hold). Reads nothing but the pools' index entries
        of `hashes` (no side effect), so looking past the first miss changes nothing, and a request's
        PrefixWalk may remember it (its callers never change the columns); C-level loops only."""
        columns, stop = {}, max_hit
        for g in kv.groups:
            r = kv.ratio[g]
            c0 = -(-(first + 1) // r) * r - 1  # the first hash block >= first that ends a page of g
            keys = list(zip(itertools.repeat(g), hashes[c0:max_hit:r]))
            on_dev = list(map(dev, keys))
            # the host is asked only for the pages the device does not hold (positions `off`), in order
            off = list(itertools.compress(itertools.count(), map(_IS_NONE, on_dev)))
            on_host = list(map(host.get(g, _none), map(keys.__getitem__, off)))
            # the first page neither holds: the first of `off` the host does not hold either
            k = next(itertools.compress(itertools.count(), map(_IS_NONE, on_host)), None)
            j = len(keys) if k is None else off[k]
            stop = min(stop, c0 + j * r) if j < len(keys) else stop
            del on_dev[j:]
            columns[g] = (on_dev, on_host if k is None else on_host[:k])
        return stop, columns

    def release(self, pins: Sequence[tuple[str, int]]) -> None:
        """Unpin host pages (`PrefixLookup.pins`), once the admission holds the ones it uses."""
        for g, blocks in _by_pool(pins).items():  # as one free per page: each pool sees its pages in order
            pool = self.pools[g]
            if len(set(blocks)) < len(blocks):  # a page pinned twice: never freed more often than referenced
                b = next((b for b, n in collections.Counter(blocks).items() if n > pool.ref_count[b]), None)
                if b is not None:
                    raise RuntimeError(f"host page {b} of {g!r} unpinned more often than it was pinned (double free)")
            pool.free(blocks)

    def admitted(self, req_id: str) -> None:
        """`req_id` is in: a later preemption may ask the tiers again from scratch. What its last lookup left to
        compute for want of a free host page is counted now (`TierCounts.unstaged`)."""
        tier, blocks = self._unstaged.pop(req_id, (0, 0))
        if blocks:
            name = self.tiers.tiers[tier].name
            self.tier_counts[name].unstaged += blocks
            if not self._unstaged_logged:
                self._unstaged_logged = True
                _log.warning("host tier: an admission computes %d hash blocks that tier %r held: no host page was "
                             "free to load them into (counted as the tier's 'unstaged'; logged once per host tier)",
                             blocks, name)
        self.tier_rounds.pop(req_id, None)
        self.retry_rounds.pop(req_id, None)

    def _ask_tiers(self, g: str, h: bytes, pages: list, ctx: LookupContext) -> bool:
        """Ask the secondary tiers for page (g, h): a HIT is appended to `pages` as (g, tier, None) -> True;
        a RETRY appends the marker "retry" -> False; a MISS -> False."""
        t, answer = self.tiers.lookup(chunk_key(self.fingerprint, g, h), ctx)
        if answer is Lookup.HIT:
            pages.append((g, t, None))
            return True
        for tier in self.tiers.tiers[: t if answer is Lookup.RETRY else len(self.tiers)]:
            self.tier_counts[tier.name].misses += 1
        if answer is Lookup.RETRY:
            self.tier_counts[self.tiers.tiers[t].name].retries += 1
            pages.append("retry")
        return False

    def _start_loads(self, kv: KVCacheManager, req, first: int, found: list) -> tuple[bool, tuple[int, int] | None]:
        """Reserve host pages for the tier-only pages of `found` (hash blocks from `first`) and plan their
        loads (one TierLoad per tier and group), as far as free host pages go; a page another request's
        load is already bringing is waited for, not loaded twice. -> (whether the request now waits, and
        (tier, hash block) of the first tier-only page no host page was free for, else None)."""
        loads: dict[tuple[int, str], tuple[list, list, list]] = {}
        jobs = self.loading.setdefault(req.req_id, set())
        short = None  # (tier, hash block) of the first tier-only page no host page was free for
        for c, pages in enumerate(found, start=first):
            for g, where, _ in pages:
                if isinstance(where, str):
                    continue
                h = kv.requests[req.req_id].hashes[c]
                if (job := self.inflight.get((g, h))) is not None:
                    self.waiters[job].add(req.req_id)
                    jobs.add(job)
                    continue
                pool = self.pools[g]
                if pool.num_free == 0:
                    short = (where, c)
                    break
                hb = pool.allocate(1)[0]  # reserved (referenced, no key) until the load is reported
                job = self.tiers.new_job()
                self.jobs[job] = (req.req_id, where, g, hb, h)
                if self.events is not None:
                    rb = kv.requests[req.req_id]
                    self._job_info[job] = kv.page_info(rb, req.tokens, g, (c + 1) // kv.ratio[g] - 1)
                self.inflight[(g, h)] = job
                self.waiters[job] = {req.req_id}
                jobs.add(job)
                keys, blocks, ids = loads.setdefault((where, g), ([], [], []))
                keys.append(chunk_key(self.fingerprint, g, h))
                blocks.append(hb)
                ids.append(job)
            else:
                continue
            break
        for (t, g), (keys, blocks, ids) in loads.items():
            self.outbox.append(TierLoad(t, g, tuple(keys), tuple(blocks), tuple(ids)))
        if not jobs:
            del self.loading[req.req_id]
        return bool(jobs), short

    def waiting_for(self, req_id: str) -> bool:
        return req_id in self.loading

    def must_retry(self, req_id: str) -> bool:
        if req_id in self._retry:
            self._retry.discard(req_id)
            return True
        return False

    def on_tier_results(self, results) -> dict[str, str]:
        """The runner's report of finished tier loads ((job, status), ...): a loaded page joins its host
        pool (pinned for its request until that request's next admission); a failed one is freed and its
        tokens will be recomputed. Status "failed" is the engine's, for a load a failed step never
        submitted or whose result it lost (`unreported_loads`): freed like a lost one, but neither counted
        against the tier nor failing anyone (the step's failure already failed its requests).
        -> under kv_load_failure_policy "fail", {req_id: why} for every request still waiting on a load
        that failed (the scheduler finishes each with "error"; the engine serves on), else {}: one failed
        chunk fails the requests that needed it, never the step."""
        failed: dict[str, str] = {}
        for job, status in results:
            req_id, t, g, hb, h = self.jobs.pop(job)
            del self.inflight[(g, h)]
            counts = self.tier_counts[self.tiers.tiers[t].name]
            pool = self.pools[g]
            info = self._job_info.pop(job, None)
            if status == "ok":
                counts.hits += 1
                self.loaded_pages[(self.tiers.tiers[t].name, g)] += 1
                pool.cache(g, hb, h, info)
                if req_id in self.loading:  # it still waits for this load (this job is in its set)
                    self.tier_pins.setdefault(req_id, []).append((g, hb))
                else:  # it was dropped: the page stays in the host pool, unpinned
                    pool.free([hb])
            else:
                if status == "corrupt":
                    counts.corrupt += 1
                elif status != "failed":
                    counts.lost += 1
                pool.free([hb])
                if status != "failed" and self.load_failure_policy == "fail":
                    why = (f"kv_load_failure_policy='fail': the load of KV chunk "
                           f"{chunk_key(self.fingerprint, g, h).hex()} (cache group {g!r}) from secondary tier "
                           f"{self.tiers.tiers[t].name!r} failed ({status})")
                    for waiter in self.waiters[job]:
                        failed.setdefault(waiter, why)
            for waiter in self.waiters.pop(job):
                jobs = self.loading.get(waiter)
                if jobs is not None:
                    jobs.discard(job)
                    if not jobs:
                        del self.loading[waiter]
        return failed

    def has_loads(self) -> bool:
        """Tier loads not yet reported (their host pages stay reserved until a step reads the results)."""
        return bool(self.jobs)

    def unreported_loads(self) -> tuple[int, ...]:
        """Load jobs this tier waits for that no runner will ever report: neither queued in the outbox nor
        submitted to the tiers and unpolled (`TierSet.pending_loads`, which the runner shares). Only a
        step that raised leaves such jobs (it stopped before submitting them, or polled their results and
        lost them with its StepResult); the engine reports them "failed" (`on_tier_results`), so their
        host pages come back and `has_loads` can turn false."""
        queued = {j for op in self.outbox if isinstance(op, TierLoad) for j in op.jobs}
        pending = self.tiers.pending_loads if self.tiers is not None else {}
        return tuple(j for j in self.jobs if j not in queued and j not in pending)

    def drop(self, req_id: str) -> None:
        """Waiting `req_id` leaves for good: its pinned host pages are released; loads it started finish for
        the requests also waiting on them, or land in the host pool unpinned."""
        self.release(self.tier_pins.pop(req_id, []))
        self.loading.pop(req_id, None)
        self._unstaged.pop(req_id, None)
        for waiting in self.waiters.values():
            waiting.discard(req_id)
        self._retry.discard(req_id)
        self.admitted(req_id)

    # ------------------------------------------------------------------------------------- counts
    def admission_counts(self) -> tuple[int, ...]:
        """Each tier's lookups answered MISS and RETRY."""
        return tuple(n for c in self.tier_counts.values() for n in (c.misses, c.retries))

    def add_admission_counts(self, delta: tuple[int, ...]) -> None:
        for c, (misses, retries) in zip(self.tier_counts.values(), zip(delta[::2], delta[1::2])):
            c.misses += misses
            c.retries += retries

    def tier_metrics(self) -> dict:
        """Per secondary tier by name: what the host tier saw of it (`TierCounts`), the tier's own counters
        (kvcache.tiers.TierStats) and the seconds its store and load jobs took with their counts
        ("store_time_s", "store_jobs", "load_time_s", "load_jobs")."""
        out = {}
        for tier in (self.tiers.tiers if self.tiers else ()):
            seen = dataclasses.asdict(self.tier_counts[tier.name])
            st = tier.stats
            own = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if not f.name.endswith("_latency")}
            times = {f"{k}_{u}": getattr(getattr(st, f"{k}_latency"), a)
                     for k in ("store", "load") for u, a in (("time_s", "sum"), ("jobs", "count"))}
            out[tier.name] = {**own, **times, **seen}
        return out

    def admission_state(self) -> tuple:
        """Everything an admission attempt may change here, comparable with == (the scheduler's check of
        skipped retries, Scheduler.verify_skipped_admissions): the pools' states, what the tiers would
        answer, and the bookkeeping of loads and pins."""
        import copy

        return ([p.state() for p in self.pools.values()], self.key()[1],
                copy.deepcopy((self.loading, self.jobs, self.tier_pins, self.tier_rounds, self.retry_rounds,
                               self.inflight, self.waiters, self._retry, self._unstaged,
                               {k: dataclasses.astuple(c) for k, c in self.tier_counts.items()})))


class HostTierPolicy:
    """The kvcache.policies.base.KVPolicy hooks a policy with a `HostTier` (`self.host_tier`) delegates to it. Put
    it before kvcache.policies.base.Policy among the bases."""

    host_tier: HostTier
    outbox: list

    def attach_events(self, sink) -> None:
        self.host_tier.attach_events(sink)

    def reset_prefix_cache(self) -> None:
        self.host_tier.reset_prefix_cache()

    def has_transfers(self) -> bool:
        """Operations not yet taken, or tier loads not yet reported: their host pages stay reserved until
        a step reads the results, so the engine keeps stepping even when the request that started them
        was aborted and nothing else runs."""
        return bool(self.outbox) or self.host_tier.has_loads()

    def waiting_for(self, req) -> bool:
        return self.host_tier.waiting_for(req.req_id)

    def must_retry(self, req) -> bool:
        return self.host_tier.must_retry(req.req_id)

    def on_tier_results(self, results) -> dict[str, str]:
        return self.host_tier.on_tier_results(results)

    def unreported_tier_loads(self) -> tuple[int, ...]:
        return self.host_tier.unreported_loads()

    def admission_counts(self) -> tuple[int, ...]:
        return self.host_tier.admission_counts()

    def add_admission_counts(self, delta: tuple[int, ...]) -> None:
        self.host_tier.add_admission_counts(delta)

    def drop(self, kv: KVCacheManager, req) -> None:
        """Its pinned host pages are released; loads it started finish for the requests also waiting on
        them, or land in the host pool unpinned."""
        self.host_tier.drop(req.req_id)
