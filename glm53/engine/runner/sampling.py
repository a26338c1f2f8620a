"""Sampling: the jitted programs that turn a group's hidden states into tokens and logprobs, and the
host-side rules around them. A request samples with PRNG key fold_in(key(seed), tokens generated so far),
so it samples the same tokens whatever it is batched with. Every sampling parameter is an array of the
batch (one entry per row), so no request compiles a program of its own; the rules themselves are
glm53.engine.logits. MTP's accept rule is glm53.engine.spec_decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention.common import pow2_at_least
from glm53.engine import logits as rules
from glm53.engine.plan import PlanRow
from glm53.engine.request import MAX_LOGIT_BIAS, MAX_LOGPROBS, TokenLogprobs
from glm53.engine.spec_decode import rejection_sample

MIN_PENALTY_WIDTH = 64  # narrowest bucket of a step's distinct penalized tokens per row


def penalty_width(n: int) -> int:
    """Columns of the penalty arrays of a step whose widest row has `n` distinct prompt and output tokens:
    0 (no penalties), else a power of two >= MIN_PENALTY_WIDTH (a bounded set of programs)."""
    return 0 if n == 0 else max(MIN_PENALTY_WIDTH, pow2_at_least(n))


def penalty_widths(limit: int) -> list[int]:
    """Every penalty width a runner can meet, 0 included: a row holds at most `limit` distinct tokens
    (min(vocab size, max_model_len))."""
    top = penalty_width(max(limit, 1))
    return [0] + [MIN_PENALTY_WIDTH << i for i in range((top // MIN_PENALTY_WIDTH).bit_length())]


@jax.jit
def _process(logits_RV, bias_ids_RB, bias_RB, seen_RL, counts_RL, presence_R, frequency_R, repetition_R):
    """`glm53.engine.logits.process` per row: logit_bias, then the penalties -> [R, V] float32."""
    return jax.vmap(rules.process)(logits_RV.astype(jnp.float32), bias_ids_RB, bias_RB, seen_RL, counts_RL,
                                   presence_R, frequency_R, repetition_R)


@functools.partial(jax.jit, static_argnames=("sampled", "with_logprobs"))
def _sample(raw_RV, logits_RV, greedy_R, temps_R, top_ks_R, top_ps_R, min_ps_R, seeds_R, counters_R, *,
            sampled: bool = True, with_logprobs: bool = True):
    """One token per row: argmax of `logits_RV` (greedy rows; lowest id on ties) or a draw from
    `glm53.engine.logits.filter_sampled` with key fold_in(key(seed), counter); and its raw logprobs from
    `raw_RV` (the model's logits before any rule) -> (tokens [R] int32, logprob [R], rank [R] int32, top
    ids [R, K] int32, top logprobs [R, K]), K = min(MAX_LOGPROBS, V); (tokens,) without `with_logprobs`.
    sampled=False: every row is greedy (the filter's vocabulary sort is not traced). Why the two static
    flags: under vmap both sides of a `where` run, and the sort and the log-softmax over the vocabulary
    cost many times an argmax per row (docs/engine.md), while most steps are greedy without logprobs."""
    k = min(MAX_LOGPROBS, raw_RV.shape[-1])

    def one(raw, z, greedy, temp, top_k, top_p, min_p, seed, counter):
        z = z.astype(jnp.float32)
        tok = jnp.argmax(z).astype(jnp.int32)
        if sampled:
            key = jax.random.fold_in(jax.random.key(seed), counter)
            drawn = jax.random.categorical(key, rules.filter_sampled(z, temp, top_k, top_p, min_p))
            tok = jnp.where(greedy, tok, drawn).astype(jnp.int32)
        return (tok, *rules.logprobs(raw, tok, k)) if with_logprobs else (tok,)

    return jax.vmap(one)(raw_RV, logits_RV, greedy_R, temps_R, top_ks_R, top_ps_R, min_ps_R, seeds_R, counters_R)


@jax.jit
def _position_logprobs(raw_RJV, toks_RJ):
    """`glm53.engine.logits.logprobs` of token toks_RJ[r, j] at each verify position -> (logprob [R, J], rank
    [R, J] int32, top ids [R, J, K] int32, top logprobs [R, J, K]), K = min(MAX_LOGPROBS, V)."""
    k = min(MAX_LOGPROBS, raw_RJV.shape[-1])
    return jax.vmap(jax.vmap(lambda raw, t: rules.logprobs(raw, t, k)))(raw_RJV, toks_RJ)


def _entries(rows: list[PlanRow], idx: list[int], counts: list[int], mine, rank, top_ids, top_lp,
             field: str = "logprobs") -> dict[str, tuple]:
    """{req_id: (TokenLogprobs, ...)} of the rows that ask for logprobs (`field` of their params: logprobs or
    prompt_logprobs): row rows[j]'s first counts[j] positions of host arrays [R, J(, K)] at row idx[j]."""
    out = {}
    for i, r, n in zip(idx, rows, counts):
        k = getattr(r.params, field)
        if k is not None:
            out[r.req_id] = tuple(TokenLogprobs(float(mine[i, j]), int(rank[i, j]),
                                                tuple(zip(top_ids[i, j, :k].tolist(), top_lp[i, j, :k].tolist())))
                                  for j in range(n))
    return out


def prompt_logprobs(logits_fn, state, hidden_RWD, rows: list[PlanRow]) -> dict[str, tuple]:
    """The prompt logprobs of a prefill group's rows with `PlanRow.prompt_len` (row i of `rows` is row i of
    hidden_RWD [R, W, D], every position's hidden state) -> {req_id: (q, (TokenLogprobs, ...))}: position j
    of the row's chunk gives prompt token q + j (q = start + 1) its raw logprob given the tokens before it
    (the chunk's next token, then `next_token` for its last position), up to prompt token prompt_len - 1.
    Two programs per (rows, width), `_position_logits` and `_position_logprobs`, which the warm-up compiles
    (`warm_prompt_logprobs`)."""
    r, w = hidden_RWD.shape[:2]
    toks, counts, asking = np.zeros((r, w), np.int32), [], []
    for i, row in enumerate(rows):
        if not row.prompt_len:
            continue
        n = min(row.num_tokens, row.prompt_len - 1 - row.start)
        toks[i, : n] = np.append(row.token_ids[1:], max(row.next_token, 0))[:n]
        asking.append(i)
        counts.append(n)
    raw = _position_logits(logits_fn, state, hidden_RWD)
    out = _entries([rows[i] for i in asking], asking, counts, *(np.asarray(x) for x in _position_logprobs(raw, toks)),
                   field="prompt_logprobs")
    return {rows[i].req_id: (rows[i].start + 1, out[rows[i].req_id]) for i in asking}


def warm_prompt_logprobs(logits_fn, state, hidden_RWD) -> None:
    """Compile `prompt_logprobs`' programs for hidden_RWD's (rows, width)."""
    raw = _position_logits(logits_fn, state, hidden_RWD)
    _position_logprobs(raw, np.zeros(hidden_RWD.shape[:2], np.int32))[0].block_until_ready()


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(logits_fn, state, hidden_RTD, last_R):
    """Logits of each row's last real token: one program per (model, rows, width), shared by every
    engine on the model (no eager gathers that would compile per shape)."""
    return logits_fn(state, hidden_RTD[jnp.arange(hidden_RTD.shape[0]), last_R])


@functools.partial(jax.jit, static_argnums=0)
def _position_logits(logits_fn, state, hidden_RJD):
    """Logits of every position of a verify group -> [R, J, V], one position at a time: each is the
    [R, D] product a one-token decode step of R rows computes (`_last_logits`), so on XLA:CPU the same
    bits (one product over all R x J rows may take another kernel and round differently)."""
    return jnp.swapaxes(jax.lax.map(lambda h_RD: logits_fn(state, h_RD), jnp.swapaxes(hidden_RJD, 0, 1)), 0, 1)


@functools.partial(jax.jit, static_argnums=0)
def _mtp_head(logits_fn, state, hidden_RTD, sel_R):
    """The MTP layer's output at each row's position sel_R -> (that state [R, 1, D], which the next draft
    pass carries, its argmax draft [R, 1] int32)."""
    h_R1D = hidden_RTD[jnp.arange(hidden_RTD.shape[0]), sel_R][:, None]
    return h_R1D, jnp.argmax(logits_fn(state, h_R1D[:, 0]), axis=-1).astype(jnp.int32)[:, None]


@jax.jit
def _concat_drafts(drafts):
    return jnp.concatenate(drafts, axis=1)


@functools.partial(jax.jit, static_argnums=0)
def _draft_argmax(logits_fn, state, hidden_R1D):
    """A one-token MTP pass's draft: argmax of its logits -> [R, 1] int32."""
    return jnp.argmax(logits_fn(state, hidden_R1D[:, 0]), axis=-1).astype(jnp.int32)[:, None]


def last_logits(logits_fn, state, hidden_RTD, last_R):
    """Logits of token last_R[r] of each row; a [rows, 1, D] hidden holds only that token."""
    if hidden_RTD.shape[1] == 1:
        last_R = np.zeros_like(last_R)
    return _last_logits(logits_fn, state, hidden_RTD, last_R)


def row_arrays(rows: list[PlanRow], idx: list[int], n: int) -> dict[str, np.ndarray]:
    """The sampling parameters of `rows` as arrays of n rows (row rows[j] at idx[j]; the others neutral
    padding), in `_sample`'s argument names."""
    a = dict(greedy_R=np.ones(n, bool), temps_R=np.ones(n, np.float32), top_ks_R=np.zeros(n, np.int32),
             top_ps_R=np.ones(n, np.float32), min_ps_R=np.zeros(n, np.float32), seeds_R=np.zeros(n, np.uint32),
             counters_R=np.zeros(n, np.int32))
    for i, r in zip(idx, rows):
        p = r.params
        a["greedy_R"][i], a["seeds_R"][i], a["counters_R"][i] = p.greedy, p.prng_seed, r.num_generated
        if not p.greedy:
            a["temps_R"][i], a["top_ks_R"][i], a["top_ps_R"][i], a["min_ps_R"][i] = p.temperature, p.top_k, p.top_p, p.min_p
    return a


def process_arrays(rows: list[PlanRow], idx: list[int], n: int, vocab: int) -> dict[str, np.ndarray]:
    """The logit_bias and penalty arrays of `rows` (`_process`'s arguments after the logits); padding ids
    are `vocab` (dropped by the scatters: JAX_NOTES' index -1 trap)."""
    width = penalty_width(max((r.penalty_tokens[0].size for r in rows if r.penalty_tokens is not None), default=0))
    a = dict(bias_ids_RB=np.full((n, MAX_LOGIT_BIAS), vocab, np.int32), bias_RB=np.zeros((n, MAX_LOGIT_BIAS), np.float32),
             seen_RL=np.full((n, width), vocab, np.int32), counts_RL=np.zeros((n, width), np.float32),
             presence_R=np.zeros(n, np.float32), frequency_R=np.zeros(n, np.float32), repetition_R=np.ones(n, np.float32))
    for i, r in zip(idx, rows):
        p = r.params
        for j, (t, b) in enumerate(p.logit_bias):
            a["bias_ids_RB"][i, j], a["bias_RB"][i, j] = min(t, vocab), b  # an id past the vocabulary does nothing
        if r.penalty_tokens is not None:
            ids, counts = r.penalty_tokens
            a["seen_RL"][i, : ids.size], a["counts_RL"][i, : ids.size] = ids, counts
            a["presence_R"][i], a["frequency_R"][i] = p.presence_penalty, p.frequency_penalty
            a["repetition_R"][i] = p.repetition_penalty
    return a


def pick(logits_RV, rows: list[PlanRow], idx: list[int]) -> tuple[dict[str, tuple[int]], dict[str, tuple]]:
    """One token per row `rows[j]` from logits row idx[j] -> ({req_id: (token,)}, {req_id: (TokenLogprobs,)}
    for the rows that ask for logprobs). Stop tokens before min_tokens are masked first (on the host: rare,
    small; not in the raw logits the logprobs come from), then logit_bias and penalties (`_process`, only
    when a row has one), then `_sample`."""
    raw = logits_RV
    banned = [(i, r.params.banned(r.num_generated)) for i, r in zip(idx, rows)]
    if any(b for _, b in banned):
        logits_RV = np.array(logits_RV)
        for i, b in banned:
            logits_RV[i, list(b)] = -np.inf
    n, vocab = logits_RV.shape
    if any(r.params.processed for r in rows):
        logits_RV = _process(logits_RV, **process_arrays(rows, idx, n, vocab))
    with_logprobs = any(r.params.logprobs is not None for r in rows)
    out = _sample(raw, logits_RV, **row_arrays(rows, idx, n), sampled=not all(r.params.greedy for r in rows),
                  with_logprobs=with_logprobs)
    toks = np.asarray(out[0])
    lps = {}
    if with_logprobs:
        lps = _entries(rows, idx, [1] * len(rows), *(np.asarray(x)[:, None] for x in out[1:]))
    return {r.req_id: (int(toks[i]),) for i, r in zip(idx, rows)}, lps


def accept(logits_fn, state, hidden, rows: list[PlanRow], need: list[int], r: int, k: int, rates):
    """The accept rule of a verify group (hidden [r, 1 + k, D]) -> host (tokens [r, 1 + k], accepted [r],
    {req_id: (TokenLogprobs of each token it keeps, ...)} for the rows that ask for logprobs: position j's
    raw logits for its j-th token)."""
    logits = raw = _position_logits(logits_fn, state, hidden)
    bans = [(i, j, b) for i in need for j in range(rows[i].num_tokens)
            if (b := rows[i].params.banned(rows[i].num_generated + j))]
    if bans:  # stop tokens before min_tokens, per position: masked on the host (rare, small)
        logits = np.array(logits)
        for i, j, b in bans:
            logits[i, j, list(b)] = -np.inf
    if any(rows[i].params.logit_bias for i in need):  # the same bias at every position (no penalty under MTP)
        j = k + 1
        flat = process_arrays([rows[i] for i in need for _ in range(j)], [i * j + q for i in need for q in range(j)],
                              r * j, logits.shape[-1])
        logits = _process(jnp.reshape(logits, (r * j, -1)), **flat).reshape(r, j, -1)
    drafts, nd = np.zeros((r, k), np.int32), np.zeros(r, np.int32)
    for i in need:
        row = rows[i]
        nd[i] = row.num_draft_tokens
        drafts[i, : nd[i]] = row.token_ids[row.num_tokens - nd[i]:]
    a = row_arrays([rows[i] for i in need], need, r)
    toks, accepted = rejection_sample(logits, drafts, nd, a["greedy_R"], a["temps_R"], a["top_ks_R"], a["top_ps_R"],
                                      a["min_ps_R"], a["seeds_R"], a["counters_R"], rates)
    toks, accepted = np.asarray(toks), np.asarray(accepted)
    lps = {}
    if any(rows[i].params.logprobs is not None for i in need):
        out = (np.asarray(x) for x in _position_logprobs(raw, toks))
        lps = _entries([rows[i] for i in need], need, [int(accepted[i]) + 1 for i in need], *out)
    return toks, accepted, lps


def warm_sampling(logits_fn, state, hidden, rows: int, k: int = 0, rates=None, verify: bool = False,
                  penalty_limit: int = 0) -> None:
    """Compile the sampling programs of `rows` rows after `hidden`: the logits, `_sample` and `_process` at
    every penalty width up to `penalty_limit` distinct tokens per row (`penalty_widths`), or under MTP's
    verify the position logits and the accept rule (padding only)."""
    ones = np.ones(rows, np.float32)
    if verify:
        logits = _position_logits(logits_fn, state, hidden)
        rejection_sample(logits, np.zeros((rows, k), np.int32), np.zeros(rows, np.int32), np.ones(rows, bool), ones,
                         np.zeros(rows, np.int32), ones, np.zeros(rows, np.float32), np.zeros(rows, np.uint32),
                         np.zeros(rows, np.int32), rates)
        _position_logprobs(logits, np.zeros((rows, k + 1), np.int32))[0].block_until_ready()
        flat = jnp.reshape(logits, (rows * (k + 1), -1))
        _process(flat, **process_arrays([], [], rows * (k + 1), flat.shape[-1])).block_until_ready()
        return
    logits = last_logits(logits_fn, state, hidden, np.zeros(rows, np.int32))
    vocab = logits.shape[-1]
    for sampled in (False, True):
        for with_logprobs in (False, True):
            _sample(logits, logits, **row_arrays([], [], rows), sampled=sampled,
                    with_logprobs=with_logprobs)[0].block_until_ready()
    for width in penalty_widths(penalty_limit) if penalty_limit else [0]:
        a = process_arrays([], [], rows, vocab)
        a["seen_RL"], a["counts_RL"] = np.full((rows, width), vocab, np.int32), np.zeros((rows, width), np.float32)
        _process(logits, **a).block_until_ready()
