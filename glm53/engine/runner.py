"""Runners turn a scheduled step into device work, and clocks tell the engine the time.

`ModelRunner` keeps the paged KV pool on the device and, per step, groups the scheduled chunks by
width bucket (1 token for decoding requests; powers of two from 16 up to max_num_batched_tokens for
prefill chunks) and runs one padded forward per group (rows: powers of two up to max_num_seqs;
attention window: powers of two up to the cache capacity). A serving run therefore compiles a bounded
set of programs (`bucket_shapes`; `warmup` compiles them all, `compiled_shapes` lists those used), and
padding stays under 2x per row: a decoding row never pads to a prefill chunk's width. Sampling is a jitted function of per-request PRNG keys
(seed, number of tokens generated so far), so a request samples the same tokens whatever it is batched
with.

The `Runner` and `Clock` protocols let a simulator drive the same scheduler in virtual time.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Protocol

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention.hisparse import HiSparseView, put_host_rows, take_host_rows
from glm53.api import window_bucket
from glm53.engine.config import DeployConfig
from glm53.engine.scheduler import ScheduledChunk
from glm53.model import GLM53, attention_form, compiled
from kvcache.paged import PagedKVCache
from parallel import model as parallel_model
from parallel.cp_cache import CpKVCache, counter_totals, zero_counters
from parallel.mesh import make_mesh
from parallel.pcp import PcpSplit


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin."""

    def sleep(self, seconds: float) -> None:
        """Let `seconds` pass (a client waiting for its next arrival; a virtual clock just advances)."""


class WallClock:
    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class Runner(Protocol):
    def execute(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[list[int]]]) -> dict[str, int]:
        """Run one step: write the chunks' KV, and return {req_id: sampled token} for every request whose
        known tokens are all computed after the step."""


MIN_PREFILL_WIDTH = 16  # narrowest prefill bucket: shorter chunks pad to it (fewer programs)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_num_blocks(deploy: DeployConfig, groups) -> int:
    """A pool that never runs out: every sequence slot at max_model_len in every group."""
    return deploy.max_num_seqs * sum(-(-deploy.max_model_len // n) for n in deploy.group_tokens_per_block(groups).values())


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


@dataclasses.dataclass
class TransferStats:
    """Device<->host traffic. On CPU both memories are the same RAM, so the bytes are counted and their
    time is modelled at the configured link bandwidth rather than measured."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    link_bytes_per_s: float = 50e9

    @property
    def modelled_link_s(self) -> float:
        return (self.d2h_bytes + self.h2d_bytes) / self.link_bytes_per_s


@dataclasses.dataclass
class ResolveStats:
    """What HiSparse decode steps' resolvers did. hot_hits / hot_misses: selected rows found in / copied
    into a hot buffer, summed over IndexShare groups; h2d_rows: rows copied host -> device, all layers.
    log: None, or per decode group step (req_ids, hits [n, G], misses [n, G], copied [n]) for tests."""

    hot_hits: int = 0
    hot_misses: int = 0
    h2d_rows: int = 0
    log: list | None = None


@dataclasses.dataclass(frozen=True)
class HostKV:
    """A request's KV blocks in host memory (pinned_host): per group, per layer, rows [blocks * B, width]."""

    arrays: dict[str, tuple[jax.Array, ...]]
    nbytes: int


@jax.jit
def _take_tokens(hidden_RTD, order_T):
    return hidden_RTD[:, order_T]


@jax.jit
def _gather_rows(arr, slots):
    return arr[slots]


@functools.partial(jax.jit, donate_argnums=0)
def _pages_d2h(host_tables, dev_tables, src_slots, dst_slots):
    """host[dst] = device[src] for each layer's table pair (slots -1: padding, dropped)."""
    out = []
    for host, dev in zip(host_tables, dev_tables):
        rows = dev.at[jnp.maximum(src_slots, 0)].get(mode="promise_in_bounds")
        out.append(put_host_rows(host, jnp.where(src_slots >= 0, dst_slots, host.shape[0]), rows))
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=0)
def _pages_h2d(dev_tables, host_tables, src_slots, dst_slots):
    """device[dst] = host[src] for each layer's table pair (slots -1: padding, dropped)."""
    out = []
    for dev, host in zip(dev_tables, host_tables):
        rows = take_host_rows(host, jnp.maximum(src_slots, 0))
        out.append(dev.at[jnp.where(src_slots >= 0, dst_slots, dev.shape[0])].set(rows, mode="drop"))
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _reset_lease(hot_pos, hot_last, hot_rows, lease, rows_H):
    return (hot_pos.at[lease].set(-1), hot_last.at[lease].set(jnp.iinfo(jnp.int32).min),
            hot_rows.at[lease].set(rows_H))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(arr, slots, rows):
    return arr.at[slots].set(rows)


class ModelRunner:
    """Runs scheduled steps on `devices` (default: the first max(PCP, DCP) of `jax.devices()`; a data-
    parallel replica passes its own group). One device: weights and KV pool live there. Several: a
    context mesh over them (parallel.model)."""

    def __init__(self, model: GLM53, deploy: DeployConfig, num_blocks: int, devices=None):
        self.model = model
        self.deploy = deploy
        self.c = compiled(model)
        n = deploy.context_parallel_size
        if devices is None:  # this process's devices, in the order make_mesh uses
            devices = sorted(jax.local_devices(), key=lambda d: d.id)[:n]
            if len(devices) < n:
                make_mesh(cp=n)  # raises with how to simulate more devices on CPU
        devices = list(devices)
        if len(devices) != n:
            raise ValueError(f"a runner with context_parallel_size={n} needs {n} devices, got {len(devices)}")
        experts = model.cfg.n_routed_experts
        if deploy.enable_expert_parallel and n > 1 and experts % n:
            raise ValueError(f"enable_expert_parallel: the model's {experts} routed experts do not split over the "
                             f"{n} devices of the context axis")
        self.devices = devices
        with jax.default_device(devices[0]):  # every array this runner creates starts on its devices
            self._init(num_blocks)

    def _init(self, num_blocks: int):
        model, deploy = self.model, self.deploy
        kv_dtype = jnp.dtype(model.dtype).name if deploy.kv_cache_dtype == "auto" else deploy.kv_cache_dtype
        self.max_rows = _pow2_at_least(deploy.max_num_seqs)
        self.max_tokens = _pow2_at_least(deploy.max_num_batched_tokens)
        self.num_blocks = num_blocks
        # Context parallelism (parallel.model): a mesh with one context axis of max(PCP, DCP) devices.
        # Under DCP a block id is a page of block_size slots on every rank, so the arrays hold
        # kv_ranks x num_blocks pages, split over the axis (rank r's table is the r-th slice).
        n = deploy.context_parallel_size
        self.mesh = make_mesh(cp=n, devices=self.devices) if n > 1 else None
        self.kv_ranks = deploy.decode_context_parallel_size
        self.cache = PagedKVCache.create(model.cfg, num_blocks * self.kv_ranks, deploy.block_size,
                                         self._table("mla", self.max_rows, []),
                                         index_block_size=deploy.index_block_size,
                                         index_block_table=self._table("indexer", self.max_rows, []),
                                         kv_cache_dtype=kv_dtype,
                                         include_mtp=False)
        if self.mesh is not None:
            self.cache = parallel_model.place(self._cp_cache(self.cache, False), self.mesh).local
            self.state = parallel_model.place_state(self.c.state, self.mesh, deploy.enable_expert_parallel)
            # each rank's work (parallel.cp_cache.COUNTERS): zeros in, this step's counts out; the step's
            # device arrays are folded into int64 host totals lazily (no sync on the serving path)
            self._cp_zero = jax.device_put(zero_counters(n), NamedSharding(self.mesh, P("cp")))
            self._cp_pending: list[dict] = []
            self._cp_totals = {k: np.zeros(n, np.int64) for k in self._cp_zero}
        else:  # weights and pool committed to this runner's device (a data-parallel replica's own copy)
            self.cache = jax.device_put(self.cache, self.devices[0])
            self.state = jax.device_put(self.c.state, self.devices[0])
        # "auto": the model picks the dense form for short windows and, on CPU, for prefill chunks over a
        # few times top-k (attention.dense_mla.use_dense_mha); force_mqa sends everything sparse
        self.form = "mqa" if deploy.sparse_mla_force_mqa else "auto"
        self.compiled_shapes: set[tuple] = set()  # (rows, tokens, window): one program each
        self.transfers = TransferStats(link_bytes_per_s=deploy.host_link_bytes_per_s)
        if self.mesh is None:
            self._host = jax.sharding.SingleDeviceSharding(self.devices[0], memory_kind="pinned_host")
            self._device = jax.sharding.SingleDeviceSharding(self.devices[0], memory_kind="device")
        else:  # host copies of KV live with the rank that holds it (a DCP shard, or every replica's copy)
            spec = P("cp") if self.kv_ranks > 1 else P()
            self._host = NamedSharding(self.mesh, spec, memory_kind="pinned_host")
            self._device = NamedSharding(self.mesh, spec, memory_kind="device")
        self.hisparse = deploy.kv_policy == "hisparse"
        if self.hisparse:
            self._init_hisparse()

    # ------------------------------------------------------------------------------ HiSparse support
    @property
    def capacity(self) -> int:
        """Positions per request the block tables address (all DCP ranks together)."""
        return self.cache.capacity * self.kv_ranks

    def page_bytes(self, group: str) -> int:
        """Bytes of one page (block_size rows; index_block_size for the indexer; on every DCP rank) of a
        group, all its layers."""
        row = sum(a.shape[1] * a.dtype.itemsize for a in self._group_arrays(group))
        return row * self._page_rows(group) * self.kv_ranks

    def _page_rows(self, group: str) -> int:
        return (self.deploy.index_block_size or self.deploy.block_size) if group == "indexer" else self.deploy.block_size

    def _init_hisparse(self):
        d, cfg = self.deploy, self.model.cfg
        # a decode step selects top-k rows per token; with MTP a step verifies num_speculative_tokens + 1
        # tokens, and one more top-k of slack keeps the previous step's rows: (spec + 2) x top-k
        self.hot_rows = d.hisparse_device_buffer_size or (d.num_speculative_tokens + 2) * cfg.index_topk
        if self.hot_rows < cfg.index_topk:
            raise ValueError(f"DeployConfig.hisparse_device_buffer_size={self.hot_rows} is below the model's top-k "
                             f"({cfg.index_topk}): a step's misses would not fit the hot buffer")
        self.host_blocks = {"mla": d.hisparse_host_pool_bytes // self.page_bytes("mla"),
                            "indexer": d.cpu_offload_bytes // self.page_bytes("indexer")}
        if self.host_blocks["mla"] < 1:
            raise ValueError(f"DeployConfig.hisparse_host_pool_bytes={d.hisparse_host_pool_bytes} holds no MLA page "
                             f"({self.page_bytes('mla')} bytes)")
        self.host_tables = {g: tuple(jax.device_put(jnp.zeros((max(n, 1) * self._page_rows(g), a.shape[1]), a.dtype),
                                                    self._host)
                                     for a in self._group_arrays(g)) for g, n in self.host_blocks.items()}
        groups = len(self.cache.index)
        self.hot_state = (jnp.full((self.max_rows, groups, self.hot_rows), -1, jnp.int32),
                          jnp.full((self.max_rows, groups, self.hot_rows), jnp.iinfo(jnp.int32).min, jnp.int32),
                          jnp.full((self.max_rows, self.hot_rows), -1, jnp.int32))
        self.lru_step = 0
        self.resolve_stats = ResolveStats()

    def _set_group_arrays(self, group: str, arrays) -> None:
        self.cache = dataclasses.replace(self.cache, **{"mla" if group == "mla" else "index": tuple(arrays)})

    def copy_pages(self, group: str, direction: str, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Whole pages between the device pool and the HiSparse host pools, every layer of `group` in one
        call ("d2h": device src -> host dst; "h2d": host src -> device dst). Pads to a power-of-two page
        count (fewer programs); counts the real bytes."""
        n = len(src_blocks)
        if n == 0:
            return
        width = _pow2_at_least(n)
        src = np.full(width, -1, np.int32)
        dst = np.full(width, -1, np.int32)
        src[:n], dst[:n] = src_blocks, dst_blocks
        src_s, dst_s = jnp.asarray(self._page_slots(group, src)), jnp.asarray(self._page_slots(group, dst))
        nbytes = n * self.page_bytes(group)
        if direction == "d2h":
            self.host_tables[group] = _pages_d2h(self.host_tables[group], self._group_arrays(group), src_s, dst_s)
            self.transfers.d2h_bytes += nbytes
        elif direction == "h2d":
            self._set_group_arrays(group, _pages_h2d(self._group_arrays(group), self.host_tables[group], src_s, dst_s))
            self.transfers.h2d_bytes += nbytes
        else:
            raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")

    def reset_lease(self, lease: int, blocks: list[int]) -> None:
        rows = self._page_slots("mla", blocks)[: self.hot_rows]
        self.hot_state = _reset_lease(*self.hot_state, lease, jnp.asarray(rows))

    def _count_resolve(self, req_ids: list[str]) -> None:
        hs, n = self._last_resolve, len(req_ids)
        hits, misses, copied, unserved = (np.asarray(x)[:n] for x in (hs.hits, hs.misses, hs.copied, hs.unserved))
        if unserved.any():  # never read fewer rows than selected without saying so
            bad = {r: int(u) for r, u in zip(req_ids, unserved) if u}
            raise RuntimeError(f"HiSparse: selected rows with no device page, host copy or hot slot: {bad}")
        st = self.resolve_stats
        st.hot_hits += int(hits.sum())
        st.hot_misses += int(misses.sum())
        st.h2d_rows += int(copied.sum())
        self.transfers.h2d_bytes += int(copied.sum()) * self.cache.mla[0].shape[1] * self.cache.mla[0].dtype.itemsize
        if st.log is not None:
            st.log.append((req_ids, hits, misses, copied))

    def _hisparse_view(self, rows: int, info: dict) -> HiSparseView:
        host = self._table("mla", rows, info["host"])
        lease = np.full(rows, -1, np.int32)
        lease[: len(info["lease"])] = info["lease"]
        self.lru_step += 1
        return HiSparseView.create(self.host_tables["mla"], host, lease, *self.hot_state, self.lru_step,
                                   self.model.cfg.index_topk)

    def _page_slots(self, group: str, blocks) -> np.ndarray:
        """Slots of the whole pages `blocks` of `group`: int32 [len(blocks) x page rows], -1 for block -1."""
        b = self._page_rows(group)
        blk = np.asarray(blocks, np.int32).reshape(-1, 1)
        slots = np.where(blk >= 0, blk * b + np.arange(b, dtype=np.int32), -1).reshape(-1)
        if self.kv_ranks > 1:  # DCP: the page on every rank; rank r's table starts at r * num_blocks * b
            ranks = np.arange(self.kv_ranks, dtype=np.int32)[:, None] * (self.num_blocks * b)
            slots = np.where(slots >= 0, slots[None, :] + ranks, -1).reshape(-1)
        return slots

    def _group_arrays(self, group: str):
        return self.cache.mla if group == "mla" else self.cache.index

    def offload(self, tables: dict[str, list[int]]) -> HostKV:
        """Copy the blocks `tables` names (per group) to host memory. The only device->host path."""
        arrays, nbytes = {}, 0
        for g, blocks in tables.items():
            slots = jnp.asarray(self._page_slots(g, blocks))
            # on a mesh, first lay the rows out like the pool (rank r's pages on rank r; `_page_slots` is
            # rank-major): device_put cannot change the layout and the memory kind in one go
            arrays[g] = tuple(jax.device_put(jax.device_put(_gather_rows(a, slots), self._device), self._host)
                              for a in self._group_arrays(g))
            nbytes += sum(x.nbytes for x in arrays[g])
        self.transfers.d2h_bytes += nbytes
        return HostKV(arrays, nbytes)

    def restore(self, saved: HostKV, tables: dict[str, list[int]]) -> None:
        """Copy a host copy back into the blocks `tables` names (same block counts). The only
        host->device path."""
        groups = {}
        for g, blocks in tables.items():
            slots = jnp.asarray(self._page_slots(g, blocks))
            groups[g] = tuple(_scatter_rows(a, slots, jax.device_put(h, self._device))
                              for a, h in zip(self._group_arrays(g), saved.arrays[g]))
        self.transfers.h2d_bytes += saved.nbytes
        self.cache = dataclasses.replace(self.cache, mla=groups.get("mla", self.cache.mla),
                                         index=groups.get("indexer", self.cache.index))

    def _table(self, group: str, rows: int, tables: list[list[int]]) -> np.ndarray:
        width = self.deploy.max_index_blocks_per_seq if group == "indexer" else self.deploy.max_blocks_per_seq
        out = np.full((rows, width), -1, np.int32)
        for i, t in enumerate(tables):
            out[i, : len(t)] = t
        return out

    def width_buckets(self) -> list[int]:
        """Tokens per row: 1 (decode) and powers of two from MIN_PREFILL_WIDTH up to the budget."""
        w = min(MIN_PREFILL_WIDTH, self.max_tokens)
        return [1] + [w << i for i in range((self.max_tokens // w).bit_length())]

    def _width(self, num_tokens: int) -> int:
        return next(w for w in self.width_buckets() if w >= num_tokens)

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, window) program a serving run can use."""
        rows = [1 << i for i in range(self.max_rows.bit_length())]
        windows = sorted({window_bucket(n, self.capacity) for n in
                          (1 << i for i in range(self.capacity.bit_length() + 1))})
        return [(r, w, win) for r in rows for w in self.width_buckets() for win in windows]

    def warmup(self, shapes=None) -> int:
        """Compile the programs of `shapes` (default: every bucket) by running padding-only steps, which
        write nothing (every slot is -1). -> number of shapes run. After this a serving run compiles
        nothing new on the decode / prefill path (tests/engine asserts it by counting compilations)."""
        shapes = self.bucket_shapes() if shapes is None else shapes
        for rows, width, window in shapes:
            tok = np.zeros((rows, width), np.int32)
            pos = np.full((rows, width), -1, np.int32)
            hidden = self._forward(tok, pos, self._table("mla", rows, []), self._table("indexer", rows, []), window)
            logits = self._last_logits(self.state, hidden, np.zeros(rows, np.int32))
            ones = np.ones(rows, np.float32)
            _sample(logits, np.zeros(rows, np.uint32), np.zeros(rows, np.int32), ones, ones).block_until_ready()
        self.cp_work_per_rank(reset=True)  # warm-up steps are not serving work
        return len(shapes)

    def _cp_cache(self, cache: PagedKVCache, tokens_split: bool) -> CpKVCache:
        d = self.deploy
        return CpKVCache(cache, "cp", d.context_parallel_size, tokens_split=tokens_split, dcp=self.kv_ranks > 1,
                         interleave=d.cp_kv_cache_interleave_size, backend=d.dcp_comm_backend)

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

    def _forward(self, tok, pos, table_mla, table_index, window, hisparse: HiSparseView | None = None) -> jax.Array:
        """Run one padded batch [rows, width] -> hidden [rows, width, D] in token order (cache updated), or,
        without a context mesh, hidden [rows, 1, D] of each row's last real token: a row samples from its
        last token only, so the model skips the last layer's query side for the others (GLM53.__call__
        last_only; without MTP nothing reads their hidden states)."""
        self.compiled_shapes.add((tok.shape[0], tok.shape[1], window))
        cache = dataclasses.replace(self.cache.with_block_table(table_mla, table_index), hisparse=hisparse)
        form = self.form
        if hisparse is not None:
            form = "mqa"  # host-only pages are reachable only through the resolver's selected rows
        if self.mesh is not None:
            if max(table_mla.max(initial=-1), table_index.max(initial=-1)) >= self.num_blocks:
                # the pool's arrays hold kv_ranks x num_blocks pages: a larger id would address another
                # rank's slice on the host but fall off the end of this rank's shard
                raise ValueError(f"block id beyond the pool's {self.num_blocks} blocks")
            # the form for the step's whole width, as without a mesh: inside shard_map a PCP rank sees
            # only its share of the tokens and "auto" would decide on that
            form = attention_form(form, window, self.model.cfg.index_topk, tok.shape[1])
            hidden, cache = self._forward_cp(tok, pos, cache, window, form)
            self.cache = cache
            return hidden
        hidden, cache, _ = self.c.forward(self.state, jnp.asarray(tok), jnp.asarray(pos), cache, window=window,
                                          form=form, impl=self.deploy.attention_impl,
                                          last_only=tok.shape[1] > 1 and hisparse is None)
        if cache.hisparse is not None:
            hs = cache.hisparse
            self.host_tables["mla"] = hs.host_mla
            self.hot_state = (hs.hot_pos, hs.hot_last, hs.hot_rows)
            self._last_resolve = hs
            cache = dataclasses.replace(cache, hisparse=None)
        self.cache = cache
        return hidden

    def _forward_cp(self, tok, pos, cache: PagedKVCache, window: int, form: str):
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
        hidden, cp = parallel_model.forward(self.state, jnp.asarray(tok), jnp.asarray(pos),
                                            self._cp_cache(cache, split), self._cp_zero, graphdef=self.c.graphdef,
                                            mesh=self.mesh, window=window, form=form,
                                            impl=self.deploy.attention_impl,
                                            expert_parallel=self.deploy.enable_expert_parallel)
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

    def execute(self, chunks, block_tables):
        # One forward per width bucket: decode rows never pad to a prefill chunk's width, and a chunk
        # pads to less than twice its length. The groups are independent requests, so running them one
        # after the other on the same cache computes exactly what one batch would.
        groups: dict[int, list[int]] = {}
        for i, ch in enumerate(chunks):
            groups.setdefault(self._width(ch.num_tokens), []).append(i)
        out = {}
        hs = block_tables.get("hisparse")
        for width, idx in groups.items():
            # the resolver runs only for decode rows of which some hold a hot buffer; without one every
            # selected page is on the device and the plain step reads it
            leased = hs is not None and width == 1 and any(hs["lease"][i] >= 0 for i in idx)
            info = {k: [v[i] for i in idx] for k, v in hs.items()} if leased else None
            out.update(self._run_group([chunks[i] for i in idx], [block_tables["mla"][i] for i in idx],
                                       [block_tables["indexer"][i] for i in idx], width, info))
        return out

    def _run_group(self, chunks, tables_mla, tables_index, width, hisparse=None) -> dict[str, int]:
        rows = _pow2_at_least(len(chunks))
        tok = np.zeros((rows, width), np.int32)
        pos = np.full((rows, width), -1, np.int32)
        last = np.zeros(rows, np.int32)
        for i, ch in enumerate(chunks):
            tok[i, : ch.num_tokens] = ch.request.token_slice(ch.start, ch.start + ch.num_tokens)
            pos[i, : ch.num_tokens] = np.arange(ch.start, ch.start + ch.num_tokens)
            last[i] = ch.num_tokens - 1
        window = window_bucket(int(pos.max()) + 1, self.capacity)
        view = None if hisparse is None else self._hisparse_view(rows, hisparse)
        hidden = self._forward(tok, pos, self._table("mla", rows, tables_mla), self._table("indexer", rows, tables_index),
                               window, view)
        if view is not None:
            self._count_resolve([ch.request.req_id for ch in chunks])
        need = [i for i, ch in enumerate(chunks) if ch.start + ch.num_tokens == ch.request.num_tokens]
        if not need:
            return {}
        logits = self._last_logits(self.state, hidden, last)
        return self._pick(logits, [chunks[i].request for i in need], need)

    def _pick(self, logits_RV, reqs, rows) -> dict[str, int]:
        out = {}
        sample_rows = [(i, r) for i, r in zip(rows, reqs) if not r.params.greedy]
        greedy = [(i, r) for i, r in zip(rows, reqs) if r.params.greedy]
        if greedy:
            host = np.asarray(logits_RV)
            for i, r in greedy:
                out[r.req_id] = int(np.argmax(host[i]))
        if sample_rows:
            n = len(logits_RV)
            seeds, counters = np.zeros(n, np.uint32), np.zeros(n, np.int32)
            temps, top_ps = np.ones(n, np.float32), np.ones(n, np.float32)
            for i, r in sample_rows:
                seeds[i], counters[i] = r.params.seed, len(r.output_ids)
                temps[i], top_ps[i] = r.params.temperature, r.params.top_p
            toks = np.asarray(_sample(logits_RV, seeds, counters, temps, top_ps))
            for i, r in sample_rows:
                out[r.req_id] = int(toks[i])
        return out
