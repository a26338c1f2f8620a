"""DeployConfig: how the engine runs a model. Field names follow vLLM's flags where one exists."""

from __future__ import annotations

import dataclasses

from attention.formats import MLA_FORMATS
from kvcache.hisparse import hot_buffer_rows
from kvcache.layout import page_bytes

KV_POLICIES = ("preempt", "offload", "hisparse")
IMPLS = ("auto", "reference", "pallas")
GROUPS = ("mla", "indexer")  # the engine's cache groups: MLA rows of every layer, keys of the full layers


@dataclasses.dataclass(frozen=True)
class KVSizes:
    """The sizes one replica's policy and runner both use, from `DeployConfig` and kvcache.layout (so a
    runner that holds no arrays plans and counts with the same numbers).

    kv_cache_dtype: the MLA row format ("auto" resolved to the model's dtype).
    num_blocks: device pool blocks (each a page in every cache group).
    page_bytes: per cache group, the bytes one block holds (every layer, every DCP rank).
    host_blocks: HiSparse's host pools in pages per group ({} under other policies).
    hot_rows / max_leases: HiSparse's hot-buffer rows per request and lease slots (0 without).
    """

    kv_cache_dtype: str
    num_blocks: int
    page_bytes: dict
    host_blocks: dict
    hot_rows: int = 0
    max_leases: int = 0


@dataclasses.dataclass(frozen=True)
class DeployConfig:
    """Engine deployment. Sizes are in tokens, blocks or bytes as the names say.

    kv_cache_dtype: "auto" (the model's dtype) or one of attention.formats.MLA_FORMATS.
    index_block_size: slots per indexer-key page. Indexer keys take ~5% of a token's KV bytes, so with
        pages of block_size tokens an indexer page costs a whole block for a twentieth of its bytes; a
        larger index_block_size (e.g. 4 x block_size) keeps the pool's block count near bytes. Prefix
        hits then end on multiples of index_block_size tokens.
    num_gpu_blocks: blocks in the device pool shared by all cache groups (None: enough for
        max_num_seqs requests of max_model_len tokens, i.e. a pool that never runs out; `kv_sizes`).
    prefill_context_parallel_size / decode_context_parallel_size: PCP (a prefill chunk's tokens split
        over the ranks) and DCP (the KV cache split round-robin over them) on one context mesh axis of
        max(PCP, DCP) devices (parallel.model); with enable_expert_parallel the routed experts are split
        over the same devices. Each is 1 or that axis size.
    data_parallel_size: independent replicas (glm53.engine.engine), each on its own max(PCP, DCP) devices
        with its own scheduler and block pool; pool sizes (num_gpu_blocks, host bytes) are per replica.
    kv_policy: what happens when the pool runs out: "preempt" (drop the victim's KV, recompute it
        later), "offload" (move it to the host pool, bring it back), "hisparse" (keep decoding with most
        MLA KV in a host pool of hisparse_host_pool_bytes; rows the indexer selects come through a hot
        buffer of hisparse_device_buffer_size rows per request, default (num_speculative_tokens + 2) x top-k,
        i.e. 2 x top-k without MTP; kvcache.hisparse).
    """

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_comm_backend: str = "ag_rs"
    cp_kv_cache_interleave_size: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    index_block_size: int | None = None  # tokens per indexer-key page (a multiple of block_size; None: block_size)
    max_model_len: int = 4096
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    kv_policy: str = "preempt"
    num_gpu_blocks: int | None = None
    cpu_offload_bytes: int = 0
    hisparse_host_pool_bytes: int = 0
    hisparse_device_buffer_size: int | None = None
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = True
    sparse_mla_force_mqa: bool = False
    attention_impl: str = "auto"
    host_link_bytes_per_s: float = 50e9

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DeployConfig.{name} must be a positive int, got {v!r}")

        for name in ("data_parallel_size", "tensor_parallel_size", "prefill_context_parallel_size",
                     "decode_context_parallel_size", "cp_kv_cache_interleave_size", "block_size", "max_model_len",
                     "max_num_batched_tokens", "max_num_seqs"):
            positive(name)
        if self.num_gpu_blocks is not None:
            positive("num_gpu_blocks")
        if self.index_block_size is not None:
            positive("index_block_size")
            if self.index_block_size % self.block_size:
                raise ValueError(f"DeployConfig.index_block_size={self.index_block_size} must be a multiple of "
                                 f"block_size={self.block_size}")
        if self.dcp_comm_backend not in ("ag_rs", "a2a"):
            raise ValueError(f"DeployConfig.dcp_comm_backend must be 'ag_rs' or 'a2a', got {self.dcp_comm_backend!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in MLA_FORMATS:
            raise ValueError(f"DeployConfig.kv_cache_dtype must be 'auto' or one of {MLA_FORMATS}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"DeployConfig.kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"DeployConfig.attention_impl must be one of {IMPLS}, got {self.attention_impl!r}")
        if self.cpu_offload_bytes < 0 or self.host_link_bytes_per_s <= 0:
            raise ValueError("DeployConfig.cpu_offload_bytes must be >= 0 and host_link_bytes_per_s > 0")
        pcp, dcp = self.prefill_context_parallel_size, self.decode_context_parallel_size
        if pcp > 1 and dcp > 1 and pcp != dcp:
            raise ValueError(f"DeployConfig.prefill_context_parallel_size={pcp} and decode_context_parallel_size={dcp} "
                             "must be equal when both exceed 1: they share one context mesh axis")
        for name in ("block_size", "index_block_size"):
            size = getattr(self, name)
            if dcp > 1 and size is not None and size % self.cp_kv_cache_interleave_size:
                raise ValueError(f"DeployConfig.cp_kv_cache_interleave_size={self.cp_kv_cache_interleave_size} must "
                                 f"divide {name}={size}: a rank's run of interleaved tokens must not cross a block")
        # What the engine does not run yet: say so instead of silently running something else.
        if self.tensor_parallel_size != 1:
            raise NotImplementedError(f"DeployConfig.tensor_parallel_size={self.tensor_parallel_size}: attention "
                                      "and MLP weights are replicated so far (the context axis and data-parallel "
                                      "replicas are built; tensor parallelism is not)")
        if self.kv_policy == "hisparse" and self.context_parallel_size > 1:
            raise NotImplementedError("DeployConfig.kv_policy='hisparse' with context parallelism: HiSparse "
                                      "residency runs on one device so far")
        if self.kv_policy == "hisparse" and self.hisparse_host_pool_bytes <= 0:
            raise ValueError("DeployConfig.kv_policy='hisparse' needs hisparse_host_pool_bytes > 0 (the host pool "
                             "for MLA pages; cpu_offload_bytes sizes the separate pool for idle indexer keys)")
        if self.hisparse_device_buffer_size is not None:
            positive("hisparse_device_buffer_size")
        if self.kv_policy == "offload" and self.cpu_offload_bytes <= 0:
            raise ValueError("DeployConfig.kv_policy='offload' needs cpu_offload_bytes > 0 (the host pool size)")
        if self.num_speculative_tokens:
            raise NotImplementedError("DeployConfig.num_speculative_tokens: MTP speculative decoding is not built yet")

    @property
    def context_parallel_size(self) -> int:
        """Devices on the context mesh axis: max(PCP, DCP) (1 = one device). Under expert parallelism the
        same devices hold the experts (EP size = this)."""
        return max(self.prefill_context_parallel_size, self.decode_context_parallel_size)

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block id covers: block_size slots on each DCP rank."""
        return self.block_size * self.decode_context_parallel_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.tokens_per_block)

    @property
    def index_tokens_per_block(self) -> int:
        """Tokens one indexer-key block covers (index_block_size slots on each DCP rank)."""
        return (self.index_block_size or self.block_size) * self.decode_context_parallel_size

    @property
    def max_index_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.index_tokens_per_block)

    def kv_sizes(self, cfg, model_dtype: str = "float32") -> KVSizes:
        """This deployment's pool and page sizes for a model of `cfg` (kvcache.layout)."""
        kv_dtype = str(model_dtype) if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        num_blocks = self.num_gpu_blocks or self.max_num_seqs * sum(
            -(-self.max_model_len // n) for n in self.group_tokens_per_block(GROUPS).values())
        pages = page_bytes(cfg, kv_dtype, self.block_size, self.index_block_size,
                           dcp=self.decode_context_parallel_size)
        if self.kv_policy != "hisparse":
            return KVSizes(kv_dtype, num_blocks, pages, {})
        host = {"mla": self.hisparse_host_pool_bytes // pages["mla"],
                "indexer": self.cpu_offload_bytes // pages["indexer"]}
        if host["mla"] < 1:
            raise ValueError(f"DeployConfig.hisparse_host_pool_bytes={self.hisparse_host_pool_bytes} holds no MLA "
                             f"page ({pages['mla']} bytes)")
        hot = hot_buffer_rows(self.hisparse_device_buffer_size, self.num_speculative_tokens, cfg.index_topk)
        return KVSizes(kv_dtype, num_blocks, pages, host, hot, self.max_num_seqs)

    def group_tokens_per_block(self, groups) -> dict[str, int]:
        """Per cache group, the tokens one block covers (kvcache.block_pool.KVCacheManager)."""
        return {g: self.index_tokens_per_block if g == "indexer" else self.tokens_per_block for g in groups}
