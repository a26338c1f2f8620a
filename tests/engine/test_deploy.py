"""DeployConfig: the defaults a user who does not tune gets (vLLM's, for the machine), the KV pool sized
from a memory budget, and bad input: every invalid field, and the engine-level checks, each a clear
error naming the field and what is allowed, raised before anything is allocated or queued."""

import types

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine import build as build_mod
from glm53.engine import engine as engine_mod
from glm53.engine.config import CPU_KV_CACHE_BYTES, GiB, batch_defaults
from glm53.engine.synthetic import SyntheticRunner

TINY = glm53.get_preset("tiny")


def _block_bytes(cfg, block=16, index_block=16):
    """Bytes one block id costs on CPU in float32, from the model's sizes (BRIEF §2's layout): the larger
    of a page of MLA rows (latent + rope, every layer) and a page of indexer keys (every full layer); a
    block id is one page of one group, the groups in one byte budget."""
    full = [i for i in cfg.full_indexer_layers if i < cfg.num_hidden_layers]
    return max(cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * block,
               len(full) * cfg.index_head_dim * 4 * index_block)


def _gpu(kind, gib):
    return types.SimpleNamespace(platform="gpu", device_kind=kind, memory_stats=lambda: {"bytes_limit": gib * GiB})


def test_defaults_follow_the_model_and_vllm_on_this_machine(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    d = DeployConfig().resolved(TINY)
    assert d.max_model_len == TINY.max_position_embeddings == 65_536
    assert (d.max_num_batched_tokens, d.max_num_seqs) == (8192, 256)  # vLLM's offline GPU defaults (docs/engine.md)
    # the pool: what vLLM's 4 GiB CPU KV space holds, not 256 requests of 65,536 tokens (~170 GB here)
    assert d.num_gpu_blocks == CPU_KV_CACHE_BYTES // _block_bytes(TINY) == 58_254
    assert d.is_resolved and DeployConfig(max_model_len=128).resolved(TINY).max_model_len == 128
    # vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) sets that space; 0 is the default, anything else not a whole
    # number of GiB is named
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert DeployConfig().resolved(TINY).num_gpu_blocks == GiB // _block_bytes(TINY)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert DeployConfig().resolved(TINY).num_gpu_blocks == 58_254
    for bad in ("1.5", "-2", "lots"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB"):
            DeployConfig().resolved(TINY)


def test_the_pool_is_capped_at_what_the_limits_need_and_sized_from_the_budget():
    # a pool never needs more than max_num_seqs requests of max_model_len: 4 x (8 MLA + 8 indexer pages)
    assert DeployConfig(max_model_len=128, max_num_seqs=4).resolved(TINY).num_gpu_blocks == 64
    budget = 10 * _block_bytes(TINY, 8, 16) + 7  # ten blocks and change
    d = DeployConfig(max_model_len=32, block_size=8, index_block_size=16, kv_cache_memory_bytes=budget).resolved(TINY)
    assert d.num_gpu_blocks == 10
    with pytest.raises(ValueError, match="max_model_len=128.*kv_cache_memory_bytes"):
        DeployConfig(max_model_len=128, block_size=8, kv_cache_memory_bytes=budget).resolved(TINY)
    assert DeployConfig(num_gpu_blocks=5).resolved(TINY).num_gpu_blocks == 5  # given: taken as is


def test_gpu_defaults_and_budget():
    assert batch_defaults(_gpu("NVIDIA H200", 141)) == (16384, 1024)
    assert batch_defaults(_gpu("NVIDIA A100-SXM4-80GB", 80)) == (8192, 256)  # vLLM keeps A100 at the small ones
    assert batch_defaults(_gpu("NVIDIA L4", 24)) == (8192, 256)
    h200 = _gpu("NVIDIA H200", 100)
    assert DeployConfig().kv_budget_bytes(h200, weights_bytes=30 * GiB) == 60 * GiB  # 0.9 x 100 GiB - weights
    assert DeployConfig(gpu_memory_utilization=0.5).kv_budget_bytes(h200) == 50 * GiB


def test_default_engine_runs_and_its_config_is_concrete():
    eng = Engine(types.SimpleNamespace(cfg=TINY, dtype="float32"), runner=SyntheticRunner(lambda row: 3))
    assert eng.deploy.is_resolved and eng.deploy.num_gpu_blocks == eng.scheduler.kv.pool.num_blocks == 58_254
    assert eng.generate([[1, 2, 3]], max_new_tokens=2)[0].token_ids.tolist() == [3, 3]


BAD_FIELDS = [  # (field, value, what the message must say is allowed)
    ("data_parallel_size", 0, "a positive int"), ("prefill_context_parallel_size", -1, "a positive int"),
    ("decode_context_parallel_size", 2.0, "a positive int"), ("cp_kv_cache_interleave_size", None, "a positive int"),
    ("block_size", 0, "a positive int"), ("block_size", True, "a positive int"),
    ("tensor_parallel_size", "2", "a positive int"),
    ("index_block_size", 0, "a positive int or None"), ("index_block_size", 24, "a multiple of block_size=16"),
    ("max_model_len", 0, "a positive int or None"), ("max_num_batched_tokens", -5, "a positive int or None"),
    ("max_num_seqs", 1.5, "a positive int or None"), ("num_gpu_blocks", 0, "a positive int or None"),
    ("kv_cache_memory_bytes", -1, "a positive int or None"), ("hisparse_device_buffer_size", 0, "a positive int or None"),
    ("cpu_offload_bytes", -1, "an int >= 0"), ("hisparse_host_pool_bytes", 0.5, "an int >= 0"),
    ("num_speculative_tokens", -1, "an int >= 0"),
    ("enable_expert_parallel", 1, "True or False"), ("enable_prefix_caching", "yes", "True or False"),
    ("sparse_mla_force_mqa", None, "True or False"),
    ("dcp_comm_backend", "ring", "one of \\('ag_rs', 'a2a'\\)"), ("dp_routing", "sticky", "one of \\('salt', 'load'\\)"), ("kv_cache_dtype", "fp8", "one of \\('auto', "),
    ("kv_policy", "lru", "one of \\('preempt', 'offload', 'swap', 'hisparse'[,)]"),
    ("attention_impl", "triton", "one of \\('auto', 'reference', 'pallas'\\)"),
    ("gpu_memory_utilization", 0.0, "a number in \\(0, 1\\]"), ("gpu_memory_utilization", 1.5, "a number in \\(0, 1\\]"),
    ("host_link_bytes_per_s", 0, "a number > 0"),
]


@pytest.mark.parametrize("field,value,allowed", BAD_FIELDS)
def test_every_invalid_field_is_named_with_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=f"DeployConfig.{field}.*{allowed}"):
        DeployConfig(**{field: value})


@pytest.mark.parametrize("fields,match", [
    (dict(kv_policy="offload"), "kv_policy='offload' needs cpu_offload_bytes > 0"),
    (dict(kv_policy="swap"), "kv_policy='swap' needs cpu_offload_bytes > 0"),
    (dict(kv_policy="hisparse"), "kv_policy='hisparse' needs hisparse_host_pool_bytes > 0"),
    (dict(prefill_context_parallel_size=8, decode_context_parallel_size=4), "decode_context_parallel_size=4 must be equal"),
    (dict(decode_context_parallel_size=2, cp_kv_cache_interleave_size=3), "interleave_size=3 must divide block_size"),
])
def test_fields_that_contradict_each_other(fields, match):
    with pytest.raises(ValueError, match=match):
        DeployConfig(**fields)


def _ktc(**extra):
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, **extra}}


def test_kv_transfer_config_is_vllms_offload_connector():
    d = DeployConfig(kv_transfer_config=_ktc(blocks_per_chunk=2))
    assert d.kv_policy == "offload" and d.cpu_offload_bytes == 1 << 20
    assert d.offload_options == {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                                 "blocks_per_chunk": 2, "eviction_policy": "lru", "secondary_tiers": []}
    assert DeployConfig(kv_policy="offload", cpu_offload_bytes=1 << 20, kv_transfer_config=_ktc()).kv_policy == "offload"
    assert DeployConfig(kv_policy="offload", cpu_offload_bytes=5).offload_options["blocks_per_chunk"] == 1


@pytest.mark.parametrize("ktc,err,match", [
    ([], ValueError, "kv_transfer_config must be a dict"),
    ({"kv_connector": "LMCacheConnectorV1"}, ValueError, "must be 'OffloadingConnector' or 'PdConnector'"),
    ({**_ktc(), "kv_rol": "kv_both"}, ValueError, "unknown keys \\['kv_rol'\\]"),
    (_ktc(cpu_byte_to_use=5), ValueError, "unknown keys \\['cpu_byte_to_use'\\]"),
    (_ktc(cpu_bytes_to_use=0), ValueError, "cpu_bytes_to_use must be an int > 0"),
    (_ktc(blocks_per_chunk=0), ValueError, "blocks_per_chunk must be a positive int"),
    (_ktc(eviction_policy="fifo"), ValueError, "eviction_policy must be 'lru' or 'arc'"),
    (_ktc(spec_name="Foo"), ValueError, "spec_name must be"),
    (_ktc(secondary_tiers=[{"type": "obj", "endpoint_override": "http://127.0.0.1:9000"}]), ValueError,
     "'obj': needs bucket"),
    (_ktc(secondary_tiers=[{"type": "obj", "bucket": "kv", "region_name": "x"}]), ValueError,
     "'obj': unknown keys \\['region_name'\\] \\(allowed: .*'region'"),
    (_ktc(secondary_tiers=[{"type": "fs"}]), ValueError, "needs root_dir"),
    (_ktc(secondary_tiers={"type": "fs"}), ValueError, "secondary_tiers must be a list"),
    (_ktc(secondary_tiers=[{"type": "fs", "root_dir": "/tmp/x", "max_byte": 1}]), ValueError, "unknown keys"),
    ({**_ktc(), "kv_load_failure_policy": "skip"}, ValueError, "kv_load_failure_policy must be one of"),
    ({**_ktc(), "kv_role": "kv_producer"}, ValueError, "producer and consumer roles are the PdConnector's"),
    ({**_ktc(), "kv_port": 5}, ValueError, "unknown keys \\['kv_port'\\]"),
    ({**_ktc(), "kv_connector": "PdConnector"}, ValueError, "kv_role must be one of"),
    ({**_ktc(), "kv_connector": "PdConnector", "kv_role": "kv_decoder"}, ValueError, "kv_role must be one of"),
    ({**_ktc(), "kv_connector": "PdConnector", "kv_role": "kv_producer", "kv_port": 70000}, ValueError,
     "kv_port must be an int in"),
    ({**_ktc(), "kv_connector": "PdConnector", "kv_role": "kv_producer", "kv_ip": ""}, ValueError, "kv_ip must be"),
    ({"kv_connector": "PdConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"producers": "h:1"}},
     ValueError, "producers must be a list of the producers' KV addresses"),
    ({"kv_connector": "PdConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"producers": ["h"]}},
     ValueError, "producers must be a list of the producers' KV addresses 'host:kv_port'"),
    ({"kv_connector": "PdConnector", "kv_role": "kv_consumer"}, ValueError,
     "cpu_bytes_to_use must be an int > 0, got 0 \\(the PdConnector's host tier"),
    ({**_ktc(lease_s=0), "kv_connector": "PdConnector", "kv_role": "kv_producer"}, ValueError, "lease_s must be"),
    (_ktc(lease_s=5), ValueError, "unknown keys \\['lease_s'\\]"),
    ({**_ktc(consumer_waits="yes"), "kv_connector": "PdConnector", "kv_role": "kv_consumer"}, ValueError,
     "consumer_waits must be True or False"),
    (_ktc(consumer_waits=True), ValueError, "unknown keys \\['consumer_waits'\\]"),
])
def test_kv_transfer_config_bad_input(ktc, err, match):
    with pytest.raises(err, match=match):
        DeployConfig(kv_transfer_config=ktc)


def test_pd_connector_is_the_offload_connector_plus_a_peer_tier():
    """The PdConnector: vLLM's kv_role / kv_ip / kv_port, a host tier (cpu_bytes_to_use, or
    --cpu-offload-bytes) and a peer tier named "pd" bound at kv_ip:kv_port after the user's tiers."""
    fs = {"type": "fs", "root_dir": "/tmp/x"}
    ktc = {"kv_connector": "PdConnector", "kv_role": "kv_producer", "kv_port": 7100,
           "kv_connector_extra_config": {"secondary_tiers": [fs], "lease_s": 2.5}}
    d = DeployConfig(cpu_offload_bytes=1 << 20, kv_transfer_config=ktc)
    assert (d.kv_policy, d.cpu_offload_bytes, d.kv_role, d.pd_lease_s) == ("offload", 1 << 20, "kv_producer", 2.5)
    assert d.offload_options["secondary_tiers"] == [fs, {"type": "p2p", "host": "127.0.0.1", "port": 7100, "name": "pd",
                                                         "producers": []}]
    assert "lease_s" not in d.offload_options
    c = DeployConfig(kv_transfer_config={"kv_connector": "PdConnector", "kv_role": "kv_consumer", "kv_ip": "::1",
                                         "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20,
                                                                       "producers": ["[::1]:7100"]}})
    assert c.offload_options["secondary_tiers"] == [{"type": "p2p", "host": "::1", "port": 0, "name": "pd",
                                                     "producers": ["[::1]:7100"]}]
    assert c.pd_producers == ("[::1]:7100",) and "producers" not in c.offload_options
    assert c.pd_lease_s == 30.0 and DeployConfig(kv_transfer_config=_ktc()).kv_role is None


def test_kv_transfer_config_contradictions():
    with pytest.raises(ValueError, match="cpu_offload_bytes=5 and kv_transfer_config cpu_bytes_to_use=1048576 disagree"):
        DeployConfig(cpu_offload_bytes=5, kv_transfer_config=_ktc())
    with pytest.raises(ValueError, match="kv_policy='swap': it is the 'offload' policy, or HiSparse's"):
        DeployConfig(kv_policy="swap", cpu_offload_bytes=1 << 20, kv_transfer_config=_ktc())


def test_kv_transfer_config_under_hisparse_is_its_offload_budget():
    """kv_policy stays "hisparse": cpu_bytes_to_use is the offload budget (the idle indexer-key pool) next
    to the HiSparse pool; what HiSparse's pools cannot do is refused by name."""
    hs = dict(kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26, max_model_len=128, block_size=8)
    d = DeployConfig(**hs, kv_transfer_config=_ktc())
    assert d.kv_policy == "hisparse" and d.cpu_offload_bytes == 1 << 20
    sizes = d.kv_sizes(TINY)
    assert sizes.host_blocks == {"mla": (1 << 26) // sizes.page_bytes["mla"],
                                 "indexer": (1 << 20) // sizes.page_bytes["indexer"]}
    assert DeployConfig(**hs, cpu_offload_bytes=1 << 20, kv_transfer_config=_ktc()).cpu_offload_bytes == 1 << 20
    with pytest.raises(ValueError, match="cpu_offload_bytes=5 and kv_transfer_config cpu_bytes_to_use=1048576 disagree"):
        DeployConfig(**hs, cpu_offload_bytes=5, kv_transfer_config=_ktc())
    with pytest.raises(ValueError, match="blocks_per_chunk must be 1 with kv_policy='hisparse', got 2"):
        DeployConfig(**hs, kv_transfer_config=_ktc(blocks_per_chunk=2))
    with pytest.raises(ValueError, match="eviction_policy must be 'lru' with kv_policy='hisparse', got 'arc'"):
        DeployConfig(**hs, kv_transfer_config=_ktc(eviction_policy="arc"))
    tiers = [{"type": "fs", "root_dir": "/tmp/x"}]
    with pytest.raises(ValueError, match="secondary_tiers with kv_policy='hisparse' need enable_prefix_caching=True"):
        DeployConfig(**hs, enable_prefix_caching=False, kv_transfer_config=_ktc(secondary_tiers=tiers))
    DeployConfig(**hs, enable_prefix_caching=False, kv_transfer_config=_ktc())  # no tiers: nothing to serve by hash
    with pytest.raises(ValueError, match="cpu_bytes_to_use=16 holds no indexer-key page"):
        DeployConfig(**hs, kv_transfer_config=_ktc(cpu_bytes_to_use=16)).kv_sizes(TINY)


def test_what_is_not_built_says_so(tiny_model):
    with pytest.raises(ValueError, match="needs 64 devices"):  # before the pool is allocated
        Engine(tiny_model, DeployConfig(tensor_parallel_size=64, max_model_len=64, num_gpu_blocks=8))
    with pytest.raises(ValueError, match="TP x PCP is not built"):
        DeployConfig(tensor_parallel_size=2, prefill_context_parallel_size=2)
    # HiSparse runs under TP alone (tests/parallel/test_tp_hisparse.py), not with its KV split over DCP ranks
    with pytest.raises(NotImplementedError, match="hisparse.*PCP / DCP"):
        DeployConfig(decode_context_parallel_size=2, kv_policy="hisparse", hisparse_host_pool_bytes=1)
    with pytest.raises(NotImplementedError, match="hisparse.*PCP / DCP"):
        DeployConfig(tensor_parallel_size=2, decode_context_parallel_size=2, kv_policy="hisparse",
                     hisparse_host_pool_bytes=1)
    # a batched HiSparse verify step resolves the union of its 1 + k positions' selections at once
    topk = tiny_model.cfg.index_topk
    with pytest.raises(ValueError, match=f"needs >= 4 x top-k = {4 * topk} rows"):
        Engine(tiny_model, DeployConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                                            "verify": "batched"},
                                        kv_policy="hisparse", hisparse_host_pool_bytes=1 << 24, max_model_len=64,
                                        num_gpu_blocks=8, hisparse_device_buffer_size=3 * topk))


@pytest.fixture
def no_allocation(monkeypatch):
    """Engine construction that would allocate a model runner fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the engine allocated a runner before rejecting its configuration")

    monkeypatch.setattr(engine_mod, "ModelRunner", forbidden)
    monkeypatch.setattr(build_mod, "ModelRunner", forbidden)  # the profile run's


@pytest.mark.parametrize("fields,match", [
    # one request's MLA pages: 128 tokens x 8 layers x (128 latent + 16 rope) float32 = 589,824 bytes
    (dict(max_model_len=128, block_size=8, kv_policy="hisparse", hisparse_host_pool_bytes=100_000),
     "hisparse_host_pool_bytes=100000 must hold at least one request of max_model_len=128: >= 589824 bytes"),
    (dict(max_model_len=TINY.max_position_embeddings + 1), "max_model_len=65537 must be <= the model's"),
    (dict(max_model_len=4096, kv_cache_memory_bytes=1 << 20), "max_model_len=4096"),
    # DP x EP (the ranks share the routed experts): ranks on devices that do not exist (this process has
    # one), experts that do not split over the ranks (the tiny model's 8 over 3), and PCP beside it
    (dict(data_parallel_size=2, enable_expert_parallel=True), "data_parallel_size=2 x 1 devices per replica needs 2"),
    (dict(data_parallel_size=3, enable_expert_parallel=True), "n_routed_experts=8 do not split evenly over the 3"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, prefill_context_parallel_size=2),
     "data_parallel_size=2 with enable_expert_parallel and prefill_context_parallel_size=2"),
])
def test_engine_rejects_a_configuration_before_allocating(tiny_model, no_allocation, fields, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model, DeployConfig(**fields))


def test_engine_rejects_bad_requests_before_queueing_them():
    eng = Engine(types.SimpleNamespace(cfg=TINY, dtype="float32"),
                 DeployConfig(max_model_len=128, max_num_seqs=2, block_size=8, num_gpu_blocks=10),
                 runner=SyntheticRunner())
    cases = [([], "non-empty"), (np.zeros((2, 3), np.int32), "1-D"), ([1.5, 2.0], "integers"),
             ([0, TINY.vocab_size], f"token ids must lie in \\[0, {TINY.vocab_size}\\)"), ([-1, 4], "token ids must lie"),
             (np.array([2**32 + 5, 7], np.int64), "token ids must lie"),  # not wrapped to 5 by an int32 cast
             (np.zeros(126, np.int32), "max_model_len=128"),
             (np.zeros(60, np.int32), "needs 16 device blocks at once under kv_policy=.preempt. but the pool has 10")]  # 8 MLA + 8 indexer pages
    cases.append(([1, 2], "stop_token_ids must lie"))
    for prompt, match in cases:
        params = SamplingParams(3, stop_token_ids=(TINY.vocab_size,) if match.startswith("stop") else ())
        with pytest.raises(ValueError, match=match):
            eng.add_request(prompt, params)
    assert not eng.requests and not eng.scheduler.waiting and not eng.has_unfinished()
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(0)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2], req_id="a")
        eng.add_request([1, 2], req_id="a")
    assert list(eng.requests) == ["a"] and len(eng.scheduler.waiting) == 1
