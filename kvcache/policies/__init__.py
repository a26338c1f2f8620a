"""KV policies, one folder each, and the registry the engine reaches them through.

    REGISTRY["hisparse"]           # the policy class (planner and spec: kvcache.policies.base.Policy)
    register_policy("mine", Mine)  # kv_policy="mine" is then a valid DeployConfig and runs in the engine

Each built-in policy is a package: preempt/, swap/, offload/, hisparse/ (kvcache.policies.base has the
protocol and the neutral defaults a new policy starts from).
"""

from __future__ import annotations

from kvcache.policies.base import KVPolicy, Policy, RequestView, RowTables
from kvcache.policies.preempt import PreemptPolicy
from kvcache.policies.offload import OffloadPolicy
from kvcache.policies.swap import SwapPolicy
from kvcache.policies.hisparse import HiSparsePolicy

REGISTRY: dict[str, type[Policy]] = {}


def register_policy(name: str, cls: type[Policy]) -> type[Policy]:
    """Make `cls` (a kvcache.policies.base.Policy subclass) the policy of kv_policy=`name`; -> cls.
    Registering a name again replaces its class."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_policy: the name must be a non-empty str, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_policy({name!r}, {cls!r}): the class must subclass kvcache.policies.base.Policy")
    REGISTRY[name] = cls
    return cls


def policy_spec(name: str) -> type[Policy]:
    """The registered class of kv_policy=`name` (ValueError naming the registered ones otherwise)."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"DeployConfig.kv_policy must be one of {tuple(REGISTRY)}, got {name!r}") from None


# the order is DeployConfig's historical KV_POLICIES order
for _name, _cls in (("preempt", PreemptPolicy), ("offload", OffloadPolicy), ("swap", SwapPolicy),
                    ("hisparse", HiSparsePolicy)):
    register_policy(_name, _cls)
del _name, _cls

__all__ = ["REGISTRY", "HiSparsePolicy", "KVPolicy", "OffloadPolicy", "Policy", "PreemptPolicy", "RequestView",
           "RowTables", "SwapPolicy", "policy_spec", "register_policy"]
