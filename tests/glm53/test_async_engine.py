"""What keeps the server's engine serving, on the real scheduler, pools and policies with runners that
need no model (glm53.engine.synthetic: SyntheticRunner, and ContentRunner, whose tokens hash the KV each
position is served, so a wrong page read anywhere changes them), so nothing compiles:

- a step whose execution raises (before or after the runner executed it) fails that step's requests
  (finish_reason "error"), frees their blocks, keeps nothing the failed step wrote findable, and the
  engine serves on with every later token right; under a policy whose plan carried KV transfers, every
  request of the replica fails and its prefix caches forget their hashes; tier loads the failed step
  never submitted, or whose results it lost, come back as failed (their host pages freed, the engine
  goes idle);
- a step whose schedule raises (a request's salt it cannot hash, a policy failing half way through an
  admission) fails the replica's requests and the engine serves on, whole;
- a request's stop check that raises ends that request alone with "error";
- the AsyncEngine thread reports such failures to the failed requests' clients and serves the next
  request; MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row make it unhealthy until a step succeeds;
- stop strings (glm53.tokenizer.TextStream as Request.stop_check) finish a request "stop" on the token
  that completes them, under MTP too (no token after it), and count as stops in vLLM's metrics; the
  text of a stop token that ends a request is dropped;
- seeds: any int64 is a seed, mapped onto the sampler's uint32 key."""

import asyncio
import collections

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from glm53.engine.engine import StepError
from glm53.engine.prometheus import ServingMetrics
from glm53.engine.request import RequestError
from glm53.engine.synthetic import ContentRunner, SyntheticRunner
from glm53.tokenizer import ByteTokenizer, TextStream
from kvcache.layout import page_bytes
from kvcache.transfer import TierLoad
from tests.engine.test_abort import _all_returned, _Model

CFG = glm53.get_preset("tiny")


class Failing:
    """A runner that raises on the plans `when` picks, before handing them to `runner` or (after=True)
    once `runner` executed them (its result, tier loads it reported included, is lost)."""

    def __init__(self, runner, when, after: bool = False):
        self.runner, self.when, self.after, self.failed = runner, when, after, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        if not self.when(plan):
            return self.runner.execute(plan)
        self.failed.append(plan)
        if self.after:
            self.runner.execute(plan)
        raise RuntimeError("injected step failure")


def _content_engine(policy: str) -> Engine:
    """test_abort's deployments (policy "offload_tier": the offload policy with a simulated filesystem
    tier behind its host pool) on a ContentRunner."""
    pages = page_bytes(CFG, "float32", 4, 4)
    fields = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=3, block_size=4, num_gpu_blocks=40)
    if policy in ("swap", "offload"):
        fields.update(kv_policy=policy, cpu_offload_bytes=64 * sum(pages.values()))
    if policy == "offload_tier":
        fields["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
            "cpu_bytes_to_use": 64 * sum(pages.values()), "secondary_tiers": [{"type": "fs", "root_dir": "unused"}]}}
    if policy == "hisparse":
        fields.update(kv_policy="hisparse", hisparse_host_pool_bytes=64 * pages["mla"],
                      cpu_offload_bytes=16 * pages["indexer"], hisparse_device_buffer_size=16, num_gpu_blocks=52)
    d = DeployConfig(**fields).resolved(CFG, "float32")
    return Engine(_Model(), d, runner=ContentRunner(CFG, d, d.kv_sizes(CFG)))


def _check_tokens(eng: Engine) -> None:
    """Every finished request's tokens are what its history gives with all its KV served right."""
    model = eng.replicas[0].runner.model
    for rid, req in eng.finished.items():
        assert tuple(req.output_ids) == model.expected(req.prompt_ids, req.output_ids, req.params), rid


POLICIES = ["preempt", "swap", "offload", "hisparse", "offload_tier"]


@pytest.mark.parametrize("after", [False, True], ids=["raise_before", "raise_after"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(policy, after):
    eng = _content_engine(policy)
    rep = eng.replicas[0]
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 512, 33)
    if policy == "offload_tier":
        # the prompt's full pages go through the host tier to the fs tier; the device and host forget them,
        # so the next admission of the prompt loads them from the tier: fail the plan that carries the loads
        eng.generate([prompt], max_new_tokens=2)
        eng.reset_prefix_cache()
        eng.finished.clear()
    a = eng.add_request(prompt, SamplingParams(20))
    b = eng.add_request(rng.integers(0, 512, 20), SamplingParams(5))
    if policy == "offload_tier":
        def when(plan):
            return any(isinstance(op, TierLoad) for op in plan.transfers)
    else:  # the step that computes a's second 16-token chunk (its first chunk's 4 blocks are cached by then)
        def when(plan):
            return any(r.req_id == a and r.start == 16 for r in plan.rows)
    rep.runner = Failing(rep.runner, when, after)
    with pytest.raises(StepError) as info:
        for _ in range(10):
            eng.step()
    plan = rep.runner.failed[0]
    everyone = {a, b}
    want = everyone if plan.transfers else {r.req_id for r in plan.rows}
    assert a in want and set(info.value.failed) == want and str(info.value.error) == "injected step failure"
    for rid in want:
        assert eng.finished[rid].finish_reason == "error" and rid not in eng.requests
        assert eng.finished[rid].error == "RuntimeError: injected step failure"
    rep.runner = rep.runner.runner
    c = eng.add_request(rng.integers(0, 512, 12), SamplingParams(6))
    for _ in range(200):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished()  # nothing keeps the engine stepping (no tier load left unreported)
    assert len(eng.finished[c].output_ids) == 6 and eng.finished[c].finish_reason == "length"
    for rid in everyone - want:  # what the failure did not touch ran to its end
        assert eng.finished[rid].finish_reason == "length"
    _all_returned(eng)  # the failed requests' blocks, leases and host pages (loads' included) are all back
    # a's first chunk was computed by a step that completed; what the failed step wrote was never cached.
    # A plan with transfers leaves nothing findable at all (its copies may have stopped half way).
    again = eng.add_request(prompt, SamplingParams(8))
    while eng.has_unfinished():
        eng.step()
    if policy != "offload_tier":  # there the tier, which keeps its whole chunks, serves them again
        assert eng.finished[again].num_cached_tokens == (0 if plan.transfers else 16)
    else:
        assert eng.finished[again].num_cached_tokens == 32
    _check_tokens(eng)  # no later request was served a page the failed step left half written
    _all_returned(eng)


@pytest.mark.parametrize("where", ["salt", "prepare"])
@pytest.mark.parametrize("policy", POLICIES[:4])
def test_a_failed_schedule_fails_the_replicas_requests_and_the_engine_serves_on(policy, where):
    """`schedule` raising half way through: at a waiting request's admission (a salt its hashing cannot
    encode, as an unchecked lone surrogate did) or in the policy's `prepare` of a request just admitted
    (its blocks allocated, off the waiting queue, not yet running). Every request of the replica ends
    "error"; the engine is whole again and serves the next request right."""
    eng = _content_engine(policy)
    rng = np.random.default_rng(5)
    a = eng.add_request(rng.integers(0, 512, 30), SamplingParams(20))
    for _ in range(3):
        eng.step()
    assert eng.requests[a].output_ids  # a is decoding
    bad = eng.add_request(rng.integers(0, 512, 9), SamplingParams(4), salt="user")
    if where == "salt":  # what Engine.add_request now refuses (RequestError naming the salt)
        eng.requests[bad].salt = "\ud800"
    else:
        pol = eng.scheduler.policy
        prepare = pol.prepare

        def failing_prepare(kv, req, n):
            if req.req_id == bad:
                raise RuntimeError("injected prepare failure")
            return prepare(kv, req, n)

        pol.prepare = failing_prepare
    with pytest.raises(StepError) as info:
        eng.step()
    assert set(info.value.failed) == {a, bad} and not eng.requests
    assert all(eng.finished[r].finish_reason == "error" for r in (a, bad))
    if where == "prepare":
        del pol.prepare
    c = eng.add_request(rng.integers(0, 512, 30), SamplingParams(10))
    while eng.has_unfinished():
        eng.step()
    assert eng.finished[c].finish_reason == "length" and len(eng.finished[c].output_ids) == 10
    _check_tokens(eng)
    _all_returned(eng)


def test_a_salt_utf8_cannot_encode_is_refused_naming_it():
    eng = _content_engine("preempt")
    with pytest.raises(RequestError, match="salt") as info:
        eng.add_request([1, 2, 3], SamplingParams(2), salt="a\udc80")
    assert info.value.field == "salt" and not eng.requests


def test_a_stop_check_that_raises_ends_its_request_alone():
    """Its step succeeds: the request whose stop check raised on its 3rd token ends "error" with that
    token last; the one beside it in the same steps runs to its end."""
    d = DeployConfig(max_model_len=64, max_num_seqs=4, block_size=4, num_gpu_blocks=40)
    eng = Engine(_Model(), d, runner=SyntheticRunner(lambda row: 7))
    seen = []

    def check(token):
        seen.append(token)
        if len(seen) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return None

    bad = eng.add_request([1, 2, 3], SamplingParams(8), stop_check=check)
    good = eng.add_request([4, 5, 6], SamplingParams(8))
    while eng.has_unfinished():
        eng.step()
    assert eng.finished[bad].finish_reason == "error" and eng.finished[bad].output_ids == [7, 7, 7]
    assert "stop check failed" in eng.finished[bad].error and "UnicodeDecodeError" in eng.finished[bad].error
    assert eng.finished[good].finish_reason == "length" and len(eng.finished[good].output_ids) == 8
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks


def _run(coro):
    return asyncio.run(coro)


async def _drain(handle):
    items = [x async for x in handle]
    return [t for t, _, _ in items], "".join(s for _, s, _ in items) + handle.ended.text, handle.ended


def test_the_engine_thread_reports_failed_steps_and_serves_on_unhealthy_only_while_steps_keep_failing():
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
        assert ae.healthy and ae.consecutive_failures == 0 and ae.failed_steps == 1
        runner.when = lambda plan: True  # now every step fails: the engine looks broken, not one batch
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert ae.healthy, i
            tokens, _, ended = await _drain(await ae.add([1, 2, 3], SamplingParams(4)))
            assert tokens == [] and ended.finish_reason == "error", i
        assert not ae.healthy and ae.error is None and "steps failed" in ae.unhealthy_reason
        # unhealthy, yet serving: once steps succeed again, so does the request, and health comes back
        runner.when = lambda plan: False
        tokens, _, ended = await _drain(await ae.add([1, 2, 3], SamplingParams(4)))
        assert tokens == [7] * 4 and ended.finish_reason == "length"
        assert ae.healthy and ae.unhealthy_reason is None and ae.failed_steps == 1 + MAX_CONSECUTIVE_STEP_FAILURES

    try:
        _run(scenario())
    finally:
        ae.shutdown()
    assert "vllm:request_success_total{engine=\"0\",finished_reason=\"error\",model_name=\"m\"} 4.0" in metrics.text()
    assert not eng.requests and eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks
    assert not ae.healthy and ae.unhealthy_reason == "the engine is shutting down"


class _StopsMidAppend(collections.deque):
    """The engine's command queue, arranged so the engine thread stops while a client is between its
    check that the engine runs and its append: that append queues a stop first, wakes the thread and
    gives it up to 0.5 s to finish before its own command goes in."""

    ae: AsyncEngine

    def append(self, cmd):
        if cmd[0] == "add":
            super().append(("stop",))
            self.ae._wake.set()
            self.ae._thread.join(0.5)
        super().append(cmd)


def test_a_command_queued_while_the_engine_stops_fails_rather_than_hangs():
    d = DeployConfig(max_model_len=64, max_num_seqs=4, block_size=4, num_gpu_blocks=40)
    ae = AsyncEngine(Engine(_Model(), d, runner=SyntheticRunner(lambda row: 7)))
    ae._cmds = _StopsMidAppend()
    ae._cmds.ae = ae
    ae.start()

    async def scenario():
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(ae.add([1, 2], SamplingParams(1)), 10)  # TimeoutError: it hung

    try:
        _run(scenario())
    finally:
        ae.shutdown()


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
    t = TextStream(tok, ["END"], stop_token_ids=(0,))
    assert [(t.add(x), t.take()) for x in b"abEN"] == [(None, ""), (None, ""), (None, "a"), (None, "b")]
    assert t.add(ord("D")) == "END" and t.take() == "" and t.flush() == ""  # the text ends before the stop string
    t = TextStream(tok, [], stop_token_ids=(0,))
    e = "é".encode()
    assert (t.add(e[0]), t.take()) == (None, "")  # an incomplete character waits for its next byte
    assert (t.add(e[1]), t.take()) == (None, "é")
    assert (t.add(0), t.take(), t.flush()) == (None, "", "")  # EOS adds no text
    # any stop token that ends the sequence adds no text (vLLM drops the terminating token's text); one
    # that comes before min_tokens does not end it and is text like any other
    t = TextStream(tok, [], stop_token_ids=(ord("!"),), min_tokens=2)
    assert [(t.add(x), t.take()) for x in b"!a!"] == [(None, "!"), (None, "a"), (None, "")] and t.flush() == ""
    t = TextStream(tok, ["x"])
    for b in "ab".encode() + e[:1]:
        t.add(b)
    assert "".join(t.take() for _ in range(3)) + t.flush() == "ab\ufffd"  # the flush gives what was held


def test_shutdown_bounds_the_engines_flush():
    """After a drain the server bounds the engine's own shutdown (the tiers' pending stores: a hung mount
    never returns): `shutdown(flush_s=)` returns False once the bound passes, without waiting for it."""
    import threading
    import time

    d = DeployConfig(max_model_len=64, block_size=8, num_gpu_blocks=16)
    eng = Engine(_Model(), d, runner=SyntheticRunner(lambda row: 7))
    hung = threading.Event()
    eng.shutdown = lambda: hung.wait(60)  # a tier flush that does not return
    ae = AsyncEngine(eng).start()
    t0 = time.monotonic()
    assert ae.shutdown(timeout_s=5.0, flush_s=0.3) is False
    assert time.monotonic() - t0 < 3.0
    hung.set()
    ok = AsyncEngine(Engine(_Model(), d, runner=SyntheticRunner(lambda row: 7))).start()
    assert ok.shutdown(timeout_s=5.0, flush_s=5.0) is True  # a flush within the bound: done
