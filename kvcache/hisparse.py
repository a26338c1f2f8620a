"""HiSparse residency policy (host side): keep requests decoding while most of their MLA KV lives in a
host pool, with the rows the indexer selects served from a per-request hot buffer (BRIEF §6).

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
  batched copy covering all MLA layers (`after_step`), so releasing a page later copies nothing.
- Release under pressure only: when free blocks fall below the watermark (max(one hot buffer, 10% of the
  pool)) or a chunk does not fit (`make_room`), clean pages of decoding requests are released, oldest
  pages first; the last two pages of a request never are, nor pages of a request still prefilling.
- Hot buffer: a request that loses a page first leases ceil(H / block_size) blocks from the same pool
  (H = hisparse_device_buffer_size, default 2 x top-k rows); they live in the same device tables, so a
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
- Why hot slots are never stale: a hot slot holds a copy of one position's row, keyed by position, and
  a position's KV never changes; hot rows are leased (no other request writes them). What can go stale
  is a device mapping of an unpinned page whose block was reused: `block_tables` checks the generation
  before each step and drops such pages to host-only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from kvcache.block_pool import BlockPool, NoFreeBlocks

if TYPE_CHECKING:  # the scheduler drives this policy; the policy needs only its duck-typed surface
    from glm53.engine.request import Request
    from glm53.engine.scheduler import ScheduledChunk, Scheduler

TAIL_PAGES = 2  # newest pages of a request that are never released


class HostMover(Protocol):
    """Device <-> host page copies and hot-buffer setup (the model runner)."""

    def copy_pages(self, group: str, direction: str, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """direction "d2h": device block src[i] -> host block dst[i] (every layer of the group); "h2d" the
        reverse."""

    def reset_lease(self, lease: int, blocks: list[int]) -> None:
        """Lease slot `lease` now uses device `blocks` as its hot rows; empty every group's hot buffer."""


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


class HiSparsePolicy:
    """kv_policy="hisparse": implements glm53.engine.scheduler.KVPolicy. `mover`: the runner; host pools of `host_mla_blocks` MLA pages and
    `host_index_blocks` indexer-key pages; `hot_rows`: H; `max_leases`: hot-buffer slots on the device."""

    def __init__(self, mover: HostMover, *, host_mla_blocks: int, host_index_blocks: int, block_size: int,
                 hot_rows: int, max_leases: int, num_device_blocks: int, enable_prefix_caching: bool = True,
                 page_bytes: dict[str, int] | None = None):
        if host_mla_blocks < 1:
            raise ValueError("HiSparse needs a host pool of at least one MLA page (hisparse_host_pool_bytes)")
        self.mover = mover
        self.block_size = block_size
        self.host_mla = BlockPool(host_mla_blocks, enable_prefix_caching=enable_prefix_caching)
        self.host_index = (BlockPool(host_index_blocks, enable_prefix_caching=enable_prefix_caching)
                           if host_index_blocks > 0 else None)
        self.lease_blocks = -(-hot_rows // block_size)
        self.free_leases = list(range(max_leases))
        self.watermark = max(self.lease_blocks, num_device_blocks // 10)
        self.state: dict[str, Residency] = {}
        self.stats = HiSparseStats()
        self.page_bytes = page_bytes or {"mla": 0, "indexer": 0}  # bytes of one host page per group
        self.host_bytes_peak = 0

    # ------------------------------------------------------------------------------------- admission
    def admit(self, sch: Scheduler, req: Request) -> int:
        kv = sch.kv
        n = kv.admit(req.req_id, req.all_token_ids, req.extra_keys)
        rb = kv.requests[req.req_id]
        st = self.state[req.req_id] = Residency()
        i = n // kv.tokens_per_block
        st.host = [self._host_ref(self.host_mla, "mla", h) for h in rb.hashes[:i]]
        # extend the device hit with pages the host pools hold (the request's prefix parked earlier); MLA
        # pages are one hash chunk, indexer pages `r` chunks; a hit ends on a page boundary of both
        r, step = kv.ratio["indexer"], kv.hit_multiple
        max_hit = (req.num_tokens - 1) // kv.tokens_per_block
        mla, index = [], []  # per chunk (device block, host block); per indexer page likewise
        while i + len(mla) < min(max_hit, len(rb.hashes)):
            c = i + len(mla)
            h = rb.hashes[c]
            dev_m, host_m = kv.pool.lookup("mla", h), self.host_mla.lookup("mla", h)
            if dev_m is None and host_m is None:
                break
            mla.append((dev_m, host_m))
            if (c + 1) % r == 0:
                dev_i = kv.pool.lookup("indexer", h)
                host_i = self.host_index.lookup("indexer", h) if self.host_index and dev_i is None else None
                if dev_i is None and host_i is None:
                    mla.pop()
                    break
                index.append((dev_i, host_i))
        keep = len(mla) - len(mla) % step  # whole hit units only
        for dev_m, host_m in mla[:keep]:
            rb.tables["mla"].append(-1 if dev_m is None else dev_m)
            st.host.append(-1 if host_m is None else host_m)
            kv.pool.touch([dev_m] if dev_m is not None else [])
            self.host_mla.touch([host_m] if host_m is not None else [])
        for dev_i, host_i in index[: keep // r]:
            rb.tables["indexer"].append(-1 if dev_i is None else dev_i)
            if dev_i is None:
                self.host_index.touch([host_i])
                st.pending_index[len(rb.tables["indexer"]) - 1] = host_i
            else:
                kv.pool.touch([dev_i])
        i += keep
        rb.num_cached_blocks = i
        st.host_prefix = i - n // kv.tokens_per_block  # counted once the request is in (prepare)
        return i * kv.tokens_per_block

    @staticmethod
    def _host_ref(pool: BlockPool | None, group: str, h) -> int:
        b = pool.lookup(group, h) if pool is not None else None
        if b is None:
            return -1
        pool.touch([b])
        return b

    def forget(self, sch: Scheduler, req: Request) -> None:
        st = self.state.pop(req.req_id)
        self.host_mla.free([b for b in st.host if b >= 0])
        if st.pending_index:
            self.host_index.free(list(st.pending_index.values()))
        self._end_lease(sch, req.req_id, st)

    # ------------------------------------------------------------------------------------------ chunks
    def _host_only(self, sch: Scheduler, req: Request) -> list[int]:
        """Pages with no device block (unpinned ones whose block survives excluded)."""
        table = sch.kv.block_table(req.req_id, "mla")
        st = self.state[req.req_id]
        return [p for p, b in enumerate(table) if b < 0 and not self._intact(sch, st, p)]

    @staticmethod
    def _intact(sch: Scheduler, st: Residency, page: int) -> bool:
        if page not in st.unpinned:
            return False
        b, gen = st.unpinned[page]
        return sch.kv.pool.generation[b] == gen

    def extra_blocks(self, sch: Scheduler, req: Request, num_tokens: int) -> int:
        st = self.state[req.req_id]
        extra = len(st.pending_index)
        if num_tokens > 1:  # a prefill chunk reads its whole prefix through the block table
            extra += len(self._host_only(sch, req)) + sum(sch.kv.pool.ref_count[b] == 0 for b, _ in
                                                          (st.unpinned[p] for p in st.unpinned
                                                           if self._intact(sch, st, p)))
        elif st.lease < 0 and (st.unpinned or -1 in sch.kv.block_table(req.req_id, "mla")):
            extra += self.lease_blocks
        return extra

    def prepare(self, sch: Scheduler, req: Request, num_tokens: int) -> None:
        kv, st = sch.kv, self.state[req.req_id]
        self.stats.host_prefix_pages += st.host_prefix
        st.host_prefix = 0
        if st.pending_index:
            pages = sorted(st.pending_index)
            blocks = kv.pool.allocate(len(pages))
            self.mover.copy_pages("indexer", "h2d", [st.pending_index[p] for p in pages], blocks)
            for p, b in zip(pages, blocks):
                kv.requests[req.req_id].tables["indexer"][p] = b
            self.host_index.free([st.pending_index[p] for p in pages])
            self.stats.restored_index_pages += len(pages)
            st.pending_index.clear()
        table = kv.block_table(req.req_id, "mla")
        if num_tokens > 1:
            for p in [p for p in st.unpinned if self._intact(sch, st, p)]:  # take intact pages back: no copy
                b, _ = st.unpinned.pop(p)
                kv.pool.touch([b])
                table[p] = b
            self.stats.lost_pages += len(st.unpinned)  # the rest were reused: staged from the host below
            st.unpinned.clear()
            pages = [p for p, b in enumerate(table) if b < 0]
            if pages:
                blocks = kv.pool.allocate(len(pages))
                self.mover.copy_pages("mla", "h2d", [st.host[p] for p in pages], blocks)
                for p, b in zip(pages, blocks):
                    table[p] = b
                self.stats.staged_pages += len(pages)
        elif st.lease < 0 and (st.unpinned or -1 in table):
            self._lease(sch, req.req_id, st)

    def _lease(self, sch: Scheduler, req_id: str, st: Residency) -> None:
        st.lease = self.free_leases.pop()
        self.mover.reset_lease(st.lease, sch.kv.lease(req_id, self.lease_blocks))
        self.stats.leases += 1

    def _end_lease(self, sch: Scheduler, req_id: str, st: Residency) -> None:
        if st.lease >= 0:
            sch.kv.end_lease(req_id)
            self.free_leases.append(st.lease)
            st.lease = -1

    def block_tables(self, sch: Scheduler, chunks: list[ScheduledChunk]) -> dict:
        """MLA tables with intact unpinned pages mapped to their old blocks (a reused one becomes
        host-only here, before the step reads it); plus each row's host pages and lease."""
        mla, host, lease = [], [], []
        for ch in chunks:
            rid = ch.request.req_id
            st = self.state[rid]
            table = list(sch.kv.block_table(rid, "mla"))
            for p in list(st.unpinned):
                if self._intact(sch, st, p):
                    table[p] = st.unpinned[p][0]
                else:
                    del st.unpinned[p]
                    self.stats.lost_pages += 1
            mla.append(table)
            host.append(st.host)
            lease.append(st.lease)
            self._count_residency(table, st)
        return {"mla": mla, "indexer": [sch.kv.block_table(ch.request.req_id, "indexer") for ch in chunks],
                "hisparse": {"host": host, "lease": lease}}

    def _count_residency(self, table: list[int], st: Residency) -> None:
        """table: this step's MLA table (intact unpinned pages mapped). full: no sealed page released or
        host-only; none: every sealed page host-only; mixed: the rest."""
        sealed = table[: len(st.host)]
        host_only = sum(b < 0 for b in sealed)
        state = "full" if not host_only and not st.unpinned else ("none" if sealed and host_only == len(sealed)
                                                                   else "mixed")
        self.stats.residency_steps[state] += 1

    # ------------------------------------------------------------------------------- after each step
    def after_step(self, sch: Scheduler) -> None:
        self._precopy(sch, sch.running)
        self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes_used())
        if sch.kv.num_free_blocks < self.watermark:
            self.make_room(sch, self.watermark)

    def _precopy(self, sch: Scheduler, reqs) -> None:
        """Copy every newly sealed, device-only MLA page of `reqs` to the host pool: one batched copy."""
        src, dst = [], []
        for req in reqs:
            st = self.state[req.req_id]
            rb = sch.kv.requests[req.req_id]
            n_full = req.num_computed_tokens // sch.kv.tokens_per_block
            st.host.extend([-1] * (n_full - len(st.host)))
            for p in range(st.sealed, n_full):
                if st.host[p] < 0 and rb.tables["mla"][p] >= 0:
                    try:
                        (hb,) = self.host_mla.allocate(1)
                    except NoFreeBlocks:  # host pool full of live pages: the page stays dirty
                        n_full = p  # (not releasable); retried after the next step
                        break
                    st.host[p] = hb
                    if p < len(rb.hashes):
                        self.host_mla.cache("mla", hb, rb.hashes[p])
                    src.append(rb.tables["mla"][p])
                    dst.append(hb)
            st.sealed = n_full
        if src:
            self.mover.copy_pages("mla", "d2h", src, dst)
            self.stats.precopied_pages += len(src)

    def reserve_blocks(self) -> int:
        return self.lease_blocks  # a request decoding over host-only pages holds a hot buffer

    def make_room(self, sch: Scheduler, free_blocks: int) -> bool:
        """Release clean pages of decoding requests until `free_blocks` are free: request by request, the
        one with the most releasable pages first, its oldest pages first. A request without a hot buffer
        leases one first and then releases at least one page more than the lease took, so every lease
        pays for itself. -> whether any page was released."""
        kv = sch.kv
        cands = []
        for req in sch.running:
            if req.num_tokens - req.num_computed_tokens > 1:  # still prefilling: it reads its whole prefix
                continue
            st = self.state[req.req_id]
            table = kv.block_table(req.req_id, "mla")
            pages = [p for p in range(min(len(st.host), len(table) - TAIL_PAGES)) if table[p] >= 0 and st.host[p] >= 0
                     and kv.pool.ref_count[table[p]] == 1]  # a shared block frees nothing
            if pages and (st.lease >= 0 or len(pages) > self.lease_blocks):
                cands.append((req, st, pages))
        released = False
        for req, st, pages in sorted(cands, key=lambda c: -len(c[2])):
            if kv.num_free_blocks >= free_blocks:
                break
            must = 0
            if st.lease < 0:
                if kv.num_free_blocks < self.lease_blocks or not self.free_leases:
                    continue
                self._lease(sch, req.req_id, st)
                must = self.lease_blocks + 1
            for i, p in enumerate(pages):
                if i >= must and kv.num_free_blocks >= free_blocks:
                    break
                b = kv.release(req.req_id, "mla", p)
                st.unpinned[p] = (b, kv.pool.generation[b])
                self.stats.released_pages += 1
                released = True
        return released

    # ------------------------------------------------------------------------------ leaving the device
    def evict(self, sch: Scheduler, victim: Request) -> None:
        """Park the victim's pages in the host pools, then drop its device KV; re-admission takes the
        parked prefix back (only the unsealed tail is recomputed)."""
        self._park(sch, victim)
        sch.drop_kv(victim)

    def saved_tokens(self, req: Request) -> int:
        return 0  # parked KV comes back through `admit`, like a prefix hit

    def restore(self, sch: Scheduler, req: Request) -> None:
        raise RuntimeError("HiSparse restores parked KV at admission, not through restore()")

    def on_finish(self, sch: Scheduler, req: Request) -> None:
        self._park(sch, req)

    def _park(self, sch: Scheduler, req: Request) -> None:
        self._precopy(sch, [req])
        st = self.state.pop(req.req_id)
        rb = sch.kv.requests[req.req_id]
        if self.host_index is not None:  # idle sessions' indexer keys: the ordinary offload path
            src, dst = [], []
            kv = sch.kv
            for p in range(req.num_computed_tokens // kv.group_tokens_per_block["indexer"]):
                h = rb.hashes[kv.page_hash_index("indexer", p)]
                b = rb.tables["indexer"][p]
                if b < 0 or self.host_index.lookup("indexer", h) is not None:
                    continue
                try:
                    (hb,) = self.host_index.allocate(1)
                except NoFreeBlocks:
                    break
                self.host_index.cache("indexer", hb, h)
                src.append(b)
                dst.append(hb)
            if src:
                self.mover.copy_pages("indexer", "d2h", src, dst)
                self.host_index.free(dst)  # parked: cached, reclaimable least recently used first
                self.stats.parked_index_pages += len(src)
        # MLA host pages stay cached under their hashes (registered at pre-copy); pages without one
        # (a partial tail, prefix caching off) simply return to the host pool
        self.host_mla.free([b for b in st.host if b >= 0])
        if st.pending_index:
            self.host_index.free(list(st.pending_index.values()))
        self._end_lease(sch, req.req_id, st)

    # ------------------------------------------------------------------------------------- reporting
    def host_bytes_used(self) -> int:
        """Host bytes held by live pages and by parked ones (cached under a prefix hash, reclaimable)."""
        def used(pool):
            parked = sum(pool.block_key[b] is not None for b in pool.free_queue)
            return pool.num_blocks - pool.num_free + parked

        out = used(self.host_mla) * self.page_bytes["mla"]
        if self.host_index is not None:
            out += used(self.host_index) * self.page_bytes["indexer"]
        return out
