"""A runner with no model and no arrays: it executes step plans by completing their transfers at once
and returning synthetic tokens. It drives the real scheduler, block pool and KV policies cheaply (the
scheduler benchmark, the scheduler's state-machine test, and the check that a plan is all a runner
needs: the same requests give the same block-pool history as under the model runner).

Secondary tiers (the offload policy's `TierStore` / `TierLoad`) run on simulated tiers
(kvcache.tiers.sim.SimTier: keys and sizes, no bytes) that the engine asks the runner for
(`make_tiers`). They see the runner's time: a SyntheticRunner has no priced steps, so its time moves
only when a step has nothing to compute and waits for a tier (to the next store or load it finishes);
the simulator (glm53.engine.sim.SimRunner) follows the engine's virtual clock and its priced steps.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from glm53.engine.plan import PlanRow, StepPlan, StepResult
from glm53.engine.spec_decode import SpeculativeConfig
from kvcache.tiers import TierSet
from kvcache.tiers.sim import INSTANT, SimTier, TierCosts
from kvcache.transfer import ResetLease, TierLoad, TierStore, Transfer, bytes_moved


class SyntheticRunner:
    """`glm53.engine.plan.Runner` without a model.

    token: the token a sampling row returns (default: 0 for every row).
    page_bytes: per cache group, bytes of one page (kvcache.layout.page_bytes, e.g. `Engine.sizes`), to
        count what the transfers move; None: no plan may carry a transfer that moves KV.
    record: keep every executed transfer in `executed` (in execution order).
    tier_costs: per secondary-tier type ("fs", ...), the simulated device behind it
        (kvcache.tiers.sim.TierCosts); None: every type costs nothing (loads finish when submitted).
    spec: MTP (glm53.engine.spec_decode.SpeculativeConfig, e.g. `DeployConfig.speculative`), or None. The
        target's token at each position a row verifies is `token` of the row cut there (a row computing
        positions [start, p] with num_generated counting the drafts before p). Standard rule: a draft
        stands iff it is that token. Synthetic: the number of drafts that stand comes from the rates with
        a uniform hashed from (request, tokens generated). Drafts for the next step: `draft(row, i)` for a
        row cut as the next step's i-th verified position (default: `token` itself, a drafter that is
        always right).
    """

    def __init__(self, token: Callable[[PlanRow], int] | None = None, page_bytes: Mapping[str, int] | None = None,
                 record: bool = False, tier_costs: Mapping[str, TierCosts] | None = None, *,
                 spec: SpeculativeConfig | None = None, draft: Callable[[PlanRow], int] | None = None):
        self.token = token or (lambda row: 0)
        self.page_bytes = page_bytes
        self.executed: list[Transfer] | None = [] if record else None
        self.steps = 0
        self.spec = spec
        self.draft = draft or self.token
        self.tier_costs = tier_costs
        self.tiers: TierSet | None = None
        self._t = 0.0  # the runner's time: "now" for its simulated tiers

    def make_tiers(self, specs: Sequence[dict], fingerprint: str = "", replica: int = 0) -> TierSet:
        """Simulated tiers for DeployConfig's secondary_tiers entries (the engine calls this instead of
        kvcache.tiers.make_tier): one SimTier per entry, named as the entry names it ("name", else its
        type), holding up to its "max_bytes", on the device `tier_costs` gives its type. The runner then
        executes the plans' TierStore / TierLoad on them and reports finished loads."""
        tiers = []
        for spec in specs:
            kind = spec.get("type")
            if self.tier_costs is None:
                costs = INSTANT
            elif kind in self.tier_costs:
                costs = self.tier_costs[kind]
            else:
                raise ValueError(f"the simulator has no cost model for a secondary tier of type {kind!r} "
                                 f"(types with one: {sorted(self.tier_costs)})")
            tiers.append(SimTier(clock=self._now, costs=costs, max_bytes=spec.get("max_bytes"),
                                 name=spec.get("name") or kind))
        self.tiers = TierSet(tiers)
        return self.tiers

    def _now(self) -> float:
        return self._t

    def execute(self, plan: StepPlan) -> StepResult:
        res = self._run(plan)
        _, loads = self._end_step(plan, 0.0)
        return dataclasses.replace(res, tier_loads=loads) if loads else res

    def _run(self, plan: StepPlan) -> StepResult:
        """The plan's transfers (tier jobs submitted at the runner's time now) and its tokens."""
        d2h = h2d = 0
        for op in plan.transfers:
            if self.page_bytes is None and not isinstance(op, ResetLease):
                raise ValueError("SyntheticRunner: a plan moves KV but the runner has no page_bytes to count it")
            a, b = bytes_moved(op, self.page_bytes or {})
            d2h, h2d = d2h + a, h2d + b
            if isinstance(op, (TierStore, TierLoad)):
                self._submit(op)
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

    def _submit(self, op: TierStore | TierLoad) -> None:
        if self.tiers is None:
            raise ValueError("SyntheticRunner: a plan moves KV to or from secondary tiers, but the runner made none "
                             "(the engine calls make_tiers)")
        size = self.page_bytes[op.group]
        if isinstance(op, TierStore):  # the sizes stand for the host pages' bytes
            self.tiers.store(op.keys, (size,) * len(op.keys))
        else:  # one job per chunk, as kvcache.host.HostMemory submits them
            for job, key in zip(op.jobs, op.keys):
                self.tiers.load(op.tier, job, (key,), (size,))

    def _end_step(self, plan: StepPlan, seconds: float) -> tuple[float, tuple[tuple[int, str], ...]]:
        """The step takes `seconds` from the runner's time now; one that computes nothing while its tiers
        have jobs pending lasts until the first of them finishes (a load first: the only requests left are
        waiting for one, or for a store a lookup answered RETRY to). -> (seconds, the loads finished by the
        step's end, as StepResult.tier_loads)."""
        if self.tiers is None:
            self._t += seconds
            return seconds, ()
        if not plan.rows:
            tiers = self.tiers.tiers
            nxt = min((t for x in tiers if (t := x.next_load_s()) is not None), default=None)
            if nxt is None:
                nxt = min((t for x in tiers if (t := x.next_event_s()) is not None), default=None)
            if nxt is not None:
                seconds = max(seconds, nxt - self._t)
        self._t += seconds
        return seconds, tuple((r.job_id, r.status[0]) for r in self.tiers.poll())


def _cut(row: PlanRow, n: int) -> PlanRow:
    """`row` as a row of its first n positions (tokens past its own are zeros): what a non-speculative
    step computing up to position start + n - 1 would be, num_generated counting the tokens between."""
    known = row.num_tokens - row.num_draft_tokens
    ids = np.zeros(n, np.int32)
    ids[: min(n, row.num_tokens)] = row.token_ids[:n]
    return dataclasses.replace(row, token_ids=ids, num_draft_tokens=0, num_generated=row.num_generated + n - known)
