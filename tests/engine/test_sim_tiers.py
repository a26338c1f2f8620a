"""Secondary tiers in the simulator (glm53.engine.sim, kvcache.tiers.sim): the offload policy's tier
stores, RETRY admissions and tier loads run on simulated tiers whose jobs finish on the virtual clock.

What does not depend on time matches the model runner's run: the counts tests/kvcache/test_tiers.py
expects of the filesystem tier (every full page stored once; a second pass over the same prompts loads
every full page short of each prompt's last token from the tier) come out the same, priced or not.
With tiers that cost nothing, pricing changes no decision, event for event."""

import dataclasses
import math

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine
from glm53.engine import sim
from glm53.engine.synthetic import SyntheticRunner
from glm53.perfmodel import NVME_GEN4, STORAGE, StorageSpec

TINY = glm53.get_preset("tiny")
# tests/kvcache/test_tiers.py's deployment and prompt lengths (37, 5, 70, 20 tokens, 5 new tokens each)
BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
LENGTHS = (37, 5, 70, 20)
STORED = 2 * sum((n + 4) // 8 for n in LENGTHS)  # full pages once each request is done, both groups
HIT_BLOCKS = sum((n - 1) // 8 for n in LENGTHS)  # full pages short of each prompt's last token
INSTANT = {"fs": StorageSpec("instant", math.inf, math.inf, 0.0, 0.0)}
TINY_PAGE_BYTES = {"mla": 18432, "indexer": 2048}  # the tiny model's page of each group (block_size 8)


def _ktc(cpu=1 << 20, **fs):
    return {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu,
                                          "secondary_tiers": [{"type": "fs", "root_dir": "/unused", **fs}]}}


def _prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, n) for n in lengths]


def _two_passes(eng: Engine, prompts):
    """Pass 1 stores every full page; the device and host prefix caches are then dropped (the tier keeps
    its chunks), and pass 2 serves the same prompts. -> (tier counters after each pass, prefix-hit tokens
    of pass 2)."""
    eng.generate(prompts, max_new_tokens=5)
    first = eng.metrics()["kv_offload"]
    eng.reset_prefix_cache()
    hits = eng.scheduler.stats.prefix_hit_tokens
    eng.generate(prompts, max_new_tokens=5)
    eng.shutdown()
    return first, eng.metrics()["kv_offload"], eng.scheduler.stats.prefix_hit_tokens - hits


@pytest.mark.parametrize("storage", ["instant", "nvme"])
def test_the_second_pass_loads_every_full_page_from_the_tier(storage):
    """The counts of the filesystem tier's engine test (a new engine on a root holding every chunk), on
    simulated tiers, with free tiers and with the NVMe model: they do not depend on time."""
    eng = sim.build_engine(TINY, DeployConfig(**BASE, kv_transfer_config=_ktc()),
                           tier_storage=INSTANT if storage == "instant" else STORAGE)
    first, second, hit_tokens = _two_passes(eng, _prompts())
    assert first["cpu"]["stored_pages"] == STORED and first["fs"]["hits"] == 0
    fs = second["fs"]
    assert fs["hits"] == fs["loaded_chunks"] == 2 * HIT_BLOCKS and fs["lost"] == fs["corrupt"] == 0
    assert fs["load_bytes"] == HIT_BLOCKS * sum(eng.sizes.page_bytes.values())
    assert second["cpu"]["hits"] - first["cpu"]["hits"] == HIT_BLOCKS  # then loaded host -> device
    assert hit_tokens == 8 * HIT_BLOCKS
    # every page the host tier stored reached the tier (write-through; the last ones at shutdown)
    assert fs["stored_chunks"] == second["cpu"]["stored_pages"] and fs["store_failed"] == 0
    assert fs["store_bytes"] == second["cpu"]["store_bytes"]
    if storage == "nvme":  # the jobs took simulated time: each its chunk's bytes / bandwidth + the fixed time
        read_s = fs["load_bytes"] / NVME_GEN4.read_bandwidth
        assert fs["load_time_s"] >= read_s + fs["load_jobs"] * NVME_GEN4.read_latency_s
        assert fs["store_time_s"] > 0 and eng.runner.tiers.tiers[0].reads.busy_s == pytest.approx(read_s)


def test_with_free_tiers_pricing_changes_no_decision(pool_history):
    """Tiers that cost nothing finish every job in the step that submits it, priced or not: the simulator
    and an unpriced synthetic runner give the same block-pool history, tokens and counters over both
    passes (the tier loads included)."""
    deploy = DeployConfig(**BASE, kv_transfer_config=_ktc(cpu=1 << 15))  # a small host tier: evictions
    eng = sim.build_engine(TINY, deploy, tier_storage=INSTANT)
    a = _two_passes(eng, _prompts())
    hist = pool_history.take()
    plain = Engine(TINY, eng.deploy, runner=SyntheticRunner(sim.hash_token(TINY.vocab_size), eng.sizes.page_bytes))
    b = _two_passes(plain, _prompts())
    assert pool_history.take() == hist and len(hist) > 100
    assert a == b and a[1]["fs"]["hits"] > 0 and a[1]["cpu"]["stored_pages"] > a[1]["cpu"]["hits"]
    assert [eng.output(r).token_ids.tolist() for r in eng.finished] == \
        [plain.output(r).token_ids.tolist() for r in plain.finished]
    assert eng.clock.now() == pytest.approx(eng.runner.busy_s)  # nothing waited


def test_a_retry_admission_waits_simulated_time_until_the_store_lands():
    """A tier that writes 1 MB/s: pass 2 starts while pass 1's stores are still being written, so its
    lookups answer RETRY and the requests wait, in simulated time, until the chunks land; then they load
    every full page as before. The clock passes the last landing; the waits are not priced work."""
    slow = {"fs": dataclasses.replace(NVME_GEN4, write_bandwidth=1e6)}
    eng = sim.build_engine(TINY, DeployConfig(**BASE, kv_transfer_config=_ktc()), tier_storage=slow)
    prompts = _prompts()
    eng.generate(prompts, max_new_tokens=5)
    tier = eng.runner.tiers.tiers[0]
    pending = tier.next_event_s()
    assert pending is not None and pending > eng.clock.now()  # pass 1 finished before its stores
    eng.reset_prefix_cache()
    eng.generate(prompts, max_new_tokens=5)
    fs = eng.metrics()["kv_offload"]["fs"]
    assert fs["retries"] > 0 and fs["hits"] == 2 * HIT_BLOCKS
    assert eng.clock.now() >= pending > eng.runner.busy_s
    eng.shutdown()


@pytest.mark.parametrize("host_pages,rounds", [(2, 16), (3, 16), (64, 16), (2, 1), (3, 1)])
def test_what_a_full_host_tier_cannot_stage_is_computed_counted_and_logged(host_pages, rounds, caplog):
    """One page a step (8 batched tokens), so pass 1 stores every full page whatever the host tier's size.
    Pass 2 loads through a host tier of `host_pages` pages per group: each round's loads stay pinned until
    the admission, so a small one fills and the rest of the prompt is computed, whether the next round
    finds no host page or the request's load rounds (`rounds`) run out first. Every full page short of a
    prompt's last token is then either a hit or counted in the tier's `unstaged` (hash blocks), and the
    first such admission is logged."""
    page = sum(TINY_PAGE_BYTES.values())
    deploy = DeployConfig(**{**BASE, "max_num_batched_tokens": 8}, kv_transfer_config=_ktc(cpu=host_pages * page))
    eng = sim.build_engine(TINY, deploy, tier_storage=INSTANT)
    assert eng.sizes.host_blocks == {"mla": host_pages, "indexer": host_pages}
    eng.scheduler.policy.host_tier.max_tier_rounds = rounds
    with caplog.at_level("WARNING", logger="kvcache.host_tier"):
        first, second, hit_tokens = _two_passes(eng, _prompts())
    assert first["cpu"]["stored_pages"] == STORED
    unstaged = second["fs"]["unstaged"]
    assert hit_tokens + 8 * unstaged == 8 * HIT_BLOCKS
    assert (unstaged > 0) == (host_pages < 8)  # the longest prompt has 8 full pages short of its last token
    logged = [r for r in caplog.records if "no host page was free" in r.getMessage()]
    assert len(logged) == (unstaged > 0)


def test_runners_that_cannot_simulate_tiers_are_refused():
    class Bare:
        def execute(self, plan):
            raise AssertionError

    with pytest.raises(NotImplementedError, match="make_tiers"):
        Engine(TINY, DeployConfig(**BASE, kv_transfer_config=_ktc()), runner=Bare())
    obj = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "obj", "bucket": "kv-chunks"}]}}
    with pytest.raises(ValueError, match="no cost model for a secondary tier of type 'obj'"):
        sim.build_engine(TINY, DeployConfig(**BASE, kv_transfer_config=obj))
