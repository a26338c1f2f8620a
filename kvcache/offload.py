"""Tiered KV offloading, the host tier: a CPU prefix cache behind the device pool (BRIEF §7; vLLM's
`OffloadingConnector` with its CPU backend). `kv_policy="offload"`.

A planner like every kvcache.policy: it decides on the device pool and on its own host pools and records
page copies (kvcache.transfer.PageCopy) that the step's runner executes in order before the forward.

Mechanics
- **Store as blocks fill.** After every step, the pages of every running request that are now full of
  computed KV (in chunks of `blocks_per_chunk` hash blocks) and not yet on the host are copied device ->
  host in one batched copy per cache group; a finishing or evicted request's last full pages likewise,
  before its blocks go back to the pool. The copy runs before the next forward (the transfer ordering
  contract), so a device block freed right after its store is copied out before anyone overwrites it.
- **Host pools, one per cache group** (`kvcache.block_pool.BlockPool`s used as caches): a page's key is
  (cache group, chained block hash), the hash the device prefix cache uses (it covers the tokens and the
  request's salt). Every host page is cached and unreferenced except while a load reads it, so the
  order in which the pool reuses free pages is the eviction policy: LRU (the free queue: a store or a
  hit makes a page most recently used, a new store takes the least recently used page and drops its
  key) or ARC (`ARCBlockPool`: pages used again are kept apart from pages stored once). The host budget is split between the groups in
  proportion to their bytes per token, the rate at which both fill.
- **Reload at admission.** The prefix lookup asks the device pool first and the host pools after it,
  page by page (a page of each group must be found for a hash block to count, as for device hits); a
  page found only on the host gets a device block when the request's first chunk is allocated
  (`extra_blocks` / `prepare`), is copied host -> device, and joins the device prefix cache. The host
  page is pinned (referenced) from the lookup until its load is recorded, so no store can take it.
- **Preemption is recompute of what no cache holds.** An evicted request's full pages are already on the
  host (stored as they filled), so nothing is copied at eviction: when it is admitted again its prefix
  comes from the device cache where it survived and from the host otherwise; only the partial last page
  is recomputed. This replaces the swap of `kvcache.policy.SwapPolicy` (`kv_policy="swap"`), which
  copied a victim's pages out at eviction and kept nothing after a request finished.

- **Secondary tiers** (kvcache.tiers; `tiers`): every page the host tier stores is passed on to each of
  them (a `TierStore` after its device -> host copy: write-through, so what the host evicts is still
  there). The prefix lookup asks device -> host -> the tiers in order, page by page; pages found only
  in a tier are loaded into host pages reserved for them (`TierLoad`, asynchronous) and the admission
  answers RETRY: the request keeps its place in the queue, requests behind it may be admitted, and it
  is tried again once its loads are reported (`on_tier_results`, from the runner's StepResult); the
  pages are then host hits, pinned until that admission. A tier that answers RETRY itself (a store of
  that chunk in flight) is asked again next step. A load that fails (the chunk is gone or fails
  verification) leaves its host page empty: those tokens are recomputed (kv_load_failure_policy
  "recompute"), or the step raises ("fail"). At most `max_tier_rounds` admissions of one request wait
  on tiers; after that it takes what the device and host hold. Tier keys are kvcache.tiers.chunk_key:
  the engine's layout fingerprint, the group, the chained hash. The host tier is the staging area:
  what one admission brings back from the tiers is bounded by the host pages free for it (a prefix
  longer than that recomputes the rest), and a chunk two requests need is loaded once.

KV events (kvcache.events, `attach_events`): the host pools report their stores and evictions under
medium "CPU"; a store planned to the secondary tiers is registered with the recorder, which announces it
as "STORAGE" once a tier reports it written (kvcache.tiers.TierSet.attach_events).

What is not built yet (issue 20): the stores do not overlap the forward (they are plan operations, run
before it). Host-pool keys carry no fingerprint: a host pool lives and dies with one engine,
whose layout is fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvcache.block_pool import ARCBlockPool, BlockInfo, BlockPool, KVCacheManager
from kvcache.policy import PreemptPolicy, RequestView
from kvcache.tiers import Lookup, LookupContext, TierSet, chunk_key
from kvcache.transfer import PageCopy, TierLoad, TierStore

LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclasses.dataclass
class OffloadStats:
    """Counted in hash blocks (`tokens_per_block` tokens; a page of a group with larger pages counts as
    the hash blocks it covers) and bytes."""

    hits: int = 0  # hash blocks of admitted prompts served from the host tier (loaded, not recomputed)
    misses: int = 0  # full hash blocks of admitted prompts found in neither the device pool nor the host
    stored_pages: int = 0  # pages copied device -> host (all groups)
    loaded_pages: int = 0  # pages copied host -> device (all groups)
    store_bytes: int = 0
    load_bytes: int = 0
    store_skipped_pages: int = 0  # full pages not stored: every host page was pinned by a pending load


@dataclasses.dataclass
class TierCounts:
    """What the offload policy saw of one secondary tier, in chunks (pages)."""

    hits: int = 0  # chunks it loaded into the host tier
    misses: int = 0  # lookups it answered MISS (a prefix lookup stops at the first chunk no tier holds)
    corrupt: int = 0  # loads that failed verification (the tier dropped the chunk; its tokens recomputed)
    lost: int = 0  # loads of a chunk that was gone by then (evicted between lookup and load)
    retries: int = 0  # lookups it answered RETRY


def host_tier_blocks(capacity_bytes: int, page_bytes: dict[str, int], group_tokens: dict[str, int]) -> dict[str, int]:
    """Host pages per cache group for a host tier of `capacity_bytes`: the budget split in proportion to
    each group's bytes per token (page bytes / tokens per page), so both hold the same number of tokens."""
    per_token = {g: page_bytes[g] / group_tokens[g] for g in page_bytes}
    tokens = capacity_bytes / sum(per_token.values())
    return {g: int(tokens // group_tokens[g]) for g in page_bytes}


class OffloadPolicy(PreemptPolicy):
    """kv_policy="offload" (a kvcache.policy.KVPolicy): the host tier of `host_blocks` pages per cache
    group (`host_tier_blocks`); page_bytes: per group, the bytes of one page (kvcache.layout.page_bytes);
    blocks_per_chunk: hash blocks stored together (a chunk is stored once all of it is full); eviction:
    "lru" (a BlockPool's free queue) or "arc" (kvcache.block_pool.ARCBlockPool)."""

    def __init__(self, host_blocks: dict[str, int], page_bytes: dict[str, int], *, blocks_per_chunk: int = 1,
                 eviction: str = "lru", tiers: TierSet | None = None, fingerprint: str = "",
                 load_failure_policy: str = "recompute", max_tier_rounds: int = 16, max_retry_rounds: int = 512):
        super().__init__()
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, got {load_failure_policy!r}")
        if tiers is not None and len(tiers) and not fingerprint:
            raise ValueError("secondary tiers need the deployment's layout fingerprint (kvcache.tiers.layout_fingerprint)")
        if not host_blocks or min(host_blocks.values()) < 1:
            raise ValueError(f"the offload host tier needs at least one page per cache group, got {host_blocks} "
                             "(raise cpu_offload_bytes)")
        if not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be a positive int, got {blocks_per_chunk!r}")
        if eviction not in ("lru", "arc"):
            raise ValueError(f"eviction must be 'lru' or 'arc', got {eviction!r}")
        # host pools always hash their pages: the host tier is a prefix cache even when the device pool's
        # prefix caching is off
        self.host = {g: ARCBlockPool(n) if eviction == "arc" else BlockPool(n, enable_prefix_caching=True)
                     for g, n in host_blocks.items()}
        self.page_bytes = dict(page_bytes)
        self.blocks_per_chunk = blocks_per_chunk
        self.stats = OffloadStats()
        self.stored: dict[str, dict[str, int]] = {}  # per request and group: pages [0, n) already considered
        # per request admitted and not yet prepared: (hash blocks its device hit covered, per group
        # {page: (host block, hash)} of the pages that wait for a device block and a load)
        self.pending: dict[str, tuple[int, dict[str, dict[int, tuple[int, bytes]]]]] = {}
        self.host_bytes_peak = 0
        self.tiers = tiers if tiers is not None and len(tiers) else None
        self.fingerprint = fingerprint
        self.load_failure_policy = load_failure_policy
        self.max_tier_rounds = max_tier_rounds
        self.max_retry_rounds = max_retry_rounds
        self.tier_counts = {t.name: TierCounts() for t in self.tiers.tiers} if self.tiers else {}
        self.loading: dict[str, set[int]] = {}  # request -> its tier loads not yet reported
        self.jobs: dict[int, tuple[str, int, str, int, bytes]] = {}  # job -> (request, tier, group, host block, hash)
        self.tier_pins: dict[str, list[tuple[str, int]]] = {}  # request -> loaded host pages pinned for it
        self.tier_rounds: dict[str, int] = {}  # request -> admissions that started tier loads
        self.retry_rounds: dict[str, int] = {}  # request -> admissions that waited on a tier's RETRY only
        self.inflight: dict[tuple[str, bytes], int] = {}  # (group, hash) -> the job loading it
        self.waiters: dict[int, set[str]] = {}  # job -> the requests waiting for it
        self._retry: set[str] = set()  # requests whose last admission answered RETRY
        self.events = None  # the KV event sink (kvcache.events.KVEventRecorder), None: events off
        self._job_info: dict[int, BlockInfo] = {}  # tier load job -> its page's event payload (events on)

    def attach_events(self, sink) -> None:
        """Report the host pools' stores and evictions ("CPU") and the tier stores this policy plans."""
        self.events = sink
        for g, pool in self.host.items():
            pool.attach_events(sink, "CPU")

    def reset_prefix_cache(self) -> None:
        """Drop every host page's hash (pinned pages stay pinned; a load in flight registers its page again)."""
        for pool in self.host.values():
            pool.reset_prefix_cache()

    # ------------------------------------------------------------------------------------- admission
    def admit(self, kv: KVCacheManager, req: RequestView) -> int:
        n = kv.admit(req.req_id, req.tokens, req.extra_keys)
        rb = kv.requests[req.req_id]
        self.stored[req.req_id] = {g: 0 for g in kv.groups}
        pins = self.tier_pins.pop(req.req_id, [])  # released below, once this admission holds the pages
        ask_tiers = (self.tiers is not None and self.tier_rounds.get(req.req_id, 0) < self.max_tier_rounds
                     and self.retry_rounds.get(req.req_id, 0) < self.max_retry_rounds)
        i = n // kv.tokens_per_block
        max_hit = min((req.num_tokens - 1) // kv.tokens_per_block, len(rb.hashes))
        # per hash block past the device hit: [(group, where, block)] of the pages ending there; where:
        # "device", "host", or the index of the secondary tier that holds it (block None)
        found, retry = [], False
        # the keys this walk may ask the tiers, in order, computed only if a tier asks (a peer tier sends
        # them in one lookup message instead of one per admission attempt)
        ctx = LookupContext(req.req_id, lambda: [chunk_key(self.fingerprint, g, rb.hashes[c]) for c in range(i, max_hit)
                                                 for g in kv.groups if not (c + 1) % kv.ratio[g]])
        while i + len(found) < max_hit:
            c = i + len(found)
            h, pages = rb.hashes[c], []
            for g in kv.groups:
                if (c + 1) % kv.ratio[g]:
                    continue  # no page of this group ends at this hash block
                if (b := kv.pool.lookup(g, h)) is not None:
                    pages.append((g, "device", b))
                elif (b := self.host[g].lookup(g, h)) is not None:
                    pages.append((g, "host", b))
                elif ask_tiers and self._ask_tiers(g, h, pages, ctx):
                    pass
                else:
                    retry |= bool(pages) and pages[-1] == "retry"
                    break
            else:
                found.append(pages)
                continue
            break
        if self.tiers is not None and ask_tiers and (retry or any(isinstance(w, int) for p in found for _, w, _ in p)):
            started = self._start_loads(kv, req, i, found)
            if started or retry:
                rounds = self.tier_rounds if started else self.retry_rounds
                rounds[req.req_id] = rounds.get(req.req_id, 0) + 1
                self._retry.add(req.req_id)
                self.pending[req.req_id] = (n // kv.tokens_per_block, {})
                # what earlier rounds loaded and what this walk found on the host stay pinned for the next
                # attempt (else the loads just reserved could evict them, and the next round miss them)
                hits = [(g, b) for p in found for g, where, b in p if where == "host"]
                for g, b in hits:
                    self.host[g].touch([b])
                self.tier_pins.setdefault(req.req_id, [])[:0] = pins + hits
                return n  # the scheduler forgets this attempt (`must_retry`)
        # what the device and the host tier hold: up to the first page that only a tier has
        cut = next((k for k, p in enumerate(found) if any(not isinstance(w, str) for _, w, _ in p)), len(found))
        keep = cut - cut % kv.hit_multiple  # a hit ends on a page boundary of every group
        # MTP: the hit gives back its last page (KVCacheManager.drop_last_hit). The walk began at the page
        # the device hit gave back, so dropping the walk's last page drops the whole hit's last page
        if kv.drop_last_hit and keep:
            keep -= kv.hit_multiple
        device, pend = [], {}
        for c, pages in enumerate(found[:keep], start=i):
            for g, where, b in pages:
                table = rb.tables[g]
                if where == "device":
                    device.append(b)
                else:
                    pend.setdefault(g, {})[len(table)] = (b, rb.hashes[c])
                    self.host[g].touch([b])  # pinned until its load is recorded
                table.append(b if where == "device" else -1)
        kv.pool.touch(device)
        for g, hb in pins:
            self.host[g].free([hb])
        # chunks the device held: the device hit and, under MTP (drop_last_hit), the walk's leading device
        # pages (the page the device hit gave back, kept when more follows it)
        dev = next((c for c, pages in enumerate(found[:keep]) if any(w != "device" for _, w, _ in pages)), keep)
        self.pending[req.req_id] = (i + dev, pend)
        rb.num_cached_blocks = i + keep
        return (i + keep) * kv.tokens_per_block

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

    def _start_loads(self, kv: KVCacheManager, req: RequestView, first: int, found: list) -> bool:
        """Reserve host pages for the tier-only pages of `found` (hash blocks from `first`) and plan their
        loads (one TierLoad per tier and group), as far as free host pages go; a page another request's
        load is already bringing is waited for, not loaded twice. -> whether the request now waits."""
        loads: dict[tuple[int, str], tuple[list, list, list]] = {}
        jobs = self.loading.setdefault(req.req_id, set())
        for c, pages in enumerate(found, start=first):
            for g, where, _ in pages:
                if isinstance(where, str):
                    continue
                h = kv.requests[req.req_id].hashes[c]
                if (job := self.inflight.get((g, h))) is not None:
                    self.waiters[job].add(req.req_id)
                    jobs.add(job)
                    continue
                pool = self.host[g]
                if pool.num_free == 0:
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
        return bool(jobs)

    def waiting_for(self, req: RequestView) -> bool:
        return req.req_id in self.loading

    def must_retry(self, req: RequestView) -> bool:
        if req.req_id in self._retry:
            self._retry.discard(req.req_id)
            return True
        return False

    def on_tier_results(self, results) -> None:
        """The runner's report of finished tier loads ((job, status), ...): a loaded page joins the host
        tier (pinned for its request until that request's next admission); a failed one is freed and
        its tokens will be recomputed ("fail": raise)."""
        failed = []
        for job, status in results:
            req_id, t, g, hb, h = self.jobs.pop(job)
            del self.inflight[(g, h)]
            counts = self.tier_counts[self.tiers.tiers[t].name]
            pool = self.host[g]
            info = self._job_info.pop(job, None)
            if status == "ok":
                counts.hits += 1
                pool.cache(g, hb, h, info)
                if req_id in self.loading:  # it still waits for this load (this job is in its set)
                    self.tier_pins.setdefault(req_id, []).append((g, hb))
                else:  # it was dropped: the page stays in the host tier, unpinned
                    pool.free([hb])
            else:
                if status == "corrupt":
                    counts.corrupt += 1
                else:
                    counts.lost += 1
                pool.free([hb])
                failed.append((req_id, self.tiers.tiers[t].name, status))
            for waiter in self.waiters.pop(job):
                jobs = self.loading.get(waiter)
                if jobs is not None:
                    jobs.discard(job)
                    if not jobs:
                        del self.loading[waiter]
        if failed and self.load_failure_policy == "fail":
            raise RuntimeError(f"secondary-tier loads failed (kv_load_failure_policy='fail'): {failed}")

    def admission_counts(self) -> tuple[int, ...]:
        """Each tier's lookups answered MISS and RETRY."""
        return tuple(n for c in self.tier_counts.values() for n in (c.misses, c.retries))

    def add_admission_counts(self, delta: tuple[int, ...]) -> None:
        for c, (misses, retries) in zip(self.tier_counts.values(), zip(delta[::2], delta[1::2])):
            c.misses += misses
            c.retries += retries

    def has_transfers(self) -> bool:
        """Operations not yet taken, or tier loads not yet reported: their host pages stay reserved until
        a step reads the results, so the engine keeps stepping even when the request that started them
        was aborted and nothing else runs."""
        return bool(self.outbox) or bool(self.jobs)

    def drop(self, kv: KVCacheManager, req: RequestView) -> None:
        """Its pinned host pages are released; loads it started finish for the requests also waiting on
        them, or land in the host tier unpinned (`on_tier_results` pins only for a request still waiting)."""
        for g, hb in self.tier_pins.pop(req.req_id, []):
            self.host[g].free([hb])
        self.loading.pop(req.req_id, None)
        for waiting in self.waiters.values():
            waiting.discard(req.req_id)
        self._retry.discard(req.req_id)
        self.tier_rounds.pop(req.req_id, None)
        self.retry_rounds.pop(req.req_id, None)

    def forget(self, kv: KVCacheManager, req: RequestView) -> None:
        for g, pages in self.pending.pop(req.req_id, (0, {}))[1].items():
            self.host[g].free([hb for hb, _ in pages.values()])
        self.stored.pop(req.req_id, None)

    def admission_key(self, kv: KVCacheManager, req: RequestView, running: Sequence[RequestView]) -> object:
        # admission reads the host pools and asks the tiers (whose answers change as stores land and
        # chunks go); make_room reads nothing
        return tuple(p.version for p in self.host.values()), self.tiers.version() if self.tiers is not None else None

    def extra_blocks(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> int:
        return sum(len(p) for p in self.pending.get(req.req_id, (0, {}))[1].values())

    def prepare(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> None:
        """Once, at admission: the request's host-only prefix pages get device blocks and are loaded, and
        the lookup is counted (hits: hash blocks the host tier added to the device hit; misses: full hash
        blocks of the prompt that neither held)."""
        if req.req_id not in self.pending:
            return
        self.tier_rounds.pop(req.req_id, None)  # admitted: a later preemption may ask the tiers again
        self.retry_rounds.pop(req.req_id, None)
        device_chunks, pend = self.pending.pop(req.req_id)
        rb = kv.requests[req.req_id]
        fresh = iter(kv.pool.allocate(sum(len(p) for p in pend.values())))
        events = kv.pool.events is not None
        for g, pages in pend.items():
            src, dst = [], []
            for page, (hb, h) in pages.items():
                b = next(fresh)
                rb.tables[g][page] = b
                # a full page again: later requests hit it on the device
                kv.pool.cache(g, b, h, kv.page_info(rb, req.tokens, g, page) if events else None)
                src.append(hb)
                dst.append(b)
            self.host[g].free(src)  # unpinned: the copy below runs before any later store can take them
            self.outbox.append(PageCopy(g, "h2d", tuple(src), tuple(dst)))
            self.stats.loaded_pages += len(src)
            self.stats.load_bytes += len(src) * self.page_bytes[g]
        hit = req.num_computed_tokens // kv.tokens_per_block
        self.stats.hits += hit - device_chunks
        self.stats.misses += max(0, (req.num_tokens - 1) // kv.tokens_per_block - hit)

    # -------------------------------------------------------------------------------------- storing
    def _store(self, kv: KVCacheManager, reqs: Sequence[RequestView]) -> None:
        """Copy the requests' full, not yet stored pages to the host tier (one PageCopy per group). A page
        allocated here stays referenced until every page of the call is placed, so one copy never names a
        host page twice (with one free page left, freeing it at once would hand it out again: two sources
        copied into one page, kept under the later key)."""
        copies: dict[str, tuple[list[int], list[int], list[bytes], list[BlockInfo]]] = {}
        events = self.events is not None
        for req in reqs:
            rb, done = kv.requests[req.req_id], self.stored[req.req_id]
            chunks = rb.num_cached_blocks - rb.num_cached_blocks % self.blocks_per_chunk
            for g in kv.groups:
                pool, table = self.host[g], rb.tables[g]
                full = chunks // kv.ratio[g]
                for j in range(done[g], full):
                    h = rb.hashes[kv.page_hash_index(g, j)]
                    hb = pool.lookup(g, h)
                    if hb is None:
                        if table[j] < 0 or pool.num_free == 0:
                            self.stats.store_skipped_pages += table[j] >= 0
                            continue
                        hb = pool.allocate(1)[0]  # the least recently used host page, its old key dropped
                        info = kv.page_info(rb, req.tokens, g, j) if events else None
                        pool.cache(g, hb, h, info)
                        src, dst, keys, infos = copies.setdefault(g, ([], [], [], []))
                        src.append(table[j])
                        dst.append(hb)
                        keys.append(h)
                        infos.append(info)
                    else:
                        pool.touch([hb])  # already on the host: now the most recently used
                        pool.free([hb])
                done[g] = max(done[g], full)
        for g, (src, dst, keys, infos) in copies.items():
            self.host[g].free(dst)
            self.outbox.append(PageCopy(g, "d2h", tuple(src), tuple(dst)))
            if self.tiers is not None:  # write-through: the host pages, once written, to every tier
                ckeys = tuple(chunk_key(self.fingerprint, g, h) for h in keys)
                self.outbox.append(TierStore(g, tuple(dst), ckeys))
                if events:
                    for ck, h, info in zip(ckeys, keys, infos):
                        self.events.tier_store_planned(ck, g, h, info, len(self.tiers))
            self.stats.stored_pages += len(src)
            self.stats.store_bytes += len(src) * self.page_bytes[g]
        if copies:
            self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes_used())

    def host_bytes_used(self) -> int:
        """Bytes of host pages holding a stored page."""
        return sum(len(p.cached) * self.page_bytes[g] for g, p in self.host.items())

    # ----------------------------------------------------------------------------------- lifecycle
    def evict(self, kv: KVCacheManager, victim: RequestView) -> bool:
        self._store(kv, [victim])
        self.stored.pop(victim.req_id, None)
        return False  # recomputed, less what the device cache and the host tier give back at re-admission

    def on_finish(self, kv: KVCacheManager, req: RequestView) -> None:
        self._store(kv, [req])
        self.stored.pop(req.req_id, None)

    def after_step(self, kv: KVCacheManager, running: Sequence[RequestView]) -> None:
        self._store(kv, running)
