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


@contextlib.contextmanager
def gpu_lowering(device_kind: str = H200, num_cores: int = common.H200_SMS):
    """Trace the Pallas kernels for a GPU of `device_kind` (no interpret mode) under an abstract mesh
    that names that device, so the Triton lowering can read its compute capability."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("aot",), abstract_device=device)
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
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call" and \
                            ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL:
                        calls.append(child)
                    walk(child)

    walk(module.operation)
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
