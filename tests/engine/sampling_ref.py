"""NumPy references of the sampler's rules, written from vLLM's definitions (vllm/v1/sample/sampler.py,
the penalties and min-p / top-k / top-p of its ops), in float64: tests/engine/test_sampling.py and
test_mtp.py check the jitted rules against them."""

import collections

import numpy as np

from glm53.engine.request import SamplingParams


def ref_process(z, params: SamplingParams, prompt, output):
    """vLLM: logit_bias added; then a token of prompt or output has a positive logit divided by
    repetition_penalty, another multiplied; then frequency x output count and presence x (count > 0)
    subtracted."""
    z = np.array(z, np.float64)
    for t, b in params.logit_bias:
        z[t] += b
    counts = collections.Counter(int(t) for t in output)
    for t in set(int(t) for t in prompt) | set(counts):
        z[t] = z[t] / params.repetition_penalty if z[t] > 0 else z[t] * params.repetition_penalty
    for t, c in counts.items():
        z[t] -= params.frequency_penalty * c + params.presence_penalty
    return z


def softmax(z):
    e = np.exp(z - np.max(z))
    return e / e.sum()


def ref_filter(z, temperature, top_k, top_p, min_p):
    """vLLM's order: / temperature; min_p drops probabilities below min_p x the largest; top_k keeps the
    logits >= the k-th largest; top_p (vLLM's ascending form) drops the tokens whose ascending cumulative
    probability is <= 1 - top_p, always keeping the largest."""
    z = np.array(z, np.float64) / temperature
    p = softmax(z)
    z[p < min_p * p.max()] = -np.inf
    if 0 < top_k < z.size:
        z[z < np.sort(z)[::-1][top_k - 1]] = -np.inf
    order = np.argsort(z, kind="stable")  # ascending
    cum = np.cumsum(softmax(z)[order])
    drop = cum <= 1 - top_p
    drop[-1] = False
    z[order[drop]] = -np.inf
    return z


def check_prompt_logprobs(got, logits_TV, prompt, k: int, tol: float = 2e-3) -> None:
    """`got` (Request.prompt_logprobs) against vLLM's definition on full-sequence logits [T, V]: prompt token
    q (q >= 1) has the raw logprob of log_softmax(logits[q - 1]), its rank (tokens within `tol` of it may
    swap places) and k alternatives, each among the k most likely."""
    assert len(got) == len(prompt) - 1
    for q, g in enumerate(got, start=1):
        z = logits_TV[q - 1].astype(np.float64)
        row = z - z.max() - np.log(np.exp(z - z.max()).sum())
        lp = row[int(prompt[q])]
        assert abs(g.logprob - lp) <= tol, (q, g.logprob, lp)
        rank, near = int((row > lp).sum()) + 1, int((np.abs(row - lp) < tol).sum())
        assert rank - near < g.rank <= rank + near, q
        assert len(g.top) == k
        for t, v in g.top:
            assert abs(v - row[t]) <= tol and v >= np.sort(row)[-k] - tol, (q, t)
