"""fp8 weights on the GPU path, lowered for an H200 on this CPU-only machine (attention.gpu_aot): the
MoE layer with fp8 experts and fp8 linear layers at GLM-5.3's widths, with impl="auto", hold no float array
of a weight's shape (no dequantised copy of a weight) and no `while` loop (no loop over experts): each
projection is one block-scaled fp8 Pallas kernel (attention.fp8_gemm). The same programs with the CPU's
"dequant" form show both, so the inspection can fail. Nothing is computed: abstract arrays only."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attention import common, fp8_matmul, gpu_aot
from glm53.config import get_preset
from glm53.fp8 import with_impl
from glm53.layers import MoE, Fp8Experts, Fp8Linear, Linear

TOKENS = 64
_FLOAT_TENSOR = re.compile(r"tensor<((?:\d+x)+)(f32|bf16|f16|f64)>")


def _fp8_moe(cfg):
    """An abstract MoE layer of `cfg` as an fp8 checkpoint holds it: routed and shared experts in fp8."""
    def build():
        moe = MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        moe.experts = Fp8Experts.from_experts(moe.experts)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(moe.shared_experts, name,
                    Fp8Linear.from_linear(getattr(moe.shared_experts, name), dtype=jnp.bfloat16))
        return moe
    return nnx.eval_shape(build)


def _lower(module, x):
    """StableHLO text and custom calls of module(x) lowered for the "cuda" platform (H200)."""
    graphdef, state = nnx.split(module)

    def fn(state, x):
        return nnx.merge(graphdef, state)(x)

    with gpu_aot.gpu_lowering():
        lowered = jax.jit(fn).trace(state, x).lower(lowering_platforms=("cuda",))
    return lowered.as_text(), gpu_aot.custom_calls(lowered)


def _weight_shapes(module) -> set:
    """(K, N) of every fp8 weight matrix in `module` (an expert stack's per-expert matrix too)."""
    shapes = set()
    for _, m in nnx.iter_modules(module):
        if isinstance(m, Fp8Linear):
            shapes.add(tuple(m.weight.shape))
        elif isinstance(m, Fp8Experts):
            shapes |= {tuple(m.gate_up_proj.shape[1:]), tuple(m.down_proj.shape[1:])}
    return shapes


def _float_arrays_of_weight_shape(text: str, shapes: set) -> list[str]:
    out = []
    for m in _FLOAT_TENSOR.finditer(text):
        dims = tuple(int(d) for d in m.group(1).rstrip("x").split("x"))
        if dims[-2:] in shapes:
            out.append(m.group(0))
    return sorted(set(out))


@pytest.fixture(scope="module")
def cfg():
    return get_preset("glm-5.3")


@pytest.fixture(autouse=True)
def checked_on_gpu(monkeypatch):
    """The lowering "auto" gives once a device run has checked the fp8 kernels on a GPU (until then
    `attention.common.NOT_YET_CHECKED_ON_GPU` keeps "auto" on the dequantised dot: the test below)."""
    monkeypatch.setattr(common, "NOT_YET_CHECKED_ON_GPU", common.NOT_YET_CHECKED_ON_GPU - {"fp8_gemm"})


def test_auto_waits_for_a_gpu_check(monkeypatch):
    """Kernels never run on a GPU are not what "auto" picks there: "dequant" while fp8_gemm is unchecked,
    "pallas" once checked; "pallas" by name either way; never the kernels off a GPU."""
    with gpu_aot.gpu_lowering():
        assert fp8_matmul.resolve_impl("auto") == "pallas"  # the fixture: checked
        monkeypatch.setattr(common, "NOT_YET_CHECKED_ON_GPU", frozenset({"fp8_gemm"}))
        assert fp8_matmul.resolve_impl("auto") == "dequant" and fp8_matmul.resolve_impl("pallas") == "pallas"
        assert common.resolve_impl("auto", "sparse_mqa") == "pallas"  # other kernels unaffected
    monkeypatch.setattr(common, "NOT_YET_CHECKED_ON_GPU", frozenset())
    assert fp8_matmul.resolve_impl("auto") == "dequant"  # not shaped for a GPU


def _x(cfg):
    return jax.ShapeDtypeStruct((1, TOKENS, cfg.hidden_size), jnp.bfloat16)


def test_fp8_moe_layer_has_no_float_weight_and_no_expert_loop(cfg):
    moe = _fp8_moe(cfg)
    shapes = _weight_shapes(moe)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    assert shapes == {(d, 2 * f), (f, d), (d, f * cfg.n_shared_experts)}  # experts; shared gate, up (down: (f, d))
    text, calls = _lower(moe, _x(cfg))
    assert _float_arrays_of_weight_shape(text, shapes) == []
    assert "stablehlo.while" not in text
    names = [name for _, name in calls if name]
    assert names.count("fp8_grouped_gemm") == 2 and names.count("fp8_gemm") == 3, names  # experts; shared MLP

    # the CPU's form lowered for the same GPU: a float32 copy of each used expert's weights, in a loop
    text, _ = _lower(with_impl(moe, "dequant"), _x(cfg))
    assert f"tensor<{cfg.hidden_size}x{2 * cfg.moe_intermediate_size}xf32>" in text and "stablehlo.while" in text


@pytest.mark.parametrize("name,din,dout", [("kv_a_proj_with_mqa", 6144, 576), ("q_b_proj", 2048, 16384)])
def test_fp8_linear_has_no_float_weight(cfg, name, din, dout):
    """576 columns: a ragged last block (4.5 x 128) read in place, no padded copy of the weight."""
    lin = nnx.eval_shape(lambda: Fp8Linear.from_linear(Linear(din, dout, rngs=nnx.Rngs(0), dtype=jnp.bfloat16),
                                                       dtype=jnp.bfloat16))
    x = jax.ShapeDtypeStruct((TOKENS, din), jnp.bfloat16)
    text, calls = _lower(lin, x)
    assert _float_arrays_of_weight_shape(text, {(din, dout)}) == []
    assert "stablehlo.while" not in text and [n for _, n in calls if n] == ["fp8_gemm"]
    assert f"tensor<{din}x{dout}xf8E4M3FN>" in text  # the weight enters the kernel as it is stored
    text, _ = _lower(with_impl(lin, "dequant"), x)
    assert _float_arrays_of_weight_shape(text, {(din, dout)}) != []
