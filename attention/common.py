"""Shared pieces of the attention references."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp


def masked_softmax_weights(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row-wise softmax over the last axis restricted to `mask`, with its natural-log LSE.

    scores [..., S] float32, mask [..., S] bool -> (p [..., S] f32, lse [...] f32). A row with no valid
    entry gets p = 0 and lse = -inf (weight 0 in an LSE merge), never NaN.
    """
    s = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, jnp.log(jnp.maximum(denom[..., 0], 1e-30)) + m[..., 0], -jnp.inf)
    return p, lse


def _ordered_int32(x_f32):
    """float32 -> int32 with the same order as `lax.top_k`'s comparison of the floats (IEEE total order:
    -inf < ... < -0.0 < +0.0 < ... < +inf). An involution: applied to the result it gives the bits back."""
    b = jax.lax.bitcast_convert_type(x_f32, jnp.int32)
    return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


# Widest row that `top_k` selects from on int32 keys. XLA:CPU's top-k of float32 rows has a fast
# selection kernel whose cost grows slowly with the row; int32 keys go through a sort that compares
# faster but grows with the whole row, so they win only on short rows (timings: docs/model.md).
INT32_TOPK_MAX_WIDTH = 1024


def top_k(x_f32, k: int):
    """`jax.lax.top_k` over the last axis of a float32 array -> (values, indices int32), identical results
    (order, ties to the lowest index, +0.0 above -0.0). On XLA:CPU, rows of at most INT32_TOPK_MAX_WIDTH
    values run on order-preserving int32 keys, which XLA:CPU selects from faster than floats there
    (docs/model.md); the indexer takes a top-k per query token of every full layer."""
    if (x_f32.dtype != jnp.float32 or x_f32.shape[-1] > INT32_TOPK_MAX_WIDTH or gpu_shaped()
            or jax.default_backend() != "cpu"):
        return jax.lax.top_k(x_f32, k)
    keys, idx = jax.lax.top_k(_ordered_int32(x_f32), k)
    return jax.lax.bitcast_convert_type(_ordered_int32(keys), jnp.float32), idx


def kernel_compute_dtype(storage_dtype, fp8: bool, compute_dtype=None):
    """The operand dtype of a Pallas kernel's matmuls for a cache stored as `storage_dtype` (or fp8).

    Default: the storage dtype for plain float caches, bfloat16 for fp8 ones (e4m3 values are exact in
    bfloat16). Why: at GLM-5.3's 64 heads a selected 656-byte row feeds ~140K FLOPs, so on an H200 the
    matmul rate decides the step time and 16-bit tensor-core operands run far faster than IEEE fp32
    (rates in docs/kernels.md), while a float32 cache is a request for float32 accuracy. Pass float32 to
    get the reference's numerics from any format; that is how the tests check a kernel's logic exactly."""
    dt = jnp.dtype(compute_dtype or (jnp.bfloat16 if fp8 else storage_dtype))
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {dt}")
    return dt


# A tensor-core `tl.dot` with 16-bit operands needs a contraction of at least this many values. Pallas'
# Triton lowering does not check it (Triton's own frontend does): with fewer, the operand layout wraps
# around the contraction and every product is summed more than once (K=8: exactly twice). Measured on an
# H200 (docs/kernels.md); interpret mode cannot see it.
MIN_DOT_K = 16


def kernel_dot(a, b, contract: tuple[int, int], compute_dtype):
    """2-D `dot_general` of a and b over axes `contract` = (a's, b's), operands cast to `compute_dtype`,
    float32 accumulation. float32 operands run at Precision.HIGHEST: Pallas' Triton lowering otherwise
    emits TF32 (inputPrecision = tf32), ~1e-3 relative error, not the reference's float32. A contraction
    shorter than `MIN_DOT_K` (e.g. the 8-word planes of a 32-dim fp8 key) runs on float32 operands
    whatever `compute_dtype` says: 16-bit tensor-core dots that short are wrong on the GPU, IEEE float32
    ones (no tensor cores) are not."""
    if jnp.dtype(compute_dtype).itemsize < 4 and a.shape[contract[0]] < MIN_DOT_K:
        compute_dtype = jnp.float32
    prec = jax.lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
    return jax.lax.dot_general(a.astype(compute_dtype), b.astype(compute_dtype), (((contract[0],), (contract[1],)), ((), ())),
                               precision=prec, preferred_element_type=jnp.float32)


H200_SMS = 132  # streaming multiprocessors of the GPU the kernels are tuned and lowered for

IMPLS = ("auto", "reference", "pallas")

# "auto" picks the Pallas kernels on a GPU only once they have been run and checked there
# (experiments/device_check.sh; the run that set it: docs/kernels.md). While False, "auto" runs the references everywhere, so a GPU user
# never gets unverified kernels by default; impl="pallas" runs them anyway. (They are also lowered and
# compiled for sm_90 without a GPU: experiments/check_gpu_lowering.py.)
PALLAS_VERIFIED_ON_GPU = True

# Kernels verified on the H200 but measured slower there than the GPU-shaped reference of the same op,
# which "auto" therefore keeps (the measurements: docs/kernels.md). impl="pallas" still runs them.
SLOWER_THAN_REFERENCE_ON_GPU = frozenset({"hisparse_resolve"})

# Kernels lowered and compiled for sm_90 and checked in interpret mode, but not yet run on a GPU: "auto"
# keeps their reference until a device_check.sh run passes their tests there (then the name leaves this
# set, with the run cited in docs/kernels.md). impl="pallas" runs them anyway.
NOT_YET_CHECKED_ON_GPU = frozenset({"fp8_gemm"})


def resolve_impl(impl: str, kernel: str | None = None) -> str:
    """Which implementation of an op to run: "reference" or "pallas". "auto": the Pallas kernel where
    code is shaped for a GPU (`gpu_shaped`) and the kernels are verified there, unless `kernel` (the
    op's kernel name) is one measured slower than its reference (`SLOWER_THAN_REFERENCE_ON_GPU`) or
    not yet run on a GPU (`NOT_YET_CHECKED_ON_GPU`); else the reference."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        fast = kernel not in SLOWER_THAN_REFERENCE_ON_GPU and kernel not in NOT_YET_CHECKED_ON_GPU
        return "pallas" if PALLAS_VERIFIED_ON_GPU and fast and gpu_shaped() else "reference"
    return impl


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# Set only inside attention.gpu_aot.gpu_lowering(): trace the kernels for a GPU lowering on a machine
# without one (ahead-of-time lowering; nothing runs). A context variable, so it never leaks into other
# threads' tracing.
_LOWER_FOR_GPU = contextvars.ContextVar("lower_for_gpu", default=False)

# Set only by `shaped_for`: which backend's code shapes to trace, overriding the backend (tests run the
# GPU-shaped references on CPU with it; None = follow the backend).
_SHAPE_FOR = contextvars.ContextVar("shape_for", default=None)


def gpu_shaped() -> bool:
    """Whether ops and model forms trace the code shaped for a GPU: batched gathers and vectorised tiles
    (one gather of every query's rows, `vmap` over tiles) instead of XLA:CPU's tuned sequential loops
    (`lax.map` over query blocks of 4 and request rows), the dense MHA form only while window <= top-k,
    and, through `resolve_impl("auto")`, the Pallas kernels once verified. True on a GPU backend, while
    `attention.gpu_aot.gpu_lowering` traces for one, or inside `shaped_for("gpu")`. The one place that
    decides it; both shapes compute the same values (tests/attention/test_gpu_shaped.py).

    Decided at trace time: a jitted function traced under one shape keeps it for its cached program, so
    switch shapes (`shaped_for`) around fresh functions or clear JAX's caches."""
    forced = _SHAPE_FOR.get()
    if forced is not None:
        return forced == "gpu"
    return on_gpu() or _LOWER_FOR_GPU.get()


@contextlib.contextmanager
def shaped_for(backend: str):
    """Trace the code shaped for `backend` ("gpu" or "cpu") whatever the real backend is. Only the
    shapes change: Pallas kernels still run in interpret mode off a GPU (`pallas_interpret`)."""
    if backend not in ("gpu", "cpu"):
        raise ValueError(f"backend must be 'gpu' or 'cpu', got {backend!r}")
    token = _SHAPE_FOR.set(backend)
    try:
        yield
    finally:
        _SHAPE_FOR.reset(token)


def pallas_interpret() -> bool:
    """Pallas kernels run in interpret mode everywhere but on a GPU (semantics only, see JAX notes),
    or while `attention.gpu_aot` lowers them for one."""
    return not (on_gpu() or _LOWER_FOR_GPU.get())


def pad_to(x, axis: int, size: int, value=0):
    """Pad `x` along `axis` up to `size` with `value` (no-op when already that long)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): bucket and padding sizes."""
    return 1 << max(n - 1, 0).bit_length()


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap (block sizes must be powers of two for Triton)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def slot_mapping(block_table_BM, pos, block_size: int):
    """Request-relative positions [B, ...] -> global slots [B, ...] int32 of a paged cache:
    block_table[b, p // block_size] * block_size + p % block_size; -1 where p < 0, past the block table,
    or on an unallocated (-1) page."""
    m = block_table_BM.shape[1]
    page_idx = pos // block_size
    inside = (pos >= 0) & (page_idx < m)
    flat = jnp.where(inside, page_idx, 0).reshape(pos.shape[0], -1)
    page = jnp.take_along_axis(block_table_BM, flat, axis=1).reshape(pos.shape)
    return jnp.where(inside & (page >= 0), page * block_size + pos % block_size, -1).astype(jnp.int32)
