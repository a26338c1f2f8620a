"""The logit rules of sampling as pure jnp functions of one row, shared by the model runner's sampler
(glm53.engine.runner.sampling) and MTP's accept rule (glm53.engine.spec_decode), so a speculative step
draws from exactly the distribution a plain step draws from. vLLM's definitions and order
(docs/engine.md, "Sampling parameters"):

    raw logits -> logprobs (log-softmax, before any rule: vLLM's default logprobs_mode)
    raw logits -> + logit_bias -> penalties (repetition, frequency, presence)   = `process`
               -> greedy: argmax
               -> sampled: / temperature -> min_p -> top_k -> top_p -> draw    = `filter_sampled`

Each works on float32 [V] (vocabulary order); the caller vmaps over rows. Masked tokens are -inf, never NaN
(JAX_NOTES: NaN ranks above everything in a sort)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def process(logits_V, bias_ids_B, bias_B, seen_ids_L, out_counts_L, presence, frequency, repetition):
    """The rules that change the argmax too: logit_bias, then the penalties.

    bias_ids_B int32 / bias_B float32: bias_B[i] is added to token bias_ids_B[i] (ids >= V, the padding,
        are dropped). seen_ids_L int32: the distinct tokens of the prompt and the output (ids >= V: padding);
        out_counts_L float32: how often each occurs in the output (0 for a prompt-only token).
    repetition (> 0): a seen token's logit is divided by it when positive, multiplied when not.
    frequency / presence: subtracted x the output count / once if the output holds the token."""
    z = logits_V.at[bias_ids_B].add(bias_B, mode="drop")
    v = z.shape[0]
    seen = jnp.zeros(v, bool).at[seen_ids_L].set(True, mode="drop")
    counts = jnp.zeros(v, jnp.float32).at[seen_ids_L].add(out_counts_L, mode="drop")
    z = jnp.where(seen, jnp.where(z > 0, z / repetition, z * repetition), z)
    return z - frequency * counts - presence * (counts > 0)


def filter_sampled(z_V, temperature, top_k, top_p, min_p):
    """Logits of the distribution a sampled row draws from, -inf outside it: z / temperature, then min_p
    (tokens with probability below min_p x the top token's go), top_k (0 = off: tokens whose logit is below
    the k-th largest go, ties with it stay), top_p (of what is left, the most likely tokens whose mass
    before them is below top_p stay, and any tied with the last of them)."""
    z = z_V / temperature
    p = jax.nn.softmax(z)
    z = jnp.where(p >= min_p * jnp.max(p), z, -jnp.inf)
    s = -jnp.sort(-z)  # descending
    v = z.shape[0]
    kth = s[jnp.clip(top_k - 1, 0, v - 1)]
    cut_k = (top_k > 0) & (top_k < v)
    z = jnp.where(cut_k & (z < kth), -jnp.inf, z)
    s = jnp.where(cut_k & (s < kth), -jnp.inf, s)
    ps = jax.nn.softmax(s)
    keep = jnp.sum(jnp.cumsum(ps) - ps < top_p)  # >= 1: nothing comes before the top token
    return jnp.where(z < s[keep - 1], -jnp.inf, z)


def logprobs(raw_V, token, k: int):
    """The raw logprobs of `token` and the k most likely tokens -> (its logprob, its rank: 1 + the tokens
    with a larger logprob, top ids [k] int32, top logprobs [k])."""
    lp = jax.nn.log_softmax(raw_V.astype(jnp.float32))
    mine = lp[token]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return mine, (jnp.sum(lp > mine) + 1).astype(jnp.int32), top_ids.astype(jnp.int32), top_lp
