"""The simulator (glm53.engine.sim): the real scheduler and policies, priced steps on a virtual clock,
no arrays; the full GLM-5.3 preset on a laptop."""

import dataclasses

import jax
import numpy as np
import pytest

import glm53
from experiments import workloads
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine import build as build_mod
from glm53.engine import engine as engine_mod
from glm53.engine import sim
from glm53.engine.plan import PlanRow, StepPlan, StepResult, VirtualClock, WallClock
from glm53.engine.runner import forward_groups, step_limits
from glm53.engine.scheduler import Scheduler
from glm53.engine.synthetic import SyntheticRunner
from glm53.perfmodel import H200_CALIBRATED
from glm53.perfmodel.step import step_cost
from kvcache.block_pool import BlockPool
from kvcache.layout import kv_bytes_per_token

TINY = glm53.get_preset("tiny")
BASE = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, block_size=8)
POLICIES = {"preempt": dict(num_gpu_blocks=40, enable_prefix_caching=False),
            "offload": dict(num_gpu_blocks=40, kv_policy="offload", cpu_offload_bytes=1 << 30),
            "swap": dict(num_gpu_blocks=40, kv_policy="swap", cpu_offload_bytes=1 << 30),
            "hisparse": dict(num_gpu_blocks=56, kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26,
                             cpu_offload_bytes=1 << 24, index_block_size=16)}
GLM53_TP8 = DeployConfig(tensor_parallel_size=8, kv_cache_dtype="fp8_ds_mla", block_size=64, max_model_len=32_768,
                         max_num_batched_tokens=8192, max_num_seqs=64, kv_cache_memory_bytes=15 << 30)


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, int(k)) for k in rng.integers(20, 120, n)]


@pytest.fixture
def no_model_runner(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the simulator built a ModelRunner")
    monkeypatch.setattr(engine_mod, "ModelRunner", refuse)
    monkeypatch.setattr(build_mod, "ModelRunner", refuse)  # the profile run's


def test_full_preset_runs_with_no_arrays(no_model_runner):
    cfg = glm53.get_preset("glm-5.3")
    before = len(jax.live_arrays())
    eng = sim.build_engine(cfg, GLM53_TP8)
    outs = eng.generate([np.arange(3000) % cfg.vocab_size, np.arange(9000) % 1000], max_new_tokens=20)
    assert len(jax.live_arrays()) == before
    assert [len(o.token_ids) for o in outs] == [20, 20]
    assert eng.num_devices == 8 and eng.deploy.num_gpu_blocks > 0
    # the clock moved by exactly the priced steps (nothing waited), and the first tokens came after a
    # prefill that costs more than one decode step
    runner = eng.runner
    assert eng.clock.now() == pytest.approx(runner.busy_s) and runner.busy_s > 0
    o = outs[1]
    gaps = np.diff(o.token_times_s)
    assert o.first_token_s - o.arrival_s > gaps.max() > 0
    assert {"sparse_mla_decode", "sparse_mla_prefill", "moe_experts", "tp_all_reduce"} <= set(runner.time_by_op)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_schedule_does_not_depend_on_pricing(pool_history, policy):
    """Without think time a run's decisions are the same whether steps are priced or not: the simulator
    and a plain synthetic runner with the same tokens give the same block-pool history and counters."""
    deploy = DeployConfig(**BASE, **POLICIES[policy])
    eng = sim.build_engine(TINY, deploy)
    outs = eng.generate(_prompts(), max_new_tokens=24)
    hist = pool_history.take()
    plain = Engine(TINY, eng.deploy, runner=SyntheticRunner(sim.hash_token(TINY.vocab_size), eng.sizes.page_bytes))
    plain_outs = plain.generate(_prompts(), max_new_tokens=24)
    assert [o.token_ids.tolist() for o in outs] == [o.token_ids.tolist() for o in plain_outs]
    assert pool_history.take() == hist and len(hist) > 50
    a, b = eng.metrics(), plain.metrics()
    for k in ("preemptions", "offloads", "recomputed_tokens", "d2h_bytes", "h2d_bytes", "prefix_hit_rate"):
        assert a[k] == b[k], k
    assert a["preemptions"] + a["offloads"] + a.get("released_pages", 0) >= 1  # the pool was under pressure
    if policy != "preempt":
        assert a["d2h_bytes"] > 0 and eng.runner.time_by_op["kv_store"] > 0


@pytest.mark.parametrize("policy", ["preempt", "preempt_cache", "offload", "hisparse"])
def test_skipped_admission_retries_change_nothing(pool_history, monkeypatch, policy):
    """The scheduler skips re-admitting the head of the queue that did not fit while nothing its admission
    reads has changed. Run those retries anyway (verify_skipped_admissions): each fails again and leaves
    every pool, block table and policy state as it was (the scheduler checks), so the run is the one
    without the skip, event for event; with the skip, tokens, counters and the final pools are the same."""
    kw = {**POLICIES, "preempt_cache": dict(num_gpu_blocks=36), "hisparse": {**POLICIES["hisparse"], "num_gpu_blocks": 40}}
    deploy = DeployConfig(**BASE, **kw[policy])

    def run():
        eng = sim.build_engine(TINY, deploy)
        outs = eng.generate(_prompts(10), max_new_tokens=24)
        sch = eng.scheduler
        pools = [sch.kv.pool] + [p for p in vars(sch.policy).values() if isinstance(p, BlockPool)]
        m = eng.metrics()
        return ([o.token_ids.tolist() for o in outs], [p.state() for p in pools],
                {k: m[k] for k in ("preemptions", "offloads", "recomputed_tokens", "d2h_bytes", "h2d_bytes",
                                   "prefix_hit_rate", "running_requests_mean")},
                eng.clock.now(), sch.stats.steps), sch.skipped_admissions

    monkeypatch.setattr(Scheduler, "verify_skipped_admissions", True)
    verified, checked = run()
    verified_events = pool_history.take()
    monkeypatch.setattr(Scheduler, "verify_skipped_admissions", False)
    skipped, n = run()
    assert n == checked > 5
    assert skipped == verified
    assert len(pool_history.take()) < len(verified_events)  # the skipped retries' touch / free pairs


def test_an_offload_admission_given_back_before_it_takes_anything_is_the_full_attempt(monkeypatch):
    """The offload policy asks whether a waiting request fits before it takes anything (`KVPolicy.admit_if`)
    and, when it does not, gives it back in one pass per pool (`BlockPool.requeue`) instead of touching its
    prefix on the device and host pools, failing the fit test and freeing it all. A run whose attempts all go
    the full way has the same pools (ref counts, free-queue order, hash index) after every schedule, and the
    same tokens and counters."""
    from kvcache.block_pool import KVCacheManager

    deploy = DeployConfig(**BASE, **POLICIES["offload"])
    given_back = []
    give_back = KVCacheManager.give_back
    monkeypatch.setattr(KVCacheManager, "give_back", lambda self, rid: given_back.append(rid) or give_back(self, rid))
    schedule = Scheduler.schedule

    def run():
        states = []

        def recorded(sch):
            plan = schedule(sch)
            states.append([p.state() for p in (sch.kv.pool, *sch.policy.host.values())])
            return plan

        monkeypatch.setattr(Scheduler, "schedule", recorded)
        eng = sim.build_engine(TINY, deploy)
        outs = eng.generate(_prompts(10), max_new_tokens=24)
        m = eng.metrics()
        return ([o.token_ids.tolist() for o in outs], states, {k: m[k] for k in ("preemptions", "prefix_hit_rate",
                                                                               "h2d_bytes", "d2h_bytes")})

    fast = run()
    assert len(given_back) > 5
    monkeypatch.setattr(Scheduler, "_fits_first_chunk", lambda self, req, budget: None)  # nothing asked: the full way
    n = len(given_back)
    assert run() == fast and len(given_back) == n


@pytest.mark.parametrize("policy", ["offload", "hisparse"])
def test_the_host_tiers_prefix_walk_is_the_page_by_page_walk(monkeypatch, policy):
    """`HostTier.lookup_prefix` walks the device and host pools by whole-group lookups (`_pool_walk`): its
    pages are the page-by-page walk's (per hash block the groups ending there, each on the device, else on
    the host, up to the first page neither holds; no secondary tier here), cut to a page boundary, and
    its per-group columns (which the policies' admissions read) are its pages'."""
    from kvcache.host_tier import HostTier

    real, found = HostTier.lookup_prefix, []

    def checked(self, kv, req, first):
        rb = kv.requests[req.req_id]
        want = []
        for c in range(first, min((req.num_tokens - 1) // kv.tokens_per_block, len(rb.hashes))):
            pages = []
            for g in (g for g in kv.groups if not (c + 1) % kv.ratio[g]):
                b, where = kv.pool.cached.get((g, rb.hashes[c])), "device"
                if b is None and g in self.pools:
                    b, where = self.pools[g].cached.get((g, rb.hashes[c])), "host"
                if b is None:
                    break
                pages.append((g, where, b))
            else:
                want.append(pages)
                continue
            break
        out = real(self, kv, req, first)
        assert out.pages == want[: len(out.pages)] and len(want) - len(out.pages) < 2 * kv.hit_multiple
        cols = {}
        for p in (p for pages in out.pages for p in pages):
            cols.setdefault(p[0], []).append(p)
        assert {g: c for g, c in out.by_group().items() if c} == cols
        found.extend(p for pages in out.pages for p in pages)
        return out

    monkeypatch.setattr(HostTier, "lookup_prefix", checked)
    eng = sim.build_engine(TINY, DeployConfig(**BASE, **POLICIES[policy]))
    prompts = _prompts(10)
    eng.generate(prompts + [np.concatenate([p, p[:9]]) for p in prompts[:5]], max_new_tokens=24)
    kinds = {w for _, w, _ in found}  # host pages were walked (and, under offload, device pages past the hit)
    assert "host" in kinds and (policy != "offload" or "device" in kinds)


def test_the_glm53_pool_holds_what_its_bytes_hold():
    """A block id is one page of one cache group and costs the larger page (kvcache.layout.block_bytes):
    with 1,024-token indexer pages (Part 1's config) the 15 GiB TP8 pool holds within 1% of the tokens
    its bytes hold (53,940 B per token without the MTP layer), four first turns of 74,160 tokens; with
    indexer pages of block_size every indexer page costs an MLA page and the pool holds about half."""
    cfg = glm53.get_preset("glm-5.3")
    per_token = kv_bytes_per_token(cfg, include_mtp=False)
    by_bytes = (15 << 30) // per_token
    for index_block, want in ((1024, 0.99), (None, 0.52)):
        d = dataclasses.replace(GLM53_TP8, max_model_len=142_000, index_block_size=index_block).resolved(cfg)
        kv = Scheduler(d, d.num_gpu_blocks).kv
        held = max(t for t in range(0, by_bytes, 64) if kv.blocks_needed_all(t) <= d.num_gpu_blocks)
        assert want <= held / by_bytes < want + 0.02, (index_block, held, by_bytes)
        if index_block:
            assert d.num_gpu_blocks // kv.blocks_needed_all(74_160) == 3 and held > 4 * 74_000


def test_think_time_advances_the_virtual_clock():
    """One session at concurrency 1: the clock ends at the priced steps plus every think time."""
    turns = [workloads.Turn(input_tokens=n, output_tokens=8, think_s=t) for n, t in ((60, 0.0), (10, 2.5), (12, 4.0))]
    sessions = [workloads.Session("s0", "u0", turns)]
    eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64))
    client = workloads.ClosedLoopClient(eng, sessions, 1, vocab_size=TINY.vocab_size,
                                        make_params=lambda n: SamplingParams(max_new_tokens=n), think_time_scale=1.0)
    res = client.run()
    assert eng.clock.now() == pytest.approx(eng.runner.busy_s + 6.5)
    outs = [eng.output(r) for r in res.request_ids]
    assert outs[1].arrival_s == pytest.approx(outs[0].finish_s + 2.5)
    assert outs[2].arrival_s == pytest.approx(outs[1].finish_s + 4.0)


def test_replicas_run_in_parallel_on_the_virtual_clock():
    eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64, data_parallel_size=2))
    eng.generate(_prompts(8), max_new_tokens=16)
    busy = [r.runner.busy_s for r in eng.replicas]
    assert min(busy) > 0
    assert max(busy) <= eng.clock.now() < sum(busy)


@pytest.mark.parametrize("routing", ["salt", "load"])
def test_dp_routing_keeps_a_salt_on_its_rank_or_balances_by_vllms_score(routing):
    """"salt": a user's later requests go to the rank that took its first, however loaded; "load": vLLM's
    DP load balancer, the least 4 x waiting + running (lowest rank on ties), whatever the salt."""
    eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64, data_parallel_size=3, dp_routing=routing))
    p = _prompts(1)[0]
    first = [eng.replica_of(eng.add_request(p, SamplingParams(max_new_tokens=4), salt=f"u{i}")) for i in range(3)]
    assert first == [0, 1, 2]  # an empty engine: the least loaded, lowest first
    eng.step()  # each rank runs its request: running 1, waiting 0
    eng.add_request(p, SamplingParams(max_new_tokens=4), req_id="w", salt="u9")  # waiting on rank 0: score 5
    again = [eng.replica_of(eng.add_request(p, SamplingParams(max_new_tokens=4), salt="u0")) for _ in range(2)]
    assert again == ([0, 0] if routing == "salt" else [1, 2])


def test_a_priced_step_is_the_perf_models_price_of_its_plan():
    """The runner's duration for a plan is step_cost's time of that plan on the default (calibrated)
    spec plus the fixed overhead."""
    eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64), step_overhead_s=1e-3)
    for p in _prompts(3):
        eng.add_request(p, SamplingParams(max_new_tokens=4))
    sch, runner = eng.scheduler, eng.runner
    while sch.has_work:
        plan = sch.schedule()
        res = runner.execute(plan)
        assert res.duration_s == pytest.approx(step_cost(TINY, H200_CALIBRATED, runner.dep, plan).time_s() + 1e-3)
        sch.update(plan, res, eng.clock.now())


def test_host_copy_overlap_hides_a_steps_copies_behind_its_forward():
    """runner host_copy_overlap: that fraction of a step's KV copies (kv_load, kv_store) runs beside its
    forward, hidden up to the forward's length: the same schedule and the same booked op times, each step
    shorter by exactly min(overlap x copies, the rest of its work)."""
    runs = {}
    for overlap in (0.0, 0.5, 1.0):
        eng = sim.build_engine(TINY, DeployConfig(**BASE, **POLICIES["offload"]), host_copy_overlap=overlap)
        steps, runner = [], eng.runner
        execute = runner.execute

        def timed(plan, execute=execute, runner=runner, steps=steps):
            before = sum(runner.time_by_op.get(k, 0.0) for k in sim.HOST_COPIES)
            res = execute(plan)
            copies = sum(runner.time_by_op.get(k, 0.0) for k in sim.HOST_COPIES) - before
            steps.append(([r.req_id for r in plan.rows], copies, res.duration_s))
            return res

        runner.execute = timed
        eng.generate(_prompts(), max_new_tokens=24)
        runs[overlap] = steps, dict(runner.time_by_op)
    serial, ops = runs[0.0]
    assert sum(c for _, c, _ in serial) > 0
    hidden_somewhere = False
    for overlap in (0.5, 1.0):
        steps, their_ops = runs[overlap]
        assert their_ops == ops and [s[0] for s in steps] == [s[0] for s in serial]
        for (_, copies, d0), (_, _, d) in zip(serial, steps):
            hidden = min(overlap * copies, d0 - copies)
            assert d == pytest.approx(d0 - hidden, rel=1e-12, abs=1e-15)
            hidden_somewhere |= hidden > 0
    assert hidden_somewhere
    with pytest.raises(ValueError, match="host_copy_overlap"):
        sim.build_engine(TINY, DeployConfig(**BASE, **POLICIES["offload"]), host_copy_overlap=1.5)


def test_padded_pricing_prices_the_runners_forwards():
    """pad_like_runner=True: a step costs one forward per width bucket the model runner would run (its
    padded rows, its window, one forward latency each), and never less than the plan's own work."""
    hw = dataclasses.replace(H200_CALIBRATED, forward_latency_s=1e-3)
    deploy = DeployConfig(**BASE, num_gpu_blocks=64)
    eng = sim.build_engine(TINY, deploy, hw, pad_like_runner=True)
    for p in _prompts(3):
        eng.add_request(p, SamplingParams(max_new_tokens=4))
    sch, runner = eng.scheduler, eng.runner
    widths = set()
    while sch.has_work:
        plan = sch.schedule()
        res = runner.execute(plan)
        groups = forward_groups(plan.rows, *step_limits(eng.deploy))
        widths.add(tuple(sorted(g[0] for g in groups)))
        assert res.duration_s == pytest.approx(sum(
            sim.forward_cost(TINY, hw, runner.dep, padded, width, window,
                             sample=any(plan.rows[i].sample for i in idx)).time_s()
            for width, idx, padded, window in groups))
        unpadded = step_cost(TINY, hw, runner.dep, plan).time_s()
        assert res.duration_s >= unpadded + (len(groups) - 1) * 1e-3 - 1e-12
        sch.update(plan, res, eng.clock.now())
    assert any(len(w) > 1 for w in widths)  # some step ran a prefill chunk beside decode rows: two forwards


def test_async_dispatch_overlaps_host_work_with_queued_forwards():
    """async_dispatch=True: a prefill chunk that samples nothing returns after its host part; the forwards
    queue, and the step that samples waits for all of them. One request: the clock ends at every step's
    priced work plus the host parts that follow a wait (the first, and each decode step's); the host
    parts of the chunks after the first hide behind the queued forwards."""
    hw = dataclasses.replace(H200_CALIBRATED, forward_latency_s=5e-3)  # forwards longer than the host part
    overhead = 1e-3
    eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64), hw, step_overhead_s=overhead,
                           pad_like_runner=True, async_dispatch=True)
    eng.add_request(np.arange(200) % TINY.vocab_size, SamplingParams(max_new_tokens=3))
    runner, durations = eng.runner, []
    while eng.has_unfinished():
        before = eng.clock.now()
        eng.step()
        durations.append(eng.clock.now() - before)
    work = runner.busy_s - overhead * runner.steps
    assert runner.steps == 6  # 4 chunks of 64 tokens (the last samples), then 2 decode steps
    assert durations[:3] == pytest.approx([overhead] * 3)  # chunks that sample nothing do not wait
    assert eng.clock.now() == pytest.approx(3 * overhead + work)
    assert eng.clock.now() < runner.busy_s
    with pytest.raises(ValueError, match="clock"):
        sim.SimRunner(TINY, eng.deploy, eng.sizes, async_dispatch=True)
    # host time after dispatch follows the forward the step samples from (sampling and the update read its
    # result): a decode step takes both, one after the other
    for overlap in (1e-3, 20e-3):
        eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64), hw, step_overhead_s=overhead,
                               pad_like_runner=True, async_dispatch=True, host_overlap_s=overlap)
        eng.add_request(np.arange(10) % TINY.vocab_size, SamplingParams(max_new_tokens=3))
        eng.step()  # the prompt
        busy = eng.runner.busy_s
        before = eng.clock.now()
        eng.step()  # one decode forward
        forward = eng.runner.busy_s - busy - overhead - overlap
        assert eng.clock.now() - before == pytest.approx(overhead + forward + overlap)
    # ... and a prefill chunk that samples nothing still returns after its host parts alone
    eng = sim.build_engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64), hw, step_overhead_s=overhead,
                           pad_like_runner=True, async_dispatch=True, host_overlap_s=2e-3)
    eng.add_request(np.arange(200) % TINY.vocab_size, SamplingParams(max_new_tokens=3))
    eng.step()
    assert eng.clock.now() == pytest.approx(overhead + 2e-3)


def test_a_priced_runner_needs_a_virtual_clock():
    class Priced(SyntheticRunner):
        def execute(self, plan) -> StepResult:
            return dataclasses.replace(super().execute(plan), duration_s=0.01)

    eng = Engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64), runner=Priced(), clock=WallClock())
    eng.add_request(_prompts(1)[0])
    with pytest.raises(TypeError, match="VirtualClock"):
        eng.step()
    clock = VirtualClock()
    with pytest.raises(ValueError, match=">= 0"):
        clock.advance(-1.0)


def test_a_model_config_needs_a_runner():
    with pytest.raises(ValueError, match="needs a runner"):
        Engine(TINY, DeployConfig(**BASE, num_gpu_blocks=64))


def test_hisparse_prices_verify_rows_as_hot_buffer_reads_and_chunks_as_staged_rows():
    """Under MTP a verify row (its last token and drafts) over host-only pages is a decode row: it is priced
    as hot-buffer misses, not as a prefill chunk staging rows; a chunk over host-only pages stages, one
    of a single token without a hot-buffer lease too (the simulator's cut of a P/D decode leg's prompt to
    its last token), where a one-token row with a lease reads through the hot buffer. (The committed
    part1_mtp3_1m sweep first ran with verify rows priced as chunks: 1.1e9 staged rows.)"""
    from kvcache.policies.hisparse import HiSparseRow

    mtp = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
           "synthetic_acceptance_length": 2.99}
    deploy = DeployConfig(**{**BASE, **POLICIES["hisparse"], "speculative_config": mtp})
    runner = sim.build_engine(TINY, deploy, pad_like_runner=True).runner
    table = (-1,) * 8 + (5, 6)  # 64 host-only positions, then two device pages

    def plan(row, lease=0):
        return StepPlan(0, (row,), {"mla": (table,), "indexer": ((1, 2, 3, 4, 5),)},
                        (HiSparseRow(tuple(range(10)), lease=lease),), ())

    params = SamplingParams(max_new_tokens=8)
    verify = plan(PlanRow("a", 79, np.zeros(4, np.int32), True, params, 3, num_draft_tokens=3))
    chunk = plan(PlanRow("a", 70, np.zeros(4, np.int32), True, params, 0))
    assert runner._stage_rows(verify) == 0 and runner._miss_rows(verify) > 0
    assert runner._stage_rows(chunk) == min(4 * TINY.index_topk, 64) and runner._miss_rows(chunk) == 0
    last = PlanRow("a", 73, np.zeros(1, np.int32), True, params, 0)
    assert runner._stage_rows(plan(last, lease=-1)) == min(TINY.index_topk, 64)
    assert runner._stage_rows(plan(last, lease=0)) == 0
    before = runner.staged_rows
    runner.execute(verify)
    assert runner.staged_rows == before and runner.hot_miss_rows > 0


def test_the_simulator_prices_the_verify_form_the_runner_computes():
    """speculative_config verify: the simulator prices the form SpeculativeConfig.verify_form gives the
    runner on the priced hardware's platform. Sequential verify is its 1 + k positions as one-token
    decode passes of the target, one after another (each pass reading the weights again), checked
    against plain one-token decode rows; batched is one forward over the 1 + k tokens."""
    import types

    from glm53.perfmodel.step import StepLayout

    cfg, hw = glm53.get_preset("glm-5.3"), H200_CALIBRATED

    def row(start, n, drafts=0):
        return types.SimpleNamespace(start=start, num_tokens=n, num_draft_tokens=drafts, sample=True)

    verify = types.SimpleNamespace(rows=(row(9_996, 4, 3),) * 8)
    seq, bat = (step_cost(cfg, hw, StepLayout(tp=8, verify=v), verify).time_s() for v in ("sequential", "batched"))
    passes = sum(step_cost(cfg, hw, StepLayout(tp=8), types.SimpleNamespace(rows=(row(9_996 + j, 1),) * 8)).time_s()
                 for j in range(4))
    assert seq == pytest.approx(passes, rel=1e-12)
    assert seq > 2 * bat  # eight rows: each pass re-reads the weights a batched forward reads once
    with pytest.raises(ValueError, match="verify"):
        StepLayout(verify="auto")

    mtp = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
           "synthetic_acceptance_length": 2.99}
    cpu = dataclasses.replace(hw, platform="cpu")
    small = dict(POLICIES["hisparse"], hisparse_device_buffer_size=2 * TINY.index_topk)  # < 4 x top-k rows

    def form(hardware, verify="auto", **extra):
        d = DeployConfig(**{**BASE, **extra, "speculative_config": dict(mtp, verify=verify)})
        runner = sim.build_engine(TINY, d, hardware).runner
        assert runner.dep.verify == runner.verify_mode
        return runner.verify_mode

    assert form(hw) == "batched" and form(cpu) == "sequential" and form(hw, "sequential") == "sequential"
    assert form(hw, **POLICIES["hisparse"]) == "batched"  # the default hot buffer holds (3 + 2) x top-k rows
    assert form(hw, **small) == "sequential"  # "auto" resolves one position at a time, as the runner does
    with pytest.raises(ValueError, match="hot buffer needs"):
        form(hw, "batched", **small)


def test_the_simulators_verify_tokens_are_the_synthetic_runners():
    """SimRunner._verify computes its tokens from the tokens-generated counts instead of cutting rows: the
    same accepted tokens and next drafts as SyntheticRunner._verify, row for row, with and without drafts
    (and the cutting path when the tokens are not the default ones)."""
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
           "synthetic_acceptance_length": 2.99}
    runner = sim.build_engine(TINY, DeployConfig(**BASE, speculative_config=mtp)).runner
    assert runner._by_count is not None
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=8)
    for i in range(300):
        drafts = int(rng.integers(0, 4))
        known = 1 if drafts else int(rng.integers(1, 9))
        ids = rng.integers(0, TINY.vocab_size, known + drafts).astype(np.int32)
        row = sim.PlanRow(f"r{i % 17}", int(rng.integers(0, 200)), ids, True, params, int(rng.integers(0, 50)),
                          num_draft_tokens=drafts)
        assert runner._verify(row) == SyntheticRunner._verify(runner, row)
    custom = sim.build_engine(TINY, DeployConfig(**BASE, speculative_config=mtp), token=lambda row: 7).runner
    assert custom._by_count is None


def _row(rid, start, n, sample=True):
    return PlanRow(rid, start, np.ones(n, np.int32), sample, SamplingParams(4), 0)


def _plan(*rows):
    tables = tuple(tuple(range(-(-(r.start + r.num_tokens) // 8))) for r in rows)
    return StepPlan(0, rows, {"mla": tables, "indexer": tables}, None, ())


def _dp_ep_step():
    """The DP2 x EP2 step the pacing tests price: rank 0 decodes two rows, rank 1 prefills a 16-token chunk."""
    return _plan(_row("a", 40, 1), _row("b", 70, 1)), _plan(_row("c", 0, 16, sample=False))


def test_dp_ep_ranks_are_priced_as_one_lock_step_with_their_all_to_alls():
    """DP2 x EP2, one step built by hand: rank 0 decodes two rows, rank 1 prefills a 16-token chunk.
    The step runs every width on both ranks at the most rows any rank pads to and the widest window, so
    its price is, per forward, the one-rank forward of those padded rows (a rank's tokens, half the
    experts, no all-to-all of its own) plus, per MoE layer, the first round's three all-to-alls of
    slots x (N - 1) rows: hidden states out, int32 expert ids, results back. A rank that idles in a width
    costs as much: the same step with rank 1 idle is priced as the decode forward alone, and a rank 1
    decoding one shorter row instead changes nothing."""
    from glm53.perfmodel import all_to_all
    from parallel.ep import first_round_capacity

    deploy = DeployConfig(**BASE, num_gpu_blocks=64, data_parallel_size=2, enable_expert_parallel=True)
    eng = sim.build_engine(TINY, deploy)
    runner, hw = eng.replicas[0].runner, H200_CALIBRATED
    assert runner.ranks == [r.runner for r in eng.replicas] and runner.dep.dp == runner.dep.ep == 2
    assert not [c for c in sim.forward_cost(TINY, hw, runner.dep, 2, 1, 64).parts if c.name.startswith("moe_dis")]

    decode, chunk = _dp_ep_step()
    limits = step_limits(eng.deploy)
    (w_dec, _, rows_dec, win_dec), = forward_groups(decode.rows, *limits)
    (w_pre, _, rows_pre, win_pre), = forward_groups(chunk.rows, *limits)
    assert (w_dec, rows_dec, w_pre, rows_pre) == (1, 2, 16, 1)

    d, k, e_local = TINY.hidden_size, TINY.num_experts_per_tok, TINY.n_routed_experts // 2
    moe_layers = [i for i, kind in enumerate(TINY.mlp_layer_types) if kind == "sparse"]

    def a2a(tokens_per_layer):  # one forward's all-to-alls, per MoE layer: slots to the one other rank
        slots = [first_round_capacity(t, k, e_local, 2) for t in tokens_per_layer]
        return sum(2 * all_to_all(hw, s * d * 2, 2).time_s + all_to_all(hw, s * 4, 2).time_s for s in slots), slots

    dec_a2a, dec_slots = a2a([rows_dec * w_dec] * len(moe_layers))
    # a prefill forward's last layer (an MoE layer in TINY) dispatches each row's last token only
    pre_a2a, pre_slots = a2a([rows_pre if i == TINY.num_hidden_layers - 1 else rows_pre * w_pre for i in moe_layers])
    dec_s = sim.forward_cost(TINY, hw, runner.dep, rows_dec, w_dec, win_dec).time_s() + dec_a2a
    pre_s = sim.forward_cost(TINY, hw, runner.dep, rows_pre, w_pre, win_pre, sample=False).time_s() + pre_a2a
    assert dec_a2a > 0 and pre_a2a > 0

    out = runner.execute_ranks([decode, chunk])
    assert [r.duration_s for r in out] == [pytest.approx(dec_s + pre_s)] * 2
    assert set(out[0].tokens) == {"a", "b"} and not out[1].tokens
    assert runner.all2all_bytes() == (sum(dec_slots) + sum(pre_slots)) * (2 * d * 2 + 4)
    # idle ranks pass padding rows: rank 1 idle, or decoding one shorter row, prices the same decode forward
    idle = runner.execute_ranks([decode, None])
    assert idle[0].duration_s == pytest.approx(dec_s) and idle[1] is None
    both = runner.execute_ranks([decode, _plan(_row("d", 9, 1))])
    assert [r.duration_s for r in both] == [pytest.approx(dec_s)] * 2


def test_vllm_dp_pacing_prices_each_ranks_own_forward_and_the_experts_on_real_tokens():
    """dp_pacing="vllm" (vLLM 0.34 on Hopper): the same hand-built DP2 x EP2 step (rank 0 decodes two rows,
    rank 1 prefills a 16-token chunk) costs the slower rank's own unpadded forward without its routed
    experts, plus the experts of the two ranks' 18 real tokens (each GPU a rank of their mean, 9) and,
    per MoE layer, the busiest sender's (16 tokens) fp8 dispatch and bf16 combine. Which rank holds which
    rows does not matter, a rank with fewer rows moves the experts' share only, the lock-step's price of
    the same step is higher (its experts run every padded row of every width), and the schedule of a
    served workload is the lock-step's with a shorter clock."""
    from glm53.perfmodel.ops import moe
    from glm53.perfmodel.step import moe_layers

    deploy = DeployConfig(**BASE, num_gpu_blocks=64, data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="dp_pacing must be one of"):
        sim.build_engine(TINY, deploy, dp_pacing="fast")
    eng = sim.build_engine(TINY, deploy, dp_pacing="vllm")
    runner, hw = eng.replicas[0].runner, H200_CALIBRATED
    dep = runner.dep

    decode, chunk = _dp_ep_step()

    def own(p):  # a rank's forward of its own rows, its routed experts left out
        return sum(c.time_s for c in step_cost(TINY, hw, dep, p).parts if c.name != "moe_experts")

    layers = moe_layers(TINY, False)
    assert layers == sum(kind == "sparse" for kind in TINY.mlp_layer_types) > 0

    def shared(mean, busiest):  # per MoE layer: the experts of a rank of the mean tokens, the busiest sender's a2a
        return layers * (moe(TINY, hw, mean, 2)[1].time_s + sum(c.time_s for c in moe(TINY, hw, busiest, 2)[3:]))

    want = max(own(decode), own(chunk)) + shared(9, 16)
    assert own(decode) != own(chunk) and shared(9, 16) > 0
    assert [r.duration_s for r in runner.execute_ranks([decode, chunk])] == [pytest.approx(want)] * 2
    assert [r.duration_s for r in runner.execute_ranks([chunk, decode])] == [pytest.approx(want)] * 2
    shorter = _plan(_row("d", 9, 1))  # rank 0's rows fewer: 17 real tokens
    assert runner.execute_ranks([shorter, chunk])[1].duration_s == pytest.approx(
        max(own(shorter), own(chunk)) + shared(8.5, 16))
    lock = sim.build_engine(TINY, deploy).replicas[0].runner
    assert lock.execute_ranks([decode, chunk])[0].duration_s > want
    # served: the same schedule (no think time), priced faster
    runs = {}
    for pacing in sim.DP_PACINGS:
        e = sim.build_engine(TINY, deploy, weight_bytes=4, dp_pacing=pacing)
        for p in _prompts(5):
            e.add_request(p, SamplingParams(6))
        steps = 0
        while e.has_unfinished():
            e.step()
            steps += 1
        m = e.metrics()
        runs[pacing] = ((steps, *(m[k] for k in ("output_tokens", "dp_rank_tokens", "dp_idle_rank_steps"))),
                        e.clock.now(), m["ep_all2all_bytes"])
    assert runs["vllm"][0] == runs["lockstep"][0]
    assert 0 < runs["vllm"][1] < runs["lockstep"][1] and runs["vllm"][2] > 0


def test_dp_ep_simulation_reports_the_engines_rank_metrics():
    """A simulated DP2 x EP2 run advances its clock by one price per lock-step (the ranks' runners are
    busy for the same steps) and reports the rank figures (each rank's tokens: its requests' prompts and
    all but their last sampled token; the ranks that idled in a step where another computed) and a rank's
    weights (the replicated ones and half of the routed experts, from the model's shapes)."""
    from glm53 import weights
    from glm53.engine.build import weights_bytes_per_device
    from flax import nnx

    deploy = DeployConfig(**BASE, num_gpu_blocks=64, data_parallel_size=2, enable_expert_parallel=True)
    eng = sim.build_engine(TINY, deploy, weight_bytes=4)
    prompts = _prompts(3)
    steps = []  # per lock-step: which ranks had rows
    execute = eng.replicas[0].runner.execute_ranks

    def counted(plans):
        steps.append([p is not None and bool(p.rows) for p in plans])
        return execute(plans)

    eng.replicas[0].runner.execute_ranks = counted
    ids = [eng.add_request(p, SamplingParams(6)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    m = eng.metrics()
    busy = [r.runner.busy_s for r in eng.replicas]
    assert busy[0] == pytest.approx(busy[1]) and eng.clock.now() == pytest.approx(busy[0])
    owner = [eng.replica_of(i) for i in ids]
    assert sorted(set(owner)) == [0, 1]  # both ranks serve
    assert m["dp_rank_tokens"] == [sum(p.size + 5 for p, o in zip(prompts, owner) if o == r) for r in range(2)]
    assert m["dp_idle_rank_steps"] == sum(len(s) - sum(s) for s in steps if any(s)) > 0
    assert m["ep_all2all_bytes"] > 0
    state = nnx.state(weights.abstract_model(TINY, "float32"))
    whole = weights_bytes_per_device(state, TINY, DeployConfig())
    experts = sum(int(np.prod(x.shape)) * 4 for p, x in jax.tree_util.tree_leaves_with_path(state)
                  if "experts" in [getattr(q, "key", None) for q in p])
    assert m["weights_bytes_per_device"] == whole - experts // 2


@pytest.mark.parametrize("limits", [dict(max_num_batched_tokens=128, max_num_seqs=2),
                                    dict(max_num_batched_tokens=100, max_num_seqs=4),
                                    dict(max_num_batched_tokens=64, max_num_seqs=8, mtp=True)])
def test_every_forward_a_step_forms_is_a_bucket_shape(limits):
    """`bucket_shapes` (what warm-up compiles) leaves out the (rows, width, window) groups no step can
    form: a prefill width with more rows than its shortest rows fit in the budget, or a window narrower
    than those rows. Every group that serving forms under pressure (long prompts chunked beside decode
    rows, prefix hits, preemption; a budget that is not a power of two; MTP's verify rows) is still one
    of them, and the pruning leaves shapes out at these limits."""
    from glm53.engine.runner.batch import bucket_shapes

    limits = dict(limits)  # pytest's parameter, shared between runs: not changed here
    mtp = limits.pop("mtp", False)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.5} if mtp else None
    deploy = DeployConfig(max_model_len=512, block_size=16, num_gpu_blocks=64, speculative_config=spec, **limits)
    eng = sim.build_engine(TINY, deploy)
    vw = eng.runner.verify_width
    shapes = set(bucket_shapes(eng.deploy, vw))
    seen = set()
    execute = eng.runner.execute

    def record(plan):
        seen.update((padded, width, window) for width, _, padded, window
                    in forward_groups(plan.rows, *step_limits(eng.deploy), vw))
        return execute(plan)

    eng.runner.execute = record
    rng = np.random.default_rng(0)
    shared = rng.integers(0, TINY.vocab_size, 96)
    for i, n in enumerate(rng.integers(2, 400, 40)):
        prompt = np.concatenate([shared[: n // 2], rng.integers(0, TINY.vocab_size, n - n // 2)]) if i % 3 else \
            rng.integers(0, TINY.vocab_size, n)
        eng.add_request(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 40))), req_id=str(i))
        if i % 4 == 3:
            for _ in range(int(rng.integers(0, 6))):
                eng.step()
    while eng.has_unfinished():
        eng.step()
    assert seen <= shapes, sorted(seen - shapes)
    assert len({w for _, w, _ in seen}) == len({w for _, w, _ in shapes})  # every width was formed
    widths, windows = sorted({w for _, w, _ in shapes}), sorted({win for *_, win in shapes})
    max_rows = 1 << (deploy.max_num_seqs - 1).bit_length()
    assert len(shapes) < len(widths) * len(windows) * max_rows.bit_length()


def test_fewer_collections_sets_the_thresholds_inside_and_restores_them_after_an_error():
    import gc

    from glm53.engine.sim import SIM_GC_THRESHOLDS, fewer_collections

    before = gc.get_threshold()
    with pytest.raises(KeyError):
        with fewer_collections():
            assert gc.get_threshold() == SIM_GC_THRESHOLDS != before
            raise KeyError("x")
    assert gc.get_threshold() == before


def test_rows_priced_as_loaded_are_cut_with_their_tables_and_policy_rows():
    """SimRunner.loaded_prompt (a P/D consumer priced as vLLM's, glm53.engine.pd_sim): a row wholly below its
    request's listed position leaves the priced plan with its block tables and policy row, a row across
    it keeps the positions from there (the entry then dropped), other rows stay as they are, and the
    engine's plan is not changed."""
    eng = sim.build_engine(glm53.get_preset("glm-5.3"), GLM53_TP8)
    run = eng.replicas[0].runner
    p = SamplingParams(max_new_tokens=4)

    def row(rid, start, n, sample):
        return PlanRow(rid, start, np.arange(n, dtype=np.int32), sample, p, 0)

    rows = (row("a", 0, 300, False), row("b", 40, 1, True), row("c", 1000, 700, True), row("d", 64, 100, True))
    tables = {"mla": ((1,), (2,), (3,), (4,)), "indexer": ((5,), (6,), (7,), (8,))}
    plan = StepPlan(0, rows, tables, ("A", "B", "C", "D"), ())
    run.loaded_prompt.update(a=1699, c=1699, d=163)
    priced = run._as_priced(plan)
    assert [(r.req_id, r.start, r.num_tokens) for r in priced.rows] == [("b", 40, 1), ("c", 1699, 1), ("d", 163, 1)]
    assert priced.block_tables == {"mla": ((2,), (3,), (4,)), "indexer": ((6,), (7,), (8,))}
    assert priced.policy_rows == ("B", "C", "D")
    assert run.loaded_prompt == {"a": 1699} and run.loaded_tokens == 300 + 699 + 99
    assert plan.rows == rows  # the engine's plan as it was
    run.loaded_prompt.clear()
    assert run._as_priced(plan) is plan
    eng.shutdown()
