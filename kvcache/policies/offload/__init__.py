"""kv_policy="offload": the host tier of tiered offloading, a CPU prefix cache (planner.py)."""

from kvcache.policies.offload.planner import LOAD_FAILURE_POLICIES, OffloadPolicy, OffloadStats, TierCounts, host_tier_blocks

__all__ = ["LOAD_FAILURE_POLICIES", "OffloadPolicy", "OffloadStats", "TierCounts", "host_tier_blocks"]
