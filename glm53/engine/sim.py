"""The simulator: a runner that prices a `StepPlan` with the performance model instead of running it.

    eng = glm53.engine.sim.build_engine(glm53.get_preset("glm-5.3"), DeployConfig(...))  # hw: H200_CALIBRATED
    client = ClosedLoopClient(eng, sessions, 32, ...)   # as on a real engine; think time is virtual

The real scheduler, block pool, KV policies, prefix caching, chunked prefill and admission run
unchanged; only the runner differs. `SimRunner.execute` completes the plan's transfers (counting their
bytes as the model runner does), returns deterministic tokens, and reports the step's price
(`StepResult.duration_s`, from `glm53.perfmodel.step_cost` on the plan's rows and bytes). The engine
advances a `VirtualClock` by it, so a simulated hour takes the scheduler's time, not an hour, and no
array is ever allocated: the full GLM-5.3 preset runs on a laptop.

What the simulator does not know (it has no arrays), and assumes instead:
- the tokens: a hash of (request, tokens generated), never a stop token (requests run to max_new_tokens,
  as the published benchmarks do with ignore_eos);
- MTP acceptance: only rejection_sample_method="synthetic" (the published MTP3 figures fix the
  acceptance length at 2.99): how many drafts stand each step comes from the configured rates. A
  verify row is priced in the form the model runner computes it on the priced hardware's platform
  (SpeculativeConfig.verify_form: batched on a GPU, sequential on CPU, sequential under HiSparse with
  a hot buffer too small for the union of 1 + k positions' selections): a decode row of 1 + k tokens,
  or 1 + k one-token passes (`StepLayout.verify`), with the MTP layer over the step's tokens
  (`StepLayout.include_mtp`), plus the k - 1 one-token draft passes (`glm53.perfmodel.step.mtp_draft_cost`);
- HiSparse hot-buffer misses: a decode row with host-only pages misses `hisparse_miss_fraction` of the
  top-k rows it selects from them (selections spread over the context in proportion to its pages);
  an *assumption*, reported with every simulated run, until the resolver's hit rate is measured at scale.
- expert routing: balanced across EP ranks unless `expert_load_imbalance` (the busiest rank's routed
  tokens over the mean) says otherwise;
- HiSparse prefill staging (a chunk over host-only pages, kvcache.views.StagingView): per chunk,
  min(chunk tokens x top-k, the row's host-only rows) rows per layer cross the link, i.e. every
  host-only row the chunk could select, once: exact while the chunk's distinct selections fit the
  staging workspace (tile x top-k rows), which keeps rows across tiles; more where they do not.

DP x EP ranks (`DeployConfig.experts_across_ranks`) are priced as the engine runs them: one lock-step
over every rank's plan, each rank at the step's padded rows, with the MoE's all-to-alls
(`SimRunner.execute_ranks`).

Secondary tiers (the offload host tier's filesystem tier and the like) are simulated
(kvcache.tiers.sim.SimTier, made by `SyntheticRunner.make_tiers`): the same offload policy, RETRY
admissions and TierStore / TierLoad operations, with each store and load finishing after its modelled
time on the medium `tier_storage` gives the tier's type (glm53.perfmodel.STORAGE: "fs" is one local
NVMe SSD). Time: a step's tier jobs are submitted at its start; the loads finished by its end (start +
its price) are reported in its StepResult.tier_loads; a step with no rows while tier jobs are pending
(every waiting request waits on a tier) lasts until the first of them finishes, so a RETRY admission
waits simulated time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import operator
import types
import typing
import zlib

from flax import nnx

from glm53.config import ModelConfig
from glm53.engine.build import weights_bytes_per_device
from glm53.engine.config import DeployConfig, KVSizes
from glm53.engine.engine import Engine
from glm53.engine.plan import PlanRow, StepPlan, StepResult, VirtualClock
from glm53.engine.runner import forward_groups, step_limits
from glm53.engine.runner.ranks import group_first_round_slots, group_has_leases, rank_groups
from glm53.engine.synthetic import SyntheticRunner, _synthetic_accepted
from glm53.perfmodel import H200_CALIBRATED, STORAGE, HardwareSpec, StorageSpec
from glm53.perfmodel.cost import StepCost, all_to_all
from glm53.perfmodel.ops import expected_remote_ranks, moe
from glm53.perfmodel.step import StepLayout, moe_layers, mtp_draft_cost, step_cost
from kvcache.layout import DEFAULT_INDEX_FORMAT
from kvcache.tiers.sim import TierCosts
from kvcache.transfer import ResetLease, TierLoad, TierStore
from parallel.ep import all2all_bytes_per_slot

SIM_DTYPE = "bfloat16"  # what "auto" KV means for a model without weights (the checkpoints' dtype)


def step_layout(deploy: DeployConfig, kv_cache_dtype: str, weight_bytes: float | None = None,
                verify: str = "batched", dcp_prefill_gather: str = "fp8_rows") -> StepLayout:
    """The performance model's view of one replica of `deploy` (kv_cache_dtype resolved, KVSizes').
    weight_bytes: bytes per matmul weight (None: the FP8 checkpoint's). verify: the MTP verify form its
    runner computes (SpeculativeConfig.verify_form). dcp_prefill_gather: what a PCP x DCP prefill gathers
    (StepLayout.dcp_prefill_gather)."""
    extra = {} if weight_bytes is None else {"weight_bytes": weight_bytes}
    return StepLayout(**extra, tp=deploy.tensor_parallel_size, pcp=deploy.prefill_context_parallel_size,
                      dcp=deploy.decode_context_parallel_size, expert_parallel=deploy.enable_expert_parallel,
                      dcp_backend=deploy.dcp_comm_backend, mla_format=kv_cache_dtype,
                      index_format=DEFAULT_INDEX_FORMAT[kv_cache_dtype],
                      include_mtp=deploy.num_speculative_tokens > 0, verify=verify,
                      dcp_prefill_gather=dcp_prefill_gather,
                      dp=deploy.data_parallel_size if deploy.experts_across_ranks else 1,
                      **deploy.policy.sim_layout(deploy))


class _Row(typing.NamedTuple):  # what step_cost reads of a plan row
    start: int
    num_tokens: int
    num_draft_tokens: int
    sample: bool


class _Rows(typing.NamedTuple):
    rows: tuple


def tier_costs(storage: StorageSpec) -> TierCosts:
    """A simulated tier's device costs from a perfmodel StorageSpec."""
    return TierCosts(read_bytes_per_s=storage.read_bandwidth, write_bytes_per_s=storage.write_bandwidth,
                     read_latency_s=storage.read_latency_s, write_latency_s=storage.write_latency_s)


# CPython's cyclic collector's thresholds while a simulation runs (`fewer_collections`)
SIM_GC_THRESHOLDS = (100_000, 50, 100)


@contextlib.contextmanager
def fewer_collections(thresholds: tuple[int, int, int] = SIM_GC_THRESHOLDS):
    """Run the block inside with the cyclic garbage collector's thresholds at `thresholds` (then restore
    them). A simulated serving run allocates millions of small objects that live for the run (block
    hashes, page lists, plans); at CPython's defaults (700, 10, 10) the collector runs every few hundred
    allocations and keeps re-scanning them (docs/simulator.md "Speed"). Objects freed by reference
    counting are freed as before; only cycles wait longer. Changes no decision of the simulation."""
    old = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def forward_cost(cfg: ModelConfig, hw: HardwareSpec, dep: StepLayout, rows: int, width: int, window: int, *,
                 sample: bool = True, hot_miss_rows: float = 0, drafts: int = 0) -> StepCost:
    """One padded forward of the model runner (`glm53.engine.runner.forward_groups`): `rows` rows of
    `width` tokens each against a `window`-position attention window (what the padded program computes,
    whatever the real rows' lengths), as one forward program; `sample`: logits for every row; `drafts`:
    the last `drafts` tokens of each row are MTP drafts (a verify group: decode rows of width tokens)."""
    group = _Rows((_Row(max(0, window - width), width, drafts, sample),) * rows)
    return step_cost(cfg, hw, dep, group, hot_miss_rows=hot_miss_rows)


def hash_token(vocab_size: int):
    """Deterministic synthetic tokens: crc32 of (request id, tokens generated before) mod the vocabulary,
    so a request's outputs do not depend on what it is batched with or on the process. The function
    carries `by_count(req_id, num_generated)`, the same token from the two fields it reads."""
    def by_count(req_id: str, num_generated: int) -> int:
        return zlib.crc32(f"{req_id}:{num_generated}".encode()) % vocab_size

    def token(row: PlanRow) -> int:
        return by_count(row.req_id, row.num_generated)
    token.by_count = by_count
    return token


@functools.lru_cache(maxsize=8)
def _weights_per_device(cfg: ModelConfig, ranks: int, weight_bytes: float | None) -> int:
    """`SimRunner.weights_bytes_per_device` from the model's shapes (nothing is allocated)."""
    from glm53 import fp8, weights  # the model's structure: only a DP x EP simulation asks for it
    dtype = {None: "bfloat16", 2: "bfloat16", 4: "float32"}[weight_bytes]
    fp8_modules = fp8.eligible_modules(weights.abstract_model(cfg, dtype)) if weight_bytes is None else ()
    state = nnx.state(weights.abstract_model(cfg, dtype, fp8_modules))
    return weights_bytes_per_device(state, cfg, DeployConfig(data_parallel_size=ranks, enable_expert_parallel=True))


DP_PACINGS = ("lockstep", "vllm")  # SimRunner.dp_pacing

# the cost names of a step's host <-> device KV copies (glm53.perfmodel.step.step_cost), which
# SimRunner.host_copy_overlap may hide behind the forward
HOST_COPIES = ("kv_load", "kv_store")

class SimRunner(SyntheticRunner):
    """`glm53.engine.plan.Runner` that prices each plan on `hw` (one GPU of a replica of `deploy`).

    deploy / sizes: the replica's resolved DeployConfig and KVSizes (what the engine's policy plans with).
    step_overhead_s: fixed time per step beyond the kernels (launch, scheduling, sampling; default 0: an
        *assumption* until calibrated).
    hisparse_miss_fraction: see the module docstring (*assumed*).
    expert_load_imbalance: routing skew, the busiest EP rank's routed tokens over the mean (default 1.0:
        balanced); prices that rank's grouped expert GEMMs (and, outside DP x EP, its all-to-alls:
        `StepLayout.expert_load_imbalance`). The DP x EP all-to-alls (`all2all_cost`) move the engine's
        fixed capacity slots, which a skew does not change.
    weight_bytes: bytes per matmul weight parameter (None: the FP8 checkpoint; 4 for a float32 model).
    pad_like_runner: price the shapes this project's model runner executes instead of the plan's own
        work: one forward per width bucket (`glm53.engine.runner.forward_groups`), each of its padded
        rows at its full width against the group's whole attention window (the padded program computes
        that much), hw.forward_latency_s per forward. For validating the simulator against the real
        engine on CPU (experiments/validate_sim.py); an H200 deployment runs unpadded kernels.
    host_overlap_s: host time per step after its forwards are dispatched (the sampling program, the
        tokens' bookkeeping; default 0): serial like step_overhead_s; under async_dispatch it overlaps
        only the forwards the step does not wait for.
    async_dispatch: model the model runner's asynchronous dispatch: the host part before dispatch
        (step_overhead_s) runs while earlier forwards still compute, a step's transfers and forwards
        queue behind them in order, and the rest of its host part (host_overlap_s) starts once the last
        forward it samples from has finished (sampling reads that forward's result and the update reads
        the tokens; the host waits for them), the step returning when it is done. A forward whose rows
        sample nothing is not waited for: the next step waits behind it, and a step with rows that samples
        nothing returns host_overlap_s after its dispatch (a step without rows, host_overlap_s after its
        transfers). Needs `clock` (the engine's VirtualClock; build_engine passes it). Off (the
        default), a step is its host parts plus its priced work.
    dp_pacing: how DP x EP ranks (`execute_ranks`) are priced: "lockstep" (the default), as this project's
        engine runs them (one forward per width bucket present on any rank, every rank at the padded rows,
        the experts on the padded rows); "vllm", as vLLM 0.34 runs them on Hopper (each rank one forward
        of its own rows, the step at the slowest rank's pace; the routed experts on every rank's real
        tokens, 1/N each; all-to-alls of real tokens, fp8 out and bf16 back, sized by the busiest sender;
        docs/simulator.md "DP x EP pacing"). Ignored without DP x EP ranks.
    host_copy_overlap: the fraction (0-1) of a step's host <-> device KV copies (the parts named in
        `HOST_COPIES`: the offload tier's loads and stores, HiSparse's pre-copies) that runs beside its
        forward instead of before it, hidden up to the forward's length (default 0: serial, as this
        project's runners execute them; 1 bounds vLLM's connector, whose copies run on their own stream).
        The copies stay booked in time_by_op at their full time; the step is shorter by what is hidden.
    tier_storage: per secondary-tier type, the medium its simulated tier runs on (glm53.perfmodel.STORAGE
        by default: "fs" on one NVMe SSD); a type without one cannot be simulated. Tier jobs follow the
        engine's `clock` (without one, the runner's own sum of step times).
    loaded_prompt: per request, a position below which its rows are priced as KV loaded rather than
        computed (left out of the forward; `_as_priced`): what a P/D consumer priced as vLLM's NIXL consumer
        is (glm53.engine.pd_sim.PdPair, decode_prompt="loaded"); empty by default.
    After each step: `busy_s` (priced seconds so far), `time_by_op` (seconds per cost name, summed),
    `steps`, `loaded_tokens` (prompt tokens left out of the forwards through `loaded_prompt`).
    """

    def __init__(self, cfg: ModelConfig, deploy: DeployConfig, sizes: KVSizes, hw: HardwareSpec = H200_CALIBRATED, *,
                 step_overhead_s: float = 0.0, hisparse_miss_fraction: float = 0.1, weight_bytes: float | None = None,
                 token=None, record: bool = False, pad_like_runner: bool = False, async_dispatch: bool = False,
                 host_overlap_s: float = 0.0, clock: VirtualClock | None = None,
                 tier_storage: typing.Mapping[str, StorageSpec] | None = None, expert_load_imbalance: float = 1.0,
                 host_copy_overlap: float = 0.0, dp_pacing: str = "lockstep"):
        if not deploy.is_resolved:
            raise ValueError("SimRunner: give the resolved DeployConfig (DeployConfig.resolved / Engine.deploy)")
        if (not (step_overhead_s >= 0 and host_overlap_s >= 0) or not 0 <= hisparse_miss_fraction <= 1
                or not 0 <= host_copy_overlap <= 1):
            raise ValueError(f"SimRunner: step_overhead_s and host_overlap_s must be >= 0, hisparse_miss_fraction and "
                             f"host_copy_overlap in [0, 1], got {step_overhead_s!r}, {host_overlap_s!r}, "
                             f"{hisparse_miss_fraction!r}, {host_copy_overlap!r}")
        if dp_pacing not in DP_PACINGS:
            raise ValueError(f"SimRunner: dp_pacing must be one of {DP_PACINGS}, got {dp_pacing!r}")
        self.dp_pacing = dp_pacing
        spec = deploy.speculative
        if spec is not None and not spec.synthetic:
            raise ValueError("SimRunner: the simulator has no draft model to measure acceptance with: give "
                             "speculative_config rejection_sample_method='synthetic' with synthetic_acceptance_length "
                             "(or _rates)")
        storage = STORAGE if tier_storage is None else tier_storage
        super().__init__(token or hash_token(cfg.vocab_size), sizes.page_bytes, record,
                         {kind: tier_costs(m) for kind, m in storage.items()}, spec=spec)
        # the default tokens read only (request, tokens generated): `_verify` then skips cutting rows
        self._by_count = (getattr(self.token, "by_count", None) if spec is not None and spec.synthetic
                          and self.draft is self.token else None)
        # the synthetic rates, derived once (SpeculativeConfig.acceptance_rates derives them on every read)
        self._rates = types.SimpleNamespace(acceptance_rates=spec.acceptance_rates) if spec is not None else None
        self.cfg, self.hw, self.deploy = cfg, hw, deploy
        self.verify_width = 1 + deploy.num_speculative_tokens if spec is not None else 0
        # the verify form the model runner computes on hw's platform (batched on a GPU unless HiSparse's
        # hot buffer cannot hold the union of a step's selections; sequential on CPU)
        self.verify_mode = spec.verify_form(hw.platform, rows_limit=deploy.policy.verify_rows_limit(sizes),
                                            index_topk=cfg.index_topk) if spec else None
        # on a GPU spec the PCP x DCP prefill gathers as vLLM's FLASHMLA_SPARSE path does (each rank's shard
        # up-converted to bf16); the CPU spec prices this project's engine, which gathers fp8 rows
        dep = step_layout(deploy, sizes.kv_cache_dtype, weight_bytes, self.verify_mode or "batched",
                          "bf16_shard" if hw.flashmla_kernels else "fp8_rows")
        self.dep = dataclasses.replace(dep, expert_load_imbalance=expert_load_imbalance)
        self.step_overhead_s, self.host_overlap_s = step_overhead_s, host_overlap_s
        self.host_copy_overlap = host_copy_overlap
        self.hisparse_miss_fraction = hisparse_miss_fraction
        self.busy_s = 0.0
        self.time_by_op: dict[str, float] = {}
        self.hot_miss_rows = 0.0
        self.staged_rows = 0.0  # prefill rows staged per layer (`_stage_rows`)
        self.pad_like_runner = pad_like_runner
        if async_dispatch and clock is None:
            raise ValueError("SimRunner(async_dispatch=True) needs the engine's clock")
        self.async_dispatch, self.clock = async_dispatch, clock
        self._device_free_s = 0.0  # virtual time at which the forwards dispatched so far are done
        self._limits = step_limits(deploy)
        # DP x EP: the ranks' runners (build_engine links them on rank 0's), the bytes a hidden-state value
        # takes on the all-to-alls (the activations: float32 for a float32 model, else bfloat16)
        self.ranks: list[SimRunner] = [self]
        self.dp_ranks = deploy.data_parallel_size if deploy.experts_across_ranks else 1
        self.itemsize = 4 if weight_bytes == 4 else 2
        self._slot_bytes = all2all_bytes_per_slot(self.dp_ranks, cfg.hidden_size, self.itemsize)
        self._all2all = 0
        # `_memo`'s prices: a DP x EP step prices the same few shapes over and over (decode: width 1 + k
        # at most max_num_seqs rows, windows in buckets); bounded (prefill widths vary)
        self._priced: dict[tuple, typing.Any] = {}
        self._priced_on: dict[HardwareSpec, dict] = {}  # set_host: each spec's kept prices
        self._weight_bytes = weight_bytes
        # a P/D consumer's prompt tokens priced as loaded, not computed (glm53.engine.pd_sim.PdPair with
        # decode_prompt="loaded" fills it, one dict shared by the decode engine's runners): per request, the
        # position below which its rows are not priced; `loaded_tokens` counts the tokens so left out
        self.loaded_prompt: dict[str, int] = {}
        self.loaded_tokens = 0

    def _as_priced(self, plan: StepPlan) -> StepPlan:
        """`plan` as this runner prices it: without `loaded_prompt` entries, `plan` itself; else each row of
        a request listed there cut to its positions at and past the listed one (a row wholly below it is
        left out, with its block tables and policy row), the entry dropped at the first row that reaches
        past it. Tokens, transfers and tier jobs always come from the plan the engine made; only the
        forward's price reads the cut rows (a cut row of one prompt token over host-only pages stages
        as a prefill chunk does: HiSparseSpec.sim_stage_rows)."""
        loaded = self.loaded_prompt
        if not loaded or not plan.rows:
            return plan
        rows, keep, cut = [], [], 0
        for i, row in enumerate(plan.rows):
            upto = loaded.get(row.req_id)
            if upto is not None:
                end = row.start + row.num_tokens
                if end > upto:  # past it: later rows (a recompute after a preemption) are priced in full
                    del loaded[row.req_id]
                if row.start < upto:
                    cut += min(end, upto) - row.start
                    if end <= upto:
                        continue
                    row = dataclasses.replace(row, start=upto, token_ids=row.token_ids[upto - row.start:])
            rows.append(row)
            keep.append(i)
        if not cut:
            return plan
        self.loaded_tokens += cut
        if len(keep) == len(plan.rows):
            return dataclasses.replace(plan, rows=tuple(rows))
        def along(seq):  # a per-row field, at the rows kept
            return tuple(seq[i] for i in keep)

        return dataclasses.replace(plan, rows=tuple(rows),
                                   block_tables={g: along(t) for g, t in plan.block_tables.items()},
                                   policy_rows=None if plan.policy_rows is None else along(plan.policy_rows))

    def _verify(self, row: PlanRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """SyntheticRunner._verify with the default tokens under the synthetic acceptance rule: the
        tokens of the rows it would cut, from their tokens-generated counts (a row cut at its known tokens
        plus j has generated j more), without building them; the same tokens (a simulated MTP step cuts
        every row 1 + k times, most of its pricing time before this)."""
        if self._by_count is None:
            return super()._verify(row)
        nd, k = row.num_draft_tokens, self.spec.num_speculative_tokens
        accepted = _synthetic_accepted(row, self._rates)
        if accepted is None:
            return super()._verify(row)
        given = row.token_ids[row.num_tokens - nd:][:accepted]
        g, rid = row.num_generated + accepted, row.req_id
        out = (*(int(t) for t in given), int(self._by_count(rid, g)))
        return out, tuple(int(self._by_count(rid, g + 1 + i)) for i in range(k))

    def _miss_rows(self, plan: StepPlan) -> float:
        """Assumed hot-buffer misses of a decode step (the policy's `sim_miss_rows`: HiSparse's, per decode
        row with a lease, the share of its top-k in host-only pages times hisparse_miss_fraction)."""
        return self.deploy.policy.sim_miss_rows(plan, self.cfg.index_topk, self.hisparse_miss_fraction)

    def _stage_rows(self, plan: StepPlan, rows=None) -> float:
        """Rows per layer a step's prefill chunks over host-only pages stage (the policy's `sim_stage_rows`;
        module docstring), over the plan's rows or those in `rows`."""
        return self.deploy.policy.sim_stage_rows(plan, self.deploy, self.cfg.index_topk, rows)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.clock is not None:
            self._t = max(self._t, self.clock.now())  # this step starts now: its tier jobs are submitted now
        res = self._run(plan)
        made, plan = plan, self._as_priced(plan)
        misses = self._miss_rows(plan)
        staged = self._stage_rows(plan)
        # host <-> storage operations do not use the device link
        moves = sum(1 for op in plan.transfers if not isinstance(op, (ResetLease, TierStore, TierLoad)))
        # a page holds every DCP rank's share; each GPU moves its own over its own link
        n = self.dep.dcp
        kw = dict(d2h_bytes=res.d2h_bytes / n, h2d_bytes=res.h2d_bytes / n, host_transfers=moves)
        # the step's device work in execution order: (StepCost, whether the host waits for its results)
        if self.pad_like_runner:
            segments = [(step_cost(self.cfg, self.hw, self.dep, _Rows(()), **kw), False)]  # the transfers
            for width, idx, padded, window in forward_groups(plan.rows, *self._limits, self.verify_width):
                sample = any(plan.rows[i].sample for i in idx)
                verify = width == (self.verify_width or 1)
                segments.append((forward_cost(self.cfg, self.hw, self.dep, padded, width, window, sample=sample,
                                              hot_miss_rows=misses if verify else self._stage_rows(plan, idx),
                                              drafts=width - 1 if verify else 0), sample))
                if sample and self.verify_width:  # the group's draft passes, on its padded rows
                    segments.append((mtp_draft_cost(self.cfg, self.hw, self.dep, [window] * padded,
                                                    self.verify_width - 2), True))
        else:
            segments = [(step_cost(self.cfg, self.hw, self.dep, plan, hot_miss_rows=misses + staged, **kw),
                         any(r.sample for r in plan.rows))]
            drafting = [r.start + r.num_tokens for r in plan.rows if r.sample]
            if drafting and self.verify_width:
                segments.append((mtp_draft_cost(self.cfg, self.hw, self.dep, drafting, self.verify_width - 2), True))
        self._book(segments)
        seconds = self._timed(self._segment_times(segments), bool(made.rows))
        self.hot_miss_rows += misses
        self.staged_rows += staged
        seconds, loads = self._end_step(made, seconds)  # an idle step waits for its tiers
        return dataclasses.replace(res, duration_s=seconds, tier_loads=loads)

    def _book(self, segments, by_name=None) -> None:
        """Add a step's costs [(StepCost, waits)] to time_by_op, part by part in order (by_name: their
        `_by_name`, when the caller books the same segments on several ranks)."""
        tbo = self.time_by_op
        get = tbo.get
        if by_name is None:
            for cost, _ in segments:
                for c in cost.parts:
                    tbo[c.name] = get(c.name, 0.0) + c.time_s
            return
        for name, times in by_name:
            tbo[name] = functools.reduce(operator.add, times, get(name, 0.0))

    def _segment_times(self, segments) -> list[tuple[float, bool]]:
        """[(seconds, waits)] of a step's device work [(StepCost, waits)] in execution order, the first
        segment (the one that holds the step's host copies, `HOST_COPIES`) shortened by what
        host_copy_overlap hides of them behind the rest of the step's work."""
        times = [(cost.time_s(), waits) for cost, waits in segments]
        if self.host_copy_overlap and segments:
            copies = sum(c.time_s for c in segments[0][0].parts if c.name in HOST_COPIES)
            if copies:
                hidden = min(self.host_copy_overlap * copies, sum(t for t, _ in times) - copies)
                times[0] = (times[0][0] - hidden, times[0][1])
        return times

    def _timed(self, times: list[tuple[float, bool]], has_rows: bool) -> float:
        """A step's seconds from its device work in execution order [(seconds, whether the host waits for
        its results)] and the host parts (class docstring: async_dispatch); adds to busy_s."""
        work = sum(t for t, _ in times)
        if self.async_dispatch:
            # the host part first, then each forward queues behind the device's earlier work; the rest of
            # the host part follows the last forward the step samples from (a step without rows waits for
            # its transfers), or the dispatch where it waits for none
            now = self.clock.now()
            dispatched = waited = now + self.step_overhead_s
            t = max(dispatched, self._device_free_s)
            for seconds, waits in times:
                t += seconds
                if waits or not has_rows:
                    waited = t
            self._device_free_s = t
            seconds = waited + self.host_overlap_s - now
        else:
            seconds = work + self.step_overhead_s + self.host_overlap_s
        self.busy_s += work + self.step_overhead_s + self.host_overlap_s
        return seconds

    def all2all_cost(self, dispatches) -> StepCost:
        """DP x EP: the MoE all-to-alls of lock-step programs, per MoE dispatch in `dispatches` (its first
        round's slots per destination: `ranks.group_first_round_slots`) the first round's three (the rows
        out, their expert ids, the results back), each one device's share of its slots x the bytes a slot
        carries on it (`parallel.ep.all2all_bytes_per_slot`: the same bytes `ep_all2all_bytes` counts);
        memoised per dispatch list (a serving run repeats a few shapes)."""
        def build():
            n, d = self.dp_ranks, self.cfg.hidden_size
            parts = []
            for slots in dispatches:
                sent = slots * (n - 1)
                parts += [all_to_all(self.hw, sent * d * self.itemsize, n, "ep_dispatch"),
                          all_to_all(self.hw, sent * 4, n, "ep_expert_ids"),
                          all_to_all(self.hw, sent * d * self.itemsize, n, "ep_combine")]
            return StepCost(tuple(p for p in parts if p.time_s > 0))
        return self._memo(("all2all", *dispatches), build)

    def set_host(self, hw: HardwareSpec, step_overhead_s: float, host_overlap_s: float) -> None:
        """Price the steps from now on on `hw` with these host parts (as the constructor's): for engines
        whose devices share one host with another engine's, so that their speed depends on what the other
        is doing (experiments.pd_http.twin). `hw` keeps the platform (the verify form depends on it); each
        spec keeps its own memoised prices."""
        if hw.platform != self.hw.platform:
            raise ValueError(f"SimRunner.set_host: the platform stays {self.hw.platform!r}, got {hw.platform!r}")
        if not (step_overhead_s >= 0 and host_overlap_s >= 0):
            raise ValueError(f"SimRunner.set_host: step_overhead_s and host_overlap_s must be >= 0, got "
                             f"{step_overhead_s!r}, {host_overlap_s!r}")
        if hw != self.hw:
            self._priced_on[self.hw] = self._priced
            self._priced = self._priced_on.pop(hw, {})
            self.hw = hw
        self.step_overhead_s, self.host_overlap_s = step_overhead_s, host_overlap_s

    @property
    def device_free_s(self) -> float:
        """Under async_dispatch, the virtual time at which the forwards dispatched so far are done (0 before
        the first; without async_dispatch a step's work ends with the step)."""
        return self._device_free_s

    def _memo(self, key: tuple, build: typing.Callable[[], typing.Any]) -> typing.Any:
        """build(), kept under `key` (at most 4096 kept; then forgotten all at once). The contract: `key`
        names everything build reads that can change during a run (its first item names the price; the
        runner's cfg and dep are fixed, and each hw keeps its own: `set_host`), and build is pure, so a
        kept price is the one build would return again, exactly (the same floats, the same parts in the
        same order): memoised pricing changes no decision and no booked time. Callers do not mutate what
        it returns."""
        hit = self._priced.get(key)
        if hit is None:
            if len(self._priced) >= 4096:
                self._priced.clear()
            hit = self._priced[key] = build()
        return hit

    @functools.cached_property
    def weights_bytes_per_device(self) -> int | None:
        """DP x EP: bytes of weights one device holds, as the model runner places them (the replicated
        weights and 1/N of the routed experts: `glm53.engine.build.weights_bytes_per_device`), for the
        weights `weight_bytes` names (None: the FP8 checkpoint's fp8 modules, the rest bfloat16; 4: float32;
        2: bfloat16); None for any other layout or weight size (not reported)."""
        if not self.deploy.experts_across_ranks or self._weight_bytes not in (None, 2, 4):
            return None
        return _weights_per_device(self.cfg, self.dp_ranks, self._weight_bytes)

    def all2all_bytes(self) -> int:
        """DP x EP: bytes one device sent by all-to-all over the run (the first rounds of every program's MoE
        dispatches, under MTP the MTP layer's passes too: `glm53.engine.runner.ranks.group_first_round_slots`),
        as `Engine.metrics`' ep_all2all_bytes."""
        return self._all2all

    def execute_ranks(self, plans: typing.Sequence[StepPlan | None]) -> list[StepResult | None]:
        """DP x EP (`DeployConfig.experts_across_ranks`; build_engine links the ranks' runners): every
        rank's plan priced as one lock-step, as `glm53.engine.runner.ranks.execute_ranks` runs it -> each
        rank's StepResult (None where its plan is None), each carrying the step's price.

        Each rank completes its own transfers on its own runner (tokens, tier jobs, bytes); the step is the
        slowest rank's transfers (each GPU its own link), then per width bucket present on any rank
        (`ranks.rank_groups`) one forward that every rank runs at the same padded rows and the widest window
        (a rank without such rows passes padding rows, which cost as much as real ones), `forward_cost`
        under `StepLayout.dp` (a rank's tokens, its 1/N of the experts), plus its all-to-alls
        (`all2all_cost`) and, under MTP, its MTP pass's all-to-alls and its draft passes with theirs; then
        the host parts as in `execute`. HiSparse misses and staging are each group's slowest rank's."""
        ranks = self.ranks
        if len(plans) != len(ranks):
            raise ValueError(f"{len(plans)} plans for {len(ranks)} ranks")
        if self.clock is not None:
            for run in ranks:
                run._t = max(run._t, self.clock.now())
        results: list[StepResult | None] = [None] * len(ranks)
        transfers = []
        for r, plan in enumerate(plans):
            if plan is not None:
                run = ranks[r]
                results[r] = run._run(plan)
                moves = sum(1 for op in plan.transfers if not isinstance(op, (ResetLease, TierStore, TierLoad)))
                d2h, h2d = results[r].d2h_bytes, results[r].h2d_bytes
                cost = self._memo(("transfers", d2h, h2d, moves), lambda: step_cost(
                    self.cfg, self.hw, self.dep, _Rows(()), d2h_bytes=d2h, h2d_bytes=h2d, host_transfers=moves))
                if cost.parts:  # (a rank that moved nothing books nothing)
                    run._book([(cost, False)])
                transfers.append(cost)
        made, plans = plans, [None if p is None else ranks[r]._as_priced(p) for r, p in enumerate(plans)]
        segments = [(max(transfers, key=StepCost.time_s, default=StepCost(())), False)]
        has_rows = False
        if self.dp_pacing == "vllm":
            has_rows = self._vllm_forward(plans, segments)
        groups = rank_groups(plans, *self._limits, self.verify_width) if self.dp_pacing == "lockstep" else {}
        for width, per in groups.items():
            rows = max(p for _, p, _ in per.values())
            window = max(w for _, _, w in per.values())
            sample = any(plans[r].rows[i].sample for r, (idx, _, _) in per.items() for i in idx)
            has_rows = True
            verify = width == (self.verify_width or 1)
            extra = []  # per rank with rows here: its hot-buffer misses (verify) or staged prefill rows
            for r, (idx, _, _) in per.items():
                run = ranks[r]
                extra.append(run._miss_rows(plans[r]) if verify else run._stage_rows(plans[r], idx))
                if verify:
                    run.hot_miss_rows += extra[-1]
                else:
                    run.staged_rows += extra[-1]
            hot, drafted = max(extra), width - 1 if verify else 0
            k = self.verify_width - 1 if self.verify_width else 0
            views = verify and group_has_leases(plans, per)
            main, drafts = self._memo(("slots", width, rows, views, sample), lambda: group_first_round_slots(
                self.cfg, self.dp_ranks, width, rows, k=k, sequential=self.verify_mode == "sequential",
                views=views, drafts=sample))
            segments.append((self._memo(("forward", rows, width, window, sample, hot, drafted, *main), lambda: StepCost(
                forward_cost(self.cfg, self.hw, self.dep, rows, width, window, sample=sample, hot_miss_rows=hot,
                             drafts=drafted).parts + self.all2all_cost(main).parts)), sample))
            self._all2all += (sum(main) + sum(drafts)) * self._slot_bytes
            if sample and self.verify_width:  # the group's draft passes, on every rank's padded rows
                segments.append((self._memo(("draft", rows, window, *drafts), lambda: StepCost(
                    mtp_draft_cost(self.cfg, self.hw, self.dep, [window] * rows, self.verify_width - 2).parts
                    + self.all2all_cost(drafts).parts, per_layer=False)), True))
        times = self._segment_times(segments)
        by_name = _by_name(segments[1:])
        for run in ranks:  # every rank's GPU runs the step's forwards (its transfers are booked above)
            run._book(segments[1:], by_name)
        has_rows = has_rows or any(p is not None and p.rows for p in made)  # rows all priced as loaded
        seconds = [run._timed(times, has_rows) for run in ranks][0]  # the same work on every rank
        out: list[StepResult | None] = []
        for r, (plan, res) in enumerate(zip(made, results)):
            if plan is None:
                out.append(None)
                continue
            took, loads = ranks[r]._end_step(plan, seconds)  # a rank without rows waits for its tiers
            out.append(dataclasses.replace(res, duration_s=took, tier_loads=loads))
        return out


    def _vllm_forward(self, plans: typing.Sequence[StepPlan | None], segments: list) -> bool:
        """`execute_ranks`' forwards under dp_pacing="vllm", appended to `segments` -> whether any rank had
        rows. Each rank with rows runs one forward of its own rows (`step_cost` of its plan, with its
        hot-buffer misses and staged rows); the step lasts as long as the slowest rank's forward without
        its routed experts, plus the experts of every rank's real tokens (each GPU 1/N of them: a rank
        of their mean, as `step_cost` prices it), plus the all-to-alls of the busiest sender's tokens
        (`ops.moe`: fp8 dispatch, bf16 combine; padding rows skip the experts, as vLLM's do), per MoE
        layer; then, under MTP, the slowest rank's draft passes over its own sampled rows. Ranks
        without rows (vLLM's dummy batches) cost no more than the slowest rank."""
        ranks, n = self.ranks, self.dp_ranks
        busy = [(r, p) for r, p in enumerate(plans) if p is not None and p.rows]
        if not busy:
            return False
        own, drafts, tokens = [], [], []
        for r, plan in busy:
            run = ranks[r]
            misses, staged = run._miss_rows(plan), run._stage_rows(plan)
            run.hot_miss_rows += misses
            run.staged_rows += staged
            cost = step_cost(self.cfg, self.hw, self.dep, plan, hot_miss_rows=misses + staged)
            own.append(StepCost(tuple(c for c in cost.parts if c.name != "moe_experts")))
            tokens.append(sum(row.num_tokens for row in plan.rows))
            drafting = [row.start + row.num_tokens for row in plan.rows if row.sample]
            if drafting and self.verify_width:
                drafts.append(mtp_draft_cost(self.cfg, self.hw, self.dep, drafting, self.verify_width - 2))
        mean, busiest = sum(tokens) / n, max(tokens)

        def shared() -> tuple:  # per MoE layer: the experts of the mean rank's tokens, the busiest sender's all-to-alls
            dep, layers = self.dep, moe_layers(self.cfg, self.dep.include_mtp)
            kw = dict(weight_bytes=dep.weight_bytes, load_imbalance=dep.moe_load_imbalance)
            experts = moe(self.cfg, self.hw, mean, n, **kw)[1]
            a2a = moe(self.cfg, self.hw, busiest, n, **kw)[3:]
            return tuple(c.scaled(layers) for c in (experts, *a2a) if c.time_s > 0)

        common = self._memo(("vllm moe", mean, busiest), shared)
        sample = any(row.sample for _, p in busy for row in p.rows)
        segments.append((StepCost(max(own, key=StepCost.time_s).parts + common), sample))
        if drafts:
            segments.append((max(drafts, key=StepCost.time_s), True))
        # bytes one device sent: its mean share of the real tokens' dispatch (fp8 + scales) and combine (bf16)
        remote = mean * expected_remote_ranks(self.cfg, n) * moe_layers(self.cfg, self.dep.include_mtp)
        self._all2all += int(remote * self.cfg.hidden_size * (1 + 4 / 128 + 2))
        return True


def _by_name(segments) -> list[tuple[str, list[float]]]:
    """The seconds of every part of [(StepCost, waits)] by name: [(name, [seconds, in order])], names in
    the order of their first part. Booking a name's seconds one after the other onto its running total
    (`SimRunner._book`) makes the same float additions in the same order as booking part by part (the
    additions to different names do not interact), and enters new names in the same order."""
    out: dict[str, list[float]] = {}
    for cost, _ in segments:
        for c in cost.parts:
            times = out.get(c.name)
            if times is None:
                out[c.name] = [c.time_s]
            else:
                times.append(c.time_s)
    return list(out.items())


def build_engine(cfg: ModelConfig, deploy: DeployConfig | None = None, hw: HardwareSpec = H200_CALIBRATED, **runner_kw) -> Engine:
    """An Engine over `cfg` (no weights) whose replicas each run a SimRunner on `hw`, on a VirtualClock.
    None fields of `deploy` resolve as on CPU (vLLM's CPU batch limits, a 4 GiB KV budget): set
    max_num_batched_tokens, max_num_seqs and kv_cache_memory_bytes (per GPU) for an H200 deployment.
    Secondary tiers in `deploy` (kv_transfer_config's secondary_tiers) are simulated on the media of
    `runner_kw["tier_storage"]` (default glm53.perfmodel.STORAGE); their root_dir and the like are not used."""
    d = (deploy or DeployConfig()).resolved(cfg, SIM_DTYPE)
    sizes = d.kv_sizes(cfg, SIM_DTYPE)
    clock = VirtualClock()
    runners = [SimRunner(cfg, d, sizes, hw, clock=clock, **runner_kw) for _ in range(d.data_parallel_size)]
    if d.experts_across_ranks:  # DP x EP: rank 0's runner prices every rank's plan as one step
        runners[0].ranks = runners
    return Engine(cfg, d, runner=runners, clock=clock)
