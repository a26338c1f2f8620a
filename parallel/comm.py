"""Bytes the parallel schemes communicate: measured from a traced program, and predicted by formulas.

The accounting (bytes one rank *sends* per call) and the formulas live in `glm53.perfmodel.traffic`,
the one source the performance model prices too; they are re-exported here beside the tracer that
checks them.

`collective_bytes(fn, *args)` traces `fn` (no compilation) and sums the sent bytes over every collective
in the jaxpr, including inside `shard_map`, `jit` and control flow (a collective inside a loop counts
once per appearance, not per iteration; of a `lax.cond` / `lax.switch` only the branch that sends the
most counts, marked `conditional` unless every branch communicates: the most a step can send);
tests/parallel/test_comm.py checks each formula against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import numpy as np

from glm53.perfmodel.traffic import (dcp_decode_bytes, dcp_full_copy_bytes, dcp_topk_merge_bytes, padded_heads,
                                     pcp_prefill_bytes, sent_bytes)

__all__ = ["Collective", "trace_collectives", "jaxpr_collectives", "collective_bytes",  # the tracer, and the formulas it checks:
           "dcp_decode_bytes", "dcp_full_copy_bytes", "dcp_topk_merge_bytes", "padded_heads", "pcp_prefill_bytes"]

_GATHER = ("all_gather", "all_gather_invariant")
_SCATTER = ("reduce_scatter",)
_A2A = ("all_to_all",)
_REDUCE = ("psum", "psum_invariant")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # "all_gather" | "reduce_scatter" | "all_to_all" | "psum"
    operand_bytes: int  # per rank
    ranks: int
    sent_bytes: float  # per rank, by the accounting above
    conditional: bool = False  # in a `lax.cond` branch that a step may skip (another branch sends nothing)


def _axis_ranks(axis_name, axis_sizes: Mapping[str, int]) -> int:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return int(np.prod([axis_sizes[a] for a in names]))


def _sub_jaxprs(params):
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(item, "eqns"):  # a Jaxpr
                yield item
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                yield item.jaxpr


def _walk(jaxpr, axis_sizes, found: list, conditional: bool = False):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        kind = ("all_gather" if name in _GATHER else "reduce_scatter" if name in _SCATTER
                else "all_to_all" if name in _A2A else "psum" if name in _REDUCE else None)
        if kind is not None:
            axis = eqn.params.get("axis_name", eqn.params.get("axes"))
            n = _axis_ranks(axis, axis_sizes)
            for var in eqn.invars:
                aval = var.aval
                s = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
                found.append(Collective(kind, s, n, sent_bytes(kind, s, n), conditional))
        if name == "cond":
            # one branch runs: the largest stands for the step (the others are alternatives, not added),
            # conditional unless every branch communicates
            branches = []
            for sub in _sub_jaxprs(eqn.params):
                branches.append([])
                _walk(sub, axis_sizes, branches[-1], conditional)
            largest = max(branches, key=lambda got: sum(c.sent_bytes for c in got), default=[])
            found.extend(largest if all(branches) else (dataclasses.replace(c, conditional=True) for c in largest))
            continue
        for sub in _sub_jaxprs(eqn.params):
            _walk(sub, axis_sizes, found, conditional)


def trace_collectives(fn: Callable, *args, axis_sizes: Mapping[str, int], **kwargs) -> list[Collective]:
    """Every collective `fn(*args, **kwargs)` would run, from its jaxpr (nothing is compiled or run)."""
    return jaxpr_collectives(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args), axis_sizes=axis_sizes)


def jaxpr_collectives(closed_jaxpr, *, axis_sizes: Mapping[str, int]) -> list[Collective]:
    """Every collective of an already traced program (`jax.jit(f).trace(...).jaxpr`, or make_jaxpr's)."""
    found: list[Collective] = []
    _walk(closed_jaxpr.jaxpr, dict(axis_sizes), found)
    return found


def collective_bytes(fn: Callable, *args, axis_sizes: Mapping[str, int], **kwargs) -> dict[str, float]:
    """{kind: bytes sent per rank} summed over the collectives of `fn`, plus "total" and "count"."""
    found = trace_collectives(fn, *args, axis_sizes=axis_sizes, **kwargs)
    out = {k: 0.0 for k in ("all_gather", "reduce_scatter", "all_to_all", "psum")}
    for c in found:
        out[c.kind] += c.sent_bytes
    out["total"] = sum(c.sent_bytes for c in found)
    out["count"] = len(found)
    return out
