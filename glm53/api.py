"""Model-level entry points: score, score_batch, topk_indices, teacher-forced decode and generate.

All of them run the same jitted forward; score_batch runs a batch of requests on a paged cache
(kvcache.paged), the others one request on a contiguous KV cache (kvcache.contiguous):
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
from kvcache.paged import PagedKVCache

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


def _prefill(c: Compiled, cache, seqs: list[np.ndarray], chunk: int, *, collect_logits: bool, collect_topk: bool,
             form: str = "auto", impl: str = "auto", start_pos: int = 0):
    """Prefill request b's tokens seqs[b] (cache row b) at positions start_pos.. in chunks of `chunk`; all
    requests advance together, a shorter one padding its rows with position -1.

    -> (cache, per request: logits [T_b, V] if collect_logits else the last hidden state [D],
        per request: {layer: topk [T_b, min(index_topk, start_pos + T_b)]}, -1 padded).
    """
    bsz, lens = len(seqs), [ids.size for ids in seqs]
    # A chunk's selection has min(index_topk, window) columns and the window grows chunk by chunk:
    # pad every chunk to the widest selection any position of the request can make.
    ks = [min(c.cfg.index_topk, start_pos + n) for n in lens]
    logits, topk, last = [[] for _ in seqs], [{} for _ in seqs], [None] * bsz
    for s in range(0, max(lens), chunk):
        ns = [max(0, min(chunk, n - s)) for n in lens]
        tok = np.zeros((bsz, chunk), np.int32)
        pos = np.full((bsz, chunk), -1, np.int32)
        for b, (ids, n) in enumerate(zip(seqs, ns)):
            tok[b, :n] = ids[s : s + n]
            pos[b, :n] = np.arange(start_pos + s, start_pos + s + n)
        window = window_bucket(start_pos + s + max(ns), cache.capacity)
        # only the last hidden state is wanted: the model skips the last layer's query side for the rest
        last_only = not (collect_logits or collect_topk)
        hidden, cache, sel = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=window, form=form,
                                       impl=impl, last_only=last_only)
        step_logits = np.asarray(c.logits(c.state, hidden)) if collect_logits else None
        sel = {layer: np.asarray(idx) for layer, idx in sel.items()} if collect_topk else {}
        for b, n in enumerate(ns):
            if n == 0:
                continue
            if collect_logits:
                logits[b].append(step_logits[b, :n])
            for layer, idx in sel.items():
                idx = idx[b, :n, : ks[b]]
                topk[b].setdefault(layer, []).append(np.pad(idx, ((0, 0), (0, ks[b] - idx.shape[1])), constant_values=-1))
            last[b] = hidden[b, 0 if last_only else n - 1]
    out = [np.concatenate(rows, 0) for rows in logits] if collect_logits else last
    return cache, out, [{layer: np.concatenate(rows, 0) for layer, rows in t.items()} for t in topk]


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
    _, logits, _ = _prefill(compiled(model), cache, [ids], chunk, collect_logits=True, collect_topk=False, form=form)
    return logits[0]


def topk_indices(model: GLM53, token_ids: Sequence[int], *, prefill_chunk: int | None = None,
                 form: str = "auto") -> dict[int, np.ndarray]:
    """{full indexer layer: int32 [T, min(index_topk, T)]}: the positions each query token selects, in the
    total order (score descending, then position ascending); -1 where fewer positions exist.

    `form` is the attention form of the layers in between (as in `score`). The forms agree up to float
    rounding, and so may the indexer scores of later layers: two positions whose scores are within
    rounding of each other can swap places. Compare selections across chunkings with one fixed form."""
    ids = as_token_array(token_ids)
    _check_tokens(model, ids)
    chunk, capacity = _chunk_and_capacity(ids.size, prefill_chunk)
    cache = ContiguousKVCache.create(model.cfg, 1, capacity, model.dtype, include_mtp=False)
    _, _, topk = _prefill(compiled(model), cache, [ids], chunk, collect_logits=False, collect_topk=True, form=form)
    return {layer: idx.astype(np.int32) for layer, idx in sorted(topk[0].items())}


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
    cache, logits, _ = _prefill(c, cache, [ids[:prefill_len]], chunk, collect_logits=True, collect_topk=False)
    out = logits
    for p in range(prefill_len, ids.size):
        hidden, cache, _ = _decode_step(c, cache, ids[p], p)
        out.append(np.asarray(c.logits(c.state, hidden))[0])
    return np.concatenate(out, 0)


def score_batch(model: GLM53, prompts: Sequence[Sequence[int]], *, kv_cache_dtype: str = "float32",
                index_cache_dtype: str | None = None, block_size: int = 16, prefill_lens: Sequence[int] | None = None, prefill_chunk: int | None = None,
                form: str = "auto", impl: str = "auto", seed: int = 0) -> list[np.ndarray]:
    """Teacher-forced float32 logits [T_i, vocab] for a batch of requests of different lengths, run
    together on a paged KV cache (kvcache.paged) in format `kv_cache_dtype` ("float32", "bfloat16",
    "float16" or "fp8_ds_mla"); indexer keys in `index_cache_dtype` (default: the matching format, fp8
    for fp8_ds_mla).

    Request i prefills its first prefill_lens[i] tokens (default: all) in chunks of `prefill_chunk`,
    all requests' chunks in one batch; the rest of its tokens go one per step through batched decode
    (a request with nothing left pads with position -1). Pages are dealt from a shuffled pool (seed),
    so a request's blocks are neither contiguous nor in order. With a float32 cache the logits equal
    `score` for each prompt alone.
    """
    seqs = [as_token_array(p) for p in prompts]
    if not seqs:
        raise ValueError("prompts must hold at least one prompt")
    for ids in seqs:
        _check_tokens(model, ids)
    lens = [ids.size for ids in seqs]
    plens = list(lens) if prefill_lens is None else [int(n) for n in prefill_lens]
    if len(plens) != len(seqs) or any(not 1 <= p <= n for p, n in zip(plens, lens)):
        raise ValueError(f"prefill_lens must give each prompt a length in [1, len(prompt)], got {plens} for {lens}")
    chunk, _ = _chunk_and_capacity(max(lens), prefill_chunk)
    cache = _shuffled_paged_cache(model.cfg, lens, block_size, seed, kv_cache_dtype=kv_cache_dtype,
                                  index_cache_dtype=index_cache_dtype)
    c = compiled(model)
    cache, logits, _ = _prefill(c, cache, [ids[:p] for ids, p in zip(seqs, plens)], chunk, collect_logits=True,
                                collect_topk=False, form=form, impl=impl)
    out = [[lg] for lg in logits]
    for j in range(max(n - p for n, p in zip(lens, plens))):
        pos = np.asarray([[p + j if p + j < n else -1] for n, p in zip(lens, plens)], np.int32)
        tok = np.asarray([[ids[q] if q >= 0 else 0] for ids, (q,) in zip(seqs, pos)], np.int32)
        window = window_bucket(int(pos.max()) + 1, cache.capacity)
        hidden, cache, _ = c.forward(c.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=window, form=form,
                                     impl=impl)
        step_logits = np.asarray(c.logits(c.state, hidden))
        for b, (q,) in enumerate(pos):
            if q >= 0:
                out[b].append(step_logits[b])
    return [np.concatenate([np.atleast_2d(x) for x in rows], 0) for rows in out]


def _shuffled_paged_cache(cfg, lens: list[int], block_size: int, seed: int, **formats) -> PagedKVCache:
    """A paged cache whose requests own ceil(len / block_size) blocks each, dealt from a shuffled pool with
    one spare block, so block ids are scattered; unused table entries are -1."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1
    perm = np.random.default_rng(seed).permutation(num_blocks)
    table = np.full((len(lens), max(need)), -1, np.int32)
    start = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[start : start + k]
        start += k
    return PagedKVCache.create(cfg, num_blocks, block_size, table, include_mtp=False, **formats)


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
    cache, last_hidden, _ = _prefill(c, cache, [ids], chunk, collect_logits=False, collect_topk=False)
    tok, key = pick(np.asarray(c.logits(c.state, last_hidden[0])), key)
    t1 = time.perf_counter()
    out = [tok]
    for p in range(ids.size, ids.size + max_new_tokens - 1):
        hidden, cache, _ = _decode_step(c, cache, tok, p)
        tok, key = pick(np.asarray(c.logits(c.state, hidden))[0, 0], key)
        out.append(tok)
    t2 = time.perf_counter()
    return Generation(np.asarray(out, np.int32), t1 - t0, t2 - t1)
