"""DeployConfig: how the engine runs a model. Field names follow vLLM's flags where one exists."""

from __future__ import annotations

import dataclasses
import os

from attention.formats import MLA_FORMATS
from kvcache.events import KVEventsConfig
from kvcache.layout import block_bytes, page_bytes, runner_block_bytes
from kvcache.host_tier import LOAD_FAILURE_POLICIES
from kvcache.policies import REGISTRY, policy_spec
from kvcache.tiers import check_tier_specs
from glm53.engine.spec_decode import SpeculativeConfig

KV_POLICIES = REGISTRY.keys()  # a live view: a policy registered later (register_policy) is accepted
IMPLS = ("auto", "reference", "pallas")
GROUPS = ("mla", "indexer")  # the engine's cache groups: MLA rows of every layer, keys of the full layers
_POSITIVE = ("data_parallel_size", "tensor_parallel_size", "prefill_context_parallel_size",
             "decode_context_parallel_size", "cp_kv_cache_interleave_size", "block_size", "hisparse_prefill_tile_tokens")
_POSITIVE_OR_NONE = ("index_block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "num_gpu_blocks",
                     "kv_cache_memory_bytes", "hisparse_device_buffer_size")
_NON_NEGATIVE = ("cpu_offload_bytes", "hisparse_host_pool_bytes", "num_speculative_tokens")
_BOOLS = ("enable_expert_parallel", "enable_prefix_caching", "sparse_mla_force_mqa")


@dataclasses.dataclass(frozen=True)
class KVSizes:
    """The sizes one replica's policy and runner both use, from `DeployConfig` and kvcache.layout (so a
    runner that holds no arrays plans and counts with the same numbers).

    kv_cache_dtype: the MLA row format ("auto" resolved to the model's dtype).
    num_blocks: device pool blocks (each one page of one cache group, kvcache.layout.block_bytes).
    page_bytes: per cache group, the bytes one block holds (every layer, every DCP rank).
    host_blocks: host pools in pages per group: HiSparse's, or the offload host tier's ({} otherwise).
    hot_rows / max_leases: HiSparse's hot-buffer rows per request and lease slots (0 without).
    """

    kv_cache_dtype: str
    num_blocks: int
    page_bytes: dict
    host_blocks: dict
    hot_rows: int = 0
    max_leases: int = 0


DP_ROUTING = ("salt", "load")  # DeployConfig.dp_routing
_CHOICES = {"dcp_comm_backend": ("ag_rs", "a2a"), "dp_routing": DP_ROUTING, "kv_cache_dtype": ("auto", *MLA_FORMATS),
            "kv_policy": KV_POLICIES, "attention_impl": IMPLS}


# the offload connector's options (kv_transfer_config's kv_connector_extra_config) and their defaults
OFFLOAD_DEFAULTS = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 0, "blocks_per_chunk": 1,
                    "eviction_policy": "lru", "secondary_tiers": []}

# the P/D connector (kv_connector "PdConnector"): its roles, the defaults of its keys, and the name of its
# peer tier (kvcache.tiers.p2p), which carries a request's KV from a producer to its consumer
PD_ROLES = ("kv_producer", "kv_consumer", "kv_both")
PD_DEFAULTS = {"kv_ip": "127.0.0.1", "kv_port": 0}
PD_TIER = "pd"
PD_LEASE_S = 30.0

GiB = 1 << 30
CPU_KV_CACHE_BYTES = 4 * GiB  # vLLM's CPU backend's KV space when VLLM_CPU_KVCACHE_SPACE is unset


def cpu_kv_cache_bytes() -> int:
    """The KV budget on a device that reports no memory (the CPU), as vLLM's CPU backend reads it:
    $VLLM_CPU_KVCACHE_SPACE GiB (an integer >= 0; 0 or unset: CPU_KV_CACHE_BYTES)."""
    raw = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not raw:
        return CPU_KV_CACHE_BYTES
    try:
        gib = int(raw)
    except ValueError:
        gib = -1
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB >= 0, got {raw!r}")
    return gib * GiB if gib else CPU_KV_CACHE_BYTES


def batch_defaults(device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) for offline use (vLLM's LLM class, which `Engine` is) on
    `device`'s platform, after vLLM's EngineArgs.get_batch_defaults: 16,384 / 1,024 on a GPU with at least
    70 GiB that is not an A100 (H100, H200); 8,192 / 256 on other GPUs. On CPU 8,192 / 256 too, not vLLM's
    CPU 4,096: under XLA:CPU every forward copies the slices of the experts it uses, so a prefill split
    into more steps pays that again (docs/engine.md, Defaults)."""
    if device is None or device.platform == "cpu":
        return 8192, 256
    memory = device_memory_bytes(device)
    if memory >= 70 * GiB and "a100" not in device.device_kind.lower():
        return 16384, 1024
    return 8192, 256


def device_memory_bytes(device) -> int:
    """Bytes of memory `device` reports it can allocate (a GPU's `memory_stats()["bytes_limit"]`); 0 for
    None and for devices that report none (CPU). A KV pool is sized from it only when it is not 0."""
    if device is None:
        return 0
    return int((device.memory_stats() or {}).get("bytes_limit", 0))


@dataclasses.dataclass(frozen=True)
class DeployConfig:
    """Engine deployment. Sizes are in tokens, blocks or bytes as the names say. A field left None is
    filled in by `resolved` (the engine does this): from the model or the machine, as vLLM does.

    kv_cache_dtype: "auto" (the model's dtype) or one of attention.formats.MLA_FORMATS.
    index_block_size: slots per indexer-key page. Indexer keys take ~5% of a token's KV bytes, so with
        pages of block_size tokens an indexer page costs a whole block for a twentieth of its bytes; a
        larger index_block_size (e.g. 16 x block_size for GLM-5.3) makes the two pages about equal, so
        the pool holds about what its bytes hold. Prefix hits then end on multiples of index_block_size
        tokens, where vLLM's end on block_size: it keeps both at block_size, one block id holding both
        groups' pages (docs/simulator.md, "Page layout: vLLM's and this engine's").
    max_model_len: tokens a request may reach (prompt + output). None: the model's
        max_position_embeddings.
    max_num_batched_tokens / max_num_seqs: the scheduler's token budget per step and its limit on
        running requests. None: vLLM's defaults for offline use on this platform (`batch_defaults`).
    num_gpu_blocks: blocks in the device pool shared by all cache groups. None: what the KV memory
        budget holds (kv_cache_memory_bytes; else 4 GiB on CPU, or $VLLM_CPU_KVCACHE_SPACE GiB, as vLLM's
        CPU backend; on a GPU
        gpu_memory_utilization of its memory less the weights and the workspace of the largest step
        program, as vLLM sizes it after its profile run), but no more than
        max_num_seqs requests of max_model_len need. A block costs the bytes of the largest page of any
        cache group (kvcache.layout.block_bytes: a block id is one page of one group, in one byte budget;
        its 1/DCP share on each device).
    tensor_parallel_size: T ranks per replica with the attention heads (q_b, kv_b, o_proj), the dense MLPs and
        the shared expert split over them (one all-reduce after o_proj and one after each MLP / MoE), the
        latent KV cache and the indexer replicated, and the routed experts split too: whole experts with
        enable_expert_parallel (EP over the TP ranks), else each expert's width (parallel.tp). DCP reuses
        the TP ranks (decode_context_parallel_size must divide T: the cache is split over DCP sub-groups
        of the T ranks, vLLM's rule); TP with PCP is not built. Heads are zero-padded to a multiple of T.
    prefill_context_parallel_size / decode_context_parallel_size: PCP (a prefill chunk's tokens split
        over the ranks) and DCP (the KV cache split round-robin over them) on one context mesh axis of
        max(PCP, DCP) devices (parallel.model); with enable_expert_parallel the routed experts are split
        over the same devices. Each is 1 or that axis size.
    data_parallel_size: N ranks, each with its own scheduler and block pool; pool sizes (num_gpu_blocks,
        host bytes) are per rank. Without expert parallelism across them they are independent replicas
        (glm53.engine.engine), each on its own devices_per_replica devices with every weight. With
        enable_expert_parallel and one device per rank (`experts_across_ranks`: vLLM's
        `--data-parallel-size N --enable-expert-parallel`) the ranks share the routed experts, 1/N each,
        and step in lock-step as one program (parallel.model.forward_dp); the model's routed experts must
        split evenly over them. With TP or DCP per replica, expert parallelism stays inside each replica.
        DP x EP with PCP is refused (not a published layout).
    dp_routing: how `Engine.route` picks the DP rank of a new request. "salt": the rank that took the
        last request with its salt (one user's requests share a rank, for its prefix hits), else the rank
        with the fewest unfinished requests. "load": vLLM's internal DP load balancer (its API server's
        `DPLBAsyncMPClient`): the least 4 x waiting + running, the lowest rank on ties, no affinity (vLLM
        reads counts the ranks publish every 100 ms; this reads them at the request).
    kv_policy: what happens when the pool runs out: "preempt" (drop the victim's KV, recompute it
        later), "offload" (the host tier of tiered offloading: every full page is stored to a CPU prefix
        cache of cpu_offload_bytes as it fills and loaded back by a later prefix lookup,
        kvcache.policies.offload), "swap" (move a victim's KV to a host pool of cpu_offload_bytes and back; nothing
        is kept after a request finishes), "hisparse" (keep decoding with most
        MLA KV in a host pool of hisparse_host_pool_bytes, at least one request of max_model_len; rows
        the indexer selects come through a hot buffer of hisparse_device_buffer_size rows per request,
        default (num_speculative_tokens + 2) x top-k, i.e. 2 x top-k without MTP; kvcache.policies.hisparse).
        Without MTP a request may be larger than the device pool: a prefill chunk over host-only pages
        stages, per tile of hisparse_prefill_tile_tokens queries, only the rows they select (a workspace
        of at most rows x tile x top-k MLA rows per layer, outside the pool), and the pool must hold
        only a request's indexer keys, its chunk, its newest pages and a hot buffer
        (kvcache.policies.hisparse.device_blocks_per_request; `hisparse_stages_rows`).
    kv_transfer_config: vLLM's shape for the offload connector, {"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": N, "blocks_per_chunk": 1, "eviction_policy": "lru", "secondary_tiers": []}}.
        It implies kv_policy="offload" and sets cpu_offload_bytes to cpu_bytes_to_use (if both are given
        they must agree); cpu_offload_bytes=N alone is the shorthand for a host tier of N bytes (LRU).
        With kv_policy="hisparse" it stays HiSparse, on the same host-memory system with two budgets:
        hisparse_host_pool_bytes for its MLA pages, cpu_bytes_to_use (the offload budget) for idle
        sessions' indexer keys; both pools write through to the secondary tiers and prefix lookups ask
        them (kvcache.policies.hisparse; blocks_per_chunk 1 and eviction_policy "lru" only).
        secondary_tiers: [{"type": "fs", "root_dir": DIR, "max_bytes": N}, {"type": "obj", "bucket": B,
        "endpoint_override": URL} (vLLM's fields access_key, secret_key, session_token, region, scheme,
        ca_bundle too; empty credentials: the environment's; kvcache.tiers.obj), {"type": "p2p", "host": H,
        "port": P, "peers": ["host:port", ...]} (kvcache.tiers.p2p: serves its chunks on H:P, fetches from
        the peers), {"type": "custom", "module_path": M}] (kvcache.tiers); the
        top-level "kv_load_failure_policy" says what a failed tier load does: "recompute" its tokens, or
        "fail" the requests that needed it (finish_reason "error"; the engine serves on).
    kv_events_config: vLLM's `--kv-events-config` shape (kvcache.events.KVEventsConfig), e.g.
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
        "topic": "kv@<ip>:<port>@<model>"}: BlockStored / BlockRemoved / AllBlocksCleared of the device
        pool, the host pools and the secondary tiers, one batch per engine step and replica, on a ZMQ PUB
        socket per data-parallel replica (port + replica index). None (or enable_kv_cache_events False):
        nothing is recorded and no socket is opened. Unknown keys are refused.
    speculative_config: vLLM's `--speculative-config` shape for MTP speculative decoding, e.g.
        {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "standard" | "synthetic",
        "synthetic_acceptance_length": 2.99} (glm53.engine.spec_decode.SpeculativeConfig has every key).
        num_speculative_tokens=k alone is the shorthand for {"method": "mtp", "num_speculative_tokens": k};
        given both, they must agree. The model needs its MTP layer (a checkpoint without one fails at
        Engine construction); the KV pool then holds the MTP layer's rows and indexer keys too (788 bytes
        per token for GLM-5.3 in fp8). With kv_policy="hisparse" a "batched" verify step resolves one
        plan per IndexShare group for the union of its 1 + k positions' selections, which needs a hot
        buffer of at least (1 + k) x top-k rows (the default (k + 2) x top-k; "auto" falls back to
        "sequential", one position at a time, below that, and an explicit "batched" is refused).
    """

    data_parallel_size: int = 1
    dp_routing: str = "salt"
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_comm_backend: str = "ag_rs"
    cp_kv_cache_interleave_size: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    index_block_size: int | None = None  # tokens per indexer-key page (a multiple of block_size; None: block_size)
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_policy: str = "preempt"
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_offload_bytes: int = 0
    hisparse_host_pool_bytes: int = 0
    hisparse_device_buffer_size: int | None = None
    hisparse_prefill_tile_tokens: int = 64
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = True
    sparse_mla_force_mqa: bool = False
    attention_impl: str = "auto"
    host_link_bytes_per_s: float = 50e9
    kv_transfer_config: dict | None = dataclasses.field(default=None, hash=False)
    kv_events_config: dict | None = dataclasses.field(default=None, hash=False)
    speculative_config: dict | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"DeployConfig.{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for name in _POSITIVE:
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "a positive int")
        for name in _POSITIVE_OR_NONE:
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                bad(name, "a positive int or None")
        for name in _NON_NEGATIVE:
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, "an int >= 0")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")
        for name, choices in _CHOICES.items():
            try:
                known = getattr(self, name) in choices  # kv_policy's: the registry's keys now
            except TypeError:  # unhashable
                known = False
            if not known:
                bad(name, f"one of {tuple(choices)}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            bad("gpu_memory_utilization", "a number in (0, 1]")
        v = self.host_link_bytes_per_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            bad("host_link_bytes_per_s", "a number > 0")
        if self.index_block_size is not None and self.index_block_size % self.block_size:
            raise ValueError(f"DeployConfig.index_block_size={self.index_block_size} must be a multiple of "
                             f"block_size={self.block_size}")
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
        if self.data_parallel_size > 1 and self.enable_expert_parallel and pcp > 1:
            raise ValueError(f"DeployConfig.data_parallel_size={self.data_parallel_size} with enable_expert_parallel "
                             f"and prefill_context_parallel_size={pcp}: DP x EP with PCP is not a published layout "
                             "(Part 2's decode ranks are one device each); drop one of them")
        tp = self.tensor_parallel_size
        if tp > 1 and (pcp > 1 or (dcp > 1 and tp % dcp)):
            raise ValueError(f"DeployConfig.tensor_parallel_size={tp} with PCP {pcp} / DCP {dcp}: DCP must divide "
                             "the TP ranks it reuses (vLLM's rule), and TP x PCP is not built")
        if self.kv_transfer_config is not None:
            self._apply_kv_transfer_config()
        try:
            KVEventsConfig.from_dict(self.kv_events_config)
        except ValueError as e:
            raise ValueError(f"DeployConfig.{e}") from None
        self.policy.check(self)  # the policy's own checks, on the policy the connector left
        self._apply_speculative_config()

    def _apply_speculative_config(self) -> None:
        """speculative_config (vLLM's shape, glm53.engine.spec_decode.SpeculativeConfig) and its shorthand
        num_speculative_tokens=k (= {"method": "mtp", "num_speculative_tokens": k}): both given must
        agree; each sets the other."""
        k = self.num_speculative_tokens
        if self.speculative_config is None:
            if not k:
                return
            object.__setattr__(self, "speculative_config", {"method": "mtp", "num_speculative_tokens": k})
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if k and k != spec.num_speculative_tokens:
            raise ValueError(f"DeployConfig.num_speculative_tokens={k} and speculative_config num_speculative_tokens="
                             f"{spec.num_speculative_tokens} disagree")
        object.__setattr__(self, "num_speculative_tokens", spec.num_speculative_tokens)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The checked speculative_config (None: no speculative decoding)."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    def _apply_kv_transfer_config(self) -> None:
        """Check kv_transfer_config (vLLM's keys; anything else is refused, so a typo is not ignored) and
        set what it implies: kv_policy "offload" and cpu_offload_bytes."""
        ktc = self.kv_transfer_config
        if not isinstance(ktc, dict):
            raise ValueError(f"DeployConfig.kv_transfer_config must be a dict, got {type(ktc).__name__}")
        pd = ktc.get("kv_connector") == "PdConnector"
        unknown = set(ktc) - {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy",
                              *(PD_DEFAULTS if pd else ())}
        if unknown:
            raise ValueError(f"DeployConfig.kv_transfer_config: unknown keys {sorted(unknown)}")
        if ktc.get("kv_connector") not in ("OffloadingConnector", "PdConnector"):
            raise ValueError("DeployConfig.kv_transfer_config['kv_connector'] must be 'OffloadingConnector' or "
                             f"'PdConnector', got {ktc.get('kv_connector')!r}")
        if pd:
            if ktc.get("kv_role") not in PD_ROLES:
                raise ValueError(f"kv_transfer_config kv_role must be one of {PD_ROLES} with the PdConnector, got "
                                 f"{ktc.get('kv_role')!r}")
            ip, port = ktc.get("kv_ip", PD_DEFAULTS["kv_ip"]), ktc.get("kv_port", PD_DEFAULTS["kv_port"])
            if not isinstance(ip, str) or not ip:
                raise ValueError(f"kv_transfer_config kv_ip must be a non-empty address, got {ip!r}")
            if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
                raise ValueError(f"kv_transfer_config kv_port must be an int in [0, 65535] (0: any free port), got "
                                 f"{port!r}")
        elif ktc.get("kv_role", "kv_both") != "kv_both":
            raise ValueError(f"kv_transfer_config kv_role={ktc['kv_role']!r}: the OffloadingConnector is 'kv_both' "
                             "(producer and consumer roles are the PdConnector's)")
        extra = ktc.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError("DeployConfig.kv_transfer_config['kv_connector_extra_config'] must be a dict")
        unknown = set(extra) - set(OFFLOAD_DEFAULTS) - ({"lease_s", "producers", "consumer_waits"} if pd else set())
        if unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config: unknown keys {sorted(unknown)}")
        lease = extra.get("lease_s", PD_LEASE_S)
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 < lease < float("inf"):
            raise ValueError(f"kv_connector_extra_config lease_s must be a positive number of seconds, got {lease!r}")
        if not isinstance(extra.get("consumer_waits", True), bool):
            raise ValueError(f"kv_connector_extra_config consumer_waits must be True or False, got "
                             f"{extra['consumer_waits']!r}")
        if pd:
            from kvcache.tiers.p2p import check_options as check_p2p

            producers = extra.get("producers", [])
            try:
                check_p2p({"host": "127.0.0.1", "port": 0, "producers": producers})
            except ValueError as e:
                raise ValueError(f"kv_connector_extra_config producers must be a list of the producers' KV addresses "
                                 f"'host:kv_port' ({e})") from None
        opts = {**OFFLOAD_DEFAULTS, **extra}
        if pd and "cpu_bytes_to_use" not in extra and self.cpu_offload_bytes:
            opts["cpu_bytes_to_use"] = self.cpu_offload_bytes  # --cpu-offload-bytes sizes the PdConnector's host tier
        if opts["spec_name"] not in ("TieringOffloadingSpec", "CPUOffloadingSpec"):
            raise ValueError("kv_connector_extra_config spec_name must be 'TieringOffloadingSpec' or "
                             f"'CPUOffloadingSpec', got {opts['spec_name']!r}")
        n = opts["cpu_bytes_to_use"]
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"kv_connector_extra_config cpu_bytes_to_use must be an int > 0, got {n!r}"
                             + (" (the PdConnector's host tier: it or cpu_offload_bytes)" if pd else ""))
        k = opts["blocks_per_chunk"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"kv_connector_extra_config blocks_per_chunk must be a positive int, got {k!r}")
        if opts["eviction_policy"] not in ("lru", "arc"):
            raise ValueError(f"kv_connector_extra_config eviction_policy must be 'lru' or 'arc', got "
                             f"{opts['eviction_policy']!r}")
        check_tier_specs(opts["secondary_tiers"])
        if ktc.get("kv_load_failure_policy", "recompute") not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, got "
                             f"{ktc['kv_load_failure_policy']!r}")
        spec = self.policy
        if not spec.accepts_connector:
            raise ValueError(f"DeployConfig.kv_transfer_config (the offload connector) with kv_policy="
                             f"{self.kv_policy!r}: it is the 'offload' policy, or HiSparse's offload budget and "
                             "tiers with kv_policy='hisparse'")
        if self.cpu_offload_bytes and self.cpu_offload_bytes != n:
            raise ValueError(f"DeployConfig.cpu_offload_bytes={self.cpu_offload_bytes} and kv_transfer_config "
                             f"cpu_bytes_to_use={n} disagree")
        if spec.own_connector:
            spec.check_connector(self, opts)
        else:
            object.__setattr__(self, "kv_policy", "offload")
        object.__setattr__(self, "cpu_offload_bytes", n)

    @property
    def offload_options(self) -> dict:
        """The offload connector's options (OFFLOAD_DEFAULTS overridden by kv_transfer_config's
        kv_connector_extra_config; cpu_bytes_to_use = cpu_offload_bytes)."""
        ktc = self.kv_transfer_config or {}
        extra = {k: v for k, v in ktc.get("kv_connector_extra_config", {}).items() if k in OFFLOAD_DEFAULTS}
        opts = {**OFFLOAD_DEFAULTS, **extra, "cpu_bytes_to_use": self.cpu_offload_bytes}
        if self.kv_role is not None:  # the PdConnector: its peer tier after the user's tiers
            pd = {**PD_DEFAULTS, **{k: ktc[k] for k in PD_DEFAULTS if k in ktc}}
            opts["secondary_tiers"] = [*opts["secondary_tiers"], {"type": "p2p", "host": pd["kv_ip"],
                                                                  "port": pd["kv_port"], "name": PD_TIER,
                                                                  "producers": list(self.pd_producers)}]
        return opts

    @property
    def kv_role(self) -> str | None:
        """The PdConnector's role ("kv_producer", "kv_consumer" or "kv_both"); None without it."""
        ktc = self.kv_transfer_config or {}
        return ktc.get("kv_role") if ktc.get("kv_connector") == "PdConnector" else None

    @property
    def pd_producers(self) -> tuple[str, ...]:
        """The producers a P/D consumer may take KV from (kv_connector_extra_config["producers"]: their
        "host:kv_port"); a request naming any other is refused. Empty: none."""
        return tuple((self.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("producers", ()))

    @property
    def pd_consumer_waits(self) -> bool:
        """Whether a P/D consumer's request waits for free host pages to stage its producer's KV in, rather
        than compute what it cannot stage (kv_connector_extra_config["consumer_waits"]; default True, as a
        vLLM decode instance keeps a remote-prefill request waiting until its blocks can be allocated;
        False: computed, counted as the "pd" tier's `unstaged`; kvcache.host_tier.HostTier's peer_waits)."""
        return bool((self.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("consumer_waits", True))

    @property
    def pd_wait_tier(self) -> str | None:
        """The tier whose pages a P/D consumer's request waits for host pages to stage (PD_TIER) under
        `pd_consumer_waits`, else None (kvcache.host_tier.HostTier's peer_waits)."""
        return PD_TIER if self.kv_role is not None and self.pd_consumer_waits else None

    @property
    def pd_lease_s(self) -> float:
        """Seconds a P/D producer holds a finished request's chunks for its consumer (kvcache.tiers.p2p.PeerTier.lease)."""
        return float((self.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("lease_s", PD_LEASE_S))

    @property
    def kv_events(self) -> KVEventsConfig:
        """kv_events_config with vLLM's defaults filled in (events off when None)."""
        return KVEventsConfig.from_dict(self.kv_events_config)

    @property
    def kv_load_failure_policy(self) -> str:
        """What a failed secondary-tier load does: "recompute" (its tokens; vLLM's default) or "fail"."""
        return (self.kv_transfer_config or {}).get("kv_load_failure_policy", "recompute")

    @property
    def is_resolved(self) -> bool:
        return None not in (self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs, self.num_gpu_blocks)

    def resolved(self, cfg, model_dtype: str = "float32", *, device=None, weights_bytes: int = 0,
                 workspace_bytes: int = 0, runner_arrays: bool = False) -> DeployConfig:
        """A copy with every None field filled in for a model of `cfg` on `device` (a jax.Device; None:
        CPU): max_model_len from the model, the batch limits from `batch_defaults`, num_gpu_blocks from
        the KV memory budget (`kv_budget_bytes`: weights_bytes, the weights one device holds, and
        workspace_bytes, the peak activation memory of its largest step, are left out of a GPU's
        budget). A block costs `kvcache.layout.block_bytes` (the groups' shared buffer: the simulator's
        and the memory plan's price), or with runner_arrays what the model runner allocates for it
        today (`runner_block_bytes`: a page of every group), so that a real pool fits its budget.
        Raises ValueError when max_model_len exceeds the model's positions or the budget cannot hold
        one request of max_model_len."""
        if self.max_model_len is not None and self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"DeployConfig.max_model_len={self.max_model_len} must be <= the model's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        tokens, seqs = batch_defaults(device)
        d = dataclasses.replace(self, max_model_len=self.max_model_len or cfg.max_position_embeddings,
                                max_num_batched_tokens=self.max_num_batched_tokens or tokens,
                                max_num_seqs=self.max_num_seqs or seqs)
        if d.num_gpu_blocks is not None:
            return d
        # blocks one request of max_model_len holds on the device when running, and the fewest it can run in
        request, least = d.policy.device_request_blocks(
            d, cfg, sum(-(-d.max_model_len // n) for n in d.group_tokens_per_block(GROUPS).values()))
        kv_dtype = str(model_dtype) if d.kv_cache_dtype == "auto" else d.kv_cache_dtype
        pages = page_bytes(cfg, kv_dtype, d.block_size, d.index_block_size, dcp=d.decode_context_parallel_size,
                           include_mtp=d.num_speculative_tokens > 0)
        price = runner_block_bytes(pages) if runner_arrays else block_bytes(pages)
        per_device = -(-price // d.decode_context_parallel_size)  # a block's share of one device
        budget = d.kv_budget_bytes(device, weights_bytes, workspace_bytes)
        fit = budget // per_device
        if fit < least:
            spent = (f" ({d.gpu_memory_utilization} x {device_memory_bytes(device)} bytes of device memory less "
                     f"{weights_bytes} of weights and {workspace_bytes} of step workspace)"
                     if d.kv_cache_memory_bytes is None and device_memory_bytes(device) else "")
            # JAX's GPU allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 by default) of the device, and
            # that is what the device reports: gpu_memory_utilization applies to it, not to the whole HBM
            fraction = (" (JAX's allocator reports XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU, 0.75 unless set: "
                        "raise it, e.g. to 0.95, for vLLM's gpu_memory_utilization of the whole memory)") if spent else ""
            raise ValueError(f"the KV memory budget of {budget} bytes{spent} holds {fit} blocks of {per_device} bytes, "
                             f"fewer than one request of max_model_len={d.max_model_len} needs ({least}): lower "
                             "DeployConfig.max_model_len (or max_num_batched_tokens, which sets the workspace) or raise "
                             f"kv_cache_memory_bytes / num_gpu_blocks{fraction}")
        return dataclasses.replace(d, num_gpu_blocks=min(fit, d.max_num_seqs * request))

    def kv_budget_bytes(self, device=None, weights_bytes: int = 0, workspace_bytes: int = 0) -> int:
        """Bytes of device memory the KV pool may take: kv_cache_memory_bytes if set; else, on a device
        that reports its memory (a GPU, `device_memory_bytes`), gpu_memory_utilization of it less
        `weights_bytes` and `workspace_bytes` (vLLM's rule: the step's activation peak, which its profile
        run measures and `ModelRunner.step_workspace_bytes` takes from the compiler); else, on CPU, vLLM's
        CPU backend's KV space: $VLLM_CPU_KVCACHE_SPACE GiB, 4 GiB where it is unset or 0."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        limit = device_memory_bytes(device)
        if not limit:
            return cpu_kv_cache_bytes()
        return max(0, int(self.gpu_memory_utilization * limit) - weights_bytes - workspace_bytes)

    def budget_from_device_memory(self, device) -> bool:
        """Whether `resolved` sizes the pool from `device`'s memory (so the weights and the step's
        workspace must be known first): no num_gpu_blocks or kv_cache_memory_bytes given, and the
        device reports its memory."""
        return self.num_gpu_blocks is None and self.kv_cache_memory_bytes is None and device_memory_bytes(device) > 0

    @property
    def hisparse_stages_rows(self) -> bool:
        """HiSparse prefill chunks over host-only pages stage only their selected rows (kvcache.host.
        StagingView; with MTP also the MTP layer's pass and the drafts after a prompt's last chunk), so a
        request may exceed the device pool."""
        return self.policy.stages_rows(self)

    @property
    def policy(self):
        """The class of `kv_policy` in kvcache.policies.REGISTRY (its planner and spec)."""
        return policy_spec(self.kv_policy)

    @property
    def devices_per_replica(self) -> int:
        """GPUs one replica runs on: max(TP x PCP, DCP) (DCP reuses TP ranks; on its own it is the context
        axis)."""
        return max(self.tensor_parallel_size * self.prefill_context_parallel_size, self.decode_context_parallel_size)

    @property
    def experts_across_ranks(self) -> bool:
        """The DP x EP layout: several data-parallel ranks of one device each that share the routed
        experts (enable_expert_parallel), so they run every step together on one mesh of
        data_parallel_size devices (glm53.engine.engine's lock-step, parallel.model.forward_dp)."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel and self.devices_per_replica == 1

    @property
    def devices_per_runner(self) -> int:
        """Devices one model runner drives: every rank's under DP x EP, else one replica's."""
        return self.data_parallel_size if self.experts_across_ranks else self.devices_per_replica

    @property
    def context_parallel_size(self) -> int:
        """Devices on the context mesh axis: max(PCP, DCP) (1 = one device). Under expert parallelism the
        same devices hold the experts (EP size = this), except under TP, whose experts are split over all
        the TP ranks (the context axis is then TP's inner DCP sub-group)."""
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
        """This deployment's pool and page sizes for a model of `cfg` (kvcache.layout); None fields are
        resolved first (`resolved`, on CPU). Raises ValueError for host pools the policy cannot run with
        (its `host_sizes`: e.g. a HiSparse host pool that cannot hold one request of max_model_len)."""
        if not self.is_resolved:
            return self.resolved(cfg, model_dtype).kv_sizes(cfg, model_dtype)
        kv_dtype = str(model_dtype) if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        pages = page_bytes(cfg, kv_dtype, self.block_size, self.index_block_size,
                           dcp=self.decode_context_parallel_size, include_mtp=self.num_speculative_tokens > 0)
        return KVSizes(kv_dtype, self.num_gpu_blocks, pages, **self.policy.host_sizes(self, cfg, pages))

    def group_tokens_per_block(self, groups) -> dict[str, int]:
        """Per cache group, the tokens one block covers (kvcache.block_pool.KVCacheManager)."""
        return {g: self.index_tokens_per_block if g == "indexer" else self.tokens_per_block for g in groups}
