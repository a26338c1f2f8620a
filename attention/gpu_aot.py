"""Ahead-of-time GPU lowering of the Pallas kernels, on a machine without a GPU.

Interpret mode (how the kernel tests run on CPU) proves semantics only: it accepts block shapes, ops
and dtypes that the GPU lowering rejects (JAX notes). `lower_triton(fn, *args)` runs the real GPU
lowering instead: it traces `fn` for the "cuda" platform under an abstract mesh whose device is an
H200 (`jax.sharding.AbstractDevice`), so Pallas' Triton lowering (the default GPU backend of jax
0.11.2's `pallas_call`) turns every kernel into a Triton-dialect (TTIR) module exactly as it would on
the GPU. Each kernel comes back as a `TritonKernel`: the TTIR text, the launch grid, and the warps and
pipeline stages XLA would compile it with.

`experiments/check_gpu_lowering.py` then compiles that TTIR to a cubin for sm_90 with the pip `triton`
package and its bundled ptxas, and reads registers, spills and shared memory.

What this does not prove: that the kernels compute the right thing on a GPU (nothing runs), and that
the Triton inside XLA's GPU compiler (which compiles the TTIR on a real GPU) accepts it exactly as the
pip `triton` does. It does prove that the Pallas -> TTIR lowering succeeds at the given shapes, which
is where illegal block shapes and unsupported ops fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax

import attention.common as common

H200 = "NVIDIA H200"
TRITON_CALL = "__gpu$xla.gpu.triton"
_DOT_SHAPE = re.compile(r"tt\.dot [^:]*: tensor<(\d+)x(\d+)x(\w+)> \* tensor<(\d+)x(\d+)x\w+> -> ")
_DOT = re.compile(r"tt\.dot [^:]*?(?:inputPrecision = (\w+))?\s*: tensor<[\dx]*x(\w+)> \* tensor<[\dx]*x(\w+)> -> "
                  r"tensor<[\dx]*x(\w+)>")


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One pallas_call as the GPU would receive it."""

    name: str
    ttir: str  # the Triton-dialect module, MLIR text
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int

    def dots(self) -> list[str]:
        """Every `tt.dot` of the kernel as "A x B -> C", plus " tf32" / " tf32x3" for float32 operands
        that Triton may round (inputPrecision; absent = ieee). Triton ignores the attribute for 16-bit
        operands, so it is not shown for them."""
        out = []
        for m in _DOT.finditer(self.ttir):
            prec, a, b, c = m.group(1) or "ieee", m.group(2), m.group(3), m.group(4)
            out.append(f"{a} x {b} -> {c}" + (f" {prec}" if a == "f32" else ""))
        return out

    def dot_shapes(self) -> list[tuple[int, int, int, str]]:
        """(M, K, N, operand dtype) of every `tt.dot` [M, K] x [K, N], e.g. (16, 32, 64, "bf16"): what
        `attention.common.MIN_DOT_K` is checked against."""
        return [(int(m.group(1)), int(m.group(2)), int(m.group(5)), m.group(3)) for m in _DOT_SHAPE.finditer(self.ttir)]


def abstract_mesh(axis_sizes=(1,), axis_names=("aot",), device_kind: str = H200,
                  num_cores: int = common.H200_SMS) -> jax.sharding.AbstractMesh:
    """A mesh of `axis_sizes` GPUs of `device_kind` that exist only as a description (Auto axes, as
    `parallel.mesh.make_mesh` builds them): enough to trace and lower a sharded program for them."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    types = (jax.sharding.AxisType.Auto,) * len(axis_sizes)
    return jax.sharding.AbstractMesh(tuple(axis_sizes), tuple(axis_names), axis_types=types, abstract_device=device)


@contextlib.contextmanager
def gpu_lowering(device_kind: str = H200, num_cores: int = common.H200_SMS, mesh=None):
    """Trace for a GPU of `device_kind`: the Pallas kernels without interpret mode, the ops and forms
    shaped for a GPU (`attention.common.gpu_shaped`), under an abstract mesh that names that device, so
    the Triton lowering can read its compute capability. `mesh`: that abstract mesh (`abstract_mesh`;
    default one device), e.g. the 8-GPU mesh a sharded step is lowered for."""
    mesh = abstract_mesh(device_kind=device_kind, num_cores=num_cores) if mesh is None else mesh
    token = common._LOWER_FOR_GPU.set(True)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        common._LOWER_FOR_GPU.reset(token)


def lower_triton(fn, *args, device_kind: str = H200) -> list[TritonKernel]:
    """Lower `fn(*args)` for a CUDA GPU of `device_kind` and return its Pallas kernels in program order.

    `args` may be arrays or `jax.ShapeDtypeStruct`s (nothing is computed). Raises whatever the Triton
    lowering raises for an illegal kernel (a non-power-of-two block, an unsupported op or dtype)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    with gpu_lowering(device_kind):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")
    calls = [op for op in _custom_calls(module) if ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL]
    kernels = []
    with module.context:
        tt_dialect.register_dialect(module.context)
        for call in calls:
            cfg = call.attributes["mhlo.backend_config"]
            ttir = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)  # TTIR as MLIR bytecode

            def num(key):
                return ir.IntegerAttr(cfg[key]).value

            kernels.append(TritonKernel(name=ir.StringAttr(cfg["name"]).value, ttir=str(ttir),
                                        grid=(num("grid_x"), num("grid_y"), num("grid_z")),
                                        num_warps=num("num_warps"), num_stages=num("num_stages")))
    return kernels


def _custom_calls(module) -> list:
    """Every stablehlo.custom_call operation of an MLIR module, in program order (nested regions too)."""
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        calls.append(child)
                    walk(child)

    walk(module.operation)
    return calls


def custom_calls(lowered) -> list[tuple[str, str | None]]:
    """(call target, kernel name) of every custom call of a lowered program (`jax.jit(f).trace(...).lower(
    ...)`), in program order; the name is the Pallas kernel's for Triton calls (its `name=`), else None.
    Custom calls are what XLA does not generate itself: the Pallas kernels, and sharding / host-offload
    annotations that the compiler removes."""
    from jax._src.lib.mlir import ir

    out = []
    for op in _custom_calls(lowered.compiler_ir("stablehlo")):
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        name = None
        if target == TRITON_CALL:
            name = ir.StringAttr(op.attributes["mhlo.backend_config"]["name"]).value
        out.append((target, name))
    return out
