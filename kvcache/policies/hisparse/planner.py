"""HiSparse residency policy: keep requests decoding while most of their MLA KV lives in a host pool,
with the rows the indexer selects served from a per-request hot buffer (BRIEF §6).

A planner like every kvcache.policies policy: it decides on the block pools and records page copies and hot
buffer resets (kvcache.transfer) that the step's runner executes in order before the forward. The
device side (the decode step's view and the row copies) is kvcache.host; the resolver op is
attention.hisparse.

Pages of the MLA cache group, per request:
- **dirty**: device copy only (the tail being written, or sealed but not yet copied);
- **clean**: sealed and pre-copied to the host pool; still on the device (pinned);
- **unpinned**: clean, and its device block given back to the pool (`KVCacheManager.release`). Its rows
  stay readable until the pool hands the block out again, which `BlockPool.generation` reveals: from
  then on the page is **host-only** and the resolver copies the rows it selects from the host.

Per request: *full* residency (every page on the device), *mixed* (some pages host-only or unpinned),
*none* (admitted on a prefix held only by the host pool: every prefix page host-only).

Mechanics
- Pre-copy: after every step, the newly sealed pages of every running request go to the host pool in one
  batched copy covering all MLA layers (`after_step`; it runs before the next step's forward), so
  releasing a page later copies nothing.
- Release under pressure only: when free blocks fall below the watermark (max(one hot buffer, 10% of the
  pool)) or a chunk does not fit (`make_room`), clean pages of decoding requests are released, oldest
  pages first; the last two pages of a request never are, nor pages of a request still prefilling.
- Hot buffer: a request that loses a page first leases ceil(H / block_size) blocks from the same pool
  (H = hisparse_device_buffer_size, default (MTP drafts + 2) x top-k rows); they live in the same device tables, so a
  row id means the same thing whether resident or hot. The device resolver (attention.hisparse) fills and
  evicts its slots; the lease returns to the pool when the request stops running.
- Prefill over host-only pages (a new turn on a parked prefix, or a long chunk of a mixed request):
  the host-only pages are staged back onto the device before the chunk runs (clean, so pressure can
  release them again at no copy cost); unpinned pages still intact are simply taken back.
- Indexer keys are not managed: a running request's keys stay on the device. When a request stops
  running (finished or evicted) its full pages are *parked*: MLA pages are already in the host pool,
  and their hashes are registered there; indexer-key pages go to a separate host offload pool
  (`cpu_offload_bytes`). A later request with the same prefix (the next turn of a session) takes
  device-cached pages where they survive and host-cached ones otherwise: MLA pages stay host-only,
  indexer pages are copied back.
- One host-memory system with offloading: the two host pools are a kvcache.host_tier.HostTier, the
  mechanism the offload host tier uses (pages registered under (group, chained hash), write-through to
  secondary tiers, the device -> host -> tiers prefix lookup with RETRY, loads into reserved host pages,
  pins, failures), with two budgets: `hisparse_host_pool_bytes` for MLA pages, the offload budget
  (`cpu_offload_bytes`, kv_transfer_config's cpu_bytes_to_use) for parked indexer keys. Every MLA page
  pre-copied and every indexer page parked is also stored to each secondary tier, so what the host pools
  evict is still there; a later admission (the next turn, or another engine on the same fs root) that
  finds a page only in a tier loads it into the host pool while its admission answers RETRY. A loaded
  MLA page is then used host-only, like a parked one; a loaded indexer page is copied back to the
  device at admission, like a parked one.
- KV events (kvcache.events, `attach_events`): both host pools report the hashes they register (MLA
  pages at pre-copy, parked indexer pages, pages loaded from a tier) and drop under medium "CPU"; tier
  stores are announced as the offload tier's are ("STORAGE").
- MTP (speculative decoding): a row verifying its last token and its drafts is a decode row here (one
  known token left), resolved through the hot buffer position by position (glm53.engine.runner); the
  hot buffer defaults to (drafts + 2) x top-k rows (`hot_buffer_rows`). Pre-copy seals pages by the
  computed count, which excludes rejected drafts and the lookahead positions the draft passes write, so
  no page goes to the host before every position in it is final. The MTP layer's rows and indexer keys
  are part of the MLA and indexer pages and follow their rules.
- Why hot slots are never stale: a hot slot holds a copy of one position's row, keyed by position, and
  a position's KV never changes; hot rows are leased (no other request writes them). What can go stale
  is a device mapping of an unpinned page whose block was reused: `row_tables` checks the generation
  before each step and drops such pages to host-only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvcache.block_pool import BlockPool, KVCacheManager, NoFreeBlocks, table_entries
from kvcache.block_pool import found as found_blocks
from kvcache.host_tier import HostTier, HostTierPolicy, host_pools
from kvcache.policies.base import RequestView, RowTables
from kvcache.policies.hisparse.spec import TAIL_PAGES, HiSparseSpec, ResolveStats, device_blocks_per_request
from kvcache.tiers import TierSet
from kvcache.transfer import PageCopy, ResetLease

@dataclasses.dataclass(frozen=True)
class HiSparseRow:
    """What a HiSparse decode row needs beyond its block tables: the host-pool block of each MLA page
    (-1: no host copy) and its hot-buffer lease slot (-1: none; then every page it selects is on the
    device)."""

    host_blocks: tuple[int, ...]
    lease: int


@dataclasses.dataclass
class HiSparseStats:
    precopied_pages: int = 0  # MLA pages copied to the host pool after sealing
    released_pages: int = 0  # MLA pages whose device block went back to the pool
    lost_pages: int = 0  # released pages whose block was reused (host-only from then on)
    staged_pages: int = 0  # host-only MLA pages copied back to the device for a prefill chunk
    parked_index_pages: int = 0  # indexer-key pages copied to the host offload pool
    restored_index_pages: int = 0  # indexer-key pages copied back at admission
    host_prefix_pages: int = 0  # prompt pages admitted from the host pools (not recomputed)
    leases: int = 0
    residency_steps: dict = dataclasses.field(default_factory=lambda: {"full": 0, "mixed": 0, "none": 0})


@dataclasses.dataclass
class Residency:
    """One request's MLA pages beyond what its block table says."""

    host: list[int] = dataclasses.field(default_factory=list)  # host block per page (-1: no host copy)
    unpinned: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # page -> (block, generation)
    sealed: int = 0  # pages [0, sealed) have been considered for pre-copy
    lease: int = -1  # hot-buffer lease slot, -1: none
    pending_index: dict[int, int] = dataclasses.field(default_factory=dict)  # page -> host indexer block
    host_prefix: int = 0  # prompt pages admitted from the host pools, not yet counted
    # changes made in place (not appends) to the request's MLA or indexer table entries, `host` entries or
    # `unpinned`: every one is made by the planner, which counts it here (`HiSparsePolicy.row_tables`)
    writes: int = 0
    # `row_tables`' last answer: (MLA table, indexer table, (their lengths, len(host), writes, lease), the
    # row's MLA and indexer tables, its HiSparseRow, its residency state)
    snapshot: tuple | None = None


class HiSparsePolicy(HostTierPolicy, HiSparseSpec):
    """kv_policy="hisparse" (a kvcache.policies.base.KVPolicy): host pools of `host_mla_blocks` MLA pages and
    `host_index_blocks` indexer-key pages (`host_tier`, a kvcache.host_tier.HostTier, with the secondary
    `tiers` behind them; `host_mla` / `host_index` are its pools); `hot_rows`: H; `max_leases`: hot-buffer
    slots on the device; page_bytes: per cache group, the bytes of one page (kvcache.layout.page_bytes);
    peer_waits: HostTier's.
    Tiers serve prefix hits by hash, so they need enable_prefix_caching."""

    def __init__(self, *, host_mla_blocks: int, host_index_blocks: int, block_size: int, hot_rows: int,
                 max_leases: int, num_device_blocks: int, enable_prefix_caching: bool = True,
                 page_bytes: dict[str, int] | None = None, tiers: TierSet | None = None, fingerprint: str = "",
                 load_failure_policy: str = "recompute", stage_rows: bool = False, chunk_tokens: int = 0,
                 peer_waits: str | None = None):
        super().__init__()
        if host_mla_blocks < 1:
            raise ValueError("HiSparse needs a host pool of at least one MLA page (hisparse_host_pool_bytes)")
        if tiers is not None and len(tiers) and not enable_prefix_caching:
            raise ValueError("HiSparse with secondary tiers needs enable_prefix_caching=True (the tiers serve "
                             "prefix hits by hash)")
        self.block_size = block_size
        self.stage_rows = stage_rows  # prefill chunks read host-only pages through row staging
        self.chunk_tokens = chunk_tokens  # max_num_batched_tokens: the longest chunk (device_blocks)
        blocks = {"mla": host_mla_blocks, **({"indexer": host_index_blocks} if host_index_blocks > 0 else {})}
        pools = host_pools(blocks, enable_prefix_caching=enable_prefix_caching)
        self.host_tier = HostTier(pools, outbox=self.outbox, tiers=tiers, fingerprint=fingerprint,
                                  load_failure_policy=load_failure_policy, peer_waits=peer_waits)
        self.host_mla: BlockPool = pools["mla"]
        self.host_index: BlockPool | None = pools.get("indexer")
        self.lease_blocks = -(-hot_rows // block_size)
        self.free_leases = list(range(max_leases))
        self.watermark = max(self.lease_blocks, num_device_blocks // 10)
        self.state: dict[str, Residency] = {}
        self.stats = HiSparseStats()
        self.resolve = ResolveStats()  # the device half's records, summed (`on_records`)
        self.page_bytes = page_bytes or {"mla": 0, "indexer": 0}  # bytes of one host page per group
        self.host_bytes_peak = 0

    # ------------------------------------------------------------------------------------- admission
    def admit(self, kv: KVCacheManager, req: RequestView) -> int:
        """Take the device pool's hit, then extend it with pages the host pools or the secondary tiers hold
        (the request's prefix parked earlier, or stored by another engine): MLA pages found on the host stay
        host-only, indexer pages found there wait in `pending_index` for their copy back (`prepare`).
        While pages load from a tier the admission answers RETRY (HostTier.lookup_prefix)."""
        n = kv.admit(req.req_id, req.tokens, req.extra_keys)
        rb = kv.requests[req.req_id]
        st = self.state[req.req_id] = Residency()
        i = n // kv.tokens_per_block
        found = self.host_tier.lookup_prefix(kv, req, i)
        if found.retry:  # tier loads under way: the scheduler forgets this attempt (`must_retry`)
            return n
        st.host = [self._host_ref(self.host_mla, "mla", h) for h in rb.hashes[:i]]
        # per hash block (device block, host block) of its MLA page, per indexer page likewise; a device
        # MLA page's host copy is looked up too (the resolver reads host rows once the page is released)
        # group by group (the j-th MLA page of the walk ends at hash block c0 + j r, r its ratio)
        # (C-level passes over the MLA pages: a long context walks thousands)
        split, hashes, r = found.split(), rb.hashes, kv.ratio["mla"]
        c0 = -(-(i + 1) // r) * r - 1
        dev_mla = split.get("mla", ((), ()))[0]
        # each MLA page's host copy: a page found on the host is the walk's host hit, its key's lookup
        host_mla = self.host_mla.lookup_all("mla", hashes[c0 : c0 + len(dev_mla) * r : r])
        index = []
        for g in kv.groups:
            if g != "mla":
                dev_col, host_col = split.get(g, ((), ()))
                on_host = iter(host_col).__next__
                index += [(b, None) if b is not None else (None, on_host()) for b in dev_col]
        rb.tables["mla"].extend(table_entries(dev_mla))
        st.host.extend(table_entries(host_mla))
        kv.pool.touch(found_blocks(dev_mla))  # one call each: this runs per block
        self.host_mla.touch(found_blocks(host_mla))
        for dev_i, host_i in index:
            rb.tables["indexer"].append(-1 if dev_i is None else dev_i)
            if dev_i is None:
                self.host_index.touch([host_i])
                st.pending_index[len(rb.tables["indexer"]) - 1] = host_i
            else:
                kv.pool.touch([dev_i])
        self.host_tier.release(found.pins)
        i += len(dev_mla)
        rb.num_cached_blocks = i
        st.host_prefix = i - n // kv.tokens_per_block  # counted once the request is in (prepare)
        if self.stage_rows:
            self._unpin_prefix(kv, req, st)
        return i * kv.tokens_per_block

    def _unpin_prefix(self, kv: KVCacheManager, req: RequestView, st: Residency) -> None:
        """With row staging, a request admitted on a long device-cached prefix into a pool that cannot
        hold the rest of it at full residency keeps pinned only its TAIL_PAGES newest MLA pages (beside
        them its chunk's pages make `device_blocks_per_request`'s count): its older cached pages
        go back to the pool unpinned (readable in place until the pool hands them out, then host-only).
        Otherwise such a request could hold more than the pool has room for beside its chunk and hot
        buffer, and no running request would be there to release pages for it. Cached pages whose host
        copy is gone are pre-copied first (planned before any later decision can reuse their blocks)."""
        table = kv.block_table(req.req_id, "mla")
        held = sum(b >= 0 for t in kv.requests[req.req_id].tables.values() for b in t)
        cap = TAIL_PAGES  # beside the chunk's own pages (device_blocks_per_request)
        pinned = [p for p, b in enumerate(table) if b >= 0]
        if len(pinned) <= cap or kv.num_free_blocks >= kv.blocks_needed_all(req.num_tokens) - held + self.lease_blocks:
            return
        self.admission_acted = True
        self._precopy(kv, [req], pages=len(table))  # cached pages whose host copy the host pool evicted
        for p in [p for p in pinned if p < len(st.host) and st.host[p] >= 0
                  and kv.pool.ref_count[table[p]] == 1][: len(pinned) - cap]:
            self._unpin(kv, req.req_id, st, p)
            self.stats.released_pages += 1

    @staticmethod
    def _unpin(kv: KVCacheManager, req_id: str, st: Residency, page: int) -> None:
        """Give MLA page `page`'s device block back to the pool; its rows stay readable there until the pool
        hands the block out again (the block's generation moves)."""
        b = kv.release(req_id, "mla", page)
        st.unpinned[page] = (b, kv.pool.generation[b])
        st.writes += 1

    @staticmethod
    def _host_ref(pool: BlockPool | None, group: str, h) -> int:
        b = pool.lookup(group, h) if pool is not None else None
        if b is None:
            return -1
        pool.touch([b])
        return b

    def forget(self, kv: KVCacheManager, req: RequestView) -> None:
        st = self.state.pop(req.req_id)
        self.host_mla.free([b for b in st.host if b >= 0])
        if st.pending_index:
            self.host_index.free(list(st.pending_index.values()))
        self._end_lease(kv, req.req_id, st)

    def admission_key(self, kv: KVCacheManager, req: RequestView, running: Sequence[RequestView]) -> object:
        """Admission reads the host pools; `make_room` reads of each running request whether it prefills,
        its MLA table and host pages (their blocks and ref counts move only with pool versions, their
        lengths are here), its lease, and the free lease slots."""
        return (self.host_tier.key(), len(self.free_leases),
                tuple((r.req_id, r.num_tokens - r.num_computed_tokens > 1, len(kv.requests[r.req_id].tables["mla"]),
                       len(self.state[r.req_id].host), self.state[r.req_id].lease) for r in running))

    # ------------------------------------------------------------------------------------------ chunks
    def _host_only(self, kv: KVCacheManager, req: RequestView) -> list[int]:
        """Pages with no device block (unpinned ones whose block survives excluded)."""
        table = kv.block_table(req.req_id, "mla")
        st = self.state[req.req_id]
        return [p for p, b in enumerate(table) if b < 0 and not self._intact(kv, st, p)]

    @staticmethod
    def _intact(kv: KVCacheManager, st: Residency, page: int) -> bool:
        if page not in st.unpinned:
            return False
        b, gen = st.unpinned[page]
        return kv.pool.generation[b] == gen

    @staticmethod
    def _prefill_chunk(req: RequestView, num_tokens: int) -> bool:
        """Whether a row of `num_tokens` is a prefill chunk (it reads its whole prefix through the block
        table), not a decode row. Under MTP a decode row verifies its last token and its drafts: it
        has one known token left to compute however many it carries, and resolves through the hot buffer
        like a one-token step (GLM53.verify)."""
        return num_tokens > 1 and req.num_tokens - req.num_computed_tokens > 1

    def extra_blocks(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> int:
        st = self.state[req.req_id]
        extra = len(st.pending_index)
        if self._prefill_chunk(req, num_tokens) and self.stage_rows:  # its host-only rows are staged outside the pool
            return extra
        if self._prefill_chunk(req, num_tokens):  # a prefill chunk reads its whole prefix through the block table
            extra += len(self._host_only(kv, req)) + sum(kv.pool.ref_count[b] == 0 for b, _ in
                                                         (st.unpinned[p] for p in st.unpinned
                                                          if self._intact(kv, st, p)))
        elif st.lease < 0 and (st.unpinned or -1 in kv.block_table(req.req_id, "mla")):
            extra += self.lease_blocks
        return extra

    def admission_reserve(self, kv: KVCacheManager, running: Sequence[RequestView]) -> int:
        """A hot buffer for each request still prefilling without one whose pages are not all on the
        device: it leases when it starts decoding, and what it could release for that it has released
        already. Without this reserve, admissions take those blocks and the lease later costs a
        preemption (Part 1 with MTP3's 160-block hot buffers: thousands of them from 24 users on)."""
        if not self.stage_rows:
            return 0
        n = 0
        for r in running:
            st = self.state[r.req_id]
            if st.lease < 0 and r.num_tokens - r.num_computed_tokens > 1 and (
                    st.unpinned or -1 in kv.block_table(r.req_id, "mla")):
                n += 1
        return n * self.lease_blocks

    def prepare(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> None:
        st = self.state[req.req_id]
        self.host_tier.admitted(req.req_id)
        self.stats.host_prefix_pages += st.host_prefix
        st.host_prefix = 0
        if st.pending_index:
            st.writes += 1
            pages = sorted(st.pending_index)
            blocks = kv.pool.allocate(len(pages))
            self.outbox.append(PageCopy("indexer", "h2d", [st.pending_index[p] for p in pages], blocks))
            for p, b in zip(pages, blocks):
                kv.requests[req.req_id].tables["indexer"][p] = b
            self.host_index.free([st.pending_index[p] for p in pages])
            self.stats.restored_index_pages += len(pages)
            st.pending_index.clear()
        table = kv.block_table(req.req_id, "mla")
        if self._prefill_chunk(req, num_tokens) and self.stage_rows:
            pass  # host-only pages stay there: the runner stages the rows the chunk selects
        elif self._prefill_chunk(req, num_tokens):
            st.writes += 1
            for p in [p for p in st.unpinned if self._intact(kv, st, p)]:  # take intact pages back: no copy
                b, _ = st.unpinned.pop(p)
                kv.pool.touch([b])
                table[p] = b
            self.stats.lost_pages += len(st.unpinned)  # the rest were reused: staged from the host below
            st.unpinned.clear()
            pages = [p for p, b in enumerate(table) if b < 0]
            if pages:
                blocks = kv.pool.allocate(len(pages))
                self.outbox.append(PageCopy("mla", "h2d", [st.host[p] for p in pages], blocks))
                for p, b in zip(pages, blocks):
                    table[p] = b
                self.stats.staged_pages += len(pages)
        elif st.lease < 0 and (st.unpinned or -1 in table):
            self._lease(kv, req.req_id, st)

    def _lease(self, kv: KVCacheManager, req_id: str, st: Residency) -> None:
        st.lease = self.free_leases.pop()
        self.outbox.append(ResetLease(st.lease, kv.lease(req_id, self.lease_blocks)))
        self.stats.leases += 1

    def _end_lease(self, kv: KVCacheManager, req_id: str, st: Residency) -> None:
        if st.lease >= 0:
            kv.end_lease(req_id)
            self.free_leases.append(st.lease)
            st.lease = -1

    def row_tables(self, kv: KVCacheManager, req: RequestView) -> RowTables:
        """The MLA table with intact unpinned pages mapped to their old blocks (a reused one becomes
        host-only here, before the step reads it), the indexer table, and the row's host pages and lease.
        Counts the request's residency state for this step.

        The answer is a function of the request's two tables, its host pages, its unpinned pages (those
        still intact) and its lease. Between steps the tables and host pages change only by appends
        (`KVCacheManager.allocate`, `_precopy`) or by the planner's own writes in place, which it counts in
        `Residency.writes`; so while the tables are the same lists, of the same lengths as the last
        answer's, with as many host pages, the same count of writes and the same lease, and no unpinned
        page was reused since, the last answer (`Residency.snapshot`: immutable tuples) is this step's."""
        st = self.state[req.req_id]
        rb = kv.requests[req.req_id]
        mla, index = rb.tables["mla"], rb.tables["indexer"]
        if st.unpinned:
            gen = kv.pool.generation  # `_intact`, inlined: this runs for every row of every step
            lost = [p for p, (b, g) in st.unpinned.items() if gen[b] != g]
            if lost:  # their blocks were reused: host-only from now on
                for p in lost:
                    del st.unpinned[p]
                self.stats.lost_pages += len(lost)
                st.writes += 1
        key = (len(mla), len(index), len(st.host), st.writes, st.lease)
        snap = st.snapshot
        if snap is None or snap[0] is not mla or snap[1] is not index or snap[2] != key:
            table = mla  # read only, unless unpinned pages map into a copy
            if st.unpinned:
                table = list(mla)
                for p, (b, _) in st.unpinned.items():  # every one intact (the reused ones are gone above)
                    table[p] = b
            table = tuple(table)
            snap = st.snapshot = (mla, index, key, table, tuple(index), HiSparseRow(tuple(st.host), st.lease),
                                  self._residency(table, st))
        self.stats.residency_steps[snap[6]] += 1
        return {"mla": snap[3], "indexer": snap[4]}, snap[5]

    @staticmethod
    def _residency(table: Sequence[int], st: Residency) -> str:
        """table: this step's MLA table (intact unpinned pages mapped). full: no sealed page released or
        host-only; none: every sealed page host-only; mixed: the rest."""
        sealed = table[: len(st.host)]
        host_only = sealed.count(-1)  # the only negative entry (KVCacheManager.block_table), counted in C
        return "full" if not host_only and not st.unpinned else ("none" if sealed and host_only == len(sealed)
                                                                 else "mixed")

    # ------------------------------------------------------------------------------- after each step
    def after_step(self, kv: KVCacheManager, running: Sequence[RequestView]) -> None:
        self._precopy(kv, running)
        self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes_used())
        if kv.num_free_blocks < self.watermark:
            self.make_room(kv, running, self.watermark)

    def _precopy(self, kv: KVCacheManager, reqs: Sequence[RequestView], pages: int | None = None) -> None:
        """Copy every newly sealed, device-only MLA page of `reqs` to the host pool: one batched copy.
        `pages`: the pages sealed so far (default: the request's computed tokens' full pages; admission
        passes its prefix hit, whose pages are full but not yet counted as computed)."""
        src, dst, infos = [], [], []
        for req in reqs:
            st = self.state[req.req_id]
            rb = kv.requests[req.req_id]
            n_full = req.num_computed_tokens // kv.tokens_per_block if pages is None else pages
            st.host.extend([-1] * (n_full - len(st.host)))
            for p in range(st.sealed, n_full):
                if st.host[p] < 0 and rb.tables["mla"][p] >= 0:
                    try:
                        (hb,) = self._host_page(req.req_id)
                    except NoFreeBlocks:  # host pool full of live pages: the page stays dirty
                        n_full = p  # (not releasable); retried after the next step
                        break
                    st.host[p] = hb
                    st.writes += 1
                    info = None
                    if p < len(rb.hashes):
                        info = kv.page_info(rb, req.tokens, "mla", p) if self.host_mla.events is not None else None
                        self.host_mla.cache("mla", hb, rb.hashes[p], info)
                    src.append(rb.tables["mla"][p])
                    dst.append(hb)
                    infos.append(info)
            st.sealed = n_full
        if src:  # and to the secondary tiers, those registered under their hash
            self.host_tier.copy_out("mla", src, dst, infos)
            self.stats.precopied_pages += len(src)

    def _host_page(self, req_id: str) -> list[int]:
        """One MLA host page for a request on the device. A host pool whose free pages are all pinned
        for waiting requests' next admissions (pages a tier loaded for them) gives those pins up first:
        the pages stay cached there, and such a request looks them up again when it is admitted (a
        running request that could not pre-copy could not release pages, and a waiting one at the head
        of the queue could wait for ever on pages held for a request behind it)."""
        try:
            return self.host_mla.allocate(1)
        except NoFreeBlocks:
            pins = self.host_tier.tier_pins
            others = [r for r in pins if r != req_id and any(g == "mla" for g, _ in pins[r])]
            if not others:
                raise
            for r in others:
                self.host_tier.release(pins.pop(r))
            self.admission_acted = True
            return self.host_mla.allocate(1)

    @property
    def shrink_chunks(self) -> bool:
        return self.stage_rows

    def device_blocks(self, kv: KVCacheManager, num_tokens: int) -> int:
        return device_blocks_per_request(num_tokens, tokens_per_block=kv.tokens_per_block,
                                         index_tokens_per_block=kv.group_tokens_per_block.get("indexer", kv.tokens_per_block),
                                         chunk_tokens=self.chunk_tokens, lease_blocks=self.lease_blocks,
                                         stage_rows=self.stage_rows)

    def make_room(self, kv: KVCacheManager, running: Sequence[RequestView], free_blocks: int) -> bool:
        """Release clean pages of decoding requests until `free_blocks` are free: request by request, the
        one with the most releasable pages first, its oldest pages first. A request without a hot buffer
        leases one first and then releases at least one page more than the lease took, so every lease
        pays for itself. With row staging, requests still prefilling release too (their next chunks
        stage what they select; they lease no hot buffer until they decode), so a prompt longer than
        the pool completes. -> whether any page was released."""
        cands = []
        for req in running:
            prefilling = req.num_tokens - req.num_computed_tokens > 1
            if prefilling and not self.stage_rows:  # it reads its whole prefix through the block table
                continue
            st = self.state[req.req_id]
            table = kv.block_table(req.req_id, "mla")
            pages = [p for p in range(min(len(st.host), len(table) - TAIL_PAGES)) if table[p] >= 0 and st.host[p] >= 0
                     and kv.pool.ref_count[table[p]] == 1]  # a shared block frees nothing
            # a request that reads host-only or unpinned pages needs its hot buffer anyway: it may lease
            # as soon as its pages and the free blocks cover one (a tight pool could not run it otherwise)
            needs_lease = bool(st.unpinned) or -1 in table
            if pages and (st.lease >= 0 or prefilling or len(pages) > self.lease_blocks
                          or (needs_lease and len(pages) + kv.num_free_blocks >= self.lease_blocks)):
                cands.append((req, st, pages, prefilling))
        released = False
        for req, st, pages, prefilling in sorted(cands, key=lambda c: -len(c[2])):
            if kv.num_free_blocks >= free_blocks:
                break
            must = 0
            if st.lease < 0 and not prefilling:
                if not self.free_leases:
                    continue
                # too few free blocks for the lease: release its pages' worth first (their blocks may go
                # to the lease; the pages are clean, so they turn host-only and nothing is lost)
                short = max(0, self.lease_blocks - kv.num_free_blocks)
                if short > len(pages):  # an earlier request's lease took the free blocks counted above
                    continue
                for p in pages[:short]:
                    self._unpin(kv, req.req_id, st, p)
                self.stats.released_pages += short
                pages = pages[short:]
                self._lease(kv, req.req_id, st)
                released = True
                must = self.lease_blocks + 1 - short
            for i, p in enumerate(pages):
                if i >= must and kv.num_free_blocks >= free_blocks:
                    break
                self._unpin(kv, req.req_id, st, p)
                self.stats.released_pages += 1
                released = True
        return released

    # ------------------------------------------------------------------------------ leaving the device
    def evict(self, kv: KVCacheManager, victim: RequestView) -> bool:
        """Park the victim's pages in the host pools; the scheduler then drops its device KV, and
        re-admission takes the parked prefix back like a prefix hit (only the unsealed tail is recomputed)."""
        self._park(kv, victim)
        return False

    def saved_tokens(self, req: RequestView) -> int:
        return 0  # parked KV comes back through `admit`, like a prefix hit

    def restore(self, kv: KVCacheManager, req: RequestView) -> None:
        raise RuntimeError("HiSparse restores parked KV at admission, not through restore()")

    def on_finish(self, kv: KVCacheManager, req: RequestView) -> None:
        self._park(kv, req)
        # a P/D prefill leg's last partial pages, for finer consumers (HostTier.store_tail): its device
        # page is one of the TAIL_PAGES never released, copied through a free page of the pools parked into
        self.host_tier.store_tail(kv, req)

    def _park(self, kv: KVCacheManager, req: RequestView) -> None:
        self._precopy(kv, [req])
        st = self.state.pop(req.req_id)
        rb = kv.requests[req.req_id]
        if self.host_index is not None:  # idle sessions' indexer keys: the ordinary offload path
            src, dst, infos = [], [], []
            for p in range(req.num_computed_tokens // kv.group_tokens_per_block["indexer"]):
                h = rb.hashes[kv.page_hash_index("indexer", p)]
                b = rb.tables["indexer"][p]
                if b < 0 or self.host_index.lookup("indexer", h) is not None:
                    continue
                try:
                    (hb,) = self.host_index.allocate(1)
                except NoFreeBlocks:
                    break
                info = kv.page_info(rb, req.tokens, "indexer", p) if self.host_index.events is not None else None
                self.host_index.cache("indexer", hb, h, info)
                src.append(b)
                dst.append(hb)
                infos.append(info)
            if src:  # and to the secondary tiers (HostTier.copy_out)
                self.host_tier.copy_out("indexer", src, dst, infos)
                self.host_index.free(dst)  # parked: cached, reclaimable least recently used first
                self.stats.parked_index_pages += len(src)
        # MLA host pages stay cached under their hashes (registered at pre-copy); pages without one
        # (a partial tail, prefix caching off) simply return to the host pool
        self.host_mla.free([b for b in st.host if b >= 0])
        if st.pending_index:
            self.host_index.free(list(st.pending_index.values()))
        self._end_lease(kv, req.req_id, st)

    # ------------------------------------------------------------------------------------- reporting
    def host_bytes_used(self) -> int:
        """Host bytes held by live pages and by parked ones (cached under a prefix hash, reclaimable)."""
        def used(pool):
            return pool.num_blocks - pool.num_free + pool.num_cached_free

        out = used(self.host_mla) * self.page_bytes["mla"]
        if self.host_index is not None:
            out += used(self.host_index) * self.page_bytes["indexer"]
        return out
