"""The DP x EP engine layout (`DeployConfig(data_parallel_size=4, enable_expert_parallel=True)`, one device
per rank): four ranks, each with its own scheduler and block pool, stepping together as one program per
width (`parallel.model.forward_dp`) with the routed experts split over them.

The subject is that sharing the experts changes nothing a rank computes: every rank's greedy tokens, and
the tokens it scheduled, equal those of one device serving that rank's requests alone, while other ranks
prefill, decode, preempt or idle beside it (padding rows). Warmed up, such a run compiles nothing. Under the
offload policy each rank's host tier is its own slice of the host pools: two ranks that store and load the
same local host pages get their own KV back. Under HiSparse each rank resolves on its own hot buffers and
host slice, and its tokens and resolver counts are one device's.

Both engines use the same shapes (the 2-layer model, test_recompilation's buckets), so the second reuses
the first's step programs (tests/parallel/conftest.py runs this file in the shared 16-device subprocess).
"""

import numpy as np
import pytest

# rows 1, 2 per rank (4, 8 in all); tokens per row 1, 16; windows 64, 128: 8 bucket shapes. 20 blocks per
# rank: two 40-token requests that grow past 48 tokens need 2 x 14 and one of them is preempted
SHAPES = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, block_size=8, num_gpu_blocks=20)
N = 4


def _params(rid: str, new: int):
    """b0 asks for logprobs (they travel back to its rank's result); the others are plain greedy."""
    from glm53 import SamplingParams

    return SamplingParams(new, logprobs=3 if rid == "b0" else None)


def _serve_alone(model, deploy, requests):
    """One device serving `requests` [(req_id, prompt, max_new_tokens)] alone, all queued at once ->
    ({req_id: finished Request}, tokens its plans scheduled, steps that computed)."""
    from glm53 import Engine

    eng = Engine(model, deploy)
    execute, seen = eng.runner.execute, [0, 0]

    def counted(plan):
        seen[0] += sum(row.num_tokens for row in plan.rows)
        seen[1] += bool(plan.rows)
        return execute(plan)

    eng.runner.execute = counted
    for rid, prompt, new in requests:
        eng.add_request(prompt, _params(rid, new), req_id=rid)
    while eng.has_unfinished():
        eng.step()
    return {rid: eng.finished[rid] for rid, _, _ in requests}, seen[0], seen[1]


@pytest.mark.multidevice
def test_dp4_ep4_ranks_equal_one_device_each_and_compile_nothing_after_warmup(small_model):
    """Rank 0 serves three requests of one salt (two run, the pool preempts one), rank 1 two of another
    salt, rank 2 one unsalted request (the least loaded rank), rank 3 none: it passes padding rows in every
    step. Ranks prefill while others decode, so both widths run with padding rows for some ranks."""
    import jax

    from glm53 import DeployConfig, Engine, SamplingParams
    from glm53.engine.runner import CompileCounter

    deploy = DeployConfig(**SHAPES, data_parallel_size=N, enable_expert_parallel=True)
    eng = Engine(small_model, deploy)
    runner = eng.replicas[0].runner
    assert all(r.runner is runner for r in eng.replicas)
    shapes = runner.bucket_shapes()
    assert {r for r, _, _ in shapes} == {4, 8} and len(shapes) == 8  # every program carries all four ranks
    assert runner.warmup() == len(shapes) and runner.compiled_shapes == set(shapes)
    runner.compiled_shapes.clear()
    # the profile run's shapes carry every rank's rows too (what a GPU's pool sizing compiles)
    assert {r % N for r, _, _ in runner.workspace_shapes()} == {0}
    assert runner.step_workspace_bytes(runner.workspace_shapes()[:1]) > 0
    kv = runner.cache.mla[0]
    assert len(kv.sharding.device_set) == N and kv.shape[0] == N * SHAPES["num_gpu_blocks"] * SHAPES["block_size"]

    rng = np.random.default_rng(5)
    vocab = small_model.cfg.vocab_size
    work = [("a0", "u0", 40, 12), ("b0", "u1", 9, 6), ("a1", "u0", 38, 12), ("a2", "u0", 17, 5),
            ("b1", "u1", 30, 4), ("c0", "", 21, 7)]
    prompts = {rid: rng.integers(0, vocab, n).astype(np.int32) for rid, _, n, _ in work}
    forwards = []  # per forward: (rows, tokens per row) of each rank
    forward = runner.fwd.forward

    def logged(tok, *args, **kw):
        forwards.append((tok.shape[0] // N, tok.shape[1]))
        return forward(tok, *args, **kw)

    runner.fwd.forward = logged
    with CompileCounter() as compiles:
        for rid, salt, _, new in work:
            eng.add_request(prompts[rid], _params(rid, new), req_id=rid, salt=salt)
        while eng.has_unfinished():
            eng.step()
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    assert runner.compiled_shapes <= set(shapes) and {w for _, w, _ in runner.compiled_shapes} == {1, 16}
    owners = {rid: eng.replica_of(rid) for rid, *_ in work}
    assert owners == {"a0": 0, "a1": 0, "a2": 0, "b0": 1, "b1": 1, "c0": 2}
    assert eng.replicas[0].scheduler.stats.preemptions >= 1 and not eng.replicas[3].scheduler.stats.steps

    m = eng.metrics()
    alone = DeployConfig(**SHAPES)
    steps = []
    for r in range(N):
        mine = [(rid, prompts[rid], new) for rid, _, _, new in work if owners[rid] == r]
        want, scheduled, computed = _serve_alone(small_model, alone, mine) if mine else ({}, 0, 0)
        for rid, req in want.items():
            got = eng.finished[rid]
            assert got.output_ids == req.output_ids, (r, rid)
            assert len(got.output_logprobs) == len(req.output_logprobs) == (len(req.output_ids) if rid == "b0" else 0)
            for a, b in zip(got.output_logprobs, req.output_logprobs):  # equal up to float summation order
                assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top], rid
                assert np.allclose([a.logprob, *(v for _, v in a.top)], [b.logprob, *(v for _, v in b.top)], atol=1e-4)
        assert m["dp_rank_tokens"][r] == scheduled, r
        steps.append(computed)
    # every rank computes in consecutive steps from the first (all requests queued at once, preempt always
    # schedules a rank with requests): the lock-step ran max(steps) steps, the others idle for the rest
    assert len(forwards) >= max(steps) and m["dp_idle_rank_steps"] == sum(max(steps) - s for s in steps) > 0

    # all-to-all bytes per device: every MoE layer of every forward sends its first round, and at most the
    # never-overflowing capacity over both rounds; a prefill forward's last layer dispatches only each
    # row's last token (GLM53.__call__'s last_only)
    from parallel.ep import all2all_bytes_per_slot, first_round_capacity

    cfg = small_model.cfg
    per_slot = all2all_bytes_per_slot(N, cfg.hidden_size, 4)
    e_local, k, last = cfg.n_routed_experts // N, cfg.num_experts_per_tok, cfg.num_hidden_layers - 1
    tokens = [rows if width > 1 and i == last else rows * width for rows, width in forwards
              for i, kind in enumerate(cfg.mlp_layer_types) if kind == "sparse"]
    first = sum(first_round_capacity(t, k, e_local, N) for t in tokens) * per_slot
    full = sum(t * min(k, e_local) for t in tokens) * per_slot
    assert 0 < first <= m["ep_all2all_bytes"] <= full, (first, m["ep_all2all_bytes"], full)

    # the simulator, on the same layout and workload (a float32 model: weight_bytes=4), schedules the same
    # rows and runs them as the same lock-step forwards: the same per-rank figures, and the first rounds'
    # bytes, which is what the engine measured (this workload never overflows a first round)
    from glm53.engine import sim

    simulated = sim.build_engine(cfg, deploy, weight_bytes=4)
    for rid, salt, _, new in work:
        simulated.add_request(prompts[rid], SamplingParams(new), req_id=rid, salt=salt)
    while simulated.has_unfinished():
        simulated.step()
    s = simulated.metrics()
    assert s["dp_rank_tokens"] == m["dp_rank_tokens"] and s["dp_idle_rank_steps"] == m["dp_idle_rank_steps"]
    assert s["ep_all2all_bytes"] == first == m["ep_all2all_bytes"], (s["ep_all2all_bytes"], first, m["ep_all2all_bytes"])

    # weights on a device: everything but the routed experts (the `experts` modules; the shared expert is
    # replicated), and a quarter of those
    state = jax.tree_util.tree_leaves_with_path(runner.c.state)
    experts = sum(x.nbytes for p, x in state if "experts" in [getattr(k, "key", None) for k in p])
    total = sum(x.nbytes for _, x in state)
    assert m["weights_bytes_per_device"] == total - experts + experts // N == s["weights_bytes_per_device"]


@pytest.mark.multidevice
def test_dp4_ep4_offload_each_rank_loads_its_own_host_pages(small_model):
    """Ranks 0 and 1 each serve a first turn, then a second turn over it with the device prefix cache off:
    both find their first turn's pages in their host tier and load them. Both ranks' policies number their
    host pages alike, so pages landing in a shared slice would hand one rank the other's KV."""
    from glm53 import DeployConfig, Engine, SamplingParams

    fields = dict(kv_policy="offload", cpu_offload_bytes=1 << 24, enable_prefix_caching=False)
    eng = Engine(small_model, DeployConfig(**SHAPES, **fields, data_parallel_size=N, enable_expert_parallel=True))
    rng = np.random.default_rng(8)
    vocab = small_model.cfg.vocab_size
    first = {s: rng.integers(0, vocab, n).astype(np.int32) for s, n in (("u0", 27), ("u1", 33))}
    ids = {s: eng.add_request(p, SamplingParams(5), req_id=f"{s}-1", salt=s) for s, p in first.items()}
    while eng.has_unfinished():
        eng.step()
    second = {s: np.concatenate([first[s], eng.finished[ids[s]].output_ids,
                                 rng.integers(0, vocab, 6)]).astype(np.int32) for s in first}
    for s, p in second.items():
        eng.add_request(p, SamplingParams(4), req_id=f"{s}-2", salt=s)
    while eng.has_unfinished():
        eng.step()
    assert [eng.replica_of(f"{s}-{t}") for s in first for t in (1, 2)] == [0, 0, 1, 1]
    tier = eng.metrics()["kv_offload"]["cpu"]
    assert tier["hits"] >= 2 and tier["loaded_pages"] > 0
    for r in (0, 1):
        assert eng.replicas[r].scheduler.transfers.h2d_bytes > 0, r
    for s in first:
        want, _, _ = _serve_alone(small_model, DeployConfig(**SHAPES),
                                  [(f"{s}-1", first[s], 5), (f"{s}-2", second[s], 4)])
        for rid, req in want.items():
            assert eng.finished[rid].output_ids == req.output_ids, rid


@pytest.mark.multidevice
def test_dp4_ep4_ranks_store_to_and_load_from_their_own_secondary_tiers(small_model, tmp_path):
    """Offload with a filesystem tier behind each rank's host tier (the ranks' tiers share its directory,
    as independent replicas' do). What one device stored, ranks 0 and 1 load from the tier into their own
    host pages (their host tiers start empty; each rank's jobs come back in its own result) and continue
    with one device's greedy tokens; what the ranks store, one device loads back, with the same tokens."""
    from glm53 import DeployConfig, Engine, SamplingParams

    def deploy(root, **layout):
        ktc = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1 << 24, "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}}
        return DeployConfig(**SHAPES, **layout, kv_transfer_config=ktc)

    dp_ep = dict(data_parallel_size=N, enable_expert_parallel=True)
    rng = np.random.default_rng(9)
    prompts = {s: rng.integers(0, small_model.cfg.vocab_size, n).astype(np.int32) for s, n in (("u0", 41), ("u1", 33))}
    pages = sum(2 * ((len(p) - 1) // SHAPES["block_size"]) for p in prompts.values())  # full pages, both groups

    def run(eng):  # the salts (part of the chunks' keys) route u0 to rank 0 and u1 to rank 1
        for s, p in prompts.items():
            eng.add_request(p, SamplingParams(4), req_id=s, salt=s)
        while eng.has_unfinished():
            eng.step()
        assert [eng.replica_of(s) for s in prompts] == ([0, 1] if len(eng.replicas) > 1 else [0, 0])
        return {s: eng.finished[s].output_ids for s in prompts}

    want = run(Engine(small_model, DeployConfig(**SHAPES)))
    for writer, reader, root in ((dict(), dp_ep, tmp_path / "a"), (dp_ep, dict(), tmp_path / "b")):
        w = Engine(small_model, deploy(root, **writer))
        run(w)
        w.shutdown()
        r = Engine(small_model, deploy(root, **reader))
        assert r.fingerprint == w.fingerprint
        assert run(r) == want, (writer, reader)
        fs = r.metrics()["kv_offload"]["fs"]
        assert fs["hits"] == pages and fs["corrupt"] == 0, (writer, reader, fs)
        r.shutdown()


@pytest.mark.multidevice
def test_dp2_ep2_mtp3_verify_and_drafts_on_the_dp_mesh_equal_one_device_each(small_model):
    """MTP with 3 drafts (CPU's sequential verify: `parallel.model.verify_dp`; the MTP layer's passes and the
    draft chain: `mtp_forward_dp`) on two ranks: rank 0 verifies while rank 1 still prefills, then rank 1
    alone has work (rank 0 passes padding rows through every MTP program). Each rank's greedy tokens equal
    one device serving its requests alone with MTP3, and the MTP steps ran (drafts verified). Then, with a
    deterministic synthetic acceptance, the simulator's all-to-all bytes (MTP passes included) equal the
    engine's."""
    from glm53 import DeployConfig, Engine, SamplingParams

    mtp = dict(SHAPES, num_speculative_tokens=3)
    eng = Engine(small_model, DeployConfig(**mtp, data_parallel_size=2, enable_expert_parallel=True))
    rng = np.random.default_rng(12)
    vocab = small_model.cfg.vocab_size
    work = [("a", "u0", 6, 4), ("b", "u1", 30, 9)]
    prompts = {rid: rng.integers(0, vocab, n).astype(np.int32) for rid, _, n, _ in work}
    for rid, salt, _, new in work:
        eng.add_request(prompts[rid], SamplingParams(new), req_id=rid, salt=salt)
    while eng.has_unfinished():
        eng.step()
    assert [eng.replica_of(rid) for rid, *_ in work] == [0, 1]
    m = eng.metrics()
    assert m["spec_num_drafts"] > 0 and m["dp_idle_rank_steps"] > 0
    for rid, _, _, new in work:
        want, _, _ = _serve_alone(small_model, DeployConfig(**mtp), [(rid, prompts[rid], new)])
        assert eng.finished[rid].output_ids == want[rid].output_ids, rid

    # the simulator counts (and prices) the MTP programs' all-to-alls too: under a deterministic synthetic
    # acceptance (the first two drafts always stand, the third never) the engine and the simulator
    # schedule the same rows, and the bytes the engine's programs report (the verify forwards, the MTP
    # layer's passes, the draft passes) are the simulator's (this workload never overflows a first round)
    from glm53.engine import sim

    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 3.0, "verify": "sequential"}
    deploy = DeployConfig(**SHAPES, speculative_config=spec, data_parallel_size=2, enable_expert_parallel=True)
    runs = []
    for e in (Engine(small_model, deploy), sim.build_engine(small_model.cfg, deploy, weight_bytes=4)):
        for rid, salt, _, new in work:
            e.add_request(prompts[rid], SamplingParams(new), req_id=rid, salt=salt)
        while e.has_unfinished():
            e.step()
        runs.append(e.metrics())
    got, simulated = runs
    assert got["spec_num_drafts"] > 0 and simulated["spec_num_drafts"] == got["spec_num_drafts"]
    assert simulated["dp_rank_tokens"] == got["dp_rank_tokens"]
    assert simulated["ep_all2all_bytes"] == got["ep_all2all_bytes"], (simulated["ep_all2all_bytes"],
                                                                      got["ep_all2all_bytes"])


# HiSparse under pressure: a hot buffer of 16 rows (top-k's 2 blocks, test_recompilation's) and 12 blocks per
# rank, so both ranks release pages and resolve misses from their host pools, and rank 0 (two requests)
# stages host rows into a prefill chunk. Every request fits one 64-position window: each program compiles
# once per window bucket, and the window is not the subject here (4 bucket shapes, not 8)
HISPARSE = dict(SHAPES, max_model_len=64, num_gpu_blocks=12, kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26,
                cpu_offload_bytes=1 << 24, index_block_size=16, hisparse_device_buffer_size=16)


def _hisparse_run(eng, work, prompts):
    """`work` [(req_id, salt, new tokens)] queued at once on `eng` -> each replica's resolver counts
    (hot hits, hot misses, staged rows, host->device bytes), its records checked: rows copied = misses x
    layers per IndexShare group."""
    for rep in eng.replicas:
        rep.scheduler.policy.resolve.log = []
    for rid, salt, new in work:
        eng.add_request(prompts[rid], _params(rid, new), req_id=rid, salt=salt)
    while eng.has_unfinished():
        eng.step()
    cfg = eng.replicas[0].runner.model.cfg
    layers = cfg.num_layers_with_mtp if eng.replicas[0].runner.k else cfg.num_hidden_layers
    per_group = np.diff([i for i in cfg.full_indexer_layers if i < layers] + [layers])
    counts = []
    for rep in eng.replicas:
        res = rep.scheduler.policy.resolve
        for rec in res.log:
            np.testing.assert_array_equal(rec.copied, rec.misses @ per_group)
        rep.scheduler.kv.check()
        counts.append((res.hot_hits, res.hot_misses, res.staged_rows, rep.scheduler.transfers.h2d_bytes))
    return counts


@pytest.mark.multidevice
@pytest.mark.parametrize("case", ["plain", "mtp3"])
def test_dp2_ep2_hisparse_each_rank_resolves_on_its_own_hot_buffers_as_one_device(small_model, case):
    """HiSparse per rank (each rank's hot buffers, host pool slice and LRU clock, the views split over "dp"):
    rank 0 serves two requests and rank 1 one, under a pool small enough that both release pages and
    resolve misses from their host pools (without MTP rank 0 also stages host rows into a prefill chunk). Each rank's
    greedy tokens and logprobs, and its hits, misses, staged rows and host->device bytes, equal one device
    serving that rank's requests alone with the same config: the ranks' resolvers neither see nor disturb
    each other (a rank runs the other's views as padding where it has nothing to resolve).
    - plain: decode views (`forward_dp`) and staging views.
    - mtp3: MTP with 3 drafts (CPU's sequential verify, `verify_dp`; the MTP layer's pass one position at
      a time, `mtp_verify_dp`; the draft passes, `mtp_forward_dp`), every pass resolving through the view."""
    from glm53 import DeployConfig, Engine

    fields = dict(HISPARSE, num_speculative_tokens=3) if case == "mtp3" else HISPARSE
    rng = np.random.default_rng(3)
    work = [("a0", "u0", 46, 12), ("a1", "u0", 44, 12), ("b0", "u1", 46, 12)]
    prompts = {rid: rng.integers(0, small_model.cfg.vocab_size, n).astype(np.int32) for rid, _, n, _ in work}
    eng = Engine(small_model, DeployConfig(**fields, data_parallel_size=2, enable_expert_parallel=True))
    got = _hisparse_run(eng, [(rid, salt, new) for rid, salt, _, new in work], prompts)
    owners = [eng.replica_of(rid) for rid, *_ in work]
    assert owners == [0, 0, 1]
    if case == "mtp3":
        assert all(rep.scheduler.spec.num_drafts > 0 for rep in eng.replicas)
    for r in range(2):
        hits, misses, staged, h2d = got[r]
        assert misses > 0 and h2d > 0 and eng.replicas[r].scheduler.policy.stats.released_pages > 0, (r, got[r])
        one = Engine(small_model, DeployConfig(**fields))
        want = _hisparse_run(one, [(rid, "", new) for (rid, _, _, new), o in zip(work, owners) if o == r], prompts)
        assert got[r] == want[0], (r, got[r], want[0])
        for rid, o in zip(prompts, owners):
            if o != r:
                continue
            a, b = eng.finished[rid], one.finished[rid]
            assert a.output_ids == b.output_ids, rid
            assert len(a.output_logprobs) == len(b.output_logprobs) == (len(b.output_ids) if rid == "b0" else 0)
            for x, y in zip(a.output_logprobs, b.output_logprobs):  # equal up to float summation order
                assert x.rank == y.rank and [t for t, _ in x.top] == [t for t, _ in y.top], rid
                assert np.allclose([x.logprob, *(v for _, v in x.top)], [y.logprob, *(v for _, v in y.top)], atol=1e-4)
    if case == "plain":
        assert got[0][2] > 0  # rank 0 staged host rows into a prefill chunk
        # the simulator, on the same layout and requests, runs the same HiSparse schedule: each rank's
        # tokens, its idle steps, its page counters (pages pre-copied, released, staged; leases; steps in
        # each residency state: a scheduler's decisions, which do not depend on what the resolver found),
        # and the first rounds' all-to-all
        # bytes (no rank overflows one here). Its misses and staged rows are priced from
        # hisparse_miss_fraction and the top-k, not resolved, so they are not compared.
        import dataclasses

        from glm53 import SamplingParams
        from glm53.engine import sim

        m = eng.metrics()
        # float32 KV as the engine's (the simulator's "auto" is bf16: half the bytes each copy moves)
        deploy = dataclasses.replace(eng.deploy, kv_cache_dtype="float32")
        simulated = sim.build_engine(small_model.cfg, deploy, weight_bytes=4)
        for rid, salt, _, new in work:
            simulated.add_request(prompts[rid], SamplingParams(new), req_id=rid, salt=salt)
        while simulated.has_unfinished():
            simulated.step()
        s = simulated.metrics()
        assert [simulated.replica_of(rid) for rid, *_ in work] == owners
        for key in ("dp_rank_tokens", "dp_idle_rank_steps", "ep_all2all_bytes", "preemptions", "d2h_bytes"):
            assert s[key] == m[key], (key, s[key], m[key])
        for r in range(2):
            a, b = simulated.replicas[r].scheduler.policy.stats, eng.replicas[r].scheduler.policy.stats
            assert dataclasses.asdict(a) == dataclasses.asdict(b) and b.released_pages > 0, (r, a, b)
