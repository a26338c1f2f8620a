"""GLM-5.3 in JAX: the model, checkpoint loading and (later) its serving engine.

Public API (see ../shared/DESIGN.md):
    model = glm53.from_pretrained("path/to/hf_dir", dtype="float32")
    model = glm53.init("tiny", seed=0)
    logits = glm53.score(model, token_ids)          # np.float32 [T, vocab]
    picked = glm53.topk_indices(model, token_ids)   # {full layer: np.int32 [T, k]}, -1 = none
    batch = glm53.score_batch(model, prompts, kv_cache_dtype="fp8_ds_mla")  # paged cache, ragged batch
"""

from glm53.api import decode_logits, generate, score, score_batch, topk_indices
from glm53.config import ModelConfig, from_hf_config, get_preset, make_config
from glm53.engine import DeployConfig, Engine, SamplingParams
from glm53.model import GLM53, init
from glm53.weights import from_pretrained, restore, save, save_pretrained

__all__ = [
    "DeployConfig", "Engine", "GLM53", "ModelConfig", "SamplingParams", "decode_logits", "from_hf_config", "from_pretrained", "generate", "get_preset",
    "init", "make_config", "restore", "save", "save_pretrained", "score", "score_batch", "topk_indices",
]
