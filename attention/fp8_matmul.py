"""Block-quantised fp8 matmul (DeepSeek-V3 / GLM-5.3 checkpoint weights): y = x @ W with W in float8_e4m3fn.

Weights (`BlockFp8`): W [..., K, N] ~= q * s, q float8_e4m3fn, one float32 scale s per 128 x 128 block
of the last two axes (scale [..., ceil(K/128), ceil(N/128)]; ragged edge blocks are simply smaller). The
scale is the checkpoint's `weight_scale_inv` (a dequantisation factor despite the name), transposed with
the weight into our [in, out] layout.

Activations are quantised as the reference kernels do (DeepSeek-V3's `act_quant`, vLLM's
`per_token_group_quant_fp8`): per token, per group of 128 values along the contraction axis K,
scale = max(amax, 1e-4) / 448, q = clip(x / scale, +-448) cast to e4m3fn (`formats.quantize_fp8`, the
KV cache's numerics). So the product is

    y[m, n] = sum_g  xs[m, g] * ws[g, n // 128] * sum_{k in group g} xq[m, k] * wq[k, n]

with every inner product of e4m3 values accumulated in float32 (a product of two e4m3 values is exact in
float32). Results are float32 [..., N]; callers cast to their activation dtype.

Three implementations compute it (`impl`):
- "reference": the formula above as written, one fp8 x fp8 dot per K group with float32 accumulation,
  scaled per (token group, weight block) and summed in float32 (`lax.scan` over the groups). This is
  the specification, exact about the block structure (each group's dot has fp8 operands, which XLA may
  hand to fp8 tensor cores on a GPU; not measured here).
- "dequant": the same products and scales, associated differently: both operands are dequantised per
  block to float32 and multiplied with one dot. It differs from "reference" only by float32 summation
  order. One large dot runs far faster on XLA:CPU than ceil(K/128) thin ones; the dequantised weight is
  a transient inside the jitted step (memory holds only the fp8 blocks).
- "pallas": `attention.fp8_gemm`'s Triton kernels, the reference's per-group order with each weight tile
  converted to bfloat16 in registers (no float copy of the weight in memory); the routed experts' grouped
  form (`ragged_matmul`) runs every expert in one kernel. Off a GPU they run in interpret mode (tests).
"auto" is "pallas" where code is shaped for a GPU (`attention.common.resolve_impl`, kernel "fp8_gemm")
once the kernels have been run and checked on one (`attention.common.NOT_YET_CHECKED_ON_GPU`), and
"dequant" elsewhere.

Error bound (3 mantissa bits; used by the tests): rounding to e4m3 moves a value by at most 2^-4 of
itself (half an ulp) in the normal range, and by at most 2^-10 x scale below it (half the smallest
subnormal, 2^-9). Hence, against float32 math with the dequantised weight W^,
|y - x @ W^| <= 2^-4 (|x| @ |W^|) + 2^-10 (xs @ |W^| per group) + float32 summation error.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attention import common, fp8_gemm
from attention.formats import FP8, FP8_MAX, GROUP, dequantize_fp8, num_groups, quantize_fp8

BLOCK = GROUP  # 128: the weight block edge and the activation group length
IMPLS = ("auto", "reference", "dequant", "pallas")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=["parts"])
@dataclasses.dataclass(frozen=True)
class BlockFp8:
    """A block-quantised weight: q [..., K, N] float8_e4m3fn, scale float32; W ~= q * the scale of its
    128 x 128 block. Leading axes (experts) index both fields.

    `parts` (static): N is `parts` equal column parts, each quantised as a matrix of its own, so the
    scale is [..., ceil(K/128), parts * ceil(N/parts/128)]: how a stacked [gate | up] expert weight holds
    the two separately quantised matrices of a checkpoint. With N / parts a multiple of 128 that equals
    blocking the whole [K, N] matrix."""

    q: jax.Array
    scale: jax.Array
    parts: int = 1

    def __post_init__(self):
        if not (hasattr(self.q, "shape") and hasattr(self.scale, "shape")):
            return  # pytree utilities rebuild nodes with other leaves (specs, placeholders)
        k, n = self.q.shape[-2:]
        if self.parts < 1 or n % self.parts:
            raise ValueError(f"BlockFp8: {n} columns do not split into parts={self.parts} equal parts")
        want = tuple(self.q.shape[:-2]) + (num_groups(k), self.parts * num_groups(n // self.parts))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"BlockFp8 scale has shape {list(self.scale.shape)}, expected {list(want)} "
                             f"(one scale per {BLOCK}x{BLOCK} block of q {list(self.q.shape)}"
                             + (f" in {self.parts} column parts)" if self.parts > 1 else ")"))

    @property
    def shape(self) -> tuple:
        return tuple(self.q.shape)

    def __getitem__(self, idx) -> BlockFp8:
        """Index the leading (non-matrix) axes, e.g. one expert of a stacked [E, K, N] weight."""
        return BlockFp8(self.q[idx], self.scale[idx], self.parts)

    def split_columns(self) -> tuple[BlockFp8, ...]:
        """The `parts` column parts, each an ordinary BlockFp8."""
        w, wb = self.q.shape[-1] // self.parts, self.scale.shape[-1] // self.parts
        return tuple(BlockFp8(self.q[..., i * w:(i + 1) * w], self.scale[..., i * wb:(i + 1) * wb])
                     for i in range(self.parts))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        if self.parts > 1:
            return jnp.concatenate([p.dequantize(dtype) for p in self.split_columns()], axis=-1)
        return dequantize_blocks(self.q, self.scale).astype(dtype)


@functools.partial(jax.jit, static_argnames="parts")
def quantize_blocks(w, *, parts: int = 1) -> BlockFp8:
    """w [..., K, N] float -> BlockFp8: per 128 x 128 block, scale = amax / 448 (1 for an all-zero block),
    q = clip(w / scale, +-448) cast to e4m3fn. The layout and numerics of DeepSeek-V3-style checkpoints
    (transformers' Fp8Quantize). parts > 1 quantises N's equal column parts separately (BlockFp8.parts)."""
    w = jnp.asarray(w, jnp.float32)
    if parts > 1:
        if w.shape[-1] % parts:
            raise ValueError(f"{w.shape[-1]} columns do not split into {parts} equal parts")
        cols = [quantize_blocks(c) for c in jnp.split(w, parts, axis=-1)]
        return BlockFp8(jnp.concatenate([c.q for c in cols], -1), jnp.concatenate([c.scale for c in cols], -1), parts)
    k, n = w.shape[-2:]
    gk, gn = num_groups(k), num_groups(n)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, gk * BLOCK - k), (0, gn * BLOCK - n)]
    blocks = jnp.pad(w, pad).reshape(w.shape[:-2] + (gk, BLOCK, gn, BLOCK))
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))  # [..., gk, gn]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(w / _per_element(scale, k, n), -FP8_MAX, FP8_MAX).astype(FP8)
    return BlockFp8(q, scale)


def dequantize_blocks(q, scale) -> jax.Array:
    """q [..., K, N] e4m3fn, scale [..., ceil(K/128), ceil(N/128)] -> float32 q * scale of its block."""
    k, n = q.shape[-2:]
    return q.astype(jnp.float32) * _per_element(scale.astype(jnp.float32), k, n)


def _per_element(scale, k: int, n: int):
    return jnp.repeat(jnp.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)[..., :k, :n]


def quantize_activations(x):
    """x [..., K] -> (xq e4m3fn [..., K], xs float32 [..., ceil(K/128)]): per token, per 128 values of K."""
    return quantize_fp8(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dequantized:
    """A BlockFp8 weight dequantised to float32 [..., K, N] once, for many `apply` calls (a loop over row
    blocks of one expert) under impl "dequant"."""

    w: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForKernel:
    """A BlockFp8 weight that `apply` multiplies with the Pallas kernel (impl "pallas"): the blocks as
    they are, nothing converted outside the kernel."""

    w: BlockFp8


def resolve_impl(impl: str) -> str:
    """"reference", "dequant" or "pallas" for `impl`; "auto": "pallas" where `attention.common.resolve_impl`
    runs the kernel "fp8_gemm" (code shaped for a GPU, the kernel checked there), else "dequant"."""
    if impl not in IMPLS:
        raise ValueError(f"fp8 matmul impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if common.resolve_impl("auto", "fp8_gemm") == "pallas" else "dequant"
    return impl


def prepare(w: BlockFp8, impl: str = "auto") -> BlockFp8 | Dequantized | ForKernel:
    """What `apply` multiplies by under `impl`: the blocks themselves ("reference"), their float32
    dequantisation ("dequant", computed here once) or the blocks marked for the kernel ("pallas")."""
    which = resolve_impl(impl)
    if which == "reference":
        return w
    if which == "pallas":
        return ForKernel(w)
    return Dequantized(w.dequantize())


def _weight_shape(w: BlockFp8 | Dequantized | ForKernel) -> tuple:
    if isinstance(w, ForKernel):
        w = w.w
    return tuple(w.q.shape if isinstance(w, BlockFp8) else w.w.shape)


def apply(x, w: BlockFp8 | Dequantized | ForKernel) -> jax.Array:
    """x [..., K] (any float dtype) times a prepared weight [K, N] -> float32 [..., N]; the activations are
    quantised per token and group of 128 here."""
    k, shape = x.shape[-1], _weight_shape(w)
    if len(shape) != 2:
        raise ValueError(f"fp8 matmul takes a 2-D weight; index the leading axes first (got {list(shape)})")
    if shape[0] != k:
        raise ValueError(f"x has {k} values per token but the weight has {shape[0]} rows")
    xq, xs = quantize_activations(x)
    lead = x.shape[:-1]
    xq, xs = xq.reshape(-1, k), xs.reshape(-1, xs.shape[-1])
    if isinstance(w, ForKernel):
        y = fp8_gemm.gemm(xq, xs, w.w.q, w.w.scale, parts=w.w.parts)
    elif isinstance(w, BlockFp8):
        y = jnp.concatenate([matmul_reference(xq, xs, p) for p in w.split_columns()], axis=-1)
    else:
        y = jnp.dot(dequantize_fp8(xq, xs), w.w, preferred_element_type=jnp.float32)
    return y.reshape(lead + (y.shape[-1],))


def matmul(x, w: BlockFp8, *, impl: str = "auto") -> jax.Array:
    """x [..., K] @ w [K, N] (BlockFp8) -> float32 [..., N] with the activations quantised per token and
    group of 128 (module docstring). impl: "auto" | "reference" | "dequant" | "pallas"."""
    return apply(x, prepare(w, impl))


def ragged_matmul(x_AK, w: BlockFp8, group_sizes_E, *, impl: str = "auto") -> jax.Array:
    """Rows x [A, K] sorted by expert, group_sizes_E [E] rows per expert (as `lax.ragged_dot` takes
    them), each row times its expert's weight w [E, K, N] (BlockFp8) -> float32 [A, N], the activations
    quantised per row and group of 128; rows past sum(group_sizes) are zero. "pallas" ("auto" on a GPU):
    one grouped kernel over every expert (`fp8_gemm.grouped_gemm`); otherwise the reference form, a loop
    over the experts at trace time (E matmuls over all rows, masked: the specification, for tests)."""
    if w.q.ndim != 3 or group_sizes_E.shape != w.q.shape[:1]:
        raise ValueError(f"ragged_matmul takes a weight [E, K, N] and group_sizes [E], got {list(w.q.shape)} and "
                         f"{list(group_sizes_E.shape)}")
    if x_AK.ndim != 2 or x_AK.shape[1] != w.q.shape[1]:
        raise ValueError(f"x has shape {list(x_AK.shape)} but the weight has {w.q.shape[1]} rows per expert")
    which = resolve_impl(impl)
    if which == "pallas":
        xq, xs = quantize_activations(x_AK)
        return fp8_gemm.grouped_gemm(xq, xs, w.q, w.scale, group_sizes_E, parts=w.parts)
    ends = jnp.cumsum(group_sizes_E.astype(jnp.int32))
    row = jnp.arange(x_AK.shape[0], dtype=jnp.int32)
    expert_A = jnp.searchsorted(ends, row, side="right", method="compare_all")  # E past the groups: no expert
    y = jnp.zeros((x_AK.shape[0], w.q.shape[-1]), jnp.float32)
    for e in range(w.q.shape[0]):
        we = prepare(w[e], which)
        y = y + jnp.where((expert_A == e)[:, None], apply(x_AK, we), 0.0)
    return y


def matmul_reference(xq_MK, xs_MG, w: BlockFp8) -> jax.Array:
    """The specification: xq [M, K] e4m3fn with scales xs [M, ceil(K/128)], w [K, N] (parts=1) -> float32
    [M, N].

    One fp8 x fp8 dot per group g of 128 contraction values, accumulated in float32, times xs[:, g] and
    the scale of each column's weight block, summed over the groups in float32 (the order of DeepSeek's
    and vLLM's block GEMM kernels). A ragged last group is zero-padded (zeros add nothing)."""
    if w.parts != 1:
        raise ValueError("matmul_reference takes one blocked matrix (parts=1); split_columns() first")
    m, k = xq_MK.shape
    n = w.q.shape[-1]
    g = num_groups(k)
    pad = g * BLOCK - k
    xq_GMB = jnp.pad(xq_MK, ((0, 0), (0, pad))).reshape(m, g, BLOCK).transpose(1, 0, 2)
    wq_GBN = jnp.pad(w.q, ((0, pad), (0, 0))).reshape(g, BLOCK, n)
    ws_GN = jnp.repeat(w.scale.astype(jnp.float32), BLOCK, axis=-1)[:, :n]

    def group(acc_MN, inputs):
        xq_MB, wq_BN, xs_M, ws_N = inputs
        part_MN = jax.lax.dot_general(xq_MB, wq_BN, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc_MN + part_MN * xs_M[:, None] * ws_N[None, :], None

    acc, _ = jax.lax.scan(group, jnp.zeros((m, n), jnp.float32), (xq_GMB, wq_GBN, xs_MG.T.astype(jnp.float32), ws_GN))
    return acc
