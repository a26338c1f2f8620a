"""The block-scaled fp8 GEMM kernels (attention.fp8_gemm) against fp8_matmul's reference, in interpret mode.

The kernels follow the reference's order (one 128-value group at a time, scaled per group in float32),
so they must equal it up to float32 summation order inside a group's dot: the tolerance is float32
rounding of the reference's magnitude, far inside the documented fp8 error bound (which the reference
itself is tested against in tests/glm53/test_fp8_weights.py). Shapes are GLM-5.3's edge cases in small:
K and N not multiples of 128 (a ragged last group and column block), M = 1, 64, 300 (one partial tile,
one full, several with a partial last), gate|up weights quantised in two parts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import fp8_gemm, fp8_matmul
from attention.common import shaped_for


def _weight(rng, shape, parts=1):
    # per-block magnitudes spread over 2^-6..2^6, so a wrong block scale cannot hide
    w = rng.normal(size=shape) * np.exp2(rng.integers(-6, 7, size=shape[:-2] + (1, 1)))
    w = w * np.exp2(rng.integers(-3, 4, size=(shape[-2] + 127) // 128)).repeat(128)[:shape[-2], None]
    return fp8_matmul.quantize_blocks(jnp.asarray(w, jnp.float32), parts=parts)


def _close(y, ref):
    y, ref = np.asarray(y), np.asarray(ref)
    assert y.shape == ref.shape and np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("m,k,n,parts,sizes", [
    (1, 200, 96, 1, None),          # decode row, ragged K group and N block; split-K in 2 (one group each)
    (64, 384, 192, 2, fp8_gemm.BlockSizes(splits=2)),  # gate|up of F = 96 (two parts, ragged blocks); 2 + 1 groups
    (300, 130, 200, 1, fp8_gemm.BlockSizes(block_n=32, max_block_m=128, splits=1)),  # 3 row tiles, 7 column tiles
])
def test_gemm_equals_reference(m, k, n, parts, sizes):
    rng = np.random.default_rng(m)
    w = _weight(rng, (k, n), parts)
    x = jnp.asarray(rng.normal(size=(m, k)) * 3, jnp.bfloat16)
    xq, xs = fp8_matmul.quantize_activations(x)
    y = fp8_gemm.gemm(xq, xs, w.q, w.scale, parts=parts, block_sizes=sizes)
    ref = jnp.concatenate([fp8_matmul.matmul_reference(xq, xs, p) for p in w.split_columns()], axis=-1)
    _close(y, ref)
    # and through fp8_matmul's dispatch, as Fp8Linear calls it
    _close(fp8_matmul.matmul(x, w, impl="pallas"), ref)


def test_group_tiles_cover_every_row_once_within_one_expert():
    rng = np.random.default_rng(0)
    for rows, bm, sizes in [(40, 16, [5, 0, 30]), (64, 16, [0, 64, 0, 0]), (7, 16, [3, 2, 2]),
                            (50, 32, [10, 0, 0, 0]), (33, 16, [40, 3])] + \
            [(r, 16, list(rng.multinomial(r, np.ones(5) / 5))) for r in (1, 17, 100)]:
        tiles = np.asarray(jax.jit(fp8_gemm.group_tiles, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), rows, bm))
        assert tiles.shape == (3, -(-rows // bm) + len(sizes) + 1)
        ends = np.minimum(np.cumsum(sizes), rows)
        owner = np.searchsorted(ends, np.arange(rows), side="right")  # len(sizes): past every group
        seen = np.zeros(rows, int)
        for expert, start, count in tiles.T:
            assert abs(count) <= bm
            for r in range(start, start + abs(count)):
                seen[r] += 1
                assert owner[r] == (expert if count > 0 else len(sizes)), (sizes, r)
        assert (seen == 1).all(), (sizes, seen)


def test_grouped_gemm_equals_reference_per_expert():
    """Experts with no rows, one row, several tiles; rows past sum(group_sizes) come out zero (as
    lax.ragged_dot's); gate|up in two parts of F = 96 (ragged blocks); K split over two programs."""
    rng = np.random.default_rng(1)
    e, k, n, m = 4, 200, 192, 45
    w = _weight(rng, (e, k, n), parts=2)
    sizes = np.array([0, 1, 37, 0], np.int32)  # 38 of 45 rows routed
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    xq, xs = fp8_matmul.quantize_activations(x)
    y = np.asarray(fp8_gemm.grouped_gemm(xq, xs, w.q, w.scale, jnp.asarray(sizes), parts=2,
                                         block_sizes=fp8_gemm.BlockSizes(block_m=16, splits=2)))  # split-K too
    off = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(e):
        if sizes[i]:
            ref = jnp.concatenate([fp8_matmul.matmul_reference(xq[off[i]:off[i + 1]], xs[off[i]:off[i + 1]], p)
                                   for p in w[i].split_columns()], axis=-1)
            _close(y[off[i]:off[i + 1]], ref)
    assert (y[off[-1]:] == 0).all()
    # fp8_matmul.ragged_matmul: the kernel ("pallas") and the reference form agree
    _close(fp8_matmul.ragged_matmul(x, w, jnp.asarray(sizes), impl="pallas"), y)
    _close(fp8_matmul.ragged_matmul(x, w, jnp.asarray(sizes), impl="reference"), y)


def test_fp8_experts_pallas_equal_the_expert_loop():
    """glm53.layers.grouped_experts over fp8 blocks: impl "pallas" (sorted assignments, two grouped
    kernels, no loop over experts) against "reference" (the expert loop over row blocks), including an
    expert chosen twice by one token with weight 0 (how expert parallelism pads) and unused experts."""
    from glm53.layers import grouped_experts

    rng = np.random.default_rng(2)
    n, e, k, d, f = 9, 6, 2, 160, 96
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    idx = np.stack([rng.choice(e - 1, k, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, k)).astype(np.float32)
    idx[0, 1], wts[0, 1] = idx[0, 0], 0.0
    gate_up, down = _weight(rng, (e, d, 2 * f), parts=2), _weight(rng, (e, f, d))
    ys = [np.asarray(jax.jit(lambda x, g, dn, impl=impl: grouped_experts(x, jnp.asarray(idx), jnp.asarray(wts), g, dn,
                                                                        fp8_impl=impl))(x, gate_up, down))
          for impl in ("pallas", "reference")]
    _close(*ys)


def test_auto_is_the_kernel_only_where_gpu_shaped(monkeypatch):
    """Once checked on a GPU (attention.common.NOT_YET_CHECKED_ON_GPU without "fp8_gemm"), "auto" is the
    kernel where code is shaped for one; until then the dequantised dot there too."""
    from attention import common

    assert fp8_matmul.resolve_impl("auto") == "dequant"  # this machine: CPU, the exactness tests' path
    with shaped_for("gpu"):
        assert fp8_matmul.resolve_impl("auto") == ("dequant" if "fp8_gemm" in common.NOT_YET_CHECKED_ON_GPU
                                                   else "pallas")
        monkeypatch.setattr(common, "NOT_YET_CHECKED_ON_GPU", common.NOT_YET_CHECKED_ON_GPU - {"fp8_gemm"})
        assert fp8_matmul.resolve_impl("auto") == "pallas"
        assert isinstance(fp8_matmul.prepare(fp8_matmul.quantize_blocks(jnp.ones((8, 8))), "auto"), fp8_matmul.ForKernel)
    with shaped_for("cpu"):
        assert fp8_matmul.resolve_impl("auto") == "dequant"
    assert fp8_matmul.resolve_impl("pallas") == "pallas"


def test_bad_input_names_the_field():
    w = fp8_matmul.quantize_blocks(jnp.ones((3, 200, 64)))
    xq, xs = fp8_matmul.quantize_activations(jnp.ones((5, 200)))
    with pytest.raises(ValueError, match="group_sizes"):
        fp8_gemm.grouped_gemm(xq, xs, w.q, w.scale, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="values per row"):
        fp8_gemm.gemm(xq[:, :128], xs[:, :1], w.q[0], w.scale[0])
    with pytest.raises(ValueError, match="activation scales"):
        fp8_gemm.gemm(xq, xs[:, :1], w.q[0], w.scale[0])
    with pytest.raises(ValueError, match="weight scales"):
        fp8_gemm.gemm(xq, xs, w.q[0], w.scale[0], parts=2)
    with pytest.raises(ValueError, match="group_sizes"):
        fp8_matmul.ragged_matmul(jnp.ones((5, 200)), w, jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        fp8_matmul.resolve_impl("triton")
    # a wave of 132 programs where the groups and the partials' bytes allow, no empty split
    assert [fp8_gemm.BlockSizes().split_count(p, g, c) for p, g, c in
            ((1, 2, 6), (16, 48, 48), (5, 48, 48), (132, 48, 48), (2, 3, 48), (16, 48, 3), (16, 16, 0))] == \
        [2, 8, 16, 1, 3, 3, 1]
    for bad in (dict(block_n=48), dict(block_m=8), dict(num_warps=3), dict(num_stages=0), dict(splits=0)):
        with pytest.raises(ValueError, match=f"BlockSizes.{next(iter(bad))}"):
            fp8_gemm.BlockSizes(**bad)
    assert fp8_gemm.CANDIDATES[0] == fp8_gemm.BlockSizes() and len(set(fp8_gemm.CANDIDATES)) == len(fp8_gemm.CANDIDATES) <= 6
