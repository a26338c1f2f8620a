"""P/D in the simulator (glm53.engine.pd_sim): a DCP2 prefill engine and a DP2 decode engine on their own
virtual clocks, driven by the closed-loop client as one engine. Every request completes; its decode leg
starts after its prefill leg finished, and its TTFT counts both legs (the client's arrival); the decode
engine takes from the producer exactly the prompt pages it does not hold itself, and computes no more
than the last page's tokens of any prompt; a decode engine of other page spans takes what the
producer's full pages cover, and engines whose chunks cannot be each other's are refused."""

import numpy as np
import pytest

import glm53
from experiments import workloads
from glm53 import DeployConfig, SamplingParams
from glm53.engine.pd_sim import PdPair, build_pd, pd_deploy, sim_runners
from glm53.engine import sim
from glm53.engine.sim import build_engine

CFG = glm53.get_preset("tiny")
COMMON = dict(max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=8, kv_cache_memory_bytes=1 << 23)
PREFILL = DeployConfig(**COMMON, decode_context_parallel_size=2, block_size=8, cpu_offload_bytes=1 << 26)
PAGE = 16


@pytest.mark.parametrize("decode", ["hisparse", "offload"])
def test_pd_pair_serves_a_closed_loop_with_the_prompts_kv_from_the_producer(decode):
    extra = dict(hisparse_host_pool_bytes=1 << 26, cpu_offload_bytes=1 << 24) if decode == "hisparse" else \
        dict(cpu_offload_bytes=1 << 26)
    dec = DeployConfig(**COMMON, block_size=PAGE, data_parallel_size=2, kv_policy=decode, **extra)
    held = []  # before each step: the requests whose hand-off chunks the decode ranks' "pd" tiers hold

    def holds_only_the_unadmitted(*_):
        # a request's chunks are held from its hand-off until the decode engine admits it, never after
        reqs = pair.decode.requests
        holders = {h for i in range(2) for h in pair.decode.pd_tier(i)._holds}
        assert holders == set(pair._holding)
        assert all(reqs[r].status.name == "WAITING" and not reqs[r].num_preemptions for r in holders)
        assert not holders & {r for r, q in reqs.items() if q.status.name != "WAITING"}
        assert not holders & set(pair.decode.finished)
        held.append(len(holders))

    pair = build_pd(CFG, PREFILL, dec, before_step=holds_only_the_unadmitted)
    sessions = workloads.openhands_sessions(6, scale=1 / 128, turns=4)
    client = workloads.ClosedLoopClient(pair, sessions, 3, vocab_size=CFG.vocab_size, salt_prefix="user:",
                                        make_params=lambda n: SamplingParams(max_new_tokens=n), max_model_len=1024)
    res = client.run()
    assert res.sessions_done == len(sessions) and len(pair.finished) == len(res.request_ids) == 24
    local = 0
    for rid in res.request_ids:
        p, d = pair.prefill.finished[rid], pair.decode.finished[rid]
        assert d.arrival_s == p.arrival_s and d.first_token_s >= p.finish_s > p.arrival_s
        assert len(p.output_ids) == 1 and len(d.output_ids) == d.params.max_new_tokens
        full = (d.prompt_ids.size - 1) // PAGE * PAGE
        assert d.num_cached_tokens == full  # the decode engine computes only the prompt's last partial page
        # both legs hold one read-only prompt (an hour at Part 2's c64 otherwise keeps ~7 GB of copies)
        assert d.prompt_ids is p.prompt_ids and not d.prompt_ids.flags.writeable
        local += full
    # each request's chunks were held for it until its admission (its producer's lease), then let go
    for i in range(2):
        tier = pair.decode.pd_tier(i)
        assert tier.holders == 0 and all(k in tier._kept for k in tier.keys())
    assert max(held) > 0
    m = pair.metrics(res.request_ids)
    # what the decode engine did not hold itself came from the producer, and nothing else did
    assert 0 < m["pd_received_tokens"] <= m["pd_handed_tokens"]
    assert m["ttft_median_s"] >= m["pd_handoff_s_median"] > 0
    assert m["num_devices"] == 4 and m["requests"] == 24
    # a caller's own array stays its own: the pair keeps a copy it cannot write
    mine = np.arange(1, 9, dtype=np.int32)
    rid = pair.add_request(mine, SamplingParams(max_new_tokens=2))
    mine[:] = 0
    while pair.has_unfinished():
        pair.step()
    assert pair.decode.finished[rid].prompt_ids.tolist() == list(range(1, 9))
    pair.shutdown()


def test_pd_pair_takes_pages_of_another_span_and_prices_what_it_reads():
    """A decode engine of 12-token pages behind the DCP2 producer's 16-token pages: each decode page below
    the prompt's last token comes from it (parts of one or two producer pages, past its full pages the
    tail chunk of its last partial page), the decode engine computes the rest, and its "pd" tier reads
    every producer page those touch, whole: more bytes than it keeps where a producer page is used in
    part."""
    dec = DeployConfig(**COMMON, block_size=12, kv_policy="offload", cpu_offload_bytes=1 << 26)
    pair = build_pd(CFG, PREFILL, dec)
    assert pair.remote is not None and pair.remote.tokens("mla") == PAGE
    rng = np.random.default_rng(48)
    prompts = [rng.integers(0, CFG.vocab_size, n) for n in (45, 70, 9)]
    ids = [pair.add_request(p, SamplingParams(max_new_tokens=2)) for p in prompts]
    while pair.has_unfinished():
        pair.step()
    want = [(p.size - 1) // 12 * 12 for p in prompts]  # all but the last token, in 12-token pages
    assert [pair.decode.finished[r].num_cached_tokens for r in ids] == want == [36, 60, 0]
    assert pair.received_tokens() == sum(want)
    tier = pair.decode.pd_tier(0)
    per_token = sum(pair.prefill.sizes.page_bytes[g] // PAGE for g in ("mla", "indexer"))
    # producer pages 0-1 and the tail (its page 2's first 12 tokens) for 36 tokens, pages 0-3 for 60
    assert tier.stats.load_bytes == (48 + 64) * per_token
    pair.shutdown()


def test_pd_pair_refuses_engines_whose_chunks_cannot_be_each_others():
    """Another KV format on the decode side (fp8 rows; the producer's are the model's dtype): no page of
    its could be made of the producer's bytes, whatever their spans; refused at start-up, naming both
    sides' page spans."""
    dec = DeployConfig(**COMMON, block_size=8, kv_policy="offload", cpu_offload_bytes=1 << 26,
                       kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"mla 16, indexer 16 tokens per page.*cannot be this engine's \(mla 8, "
                                         r"indexer 8 tokens per page\)"):
        build_pd(CFG, PREFILL, dec)
    with pytest.raises(ValueError, match="needs the PdConnector as kv_consumer"):
        PdPair(build_engine(CFG, pd_deploy(PREFILL, "kv_producer")), build_engine(CFG, dec))
    with pytest.raises(ValueError, match="needs cpu_offload_bytes > 0"):
        pd_deploy(DeployConfig(**COMMON), "kv_producer")


def test_at_1m_only_pcp_dcp_prefill_with_hisparse_decode_can_be_built():
    """configs/paper/part2_1m.py (BRIEF §8: at 1M only PCP x DCP prefill + HiSparse decode can serve a
    request at all): the engine builds the PCP8 x DCP8 x EP8 + HiSparse pair, and refuses DP8 prefill
    (a rank's pool holds 5,111 of a 1M request's 17,408 blocks) and offload decode (a decode rank holds
    no 1M request either), each when it sizes that engine."""
    from experiments import serve
    from experiments.common import load_config

    cfg = load_config(str(serve.REPO / "configs/paper/part2_1m.py"))
    model = glm53.get_preset(cfg.model.preset)
    pair = serve._engine(model, cfg, "pcp_dcp+hisparse")
    assert pair.prefill.deploy.prefill_context_parallel_size == 8 and pair.decode.deploy.kv_policy == "hisparse"
    assert pair.prefill.deploy.max_model_len == pair.decode.deploy.max_model_len == 1_048_576
    # on the H200 spec the PCP x DCP prefill is priced gathering as vLLM does (bf16 shards), not fp8 rows
    assert pair.prefill.replicas[0].runner.dep.dcp_prefill_gather == "bf16_shard"
    for name in ("dp+hisparse", "pcp_dcp+offload"):
        with pytest.raises(ValueError, match="fewer than one request of max_model_len=1048576"):
            serve._engine(model, cfg, name)


def test_chunk_keys_taken_from_the_salts_last_prompt_equal_keys_computed_afresh(monkeypatch):
    """`chunk_keys` reuses the keys of the blocks a prompt shares with the last prompt of its salt: a
    longer prompt, a shorter one, one that diverges, another salt all get, per full hash block, the key of
    each group's page ending there (kvcache.tiers.chunk_key of the block's hash)."""
    from glm53.engine import pd
    from kvcache.block_pool import block_hashes
    from kvcache.tiers import chunk_key

    eng = build_engine(CFG, DeployConfig(**COMMON, block_size=8, index_block_size=32, kv_policy="offload",
                                         cpu_offload_bytes=1 << 26))
    kv = eng.scheduler.kv
    assert kv.ratio == {"mla": 1, "indexer": 4}  # an indexer page ends every 4th hash block
    rng = np.random.default_rng(5)
    a = rng.integers(0, CFG.vocab_size, 600)
    b = np.concatenate([a[:300], rng.integers(0, CFG.vocab_size, 300)])
    for tokens, salt in [(a[:200], "u1"), (a, "u1"), (a[:130], "u1"), (b, "u1"), (a, "u2"), (a, "u1")]:
        n = tokens.size - 1
        tpb, got = eng.chunk_keys(tokens, (salt,), upto=n)
        hashes = block_hashes(tokens, 8, (salt,), upto=n)
        want = [[(g, chunk_key(eng.fingerprint, g, h)) for g in kv.groups if (c + 1) % kv.ratio[g] == 0]
                for c, h in enumerate(hashes)]
        assert tpb == 8 and got == want and len(got) == n // 8
    assert len(eng._chunk_keys_memo) == 2  # one entry per salt
    # bounded by the hash blocks it holds: a third salt's 74 blocks over a cap of 150 push out the salt
    # keyed least recently (u2's 74), and a prompt over the cap alone is kept alone (the newest stays)
    monkeypatch.setattr(pd, "CHUNK_KEYS_MEMO_BLOCKS", 150)
    eng.chunk_keys(a, ("u3",), upto=599)
    assert list(eng._chunk_keys_memo) == [(0, ("u1",)), (0, ("u3",))]
    monkeypatch.setattr(pd, "CHUNK_KEYS_MEMO_BLOCKS", 50)
    tpb, got = eng.chunk_keys(a, ("u1",), upto=599)
    assert list(eng._chunk_keys_memo) == [(0, ("u1",))] and len(got) == 74
    eng.shutdown()


@pytest.mark.parametrize("waits", [False, True])
def test_a_consumer_short_of_host_pages_computes_the_handed_kv_or_waits_for_pages(waits):
    """HiSparse decode ranks whose host pools hold one request of max_model_len and a bit: while running
    requests fill a pool, the next prompt's producer pages cannot be staged. Without consumer_waits the
    rank computes them (counted as the "pd" tier's `unstaged`, some requests below their full pages);
    with it the request waits for pages and every request takes all its full pages from the producer."""
    dec = DeployConfig(**COMMON, block_size=PAGE, data_parallel_size=2, kv_policy="hisparse",
                       hisparse_host_pool_bytes=2_400_000, cpu_offload_bytes=1 << 24)
    pair = build_pd(CFG, PREFILL, dec, consumer_waits=waits)
    assert pair.decode.deploy.pd_consumer_waits == waits
    sessions = workloads.openhands_sessions(6, scale=1 / 128, turns=4)
    client = workloads.ClosedLoopClient(pair, sessions, 3, vocab_size=CFG.vocab_size, salt_prefix="user:",
                                        make_params=lambda n: SamplingParams(max_new_tokens=n), max_model_len=1024)
    res = client.run()
    assert res.sessions_done == len(sessions)
    short = 0
    for rid in res.request_ids:
        d = pair.decode.finished[rid]
        short += d.num_cached_tokens < (d.prompt_ids.size - 1) // PAGE * PAGE
    unstaged = pair.decode.metrics()["kv_offload"]["pd"]["unstaged"]
    assert (unstaged, short) == (0, 0) if waits else (unstaged > 0 and short > 0)
    pair.shutdown()


def test_before_step_prices_each_step_of_either_engine_on_the_spec_it_sets():
    """PdPair's before_step runs before every step of each engine, with the other engine; a hook that sets
    every runner to spec B (SimRunner.set_host) serves exactly what a pair built on B serves, so a step is
    priced on what the hook set, and each spec keeps its own memoised prices; at concurrency 3 the hook
    sees the other engine both busy (`busy_until` past the step's start) and idle."""
    import dataclasses

    from glm53.engine.pd_sim import busy_until, sim_runners
    from glm53.perfmodel import H200_CALIBRATED

    slow = dataclasses.replace(H200_CALIBRATED, bf16_flops=H200_CALIBRATED.bf16_flops / 3,
                               hbm_bandwidth=H200_CALIBRATED.hbm_bandwidth / 3)
    dec = DeployConfig(**COMMON, block_size=PAGE, data_parallel_size=2, enable_expert_parallel=True,
                       kv_policy="offload", cpu_offload_bytes=1 << 26)
    sessions = workloads.openhands_sessions(6, scale=1 / 128, turns=3)

    def serve(hw, hook=None):
        pair = build_pd(CFG, PREFILL, dec, hw, before_step=hook, step_overhead_s=2e-4, host_overlap_s=1e-4,
                        async_dispatch=True)
        client = workloads.ClosedLoopClient(pair, sessions, 3, vocab_size=CFG.vocab_size, salt_prefix="user:",
                                            make_params=lambda n: SamplingParams(max_new_tokens=n), max_model_len=1024)
        ids = client.run().request_ids
        return pair, {k: v for k, v in pair.metrics(ids).items() if isinstance(v, (int, float))}

    calls, busy = {"prefill": 0, "decode": 0}, set()

    def to_slow(engine, other):
        calls["prefill" if engine.deploy.kv_role == "kv_producer" else "decode"] += 1
        busy.add(busy_until(other) > engine.clock.now())
        for r in sim_runners(engine):
            r.set_host(slow, 2e-4, 1e-4)

    def alternate(engine, other):  # either spec in turn
        turn.append(None)
        for r in sim_runners(engine):
            r.set_host(slow if len(turn) % 2 else H200_CALIBRATED, 2e-4, 1e-4)

    _, want = serve(slow)
    pair, got = serve(H200_CALIBRATED, to_slow)
    assert got == want
    assert calls == {"prefill": pair.prefill._steps_begun, "decode": pair.decode._steps_begun}
    assert busy == {True, False}
    _, fast = serve(H200_CALIBRATED)
    assert fast["tpot_mean_s"] < want["tpot_mean_s"]
    # each spec keeps its own memoised prices: switching specs every step prices as if nothing were kept
    turn = []
    _, kept = serve(H200_CALIBRATED, alternate)
    turn = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sim.SimRunner, "_memo", lambda self, key, build: build())
        _, unkept = serve(H200_CALIBRATED, alternate)
    assert kept == unkept and fast["tpot_mean_s"] < kept["tpot_mean_s"] < want["tpot_mean_s"]
    runner = sim_runners(pair.decode)[0]
    with pytest.raises(ValueError, match="platform"):
        runner.set_host(dataclasses.replace(slow, platform="cpu"), 0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        runner.set_host(slow, -1.0, 0.0)


@pytest.mark.parametrize("decode, mtp, index_pages", [("offload", False, 1), ("hisparse", False, 1),
                                                      ("offload", True, 1), ("offload", False, 2)])
def test_a_decode_leg_priced_as_loaded_leaves_out_all_but_the_prompts_last_token(decode, mtp, index_pages):
    """PdPair(decode_prompt="loaded") prices a decode leg as vLLM's NIXL consumer serves it: the decode
    engine schedules exactly what it schedules under "computed" (the same tokens, the same pages taken
    from the producer), but its DP x EP ranks' forwards leave out every prompt row below the prompt's last
    token (each request's rows from its hit to that token, counted, every request's entry used up), the
    rows of the decode pages the prompt fills in part are read over the "pd" tier with the last chunk
    (each cache group's own: indexer pages of `index_pages` MLA pages), and the decode engine's priced
    time is shorter. Under MTP the decode engine's hit gives back its last page, which it computes again:
    that page is left out of the price too."""
    import dataclasses

    extra = dict(hisparse_host_pool_bytes=1 << 26, cpu_offload_bytes=1 << 24) if decode == "hisparse" else \
        dict(cpu_offload_bytes=1 << 26)
    hit = PAGE * index_pages  # a hit ends on a page of every group
    dec = DeployConfig(**COMMON, block_size=PAGE, index_block_size=hit, data_parallel_size=2,
                       enable_expert_parallel=True, kv_policy=decode, **extra)
    pre = dataclasses.replace(PREFILL, index_block_size=8 * index_pages)  # DCP2: the same spans
    if mtp:
        spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_length": 2.99}
        dec, pre = (dataclasses.replace(d, speculative_config=spec) for d in (dec, pre))
    rng = np.random.default_rng(53)
    prompts = [rng.integers(0, CFG.vocab_size, n) for n in (45, 70, 130, 33)]
    runs = {}
    for mode in ("computed", "loaded"):
        pair = build_pd(CFG, pre, dec, decode_prompt=mode)
        assert pair.remote is None
        ids = [pair.add_request(p, SamplingParams(max_new_tokens=3)) for p in prompts]
        while pair.has_unfinished():
            pair.step()
        fin = [pair.decode.finished[r] for r in ids]
        runs[mode] = dict(out=[list(f.output_ids) for f in fin], cached=[f.num_cached_tokens for f in fin],
                          loads=sum(pair.decode.pd_tier(i).stats.load_bytes for i in range(2)),
                          busy=sum(r.busy_s for r in sim_runners(pair.decode)), metrics=pair.metrics(ids),
                          left=pair._loaded)
        pair.shutdown()
    c, ld = runs["computed"], runs["loaded"]
    assert ld["out"] == c["out"] and ld["cached"] == c["cached"]
    # it computes its last partial page, under MTP the full page before it too
    assert c["cached"] == [max((p.size - 1) // hit - mtp, 0) * hit for p in prompts]
    assert ld["metrics"]["pd_loaded_prompt_tokens"] == sum(p.size - 1 - k for p, k in zip(prompts, ld["cached"]))
    assert ld["left"] == {} and c["left"] is None
    assert "pd_loaded_prompt_tokens" not in c["metrics"] and ld["metrics"]["pd_decode_prompt"] == "loaded"
    per_token = {g: b // dec.group_tokens_per_block(("mla", "indexer"))[g]
                 for g, b in pair.decode.sizes.page_bytes.items()}
    partial = sum((p.size - 1) % PAGE * per_token["mla"] + (p.size - 1) % hit * per_token["indexer"] for p in prompts)
    assert ld["loads"] - c["loads"] == partial
    assert ld["metrics"]["pd_handed_tokens"] == sum(p.size - 1 for p in prompts)
    assert ld["busy"] < c["busy"]
    with pytest.raises(ValueError, match="decode_prompt must be one of"):
        build_pd(CFG, PREFILL, dec, decode_prompt="free")


def test_a_relaid_decode_leg_priced_as_loaded_reads_the_producer_pages_its_partial_pages_need():
    """Decode pages of 12 tokens behind the producer's 16 (test_pd_pair_takes_pages_of_another_span...):
    under decode_prompt="loaded" the rows of each prompt's partial decode page below its last token are
    read as the producer pages they need that no full decode page read, whole: none for the 45-token
    prompt (its rows 36-43 are in the producer's page 2, read for the decode page 24-35), producer page 4
    for the 70-token one (rows 60-68; pages 0-3 read), nothing for the 9-token one (no full decode page:
    no chunk to read them with)."""
    dec = DeployConfig(**COMMON, block_size=12, kv_policy="offload", cpu_offload_bytes=1 << 26)
    rng = np.random.default_rng(48)
    prompts = [rng.integers(0, CFG.vocab_size, n) for n in (45, 70, 9)]
    loads = {}
    for mode in ("computed", "loaded"):
        pair = build_pd(CFG, PREFILL, dec, decode_prompt=mode)
        ids = [pair.add_request(p, SamplingParams(max_new_tokens=2)) for p in prompts]
        while pair.has_unfinished():
            pair.step()
        assert [pair.decode.finished[r].num_cached_tokens for r in ids] == [36, 60, 0]
        loads[mode] = pair.decode.pd_tier(0).stats.load_bytes
        pair.shutdown()
    per_token = sum(pair.prefill.sizes.page_bytes[g] // PAGE for g in ("mla", "indexer"))
    assert loads["computed"] == (48 + 64) * per_token and loads["loaded"] - loads["computed"] == PAGE * per_token
