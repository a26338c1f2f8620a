"""HiSparse end to end on the tiny model cut to 4 layers (full and shared indexer layers): a pool so small
that requests decode in mixed residency, and second turns that start on prefixes held only by the host
pool (no residency, staging), must give the greedy tokens of full residency; the resolver's copies are
counted. Plus the residency policy's page rules, driven without a model."""

import dataclasses

import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from glm53.engine.request import Request, SamplingParams
from glm53.engine.scheduler import Scheduler
from glm53.engine.synthetic import SyntheticRunner
from kvcache.policies.hisparse import TAIL_PAGES, HiSparsePolicy
from kvcache.transfer import PageCopy
from tests.engine.serving_checks import check_buckets_used, count_compiles, random_arrivals, warm_up
from tests.engine.test_mtp import K, with_oracle_drafts

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
# indexer-key pages of 2 blocks: larger pages than the MLA group exercise the per-group page sizes
HISPARSE = dict(kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26, cpu_offload_bytes=1 << 24, index_block_size=16)
NEW = 10


@pytest.fixture(scope="module")
def hisparse_model():
    """The tiny preset cut to 4 layers (tests/models.py: IndexShare groups of 1 and 3 layers), so that rows
    copied per group (misses x layers of the group) are checked on groups of unequal length, at half the
    8-layer model's compile time."""
    import glm53
    from tests.models import four_layers

    return glm53.init(four_layers("tiny"), seed=0, std=0.1)


@pytest.fixture(scope="module")
def two_turns(hisparse_model):
    """Turn 1: four prompts; turn 2: each conversation so far, continued. Conversations 0 and 2 end on
    a page boundary (prompt + outputs - 1 = 80 / 88 computed tokens), and their second turn continues
    generating with no new tokens: the one token left to compute decodes straight on the host-only
    prefix (no residency). 1 and 3 append five new tokens: a multi-token chunk over the host-only
    prefix (its selected rows staged per tile, kvcache.views.StagingView)."""
    rng = np.random.default_rng(1)
    first = [rng.integers(0, 512, n) for n in (71, 55, 79, 45)]
    # full residency: the default policy with a pool that never runs out (tests/engine/test_engine.py
    # checks such an engine against one-request-at-a-time glm53.generate)
    full = Engine(hisparse_model, DeployConfig(**BASE))
    ref1 = [o.token_ids for o in full.generate(first, max_new_tokens=NEW)]
    second = [np.concatenate([p, out] + ([] if i % 2 == 0 else [rng.integers(0, 512, 5)]))
              for i, (p, out) in enumerate(zip(first, ref1))]
    ref2 = [o.token_ids.tolist() for o in full.generate(second, max_new_tokens=NEW)]
    assert full.scheduler.stats.preemptions == 0
    return first, [r.tolist() for r in ref1], second, ref2


def test_mixed_and_no_residency_match_full_residency(hisparse_model, two_turns, pool_history):
    first, ref1, second, ref2 = two_turns
    eng = Engine(hisparse_model, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=48))
    eng.scheduler.policy.resolve.log = []
    assert [o.token_ids.tolist() for o in eng.generate(first, max_new_tokens=NEW)] == ref1
    # between turns other sessions reuse the device pool; dropping its prefix cache does the same here,
    # so turn 2 finds its prefixes only in the host pools
    eng.scheduler.kv.pool.reset_prefix_cache()
    assert [o.token_ids.tolist() for o in eng.generate(second, max_new_tokens=NEW)] == ref2
    pol, res = eng.scheduler.policy, eng.scheduler.policy.resolve
    st = pol.stats
    assert st.residency_steps["mixed"] > 0 and st.residency_steps["none"] > 0
    assert st.released_pages > 0 and st.lost_pages > 0  # released pages whose blocks were reused
    assert st.host_prefix_pages > 0 and st.restored_index_pages > 0
    # chunks over host-only pages stage the rows they select, never whole pages
    assert st.staged_pages == 0 and res.staged_rows > 0 and res.staged_h2d_rows >= res.staged_rows
    assert res.hot_hits > 0 and res.hot_misses > 0
    # rows copied per request per step = sum over IndexShare groups of misses x layers of the group
    cfg = hisparse_model.cfg
    full = [i for i in cfg.full_indexer_layers if i < cfg.num_hidden_layers]
    layers_per_group = np.diff(full + [cfg.num_hidden_layers])
    assert layers_per_group.tolist() == [1, 3]  # shared layers are exercised
    for rec in res.log:
        assert (rec.misses <= cfg.index_topk).all() and (rec.hits + rec.misses <= cfg.index_topk).all()
        np.testing.assert_array_equal(rec.copied, rec.misses @ layers_per_group)
    assert res.h2d_rows == sum(int(rec.copied.sum()) for rec in res.log)
    # everything returns: no request state, no lease, device pool and host pool consistent
    eng.scheduler.kv.check()
    pol.host_mla.check()
    pol.host_index.check()
    assert not pol.state and not eng.scheduler.kv.leases and len(pol.free_leases) == eng.deploy.max_num_seqs
    m = eng.metrics()
    assert m["hot_hits"] == res.hot_hits and m["hot_misses"] == res.hot_misses and m["h2d_bytes"] > 0

    # The plan is all a runner needs: a runner without the model (replaying its tokens, completing the
    # transfers) drives device and host pools through the same history, with the same page counters and
    # bytes (less the decode steps' row copies, which only the model's resolver makes).
    history = pool_history.take()
    outputs = {o.req_id: o.token_ids.tolist() for o in map(eng.output, eng.finished)}
    syn = Engine(hisparse_model, eng.deploy, runner=SyntheticRunner(lambda row: outputs[row.req_id][row.num_generated],
                                                                page_bytes=eng.sizes.page_bytes))
    syn.generate(first, max_new_tokens=NEW)
    syn.scheduler.kv.pool.reset_prefix_cache()
    syn.generate(second, max_new_tokens=NEW)
    assert pool_history.take() == history and len(history) > 200
    assert dataclasses.asdict(syn.scheduler.policy.stats) == dataclasses.asdict(st)
    assert syn.scheduler.stats == eng.scheduler.stats
    mt, st_ = eng.scheduler.transfers, syn.scheduler.transfers
    copied = (res.h2d_rows + res.staged_h2d_rows) * eng.runner.host.row_bytes_mla
    assert st_.d2h_bytes == mt.d2h_bytes and st_.h2d_bytes == mt.h2d_bytes - copied


def test_room_in_the_pool_means_no_host_to_device_copies(hisparse_model, two_turns):
    first, ref1, _, _ = two_turns
    # the same pool (so the same compiled programs), two requests: 40 of its 48 blocks, above the watermark
    eng = Engine(hisparse_model, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=48))
    eng.scheduler.policy.resolve.log = []
    assert [o.token_ids.tolist() for o in eng.generate(first[:2], max_new_tokens=NEW)] == ref1[:2]
    assert eng.scheduler.policy.resolve.log == [] and eng.runner.half.lru_step == 0  # no decode step ran the resolver
    st = eng.scheduler.policy.stats
    assert st.precopied_pages > 0  # sealed pages still go to the host (pre-copy)
    assert st.released_pages == 0 and st.leases == 0 and eng.scheduler.transfers.h2d_bytes == 0
    assert eng.scheduler.policy.resolve.hot_misses == 0 and st.residency_steps["mixed"] == 0


# --------------------------------------------------------------------------- the policy without a model
def _scheduler(num_blocks=40, seqs=2):
    deploy = DeployConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=seqs, block_size=4,
                          num_gpu_blocks=num_blocks, kv_policy="hisparse", hisparse_host_pool_bytes=1)
    pol = HiSparsePolicy(host_mla_blocks=64, host_index_blocks=64, block_size=4, hot_rows=8,
                         max_leases=seqs, num_device_blocks=num_blocks)
    runner = SyntheticRunner(token=lambda row: 7, page_bytes={"mla": 1, "indexer": 1}, record=True)
    return Scheduler(deploy, num_blocks, policy=pol), pol, runner


def _run(sch, runner, steps):
    for _ in range(steps):
        plan = sch.schedule()
        sch.update(plan, runner.execute(plan), 0.0)


def _copies(runner, direction):
    return [op for op in runner.executed if isinstance(op, PageCopy) and op.direction == direction]


def test_pages_are_precopied_once_and_released_only_under_pressure():
    sch, pol, runner = _scheduler()
    a = Request("a", np.arange(30, dtype=np.int32), SamplingParams(max_new_tokens=20))
    sch.add(a)
    _run(sch, runner, 3)
    # prefill of 30 tokens sealed 7 pages of 4: one batched d2h copy of exactly those (planned after the
    # prefill step, executed before the next step's forward)
    d2h = _copies(runner, "d2h")
    assert d2h[0].group == "mla" and list(d2h[0].src) == sch.kv.block_table("a", "mla")[:7]
    assert pol.stats.precopied_pages == (a.num_computed_tokens // 4) and pol.stats.released_pages == 0
    # pressure: a second request takes most of the pool; below the watermark clean pages go: those of
    # the request with the most of them (b, 40 tokens, decoding after one step), oldest first, never
    # its tail, and at least one more than the hot buffer it leases first
    b = Request("b", np.arange(100, 140, dtype=np.int32), SamplingParams(max_new_tokens=2))
    sch.add(b)
    _run(sch, runner, 1)
    assert sch.kv.num_free_blocks >= pol.watermark
    table = sch.kv.block_table("b", "mla")
    released = [p for p, blk in enumerate(table) if blk < 0]
    assert len(released) > pol.lease_blocks and released == list(range(len(released)))  # oldest pages
    assert all(blk >= 0 for blk in table[-TAIL_PAGES:])
    assert pol.state["b"].lease >= 0 and len(sch.kv.leases["b"]) == pol.lease_blocks  # hot buffer leased
    assert -1 not in sch.kv.block_table("a", "mla") and pol.state["a"].lease < 0  # a was not needed
    assert sch.stats.preemptions == 0
    sch.kv.check()


def test_reused_block_makes_the_page_host_only():
    sch, pol, runner = _scheduler()
    a = Request("a", np.arange(30, dtype=np.int32), SamplingParams(max_new_tokens=20))
    sch.add(a)
    _run(sch, runner, 2)
    st = pol.state["a"]
    assert pol.make_room(sch.kv, sch.running, sch.kv.num_free_blocks + 1)
    (page, (blk, _)), *_ = st.unpinned.items()
    tables, _ = pol.row_tables(sch.kv, a)
    assert tables["mla"][page] == blk  # unpinned but intact: still read in place
    # hand every free block out once: the released page's block is reused by someone else
    sch.kv.pool.free(sch.kv.pool.allocate(sch.kv.num_free_blocks))
    lost = pol.stats.lost_pages
    tables, row = pol.row_tables(sch.kv, a)
    assert tables["mla"][page] == -1 and page not in st.unpinned and pol.stats.lost_pages > lost
    assert row.host_blocks[page] >= 0  # served from the host copy from now on
    assert row.lease == st.lease >= 0  # through the hot buffer


def test_evicted_request_comes_back_from_the_host_and_recomputes_only_its_tail():
    sch, pol, runner = _scheduler(num_blocks=40)
    a = Request("a", np.arange(30, dtype=np.int32), SamplingParams(max_new_tokens=20))
    sch.add(a)
    _run(sch, runner, 3)  # prefill 30 tokens, decode 2: 32 tokens, 7 full pages pre-copied
    sch._evict(a)
    assert sch.stats.preemptions == 1 and "a" not in pol.state and not sch.kv.requests
    # parked: the indexer-key pages went to the host offload pool, the MLA pages were already there
    assert pol.stats.parked_index_pages == 8 and pol.host_index.check() is None and pol.host_mla.check() is None
    sch.kv.pool.reset_prefix_cache()  # the device copies are gone: only the host pools can serve it
    _run(sch, runner, 1)
    st = pol.state["a"]
    assert a.status.name == "RUNNING" and pol.stats.host_prefix_pages == 8 and pol.stats.restored_index_pages == 8
    # all 32 computed tokens (8 full pages) came back: nothing recomputed, one new token computed; a
    # one-token chunk decodes on the host-only prefix through a hot buffer (no residency)
    assert sch.stats.recomputed_tokens == 0 and a.num_computed_tokens == 33
    assert sch.kv.block_table("a", "mla")[:8] == [-1] * 8 and st.lease >= 0 and pol.stats.staged_pages == 0
    assert not st.pending_index
    sch.kv.check()


def test_admission_that_does_not_fit_gives_back_its_host_references():
    sch, pol, runner = _scheduler(num_blocks=40)
    a = Request("a", np.arange(30, dtype=np.int32), SamplingParams(max_new_tokens=3))
    sch.add(a)
    _run(sch, runner, 5)  # finished and parked
    assert not sch.running and not pol.state
    refs = (list(pol.host_mla.ref_count), list(pol.host_index.ref_count))
    sch.kv.pool.reset_prefix_cache()
    b = Request("b", np.concatenate([np.arange(30), [7, 7, 7]]).astype(np.int32), SamplingParams(max_new_tokens=2))
    hog = sch.kv.pool.allocate(sch.kv.num_free_blocks - 1)  # no room for b's restored pages
    sch.add(b)
    _run(sch, runner, 1)
    assert b.status.name == "WAITING" and "b" not in pol.state and "b" not in sch.kv.requests
    assert (list(pol.host_mla.ref_count), list(pol.host_index.ref_count)) == refs  # nothing leaked
    sch.kv.pool.free(hog)
    _run(sch, runner, 1)
    assert b.status.name == "RUNNING" and pol.stats.host_prefix_pages > 0


# ------------------------------------------------------------------ behind a secondary tier (issue 20)
def _tiered(root, **ktc) -> DeployConfig:
    """The deployment above with a filesystem tier behind its host pools: kv_transfer_config's
    cpu_bytes_to_use is HiSparse's offload budget (the indexer-key pool), the policy stays HiSparse."""
    extra = {"cpu_bytes_to_use": HISPARSE["cpu_offload_bytes"],
             "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}
    ktc = {"kv_connector": "OffloadingConnector", **ktc, "kv_connector_extra_config": extra}
    d = DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=48, kv_transfer_config=ktc)
    assert d.kv_policy == "hisparse"
    return d


@pytest.fixture(scope="module")
def stored_turn_1(hisparse_model, two_turns, tmp_path_factory):
    """A root written by a HiSparse engine that served the first turns (in mixed residency): its
    pre-copied MLA pages and parked indexer pages, written through to the filesystem tier. -> (the root,
    the engine, a copy of the root as engine 1 left it: the engines of later tests write to the root)."""
    import shutil

    first, ref1, _, _ = two_turns
    root = tmp_path_factory.mktemp("hisparse_fs")
    eng = Engine(hisparse_model, _tiered(root))
    assert [o.token_ids.tolist() for o in eng.generate(first, max_new_tokens=NEW)] == ref1
    eng.shutdown()  # every store reported is on disk
    snapshot = tmp_path_factory.mktemp("hisparse_fs_turn_1") / "root"
    shutil.copytree(root, snapshot)
    return root, eng, snapshot


def test_a_new_engine_serves_the_next_turns_from_the_tier(hisparse_model, two_turns, stored_turn_1):
    """Engine 1 pre-copied every sealed MLA page and parked every indexer page of the first turns, and
    wrote each through to the filesystem tier. Engine 2 (empty device and host pools) on the same root
    serves the second turns: the prefixes load from the tier into its host pools while the admissions
    answer RETRY, the MLA pages stay host-only (no residency, then staging for the turns with new
    tokens), the indexer pages are copied back; its greedy tokens are those of full residency (and so of
    HiSparse without tiers: test_mixed_and_no_residency_match_full_residency)."""
    first, _, second, ref2 = two_turns
    root, one, _ = stored_turn_1
    st = one.scheduler.policy.stats
    assert st.released_pages > 0 and st.residency_steps["mixed"] > 0  # the first turns ran in mixed residency
    m = one.metrics()["kv_offload"]
    assert set(m) == {"fs"}  # the tiers' counters; HiSparse counts its host pools itself
    # write-through: every full page of both groups went to the tier once (what turn 1 computed: its
    # prompt and all but the last output). Pre-copies may exceed it: a page recomputed after a
    # preemption whose hash a parked page still holds is copied to a private host page, not stored again
    computed = [len(p) + NEW - 1 for p in first]
    pages = {"mla": sum(c // 8 for c in computed), "indexer": sum(c // 16 for c in computed)}
    assert m["fs"]["stored_chunks"] == sum(pages.values()) and m["fs"]["store_failed"] == 0
    assert m["fs"]["store_bytes"] == sum(n * one.sizes.page_bytes[g] for g, n in pages.items())
    assert st.precopied_pages >= pages["mla"] and st.parked_index_pages == pages["indexer"]

    two = Engine(hisparse_model, _tiered(root))
    assert [o.token_ids.tolist() for o in two.generate(second, max_new_tokens=NEW)] == ref2
    two.shutdown()
    fs, st = two.metrics()["kv_offload"]["fs"], two.scheduler.policy.stats
    # a hit ends on an indexer page (16 tokens)
    hits = [min(c, len(s) - 1) // 16 * 16 for c, s in zip(computed, second)]
    assert two.scheduler.stats.prefix_hit_tokens == sum(hits)  # nothing of it recomputed
    # loaded: the MLA pages up to the prompt's last full page (or the last one stored) and the indexer pages
    loaded = sum(min(c, len(s) - 1) // 8 + c // 16 for c, s in zip(computed, second))
    assert fs["hits"] == fs["loaded_chunks"] == loaded and fs["corrupt"] == fs["lost"] == 0
    assert fs["load_bytes"] > 0 and two.scheduler.transfers.h2d_bytes > 0
    # (a request preempted and admitted again takes its parked prefix back once more)
    assert st.host_prefix_pages >= sum(hits) // 8 and st.restored_index_pages >= sum(hits) // 16
    # host-only prefixes: decoded, and the chunks over them staged the rows they select
    assert st.residency_steps["none"] > 0 and two.scheduler.policy.resolve.staged_rows > 0
    pol = two.scheduler.policy
    assert not pol.host_tier.tier_pins and not pol.host_tier.jobs and not pol.state
    assert all(p.num_free == p.num_blocks for p in pol.host_tier.pools.values())
    from prometheus_client.parser import text_string_to_metric_families

    from glm53.engine.prometheus import ServingMetrics

    samples = {(x.name, x.labels.get("tier")): x.value
               for f in text_string_to_metric_families(ServingMetrics(two, "tiny").text()) for x in f.samples}
    assert samples[("vllm:kv_offload_hits_total", "fs")] == loaded
    assert ("vllm:kv_offload_hits_total", "cpu") not in samples


def test_an_offload_engine_serves_the_next_turns_from_hisparse_chunks(hisparse_model, two_turns, stored_turn_1, tmp_path):
    """The chunk keys name the layout, not the policy, and HiSparse's host pages are laid out as the
    offload host tier's: an offload engine of the same layout (kv_policy="offload", the same page
    sizes) on a copy of engine 1's root serves the second turns from HiSparse's chunks, every one of
    them loaded, with full residency's greedy tokens."""
    import shutil

    first, _, second, ref2 = two_turns
    _, one, turn_1 = stored_turn_1
    shutil.copytree(turn_1, tmp_path / "root")
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 24, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "root")}]}}
    off = Engine(hisparse_model, DeployConfig(**BASE, index_block_size=16, num_gpu_blocks=48, kv_transfer_config=ktc))
    assert off.deploy.kv_policy == "offload" and off.fingerprint == one.fingerprint
    assert [o.token_ids.tolist() for o in off.generate(second, max_new_tokens=NEW)] == ref2
    off.shutdown()
    fs = off.metrics()["kv_offload"]["fs"]
    computed = [len(p) + NEW - 1 for p in first]
    # what the HiSparse engine above loaded: the same pages (a hit ends on an indexer page here too)
    loaded = sum(min(c, len(s) - 1) // 8 + c // 16 for c, s in zip(computed, second))
    assert fs["hits"] == fs["loaded_chunks"] == loaded and fs["corrupt"] == fs["lost"] == 0
    assert off.scheduler.stats.prefix_hit_tokens == sum(min(c, len(s) - 1) // 16 * 16 for c, s in zip(computed, second))


def test_corrupt_chunks_are_recomputed_or_fail_by_policy_under_hisparse(hisparse_model, two_turns, stored_turn_1,
                                                                        tmp_path):
    """Chunks flipped on disk: the MLA page at hash block 2 of every second-turn prompt, and the first
    indexer page of the last one. An engine on that root loads every chunk of the prefixes, finds those
    five corrupt (deleted, their tokens recomputed), and takes the prefix up to the first of them: the
    first indexer page (16 tokens) of three prompts, nothing of the fourth; its greedy tokens are those
    of full residency. Under kv_load_failure_policy="fail" the requests that needed those chunks end with
    "error" instead (generate raises naming the policy once the others are done)."""
    import shutil

    from kvcache.block_pool import block_hashes
    from kvcache.tiers import chunk_key

    _, _, second, ref2 = two_turns
    _, one, turn_1 = stored_turn_1  # the root as engine 1 left it (engine 2 above stored its turns there too)
    bad = [chunk_key(one.fingerprint, "mla", block_hashes(p, 8)[2]) for p in second]
    bad.append(chunk_key(one.fingerprint, "indexer", block_hashes(second[3], 8)[1]))  # page 0 = 2 hash blocks

    def damaged(dst):
        shutil.copytree(turn_1, dst)
        for key in bad:
            (path,) = dst.rglob(key.hex() + ".kv")
            data = bytearray(path.read_bytes())
            data[-7] ^= 0xFF
            path.write_bytes(bytes(data))
        return dst

    eng = Engine(hisparse_model, _tiered(damaged(tmp_path / "a")))
    assert [o.token_ids.tolist() for o in eng.generate(second, max_new_tokens=NEW)] == ref2
    eng.shutdown()
    fs = eng.metrics()["kv_offload"]["fs"]
    computed = [len(p) + NEW - 1 for p in two_turns[0]]
    loaded = sum(min(c, len(s) - 1) // 8 + c // 16 for c, s in zip(computed, second))  # as on the intact root
    assert fs["corrupt"] == len(bad) and fs["hits"] == loaded - len(bad) and fs["lost"] == 0
    assert eng.scheduler.stats.prefix_hit_tokens == 3 * 16
    assert not eng.scheduler.policy.host_tier.tier_pins
    eng = Engine(hisparse_model, _tiered(damaged(tmp_path / "b"), kv_load_failure_policy="fail"))
    with pytest.raises(RuntimeError, match="kv_load_failure_policy='fail'"):
        eng.generate(second, max_new_tokens=NEW)
    eng.shutdown()


# ------------------------------------------------------------- with MTP, on the 2-layer model (last: its
# programs are the file's most numerous)
# two rows of 1 + K or 16 tokens in one 64-position window: 4 bucket shapes (a window that grows under
# MTP and HiSparse is tests/engine/test_hisparse_beyond_pool.py's mtp3 case: 64 to 1,024 positions)
MTP_BASE = dict(BASE, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2)


@pytest.fixture(scope="module")
def small_two_turns(small_model):
    """`two_turns` on the 2-layer model (tests/engine/conftest.py) at half the lengths (every turn within
    64 positions: conversations 0 and 2 still end on a page boundary, 1 and 3 still append five tokens),
    full residency's greedy tokens from an engine of the MTP test's shapes without HiSparse or MTP."""
    rng = np.random.default_rng(1)
    first = [rng.integers(0, 512, n) for n in (35, 27, 39, 22)]
    full = Engine(small_model, DeployConfig(**MTP_BASE))
    ref1 = [o.token_ids.tolist() for o in full.generate(first, max_new_tokens=NEW)]
    second = [np.concatenate([p, out] + ([] if i % 2 == 0 else [rng.integers(0, 512, 5)]))
              for i, (p, out) in enumerate(zip(first, ref1))]
    ref2 = [o.token_ids.tolist() for o in full.generate(second, max_new_tokens=NEW)]
    assert full.scheduler.stats.preemptions == 0
    return first, ref1, second, ref2


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["sequential", "batched"])
def test_mtp_under_hisparse_matches_full_residency_and_compiles_nothing_after_warmup(small_model, small_two_turns,
                                                                                     verify):
    """HiSparse with MTP (issue 21 item 4), on the 2-layer model: after the runner's warm-up, the two
    turns above with K = 3 drafts that stand 0..K at a time (an oracle's, tests/engine/test_mtp.py) and
    the KV of every position that does not stand poisoned after each step, on a pool small enough that
    pages are released and verify steps, the MTP pass and the draft passes read host-only rows through
    the hot buffer, give full residency's non-speculative greedy tokens; then requests arriving at
    random, greedy and sampled, keep the pool under pressure. The whole run compiles nothing inside the
    runner (tests/engine/test_recompilation.py's check for the other policies: the cases
    mtp_hisparse and mtp_hisparse_batched were merged here, with every assertion they made).
    Sequential verify: a hot buffer of 2 x top-k rows, below MTP's default (K + 2) x top-k, so that
    the positions of one verify step evict each other's rows: each resolves and reads its own selection
    before the next one runs. Batched verify: one plan per group and step for the union of the 1 + K
    positions' selections, in a hot buffer of (1 + K) x top-k rows, the least that holds it."""
    first, ref1, second, ref2 = small_two_turns
    cfg = small_model.cfg
    spec = {"method": "mtp", "num_speculative_tokens": K, "verify": verify}
    rows, blocks = (2 * cfg.index_topk, 20) if verify == "sequential" else ((1 + K) * cfg.index_topk, 28)
    eng = Engine(small_model, DeployConfig(**MTP_BASE, **HISPARSE, num_gpu_blocks=blocks, speculative_config=spec,
                                          hisparse_device_buffer_size=rows))
    runner = eng.runner
    assert runner.verify_mode == verify
    assert len(runner.bucket_shapes()) == 2 * 2  # rows 1, 2; tokens per row 1 + K, 16; window 64
    warm_up(eng)
    eng.scheduler.policy.resolve.log = []
    compiles = count_compiles(eng)
    want = {}
    log = with_oracle_drafts(eng, want)
    for prompts, ref in ((first, ref1), (second, ref2)):
        ids = [eng.add_request(p, SamplingParams(NEW)) for p in prompts]
        want.update(zip(ids, ref))
        while eng.has_unfinished():
            eng.step()
        assert [eng.output(r).token_ids.tolist() for r in ids] == ref
        eng.scheduler.kv.pool.reset_prefix_cache()  # turn 2 finds its prefixes in the host pools only
    assert {len(toks) - 1 for step in log for nd, toks in step.values() if nd and toks} == set(range(K + 1))
    # requests arriving at random (the MTP layer's own drafts), greedy and sampled, long enough to decode
    # under pressure
    random_arrivals(eng, 120, (20, 50), lambda n, rng: rng.integers(8, 64 - n))
    while eng.has_unfinished():
        eng.step()
    assert sum(compiles) == 0 and len(compiles) > 150, f"{sum(compiles)} compilations during the run"

    pol, res = eng.scheduler.policy, eng.scheduler.policy.resolve
    st = pol.stats
    assert st.released_pages > 0 and st.residency_steps["mixed"] > 0 and st.precopied_pages > 0
    assert st.leases > 0 and st.parked_index_pages > 0
    assert res.hot_hits > 0 and res.hot_misses > 0
    assert eng.scheduler.transfers.d2h_bytes > 0 and eng.scheduler.transfers.h2d_bytes > 0
    if verify == "sequential":  # chunks over host-only pages ran the staging programs (warmed up too)
        assert runner.staging_shapes and res.staged_rows > 0
    # each of a leased verify group's forwards (verify, MTP pass, draft passes) resolved: the target's
    # group (a full and a shared layer), and the MTP layer's own indexer (a group of one layer); rows
    # copied = misses x layers
    layers_per_group = np.diff(list(cfg.full_indexer_layers) + [cfg.num_layers_with_mtp])
    assert layers_per_group.tolist() == [2, 1]
    assert any(rec.misses[:, :-1].any() for rec in res.log) and any(rec.misses[:, -1].any() for rec in res.log)
    for rec in res.log:
        assert (rec.hits + rec.misses <= (1 + K) * cfg.index_topk).all()
        np.testing.assert_array_equal(rec.copied, rec.misses @ layers_per_group)
    check_buckets_used(eng, {16})
    eng.scheduler.kv.check()
    pol.host_mla.check()
    assert not pol.state and not eng.scheduler.kv.leases and len(pol.free_leases) == eng.deploy.max_num_seqs
