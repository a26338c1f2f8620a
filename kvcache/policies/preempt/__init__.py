"""kv_policy="preempt": drop a victim's KV and recompute it when it runs again (vLLM's recompute
preemption). Every hook is kvcache.policies.base.Policy's plain one; the offload connector turns it into
"offload"."""

from __future__ import annotations

from kvcache.policies.base import Policy


class PreemptPolicy(Policy):
    """vLLM's recompute preemption (kvcache.policies.base.Policy as it is)."""

    accepts_connector = True
