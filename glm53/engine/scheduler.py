"""The scheduler: continuous batching with chunked prefill under a token budget, and the policy that
decides what happens when the block pool runs out.

Each step (`schedule`):
1. Running requests, oldest first, get their next tokens: 1 for a decoding request, a chunk of the
   remaining prompt for one still prefilling, within `max_num_batched_tokens`. If the pool cannot hold
   a request's new blocks, the policy evicts the newest running request (possibly the request itself)
   until it can (vLLM's recompute-preemption order).
2. If nothing was evicted this step, waiting requests are admitted first come first served while there
   is budget, a free sequence slot (`max_num_seqs`) and room in the pool. Admission takes the longest
   cached prefix (kvcache.block_pool), so only the rest is prefilled.

After the runner has computed the step (`update`), each request's computed-token count advances; a
request whose known tokens are all computed gets one new token sampled, its full blocks join the prefix
cache, and it finishes at `max_new_tokens`.

Policies (`KVPolicy`): `PreemptPolicy` drops the victim's KV (its blocks go back to the pool, still
prefix-cached until reused) and re-queues it to be recomputed. `OffloadPolicy` copies the victim's
computed KV to a host pool first and copies all of it back before the request runs again (falling back
to preemption when the host pool is full). `kvcache.hisparse.HiSparsePolicy` keeps running requests
decoding with most of their MLA KV in a host pool.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

from glm53.engine.config import DeployConfig
from glm53.engine.request import Request, Status
from kvcache.block_pool import KVCacheManager


@dataclasses.dataclass
class SchedulerStats:
    preemptions: int = 0  # evictions of a running request, whatever the policy did with its KV
    offloads: int = 0  # evictions whose KV went to the host pool
    recomputed_tokens: int = 0  # tokens whose KV was computed again after a preemption
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prompt_tokens: int = 0  # prompt tokens admitted (hit or computed)
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at position `start` run this step."""

    request: Request
    start: int
    num_tokens: int


class KVPolicy(Protocol):
    """What happens to KV when the pool runs out. The scheduler calls, per request: `admit` (take a
    cached prefix), `extra_blocks` / `prepare` (blocks a chunk needs beyond its new tokens' pages, and
    what to do with them once allocated), `make_room` (free blocks without evicting anyone), `evict`,
    `on_finish`; per step: `block_tables` (what the runner reads) and `after_step`. `PreemptPolicy`
    gives the plain behaviour of each; kvcache.hisparse overrides most."""

    def admit(self, scheduler: Scheduler, req: Request) -> int:
        """Start tracking a newly admitted request; -> prompt tokens whose KV is already available."""

    def forget(self, scheduler: Scheduler, req: Request) -> None:
        """Undo `admit` (the request did not fit after all)."""

    def reserve_blocks(self) -> int:
        """Blocks a request may need beyond its pages (checked against the pool size at `add`)."""

    def extra_blocks(self, scheduler: Scheduler, req: Request, num_tokens: int) -> int:
        """Device blocks a chunk of `num_tokens` needs beyond the pages of its new tokens."""

    def prepare(self, scheduler: Scheduler, req: Request, num_tokens: int) -> None:
        """Called once the chunk's blocks are allocated (and `extra_blocks` are free)."""

    def make_room(self, scheduler: Scheduler, free_blocks: int) -> bool:
        """Try to reach `free_blocks` free blocks without evicting a request; -> whether anything was freed."""

    def evict(self, scheduler: Scheduler, victim: Request) -> None:
        """Make `victim` give up its device blocks (and set its num_computed_tokens to what survives); it
        must be runnable again later."""

    def saved_tokens(self, req: Request) -> int:
        """Tokens of KV the policy holds for `req` outside the device pool (0: none)."""

    def restore(self, scheduler: Scheduler, req: Request) -> None:
        """Copy the saved KV into the request's newly allocated blocks."""

    def on_finish(self, scheduler: Scheduler, req: Request) -> None:
        """The request finished; its device blocks are freed right after."""

    def block_tables(self, scheduler: Scheduler, chunks: list[ScheduledChunk]) -> dict:
        """What the runner reads this step: per cache group, the chunks' block tables (and anything else
        the policy's runner support needs)."""

    def after_step(self, scheduler: Scheduler) -> None:
        """After the step's KV is written and the scheduler has advanced."""


class KVMover(Protocol):
    """Moves a request's KV blocks between the device pool and host memory (the runner)."""

    def offload(self, tables: dict[str, list[int]]): ...

    def restore(self, saved, tables: dict[str, list[int]]) -> None: ...


class PreemptPolicy:
    """Drop the victim's KV and recompute it when it runs again (vLLM's recompute preemption)."""

    def admit(self, scheduler: Scheduler, req: Request) -> int:
        return scheduler.kv.admit(req.req_id, req.all_token_ids, req.extra_keys)

    def forget(self, scheduler: Scheduler, req: Request) -> None:
        pass

    def reserve_blocks(self) -> int:
        return 0

    def extra_blocks(self, scheduler: Scheduler, req: Request, num_tokens: int) -> int:
        return 0

    def prepare(self, scheduler: Scheduler, req: Request, num_tokens: int) -> None:
        pass

    def make_room(self, scheduler: Scheduler, free_blocks: int) -> bool:
        return False

    def on_finish(self, scheduler: Scheduler, req: Request) -> None:
        pass

    def block_tables(self, scheduler: Scheduler, chunks: list[ScheduledChunk]) -> dict:
        return {g: [scheduler.kv.block_table(ch.request.req_id, g) for ch in chunks] for g in scheduler.kv.groups}

    def after_step(self, scheduler: Scheduler) -> None:
        pass

    def evict(self, scheduler: Scheduler, victim: Request) -> None:
        scheduler.drop_kv(victim)

    def saved_tokens(self, req: Request) -> int:
        return 0

    def restore(self, scheduler: Scheduler, req: Request) -> None:
        raise RuntimeError("the preempt policy saves no KV")


class OffloadPolicy(PreemptPolicy):
    """Move the victim's computed KV (every cache group, whole blocks) to a host pool of `capacity_bytes`;
    bring all of it back before the request runs again. A victim that does not fit the host pool is
    preempted instead (its KV dropped)."""

    def __init__(self, mover: KVMover, capacity_bytes: int, page_bytes: dict[str, int]):
        self.mover = mover
        self.capacity_bytes = capacity_bytes
        self.page_bytes = page_bytes  # per cache group: bytes of one page, every layer
        self.used_bytes = 0
        self.saved: dict[str, tuple[object, int, int]] = {}  # req_id -> (host copy, tokens, bytes)

    def _tables(self, scheduler: Scheduler, req: Request, tokens: int) -> dict[str, list[int]]:
        kv = scheduler.kv
        return {g: kv.block_table(req.req_id, g)[: kv.blocks_needed(tokens, g)] for g in kv.groups}

    def evict(self, scheduler: Scheduler, victim: Request) -> None:
        tables = self._tables(scheduler, victim, victim.num_computed_tokens)
        nbytes = sum(len(t) * self.page_bytes[g] for g, t in tables.items())
        if nbytes == 0 or self.used_bytes + nbytes > self.capacity_bytes:
            return super().evict(scheduler, victim)
        self.saved[victim.req_id] = (self.mover.offload(tables), victim.num_computed_tokens, nbytes)
        self.used_bytes += nbytes
        scheduler.kv.free(victim.req_id)
        scheduler.stats.preemptions += 1
        scheduler.stats.offloads += 1
        victim.num_preemptions += 1

    def saved_tokens(self, req: Request) -> int:
        return self.saved[req.req_id][1] if req.req_id in self.saved else 0

    def restore(self, scheduler: Scheduler, req: Request) -> None:
        host, tokens, nbytes = self.saved.pop(req.req_id)
        self.mover.restore(host, self._tables(scheduler, req, tokens))
        self.used_bytes -= nbytes


class Scheduler:
    def __init__(self, deploy: DeployConfig, num_blocks: int, groups=("mla", "indexer"), *,
                 policy: KVPolicy | None = None):
        self.deploy = deploy
        self.kv = KVCacheManager(num_blocks, deploy.tokens_per_block, groups,
                                 enable_prefix_caching=deploy.enable_prefix_caching,
                                 group_tokens_per_block=deploy.group_tokens_per_block(groups))
        self.policy: KVPolicy = policy or PreemptPolicy()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.lost_tokens: dict[str, int] = {}  # per request: computed tokens dropped by preemption, not yet redone

    def add(self, req: Request) -> None:
        need = self.kv.blocks_needed_all(req.prompt_ids.size + req.params.max_new_tokens) + self.policy.reserve_blocks()
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"request {req.req_id!r} needs {need} blocks but the pool has {self.kv.pool.num_blocks}: "
                             "raise DeployConfig.num_gpu_blocks")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drop_kv(self, victim: Request) -> None:
        """Preempt `victim` by dropping its device KV: what it had computed is recomputed later, less
        whatever a cache (device prefix cache, a policy's host pool) gives back at re-admission."""
        self.kv.free(victim.req_id)
        self.stats.preemptions += 1
        self.lost_tokens[victim.req_id] = self.lost_tokens.get(victim.req_id, 0) + victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1

    def _evict(self, victim: Request) -> None:
        self.policy.evict(self, victim)
        self.running.remove(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.deploy.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        evicted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # evicted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._fits(req, n):
                if self.policy.make_room(self, self._need(req, n)):
                    continue
                victim = self.running[-1]
                self._evict(victim)
                evicted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            self.kv.allocate(req.req_id, req.num_computed_tokens + n)
            self.policy.prepare(self, req, n)
            out.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        while not evicted and budget > 0 and self.waiting and len(self.running) < self.deploy.max_num_seqs:
            req = self.waiting[0]
            saved = self.policy.saved_tokens(req)
            if saved:  # its KV waits in host memory: no prefix lookup, it all comes back
                self.kv.admit(req.req_id, req.all_token_ids, req.extra_keys, use_prefix_cache=False)
                req.num_computed_tokens = saved
            else:
                req.num_computed_tokens = self.policy.admit(self, req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._fits(req, n) and self.policy.make_room(self, self._need(req, n)):
                pass
            if not self._fits(req, n):
                self.policy.forget(self, req)
                self.kv.free(req.req_id)  # give back the prefix hit; admit again when there is room
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.kv.allocate(req.req_id, req.num_computed_tokens + n)
            if saved:
                self.policy.restore(self, req)
            else:
                self._count_admission(req)
            self.policy.prepare(self, req, n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        self.stats.steps += 1
        return out

    def _need(self, req: Request, n: int) -> int:
        """Free blocks a chunk of n tokens of `req` needs."""
        return self.kv.missing_blocks(req.req_id, req.num_computed_tokens + n) + self.policy.extra_blocks(self, req, n)

    def _fits(self, req: Request, n: int) -> bool:
        return self._need(req, n) <= self.kv.num_free_blocks

    def _count_admission(self, req: Request) -> None:
        lost = self.lost_tokens.pop(req.req_id, None)
        if lost is None:  # first admission: prompt accounting
            self.stats.prompt_tokens += req.prompt_ids.size
            self.stats.prefix_hit_tokens += req.num_computed_tokens
        else:  # re-admission after preemption: what the prefix cache did not save is recomputed
            self.stats.recomputed_tokens += max(0, lost - req.num_computed_tokens)

    def update(self, chunks: list[ScheduledChunk], sampled: dict[str, int], now_s: float) -> list[Request]:
        """Advance after a step. `sampled`: the new token of every request whose known tokens are now all
        computed. -> the requests that finished."""
        finished = []
        for ch in chunks:
            req = ch.request
            req.num_computed_tokens = ch.start + ch.num_tokens
            if req.req_id in sampled:
                req.output_ids.append(sampled[req.req_id])
                req.token_times_s.append(now_s)
                if req.first_token_s is None:
                    req.first_token_s = now_s
            if req.num_computed_tokens // self.kv.tokens_per_block > self.kv.requests[req.req_id].num_cached_blocks:
                # only when a block filled up; the view hands over just the new blocks' tokens (hashing
                # packs them as int64, so array and list slices hash alike)
                self.kv.cache_full_blocks(req.req_id, req.tokens, req.num_computed_tokens, req.extra_keys)
            if req.done:
                req.status = Status.FINISHED
                req.finish_s = now_s
                self.policy.on_finish(self, req)
                self.kv.free(req.req_id)
                self.running.remove(req)
                finished.append(req)
        self.policy.after_step(self)
        return finished
