"""KV policies: what happens to a request's KV when the device block pool runs out; the base every
policy of kvcache.policies builds on.

A policy is a planner. It decides on the block pool (`kvcache.block_pool.KVCacheManager`) and on a
narrow view of requests (`RequestView`), and it records the KV movement its decisions need as transfer
operations (kvcache.transfer) in its outbox; the scheduler puts them into the step's plan and a runner
executes them. A policy never holds device arrays, never calls a runner and never reaches into the
scheduler, so the same decisions run against the model, a simulator or a test.

The scheduler calls, per request: `admit` (take a cached prefix), `forget` (undo it: the request did not
fit), `admission_key` (whether a retry of a request that did not fit could go differently),
`extra_blocks` / `prepare` (blocks a chunk needs beyond its new tokens' pages, and what to do with them
once allocated), `make_room` (free blocks without evicting anyone), `choose_victim` (whom to evict when
nothing else makes room), `evict` (the request gives up its device blocks), `saved_tokens` / `restore`
(KV held outside the pool and its return), `row_tables` (what the runner reads for the request's row
this step), `on_finish`; per step: `after_step`. It takes the outbox with `take_transfers` at the end
of each `schedule` and `update`.

`Policy` is that protocol with every hook doing the plain thing (drop the victim's KV and recompute it:
vLLM's recompute preemption), and the spec the engine, the deployment config and the simulator read
(class-level hooks: config checks, sizes, construction, metrics, Prometheus series, pricing), each with a
neutral default; a policy overrides only what it changes. The deployment config is read duck-typed
(glm53.engine.config.DeployConfig's fields and properties): kvcache imports nothing from glm53.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcache.block_pool import KVCacheManager
from kvcache.transfer import Transfer


class RequestView(Protocol):
    """What a policy may read of a request (the scheduler's `Request` is one)."""

    req_id: str
    num_computed_tokens: int  # leading tokens whose KV is cached or computed

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: prompt + generated."""

    @property
    def tokens(self) -> Sequence[int]:
        """The prompt and the generated tokens (hashed for prefix caching): len() and contiguous slices,
        each slice built only when asked for (a long context is not copied per admission)."""

    @property
    def extra_keys(self) -> tuple:
        """Extra prefix-hash keys (the request's salt)."""


RowTables = tuple[dict[str, tuple[int, ...]], object]  # (per cache group, the row's block table; the policy's per-row data or None)


class KVPolicy(Protocol):
    def take_transfers(self) -> list[Transfer]:
        """The operations recorded since the last call, in decision order (the outbox is emptied)."""

    def has_transfers(self) -> bool:
        """Whether the outbox holds operations not yet taken."""

    def admit(self, kv: KVCacheManager, req: RequestView) -> int:
        """Start tracking a newly admitted request; -> prompt tokens whose KV is already available."""

    def admit_if(self, kv: KVCacheManager, req: RequestView, fits) -> int | None:
        """`admit`, for a policy that can tell before it takes anything that the request will not fit: it
        may ask `fits(computed_tokens, taken)` (the scheduler's test of the first chunk, with `taken` free
        device blocks fewer: those its touches would take out of the free queue) once the request's tables
        and `extra_blocks` read as after `admit`, no reference taken yet. On no it leaves every pool, table
        and its own state as `admit`, `forget` and `KVCacheManager.free(keep_hashes=True)` would, moves the
        counters `admit` moves, and -> None. Only a policy whose `make_room` never acts at admission and
        whose chunks never shrink may ask, so that no is final. The default admits and asks nothing."""

    def forget(self, kv: KVCacheManager, req: RequestView) -> None:
        """Undo `admit` (the request did not fit after all)."""

    def admission_counts(self) -> tuple[int, ...]:
        """Counters of the policy's own that an admission attempt moves even when the request then does not
        fit (e.g. secondary-tier lookups answered MISS): the scheduler adds a failed attempt's change again
        when it skips an identical retry (`add_admission_counts`), so skipping changes no count."""

    def add_admission_counts(self, delta: tuple[int, ...]) -> None:
        """Add `delta` (a difference of two `admission_counts`) to those counters."""

    def drop(self, kv: KVCacheManager, req: RequestView) -> None:
        """Waiting `req` leaves for good (aborted): release whatever the policy holds for it (saved KV,
        host pages pinned for it, its place in tier loads)."""

    def admission_key(self, kv: KVCacheManager, req: RequestView, running: Sequence[RequestView]) -> object:
        """A value (compared with ==) that moves whenever anything an admission attempt of waiting `req`
        reads, beyond the device pool and the request itself, may have changed: the policy's own pools and
        state, and what `make_room` reads of the running requests. The scheduler skips re-admitting a
        request that did not fit while neither this nor the device pool's version has moved (the attempt
        would fail again and leave everything as it was)."""

    shrink_chunks: bool
    admission_acted: bool
    """Set by an admission attempt that changed more than the prefix lookup does (the scheduler resets
    it before each attempt and does not skip the retry of a failed attempt that set it)."""

    """Whether the scheduler shortens a prefill chunk that does not fit rather than evicting (vLLM evicts;
    HiSparse with row staging shortens, so a prompt longer than the pool makes progress)."""

    def device_blocks(self, kv: KVCacheManager, num_tokens: int) -> int:
        """Most device blocks a request of `num_tokens` tokens (prompt, outputs, lookahead) holds at once
        under this policy: what `Scheduler.add` checks against the pool (a request above it could never
        run). Plain policies: every page of every group."""

    def extra_blocks(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> int:
        """Device blocks a chunk of `num_tokens` needs beyond the pages of its new tokens."""

    def admission_reserve(self, kv: KVCacheManager, running: Sequence[RequestView]) -> int:
        """Free blocks that admitting one more request must leave free (beyond its first chunk's need) for
        what the `running` requests, the candidate last among them, will need without anything left to
        release: e.g. HiSparse hot buffers of requests still prefilling. Read with the admission key."""

    def prepare(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> None:
        """Called once the chunk's blocks are allocated (and `extra_blocks` are free)."""

    def make_room(self, kv: KVCacheManager, running: Sequence[RequestView], free_blocks: int) -> bool:
        """Try to reach `free_blocks` free blocks without evicting a request; -> whether anything was freed."""

    def choose_victim(self, candidates: Sequence[RequestView]) -> RequestView:
        """The request to evict when nothing else makes room for `candidates[0]`: one of `candidates`, the
        running requests not yet scheduled this step in admission order (`candidates[0]` itself: it waits)."""

    def evict(self, kv: KVCacheManager, victim: RequestView) -> bool:
        """`victim` is about to give up its device blocks (the scheduler frees them right after). -> True if
        the policy saved all of its computed KV outside the pool (nothing is recomputed; it comes back
        through `restore`), False if what the device pool does not keep cached is recomputed."""

    def saved_tokens(self, req: RequestView) -> int:
        """Tokens of KV the policy holds for `req` outside the device pool (0: none)."""

    def restore(self, kv: KVCacheManager, req: RequestView) -> None:
        """Bring the saved KV into the request's newly allocated blocks."""

    def row_tables(self, kv: KVCacheManager, req: RequestView) -> RowTables:
        """What the runner reads for `req`'s row this step: its block table per cache group, and the
        policy's per-row data (kvcache.policies.hisparse.HiSparseRow, or None)."""

    def on_finish(self, kv: KVCacheManager, req: RequestView) -> None:
        """The request finished; the scheduler frees its device blocks right after."""

    def after_step(self, kv: KVCacheManager, running: Sequence[RequestView]) -> None:
        """After a step's results are in and the scheduler has advanced its requests."""

    def waiting_for(self, req: RequestView) -> bool:
        """Whether waiting `req`'s KV is still on the way from a secondary tier (its admission is not tried)."""

    def must_retry(self, req: RequestView) -> bool:
        """Right after `admit`: whether the lookup answered RETRY (the scheduler undoes the attempt with
        `forget` and passes the request over this step)."""

    def on_tier_results(self, results) -> dict[str, str]:
        """The runner's report of finished secondary-tier loads (StepResult.tier_loads) -> {req_id: why}
        for the requests a failed load fails (kv_load_failure_policy "fail"; the scheduler finishes them
        with "error"), {} when none does."""

    def on_records(self, resolves, stages) -> None:
        """The step's records from the policy's device half (StepResult.resolves and .stages), for its
        metrics."""

    def unreported_tier_loads(self) -> tuple[int, ...]:
        """Tier load jobs the policy waits for that no runner will report (a step raised before submitting
        them or lost their results): the engine reports them to `on_tier_results` with status "failed"."""

    def attach_events(self, sink) -> None:
        """Report the policy's own pools' hashes to a KV event sink (kvcache.events.KVEventRecorder)."""

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of the policy's own pools (the engine's prefix-cache reset; the device pool's
        are the scheduler's)."""


class Policy:
    """Drop the victim's KV and recompute it when it runs again (vLLM's recompute preemption): each
    planner hook does the plain thing. Also the policy's spec, read through kvcache.policies.REGISTRY by
    the engine (glm53.engine), its config checks and the simulator: the class-level hooks below the
    planner's, each neutral here. `deploy` in them is a glm53.engine.config.DeployConfig, `sizes` its
    KVSizes, `cfg` the model's ModelConfig, `sch` a glm53.engine.scheduler.Scheduler (read, not imported)."""

    # ------------------------------------------------------------------------------- spec: config
    accepts_connector = False
    """Whether the offload connector (kv_transfer_config) may be given with this policy: the deployment
    then runs kv_policy="offload" (the connector is that policy), unless `own_connector`."""
    own_connector = False
    """With the connector, keep this policy: it reads the connector's budget and tiers itself (checked by
    `check_connector`)."""
    uses_tiers = False  # whether the connector's secondary tiers sit behind this policy's host pools
    too_large_hint = "; kv_policy='hisparse' keeps most of a long request's KV in host memory"
    """What the scheduler adds when it refuses a request larger than the device pool allows."""

    @classmethod
    def check(cls, deploy) -> None:
        """Raise ValueError / NotImplementedError (naming the field) for a deployment this policy cannot run.
        Called by DeployConfig once kv_transfer_config has been applied."""

    @classmethod
    def check_connector(cls, deploy, opts: dict) -> None:
        """Raise ValueError for connector options (`opts`: kv_connector_extra_config over its defaults) this
        policy cannot run with; only for an `own_connector` policy."""

    @classmethod
    def stages_rows(cls, deploy) -> bool:
        """Whether prefill chunks over host-only pages stage only the rows they select (DeployConfig.
        hisparse_stages_rows): a request may then exceed the device pool."""
        return False

    @classmethod
    def device_request_blocks(cls, deploy, cfg, request: int) -> tuple[int, int]:
        """(blocks a request of max_model_len holds in the pool when running, the fewest the pool must
        hold for one such request to run) given `request`, every page of every group: the first caps
        the pool at max_num_seqs such requests, the second is what the KV budget must hold."""
        return request, request

    @classmethod
    def host_sizes(cls, deploy, cfg, pages: dict[str, int]) -> dict:
        """The host-side fields of KVSizes (host_blocks, hot_rows, max_leases) for page bytes `pages` per
        cache group; raises ValueError for a budget that cannot run."""
        return {"host_blocks": {}}

    @classmethod
    def verify_rows_limit(cls, sizes) -> int | None:
        """Rows the union of a batched MTP verify step's selections must fit in on the device
        (glm53.engine.spec_decode.SpeculativeConfig.verify_form's rows_limit); None: no limit."""
        return None

    # ------------------------------------------------------------------------ spec: construction
    @classmethod
    def make(cls, deploy, sizes, tiers=None, fingerprint: str = "") -> Policy:
        """The planner of one replica of `deploy`, sized by `sizes` (`tiers`: the secondary tiers behind
        its host pools when `uses_tiers`; `fingerprint`: their key prefix)."""
        return cls()

    @classmethod
    def device_half(cls, deploy, sizes, *, index_topk: int):
        """This policy's device half for a replica of `deploy` with `sizes` (kvcache.policies.device: the
        arrays and copies it needs at execute time, which the model runner calls without knowing the
        policy); `index_topk`: the model's top-k. The default has none: the plain paged cache."""
        from kvcache.policies.device import DeviceHalf

        return DeviceHalf()

    # ---------------------------------------------------------------------- spec: the simulator
    @classmethod
    def sim_layout(cls, deploy) -> dict:
        """Fields of the performance model's StepLayout (glm53.perfmodel.step) this policy sets."""
        return {}

    @classmethod
    def sim_miss_rows(cls, plan, topk: int, miss_fraction: float) -> float:
        """Rows per layer a priced step's decode rows copy host -> device (assumed misses)."""
        return 0.0

    @classmethod
    def sim_stage_rows(cls, plan, deploy, topk: int, rows=None) -> float:
        """Rows per layer a priced step's prefill chunks stage from the host (over all the plan's rows,
        or the indices in `rows`)."""
        return 0.0

    # -------------------------------------------------------------------- metrics (per planner)
    def metrics(self, sch) -> dict:
        """This replica's policy figures for Engine.metrics, each summable over replicas."""
        return {}

    @classmethod
    def finish_metrics(cls, out: dict) -> None:
        """Turn the replicas' summed figures (`out`, in place) into the ones that do not add up (rates)."""

    def tier_metrics(self) -> dict:
        """The offload tiers' counters, {tier: {...}}; {} for a policy without them (Engine.metrics'
        "kv_offload"; its vllm:kv_offload_* series)."""
        return {}

    @classmethod
    def reports_tiers(cls, deploy) -> bool:
        """Whether the vllm:kv_offload_* series are exported for `deploy`."""
        return False

    prometheus_series: tuple[tuple[str, str, str, str], ...] = ()
    """(key, "gauge" | "counter", series name, help) of the policy's own Prometheus series."""

    def prometheus_values(self, sch, engine) -> dict[str, float]:
        """This replica's value of each of `prometheus_series` by key (`engine`: the glm53 Engine)."""
        return {}


    def __init__(self):
        self.outbox: list[Transfer] = []

    def take_transfers(self) -> list[Transfer]:
        out = list(self.outbox)
        self.outbox.clear()  # in place: a policy's kvcache.host_tier.HostTier records into this same list
        return out

    def has_transfers(self) -> bool:
        return bool(self.outbox)

    def admit(self, kv: KVCacheManager, req: RequestView) -> int:
        return kv.admit(req.req_id, req.tokens, req.extra_keys)

    def admit_if(self, kv: KVCacheManager, req: RequestView, fits) -> int | None:
        return self.admit(kv, req)

    def forget(self, kv: KVCacheManager, req: RequestView) -> None:
        pass

    def drop(self, kv: KVCacheManager, req: RequestView) -> None:
        pass

    def admission_counts(self) -> tuple[int, ...]:
        return ()

    def add_admission_counts(self, delta: tuple[int, ...]) -> None:
        pass

    def admission_key(self, kv: KVCacheManager, req: RequestView, running: Sequence[RequestView]) -> object:
        return self.saved_tokens(req)  # admission reads the device pool only; make_room frees nothing

    shrink_chunks = False
    admission_acted = False

    def device_blocks(self, kv: KVCacheManager, num_tokens: int) -> int:
        return kv.blocks_needed_all(num_tokens)

    def extra_blocks(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> int:
        return 0

    def admission_reserve(self, kv: KVCacheManager, running: Sequence[RequestView]) -> int:
        return 0

    def prepare(self, kv: KVCacheManager, req: RequestView, num_tokens: int) -> None:
        pass

    def make_room(self, kv: KVCacheManager, running: Sequence[RequestView], free_blocks: int) -> bool:
        return False

    def choose_victim(self, candidates: Sequence[RequestView]) -> RequestView:
        return candidates[-1]  # the newest (vLLM's)

    def evict(self, kv: KVCacheManager, victim: RequestView) -> bool:
        return False

    def saved_tokens(self, req: RequestView) -> int:
        return 0

    def restore(self, kv: KVCacheManager, req: RequestView) -> None:
        raise RuntimeError(f"{type(self).__name__} saves no KV")

    def row_tables(self, kv: KVCacheManager, req: RequestView) -> RowTables:
        return {g: tuple(kv.block_table(req.req_id, g)) for g in kv.groups}, None

    def on_finish(self, kv: KVCacheManager, req: RequestView) -> None:
        pass

    def after_step(self, kv: KVCacheManager, running: Sequence[RequestView]) -> None:
        pass

    def waiting_for(self, req: RequestView) -> bool:
        return False

    def must_retry(self, req: RequestView) -> bool:
        return False

    def on_tier_results(self, results) -> dict[str, str]:
        raise RuntimeError(f"tier load results {results} for a policy without secondary tiers")

    def on_records(self, resolves, stages) -> None:
        if resolves or stages:
            raise RuntimeError("device-half records for a policy whose device half makes none")

    def unreported_tier_loads(self) -> tuple[int, ...]:
        return ()

    def attach_events(self, sink) -> None:
        pass  # no pool of its own that caches prefixes

    def reset_prefix_cache(self) -> None:
        pass
