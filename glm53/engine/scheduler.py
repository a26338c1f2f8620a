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
cache, and it finishes at `max_new_tokens` or on a stop token (`abort` ends one from outside).

The policy (kvcache.policies: `preempt`, `swap`, `offload`, `hisparse`, or a registered one) decides on the block
pool at the hooks named there and records the KV movement it needs; `schedule` returns the step as a
frozen `glm53.engine.plan.StepPlan` carrying those transfers, and `update` takes the runner's
`StepResult`. Transfers the policy records during `update` (pre-copy, parking a finished request) go
out with the next plan, so the scheduler has work (`has_work`) until they have been executed.
"""

from __future__ import annotations

import collections
import dataclasses
from types import MappingProxyType

import numpy as np

from glm53.engine.config import DeployConfig
from glm53.engine.plan import PlanRow, StepPlan, StepResult
from glm53.engine.request import Request, RequestError, Status
from glm53.engine.spec_decode import SpecDecodeStats
from kvcache.block_pool import KVCacheManager
from kvcache.policies import KVPolicy, Policy
from kvcache.transfer import TransferStats


_RETRY = object()  # `Scheduler._attempt`: the admission's lookup answered RETRY
_GAVE_BACK = object()  # `Scheduler._attempt`: it did not fit, found before it took anything (KVPolicy.admit_if)
BLOCK_USES = ("indexer", "mla_decoding", "mla_prefilling", "hot_buffers")  # `Scheduler._count_blocks`


@dataclasses.dataclass
class SchedulerStats:
    preemptions: int = 0  # evictions of a running request, whatever the policy did with its KV
    offloads: int = 0  # evictions whose KV went to the host pool
    recomputed_tokens: int = 0  # tokens whose KV was computed again after a preemption
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prompt_tokens: int = 0  # prompt tokens admitted (hit or computed)
    steps: int = 0  # steps that scheduled requests (steps that only move KV are not counted)


class Scheduler:
    """Decides each step on one block pool. `requests`: the live requests by id (waiting or running)."""

    verify_skipped_admissions = False  # tests: run the retries `schedule` skips anyway, check they change nothing

    def __init__(self, deploy: DeployConfig, num_blocks: int, groups=("mla", "indexer"), *,
                 policy: KVPolicy | None = None):
        self.deploy = deploy
        self.kv = KVCacheManager(num_blocks, deploy.tokens_per_block, groups,
                                 enable_prefix_caching=deploy.enable_prefix_caching,
                                 group_tokens_per_block=deploy.group_tokens_per_block(groups),
                                 drop_last_hit=deploy.num_speculative_tokens > 0)
        self.policy: KVPolicy = policy or Policy()  # the base: recompute preemption
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.transfers = TransferStats(link_bytes_per_s=deploy.host_link_bytes_per_s)
        self.lost_tokens: dict[str, int] = {}  # per request: computed tokens dropped by preemption, not yet redone
        # the head of the queue that did not fit: (request, `_admission_signature` after the attempt, the
        # counters its admission moved, `_attempt_counts`); see `schedule`
        self._unfit: tuple | None = None
        self.skipped_admissions = 0  # retries skipped because nothing they read had changed
        self.device_blocks_peak = 0  # most pool blocks in use (held by requests or leases) after a schedule
        # pool blocks by use after each schedule (`_count_blocks`): sums over steps, and the split at the peak
        self.blocks_by_use_sum = dict.fromkeys(BLOCK_USES, 0)
        self.blocks_by_use_at_peak = dict.fromkeys(BLOCK_USES, 0)
        self.block_samples = 0
        # `_count_blocks`' last count per (running request, group): (a copy of the table, its entries that
        # name a block). A table equal to the copy (a list comparison: mostly identical entries, much
        # cheaper than counting the -1 among them) holds as many.
        self._held: dict[tuple[str, str], tuple[list[int], int]] = {}
        self.idle_wait = False  # the last step scheduled nothing because its waiting requests wait for tier loads
        self.num_spec = deploy.num_speculative_tokens  # MTP drafts per step (0: no speculative decoding)
        self.spec = SpecDecodeStats()
        # per request of the last `update`: the tokens it took (those past a stop or max_new_tokens dropped)
        self.last_tokens: dict[str, tuple[int, ...]] = {}

    def _max_tokens(self, req: Request) -> int:
        """Positions the request's blocks may ever have to cover: its prompt and outputs; with MTP also the
        drafts of its last step and the positions its drafting writes the MTP layer's KV at (`_target`)."""
        n = req.prompt_ids.size + req.params.max_new_tokens
        return min(n + 2 * self.num_spec - 2, self.deploy.max_model_len) if self.num_spec else n

    def _target(self, req: Request, n: int) -> int:
        """Tokens the request's blocks must cover for a chunk of n tokens: the chunk; under MTP a row that
        samples also drafts, and the MTP layer's draft passes 2..k write its KV k-1 positions past the
        row's last (vLLM's lookahead slots), within max_model_len."""
        end = req.num_computed_tokens + n
        if self.num_spec and end >= req.num_tokens:
            end = min(end + self.num_spec - 1, self.deploy.max_model_len)
        return end

    def add(self, req: Request) -> None:
        """Queue `req`; a request that could never run under the policy (it needs more device blocks at
        once than the pool has, `KVPolicy.device_blocks`) is refused with a RequestError naming both."""
        need = self.policy.device_blocks(self.kv, self._max_tokens(req))
        if need > self.kv.pool.num_blocks:
            raise RequestError("prompt_ids", f"request {req.req_id!r} of {self._max_tokens(req)} tokens needs {need} "
                               f"device blocks at once under kv_policy={self.deploy.kv_policy!r} but the pool has "
                               f"{self.kv.pool.num_blocks} (num_gpu_blocks): raise num_gpu_blocks or shorten the "
                               "request" + self.policy.too_large_hint)
        self.waiting.append(req)
        self.requests[req.req_id] = req

    @property
    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_work(self) -> bool:
        """Requests to run, or KV transfers recorded but not yet sent out in a plan."""
        return self.has_requests or self.policy.has_transfers()

    def _evict(self, victim: Request) -> None:
        """Preempt `victim`: the policy saves or parks what it keeps, its device blocks go back to the
        pool (still prefix-cached until reused), and it waits at the front of the queue. What the policy
        did not save is recomputed later, less whatever a cache gives back at re-admission."""
        saved = self.policy.evict(self.kv, victim)
        self.kv.free(victim.req_id, keep_hashes=True)
        victim.spec_token_ids = []  # it drafts again after its next sampled token
        self.stats.preemptions += 1
        victim.num_preemptions += 1
        if saved:
            self.stats.offloads += 1
        else:
            self.lost_tokens[victim.req_id] = self.lost_tokens.get(victim.req_id, 0) + victim.num_computed_tokens
            victim.num_computed_tokens = 0
        self.running.remove(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)

    def abort(self, req_id: str, now_s: float, reason: str = "abort") -> Request:
        """Finish `req_id` now with finish_reason `reason` ("abort": a client went away; "error": the step
        that ran it failed): a running request's KV is kept as a finished one's is (its full blocks,
        computed by steps that completed, stay prefix-cached, the policy stores or parks them; what a failed
        step wrote lies past them and is freed), a waiting one gives back whatever the policy holds for it.
        Between steps only."""
        req = self.requests.pop(req_id, None)
        if req is None:
            raise KeyError(f"no live request {req_id!r}")
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.policy.on_finish(self.kv, req)
            self.kv.free(req_id)
        else:
            self.waiting.remove(req)
            self.policy.drop(self.kv, req)
            self.kv.drop_kept_hashes(req_id)
        self.lost_tokens.pop(req_id, None)
        if self._unfit is not None and self._unfit[0] is req:
            self._unfit = None
        req.status, req.finish_s, req.finish_reason = Status.FINISHED, now_s, reason
        return req

    def fail_all(self, now_s: float) -> list[Request]:
        """Finish every request with finish_reason "error" after `schedule` raised part way through -> them.
        Besides the running and waiting ones (released as `abort` releases them), a request the failed
        schedule left half admitted (its prefix taken, or taken off the queue and not yet running) has its
        admission undone (`KVPolicy.forget`) and is dropped like a waiting one."""
        failed = []
        for req in list(self.requests.values()):
            rid = req.req_id
            if req in self.running:
                self.running.remove(req)
                self.policy.on_finish(self.kv, req)
            else:
                if req in self.waiting:
                    self.waiting.remove(req)
                if rid in self.kv.requests:  # half admitted
                    self.policy.forget(self.kv, req)
                    self.kv.free(rid, keep_hashes=True)
                self.policy.drop(self.kv, req)
                self.kv.drop_kept_hashes(rid)
            if rid in self.kv.requests:
                self.kv.free(rid)
            del self.requests[rid]
            req.status, req.finish_s, req.finish_reason = Status.FINISHED, now_s, "error"
            failed.append(req)
        self.lost_tokens.clear()
        self._unfit = None
        return failed

    def schedule(self) -> StepPlan:
        self.kv.verify_walks = self.verify_skipped_admissions  # the checks cover the walk memos (PrefixWalk) too
        counted = self.has_requests
        budget = self.deploy.max_num_batched_tokens
        out: list[tuple[Request, int, int]] = []  # (request, start, tokens incl. drafts)
        evicted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # evicted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.spec_token_ids:  # a decoding request verifies its drafts: those the budget and
                # max_model_len leave room for (vLLM trims them the same way)
                room = min(budget - n, self.deploy.max_model_len - req.num_tokens)
                del req.spec_token_ids[max(0, room):]
                n += len(req.spec_token_ids)
            while not self._fits(req, n):
                if self.policy.make_room(self.kv, self.running, self._need(req, n)):
                    continue
                if (m := self._shrink(req, n)) is not None:
                    n = m
                    break
                # the policy picks among the requests not yet scheduled this step (req first)
                victim = self.policy.choose_victim(self.running[self.running.index(req):])
                self._evict(victim)
                evicted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            self.kv.allocate(req.req_id, self._target(req, n))
            self.policy.prepare(self.kv, req, n)
            out.append((req, req.num_computed_tokens, n))
            budget -= n
        skip = 0  # waiting requests at the head of the queue passed over: their KV is on the way from a tier
        waited = False
        while not evicted and budget > 0 and len(self.waiting) > skip and len(self.running) < self.deploy.max_num_seqs:
            req = self.waiting[skip]
            if self.policy.waiting_for(req):
                skip, waited = skip + 1, True
                continue
            if self._sibling_prefilling(req):  # n > 1: it takes the prompt's KV from the prefix cache after
                skip += 1
                continue
            before = None
            if self._unfit is not None and self._unfit[0] is req and self._unfit[1] == self._admission_signature(req, budget):
                # it did not fit and nothing its admission reads has changed since: the retry would take
                # the same prefix, fail again and give it back, leaving every pool as it is now
                if not self.verify_skipped_admissions:
                    self._add_attempt_counts(self._unfit[2])
                    self.skipped_admissions += 1
                    break
                before = self._admission_state()
            pool_stats = self.kv.pool.stats
            queries, hits = pool_stats.queries, pool_stats.hits
            counts = self._attempt_counts()
            saved = self.policy.saved_tokens(req)
            n = self._attempt(req, budget, saved, ask=before is None)
            if n is _RETRY:  # the lookup answered RETRY: loads from a tier are under way
                pool_stats.queries, pool_stats.hits = queries, hits  # counted when it is admitted
                skip, waited = skip + 1, True
                continue
            gave_back = n is _GAVE_BACK
            if n is None or gave_back:  # it did not fit; admit again when there is room
                delta = tuple(a - b for a, b in zip(self._attempt_counts(), counts))
                if before is not None:
                    self._check_retry(before, delta)
                    self.skipped_admissions += 1
                # an attempt whose policy moved KV for it (HiSparse unpinning a long cached prefix) is not
                # known to be repeatable: it is retried, not skipped
                self._unfit = None if self.policy.admission_acted else (req, self._admission_signature(req, budget),
                                                                        delta)
                if self.verify_skipped_admissions and gave_back and self._unfit is not None:
                    # the policy gave it back before taking anything: the full attempt, run now from the
                    # state it left, fails too and changes nothing (what a skipped retry is checked for)
                    before, counts = self._admission_state(), self._attempt_counts()
                    if self._attempt(req, budget, saved, ask=False) is not None:
                        raise AssertionError(f"step {self.stats.steps}: {req.req_id!r} was given back but fits")
                    self._check_retry(before, tuple(a - b for a, b in zip(self._attempt_counts(), counts)), keep=False)
                    self._unfit = (req, self._admission_signature(req, budget), delta)  # versions moved by the check
                break
            if before is not None:
                raise AssertionError(f"step {self.stats.steps}: a skipped admission of {req.req_id!r} would have succeeded")
            self._unfit = None
            del self.waiting[skip]
            self.kv.allocate(req.req_id, self._target(req, n))
            if saved:
                self.policy.restore(self.kv, req)
            else:
                self._count_admission(req)
            self.policy.prepare(self.kv, req, n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append((req, req.num_computed_tokens, n))
            budget -= n
        # a step that only waits for tier loads is not a scheduling step
        self.idle_wait = waited and not out
        counted = counted and not self.idle_wait
        plan = self._plan(out)
        self._count_blocks()
        if counted:
            self.stats.steps += 1
        return plan

    def _attempt(self, req: Request, budget: int, saved: int, *, ask: bool) -> int | None | object:
        """One admission attempt of waiting `req` under `budget` (`saved`: the policy's saved tokens for it)
        -> the tokens of its first chunk, now in its tables and the policy's (`_target`'s blocks not yet
        allocated); None: it did not fit and gave back what it took (only the counters of its lookups
        moved); _GAVE_BACK: likewise, found by the policy before it took anything; _RETRY: its lookup
        answered RETRY (forgotten; it waits for tier loads). ask: let the policy ask whether it fits
        before it takes anything (`KVPolicy.admit_if`), else the full way."""
        self.policy.admission_acted = False
        if saved:  # its KV waits in host memory: no prefix lookup, it all comes back
            self.kv.admit(req.req_id, req.tokens, req.extra_keys, use_prefix_cache=False)
            req.num_computed_tokens = saved
        else:
            computed = self.policy.admit_if(self.kv, req, self._fits_first_chunk(req, budget) if ask else None)
            if computed is None:  # given back before it took anything
                req.num_computed_tokens = 0
                return _GAVE_BACK
            req.num_computed_tokens = computed
        if self.policy.must_retry(req):
            self.policy.forget(self.kv, req)
            self.kv.free(req.req_id, keep_hashes=True)
            req.num_computed_tokens = 0
            return _RETRY
        n, reserve = self._first_chunk(req, budget)
        while not self._fits(req, n, reserve) and self.policy.make_room(self.kv, self.running,
                                                                        self._need(req, n) + reserve):
            pass
        if not self._fits(req, n, reserve) and (m := self._shrink(req, n, reserve)) is not None:
            n = m
        if not self._fits(req, n, reserve):
            self.policy.forget(self.kv, req)
            self.kv.free(req.req_id, keep_hashes=True)  # give back the prefix hit
            req.num_computed_tokens = 0
            return None
        return n

    def _first_chunk(self, req: Request, budget: int) -> tuple[int, int]:
        """An admitted request's first chunk under `budget`, and the free blocks admitting it must leave."""
        return (min(req.num_tokens - req.num_computed_tokens, budget),
                self.policy.admission_reserve(self.kv, [*self.running, req]))

    def _fits_first_chunk(self, req: Request, budget: int):
        """The test `KVPolicy.admit_if` asks: whether the first chunk of `req`, with `computed` tokens cached,
        fits once its touches have taken `taken` free blocks (the check `_attempt` makes after a full
        admission, on the state it would have then)."""
        def fits(computed: int, taken: int) -> bool:
            req.num_computed_tokens = computed
            n, reserve = self._first_chunk(req, budget)
            return self._fits(req, n, reserve + taken)
        return fits

    def _sibling_prefilling(self, req: Request) -> bool:
        """Whether `req` waits for the sibling it shares a prompt with (Request.prefill_after, n > 1) to finish
        computing that prompt: then its full pages are in the prefix cache and `req` computes only the last
        partial page (one prefill for all n). A sibling that is gone, or was never here, holds nothing up."""
        lead = self.requests.get(req.prefill_after) if req.prefill_after is not None else None
        return lead is not None and lead.num_computed_tokens < lead.prompt_ids.size

    def _plan(self, scheduled: list[tuple[Request, int, int]]) -> StepPlan:
        """The frozen plan of this step's rows: tokens, sampling, each row's tables from the policy, and
        every transfer the policy recorded since the last plan."""
        rows, tables, extra = [], {g: [] for g in self.kv.groups}, []
        for req, start, n in scheduled:
            drafts = req.spec_token_ids if start + n > req.num_tokens else []
            end = start + n - len(drafts)
            p = req.prompt_ids.size
            if start >= p:  # a decoding row: its generated tokens and drafts, one list (Request.token_slice's)
                ids = np.array(req.output_ids[start - p : end - p] + drafts, np.int32)  # its own read-only copy
            else:
                ids = np.array(req.token_slice(start, end), np.int32)
                if drafts:
                    ids = np.concatenate([ids, np.asarray(drafts, np.int32)])
            ids.setflags(write=False)
            prompt_len = p if req.params.prompt_logprobs is not None and start < p - 1 else 0
            nxt = int(req.token_slice(end, end + 1)[0]) if (self.num_spec or prompt_len) and end < req.num_tokens else -1
            sample = end == req.num_tokens
            rows.append(PlanRow(req.req_id, start, ids, sample, req.params, len(req.output_ids),
                                num_draft_tokens=len(drafts), next_token=nxt,
                                penalty_tokens=req.penalty_tokens() if sample and req.params.penalized else None,
                                prompt_len=prompt_len))
            row_tables, row_extra = self.policy.row_tables(self.kv, req)
            for g in self.kv.groups:
                tables[g].append(row_tables[g])
            extra.append(row_extra)
        policy_rows = tuple(extra) if extra and extra[0] is not None else None
        return StepPlan(self.stats.steps, tuple(rows), MappingProxyType({g: tuple(t) for g, t in tables.items()}),
                        policy_rows, tuple(self.policy.take_transfers()))

    def _admission_signature(self, req: Request, budget: int) -> tuple:
        """What an admission attempt of waiting `req` under `budget` reads: its tokens (a waiting request's
        only grow with its turn), the device pool (its version moves on every change of ref counts, free
        queue or hash index) and what the policy names (`KVPolicy.admission_key`: its pools and state,
        what `make_room` reads of the running requests).

        Why a retry under an unchanged signature is skipped exactly: after a failed attempt the request's
        prefix blocks are back in the free queue, at its end, in the order `KVCacheManager.free` gave
        them back. A retry from that state finds the same blocks (the hash index is unchanged), touching
        them takes them out of the queue and restores the state in which `_fits` and `make_room` said no
        (`make_room` changes nothing when it returns False), and freeing them puts them back in the same
        order at the end: the pools, tables and kept hashes are as before, and only the prefix-cache
        query / hit counters move, which the skip adds."""
        return (req.num_tokens, budget, self.kv.pool.version, self.policy.admission_key(self.kv, req, self.running))

    def _admission_state(self) -> tuple:
        """For verify_skipped_admissions: every pool's state, the block tables and the policy's state."""
        import copy

        from kvcache.block_pool import BlockPool

        def is_pools(v):  # a pool, or a dict of them (the offload tier's per group)
            return isinstance(v, BlockPool) or (isinstance(v, dict) and v and all(isinstance(x, BlockPool) for x in v.values()))

        from kvcache.tiers import TierSet

        # secondary tiers are compared by what a lookup would answer (their version), not by identity; a
        # policy's host tier (kvcache.host_tier.HostTier) by its own snapshot (already a copy: copying its
        # pools' state tuples again cost this check most of a simulated run's time)
        pol = {k: v.version() if isinstance(v, TierSet) else v.admission_state() if hasattr(v, "admission_state")
               else copy.deepcopy(v) for k, v in vars(self.policy).items() if not is_pools(v)}
        pools = [self.kv.pool] + [p for v in vars(self.policy).values() if is_pools(v)
                                  for p in (v.values() if isinstance(v, dict) else (v,))]
        kv = ({r: (copy.deepcopy(rb.tables), rb.num_cached_blocks, len(rb.hashes)) for r, rb in self.kv.requests.items()},
              copy.deepcopy(self.kv.leases), {r: (k, list(h)) for r, (k, h) in self.kv._kept_hashes.items()})
        return [p.state() for p in pools], kv, pol, [r.num_computed_tokens for r in self.running]

    def _attempt_counts(self) -> tuple[int, ...]:
        """The counters an admission attempt moves even when it fails: the device pool's prefix-cache
        queries and hits, and the policy's (`KVPolicy.admission_counts`: e.g. secondary-tier lookups)."""
        st = self.kv.pool.stats
        return st.queries, st.hits, *self.policy.admission_counts()

    def _add_attempt_counts(self, delta: tuple[int, ...], sign: int = 1) -> None:
        """Count a skipped attempt as if it had run (sign -1: take a run attempt's counts back out)."""
        st = self.kv.pool.stats
        st.queries += sign * delta[0]
        st.hits += sign * delta[1]
        self.policy.add_admission_counts(tuple(sign * d for d in delta[2:]))

    def _check_retry(self, before: tuple, delta: tuple[int, ...], *, keep: bool = True) -> None:
        """A retry of the failed attempt `_unfit` names ran from state `before` and moved the counters by
        `delta`: check that it moved them as that attempt did and changed nothing else. keep: its counts
        stay (it stands for a retry the run without the check skips), else they are taken out again."""
        self._add_attempt_counts(delta, -1)  # the one thing a retry moves: compare without it
        try:
            after = self._admission_state()
        finally:
            if keep:
                self._add_attempt_counts(delta)
        if delta != self._unfit[2] or after != before:
            raise AssertionError(f"step {self.stats.steps}: a retry of {self._unfit[0].req_id!r}'s failed admission "
                                 "would have changed the state")

    def _need(self, req: Request, n: int) -> int:
        """Free blocks a chunk of n tokens of `req` needs."""
        return self.kv.missing_blocks(req.req_id, self._target(req, n)) + self.policy.extra_blocks(self.kv, req, n)

    def _count_blocks(self) -> None:
        """Pool blocks in use after this schedule, by use (BLOCK_USES): the running requests' indexer-key
        pages; MLA pages of requests decoding (their tails and the pages not released) and of requests
        still prefilling (their chunks and the prefix they keep); hot buffers (leases); a block that
        requests share counts once per holder (the pool's count of blocks in use counts it once)."""
        by = dict.fromkeys(BLOCK_USES, 0)
        requests, last, held = self.kv.requests, self._held, {}
        for r in self.running:
            mla_use = "mla_prefilling" if r.num_tokens - r.num_computed_tokens > 1 else "mla_decoding"
            for g, t in requests[r.req_id].tables.items():
                seen = last.get((r.req_id, g))
                if seen is None or seen[0] != t:
                    seen = (list(t), len(t) - t.count(-1))
                held[r.req_id, g] = seen
                by[mla_use if g == "mla" else "indexer"] += seen[1]
        self._held = held
        by["hot_buffers"] = sum(len(b) for b in self.kv.leases.values())
        used = self.kv.pool.num_blocks - self.kv.num_free_blocks
        if used > self.device_blocks_peak or not self.block_samples:
            self.blocks_by_use_at_peak = by
        self.device_blocks_peak = max(self.device_blocks_peak, used)
        if self.running:
            self.block_samples += 1
            for k, v in by.items():
                self.blocks_by_use_sum[k] += v

    def _fits(self, req: Request, n: int, reserve: int = 0) -> bool:
        """Whether a chunk of n tokens of `req` fits the free blocks, leaving `reserve` of them free (an
        admission: `KVPolicy.admission_reserve`)."""
        return self._need(req, n) + reserve <= self.kv.num_free_blocks

    def _shrink(self, req: Request, n: int, reserve: int = 0) -> int | None:
        """The longest prefix of a prefill chunk of n tokens that fits the free blocks now (leaving
        `reserve` free, as `_fits`), if the policy
        lets a chunk shrink (HiSparse with row staging: a shorter chunk needs fewer pages, and the pages
        its predecessors sealed can be released meanwhile), ending on a page boundary; None otherwise, and
        for a row that verifies drafts."""
        if not self.policy.shrink_chunks or n <= 1 or req.spec_token_ids:
            return None
        tpb = self.kv.tokens_per_block
        lo, hi = 0, n - 1  # largest m in [1, n) with _fits, searched over chunk lengths that end on a page
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            end = (req.num_computed_tokens + mid) // tpb * tpb  # end the chunk on a page boundary
            m = end - req.num_computed_tokens
            if m >= 1 and self._fits(req, m, reserve):
                best, lo = m, mid + 1
            else:
                hi = mid - 1
        return best

    def _count_admission(self, req: Request) -> None:
        lost = self.lost_tokens.pop(req.req_id, None)
        if lost is None:  # first admission: prompt accounting
            self.stats.prompt_tokens += req.prompt_ids.size
            self.stats.prefix_hit_tokens += req.num_computed_tokens
            req.num_cached_tokens = req.num_computed_tokens
        else:  # re-admission after preemption: what the prefix cache did not save is recomputed
            self.stats.recomputed_tokens += max(0, lost - req.num_computed_tokens)

    def update(self, plan: StepPlan, result: StepResult, now_s: float) -> list[Request]:
        """Advance after the runner executed `plan`: each row's computed-token count moves on, rows that
        sampled take their tokens, newly full blocks join the prefix cache, requests at max_new_tokens
        finish (the policy parks or drops their KV), and under kv_load_failure_policy "fail" the waiting
        requests whose tier loads failed finish with "error" (`Request.error` names the chunk; their host
        pages are freed, nothing of the failed chunk is kept). -> the requests that finished."""
        self._check_result(plan, result)
        self.transfers.d2h_bytes += result.d2h_bytes
        self.transfers.h2d_bytes += result.h2d_bytes
        if result.resolves or result.stages:
            self.policy.on_records(result.resolves, result.stages)
        # kv_load_failure_policy "fail": the waiting requests whose KV failed to load end with "error" below
        load_failed = self.policy.on_tier_results(result.tier_loads) if result.tier_loads else {}
        finished = []
        self.last_tokens = {}
        for row in plan.rows:
            req = self.requests[row.req_id]
            toks = result.tokens.get(row.req_id, ())
            # a verify row keeps the KV of its last sampled token and of the drafts that stood; the
            # rejected drafts' positions count as not computed, so the next step writes them again before
            # anything reads them, and no block holding them is prefix-cached before then
            accepted = len(toks) - 1 if row.num_draft_tokens else 0
            req.num_computed_tokens = row.start + row.num_tokens - row.num_draft_tokens + accepted
            self.spec.observe(row.num_draft_tokens, accepted)
            req.spec_token_ids = []
            reason, taken = None, 0
            if row.req_id in result.prompt_logprobs:
                q, entries = result.prompt_logprobs[row.req_id]
                have = len(req.prompt_logprobs)  # entries for prompt tokens 1 .. have; a recomputed chunk repeats some
                req.prompt_logprobs.extend(entries[max(have + 1 - q, 0):] if q <= have + 1 else ())
            lps = result.logprobs.get(row.req_id, ())
            for k, tok in enumerate(toks):
                req.output_ids.append(int(tok))
                if k < len(lps):
                    req.output_logprobs.append(lps[k])
                req.token_times_s.append(now_s)
                taken += 1
                if req.first_token_s is None:
                    req.first_token_s = now_s
                if reason := req.check_stop():
                    break  # tokens sampled after the one that finished it are dropped
            if taken:
                self.last_tokens[row.req_id] = tuple(req.output_ids[-taken:])
            # drafts that stood past a stop token or max_new_tokens are dropped with their tokens: their
            # KV (past the request's last token) is never cached and goes with the request's blocks
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            if not reason and row.req_id in result.drafts:
                req.spec_token_ids = list(result.drafts[row.req_id])
            if req.num_computed_tokens // self.kv.tokens_per_block > self.kv.requests[req.req_id].num_cached_blocks:
                # only when a block filled up; the view hands over just the new blocks' tokens (hashing
                # packs them as int64, so array and list slices hash alike)
                self.kv.cache_full_blocks(req.req_id, req.tokens, req.num_computed_tokens, req.extra_keys)
            if reason:
                req.status = Status.FINISHED
                req.finish_s = now_s
                req.finish_reason = reason
                self.policy.on_finish(self.kv, req)
                self.kv.free(req.req_id)
                self.running.remove(req)
                del self.requests[req.req_id]
                finished.append(req)
        for rid, why in load_failed.items():
            if rid in self.requests:
                req = self.abort(rid, now_s, reason="error")
                req.error = why
                finished.append(req)
        self.policy.after_step(self.kv, self.running)
        return finished

    @staticmethod
    def _check_result(plan: StepPlan, result: StepResult) -> None:
        """A result must cover its plan (checked before anything changes): every transfer completed (every
        runner here completes them within the step; nothing waits on one yet), a token for each row
        that samples and none for the others."""
        pending = set(range(len(plan.transfers))) - set(result.completed)
        if pending:
            raise RuntimeError(f"step {plan.step}: transfers {sorted(pending)} did not complete "
                               "(asynchronous transfers are not supported yet)")
        for row in plan.rows:
            toks = result.tokens.get(row.req_id, ())
            if row.sample != bool(toks):
                raise RuntimeError(f"step {plan.step}: request {row.req_id!r} "
                                   f"{'sampled no token' if row.sample else 'sampled a token it did not ask for'}")
            if len(toks) > 1 + row.num_draft_tokens:
                raise RuntimeError(f"step {plan.step}: request {row.req_id!r} got {len(toks)} tokens from a row with "
                                   f"{row.num_draft_tokens} draft tokens")
        sampled = {row.req_id for row in plan.rows if row.sample}
        extra = set(result.tokens) - {row.req_id for row in plan.rows}
        if extra:
            raise RuntimeError(f"step {plan.step}: tokens for requests not in the plan: {sorted(extra)}")
        if set(result.drafts) - sampled:
            raise RuntimeError(f"step {plan.step}: drafts for requests that did not sample: "
                               f"{sorted(set(result.drafts) - sampled)}")
