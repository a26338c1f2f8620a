"""One engine step as data: the scheduler's `StepPlan`, a runner's `StepResult`, and the `Runner` and
`Clock` protocols that connect them.

    plan = scheduler.schedule()        # decides: rows, block tables, KV transfers (touches no arrays)
    result = runner.execute(plan)      # computes: transfers in order, the forward, sampling
    scheduler.update(plan, result)     # advances requests; policies decide what moves next

A plan is complete and frozen: a runner reads nothing else (not the scheduler, not a request), so any
runner can execute it: the model on one device or a mesh (glm53.engine.runner.ModelRunner), a runner
that returns synthetic tokens (glm53.engine.synthetic), a simulator that prices it. Field comments give
shape and why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from glm53.engine.request import SamplingParams
from kvcache.policies.hisparse import HiSparseRow
from kvcache.policies.hisparse.device import ResolveRecord, StageRecord  # StepResult's records, re-exported
from kvcache.transfer import Transfer


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One request's share of a step: the tokens whose KV it computes and whether it samples."""

    req_id: str
    # position of token_ids[0]; the row computes positions [start, start + num_tokens)
    start: int
    # int32 [num_tokens]: a prefill chunk, or the one token a decoding request feeds back
    token_ids: np.ndarray
    # whether the row samples after its last token (a prefill chunk short of the prompt's end does not)
    sample: bool
    # how to sample, and the PRNG counter: tokens the request generated before this step (a request
    # samples the same tokens whatever it is batched with)
    params: SamplingParams
    num_generated: int
    # the last num_draft_tokens of token_ids are draft tokens to verify (MTP speculative decoding): the
    # row returns between 1 and 1 + num_draft_tokens tokens (the drafts that stood, then the target's next)
    num_draft_tokens: int = 0
    # the known token after the row's last one (a prefill chunk short of the request's known tokens), else
    # -1: the MTP layer pairs each position's hidden state with the token after it, so a chunk's last
    # position needs the next chunk's first token (a row that samples pairs it with the sampled token)
    next_token: int = -1
    # with a penalty on (params.penalized) and `sample`: (the distinct token ids of the prompt and the output
    # so far, int32 [L]; how often each occurs in the output, float32 [L]): the penalties' whole input,
    # built per step on the host (Request.penalty_tokens), so the runner keeps no per-request state
    penalty_tokens: tuple[np.ndarray, np.ndarray] | None = None
    # with params.prompt_logprobs and a chunk holding prompt positions before the last: the prompt's size, so
    # the runner gives logprobs to the prompt tokens start + 1 .. min(start + num_tokens, prompt_len - 1)
    # (the chunk's last target is next_token); 0 otherwise
    prompt_len: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything one step runs, in the order a runner must do it: `transfers`, then the forward of
    `rows` over `block_tables`, then sampling."""

    # the scheduler's step index (0-based; steps that only move KV have no rows and no index of their own)
    step: int
    rows: tuple[PlanRow, ...]
    # per cache group ("mla", "indexer"), per row: the request's block ids in position order (-1: a page
    # with no device block, HiSparse only); one entry covers kvcache.block_pool tokens_per_block tokens
    # (the group's own page size)
    block_tables: Mapping[str, tuple[tuple[int, ...], ...]]
    # per row, the policy's data for its device half (KVPolicy.row_tables' second value; None for a policy
    # without one). HiSparse: the row's MLA pages' host-pool blocks and its hot-buffer lease
    policy_rows: tuple[HiSparseRow, ...] | None
    # KV movement the step needs, executed in order before the forward (kvcache.transfer's contract):
    # page copies to and from the host pools, offload saves and loads, hot-buffer resets
    transfers: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a runner reports for a plan."""

    # per request that sampled: its new tokens in order (one; or, for a row with draft tokens, the drafts
    # that stood and then the target's next token), in the runner's row order
    tokens: Mapping[str, tuple[int, ...]]
    # indices into plan.transfers of the operations that completed (all of them for the runners here;
    # an asynchronous runner may report some later)
    completed: frozenset[int]
    # bytes moved by the transfers and by the decode step's row copies
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    resolves: tuple[ResolveRecord, ...] = ()
    # secondary-tier loads (kvcache.transfer.TierLoad jobs, planned in this or an earlier step) that
    # finished since the runner's last result: ((job, "ok" | "miss" | "corrupt"), ...)
    tier_loads: tuple[tuple[int, str], ...] = ()
    # seconds the step takes when a runner prices it instead of running it (the simulator); None: it
    # ran, and the engine reads the time off its clock
    duration_s: float | None = None
    # MTP: per request that sampled, the draft tokens proposed for its next step (num_speculative_tokens
    # of them; the scheduler trims what the next step's budget or max_model_len leaves no room for)
    drafts: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # HiSparse prefill groups that staged host rows (their copies are in h2d_bytes)
    stages: tuple[StageRecord, ...] = ()
    # per request that sampled with params.logprobs: one glm53.engine.request.TokenLogprobs per token
    logprobs: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    # per row with PlanRow.prompt_len: (q, (TokenLogprobs, ...)): prompt tokens q, q + 1, ... given those before
    prompt_logprobs: Mapping[str, tuple] = dataclasses.field(default_factory=dict)


class Runner(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: the plan's transfers in order, the forward of its rows (their KV written), and
        sampling for the rows with `sample`."""


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin."""

    def sleep(self, seconds: float) -> None:
        """Let `seconds` pass (a client waiting for its next arrival; a virtual clock just advances)."""


class VirtualClock:
    """Simulated time: it moves only when told (`advance` by a priced step, `sleep` by a client waiting
    for its next arrival), so a simulated run's timings do not depend on the machine it runs on."""

    def __init__(self, t0: float = 0.0):
        self.t = float(t0)

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"VirtualClock.advance: seconds must be >= 0, got {seconds!r}")
        self.t += seconds


class WallClock:
    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))
