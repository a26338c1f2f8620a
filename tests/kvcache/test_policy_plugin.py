"""A KV policy added from outside the package: one folder (tests/kvcache/toy_policy) and one registry line,
then kv_policy="evict_oldest" is a DeployConfig, runs in the engine on the model (greedy tokens equal to
preempt's, whether or not the pool overflows) and in the simulator, and reports its counts."""

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine
from glm53.engine import sim
from glm53.engine.prometheus import ServingMetrics
from kvcache.policies import REGISTRY, register_policy
from kvcache.policies.device import DeviceHalf
from tests.kvcache.toy_policy import EvictOldest

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)  # as tests/engine/test_engine.py
SMALL_POOL = dict(num_gpu_blocks=24, enable_prefix_caching=False)  # as tests/engine/test_plan.py: it preempts


@pytest.fixture(scope="module", autouse=True)
def evict_oldest():
    register_policy("evict_oldest", EvictOldest)  # all a new policy needs beside its folder
    yield
    del REGISTRY["evict_oldest"]  # the registry as the other tests' modules expect it


def test_the_registry_names_the_policies_and_a_registered_one_is_a_deploy_config():
    assert list(REGISTRY)[:4] == ["preempt", "offload", "swap", "hisparse"] and REGISTRY["evict_oldest"] is EvictOldest
    assert DeployConfig(kv_policy="evict_oldest").policy is EvictOldest
    with pytest.raises(ValueError, match="kv_policy must be one of .*'evict_oldest'.*got 'evict_newest'"):
        DeployConfig(kv_policy="evict_newest")
    with pytest.raises(TypeError, match="must subclass"):
        register_policy("not_a_policy", object)
    # what it leaves to the base: no connector, no host pools, no device half
    with pytest.raises(ValueError, match="kv_transfer_config .* with kv_policy='evict_oldest'"):
        DeployConfig(kv_policy="evict_oldest", kv_transfer_config={
            "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}})
    assert DeployConfig(kv_policy="evict_oldest").kv_sizes(glm53.get_preset("tiny")).host_blocks == {}
    assert type(EvictOldest.device_half(None, None, index_topk=16)) is DeviceHalf  # the plain paged cache


def _outputs(eng, prompts):
    outs = eng.generate(prompts, max_new_tokens=5)
    return [o.req_id for o in outs], [o.token_ids.tolist() for o in outs], [o.num_preemptions for o in outs]


def test_on_the_model_it_gives_preempts_tokens_and_evicts_the_oldest(small_model, small_reference):
    """One pool size for every run (one set of compiled programs): three of the four prompts fit it
    together, all four do not."""
    prompts, want = small_reference  # one prompt at a time, no engine: what preempt's engine gives too
    toy = Engine(small_model, DeployConfig(**BASE, **SMALL_POOL, kv_policy="evict_oldest"))
    pol, st = toy.scheduler.policy, toy.scheduler.stats
    fit = [0, 1, 3]
    _, tokens, _ = _outputs(toy, [prompts[i] for i in fit])
    assert tokens == [want[i] for i in fit] and pol.evictions == st.preemptions == 0

    _, pre_tokens, pre_counts = _outputs(Engine(small_model, DeployConfig(**BASE, **SMALL_POOL)), prompts)
    ids, tokens, counts = _outputs(toy, prompts)
    assert pre_tokens == tokens == want
    assert pol.evictions >= 1 and pol.evictions == st.preemptions == sum(counts) == toy.metrics()["evictions"]
    assert [pol.victims.count(rid) for rid in ids] == counts
    assert counts != pre_counts  # it chose other victims than preempt's newest-first
    assert pol.age == {}  # nothing kept for finished requests
    text = ServingMetrics(toy, model_name="toy").text()
    assert f'glm53:evict_oldest_evictions_total{{engine="0",model_name="toy"}} {float(pol.evictions)}' in text


def test_in_the_simulator():
    cfg = glm53.get_preset("tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (37, 5, 70, 20)]
    runs = {}
    for policy in ("preempt", "evict_oldest"):
        eng = sim.build_engine(cfg, DeployConfig(**BASE, **SMALL_POOL, kv_policy=policy))
        outs = eng.generate(prompts, max_new_tokens=5)
        runs[policy] = eng, [o.token_ids.tolist() for o in outs], [o.num_preemptions for o in outs]
    eng, tokens, counts = runs["evict_oldest"]
    assert tokens == runs["preempt"][1]
    pol = eng.scheduler.policy
    assert isinstance(pol, EvictOldest) and pol.evictions >= 1 and pol.evictions == sum(counts)
    assert eng.metrics()["evictions"] == pol.evictions and eng.clock.now() > 0
