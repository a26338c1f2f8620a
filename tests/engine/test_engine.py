"""The engine against one-request-at-a-time decoding on the 2-layer model (scheduling, not depth, is the
subject): batching, chunked prefill, preemption and prefix caching must not change greedy outputs; counts
say what was computed."""

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)


def _prompts(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n) for n in lens]


def test_batched_chunked_greedy_equals_one_at_a_time(small_model, small_reference):
    prompts, want = small_reference
    streamed = []
    eng = Engine(small_model, DeployConfig(**BASE))
    outs = eng.generate(prompts, max_new_tokens=5, on_token=lambda rid, tok: streamed.append((rid, tok)))
    assert [o.token_ids.tolist() for o in outs] == want
    assert sorted(streamed) == sorted((o.req_id, t) for o in outs for t in o.token_ids.tolist())
    assert all(o.arrival_s <= o.first_token_s <= o.finish_s and len(o.token_times_s) == 5 for o in outs)
    # a 70-token prompt under a 32-token budget takes 3 chunks; 4 rows never exceed max_num_seqs
    assert eng.scheduler.stats.preemptions == 0 and eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks


# A small pool that preempts (recomputing, or swapping to the host and back) still matches:
# tests/engine/test_plan.py::test_a_synthetic_runner_gives_the_model_runners_block_history, whose model
# engines are these deployments.


def test_second_turn_prefills_only_new_tokens_and_salts_share_nothing(small_model):
    bs = BASE["block_size"]
    eng = Engine(small_model, DeployConfig(**BASE))
    turn1 = _prompts([29], seed=5)[0]
    out1 = eng.generate([turn1], max_new_tokens=3)[0]
    new = _prompts([6], seed=6)[0]
    turn2 = np.concatenate([turn1, out1.token_ids, new])
    before = eng.scheduler.stats.prefix_hit_tokens
    rid = eng.add_request(turn2, SamplingParams(2))
    while eng.has_unfinished():
        eng.step()
    hit = eng.scheduler.stats.prefix_hit_tokens - before
    prefilled = turn2.size - hit
    # New to the cache: the turn's new input plus turn 1's last output token, which was sampled but never
    # fed back (its KV was never computed); at most a partial block more is recomputed.
    not_computed_before = new.size + 1
    assert prefilled <= not_computed_before + bs - 1, (prefilled, not_computed_before)
    assert hit > 0
    assert eng.output(rid).token_ids.size == 2
    # the same tokens under another user's salt hit nothing
    before = eng.scheduler.stats.prefix_hit_tokens
    eng.add_request(turn2, SamplingParams(1), salt="user-b")
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.stats.prefix_hit_tokens == before


def test_sampling_is_reproducible_per_request(small_model):
    p = _prompts([12, 9])
    a = Engine(small_model, DeployConfig(**BASE)).generate(p, 4, greedy=False, temperature=0.8, top_p=0.9, seed=7)
    b = Engine(small_model, DeployConfig(**BASE)).generate(p[:1], 4, greedy=False, temperature=0.8, top_p=0.9, seed=7)
    assert a[0].token_ids.tolist() == b[0].token_ids.tolist()  # batching with another request changes nothing


def test_bad_input_is_rejected(small_model):
    """Engine-level checks on a real model runner (tests/engine/test_deploy.py has every DeployConfig field)."""
    eng = Engine(small_model, DeployConfig(**BASE))
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(np.zeros(126, np.int32), SamplingParams(3))
    with pytest.raises(ValueError, match="needs 64 devices"):  # this process has fewer
        Engine(small_model, DeployConfig(**BASE, decode_context_parallel_size=64))
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Engine(small_model, DeployConfig(**BASE, num_gpu_blocks=2)).add_request(np.zeros(40, np.int32))


def test_stop_tokens_min_tokens_and_abort_on_the_model(small_model, small_reference):
    """A stop token ends a request where greedy decoding samples it; under min_tokens it cannot be sampled
    (its logit is masked) and greedy picks the next best; aborting one request mid-decode changes nothing
    for the others."""
    prompts, want = small_reference
    eng = Engine(small_model, DeployConfig(**BASE))
    w = want[0]
    stop = eng.add_request(prompts[0], SamplingParams(5, stop_token_ids=(w[2],)))
    masked = eng.add_request(prompts[0], SamplingParams(5, stop_token_ids=(w[2],), min_tokens=4))
    gone = eng.add_request(prompts[2], SamplingParams(5))
    rest = [eng.add_request(p, SamplingParams(5)) for p in (prompts[1], prompts[3])]
    while eng.finished.get(gone) is None:
        eng.step()
        if len(eng.requests[gone].output_ids) == 2:
            out = eng.abort_request(gone)
            assert out.token_ids.tolist() == want[2][:2]
    while eng.has_unfinished():
        eng.step()
    assert eng.output(stop).token_ids.tolist() == w[:3] and eng.finished[stop].finish_reason == "stop"
    got = eng.output(masked).token_ids.tolist()
    assert got[:2] == w[:2] and got[2] != w[2] and w[2] not in got[:3]
    logits = glm53.score(small_model, np.concatenate([prompts[0], w[:2]]))[-1]
    logits[w[2]] = -np.inf
    assert got[2] == int(np.argmax(logits))  # the best token but the banned one
    assert [eng.output(r).token_ids.tolist() for r in rest] == [want[1], want[3]]
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks
