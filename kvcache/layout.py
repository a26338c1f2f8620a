"""Byte accounting of the KV cache per token and cache group.

Formats (BRIEF §2; the byte layouts are in attention/formats.py):
- MLA rows, per token per attention layer: "fp8_ds_mla" = kv_lora x e4m3 + one fp32 scale per 128 latent
  values + rope x bf16 (656 B for GLM-5.3); "bfloat16" / "float32" = (kv_lora + rope) values.
- Indexer keys, per token per full indexer layer: "fp8" = index_head_dim x e4m3 + one fp32 scale
  (132 B for GLM-5.3); "bfloat16" / "float32".
MTP layers cache both their MLA rows and their own indexer keys (the published accounting).
"""

from __future__ import annotations

import dataclasses

from attention.formats import INDEX_FORMATS, MLA_FORMATS, IndexKeyFormat, MLARowFormat  # noqa: F401


# The index-key format that goes with each MLA row format by default (vLLM pairs fp8_ds_mla with fp8 keys).
DEFAULT_INDEX_FORMAT = {"fp8_ds_mla": "fp8", "bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def mla_row_bytes(kv_lora_rank: int, rope_dim: int, fmt: str = "fp8_ds_mla") -> int:
    return MLARowFormat(fmt, kv_lora_rank, rope_dim).row_bytes


def index_key_bytes(index_head_dim: int, fmt: str = "fp8") -> int:
    return IndexKeyFormat(fmt, index_head_dim).row_bytes


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """One cache group: `layers` each store `bytes_per_token` bytes per token."""

    name: str
    layers: tuple[int, ...]
    bytes_per_token: int

    @property
    def total_bytes_per_token(self) -> int:
        return len(self.layers) * self.bytes_per_token


def cache_groups(cfg, mla_format: str = "fp8_ds_mla", index_format: str = "fp8", *, include_mtp: bool = True):
    """The model's cache groups: MLA rows of every attention layer, indexer keys of every full layer."""
    n = cfg.num_layers_with_mtp if include_mtp else cfg.num_hidden_layers
    return (
        CacheGroup("mla", tuple(range(n)), mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, mla_format)),
        CacheGroup("indexer", tuple(i for i in cfg.full_indexer_layers if i < n),
                   index_key_bytes(cfg.index_head_dim, index_format)),
    )


def kv_bytes_per_token(cfg, mla_format: str = "fp8_ds_mla", index_format: str = "fp8", *, include_mtp: bool = True) -> int:
    """Bytes of KV cache one token occupies across all layers (54,728 for GLM-5.3 with fp8 formats)."""
    return sum(g.total_bytes_per_token for g in cache_groups(cfg, mla_format, index_format, include_mtp=include_mtp))


def page_bytes(cfg, kv_cache_dtype: str, block_size: int, index_block_size: int | None = None, *, dcp: int = 1,
               include_mtp: bool = False) -> dict[str, int]:
    """Bytes one block id holds in each cache group: a page of `block_size` rows (`index_block_size` for
    the indexer keys) in every layer of the group, on each of the `dcp` ranks. kv_cache_dtype is an MLA
    format (attention.formats.MLA_FORMATS); the keys take its DEFAULT_INDEX_FORMAT. What the host pools
    and the offload policy count their capacity in. include_mtp: the MTP layer's rows and indexer keys too
    (cached only under MTP speculative decoding)."""
    mla, index = cache_groups(cfg, kv_cache_dtype, DEFAULT_INDEX_FORMAT[kv_cache_dtype], include_mtp=include_mtp)
    return {"mla": mla.total_bytes_per_token * block_size * dcp,
            "indexer": index.total_bytes_per_token * (index_block_size or block_size) * dcp}


def block_bytes(pages: dict[str, int]) -> int:
    """Bytes one block id of the device pool reserves: the largest page of any cache group. A block id is
    one page of one group (a request takes separate ids for its MLA and indexer pages, so HiSparse can
    release one without the other), and the groups share one byte budget;
    `DeployConfig.index_block_size` makes the indexer page about as large as an MLA page, so little of a
    block is idle (vLLM instead keeps 64-token pages in every group: docs/simulator.md, "Page layout:
    vLLM's and this engine's"). This is the design's price, which the simulator and the memory plan
    use; the model runner's arrays still hold num_blocks pages of every group (`runner_block_bytes`)
    until the shared buffer exists (docs/memory.md)."""
    return max(pages.values())


def runner_block_bytes(pages: dict[str, int]) -> int:
    """Bytes the model runner allocates per block id today: a page of every group (its PagedKVCache has
    one array per layer and group, each of num_blocks pages), so the sum of the groups' pages, not the
    largest. An engine that sizes its real pool from a byte budget divides by this, so that the arrays
    fit the budget it was given (`DeployConfig.resolved(runner_arrays=True)`)."""
    return sum(pages.values())
