"""P/D disaggregation in the simulator: a prefill engine and a decode engine, each on its own virtual
clock, coupled as the PdConnector couples a prefill server and a decode server (docs/simulator.md "P/D").

`PdPair(prefill, decode)` looks like one engine to `experiments.workloads.ClosedLoopClient`
(`add_request`, `step`, `has_unfinished`, `clock`, `cfg`, `deploy`):
- a client request goes to the prefill engine at the client's time, with max_new_tokens 1 (vLLM's prefill
  leg; its token is dropped, as the router drops it);
- once its KV is parked (`Engine.parked`: the producer's next plan has run, or it has nothing left
  to run), the leading chunks of its prompt that the producer's "pd" tier holds
  (`Engine.prompt_chunk_keys`) are put into the decode replica's simulated "pd" tier (`SimTier.put`), and
  the request joins the decode engine at the producer's time then, with the client's max_new_tokens and
  its original arrival time (so TTFT and end-to-end rates cover both legs and the hand-off);
- the decode engine's admission finds its own device and host hits first, then loads the rest from the
  "pd" tier on that tier's read channel (the network: glm53.perfmodel.RDMA_CX7 by default) into its
  host tier or HiSparse's host pool, and computes what is left;
- the chunks put for a request are held for it until its first admission (`SimTier.put`'s holder), as
  the producer leases them until its consumer reads them; another request on the replica may load them
  meanwhile, but after that admission (a re-admission after a preemption included) only what was
  handed over again, or what the replica stored itself, is there.
Each engine runs at its own pace. The events (a step of an engine with work, starting at its clock; a
request delivered to an engine at its time) are processed in time order, deliveries first on a tie. An
idle engine's clock jumps to the time of the work it is given. The producer's "pd" tier costs nothing
(its chunks are the bytes its host tier already holds; a NIXL-style read takes them from there), and
its parking is priced as the offload policy's copies are.

The engines' pages may span different tokens (a DCP8 producer's block_size x 8 tokens, a decode rank's
block_size): the consumer then takes each of its full pages below the prompt's last token, from the
producer's full pages and the tail chunk of its last partial page (kvcache.tiers.tail_chunk, stored by
the prefill leg's finish), as the servers do (kvcache.tiers.remote.RelayoutTier). The relayout is priced as
the producer's bytes it reads: each of the consumer's chunks is put into its "pd" tier at the size of the
producer pages first needed for it (kvcache.relayout.page_parts), so a producer page that the consumer's pages
use only in part is still read whole over the tier's read channel. The host copy that assembles a page is not
priced. Engines whose chunks cannot be each other's (another model or KV format, MTP on one side only:
`Engine.remote_source`) are refused with a ValueError naming both sides' page spans.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import operator

from glm53.engine.config import DeployConfig
from glm53.engine.engine import Engine
from glm53.engine.metrics import summarize
from glm53.engine.request import SamplingParams, Status
from glm53.model import as_token_array
from glm53.perfmodel.hardware import STORAGE, StorageSpec
from kvcache.relayout import page_parts

# the producer's own "pd" tier: its host memory, which the consumer reads (the read is priced there)
PRODUCER_HOST = StorageSpec("the producer's host memory (read by the consumer)", read_bandwidth=math.inf,
                            write_bandwidth=math.inf, read_latency_s=0.0, write_latency_s=0.0)


_GROUP, _KEY = operator.itemgetter(0), operator.itemgetter(1)  # of a (group, chunk key) pair


class _Clock:
    """The client's clock: the end of the last step processed (it may step back a little when the other
    engine's next step ends earlier) and the client's sleeps."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def pd_deploy(deploy: DeployConfig, role: str, *, consumer_waits: bool = True) -> DeployConfig:
    """`deploy` with the PdConnector in `role` ("kv_producer" / "kv_consumer"); its host tier is
    deploy.cpu_offload_bytes, and its kv_policy stays (offload, or HiSparse with its offload budget).
    consumer_waits: the connector's key of that name (DeployConfig.pd_consumer_waits)."""
    if deploy.cpu_offload_bytes <= 0:
        raise ValueError(f"pd_deploy: the {role} needs cpu_offload_bytes > 0 (the PdConnector's host tier)")
    policy = deploy.kv_policy if deploy.policy.own_connector else "offload"
    ktc = {"kv_connector": "PdConnector", "kv_role": role,
           "kv_connector_extra_config": {"cpu_bytes_to_use": deploy.cpu_offload_bytes,
                                         **({} if consumer_waits else {"consumer_waits": False})}}
    return dataclasses.replace(deploy, kv_policy=policy, kv_transfer_config=ktc)


def sim_runners(engine: Engine) -> list:
    """A simulated engine's SimRunners, each once (DP x EP ranks share one runner, which holds the ranks')."""
    return list({id(r): r for rep in engine.replicas for r in rep.runner.ranks}.values())


def busy_until(engine: Engine) -> float:
    """The virtual time until which a simulated engine works: where its last step's host part ended (its
    clock) or, under async dispatch, where the forwards it dispatched end (`SimRunner.device_free_s`)."""
    return max(engine.clock.now(), *(r.device_free_s for r in sim_runners(engine)))


def build_pd(cfg, prefill: DeployConfig, decode: DeployConfig, hw=None, *, consumer_waits: bool = True,
             before_step=None, decode_prompt: str = "computed", **runner_kw) -> PdPair:
    """A PdPair of simulated engines (glm53.engine.sim.build_engine) for `prefill` and `decode`, each given
    the PdConnector's role; the decode side reads the producer over `runner_kw["tier_storage"]["p2p"]`
    (default glm53.perfmodel.RDMA_CX7). consumer_waits: the decode side waits for host pages to stage
    the producer's KV rather than compute it (DeployConfig.pd_consumer_waits; False computes it).
    before_step, decode_prompt: PdPair's."""
    from glm53.engine.sim import build_engine

    kw = {} if hw is None else {"hw": hw}
    storage = dict(runner_kw.pop("tier_storage", None) or STORAGE)
    pre = build_engine(cfg, pd_deploy(prefill, "kv_producer"), tier_storage={**storage, "p2p": PRODUCER_HOST},
                       **kw, **runner_kw)
    dec = build_engine(cfg, pd_deploy(decode, "kv_consumer", consumer_waits=consumer_waits), tier_storage=storage,
                       **kw, **runner_kw)
    return PdPair(pre, dec, before_step=before_step, decode_prompt=decode_prompt)


DECODE_PROMPTS = ("computed", "loaded")  # PdPair.decode_prompt


class PdPair:
    """A prefill and a decode engine as one (see the module docstring). Request ids are the client's in
    both engines. before_step(engine, other): called before each step of either engine, at its clock,
    with the other engine (which may still be busy then: `busy_until`); it may change how the step is
    priced (`SimRunner.set_host`), never what it schedules.

    decode_prompt: how a decode leg's prompt is priced. "computed" (the default): as this engine serves
    it, the decode engine computing what it takes from neither its own pages nor the producer's full
    pages (at least its last partial page; under MTP the page its hit gives back too). "loaded": as
    vLLM's NIXL consumer serves it (docs/simulator.md "Page layout"), every prompt token the producer
    holds is loaded and only the prompt's last one computed: the decode engine schedules as before,
    its runners leave the rows below the prompt's last token out of the forwards' price
    (`SimRunner.loaded_prompt`), and the rows of the decode pages the prompt fills in part (below its
    last token) are read over the "pd" tier's channel with the last chunk (under a relayout, the
    producer pages they need, whole). A pricing ablation: the decode engine's pages, tokens and counts
    are what it computes; `handed_tokens` counts every prompt token the producer held below the last."""

    def __init__(self, prefill: Engine, decode: Engine, *, before_step=None, decode_prompt: str = "computed"):
        if decode_prompt not in DECODE_PROMPTS:
            raise ValueError(f"PdPair: decode_prompt must be one of {DECODE_PROMPTS}, got {decode_prompt!r}")
        for name, eng, roles in (("prefill", prefill, ("kv_producer", "kv_both")),
                                 ("decode", decode, ("kv_consumer", "kv_both"))):
            if eng.deploy.kv_role not in roles:
                raise ValueError(f"PdPair: the {name} engine needs the PdConnector as {' or '.join(roles)}, got "
                                 f"kv_role {eng.deploy.kv_role!r}")
            if not hasattr(eng.clock, "advance"):
                raise ValueError(f"PdPair: the {name} engine needs a VirtualClock (a simulated engine)")
        try:
            self.remote = decode.remote_source(prefill.page_spans())  # None: the same chunks on both sides
        except ValueError as e:
            raise ValueError(f"PdPair: {e}") from None
        self.prefill, self.decode = prefill, decode
        self.before_step = before_step
        self.clock = _Clock()
        self.cfg, self.deploy = decode.cfg, decode.deploy
        self._ids, self._seq = itertools.count(), itertools.count()
        self._to_prefill: list = []  # heap of (time, seq, req_id)
        self._to_decode: list = []  # heap of (time, seq, req_id)
        # finished on the prefill engine, KV not parked yet, in the order they finished (a dict, not a set:
        # hand-offs at one time are delivered in this order, which must not depend on string hashing)
        self._parking: dict[str, None] = {}
        self._req: dict[str, tuple] = {}  # req_id -> (prompt, params, salt, arrival)
        self.handed_tokens = 0  # prompt tokens whose chunks the producer held at hand-off ("loaded": all of them)
        self.handoff_s: list[float] = []  # per request: hand-off time - client arrival
        self._holding: dict[str, object] = {}  # decode request not admitted yet -> the "pd" tier holding its chunks
        self.decode_prompt = decode_prompt
        self._loaded: dict[str, int] | None = None  # decode_prompt="loaded": SimRunner.loaded_prompt, shared
        if decode_prompt == "loaded":
            self._loaded = {}
            for run in sim_runners(decode):
                run.loaded_prompt = self._loaded

    @property
    def finished(self) -> dict:
        """Requests done (their decode leg finished), by id."""
        return self.decode.finished

    @property
    def num_devices(self) -> int:
        return self.prefill.num_devices + self.decode.num_devices

    def add_request(self, prompt_ids, params: SamplingParams, *, salt: str = "") -> str:
        rid = f"pd-{next(self._ids)}"
        prompt = as_token_array(prompt_ids)
        prompt.flags.writeable = False  # one array for both legs: each engine keeps it without a copy
        self._req[rid] = (prompt, params, salt, self.clock.now())
        heapq.heappush(self._to_prefill, (self.clock.now(), next(self._seq), rid))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._to_prefill or self._to_decode or self._parking or self.prefill.has_unfinished()
                    or self.decode.has_unfinished())

    def step(self) -> list[tuple[str, int, bool]]:
        """Process events in time order up to and including one engine step -> the decode engine's tokens
        of that step ([] for a prefill step)."""
        while True:
            events = []
            if self._to_prefill:
                events.append((self._to_prefill[0][0], 0, "to_prefill"))
            if self._to_decode:
                events.append((self._to_decode[0][0], 0, "to_decode"))
            if self.prefill.has_unfinished():
                events.append((self.prefill.clock.now(), 1, "prefill"))
            if self.decode.has_unfinished():
                events.append((self.decode.clock.now(), 1, "decode"))
            if not events:
                if not self._parking:
                    return []
                self._hand_off()  # the producer went idle: nothing more to park
                continue
            t, _, kind = min(events)
            if kind == "to_prefill":
                self._deliver_prefill(*heapq.heappop(self._to_prefill))
            elif kind == "to_decode":
                self._deliver_decode(*heapq.heappop(self._to_decode))
            elif kind == "prefill":
                if self.before_step is not None:
                    self.before_step(self.prefill, self.decode)
                for rid, _, fin in self.prefill.step():
                    if fin:
                        self._parking[rid] = None
                self.clock.t = self.prefill.clock.now()
                self._hand_off()
                return []
            else:
                if self.before_step is not None:
                    self.before_step(self.decode, self.prefill)
                try:
                    out = self.decode.step()
                finally:  # a step that failed its requests finished them: their holds go too
                    self._release_admitted()
                self.clock.t = self.decode.clock.now()
                return out

    def _catch_up(self, eng: Engine, t: float) -> None:
        if not eng.has_unfinished() and eng.clock.now() < t:
            eng.clock.advance(t - eng.clock.now())

    def _deliver_prefill(self, t: float, _seq: int, rid: str) -> None:
        prompt, params, salt, arrival = self._req[rid]
        self._catch_up(self.prefill, t)
        leg = dataclasses.replace(params, max_new_tokens=1, min_tokens=0)
        self.prefill.add_request(prompt, leg, req_id=rid, salt=salt, kv_produce=True)
        self.prefill.requests[rid].arrival_s = arrival

    def _hand_off(self) -> None:
        """Requests whose KV the producer's last plan parked go to the decode engine now."""
        now = self.prefill.clock.now()
        for rid in [r for r in self._parking if self.prefill.parked(r)]:
            del self._parking[rid]
            heapq.heappush(self._to_decode, (now, next(self._seq), rid))

    def _release_admitted(self) -> None:
        """Release the chunks put for each decode request its engine has admitted since (running or
        finished; the scheduler preempts nothing in a step that admits)."""
        reqs = self.decode.requests
        for rid in [r for r in self._holding if r not in reqs or reqs[r].status is not Status.WAITING]:
            self._holding.pop(rid).release(rid)

    def _deliver_decode(self, t: float, _seq: int, rid: str) -> None:
        prompt, params, salt, arrival = self._req.pop(rid)
        tier = self.prefill.pd_tier(self.prefill.replica_of(rid))
        tpb, blocks = self.prefill.prompt_chunk_keys(rid)
        has = tier.held_now()
        # the leading hash blocks whose every page the producer holds: up to the block of the first key it
        # does not hold (C-level loops over the prompt's keys)
        missing = map(operator.not_, map(has.__contains__, map(_KEY, itertools.chain.from_iterable(blocks))))
        first = next(itertools.compress(itertools.count(), missing), None)
        held = blocks if first is None else blocks[:bisect.bisect_right(list(itertools.accumulate(map(len, blocks))), first)]
        handed = len(held) * tpb
        whole = len(held) == len(blocks)  # every full page below the prompt's last token
        if self.remote is not None:  # past its full pages, the tail chunks of its last partial pages
            upto, tails = self.prefill.prompt_tail_keys(rid)
            whole = whole and all(k in has for _, k in tails)
            handed = upto if whole else handed
        self._catch_up(self.decode, t)
        self.decode.add_request(prompt, params, req_id=rid, salt=salt, kv_peer="producer")
        self.decode.requests[rid].arrival_s = arrival
        tier = self.decode.pd_tier(self.decode.replica_of(rid))
        # decode_prompt="loaded": vLLM's consumer loads every prompt token but the last that the producer
        # holds; the rows of the decode engine's pages it fills in part ride with the last chunk read (a
        # prompt shorter than one page has none: its rows are not priced as read)
        loaded = self._loaded is not None and whole
        if self.remote is None:
            pages = self.decode.sizes.page_bytes
            pairs = list(itertools.chain.from_iterable(held))
            chunks = list(zip(map(_KEY, pairs), map(pages.__getitem__, map(_GROUP, pairs))))
            if loaded and chunks:
                chunks[-1] = (chunks[-1][0], chunks[-1][1] + self._partial_bytes(len(prompt) - 1))
        else:
            chunks = self._relaid(rid, handed, partial=loaded)
        if self._loaded is not None:
            handed = self._loaded[rid] = len(prompt) - 1 if whole else handed
        tier.put(chunks, holder=rid)
        self._holding[rid] = tier
        self.handed_tokens += handed
        self.handoff_s.append(t - arrival)

    def _partial_bytes(self, num_tokens: int) -> int:
        """Bytes of the decode engine's pages that the first `num_tokens` tokens of a prompt fill in part:
        per cache group, the rows past its last full page, at its bytes a token."""
        own, pages = self.decode.page_spans(), self.decode.sizes.page_bytes
        return sum(num_tokens % own.tokens(g) * (pages[g] // own.tokens(g)) for g, _ in own.page_tokens)

    def _relaid(self, rid: str, held_tokens: int, partial: bool = False) -> list[tuple[bytes, int]]:
        """The decode engine's chunks of finished prefill `rid` that the producer's first `held_tokens`
        tokens make, each as (its key, the bytes of the producer pages read first for it). partial: the
        rows of the decode pages those tokens fill in part are read too (decode_prompt="loaded"): the
        producer pages they need that no chunk read, whole, with the last chunk."""
        src, req = self.remote, self.prefill.finished[rid]
        own = self.decode.page_spans()
        tpb, blocks = self.decode.chunk_keys(req.prompt_ids, req.extra_keys, upto=held_tokens)
        per_token = {g: self.prefill.sizes.page_bytes[g] // src.tokens(g) for g, _ in own.page_tokens}
        read, out = set(), []
        for c, block in enumerate(blocks):
            for g, key in block:
                tc, tp = own.tokens(g), src.tokens(g)
                page = (c + 1) * tpb // tc - 1
                new = {j for j, _, _ in page_parts(tc, tp, page)} - {j for gg, j in read if gg == g}
                read |= {(g, j) for j in new}
                out.append((key, len(new) * tp * per_token[g]))
        if partial and out:
            extra = 0
            for g, _ in own.page_tokens:
                tp, lo = src.tokens(g), held_tokens // own.tokens(g) * own.tokens(g)
                if lo < held_tokens:
                    new = set(range(lo // tp, (held_tokens - 1) // tp + 1)) - {j for gg, j in read if gg == g}
                    extra += len(new) * tp * per_token[g]
            out[-1] = (out[-1][0], out[-1][1] + extra)
        return out

    def metrics(self, req_ids=None, window: tuple[float, float] | None = None) -> dict:
        """The decode engine's metrics over the requests (their arrival is the client's, so TTFT and
        end-to-end rates include the prefill leg and the hand-off), with throughput over both engines'
        devices, and the prefill engine's own figures under `prefill_`; `window` as Engine.metrics."""
        ids = list(req_ids) if req_ids is not None else list(self.decode.finished)
        m = self.decode.metrics(ids, window=window)
        outs = [self.decode.output(r) for r in ids]
        duration = max(o.finish_s for o in outs) - min(o.arrival_s for o in outs)
        m["throughput_tok_s_per_device"] = summarize(outs, duration_s=duration, num_devices=self.num_devices,
                                                     window=window)["throughput_tok_s_per_device"]
        pre = self.prefill.metrics([r for r in ids if r in self.prefill.finished])
        m.update({f"prefill_{k}": pre[k] for k in ("prefix_hit_rate", "preemptions", "recomputed_tokens",
                                                    "d2h_bytes", "h2d_bytes", "device_blocks_peak")})
        m.update(pd_handed_tokens=self.handed_tokens, pd_received_tokens=self.received_tokens(),
                 pd_handoff_s_median=sorted(self.handoff_s)[len(self.handoff_s) // 2] if self.handoff_s else math.nan,
                 num_devices=self.num_devices)
        if self._loaded is not None:  # over the whole run, as the runners count them
            m.update(pd_decode_prompt="loaded",
                     pd_loaded_prompt_tokens=sum(r.loaded_tokens for r in sim_runners(self.decode)))
        return m

    def received_tokens(self) -> int:
        """Prompt tokens the decode engine loaded from the producer (glm53:kv_transfer_received_tokens)."""
        return sum(self.decode.kv_transfer_received_tokens(i) for i in range(len(self.decode.replicas)))

    def shutdown(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()
