"""A runner with no model and no arrays: it executes step plans by completing their transfers at once
and returning synthetic tokens. It drives the real scheduler, block pool and KV policies cheaply (the
scheduler benchmark, the scheduler's state-machine test, and the check that a plan is all a runner
needs: the same requests give the same block-pool history as under the model runner).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from glm53.engine.plan import PlanRow, StepPlan, StepResult
from kvcache.transfer import ResetLease, Transfer, bytes_moved


class SyntheticRunner:
    """`glm53.engine.plan.Runner` without a model.

    token: the token a sampling row returns (default: 0 for every row).
    page_bytes: per cache group, bytes of one page (kvcache.layout.page_bytes, e.g. `Engine.sizes`), to
        count what the transfers move; None: no plan may carry a transfer that moves KV.
    record: keep every executed transfer in `executed` (in execution order).
    """

    def __init__(self, token: Callable[[PlanRow], int] | None = None, page_bytes: Mapping[str, int] | None = None,
                 record: bool = False):
        self.token = token or (lambda row: 0)
        self.page_bytes = page_bytes
        self.executed: list[Transfer] | None = [] if record else None
        self.steps = 0

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
        tokens = {row.req_id: (int(self.token(row)),) for row in plan.rows if row.sample}
        return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d)
