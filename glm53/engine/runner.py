"""The model runner: executes a `glm53.engine.plan.StepPlan` on the paged KV pool of one device or a
context mesh, and samples.

Per step it runs the plan's KV transfers (kvcache.host.HostMemory), then groups the rows by width
bucket (1 token for decoding requests; powers of two from 16 up to max_num_batched_tokens for prefill
chunks) and runs one padded forward per group (rows: powers of two up to max_num_seqs; attention
window: powers of two up to the cache capacity), then samples. A serving run therefore compiles a
bounded set of programs (`bucket_shapes`; `warmup` compiles them all, the copy programs of the KV
policy included; `compiled_shapes` lists those used), and padding stays under 2x per row: a decoding
row never pads to a prefill chunk's width. Sampling is a jitted function of per-request PRNG keys
(seed, number of tokens generated so far), so a request samples the same tokens whatever it is batched
with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention.common import pow2_at_least
from glm53.api import window_bucket
from glm53.engine.config import DeployConfig, KVSizes
from glm53.engine.plan import PlanRow, ResolveRecord, StageRecord, StepPlan, StepResult
from glm53.engine.spec_decode import rates_array, rejection_sample
from glm53.model import GLM53, attention_form, compiled
from kvcache.host import HiSparseView, HostMemory, StagingView
from kvcache.paged import PagedKVCache
from parallel import model as parallel_model
from parallel import tp as parallel_tp
from parallel.cp_cache import CpKVCache, counter_totals, zero_counters
from parallel.mesh import make_mesh
from parallel.pcp import PcpSplit


MIN_PREFILL_WIDTH = 16  # narrowest prefill bucket: shorter chunks pad to it (fewer programs)


def width_buckets(max_tokens: int, verify_width: int = 0) -> list[int]:
    """Tokens per row of the compiled programs: 1 (decode) and powers of two from MIN_PREFILL_WIDTH up to
    `max_tokens` (a power of two: the step's token budget, or max_model_len if smaller). Under MTP the
    first bucket is `verify_width` (1 + num_speculative_tokens: a decoding row and its drafts) instead
    of 1."""
    w = min(MIN_PREFILL_WIDTH, max_tokens)
    prefill = [w << i for i in range((max_tokens // w).bit_length())]
    if verify_width in prefill:
        raise NotImplementedError(f"a verify width of {verify_width} tokens (1 + num_speculative_tokens) must be "
                                  f"below the narrowest prefill width {w} (min(16, max_num_batched_tokens))")
    return [verify_width or 1] + prefill


def step_limits(deploy: DeployConfig) -> tuple[int, int]:
    """(widest row bucket, positions a block table addresses) of a runner of the resolved `deploy`: no
    chunk is wider than the budget or than a whole request; max_model_len rounded up to whole pages."""
    return (pow2_at_least(min(deploy.max_num_batched_tokens, deploy.max_model_len)),
            deploy.max_blocks_per_seq * deploy.tokens_per_block)


def forward_groups(rows, max_tokens: int, capacity: int, verify_width: int = 0) -> list[tuple[int, list[int], int, int]]:
    """How a step's rows (anything with `start`, `num_tokens` and `num_draft_tokens`) run as padded
    forwards: one forward per width bucket -> [(width, indices of its rows, padded rows, window)], in
    order of first appearance. Padded rows: a power of two; window: the attention window bucket of the
    group's last position (`glm53.api.window_bucket` under `capacity`). Under MTP (`verify_width`) a row
    with drafts, or of one token, goes to the verify bucket, every other row to a prefill width. The
    model runner executes exactly these shapes and the simulator prices them
    (`glm53.engine.sim.SimRunner(pad_like_runner=True)`)."""
    widths = width_buckets(max_tokens, verify_width)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if verify_width and (row.num_draft_tokens or row.num_tokens == 1):
            w = verify_width
        else:
            w = next(w for w in widths[1 if verify_width else 0:] if w >= row.num_tokens)
        groups.setdefault(w, []).append(i)
    return [(w, idx, pow2_at_least(len(idx)), window_bucket(max(rows[i].start + rows[i].num_tokens for i in idx),
                                                            capacity))
            for w, idx in groups.items()]


@jax.jit
def _sample(logits_RV, seeds_R, counters_R, temps_R, top_ps_R):
    """Temperature / top-p sampling, one PRNG key per row: fold_in(key(seed), counter)."""

    def one(logits, seed, counter, temp, top_p):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        z = logits / temp
        order = jnp.argsort(-z)
        probs = jax.nn.softmax(z[order])
        keep = jnp.cumsum(probs) - probs < top_p  # the smallest prefix whose mass reaches top_p
        z_sorted = jnp.where(keep, z[order], -jnp.inf)
        return order[jax.random.categorical(key, z_sorted)]

    return jax.vmap(one)(logits_RV, seeds_R, counters_R, temps_R, top_ps_R)


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(logits_fn, state, hidden_RTD, last_R):
    """Logits of each row's last real token: one program per (model, rows, width), shared by every
    engine on the model (no eager gathers that would compile per shape)."""
    return logits_fn(state, hidden_RTD[jnp.arange(hidden_RTD.shape[0]), last_R])


class CompileCounter:
    """Context manager counting XLA compilations (JAX's backend-compile events) while active: `.count`."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event, duration_s, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


@jax.jit
def _take_tokens(hidden_RTD, order_T):
    return hidden_RTD[:, order_T]


@jax.jit
def _take_rows(hidden_RTD, last_R):
    """hidden [R, T, D] -> [R, 1, D] at each row's position last_R[r]."""
    return jnp.take_along_axis(hidden_RTD, last_R[:, None, None], axis=1)


@functools.partial(jax.jit, static_argnums=0)
def _position_logits(logits_fn, state, hidden_RJD):
    """Logits of every position of a verify group -> [R, J, V], one position at a time: each is the
    [R, D] product a one-token decode step of R rows computes (`_last_logits`), so on XLA:CPU the same
    bits (one product over all R x J rows may take another kernel and round differently)."""
    return jnp.swapaxes(jax.lax.map(lambda h_RD: logits_fn(state, h_RD), jnp.swapaxes(hidden_RJD, 0, 1)), 0, 1)


@functools.partial(jax.jit, static_argnums=0)
def _mtp_head(logits_fn, state, hidden_RTD, sel_R):
    """The MTP layer's output at each row's position sel_R -> (that state [R, 1, D], which the next draft
    pass carries, its argmax draft [R, 1] int32)."""
    h_R1D = hidden_RTD[jnp.arange(hidden_RTD.shape[0]), sel_R][:, None]
    return h_R1D, jnp.argmax(logits_fn(state, h_R1D[:, 0]), axis=-1).astype(jnp.int32)[:, None]


@jax.jit
def _concat_drafts(drafts):
    return jnp.concatenate(drafts, axis=1)


@functools.partial(jax.jit, static_argnums=0)
def _draft_argmax(logits_fn, state, hidden_R1D):
    """A one-token MTP pass's draft: argmax of its logits -> [R, 1] int32."""
    return jnp.argmax(logits_fn(state, hidden_R1D[:, 0]), axis=-1).astype(jnp.int32)[:, None]


class ModelRunner:
    """Executes step plans on `devices` (default: the first `deploy.devices_per_replica` of
    `jax.devices()`; a data-parallel replica passes its own group). One device: weights and KV pool live
    there. Several: a context mesh over them (parallel.model), or under tensor parallelism a mesh
    tp x cp (DCP reusing the TP ranks) with the weights split over it (parallel.tp). `sizes`: the
    replica's pool, page and host-pool sizes (glm53.engine.config.KVSizes), the same numbers its policy
    plans with."""

    def __init__(self, model: GLM53, deploy: DeployConfig, sizes: KVSizes, devices=None, *, tiers=None):
        self.model = model
        self.deploy = deploy
        self.sizes = sizes
        self.c = compiled(model)
        n = deploy.devices_per_replica
        if devices is None:  # this process's devices, in the order make_mesh uses
            devices = sorted(jax.local_devices(), key=lambda d: d.id)[:n]
            if len(devices) < n:
                make_mesh(cp=n)  # raises with how to simulate more devices on CPU
        devices = list(devices)
        if len(devices) != n:
            raise ValueError(f"a runner with devices_per_replica={n} needs {n} devices, got {len(devices)}")
        experts = model.cfg.n_routed_experts
        self.tp = deploy.tensor_parallel_size  # TP pads the experts to its ranks (parallel.tp)
        if self.tp > 1:
            # before any array is allocated: what TP cannot split (fp8 experts by width, blocks straddling)
            parallel_tp.check_weights(self.c.state, model.cfg, self.tp, deploy.enable_expert_parallel)
        if deploy.enable_expert_parallel and self.tp == 1 and n > 1 and experts % n:
            raise ValueError(f"enable_expert_parallel: the model's {experts} routed experts do not split over the "
                             f"{n} devices of the context axis")
        self.devices = devices
        self.tiers = tiers  # the offload host tier's secondary tiers (kvcache.tiers.TierSet), or None
        # MTP speculative decoding: drafts per step (0: off), the verify bucket, the verify mode
        self.spec = deploy.speculative
        self.k = deploy.num_speculative_tokens
        if self.k and model.cfg.num_nextn_predict_layers < 1:
            raise ValueError("DeployConfig.speculative_config: the model has no MTP layer to draft with")
        self.verify_width = 1 + self.k if self.k else 0
        # one resolver plan per group serves the union of the 1 + k positions' selections under batched
        # verify: the hot buffer must hold it (the default (k + 2) x top-k does), else "auto" resolves one
        # position at a time
        self.verify_mode = self.spec.verify_form(
            devices[0].platform, hisparse=deploy.kv_policy == "hisparse", hot_rows=sizes.hot_rows,
            index_topk=model.cfg.index_topk) if self.k else None
        self._views: list[HiSparseView | StagingView] = []  # the views a group's forwards returned
        self.rates = rates_array(self.spec, self.k)
        self.compiled_draft_shapes: set[tuple] = set()  # (rows, window) of the MTP layer's one-token passes
        with jax.default_device(devices[0]):  # every array this runner creates starts on its devices
            self._init(sizes.num_blocks)

    def _init(self, num_blocks: int):
        model, deploy = self.model, self.deploy
        self.max_rows = pow2_at_least(deploy.max_num_seqs)
        self.max_tokens = step_limits(deploy)[0]
        self.num_blocks = num_blocks
        # Context parallelism (parallel.model): a mesh with one context axis of max(PCP, DCP) devices.
        # Under DCP a block id is a page of block_size slots on every rank, so the arrays hold
        # kv_ranks x num_blocks pages, split over the axis (rank r's table is the r-th slice).
        # Tensor parallelism (parallel.tp): a mesh tp x cp of devices_per_replica devices, DCP on its inner
        # "cp" axis, the weights split over both.
        n = deploy.context_parallel_size
        if self.tp > 1:
            self.mesh = make_mesh(**parallel_tp.mesh_sizes(self.tp, deploy.decode_context_parallel_size),
                                  devices=self.devices)
        else:
            self.mesh = make_mesh(cp=n, devices=self.devices) if n > 1 else None
        self.kv_ranks = deploy.decode_context_parallel_size
        self.cache = PagedKVCache.create(model.cfg, num_blocks * self.kv_ranks, deploy.block_size,
                                         self._table("mla", self.max_rows, []),
                                         index_block_size=deploy.index_block_size,
                                         index_block_table=self._table("indexer", self.max_rows, []),
                                         kv_cache_dtype=self.sizes.kv_cache_dtype,
                                         include_mtp=self.k > 0)
        if self.mesh is not None:
            self.cache = parallel_model.place(self._cp_cache(self.cache, False), self.mesh).local
            if self.tp > 1:
                self.state = parallel_tp.place_state(self.c.state, model.cfg, self.mesh, deploy.enable_expert_parallel)
            else:
                self.state = parallel_model.place_state(self.c.state, self.mesh, deploy.enable_expert_parallel)
            # each rank's work (parallel.cp_cache.COUNTERS): zeros in, this step's counts out; the step's
            # device arrays are folded into int64 host totals lazily (no sync on the serving path)
            self._cp_zero = jax.device_put(zero_counters(n), NamedSharding(self.mesh, P("cp")))
            self._cp_pending: list[dict] = []
            self._cp_totals = {k: np.zeros(n, np.int64) for k in self._cp_zero}
            # host copies of KV live with the rank that holds it (a DCP shard; the host pools split once more
            # over "tp": HostMemory(shared=))
            spec = P("cp") if self.kv_ranks > 1 else P()
            host = NamedSharding(self.mesh, spec, memory_kind="pinned_host")
            device = NamedSharding(self.mesh, spec, memory_kind="device")
        else:  # weights and pool committed to this runner's device (a data-parallel replica's own copy)
            self.cache = jax.device_put(self.cache, self.devices[0])
            self.state = jax.device_put(self.c.state, self.devices[0])
            host = jax.sharding.SingleDeviceSharding(self.devices[0], memory_kind="pinned_host")
            device = jax.sharding.SingleDeviceSharding(self.devices[0], memory_kind="device")
        # bytes of weights on the fullest device (engine.metrics()["weights_bytes_per_device"])
        self.weights_bytes_per_device = max(parallel_tp.bytes_on_each_device(self.state).values())
        # "auto": the model picks the dense form for short windows and, on CPU, for prefill chunks over a
        # few times top-k (attention.dense_mla.use_dense_mha); force_mqa sends everything sparse
        self.form = "mqa" if deploy.sparse_mla_force_mqa else "auto"
        self.compiled_shapes: set[tuple] = set()  # (rows, tokens, window): one program each
        self.staging_shapes: set[tuple] = set()  # ... run with HiSparse prefill staging (`StagingView`)
        sz = self.sizes
        self.hisparse = deploy.kv_policy == "hisparse"
        # prefill chunks over host-only pages stage their selected rows per tile (kvcache.host.StagingView)
        self.stage_rows = deploy.hisparse_stages_rows
        self.stage_tile = deploy.hisparse_prefill_tile_tokens
        self.host = HostMemory(self.cache, page_rows={"mla": deploy.block_size,
                                                      "indexer": deploy.index_block_size or deploy.block_size},
                               kv_ranks=self.kv_ranks, interleave=deploy.cp_kv_cache_interleave_size,
                               num_blocks=num_blocks, host=host, device=device,
                               host_blocks=sz.host_blocks or None, tiers=self.tiers,
                               # one host pool per replica, shared by its TP ranks (1/tp of it each)
                               shared=("tp", self.mesh.shape["tp"]) if self.mesh is not None else None,
                               hot=(sz.max_leases, len(self.cache.index), sz.hot_rows) if self.hisparse else None)
        if self.host.page_bytes != sz.page_bytes:  # the policy plans in kvcache.layout's page sizes
            raise RuntimeError(f"page bytes of the device arrays {self.host.page_bytes} differ from "
                               f"kvcache.layout's {sz.page_bytes}")

    @property
    def capacity(self) -> int:
        """Positions per request a block table can address (max_model_len rounded up to whole pages)."""
        return step_limits(self.deploy)[1]

    def _resolve_record(self, req_ids: tuple[str, ...], view: HiSparseView) -> tuple[ResolveRecord, int]:
        """The counts a HiSparse decode forward's resolvers left in its view -> (record, bytes copied)."""
        n = len(req_ids)
        hits, misses, copied, unserved = (np.asarray(x)[:n] for x in (view.hits, view.misses, view.copied,
                                                                       view.unserved))
        if unserved.any():  # never read fewer rows than selected without saying so
            bad = {r: int(u) for r, u in zip(req_ids, unserved) if u}
            raise RuntimeError(f"HiSparse: selected rows with no device page, host copy or hot slot: {bad}")
        return ResolveRecord(req_ids, hits, misses, copied), int(copied.sum()) * self.host.row_bytes_mla

    def _stage_record(self, req_ids: tuple[str, ...], view: StagingView) -> tuple[StageRecord, int]:
        """The counts a HiSparse prefill forward's staging left in its view -> (record, bytes copied)."""
        n = len(req_ids)
        staged, copied, unserved = (np.asarray(x)[:n] for x in (view.staged, view.copied, view.unserved))
        if unserved.any():  # never read fewer rows than selected without saying so
            bad = {r: int(u) for r, u in zip(req_ids, unserved) if u}
            raise RuntimeError(f"HiSparse: prefill rows selected positions with no device page or host copy: {bad}")
        return StageRecord(req_ids, staged, copied), int(copied.sum()) * self.host.row_bytes_mla

    def _table(self, group: str, rows: int, tables, window: int | None = None) -> np.ndarray:
        """Block tables [rows, pages] int32 (-1 padded) covering positions < `window` (None: the whole
        max_model_len): a step reads no page past its window, so its tables cost O(window) per step, not
        O(max_model_len), and their width follows the window bucket (no extra programs)."""
        d = self.deploy
        pages = d.max_blocks_per_seq if window is None else -(-window // d.tokens_per_block)
        if group == "indexer":
            pages = -(-pages * d.tokens_per_block // d.index_tokens_per_block)
        out = np.full((rows, pages), -1, np.int32)
        for i, t in enumerate(tables):
            t = t[:pages]  # pages past the window (MTP's lookahead slots) are not this forward's
            out[i, : len(t)] = t
        return out

    def width_buckets(self) -> list[int]:
        """Tokens per row: 1 (decode; 1 + k under MTP) and powers of two from MIN_PREFILL_WIDTH up to the
        budget."""
        return width_buckets(self.max_tokens, self.verify_width)

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, window) program a serving run can use."""
        rows = [1 << i for i in range(self.max_rows.bit_length())]
        windows = sorted({window_bucket(n, self.capacity) for n in
                          (1 << i for i in range(self.capacity.bit_length() + 1))})
        return [(r, w, win) for r in rows for w in self.width_buckets() for win in windows]

    def warmup(self, shapes=None) -> int:
        """Compile the programs of `shapes` (default: every bucket) by running padding-only steps, which
        write nothing (every slot is -1), and every copy program of the KV policy (kvcache.host); under
        HiSparse each decode shape also runs with a hot-buffer view. -> number of shapes run. After this
        a serving run compiles nothing (tests/engine counts compilations under every policy)."""
        shapes = self.bucket_shapes() if shapes is None else shapes
        if self.k:
            self._warmup_mtp(shapes)
        for rows, width, window in ([] if self.k else shapes):
            tok = np.zeros((rows, width), np.int32)
            pos = np.full((rows, width), -1, np.int32)
            views = [None]
            if self.hisparse and width == 1:
                views.append(self.host.view(self._table("mla", rows, [], window), np.full(rows, -1, np.int32),
                                            self.model.cfg.index_topk))
            elif self.stage_rows:  # a chunk over host-only pages (and the last layer's one query per row)
                views.append(self.host.staging_view(self._table("mla", rows, [], window), self.stage_tile))
            for view in views:
                hidden = self._forward(tok, pos, self._table("mla", rows, [], window),
                                       self._table("indexer", rows, [], window), window, view)
                logits = self._last_logits(self.state, hidden, np.zeros(rows, np.int32))
                ones = np.ones(rows, np.float32)
                _sample(logits, np.zeros(rows, np.uint32), np.zeros(rows, np.int32), ones, ones).block_until_ready()
        self._views = []  # the warm-up views counted nothing
        if shapes:
            d = self.deploy
            blocks = {"mla": d.max_blocks_per_seq, "indexer": d.max_index_blocks_per_seq} \
                if d.kv_policy == "swap" else {}
            self.cache = self.host.warmup(self.cache, blocks)
        self.host.lru_step = 0
        self.cp_work_per_rank(reset=True)  # warm-up steps are not serving work
        return len(shapes)

    def _warmup_mtp(self, shapes) -> None:
        """`warmup` under MTP: per shape the programs `_run_group_mtp` runs (the verify or keep_all forward,
        the logits, the accept rule or sampling, the MTP pass over the group, the first draft), then the
        one-token draft passes for every (rows, window) the shapes name; under HiSparse also the verify
        shapes' forwards with a decode view, the prefill shapes' with a staging view (row staging), and
        the draft passes with each. Padding only: nothing is written (and no lease: the views resolve
        nothing)."""
        self._views = []
        if self.hisparse:  # decode views for verify shapes; staging views for prefill shapes
            for rows, width, window in shapes:
                if width != self.verify_width and not self.stage_rows:
                    continue
                tok = np.zeros((rows, width), np.int32)
                pos = np.full((rows, width), -1, np.int32)
                t_mla, t_idx = self._table("mla", rows, [], window), self._table("indexer", rows, [], window)
                if width == self.verify_width:
                    queries = width if self.verify_mode == "batched" else 1
                    view = lambda win: self._mtp_view([], rows, win, queries)  # noqa: E731
                    hidden = self._verify_forward(tok, pos, t_mla, t_idx, window, view(window))
                else:
                    view = lambda win: self._stage_view([], rows, win)  # noqa: E731
                    _, hidden = self._forward_keep_all(tok, pos, t_mla, t_idx, window, view(window))
                self._mtp_pass(hidden, tok, pos, t_mla, t_idx, window, np.zeros(rows, np.int32), view(window))
            for rows, window in sorted({(r, w) for r, _, w in shapes}):
                h = jax.device_put(np.zeros((rows, 1, self.model.cfg.hidden_size), self.model.dtype), self.devices[0])
                d = jax.device_put(np.zeros((rows, 1), np.int32), self.devices[0])
                t_mla, t_idx = self._table("mla", rows, [], window), self._table("indexer", rows, [], window)
                for view in [self._mtp_view] + ([self._stage_view] if self.stage_rows else []):
                    self._draft_chain(h, d, np.full((self.k - 1, rows), -1, np.int32), t_mla, t_idx, window,
                                      view([], rows, window)).block_until_ready()
            self._views = []
        for rows, width, window in shapes:
            tok = np.zeros((rows, width), np.int32)
            pos = np.full((rows, width), -1, np.int32)
            t_mla, t_idx = self._table("mla", rows, [], window), self._table("indexer", rows, [], window)
            ones = np.ones(rows, np.float32)
            if width == self.verify_width:
                hidden = self._verify_forward(tok, pos, t_mla, t_idx, window)
                logits = _position_logits(self.c.logits, self.state, hidden)
                rejection_sample(logits, np.zeros((rows, self.k), np.int32), np.zeros(rows, np.int32),
                                 np.ones(rows, bool), ones, ones, np.zeros(rows, np.uint32), np.zeros(rows, np.int32),
                                 self.rates)
            else:
                last, hidden = self._forward_keep_all(tok, pos, t_mla, t_idx, window)
                logits = self._last_logits(self.state, last, np.zeros(rows, np.int32))
                _sample(logits, np.zeros(rows, np.uint32), np.zeros(rows, np.int32), ones, ones)
            self._mtp_pass(hidden, tok, pos, t_mla, t_idx, window, np.zeros(rows, np.int32))
        for rows, window in sorted({(r, w) for r, _, w in shapes}):
            h = jax.device_put(np.zeros((rows, 1, self.model.cfg.hidden_size), self.model.dtype), self.devices[0])
            d = jax.device_put(np.zeros((rows, 1), np.int32), self.devices[0])
            t_mla, t_idx = self._table("mla", rows, [], window), self._table("indexer", rows, [], window)
            self._draft_chain(h, d, np.full((self.k - 1, rows), -1, np.int32), t_mla, t_idx, window).block_until_ready()

    def _cp_cache(self, cache: PagedKVCache, tokens_split: bool) -> CpKVCache:
        d = self.deploy
        return CpKVCache(cache, "cp", d.context_parallel_size, tokens_split=tokens_split, dcp=self.kv_ranks > 1,
                         interleave=d.cp_kv_cache_interleave_size, backend=d.dcp_comm_backend,
                         heads_split=self.tp > 1, gather_queries=self.tp > 1)

    def _fold_cp_work(self, steps: int) -> None:
        """Add the oldest `steps` pending steps' device counters to the int64 host totals."""
        for step in self._cp_pending[:steps]:
            for k, v in counter_totals(step).items():
                self._cp_totals[k] += v
        del self._cp_pending[:steps]

    def cp_work_per_rank(self, reset: bool = False) -> dict[str, np.ndarray]:
        """Context parallelism: each rank's work since the start (or the last reset) -> {name: int64 [N]}
        (parallel.cp_cache.COUNTERS: indexer pairs scored, causal and computed, and MLA rows read);
        {} without a mesh."""
        if self.mesh is None:
            return {}
        self._fold_cp_work(len(self._cp_pending))
        out = {k: v.copy() for k, v in self._cp_totals.items()}
        if reset:
            for v in self._cp_totals.values():
                v[:] = 0
        return out

    def _forward(self, tok, pos, table_mla, table_index, window,
                 hisparse: HiSparseView | StagingView | None = None, *, lower: bool = False) -> jax.Array:
        """Run one padded batch [rows, width] -> hidden [rows, width, D] in token order (cache updated), or,
        without a context mesh, hidden [rows, 1, D] of each row's last real token: a row samples from its
        last token only, so the model skips the last layer's query side for the others (GLM53.__call__
        last_only; without MTP nothing reads their hidden states). `hisparse`: a decode group's resolver
        view, or a prefill group's staging view (its rows have host-only pages). lower=True: run nothing,
        return the step's `jax.stages.Lowered` program (`step_workspace_bytes`)."""
        if not lower:
            self.compiled_shapes.add((tok.shape[0], tok.shape[1], window))
            if isinstance(hisparse, StagingView):  # a program of its own per shape (warmup compiles every prefill one)
                self.staging_shapes.add((tok.shape[0], tok.shape[1], window))
        cache = self._with_view(self.cache.with_block_table(table_mla, table_index), hisparse)
        # host-only pages are reachable only through the resolver's or the staging's rows
        form = self.form if hisparse is None else "mqa"
        if self.mesh is not None:
            self._check_ids(table_mla, table_index)
            # the form for the step's whole width, as without a mesh: inside shard_map a PCP rank sees
            # only its share of the tokens and "auto" would decide on that
            form = attention_form(form, window, self.model.cfg.index_topk, tok.shape[1])
            if lower:
                return self._forward_cp(tok, pos, cache, window, form, lower=True)
            hidden, cache = self._forward_cp(tok, pos, cache, window, form)
            self.cache = self._take_view(cache)  # TP: the views came back replicated
            return hidden
        args = (self.state, jnp.asarray(tok), jnp.asarray(pos), cache)
        kw = dict(window=window, form=form, impl=self.deploy.attention_impl,
                  last_only=tok.shape[1] > 1 and not isinstance(hisparse, HiSparseView))
        if lower:
            return self.c.forward.trace(*args, **kw).lower()
        hidden, cache, _ = self.c.forward(*args, **kw)
        self.cache = self._take_view(cache)
        return hidden

    def workspace_shapes(self) -> list[tuple[int, int, int]]:
        """The (rows, tokens per row, window) step programs whose workspace bounds every step's: decode
        (max_num_seqs rows, padded), a chunk of the whole token budget at a fresh prompt's window and at
        the max_model_len window, and the prefill groups with the most padded tokens that
        `forward_groups` can form: a group of width w holds rows of more than w / 2 tokens (2 in the
        narrowest bucket), so at most budget // (w / 2 + 1) of them, padded to a power of two, up to
        about twice the budget in all (the narrowest and the widest such width stand for their ties)."""
        cap, budget = self.capacity, self.deploy.max_num_batched_tokens
        full = window_bucket(cap, cap)
        prefill = self.width_buckets()[1:]
        groups = []
        for w in prefill:
            per_row = 2 if w == prefill[0] else w // 2 + 1
            rows = min(self.max_rows, pow2_at_least(max(1, min(self.deploy.max_num_seqs, budget // per_row))))
            groups.append((rows * w, rows, w))
        most = max(t for t, _, _ in groups)
        ties = [(r, w) for t, r, w in groups if t == most]
        return sorted({(self.max_rows, 1, full), (1, self.max_tokens, window_bucket(self.max_tokens, cap)),
                       (1, self.max_tokens, full), (*ties[0], full), (*ties[-1], full)})

    def step_workspace_bytes(self, shapes=None) -> int:
        """Peak device bytes of this runner's step programs beyond their arguments (weights, pool, tables):
        XLA's temporaries plus the outputs that do not alias the donated cache, from the compiled
        programs' memory analysis, per device of the replica, the most over the forwards of `shapes`
        (default `workspace_shapes`) and the logits and sampling of max_num_seqs rows. What vLLM's
        profile run measures and leaves out of the KV budget (`DeployConfig.kv_budget_bytes`). Compiles
        them (nothing runs, nothing is allocated); the cache is donated, so the pool's size does not
        change the result (tests/engine/test_workspace.py). Not profiled: MTP's verify and draft
        programs, and HiSparse's resolver and staging state (the plain programs of the same shapes are).

        The step's own inputs count too (XLA's analysis leaves arguments out): those sent from the host
        (token ids, positions, block tables, sampling parameters) twice, since dispatch is asynchronous
        and the next step's are on the device while this step's temporaries are live; those an earlier
        program left on the device (the hidden rows the logits program reads, the logits sampling reads)
        once. Without them the H200 measured a peak above XLA's figure by 131-279 KB at 8-32K-token steps
        (docs/memory.md)."""
        def nbytes(xs) -> int:
            return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in xs)

        def peak(lowered, host=(), device=()) -> int:
            ma = lowered.compile().memory_analysis()
            return (int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)
                    + 2 * nbytes(host) + nbytes(device))

        most = 0
        for rows, width, window in (self.workspace_shapes() if shapes is None else shapes):
            inputs = (np.zeros((rows, width), np.int32), np.full((rows, width), -1, np.int32),
                      self._table("mla", rows, [], window), self._table("indexer", rows, [], window))
            most = max(most, peak(self._forward(*inputs, window, lower=True), host=inputs))
        r, cfg = self.max_rows, self.model.cfg
        hidden = jax.ShapeDtypeStruct((r, 1, cfg.hidden_size), jnp.dtype(self.model.dtype))
        rows_i = jax.ShapeDtypeStruct((r,), jnp.int32)
        most = max(most, peak(_last_logits.trace(self.c.logits, self.state, hidden, rows_i).lower(), host=[rows_i],
                              device=[hidden]))
        f32 = jax.ShapeDtypeStruct((r,), jnp.float32)
        logits = jax.ShapeDtypeStruct((r, cfg.vocab_size), jnp.float32)
        key = jax.ShapeDtypeStruct((r,), jnp.uint32)
        return max(most, peak(_sample.trace(logits, key, rows_i, f32, f32).lower(), host=[key, rows_i, f32, f32],
                              device=[logits]))

    def _forward_cp(self, tok, pos, cache: PagedKVCache, window: int, form: str, *, lower: bool = False):
        """`_forward` on the context mesh. Prefill rows (width > 1) under PCP are split into the balanced
        2N-chunk layout and their hidden states restored to token order; decode rows run replicated.

        The split is over the group's longest chunk L (`parallel.pcp.PcpSplit(L, N)`: rank g holds chunks
        g and 2N-1-g of every row), not over the padded bucket width W, so a chunk much shorter than its
        bucket stays balanced; each rank's slots are padded to those of a W-token split, so the shapes
        (and compiled programs) depend on the bucket only."""
        split = self.deploy.prefill_context_parallel_size > 1 and tok.shape[1] > 1
        if self.kv_ranks > 1 and not split:
            form = "mqa"  # queries go to the KV shards; the dense form would need the whole context here
        order = None
        if split:
            n, width = self.deploy.context_parallel_size, tok.shape[1]
            slots = PcpSplit(width, n).tokens_per_rank
            real = PcpSplit(max(int((pos >= 0).sum(axis=1).max()), 1), n).positions()  # [n, <= slots]
            src = np.full((n, slots), -1, np.int32)
            src[:, : real.shape[1]] = real
            src = src.reshape(-1)  # the row-relative token each slot holds (-1 = padding)
            tok = np.where(src >= 0, tok[:, np.maximum(src, 0)], 0)
            pos = np.where(src >= 0, pos[:, np.maximum(src, 0)], -1)
            order = np.zeros(width, np.int32)  # token j's slot; tokens past the longest chunk read slot 0
            order[src[src >= 0]] = np.nonzero(src >= 0)[0]
        args = (self.state, jnp.asarray(tok), jnp.asarray(pos), self._cp_cache(cache, split), self._cp_zero)
        kw = dict(graphdef=self.c.graphdef, mesh=self.mesh, window=window, form=form,
                  impl=self.deploy.attention_impl, expert_parallel=self.deploy.enable_expert_parallel,
                  tensor_parallel=self.tp > 1)
        if lower:
            return parallel_model.forward.trace(*args, **kw).lower()
        hidden, cp = parallel_model.forward(*args, **kw)
        self._cp_pending.append(cp.counters)
        if len(self._cp_pending) > 256:
            self._fold_cp_work(len(self._cp_pending) - 1)  # all but this step's, which may still run
        if order is not None:
            hidden = _take_tokens(hidden, jnp.asarray(order))
        return hidden, cp.local

    def _last_logits(self, state, hidden_RTD, last_R):
        """Logits of token last_R[r] of each row; a [rows, 1, D] hidden (`_forward`) holds only that token."""
        if hidden_RTD.shape[1] == 1:
            last_R = np.zeros_like(last_R)
        return _last_logits(self.c.logits, state, hidden_RTD, last_R)

    def execute(self, plan: StepPlan) -> StepResult:
        """The plan's transfers in order, then one forward per width bucket (decode rows never pad to a
        prefill chunk's width, and a chunk pads to less than twice its length; the groups are independent
        requests, so running them one after the other on the same cache computes exactly what one batch
        would), then sampling."""
        if self.k:
            return self._execute_mtp(plan)
        if any(row.num_draft_tokens for row in plan.rows):
            raise ValueError("a plan with draft tokens for a runner without MTP (DeployConfig.speculative_config)")
        self.cache, d2h, h2d = self.host.apply(plan.transfers, self.cache)
        tokens, resolves, stages = {}, [], []
        hs = plan.policy_rows
        for width, idx, padded, window in forward_groups(plan.rows, self.max_tokens, self.capacity):
            # the resolver runs only for decode rows of which some hold a hot buffer; without one every
            # selected page is on the device and the plain step reads it
            leased = hs is not None and width == 1 and any(hs[i].lease >= 0 for i in idx)
            # a prefill group of which some row has host-only pages stages the rows its queries select
            staged = (hs is not None and width > 1 and self.stage_rows
                      and any(-1 in plan.block_tables["mla"][i] for i in idx))
            rows = [plan.rows[i] for i in idx]
            self._views = []
            tokens.update(self._run_group(rows, [plan.block_tables["mla"][i] for i in idx],
                                          [plan.block_tables["indexer"][i] for i in idx], width, padded, window,
                                          [hs[i] for i in idx] if leased or staged else None, staged))
            if leased:
                rec, nbytes = self._resolve_record(tuple(row.req_id for row in rows), self._views[-1])
                resolves.append(rec)
                h2d += nbytes
            if staged:
                rec, nbytes = self._stage_record(tuple(row.req_id for row in rows), self._views[-1])
                stages.append(rec)
                h2d += nbytes
        # tier loads finished by now; a step with nothing to compute waits a little for one (an engine
        # whose only waiting requests wait on tiers would otherwise spin)
        loads = self.host.poll_tiers(wait_s=0.0 if plan.rows else 0.02)
        return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d, tuple(resolves), loads,
                          stages=tuple(stages))

    # ------------------------------------------------------------------------------------ MTP steps
    def _execute_mtp(self, plan: StepPlan) -> StepResult:
        """`execute` under MTP: per width group, the target's forward, the accept rule or sampling, and the
        MTP layer's passes (`_run_group_mtp`). Under HiSparse a verify group of which some row holds a hot
        buffer runs all three with HiSparse's decode view (one position at a time, or one plan for the
        union of the verify step's positions under batched verify): each of its forwards
        (verify, the MTP pass over the group, the draft chain) leaves one ResolveRecord. A prefill group
        of which some row has host-only pages runs all three with a staging view (kvcache.host.
        StagingView): each leaves one StageRecord."""
        self.cache, d2h, h2d = self.host.apply(plan.transfers, self.cache)
        tokens, drafts, resolves, stages = {}, {}, [], []
        hs = plan.policy_rows
        for width, idx, padded, window in forward_groups(plan.rows, self.max_tokens, self.capacity, self.verify_width):
            leased = hs is not None and width == self.verify_width and any(hs[i].lease >= 0 for i in idx)
            staged = (hs is not None and width != self.verify_width and self.stage_rows
                      and any(-1 in plan.block_tables["mla"][i] for i in idx))
            rows = [plan.rows[i] for i in idx]
            self._views = []
            out, new = self._run_group_mtp(rows, [plan.block_tables["mla"][i] for i in idx],
                                           [plan.block_tables["indexer"][i] for i in idx], width, padded, window,
                                           [hs[i] for i in idx] if leased or staged else None, staged)
            tokens.update(out)
            drafts.update(new)
            ids = tuple(row.req_id for row in rows)
            for view in self._views:
                if isinstance(view, StagingView):
                    rec, nbytes = self._stage_record(ids, view)
                    stages.append(rec)
                else:
                    rec, nbytes = self._resolve_record(ids, view)
                    resolves.append(rec)
                h2d += nbytes
        loads = self.host.poll_tiers(wait_s=0.0 if plan.rows else 0.02)
        return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d, tuple(resolves), loads,
                          drafts=drafts, stages=tuple(stages))

    def _mtp_view(self, hisparse, r: int, window: int, queries: int = 1) -> HiSparseView | None:
        """HiSparse's decode view of a verify group's rows (their HiSparseRows; None: no view) for forwards
        over `window` with `queries` positions per row in one pass. Its plans are [r, queries x min(top-k,
        window)]: the selection of one position, which the one-position-at-a-time forwards (GLM53.verify,
        GLM53.mtp_verify, the draft passes) resolve, or the union of a batched verify's 1 + k positions."""
        if hisparse is None:
            return None
        lease = np.full(r, -1, np.int32)
        lease[: len(hisparse)] = [h.lease for h in hisparse]
        return self.host.view(self._table("mla", r, [h.host_blocks for h in hisparse], window), lease,
                              queries * min(self.model.cfg.index_topk, window))

    def _stage_view(self, hisparse, r: int, window: int) -> StagingView | None:
        """The staging view of a prefill group's rows (their HiSparseRows; None: no view) for forwards over
        `window`: each forward stages the host rows its queries select, `stage_tile` queries at a time."""
        if hisparse is None:
            return None
        return self.host.staging_view(self._table("mla", r, [h.host_blocks for h in hisparse], window), self.stage_tile)

    def _with_view(self, cache: PagedKVCache, view: HiSparseView | StagingView | None) -> PagedKVCache:
        if view is None:
            return cache
        if isinstance(view, StagingView):
            return dataclasses.replace(cache, staging=view)
        return dataclasses.replace(cache, hisparse=view)

    def _take_view(self, cache: PagedKVCache) -> PagedKVCache:
        """A forward's cache back without its HiSparse or staging view: the host tables (and hot state) go
        back to HostMemory, the view (its counts) to `_views` for the step's Resolve- or StageRecords."""
        if cache.staging is not None:
            self.host.absorb_staging(cache.staging)
            self._views.append(cache.staging)
            return dataclasses.replace(cache, staging=None)
        if cache.hisparse is None:
            return cache
        self.host.absorb(cache.hisparse)
        self._views.append(cache.hisparse)
        return dataclasses.replace(cache, hisparse=None)

    def _check_ids(self, table_mla, table_index) -> None:
        """On a mesh: the pool's arrays hold kv_ranks x num_blocks pages, so a larger block id would address
        another rank's slice on the host but fall off the end of this rank's shard."""
        if max(table_mla.max(initial=-1), table_index.max(initial=-1)) >= self.num_blocks:
            raise ValueError(f"block id beyond the pool's {self.num_blocks} blocks")

    def _cp_kw(self, window: int) -> dict:
        """Static arguments of parallel.model's MTP-step functions (DCP: the "mqa" form, as a decode step's;
        TP: the programs over the split weights, as `_forward_cp`'s)."""
        return dict(graphdef=self.c.graphdef, mesh=self.mesh, window=window, form="mqa",
                    impl=self.deploy.attention_impl, expert_parallel=self.deploy.enable_expert_parallel,
                    tensor_parallel=self.tp > 1)

    def _verify_forward(self, tok, pos, table_mla, table_index, window, view: HiSparseView | None = None):
        """A verify group's forward -> hidden [rows, 1 + k, D] of every position (cache updated). `view`:
        HiSparse's decode view (one device, the sparse form): sequential verify resolves each position's
        selection at its own step, as a HiSparse decode step does; batched verify resolves one plan per
        IndexShare group for the union of the 1 + k positions' selections (`_mtp_view` with 1 + k
        queries)."""
        self.compiled_shapes.add((tok.shape[0], tok.shape[1], window))
        cache = self._with_view(self.cache.with_block_table(table_mla, table_index), view)
        if self.mesh is not None:  # DCP: queries go to the KV shards (the "mqa" form, as a decode step's)
            self._check_ids(table_mla, table_index)
            if self.verify_mode == "batched":
                hidden, cache = self._forward_cp(tok, pos, cache, window, "mqa")
            else:
                hidden, cp = parallel_model.verify(self.state, jnp.asarray(tok), jnp.asarray(pos),
                                                   self._cp_cache(cache, False), **self._cp_kw(window))
                cache = cp.local
        else:
            args = (self.state, jnp.asarray(tok), jnp.asarray(pos), cache)
            kw = dict(window=window, form="mqa" if view is not None else self.form, impl=self.deploy.attention_impl)
            if self.verify_mode == "batched":
                hidden, cache, _ = self.c.forward(*args, **kw)
            else:
                hidden, cache = self.c.verify(*args, **kw)
        self.cache = self._take_view(cache)
        return hidden

    def _forward_keep_all(self, tok, pos, table_mla, table_index, window, staging: StagingView | None = None):
        """A prefill group's forward -> (hidden [rows, 1, D] of each row's last token, as without MTP;
        hidden [rows, width, D] of every position, for the MTP layer). `staging`: the group's staging view
        (some row has host-only pages; one device: the sparse form reads them through staged rows)."""
        self.compiled_shapes.add((tok.shape[0], tok.shape[1], window))
        cache = self._with_view(self.cache.with_block_table(table_mla, table_index), staging)
        form = self.form
        if staging is not None:  # host-only pages are reachable only through the staged rows
            self.staging_shapes.add((tok.shape[0], tok.shape[1], window))
            form = "mqa"
        if self.mesh is not None:  # the context mesh's forward returns every position already
            self._check_ids(table_mla, table_index)
            hidden, cache = self._forward_cp(tok, pos, cache, window, attention_form(
                form, window, self.model.cfg.index_topk, tok.shape[1]))
            self.cache = self._take_view(cache)
            last_R = np.maximum((pos >= 0).sum(axis=1) - 1, 0)
            return _take_rows(hidden, jnp.asarray(last_R)), hidden
        (last, hidden), cache, _ = self.c.forward(self.state, jnp.asarray(tok), jnp.asarray(pos), cache,
                                                  window=window, form=form, impl=self.deploy.attention_impl,
                                                  last_only=True, keep_all=True)
        self.cache = self._take_view(cache)
        return last, hidden

    def _mtp_pass(self, hidden, nxt, mpos, table_mla, table_index, window, sel,
                  view: HiSparseView | StagingView | None = None):
        """The MTP layer over a whole group: position mpos[r, j] (-1: skip) pairs hidden[r, j] with token
        nxt[r, j] (the token after it) and writes the MTP layer's KV there -> (its state at each row's
        position sel[r], [rows, 1, D]; the draft taken from it, [rows, 1] int32). `view`: HiSparse's decode
        view; the MTP layer's own indexer's selections then resolve through the hot buffer (its IndexShare
        group of one layer), one position at a time (GLM53.mtp_verify) under sequential verify, as one
        plan for the union of the positions under batched verify. A staging view: the pass over the group
        at once, its selected host rows staged per tile."""
        cache = self._with_view(self.cache.with_block_table(table_mla, table_index), view)
        # HiSparse's sequential verify: the MTP pass resolves one position at a time too
        per_position = isinstance(view, HiSparseView) and self.verify_mode != "batched"
        args = (self.state, hidden, jnp.asarray(nxt), jnp.asarray(mpos))
        if self.mesh is not None:
            fn = parallel_model.mtp_verify if per_position else parallel_model.mtp_forward
            h, cp = fn(*args, self._cp_cache(cache, False), **self._cp_kw(window))
            cache = cp.local
        else:
            fn = self.c.mtp_verify if per_position else self.c.mtp_forward
            h, cache = fn(*args, cache, j=0, window=window, form="mqa" if view is not None else self.form,
                          impl=self.deploy.attention_impl)
        self.cache = self._take_view(cache)
        return _mtp_head(self.c.logits, self.state, h, jnp.asarray(sel))

    def _draft_chain(self, h, d, dpos, table_mla, table_index, window,
                     view: HiSparseView | StagingView | None = None):
        """Drafts 2..k: k - 1 one-token MTP passes, pass s at positions dpos[s] (-1: skip) with the previous
        draft as its token and the previous pass's normed output as its state (not the raw residual: vLLM
        PR #46075) -> drafts [rows, k] int32 (device). `view`: HiSparse's decode view, which each pass
        resolves (one-token steps, the sparse form), or a staging view (after a prefill chunk over
        host-only pages: each pass stages the host rows its query selects)."""
        self.compiled_draft_shapes.add((d.shape[0], window))
        cache = self._with_view(self.cache.with_block_table(table_mla, table_index), view)
        form = "mqa" if view is not None else self.form
        out = [d]
        for p in dpos:
            if self.mesh is not None:
                h, cp = parallel_model.mtp_forward(self.state, h, d, jnp.asarray(p[:, None]), self._cp_cache(cache, False),
                                                   **self._cp_kw(window))
                cache = cp.local
            else:
                h, cache = self.c.mtp_forward(self.state, h, d, jnp.asarray(p[:, None]), cache, j=0, window=window,
                                              form=form, impl=self.deploy.attention_impl)
            d = _draft_argmax(self.c.logits, self.state, h)
            out.append(d)
        self.cache = self._take_view(cache)
        return _concat_drafts(tuple(out))

    def _run_group_mtp(self, rows: list[PlanRow], tables_mla, tables_index, width: int, r: int,
                       window: int, hisparse=None, staged: bool = False) -> tuple[dict, dict]:
        """One width group under MTP -> (tokens, drafts) of its rows that sample. `hisparse`: the rows'
        HiSparseRows when the group resolves through HiSparse's decode view (a verify group of which some
        row holds a hot buffer): the verify step, the MTP pass and the draft passes each get a view and
        resolve per position, or per step for the union of its positions under batched verify (hot rows
        hold only sealed positions, whose KV is final). With `staged` (a
        prefill group of which some row has host-only pages) they each get a staging view instead."""
        queries = width if self.verify_mode == "batched" and width == self.verify_width else 1

        def view(hs, r, win, q=1):  # HiSparse's decode view (q positions resolved at once) or a staging view
            return self._stage_view(hs, r, win) if staged else self._mtp_view(hs, r, win, q)

        tok = np.zeros((r, width), np.int32)
        pos = np.full((r, width), -1, np.int32)
        for i, row in enumerate(rows):
            tok[i, : row.num_tokens] = row.token_ids
            pos[i, : row.num_tokens] = np.arange(row.start, row.start + row.num_tokens)
        t_mla, t_idx = self._table("mla", r, tables_mla, window), self._table("indexer", r, tables_index, window)
        need = [i for i, row in enumerate(rows) if row.sample]
        # per row: positions whose KV stands (from the row's start) and the token after the last of them
        stand = [row.num_tokens for row in rows]
        final = [row.next_token for row in rows]
        out = {}
        if width == self.verify_width:
            hidden = self._verify_forward(tok, pos, t_mla, t_idx, window, view(hisparse, r, window, queries))
            if need:
                toks, accepted = self._accept(hidden, rows, need, r)
                for i in need:
                    a = int(accepted[i])
                    out[rows[i].req_id] = tuple(int(t) for t in toks[i, : a + 1])
                    stand[i] = rows[i].num_tokens - rows[i].num_draft_tokens + a
                    final[i] = int(toks[i, a])
        else:
            last, hidden = self._forward_keep_all(tok, pos, t_mla, t_idx, window, view(hisparse, r, window))
            if need:
                picked = self._pick(self._last_logits(self.state, last, np.zeros(r, np.int32)),
                                    [rows[i] for i in need], need)
                out.update(picked)
                for i in need:
                    final[i] = picked[rows[i].req_id][0]
        # the MTP layer over the group: position p pairs hidden[p] with token p+1
        nxt = np.zeros((r, width), np.int32)
        mpos = np.full((r, width), -1, np.int32)
        sel = np.zeros(r, np.int32)
        for i, row in enumerate(rows):
            n = stand[i]
            nxt[i, : n - 1] = tok[i, 1:n]
            nxt[i, n - 1] = max(final[i], 0)
            mpos[i, :n] = pos[i, :n]
            if final[i] < 0:  # no known next token (cannot happen for a plan from the scheduler): skip it
                mpos[i, n - 1] = -1
            sel[i] = n - 1
        h, d = self._mtp_pass(hidden, nxt, mpos, t_mla, t_idx, window, sel, view(hisparse, r, window, queries))
        if not need:
            return out, {}
        # drafts 2..k at the positions after each sampling row's last standing one, within max_model_len
        limit = self.deploy.max_model_len
        dpos = np.full((self.k - 1, r), -1, np.int32)
        for i in need:
            base = rows[i].start + stand[i] - 1
            for s in range(1, self.k):
                dpos[s - 1, i] = base + s if base + s < limit else -1
        dwin = window_bucket(int(dpos.max(initial=0)) + 1, self.capacity)
        drafts = np.asarray(self._draft_chain(h, d, dpos, self._table("mla", r, tables_mla, dwin),
                                              self._table("indexer", r, tables_index, dwin), dwin,
                                              view(hisparse, r, dwin)))
        return out, {rows[i].req_id: tuple(int(t) for t in drafts[i]) for i in need}

    def _accept(self, hidden, rows: list[PlanRow], need: list[int], r: int):
        """The accept rule of a verify group -> host (tokens [r, 1 + k], accepted [r])."""
        logits = _position_logits(self.c.logits, self.state, hidden)
        bans = [(i, j, b) for i in need for j in range(rows[i].num_tokens)
                if (b := rows[i].params.banned(rows[i].num_generated + j))]
        if bans:  # stop tokens before min_tokens, per position: masked on the host (rare, small)
            logits = np.array(logits)
            for i, j, b in bans:
                logits[i, j, list(b)] = -np.inf
        k = self.k
        drafts, nd = np.zeros((r, k), np.int32), np.zeros(r, np.int32)
        greedy, temps, top_ps = np.ones(r, bool), np.ones(r, np.float32), np.ones(r, np.float32)
        seeds, counters = np.zeros(r, np.uint32), np.zeros(r, np.int32)
        for i in need:
            row = rows[i]
            nd[i] = row.num_draft_tokens
            drafts[i, : nd[i]] = row.token_ids[row.num_tokens - nd[i]:]
            greedy[i], temps[i], top_ps[i] = row.params.greedy, row.params.temperature, row.params.top_p
            seeds[i], counters[i] = row.params.prng_seed, row.num_generated
        toks, accepted = rejection_sample(logits, drafts, nd, greedy, temps, top_ps, seeds, counters, self.rates)
        return np.asarray(toks), np.asarray(accepted)

    def _run_group(self, rows: list[PlanRow], tables_mla, tables_index, width: int, r: int, window: int,
                   hisparse=None, staged: bool = False) -> dict[str, tuple[int]]:
        """One width group as one padded forward of r rows over `window` positions (`forward_groups`);
        `hisparse`: the rows' HiSparseRows when the resolver runs (some row holds a hot buffer) or, with
        `staged`, when a prefill group stages host rows (some row has host-only pages)."""
        tok = np.zeros((r, width), np.int32)
        pos = np.full((r, width), -1, np.int32)
        last = np.zeros(r, np.int32)
        for i, row in enumerate(rows):
            tok[i, : row.num_tokens] = row.token_ids
            pos[i, : row.num_tokens] = np.arange(row.start, row.start + row.num_tokens)
            last[i] = row.num_tokens - 1
        view = None
        if staged:
            view = self.host.staging_view(self._table("mla", r, [h.host_blocks for h in hisparse], window),
                                          self.stage_tile)
        elif hisparse is not None:
            lease = np.full(r, -1, np.int32)
            lease[: len(rows)] = [h.lease for h in hisparse]
            view = self.host.view(self._table("mla", r, [h.host_blocks for h in hisparse], window), lease,
                                  self.model.cfg.index_topk)
        hidden = self._forward(tok, pos, self._table("mla", r, tables_mla, window),
                               self._table("indexer", r, tables_index, window), window, view)
        need = [i for i, row in enumerate(rows) if row.sample]
        if not need:
            return {}
        logits = self._last_logits(self.state, hidden, last)
        return self._pick(logits, [rows[i] for i in need], need)

    def _pick(self, logits_RV, rows: list[PlanRow], idx: list[int]) -> dict[str, tuple[int]]:
        out = {}
        sample_rows = [(i, r) for i, r in zip(idx, rows) if not r.params.greedy]
        greedy = [(i, r) for i, r in zip(idx, rows) if r.params.greedy]
        banned = [(i, r.params.banned(r.num_generated)) for i, r in zip(idx, rows)]
        if any(b for _, b in banned):  # stop tokens before min_tokens: masked on the host (rare, small)
            logits_RV = np.array(logits_RV)
            for i, b in banned:
                logits_RV[i, list(b)] = -np.inf
        if greedy:
            host = np.asarray(logits_RV)
            for i, r in greedy:
                out[r.req_id] = (int(np.argmax(host[i])),)
        if sample_rows:
            n = len(logits_RV)
            seeds, counters = np.zeros(n, np.uint32), np.zeros(n, np.int32)
            temps, top_ps = np.ones(n, np.float32), np.ones(n, np.float32)
            for i, r in sample_rows:
                seeds[i], counters[i] = r.params.prng_seed, r.num_generated
                temps[i], top_ps[i] = r.params.temperature, r.params.top_p
            toks = np.asarray(_sample(logits_RV, seeds, counters, temps, top_ps))
            for i, r in sample_rows:
                out[r.req_id] = (int(toks[i]),)
        return out
