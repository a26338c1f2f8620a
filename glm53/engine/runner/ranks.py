"""One step of every DP x EP rank as one set of programs (`DeployConfig.experts_across_ranks`).

Each rank has its own scheduler, so a step is N plans, one per rank (None: the rank has nothing to run).
They run together because the ranks share the routed experts: every MoE layer's all-to-all needs all N
ranks in the same program (`parallel.model.forward_dp`), so a rank with no rows of some width still
passes that program padding rows (vLLM's dummy batches).

- Transfers: each rank's, in plan order, on its own slice of the pool and of the host pools (rank r's
  block b is page r x num_blocks + b of the runner's arrays, its host page h is r x host_blocks + h:
  the slices the "dp" split puts on rank r's device and its host memory).
- Forwards: one per width bucket present on any rank, in order of first appearance; every rank gets the
  same number of rows R (the most any rank pads its group to, a power of two) and the widest window,
  rank-major, so the programs are the one-device buckets with N x R rows (`ModelRunner.bucket_shapes`).
- Sampling: once over all N x R rows (under MTP the accept rule, the MTP layer's pass over the group and
  the draft passes, each one program over every rank's rows); each rank's result holds its own
  requests' tokens, drafts and logprobs.

- Secondary tiers: each rank's own (`ModelRunner.rank_tiers`, set by the engine): its stores go to its
  tiers, its loads come from them, its finished loads back in its result under its own job ids.

- A policy's device half (HiSparse): one half serves every rank (`DeviceHalf.bind(ranks=N)`); a rank's
  lease resets run on its own hot buffers (`transfer(op, rank)`), a group's views carry every rank's rows
  (each rank's host blocks and leases local to its slices), and each rank's resolve and staging counts
  come back in its own result (`take_rank_records`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import numpy as np

from glm53.engine.plan import PlanRow, StepPlan, StepResult
from glm53.engine.request import SamplingParams
from glm53.engine.runner.batch import forward_groups, step_limits
from kvcache.transfer import LoadKV, PageCopy, ResetLease, SaveKV, TierLoad, TierStore
from parallel.ep import all2all_bytes_per_slot, first_round_capacity

# a padding row: no tokens (positions all -1, nothing written), no table, never samples
_PAD = PlanRow("", 0, np.zeros(0, np.int32), False, SamplingParams(), 0)


def shift_transfer(op, rank: int, num_blocks: int, host_blocks: dict[str, int], ranks: int = 1):
    """Rank `rank`'s transfer `op` (ids local to its slices) -> the same operation on the runner's arrays.
    A secondary-tier load's job ids become job x ranks + rank (`rank_job`): the ranks' policies number
    their jobs independently, the runner tracks them in one table."""
    dev = rank * num_blocks
    if isinstance(op, PageCopy):
        host = rank * host_blocks[op.group]
        src, dst = (dev, host) if op.direction == "d2h" else (host, dev)
        return dataclasses.replace(op, src=tuple(b + src for b in op.src), dst=tuple(b + dst for b in op.dst))
    if isinstance(op, (SaveKV, LoadKV)):
        return dataclasses.replace(op, blocks=tuple((g, tuple(b + dev for b in bs)) for g, bs in op.blocks))
    if isinstance(op, ResetLease):  # lease and blocks stay local: the device half runs it on rank `rank`'s
        return op
    if isinstance(op, (TierStore, TierLoad)):
        host = rank * host_blocks[op.group]
        op = dataclasses.replace(op, host_blocks=tuple(b + host for b in op.host_blocks))
        if isinstance(op, TierLoad):
            op = dataclasses.replace(op, jobs=tuple(rank_job(j, rank, ranks) for j in op.jobs))
        return op
    raise NotImplementedError(f"{type(op).__name__} transfers under DP x EP (data_parallel_size with "
                              "enable_expert_parallel)")


def rank_job(job: int, rank: int, ranks: int) -> int:
    """Rank `rank`'s tier job `job` as the runner names it (one table for every rank's jobs)."""
    return job * ranks + rank


@contextlib.contextmanager
def rank_tiers(host, tiers, rank: int):
    """`host` (the runner's HostMemory) with rank `rank`'s secondary tiers (`tiers`: one TierSet per rank,
    `ModelRunner.rank_tiers`; None: the runner's own) while the block runs: a rank's stores go to its own
    tiers and its loads come from them."""
    if tiers is None:
        yield host
        return
    own = host.tiers
    host.tiers = tiers[rank]
    try:
        yield host
    finally:
        host.tiers = own


def rank_groups(plans: Sequence[StepPlan | None], max_tokens: int, capacity: int, verify_width: int = 0
                ) -> dict[int, dict[int, tuple[list[int], int, int]]]:
    """The step's forwards: width -> {rank: (indices of its rows of that width, its padded rows, its
    window)} (`batch.forward_groups` per rank), widths in order of first appearance. The forward of a width
    runs max(padded) rows per rank over max(window)."""
    groups: dict[int, dict[int, tuple[list[int], int, int]]] = {}
    for r, plan in enumerate(plans):
        if plan is not None:
            for width, idx, padded, window in forward_groups(plan.rows, max_tokens, capacity, verify_width):
                groups.setdefault(width, {})[r] = (idx, padded, window)
    return groups


def group_first_round_slots(cfg, ranks: int, width: int, rows: int, *, k: int = 0, sequential: bool = False,
                            views: bool = False, drafts: bool = False) -> tuple[list[int], list[int]]:
    """The MoE dispatches of one DP x EP width group of `rows` rows per rank of `width` tokens, each as its
    first round's slots per destination (`parallel.ep.first_round_capacity` of the tokens it dispatches per
    rank) -> (the group's forward and, under MTP (`k` drafts), the MTP layer's pass over it; the k - 1
    draft passes, when some row samples: `drafts`), as the model runner's programs count them:
    - the forward: every main MoE layer dispatches rows x width tokens, but the last layer of a prefill
      forward only each row's last one (GLM53.__call__'s last_only), and under MTP also every position
      (keep_all runs that layer on them too); a verify forward in the `sequential` form (`verify_dp`) is
      width one-token steps, each dispatching rows tokens;
    - the MTP pass: rows x width tokens, or in a sequential verify group with HiSparse's `views` one
      position at a time (`mtp_verify_dp`), width x rows;
    - each draft pass: rows tokens.
    x `parallel.ep.all2all_bytes_per_slot`: the bytes one device sends."""
    e_local = cfg.n_routed_experts // ranks

    def cap(tokens: int) -> int:
        return first_round_capacity(tokens, cfg.num_experts_per_tok, e_local, ranks)

    prefill = width > (1 + k if k else 1)
    stepwise = not prefill and k > 0 and sequential  # the verify group's positions one at a time
    last = cfg.num_hidden_layers - 1
    out = []
    for i, kind in enumerate(cfg.mlp_layer_types):
        if kind != "sparse":
            continue
        if prefill and i == last:
            out += [cap(rows * width), cap(rows)] if k else [cap(rows)]
        else:
            out.append(width * cap(rows) if stepwise else cap(rows * width))
    if not k:
        return out, []
    out.append(width * cap(rows) if stepwise and views else cap(rows * width))  # the MTP layer's MoE
    return out, [cap(rows)] * (k - 1) if drafts else []


def group_has_leases(plans: Sequence[StepPlan | None], per) -> bool:
    """Whether some row of a width group (`per`: rank_groups' entry) holds a HiSparse hot-buffer lease, so
    its decode forwards carry a view (`HiSparseDevice.group_views`)."""
    return any(getattr(plans[r].policy_rows[i], "lease", -1) >= 0 for r, (idx, _, _) in per.items()
               if plans[r].policy_rows is not None for i in idx)


def first_round_all2all_bytes(plans: Sequence[StepPlan | None], cfg, deploy, itemsize: int,
                              verify_mode: str = "batched") -> int:
    """Bytes one device sends by all-to-all in the first rounds of the MoE dispatch (`parallel.ep.moe_local`)
    when DP x EP ranks run `plans` as one step, from the plans alone: per width group,
    `group_first_round_slots` (under MTP its MTP pass and draft passes too; `verify_mode`: the runner's
    verify form). What the simulator reports as `ep_all2all_bytes`; the model runner measures the same
    plus any second rounds (routing that overflows the first round's slots) outside a sequential scan."""
    n = len(plans)
    max_tokens, capacity = step_limits(deploy)
    k = deploy.num_speculative_tokens
    slots = 0
    for width, per in rank_groups(plans, max_tokens, capacity, 1 + k if k else 0).items():
        fwd, drafts = group_first_round_slots(
            cfg, n, width, max(p for _, p, _ in per.values()), k=k, sequential=verify_mode == "sequential",
            views=group_has_leases(plans, per),
            drafts=any(plans[r].rows[i].sample for r, (idx, _, _) in per.items() for i in idx))
        slots += sum(fwd) + sum(drafts)
    return slots * all2all_bytes_per_slot(n, cfg.hidden_size, itemsize)


def execute_ranks(runner, plans: Sequence[StepPlan | None]) -> list[StepResult | None]:
    """Run `plans` (one per rank, None for a rank without one) as one step of `runner` (a ModelRunner whose
    strategy is `DataParallelExperts`) -> each rank's StepResult (None where its plan was None)."""
    n = runner.fwd.ranks
    if len(plans) != n:
        raise ValueError(f"{len(plans)} plans for {n} ranks")
    host_blocks = dict(runner.sizes.host_blocks or {})
    tiers = getattr(runner, "rank_tiers", None)  # each rank's secondary tiers (the engine's), or None
    moved = [(0, 0)] * n
    for r, plan in enumerate(plans):
        if plan is None:
            continue
        if not runner.k and any(row.num_draft_tokens for row in plan.rows):
            raise ValueError("a plan with draft tokens for a runner without MTP (DeployConfig.speculative_config)")
        ops = tuple(shift_transfer(op, r, runner.num_blocks, host_blocks, n) for op in plan.transfers)
        with rank_tiers(runner.host, tiers, r) as host:
            runner.cache, d2h, h2d = host.apply(ops, runner.cache,
                                                others=lambda op, r=r: runner.half.transfer(op, rank=r))
        moved[r] = (d2h, h2d)
    resolves: list[list] = [[] for _ in range(n)]
    stages: list[list] = [[] for _ in range(n)]
    tokens: dict[str, tuple[int, ...]] = {}
    drafts: dict[str, tuple[int, ...]] = {}
    runner._logprobs = {}  # filled by the groups' sampling (`ModelRunner._pick`, the accept rule)
    for width, per in rank_groups(plans, runner.max_tokens, runner.capacity, runner.verify_width).items():
        rows_per_rank = max(p for _, p, _ in per.values())
        window = max(w for _, _, w in per.values())
        rows, t_mla, t_idx, data = [], [], [], []
        for r in range(n):
            idx = per[r][0] if r in per else []
            plan = plans[r]
            pad = rows_per_rank - len(idx)
            rows += [plan.rows[i] for i in idx] + [_PAD] * pad
            t_mla += [plan.block_tables["mla"][i] for i in idx] + [()] * pad
            t_idx += [plan.block_tables["indexer"][i] for i in idx] + [()] * pad
            own = plan.policy_rows if idx else None
            data += [None if own is None else own[i] for i in idx] + [None] * pad
        views = runner.half.group_views(data if any(h is not None for h in data) else None,
                                        decode=width == (runner.verify_width or 1), tables_mla=t_mla,
                                        padded=n * rows_per_rank)
        out, new = runner._run_group(rows, t_mla, t_idx, width, n * rows_per_rank, window, views)
        tokens.update(out)
        drafts.update(new)
        parts = [(tuple(rows[r * rows_per_rank + j].req_id for j in range(len(per[r][0]) if r in per else 0)),
                  r * rows_per_rank) for r in range(n)]
        for r, (res, st, nbytes) in enumerate(runner.half.take_rank_records(parts)):
            resolves[r] += res
            stages[r] += st
            moved[r] = (moved[r][0], moved[r][1] + nbytes)
    # each rank's finished tier loads under its own job ids; when no rank computed, wait a little for
    # them (an engine whose only waiting requests wait on tiers would otherwise spin)
    idle = not any(p is not None and p.rows for p in plans)
    loads = [()] * n
    for r in range(n if tiers is not None else 1):
        with rank_tiers(runner.host, tiers, r) as host:
            loads[r] = tuple(((j - r) // n if tiers is not None else j, status)
                             for j, status in host.poll_tiers(wait_s=0.02 / n if idle else 0.0))
    results: list[StepResult | None] = []
    for r, plan in enumerate(plans):
        if plan is None:
            results.append(None)
            continue
        mine = {row.req_id: tokens[row.req_id] for row in plan.rows if row.req_id in tokens}
        results.append(StepResult(mine, frozenset(range(len(plan.transfers))), *moved[r], tuple(resolves[r]),
                                  tier_loads=loads[r], stages=tuple(stages[r]),
                                  drafts={rid: drafts[rid] for rid in mine if rid in drafts},
                                  logprobs={rid: runner._logprobs[rid] for rid in mine if rid in runner._logprobs}))
    return results
