"""The engine: requests in, tokens out. Scheduler (what runs) + runner (how it runs) + clock."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from glm53.engine.config import DeployConfig
from glm53.engine.metrics import cp_work_metrics, summarize
from glm53.engine.request import Request, RequestOutput, SamplingParams
from glm53.engine.runner import Clock, ModelRunner, Runner, WallClock, default_num_blocks
from glm53.engine.scheduler import OffloadPolicy, Scheduler, SchedulerStats
from glm53.model import GLM53, as_token_array
from kvcache.hisparse import HiSparsePolicy

GROUPS = ("mla", "indexer")


class ServingMetrics:
    """What every engine front end shares (Engine, and the data-parallel one over its replicas):
    `generate`, `metrics` and `live_metrics`, over a few hooks: `output`, `finished`, `timeline`,
    `deploy`, `_stats` (scheduler counters), `_transfers` (device<->host bytes), `_counts` (running,
    waiting, free blocks now), `_policy_metrics` and `_cp_metrics` (per-rank work under context parallelism)."""

    @property
    def num_devices(self) -> int:
        d = self.deploy
        return d.data_parallel_size * d.context_parallel_size

    def metrics(self, req_ids: Sequence[str] | None = None) -> dict:
        """Serving metrics (glm53.engine.metrics.summarize) over finished requests (default: all)."""
        outs = [self.output(r) for r in (req_ids if req_ids is not None else self.finished)]
        duration = max(o.finish_s for o in outs) - min(o.arrival_s for o in outs)
        out = summarize(outs, duration_s=duration, num_devices=self.num_devices, scheduler_stats=self._stats(),
                        transfers=self._transfers(), running_per_step=self.running_per_step)
        out.update(self._policy_metrics())
        out.update(self._cp_metrics())
        rows = self.timeline[:: max(1, -(-len(self.timeline) // 256))]  # at most 256 points
        out["timeline"] = {"t_s": [r[0] for r in rows], "running_requests": [r[1] for r in rows],
                           "waiting_requests": [r[2] for r in rows], "free_gpu_blocks": [r[3] for r in rows]}
        return out

    @property
    def running_per_step(self) -> list[int]:
        return [row[1] for row in self.timeline]

    def live_metrics(self) -> dict:
        """Counters of the run so far (for a live Prometheus endpoint; units in the key names)."""
        st = self._stats()
        running, waiting, free = self._counts()
        out = {"running_requests": running, "waiting_requests": waiting,
               "finished_requests": len(self.finished), "free_gpu_blocks": free,
               "steps": st.steps, "preemptions": st.preemptions, "recomputed_tokens": st.recomputed_tokens,
               "prefix_hit_rate": st.prefix_hit_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
               "output_tokens": sum(len(r.output_ids) for r in self.finished.values())}
        tr = self._transfers()
        if tr is not None:
            out.update(d2h_bytes=tr.d2h_bytes, h2d_bytes=tr.h2d_bytes)
        out.update(self._policy_metrics())
        return out

    def generate(self, prompts: Sequence, max_new_tokens: int = 16, *, greedy: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, on_token: Callable[[str, int], None] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion (request i samples with seed + i); `on_token(req_id, token)` streams
        tokens as they come. -> outputs in prompt order, each with `.token_ids`."""
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
        return [self.output(rid) for rid in ids]


class Engine(ServingMetrics):
    """Serve `model` under `deploy`. `add_request` queues a prompt; each `step` schedules and runs one
    batch and returns the tokens it produced; `generate` runs prompts to completion.

    runner / clock: injectable (a simulator passes its own); by default the model runs on the paged
    cache of `devices` (default: the first max(PCP, DCP) devices JAX sees) and time is wall time.
    With deploy.data_parallel_size > 1, `Engine(...)` builds a `glm53.engine.dp.DataParallelEngine`
    (independent replicas on disjoint device groups, the same API).
    """

    def __new__(cls, model=None, deploy: DeployConfig | None = None, **kwargs):
        if cls is Engine and deploy is not None and deploy.data_parallel_size > 1:
            from glm53.engine.dp import DataParallelEngine

            if kwargs.get("runner") is not None:
                raise ValueError("a data-parallel engine builds one runner per replica: runner= is for "
                                 "data_parallel_size=1")
            kwargs.pop("runner", None)
            return DataParallelEngine(model, deploy, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: GLM53, deploy: DeployConfig | None = None, *, runner: Runner | None = None,
                 clock: Clock | None = None, devices=None):
        self.model = model
        self.deploy = deploy or DeployConfig()
        if self.deploy.data_parallel_size > 1:
            raise ValueError("one Engine is one replica: data_parallel_size > 1 builds a DataParallelEngine")
        num_blocks = self.deploy.num_gpu_blocks or default_num_blocks(self.deploy, GROUPS)
        self.runner = runner or ModelRunner(model, self.deploy, num_blocks, devices)
        policy = None
        if self.deploy.kv_policy == "offload":
            policy = OffloadPolicy(self.runner, self.deploy.cpu_offload_bytes,
                                   {g: self.runner.page_bytes(g) for g in GROUPS})
        elif self.deploy.kv_policy == "hisparse":
            r = self.runner
            policy = HiSparsePolicy(r, host_mla_blocks=r.host_blocks["mla"], host_index_blocks=r.host_blocks["indexer"],
                                    block_size=self.deploy.block_size, hot_rows=r.hot_rows,
                                    max_leases=r.max_rows, num_device_blocks=num_blocks,
                                    enable_prefix_caching=self.deploy.enable_prefix_caching,
                                    page_bytes={g: r.page_bytes(g) for g in GROUPS})
        self.scheduler = Scheduler(self.deploy, num_blocks, GROUPS, policy=policy)
        self.clock = clock or WallClock()
        self.requests: dict[str, Request] = {}
        # one row per step, after its scheduling: (clock s, running, waiting, free device blocks)
        self.timeline: list[tuple[float, int, int, int]] = []
        self.finished: dict[str, Request] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_ids, params: SamplingParams | None = None, *, req_id: str | None = None,
                    salt: str = "") -> str:
        """Queue a prompt. Rejects (ValueError) a prompt whose tokens plus max_new_tokens exceed
        max_model_len, rather than truncating it."""
        params = params or SamplingParams()
        ids = as_token_array(prompt_ids)
        cfg = self.model.cfg
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
        total = ids.size + params.max_new_tokens
        if total > self.deploy.max_model_len:
            raise ValueError(f"prompt of {ids.size} tokens + max_new_tokens={params.max_new_tokens} = {total} exceeds "
                             f"max_model_len={self.deploy.max_model_len}")
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self.requests or req_id in self.finished:
            raise ValueError(f"request id {req_id!r} is already in use")
        req = Request(req_id, ids, params, salt=salt, arrival_s=self.clock.now())
        self.scheduler.add(req)
        self.requests[req_id] = req
        return req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[tuple[str, int, bool]]:
        """One scheduling step. -> [(req_id, new token, finished)] for the tokens produced."""
        chunks = self.scheduler.schedule()
        sch = self.scheduler
        self.timeline.append((self.clock.now(), len(sch.running), len(sch.waiting), sch.kv.num_free_blocks))
        tables = sch.policy.block_tables(sch, chunks)
        sampled = self.runner.execute(chunks, tables)
        finished = self.scheduler.update(chunks, sampled, self.clock.now())
        for req in finished:
            self.finished[req.req_id] = self.requests.pop(req.req_id)
        done = {r.req_id for r in finished}
        return [(rid, tok, rid in done) for rid, tok in sampled.items()]

    def output(self, req_id: str) -> RequestOutput:
        r = self.finished[req_id]
        return RequestOutput(r.req_id, r.prompt_ids, np.asarray(r.output_ids, np.int32), r.arrival_s, r.first_token_s,
                             r.finish_s, tuple(r.token_times_s), r.num_preemptions)

    @property
    def replicas(self) -> list[Engine]:
        """The engines that hold requests: [self] (a data-parallel engine has one per replica)."""
        return [self]

    def _stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def _transfers(self):
        return getattr(self.runner, "transfers", None)

    def _counts(self) -> tuple[int, int, int]:
        sch = self.scheduler
        return len(sch.running), len(sch.waiting), sch.kv.num_free_blocks

    def _cp_metrics(self) -> dict:
        return cp_work_metrics(self.runner.cp_work_per_rank() if isinstance(self.runner, ModelRunner) else {})

    def _policy_metrics(self) -> dict:
        """HiSparse figures (empty for other policies): hot-buffer hits and misses (summed over IndexShare
        groups), rows copied host->device by decode steps (all layers), host pool bytes in use now and at
        peak, mean requests per step in each residency state, and the page counters."""
        pol = self.scheduler.policy
        if not isinstance(pol, HiSparsePolicy):
            return {}
        rs, st = self.runner.resolve_stats, pol.stats
        steps = max(1, self.scheduler.stats.steps)
        looked_up = rs.hot_hits + rs.hot_misses
        out = {"hot_hits": rs.hot_hits, "hot_misses": rs.hot_misses,
               "hot_hit_rate": rs.hot_hits / looked_up if looked_up else float("nan"), "hisparse_h2d_rows": rs.h2d_rows,
               "host_pool_bytes_used": pol.host_bytes_used(), "host_pool_bytes_peak": pol.host_bytes_peak}
        out.update({f"residency_{k}_requests_mean": v / steps for k, v in st.residency_steps.items()})
        out.update({k: v for k, v in dataclasses.asdict(st).items() if k != "residency_steps"})
        return out

