"""Data parallelism: `data_parallel_size` independent engine replicas behind one front end (vLLM's DP).

Replica i is an ordinary `Engine` (its own scheduler, block pool, host pools and runner) on devices
[i * N, (i + 1) * N) of the process's devices (N = max(PCP, DCP) = the replica's context axis), with its
own copy of the weights. Replicas share nothing, so a request's tokens do not depend on which replica
serves it.

Routing happens at admission: a request with a salt (a user or session key; `experiments.workloads`
salts every turn of a user's sessions) goes to the replica that served that salt before, so later turns
find their prefix in that replica's cache; a new salt, or none, goes to the replica with the fewest
unfinished requests (ties: the lowest index). A step steps every replica that has work; on one host they
run one after the other (on real hardware each replica runs on its own GPUs).

Metrics (`metrics`, `live_metrics`) cover all replicas: scheduler counters and transfer bytes are summed,
throughput is divided by data_parallel_size x N devices, and the timeline has one row per front-end step
with the replicas' running / waiting requests and free blocks summed.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax

from glm53.engine.config import DeployConfig
from glm53.engine.engine import Engine, ServingMetrics
from glm53.engine.request import RequestOutput, SamplingParams
from glm53.engine.runner import Clock, TransferStats, WallClock
from glm53.engine.scheduler import SchedulerStats
from glm53.model import GLM53


class DataParallelEngine(ServingMetrics):
    """`Engine`'s API over `deploy.data_parallel_size` replicas (see the module docstring)."""

    def __init__(self, model: GLM53, deploy: DeployConfig, *, clock: Clock | None = None, devices=None):
        self.model = model
        self.deploy = deploy
        d, n = deploy.data_parallel_size, deploy.context_parallel_size
        devices = sorted(jax.devices(), key=lambda x: (x.process_index, x.id)) if devices is None else list(devices)
        if len(devices) < d * n:
            raise ValueError(f"data_parallel_size={d} x {n} devices per replica needs {d * n} devices, but only "
                             f"{len(devices)} are available (on CPU, simulate more with "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={d * n})")
        self.clock = clock or WallClock()
        one = dataclasses.replace(deploy, data_parallel_size=1)
        self._replicas = [Engine(model, one, clock=self.clock, devices=devices[i * n:(i + 1) * n]) for i in range(d)]
        self._owner: dict[str, int] = {}  # request id -> replica index
        self._by_salt: dict[str, int] = {}  # salt -> replica that served it last
        self.timeline: list[tuple[float, int, int, int]] = []
        self._steps = 0
        self._ids = itertools.count()

    @property
    def replicas(self) -> list[Engine]:
        return list(self._replicas)

    def route(self, salt: str) -> int:
        """The replica a new request with `salt` goes to."""
        if salt and salt in self._by_salt:
            return self._by_salt[salt]
        load = [len(r.requests) for r in self._replicas]
        return load.index(min(load))

    def add_request(self, prompt_ids, params: SamplingParams | None = None, *, req_id: str | None = None,
                    salt: str = "") -> str:
        """Queue a prompt on the replica `route(salt)` picks (checks as `Engine.add_request`)."""
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self._owner:
            raise ValueError(f"request id {req_id!r} is already in use")
        i = self.route(salt)
        self._replicas[i].add_request(prompt_ids, params, req_id=req_id, salt=salt)
        self._owner[req_id] = i
        if salt:
            self._by_salt[salt] = i
        return req_id

    def replica_of(self, req_id: str) -> int:
        return self._owner[req_id]

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self._replicas)

    def step(self) -> list[tuple[str, int, bool]]:
        """One step of every replica with work -> [(req_id, new token, finished)] of all of them."""
        out, running, waiting = [], 0, 0
        for r in self._replicas:
            if r.has_unfinished():
                out += r.step()
                running, waiting = running + r.timeline[-1][1], waiting + r.timeline[-1][2]
        self._steps += 1
        self.timeline.append((self.clock.now(), running, waiting, self._counts()[2]))
        return out

    @property
    def finished(self) -> dict:
        return {rid: req for r in self._replicas for rid, req in r.finished.items()}

    @property
    def requests(self) -> dict:
        return {rid: req for r in self._replicas for rid, req in r.requests.items()}

    def output(self, req_id: str) -> RequestOutput:
        return self._replicas[self._owner[req_id]].output(req_id)

    # ------------------------------------------------------------------------- metrics hooks (summed)
    def _stats(self) -> SchedulerStats:
        stats = [r._stats() for r in self._replicas]
        total = SchedulerStats(**{f.name: sum(getattr(s, f.name) for s in stats)
                                  for f in dataclasses.fields(SchedulerStats)})
        return dataclasses.replace(total, steps=self._steps)

    def _transfers(self):
        trs = [r._transfers() for r in self._replicas]
        if any(t is None for t in trs):
            return None
        # every replica has its own host link: D links in parallel, so the modelled time is one link's
        return TransferStats(sum(t.d2h_bytes for t in trs), sum(t.h2d_bytes for t in trs),
                             sum(t.link_bytes_per_s for t in trs))

    def _counts(self) -> tuple[int, int, int]:
        counts = [r._counts() for r in self._replicas]
        return tuple(sum(c[i] for c in counts) for i in range(3))

    def _cp_metrics(self) -> dict:
        """Every replica's ranks side by side in the per-rank lists; a max/mean is the worst replica's
        (the balance of context parallelism inside a replica, not the load across replicas)."""
        parts = [r._cp_metrics() for r in self._replicas]
        return {k: (sum((p[k] for p in parts), []) if k.endswith("_per_rank") else max(p[k] for p in parts))
                for k in parts[0]}

    def _policy_metrics(self) -> dict:
        """The replicas' policy figures summed (means of per-step counts add up too; a peak is the sum of
        the replicas' peaks, an upper bound); the hot-buffer hit rate is recomputed from the sums."""
        parts = [r._policy_metrics() for r in self._replicas]
        out = {k: sum(p[k] for p in parts) for k in parts[0]}
        if "hot_hit_rate" in out:
            looked_up = out["hot_hits"] + out["hot_misses"]
            out["hot_hit_rate"] = out["hot_hits"] / looked_up if looked_up else float("nan")
        return out
