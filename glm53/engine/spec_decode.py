"""MTP speculative decoding: vLLM's `speculative_config`, the accept rule, and the counters.

One step of a decoding request with drafts: the target model verifies the row's last sampled token and
its k draft tokens (positions s .. s+k) in one step; `rejection_sample` decides how many drafts stand
(a) and samples one more token from the target at position s+a (the bonus, or the replacement of the
first rejected draft), so a step yields a+1 tokens. The checkpoint's MTP layer then drafts the next k
tokens (glm53.engine.runner). This module holds the pieces that need no model:

- `SpeculativeConfig`: vLLM's keys (`method`, `num_speculative_tokens`, `rejection_sample_method`,
  `synthetic_acceptance_length` / `synthetic_acceptance_rates`, `draft_sample_method`) plus one of ours,
  `verify` (how the runner computes the verify step, see `SpeculativeConfig`).
- `rejection_sample`: greedy rows accept a draft iff it is the target's argmax; sampled rows run
  rejection sampling against the target distribution (temperature, min-p, top-k, top-p), with the drafts as one-hot
  proposals (vLLM's draft_sample_method="greedy": the MTP layer drafts by argmax), which leaves the
  output distributed exactly as the target's; synthetic rows accept a number of drafts drawn from the
  configured per-position rates whatever the tokens are (vLLM's benchmark mode: the text is meaningless,
  the acceptance length is what was asked for).
- `SpecDecodeStats`: vLLM's spec-decode counters (`vllm:spec_decode_num_drafts`, ...).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from glm53.engine.logits import filter_sampled

METHODS = ("mtp",)
REJECTION_METHODS = ("standard", "synthetic")
VERIFY_MODES = ("auto", "sequential", "batched")
KEYS = ("method", "num_speculative_tokens", "rejection_sample_method", "synthetic_acceptance_length",
        "synthetic_acceptance_rates", "draft_sample_method", "verify")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for GLM-5.3's MTP layer, e.g. {"method": "mtp",
    "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", "synthetic_acceptance_length":
    2.99}.

    method: "mtp" (the checkpoint's MTP layer drafts autoregressively, one token per pass).
    num_speculative_tokens: drafts per step (k >= 1).
    rejection_sample_method: "standard" (greedy: a draft stands iff it is the target's argmax, so the
        output equals non-speculative greedy decoding; sampled: rejection sampling that keeps the target
        distribution) or "synthetic" (benchmarks: acceptance drawn from fixed per-position rates).
    synthetic_acceptance_rates: synthetic only, k unconditional rates, non-increasing, in [0, 1]: entry i
        is the probability that the first i+1 drafts all stand (vLLM's definition).
    synthetic_acceptance_length: synthetic only, instead of the rates: a mean acceptance length L in
        [1, k+1] (counting the target's own token), resolved to [1]*floor(L-1) + [frac(L-1)] + [0]*... (L =
        2.99 with k = 3: [1.0, 0.99, 0.0]). Exactly one of the two with "synthetic".
    draft_sample_method: "greedy" (the only one built: drafts are the MTP layer's argmax and count as
        one-hot proposals).
    verify (ours, not vLLM's): how the model runner computes a verify step. "sequential": the 1+k
        positions run as one-token decode steps one after the other inside one program, so each
        position's logits are bitwise those of a one-token decode step and greedy outputs cannot differ
        from non-speculative decoding by rounding; "batched": one forward over the 1+k tokens (what a
        GPU wants: the weights are read once), equal to decoding up to float rounding; "auto"
        (default): sequential on CPU, batched elsewhere. Under kv_policy="hisparse" a batched step
        resolves one plan for the union of its positions' selections, so its hot buffer must hold
        (1 + k) x top-k rows (else "auto" is sequential and "batched" is refused).
    """

    num_speculative_tokens: int
    method: str = "mtp"
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    draft_sample_method: str = "greedy"
    verify: str = "auto"

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """Check a speculative_config dict (unknown keys are refused, so a typo is not ignored)."""
        if not isinstance(d, dict):
            raise ValueError(f"DeployConfig.speculative_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - set(KEYS)
        if unknown:
            raise ValueError(f"DeployConfig.speculative_config: unknown keys {sorted(unknown)} (known: {list(KEYS)})")
        if d.get("method") not in METHODS:
            raise ValueError(f"DeployConfig.speculative_config['method'] must be one of {METHODS}, got "
                             f"{d.get('method')!r} (GLM-5.3 drafts with its own MTP layer)")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"DeployConfig.speculative_config['num_speculative_tokens'] must be an int >= 1, "
                             f"got {k!r}")
        rej = d.get("rejection_sample_method", "standard")
        if rej not in REJECTION_METHODS:
            raise ValueError(f"DeployConfig.speculative_config['rejection_sample_method'] must be one of "
                             f"{REJECTION_METHODS}, got {rej!r}")
        draft = d.get("draft_sample_method", "greedy")
        if draft != "greedy":
            raise NotImplementedError(f"speculative_config draft_sample_method={draft!r}: only 'greedy' is built "
                                      "(the MTP layer drafts by argmax)")
        verify = d.get("verify", "auto")
        if verify not in VERIFY_MODES:
            raise ValueError(f"DeployConfig.speculative_config['verify'] must be one of {VERIFY_MODES}, got {verify!r}")
        rates, length = d.get("synthetic_acceptance_rates"), d.get("synthetic_acceptance_length")
        if rej != "synthetic":
            if rates is not None or length is not None:
                raise ValueError("speculative_config synthetic_acceptance_rates / synthetic_acceptance_length are only "
                                 "valid with rejection_sample_method='synthetic'")
        elif (rates is None) == (length is None):
            raise ValueError("speculative_config rejection_sample_method='synthetic' needs exactly one of "
                             "synthetic_acceptance_rates and synthetic_acceptance_length")
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, (int, float)) or not 1 <= length <= k + 1:
                raise ValueError(f"speculative_config synthetic_acceptance_length must be a number in [1, "
                                 f"num_speculative_tokens + 1 = {k + 1}], got {length!r}")
            length = float(length)
        if rates is not None:
            ok = isinstance(rates, (list, tuple)) and len(rates) == k and all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates)
            if not ok or any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"speculative_config synthetic_acceptance_rates must be {k} non-increasing numbers "
                                 f"in [0, 1] (one per draft position), got {rates!r}")
            rates = tuple(float(r) for r in rates)
        return cls(num_speculative_tokens=k, method=d["method"], rejection_sample_method=rej,
                   synthetic_acceptance_rates=rates, synthetic_acceptance_length=length, draft_sample_method=draft,
                   verify=verify)

    def as_dict(self) -> dict:
        """The vLLM-shaped dict (keys left at their defaults omitted)."""
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.rejection_sample_method != "standard":
            out["rejection_sample_method"] = self.rejection_sample_method
        if self.synthetic_acceptance_rates is not None:
            out["synthetic_acceptance_rates"] = list(self.synthetic_acceptance_rates)
        if self.synthetic_acceptance_length is not None:
            out["synthetic_acceptance_length"] = self.synthetic_acceptance_length
        if self.verify != "auto":
            out["verify"] = self.verify
        return out

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @property
    def acceptance_rates(self) -> tuple[float, ...] | None:
        """Synthetic mode: the k unconditional per-position rates (entry i: probability that drafts 0..i all
        stand); None otherwise."""
        if not self.synthetic:
            return None
        if self.synthetic_acceptance_rates is not None:
            return self.synthetic_acceptance_rates
        return length_to_rates(self.synthetic_acceptance_length, self.num_speculative_tokens)

    def verify_mode(self, platform: str) -> str:
        """"sequential" or "batched" on a device of `platform` ("cpu", "gpu", ...)."""
        if self.verify != "auto":
            return self.verify
        return "sequential" if platform == "cpu" else "batched"

    def verify_form(self, platform: str, *, rows_limit: int | None = None, index_topk: int = 0) -> str:
        """The verify form a runner on `platform` computes: `verify_mode`, except under a policy whose
        decode rows read through a device buffer of `rows_limit` rows (its `verify_rows_limit`: HiSparse's
        hot buffer; None: no limit). A batched step resolves one plan for the union of its 1 + k positions'
        selections, so the buffer must hold (1 + k) x index_topk rows: "auto" falls back to "sequential"
        (resolving one position at a time), "batched" is refused (ValueError). The model runner computes
        this form and the simulator prices it."""
        mode = self.verify_mode(platform)
        need = (1 + self.num_speculative_tokens) * index_topk
        if rows_limit is not None and mode == "batched" and rows_limit < need:
            if self.verify == "batched":
                raise ValueError(f"speculative_config verify='batched' with kv_policy='hisparse' resolves the union "
                                 f"of {1 + self.num_speculative_tokens} positions' selections at once: the hot buffer "
                                 f"needs >= {1 + self.num_speculative_tokens} x top-k = {need} rows, got "
                                 f"hisparse_device_buffer_size={rows_limit}")
            mode = "sequential"
        return mode


def length_to_rates(length: float, k: int) -> tuple[float, ...]:
    """A mean acceptance length L in [1, k+1] -> k unconditional rates spending it on the earliest
    positions: [1]*floor(L-1) + [frac(L-1)] + [0]*... (vLLM's minimum-variance schedule). The mean
    acceptance length of the rates is 1 + their sum = L."""
    whole = min(k, math.floor(length - 1))
    rates = [1.0] * whole
    if whole < k:
        rates.append(round(length - 1 - whole, 12))
    return tuple(rates + [0.0] * (k - len(rates)))


# ------------------------------------------------------------------------------------------ accept rule
@jax.jit
def rejection_sample(logits_RJV, drafts_RK, num_drafts_R, greedy_R, temps_R, top_ks_R, top_ps_R, min_ps_R, seeds_R,
                     counters_R, rates_K):
    """The accept rule of one verify step, per row.

    logits_RJV: float32 [R, K+1, V], the target's logits at positions s .. s+K (stop tokens a row may not
        sample yet already at -inf). drafts_RK: int32 [R, K], the drafts at positions s+1 .. s+K (entries
        past num_drafts_R are ignored). greedy_R: bool; temps_R, top_ks_R (int32), top_ps_R, min_ps_R: the
        sampled rows' rules (glm53.engine.logits.filter_sampled, the plain sampler's: the same target);
        seeds_R uint32 / counters_R int32: the row's PRNG key is fold_in(key(seed), counter), counter = the
        tokens it generated before this step, so no key repeats across its steps. rates_K: float32 [K],
        the synthetic unconditional rates, or a [K] array of NaN for the standard rule.
    -> (tokens [R, K+1] int32: the row's drafts that stand then its next token, valid up to index
        accepted; accepted [R] int32 in [0, num_drafts]).

    Standard, greedy row: draft i stands iff it equals argmax(logits[i]) (and all before it stood); the
    next token is argmax(logits[accepted]). Standard, sampled row: with p_j the target distribution at
    position j, draft i stands with probability p_i(draft_i) (a one-hot proposal q: min(1, p / q)); at the
    first rejection the token is drawn from p_i with draft_i removed (the normalised residual max(p - q,
    0)); if all stand, from p_K. Each token of the output is then distributed as the target's (Leviathan et
    al. 2023). Synthetic: one uniform U per row, accepted = #{i < num_drafts : U < rate_i} (so P(accepted
    >= i+1) = rate_i), whatever the tokens; the next token is argmax (greedy) or a draw from p_accepted."""
    k1 = logits_RJV.shape[1]
    synthetic = ~jnp.isnan(rates_K[0]) if rates_K.shape[0] else jnp.bool_(False)

    def one(logits_JV, drafts_K, nd, greedy, temp, top_k, top_p, min_p, seed, counter):
        base = jax.random.fold_in(jax.random.key(seed), counter)
        j = jnp.arange(k1)
        logits_JV = logits_JV.astype(jnp.float32)
        filt_JV = jax.vmap(filter_sampled, in_axes=(0, None, None, None, None))(logits_JV, temp, top_k, top_p, min_p)
        logp_JV = jax.nn.log_softmax(filt_JV, axis=-1)
        argmax_J = jnp.argmax(logits_JV, axis=-1).astype(jnp.int32)
        d = drafts_K[: k1 - 1]
        in_range = j[: k1 - 1] < nd
        # standard: does draft i stand (on its own)?
        u_K = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(base, 2 * i)))(j[: k1 - 1])
        p_draft = jnp.exp(jnp.take_along_axis(logp_JV[: k1 - 1], jnp.maximum(d, 0)[:, None], axis=1)[:, 0])
        stands = jnp.where(greedy, d == argmax_J[: k1 - 1], u_K < p_draft) & in_range
        accepted_std = jnp.argmin(jnp.concatenate([stands, jnp.zeros(1, bool)]))  # first False
        u = jax.random.uniform(jax.random.fold_in(base, 2 * k1 + 1))
        accepted_syn = jnp.sum((u < rates_K) & in_range)
        accepted = jnp.where(synthetic, accepted_syn, accepted_std).astype(jnp.int32)
        # the next token: argmax, or a draw from p_accepted, without the rejected draft if one was rejected
        rejected = (~synthetic) & (accepted < nd)
        logits_next = filt_JV[accepted]
        banned = jnp.where(rejected, drafts_K[jnp.minimum(accepted, k1 - 2)], -1) if k1 > 1 else -1
        logits_next = jnp.where(jnp.arange(logits_next.shape[0]) == banned, -jnp.inf, logits_next)
        drawn = jax.random.categorical(jax.random.fold_in(base, 2 * accepted + 1), logits_next).astype(jnp.int32)
        nxt = jnp.where(greedy, argmax_J[accepted], drawn)
        tokens = jnp.where(j < accepted, jnp.concatenate([d, jnp.zeros(1, d.dtype)]), 0)
        tokens = jnp.where(j == accepted, nxt, tokens)
        return tokens.astype(jnp.int32), accepted

    return jax.vmap(one)(logits_RJV, drafts_RK, num_drafts_R, greedy_R, temps_R, top_ks_R, top_ps_R, min_ps_R, seeds_R,
                         counters_R)


def rates_array(spec: SpeculativeConfig | None, k: int) -> np.ndarray:
    """`rejection_sample`'s rates_K argument: the synthetic rates, or NaN (the standard rule)."""
    rates = spec.acceptance_rates if spec is not None else None
    return np.full(k, np.nan, np.float32) if rates is None else np.asarray(rates, np.float32)


# ----------------------------------------------------------------------------------------------- counters
@dataclasses.dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters, per scheduler (engine.metrics sums replicas). A draft is one step of
    one request that verified drafts: num_drafts counts them, num_draft_tokens their tokens,
    num_accepted_tokens the drafts that stood, accepted_per_pos[i] the steps whose draft i stood. Counted
    as the rule decided, before a stop token or max_new_tokens drops what follows (vLLM counts so too).
    Mean acceptance length = 1 + num_accepted_tokens / num_drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = dataclasses.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_length_mean(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")
