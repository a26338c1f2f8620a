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
  dequantised on load.

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

from glm53.config import ModelConfig, from_hf_config, to_hf_config
from glm53.model import GLM53

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
FP8_BLOCK = 128


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
    if sub[-2:] == ("experts", "gate_up_proj"):
        return HFTensor(name, "experts_gate_up")
    if sub[-2:] == ("experts", "down_proj"):
        return HFTensor(name, "experts_down")
    is_matrix = sub[-1] == "weight" and sub[-2] not in ("input_layernorm", "post_attention_layernorm", "norm",
                                                        "q_a_layernorm", "kv_a_layernorm", "k_norm", "enorm", "hnorm")
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


def abstract_model(cfg: ModelConfig, dtype="float32") -> GLM53:
    """The model's structure with ShapeDtypeStruct leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: GLM53(cfg, rngs=nnx.Rngs(0), dtype=dtype))


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

    def get(self, name: str) -> np.ndarray:
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


def from_pretrained(directory: str | os.PathLike, dtype="float32", *, config: ModelConfig | None = None) -> GLM53:
    """Load an HF GlmMoeDsaForCausalLM checkpoint directory (config.json + safetensors, single file or
    sharded with model.safetensors.index.json). The MTP layers (at layer index num_hidden_layers + j) are
    loaded when config.json declares `num_nextn_predict_layers` and the checkpoint holds them.

    Raises ValueError naming every missing or mis-shaped tensor.
    """
    directory = Path(directory)
    if config is None:
        cfg_file = directory / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{cfg_file} not found")
        config = from_hf_config(json.loads(cfg_file.read_text()))
    reader = _CheckpointReader(directory)
    config = _drop_absent_mtp(config, reader, directory)
    graphdef, state = nnx.split(abstract_model(config, dtype))
    flat = nnx.to_flat_state(state)
    loader = _Loader(reader)
    values = []
    for path, var in flat:
        t = hf_tensor(config, path)
        want = hf_shape(t, var.shape)
        x = loader.experts(t, want) if t.kind.startswith("experts") else loader.tensor(t.name, want)
        values.append(None if x is None else jnp.asarray(to_hf_layout(t, x), dtype=var.dtype))  # involution
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


def _is_mtp_copy(cfg: ModelConfig, name: str) -> bool:
    """MTP layers may carry their own copies of the embedding and lm_head; they equal the main model's."""
    return any(name in (f"model.layers.{cfg.num_hidden_layers + j}.embed_tokens.weight",
                        f"model.layers.{cfg.num_hidden_layers + j}.shared_head.head.weight")
               for j in range(cfg.num_nextn_predict_layers))


def save_pretrained(model: GLM53, directory: str | os.PathLike, *, max_shard_bytes: int | None = None,
                    experts: str = "per_expert") -> None:
    """Write `model` as an HF checkpoint (config.json + safetensors, sharded when it exceeds
    `max_shard_bytes`). `experts`: "per_expert" (released-checkpoint layout) or "fused" (transformers 5).

    Files are written to a temporary directory first and each is then renamed into `directory`, so a
    failure leaves no half-written file. Other files already in `directory` (a tokenizer, a generation
    config) are kept; old weight files (`model*.safetensors`, the index) are replaced."""
    from safetensors.numpy import save_file

    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts must be 'per_expert' or 'fused', got {experts!r}")
    cfg = model.cfg
    tensors: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        t = hf_tensor(cfg, path)
        x = np.ascontiguousarray(to_hf_layout(t, np.asarray(jnp.asarray(var[...], jnp.float32))))
        if t.kind.startswith("experts") and experts == "per_expert":
            prefix = t.name.rsplit(".", 1)[0]
            for i in range(x.shape[0]):
                if t.kind == "experts_gate_up":
                    g, u = np.split(x[i], 2, axis=0)
                    tensors[f"{prefix}.{i}.gate_proj.weight"] = np.ascontiguousarray(g)
                    tensors[f"{prefix}.{i}.up_proj.weight"] = np.ascontiguousarray(u)
                else:
                    tensors[f"{prefix}.{i}.down_proj.weight"] = np.ascontiguousarray(x[i])
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
        meta = {"config": dataclasses.asdict(model.cfg), "dtype": jnp.dtype(model.dtype).name}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def restore(directory: str | os.PathLike) -> GLM53:
    """Inverse of `save`."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    meta = json.loads((directory / CONFIG_FILE).read_text())
    cfg = ModelConfig(**meta["config"])
    model = abstract_model(cfg, meta["dtype"])
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
