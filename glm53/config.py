"""GLM-5.3 model configuration.

`ModelConfig` is a frozen dataclass holding every architectural field of GLM-5.3 (HF `model_type =
glm_moe_dsa`). It is validated on construction: a bad value raises `ValueError` naming the field.

Layer structure (see ../shared/BRIEF.md §1):
- `indexer_types[i]` is "full" when layer i runs its own lightning indexer and "shared" when it reuses the
  top-k indices of the nearest earlier full layer (IndexShare). Derived from `index_topk_freq` /
  `index_skip_topk_offset` (layer i is full iff `max(i - offset + 1, 0) % freq == 0`) unless given.
- `mlp_layer_types[i]` is "dense" (SwiGLU MLP of `intermediate_size`) or "sparse" (MoE).
- `num_nextn_predict_layers` MTP layers follow the main layers; each is a full decoder layer (MoE MLP, own
  indexer) plus the MTP projections. In HF checkpoints MTP layer j is stored at layer index
  `num_hidden_layers + j`.

Presets: "glm-5.3" (full size; only its counts are computed on CPU), "tiny" (same structure, runs on CPU
in seconds) and "mid" (the mid-size config of the model benchmark).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")


def indexer_pattern(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """IndexShare schedule: layer i is "full" iff max(i - offset + 1, 0) % freq == 0.

    GLM-5.3 (78 layers, freq 4, offset 3) gives full layers {0, 1, 2, 6, 10, ..., 74}: 21 of 78.
    """
    if freq < 1:
        raise ValueError(f"index_topk_freq must be >= 1, got {freq}")
    if offset < 0:
        raise ValueError(f"index_skip_topk_offset must be >= 0, got {offset}")
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GLM-5.3-style model. Units: counts and widths in elements.

    Invariants (checked in __post_init__): all sizes positive; `len(indexer_types) == len(mlp_layer_types)
    == num_hidden_layers`; layer 0 is a full indexer layer; `n_routed_experts % n_group == 0`;
    `topk_group <= n_group`; the experts in the chosen groups can supply `num_experts_per_tok`;
    `qk_rope_head_dim` is even and `<= index_head_dim` (the indexer ropes its first rope-width dims).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense SwiGLU MLP width
    moe_intermediate_size: int  # width of one routed (and of the shared) expert
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_nextn_predict_layers: int = 0
    rope_theta: float = 8e6
    max_position_embeddings: int = 1_048_576
    rms_norm_eps: float = 1e-5  # input, post-attention, final and MTP norms
    latent_norm_eps: float = 1e-6  # q_a_layernorm and kv_a_layernorm (HF's class default)
    indexer_norm_eps: float = 1e-6  # the indexer's k_norm LayerNorm
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        # Normalise list-valued fields to tuples so the config stays hashable (it is a jit static arg).
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        self._validate()

    # ----------------------------------------------------------------------------------------- validation
    def _validate(self):
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "index_n_heads", "index_head_dim", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.index_topk, int) or self.index_topk < 1:
            raise ValueError(f"ModelConfig.index_topk must be an int >= 1, got {self.index_topk!r}")
        for name in ("n_shared_experts", "num_nextn_predict_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("rope_theta", "routed_scaling_factor", "rms_norm_eps", "latent_norm_eps", "indexer_norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"ModelConfig.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"ModelConfig.index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer applies RoPE to its first qk_rope_head_dim dims"
            )
        for name, allowed in (("indexer_types", INDEXER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            values = getattr(self, name)
            if len(values) != self.num_hidden_layers:
                raise ValueError(
                    f"ModelConfig.{name} has {len(values)} entries, expected num_hidden_layers={self.num_hidden_layers}"
                )
            for i, v in enumerate(values):
                if v not in allowed:
                    raise ValueError(f"ModelConfig.{name}[{i}] = {v!r} is not one of {allowed}")
        if self.indexer_types[0] != "full":
            raise ValueError("ModelConfig.indexer_types[0] must be 'full': a shared layer needs an earlier full layer")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"ModelConfig.n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"ModelConfig.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
            raise ValueError("ModelConfig.n_group: grouped routing scores a group by its top-2 experts, so each "
                             f"group needs >= 2 experts (n_routed_experts={self.n_routed_experts}, n_group={self.n_group})")
        eligible = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > eligible:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {eligible} experts "
                f"in topk_group={self.topk_group} groups"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"ModelConfig.hidden_act must be 'silu', got {self.hidden_act!r}")

    # --------------------------------------------------------------------------------- derived structure
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA's softmax scale (qk_nope + qk_rope)^-0.5 (HF's `head_dim` field is the rope width: unused)."""
        return self.qk_head_dim ** -0.5

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def layer_indexer_type(self, layer: int) -> str:
        """Indexer type of any layer id; MTP layers (ids >= num_hidden_layers) always run their own indexer."""
        return self.indexer_types[layer] if layer < self.num_hidden_layers else "full"

    def layer_mlp_type(self, layer: int) -> str:
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else "sparse"

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """Layer ids (main and MTP) that run an indexer and therefore cache indexer keys."""
        return tuple(i for i in range(self.num_layers_with_mtp) if self.layer_indexer_type(i) == "full")

    def topk_source_layer(self, layer: int) -> int:
        """The full layer whose top-k indices `layer` uses (itself when full)."""
        while self.layer_indexer_type(layer) != "full":
            layer -= 1
        return layer

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def first_layers(self, n: int) -> ModelConfig:
        """The model cut to its first `n` decoder layers, each keeping its indexer and MLP type (the MTP
        layers unchanged): what the quick runs of a benchmark or a check compile."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ValueError(f"first_layers: n must be in [1, {self.num_hidden_layers}], got {n}")
        return self.replace(num_hidden_layers=n, indexer_types=self.indexer_types[:n],
                            mlp_layer_types=self.mlp_layer_types[:n])


def make_config(
    *,
    num_hidden_layers: int,
    index_topk_freq: int = 1,
    index_skip_topk_offset: int = 0,
    first_k_dense_replace: int = 0,
    indexer_types: Sequence[str] | None = None,
    mlp_layer_types: Sequence[str] | None = None,
    **fields: Any,
) -> ModelConfig:
    """Build a ModelConfig, deriving the per-layer patterns from the HF-style schedule fields.

    An explicit `indexer_types` / `mlp_layer_types` wins over `index_topk_freq` / `index_skip_topk_offset` /
    `first_k_dense_replace` (as in HF's config).
    """
    if indexer_types is None:
        indexer_types = indexer_pattern(num_hidden_layers, index_topk_freq, index_skip_topk_offset)
    if mlp_layer_types is None:
        if first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be >= 0, got {first_k_dense_replace}")
        n_dense = min(first_k_dense_replace, num_hidden_layers)
        mlp_layer_types = ("dense",) * n_dense + ("sparse",) * (num_hidden_layers - n_dense)
    return ModelConfig(
        num_hidden_layers=num_hidden_layers,
        indexer_types=tuple(indexer_types),
        mlp_layer_types=tuple(mlp_layer_types),
        **fields,
    )


# ------------------------------------------------------------------------------------------------- presets
# GLM-5.3's schedule fields (make_config's arguments); the small presets are differences over it
_GLM53 = dict(
    vocab_size=154_880, hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    intermediate_size=12_288, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=32, index_head_dim=128, index_topk=2048, index_topk_freq=4, index_skip_topk_offset=3,
    first_k_dense_replace=3, num_nextn_predict_layers=1, rope_theta=8e6, max_position_embeddings=1_048_576,
)
# GLM-5.3's structure at toy width: 8 layers with IndexShare freq 4 / offset 3 (full, full, full, shared,
# shared, shared, full, shared), 3 dense then MoE layers, one MTP layer. Every width is a power of two so
# Triton-style kernels can use the same shapes. vocab 512 covers byte-level text.
_TINY = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
    q_lora_rank=64, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    index_n_heads=8, index_head_dim=32, index_topk=16, rope_theta=10_000.0, max_position_embeddings=65_536,
)
# The mid-size config of experiments/bench_model.py. Fields the benchmark's spec left open are ours: vocab
# 4096, dense MLP 1024 (first layer), expert width 256, one shared expert.
_MID = dict(
    vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
    q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=2,
    index_n_heads=4, index_head_dim=64, index_topk=256, first_k_dense_replace=1, num_nextn_predict_layers=0,
    rope_theta=10_000.0, max_position_embeddings=65_536,
)


def _glm53() -> ModelConfig:
    return make_config(**_GLM53)


def _tiny() -> ModelConfig:
    return make_config(**{**_GLM53, **_TINY})


def _mid() -> ModelConfig:
    return make_config(**{**_GLM53, **_MID})


PRESETS = {"glm-5.3": _glm53, "tiny": _tiny, "mid": _mid}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


# ------------------------------------------------------------------------------------------ HF config.json
def from_hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Read an HF `glm_moe_dsa` config.json dict.

    Follows HF's GlmMoeDsaConfig: explicit `indexer_types` / `mlp_layer_types` win; otherwise
    `index_topk_pattern` ("FSS..."), else `index_topk_freq` (default 1) / `index_skip_topk_offset`
    (default 2) and `first_k_dense_replace` (default 3). `head_dim` is ignored (HF overwrites it with the
    rope width). RoPE theta is read from `rope_parameters` (or a legacy top-level `rope_theta`); only
    plain ("default") RoPE is supported.
    """
    hf = dict(hf)
    model_type = hf.get("model_type", "glm_moe_dsa")
    if model_type != "glm_moe_dsa":
        raise ValueError(f"config.json model_type must be 'glm_moe_dsa', got {model_type!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    n_heads = hf.get("num_attention_heads", 64)
    n_kv = hf.get("num_key_value_heads", n_heads)
    if n_kv != n_heads:
        raise ValueError(
            f"num_key_value_heads ({n_kv}) must equal num_attention_heads ({n_heads}): MLA has no KV-head grouping"
        )
    num_layers = hf.get("num_hidden_layers", 78)
    indexer_types = hf.get("indexer_types")
    if indexer_types is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        if isinstance(pattern, str):
            try:
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            except KeyError as e:
                raise ValueError(f"index_topk_pattern: unknown letter {e.args[0]!r} (allowed 'F', 'S')") from None
        else:
            indexer_types = list(pattern)
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported (GLM-5.3 has no attention biases)")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    return make_config(
        vocab_size=hf.get("vocab_size", 154_880),
        hidden_size=hf.get("hidden_size", 6144),
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        q_lora_rank=hf.get("q_lora_rank", 2048),
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 192),
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        v_head_dim=hf.get("v_head_dim", 256),
        intermediate_size=hf.get("intermediate_size", 12_288),
        moe_intermediate_size=hf.get("moe_intermediate_size", 2048),
        n_routed_experts=hf.get("n_routed_experts", hf.get("num_experts", 256)),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        n_shared_experts=hf.get("n_shared_experts", 1),
        n_group=hf.get("n_group", 1),
        topk_group=hf.get("topk_group", 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        index_n_heads=hf.get("index_n_heads", 32),
        index_head_dim=hf.get("index_head_dim", 128),
        index_topk=hf.get("index_topk", 2048),
        indexer_types=indexer_types,
        mlp_layer_types=hf.get("mlp_layer_types"),
        index_topk_freq=max(hf.get("index_topk_freq", 1), 1),
        index_skip_topk_offset=hf.get("index_skip_topk_offset", 2),
        first_k_dense_replace=hf.get("first_k_dense_replace", 3),
        num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
        rope_theta=float(rope_theta),
        max_position_embeddings=hf.get("max_position_embeddings", 202_752),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_act=hf.get("hidden_act", "silu"),
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dict for `cfg` (explicit per-layer patterns, so it round-trips exactly)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "indexer_types": list(cfg.indexer_types),
        "mlp_layer_types": list(cfg.mlp_layer_types),
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "attention_bias": False,
    }
