"""Bytes the parallel schemes communicate: measured from a traced program, and predicted by formulas.

Accounting unit: bytes one rank *sends* per call (equal to what it receives), for the standard
algorithms over an axis of N ranks with per-rank operand size s bytes:
- all-gather: (N - 1) s (it forwards its s to every other rank);
- reduce-scatter: (N - 1) / N * s (it sends all but its own 1/N of the operand);
- all-to-all: (N - 1) / N * s (it keeps its own 1/N);
- all-reduce (psum): 2 (N - 1) / N * s (ring: reduce-scatter + all-gather).

`collective_bytes(fn, *args)` traces `fn` (no compilation) and sums these over every collective in the
jaxpr, including inside `shard_map`, `jit` and control flow (a collective inside a loop counts once per
appearance, not per iteration). The formulas below describe the layer-level drivers of `parallel.layers`
(DCP decode, PCP and PCP x DCP prefill) exactly at their float32 test shapes (tests/parallel/test_comm.py
checks that) and predict GLM-5.3's traffic when given its dimensions and storage formats (bf16 queries
and outputs, fp32 LSE, 656 B fp8_ds_mla rows, 132 B fp8 indexer keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import numpy as np

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


def _walk(jaxpr, axis_sizes, found: list):
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
                factor = {"all_gather": n - 1, "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
                          "psum": 2 * (n - 1) / n}[kind]
                found.append(Collective(kind, s, n, factor * s))
        for sub in _sub_jaxprs(eqn.params):
            _walk(sub, axis_sizes, found)


def trace_collectives(fn: Callable, *args, axis_sizes: Mapping[str, int], **kwargs) -> list[Collective]:
    """Every collective `fn(*args, **kwargs)` would run, from its jaxpr (nothing is compiled or run)."""
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    found: list[Collective] = []
    _walk(closed.jaxpr, dict(axis_sizes), found)
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


# --------------------------------------------------------------------------------------------- formulas
def padded_heads(heads: int, n: int) -> int:
    return -(-heads // n) * n


def dcp_decode_bytes(backend: str, *, n: int, tokens: int, heads: int, kv_lora: int, rope: int, q_bytes: float = 2,
                     out_bytes: float = 2, lse_bytes: float = 4) -> dict[str, float]:
    """Bytes one rank sends per decode layer for `tokens` query tokens (batch x query length) under DCP N.

    Both backends all-gather the query (each rank holds H/N heads of q_lat [R] and q_pe [P]). "ag_rs" then
    all-gathers the LSEs [H] and reduce-scatters the scaled outputs [H, R] by head; "a2a" sends one packed
    [H, R + 1] buffer (outputs + LSE; the LSE is sized `lse_bytes`). Heads are padded to a multiple of N.
    Independent of the context length: DCP moves queries and results, never KV.
    """
    hp = padded_heads(heads, n)
    q = (n - 1) * tokens * (hp // n) * (kv_lora + rope) * q_bytes
    if backend == "ag_rs":
        lse = (n - 1) * tokens * hp * lse_bytes
        rs = (n - 1) / n * tokens * hp * kv_lora * out_bytes
        return {"query_all_gather": q, "lse_all_gather": lse, "output_reduce_scatter": rs, "total": q + lse + rs,
                "collectives": 3}
    if backend == "a2a":
        a2a = (n - 1) / n * tokens * hp * (kv_lora * out_bytes + lse_bytes)
        return {"query_all_gather": q, "output_all_to_all": a2a, "total": q + a2a, "collectives": 2}
    raise ValueError(f"backend must be 'ag_rs' or 'a2a', got {backend!r}")


def dcp_topk_merge_bytes(*, n: int, tokens: int, local_k: int, score_bytes: float = 4, pos_bytes: float = 4) -> float:
    """Bytes one rank sends to merge the sparse top-k: all-gather of `local_k` (score, position) candidates
    per query token (local_k = min(top-k, the rank's local positions))."""
    return (n - 1) * tokens * local_k * (score_bytes + pos_bytes)


def pcp_prefill_bytes(*, n: int, new_tokens: int, row_bytes: float, key_bytes: float = 0,
                      pos_bytes: float = 4) -> float:
    """Bytes one rank sends per layer to all-gather the new tokens' cache rows (and indexer keys) under
    PCP N, each write with the tokens' positions (int32; `parallel.cp_cache.CpKVCache.write_packed`);
    new_tokens is the padded prompt length (a multiple of 2N)."""
    groups = 2 if key_bytes else 1
    return (n - 1) * (new_tokens // n) * (row_bytes + key_bytes + groups * pos_bytes)


def dcp_full_copy_bytes(*, n: int, local_slots: int, row_bytes: float, key_bytes: float = 0) -> float:
    """Bytes one rank sends per layer to build the temporary full-context copy in PCP x DCP prefill: an
    all-gather of its share of the request (local_slots = the request's blocks x block size, about context / N)."""
    return (n - 1) * local_slots * (row_bytes + key_bytes)
