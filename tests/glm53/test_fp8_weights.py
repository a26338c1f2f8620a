"""fp8 block-quantised weights: the fp8 matmul against its block-exact reference and a derived error bound,
checkpoints loaded with quantization="fp8" (fp8 in memory, no float copy on the way), the fp8 model
against the same checkpoint dequantised, the engine serving it, and clear errors.

The tiny fp8 fixture is tests/fixtures/make_fp8_fixture.py written into a temporary directory.
"""

import importlib.util
import json
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import glm53
from attention import fp8_matmul
from glm53 import fp8
from glm53.layers import Fp8Experts, Fp8Linear, grouped_experts

FP8 = ml_dtypes.float8_e4m3fn
REPO_FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"


def load_file(path):
    """{name: array} of a safetensors file, float8 included (safetensors' numpy reader has no float8)."""
    from glm53.weights import _SafetensorsFile

    st = _SafetensorsFile(path)
    return {name: np.array(st.get(name)) for name in st.keys()}


def _fixture_script():
    spec = importlib.util.spec_from_file_location("make_fp8_fixture", REPO_FIXTURES / "make_fp8_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory, tiny_model):
    """The tiny fp8 fixture (per-expert tensors), written once per module from the session's tiny model
    (glm53.init("tiny", seed=0, std=0.1), what the script quantises)."""
    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    _fixture_script().write(out, model=tiny_model)
    return out


@pytest.fixture(scope="module")
def fp8_model(fp8_ckpt):
    return glm53.from_pretrained(fp8_ckpt, quantization="fp8")


@pytest.fixture(scope="module")
def dequantised_model(fp8_ckpt):
    return glm53.from_pretrained(fp8_ckpt)


# ------------------------------------------------------------------------------------------ the matmul op
def _blocky_weight(rng, k, n):
    """w [k, n] whose 128 x 128 blocks have magnitudes 10^-3 .. 10^3: a scale applied to the wrong block
    shows as an error of orders of magnitude."""
    mags = 10.0 ** rng.integers(-3, 4, (-(-k // 128), -(-n // 128)))
    return (rng.standard_normal((k, n)) * np.repeat(np.repeat(mags, 128, 0), 128, 1)[:k, :n]).astype(np.float32)


def _dequantised_activations_f64(x):
    """x [..., K] -> float64: per token and group of 128, quantised to e4m3 and back (numpy's own version
    of the rule; only the rounding to e4m3 itself goes through ml_dtypes' cast)."""
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    out = np.empty_like(x)
    for g in range(0, k, 128):
        xg = x[..., g:g + 128]
        scale = np.maximum(np.abs(xg).max(-1, keepdims=True), 1e-4) / 448
        q = np.clip(xg / scale, -448, 448).astype(np.float32).astype(FP8).astype(np.float64)
        out[..., g:g + 128] = q * scale
    return out


def test_quantize_blocks_layout_and_ragged_edges():
    rng = np.random.default_rng(0)
    w = _blocky_weight(rng, 200, 300)
    w[128:, 256:] = 0  # an all-zero (ragged) block
    b = fp8_matmul.quantize_blocks(w)
    assert b.q.dtype == jnp.float8_e4m3fn and b.q.shape == (200, 300)
    assert b.scale.dtype == jnp.float32 and b.scale.shape == (2, 3)
    for i, rows in enumerate((slice(0, 128), slice(128, 200))):
        for j, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
            amax = np.abs(w[rows, cols]).max()
            assert float(b.scale[i, j]) == pytest.approx(amax / 448 if amax else 1.0, rel=1e-6)
    deq = np.asarray(b.dequantize(), np.float64)
    s = np.repeat(np.repeat(np.asarray(b.scale, np.float64), 128, 0), 128, 1)[:200, :300]
    err = np.abs(deq - w)
    assert (err <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s).all()  # 3 mantissa bits; subnormals below 2^-6
    assert (deq[128:, 256:] == 0).all() and err.max() > 0


def test_matmul_reference_is_exact_about_the_block_structure():
    """K = 300 (groups of 128, 128, 44), N = 200 (blocks of 128, 72), leading dims [2, 3], block magnitudes
    spread over six orders: the reference equals float64 math on the dequantised operands to float32
    rounding, and the one-dot implementation equals the reference to float32 summation order."""
    rng = np.random.default_rng(1)
    w = fp8_matmul.quantize_blocks(_blocky_weight(rng, 300, 200))
    x = (rng.standard_normal((2, 3, 300)) * rng.choice([1e-3, 1.0, 1e3], (2, 3, 300))).astype(np.float32)
    want = _dequantised_activations_f64(x) @ np.asarray(w.dequantize(), np.float64)
    scale = np.abs(_dequantised_activations_f64(x)) @ np.abs(np.asarray(w.dequantize(), np.float64))
    ref = np.asarray(jax.jit(lambda x, w: fp8_matmul.matmul(x, w, impl="reference"))(x, w))
    deq = np.asarray(fp8_matmul.matmul(x, w, impl="dequant"))
    assert ref.shape == (2, 3, 200) and ref.dtype == np.float32
    assert (np.abs(ref - want) <= 1e-5 * scale).all()
    assert (np.abs(deq - ref) <= 1e-5 * scale).all()
    np.testing.assert_array_equal(np.asarray(fp8_matmul.matmul(x, w)), deq)  # "auto"


def test_matmul_error_bound_against_float32():
    """Derived bound (attention/fp8_matmul.py): each activation moves by <= 2^-4 |x| + 2^-10 xs under e4m3
    rounding, each weight by <= 2^-4 |w| + 2^-10 ws, so |y - x @ w| <= sum_k (those) x |other operand|,
    plus float32 summation. The bound holds elementwise and is not vacuous."""
    rng = np.random.default_rng(2)
    k, n = 260, 150
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((64, k)).astype(np.float32)
    b = fp8_matmul.quantize_blocks(w)
    w_hat = np.asarray(b.dequantize(), np.float64)
    ws = np.repeat(np.repeat(np.asarray(b.scale, np.float64), 128, 0), 128, 1)[:k, :n]
    xs = np.repeat(np.maximum(np.abs(np.pad(x, ((0, 0), (0, 384 - k)))).reshape(64, 3, 128).max(-1), 1e-4) / 448,
                   128, 1)[:, :k]
    y = np.asarray(fp8_matmul.matmul(x, b), np.float64)
    x64 = x.astype(np.float64)
    dx = 2.0 ** -4 * np.abs(x64) + 2.0 ** -10 * xs
    f32 = 4 * k * 2.0 ** -24 * (np.abs(x64) + dx) @ np.abs(w_hat)
    err_deq = np.abs(y - x64 @ w_hat)  # against the dequantised weight: activation rounding only
    bound_deq = dx @ np.abs(w_hat) + f32
    assert (err_deq <= bound_deq).all()
    dw = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * ws
    err = np.abs(y - x64 @ w.astype(np.float64))  # against the original float32 weight: both roundings
    bound = dx @ np.abs(w_hat) + np.abs(x64) @ dw + f32
    assert (err <= bound).all()
    ratio = err / bound
    assert 1e-3 < ratio.max() < 1 and ratio.mean() < 0.2, (ratio.max(), ratio.mean())
    # what is typical: the relative RMS error of one product (reported in docs/model.md)
    rel = np.sqrt((err ** 2).mean() / ((x64 @ w.astype(np.float64)) ** 2).mean())
    assert 0.005 < rel < 0.05, rel


def test_matmul_zero_rows_huge_range_and_bad_input():
    """No NaN from an all-zero token; a huge group is exact (its amax maps to 448); below the 1e-4 scale
    floor (DeepSeek's act_quant) a group keeps values down to about 1e-4 / 448 x 2^-10 and flushes the rest
    to zero."""
    w = fp8_matmul.quantize_blocks(np.eye(128, 16, dtype=np.float32) * 3)
    x = np.zeros((4, 128), np.float32)
    x[1, 0], x[2, 0], x[3, 0] = 1e30, 5e-5, 1e-30
    y = np.asarray(fp8_matmul.matmul(x, w, impl="reference"))
    assert np.isfinite(y).all() and (y[0] == 0).all()
    assert y[1, 0] == pytest.approx(3e30, rel=1e-6)
    assert y[2, 0] == pytest.approx(1.5e-4, rel=2 ** -4) and y[3, 0] == 0
    with pytest.raises(ValueError, match="impl must be one of"):
        fp8_matmul.matmul(x, w, impl="pallas")
    w16 = fp8_matmul.BlockFp8(jnp.zeros((16, 4), jnp.float8_e4m3fn), jnp.ones((1, 1)))
    with pytest.raises(ValueError, match="x has 17 values per token but the weight has 16 rows"):
        fp8_matmul.matmul(np.zeros((2, 17), np.float32), w16)
    with pytest.raises(ValueError, match=r"scale has shape \[2, 1\], expected \[1, 1\]"):
        fp8_matmul.BlockFp8(jnp.zeros((16, 4), jnp.float8_e4m3fn), jnp.ones((2, 1)))


def test_column_parts_are_blocked_separately():
    """[gate | up] with F = 32: each half has its own 128 x 128 blocks (as per-expert checkpoint tensors);
    the stacked matrix's single block would share one scale."""
    rng = np.random.default_rng(3)
    gate, up = rng.standard_normal((64, 32)).astype(np.float32), 100 * rng.standard_normal((64, 32)).astype(np.float32)
    b = fp8_matmul.quantize_blocks(np.concatenate([gate, up], 1), parts=2)
    assert b.scale.shape == (1, 2)
    g, u = b.split_columns()
    np.testing.assert_array_equal(np.asarray(g.dequantize()), np.asarray(fp8_matmul.quantize_blocks(gate).dequantize()))
    np.testing.assert_array_equal(np.asarray(u.dequantize()), np.asarray(fp8_matmul.quantize_blocks(up).dequantize()))
    x = rng.standard_normal((5, 64)).astype(np.float32)
    y = np.asarray(fp8_matmul.matmul(x, b, impl="reference"))
    np.testing.assert_allclose(y[:, :32], np.asarray(fp8_matmul.matmul(x, g, impl="reference")), rtol=0, atol=0)


def _fake_quant(x):
    """Per token, per 128 values: quantise to e4m3 and back (the tests' own jnp version of the rule)."""
    xf = x.astype(jnp.float32)
    k = xf.shape[-1]
    g = -(-k // 128)
    xg = jnp.pad(xf, [(0, 0)] * (xf.ndim - 1) + [(0, g * 128 - k)]).reshape(xf.shape[:-1] + (g, 128))
    scale = jnp.maximum(jnp.max(jnp.abs(xg), -1, keepdims=True), 1e-4) / 448
    q = jnp.clip(xg / scale, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(xf.shape[:-1] + (g * 128,))[..., :k]


@pytest.mark.parametrize("impl", ["reference", "dequant"])
def test_grouped_experts_fp8_equal_a_dense_fake_quant_moe(impl):
    """Stacked fp8 experts through the blocked grouped loop (ragged blocks of 5 rows) against a dense
    per-expert computation on fake-quantised activations and dequantised weights."""
    rng = np.random.default_rng(4)
    e, d, f, n, k = 4, 160, 96, 13, 2
    experts = Fp8Experts(fp8_matmul.quantize_blocks(rng.standard_normal((e, d, 2 * f)), parts=2),
                         fp8_matmul.quantize_blocks(rng.standard_normal((e, f, d))), impl=impl)
    gu, dn = (w.dequantize() for w in experts.weights())
    x = rng.standard_normal((n, d)).astype(np.float32)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, k)).astype(np.float32)
    run = jax.jit(lambda x, i, w: grouped_experts(x, i, w, *experts.weights(), block=5, fp8_impl=impl))
    got = np.asarray(run(x, idx, wts))
    h = jnp.einsum("nd,edf->enf", _fake_quant(x), gu)
    y = jnp.einsum("enf,efd->end", _fake_quant(jax.nn.silu(h[..., :f]) * h[..., f:]), dn)
    comb = np.zeros((n, e), np.float32)
    np.add.at(comb, (np.arange(n)[:, None], idx), wts)
    want = np.asarray(jnp.einsum("end,ne->nd", y, comb))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
