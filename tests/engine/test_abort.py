"""Requests that end early: aborted while waiting (after a preemption, with KV saved or parked) or while
running, and stopped by a stop token, under each KV policy; afterwards nothing is held for them and the
other requests finish as they would have. The state machine (test_scheduler_states.py) aborts at random;
these tests make sure each policy's waiting state is actually reached."""

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.request import Status
from glm53.engine.synthetic import SyntheticRunner
from kvcache.layout import page_bytes

CFG = glm53.get_preset("tiny")


class _Model:
    cfg, dtype = CFG, "float32"


def _engine(policy: str, **extra) -> Engine:
    pages = page_bytes(CFG, "float32", 4, 4)
    fields = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=3, block_size=4, num_gpu_blocks=40,
                  kv_policy=policy, **extra)
    if policy in ("swap", "offload"):
        fields["cpu_offload_bytes"] = 64 * sum(pages.values())
    if policy == "hisparse":
        fields.update(hisparse_host_pool_bytes=64 * pages["mla"], cpu_offload_bytes=16 * pages["indexer"],
                      hisparse_device_buffer_size=16, num_gpu_blocks=52)
    d = DeployConfig(**fields)
    return Engine(_Model(), d, runner=SyntheticRunner(lambda row: 5, page_bytes=d.kv_sizes(CFG).page_bytes))


def _preempted_and_waiting(eng: Engine) -> str:
    """Three requests that overflow the pool: step until one was preempted and waits again."""
    rng = np.random.default_rng(0)
    ids = [eng.add_request(rng.integers(0, 512, 30), SamplingParams(30)) for _ in range(3)]
    sch = eng.scheduler
    for _ in range(200):
        eng.step()
        victims = [r for r in sch.waiting if r.num_preemptions]
        if victims:
            return victims[0].req_id
    raise AssertionError(f"no preemption: {ids}")


def _all_returned(eng: Engine) -> None:
    sch = eng.scheduler
    sch.kv.check()
    assert sch.kv.num_free_blocks == sch.kv.pool.num_blocks and not sch.kv.requests and not sch.kv._kept_hashes
    pol = sch.policy
    tier = getattr(pol, "host_tier", None)
    for pool in tier.pools.values() if tier is not None else ():  # offload's or HiSparse's host pools: nothing held
        pool.check()
        assert pool.num_free == pool.num_blocks
    if eng.deploy.kv_policy == "swap":
        assert pol.used_bytes == 0 and not pol.saved
    if eng.deploy.kv_policy == "hisparse":
        assert not pol.state and pol.host_mla.num_free == pol.host_mla.num_blocks


@pytest.mark.parametrize("policy", ["preempt", "swap", "offload", "hisparse"])
def test_aborting_a_preempted_waiting_request_releases_what_the_policy_saved(policy):
    eng = _engine(policy)
    victim = _preempted_and_waiting(eng)
    if policy == "swap":
        assert victim in eng.scheduler.policy.saved  # its KV waits on the host
    out = eng.abort_request(victim)
    assert eng.finished[victim].finish_reason == "abort" and eng.finished[victim].status is Status.FINISHED
    assert len(out.token_ids) < 30 and victim not in eng.scheduler.requests
    if policy == "swap":
        assert victim not in eng.scheduler.policy.saved
    while eng.has_unfinished():
        eng.step()
    assert all(len(eng.finished[r].output_ids) == 30 for r in eng.finished if r != victim)
    _all_returned(eng)
    with pytest.raises(KeyError, match="no live request"):
        eng.abort_request(victim)


@pytest.mark.parametrize("policy", ["preempt", "offload", "hisparse"])
def test_aborting_a_running_request_frees_its_blocks_and_keeps_its_prefix(policy):
    eng = _engine(policy)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 512, 33)
    a = eng.add_request(prompt, SamplingParams(20))
    b = eng.add_request(rng.integers(0, 512, 20), SamplingParams(5))
    for _ in range(4):  # a is past its prefill: 33 prompt tokens in 16-token chunks shared with b
        eng.step()
    assert eng.finished.get(a) is None and eng.requests[a].status is Status.RUNNING
    held = len(eng.scheduler.kv.requests[a].tables["mla"])
    free = eng.scheduler.kv.num_free_blocks
    eng.abort_request(a)
    assert eng.scheduler.kv.num_free_blocks >= free + held  # its blocks (and any lease) are back
    while eng.has_unfinished():
        eng.step()
    _all_returned(eng)
    # its full blocks stay cached: the same prompt again hits them (8 of its 33 tokens' full 4-token blocks)
    c = eng.add_request(prompt, SamplingParams(1))
    while eng.has_unfinished():
        eng.step()
    assert eng.finished[c].num_cached_tokens == 32 and eng.output(b).token_ids.tolist() == [5] * 5


def test_stop_tokens_end_a_request_after_min_tokens():
    def token(row):  # 3, 4, 5, ... per request: the k-th generated token is 3 + k
        return 3 + row.num_generated

    eng = Engine(_Model(), DeployConfig(max_model_len=64, max_num_seqs=4, block_size=4, num_gpu_blocks=40),
                 runner=SyntheticRunner(token))
    stop = eng.add_request(np.arange(10), SamplingParams(10, stop_token_ids=(6, 4)))
    late = eng.add_request(np.arange(10), SamplingParams(10, stop_token_ids=(4, 8), min_tokens=4))
    never = eng.add_request(np.arange(10), SamplingParams(3, stop_token_ids=(40,)))
    while eng.has_unfinished():
        eng.step()
    r = eng.finished
    assert r[stop].output_ids == [3, 4] and r[stop].finish_reason == "stop"
    assert r[late].output_ids == [3, 4, 5, 6, 7, 8] and r[late].finish_reason == "stop"  # 4 came before min_tokens
    assert r[never].output_ids == [3, 4, 5] and r[never].finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(3, min_tokens=4)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(3, stop_token_ids=[1])


@pytest.mark.parametrize("policy", ["offload", "hisparse"])
def test_aborting_a_request_while_its_tier_loads_are_in_flight(policy):
    """Offload, or HiSparse on the same host tier, with a simulated secondary tier whose loads take 5 s of
    runner time: a request whose prefix only the tier holds waits for its loads, pinning what they
    brought; aborted then, its pins are released, the engine still steps until the loads are reported
    (their host pages are reserved till then), and they land in the host pools unpinned."""
    from kvcache.tiers.sim import TierCosts

    pages = page_bytes(CFG, "float32", 4, 4)
    budget = 64 * sum(pages.values()) if policy == "offload" else 16 * pages["indexer"]
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "cpu_bytes_to_use": budget, "secondary_tiers": [{"type": "fs", "root_dir": "unused"}]}}
    fields = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=3, block_size=4, num_gpu_blocks=40)
    if policy == "hisparse":
        fields.update(kv_policy="hisparse", hisparse_host_pool_bytes=64 * pages["mla"], hisparse_device_buffer_size=16,
                      num_gpu_blocks=52)
    d = DeployConfig(**fields, kv_transfer_config=ktc)
    assert d.kv_policy == policy
    runner = SyntheticRunner(lambda row: 5, page_bytes=d.kv_sizes(CFG).page_bytes,
                             tier_costs={"fs": TierCosts(read_latency_s=5.0)})
    eng = Engine(_Model(), d, runner=runner)
    prompt = np.arange(30)
    eng.generate([prompt], max_new_tokens=2)  # its full pages go to the host tier and on to the fs tier
    eng.reset_prefix_cache()  # device and host forget them; the tier keeps them
    pol = eng.scheduler.policy
    tier = pol.host_tier
    busy = eng.add_request(np.arange(100, 110), SamplingParams(6))  # keeps steps computing: time stands still
    eng.step()
    rid = eng.add_request(prompt, SamplingParams(2))
    eng.step()
    assert pol.waiting_for(eng.requests[rid]) and tier.jobs  # its loads are under way
    eng.abort_request(rid)
    while eng.finished.get(busy) is None:
        eng.step()
    assert tier.jobs and eng.has_unfinished()  # the loads' host pages stay reserved until a step reads them
    while eng.has_unfinished():
        eng.step()
    assert not tier.jobs and not tier.loading and not tier.tier_pins
    _all_returned(eng)  # every host page unpinned
    assert eng.metrics()["kv_offload"]["fs"]["hits"] == 14  # 7 full pages of each group landed in the host tier
    # its 7 full pages of each group, and the 3 of the busy request (15 computed tokens), are host-cached
    assert {g: len(p.cached) for g, p in tier.pools.items()} == {"mla": 10, "indexer": 10}
    # aborted after its loads landed: the pages they brought, pinned for its admission, are released
    eng.reset_prefix_cache()
    rid = eng.add_request(prompt, SamplingParams(2))
    eng.step()  # nothing else to compute: the step lasts until the loads finish, and reports them
    assert not tier.jobs and len(tier.tier_pins[rid]) == 14 and eng.requests[rid].status is Status.WAITING
    eng.abort_request(rid)
    assert not tier.tier_pins and not tier.loading and eng.metrics()["kv_offload"]["fs"]["hits"] == 28
    _all_returned(eng)
