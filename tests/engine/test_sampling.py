"""The sampler's rules against a NumPy reference written from vLLM's definitions (logit_bias, repetition /
frequency / presence penalties, temperature, min_p, top_k, top_p, raw logprobs), on fixed logits; the draws
follow the filtered distribution (chi-square); and through an engine: every token of requests mixing every
parameter is the reference's choice on the logits the runner saw, and a 200-step run of them after warm-up
compiles nothing."""

import collections

import numpy as np
import pytest
from scipy import stats

from glm53 import DeployConfig, Engine
from glm53.engine.plan import PlanRow
from glm53.engine.request import MAX_LOGIT_BIAS, Request, RequestError, SamplingParams
from glm53.engine.runner import CompileCounter
from glm53.engine.runner.sampling import (_position_logprobs, _process, _sample, penalty_width, penalty_widths, pick,
                                          process_arrays, row_arrays)
from tests.engine.sampling_ref import check_prompt_logprobs, ref_filter, ref_process, softmax
from tests.engine.serving_checks import count_compiles

V = 64


def _rows(params_list, prompts, outputs):
    rows = []
    for i, (p, pr, out) in enumerate(zip(params_list, prompts, outputs)):
        req = Request(f"r{i}", np.asarray(pr, np.int32), p, output_ids=list(out))
        rows.append(PlanRow(req.req_id, 0, np.zeros(1, np.int32), True, p, len(out),
                            penalty_tokens=req.penalty_tokens() if p.penalized else None))
    return rows


PARAMS = [
    SamplingParams(8, greedy=False, temperature=0.7, top_k=5, seed=1),
    SamplingParams(8, greedy=False, temperature=1.3, top_p=0.6, min_p=0.05, seed=2,
                   presence_penalty=0.8, frequency_penalty=-0.5, repetition_penalty=1.7),
    SamplingParams(8, greedy=True, repetition_penalty=0.6, logit_bias=((3, 5.0), (7, -100.0), (63, 2.5))),
    SamplingParams(8, greedy=False, temperature=0.9, top_k=12, top_p=0.8, min_p=0.02, seed=3, frequency_penalty=1.1,
                   logit_bias=((0, 1.0),)),
]


@pytest.fixture(scope="module")
def fixed():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, (len(PARAMS), V)).astype(np.float32)
    prompts = [rng.integers(0, V, int(n)) for n in rng.integers(3, 30, len(PARAMS))]
    outputs = [rng.integers(0, V, int(n)) for n in rng.integers(0, 20, len(PARAMS))]
    return logits, prompts, outputs


def test_logit_bias_and_penalties_equal_the_reference(fixed):
    logits, prompts, outputs = fixed
    rows = _rows(PARAMS, prompts, outputs)
    got = np.asarray(_process(logits, **process_arrays(rows, list(range(len(rows))), len(rows), V)))
    for i, p in enumerate(PARAMS):
        np.testing.assert_allclose(got[i], ref_process(logits[i], p, prompts[i], outputs[i]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, logits)  # each row changed something


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.5, 3, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (2.0, 0, 1.0, 0.1), (0.8, 10, 0.7, 0.05),
    (1.0, 1, 0.3, 0.9), (1.0, V, 1.0, 0.0), (1.5, 0, 0.05, 0.0)])
def test_temperature_min_p_top_k_top_p_equal_the_reference(temperature, top_k, top_p, min_p):
    from glm53.engine.logits import filter_sampled

    rng = np.random.default_rng(11)
    for _ in range(4):
        z = rng.normal(0, 2, V).astype(np.float32)
        got = np.asarray(filter_sampled(z, np.float32(temperature), np.int32(top_k), np.float32(top_p),
                                        np.float32(min_p)))
        want = ref_filter(z, temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5)
        if (temperature, top_k, top_p, min_p) != (1.0, 0, 1.0, 0.0) and top_k != V:
            assert np.isfinite(got).sum() < V  # the case cuts something


def test_greedy_rows_take_the_processed_argmax_and_neutral_greedy_is_plain_argmax(fixed):
    logits, prompts, outputs = fixed
    neutral = [SamplingParams(8)] * len(PARAMS)
    toks, _ = pick(logits, _rows(neutral, prompts, outputs), list(range(len(PARAMS))))
    assert [toks[f"r{i}"][0] for i in range(len(PARAMS))] == np.argmax(logits, axis=1).tolist()
    greedy = [dataclass_replace(p, greedy=True) for p in PARAMS]
    toks, _ = pick(logits, _rows(greedy, prompts, outputs), list(range(len(PARAMS))))
    want = [int(np.argmax(ref_process(logits[i], p, prompts[i], outputs[i]))) for i, p in enumerate(greedy)]
    assert [toks[f"r{i}"][0] for i in range(len(PARAMS))] == want
    assert want != np.argmax(logits, axis=1).tolist()


def dataclass_replace(p, **kw):
    import dataclasses

    return dataclasses.replace(p, **kw)


def test_draws_follow_the_processed_filtered_distribution(fixed):
    """6,000 draws of each sampled row in one batch (one row per counter value: the keys differ) against
    the reference distribution softmax(ref_filter(ref_process(...))): chi-square over its support, nothing
    outside it."""
    logits, prompts, outputs = fixed
    n = 6000
    which = [i for i, p in enumerate(PARAMS) if not p.greedy]
    rows, tiled = [], []
    for i in which:
        rows += [dataclass_replace(r, num_generated=c) for c, r in
                 enumerate(_rows([PARAMS[i]] * n, [prompts[i]] * n, [outputs[i]] * n))]
        tiled.append(np.tile(logits[i], (n, 1)))
    tiled = np.concatenate(tiled)
    idx = list(range(len(rows)))
    processed = _process(tiled, **process_arrays(rows, idx, len(rows), V))
    toks = np.asarray(_sample(tiled, processed, **row_arrays(rows, idx, len(rows)))[0]).reshape(len(which), n)
    for j, i in enumerate(which):
        p = PARAMS[i]
        want = softmax(ref_filter(ref_process(logits[i], p, prompts[i], outputs[i]), p.temperature, p.top_k, p.top_p,
                                  p.min_p))
        counts = np.bincount(toks[j], minlength=V)
        assert counts[want == 0].sum() == 0, f"row {i}: draws outside the filtered support"
        support = want > 0
        assert support.sum() >= 2
        res = stats.chisquare(counts[support], want[support] * n)
        assert res.pvalue > 1e-4, (i, res.pvalue)


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_alternatives(fixed):
    logits, prompts, outputs = fixed
    params = [dataclass_replace(p, logprobs=k) for p, k in zip(PARAMS, (0, 3, 20, None))]
    toks, lps = pick(logits, _rows(params, prompts, outputs), list(range(len(params))))
    assert set(lps) == {"r0", "r1", "r2"}
    for i in range(3):
        ref = logits[i].astype(np.float64) - np.log(np.exp(logits[i].astype(np.float64)).sum())
        tok = toks[f"r{i}"][0]
        (lp,) = lps[f"r{i}"]
        assert lp.logprob == pytest.approx(ref[tok], abs=1e-5)
        assert lp.rank == 1 + int((ref > ref[tok]).sum())
        k = params[i].logprobs
        assert [t for t, _ in lp.top] == np.argsort(-ref, kind="stable")[:k].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:k], atol=1e-5)
    # a processed greedy row's token is the processed argmax, its logprob the raw one's
    want = int(np.argmax(ref_process(logits[2], params[2], prompts[2], outputs[2])))
    assert toks["r2"][0] == want != int(np.argmax(logits[2]))


def test_verify_positions_logprobs_are_each_positions_raw_log_softmax():
    """MTP's verify step: token j's logprobs come from position j's raw logits."""
    rng = np.random.default_rng(3)
    raw = rng.normal(0, 2, (2, 3, V)).astype(np.float32)
    toks = rng.integers(0, V, (2, 3)).astype(np.int32)
    mine, rank, top_ids, top_lp = (np.asarray(x) for x in _position_logprobs(raw, toks))
    ref = raw.astype(np.float64) - np.log(np.exp(raw.astype(np.float64)).sum(-1, keepdims=True))
    for i in range(2):
        for j in range(3):
            assert mine[i, j] == pytest.approx(ref[i, j, toks[i, j]], abs=1e-5)
            assert rank[i, j] == 1 + (ref[i, j] > ref[i, j, toks[i, j]]).sum()
            assert top_ids[i, j].tolist() == np.argsort(-ref[i, j], kind="stable")[:20].tolist()


def test_bad_parameters_name_their_field():
    cases = [(dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=2.5), "presence_penalty"),
             (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
             (dict(logit_bias=((1, 101.0),)), "logit_bias"), (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
             (dict(logit_bias=tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))), "logit_bias"),
             (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs")]
    for kw, field in cases:
        with pytest.raises(RequestError) as e:
            SamplingParams(4, **kw)
        assert e.value.field == field, (kw, e.value.field)
    assert SamplingParams(4, top_k=-1).top_k == 0  # vLLM's -1 = off
    assert penalty_width(0) == 0 and penalty_width(1) == 64 and penalty_width(65) == 128
    assert penalty_widths(128) == [0, 64, 128] and penalty_widths(100) == [0, 64, 128] and penalty_widths(1) == [0, 64]


# ---------------------------------------------------------------------------------- through an engine
SHAPES = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, block_size=8, num_gpu_blocks=28)


def _mixed(rng, step: int) -> SamplingParams:
    """A request's parameters with every rule on at random."""
    kw = dict(greedy=bool(rng.random() < 0.3), temperature=float(rng.uniform(0.5, 1.5)), seed=step,
              top_k=int(rng.choice([0, 1, 5, 40])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
              min_p=float(rng.choice([0.0, 0.05])), presence_penalty=float(rng.choice([0.0, 0.7])),
              frequency_penalty=float(rng.choice([0.0, -0.4, 1.2])), repetition_penalty=float(rng.choice([1.0, 1.5, 0.8])),
              logprobs=rng.choice([None, 0, 5, 20]), prompt_logprobs=rng.choice([None, None, 0, 4]))
    if rng.random() < 0.5:
        ids = rng.choice(512, int(rng.integers(1, MAX_LOGIT_BIAS + 1)), replace=False)
        kw["logit_bias"] = tuple((int(t), float(rng.uniform(-100, 100))) for t in ids)
    for f in ("logprobs", "prompt_logprobs"):
        kw[f] = None if kw[f] is None else int(kw[f])
    return SamplingParams(int(rng.integers(1, 12)), **kw)


@pytest.fixture(scope="module")
def engine(small_model):
    eng = Engine(small_model, DeployConfig(**SHAPES))
    runner = eng.runner
    assert runner.warmup(prompt_logprobs=True) == len(runner.bucket_shapes())
    runner.compiled_shapes.clear()
    return eng


def test_every_token_is_the_references_and_200_steps_compile_nothing(engine):
    """200 steps of arrivals mixing every parameter (after warm-up): nothing compiles, and each greedy token
    is the reference's argmax on the logits the runner sampled from, with the request's prompt and output so
    far; each sampled token lies in the reference's filtered support; each logprob is the raw logits'."""
    eng = engine
    seen = {}
    orig = eng.runner._pick

    def record(logits_RV, rows, idx):
        host = np.asarray(logits_RV)
        for i, row in zip(idx, rows):
            seen[row.req_id, row.num_generated] = host[i].copy()
        return orig(logits_RV, rows, idx)

    eng.runner._pick = record
    compiles = count_compiles(eng)
    rng = np.random.default_rng(0)
    try:
        with CompileCounter() as whole:
            for step in range(200):
                if len(eng.scheduler.waiting) < 2 and rng.random() < 0.5:
                    eng.add_request(rng.integers(0, 512, int(rng.integers(1, 90))), _mixed(rng, step))
                eng.step()
    finally:
        eng.runner._pick = orig
        eng.runner.execute = type(eng.runner).execute.__get__(eng.runner)
    assert sum(compiles) == whole.count == 0, f"{whole.count} compilations during the run"
    done = list(eng.finished.values())
    assert len(done) >= 10
    kinds = collections.Counter()
    for r in done:
        p = r.params
        for n, tok in enumerate(r.output_ids):
            z = seen[r.req_id, n]
            if n < p.min_tokens:
                continue
            processed = ref_process(z, p, r.prompt_ids, r.output_ids[:n])
            if p.greedy:
                assert tok == int(np.argmax(processed)), (r.req_id, n)
                kinds["greedy"] += 1
            else:
                filt = ref_filter(processed, p.temperature, p.top_k, p.top_p, p.min_p)
                assert np.isfinite(filt[tok]), (r.req_id, n, p)
                kinds["sampled"] += 1
            if p.logprobs is not None:
                lp = r.output_logprobs[n]
                ref = z.astype(np.float64) - np.log(np.exp(z.astype(np.float64) - z.max()).sum()) - z.max()
                assert lp.logprob == pytest.approx(ref[tok], abs=1e-4) and len(lp.top) == p.logprobs
                kinds["logprobs"] += 1
        assert len(r.output_logprobs) == (len(r.output_ids) if p.logprobs is not None else 0)
        if p.prompt_logprobs is not None:  # their values: test_prompt_logprobs_equal_the_full_sequence_reference
            assert len(r.prompt_logprobs) == r.prompt_ids.size - 1
            assert all(len(e.top) == p.prompt_logprobs for e in r.prompt_logprobs)
            kinds["prompt_logprobs"] += 1
        else:
            assert r.prompt_logprobs == []
    assert min(kinds.values()) >= 10 and len(kinds) == 4, kinds


def test_n_siblings_share_one_prefill_and_draw_their_own_tokens(engine):
    """Siblings added with prefill_after wait for the first one's prompt, then find its full pages in the
    prefix cache: the prompt's tokens are computed once (plus each sibling's last partial page)."""
    eng = engine
    while eng.has_unfinished():  # what an earlier test left running
        eng.step()
    prompt = np.arange(40, 80, dtype=np.int32)  # 40 tokens: 5 full pages of 8
    computed = []
    execute = eng.runner.execute

    def counting(plan):
        computed.append(sum(r.num_tokens for r in plan.rows))
        return execute(plan)

    eng.runner.execute = counting
    try:
        lead = eng.add_request(prompt, SamplingParams(6, greedy=False, seed=100))
        sibs = [eng.add_request(prompt, SamplingParams(6, greedy=False, seed=100 + j), prefill_after=lead)
                for j in (1, 2)]
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.runner.execute = execute
    outs = [eng.finished[r] for r in (lead, *sibs)]
    assert [o.num_cached_tokens for o in outs[1:]] == [32, 32]  # all but the last (partial) page... of 40
    assert sum(computed) == 40 + 2 * 8 + 3 * 5  # one prefill, two last pages, 5 decode steps each
    assert len({tuple(o.output_ids) for o in outs}) == 3  # their own seed streams


def test_mtp_refuses_penalties_naming_the_field(small_model):
    """Under MTP the accept rule applies temperature, min_p, top_k, top_p and logit_bias (test_mtp.py's
    chi-square test and its greedy run with logprobs); a penalty is refused at add_request, the field named."""
    from glm53.engine.synthetic import SyntheticRunner

    cfg = small_model.cfg
    d = DeployConfig(**SHAPES, num_speculative_tokens=2)
    eng = Engine(type("M", (), {"cfg": cfg, "dtype": "float32"})(), d,
                 runner=SyntheticRunner(lambda row: 1, page_bytes=d.kv_sizes(cfg).page_bytes, spec=d.speculative))
    for kw, field in ((dict(presence_penalty=0.5), "presence_penalty"), (dict(frequency_penalty=-1.0), "frequency_penalty"),
                      (dict(repetition_penalty=1.2), "repetition_penalty")):
        with pytest.raises(RequestError, match="speculative decoding") as e:
            eng.add_request([1, 2, 3], SamplingParams(4, greedy=False, **kw))
        assert e.value.field == field
    with pytest.raises(RequestError, match="SyntheticRunner") as e:  # no logits, no logprobs: refused, not ignored
        eng.add_request([1, 2, 3], SamplingParams(4, logprobs=2))
    assert e.value.field == "logprobs"
    with pytest.raises(RequestError, match="SyntheticRunner") as e:
        eng.add_request([1, 2, 3], SamplingParams(4, prompt_logprobs=0))
    assert e.value.field == "prompt_logprobs"
    rid = eng.add_request([1, 2, 3], SamplingParams(4, greedy=False, top_k=5, top_p=0.9, min_p=0.1,
                                                    logit_bias=((3, 1.0),)))
    while eng.has_unfinished():
        eng.step()
    assert len(eng.finished[rid].output_ids) == 4
    with pytest.raises(RequestError) as e:  # a bias token outside the vocabulary, without MTP too
        Engine(type("M", (), {"cfg": cfg, "dtype": "float32"})(), DeployConfig(**SHAPES),
               runner=SyntheticRunner(lambda row: 1, page_bytes=d.kv_sizes(cfg).page_bytes)).add_request(
            [1], SamplingParams(2, logit_bias=((cfg.vocab_size, 1.0),)))
    assert e.value.field == "logit_bias"


def test_prompt_logprobs_equal_the_full_sequence_reference(engine, small_model):
    """Prompt logprobs computed chunk by chunk (16-token chunks; prompts of 40 and 23 tokens batched with a
    request without them) equal the log-softmax of `glm53.score`'s full-sequence logits: each prompt token's
    logprob and rank, and its k alternatives; a second identical request computes them again rather than
    taking the first's pages from the prefix cache; nothing compiles."""
    import glm53

    eng = engine
    while eng.has_unfinished():
        eng.step()
    # in a long test worker tests/conftest.py's bound_memory_maps may have dropped JAX's caches since the
    # fixture's warm-up: warm again (a reload from the on-disk cache), so the count below is this test's
    eng.runner.warmup(prompt_logprobs=True)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 512, 40).astype(np.int32), rng.integers(0, 512, 23).astype(np.int32)]
    compiles = count_compiles(eng)
    try:
        ids = [eng.add_request(prompts[0], SamplingParams(3, prompt_logprobs=5)),
               eng.add_request(prompts[1], SamplingParams(2, prompt_logprobs=0, logprobs=2)),
               eng.add_request(prompts[0][:20], SamplingParams(2))]
        while eng.has_unfinished():
            eng.step()
        again = eng.add_request(prompts[0], SamplingParams(1, prompt_logprobs=5))
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.runner.execute = type(eng.runner).execute.__get__(eng.runner)
    assert sum(compiles) == 0, compiles
    assert eng.finished[ids[2]].prompt_logprobs == []
    for rid, prompt, k in ((ids[0], prompts[0], 5), (ids[1], prompts[1], 0), (again, prompts[0], 5)):
        check_prompt_logprobs(eng.finished[rid].prompt_logprobs, np.asarray(glm53.score(small_model, prompt)), prompt, k)
    assert eng.finished[again].num_cached_tokens == 0


def test_prompt_logprobs_survive_preemption(engine, small_model):
    """Two 70-token prompts with 20 tokens each overfill the 28-block pool: one is preempted and computed
    again (from its own cached pages or from scratch); its prompt logprobs are each token's once, still the
    reference's."""
    import glm53

    eng = engine
    while eng.has_unfinished():
        eng.step()
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 512, 70).astype(np.int32) for _ in range(2)]
    ids = [eng.add_request(p, SamplingParams(20, prompt_logprobs=1)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    assert sum(eng.finished[rid].num_preemptions for rid in ids) >= 1
    for rid, prompt in zip(ids, prompts):
        check_prompt_logprobs(eng.finished[rid].prompt_logprobs, np.asarray(glm53.score(small_model, prompt)), prompt, 1)


def test_prompt_logprobs_out_of_range_name_the_field():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(RequestError) as e:
            SamplingParams(4, prompt_logprobs=bad)
        assert e.value.field == "prompt_logprobs"
