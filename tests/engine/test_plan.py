"""The step plan is the whole seam between scheduler and runner: a runner that is not the model runner
(glm53.engine.synthetic, replaying the model's tokens and completing the transfers it is given) drives
the real scheduler, block pool and policy to the same block-pool history, counters and bytes moved."""

import dataclasses

import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from glm53.engine.plan import StepResult
from glm53.engine.synthetic import SyntheticRunner
from kvcache.transfer import PageCopy, SaveKV

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)  # as tests/engine/test_engine.py
POLICIES = {"preempt": dict(num_gpu_blocks=24, enable_prefix_caching=False),
            "swap": dict(num_gpu_blocks=24, enable_prefix_caching=False, kv_policy="swap", cpu_offload_bytes=1 << 30),
            "offload": dict(num_gpu_blocks=24, enable_prefix_caching=False, kv_policy="offload",
                            cpu_offload_bytes=1 << 30)}


def _prompts():
    """The prompts of tests/conftest.py's `small_reference` (37, 5, 70 and 20 tokens)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]


def replay(outputs):
    """A synthetic runner's token function that returns, for each request, the tokens another run gave."""
    return lambda row: outputs[row.req_id][row.num_generated]


def counters(eng) -> dict:
    """The run's counts; the running requests per step, not over time (wall-clock step times differ)."""
    m = eng.metrics()
    return {k: m[k] for k in ("preemptions", "offloads", "recomputed_tokens", "d2h_bytes", "h2d_bytes",
                              "prefix_hit_rate", "running_requests_mean_per_step")}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_synthetic_runner_gives_the_model_runners_block_history(small_model, small_reference, pool_history, policy):
    """A 24-block pool that preempts: the model runner gives one-request-at-a-time greedy tokens (the
    preempted requests recomputed, swapped out and back, or reloaded from the host tier), and a synthetic
    runner replaying its tokens drives the pools through the same history. (tests/engine/test_engine.py's
    small-pool preempt and swap checks were merged here: one engine of each deployment.)"""
    deploy = DeployConfig(**BASE, **POLICIES[policy])
    model_eng = Engine(small_model, deploy)
    outs = model_eng.generate(_prompts(), max_new_tokens=5)
    model_history = pool_history.take()
    assert [o.token_ids.tolist() for o in outs] == small_reference[1]
    st, tr = model_eng.scheduler.stats, model_eng.scheduler.transfers
    assert st.preemptions >= 1 and sum(o.num_preemptions for o in outs) == st.preemptions
    if policy == "preempt":
        assert st.recomputed_tokens > 0
    if policy == "swap":
        assert st.offloads >= 1 and st.offloads == st.preemptions and st.recomputed_tokens == 0
        # every offloaded byte came back, and each offload moved whole blocks of every layer (page bytes as
        # the device arrays hold them)
        pages = model_eng.runner.host.page_bytes
        assert tr.d2h_bytes == tr.h2d_bytes > 0 and tr.d2h_bytes % (pages["mla"] + pages["indexer"]) == 0
        assert tr.modelled_link_s == pytest.approx(2 * tr.d2h_bytes / 50e9)
        assert model_eng.scheduler.policy.used_bytes == 0 and not model_eng.scheduler.policy.saved
        m = model_eng.metrics()
        assert (m["preemptions"], m["recomputed_tokens"], m["d2h_bytes"]) == (st.preemptions, 0, tr.d2h_bytes)
        assert m["requests"] == 4 and m["ttft_median_s"] > 0 and 0 < m["running_requests_mean"] <= 4
    runner = SyntheticRunner(replay({o.req_id: o.token_ids.tolist() for o in outs}),
                             page_bytes=model_eng.sizes.page_bytes, record=True)
    syn_eng = Engine(small_model, deploy, runner=runner)
    syn_outs = syn_eng.generate(_prompts(), max_new_tokens=5)
    assert [o.token_ids.tolist() for o in syn_outs] == [o.token_ids.tolist() for o in outs]
    assert pool_history.take() == model_history and len(model_history) > 50
    want = counters(model_eng)
    assert want["preemptions"] >= 1 and (policy != "swap" or want["offloads"] >= 1)
    got = counters(syn_eng)
    assert got == want
    assert (policy == "swap") == any(isinstance(op, SaveKV) for op in runner.executed)
    assert (policy == "offload") == any(isinstance(op, PageCopy) and op.direction == "h2d" for op in runner.executed)


def test_the_plan_is_frozen_and_carries_what_the_runner_reads(small_model):
    eng = Engine(small_model, DeployConfig(**BASE), runner=SyntheticRunner())
    ids = [eng.add_request(p) for p in _prompts()]
    plan = eng.scheduler.schedule()
    reqs = eng.scheduler.requests
    # the 32-token budget: the 37-token prompt's first chunk, nothing else
    assert [(r.req_id, r.start, r.num_tokens, r.sample) for r in plan.rows] == [(ids[0], 0, 32, False)]
    np.testing.assert_array_equal(plan.rows[0].token_ids, _prompts()[0][:32])
    assert plan.block_tables["mla"][0] == tuple(eng.scheduler.kv.block_table(ids[0], "mla"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = ()
    # nothing in it aliases the scheduler's state: token ids are a read-only copy, the tables immutable
    assert not plan.rows[0].token_ids.flags.writeable
    assert not np.shares_memory(plan.rows[0].token_ids, reqs[ids[0]].prompt_ids)
    with pytest.raises(TypeError):
        plan.block_tables["mla"] = ()
    tables = plan.block_tables["mla"][0]
    eng.scheduler.update(plan, StepResult({}, frozenset()), 0.0)
    plan2 = eng.scheduler.schedule()  # the next plan grows the tables; the first one is unchanged
    assert plan.block_tables["mla"][0] == tables and len(plan2.block_tables["mla"][0]) > len(tables)
    assert plan2.rows[0].start == 32 and plan2.rows[0].sample and reqs[ids[0]].num_computed_tokens == 32
    # a result that leaves out a sampled token or a transfer is an error, never silently dropped
    with pytest.raises(RuntimeError, match="sampled no token"):
        eng.scheduler.update(plan2, StepResult({}, frozenset()), 0.0)
