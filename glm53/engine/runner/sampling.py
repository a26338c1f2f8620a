"""Sampling: the jitted programs that turn a group's hidden states into tokens, and the host-side rules
around them. A request samples with PRNG key fold_in(key(seed), tokens generated so far), so it samples
the same tokens whatever it is batched with. MTP's accept rule is glm53.engine.spec_decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm53.engine.plan import PlanRow
from glm53.engine.spec_decode import rejection_sample


@jax.jit
def _sample(logits_RV, seeds_R, counters_R, temps_R, top_ps_R):
    """Temperature / top-p sampling, one PRNG key per row: fold_in(key(seed), counter)."""

    def one(logits, seed, counter, temp, top_p):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        z = logits / temp
        order = jnp.argsort(-z)
        probs = jax.nn.softmax(z[order])
        keep = jnp.cumsum(probs) - probs < top_p  # the smallest prefix whose mass reaches top_p
        z_sorted = jnp.where(keep, z[order], -jnp.inf)
        return order[jax.random.categorical(key, z_sorted)]

    return jax.vmap(one)(logits_RV, seeds_R, counters_R, temps_R, top_ps_R)


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


def pick(logits_RV, rows: list[PlanRow], idx: list[int]) -> dict[str, tuple[int]]:
    """One token per row `rows[j]` from logits row idx[j]: argmax for greedy rows, `_sample` for the
    others; stop tokens before min_tokens masked first (on the host: rare, small)."""
    out = {}
    sample_rows = [(i, r) for i, r in zip(idx, rows) if not r.params.greedy]
    greedy = [(i, r) for i, r in zip(idx, rows) if r.params.greedy]
    banned = [(i, r.params.banned(r.num_generated)) for i, r in zip(idx, rows)]
    if any(b for _, b in banned):
        logits_RV = np.array(logits_RV)
        for i, b in banned:
            logits_RV[i, list(b)] = -np.inf
    if greedy:
        host = np.asarray(logits_RV)
        for i, r in greedy:
            out[r.req_id] = (int(np.argmax(host[i])),)
    if sample_rows:
        n = len(logits_RV)
        seeds, counters = np.zeros(n, np.uint32), np.zeros(n, np.int32)
        temps, top_ps = np.ones(n, np.float32), np.ones(n, np.float32)
        for i, r in sample_rows:
            seeds[i], counters[i] = r.params.prng_seed, r.num_generated
            temps[i], top_ps[i] = r.params.temperature, r.params.top_p
        toks = np.asarray(_sample(logits_RV, seeds, counters, temps, top_ps))
        for i, r in sample_rows:
            out[r.req_id] = (int(toks[i]),)
    return out


def accept(logits_fn, state, hidden, rows: list[PlanRow], need: list[int], r: int, k: int, rates):
    """The accept rule of a verify group (hidden [r, 1 + k, D]) -> host (tokens [r, 1 + k], accepted [r])."""
    logits = _position_logits(logits_fn, state, hidden)
    bans = [(i, j, b) for i in need for j in range(rows[i].num_tokens)
            if (b := rows[i].params.banned(rows[i].num_generated + j))]
    if bans:  # stop tokens before min_tokens, per position: masked on the host (rare, small)
        logits = np.array(logits)
        for i, j, b in bans:
            logits[i, j, list(b)] = -np.inf
    drafts, nd = np.zeros((r, k), np.int32), np.zeros(r, np.int32)
    greedy, temps, top_ps = np.ones(r, bool), np.ones(r, np.float32), np.ones(r, np.float32)
    seeds, counters = np.zeros(r, np.uint32), np.zeros(r, np.int32)
    for i in need:
        row = rows[i]
        nd[i] = row.num_draft_tokens
        drafts[i, : nd[i]] = row.token_ids[row.num_tokens - nd[i]:]
        greedy[i], temps[i], top_ps[i] = row.params.greedy, row.params.temperature, row.params.top_p
        seeds[i], counters[i] = row.params.prng_seed, row.num_generated
    toks, accepted = rejection_sample(logits, drafts, nd, greedy, temps, top_ps, seeds, counters, rates)
    return np.asarray(toks), np.asarray(accepted)


def warm_sampling(logits_fn, state, hidden, rows: int, k: int = 0, rates=None, verify: bool = False) -> None:
    """Compile the sampling programs of `rows` rows after `hidden`: the logits and `_sample`, or under MTP's
    verify the position logits and the accept rule (padding only)."""
    ones = np.ones(rows, np.float32)
    if verify:
        logits = _position_logits(logits_fn, state, hidden)
        rejection_sample(logits, np.zeros((rows, k), np.int32), np.zeros(rows, np.int32), np.ones(rows, bool), ones,
                         ones, np.zeros(rows, np.uint32), np.zeros(rows, np.int32), rates)
        return
    logits = last_logits(logits_fn, state, hidden, np.zeros(rows, np.int32))
    _sample(logits, np.zeros(rows, np.uint32), np.zeros(rows, np.int32), ones, ones).block_until_ready()
