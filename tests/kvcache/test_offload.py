"""The host tier of tiered offloading (kvcache.policies.offload, kv_policy="offload"): a CPU prefix cache behind
the device pool. Against an engine without tiers (the same greedy tokens) and with the counts asserted:
pages stored as they fill, hits that replace recomputation after preemption and after the device cache
lost a prefix, LRU eviction on the host, pinned pages during a load, and bytes that follow the pages."""

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.synthetic import SyntheticRunner
from kvcache.block_pool import ARCBlockPool, KVCacheManager, block_hashes
from kvcache.policies.offload import OffloadPolicy, host_tier_blocks
from kvcache.transfer import PageCopy

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n) for n in lengths]


def test_preempted_requests_come_back_from_the_host_tier(small_model, small_reference):
    """A pool of 24 blocks under 4 requests preempts; with the device prefix cache off, whatever the victims
    had computed in full pages comes back from the host tier, so less is recomputed than under preempt."""
    prompts, want = small_reference
    runs = {}
    for policy, extra in (("preempt", {}), ("offload", dict(cpu_offload_bytes=1 << 24))):
        eng = Engine(small_model, DeployConfig(**BASE, num_gpu_blocks=24, enable_prefix_caching=False,
                                              kv_policy=policy, **extra))
        outs = eng.generate(prompts, max_new_tokens=5)
        assert [o.token_ids.tolist() for o in outs] == want
        runs[policy] = eng
    eng = runs["offload"]
    st, tier = eng.scheduler.stats, eng.metrics()["kv_offload"]["cpu"]
    assert st.preemptions >= 1 and st.offloads == 0  # nothing is copied at eviction
    assert tier["hits"] > 0 and tier["corrupt"] == 0
    assert st.recomputed_tokens < runs["preempt"].scheduler.stats.recomputed_tokens
    # the bytes are the pages: each stored page is one page of its group in every layer
    pages = eng.runner.host.page_bytes
    pol = eng.scheduler.policy
    tr = eng.scheduler.transfers
    assert tr.d2h_bytes == tier["store_bytes"] > 0 and tr.h2d_bytes == tier["load_bytes"] > 0
    assert tier["load_bytes"] % (pages["mla"] + pages["indexer"]) == 0  # block size 8 in both groups
    assert tier["stored_pages"] == pol.stats.stored_pages and not pol.pending and not pol.stored
    for p in pol.host.values():
        p.check()
        assert p.num_free == p.num_blocks  # nothing pinned once every request is done


def test_a_block_freed_while_its_store_is_pending_is_copied_before_it_is_reused(small_model, small_reference):
    """vLLM #52360's hazard: a page fills (its store goes out with the next step's plan), the next step's
    scheduling frees its block (the request is evicted or finishes) and hands it to another request,
    whose forward writes it in that same step. The plan carries both; the copy runs first, so the host
    keeps the right bytes: a second pass, served from the host tier, gives the small_reference tokens. (24
    blocks, the pool of the other engine tests here, so their compiled programs serve it too; small_reference
    prompts 3 and 2: a schedule that makes it happen, found with the synthetic runner.)"""
    prompts, want = small_reference
    eng = Engine(small_model, DeployConfig(**BASE, num_gpu_blocks=24, kv_policy="offload", cpu_offload_bytes=1 << 24))
    plans, execute = [], eng.runner.execute
    eng.runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    outs = eng.generate([prompts[3], prompts[2]], max_new_tokens=5)
    assert [o.token_ids.tolist() for o in outs] == [want[3], want[2]]
    reused, bs = 0, BASE["block_size"]  # both groups' pages hold block_size tokens here
    for plan in plans:
        stored = {(op.group, b) for op in plan.transfers if isinstance(op, PageCopy) and op.direction == "d2h"
                  for b in op.src}
        for i, row in enumerate(plan.rows):
            reused += len(stored & {(g, tables[i][p // bs]) for g, tables in plan.block_tables.items()
                                    for p in range(row.start, row.start + row.num_tokens)})
    assert reused >= 1  # the first pass had the hazard
    outs = eng.generate([prompts[3], prompts[2]], max_new_tokens=5)
    assert [o.token_ids.tolist() for o in outs] == [want[3], want[2]]
    assert eng.metrics()["kv_offload"]["cpu"]["hits"] > 0  # the second pass read what the racing stores wrote


def test_a_later_turn_hits_the_host_after_the_device_lost_its_prefix(small_model):
    """Turn 1 runs, the device prefix cache is wiped (as other traffic would evict it), turn 2 takes its
    whole prefix from the host tier and prefills only its new tokens; its tokens equal an engine without
    tiers. (The pool of the other engine tests here: the same compiled programs.)"""
    turn1 = _prompts([45], seed=3)[0]
    new = _prompts([7], seed=4)[0]
    outs = {}
    for policy, extra in (("preempt", {}), ("offload", dict(cpu_offload_bytes=1 << 24))):
        eng = Engine(small_model, DeployConfig(**BASE, num_gpu_blocks=24, kv_policy=policy, **extra))
        out1 = eng.generate([turn1], max_new_tokens=3)[0]
        eng.scheduler.kv.pool.reset_prefix_cache()
        turn2 = np.concatenate([turn1, out1.token_ids, new])
        before = eng.scheduler.stats.prefix_hit_tokens
        out2 = eng.generate([turn2], max_new_tokens=4)[0]
        outs[policy] = (out1.token_ids.tolist(), out2.token_ids.tolist(), eng.scheduler.stats.prefix_hit_tokens - before,
                        eng)
    assert outs["offload"][:2] == outs["preempt"][:2]
    assert outs["preempt"][2] == 0  # nothing left on the device
    # turn 2 holds 45 + 3 + 7 = 55 tokens: turn 1's computed KV covers 47 of them (its last output token
    # was never fed back), i.e. 5 full blocks of 8
    assert outs["offload"][2] == 40
    eng = outs["offload"][3]
    tier = eng.metrics()["kv_offload"]["cpu"]
    assert tier["hits"] == 5 and tier["loaded_pages"] == 10  # 5 MLA + 5 indexer pages
    # turn 1 stored its 5 full blocks (47 computed tokens), turn 2 its 6th and 7th (55 tokens + 4 outputs,
    # 58 computed): every page stored once, none twice
    assert tier["stored_pages"] == 2 * 7


class _Req:
    def __init__(self, req_id, tokens):
        self.req_id, self._tokens, self.num_computed_tokens = req_id, np.asarray(tokens), 0

    @property
    def num_tokens(self):
        return self._tokens.size

    @property
    def tokens(self):
        return self._tokens

    extra_keys = ()


def _run_to_full(kv, pol, req):
    """Admit `req`, allocate and compute all of it (as a step would), store its full pages."""
    req.num_computed_tokens = pol.admit(kv, req)
    kv.allocate(req.req_id, req.num_tokens)
    pol.prepare(kv, req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req.req_id, req.tokens, req.num_tokens)
    pol.after_step(kv, [req])


def test_host_tier_is_lru_and_pins_pages_it_is_loading():
    kv = KVCacheManager(64, 4, ("mla", "indexer"), enable_prefix_caching=False)
    pol = OffloadPolicy({"mla": 4, "indexer": 4}, {"mla": 100, "indexer": 10})
    rng = np.random.default_rng(0)
    a, b = _Req("a", rng.integers(0, 512, 9)), _Req("b", rng.integers(0, 512, 9))  # 2 full blocks each
    for r in (a, b):
        _run_to_full(kv, pol, r)
        pol.on_finish(kv, r)
        kv.free(r.req_id)
    ops = pol.take_transfers()
    assert [(op.group, op.direction, len(op.src)) for op in ops] == [("mla", "d2h", 2), ("indexer", "d2h", 2)] * 2
    assert pol.host_bytes_used() == 4 * 110
    # a's first page is found again: it becomes the most recently used, so a new request evicts b's pages
    a2 = _Req("a2", np.concatenate([a.tokens[:4], rng.integers(0, 512, 5)]))
    assert pol.admit(kv, a2) == 4
    a2.num_computed_tokens = 4
    assert pol.extra_blocks(kv, a2, 5) == 2  # one MLA and one indexer page wait for a device block
    # while a2's load is pending its host page is pinned: c's 4 pages take the other 3 host pages (LRU:
    # b's two, a's second), never the pinned one; the 4th is skipped, not written over c's first in the
    # same copy (one copy never names a host page twice)
    c = _Req("c", rng.integers(0, 512, 17))  # 4 full blocks
    _run_to_full(kv, pol, c)
    mla = pol.host["mla"]
    ha, hb, hc = (block_hashes(r.tokens, 4) for r in (a, b, c))
    pinned = mla.lookup("mla", ha[0])
    assert pinned is not None and mla.ref_count[pinned] == 1 and mla.ref_count.count(0) == 3
    assert all(mla.lookup("mla", h) is None for h in (hb[0], hb[1], ha[1], hc[3]))
    assert all(mla.lookup("mla", h) is not None for h in hc[:3])
    assert pol.stats.store_skipped_pages == 2 and pol.stats.stored_pages == 2 * (2 + 2 + 3)
    pol.take_transfers()
    kv.allocate("a2", a2.num_tokens)
    pol.prepare(kv, a2, 5)
    (load_mla, load_index) = pol.take_transfers()
    assert isinstance(load_mla, PageCopy) and load_mla.direction == "h2d" and load_mla.src == (pinned,)
    assert load_mla.dst == (kv.block_table("a2", "mla")[0],) and load_index.group == "indexer"
    assert pol.stats.hits == 1 and pol.stats.misses == 2 + 2 + 4 + 1  # a2's second block was never computed
    assert mla.ref_count.count(0) == 4  # unpinned once its load is recorded
    # with every host page pinned, a store has nowhere to go: it is skipped and counted
    full = OffloadPolicy({"mla": 1, "indexer": 1}, {"mla": 100, "indexer": 10})
    kv2 = KVCacheManager(64, 4, ("mla", "indexer"))
    _run_to_full(kv2, full, _Req("x", a.tokens[:5]))  # one full block
    kv2.free("x")
    kv2.pool.reset_prefix_cache()
    y = _Req("y", np.concatenate([a.tokens[:4], rng.integers(0, 512, 9)]))  # hits x's first page on the host
    assert full.admit(kv2, y) == 4
    y.num_computed_tokens = 4
    kv2.allocate("y", y.num_tokens)
    kv2.requests["y"].num_cached_blocks = 3
    kv2.requests["y"].hashes = block_hashes(y.tokens, 4)
    full.after_step(kv2, [y])  # y's pages 1 and 2 (page 0 waits for its load) find the host page pinned
    assert full.stats.store_skipped_pages == 2 * 2
    for p in pol.host.values():
        p.check()


class _StoreOnePageAtATime(OffloadPolicy):
    """The host store as the docstring of OffloadPolicy._store states it, one page at a time: a lookup, then
    a hit touched and freed (in runs between allocations) or one host page allocated and keyed."""

    def _store(self, kv, reqs):
        copies = {}
        for req in reqs:
            rb, done = kv.requests[req.req_id], self.stored[req.req_id]
            chunks = rb.num_cached_blocks - rb.num_cached_blocks % self.blocks_per_chunk
            for g in kv.groups:
                r, pool, table = kv.ratio[g], self.host[g], rb.tables[g]
                full, fresh = chunks // r, []
                for j in range(done[g], full):
                    h = rb.hashes[(j + 1) * r - 1]
                    hb = pool.lookup(g, h)
                    if hb is not None:
                        fresh.append(hb)
                        continue
                    if table[j] < 0 or pool.num_free == 0:
                        self.stats.store_skipped_pages += table[j] >= 0
                        continue
                    if fresh:
                        pool.touch(fresh)
                        pool.free(fresh)
                        fresh = []
                    hb = pool.allocate(1)[0]
                    pool.cache(g, hb, h)
                    src, dst, infos = copies.setdefault(g, ([], [], []))
                    src.append(table[j]), dst.append(hb), infos.append(None)
                if fresh:
                    pool.touch(fresh)
                    pool.free(fresh)
                done[g] = max(done[g], full)
        for g, (src, dst, infos) in copies.items():
            self.host[g].free(dst)
            self.host_tier.copy_out(g, src, dst, infos)
            self.stats.stored_pages += len(src)
            self.stats.store_bytes += len(src) * self.page_bytes[g]


@pytest.mark.parametrize("eviction", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(24))
def test_the_host_store_is_one_page_at_a_time(eviction, seed):
    """OffloadPolicy._store looks a call's pages up at once and allocates consecutive misses in one call;
    it leaves the host pools, the copies and the counts as one page at a time does, where an allocation
    takes the LRU page that holds a later page of the same call, pinned pages leave no page free, and
    requests share prefixes (a two-letter alphabet)."""
    rng = np.random.default_rng(seed)
    sides = []
    for cls in (OffloadPolicy, _StoreOnePageAtATime):
        kv = KVCacheManager(256, 2, ("mla", "indexer"), group_tokens_per_block={"indexer": 4},
                            enable_prefix_caching=False)
        sides.append((kv, cls({"mla": 5, "indexer": 3}, {"mla": 100, "indexer": 10}, eviction=eviction)))
    draws = [(rng.integers(0, 2, int(rng.integers(3, 24))), rng.random() < 0.3) for _ in range(30)]
    for k, (tokens, keep) in enumerate(draws):
        views = []
        for kv, pol in sides:
            req = _Req(f"r{k}", tokens)
            _run_to_full(kv, pol, req)
            if not keep:  # else it stays admitted: what it loaded stays pinned until it finishes
                pol.on_finish(kv, req)
                kv.free(req.req_id)
            views.append(([p.state() for p in pol.host.values()], pol.take_transfers(), pol.stats))
        assert views[0] == views[1], f"request {k}"
    assert sides[0][1].stats.store_skipped_pages > 0 and sides[0][1].host["mla"].stats.evicted > 0


def test_host_tier_sizes_split_the_budget_by_bytes_per_token():
    # MLA pages of 8 tokens x 1,000 B, indexer pages of 32 tokens x 400 B: 125 + 12.5 B per token
    blocks = host_tier_blocks(137_500, {"mla": 1000, "indexer": 400}, {"mla": 8, "indexer": 32})
    assert blocks == {"mla": 125, "indexer": 31}  # 1,000 tokens each (31 whole indexer pages)
    sizes = DeployConfig(**BASE, num_gpu_blocks=24, kv_policy="offload", cpu_offload_bytes=1 << 20).kv_sizes(
        glm53.get_preset("tiny"))
    used = sum(sizes.host_blocks[g] * sizes.page_bytes[g] for g in sizes.host_blocks)
    assert used <= 1 << 20 and used > (1 << 20) - sum(sizes.page_bytes.values())
    with pytest.raises(ValueError, match="holds no page"):
        DeployConfig(**BASE, num_gpu_blocks=24, kv_policy="offload", cpu_offload_bytes=10).kv_sizes(glm53.get_preset("tiny"))


def test_blocks_per_chunk_stores_whole_chunks_only():
    kv = KVCacheManager(64, 4, ("mla", "indexer"))
    pol = OffloadPolicy({"mla": 16, "indexer": 16}, {"mla": 100, "indexer": 10}, blocks_per_chunk=2)
    r = _Req("r", np.arange(13))  # 3 full blocks: one chunk of 2 is stored, the third block waits for its pair
    _run_to_full(kv, pol, r)
    assert pol.stats.stored_pages == 2 * 2


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_synthetic_runner_counts_the_same_bytes(small_model, eviction):
    """The simulator's path (no arrays): the policy's byte counters equal what the runner counted."""
    deploy = DeployConfig(**BASE, num_gpu_blocks=24, enable_prefix_caching=False, kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24, "eviction_policy": eviction}})
    sizes = deploy.kv_sizes(small_model.cfg)
    eng = Engine(small_model, deploy, runner=SyntheticRunner(page_bytes=sizes.page_bytes))
    prompts = _prompts([37, 5, 70, 20])
    ids = [eng.add_request(p, SamplingParams(5)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    m = eng.metrics(ids)
    assert m["d2h_bytes"] == m["kv_offload"]["cpu"]["store_bytes"] and m["h2d_bytes"] == m["kv_offload"]["cpu"]["load_bytes"]
    assert m["kv_offload"]["cpu"]["hits"] > 0 and m["host_pool_bytes_peak"] >= m["host_pool_bytes_used"] > 0
    assert isinstance(eng.scheduler.policy.host["mla"], ARCBlockPool) == (eviction == "arc")
