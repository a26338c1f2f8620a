"""HiSparse under tensor parallelism (issue 24 item 1) on simulated devices: TP2 x DP2 and TP2 with MTP3
HiSparse engines against TP2 full residency, staging under TP2 against the device-resident chunk, and
host pools shared by the TP ranks (split from tests/parallel/test_tp.py: each file runs in its own 16-device subprocess,
tests/parallel/conftest.py)."""

import dataclasses

import numpy as np
import pytest

from tests.parallel.test_model_cp import BS, TOL, WINDOW, _batch, _prompts


def _two_turns(model, deploy, first, extra, *, reset: bool):
    """Two turns of the conversations `first` under `deploy`: turn 2 continues each with its outputs and
    `extra[i]` new tokens; `reset`: the device prefix cache is dropped between the turns (turn 2 then finds
    its prefixes in HiSparse's host pools only). -> (tokens per turn, the engine)."""
    from glm53 import Engine

    eng = Engine(model, deploy)
    for rep in eng.replicas:  # HiSparse's resolver records (full residency's policy keeps none)
        if hasattr(rep.scheduler.policy, "resolve"):
            rep.scheduler.policy.resolve.log = []
    out1 = [o.token_ids.tolist() for o in eng.generate(first, max_new_tokens=10)]
    if reset:
        for rep in eng.replicas:
            rep.scheduler.kv.pool.reset_prefix_cache()
    second = [np.concatenate([p, o, e]).astype(np.int32) for p, o, e in zip(first, out1, extra)]
    return (out1, [o.token_ids.tolist() for o in eng.generate(second, max_new_tokens=10)]), eng


_TP2_FULL = {}  # the TP2 full-residency reference, shared by both cases


@pytest.mark.multidevice
@pytest.mark.parametrize("case", ["tp2_dp2", "tp2_mtp3"])
def test_engine_hisparse_under_tp2_equals_full_residency(small_model, case):
    """HiSparse under tensor parallelism (issue 24 item 1): on a two-turn workload, a HiSparse engine of
    TP2 replicas whose pools are small enough that pages are released, decode steps read host rows
    through the hot buffers and turn 2's chunks stage host rows gives the greedy tokens of one TP2 engine
    whose pool holds everything (the reference is TP2 too: TP's all-reduces round differently from one
    device, which can flip a top-k choice or a near-tied token over 20 tokens, and HiSparse must not
    change anything beyond that).
    - tp2_dp2: two data-parallel replicas of TP2 on 4 devices, each with its own host pools on its own two
      devices, shared by its two TP ranks (kvcache.host.HostMemory(shared=), docs/parallel.md): each rank
      holds half of its replica's pages.
    - tp2_mtp3: one TP2 replica with MTP (3 drafts of the model's MTP layer, sequential verify:
      non-speculative greedy tokens): the verify step, the MTP pass and the draft passes resolve through
      the view on the mesh too.
    Rows copied = misses x layers of each IndexShare group, per resolve."""
    from glm53 import DeployConfig

    rng = np.random.default_rng(1)
    first = [rng.integers(0, 512, n).astype(np.int32) for n in (35, 27, 39, 22)]
    extra = [rng.integers(0, 512, n).astype(np.int32) for n in (0, 5, 0, 5)]
    base = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8, tensor_parallel_size=2)
    if not _TP2_FULL:
        _TP2_FULL["tokens"], full = _two_turns(small_model, DeployConfig(**base), first, extra, reset=False)
        assert full.scheduler.stats.preemptions == 0
    cfg = small_model.cfg
    hs = dict(base, index_block_size=16, kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26,
              cpu_offload_bytes=1 << 24, num_gpu_blocks=48)
    mtp = case == "tp2_mtp3"
    if mtp:  # two rows of 1 + K or 16 tokens, as test_hisparse's MTP engines: 8 bucket shapes, not 24
        hs.update(max_num_batched_tokens=16, max_num_seqs=2, num_gpu_blocks=28,
                  hisparse_device_buffer_size=2 * cfg.index_topk,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3, "verify": "sequential"})
    else:  # two conversations per replica, half the pool each
        hs.update(data_parallel_size=2, max_num_seqs=2, num_gpu_blocks=24)
    got, eng = _two_turns(small_model, DeployConfig(**hs), first, extra, reset=True)
    assert got == _TP2_FULL["tokens"]
    layers = cfg.num_layers_with_mtp if mtp else cfg.num_hidden_layers
    per_group = np.diff([i for i in cfg.full_indexer_layers if i < layers] + [layers])
    devices = []
    for rep in eng.replicas:
        pol, res = rep.scheduler.policy, rep.scheduler.policy.resolve
        assert pol.stats.released_pages > 0 and pol.stats.residency_steps["mixed"] > 0
        assert res.hot_hits > 0 and res.hot_misses > 0 and res.staged_rows > 0
        for rec in res.log:
            np.testing.assert_array_equal(rec.copied, rec.misses @ per_group)
        if mtp:
            assert rep.scheduler.spec.num_drafts > 0 and any(rec.misses[:, -1].any() for rec in res.log)
        rep.scheduler.kv.check()
        pol.host_mla.check()
        host = rep.runner.host.host_tables["mla"][0]
        assert host.sharding.memory_kind == "pinned_host" and len(host.sharding.device_set) == 2
        # one pool shared by the replica's two ranks: each holds half of its pages (the misses gathered
        # where they live)
        assert [x.data.shape[0] for x in host.addressable_shards] == [host.shape[0] // 2] * 2
        devices.append(sorted(d.id for d in host.sharding.device_set))
        pools = sum(t.nbytes for tables in rep.runner.host.host_tables.values() for t in tables)
        assert eng.metrics()["host_pool_bytes_per_device"] == pools // 2
    assert devices == ([[0, 1]] if mtp else [[0, 1], [2, 3]]) and eng.num_devices == 2 * len(devices)


@pytest.mark.multidevice
def test_hisparse_staging_under_tp2_reads_what_the_device_holds(small_model):
    """A prefill chunk over host-only pages under TP2 (`CpKVCache.attend` with a replicated StagingView):
    its logits equal the same chunk's with every page on the device, bitwise, on one device and under TP2,
    with the same rows staged per layer (each rank stages the same rows), whether each rank holds the
    whole host pool or half of it (one pool shared by the ranks: `kvcache.host.take_shared_rows`)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm53.model import compiled
    from kvcache.views import StagingView
    from kvcache.paged import PagedKVCache
    from parallel import model as pmodel
    from parallel import tp as tp_ops
    from parallel.cp_cache import CpKVCache
    from parallel.mesh import make_mesh

    cfg, c = small_model.cfg, compiled(small_model)
    prompts = _prompts(cfg.vocab_size)
    tok, pos, _, _ = _batch(prompts)
    b, m = len(prompts), WINDOW // BS
    rng = np.random.default_rng(3)
    tok2 = rng.integers(0, cfg.vocab_size, (b, 8)).astype(np.int32)  # a chunk of 8 after each prompt
    pos2 = np.stack([np.arange(p.size, p.size + 8) for p in prompts]).astype(np.int32)
    table = np.arange(b * m, dtype=np.int32).reshape(b, m)
    host_only = np.where(np.arange(m) < 2, -1, table)  # each row's first 2 pages (8 tokens) on the host only
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(np.asarray(x)), tree)  # noqa: E731

    def run(tp, shared=False):
        local = PagedKVCache.create(cfg, b * m, BS, table, kv_cache_dtype="float32", include_mtp=False)
        if tp > 1:
            mesh = make_mesh(**tp_ops.mesh_sizes(tp, 1))
            state = tp_ops.place_state(c.state, cfg, mesh, False)
            wrap = lambda loc: CpKVCache(loc, "cp", 1, heads_split=True, gather_queries=True)  # noqa: E731
            fwd = lambda t, p, cache: pmodel.forward(  # noqa: E731
                state, jnp.asarray(t), jnp.asarray(p), cache, graphdef=c.graphdef, mesh=mesh, window=WINDOW,
                form="mqa", impl="auto", tensor_parallel=True)
            host = NamedSharding(mesh, P("tp") if shared else P(), memory_kind="pinned_host")
            local = pmodel.place(wrap(local), mesh).local
        else:
            wrap = lambda loc: loc  # noqa: E731
            fwd = lambda t, p, cache: c.forward(c.state, jnp.asarray(t), jnp.asarray(p), cache, window=WINDOW,  # noqa: E731
                                                form="mqa")[:2]
            host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        _, cache = fwd(tok, pos, wrap(local))
        loc = cache.local if tp > 1 else cache
        want, _ = fwd(tok2, pos2, wrap(copy(loc)))
        pools = tuple(jax.device_put(np.asarray(a), host) for a in loc.mla)  # every page has a host copy
        staged = dataclasses.replace(copy(loc).with_block_table(host_only, table),
                                     staging=StagingView.create(pools, table, tile=4, groups=len(cfg.full_indexer_layers),
                                                                host_axis="tp" if shared else None))
        got, out = fwd(tok2, pos2, wrap(staged))
        view = (out.local if tp > 1 else out).staging
        assert view.host_mla[0].sharding.memory_kind == "pinned_host"
        assert {x.data.shape[0] for x in view.host_mla[0].addressable_shards} == {b * m * BS // (2 if shared else 1)}
        return np.asarray(c.logits(c.state, want)), np.asarray(c.logits(c.state, got)), np.asarray(view.staged)

    results = {tp: run(tp) for tp in (1, 2)}
    results["2 shared"] = run(2, shared=True)
    for tp, (want, got, staged) in results.items():
        np.testing.assert_array_equal(got, want)
        assert staged[:, 0].min() > 0
    np.testing.assert_array_equal(results[2][2], results[1][2])
    np.testing.assert_array_equal(results["2 shared"][1], results[2][1])
    np.testing.assert_array_equal(results["2 shared"][2], results[2][2])
    assert np.abs(results[2][0] - results[1][0]).max() <= TOL * np.abs(results[1][0]).max()


@pytest.mark.multidevice
def test_host_pools_shared_by_tp_ranks_hold_one_copy_and_move_the_same_bytes(small_model):
    """HostMemory on a TP2 x DCP2 mesh: host pools shared by the TP ranks (each device 1/4 of a pool:
    its DCP shard, halved) against pools replicated over them (1/2 each). The same page copies both
    ways, tier reads and writes give the same device cache and the same canonical page bytes; a pool of
    5 pages is padded to 6 so that both TP ranks hold whole pages."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvcache.host import HostMemory
    from kvcache.paged import PagedKVCache
    from kvcache.transfer import PageCopy
    from parallel.mesh import make_mesh

    cfg, nb, ibs = small_model.cfg, 8, 2 * BS
    mesh = make_mesh(tp=2, cp=2)
    rng = np.random.default_rng(0)
    local = PagedKVCache.create(cfg, 2 * nb, BS, np.full((1, 4), -1, np.int32), kv_cache_dtype="float32",
                                include_mtp=False, index_block_size=ibs, index_block_table=np.full((1, 2), -1, np.int32))
    on = lambda a, kind="device": jax.device_put(a, NamedSharding(mesh, P("cp"), memory_kind=kind))  # noqa: E731
    fill = lambda arrays: tuple(on(rng.standard_normal(a.shape).astype(np.float32)) for a in arrays)  # noqa: E731
    cache = dataclasses.replace(local, mla=fill(local.mla), index=fill(local.index))

    def memory(shared):
        return HostMemory(cache, page_rows={"mla": BS, "indexer": ibs}, kv_ranks=2, num_blocks=nb,
                          host=NamedSharding(mesh, P("cp"), memory_kind="pinned_host"),
                          device=NamedSharding(mesh, P("cp"), memory_kind="device"),
                          host_blocks={"mla": 5, "indexer": 3}, shared=("tp", 2) if shared else None)

    results = []
    for shared in (False, True):
        mem = memory(shared)
        assert mem.host_blocks == ({"mla": 6, "indexer": 4} if shared else {"mla": 5, "indexer": 3})
        tables = mem.host_tables["mla"][0]
        assert tables.sharding.memory_kind == "pinned_host"
        assert {x.data.shape[0] for x in tables.addressable_shards} == {2 * mem.host_blocks["mla"] * BS // (4 if shared else 2)}
        c = jax.tree.map(jnp.copy, cache)  # the copies donate the arrays they update
        ops = (PageCopy("mla", "d2h", (1, 6, 3, 7), (4, 0, 1, 2)), PageCopy("indexer", "d2h", (0, 5), (2, 0)))
        c, d2h, _ = mem.apply(ops, c)
        pages = {g: mem.read_host_pages(g, b) for g, b in (("mla", (0, 1, 2, 4)), ("indexer", (0, 2)))}
        mem.write_host_pages("mla", (3,), [pages["mla"][0]])  # a tier load into another host page
        c, _, h2d = mem.apply((PageCopy("mla", "h2d", (3, 4, 1), (0, 2, 5)), PageCopy("indexer", "h2d", (2,), (7,))), c)
        results.append((pages, [np.asarray(a) for a in c.mla + c.index], d2h, h2d, mem.host_bytes_per_device))
    (p0, c0, d0, h0, b0), (p1, c1, d1, h1, b1) = results
    for g in p0:
        for x, y in zip(p0[g], p1[g]):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(c0, c1):
        np.testing.assert_array_equal(x, y)
    assert (d0, h0) == (d1, h1) and d0 > 0 and h0 > 0
    whole = sum(n * mem.page_bytes[g] for g, n in {"mla": 5, "indexer": 3}.items())  # one pool, both DCP ranks
    assert b0 == whole // 2 and b1 == sum(n * mem.page_bytes[g] for g, n in {"mla": 6, "indexer": 4}.items()) // 4
