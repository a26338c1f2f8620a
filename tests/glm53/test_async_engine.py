"""What keeps the server's engine serving, on the real scheduler, pools and policies with a runner that
needs no model (glm53.engine.synthetic.SyntheticRunner), so nothing compiles:

- a step whose execution raises fails that step's requests (finish_reason "error"), frees their blocks,
  keeps nothing the failed step wrote findable, and the engine serves on; under a policy whose plan
  carried KV transfers, every request of the replica fails and its prefix caches forget their hashes;
- the AsyncEngine thread reports such a failure to the failed requests' clients and serves the next
  request; only MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row stop it;
- stop strings (glm53.tokenizer.TextStream as Request.stop_check) finish a request "stop" on the token
  that completes them, under MTP too (no token after it), and count as stops in vLLM's metrics;
- seeds: any int64 is a seed, mapped onto the sampler's uint32 key."""

import asyncio

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from glm53.engine.engine import StepError
from glm53.engine.prometheus import ServingMetrics
from glm53.engine.synthetic import SyntheticRunner
from glm53.tokenizer import ByteTokenizer, TextStream
from tests.engine.test_abort import _all_returned, _engine, _Model

CFG = glm53.get_preset("tiny")


class Failing:
    """A runner that raises instead of executing the plans `when` picks (the rest go to `runner`)."""

    def __init__(self, runner, when):
        self.runner, self.when, self.failed = runner, when, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        if self.when(plan):
            self.failed.append(plan)
            raise RuntimeError("injected step failure")
        return self.runner.execute(plan)


@pytest.mark.parametrize("policy", ["preempt", "swap", "offload", "hisparse"])
def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(policy):
    eng = _engine(policy)
    rep = eng.replicas[0]
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 512, 33)
    a = eng.add_request(prompt, SamplingParams(20))
    b = eng.add_request(rng.integers(0, 512, 20), SamplingParams(5))
    # fail the step that computes a's second 16-token chunk (its first chunk's 4 blocks are cached by then)
    rep.runner = Failing(rep.runner, lambda plan: any(r.req_id == a and r.start == 16 for r in plan.rows))
    with pytest.raises(StepError) as info:
        for _ in range(10):
            eng.step()
    plan = rep.runner.failed[0]
    everyone = {a, b}
    want = everyone if plan.transfers else {r.req_id for r in plan.rows}
    assert a in want and set(info.value.failed) == want and str(info.value.error) == "injected step failure"
    for rid in want:
        assert eng.finished[rid].finish_reason == "error" and rid not in eng.requests
    rep.runner = rep.runner.runner
    c = eng.add_request(rng.integers(0, 512, 12), SamplingParams(6))
    while eng.has_unfinished():
        eng.step()
    assert len(eng.finished[c].output_ids) == 6 and eng.finished[c].finish_reason == "length"
    for rid in everyone - want:  # what the failure did not touch ran to its end
        assert eng.finished[rid].finish_reason == "length"
    _all_returned(eng)  # the failed requests' blocks, leases and host pages are all back
    # a's first chunk was computed by a step that completed; what the failed step wrote was never cached.
    # A plan with transfers leaves nothing findable at all (its copies may have stopped half way).
    again = eng.add_request(prompt, SamplingParams(1))
    while eng.has_unfinished():
        eng.step()
    assert eng.finished[again].num_cached_tokens == (0 if plan.transfers else 16)
    _all_returned(eng)


def _run(coro):
    return asyncio.run(coro)


async def _drain(handle):
    items = [x async for x in handle]
    return [t for t, _, _ in items], "".join(s for _, s, _ in items) + handle.ended.text, handle.ended


def test_the_engine_thread_reports_a_failed_step_and_serves_on_until_steps_keep_failing():
    marker = [500, 501, 502]
    d = DeployConfig(max_model_len=64, max_num_seqs=4, block_size=4, num_gpu_blocks=40)
    runner = Failing(SyntheticRunner(lambda row: 7), lambda plan: any(
        r.start == 0 and r.token_ids[:3].tolist() == marker for r in plan.rows))
    eng = Engine(_Model(), d, runner=runner)
    metrics = ServingMetrics(eng, model_name="m")
    ae = AsyncEngine(eng).start()

    async def scenario():
        bad = await ae.add(marker + [1, 2], SamplingParams(4))
        tokens, _, ended = await _drain(bad)
        assert tokens == [] and ended.finish_reason == "error" and "injected step failure" in ended.error
        good = await ae.add([1, 2, 3], SamplingParams(4))
        tokens, _, ended = await _drain(good)
        assert tokens == [7] * 4 and ended.finish_reason == "length" and ended.num_output_tokens == 4
        assert ae.error is None and ae.consecutive_failures == 0 and ae.failed_steps == 1
        runner.when = lambda plan: True  # now every step fails: the engine is broken, not one batch
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert ae.error is None
            tokens, _, ended = await _drain(await ae.add([1, 2, 3], SamplingParams(4)))
            assert tokens == [] and ended.finish_reason == "error", i
        for _ in range(100):
            if ae.error is not None:
                break
            await asyncio.sleep(0.01)
        assert ae.error is not None and "steps in a row failed" in str(ae.error)
        with pytest.raises(RuntimeError, match="engine is stopped"):
            await ae.add([1, 2, 3], SamplingParams(4))

    try:
        _run(scenario())
    finally:
        ae.shutdown()
    assert "vllm:request_success_total{engine=\"0\",finished_reason=\"error\",model_name=\"m\"} 4.0" in metrics.text()
    assert not eng.requests and eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks


@pytest.mark.parametrize("mtp", [0, 3])
def test_stop_strings_finish_requests_as_stops_on_the_token_that_completes_them(mtp):
    """Each request's k-th token is the byte "a" + k. With MTP 3 (drafts always right) a step yields up to
    four tokens: the ones after the stop are dropped, as after a stop token."""
    d = DeployConfig(max_model_len=64, max_num_seqs=4, block_size=4, num_gpu_blocks=40,
                     speculative_config={"method": "mtp", "num_speculative_tokens": mtp} if mtp else None)
    eng = Engine(_Model(), d, runner=SyntheticRunner(lambda row: ord("a") + row.num_generated, spec=d.speculative,
                                                     page_bytes=d.kv_sizes(CFG).page_bytes))
    metrics = ServingMetrics(eng, model_name="m")
    ae = AsyncEngine(eng).start()
    tok = ByteTokenizer()

    async def one(stop, min_tokens=0, n=12):
        text = TextStream(tok, stop, min_tokens=min_tokens)
        h = await ae.add([1, 2, 3], SamplingParams(n, min_tokens=min_tokens), text=text)
        tokens, out, ended = await _drain(h)
        return bytes(tokens).decode(), out, ended, text.stopped_by

    async def scenario():
        got = await asyncio.gather(one(["cd"]), one(["b", "e"], min_tokens=3), one(["zz"], n=5), one(["fgh", "g"]))
        assert got[0][:2] == ("abcd", "ab") and got[0][2].finish_reason == "stop" and got[0][3] == "cd"
        assert got[0][2].num_output_tokens == 4
        # "b" came with the 2nd token, before min_tokens=3 were out: only "e" (the 5th) counts
        assert got[1][:2] == ("abcde", "abcd") and got[1][2].finish_reason == "stop" and got[1][3] == "e"
        assert got[2][:2] == ("abcde", "abcde") and got[2][2].finish_reason == "length" and got[2][3] is None
        # the first stop string to end in the text wins ("g" ends with the 7th token; "fgh" would with the 8th)
        assert got[3][:2] == ("abcdefg", "abcdef") and got[3][3] == "g"

    try:
        _run(scenario())
    finally:
        ae.shutdown()
    text = metrics.text()
    assert 'finished_reason="stop",model_name="m"} 3.0' in text and 'finished_reason="length",model_name="m"} 1.0' in text
    assert 'finished_reason="abort",model_name="m"} 0.0' in text


def test_seeds_are_int64_on_the_samplers_uint32_key():
    assert SamplingParams(seed=5).prng_seed == 5 and SamplingParams(seed=2**32 - 1).prng_seed == 2**32 - 1
    keys = {SamplingParams(seed=s).prng_seed for s in (-1, -(2**63), 2**63 - 1, 2**32, 2**40 + 3)}
    assert all(0 <= k < 2**32 for k in keys) and len(keys) == 5
    assert SamplingParams(seed=-1).prng_seed == SamplingParams(seed=np.int64(-1)).prng_seed
    for bad in (2**63, -(2**63) - 1, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=bad)


def test_text_stream_holds_back_what_may_still_become_a_stop_string():
    tok = ByteTokenizer()
    t = TextStream(tok, ["END"], eos=(0,))
    assert [(t.add(x), t.take()) for x in b"abEN"] == [(None, ""), (None, ""), (None, "a"), (None, "b")]
    assert t.add(ord("D")) == "END" and t.take() == "" and t.flush() == ""  # the text ends before the stop string
    t = TextStream(tok, [], eos=(0,))
    e = "é".encode()
    assert (t.add(e[0]), t.take()) == (None, "")  # an incomplete character waits for its next byte
    assert (t.add(e[1]), t.take()) == (None, "é")
    assert (t.add(0), t.take(), t.flush()) == (None, "", "")  # EOS adds no text
    t = TextStream(tok, ["x"])
    for b in "ab".encode() + e[:1]:
        t.add(b)
    assert "".join(t.take() for _ in range(3)) + t.flush() == "ab\ufffd"  # the flush gives what was held
