"""Model-level entry points: score, topk_indices, teacher-forced decode and generate.

All of them run the same jitted forward over a contiguous KV cache (kvcache.contiguous):
- a prompt is prefilled in chunks of `prefill_chunk` tokens, each chunk attending to the cached rows of
  the earlier chunks plus its own (chunked prefill with DSA semantics);
- decode feeds one token per step at its position, reading cached latent rows and indexer keys.
Shapes are bucketed (cache capacity = next power of two >= 64), so a series of calls with similar
lengths compiles few programs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm53.model import GLM53, Compiled, as_token_array, compiled
from kvcache.contiguous import ContiguousKVCache

DEFAULT_PREFILL_CHUNK = 1024
MIN_CAPACITY = 64


def cache_capacity(num_tokens: int) -> int:
    """Cache bucket for a request of `num_tokens` positions: the next power of two, at least 64."""
    return max(MIN_CAPACITY, 1 << max(num_tokens - 1, 0).bit_length())


def window_bucket(num_positions: int, capacity: int) -> int:
    """Attention window for a step whose largest position is num_positions - 1: a power-of-two bucket
    (few compiled programs), never beyond the cache capacity. Attention cost grows with it, so a
    chunked prefill reads only the part of the cache it can see."""
    return min(capacity, cache_capacity(num_positions))


def _check_tokens(model: GLM53, ids: np.ndarray, extra: int = 0) -> None:
    cfg = model.cfg
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got range [{ids.min()}, {ids.max()}]")
    if ids.size + extra > cfg.max_position_embeddings:
        raise ValueError(
            f"{ids.size + extra} positions exceed max_position_embeddings={cfg.max_position_embeddings}")


def _prefill(c: Compiled, cache, ids: np.ndarray, chunk: int, *, collect_logits: bool, collect_topk: bool,
             form: str = "auto", start_pos: int = 0):
    """Prefill `ids` (one request) at positions start_pos.. in chunks. -> (cache, logits [T,V] or last
    hidden [1,D], {layer: topk [T, min(index_topk, start_pos + T)]}, -1 padded)."""
    t = ids.size
    # A chunk's selection has min(index_topk, window) columns and the window grows chunk by chunk:
    # pad every chunk to the widest selection any position of this prompt can make.
    k = min(c.cfg.index_topk, start_pos + t)
    logits, topk = [], {}
    for s in range(0, t, chunk):
        n = min(chunk, t - s)
        tok = np.zeros((1, chunk), np.int32)
        tok[0, :n] = ids[s : s + n]
        pos = np.full((1, chunk), -1, np.int32)
        pos[0, :n] = np.arange(start_pos + s, start_pos + s + n)
        window = window_bucket(start_pos + s + n, cache.capacity)
        hidden, cache, sel = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=window, form=form)
        if collect_logits:
            logits.append(np.asarray(c.logits(c.state, hidden))[0, :n])
        if collect_topk:
            for layer, idx in sel.items():
                idx = np.asarray(idx)[0, :n, :k]
                idx = np.pad(idx, ((0, 0), (0, k - idx.shape[1])), constant_values=-1)
                topk.setdefault(layer, []).append(idx)
        last_hidden = hidden[:, n - 1]
    out_logits = np.concatenate(logits, 0) if collect_logits else last_hidden
    return cache, out_logits, {layer: np.concatenate(rows, 0) for layer, rows in topk.items()}


def _decode_step(c: Compiled, cache, token: int, pos: int):
    """One decode step of one request: token at position `pos`."""
    return c.forward(c.state, jnp.asarray([[token]], jnp.int32), jnp.asarray([[pos]], jnp.int32), cache,
                     window=window_bucket(pos + 1, cache.capacity))


def _chunk_and_capacity(num_positions: int, prefill_chunk: int | None):
    if prefill_chunk is not None and (not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    capacity = cache_capacity(num_positions)
    chunk = min(capacity, prefill_chunk or DEFAULT_PREFILL_CHUNK)
    return chunk, capacity


def score(model: GLM53, token_ids: Sequence[int], *, prefill_chunk: int | None = None, form: str = "auto") -> np.ndarray:
    """Full causal prefill with DSA semantics: float32 logits [T, vocab] for every position."""
    ids = as_token_array(token_ids)
    _check_tokens(model, ids)
    chunk, capacity = _chunk_and_capacity(ids.size, prefill_chunk)
    cache = ContiguousKVCache.create(model.cfg, 1, capacity, model.dtype, include_mtp=False)
    _, logits, _ = _prefill(compiled(model), cache, ids, chunk, collect_logits=True, collect_topk=False, form=form)
    return logits


def topk_indices(model: GLM53, token_ids: Sequence[int], *, prefill_chunk: int | None = None) -> dict[int, np.ndarray]:
    """{full indexer layer: int32 [T, min(index_topk, T)]}: the positions each query token selects, in the
    total order (score descending, then position ascending); -1 where fewer positions exist."""
    ids = as_token_array(token_ids)
    _check_tokens(model, ids)
    chunk, capacity = _chunk_and_capacity(ids.size, prefill_chunk)
    cache = ContiguousKVCache.create(model.cfg, 1, capacity, model.dtype, include_mtp=False)
    _, _, topk = _prefill(compiled(model), cache, ids, chunk, collect_logits=False, collect_topk=True)
    return {layer: idx.astype(np.int32) for layer, idx in sorted(topk.items())}


def decode_logits(model: GLM53, token_ids: Sequence[int], prefill_len: int, *, prefill_chunk: int | None = None) -> np.ndarray:
    """Teacher-forced decode: prefill the first `prefill_len` tokens, then feed the rest one token per
    step through the decode path. -> float32 logits [T, vocab], comparable with `score`."""
    ids = as_token_array(token_ids)
    _check_tokens(model, ids)
    if not 1 <= prefill_len <= ids.size:
        raise ValueError(f"prefill_len must be in [1, {ids.size}], got {prefill_len}")
    c = compiled(model)
    chunk, capacity = _chunk_and_capacity(ids.size, prefill_chunk)
    cache = ContiguousKVCache.create(model.cfg, 1, capacity, model.dtype, include_mtp=False)
    cache, logits, _ = _prefill(c, cache, ids[:prefill_len], chunk, collect_logits=True, collect_topk=False)
    out = [logits]
    for p in range(prefill_len, ids.size):
        hidden, cache, _ = _decode_step(c, cache, ids[p], p)
        out.append(np.asarray(c.logits(c.state, hidden))[0])
    return np.concatenate(out, 0)


class Generation:
    """Result of `generate`: new token ids and timings (seconds)."""

    def __init__(self, token_ids, prefill_s, decode_s):
        self.token_ids = token_ids
        self.prefill_s = prefill_s
        self.decode_s = decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1  # the first new token comes out of the prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def generate(model: GLM53, prompt_ids: Sequence[int], max_new_tokens: int, *, greedy: bool = True,
             temperature: float = 1.0, seed: int = 0, prefill_chunk: int | None = None) -> Generation:
    """Generate `max_new_tokens` tokens for one prompt: chunked prefill, then one decode step per token.

    Greedy (argmax; lowest token id on exact ties) or temperature sampling with a seeded PRNG key.
    """
    ids = as_token_array(prompt_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    _check_tokens(model, ids, extra=max_new_tokens)
    c = compiled(model)
    chunk, capacity = _chunk_and_capacity(ids.size + max_new_tokens, prefill_chunk)
    cache = ContiguousKVCache.create(model.cfg, 1, capacity, model.dtype, include_mtp=False)
    key = jax.random.key(seed)

    def pick(logits_V, key):
        if greedy:
            return int(np.argmax(logits_V)), key
        key, sub = jax.random.split(key)
        return int(jax.random.categorical(sub, jnp.asarray(logits_V) / temperature)), key

    t0 = time.perf_counter()
    cache, last_hidden, _ = _prefill(c, cache, ids, chunk, collect_logits=False, collect_topk=False)
    tok, key = pick(np.asarray(c.logits(c.state, last_hidden))[0], key)
    t1 = time.perf_counter()
    out = [tok]
    for p in range(ids.size, ids.size + max_new_tokens - 1):
        hidden, cache, _ = _decode_step(c, cache, tok, p)
        tok, key = pick(np.asarray(c.logits(c.state, hidden))[0, 0], key)
        out.append(tok)
    t2 = time.perf_counter()
    return Generation(np.asarray(out, np.int32), t1 - t0, t2 - t1)
