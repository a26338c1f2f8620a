"""The cost algebra: `Cost` (one kernel, collective or copy on one GPU), sums, the roofline of a kernel
and of a collective, the collectives and host copies, and `StepCost` (one step's Costs in order)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from glm53.perfmodel.hardware import HardwareSpec

DCP_GATHER = "dcp_prefill_gather"  # name of the per-layer context all-gather of a PCP x DCP prefill
# How a step's Costs share time (`StepCost.time_s`). "none" is vLLM's schedule: its DCP collectives (the
# PCP x DCP prefill gather, the decode query gather and LSE merge, the indexer's top-k merge) are blocking
# calls on the compute stream between the kernels that produce and consume their data (docs/perfmodel.md,
# "The DCP gather as vLLM schedules it"). "dcp_prefetch" is the other bound, an ablation no vLLM path runs.
OVERLAPS = ("none", "dcp_prefetch")


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs, bytes and time of one kernel, collective or copy on one GPU (or a sum of them).

    flops / useful_flops: FLOPs executed / FLOPs excluding padding. hbm_bytes: HBM bytes read + written.
    nvlink_bytes: bytes this GPU receives over NVLink. host_bytes: bytes over the host link (one way).
    compute_s, memory_s, link_s, latency_s: the roofline terms (seconds). time_s: seconds this Cost takes
    (for one kernel max(compute, memory, link) + latency; for a sum of Costs, the sum of their times).
    kind: "kernel" | "collective" | "copy" | "sum". layer: the decoder layer it belongs to (-1: none).
    """

    name: str
    kind: str = "kernel"
    layer: int = -1
    flops: float = 0.0
    useful_flops: float = 0.0
    hbm_bytes: float = 0.0
    nvlink_bytes: float = 0.0
    host_bytes: float = 0.0
    compute_s: float = 0.0
    memory_s: float = 0.0
    link_s: float = 0.0
    latency_s: float = 0.0
    time_s: float = 0.0

    @property
    def bound(self) -> str:
        """Which roofline term dominates: "compute" | "memory" | "link" | "latency"."""
        terms = {"compute": self.compute_s, "memory": self.memory_s, "link": self.link_s, "latency": self.latency_s}
        return max(terms, key=terms.get)

    @property
    def intensity(self) -> float:
        """Executed FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf

    def at_layer(self, layer: int) -> Cost:
        return dataclasses.replace(self, layer=layer)

    def scaled(self, factor: float, name: str | None = None, layer: int | None = None) -> Cost:
        """The same work done `factor` times (every count and time multiplied), optionally renamed and
        re-tagged with `layer`."""
        # the constructor directly (dataclasses.replace costs twice as much; a simulator scales every part
        # of every step)
        return Cost(self.name if name is None else name, self.kind, self.layer if layer is None else layer,
                    self.flops * factor, self.useful_flops * factor,
                    self.hbm_bytes * factor, self.nvlink_bytes * factor, self.host_bytes * factor,
                    self.compute_s * factor, self.memory_s * factor, self.link_s * factor, self.latency_s * factor,
                    self.time_s * factor)


_ADDITIVE = ("flops", "useful_flops", "hbm_bytes", "nvlink_bytes", "host_bytes", "compute_s", "memory_s", "link_s",
             "latency_s", "time_s")


def total(costs: Iterable[Cost], name: str = "total") -> Cost:
    """Sum of Costs run one after another (every field adds, time included)."""
    sums = dict.fromkeys(_ADDITIVE, 0.0)
    for c in costs:
        for f in _ADDITIVE:
            sums[f] += getattr(c, f)
    return Cost(name=name, kind="sum", **sums)


def _kernel(name: str, hw: HardwareSpec, *, flops: float, hbm_bytes: float, dtype: str = "bf16",
            efficiency: float | None = None, useful_flops: float | None = None, extra_compute_s: float = 0.0) -> Cost:
    eff = hw.matmul_efficiency if efficiency is None else efficiency
    compute_s = flops / (hw.peak_flops(dtype) * eff) + extra_compute_s
    memory_s = hbm_bytes / (hw.hbm_bandwidth * hw.hbm_efficiency)
    return Cost(name=name, kind="kernel", flops=flops, useful_flops=flops if useful_flops is None else useful_flops,
                hbm_bytes=hbm_bytes, compute_s=compute_s, memory_s=memory_s, time_s=max(compute_s, memory_s))


def _gemm(name: str, hw: HardwareSpec, *, flops: float, hbm_bytes: float, dtype: str = "bf16") -> Cost:
    """One GEMM kernel: the roofline at hw's GEMM efficiencies plus its fixed time (hw.gemm_latency_s)."""
    ce, me = hw.gemm_eff()
    compute_s = flops / (hw.peak_flops(dtype) * ce)
    memory_s = hbm_bytes / (hw.hbm_bandwidth * me)
    lat = hw.gemm_latency_s
    return Cost(name=name, kind="kernel", flops=flops, useful_flops=flops, hbm_bytes=hbm_bytes, compute_s=compute_s,
                memory_s=memory_s, latency_s=lat, time_s=max(compute_s, memory_s) + lat)


def _grouped_gemm(name: str, hw: HardwareSpec, *, flops: float, hbm_bytes: float, dtype: str = "bf16") -> Cost:
    """One grouped GEMM kernel (the routed experts): max(C, M) + exposed x min(C, M) + fixed time, with C and M
    at hw's grouped-GEMM efficiencies (`HardwareSpec.moe_gemm`; the dense `_gemm` where the spec has none)."""
    ce, me, lat, exposed = hw.moe_gemm()
    compute_s = flops / (hw.peak_flops(dtype) * ce)
    memory_s = hbm_bytes / (hw.hbm_bandwidth * me)
    return Cost(name=name, kind="kernel", flops=flops, useful_flops=flops, hbm_bytes=hbm_bytes, compute_s=compute_s,
                memory_s=memory_s, latency_s=lat,
                time_s=max(compute_s, memory_s) + exposed * min(compute_s, memory_s) + lat)


def _collective(name: str, hw: HardwareSpec, *, recv_bytes: float, hbm_bytes: float, n: int,
                op: str = "all_gather") -> Cost:
    if n <= 1 or recv_bytes <= 0:
        return Cost(name=name, kind="collective")
    link_s = recv_bytes / (hw.nvlink_bandwidth * hw.link_eff(op))
    memory_s = hbm_bytes / (hw.hbm_bandwidth * hw.hbm_efficiency)
    lat = hw.collective_latency_s
    return Cost(name=name, kind="collective", hbm_bytes=hbm_bytes, nvlink_bytes=recv_bytes, link_s=link_s,
                memory_s=memory_s, latency_s=lat, time_s=max(link_s, memory_s) + lat)


# ------------------------------------------------------------------------------------------ collectives
def all_gather(hw: HardwareSpec, bytes_per_rank: float, n: int, name: str = "all_gather") -> Cost:
    """Each of n ranks contributes `bytes_per_rank`; every rank ends with all n parts.
    Per GPU: receives (n-1) * bytes_per_rank over NVLink; HBM writes what it receives, reads its own part."""
    recv = (n - 1) * bytes_per_rank
    return _collective(name, hw, recv_bytes=recv, hbm_bytes=recv + bytes_per_rank, n=n)


def reduce_scatter(hw: HardwareSpec, total_bytes: float, n: int, name: str = "reduce_scatter") -> Cost:
    """Sum n buffers of `total_bytes` and leave 1/n of the sum on each rank.
    Per GPU: receives (n-1)/n * total_bytes of partial sums; HBM reads its buffer and the partials."""
    recv = (n - 1) / n * total_bytes
    return _collective(name, hw, recv_bytes=recv, hbm_bytes=total_bytes + recv, n=n)


def all_reduce(hw: HardwareSpec, total_bytes: float, n: int, name: str = "all_reduce") -> Cost:
    """Ring all-reduce (reduce-scatter + all-gather): receives 2 (n-1)/n * total_bytes per GPU."""
    recv = 2 * (n - 1) / n * total_bytes
    return _collective(name, hw, recv_bytes=recv, hbm_bytes=total_bytes + recv, n=n, op="all_reduce")


def all_to_all(hw: HardwareSpec, send_bytes: float, n: int, name: str = "all_to_all") -> Cost:
    """Each rank sends `send_bytes` in total to the other ranks and receives as many (balanced)."""
    return _collective(name, hw, recv_bytes=send_bytes, hbm_bytes=2 * send_bytes, n=n, op="all_to_all")


def collective(hw: HardwareSpec, kind: str, sent_bytes: float, n: int, name: str | None = None) -> Cost:
    """A collective given the bytes each rank sends (`glm53.perfmodel.traffic`'s formulas; kind:
    "all_gather" | "reduce_scatter" | "all_to_all" | "psum"): received = sent (balanced); HBM as in the
    functions above, from the operand size that sends that many bytes."""
    if kind not in ("all_gather", "reduce_scatter", "psum", "all_to_all"):
        raise ValueError(f"collective kind must be all_gather, reduce_scatter, psum or all_to_all, got {kind!r}")
    name = name or kind
    if n <= 1 or sent_bytes <= 0:
        return Cost(name=name, kind="collective")
    operand = {"all_gather": sent_bytes / (n - 1), "reduce_scatter": sent_bytes * n / (n - 1),
               "psum": sent_bytes * n / (2 * (n - 1)), "all_to_all": sent_bytes}[kind]
    op = {"psum": "all_reduce", "all_to_all": "all_to_all"}.get(kind, kind)
    return _collective(name, hw, recv_bytes=sent_bytes, hbm_bytes=sent_bytes + operand, n=n, op=op)


def host_copy(hw: HardwareSpec, nbytes: float, *, transfers: int = 1, name: str = "host_copy") -> Cost:
    """A host <-> device copy of `nbytes` over the pinned host link (one direction), in `transfers` calls.
    HBM sees the same bytes (far below its bandwidth). time = latency * transfers + max(link, HBM)."""
    if nbytes <= 0:
        return Cost(name=name, kind="copy")
    link_s = nbytes / (hw.host_link_bandwidth * hw.host_link_efficiency)
    memory_s = nbytes / (hw.hbm_bandwidth * hw.hbm_efficiency)
    lat = transfers * hw.host_copy_latency_s
    return Cost(name=name, kind="copy", hbm_bytes=nbytes, host_bytes=nbytes, link_s=link_s, memory_s=memory_s,
                latency_s=lat, time_s=max(link_s, memory_s) + lat)



@dataclasses.dataclass(frozen=True)
class StepCost:
    """All Costs of one engine step on one GPU, in execution order, each tagged with its layer; or, with
    per_layer=False, one Cost per op and layer kind covering every layer of that kind (`Cost.scaled`;
    layer -1): the same sums, cheaper to build, but no layer order for the overlap options."""

    parts: tuple[Cost, ...]
    per_layer: bool = True

    def total(self) -> Cost:
        return total(self.parts, "step")

    def by_name(self) -> dict[str, Cost]:
        """Costs summed by name (e.g. all layers' "sparse_mla")."""
        names = dict.fromkeys(c.name for c in self.parts)
        return {n: total((c for c in self.parts if c.name == n), n) for n in names}

    def time_s(self, overlap: str = "none") -> float:
        """Step time in seconds under an overlap assumption (`OVERLAPS`):
        "none": every Cost runs after the previous one (sum of times); what vLLM does, and the default.
        "dcp_prefetch": layer l's DCP context all-gather runs during layer l-1's kernels, so only
        max(0, gather_l - kernels_{l-1}) of it shows (the first layer's gather is fully exposed): a lower
        bound for any one-layer-ahead prefetch, kept as an ablation."""
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
        if overlap == "none":
            return sum(c.time_s for c in self.parts)
        if not self.per_layer:
            raise ValueError(f"overlap={overlap!r} needs a StepCost with per-layer parts (per_layer=True)")
        kernels: dict[int, float] = {}
        gathers: dict[int, float] = {}
        rest = 0.0
        for c in self.parts:
            if c.name == DCP_GATHER:
                gathers[c.layer] = gathers.get(c.layer, 0.0) + c.time_s
            else:
                rest += c.time_s
                if c.kind == "kernel":
                    kernels[c.layer] = kernels.get(c.layer, 0.0) + c.time_s
        return rest + sum(max(0.0, g - kernels.get(layer - 1, 0.0)) for layer, g in gathers.items())

