"""MTP speculative decoding (issue 21 item 3): vLLM's speculative_config, the accept rule, the verify step's
exactness, and the engine against non-speculative decoding.

The tiny model's MTP layer has random weights, so its own drafts are almost never right; the tests that
need drafts to stand replace them with an oracle's (the non-speculative continuation, some corrupted)
after the runner has run the MTP layer, so the verify step, the rollback of rejected drafts and the cut
at stop tokens and max_new_tokens run on the real model with every acceptance count."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.runner import _last_logits, _position_logits
from glm53.engine.spec_decode import SpecDecodeStats, length_to_rates, rejection_sample
from tests.engine.sampling_ref import check_prompt_logprobs, ref_filter
from glm53.model import compiled
from kvcache.contiguous import ContiguousKVCache
from kvcache.paged import PagedKVCache
from tests.engine.serving_checks import check_buckets_used, count_compiles, random_arrivals, warm_up

BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)  # test_engine.py's
K = 3
# every engine test below runs this deployment, one set of compiled programs (an MTP engine's cache holds
# the MTP layer, so none is shared with engines without MTP): two rows of 1 + K or 16 tokens, a pool of 24
# blocks that holds one request of 70 + 16 tokens (+ its draft lookahead) and forces preemptions
MTP = dict(BASE, max_num_batched_tokens=16, max_num_seqs=2, num_gpu_blocks=24, num_speculative_tokens=K)
SYNTHETIC = {"method": "mtp", "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
             "synthetic_acceptance_length": 2.99}


# ------------------------------------------------------------------------------------------------ config
def test_speculative_config_is_vllms_shape_and_bad_input_is_named():
    d = DeployConfig(num_speculative_tokens=3)  # the shorthand
    assert d.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    d = DeployConfig(speculative_config=SYNTHETIC)
    assert d.num_speculative_tokens == 3 and d.speculative.acceptance_rates == (1.0, 0.99, 0.0)
    assert DeployConfig(speculative_config=SYNTHETIC, num_speculative_tokens=3).num_speculative_tokens == 3
    assert dataclasses.replace(d, max_model_len=64).speculative == d.speculative
    # vLLM's length -> unconditional rates: 1 + sum(rates) is the length
    assert length_to_rates(2.6, 3) == (1.0, 0.6, 0.0) and length_to_rates(1.0, 3) == (0.0, 0.0, 0.0)
    assert length_to_rates(4.0, 3) == (1.0, 1.0, 1.0) and length_to_rates(3.5, 4) == (1.0, 1.0, 0.5, 0.0)
    bad = [({**SYNTHETIC, "num_speculative_tokens": 2}, "disagree", dict(num_speculative_tokens=3)),
           ({"method": "eagle", "num_speculative_tokens": 3}, "method", {}),
           ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens", {}),
           ({"method": "mtp", "num_speculative_tokens": 3, "typo": 1}, "unknown keys", {}),
           ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}, "exactly one", {}),
           ({**SYNTHETIC, "synthetic_acceptance_rates": [1, 1, 1]}, "exactly one", {}),
           ({"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0}, "only valid", {}),
           ({**SYNTHETIC, "synthetic_acceptance_length": 4.5}, r"\[1, num_speculative_tokens \+ 1", {}),
           ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
             "synthetic_acceptance_rates": [0.5, 0.9]}, "non-increasing", {}),
           ({"method": "mtp", "num_speculative_tokens": 2, "verify": "fast"}, "verify", {})]
    for spec, match, extra in bad:
        with pytest.raises(ValueError, match=match):
            DeployConfig(speculative_config=spec, **extra)
    with pytest.raises(NotImplementedError, match="draft_sample_method"):
        DeployConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 1,
                                         "draft_sample_method": "probabilistic"})
    # HiSparse with MTP: a hot buffer of (k + 2) x top-k rows by default, which holds the union of a
    # batched verify step's 1 + k selections (a smaller one is refused by the model runner: test_deploy)
    hs = DeployConfig(**BASE, num_speculative_tokens=3, kv_policy="hisparse", hisparse_host_pool_bytes=1 << 24)
    assert hs.kv_sizes(glm53.get_preset("tiny")).hot_rows == 5 * glm53.get_preset("tiny").index_topk


def test_the_pool_counts_the_mtp_layers_kv():
    """With MTP the MTP layer's rows and indexer keys are cached: GLM-5.3's 788 bytes per token (fp8)."""
    cfg = glm53.get_preset("glm-5.3")
    plain = DeployConfig(block_size=64, kv_cache_dtype="fp8_ds_mla", max_model_len=4096, num_gpu_blocks=8)
    pages = plain.kv_sizes(cfg).page_bytes
    mtp = dataclasses.replace(plain, num_speculative_tokens=3).kv_sizes(cfg).page_bytes
    assert mtp["mla"] - pages["mla"] == 656 * 64 and mtp["indexer"] - pages["indexer"] == 132 * 64
    assert (mtp["mla"] + mtp["indexer"]) / 64 == 54_728


def test_a_checkpoint_without_mtp_weights_fails_at_engine_construction(hf_fixtures, tmp_path, caplog):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "no_mtp"
    d.mkdir()
    for f in ("config.json", "generation_config.json"):
        (d / f).write_text((hf_fixtures / "base" / f).read_text())
    tensors = load_file(hf_fixtures / "base" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.5.")}, d / "model.safetensors")
    model = glm53.from_pretrained(d)  # loads without MTP (a warning)
    assert model.cfg.num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match="MTP layer.*num_nextn_predict_layers=0"):
        Engine(model, DeployConfig(**MTP))
    Engine(model, DeployConfig(**BASE))  # without MTP it serves


# ------------------------------------------------------------------------------------------- accept rule
def _run_rule(logits_JV, drafts, n, *, greedy=False, temp=1.0, top_p=1.0, top_k=0, min_p=0.0, rates=None, seed=0):
    """The accept rule on n rows that all see the same target logits and drafts (different PRNG keys)."""
    k = len(drafts)
    logits = jnp.broadcast_to(jnp.asarray(logits_JV, jnp.float32), (n,) + np.shape(logits_JV))
    rates = np.full(k, np.nan, np.float32) if rates is None else np.asarray(rates, np.float32)
    toks, acc = rejection_sample(logits, np.tile(np.asarray(drafts, np.int32), (n, 1)), np.full(n, k, np.int32),
                                 np.full(n, greedy), np.full(n, temp, np.float32), np.full(n, top_k, np.int32),
                                 np.full(n, top_p, np.float32), np.full(n, min_p, np.float32),
                                 np.full(n, seed, np.uint32), np.arange(n, dtype=np.int32), rates)
    return np.asarray(toks), np.asarray(acc)


def _target(logits_V, temp, top_p, top_k=0, min_p=0.0):
    """The distribution a sampled row draws from (numpy): tests/engine/test_sampling.py's reference of
    temperature, min-p, top-k and top-p (vLLM's definitions), normalised."""
    z = ref_filter(logits_V, temp, top_k, top_p, min_p)
    p = np.exp(z - z.max())
    return p / p.sum()


def test_rejection_sampling_keeps_the_target_distribution():
    """Sampled rows: every output position is distributed as the target's distribution there (given the
    tokens before it), whatever the drafts: chi-square tests over 40,000 draws per case, a likely and an
    unlikely draft, with temperature and top-p, and a target processed by min-p, top-k and top-p at once."""
    rng = np.random.default_rng(1)
    v, n = 8, 40_000
    logits = rng.normal(0, 1.5, (3, v)).astype(np.float32)
    for temp, top_p, top_k, min_p in ((1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (0.8, 0.95, 5, 0.1)):
        p = [_target(lg, temp, top_p, top_k, min_p) for lg in logits]
        if top_k:  # the processed case cuts each position's support
            assert all((q > 0).sum() <= top_k for q in p)
        for drafts in ([int(np.argmax(p[0])), int(np.argmax(p[1]))], [int(np.argmin(logits[0])), 3]):
            toks, acc = _run_rule(logits, drafts, n, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
            assert set(np.unique(acc)) <= {0, 1, 2}
            # position 0: always present, ~ p0
            _chi2(toks[:, 0], p[0], f"position 0, drafts {drafts}, T={temp}, top_p={top_p}, top_k={top_k}, min_p={min_p}")
            # position 1 exists when draft 0 stood (output[0] == draft 0): ~ p1
            stood = acc >= 1
            assert np.all(toks[stood, 0] == drafts[0]) and np.all(toks[~stood, 0] != drafts[0])
            if stood.sum() > 500:
                _chi2(toks[stood, 1], p[1], f"position 1, drafts {drafts}")
            both = acc == 2  # position 2: the bonus after two drafts, ~ p2
            if both.sum() > 500:
                _chi2(toks[both, 2], p[2], f"position 2, drafts {drafts}")
            # the acceptance probability of draft 0 is p0(draft 0) (a one-hot proposal)
            assert abs(stood.mean() - p[0][drafts[0]]) < 4 * np.sqrt(p[0][drafts[0]] * (1 - p[0][drafts[0]]) / n) + 1e-9


def _chi2(samples, p, what):
    support = p > 0
    assert np.all(support[samples]), f"{what}: a token outside the target's support"
    counts = np.bincount(samples, minlength=p.size)[support]
    res = stats.chisquare(counts, p[support] * len(samples))
    assert res.pvalue > 1e-4, f"{what}: chi-square p = {res.pvalue:.2e}, counts {counts}, expected {p[support] * len(samples)}"


def test_greedy_and_synthetic_rules():
    logits = np.zeros((4, 16), np.float32)
    best = [5, 9, 2, 7]
    for j, b in enumerate(best):
        logits[j, b] = 3.0
        logits[j, (b + 1) % 16] = 2.0
    # greedy: drafts stand while they are the argmax; the next token is the argmax after them
    for drafts, want_acc in (([5, 9, 2], 3), ([5, 9, 3], 2), ([6, 9, 2], 0)):
        toks, acc = _run_rule(logits, drafts, 2, greedy=True)
        assert list(acc) == [want_acc] * 2
        assert list(toks[0, : want_acc + 1]) == drafts[:want_acc] + [best[want_acc]]
    # synthetic: acceptance follows the rates whatever the tokens (wrong drafts stand); 2.99 with 3 drafts
    # is [1.0, 0.99, 0.0]: two drafts stand 99% of the time, one 1%, three never
    toks, acc = _run_rule(logits, [0, 0, 0], 20_000, greedy=True, rates=length_to_rates(2.99, 3))
    counts = np.bincount(acc, minlength=4)
    assert counts[0] == counts[3] == 0 and abs(counts[1] / 20_000 - 0.01) < 0.003
    assert abs(1 + acc.mean() - 2.99) < 0.005
    assert np.all(toks[acc == 2][:, :2] == 0) and np.all(toks[acc == 2][:, 2] == best[2])  # then the argmax


def test_spec_stats_follow_vllms_definitions():
    st = SpecDecodeStats()
    for nd, acc in ((3, 3), (3, 0), (2, 1), (0, 0)):
        st.observe(nd, acc)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 8, 4)
    assert st.accepted_per_pos == [2, 1, 1] and st.acceptance_length_mean == pytest.approx(1 + 4 / 3)


# ----------------------------------------------------------------------------------- verify exactness
def test_verify_step_logits_equal_one_token_decode_steps(tiny_model):
    """The sequential verify step (GLM53.verify + the runner's `_position_logits`) gives each of its 1 + k
    positions bitwise the float32 logits of one-token decode steps (a forward of width 1 and the
    runner's `_last_logits`) over the same batch of rows; the batched form (one forward of 1 + k tokens)
    equals them only up to rounding."""
    c = compiled(tiny_model)
    cfg = tiny_model.cfg
    rng = np.random.default_rng(3)
    rows, prompt, new = 2, (37, 21), 4
    seqs = [rng.integers(0, 512, n + new).astype(np.int32) for n in prompt]
    table = np.arange(2 * 8, dtype=np.int32).reshape(rows, 8)

    def prefilled():  # a pool like the engine tests' (24 blocks, both groups' tables): their programs
        cache = PagedKVCache.create(cfg, 24, 8, table, kv_cache_dtype="float32", include_mtp=True,
                                    index_block_table=table)
        tok = np.zeros((rows, 64), np.int32)
        pos = np.full((rows, 64), -1, np.int32)
        for b, n in enumerate(prompt):
            tok[b, :n], pos[b, :n] = seqs[b][:n], np.arange(n)
        return c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=64)[1]

    cache = prefilled()
    decode = []
    for j in range(new):
        tok = np.asarray([[s[n + j]] for s, n in zip(seqs, prompt)], np.int32)
        pos = np.asarray([[n + j] for n in prompt], np.int32)
        h, cache, _ = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=64, form="auto", impl="auto")
        decode.append(np.asarray(_last_logits(c.logits, c.state, h, np.zeros(rows, np.int32))))
    decode = np.stack(decode, 1)  # [rows, new, V]
    tok = np.stack([s[n:n + new] for s, n in zip(seqs, prompt)])
    pos = np.stack([np.arange(n, n + new) for n in prompt]).astype(np.int32)
    h, _ = c.verify(c.state, jnp.asarray(tok), jnp.asarray(pos), prefilled(), window=64, form="auto", impl="auto")
    np.testing.assert_array_equal(np.asarray(_position_logits(c.logits, c.state, h)), decode)
    h, _, _ = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), prefilled(), window=64)
    np.testing.assert_allclose(np.asarray(_position_logits(c.logits, c.state, h)), decode, atol=1e-4)


# ------------------------------------------------------------------------------------------------ engine
# The engine tests below run the 2-layer model (tests/engine/conftest.py): MTP's subject is the verify
# step, the drafts and the cache's rollback, whatever the target's depth.
@pytest.fixture(scope="module")
def continuation(small_model):
    """Four prompts (37, 5, 70 and 20 tokens: tests/conftest.py's `reference` prompts) and the 2-layer
    model's 16 greedy tokens for each, one prompt at a time with no engine."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]
    return prompts, [glm53.generate(small_model, p, 16).token_ids.tolist() for p in prompts]


POISON = 1e4  # finite: a masked-out row times a zero weight stays zero


def poison_unstood(runner, plan, res):
    """Overwrite, in every layer (the MTP layer's too) and both cache groups, the KV of each sampling row's
    positions that do not stand after this step (rejected drafts, and the K - 1 lookahead positions the
    MTP draft passes wrote) with a large value: any later read of it before it is rewritten changes the
    tokens (a target layer's read) or the drafts (the MTP layer's)."""
    cache = runner.cache
    page = {"mla": cache.block_size, "indexer": cache.index_block_size or cache.block_size}
    slots = {"mla": [], "indexer": []}
    for i, row in enumerate(plan.rows):
        toks = res.tokens.get(row.req_id, ())
        if not toks:
            continue
        # the row's positions before its drafts, and the drafts that stood (all but the last token)
        stand = row.start + row.num_tokens - row.num_draft_tokens + len(toks) - 1
        for g, b in page.items():
            table = plan.block_tables[g][i]
            for p in range(stand, row.start + row.num_tokens + K - 1):
                if p // b < len(table) and table[p // b] >= 0:
                    slots[g].append(table[p // b] * b + p % b)
    if slots["mla"]:
        put = lambda arrays, s: tuple(a.at[np.asarray(s)].set(POISON) for a in arrays)  # noqa: E731
        runner.cache = dataclasses.replace(cache, mla=put(cache.mla, slots["mla"]), index=put(cache.index, slots["indexer"]))


def with_oracle_drafts(eng, want: dict, poison: bool = True):
    """After each step, replace the MTP layer's drafts with the next K tokens of `want[req_id]` (the
    non-speculative continuation), the i-th of them wrong on a request's i-th, (K+1+i)-th, ... drafting
    (none wrong every K+1-th time): drafts that stand in every number, on the real model; requests that
    `want` does not name keep the MTP layer's own drafts. `poison`: the
    KV of positions that do not stand is overwritten after each step (`poison_unstood`). -> a list that
    records each step as {request: (draft tokens verified, tokens returned)}."""
    execute, log, count = eng.runner.execute, [], {}

    def run(plan):
        res = execute(plan)
        if poison:
            poison_unstood(eng.runner, plan, res)
        drafts = dict(res.drafts)  # a request `want` does not name keeps the MTP layer's own
        for rid, toks in res.tokens.items():
            if rid not in want:
                continue
            n = len(eng.requests[rid].output_ids) + len(toks)
            d = (list(want[rid][n:n + K]) + [0] * K)[:K]
            i = count[rid] = count.get(rid, -1) + 1
            if i % (K + 1) < K:
                d[i % (K + 1)] = (d[i % (K + 1)] + 1) % 512
            drafts[rid] = tuple(d)
        log.append({row.req_id: (row.num_draft_tokens, res.tokens.get(row.req_id, ())) for row in plan.rows})
        return dataclasses.replace(res, drafts=drafts)

    eng.runner.execute = run
    return log


def test_mtp_greedy_equals_non_speculative(small_model, continuation):
    """The MTP layer's own drafts (random weights: almost all rejected) under chunked prefill (a 70-token
    prompt in 16-token chunks) and preemption (a 24-block pool): the reference tokens, and vLLM's counts."""
    prompts, cont = continuation
    want = [c[:5] for c in cont]
    eng = Engine(small_model, DeployConfig(**MTP))
    outs = eng.generate(prompts, max_new_tokens=5)
    assert [o.token_ids.tolist() for o in outs] == want
    m = eng.metrics()
    assert m["preemptions"] >= 1
    assert m["spec_num_drafts"] > 0 and m["spec_num_draft_tokens"] == K * m["spec_num_drafts"]
    assert m["spec_acceptance_length_mean"] == 1 + m["spec_num_accepted_tokens"] / m["spec_num_drafts"]
    assert len(m["spec_accepted_tokens_per_pos"]) == K
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks
    # logprobs and a logit_bias under MTP: every kept token has its entry, from its own position's raw logits
    # (a greedy token is its position's most likely: rank 1), and a +100 bias makes every token
    lp_id = eng.add_request(prompts[0], SamplingParams(5, logprobs=3))
    bias_id = eng.add_request(prompts[1], SamplingParams(5, logit_bias=((7, 100.0),)))
    while eng.has_unfinished():
        eng.step()
    r = eng.finished[lp_id]
    assert r.output_ids == want[0] and len(r.output_logprobs) == 5
    assert all(lp.rank == 1 and lp.top[0] == (t, lp.logprob) and len(lp.top) == 3
               for lp, t in zip(r.output_logprobs, r.output_ids))
    assert eng.finished[bias_id].output_ids == [7] * 5
    # prompt logprobs under MTP: its prefill's every-position hidden states, chunk by chunk (70 tokens in 16s)
    pl_id = eng.add_request(prompts[2], SamplingParams(5, prompt_logprobs=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.finished[pl_id].output_ids == want[2]
    check_prompt_logprobs(eng.finished[pl_id].prompt_logprobs, np.asarray(glm53.score(small_model, prompts[2])),
                          prompts[2], 2)


@pytest.mark.slow
def test_mtp_greedy_with_standing_drafts_cut_by_stop_tokens_and_max_new_tokens(small_model, continuation):
    """Oracle drafts that stand 0..K at a time on the real model, under chunked prefill, preemption and
    prefix caching: every request's tokens are the non-speculative ones, cut at a stop token or at
    max_new_tokens inside a run of drafts that stood (what follows is dropped, and its KV is never
    cached: a later turn that continues differently hits only the kept tokens and decodes as without
    MTP). The KV of rejected positions is poisoned after every step, so a read of it before it is
    rewritten would show in the tokens. The engine is warmed up first, and then requests arriving at random
    (greedy and sampled, the MTP layer's own drafts) keep the pool preempting: the whole run compiles
    nothing inside the runner (tests/engine/test_recompilation.py's check, its mtp_preempt case merged
    here)."""
    prompts, cont = continuation
    eng = Engine(small_model, DeployConfig(**MTP))
    warm_up(eng)
    compiles = count_compiles(eng)
    want, expect, ids = {}, {}, []
    for i, p in enumerate(prompts):
        cases = [(SamplingParams(10), cont[i][:10]), (SamplingParams(6), cont[i][:6])]
        # a stop token: the first token that first appears at index >= 3 (the model repeats itself)
        first = next((j for j in range(3, 12) if cont[i][j] not in cont[i][:j]), None)
        if first is not None:
            cases.append((SamplingParams(12, stop_token_ids=(cont[i][first],)), cont[i][:first + 1]))
        for params, out in cases:
            rid = eng.add_request(p, params)
            want[rid], expect[rid] = cont[i], out
            ids.append(rid)
    log = with_oracle_drafts(eng, want)
    while eng.has_unfinished():
        eng.step()
    assert {rid: eng.output(rid).token_ids.tolist() for rid in ids} == expect
    m = eng.metrics()
    accepted = [len(toks) - 1 for step in log for nd, toks in step.values() if nd and toks]
    assert m["preemptions"] >= 1 and set(accepted) == set(range(K + 1)), sorted(set(accepted))
    assert m["spec_num_accepted_tokens"] == sum(accepted) and m["spec_num_drafts"] == len(accepted)
    # some requests were returned more tokens than they kept (a stop or max_new_tokens inside a run of
    # drafts that stood)
    returned = {rid: sum(len(step.get(rid, (0, ()))[1]) for step in log) for rid in ids}
    assert any(returned[rid] > len(expect[rid]) for rid in ids)
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks
    # the next turn of a stopped request continues differently from the dropped tokens
    stopped = max((rid for rid in ids if eng.finished[rid].finish_reason == "stop"), key=lambda r: eng.finished[r].finish_s)
    done = eng.output(stopped)
    turn = np.concatenate([done.prompt_ids, done.token_ids, [(want[stopped][len(done.token_ids)] + 7) % 512, 3, 4]])
    before = eng.scheduler.stats.prefix_hit_tokens
    rid = eng.add_request(turn, SamplingParams(5))
    want[rid] = glm53.generate(small_model, turn, 8).token_ids.tolist()
    while eng.has_unfinished():
        eng.step()
    assert eng.output(rid).token_ids.tolist() == want[rid][:5]
    hit = eng.scheduler.stats.prefix_hit_tokens - before  # (0 if the small pool reused the blocks since)
    assert hit <= done.prompt_ids.size + len(done.token_ids) - BASE["block_size"]  # MTP gives back the last page
    _serve_at_random(eng)
    assert eng.metrics()["preemptions"] > m["preemptions"]
    assert sum(compiles) == 0, f"{sum(compiles)} compilations during the run"


def _serve_at_random(eng):
    """200 steps of random arrivals (prompts of 1-74 tokens: with 11 new ones and the drafts' lookahead a
    request fits the 24-block pool), then until every request has finished; the buckets they went through."""
    random_arrivals(eng, 200, (1, 75), lambda n, rng: rng.integers(1, 12))
    while eng.has_unfinished():
        eng.step()
    check_buckets_used(eng, {16})


def test_prefix_hits_give_back_their_last_page_under_mtp():
    """The MTP layer's KV at a page's last position pairs it with the token after the page, which a request
    sharing only the page need not have: under MTP a prefix hit ends one page earlier (vLLM drops the
    last matched block for EAGLE / MTP), on the device pool and through the offload host tier alike."""
    from glm53.engine.synthetic import SyntheticRunner

    cfg = glm53.get_preset("tiny")
    model = type("M", (), {"cfg": cfg, "dtype": "float32"})()
    prompt = np.arange(40, dtype=np.int32)
    for extra in ({}, {"kv_policy": "offload", "cpu_offload_bytes": 1 << 24}):
        hits = {}
        for k in (0, K):
            d = DeployConfig(**{**BASE, **extra, "num_speculative_tokens": k})
            eng = Engine(model, d, runner=SyntheticRunner(lambda row: 1, page_bytes=d.kv_sizes(cfg).page_bytes,
                                                          spec=d.speculative))
            eng.generate([prompt], max_new_tokens=2)
            if extra:  # only the host tier has the prefix now
                eng.scheduler.kv.pool.reset_prefix_cache()
            before = eng.scheduler.stats.prefix_hit_tokens
            eng.generate([np.concatenate([prompt, [7, 8]])], max_new_tokens=2)
            hits[k] = eng.scheduler.stats.prefix_hit_tokens - before
        assert hits == {0: 40, K: 32}, (extra, hits)


def test_drafts_are_the_mtp_layers_chain(small_model, continuation):
    """The silent-acceptance bugs (ANCHORS §6) change the drafts, not the outputs, so the engine's drafts
    are checked against the MTP chain computed apart from it: the whole sequence prefilled at once, the MTP
    layer over every position (position p pairs the normed final hidden state at p with token p+1, on the
    MTP layer's own cache and indexer), the first draft from the last position, then K-1 one-token passes
    each carrying the previous pass's normed output. Drafts may differ only where the reference's top two
    logits are within float rounding of each other. The KV of positions that do not stand is poisoned after
    every step: with oracle drafts only the target layers' reads of it could show in the tokens, here the
    MTP layer's show in the drafts."""
    prompts, _ = continuation
    c = compiled(small_model)
    eng = Engine(small_model, DeployConfig(**MTP))
    execute, seen = eng.runner.execute, []

    def run(plan):
        res = execute(plan)
        poison_unstood(eng.runner, plan, res)  # a later draft that read the MTP layer's stale KV would differ
        for rid, d in res.drafts.items():
            req = eng.requests[rid]
            seen.append((np.concatenate([req.prompt_ids, req.output_ids, res.tokens[rid]]), d))
        return res

    eng.runner.execute = run
    eng.generate(prompts[:2], max_new_tokens=6)
    assert len(seen) >= 8
    width = 64
    mismatched = 0
    for seq, drafts in seen:
        n = seq.size
        cache = ContiguousKVCache.create(small_model.cfg, 1, 128, small_model.dtype)
        tok, pos = np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32)
        tok[0, : n - 1], pos[0, : n - 1] = seq[:-1], np.arange(n - 1)
        h, cache, _ = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=width)
        nxt = np.zeros((1, width), np.int32)
        nxt[0, : n - 1] = seq[1:]
        hm, cache = c.mtp_forward(c.state, h, jnp.asarray(nxt), jnp.asarray(pos), cache, j=0, window=width)
        h1 = hm[:, n - 2: n - 1]
        want, margins = [], []
        for s in range(K):
            logits = np.asarray(c.logits(c.state, h1))[0, 0]
            top = np.sort(logits)[-2:]
            want.append(int(np.argmax(logits)))
            margins.append(top[1] - top[0])
            if s < K - 1:
                h1, cache = c.mtp_forward(c.state, h1, jnp.asarray([[want[-1]]], np.int32),
                                          jnp.asarray([[n - 1 + s]], np.int32), cache, j=0, window=width)
        for s, (got, ref, margin) in enumerate(zip(drafts, want, margins)):
            if got != ref:
                assert margin < 1e-4, (s, got, ref, margin)
                mismatched += 1
                break  # later drafts follow another token
    assert mismatched <= 1


def test_synthetic_acceptance_length_and_vllm_metric_names(small_model):
    """rejection_sample_method="synthetic" with synthetic_acceptance_length 2.99 (vLLM's benchmark mode, the
    published MTP3 setting) measures 2.99 +- 0.02 on the real model runner, sampled and greedy rows alike
    (1,000+ drafts: the standard error is ~0.003); Prometheus shows vLLM's spec-decode counters."""
    from prometheus_client.parser import text_string_to_metric_families

    from glm53.engine.prometheus import ServingMetrics

    eng = Engine(small_model, DeployConfig(**{**MTP, "num_speculative_tokens": 0}, speculative_config=SYNTHETIC))
    prom = ServingMetrics(eng)
    rng = np.random.default_rng(7)
    for i in range(150):  # short requests: two run at a time
        eng.add_request(rng.integers(0, 512, 4), SamplingParams(21, greedy=i % 2 == 0, temperature=0.8, seed=i))
    while eng.has_unfinished():
        eng.step()
    m = eng.metrics()
    assert m["spec_num_drafts"] >= 1000 and abs(m["spec_acceptance_length_mean"] - 2.99) <= 0.02, m
    per_pos = m["spec_accepted_tokens_per_pos"]
    assert per_pos[0] == m["spec_num_drafts"] and per_pos[2] == 0  # rates 1.0, 0.99, 0.0
    assert m["spec_acceptance_rate_per_pos"] == [n / m["spec_num_drafts"] for n in per_pos]
    assert all(len(o.token_ids) == 21 for o in (eng.output(r) for r in eng.finished))
    fams = {f.name: f for f in text_string_to_metric_families(prom.text())}
    value = {f"{f.name}:{s.labels.get('position', '')}": s.value for f in fams.values() for s in f.samples
             if f.name.startswith("vllm:spec_decode") and s.name.endswith("_total")}
    assert value["vllm:spec_decode_num_drafts:"] == m["spec_num_drafts"]
    assert value["vllm:spec_decode_num_draft_tokens:"] == m["spec_num_draft_tokens"]
    assert value["vllm:spec_decode_num_accepted_tokens:"] == m["spec_num_accepted_tokens"]
    assert [value[f"vllm:spec_decode_num_accepted_tokens_per_pos:{i}"] for i in range(K)] == per_pos
    assert fams["vllm:spec_decode_num_drafts"].type == "counter"
    assert not any(n.startswith("vllm:spec_decode") for n in
                   (f.name for f in text_string_to_metric_families(ServingMetrics(Engine(small_model, DeployConfig(**BASE))).text())))


@pytest.mark.slow
def test_mtp_greedy_on_a_checkpoint_with_mtp_weights(hf_fixtures):
    """A checkpoint loaded with from_pretrained whose MTP layer is in the file (tests/fixtures/
    make_hf_golden.py writes one into "base"): MTP greedy decoding gives HF's greedy tokens, with the MTP
    layer's own drafts (sequential verification) and with drafts that stand under batched verification
    (one forward of 1 + K tokens, a GPU's default: equal to decoding up to rounding, and HF's greedy
    margins are far above it)."""
    model = glm53.from_pretrained(hf_fixtures / "base")
    assert model.cfg.num_nextn_predict_layers == 1
    golden = np.load(hf_fixtures / "base" / "golden.npz")
    prompt, want = golden["input_ids"], golden["greedy_tokens"].tolist()
    deploy = DeployConfig(**{**BASE, "num_speculative_tokens": K})
    assert Engine(model, deploy).generate([prompt], max_new_tokens=16)[0].token_ids.tolist() == want
    eng = Engine(model, DeployConfig(**BASE, speculative_config={"method": "mtp", "num_speculative_tokens": K,
                                                                 "verify": "batched"}))
    assert eng.runner.verify_mode == "batched"
    rid = eng.add_request(prompt, SamplingParams(16))
    log = with_oracle_drafts(eng, {rid: want})
    while eng.has_unfinished():
        eng.step()
    assert eng.output(rid).token_ids.tolist() == want
    assert max(len(toks) for step in log for _, toks in step.values()) == K + 1


def test_the_simulator_prices_mtp3_with_synthetic_acceptance():
    """The simulator runs speculative_config in synthetic mode (the Part 1 MTP3 setting): the same requests
    take fewer, dearer steps (1 + k tokens per decode row and the draft passes are priced), the measured
    acceptance length is the configured 2.99, and time per output token drops. Without a synthetic rule
    it refuses (it has no draft model)."""
    from glm53.engine import sim

    cfg = glm53.get_preset("glm-5.3")
    base = DeployConfig(tensor_parallel_size=8, kv_cache_dtype="fp8_ds_mla", block_size=64, max_model_len=32_768,
                        max_num_batched_tokens=8192, max_num_seqs=64, kv_cache_memory_bytes=15 << 30)
    prompts = [np.arange(2000 + 100 * i) % cfg.vocab_size for i in range(16)]
    runs = {}
    for name, spec in (("plain", None), ("mtp3", SYNTHETIC)):
        for pad in (False, True):
            eng = sim.build_engine(cfg, dataclasses.replace(base, speculative_config=spec), pad_like_runner=pad)
            outs = eng.generate(prompts, max_new_tokens=200)
            assert all(len(o.token_ids) == 200 for o in outs)
            runs[name, pad] = (eng.metrics(), eng.scheduler.stats.steps, eng.runner.time_by_op)
    for pad in (False, True):
        (plain, plain_steps, _), (mtp, mtp_steps, ops) = runs["plain", pad], runs["mtp3", pad]
        assert abs(mtp["spec_acceptance_length_mean"] - 2.99) <= 0.02 and mtp["spec_num_drafts"] >= 1000
        assert mtp_steps < 0.45 * plain_steps
        assert plain["tpot_mean_s"] / mtp["tpot_mean_s"] > 1.3, (plain["tpot_mean_s"], mtp["tpot_mean_s"])
        assert any(k.startswith("mtp_draft_") for k in ops)
    with pytest.raises(ValueError, match="synthetic"):
        sim.build_engine(cfg, dataclasses.replace(base, num_speculative_tokens=3))


def test_the_simulator_runs_hisparse_with_mtp3():
    """HiSparse with MTP3 in the simulator (Part 1's published pairing) at GLM-5.3 scale: 16 requests of
    20K+ tokens over a pool of about half their KV, so decoding requests lease hot buffers of (3 + 2) x
    top-k rows and release pages while their rows verify 1 + 3 tokens a step; the acceptance length is
    the configured 2.99."""
    from glm53.engine import sim

    cfg = glm53.get_preset("glm-5.3")
    deploy = DeployConfig(tensor_parallel_size=8, kv_cache_dtype="fp8_ds_mla", block_size=64, index_block_size=1024,
                          max_model_len=32_768, max_num_batched_tokens=8192, max_num_seqs=64,
                          kv_cache_memory_bytes=8 << 30, kv_policy="hisparse", hisparse_host_pool_bytes=64 << 30,
                          cpu_offload_bytes=8 << 30, speculative_config=SYNTHETIC)
    prompts = [np.random.default_rng(i).integers(0, cfg.vocab_size, 20_000 + 100 * i) for i in range(16)]
    eng = sim.build_engine(cfg, deploy)
    assert eng.sizes.hot_rows == (K + 2) * cfg.index_topk
    assert all(len(o.token_ids) == 200 for o in eng.generate(prompts, max_new_tokens=200))
    m = eng.metrics()
    assert abs(m["spec_acceptance_length_mean"] - 2.99) <= 0.02 and m["spec_num_drafts"] >= 1000
    assert m["released_pages"] > 0 and m["leases"] > 0 and m["residency_mixed_requests_mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["swap", "offload"])
def test_mtp_greedy_under_swap_and_offload(small_model, continuation, policy):
    """Drafts that stand while preempted requests' KV, the MTP layer's rows and indexer keys included, goes
    to host memory and back (swap) or to the offload tier and back at re-admission (no device prefix cache:
    only the host tier gives prefixes back): the non-speculative tokens. On a warm engine, and then under
    random arrivals: the whole run compiles nothing inside the runner (tests/engine/test_recompilation.py's
    check, its mtp_swap and mtp_offload cases merged here)."""
    prompts, cont = continuation
    extra = dict(kv_policy="swap", cpu_offload_bytes=1 << 30) if policy == "swap" else \
        dict(kv_policy="offload", cpu_offload_bytes=1 << 30, enable_prefix_caching=False)
    eng = Engine(small_model, DeployConfig(**MTP, **extra))
    assert eng.runner.host.page_bytes == eng.sizes.page_bytes  # pages hold the MTP layer's KV too
    warm_up(eng)
    compiles = count_compiles(eng)
    ids = [eng.add_request(p, SamplingParams(12)) for p in prompts + prompts[::-1]]
    log = with_oracle_drafts(eng, dict(zip(ids, cont + cont[::-1])))
    while eng.has_unfinished():
        eng.step()
    assert [eng.output(r).token_ids.tolist() for r in ids] == [c[:12] for c in cont + cont[::-1]]
    assert max(len(toks) for step in log for _, toks in step.values()) == K + 1
    m = eng.metrics()
    if policy == "swap":
        assert m["offloads"] >= 1 and m["recomputed_tokens"] == 0
    else:
        assert m["preemptions"] >= 1 and m["kv_offload"]["cpu"]["loaded_pages"] > 0
    _serve_at_random(eng)
    m2 = eng.metrics()
    if policy == "swap":  # saves and loads ran again, not only the fallback to preemption
        assert m2["offloads"] > m["offloads"] and m2["h2d_bytes"] > m["h2d_bytes"]
    else:  # pages were stored to the host tier and loaded back again
        tier, before = m2["kv_offload"]["cpu"], m["kv_offload"]["cpu"]
        assert tier["stored_pages"] > before["stored_pages"] and tier["loaded_pages"] > before["loaded_pages"]
    assert sum(compiles) == 0, f"{sum(compiles)} compilations during the run"
