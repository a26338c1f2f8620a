"""The engine: requests in, tokens out, over `data_parallel_size` replicas (1 = one replica).

A replica is a scheduler (what runs; kvcache block pool and KV policy) and a runner (how it runs). One
engine step steps every replica that has work, each with the same three calls:

    plan = replica.scheduler.schedule()
    result = replica.runner.execute(plan)
    replica.scheduler.update(plan, result, now)

Replica i runs on devices [i * N, (i + 1) * N) of the process's devices (N =
DeployConfig.devices_per_replica: its context axis max(PCP, DCP), or its TP ranks, which DCP reuses),
with its own copy of the weights, block pool and host pools; replicas share nothing, so a request's
tokens do not depend on which replica serves it (vLLM's data parallelism). Under DP x EP
(DeployConfig.experts_across_ranks: one device per rank, enable_expert_parallel) the ranks share the
routed experts: each keeps its own scheduler, but one runner drives every rank's device, and a step
schedules every rank, runs their plans as one step (`ModelRunner.execute_ranks`: every MoE layer's
all-to-all needs all ranks; a rank without work passes padding rows) and updates each rank with its
own results. Routing happens at
admission: a request with a salt (a user or session key; experiments.workloads salts every turn of a
user's sessions) goes to the replica that served that salt before, so later turns find their prefix in
that replica's cache; a new salt, or none, goes to the replica with the fewest unfinished requests
(ties: the lowest index). On one host the replicas run one after the other (on real hardware each runs
on its own GPUs).

KV events (DeployConfig.kv_events_config, kvcache.events): each replica has an event recorder on its
device pool, its policy's host pools and its secondary tiers, and a publisher; after a replica's step
its events go out as one batch stamped with the replica's index as data_parallel_rank (vLLM publishes
per scheduler step). `reset_prefix_cache` drops every cached prefix (AllBlocksCleared); `shutdown`
closes the sockets.

Metrics (`metrics`; live Prometheus metrics: glm53.engine.prometheus) cover all replicas: scheduler
counters and transfer bytes are summed,
throughput is divided by data_parallel_size x N devices, and the timeline has one row per engine step
with the replicas' running / waiting requests and free blocks (after scheduling) summed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm53.config import ModelConfig
from glm53.engine.build import kv_fingerprint, make_policy, profile_workspace, weights_bytes, weights_sample
from glm53.engine.config import GROUPS, DeployConfig
from glm53.engine.metrics import cp_work_metrics, summarize
from glm53.engine.pd import PdQueries
from glm53.engine.plan import Clock, Runner, WallClock
from glm53.engine.request import Request, RequestError, RequestOutput, SamplingParams, is_utf8
from glm53.engine.runner import ModelRunner
from glm53.engine.runner.ranks import first_round_all2all_bytes
from glm53.engine.scheduler import BLOCK_USES, Scheduler, SchedulerStats
from glm53.engine.spec_decode import SpecDecodeStats
from glm53.model import as_token_array
from kvcache.events import KVEventRecorder, batch, make_publisher
from kvcache.tiers import PageSpans, TierSet, make_tier
from kvcache.transfer import TransferStats

_log = logging.getLogger(__name__)


# vLLM's kv_cache_spec_kind of GLM-5.3's cache groups: the MLA rows and the indexer keys are both
# MLAAttentionSpec there (the indexer cache is one 132-byte "head")
KV_EVENT_SPEC_KINDS = {"mla": "mla_attention", "indexer": "mla_attention"}
# salts whose replica the engine remembers (LRU): each entry is a client-chosen string
MAX_SALTS = 1 << 16


@dataclasses.dataclass
class Replica:
    """One data-parallel replica: its scheduler (block pool, policy) and its runner."""

    scheduler: Scheduler
    runner: Runner

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)


class Engine(PdQueries):
    """Serve `model` under `deploy`. `add_request` queues a prompt; each `step` schedules and runs one
    batch per replica and returns the tokens produced; `generate` runs prompts to completion.

    model: a GLM53 (weights), or a bare ModelConfig for a runner that needs no weights (the simulator,
        glm53.engine.sim; its "auto" KV dtype is bfloat16, the checkpoints' dtype).
    runner / clock: injectable (a simulator or a test passes its own runner; with data parallelism, one
    runner per replica as a sequence); by default the model runs on the paged cache of `devices`
    (default: the devices JAX sees) and time is wall time. A runner whose results carry `duration_s`
    (a priced step) needs a clock with `advance` (glm53.engine.plan.VirtualClock): each replica's
    tokens arrive at the step's start plus its own duration, and the clock moves by the slowest
    replica's (replicas run in parallel on their own GPUs). Secondary tiers (DeployConfig's
    secondary_tiers) are built from their specs for the model runner; an injected runner must make them
    itself (`runner.make_tiers(specs, fingerprint, replica)`: the simulator's tiers hold keys, no bytes).
    """

    def __init__(self, model, deploy: DeployConfig | None = None, *, runner: Runner | Sequence[Runner] | None = None,
                 clock: Clock | None = None, devices=None):
        self.model = model
        self.cfg: ModelConfig = model if isinstance(model, ModelConfig) else model.cfg
        d = deploy or DeployConfig()
        self.clock = clock or WallClock()
        dp, n = d.data_parallel_size, d.devices_per_replica
        runners = list(runner) if isinstance(runner, (list, tuple)) else None if runner is None else [runner]
        if runners is not None and len(runners) != dp:
            raise ValueError(f"runner: {len(runners)} runner(s) given for data_parallel_size={dp} (one per replica)")
        # every default filled in and every size checked before any array is allocated (but, on a GPU, the
        # profile run's throwaway runner below: the weights and a one-block pool, freed before the real one)
        if d.num_speculative_tokens and self.cfg.num_nextn_predict_layers < 1:
            raise ValueError("DeployConfig.speculative_config: method 'mtp' drafts with the checkpoint's MTP layer, "
                             "but this model has none (num_nextn_predict_layers=0; glm53.from_pretrained loads a "
                             "checkpoint without model.layers.{num_hidden_layers}.* tensors without MTP): use a "
                             "checkpoint with MTP weights or turn speculative decoding off")
        if isinstance(model, ModelConfig) and runners is None:
            raise ValueError("Engine(ModelConfig): a model without weights needs a runner that runs without "
                             "them (e.g. glm53.engine.sim.SimRunner); pass runner=")
        lockstep = d.experts_across_ranks
        if lockstep and self.cfg.n_routed_experts % dp:
            raise ValueError(f"enable_expert_parallel with data_parallel_size={dp}: the model's n_routed_experts="
                             f"{self.cfg.n_routed_experts} do not split evenly over the {dp} ranks")
        dtype = "bfloat16" if isinstance(model, ModelConfig) else jnp.dtype(getattr(model, "dtype", jnp.float32)).name
        device = None
        if runners is None:
            device = list(devices)[0] if devices is not None else jax.devices()[0]
        groups = [None] * dp
        if runners is None and (dp > 1 or devices is not None):
            devices = sorted(jax.devices(), key=lambda x: (x.process_index, x.id)) if devices is None else list(devices)
            if len(devices) < dp * n:
                raise ValueError(f"data_parallel_size={dp} x {n} devices per replica needs {dp * n} devices, but only "
                                 f"{len(devices)} are available (on CPU, simulate more with "
                                 f"XLA_FLAGS=--xla_force_host_platform_device_count={dp * n})")
            # DP x EP: one runner drives every rank's device (each group names them all)
            groups = [devices[:dp]] * dp if lockstep else [devices[i * n:(i + 1) * n] for i in range(dp)]
        # a pool sized from a GPU's memory leaves out the weights and the largest step's workspace
        # (vLLM's profile run): the workspace comes from compiling that step once on a one-block pool
        self.workspace_bytes = 0
        if runners is None and d.budget_from_device_memory(device):
            self.workspace_bytes = profile_workspace(model, d, dtype, device, groups[0])
        # the model runner's arrays hold a page of every group per block id (no shared buffer yet): a pool
        # sized from a byte budget is priced at that, so it fits; injected runners keep the design's price
        self.deploy = d = d.resolved(self.cfg, dtype, device=device, weights_bytes=weights_bytes(model, device, d),
                                     workspace_bytes=self.workspace_bytes, runner_arrays=runners is None)
        self.sizes = d.kv_sizes(self.cfg, dtype)
        specs = d.offload_options["secondary_tiers"] if d.policy.uses_tiers else []
        if specs and runners is not None and not all(hasattr(r, "make_tiers") for r in runners):
            raise NotImplementedError("secondary KV tiers need the model runner or a runner that simulates them "
                                      "(make_tiers: glm53.engine.synthetic.SyntheticRunner, glm53.engine.sim.SimRunner)")
        self._weights_sample = weights_sample(model) if specs else b""
        self._spans: dict[tuple, PageSpans] = {}  # page_spans' answers by tokens per page (a few producers' spans)
        self.fingerprint = kv_fingerprint(model, d, self.sizes, weights=self._weights_sample) if specs else ""
        # P/D consumer, per replica: requests whose producer's chunks cannot be ours (remote_source)
        self.kv_transfer_failed_lookups = [0] * dp
        self._failures_logged: set = set()
        self.replicas: list[Replica] = []
        self.tiers: list[TierSet | None] = []
        for i in range(dp):
            if specs and runners is not None:  # an injected runner simulates its tiers (keys, no bytes)
                tiers = runners[i].make_tiers(specs, self.fingerprint, replica=i)
            else:
                tiers = (TierSet([self._wrap(make_tier(spec, self.fingerprint, replica=i), spec, i) for spec in specs])
                         if specs else None)
            self.tiers.append(tiers)
            policy = make_policy(d, self.sizes, tiers, self.fingerprint)
            if runners is not None:
                run = runners[i]
            elif lockstep and i:
                run = self.replicas[0].runner  # the ranks' one runner: their plans run as one step
            else:
                run = ModelRunner(model, d, self.sizes, groups[i], tiers=tiers)
            self.replicas.append(Replica(Scheduler(d, self.sizes.num_blocks, GROUPS, policy=policy), run))
        if lockstep and runners is None and specs:  # DP x EP: each rank's transfers run on its own tiers
            self.replicas[0].runner.rank_tiers = list(self.tiers)
        # KV events: a recorder per replica on every pool that caches prefixes, a publisher per replica
        events = d.kv_events
        self._events: list[KVEventRecorder | None] = [None] * dp
        if events.enable_kv_cache_events:
            for i, rep in enumerate(self.replicas):
                rec = self._events[i] = KVEventRecorder(GROUPS, d.group_tokens_per_block(GROUPS), KV_EVENT_SPEC_KINDS)
                rep.scheduler.kv.attach_events(rec)
                rep.scheduler.policy.attach_events(rec)
                if self.tiers[i] is not None:
                    self.tiers[i].attach_events(rec)
        self.kv_event_publishers = []
        try:
            for i in range(dp):
                self.kv_event_publishers.append(make_publisher(events, i))
        except BaseException:  # a busy or bad address: close what opened, stop the tiers' threads
            _shutdown(list(self.tiers), [None] * dp, self.kv_event_publishers)
            raise
        # at interpreter exit too: every chunk reported stored is complete on disk, the last events sent
        self._finalizer = weakref.finalize(self, _shutdown, list(self.tiers), list(self._events),
                                           list(self.kv_event_publishers))
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.finished: dict[str, Request] = {}
        self._owner: dict[str, int] = {}  # request id -> replica index
        # salt -> the replica that served it last, least recently used first; bounded (MAX_SALTS) because
        # clients name the salts: a salt forgotten is routed by load, as a new one
        self._by_salt: collections.OrderedDict[str, int] = collections.OrderedDict()
        # one row per engine step that scheduled requests, after scheduling: (clock s at its start, running,
        # waiting, free device blocks, clock s at its end, prefill tokens), summed over replicas; the end makes
        # the running requests a time series (metrics' time-weighted mean); prefill tokens: those of rows that
        # are not a decode row (one token and its drafts), 0 for a decode-only step
        self.timeline: list[tuple[float, int, int, int, float, int]] = []
        self._steps = 0
        self.plans_run = [0] * dp  # per replica: plans its runner executed (KV transfers included)
        # DP x EP: the ranks' plans run as one step (the model runner's, or a simulator's that prices them so)
        self._lockstep = d.experts_across_ranks and (runners is None or hasattr(runners[0], "execute_ranks"))
        self.dp_rank_tokens = [0] * dp  # per replica: tokens its plans scheduled
        self.dp_idle_rank_steps = 0  # over steps that computed: replicas without rows
        self._all2all_estimate = 0  # DP x EP on injected runners: ep_all2all_bytes from the plans
        self._itemsize = jnp.dtype(dtype).itemsize  # bytes of a hidden-state value (what the all-to-alls move)
        self._steps_begun = self._steps_ended = 0  # `step` calls begun and returned (`parked` reads them)
        self._ids = itertools.count()
        self.observers: list = []  # each has on_step(engine, tokens, finished requests), called after every step
        # ids of the requests the last step finished, a finishing token or not (one whose KV failed to load
        # under kv_load_failure_policy "fail" ends with none): AsyncEngine ends their streams from it
        self.last_finished: tuple[str, ...] = ()
        # history a long-running server bounds (None: keep all, for metrics() over a whole run): the newest
        # finished requests kept (with their replica), and the newest timeline rows
        self.max_finished: int | None = None
        self.max_timeline: int | None = None

    def add_observer(self, observer) -> None:
        """Call `observer.on_step(engine, tokens, finished)` after every step (glm53.engine.prometheus)."""
        self.observers.append(observer)

    def shutdown(self) -> None:
        """Wait for the secondary tiers' pending stores and stop their threads, publish the last KV events
        (the stores that finished meanwhile) and close the event sockets (also run at interpreter exit).
        Idempotent; `metrics()` stays readable; stepping after it is an error for tiered engines and
        for engines that publish events."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix of every replica: the device pool's and the host pools' hashes
        (vLLM's `LLM.reset_prefix_cache`, which also serves after a weight update). Running requests
        keep their blocks. The secondary tiers keep their chunks. With KV events on, each replica
        publishes AllBlocksCleared, or, while a secondary tier holds announced chunks, a removal of each
        dropped hash (AllBlocksCleared would tell a router the tier's chunks went too)."""
        for i in range(len(self.replicas)):
            self._reset_prefix_cache(i)

    def _reset_prefix_cache(self, i: int) -> None:
        """`reset_prefix_cache` of replica i."""
        rec, sch = self._events[i], self.replicas[i].scheduler
        with rec.clearing() if rec is not None else contextlib.nullcontext():
            sch.kv.pool.reset_prefix_cache()
            sch.policy.reset_prefix_cache()
        self._publish_events(i)

    def _publish_events(self, i: int) -> None:
        """Replica i's events since its last batch, as one batch (none if it recorded nothing)."""
        rec = self._events[i]
        if rec is not None and rec.events:
            self.kv_event_publishers[i].publish(batch(rec.take(), i))

    # ------------------------------------------------------------------------------------ one replica
    def _only(self) -> Replica:
        if len(self.replicas) != 1:
            raise AttributeError(f"this engine has {len(self.replicas)} data-parallel replicas: use "
                                 "engine.replicas[i].scheduler / .runner")
        return self.replicas[0]

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of a one-replica engine."""
        return self._only().scheduler

    @property
    def runner(self) -> Runner:
        """The runner of a one-replica engine."""
        return self._only().runner

    @property
    def num_devices(self) -> int:
        return self.deploy.data_parallel_size * self.deploy.devices_per_replica

    def warmup(self, *, prompt_logprobs: bool = False) -> int:
        """Compile every bucket shape of each distinct runner (`ModelRunner.warmup`: independent replicas
        each for their own devices; DP x EP ranks share one runner, warmed once) -> shapes run."""
        runners = list({id(r.runner): r.runner for r in self.replicas}.values())
        return sum(r.warmup(prompt_logprobs=prompt_logprobs) for r in runners)

    # -------------------------------------------------------------------------------------- requests
    def route(self, salt: str) -> int:
        """The replica a new request with `salt` goes to (DeployConfig.dp_routing)."""
        if self.deploy.dp_routing == "load":
            score = [4 * len(r.scheduler.waiting) + len(r.scheduler.running) for r in self.replicas]
            return score.index(min(score))
        if salt and salt in self._by_salt:
            return self._by_salt[salt]
        load = [r.num_unfinished for r in self.replicas]
        return load.index(min(load))

    def parked(self, req_id: str) -> bool:
        """Whether finished `req_id`'s KV transfers (the parking its finish planned) have run: its replica
        ran a plan after the one it finished in, or has nothing left to run, or it was forgotten
        (max_finished: so many requests finished after it that its plan ran long ago). A server thread may
        call it."""
        r, req = self._owner.get(req_id), self.finished.get(req_id)
        if r is None or req is None or self.plans_run[r] > req.finished_in_plan:
            return True
        # nothing to run, read before the step counters: a step that began meanwhile may have taken the
        # transfers (has_work False) without having run them yet, and then the counters differ
        idle = not self.replicas[r].scheduler.has_work
        return idle and self._steps_begun == self._steps_ended

    def replica_of(self, req_id: str) -> int:
        return self._owner[req_id]

    def add_request(self, prompt_ids, params: SamplingParams | None = None, *, req_id: str | None = None,
                    salt: str = "", kv_peer: str | None = None, kv_lease: int = 0,
                    kv_remote: PageSpans | None = None, kv_produce: bool = False,
                    stop_check: Callable[[int], str | None] | None = None, prefill_after: str | None = None) -> str:
        """Queue a prompt on the replica `route(salt)` picks. kv_peer: "host:port" of the peer tier (a P/D
        producer's) its prefix lookup asks for the prompt's KV (kvcache.tiers.LookupContext.peer), kv_lease:
        that producer's lease on it (handed over to the lookup, so the fetch frees it); kv_remote: the page
        spans it announced (`remote_source`: a producer whose chunks this engine cannot read is counted and
        logged, and the prompt is computed here); kv_produce: it is a P/D prefill leg (its finish also stores
        its prompt's last partial page for a consumer of finer pages: `prompt_tail_keys`). stop_check: the
        request's stop strings (`Request.stop_check`). Rejects (RequestError, a ValueError naming the field)
        token ids outside the vocabulary, a prompt whose tokens plus max_new_tokens exceed max_model_len
        (rather than truncating it), and a salt that is not text UTF-8 can carry (it is hashed into every
        block's key at admission, inside a step). prefill_after: a live request with the same prompt (n > 1's
        first sibling): this one runs on its replica and is admitted once that one's prompt is computed, so the
        prompt's full pages are computed once and shared through the prefix cache. Under MTP a penalty is
        refused: it would change with every draft token, and the accept rule has none."""
        params = params or SamplingParams()
        if self.deploy.num_speculative_tokens:
            p = params
            for field, on in (("presence_penalty", p.presence_penalty != 0), ("frequency_penalty", p.frequency_penalty != 0),
                              ("repetition_penalty", p.repetition_penalty != 1)):
                if on:
                    raise RequestError(field, f"{field} is not supported with speculative decoding (MTP): a "
                                              "penalty changes with every draft token, which the accept rule does "
                                              "not follow (temperature, min_p, top_k, top_p and logit_bias it does)")
        ids = as_token_array(prompt_ids)
        ids.flags.writeable = False  # a request's prompt never changes: whoever reads it may share it
        cfg = self.cfg
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise RequestError("prompt_ids", f"token ids must lie in [0, {cfg.vocab_size})")
        if any(t >= cfg.vocab_size for t in params.stop_token_ids):
            raise RequestError("stop_token_ids",
                               f"stop_token_ids must lie in [0, {cfg.vocab_size}), got {params.stop_token_ids}")
        if params.logprobs is not None and not all(getattr(r.runner, "gives_logprobs", False) for r in self.replicas):
            raise RequestError("logprobs", f"logprobs need the model's logits; this engine's runner "
                                           f"({type(self.replicas[0].runner).__name__}) computes none")
        if params.prompt_logprobs is not None and not all(getattr(r.runner, "gives_prompt_logprobs", False)
                                                          for r in self.replicas):
            raise RequestError("prompt_logprobs", f"prompt_logprobs need every prompt position's logits; this "
                                                  f"engine's runner ({type(self.replicas[0].runner).__name__}, or "
                                                  f"DP x EP ranks) computes none")
        if any(t >= cfg.vocab_size for t, _ in params.logit_bias):
            raise RequestError("logit_bias", f"logit_bias token ids must lie in [0, {cfg.vocab_size}), got "
                                             f"{sorted(t for t, _ in params.logit_bias if t >= cfg.vocab_size)[:8]}")
        total = ids.size + params.max_new_tokens
        if total > self.deploy.max_model_len:
            raise RequestError("max_new_tokens", f"prompt of {ids.size} tokens + max_new_tokens="
                                                 f"{params.max_new_tokens} = {total} exceeds max_model_len="
                                                 f"{self.deploy.max_model_len}")
        if not isinstance(salt, str) or not is_utf8(salt):
            raise RequestError("salt", f"the salt must be text UTF-8 can encode (no lone surrogates), got {salt!r}")
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self.requests or req_id in self.finished:
            raise ValueError(f"request id {req_id!r} is already in use")
        i = self._owner[prefill_after] if prefill_after in self.requests else self.route(salt)
        remote = None
        if kv_peer is not None:
            try:
                remote = self.remote_source(kv_remote)
            except ValueError as e:
                self.kv_transfer_failed_lookups[i] += 1
                key = (kv_peer, kv_remote.fingerprint)
                if key not in self._failures_logged and len(self._failures_logged) < 1024:  # once per producer
                    self._failures_logged.add(key)
                    _log.warning("P/D: the producer at %s holds chunks this engine cannot read; prompts it prefills "
                                 "are computed here: %s", kv_peer, e)
                kv_peer, kv_lease = None, 0  # nothing of it could be ours: compute, do not ask
        req = Request(req_id, ids, params, salt=salt, arrival_s=self.clock.now(), kv_peer=kv_peer,
                      kv_lease=kv_lease, kv_remote=remote, kv_produce=ids.size - 1 if kv_produce else 0,
                      stop_check=stop_check, prefill_after=prefill_after)
        self.replicas[i].scheduler.add(req)
        self.requests[req_id] = req
        self._owner[req_id] = i
        if salt:
            self._by_salt[salt] = i
            self._by_salt.move_to_end(salt)
            if len(self._by_salt) > MAX_SALTS:
                self._by_salt.popitem(last=False)
        return req_id

    def abort_request(self, req_id: str) -> RequestOutput:
        """Finish a live request now (finish_reason "abort": its client went away) and free its blocks;
        its output so far is returned. Between steps only (the engine is single-threaded; a server's
        engine loop applies aborts there)."""
        if req_id not in self.requests:
            raise KeyError(f"no live request {req_id!r}")
        req = self.replicas[self._owner[req_id]].scheduler.abort(req_id, self.clock.now())
        self.finished[req_id] = self.requests.pop(req_id)
        for obs in self.observers:
            obs.on_step(self, [], [req])
        return self.output(req_id)

    def has_unfinished(self) -> bool:
        """Requests to run, or KV transfers still to be executed (a finished request's parking)."""
        return any(r.scheduler.has_work for r in self.replicas)

    def step(self) -> list[tuple[str, int, bool]]:
        """One step of every replica with work. -> [(req_id, new token, finished)] for the tokens produced.
        Raises StepError when executing some replica's plan raised: that plan's requests are finished
        ("error") and the other replicas' tokens travel in the error; the engine can step again."""
        self._steps_begun += 1
        try:
            return self._step()
        finally:
            self._steps_ended += 1

    def _step(self) -> list[tuple[str, int, bool]]:
        out, t, counted, finished_all = [], None, False, []
        failures: dict[str, BaseException] = {}
        errors: list[BaseException] = []
        counts = [0, 0, 0]  # running, waiting, free blocks: after scheduling, summed over replicas
        prefill = 0  # tokens of the step's rows that are not decode rows, summed over replicas
        start, priced = self.clock.now(), []  # priced: the durations of simulated steps
        plans = [None] * len(self.replicas)
        for r, rep in enumerate(self.replicas):
            sch = rep.scheduler
            if sch.has_work:
                try:
                    plans[r] = sch.schedule()
                except Exception as e:  # noqa: BLE001 - the replica's requests fail; the engine goes on if it is whole
                    errors.append(e)
                    failed = self._fail_schedule(r, e)
                    failures.update((req.req_id, e) for req in failed)
                    self._publish_events(r)
                    finished_all += failed
                    continue
                counted |= sch.has_requests and not sch.idle_wait
                t = self.clock.now() if t is None else t
                for row in plans[r].rows:
                    req = sch.requests[row.req_id]
                    if req.scheduled_s is None:
                        req.scheduled_s = t
                    if row.num_tokens != 1 + row.num_draft_tokens:  # a prompt chunk (timeline's prefill tokens)
                        prefill += row.num_tokens
            for i, c in enumerate((len(sch.running), len(sch.waiting), sch.kv.num_free_blocks)):
                counts[i] += c
        if counted:
            self._count_ranks(plans)
        for r, (plan, result) in enumerate(zip(plans, self._execute(plans))):
            if plan is None:
                continue
            sch = self.replicas[r].scheduler
            self.plans_run[r] += 1  # a failed plan's transfers may have run in part; a later plan parks what it failed
            try:
                if isinstance(result, BaseException):
                    raise result
                if result.duration_s is not None:
                    priced.append(result.duration_s)
                    now = start + result.duration_s
                else:
                    now = self.clock.now()
                finished = sch.update(plan, result, now)
            except Exception as e:  # noqa: BLE001 - the plan's requests fail; the engine and its other requests go on
                errors.append(e)
                failed = self._fail_plan(r, plan, e)
                failures.update((req.req_id, e) for req in failed)
                self._publish_events(r)
                finished_all += failed
                continue
            self._publish_events(r)
            for req in finished:
                req.finished_in_plan = self.plans_run[r]  # its KV's parking runs in a later plan
                self.finished[req.req_id] = self.requests.pop(req.req_id)
            finished_all += finished
            done = {r.req_id for r in finished}
            out += [(rid, tok, rid in done and k == len(toks) - 1)
                    for rid, toks in sch.last_tokens.items() for k, tok in enumerate(toks)]
        if priced:
            advance = getattr(self.clock, "advance", None)
            if advance is None:
                raise TypeError(f"the runner priced its step ({max(priced)} s) but the engine's clock "
                                f"{type(self.clock).__name__} cannot advance: use glm53.engine.plan.VirtualClock")
            advance(max(priced))
        if counted:
            self._steps += 1
            self.timeline.append((t, *counts, self.clock.now(), prefill))
        self.last_finished = tuple(r.req_id for r in finished_all)
        self._forget_history()
        for obs in self.observers:
            obs.on_step(self, out, finished_all)
        if errors:
            raise StepError(errors[0], failures, out) from errors[0]
        return out

    def _forget_history(self) -> None:
        """Drop the oldest finished requests past max_finished (and their replica) and the oldest timeline
        rows past max_timeline (amortised: cut when twice as long)."""
        if self.max_finished is not None:
            while len(self.finished) > self.max_finished:
                rid = next(iter(self.finished))
                del self.finished[rid]
                self._owner.pop(rid, None)
        if self.max_timeline is not None and len(self.timeline) > 2 * self.max_timeline:
            del self.timeline[:-self.max_timeline]

    def _execute(self, plans: list) -> list:
        """Run each replica's plan (None: none) -> per replica its StepResult, the exception its execution
        raised, or None. Independent replicas run one after the other; DP x EP ranks, which share one
        runner, run as one step (`ModelRunner.execute_ranks`), so an exception there fails every rank's plan."""
        if self._lockstep:
            if not any(p is not None for p in plans):
                return plans
            try:
                return self.replicas[0].runner.execute_ranks(plans)
            except Exception as e:  # noqa: BLE001 - every rank's plan fails; the engine goes on
                return [None if p is None else e for p in plans]
        out = []
        for rep, plan in zip(self.replicas, plans):
            try:
                out.append(None if plan is None else rep.runner.execute(plan))
            except Exception as e:  # noqa: BLE001 - this plan's requests fail; the other replicas go on
                out.append(e)
        return out

    def _count_ranks(self, plans: list) -> None:
        """Per rank, the tokens its plan scheduled (`dp_rank_tokens`), and the ranks without rows in a step
        where some rank computed (`dp_idle_rank_steps`: under DP x EP each passes padding rows)."""
        rows = [0 if p is None else sum(row.num_tokens for row in p.rows) for p in plans]
        for r, n in enumerate(rows):
            self.dp_rank_tokens[r] += n
        if any(rows):
            self.dp_idle_rank_steps += sum(n == 0 for n in rows)
        if self.deploy.experts_across_ranks and not self._lockstep:  # injected ranks run one by one: the plans' first rounds
            self._all2all_estimate += first_round_all2all_bytes(plans, self.cfg, self.deploy, self._itemsize)

    def ep_all2all_bytes(self) -> int:
        """DP x EP (`DeployConfig.experts_across_ranks`): the bytes one device sent through the MoE
        all-to-alls over the run, as the ranks' one runner measured them (an injected runner that steps
        the ranks one by one: the plans' first rounds); 0 for any other layout."""
        if not self.deploy.experts_across_ranks:
            return 0
        return self.replicas[0].runner.all2all_bytes() if self._lockstep else self._all2all_estimate

    def _fail_plan(self, r: int, plan, error: BaseException) -> list[Request]:
        """Finish the requests of replica r's `plan`, whose execution raised `error`, with finish_reason
        "error" (Scheduler.abort: their device blocks go back to the pool; what earlier steps computed and
        cached stays, what this step wrote lies past their computed tokens and is never cached) -> them.

        A plan that carried KV transfers may have stopped inside them, with host or device pages half
        copied that a prefix lookup, a swap-in or a HiSparse read would take as whole: then every request
        of the replica fails and its prefix caches (device pool and host pools) forget every hash, so
        nothing the plan was filling is read again. Tier loads no runner will report (`_fail_tier_loads`)
        come back as failed. A request the failed update had already finished is beyond repair here: that
        raises, and the engine must not be stepped again."""
        sch, now, failed = self.replicas[r].scheduler, self.clock.now(), []
        rids = [row.req_id for row in plan.rows]
        if plan.transfers:
            rids += [req.req_id for req in sch.running] + [req.req_id for req in sch.waiting]
        for rid in dict.fromkeys(rids):
            if rid not in sch.requests:
                raise RuntimeError(f"step {plan.step} failed ({error!r}) after request {rid!r} had left its "
                                   "scheduler: the engine's state cannot be repaired") from error
            failed.append(self._failed(r, sch.abort(rid, now, reason="error"), error))
        if plan.transfers:
            self._reset_prefix_cache(r)
        self._fail_tier_loads(r)
        return failed

    def _fail_schedule(self, r: int, error: BaseException) -> list[Request]:
        """Replica r's `schedule` raised `error` part way through (a request's data it could not hash,
        say): decisions taken for some requests but not others, and no plan. Which partial decision is
        safe to keep cannot be told from here, so every request of the replica finishes "error"
        (`Scheduler.fail_all`) and its prefix caches forget every hash; transfers the policies recorded
        still run in the next plan, as for any finished request. The replica goes on only if it is whole
        again (`_check_whole`: every device block free, the pool consistent); otherwise this raises and
        the engine must not be stepped again. -> the failed requests."""
        sch = self.replicas[r].scheduler
        try:
            failed = [self._failed(r, req, error) for req in sch.fail_all(self.clock.now())]
            self._reset_prefix_cache(r)
            self._fail_tier_loads(r)
            self._check_whole(r)
        except Exception as e:
            raise RuntimeError(f"replica {r}'s schedule failed ({error!r}) and its state cannot be repaired: "
                               f"{e!r}") from error
        return failed

    def _failed(self, r: int, req: Request, error: BaseException) -> Request:
        """Record `req`, just finished "error" by replica r's failed step, as finished."""
        req.error = f"{type(error).__name__}: {error}"
        req.finished_in_plan = self.plans_run[r]
        self.finished[req.req_id] = self.requests.pop(req.req_id)
        return req

    def _fail_tier_loads(self, r: int) -> None:
        """After a failed step: the tier loads replica r's policy waits for that its runner will never
        report (the step stopped before submitting them, or lost their results) come back as failed
        through the policy's tier-results path, so their host pages are freed and the replica can go idle."""
        policy = self.replicas[r].scheduler.policy
        lost = policy.unreported_tier_loads()
        if lost:
            policy.on_tier_results(tuple((job, "failed") for job in lost))

    def _check_whole(self, r: int) -> None:
        """Replica r holds nothing for any request: no block tables, leases or kept hashes, every device
        block free, the pool's own invariants (raises AssertionError or RuntimeError otherwise)."""
        kv = self.replicas[r].scheduler.kv
        kv.check()
        held = {"block tables": list(kv.requests), "leases": list(kv.leases), "kept hashes": list(kv._kept_hashes)}
        if any(held.values()) or kv.num_free_blocks != kv.pool.num_blocks:
            raise RuntimeError(f"replica {r} still holds {held} and {kv.pool.num_blocks - kv.num_free_blocks} "
                               "device blocks with no request left")

    def generate(self, prompts: Sequence, max_new_tokens: int = 16, *, greedy: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, on_token: Callable[[str, int], None] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion (request i samples with seed + i); `on_token(req_id, token)` streams
        tokens as they come. -> outputs in prompt order, each with `.token_ids`. When the engine has no
        other requests it also finishes the KV transfers the last ones left (parking their KV). A request
        that ends with "error" without its step failing (its KV failed to load under
        kv_load_failure_policy "fail") raises RuntimeError with its error once the others are done."""
        ids = [self.add_request(p, SamplingParams(max_new_tokens, greedy, temperature, top_p, seed + i))
               for i, p in enumerate(prompts)]
        pending = set(ids)
        while pending:
            if not self.has_unfinished():
                raise RuntimeError("the engine stopped with requests unfinished")
            for rid, tok, fin in self.step():
                if on_token is not None and rid in pending:
                    on_token(rid, tok)
                if fin:
                    pending.discard(rid)
            pending.difference_update(self.last_finished)
        while not self.requests and self.has_unfinished():
            self.step()
        failed = {rid: self.finished[rid].error for rid in ids if self.finished[rid].finish_reason == "error"}
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed: {failed}")
        return [self.output(rid) for rid in ids]

    def output(self, req_id: str) -> RequestOutput:
        r = self.finished[req_id]
        return RequestOutput(r.req_id, r.prompt_ids, np.asarray(r.output_ids, np.int32), r.arrival_s, r.first_token_s,
                             r.finish_s, tuple(r.token_times_s), r.num_preemptions)

    # --------------------------------------------------------------------------------------- metrics
    def metrics(self, req_ids: Sequence[str] | None = None, window: tuple[float, float] | None = None) -> dict:
        """Serving metrics (glm53.engine.metrics.summarize) over finished requests (default: all), over
        the whole run or over `window` (t0, t1) on the engine clock (the latency and throughput figures
        and running_requests_mean; counters such as preemptions and bytes stay the whole run's)."""
        outs = [self.output(r) for r in (req_ids if req_ids is not None else self.finished)]
        duration = max(o.finish_s for o in outs) - min(o.arrival_s for o in outs)
        out = summarize(outs, duration_s=duration, num_devices=self.num_devices, scheduler_stats=self._stats(),
                        transfers=self._transfers(), steps=[(r[0], r[4], r[1]) for r in self.timeline],
                        window=window)
        out.update(self._policy_metrics())
        out.update(self._cp_metrics())
        out.update(self._spec_metrics())
        # most pool blocks in use at once (requests' pages, leases), the fullest replica's, beside its pool
        out["device_blocks_peak"] = max(r.scheduler.device_blocks_peak for r in self.replicas)
        out["num_gpu_blocks"] = self.replicas[0].scheduler.kv.pool.num_blocks
        # what holds the pool (Scheduler._count_blocks): per replica mean over steps with requests running,
        # summed over replicas; and the fullest replica's split at its peak
        out["device_blocks_by_use_mean"] = {k: sum(r.scheduler.blocks_by_use_sum[k] / max(1, r.scheduler.block_samples)
                                                   for r in self.replicas) for k in BLOCK_USES}
        fullest = max(self.replicas, key=lambda r: r.scheduler.device_blocks_peak).scheduler
        out["device_blocks_by_use_at_peak"] = dict(fullest.blocks_by_use_at_peak)
        if len(self.replicas) > 1:  # the ranks' balance: under DP x EP an idle rank still runs padding rows
            out["dp_rank_tokens"] = list(self.dp_rank_tokens)
            out["dp_idle_rank_steps"] = self.dp_idle_rank_steps
        if self.deploy.experts_across_ranks:
            out["ep_all2all_bytes"] = self.ep_all2all_bytes()
        weights = [getattr(r.runner, "weights_bytes_per_device", None) for r in self.replicas]
        if None not in weights:  # the model runner's (1/tp of the split weights under TP)
            out["weights_bytes_per_device"] = max(weights)
        if self.workspace_bytes:  # the pool was sized from device memory: what the step's peak took out of it
            out["workspace_bytes_per_device"] = self.workspace_bytes
        hosts = [getattr(getattr(r.runner, "host", None), "host_bytes_per_device", None) for r in self.replicas]
        if None not in hosts:  # host pools on the fullest device (1/tp of one pool: its TP ranks share it)
            out["host_pool_bytes_per_device"] = max(hosts)
        rows = self.timeline[:: max(1, -(-len(self.timeline) // 256))]  # at most 256 points
        out["timeline"] = {"t_s": [r[0] for r in rows], "running_requests": [r[1] for r in rows],
                           "waiting_requests": [r[2] for r in rows], "free_gpu_blocks": [r[3] for r in rows]}
        return out

    @property
    def running_per_step(self) -> list[int]:
        return [row[1] for row in self.timeline]

    def _stats(self) -> SchedulerStats:
        """The replicas' scheduler counters summed; `steps` counts engine steps."""
        stats = [r.scheduler.stats for r in self.replicas]
        total = SchedulerStats(**{f.name: sum(getattr(s, f.name) for s in stats)
                                  for f in dataclasses.fields(SchedulerStats)})
        return dataclasses.replace(total, steps=self._steps)

    def _transfers(self) -> TransferStats:
        trs = [r.scheduler.transfers for r in self.replicas]
        # every replica has its own host link: D links in parallel, so the modelled time is one link's
        return TransferStats(sum(t.d2h_bytes for t in trs), sum(t.h2d_bytes for t in trs),
                             sum(t.link_bytes_per_s for t in trs))

    def _counts(self) -> tuple[int, int, int]:
        counts = [(len(r.scheduler.running), len(r.scheduler.waiting), r.scheduler.kv.num_free_blocks)
                  for r in self.replicas]
        return tuple(sum(c[i] for c in counts) for i in range(3))

    def spec_stats(self) -> SpecDecodeStats:
        """MTP's counters (glm53.engine.spec_decode.SpecDecodeStats) summed over replicas."""
        total = SpecDecodeStats()
        for r in self.replicas:
            st = r.scheduler.spec
            total.num_drafts += st.num_drafts
            total.num_draft_tokens += st.num_draft_tokens
            total.num_accepted_tokens += st.num_accepted_tokens
            per = st.accepted_per_pos
            total.accepted_per_pos += [0] * (len(per) - len(total.accepted_per_pos))
            for i, n in enumerate(per):
                total.accepted_per_pos[i] += n
        return total

    def _spec_metrics(self) -> dict:
        """MTP speculative decoding (empty without it): steps that verified drafts (`spec_num_drafts`),
        their draft tokens, the drafts that stood (over all and per position), the acceptance rate per
        position (drafts that stood there / steps that verified drafts, vLLM's "per-position acceptance
        rate"; NaN before any) and the mean acceptance length 1 + accepted / drafts (vLLM's definitions;
        counted before stop tokens drop anything)."""
        if not self.deploy.num_speculative_tokens:
            return {}
        st = self.spec_stats()
        return {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                "spec_num_accepted_tokens": st.num_accepted_tokens,
                "spec_accepted_tokens_per_pos": list(st.accepted_per_pos),
                "spec_acceptance_rate_per_pos": [n / st.num_drafts if st.num_drafts else float("nan")
                                                 for n in st.accepted_per_pos],
                "spec_acceptance_length_mean": st.acceptance_length_mean}

    def _cp_metrics(self) -> dict:
        """Context parallelism's per-rank work: every replica's ranks side by side in the per-rank lists;
        a max/mean is the worst replica's (the balance inside a replica, not the load across replicas)."""
        parts = [cp_work_metrics(getattr(r.runner, "cp_work_per_rank", dict)()) for r in self.replicas]
        return {k: (sum((p[k] for p in parts), []) if k.endswith("_per_rank") else max(p[k] for p in parts))
                for k in parts[0]}

    def _policy_metrics(self) -> dict:
        """The policy's own figures (its `metrics`, summed over replicas: means of per-step counts add up
        too; a peak is the sum of the replicas' peaks, an upper bound; then its `finish_metrics`), and the
        offload tiers' counters (`kv_offload`, its `tier_metrics`: the offload host tier's, and the
        secondary tiers behind a policy's host pools; with the host pools' bytes in use now and at peak);
        empty for a policy without either."""
        parts = [r.scheduler.policy.metrics(r.scheduler) for r in self.replicas]
        out = {k: sum(p[k] for p in parts) for k in parts[0]}
        tiers = [r.scheduler.policy.tier_metrics() for r in self.replicas]
        if tiers[0]:
            out["kv_offload"] = {t: {k: sum(p[t][k] for p in tiers) for k in tiers[0][t]} for t in tiers[0]}
            out["host_pool_bytes_used"] = sum(r.scheduler.policy.host_bytes_used() for r in self.replicas)
            out["host_pool_bytes_peak"] = sum(r.scheduler.policy.host_bytes_peak for r in self.replicas)
        if out:
            self.deploy.policy.finish_metrics(out)
        return out


class StepError(RuntimeError):
    """Executing a step raised on some replica (`Engine.step`): its requests were finished with
    finish_reason "error" and the engine can step on. error: the (first) exception; failed: {req_id: the
    exception its plan raised} (empty when the plan only moved KV for finished requests); tokens: what
    the step produced on the other replicas, as `step` returns it."""

    def __init__(self, error: BaseException, failed: dict[str, BaseException], tokens: list[tuple[str, int, bool]]):
        super().__init__(f"a step failed ({len(failed)} request(s) finished with finish_reason 'error'): {error!r}")
        self.error, self.failed, self.tokens = error, failed, tokens


def _shutdown(tiers, recorders, publishers) -> None:
    """Stop the tiers (their pending stores written), publish the events of the stores that finished
    meanwhile, close the publishers."""
    for i, t in enumerate(tiers):
        if t is not None:
            t.shutdown(wait=True)
            if recorders[i] is not None:
                t.poll()  # the last store results (loads are nobody's business any more)
    for i, p in enumerate(publishers):
        rec = recorders[i] if i < len(recorders) else None
        if rec is not None and rec.events:
            p.publish(batch(rec.take(), i))
        p.close()
