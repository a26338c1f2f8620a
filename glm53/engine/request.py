"""Requests, sampling parameters and outputs."""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Callable

import numpy as np

SEED_RANGE = (-(1 << 63), 1 << 63)  # seeds are int64, as OpenAI's and vLLM's APIs take them: [lo, hi)
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 64  # logit_bias entries per request: the sampler's bias arrays are [rows, MAX_LOGIT_BIAS]
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range of a bias value


def is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (a lone surrogate from JSON's \\ud800 escapes does not): what a
    request's strings must be before they reach a tokenizer, a hash or an error body."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestError(ValueError):
    """A request the engine refuses. field: the engine's name of what is wrong (a SamplingParams field,
    "prompt_ids", "salt", "kv_peer"), so a server can name its own field for it without reading the
    message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens >= 1; greedy (argmax, lowest id on ties) or temperature / top-p sampling driven by a
    per-request PRNG key derived from `seed` (same seed, same tokens, whatever the batch). seed: any int64,
    [-2^63, 2^63) (the range an OpenAI client may send); the sampler keys on `prng_seed`, its uint32 image.

    stop_token_ids: sampling one of them finishes the request (finish_reason "stop"; the token is the
        last of its output), as vLLM's stop_token_ids and a checkpoint's EOS do. min_tokens: until that
        many tokens are out, the stop tokens cannot be sampled (their logits are masked, vLLM's rule).

    The logit rules, vLLM's, in the order the sampler applies them (glm53.engine.logits; docs/engine.md):
    logit_bias: ((token id, bias in [-100, 100]), ...), at most MAX_LOGIT_BIAS entries, ids unique: added
        to the logits. repetition_penalty > 0 (1 = off): a token seen in the prompt or the output has a
        positive logit divided by it, a negative one multiplied. frequency_penalty, presence_penalty in
        [-2, 2] (0 = off): subtracted, x the token's count in the output / once if it is in the output.
    Greedy rows then take the argmax; sampled rows divide by temperature, then min_p in [0, 1] (0 = off:
        tokens below min_p x the top token's probability go), top_k (0 = off, else >= 1: tokens below the
        k-th largest logit go, ties kept), top_p in (0, 1] (the smallest most-likely set whose mass reaches
        top_p stays).
    logprobs: None, or 0..MAX_LOGPROBS: each generated token comes with its log-probability, its rank and
        that many most likely alternatives, from the model's raw logits (log-softmax before any rule:
        vLLM's default logprobs_mode "raw_logprobs").
    prompt_logprobs: None, or 0..MAX_LOGPROBS: each prompt token after the first comes with its raw logprob
        given the tokens before it, its rank and that many alternatives (`Request.prompt_logprobs`). Such a
        request takes nothing from the prefix cache (`Request.extra_keys`): a cached token's logits were
        never computed for it."""

    max_new_tokens: int = 16
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) \
                or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise RequestError("seed", f"seed must be an int in [-2^63, 2^63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # a numpy integer becomes a Python int (prng_seed's math)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError("max_new_tokens", f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.greedy and not self.temperature > 0:
            raise RequestError("temperature", f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise RequestError("stop_token_ids", f"stop_token_ids must be a tuple of token ids >= 0, got {ids!r}")
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.max_new_tokens:
            raise RequestError("min_tokens",
                               f"min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], got {m!r}")
        k = self.top_k
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise RequestError("top_k", f"top_k must be an int >= 1, or 0 / -1 for off, got {k!r}")
        object.__setattr__(self, "top_k", max(k, 0))
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 1e6:
            raise RequestError("repetition_penalty", f"repetition_penalty must be > 0 (1 = off), got "
                                                     f"{self.repetition_penalty!r}")
        bias = self.logit_bias
        ok = isinstance(bias, tuple) and all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], int) and not isinstance(e[0], bool)
            and e[0] >= 0 and _is_number(e[1]) and LOGIT_BIAS_RANGE[0] <= e[1] <= LOGIT_BIAS_RANGE[1] for e in bias)
        if not ok or len({t for t, _ in bias}) != len(bias):
            raise RequestError("logit_bias", f"logit_bias must map distinct token ids >= 0 to biases in "
                                             f"{list(LOGIT_BIAS_RANGE)}, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError("logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise RequestError("logprobs", f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {lp!r}")
        lp = self.prompt_logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise RequestError("prompt_logprobs",
                               f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {lp!r}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on: the sampler then needs the row's prompt and output tokens."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether a rule changes the logits before greedy or sampling (a penalty or a logit bias)."""
        return self.penalized or bool(self.logit_bias)

    @property
    def prng_seed(self) -> int:
        """`seed` as the sampler's uint32 PRNG seed: a seed in [0, 2^32) is itself (so such a seed samples
        what the sampler always gave it); any other is folded from its two's-complement 64 bits (low word +
        high word x an odd constant, mod 2^32). Equal seeds give equal keys; a 64-to-32-bit map must send
        some distinct seeds to one key."""
        s = self.seed % (1 << 64)
        return (s + (s >> 32) * 0x9E3779B1) % (1 << 32)

    def banned(self, num_generated: int) -> tuple[int, ...]:
        """Token ids the next sample must not take, with `num_generated` tokens out so far."""
        return self.stop_token_ids if num_generated < self.min_tokens else ()


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and bool(np.isfinite(v))


def _check_range(field: str, v, lo: float, hi: float) -> None:
    if not _is_number(v) or not lo <= v <= hi:
        raise RequestError(field, f"{field} must be a number in [{lo}, {hi}], got {v!r}")


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprobs from the model's raw logits: its own (logprob, rank: 1 + the tokens
    more likely than it), and the `logprobs` most likely tokens as ((token id, logprob), ...), most likely
    first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One request's state. `num_computed_tokens`: leading tokens of `all_token_ids` whose KV is in the
    cache (from the prefix cache or computed). Times are the engine clock's seconds."""

    req_id: str
    prompt_ids: np.ndarray
    params: SamplingParams
    salt: str = ""
    arrival_s: float = 0.0
    # P/D consumer: "host:port" of the producer's peer tier its prompt's KV comes from (kv_transfer_params)
    kv_peer: str | None = None
    kv_lease: int = 0  # and that producer's lease on them (its remote_lease; 0: none), released by our lookup
    # and its page spans where they differ from ours (kvcache.tiers.PageSpans; None: the same chunks)
    kv_remote: object = None
    # P/D producer leg: the leading prompt tokens a consumer takes (all but the last), whose last partial
    # page its finish also stores (kvcache.host_tier.HostTier.store_tail); 0: not a prefill leg
    kv_produce: int = 0
    finished_in_plan: int = -1  # Engine.plans_run of its replica when it finished (a later plan parks its KV)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    num_preemptions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    scheduled_s: float | None = None  # when a step first scheduled it (the end of its queue time)
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"; set when it finishes
    error: str | None = None  # with finish_reason "error": what failed (its step, or its stop_check)
    num_cached_tokens: int = 0  # prompt tokens its first admission found in a cache (not computed)
    # MTP: draft tokens proposed after its last step, verified by its next one (vLLM's spec_token_ids);
    # positions num_tokens .. num_tokens + len - 1. Dropped when it is preempted.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # with params.logprobs: one TokenLogprobs per output token, in order (appended with it, in the step)
    output_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # with params.prompt_logprobs: entry q - 1 is prompt token q's TokenLogprobs (q = 1 .. prompt size - 1),
    # filled chunk by chunk as the prefill runs (a chunk computed again after preemption adds nothing)
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # n > 1: the sibling whose prompt KV this one waits to find in the prefix cache (one prefill for all)
    prefill_after: str | None = None
    # stop strings (a server's detokenizer, glm53.tokenizer.TextStream.add): called with each generated
    # token in order, it returns the stop string the text now reaches (the request finishes "stop" on that
    # token, as on a stop token) or None. It runs on the engine's thread, inside the step.
    stop_check: Callable[[int], str | None] | None = dataclasses.field(default=None, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids.tolist() + self.output_ids

    @property
    def tokens(self) -> TokenView:
        """Sliceable view of all_token_ids that builds only the slice asked for."""
        return TokenView(self)

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """all_token_ids[start:end] without building the whole list (O(end - start), not O(context))."""
        p = self.prompt_ids.size
        if start >= p:  # a decoding row: generated tokens only
            return np.asarray(self.output_ids[start - p : end - p], np.int32)
        head = self.prompt_ids[start:min(end, p)]
        if end <= p:
            return head
        return np.concatenate([head, np.asarray(self.output_ids[max(start - p, 0) : end - p], np.int32)])

    @property
    def num_tokens(self) -> int:
        return self.prompt_ids.size + len(self.output_ids)

    def penalty_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """The penalties' input (PlanRow.penalty_tokens): the distinct ids of prompt and output, int32 [L], and
        each one's count in the output, float32 [L]. O(context log context) per call: the price of keeping
        no per-request state on the device."""
        out = np.asarray(self.output_ids, np.int32)
        ids, inverse = np.unique(np.concatenate([self.prompt_ids.astype(np.int32), out]), return_inverse=True)
        counts = np.bincount(inverse[self.prompt_ids.size:], minlength=ids.size).astype(np.float32)
        return ids.astype(np.int32), counts

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """The prefix cache's extra hash keys: the salt, and for a request with prompt_logprobs its own id, so
        its lookup finds nothing (every prompt position's logits get computed, as vLLM skips the prefix
        cache for it) and no other request shares its pages."""
        keys = (self.salt,) if self.salt else ()
        return keys + (f"prompt_logprobs:{self.req_id}",) if self.params.prompt_logprobs is not None else keys

    def check_stop(self) -> str | None:
        """Why the request is done after the token just appended: "stop" (a stop token, or `stop_check`
        found a stop string), "length" (max_new_tokens), "error" (`stop_check` raised: the exception is in
        `error`; this request alone ends, the step and the others go on), or None (not done). Call it once
        per generated token, in order: it hands that token to `stop_check`."""
        out = self.output_ids
        try:
            text_stop = self.stop_check(out[-1]) if self.stop_check is not None and out else None
        except Exception as e:  # noqa: BLE001 - a client's detokenizer failing is that request's end, not the step's
            self.error = f"its stop check failed: {type(e).__name__}: {e}"
            return "error"
        if out and out[-1] in self.params.stop_token_ids and len(out) >= self.params.min_tokens:
            return "stop"
        if text_stop is not None:
            return "stop"
        return "length" if len(out) >= self.params.max_new_tokens else None


class TokenView:
    """`request.tokens[a:b]` == `request.all_token_ids[a:b]` (as int32 array), in O(b - a)."""

    __slots__ = ("req",)

    def __init__(self, req: Request):
        self.req = req

    def __len__(self) -> int:
        return self.req.num_tokens

    def __getitem__(self, s: slice) -> np.ndarray:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("TokenView supports contiguous slices only")
        start, stop, _ = s.indices(self.req.num_tokens)
        return self.req.token_slice(start, max(start, stop))


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request: generated token ids and timestamps (engine clock, seconds)."""

    req_id: str
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    arrival_s: float
    first_token_s: float
    finish_s: float
    token_times_s: tuple[float, ...]
    num_preemptions: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s
