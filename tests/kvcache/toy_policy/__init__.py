"""A toy KV policy, the example of docs/architecture.md's "Adding a KV policy": kv_policy="evict_oldest".

When a running request needs device blocks and nothing else frees any, the scheduler evicts a request;
vLLM (and kvcache.policies.preempt) evicts the newest, this policy the one admitted first among those the
scheduler may still evict this step. The victim's KV is dropped and recomputed (the base's `evict`), so
greedy tokens are those of any other policy. It counts what it did (`evictions`, `victims`) and reports
the count as an engine metric and a Prometheus series."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_pool import KVCacheManager
from kvcache.policies.base import Policy, RequestView


class EvictOldest(Policy):
    """Evict the earliest-admitted candidate (first admission attempt: a re-admitted request keeps its age)."""

    prometheus_series = (("evictions", "counter", "glm53:evict_oldest_evictions", "Requests evicted, oldest first."),)

    def __init__(self):
        super().__init__()
        self.age: dict[str, int] = {}  # req_id -> order of its first admission attempt (live requests only)
        self.victims: list[str] = []  # every victim, in eviction order
        self._admitted = 0

    def admit(self, kv: KVCacheManager, req: RequestView) -> int:
        if req.req_id not in self.age:
            self.age[req.req_id] = self._admitted
            self._admitted += 1
        return super().admit(kv, req)

    def choose_victim(self, candidates: Sequence[RequestView]) -> RequestView:
        return min(candidates, key=lambda r: self.age[r.req_id])

    def evict(self, kv: KVCacheManager, victim: RequestView) -> bool:
        self.victims.append(victim.req_id)
        return super().evict(kv, victim)  # False: its KV is recomputed

    def on_finish(self, kv: KVCacheManager, req: RequestView) -> None:
        self.age.pop(req.req_id, None)

    def drop(self, kv: KVCacheManager, req: RequestView) -> None:
        self.age.pop(req.req_id, None)

    @property
    def evictions(self) -> int:
        return len(self.victims)

    def metrics(self, sch) -> dict:
        return {"evictions": self.evictions}

    def prometheus_values(self, sch, engine) -> dict[str, float]:
        return {"evictions": self.evictions}
