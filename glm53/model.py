"""The GLM-5.3 causal LM (flax.nnx) and its forward pass over a KV-cache view.

One forward covers prefill chunks and decode steps alike: a batch of B requests, each with T new tokens
at request-relative positions [B, T] (-1 = padding), attends to its cached rows plus the new ones. The
layers write the new rows into the cache first, then read what they attend to through the cache
interface (kvcache.base.KVCache).

For speed, `compiled(model)` splits the module into (graphdef, state) once and jits pure functions of
(state, tokens, positions, cache) with the cache donated; calling an nnx module eagerly or through
nnx.jit per step costs milliseconds of Python per call.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention import dense_mla
from glm53.config import ModelConfig
from glm53.layers import DecoderLayer, MTPLayer, RMSNorm
from kvcache.base import KVCache

Array = jax.Array

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None
    return jnp.dtype(dtype).type


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (vocab, dim))).astype(dtype))

    def __call__(self, ids: Array) -> Array:
        return jnp.take(self.weight[...], ids, axis=0)


class LMHead(nnx.Module):
    """lm_head.weight stored [D, vocab]."""

    def __init__(self, dim: int, vocab: int, *, rngs: nnx.Rngs, dtype):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (dim, vocab))).astype(dtype))


class GLM53(nnx.Module):
    """GlmMoeDsaForCausalLM. Parameter paths mirror HF names (see weights.py): `embed_tokens`, `layers.i`,
    `norm`, `lm_head`, and `mtp.j` for HF's `model.layers.{num_hidden_layers + j}`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        dtype = as_dtype(dtype)
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype)
        self.mtp = nnx.List([MTPLayer(cfg, cfg.num_hidden_layers + j, rngs=rngs, dtype=dtype)
                             for j in range(cfg.num_nextn_predict_layers)])

    # ---------------------------------------------------------------------------------------------- forward
    def __call__(self, tokens_BT: Array, pos_BT: Array, cache: KVCache, *, window: int, form: str = "auto",
                 impl: str = "auto", last_only: bool = False, keep_all: bool = False):
        """tokens [B,T] int32, positions [B,T] int32 (-1 = padding) -> (hidden [B,T,D] after the final norm,
        cache, {full layer: top-k positions [B,T,K] int32, -1 = none}).

        window (static): all positions in this call are < window; attention reads cache positions
        [0, window) only. form: "mqa" (sparse absorbed), "mha" (dense un-absorbed with the top-k mask) or
        "auto" (see `attention_form`); all give the same result. impl: the attention ops' implementation
        ("auto", "reference" or "pallas"; attention.common.resolve_impl).
        last_only (static): return hidden [B,1,D] of each row's last real token (its rightmost position >=
        0; a row without one returns garbage) and skip the rest of the last layer's query side: every
        token still writes its KV, but attention, o_proj and the MLP of the last layer run for one token
        per row (a serving prefill samples from the last token only: about 1/L of the work saved).
        keep_all (static, with last_only): hidden is the pair (hidden [B,1,D] of the last_only form, hidden
        [B,T,D] of every position): the last layer runs in full for every position (MTP needs each
        position's hidden state) and again for the last token alone, so the sampled token's logits are
        those of the last_only forward an engine without MTP runs (the second run writes the same KV).
        """
        topk_k = self.cfg.index_topk
        layer_form = attention_form(form, window, topk_k, tokens_BT.shape[1])
        x = self.embed_tokens(tokens_BT)
        topk, selections = None, {}
        last_rows = jnp.argmax(jnp.where(pos_BT >= 0, jnp.arange(pos_BT.shape[1]), -1), axis=1)[:, None]
        x_all = None
        for i, layer in enumerate(self.layers):
            rows = None
            if last_only and i == len(self.layers) - 1:  # one query per row: the form for one query
                if keep_all:
                    x_all, cache, _ = layer(x, pos_BT, cache, topk, window=window, form=layer_form, impl=impl)
                rows, layer_form = last_rows, attention_form(form, window, topk_k, 1)
            x, cache, topk = layer(x, pos_BT, cache, topk, window=window, form=layer_form, impl=impl, rows_BR=rows)
            if layer.self_attn.indexer is not None:
                selections[layer.self_attn.layer] = topk
        if x_all is not None:
            return (self.norm(x), self.norm(x_all)), cache, selections
        return self.norm(x), cache, selections

    def verify(self, tokens_BT: Array, pos_BT: Array, cache: KVCache, *, window: int, form: str = "auto",
               impl: str = "auto"):
        """Each of the T positions as a one-token decode step, one after the other (lax.scan), in one program:
        -> (hidden [B,T,D], cache). Every step has the shapes of a one-token decode step of B rows, so on
        a backend whose kernels depend only on shapes (XLA:CPU) each position's hidden state is bitwise
        that of a decode step: an MTP verify step cannot round a greedy token differently from decoding.
        A cache carrying HiSparse's decode view (kvcache.views.HiSparseView) resolves each position's
        selections at its own step (kvcache.paged.PagedKVCache.sparse_slots): position j reads every row it
        selected before position j + 1 resolves, so a later position never evicts a hot row an earlier one
        still needs."""

        def step(cache, tp):
            tok_B, pos_B = tp
            h, cache, _ = self(tok_B[:, None], pos_B[:, None], cache, window=window, form=form, impl=impl)
            return cache, h[:, 0]

        cache, h_TBD = jax.lax.scan(step, cache, (tokens_BT.T, pos_BT.T))
        return jnp.swapaxes(h_TBD, 0, 1), cache

    def mtp_verify(self, j: int, h_prev_BTD: Array, next_tokens_BT: Array, pos_BT: Array, cache: KVCache, *,
                   window: int, form: str = "auto", impl: str = "auto"):
        """`mtp_forward` one position at a time (lax.scan), like `verify`: -> (hidden [B,T,D], cache). For a
        HiSparse decode view, whose resolver serves one-token steps (each position resolves and reads its
        own selection before the next)."""

        def step(cache, args):
            h_BD, tok_B, pos_B = args
            h, cache = self.mtp_forward(j, h_BD[:, None], tok_B[:, None], pos_B[:, None], cache, window=window,
                                        form=form, impl=impl)
            return cache, h[:, 0]

        cache, h_TBD = jax.lax.scan(step, cache, (jnp.swapaxes(h_prev_BTD, 0, 1), next_tokens_BT.T, pos_BT.T))
        return jnp.swapaxes(h_TBD, 0, 1), cache

    def logits(self, hidden_BTD: Array) -> Array:
        """Final hidden states -> float32 logits [..., vocab]."""
        w = self.embed_tokens.weight[...].T if self.lm_head is None else self.lm_head.weight[...]
        return (hidden_BTD @ w).astype(jnp.float32)

    def mtp_forward(self, j: int, h_prev_BTD: Array, next_tokens_BT: Array, pos_BT: Array, cache: KVCache,
                    *, window: int, form: str = "auto", impl: str = "auto"):
        """MTP layer j: main hidden state at t and token t+1 -> (hidden [B,T,D] for predicting t+2, cache)."""
        return self.mtp[j].mtp(self.embed_tokens(next_tokens_BT), h_prev_BTD, pos_BT, cache, window=window,
                               form=attention_form(form, window, self.cfg.index_topk, next_tokens_BT.shape[1]),
                               impl=impl)


def attention_form(form: str, window: int, index_topk: int, num_queries: int = 1) -> str:
    """Resolve "auto" for a step of `num_queries` tokens per request: the dense MHA form while every
    visible position is selected anyway (window <= top-k: DSA is dense attention there, and expanding a
    short window beats gathering rows), and on CPU for prefill chunks whose window is a few times top-k;
    the sparse MQA form beyond (attention.dense_mla.use_dense_mha). form="mqa" forces the sparse path
    everywhere (force_mqa)."""
    if form == "auto":
        return "mha" if dense_mla.use_dense_mha(window, index_topk, num_queries=num_queries) else "mqa"
    if form not in ("mqa", "mha"):
        raise ValueError(f"attention form must be 'auto', 'mqa' or 'mha', got {form!r}")
    return form


def init(cfg_or_preset: ModelConfig | str, seed: int = 0, dtype="float32", *, std: float | None = None) -> GLM53:
    """A GLM53 with random weights. Norm weights start at 1, the router bias at 0, matrices ~ N(0, 0.02^2)
    unless `std` rescales them (the tiny model uses larger weights so its outputs are not near-uniform)."""
    from glm53.config import get_preset

    cfg = get_preset(cfg_or_preset) if isinstance(cfg_or_preset, str) else cfg_or_preset
    model = GLM53(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    if std is not None:
        state = nnx.state(model, nnx.Param)
        scaled = jax.tree.map(lambda a: a * (std / 0.02) if a.ndim >= 2 else a, state)
        nnx.update(model, scaled)
    return model


# ------------------------------------------------------------------------------------------ compiled steps
@dataclasses.dataclass
class Compiled:
    """Jitted pure functions over (state, tokens, positions, cache). The cache argument is donated:
    never reuse a cache you passed in."""

    cfg: ModelConfig
    graphdef: Any
    state: Any
    forward: Any  # (state, tokens_BT, pos_BT, cache, *, window, form, impl, last_only, keep_all) -> (hidden, cache, selections)
    verify: Any  # (state, tokens_BT, pos_BT, cache, *, window, form, impl) -> (hidden [B,T,D], cache): GLM53.verify
    logits: Any  # (state, hidden) -> logits f32
    mtp_forward: Any  # (state, h_prev, next_tokens, pos, cache, *, j, window, form, impl) -> (hidden, cache)
    mtp_verify: Any  # the same, one position at a time: GLM53.mtp_verify


def _make_compiled(model: GLM53) -> Compiled:
    graphdef, state = nnx.split(model)

    def fwd(state, tokens, pos, cache, *, window, form="auto", impl="auto", last_only=False, keep_all=False):
        return nnx.merge(graphdef, state)(tokens, pos, cache, window=window, form=form, impl=impl, last_only=last_only,
                                          keep_all=keep_all)

    def verify(state, tokens, pos, cache, *, window, form="auto", impl="auto"):
        return nnx.merge(graphdef, state).verify(tokens, pos, cache, window=window, form=form, impl=impl)

    def logits(state, hidden):
        return nnx.merge(graphdef, state).logits(hidden)

    def mtp_fwd(state, h_prev, next_tokens, pos, cache, *, j, window, form="auto", impl="auto"):
        return nnx.merge(graphdef, state).mtp_forward(j, h_prev, next_tokens, pos, cache, window=window, form=form,
                                                      impl=impl)

    def mtp_verify(state, h_prev, next_tokens, pos, cache, *, j, window, form="auto", impl="auto"):
        return nnx.merge(graphdef, state).mtp_verify(j, h_prev, next_tokens, pos, cache, window=window, form=form,
                                                     impl=impl)

    return Compiled(
        cfg=model.cfg,
        graphdef=graphdef,
        state=state,
        forward=jax.jit(fwd, static_argnames=("window", "form", "impl", "last_only", "keep_all"), donate_argnums=(3,)),
        verify=jax.jit(verify, static_argnames=("window", "form", "impl"), donate_argnums=(3,)),
        logits=jax.jit(logits),
        mtp_forward=jax.jit(mtp_fwd, static_argnames=("j", "window", "form", "impl"), donate_argnums=(4,)),
        mtp_verify=jax.jit(mtp_verify, static_argnames=("j", "window", "form", "impl"), donate_argnums=(4,)),
    )


_COMPILED: weakref.WeakKeyDictionary[GLM53, Compiled] = weakref.WeakKeyDictionary()


def compiled(model: GLM53) -> Compiled:
    """The model's jitted step functions, built once per model object (rebuilt if its params change)."""
    c = _COMPILED.get(model)
    if c is None or any(a is not b for a, b in zip(jax.tree.leaves(c.state), jax.tree.leaves(nnx.state(model)))):
        c = _COMPILED[model] = _make_compiled(model)
    return c


def as_token_array(token_ids) -> np.ndarray:
    """token_ids as a 1-D int32 array: a copy, so that the caller's later writes to its own array do not
    reach it, except for an int32 array that owns its data and is read-only (one made here and frozen by
    its holder, such as the prompt a P/D pair hands to both its engines), which is returned as it is and
    shared. Raises ValueError for an empty or non-integer sequence and for ids outside [0, 2**31)."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:  # before the cast, which would wrap them
        raise ValueError(f"token ids must lie in [0, {np.iinfo(np.int32).max}], got [{ids.min()}, {ids.max()}]")
    if ids.dtype == np.int32 and ids.flags.owndata and not ids.flags.writeable:
        return ids
    return ids.astype(np.int32)
