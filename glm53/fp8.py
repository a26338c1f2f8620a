"""fp8 block-quantised weights at the model level: which layers hold them, and turning float layers into fp8.

GLM-5.3's released checkpoint follows DeepSeek-V3: `config.json` carries
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}` and every quantised linear weight is stored as float8_e4m3fn with a
float32 `weight_scale_inv` per 128 x 128 block. Which layers are quantised follows transformers'
fine-grained fp8 integration (`replace_with_fp8_linear`): every nn.Linear and the routed experts, except
- `lm_head` (always skipped), the embeddings, norms and the router `mlp.gate` (not nn.Linear in HF);
- the modules of the model's `_keep_in_fp32_modules`: `indexer.weights_proj` for glm_moe_dsa;
- any module whose name matches an entry of `quantization_config.modules_to_not_convert` (transformers
  replaces the digits of the parameter name by "*" and tests `entry in name`; we also accept exact names);
and, for the MTP layer, which HF does not build, vLLM's rule: `eh_proj` is an unquantised nn.Linear.
So the quantised layers are MLA's q_a / q_b / kv_a / kv_b / o projections, the indexer's wq_b and wk,
the dense MLPs, the shared experts and the routed experts.

In memory an fp8 layer is a `glm53.layers.Fp8Linear` or `Fp8Experts` in place of the float module, with
parameter paths `…weight` / `…weight_scale_inv` that map to the checkpoint's names (weights.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

from attention import fp8_matmul
from glm53.config import ModelConfig
from glm53.layers import Experts, Fp8Experts, Fp8Linear, Linear

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [fp8_matmul.BLOCK, fp8_matmul.BLOCK]}
# Path suffixes of Linear modules that stay in float whatever the checkpoint says (see the module docstring).
ALWAYS_FLOAT = (("indexer", "weights_proj"), ("eh_proj",))


def eligible_modules(model: nnx.Module) -> list[tuple]:
    """Paths of the float modules an fp8 checkpoint quantises (before modules_to_not_convert), in model
    order: Linear and Experts modules under the decoder and MTP layers, less ALWAYS_FLOAT."""
    out = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Linear | Experts) and not any(path[-len(s):] == s for s in ALWAYS_FLOAT):
            out.append(tuple(path))
    return out


def hf_module_name(cfg: ModelConfig, path: tuple) -> str:
    """HF name of the module at our `path` ("layers", i, …) or ("mtp", j, …), e.g.
    ("mtp", 0, "eh_proj") -> "model.layers.{num_hidden_layers}.eh_proj"."""
    if path[0] not in ("layers", "mtp"):
        raise ValueError(f"no HF module name for {path}: only decoder and MTP layers hold linear layers")
    layer = path[1] if path[0] == "layers" else cfg.num_hidden_layers + path[1]
    return f"model.layers.{layer}." + ".".join(str(p) for p in path[2:])


def not_converted(hf_name: str, modules_to_not_convert) -> bool:
    """transformers' test: an entry is a substring of the parameter name with its digits replaced by "*"
    (so "model.layers.*.mlp.shared_experts" or "shared_experts" exclude every layer's); an exact module
    name with its digits (this module or an ancestor) also matches."""
    starred = re.sub(r"\d+", "*", hf_name + ".weight")
    return any(key in starred or hf_name == key or hf_name.startswith(key + ".")
               for key in (modules_to_not_convert or ()))


def fp8_modules(model: nnx.Module) -> list[tuple]:
    """Paths of the model's fp8 modules (Fp8Linear, Fp8Experts), in model order."""
    return [tuple(p) for p, m in nnx.iter_modules(model) if isinstance(m, Fp8Linear | Fp8Experts)]


def convert(model: nnx.Module, paths, *, impl: str = "auto") -> nnx.Module:
    """Replace the float modules at `paths` (Linear or Experts) by fp8 ones holding their weights quantised
    in 128 x 128 blocks (fp8_matmul.quantize_blocks), in place; returns `model`. Under nnx.eval_shape this
    builds the fp8 structure without allocating anything (what the checkpoint loader does)."""
    dtype = model.dtype
    for path in paths:
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        module = getattr(parent, path[-1])
        if isinstance(module, Linear):
            new = Fp8Linear.from_linear(module, dtype=dtype, impl=impl)
        elif isinstance(module, Experts):
            new = Fp8Experts.from_experts(module, impl=impl)
        else:
            raise ValueError(f"module {path} is a {type(module).__name__}; only Linear and Experts are quantised")
        setattr(parent, path[-1], new)
    return model


def quantize(model: nnx.Module, *, modules_to_not_convert=(), impl: str = "auto") -> nnx.Module:
    """A copy of a float model with the layers an fp8 checkpoint quantises (module docstring) held in
    fp8 blocks, as a block-quantised checkpoint of it would load. The input model is not changed.
    `modules_to_not_convert`: HF module names (or transformers-style patterns) to keep in float."""
    if fp8_modules(model):
        raise ValueError("model already holds fp8 modules; quantize a float model")
    fp8_matmul.resolve_impl(impl)
    graphdef, state = nnx.split(model)
    paths = [p for p in eligible_modules(model)
             if not not_converted(hf_module_name(model.cfg, p), modules_to_not_convert)]

    def build(state):
        return convert(nnx.merge(graphdef, state), paths, impl=impl)

    # One jitted program quantises every layer (eagerly, each op of each shape would compile on its own).
    new_graphdef = nnx.graphdef(nnx.eval_shape(build, state))
    new_state = jax.jit(lambda state: nnx.state(build(state)))(state)
    return nnx.merge(new_graphdef, new_state)


def with_impl(model: nnx.Module, impl: str) -> nnx.Module:
    """A copy of `model` (sharing its arrays) whose fp8 modules use the fp8 matmul implementation `impl`
    ("auto", "reference", "dequant", "pallas"). A copy, not an in-place change: the jitted steps of a model
    (`glm53.model.compiled`) are cached per model object and keyed on its arrays, not its graph."""
    fp8_matmul.resolve_impl(impl)
    copy = nnx.merge(*nnx.split(model))
    for _, module in nnx.iter_modules(copy):
        if isinstance(module, Fp8Linear | Fp8Experts):
            module.impl = impl
    return copy


def quantization_config(model: nnx.Module) -> dict | None:
    """The `quantization_config` a checkpoint of `model` declares: None for a float model; else
    QUANTIZATION_CONFIG, plus `modules_to_not_convert` naming the eligible modules kept in float (exact
    names) when there are any."""
    if not fp8_modules(model):
        return None
    out = {k: list(v) if isinstance(v, list) else v for k, v in QUANTIZATION_CONFIG.items()}
    kept = [hf_module_name(model.cfg, p) for p in eligible_modules(model)]
    if kept:
        out["modules_to_not_convert"] = kept
    return out


def weight_bytes(model: nnx.Module) -> dict[str, int]:
    """{"fp8": bytes of the fp8 modules' parameters (values and scales), "float": the rest}."""
    fp8 = {tuple(p) for p in fp8_modules(model)}
    out = {"fp8": 0, "float": 0}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = var[...]
        out["fp8" if tuple(path[:-1]) in fp8 else "float"] += x.size * jnp.dtype(x.dtype).itemsize
    return out
