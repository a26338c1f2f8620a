"""kv_policy="swap": a victim's KV goes to a host pool and all of it back before it runs again (the
project's first offload policy, kept for comparison with kvcache.policies.offload)."""

from __future__ import annotations

from kvcache.block_pool import KVCacheManager
from kvcache.policies.base import Policy, RequestView
from kvcache.transfer import LoadKV, SaveKV


class SwapPolicy(Policy):
    """kv_policy="swap": the victim's computed KV (every cache group, whole pages) goes to a host pool of
    `capacity_bytes` and all of it back before the request runs again (`SaveKV` / `LoadKV`). A victim
    that does not fit what is left of the host pool is preempted instead (its KV dropped). Nothing is
    kept after a request finishes (no prefix reuse from the host: that is kvcache.policies.offload). page_bytes:
    per cache group, the bytes of one page (kvcache.layout.page_bytes)."""

    def __init__(self, capacity_bytes: int, page_bytes: dict[str, int]):
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"the swap policy needs a host pool of > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.page_bytes = dict(page_bytes)
        self.used_bytes = 0
        self.saved: dict[str, tuple[int, int]] = {}  # req_id -> (tokens, bytes) held on the host

    @staticmethod
    def _tables(kv: KVCacheManager, req: RequestView, tokens: int) -> dict[str, tuple[int, ...]]:
        return {g: tuple(kv.block_table(req.req_id, g)[: kv.blocks_needed(tokens, g)]) for g in kv.groups}

    @classmethod
    def device_half(cls, deploy, sizes, *, index_topk: int):
        from kvcache.policies.device import SavedCopies

        return SavedCopies({"mla": deploy.max_blocks_per_seq, "indexer": deploy.max_index_blocks_per_seq})

    @classmethod
    def check(cls, deploy) -> None:
        if deploy.cpu_offload_bytes <= 0:
            raise ValueError(f"DeployConfig.kv_policy={deploy.kv_policy!r} needs cpu_offload_bytes > 0 (the host pool size)")

    @classmethod
    def make(cls, deploy, sizes, tiers=None, fingerprint: str = "") -> SwapPolicy:
        return cls(deploy.cpu_offload_bytes, sizes.page_bytes)


    def evict(self, kv: KVCacheManager, victim: RequestView) -> bool:
        tables = self._tables(kv, victim, victim.num_computed_tokens)
        nbytes = sum(len(t) * self.page_bytes[g] for g, t in tables.items())
        if nbytes == 0 or self.used_bytes + nbytes > self.capacity_bytes:
            return False
        self.outbox.append(SaveKV(victim.req_id, tables))
        self.saved[victim.req_id] = (victim.num_computed_tokens, nbytes)
        self.used_bytes += nbytes
        return True

    def saved_tokens(self, req: RequestView) -> int:
        return self.saved[req.req_id][0] if req.req_id in self.saved else 0

    def drop(self, kv: KVCacheManager, req: RequestView) -> None:
        self.used_bytes -= self.saved.pop(req.req_id, (0, 0))[1]  # its host copy is never loaded

    def restore(self, kv: KVCacheManager, req: RequestView) -> None:
        tokens, nbytes = self.saved.pop(req.req_id)
        self.outbox.append(LoadKV(req.req_id, self._tables(kv, req, tokens)))
        self.used_bytes -= nbytes
