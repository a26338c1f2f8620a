"""A tier that serves this engine's pages from chunks of another page span: the P/D consumer's side of
"any producer layout" (docs/engine.md, P/D "Layout").

Chunks are canonical pages keyed by `chunk_key(fingerprint, group, chained hash)`, and both the chained
hash (over blocks of block_size x DCP tokens) and the fingerprint (tokens per page) depend on how an
engine pages a request. A producer whose pages span other tokens than ours therefore holds the prompt's
KV under keys we would never ask for. `RelayoutTier` wraps the tier that reaches the producer (the
PdConnector's peer tier) and, for a lookup whose context names the producer's spans
(`LookupContext.remote`, a `RemoteSource` built from the producer's kv_transfer_params):
- computes the producer's chained hashes and chunk keys from the request's tokens and salt (the consumer
  knows both), and for each of our pages the producer pages and token ranges it is made of
  (kvcache.relayout.page_parts: k whole pages, a slice of one, or an lcm mix);
- answers HIT for one of our pages when the inner tier answers HIT for every part, MISS when one part is a
  MISS, RETRY otherwise; the inner tier is asked with the producer's keys in walk order, so a peer tier
  still asks the producer once per request;
- loads each producer chunk once however many of our pages share it, and assembles each of our pages
  (kvcache.relayout.assemble_page) when its parts have arrived: "ok" only when every part is.
A lookup without `remote` goes to the inner tier unchanged (the same spans on both sides), and where the
inner tier misses, to the writers listed in `also` in order (a storage tier's `read_page_tokens`: engines
of those spans write the same directory or bucket, each under its own fingerprint, so each comes with a
tier reading that fingerprint's chunks; the request's tokens come with the context, so each listed
writer's chunks are named and assembled exactly as a producer's are).

The keys stay `chunk_key(fingerprint, group, chained hash)` on both sides: nothing new to authenticate,
a chunk is the producer's as it stored it. Everything else (name, stats, a peer tier's lease and
address) is the inner tier's.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from kvcache.block_pool import block_hashes
from kvcache.relayout import assemble_page, page_parts
from kvcache.tiers import chunk_key, tail_chunk
from kvcache.tiers.base import JobResult, LoadJob, Lookup, LookupContext, PageSpans, RemoteSource

MAX_PLANS = 256  # requests whose key mapping is kept (an admission asks again every step until it is in)
MAX_RECIPES = 1 << 16  # pages answered HIT and not loaded yet (a HIT the host tier had no room to load stays)


@dataclasses.dataclass
class _Plan:
    """One request's mapping: per page of ours (its key), (group, [(producer key, first, end token)]); the
    producer's keys in walk order (what the inner tier's context asks)."""

    parts: dict
    src_keys: tuple
    ctx: LookupContext | None = None


@dataclasses.dataclass
class _Fetch:
    """One producer chunk being loaded for one or more of our pages."""

    status: str | None = None
    payload: np.ndarray | None = None
    waiting: set = dataclasses.field(default_factory=set)  # outer job ids


class RelayoutTier:
    """`inner` (a SecondaryTier) seen through our page spans `own`; `row_bytes`: per cache group, the bytes
    per token of each array of the group in the canonical layout's order (kvcache.host.HostMemory: one per
    layer, the MTP layer's last); `also`: other writers to try, in order, for a page the inner tier does not
    hold under our key (a lookup whose context carries the request's `tokens`): (their spans, a tier that
    reads their chunks), whose loads this tier submits and polls, and shuts down with the inner one."""

    def __init__(self, inner, own: PageSpans, row_bytes: dict[str, tuple[int, ...]], also: tuple = ()):
        self.inner, self.own = inner, own
        self.also = tuple((sp, t) for sp, t in also if sp.fingerprint != own.fingerprint)  # ours: the inner tier
        self.row_bytes = {g: tuple(int(w) for w in ws) for g, ws in row_bytes.items()}
        missing = [g for g, _ in own.page_tokens if g not in self.row_bytes]
        if missing:
            raise ValueError(f"RelayoutTier: no row_bytes for cache groups {missing}")
        self._lock = threading.Lock()
        self._plans: collections.OrderedDict[tuple, _Plan] = collections.OrderedDict()
        # our key -> (group, parts, the producer's spans), from a HIT, oldest first
        self._recipes: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self._fetches: dict[bytes, _Fetch] = {}  # producer key -> its load
        self._inner_jobs: dict[int, bytes] = {}  # inner (negative) job id -> producer key (on any reading tier)
        self._outer: dict[int, tuple] = {}  # outer job -> (our key, group, parts, spans of the source)
        self._ids = 0
        self._finished: list[JobResult] = []

    def __getattr__(self, name):  # name, stats, version, a peer tier's lease / held_prefix / address ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------------------- the interface
    def lookup(self, key: bytes, ctx: LookupContext | None = None) -> Lookup:
        remote = ctx.remote if ctx is not None else None
        if remote is not None:
            return self._lookup_from(key, ctx, remote, self.inner)
        answer = self.inner.lookup(key, ctx)
        if answer is not Lookup.MISS or not self.also or ctx is None or ctx.tokens is None:
            return answer
        for spans, tier in self.also:  # a writer of other spans, named from the request's tokens and salt
            answer = self._lookup_from(key, ctx, RemoteSource(spans, *ctx.tokens), tier)
            if answer is not Lookup.MISS:
                return answer
        return Lookup.MISS

    def _lookup_from(self, key: bytes, ctx: LookupContext, remote: RemoteSource, tier) -> Lookup:
        """Our page `key` as chunks of `remote`'s spans: HIT when `tier` holds every part."""
        plan = self._plan(ctx, remote)
        found = plan.parts.get(key)
        if found is None:  # a page of ours past the producer's full pages: it cannot have it
            return Lookup.MISS
        group, parts = found
        answers = [tier.lookup(k, plan.ctx) for k, _, _ in parts]
        if Lookup.MISS in answers:
            return Lookup.MISS
        if Lookup.RETRY in answers:
            return Lookup.RETRY
        with self._lock:
            self._recipes[key] = (group, parts, remote.spans, tier)
            self._recipes.move_to_end(key)
            while len(self._recipes) > MAX_RECIPES:
                self._recipes.popitem(last=False)
        return Lookup.HIT

    def submit_load(self, job: LoadJob) -> None:
        with self._lock:
            recipes = [self._recipes.pop(k, None) for k in job.keys]
        if all(r is None for r in recipes):
            return self.inner.submit_load(job)
        if len(job.keys) != 1 or recipes[0] is None:
            raise ValueError("RelayoutTier: a load of pages assembled from another page span takes one key per job")
        group, parts, spans, tier = recipes[0]
        start = []
        with self._lock:
            self._outer[job.job_id] = (job.keys[0], group, parts, spans)
            for k in dict.fromkeys(k for k, _, _ in parts):
                f = self._fetches.get(k)
                if f is None:
                    f = self._fetches[k] = _Fetch()
                    self._ids -= 1
                    self._inner_jobs[self._ids] = k
                    start.append((self._ids, k, spans.tokens(group) * sum(self.row_bytes[group])))
                f.waiting.add(job.job_id)
        for inner_id, k, size in start:
            tier.submit_load(LoadJob(inner_id, (k,), (size,)))
        self._complete()

    def get_finished_jobs(self) -> list[JobResult]:
        out = []
        finished = list(self.inner.get_finished_jobs())
        for _, tier in self.also:
            finished += tier.get_finished_jobs()
        for r in finished:
            if r.kind == "load" and r.job_id < 0:
                with self._lock:
                    k = self._inner_jobs.pop(r.job_id)
                    f = self._fetches[k]
                    f.status, f.payload = r.status[0], r.payloads[0] if r.payloads else None
            else:
                out.append(r)
        self._complete()
        with self._lock:
            out += self._finished
            self._finished = []
        return out

    def submit_store(self, job) -> None:
        self.inner.submit_store(job)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)
        for _, tier in self.also:
            tier.shutdown(wait=wait)

    # ------------------------------------------------------------------------------------ internals
    def _complete(self) -> None:
        """Assemble every outer job whose parts have all arrived; drop fetches no job waits for."""
        with self._lock:
            for job, (key, group, parts, spans) in list(self._outer.items()):
                fetched = [self._fetches[k] for k, _, _ in parts]
                if any(f.status is None for f in fetched):
                    continue
                del self._outer[job]
                bad = [f.status for f in fetched if f.status != "ok"]
                if bad:
                    status, payload = ("corrupt" if "corrupt" in bad else bad[0]), None
                else:
                    status = "ok"
                    payload = assemble_page([(f.payload, lo, hi) for f, (_, lo, hi) in zip(fetched, parts)],
                                            self.row_bytes[group], spans.tokens(group))
                self._finished.append(JobResult(job, "load", (status,), (payload,)))
                for k, _, _ in parts:
                    f = self._fetches.get(k)
                    if f is not None:
                        f.waiting.discard(job)
                        if not f.waiting:
                            del self._fetches[k]

    def _plan(self, ctx: LookupContext, remote: RemoteSource) -> _Plan:
        at = (ctx.req_id, remote.spans, remote.num_tokens)
        with self._lock:
            plan = self._plans.get(at)
            if plan is not None:
                self._plans.move_to_end(at)
                return plan
        plan = key_plan(remote, self.own)
        plan.ctx = LookupContext(ctx.req_id, plan.src_keys, peer=ctx.peer, lease=ctx.lease)
        with self._lock:
            self._plans[at] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return plan


def key_plan(remote: RemoteSource, own: PageSpans) -> _Plan:
    """For a request whose KV a producer of spans `remote.spans` holds: each full page of ours (spans
    `own`) within the first `remote.num_tokens` tokens, keyed as our lookup asks for it, with the producer
    chunks (keys) and token ranges it is made of: the producer's full pages, and past them its tail chunk
    (kvcache.tiers.tail_chunk: its partial page's rows below num_tokens, which a P/D producer stores for
    the prompt's all-but-last tokens; a producer that did not store it answers MISS for it)."""
    src, n = remote.spans, remote.num_tokens
    hs = block_hashes(remote.tokens, src.hash_block_tokens, remote.extra_keys, upto=n)
    hd = block_hashes(remote.tokens, own.hash_block_tokens, remote.extra_keys, upto=n)
    parts, src_keys = {}, {}
    for g, tc in own.page_tokens:
        tp = src.tokens(g)
        held = n // tp  # the producer's full pages of this group; past them, its tail chunk
        tail = tail_chunk(src.fingerprint, g, tp, src.hash_block_tokens, remote.tokens, remote.extra_keys, n, hs)
        for i in range(min(len(hd) * own.hash_block_tokens // tc, n // tc)):
            ps = []
            for j, lo, hi in page_parts(tc, tp, i):
                k = (chunk_key(src.fingerprint, g, hs[(j + 1) * tp // src.hash_block_tokens - 1]) if j < held
                     else tail[1])
                ps.append((k, lo, hi))
                src_keys[(j + 1) * tp, g] = k
            parts[chunk_key(own.fingerprint, g, hd[(i + 1) * tc // own.hash_block_tokens - 1])] = (g, ps)
    groups = [g for g, _ in own.page_tokens]
    ordered = sorted(src_keys.items(), key=lambda kv: (kv[0][0], groups.index(kv[0][1])))
    return _Plan(parts, tuple(k for _, k in ordered))
