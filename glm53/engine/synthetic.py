"""A runner with no model and no arrays: it executes step plans by completing their transfers at once
and returning synthetic tokens. It drives the real scheduler, block pool and KV policies cheaply (the
scheduler benchmark, the scheduler's state-machine test, and the check that a plan is all a runner
needs: the same requests give the same block-pool history as under the model runner).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping

import numpy as np

from glm53.engine.plan import PlanRow, StepPlan, StepResult
from glm53.engine.spec_decode import SpeculativeConfig
from kvcache.transfer import ResetLease, Transfer, bytes_moved


class SyntheticRunner:
    """`glm53.engine.plan.Runner` without a model.

    token: the token a sampling row returns (default: 0 for every row).
    page_bytes: per cache group, bytes of one page (kvcache.layout.page_bytes, e.g. `Engine.sizes`), to
        count what the transfers move; None: no plan may carry a transfer that moves KV.
    record: keep every executed transfer in `executed` (in execution order).
    spec: MTP (glm53.engine.spec_decode.SpeculativeConfig, e.g. `DeployConfig.speculative`), or None. The
        target's token at each position a row verifies is `token` of the row cut there (a row computing
        positions [start, p] with num_generated counting the drafts before p). Standard rule: a draft
        stands iff it is that token. Synthetic: the number of drafts that stand comes from the rates with
        a uniform hashed from (request, tokens generated). Drafts for the next step: `draft(row, i)` for a
        row cut as the next step's i-th verified position (default: `token` itself, a drafter that is
        always right).
    """

    def __init__(self, token: Callable[[PlanRow], int] | None = None, page_bytes: Mapping[str, int] | None = None,
                 record: bool = False, *, spec: SpeculativeConfig | None = None,
                 draft: Callable[[PlanRow], int] | None = None):
        self.token = token or (lambda row: 0)
        self.page_bytes = page_bytes
        self.executed: list[Transfer] | None = [] if record else None
        self.steps = 0
        self.spec = spec
        self.draft = draft or self.token

    def execute(self, plan: StepPlan) -> StepResult:
        d2h = h2d = 0
        for op in plan.transfers:
            if self.page_bytes is None and not isinstance(op, ResetLease):
                raise ValueError("SyntheticRunner: a plan moves KV but the runner has no page_bytes to count it")
            a, b = bytes_moved(op, self.page_bytes or {})
            d2h, h2d = d2h + a, h2d + b
        if self.executed is not None:
            self.executed.extend(plan.transfers)
        self.steps += 1
        if self.spec is None:
            tokens = {row.req_id: (int(self.token(row)),) for row in plan.rows if row.sample}
            return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d)
        tokens, drafts = {}, {}
        for row in plan.rows:
            if row.sample:
                tokens[row.req_id], drafts[row.req_id] = self._verify(row)
        return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d, drafts=drafts)

    def _verify(self, row: PlanRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A row's tokens under MTP (the drafts that stood, then the target's next) and its next drafts."""
        nd, k = row.num_draft_tokens, self.spec.num_speculative_tokens
        known = row.num_tokens - nd  # the row's tokens before its drafts
        given = [int(t) for t in row.token_ids[known:]]
        rates = self.spec.acceptance_rates
        if rates is not None:
            u = zlib.crc32(f"{row.req_id}:{row.num_generated}:accept".encode()) / 2 ** 32
            accepted = sum(1 for r in rates[:nd] if u < r)
        else:
            accepted = next((i for i, d in enumerate(given) if d != int(self.token(_cut(row, known + i)))), nd)
        out = tuple(given[:accepted]) + (int(self.token(_cut(row, known + accepted))),)
        first = known + accepted + 1  # the next step verifies from the position after this row's last token
        return out, tuple(int(self.draft(_cut(row, first + i))) for i in range(k))


def _cut(row: PlanRow, n: int) -> PlanRow:
    """`row` as a row of its first n positions (tokens past its own are zeros): what a non-speculative
    step computing up to position start + n - 1 would be, num_generated counting the tokens between."""
    known = row.num_tokens - row.num_draft_tokens
    ids = np.zeros(n, np.int32)
    ids[: min(n, row.num_tokens)] = row.token_ids[:n]
    return dataclasses.replace(row, token_ids=ids, num_draft_tokens=0, num_generated=row.num_generated + n - known)
