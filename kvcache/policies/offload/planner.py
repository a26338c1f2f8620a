"""kv_policy="offload": tiered KV offloading, the host tier: a CPU prefix cache behind the device pool (BRIEF §7; vLLM's
`OffloadingConnector` with its CPU backend). `kv_policy="offload"`.

A planner like every kvcache.policies policy: it decides on the device pool and on its own host pools and records
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
  is recomputed. This replaces the swap of `kvcache.policies.swap.SwapPolicy` (`kv_policy="swap"`), which
  copied a victim's pages out at eviction and kept nothing after a request finished.

- **Secondary tiers** (kvcache.tiers): every page the host tier stores is passed on to each of them
  (write-through: what the host evicts is still there), and the prefix lookup asks device -> host ->
  the tiers in order, page by page; pages found only in a tier are loaded into host pages reserved for
  them while the admission answers RETRY. The mechanism (pools keyed by hash, write-through, lookup,
  loads, pins, failures, abort, counts) is kvcache.host_tier's `HostTier`, which HiSparse's host pools
  use too (kvcache.policies.hisparse); this policy adds what the offload tier does with it: every page stored
  as it fills, freed once copied, and copied back to the device at admission.

KV events (kvcache.events, `attach_events`): the host pools report their stores and evictions under
medium "CPU"; a store planned to the secondary tiers is registered with the recorder, which announces it
as "STORAGE" once a tier reports it written (kvcache.tiers.TierSet.attach_events).

What is not built yet: the stores do not overlap the forward (they are plan operations, run
before it). Host-pool keys carry no fingerprint: a host pool lives and dies with one engine,
whose layout is fixed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Sequence

from kvcache.block_pool import BlockInfo, BlockPool, KVCacheManager, table_entries
from kvcache.host_tier import LOAD_FAILURE_POLICIES, HostTier, HostTierPolicy, TierCounts, host_pools
from kvcache.policies.base import Policy, RequestView
from kvcache.tiers import TierSet
from kvcache.transfer import PageCopy

_IS_NONE = functools.partial(operator.is_, None)

__all__ = ["LOAD_FAILURE_POLICIES", "OffloadPolicy", "OffloadStats", "TierCounts", "host_tier_blocks"]


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


def _walk_order(kv: KVCacheManager, split: dict, first: int) -> list[int]:
    """The device pages of a prefix walk from hash block `first` (`PrefixLookup.split`) in the walk's order:
    hash block by hash block, the groups ending at one in kv.groups order."""
    pages = []
    for gi, g in enumerate(kv.groups):
        r = kv.ratio[g]
        c0 = -(-(first + 1) // r) * r - 1  # the hash block its first page ends at
        pages += [(c0 + j * r, gi, b) for j, b in enumerate(split.get(g, ((), ()))[0]) if b is not None]
    return [b for _, _, b in sorted(pages)]


def host_tier_blocks(capacity_bytes: int, page_bytes: dict[str, int], group_tokens: dict[str, int]) -> dict[str, int]:
    """Host pages per cache group for a host tier of `capacity_bytes`: the budget split in proportion to
    each group's bytes per token (page bytes / tokens per page), so both hold the same number of tokens."""
    per_token = {g: page_bytes[g] / group_tokens[g] for g in page_bytes}
    tokens = capacity_bytes / sum(per_token.values())
    return {g: int(tokens // group_tokens[g]) for g in page_bytes}


class OffloadPolicy(HostTierPolicy, Policy):
    """kv_policy="offload" (a kvcache.policies.base.KVPolicy): the host tier of `host_blocks` pages per cache
    group (`host_tier_blocks`); page_bytes: per group, the bytes of one page (kvcache.layout.page_bytes);
    blocks_per_chunk: hash blocks stored together (a chunk is stored once all of it is full); eviction:
    "lru" (a BlockPool's free queue) or "arc" (kvcache.block_pool.ARCBlockPool); peer_waits: HostTier's. The
    host pools and the secondary tiers behind them are `host_tier` (kvcache.host_tier.HostTier); `host` is
    its pools."""

    def __init__(self, host_blocks: dict[str, int], page_bytes: dict[str, int], *, blocks_per_chunk: int = 1,
                 eviction: str = "lru", tiers: TierSet | None = None, fingerprint: str = "",
                 load_failure_policy: str = "recompute", max_tier_rounds: int = 16, max_retry_rounds: int = 512,
                 peer_waits: str | None = None):
        super().__init__()
        if not host_blocks or min(host_blocks.values()) < 1:
            raise ValueError(f"the offload host tier needs at least one page per cache group, got {host_blocks} "
                             "(raise cpu_offload_bytes)")
        if not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be a positive int, got {blocks_per_chunk!r}")
        # host pools always hash their pages: the host tier is a prefix cache even when the device pool's
        # prefix caching is off
        self.host = host_pools(host_blocks, eviction=eviction)
        self.host_tier = HostTier(self.host, outbox=self.outbox, tiers=tiers, fingerprint=fingerprint,
                                  load_failure_policy=load_failure_policy, max_tier_rounds=max_tier_rounds,
                                  max_retry_rounds=max_retry_rounds, peer_waits=peer_waits)
        self.page_bytes = dict(page_bytes)
        self.blocks_per_chunk = blocks_per_chunk
        self.stats = OffloadStats()
        self.stored: dict[str, dict[str, int]] = {}  # per request and group: pages [0, n) already considered
        # per request admitted and not yet prepared: (hash blocks its device hit covered, per group
        # {page: (host block, hash)} of the pages that wait for a device block and a load)
        self.pending: dict[str, tuple[int, dict[str, dict[int, tuple[int, bytes]]]]] = {}
        self.host_bytes_peak = 0

    # ---------------------------------------------------------------------------------------- spec
    accepts_connector = True
    uses_tiers = True

    @classmethod
    def check(cls, deploy) -> None:
        if deploy.cpu_offload_bytes <= 0:
            raise ValueError(f"DeployConfig.kv_policy={deploy.kv_policy!r} needs cpu_offload_bytes > 0 (the host pool size)")

    @classmethod
    def host_sizes(cls, deploy, cfg, pages: dict[str, int]) -> dict:
        tiers = host_tier_blocks(deploy.cpu_offload_bytes, pages, deploy.group_tokens_per_block(pages))
        if min(tiers.values()) < 1:
            raise ValueError(f"DeployConfig.cpu_offload_bytes={deploy.cpu_offload_bytes} holds no page of some cache "
                             f"group ({tiers}; pages of {pages} bytes)")
        return {"host_blocks": tiers}

    @classmethod
    def make(cls, deploy, sizes, tiers=None, fingerprint: str = "") -> OffloadPolicy:
        opts = deploy.offload_options
        return cls(sizes.host_blocks, sizes.page_bytes, blocks_per_chunk=opts["blocks_per_chunk"],
                   eviction=opts["eviction_policy"], tiers=tiers, fingerprint=fingerprint,
                   load_failure_policy=deploy.kv_load_failure_policy, peer_waits=deploy.pd_wait_tier)

    def tier_metrics(self) -> dict:
        """"cpu" (the host tier, in hash blocks and bytes): "hits" (loaded host -> device at admission,
        whatever brought them to the host), "misses", "corrupt" (0: host memory is not verified),
        "store_bytes", "load_bytes", "stored_pages", "loaded_pages", "store_skipped_pages"; then each
        secondary tier by name (kvcache.host_tier.HostTier.tier_metrics)."""
        return {"cpu": {"corrupt": 0, **dataclasses.asdict(self.stats)}, **self.host_tier.tier_metrics()}

    @classmethod
    def reports_tiers(cls, deploy) -> bool:
        return True

    prometheus_series = (("host_usage", "gauge", "vllm:kv_offload_host_cache_usage_perc", "Offload host tier usage."),)

    def prometheus_values(self, sch, engine) -> dict[str, float]:
        capacity = sum(engine.sizes.host_blocks.get(g, 0) * b for g, b in engine.sizes.page_bytes.items())
        return {"host_usage": self.host_bytes_used() / capacity if capacity else 0.0}

    # ------------------------------------------------------------------------------------- admission
    def admit(self, kv: KVCacheManager, req: RequestView) -> int:
        return self.admit_if(kv, req, None)

    def admit_if(self, kv: KVCacheManager, req: RequestView, fits) -> int | None:
        """`admit`, asking `fits` (the scheduler's, see KVPolicy.admit_if) before taking anything: its
        device hit, the device pages of its walk and the host pages to load are found and entered in its
        tables and `pending` without a reference. Given back when it does not fit (one `requeue` per pool
        instead of a touch and a free), taken as `admit` takes it otherwise. Not asked when the lookup
        answered RETRY or handed over pins (host pages pinned by an earlier round, released here): those
        attempts go the full way."""
        n = kv.admit(req.req_id, req.tokens, req.extra_keys, take=False)
        rb = kv.requests[req.req_id]
        self.stored[req.req_id] = {g: 0 for g in kv.groups}
        i = n // kv.tokens_per_block
        found = self.host_tier.lookup_prefix(kv, req, i)
        if found.retry:  # tier loads under way: the scheduler forgets this attempt (`must_retry`)
            kv.take(req.req_id)
            self.pending[req.req_id] = (i, {})
            return n
        walk = functools.partial(self._walk_pages, kv, rb.hashes, i, found)
        if found.from_pools and rb.walk is not None:  # a function of the pools' index entries of its hashes
            walk = functools.partial(rb.walk.memo, "offload pages", (i, found.blocks, req.num_tokens),
                                     (kv.pool, *self.host.values()), walk, kv.verify_walks)
        entries, pend, pinned, dev = walk()
        for g, e in entries.items():
            rb.tables[g].extend(e)
        self.pending[req.req_id] = (i + (found.blocks if dev is None else dev), dict(pend))
        rb.num_cached_blocks = i + found.blocks
        computed = rb.num_cached_blocks * kv.tokens_per_block
        if fits is not None and not found.pins and not fits(computed, kv.free_in_tables(req.req_id)):
            # what the touches below and then `forget` and KVCacheManager.free(keep_hashes=True) would leave
            for g, blocks in pinned.items():
                self.host[g].requeue(blocks)
            del self.pending[req.req_id], self.stored[req.req_id]
            kv.give_back(req.req_id)
            return None
        kv.take(req.req_id)
        for g, blocks in pinned.items():
            self.host[g].touch(blocks)  # pinned until its load is recorded
        kv.pool.touch(_walk_order(kv, found.split(), i))
        self.host_tier.release(found.pins)
        return computed

    @staticmethod
    def _walk_pages(kv: KVCacheManager, hashes, i: int, found) -> tuple[dict, dict, dict, int | None]:
        """What `admit_if` makes of the pages of a prefix lookup `found` past a device hit of `i` hash blocks
        (the request's tables hold its hit): -> (per group, the entries its table gets: its device pages'
        blocks, -1 for a host page that waits for a device block and a load; `pend`: per group, {page:
        (host block, hash)} of those, the groups in the order the walk met their first host page; per
        group its host blocks in order, to pin; the hash blocks past the device hit the walk's leading
        device pages cover, None without host pages). Reads only `found`, `hashes` and the groups' ratios
        (a PrefixWalk walk when `found.from_pools`); the caller changes none of it."""
        split = found.split()
        # group by group (the walk is thousands of pages long; one group's pages do not interact with
        # another's), C-level loops over its pages
        entries = {}
        firsts = []  # (hash block of the group's first host page, the group's index, group, its pend, its pins)
        for gi, g in enumerate(kv.groups):
            dev_col, host_col = split.get(g, ((), ()))
            if not dev_col:
                continue
            r = kv.ratio[g]
            c0, base = -(-(i + 1) // r) * r - 1, i // r  # the hash block its first page ends at; its table's length
            entries[g] = list(table_entries(dev_col))
            if host_col:
                hosts = list(itertools.compress(range(len(dev_col)), map(_IS_NONE, dev_col)))
                firsts.append((c0 + hosts[0] * r, gi, g,
                               {base + j: (hb, hashes[c0 + j * r]) for j, hb in zip(hosts, host_col)}, host_col))
        firsts.sort()
        pend = {g: pages for _, _, g, pages, _ in firsts}
        pinned = {g: pins for _, _, g, _, pins in firsts}
        # chunks the device held: the device hit and, under MTP (drop_last_hit), the walk's leading device
        # pages (the page the device hit gave back, kept when more follows it)
        return entries, pend, pinned, firsts[0][0] - i if firsts else None

    def forget(self, kv: KVCacheManager, req: RequestView) -> None:
        for g, pages in self.pending.pop(req.req_id, (0, {}))[1].items():
            self.host[g].free([hb for hb, _ in pages.values()])
        self.stored.pop(req.req_id, None)

    def admission_key(self, kv: KVCacheManager, req: RequestView, running: Sequence[RequestView]) -> object:
        # admission reads the host pools and asks the tiers (whose answers change as stores land and
        # chunks go); make_room reads nothing
        return self.host_tier.key()

    def extra_blocks(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> int:
        return sum(len(p) for p in self.pending.get(req.req_id, (0, {}))[1].values())

    def prepare(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> None:
        """Once, at admission: the request's host-only prefix pages get device blocks and are loaded, and
        the lookup is counted (hits: hash blocks the host tier added to the device hit; misses: full hash
        blocks of the prompt that neither held)."""
        if req.req_id not in self.pending:
            return
        self.host_tier.admitted(req.req_id)
        device_chunks, pend = self.pending.pop(req.req_id)
        rb = kv.requests[req.req_id]
        fresh = kv.pool.allocate(sum(len(p) for p in pend.values()))
        events = kv.pool.events is not None
        k = 0
        for g, pages in pend.items():
            dst = fresh[k:k + len(pages)]
            k += len(pages)
            table = rb.tables[g]
            for page, b in zip(pages, dst):
                table[page] = b
            src, hashes = zip(*pages.values()) if pages else ((), ())
            # full pages again: later requests hit them on the device
            kv.pool.cache_all(g, dst, hashes, [kv.page_info(rb, req.tokens, g, p) for p in pages] if events else None)
            self.host[g].free(src)  # unpinned: the copy below runs before any later store can take them
            self.outbox.append(PageCopy(g, "h2d", tuple(src), tuple(dst)))
            self.stats.loaded_pages += len(src)
            self.stats.load_bytes += len(src) * self.page_bytes[g]
        hit = req.num_computed_tokens // kv.tokens_per_block
        self.stats.hits += hit - device_chunks
        self.stats.misses += max(0, (req.num_tokens - 1) // kv.tokens_per_block - hit)

    # -------------------------------------------------------------------------------------- storing
    def _store(self, kv: KVCacheManager, reqs: Sequence[RequestView]) -> None:
        """Copy the requests' full, not yet stored pages to the host tier (one PageCopy per group, then
        their write-through to the secondary tiers: HostTier.copy_out). A page allocated here stays
        referenced until every page of the call is placed, so one copy never names a host page twice
        (with one free page left, freeing it at once would hand it out again: two sources copied into
        one page, kept under the later key)."""
        copies: dict[str, tuple[list[int], list[int], list[BlockInfo]]] = {}
        events = self.host_tier.events is not None
        ratio = kv.ratio
        for req in reqs:
            rb, done = kv.requests[req.req_id], self.stored[req.req_id]
            chunks = rb.num_cached_blocks - rb.num_cached_blocks % self.blocks_per_chunk
            for g in kv.groups:
                r = ratio[g]
                full = chunks // r
                if done[g] >= full:  # nothing newly full (most steps of a decoding request)
                    continue
                pool, table = self.host[g], rb.tables[g]
                # page j's hash is its last hash block's (KVCacheManager.page_hash_index: (j + 1) r - 1)
                hashes = rb.hashes[(done[g] + 1) * r - 1 : full * r : r]

                def place(pages: list[int]) -> None:
                    # host pages for `pages` (the least recently used ones, their old keys dropped), keyed
                    blocks = pool.allocate(len(pages))
                    hs = [hashes[j - done[g]] for j in pages]
                    new = [kv.page_info(rb, req.tokens, g, j) for j in pages] if events else None
                    pool.cache_all(g, blocks, hs, new)
                    src, dst, infos = copies.setdefault(g, ([], [], []))
                    src.extend(table[j] for j in pages)
                    dst.extend(blocks)
                    infos.extend(new if events else [None] * len(pages))

                # as one page at a time: a lookup, then either a hit (touched and freed: the most recently
                # used, in runs between allocations, so that a run's order in the free queue is the pages'
                # order and the allocation after it sees them moved) or a host page allocated and keyed.
                # The lookups are made up front: a hit stays one unless an allocation before it took its
                # page (checked when it comes); a miss stays one (only its own page is keyed under its hash).
                # A plain pool's consecutive allocations are made in one call (the same pages, in order);
                # an ARC pool's next page depends on what `cache` recorded, so it allocates one at a time
                batch = type(pool) is BlockPool
                key_of, avail = pool.block_key, pool.num_free  # (a touch and a free leave num_free as it is)
                fresh: list[int] = []
                need: list[int] = []
                for j, h, hb in zip(itertools.count(done[g]), hashes, pool.lookup_all(g, hashes)):
                    if hb is not None:
                        if need:
                            place(need)
                            need = []
                        if key_of[hb] == (g, h):
                            fresh.append(hb)
                            continue
                    if table[j] < 0 or avail == 0:
                        self.stats.store_skipped_pages += table[j] >= 0
                        continue
                    if fresh:
                        pool.touch(fresh)
                        pool.free(fresh)
                        fresh = []
                    avail -= 1
                    need.append(j)
                    if not batch:
                        place(need)
                        need = []
                if need:
                    place(need)
                if fresh:
                    pool.touch(fresh)
                    pool.free(fresh)
                done[g] = full
        for g, (src, dst, infos) in copies.items():
            self.host[g].free(dst)
            self.host_tier.copy_out(g, src, dst, infos)  # write-through: the host pages, once written, to every tier
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
        self.host_tier.store_tail(kv, req)  # a P/D prefill leg's last partial page, for finer consumers
        self.stored.pop(req.req_id, None)

    def after_step(self, kv: KVCacheManager, running: Sequence[RequestView]) -> None:
        self._store(kv, running)
