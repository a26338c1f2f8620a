"""Device meshes for the parallel schemes, and multi-process (multi-host) start-up.

Every mesh has the three named axes `AXES = ("dp", "tp", "cp")`:
- "dp": data parallelism (independent replicas, each with its own requests);
- "tp": tensor parallelism (heads / weight columns split);
- "cp": the context axis. Attention uses it for prefill context parallelism (PCP: queries split by
  token, `parallel.pcp`) and decode context parallelism (DCP: the KV cache split by token round-robin,
  `parallel.dcp`); the MoE uses the same devices as its expert axis (`parallel.ep`). vLLM's
  "PCP8 x DCP8 x EP8" is therefore `make_mesh(cp=8)`: 8 devices, not 512.

The expert axis is not a separate mesh axis: `ep_axes(mesh, ep)` names the mesh axes whose product is the
expert-parallel size (e.g. ("cp",) or ("dp", "cp")), and `parallel.ep` takes those names. Axes of size 1
cost nothing, so code can always name all three.

Devices are laid out with "cp" innermost and ordered by (process, device id), so a context group stays
inside one host when the mesh spans several (16 devices as 2 hosts x 8: `make_mesh(dp=2, cp=8)`).

Meshes are built with `AxisType.Auto` axes: `jax.make_mesh` defaults to Explicit axes in JAX 0.11, under
which `shard_map` rejects inputs that are not already on the mesh's sharding.

Multi-process: `init_distributed()` starts JAX's multi-controller runtime (`jax.distributed.initialize`).
On CPU it selects the gloo cross-process collectives (without them a computation spanning processes fails
to compile) and sets the number of local CPU devices; the coordinator address, process count and process
id come from arguments or from the environment variables that `parallel.launch` sets.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("dp", "tp", "cp")
MESH_SIZES = (1, 2, 4, 8, 16)  # device counts the project targets (any product of the axes is accepted)

# Environment variables read by `init_distributed` (written by `parallel.launch`).
ENV_COORDINATOR = "PARALLEL_COORDINATOR"
ENV_NUM_PROCESSES = "PARALLEL_NUM_PROCESSES"
ENV_PROCESS_ID = "PARALLEL_PROCESS_ID"
ENV_LOCAL_DEVICES = "PARALLEL_LOCAL_DEVICES"


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; `size` = dp * tp * cp devices."""

    dp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in AXES:
            _positive_int(f"MeshShape.{name}", getattr(self, name))

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.cp

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.cp)


def make_mesh(dp: int = 1, tp: int = 1, cp: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ("dp", "tp", "cp") of the given sizes (all `AxisType.Auto`).

    Uses the first dp * tp * cp of `devices` (default: all devices, ordered by process then id, so "cp"
    groups are contiguous within a process). Raises ValueError if there are too few devices.
    """
    shape = MeshShape(dp, tp, cp)
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    if len(devices) < shape.size:
        raise ValueError(
            f"a mesh dp={dp} x tp={tp} x cp={cp} needs {shape.size} devices, but only {len(devices)} are "
            "available (on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N or "
            "jax.config.update('jax_num_cpu_devices', N) before JAX initialises)")
    grid = np.array(devices[: shape.size], dtype=object).reshape(shape.sizes)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh: Mesh, axes: str | Sequence[str]) -> int:
    """Product of the sizes of the named mesh axes (a collective over `axes` spans this many devices)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in mesh.shape:
            raise ValueError(f"axis {a!r} is not in the mesh (axes {tuple(mesh.shape)})")
    return math.prod(mesh.shape[a] for a in names)


def ep_axes(mesh: Mesh, ep: int) -> tuple[str, ...]:
    """The mesh axes the MoE experts are split over for expert-parallel size `ep`.

    The expert group is the innermost axes whose sizes multiply to `ep`: cp alone (PCP8 x DCP8 x EP8:
    ep = cp), then tp x cp, then dp x tp x cp. Axes of size 1 are dropped. ep = 1 gives ().
    """
    ep = _positive_int("ep (expert-parallel size)", ep)
    if ep == 1:
        return ()
    for start in (2, 1, 0):  # ("cp",), ("tp", "cp"), ("dp", "tp", "cp")
        axes = AXES[start:]
        if axis_size(mesh, axes) == ep:
            return tuple(a for a in axes if mesh.shape[a] > 1)
    raise ValueError(
        f"ep={ep} is not the size of an innermost group of mesh axes {dict(mesh.shape)}: allowed values are "
        f"{sorted({axis_size(mesh, AXES[s:]) for s in (2, 1, 0)})}")


def shard_bytes(tree, specs, axis_sizes: dict[str, int]) -> list[int]:
    """Bytes one device holds of each leaf of `tree` (arrays or jax.ShapeDtypeStructs) laid out by the
    PartitionSpecs `specs` (a matching tree) on a mesh of `axis_sizes` ({axis name: size}). The mesh is
    abstract (jax.sharding.AbstractMesh): no devices are needed, so full-size layouts can be sized on a
    laptop. A dimension split over axes of total size n holds dim / n on each device (JAX's shard_shape)."""
    mesh = jax.sharding.AbstractMesh(tuple(axis_sizes.values()), tuple(axis_sizes))
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    if len(leaves) != len(spec_leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(spec_leaves)} PartitionSpecs")
    return [math.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
            for x, spec in zip(leaves, spec_leaves)]


def bytes_per_device(tree, specs, axis_sizes: dict[str, int]) -> int:
    """Total of `shard_bytes`: what one device of the mesh holds of `tree`."""
    return sum(shard_bytes(tree, specs, axis_sizes))


def describe(mesh: Mesh) -> str:
    """E.g. 'dp1 x tp1 x cp8 (8 devices, 1 process)'."""
    procs = len({d.process_index for d in mesh.devices.flat})
    axes = " x ".join(f"{a}{mesh.shape[a]}" for a in mesh.axis_names)
    return f"{axes} ({mesh.devices.size} devices, {procs} process{'es' if procs > 1 else ''})"


def set_cpu_device_count(n: int) -> None:
    """Simulate `n` CPU devices in this process. Must run before JAX initialises its backend."""
    n = _positive_int("CPU device count", n)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backend already exists: the count is fixed for this process
        if jax.device_count() != n:
            raise RuntimeError(f"cannot set {n} CPU devices: JAX already initialised with {jax.device_count()} "
                               "(set the count before any array is created, or run in a fresh process)") from e


def init_distributed(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                     *, local_cpu_devices: int | None = None, timeout_s: int = 120) -> None:
    """Join a multi-process JAX run (`jax.distributed.initialize`); call before any JAX computation.

    Arguments default to the PARALLEL_* environment variables set by `parallel.launch`. With
    `local_cpu_devices` (or PARALLEL_LOCAL_DEVICES) each process simulates that many CPU devices and
    cross-process CPU collectives go through gloo (loopback works; a dead peer is detected by the
    heartbeat after about `timeout_s`, but callers should still run under the launcher's timeouts).
    """
    env = os.environ
    coordinator = coordinator or env.get(ENV_COORDINATOR)
    if not coordinator:
        raise ValueError(f"coordinator address missing: pass coordinator='host:port' or set {ENV_COORDINATOR}")
    num_processes = _positive_int("num_processes", num_processes if num_processes is not None
                                  else int(env.get(ENV_NUM_PROCESSES, "0")))
    process_id = process_id if process_id is not None else int(env.get(ENV_PROCESS_ID, "-1"))
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if local_cpu_devices is None and env.get(ENV_LOCAL_DEVICES):
        local_cpu_devices = int(env[ENV_LOCAL_DEVICES])
    if local_cpu_devices is not None:
        set_cpu_device_count(local_cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=max(10, timeout_s // 4),
                               shutdown_timeout_seconds=max(10, timeout_s // 4))
