"""Checkpoints: HF safetensors in and out, orbax save/restore.

HF layout (GlmMoeDsaForCausalLM): `model.embed_tokens.weight`, `model.layers.{i}.…`, `model.norm.weight`,
`lm_head.weight`; MTP layer j at `model.layers.{num_hidden_layers + j}.…` with `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm` (and optional copies `embed_tokens` / `shared_head.head`, which are the
main model's and are ignored). Our parameter paths mirror these names; the differences:
- nn.Linear weights are [out, in] in HF and [in, out] here (transposed on load and save);
- routed experts are either fused (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F],
  as transformers 5 holds them) or per expert (`mlp.experts.{e}.gate_proj.weight` [F, D], `up_proj` [F, D],
  `down_proj` [D, F], as released checkpoints store them); we hold gate_up [E, D, 2F] and down [E, F, D].
- FP8 block-quantised weights (float8_e4m3fn with a `…weight_scale_inv` of 128 x 128 blocks) are
  dequantised on load by default; with `quantization="fp8"` the layers glm53.fp8 names keep them in fp8
  (`layers.Fp8Linear` / `Fp8Experts`: `…weight` [in, out] e4m3fn and `…weight_scale_inv`
  [ceil(in/128), ceil(out/128)], both transposed from HF's [out, in]; experts `gate_up_proj_scale_inv`
  [E, ceil(D/128), 2 ceil(F/128)] and `down_proj_scale_inv` [E, ceil(F/128), ceil(D/128)]).

Every expected tensor is checked: a missing or mis-shaped tensor fails the load with a message naming
all of them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from glm53 import fp8
from glm53.config import ModelConfig, from_hf_config, to_hf_config
from glm53.layers import Experts
from glm53.model import GLM53

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
FP8_BLOCK = 128
QUANTIZATIONS = (None, "fp8")


# ------------------------------------------------------------------------------------------- name mapping
@dataclasses.dataclass(frozen=True)
class HFTensor:
    """How one of our parameters is stored in an HF checkpoint."""

    name: str  # HF tensor name (for experts: the fused name)
    kind: str  # "plain" | "linear" (transposed) | "experts_gate_up" | "experts_down"


def hf_tensor(cfg: ModelConfig, path: tuple) -> HFTensor:
    """Map one of our parameter paths (as in nnx.to_flat_state) to its HF tensor."""
    head, rest = path[0], path[1:]
    if head == "embed_tokens":
        return HFTensor("model.embed_tokens.weight", "plain")
    if head == "norm":
        return HFTensor("model.norm.weight", "plain")
    if head == "lm_head":
        return HFTensor("lm_head.weight", "linear")
    if head not in ("layers", "mtp"):
        raise KeyError(f"no HF name for parameter {path}")
    layer = rest[0] if head == "layers" else cfg.num_hidden_layers + rest[0]
    sub = rest[1:]
    name = f"model.layers.{layer}." + ".".join(str(p) for p in sub)
    if sub[-2:] in (("experts", "gate_up_proj"), ("experts", "gate_up_proj_scale_inv")):
        return HFTensor(name, "experts_gate_up")
    if sub[-2:] in (("experts", "down_proj"), ("experts", "down_proj_scale_inv")):
        return HFTensor(name, "experts_down")
    norms = ("input_layernorm", "post_attention_layernorm", "norm", "q_a_layernorm", "kv_a_layernorm", "k_norm",
             "enorm", "hnorm")
    is_matrix = sub[-1] in ("weight", "weight_scale_inv") and sub[-2] not in norms
    return HFTensor(name, "linear" if is_matrix else "plain")


def hf_shape(t: HFTensor, our_shape: tuple) -> tuple:
    if t.kind == "linear":
        return tuple(reversed(our_shape))
    if t.kind in ("experts_gate_up", "experts_down"):
        return (our_shape[0], our_shape[2], our_shape[1])
    return tuple(our_shape)


def to_hf_layout(t: HFTensor, x: np.ndarray) -> np.ndarray:
    if t.kind == "linear":
        return x.T
    if t.kind in ("experts_gate_up", "experts_down"):
        return np.swapaxes(x, 1, 2)
    return x


def abstract_model(cfg: ModelConfig, dtype="float32", fp8_modules=()) -> GLM53:
    """The model's structure with ShapeDtypeStruct leaves: nothing is allocated. `fp8_modules`: paths of
    the Linear / Experts modules that hold fp8 blocks instead (glm53.fp8.convert)."""
    return nnx.eval_shape(lambda: fp8.convert(GLM53(cfg, rngs=nnx.Rngs(0), dtype=dtype), fp8_modules))


def expected_hf_tensors(cfg: ModelConfig) -> dict[str, tuple]:
    """{HF name: shape} of every tensor a checkpoint of `cfg` must hold (experts in fused form)."""
    flat = nnx.to_flat_state(nnx.state(abstract_model(cfg)))
    out = {}
    for path, var in flat:
        t = hf_tensor(cfg, path)
        out[t.name] = hf_shape(t, var.shape)
    return out


# -------------------------------------------------------------------------------------------- safetensors
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class _SafetensorsFile:
    """Memory-mapped view of one .safetensors file (8-byte little-endian header size, JSON header, data).

    Read directly so that bfloat16 and float8 tensors (which safetensors' numpy/flax readers reject or
    copy to a device) come back as numpy arrays of ml_dtypes types, without copying the file."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header = header
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if header else None

    def keys(self):
        return self.header.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string ("F8_E4M3", "BF16", ...), read from the header."""
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only view of the mapped file (no copy)."""
        info = self.header[name]
        try:
            dtype = _ST_DTYPES[info["dtype"]]
        except KeyError:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}") from None
        start, end = info["data_offsets"]
        return self._data[start:end].view(dtype).reshape(info["shape"])


class _CheckpointReader:
    """Lazy access to the tensors of a single-file or sharded (index json) safetensors checkpoint."""

    def __init__(self, directory: Path):
        index = directory / SAFETENSORS_INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            paths = {name: directory / f for name, f in weight_map.items()}
            for f in set(paths.values()):
                if not f.exists():
                    raise FileNotFoundError(f"{index} names shard {f.name}, which does not exist")
            shards = {f: _SafetensorsFile(f) for f in set(paths.values())}
            self.files = {name: shards[f] for name, f in paths.items()}
        else:
            single = sorted(directory.glob("*.safetensors"))
            if not single:
                raise FileNotFoundError(f"no *.safetensors files and no {SAFETENSORS_INDEX} in {directory}")
            self.files = {}
            for f in single:
                st = _SafetensorsFile(f)
                self.files.update({name: st for name in st.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> Iterator[str]:
        return iter(self.files)

    def shape(self, name: str) -> tuple:
        return self.files[name].shape(name)

    def dtype_name(self, name: str) -> str:
        return self.files[name].dtype_name(name)

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (a view of the mapped file)."""
        return self.files[name].get(name)

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32. float8 weights must come with `<name>_scale_inv` (one fp32 scale per
        128 x 128 block of the last two axes) and are dequantised."""
        x = self.files[name].get(name)
        if x.dtype not in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            return x.astype(np.float32)
        scale_name = name + "_scale_inv"
        if scale_name not in self.files:
            raise ValueError(f"tensor {name} is {x.dtype} but the checkpoint has no {scale_name} to dequantise it")
        scale = self.files[scale_name].get(scale_name)
        want = x.shape[:-2] + tuple(-(-n // FP8_BLOCK) for n in x.shape[-2:])
        if scale.shape != want:
            raise ValueError(f"tensor {scale_name} has shape {list(scale.shape)}, expected {list(want)} "
                             f"(one scale per {FP8_BLOCK}x{FP8_BLOCK} block of {name} {list(x.shape)})")
        return _dequantize_fp8_blocks(x, scale)


def _dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """w [..., rows, cols] float8, scale_inv [..., ceil(rows/128), ceil(cols/128)] -> float32 w * scale
    of its 128 x 128 block."""
    rows, cols = w.shape[-2:]
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, -2), FP8_BLOCK, -1)[..., :rows, :cols]
    return w.astype(np.float32) * s


FP8_STORED = "F8_E4M3"
_SCALE_DTYPES = ("F32", "BF16", "F16")


class _Loader:
    """Reads the tensors of one checkpoint against expected shapes, collecting every problem and the set
    of tensor names it consumed (so leftovers can be reported)."""

    def __init__(self, reader: _CheckpointReader):
        self.reader = reader
        self.problems: list[str] = []
        self.used: set[str] = set()

    def tensor(self, name: str, want_shape: tuple) -> np.ndarray | None:
        self.used.add(name)
        if name not in self.reader:
            self.problems.append(f"missing tensor {name} (expected shape {list(want_shape)})")
            return None
        got = self.reader.shape(name)
        if got != tuple(want_shape):
            self.problems.append(f"tensor {name} has shape {list(got)}, expected {list(want_shape)}")
            return None
        self.used.add(name + "_scale_inv")
        try:
            return self.reader.get(name)
        except ValueError as e:
            self.problems.append(str(e))
            return None

    def _fp8_raw(self, name: str, want_shape: tuple, *, scale: bool) -> np.ndarray | None:
        """A stored fp8 weight (scale=False) or its block scales (scale=True), checked, as a view of the
        mapped file; None (and a problem recorded) if missing, mis-shaped or of the wrong dtype."""
        self.used.add(name)
        if name not in self.reader:
            self.problems.append(f"missing tensor {name} (expected shape {list(want_shape)})")
            return None
        got = self.reader.shape(name)
        if got != tuple(want_shape):
            why = (f" (one scale per {FP8_BLOCK}x{FP8_BLOCK} block of {name.removesuffix('_scale_inv')})"
                   if scale else "")
            self.problems.append(f"tensor {name} has shape {list(got)}, expected {list(want_shape)}{why}")
            return None
        dt = self.reader.dtype_name(name)
        if dt not in (_SCALE_DTYPES if scale else (FP8_STORED,)):
            want = f"one of {list(_SCALE_DTYPES)}" if scale else f"{FP8_STORED} (float8_e4m3fn)"
            self.problems.append(f"tensor {name} is {dt}, expected {want}")
            return None
        return self.reader.raw(name)

    def fp8_param(self, t: HFTensor, want_shape: tuple, *, scale: bool) -> np.ndarray | None:
        """One parameter of an fp8 module (weight or block scales) in our layout. `want_shape` is the HF
        shape (experts: the fused one). It is built in one host array of its in-memory dtype straight
        from the mapped file: a weight stays float8 (1 byte per value), no float copy of it is made;
        scales become float32."""
        dtype = np.float32 if scale else ml_dtypes.float8_e4m3fn
        if t.kind == "linear" or t.name.removesuffix("_scale_inv") in self.reader:  # a matrix, or fused experts
            x = self._fp8_raw(t.name, want_shape, scale=scale)
            if x is None:
                return None
            return np.ascontiguousarray(x.T if t.kind == "linear" else np.swapaxes(x, 1, 2)).astype(dtype, copy=False)
        prefix = t.name.rsplit(".", 1)[0]  # model.layers.i.mlp.experts
        leaf = "weight_scale_inv" if scale else "weight"
        e, a, b = want_shape
        if t.kind == "experts_gate_up":
            parts = [("gate_proj", slice(0, a // 2)), ("up_proj", slice(a // 2, a))]
        else:
            parts = [("down_proj", slice(0, a))]
        out = np.empty((e, b, a), dtype)  # our layout [E, in, out]
        ok = True
        for i in range(e):
            for proj, cols in parts:
                x = self._fp8_raw(f"{prefix}.{i}.{proj}.{leaf}", (cols.stop - cols.start, b), scale=scale)
                if x is None:
                    ok = False
                else:
                    out[i, :, cols] = x.T
        return out if ok else None

    def experts(self, t: HFTensor, want_shape: tuple) -> np.ndarray | None:
        """Fused tensor if present, else stack the per-expert tensors. `want_shape` is the fused HF shape."""
        if t.name in self.reader:
            return self.tensor(t.name, want_shape)
        prefix = t.name.rsplit(".", 1)[0]  # model.layers.i.mlp.experts
        e, a, b = want_shape
        if t.kind == "experts_gate_up":
            parts = []
            for i in range(e):
                g = self.tensor(f"{prefix}.{i}.gate_proj.weight", (a // 2, b))
                u = self.tensor(f"{prefix}.{i}.up_proj.weight", (a // 2, b))
                parts.append(None if g is None or u is None else np.concatenate([g, u], 0))
        else:
            parts = [self.tensor(f"{prefix}.{i}.down_proj.weight", (a, b)) for i in range(e)]
        return None if any(p is None for p in parts) else np.stack(parts)


def _drop_absent_mtp(config: ModelConfig, reader: _CheckpointReader, directory: Path) -> ModelConfig:
    """transformers' save_pretrained keeps `num_nextn_predict_layers` in config.json but writes no MTP
    tensors: load such a checkpoint without its MTP layers (with a warning) rather than failing."""
    n = config.num_nextn_predict_layers
    if n == 0:
        return config
    prefixes = tuple(f"model.layers.{config.num_hidden_layers + j}." for j in range(n))
    if any(name.startswith(prefixes) for name in reader.names()):
        return config
    log.warning("%s: config.json declares %d MTP layer(s) but the checkpoint has no model.layers.%d.* tensors; "
                "loading without MTP", directory, n, config.num_hidden_layers)
    return config.replace(num_nextn_predict_layers=0)


def from_pretrained(directory: str | os.PathLike, dtype="float32", *, quantization: str | None = None,
                    config: ModelConfig | None = None, on_host: bool = False) -> GLM53:
    """Load an HF GlmMoeDsaForCausalLM checkpoint directory (config.json + safetensors, single file or
    sharded with model.safetensors.index.json). The MTP layers (at layer index num_hidden_layers + j) are
    loaded when config.json declares `num_nextn_predict_layers` and the checkpoint holds them.

    `dtype`: the activation dtype and that of every float weight. `quantization`: None dequantises any
    fp8 block-quantised weight on load (to float32, then `dtype`); "fp8" keeps them in fp8 in memory
    (the layers glm53.fp8 names, as `Fp8Linear` / `Fp8Experts` computing with fp8 activations,
    attention.fp8_matmul): each such tensor is copied from the mapped file into one float8 array, never
    into a float one. Needs a checkpoint whose quantised layers are float8_e4m3fn with 128 x 128
    `weight_scale_inv` blocks; its `quantization_config`, if any, must say so (quant_method "fp8", fmt
    "e4m3", activation_scheme "dynamic", weight_block_size [128, 128]), and its
    `modules_to_not_convert` keeps the modules it names in float. A layer the rules would quantise but
    the checkpoint stores in float stays float (with a warning).

    `on_host`: keep every weight in host memory (numpy arrays) for a `glm53.Engine` to place, instead of
    on JAX's default device. Under tensor or expert parallelism each device then receives only its
    slice (`parallel.tp.place_state` lays the weights out on the host and transfers the shards), so a
    model larger than one device (GLM-5.3: ~750 GB of fp8 weights against 141 GB per H200) can load;
    the one-shot API on such a model moves the weights at every call.

    Raises ValueError naming every missing or mis-shaped tensor, a bad `quantization`, a
    quantization_config it cannot serve, and a checkpoint without fp8 layers asked for "fp8".
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    directory = Path(directory)
    cfg_file = directory / "config.json"
    hf = json.loads(cfg_file.read_text()) if cfg_file.exists() else None
    if config is None:
        if hf is None:
            raise FileNotFoundError(f"{cfg_file} not found")
        config = from_hf_config(hf)
    reader = _CheckpointReader(directory)
    config = _drop_absent_mtp(config, reader, directory)
    fp8_paths = []
    if quantization == "fp8":
        fp8_paths = _fp8_plan(config, reader, _fp8_not_converted(hf, cfg_file), directory)
    graphdef, state = nnx.split(abstract_model(config, dtype, fp8_paths))
    flat = nnx.to_flat_state(state)
    loader = _Loader(reader)
    fp8_set = set(fp8_paths)
    xp = np if on_host else jnp
    values = []
    for path, var in flat:
        t = hf_tensor(config, path)
        want = hf_shape(t, var.shape)
        if tuple(path[:-1]) in fp8_set:
            x = loader.fp8_param(t, want, scale=path[-1].endswith("_scale_inv"))
            values.append(None if x is None else xp.asarray(x))
            continue
        x = loader.experts(t, want) if t.kind.startswith("experts") else loader.tensor(t.name, want)
        values.append(None if x is None else xp.asarray(to_hf_layout(t, x), dtype=var.dtype))  # involution
    if loader.problems:
        raise ValueError(f"checkpoint {directory} does not match its config ({len(loader.problems)} problems):\n  "
                         + "\n  ".join(loader.problems))
    unexpected = [n for n in reader.names() if n not in loader.used and not _is_mtp_copy(config, n)]
    if unexpected:
        log.warning("ignoring %d tensors of %s that the model does not use, e.g. %s",
                    len(unexpected), directory, unexpected[:5])
    for (_, var), x in zip(flat, values):
        var.set_value(x)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _fp8_not_converted(hf: dict | None, source: Path) -> tuple[str, ...]:
    """Check an HF config's `quantization_config` for quantization="fp8" -> its modules_to_not_convert.
    Without a quantization_config the stored dtypes alone decide (block size 128, transformers' default)."""
    qc = (hf or {}).get("quantization_config")
    if qc is None:
        return ()

    def bad(field, allowed, got):
        raise ValueError(f"{source}: quantization_config.{field} must be {allowed} for quantization='fp8', got {got!r}")

    if not isinstance(qc, dict):
        bad("", "a dict", qc)
    if qc.get("quant_method") != "fp8":
        bad("quant_method", "'fp8' (block-quantised fp8 weights)", qc.get("quant_method"))
    if qc.get("fmt", "e4m3") != "e4m3":
        bad("fmt", "'e4m3' (float8_e4m3fn)", qc.get("fmt"))
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        bad("activation_scheme", "'dynamic' (activation scales computed per token at run time)",
            qc.get("activation_scheme"))
    block = qc.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if not isinstance(block, list | tuple) or list(block) != [FP8_BLOCK, FP8_BLOCK]:
        bad("weight_block_size", f"[{FP8_BLOCK}, {FP8_BLOCK}]", block)
    keep = qc.get("modules_to_not_convert") or []
    if not isinstance(keep, list | tuple) or not all(isinstance(k, str) for k in keep):
        bad("modules_to_not_convert", "a list of module names", keep)
    return tuple(keep)


def _fp8_plan(config: ModelConfig, reader: _CheckpointReader, not_converted: tuple[str, ...], directory: Path) -> list:
    """Paths of the modules to hold in fp8: those glm53.fp8 quantises, less `not_converted`, whose stored
    weights are all float8_e4m3fn (their scales are checked when they load)."""
    model = abstract_model(config)
    modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
    paths, kept, problems = [], [], []
    for path in fp8.eligible_modules(model):
        name = fp8.hf_module_name(config, path)
        if fp8.not_converted(name, not_converted):
            continue
        if isinstance(modules[path], Experts):
            fused = [f"{name}.gate_up_proj", f"{name}.down_proj"]
            names = fused if any(n in reader for n in fused) else [
                f"{name}.{i}.{proj}.weight" for i in range(config.n_routed_experts)
                for proj in ("gate_proj", "up_proj", "down_proj")]
        else:
            names = [f"{name}.weight"]
        stored = {reader.dtype_name(n) for n in names if n in reader}
        if not stored:
            continue  # missing: the load names it
        if stored == {FP8_STORED}:
            paths.append(path)
        elif FP8_STORED in stored:
            problems.append(f"{name}: some weights are {FP8_STORED} and some {sorted(stored - {FP8_STORED})}; "
                            "an fp8 layer needs all of them in fp8")
        else:
            kept.append(f"{name} ({'/'.join(sorted(stored))})")
    if problems:
        raise ValueError(f"checkpoint {directory} cannot load with quantization='fp8' ({len(problems)} problems):\n  "
                         + "\n  ".join(problems))
    if not paths:
        raise ValueError(f"quantization='fp8' but checkpoint {directory} stores none of the layers an fp8 checkpoint "
                         f"quantises as {FP8_STORED} with weight_scale_inv blocks; load it with quantization=None")
    if kept:
        log.warning("quantization='fp8': %d layers of %s that fp8 checkpoints quantise are stored in float and stay "
                    "float, e.g. %s", len(kept), directory, kept[:5])
    return paths


def _is_mtp_copy(cfg: ModelConfig, name: str) -> bool:
    """MTP layers may carry their own copies of the embedding and lm_head; they equal the main model's."""
    return any(name in (f"model.layers.{cfg.num_hidden_layers + j}.embed_tokens.weight",
                        f"model.layers.{cfg.num_hidden_layers + j}.shared_head.head.weight")
               for j in range(cfg.num_nextn_predict_layers))


def save_pretrained(model: GLM53, directory: str | os.PathLike, *, max_shard_bytes: int | None = None,
                    experts: str = "per_expert") -> None:
    """Write `model` as an HF checkpoint (config.json + safetensors, sharded when it exceeds
    `max_shard_bytes`). `experts`: "per_expert" (released-checkpoint layout) or "fused" (transformers 5).

    Float weights are written as float32. The fp8 layers of a quantised model (glm53.fp8) are written as
    block-quantised checkpoints store them: `…weight` float8_e4m3fn and `…weight_scale_inv` float32
    (per expert: `experts.{e}.gate_proj.weight_scale_inv`, ...), with config.json's
    `quantization_config` (glm53.fp8.quantization_config).

    Files are written to a temporary directory first and each is then renamed into `directory`, so a
    failure leaves no half-written file. Other files already in `directory` (a tokenizer, a generation
    config) are kept; old weight files (`model*.safetensors`, the index) are replaced."""
    from safetensors.numpy import save_file

    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts must be 'per_expert' or 'fused', got {experts!r}")
    cfg = model.cfg
    quant_config = fp8.quantization_config(model)
    if quant_config and experts == "fused" and cfg.moe_intermediate_size % FP8_BLOCK and any(
            "experts" in p for p in fp8.fp8_modules(model)):
        raise ValueError(f"experts='fused' cannot hold fp8 experts with moe_intermediate_size "
                         f"{cfg.moe_intermediate_size} (not a multiple of {FP8_BLOCK}: gate and up are blocked "
                         "separately); use experts='per_expert'")
    tensors: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        t = hf_tensor(cfg, path)
        v = var[...]
        v = v if v.dtype == jnp.float8_e4m3fn else jnp.asarray(v, jnp.float32)
        x = np.ascontiguousarray(to_hf_layout(t, np.asarray(v)))
        if t.kind.startswith("experts") and experts == "per_expert":
            prefix = t.name.rsplit(".", 1)[0]
            leaf = "weight_scale_inv" if path[-1].endswith("_scale_inv") else "weight"
            for i in range(x.shape[0]):
                if t.kind == "experts_gate_up":
                    g, u = np.split(x[i], 2, axis=0)
                    tensors[f"{prefix}.{i}.gate_proj.{leaf}"] = np.ascontiguousarray(g)
                    tensors[f"{prefix}.{i}.up_proj.{leaf}"] = np.ascontiguousarray(u)
                else:
                    tensors[f"{prefix}.{i}.down_proj.{leaf}"] = np.ascontiguousarray(x[i])
        else:
            tensors[t.name] = x
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        shards, shard, size = [], {}, 0
        for name in sorted(tensors):
            nbytes = tensors[name].nbytes
            if shard and max_shard_bytes is not None and size + nbytes > max_shard_bytes:
                shards.append(shard)
                shard, size = {}, 0
            shard[name] = tensors[name]
            size += nbytes
        shards.append(shard)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, sh in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in sh})
            total = sum(x.nbytes for x in tensors.values())
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        hf_cfg = to_hf_config(cfg)
        hf_cfg["torch_dtype"] = "float32"
        if quant_config:
            hf_cfg["quantization_config"] = quant_config
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=1))
        directory.mkdir(exist_ok=True)
        for old in [*directory.glob("model*.safetensors"), directory / SAFETENSORS_INDEX]:
            old.unlink(missing_ok=True)
        for f in tmp.iterdir():
            os.replace(f, directory / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- orbax
CONFIG_FILE = "glm53_config.json"


def save(model: GLM53, directory: str | os.PathLike) -> None:
    """Save parameters with orbax plus the ModelConfig (JSON) under `directory` (must not exist). Written
    beside it and renamed into place, so an interrupted save leaves no partial checkpoint."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"{directory} exists; choose a new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", state)
        meta = {"config": dataclasses.asdict(model.cfg), "dtype": jnp.dtype(model.dtype).name,
                "fp8_modules": [list(p) for p in fp8.fp8_modules(model)]}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def restore(directory: str | os.PathLike) -> GLM53:
    """Inverse of `save` (fp8 modules come back with the default fp8 matmul impl, "auto")."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    meta = json.loads((directory / CONFIG_FILE).read_text())
    cfg = ModelConfig(**meta["config"])
    model = abstract_model(cfg, meta["dtype"], [tuple(p) for p in meta.get("fp8_modules", [])])
    graphdef, state = nnx.split(model)
    target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckptr:
        values = ckptr.restore(directory / "params", target)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def param_count(cfg: ModelConfig, *, include_mtp: bool = True) -> int:
    """Number of parameters, from the model definition's shapes (nothing allocated)."""
    return sum(n for _, n in _param_sizes(cfg, include_mtp))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters that touch one token in one forward pass of the main model (MTP excluded): every
    non-expert weight except the input embedding table (a lookup, not a matmul), plus
    num_experts_per_tok of the n_routed_experts routed experts of each MoE layer."""
    total = 0
    for path, n in _param_sizes(cfg, include_mtp=False):
        if path[0] == "embed_tokens":
            continue
        if "experts" in path and path[-1] in ("gate_up_proj", "down_proj"):
            n = n // cfg.n_routed_experts * cfg.num_experts_per_tok
        total += n
    return total


def _param_sizes(cfg: ModelConfig, include_mtp: bool):
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)):
        if include_mtp or path[0] != "mtp":
            yield path, math.prod(var.shape)
