"""The 2-layer model (tests/conftest.py's small_model: each layer kind of the tiny preset) under PCP, DCP,
PCP x DCP and EP on 8 and 16 simulated devices against one device.

Model level (`parallel.model.forward` on a `CpKVCache`): a batch of two prompts (37 tokens: not a
multiple of 2N, longer than top-k 16, and top-k larger than a rank's share of the context; 10 tokens:
shorter than top-k) is prefilled in one padded row each, then one decode step runs; every real token's
logits must match one device's within 1e-5 of the largest logit (float32). Engine level: the same
prompts give the same greedy tokens on one device, under PCP8 x DCP8 x EP8 and with two data-parallel
replicas.
"""

import dataclasses
from collections import Counter

import jax
import numpy as np
import pytest

TOL = 1e-5  # of the largest |logit|
BS = 4  # block size (slots per rank)
WIDTH = 48  # prefill row width (padded)
WINDOW = 64
LENGTHS = (37, 10)


def _prompts(vocab):
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in LENGTHS]


def _batch(prompts):
    tok = np.zeros((len(prompts), WIDTH), np.int32)
    pos = np.full((len(prompts), WIDTH), -1, np.int32)
    for i, p in enumerate(prompts):
        tok[i, : p.size], pos[i, : p.size] = p, np.arange(p.size)
    nxt = np.array([[p[-1]] for p in prompts], np.int32)  # any token will do: compare the logits
    return tok, pos, nxt, np.array([[p.size] for p in prompts], np.int32)


def _single_device(model, prompts, kv, *, with_cache=False):
    import jax.numpy as jnp

    from glm53.model import compiled
    from kvcache.paged import PagedKVCache

    c = compiled(model)
    b, m = len(prompts), WINDOW // BS
    cache = PagedKVCache.create(model.cfg, b * m, BS, np.arange(b * m).reshape(b, m), kv_cache_dtype=kv,
                                include_mtp=False)
    nbytes = cache.mla[0].nbytes
    tok, pos, nxt, pos1 = _batch(prompts)
    h, cache, _ = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=WINDOW, form="mqa")
    prefill = np.asarray(c.logits(c.state, h))
    h, cache, _ = c.forward(c.state, jnp.asarray(nxt), jnp.asarray(pos1), cache, window=WINDOW, form="mqa")
    out = prefill, np.asarray(c.logits(c.state, h))[:, 0], nbytes
    return out + (cache,) if with_cache else out


def _context_parallel(model, prompts, n, *, pcp, dcp, kv, backend="ag_rs", interleave=1, ep=False, form="mqa"):
    """-> (prefill logits [B, WIDTH, V] in token order, decode logits [B, V], bytes of MLA layer 0 per device,
    the cache's global arrays (kvcache.paged.PagedKVCache, DCP shards rank-major))."""
    import jax.numpy as jnp

    from glm53.model import compiled
    from kvcache.paged import PagedKVCache
    from parallel import model as pmodel
    from parallel.cp_cache import CpKVCache
    from parallel.mesh import make_mesh
    from parallel.pcp import PcpSplit

    c = compiled(model)
    mesh = make_mesh(cp=n)
    ranks = n if dcp else 1
    b, m = len(prompts), -(-WINDOW // (BS * ranks))
    local = PagedKVCache.create(model.cfg, b * m * ranks, BS, np.arange(b * m).reshape(b, m), kv_cache_dtype=kv,
                                include_mtp=False)
    cache = pmodel.place(CpKVCache(local, "cp", n, tokens_split=pcp, dcp=dcp, interleave=interleave, backend=backend),
                         mesh)
    tok, pos, nxt, pos1 = _batch(prompts)
    if pcp:
        split = PcpSplit(WIDTH, n)
        tok, pos = split.shard(tok.T).T, np.where(split.shard(pos.T + 1).T > 0, split.shard(pos.T).T, -1)
    run = dict(graphdef=c.graphdef, mesh=mesh, window=WINDOW, impl="auto", expert_parallel=ep)
    h, cache = pmodel.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, form=form, **run)
    prefill = np.asarray(c.logits(c.state, h))
    if pcp:
        prefill = split.unshard(prefill.transpose(1, 0, 2)).transpose(1, 0, 2)
    cache = dataclasses.replace(cache, tokens_split=False)
    h, cache = pmodel.forward(c.state, jnp.asarray(nxt), jnp.asarray(pos1), cache, form="mqa", **run)
    per_device = {s.data.nbytes for s in cache.local.mla[0].addressable_shards}
    assert len(per_device) == 1
    return prefill, np.asarray(c.logits(c.state, h))[:, 0], per_device.pop(), cache.local


def _check(model, cases, n, kv="float32"):
    prompts = _prompts(model.cfg.vocab_size)
    want_prefill, want_decode, single_bytes, single = _single_device(model, prompts, kv, with_cache=True)
    for kw in cases:
        prefill, decode, per_device, cache = _context_parallel(model, prompts, n, kv=kv, **kw)
        for i, p in enumerate(prompts):
            scale = np.abs(want_prefill[i, : p.size]).max()
            err = np.abs(prefill[i, : p.size] - want_prefill[i, : p.size]).max() / scale
            assert err <= TOL, (kw, "prefill", p.size, err)
        err = np.abs(decode - want_decode).max() / np.abs(want_decode).max()
        assert err <= TOL, (kw, "decode", err)
        # DCP: each device stores 1/N of the context (the pool is the batch's whole-window tables here)
        assert per_device == (single_bytes // n if kw["dcp"] else single_bytes), kw
        if kw["dcp"] and kv == "float32":  # (fp8 rows: a rounding flip of an e4m3 value is not an error)
            _check_relayout(single, cache, [p.size + 1 for p in prompts], n, kw.get("interleave", 1))


def _check_relayout(single, cache, lengths, n, interleave):
    """What P/D's consumer reads (kvcache.relayout): each request's rows in token order, read from the DCP
    cache in its layout (N ranks, the interleave), equal one device's, in every array of both groups."""
    from kvcache.relayout import PagedLayout, gather_tokens

    for arrays_1, arrays_n, fmt in ((single.mla, cache.mla, single.mla_format),
                                    (single.index, cache.index, single.index_format)):
        one = PagedLayout(BS, arrays_1[0].shape[0] // BS)
        split = PagedLayout(BS, arrays_n[0].shape[0] // (BS * n), n, interleave)
        for i, length in enumerate(lengths):
            pos = np.arange(length)
            want = gather_tokens(arrays_1, one, np.asarray(single.block_table)[i], pos)
            got = gather_tokens(arrays_n, split, np.asarray(cache.block_table)[i], pos)
            for w, g in zip(want, got, strict=True):
                w, g = np.asarray(fmt.unpack(w)), np.asarray(fmt.unpack(g))
                assert np.abs(g - w).max() <= TOL * np.abs(w).max(), (i, length, interleave)


@pytest.mark.multidevice
def test_small_model_on_8_devices_matches_one_device(small_model):
    _check(small_model, [
        dict(pcp=True, dcp=False),  # PCP alone: a replicated cache
        dict(pcp=False, dcp=True, backend="a2a", interleave=2),  # DCP prefill without PCP, then decode
        dict(pcp=True, dcp=True, backend="ag_rs", ep=True),  # PCP x DCP prefill (full copies), DCP decode, EP
    ], 8)


@pytest.mark.multidevice
def test_small_model_on_16_devices_matches_one_device(small_model):
    # fp8_ds_mla rows and fp8 indexer keys: the shards and the full copies move packed rows
    _check(small_model, [dict(pcp=True, dcp=True, backend="a2a", form="mha")], 16, kv="fp8_ds_mla")


@pytest.mark.multidevice
def test_dp4_ranks_sharing_their_experts_match_one_device_per_rank(small_model):
    """DP4 x EP4 (`parallel.model.forward_dp`, BRIEF §3's DP decode ranks with EP): four ranks, each
    with two requests of its own (lengths 1 to 48, padded) on its own pool, prefill then one decode step,
    the 8 routed experts split 2 per rank and every MoE assignment sent to its expert's rank and back.
    Each rank's logits equal one device running that rank's two requests alone (within 1e-5); the
    step's collectives are the MoE's: per layer three all-to-alls (rows and expert ids out, results
    back) of the first round, the overflow flag's all-reduce, and the second round's three inside a
    lax.cond (`parallel.ep.moe_local`)."""
    import jax.numpy as jnp

    from glm53.model import compiled
    from kvcache.paged import PagedKVCache
    from parallel import comm
    from parallel import model as pmodel
    from parallel.mesh import make_mesh

    n, cfg = 4, small_model.cfg
    c = compiled(small_model)
    rng = np.random.default_rng(11)
    ranks = [[rng.integers(0, cfg.vocab_size, k).astype(np.int32) for k in pair]
             for pair in ((37, 10), (20, 45), (5, 30), (48, 1))]
    b, m = 2, WINDOW // BS

    def pool():
        return PagedKVCache.create(cfg, b * m, BS, np.arange(b * m).reshape(b, m), kv_cache_dtype="float32",
                                   include_mtp=False)

    mesh = make_mesh(dp=n)
    caches = [pool() for _ in range(n)]
    cache = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *caches)
    cache = jax.tree.map(lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), cache,
                         pmodel.dp_cache_specs(cache))
    state = pmodel.place_state(c.state, mesh, True, axis="dp")
    assert len(state["layers"][cfg.mlp_layer_types.index("sparse")]["mlp"]["experts"]["gate_up_proj"].value.addressable_shards[0].data) == 2
    batches = [_batch(pr) for pr in ranks]
    tok, pos, nxt, pos1 = (jnp.asarray(np.concatenate([x[i] for x in batches])) for i in range(4))
    kw = dict(graphdef=c.graphdef, mesh=mesh, window=WINDOW, form="mqa", impl="auto")
    found = comm.jaxpr_collectives(pmodel.forward_dp.trace(state, tok, pos, cache, **kw).jaxpr,
                                   axis_sizes={"dp": n})
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    kinds = Counter((x.kind, x.conditional) for x in found)
    assert kinds == {("all_to_all", False): 3 * moe_layers, ("all_to_all", True): 3 * moe_layers,
                     ("psum", False): moe_layers}, kinds
    h, cache = pmodel.forward_dp(state, tok, pos, cache, **kw)
    prefill = np.asarray(c.logits(c.state, jax.device_get(h)))
    h, cache = pmodel.forward_dp(state, nxt, pos1, cache, **kw)
    decode = np.asarray(c.logits(c.state, jax.device_get(h)))[:, 0]
    for r, prompts in enumerate(ranks):
        want_prefill, want_decode, _ = _single_device(small_model, prompts, "float32")
        for i, p in enumerate(prompts):
            got = prefill[2 * r + i, : p.size]
            assert np.abs(got - want_prefill[i, : p.size]).max() <= TOL * np.abs(want_prefill[i, : p.size]).max(), (r, i)
        got = decode[2 * r : 2 * r + 2]
        assert np.abs(got - want_decode).max() <= TOL * np.abs(want_decode).max(), r


@pytest.mark.multidevice
def test_engine_pcp8_dcp8_ep8_and_dp2_greedy_tokens_equal_one_device(small_model):
    """The engine with DeployConfig(prefill_context_parallel_size=8, decode_context_parallel_size=8,
    enable_expert_parallel=True) on 8 devices: the same greedy tokens as on one device, with the KV pool
    split over the 8 devices and the experts too, under the offload policy; and with data_parallel_size=2."""
    from glm53 import DeployConfig, Engine

    # Two prompts of 30 and 29 tokens under a budget of 32: the second prefills in two chunks, the second
    # chunk after a cached prefix. An MLA block id covers 4 x 8 = 32 tokens (an indexer-key one 64;
    # interleave 2): with 4 blocks both prompts fit (a page of MLA rows and one of indexer keys each),
    # then both grow past 32 tokens while decoding and one request is offloaded to the host pool (its
    # shards from every rank) and brought back.
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, small_model.cfg.vocab_size, n).astype(np.int32) for n in (30, 29)]
    base = dict(block_size=BS, index_block_size=2 * BS, max_model_len=96, max_num_batched_tokens=32, max_num_seqs=2,
                kv_cache_dtype="float32")
    want = Engine(small_model, DeployConfig(**base)).generate(prompts, max_new_tokens=4, greedy=True)
    eng = Engine(small_model, DeployConfig(**base, prefill_context_parallel_size=8, decode_context_parallel_size=8,
                                          cp_kv_cache_interleave_size=2, enable_expert_parallel=True,
                                          num_gpu_blocks=4, kv_policy="swap", cpu_offload_bytes=1 << 24))
    got = eng.generate(prompts, max_new_tokens=4, greedy=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    assert eng.scheduler.stats.offloads >= 1 and eng.scheduler.stats.recomputed_tokens == 0
    assert eng.scheduler.transfers.h2d_bytes == eng.scheduler.transfers.d2h_bytes > 0
    # the offload host tier on the same mesh (each host page holds the block's shard from every rank): a
    # second turn over the first one's 32-token block, with the device prefix cache off, loads it
    turn2 = np.concatenate([prompts[0], got[0].token_ids, rng.integers(0, small_model.cfg.vocab_size, 5)]).astype(np.int32)
    want2 = Engine(small_model, DeployConfig(**base)).generate([turn2], max_new_tokens=3, greedy=True)[0]
    tiered = Engine(small_model, DeployConfig(**{**base, "index_block_size": None}, prefill_context_parallel_size=8,
                                             decode_context_parallel_size=8, cp_kv_cache_interleave_size=2,
                                             enable_expert_parallel=True, num_gpu_blocks=4, enable_prefix_caching=False,
                                             kv_policy="offload", cpu_offload_bytes=1 << 24))
    np.testing.assert_array_equal(tiered.generate([prompts[0]], max_new_tokens=4, greedy=True)[0].token_ids,
                                  want[0].token_ids)
    np.testing.assert_array_equal(tiered.generate([turn2], max_new_tokens=3, greedy=True)[0].token_ids,
                                  want2.token_ids)
    tier = tiered.metrics()["kv_offload"]["cpu"]
    assert tier["hits"] == 1 and tier["loaded_pages"] == 2 and tiered.scheduler.transfers.h2d_bytes == tier["load_bytes"]
    kv = eng.runner.cache.mla[0]
    assert len(kv.sharding.device_set) == 8 and kv.sharding.spec == jax.sharding.PartitionSpec("cp")
    assert eng.deploy.max_blocks_per_seq == -(-96 // (BS * 8))  # a block id covers B x N tokens
    # Per-rank work counted where it is done: every computed token (prompt, then 3 fed-back outputs) at
    # position p scored p + 1 causal (query, key) pairs in each full indexer layer, whichever rank scored
    # them (PCP prefill: the query's rank; DCP decode: each rank its own keys)
    m = eng.metrics()
    causal = m["cp_indexer_pairs_causal_per_rank"]
    full_layers = sum(1 for i in small_model.cfg.full_indexer_layers if i < small_model.cfg.num_hidden_layers)
    assert len(causal) == 8 and min(causal) > 0
    assert sum(causal) == full_layers * sum((n + 3) * (n + 4) // 2 for n in (30, 29))
    assert min(m["cp_mla_rows_attended_per_rank"]) > 0 and m["cp_indexer_pairs_computed_max_over_mean"] >= 1.0

    # Data parallelism: two independent replicas on devices 0 and 1, the same tokens
    dp = Engine(small_model, DeployConfig(**base, data_parallel_size=2))
    got = dp.generate(prompts + prompts[:1], max_new_tokens=4, greedy=True)
    for g, w in zip(got, want + want[:1]):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    assert [dp.replica_of(o.req_id) for o in got] == [0, 1, 0]  # least loaded first
    assert [next(iter(r.runner.cache.mla[0].devices())).id for r in dp.replicas] == [0, 1]
    again = dp.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]  # to the least loaded: replica 0
    np.testing.assert_array_equal(again.token_ids, want[0].token_ids)
    m = dp.metrics()  # ... which has the prompt cached: a prefix hit
    assert m["requests"] == 4 and m["prefix_hit_rate"] > 0 and dp.num_devices == 2
    # a salt sticks to its replica (its prefix cache), whatever the load
    a = dp.add_request(prompts[1], req_id="s1", salt="user:a")
    b = dp.add_request(prompts[1], req_id="s2", salt="user:a")
    assert dp.replica_of(a) == dp.replica_of(b)


@pytest.mark.multidevice
def test_offload_host_tier_under_dcp2_with_more_host_pages_than_device_blocks(small_model):
    """Under DCP a host page holds the block's shard from every rank, each rank's n host pages in its own
    slice of the host pool: a second pass over six prompts, with the device prefix cache off, reloads all
    their full pages from the host tier (more host pages than device blocks, so a rank stride of the device
    pool's size would land two pages' shards in one slot) and gives the same greedy tokens as one device."""
    from glm53 import DeployConfig, Engine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, small_model.cfg.vocab_size, 40).astype(np.int32) for _ in range(6)]
    base = dict(block_size=BS, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=1, kv_cache_dtype="float32")
    want = Engine(small_model, DeployConfig(**base)).generate(prompts, max_new_tokens=3, greedy=True)
    eng = Engine(small_model, DeployConfig(**base, decode_context_parallel_size=2, num_gpu_blocks=12,
                                          enable_prefix_caching=False, kv_policy="offload", cpu_offload_bytes=1 << 22))
    for _ in range(2):
        for g, w in zip(eng.generate(prompts, max_new_tokens=3, greedy=True), want):
            np.testing.assert_array_equal(g.token_ids, w.token_ids)
    tier = eng.metrics()["kv_offload"]["cpu"]
    used = len(eng.scheduler.policy.host["mla"].cached)
    assert tier["hits"] == 6 * (39 // 8) and used > eng.runner.num_blocks


@pytest.mark.multidevice
def test_tier_chunks_are_shared_across_dcp_layouts(small_model, tmp_path):
    """Chunks are stored in the canonical layout (every layer's rows in token order): an engine under DCP2
    (4 slots per rank, interleave 2) writes a filesystem tier that an engine on one device with 8-slot
    blocks (the same 8 tokens per page) reads, and the other way round; both give one device's greedy
    tokens with every full page loaded from the tier."""
    from glm53 import DeployConfig, Engine

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, small_model.cfg.vocab_size, 40).astype(np.int32) for _ in range(3)]
    base = dict(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=1, kv_cache_dtype="float32")
    want = Engine(small_model, DeployConfig(**base, block_size=8)).generate(prompts, max_new_tokens=3)

    def engine(root, **layout):
        ktc = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1 << 22, "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}}
        return Engine(small_model, DeployConfig(**base, **layout, kv_transfer_config=ktc))

    dcp2 = dict(block_size=4, decode_context_parallel_size=2, cp_kv_cache_interleave_size=2)
    one = dict(block_size=8)
    for writer, reader, root in ((dcp2, one, tmp_path / "a"), (one, dcp2, tmp_path / "b")):
        w = engine(root, **writer)
        w.generate(prompts, max_new_tokens=3)
        w.shutdown()
        r = engine(root, **reader)
        assert r.fingerprint == w.fingerprint  # one name for the same tokens' KV, whatever the layout
        for g, x in zip(r.generate(prompts, max_new_tokens=3), want):
            np.testing.assert_array_equal(g.token_ids, x.token_ids)
        fs = r.metrics()["kv_offload"]["fs"]
        assert fs["hits"] == 2 * 3 * (39 // 8) and fs["corrupt"] == 0  # every full page of both groups
        r.shutdown()
    # attention over a loaded prefix does not see the order of its rows, so compare the bytes: the same
    # chunk written under DCP2 and on one device holds the same rows in the same (token) order, up to
    # the rounding of DCP's merged attention in the layers above the first
    from kvcache.tiers.format import HEADER

    files = {p.name: p for p in (tmp_path / "a").rglob("*.kv")}
    assert files
    for p in (tmp_path / "b").rglob("*.kv"):
        a = np.frombuffer(files[p.name].read_bytes()[HEADER.size:], np.float32)
        b = np.frombuffer(p.read_bytes()[HEADER.size:], np.float32)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)

