"""HiSparse end to end on the tiny model (full and shared indexer layers): a pool so small that requests
decode in mixed residency, and second turns that start on prefixes held only by the host pool (no
residency, staging), must give the greedy tokens of full residency; the resolver's copies are counted.
Plus the residency policy's page rules, driven without a model."""

import dataclasses

import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from glm53.engine.request import Request, SamplingParams
from glm53.engine.scheduler import Scheduler
from glm53.engine.synthetic import SyntheticRunner
from kvcache.hisparse import TAIL_PAGES, HiSparsePolicy
from kvcache.transfer import PageCopy

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
# indexer-key pages of 2 blocks: larger pages than the MLA group exercise the per-group page sizes
HISPARSE = dict(kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26, cpu_offload_bytes=1 << 24, index_block_size=16)
NEW = 10


@pytest.fixture(scope="module")
def two_turns(tiny_model):
    """Turn 1: four prompts; turn 2: each conversation so far, continued. Conversations 0 and 2 end on
    a page boundary (prompt + outputs - 1 = 80 / 88 computed tokens), and their second turn continues
    generating with no new tokens: the one token left to compute decodes straight on the host-only
    prefix (no residency). 1 and 3 append five new tokens: a multi-token chunk over the host-only
    prefix (staged prefill)."""
    rng = np.random.default_rng(1)
    first = [rng.integers(0, 512, n) for n in (71, 55, 79, 45)]
    # full residency: the default policy with a pool that never runs out (tests/engine/test_engine.py
    # checks this engine against one-request-at-a-time glm53.generate, and it reuses that test's programs)
    full = Engine(tiny_model, DeployConfig(**BASE))
    ref1 = [o.token_ids for o in full.generate(first, max_new_tokens=NEW)]
    second = [np.concatenate([p, out] + ([] if i % 2 == 0 else [rng.integers(0, 512, 5)]))
              for i, (p, out) in enumerate(zip(first, ref1))]
    ref2 = [o.token_ids.tolist() for o in full.generate(second, max_new_tokens=NEW)]
    assert full.scheduler.stats.preemptions == 0
    return first, [r.tolist() for r in ref1], second, ref2


def test_mixed_and_no_residency_match_full_residency(tiny_model, two_turns, pool_history):
    first, ref1, second, ref2 = two_turns
    eng = Engine(tiny_model, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=48))
    eng.scheduler.resolve.log = []
    assert [o.token_ids.tolist() for o in eng.generate(first, max_new_tokens=NEW)] == ref1
    # between turns other sessions reuse the device pool; dropping its prefix cache does the same here,
    # so turn 2 finds its prefixes only in the host pools
    eng.scheduler.kv.pool.reset_prefix_cache()
    assert [o.token_ids.tolist() for o in eng.generate(second, max_new_tokens=NEW)] == ref2
    pol, res = eng.scheduler.policy, eng.scheduler.resolve
    st = pol.stats
    assert st.residency_steps["mixed"] > 0 and st.residency_steps["none"] > 0
    assert st.released_pages > 0 and st.lost_pages > 0  # released pages whose blocks were reused
    assert st.host_prefix_pages > 0 and st.staged_pages > 0 and st.restored_index_pages > 0
    assert res.hot_hits > 0 and res.hot_misses > 0
    # rows copied per request per step = sum over IndexShare groups of misses x layers of the group
    cfg = tiny_model.cfg
    full = [i for i in cfg.full_indexer_layers if i < cfg.num_hidden_layers]
    layers_per_group = np.diff(full + [cfg.num_hidden_layers])
    assert layers_per_group.tolist() == [1, 1, 4, 2]  # shared layers are exercised
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
    syn = Engine(tiny_model, eng.deploy, runner=SyntheticRunner(lambda row: outputs[row.req_id][row.num_generated],
                                                                page_bytes=eng.sizes.page_bytes))
    syn.generate(first, max_new_tokens=NEW)
    syn.scheduler.kv.pool.reset_prefix_cache()
    syn.generate(second, max_new_tokens=NEW)
    assert pool_history.take() == history and len(history) > 200
    assert dataclasses.asdict(syn.scheduler.policy.stats) == dataclasses.asdict(st)
    assert syn.scheduler.stats == eng.scheduler.stats
    mt, st_ = eng.scheduler.transfers, syn.scheduler.transfers
    assert st_.d2h_bytes == mt.d2h_bytes and st_.h2d_bytes == mt.h2d_bytes - res.h2d_rows * eng.runner.host.row_bytes_mla


def test_room_in_the_pool_means_no_host_to_device_copies(tiny_model, two_turns):
    first, ref1, _, _ = two_turns
    # the same pool (so the same compiled programs), two requests: 40 of its 48 blocks, above the watermark
    eng = Engine(tiny_model, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=48))
    eng.scheduler.resolve.log = []
    assert [o.token_ids.tolist() for o in eng.generate(first[:2], max_new_tokens=NEW)] == ref1[:2]
    assert eng.scheduler.resolve.log == [] and eng.runner.host.lru_step == 0  # no decode step ran the resolver
    st = eng.scheduler.policy.stats
    assert st.precopied_pages > 0  # sealed pages still go to the host (pre-copy)
    assert st.released_pages == 0 and st.leases == 0 and eng.scheduler.transfers.h2d_bytes == 0
    assert eng.scheduler.resolve.hot_misses == 0 and st.residency_steps["mixed"] == 0


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
