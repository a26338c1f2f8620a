"""Forward strategies: how one padded batch runs on a replica's devices. One class per layout, chosen
once at start-up (`strategy_for`): `OneDevice` (weights and pool on one device), `ContextMesh` (PCP /
DCP over a context axis, parallel.model; the PCP permutation of prefill rows lives here),
`TensorParallel` (a tp x cp mesh with the weights split over it, parallel.tp; DCP reuses the TP ranks)
and `DataParallelExperts` (DP x EP: every rank's rows in one program over a "dp" mesh).

Every method takes the step's inputs as host arrays and a donated cache and returns the new cache; the
runner decides the form and the view, the strategy only runs the programs. The programs each method
calls are exactly those the serving path compiles (tests/engine/test_recompilation.py counts them).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm53.model import attention_form
from kvcache.paged import PagedKVCache
from parallel import ep as parallel_ep
from parallel import model as parallel_model
from parallel import tp as parallel_tp
from parallel.cp_cache import CpKVCache, counter_totals, zero_counters
from parallel.mesh import make_mesh
from parallel.pcp import PcpSplit


@jax.jit
def _take_tokens(hidden_RTD, order_T):
    return hidden_RTD[:, order_T]


@jax.jit
def _take_rows(hidden_RTD, last_R):
    """hidden [R, T, D] -> [R, 1, D] at each row's position last_R[r]."""
    return jnp.take_along_axis(hidden_RTD, last_R[:, None, None], axis=1)


class OneDevice:
    """Weights and pool committed to one device (a data-parallel replica's own copy)."""

    mesh = None
    kv_ranks = 1
    ranks = 1  # independent ranks whose rows and pool slices one forward carries (DP x EP: N)

    def __init__(self, runner, devices):
        self.r = runner
        self.device = devices[0]

    def place(self, cache: PagedKVCache, state):
        """-> (cache, weights) on this strategy's devices."""
        return jax.device_put(cache, self.device), jax.device_put(state, self.device)

    def memory(self):
        """Shardings of host-resident and device-resident KV copies (kvcache.host.HostMemory's)."""
        return (jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host"),
                jax.sharding.SingleDeviceSharding(self.device, memory_kind="device"))

    def host_share(self):
        return None

    def check_ids(self, table_mla, table_index) -> None:
        """Block tables the pool can address (every id is, on one device)."""

    def cp_work_per_rank(self, reset: bool = False) -> dict:
        return {}

    def all2all_bytes(self, reset: bool = False) -> int:
        return 0

    def forward(self, tok, pos, cache, window: int, form: str, *, keep_all: bool = False, lower: bool = False):
        """One padded batch [rows, width] -> (hidden, cache). keep_all: ((hidden [rows, 1, D] of each row's
        last token, hidden [rows, width, D]), cache), as MTP's prefill reads it. Otherwise hidden
        [rows, 1, D] of the last real token for a prefill width (GLM53.__call__ last_only: nothing else
        reads the others), [rows, 1, D] for a decode width. lower=True: the `jax.stages.Lowered` program."""
        r = self.r
        args = (r.state, jnp.asarray(tok), jnp.asarray(pos), cache)
        if keep_all:
            out, cache, _ = r.c.forward(*args, window=window, form=form, impl=r.deploy.attention_impl,
                                        last_only=True, keep_all=True)
            return out, cache
        kw = dict(window=window, form=form, impl=r.deploy.attention_impl, last_only=tok.shape[1] > 1)
        if lower:
            return r.c.forward.trace(*args, **kw).lower()
        hidden, cache, _ = r.c.forward(*args, **kw)
        return hidden, cache

    def verify(self, tok, pos, cache, window: int, form: str, batched: bool):
        """A verify group [rows, 1 + k] -> (hidden [rows, 1 + k, D] of every position, cache): batched as one
        forward, or sequential as 1 + k one-token steps in one program (GLM53.verify)."""
        r = self.r
        args = (r.state, jnp.asarray(tok), jnp.asarray(pos), cache)
        kw = dict(window=window, form=form, impl=r.deploy.attention_impl)
        if batched:
            hidden, cache, _ = r.c.forward(*args, **kw)
            return hidden, cache
        return r.c.verify(*args, **kw)

    def mtp(self, hidden, nxt, mpos, cache, window: int, form: str, per_position: bool):
        """The MTP layer over a group (GLM53.mtp_forward, or mtp_verify one position at a time)."""
        r = self.r
        fn = r.c.mtp_verify if per_position else r.c.mtp_forward
        return fn(r.state, hidden, jnp.asarray(nxt), jnp.asarray(mpos), cache, j=0, window=window, form=form,
                  impl=r.deploy.attention_impl)

    def draft(self, h, d, pos, cache, window: int, form: str):
        """One one-token MTP pass (a draft after the first)."""
        r = self.r
        return r.c.mtp_forward(r.state, h, d, jnp.asarray(pos[:, None]), cache, j=0, window=window, form=form,
                               impl=r.deploy.attention_impl)


class ContextMesh(OneDevice):
    """A mesh with one context axis of max(PCP, DCP) devices (parallel.model). Under DCP a block id is a
    page of block_size slots on every rank, so the arrays hold kv_ranks x num_blocks pages, split over
    the axis (rank r's table is the r-th slice). Each rank's work (parallel.cp_cache.COUNTERS) comes out
    of every forward as device arrays, folded into int64 host totals lazily (no sync on the serving
    path)."""

    tp = 1

    def __init__(self, runner, devices):
        super().__init__(runner, devices)
        d = runner.deploy
        self.n = d.context_parallel_size
        self.kv_ranks = d.decode_context_parallel_size
        self.mesh = self._mesh(devices)
        self._zero = jax.device_put(zero_counters(self.n), NamedSharding(self.mesh, P("cp")))
        self._pending: list[dict] = []
        self._totals = {k: np.zeros(self.n, np.int64) for k in self._zero}

    def _mesh(self, devices):
        return make_mesh(cp=self.n, devices=devices)

    def _state(self, state):
        return parallel_model.place_state(state, self.mesh, self.r.deploy.enable_expert_parallel)

    def place(self, cache, state):
        return parallel_model.place(self.cp_cache(cache, False), self.mesh).local, self._state(state)

    def memory(self):
        # host copies of KV live with the rank that holds it (a DCP shard)
        spec = P("cp") if self.kv_ranks > 1 else P()
        return (NamedSharding(self.mesh, spec, memory_kind="pinned_host"),
                NamedSharding(self.mesh, spec, memory_kind="device"))

    def host_share(self):
        """One host pool per replica, shared by its TP ranks (1/tp of it each): kvcache.host.HostMemory(shared=)."""
        return ("tp", self.mesh.shape["tp"])

    def cp_cache(self, cache: PagedKVCache, tokens_split: bool) -> CpKVCache:
        d = self.r.deploy
        return CpKVCache(cache, "cp", d.context_parallel_size, tokens_split=tokens_split, dcp=self.kv_ranks > 1,
                         interleave=d.cp_kv_cache_interleave_size, backend=d.dcp_comm_backend,
                         heads_split=self.tp > 1, gather_queries=self.tp > 1)

    def _kw(self, window: int, form: str) -> dict:
        d = self.r.deploy
        return dict(graphdef=self.r.c.graphdef, mesh=self.mesh, window=window, form=form, impl=d.attention_impl,
                    expert_parallel=d.enable_expert_parallel, tensor_parallel=self.tp > 1)

    def _fold(self, steps: int) -> None:
        """Add the oldest `steps` pending steps' device counters to the int64 host totals."""
        for step in self._pending[:steps]:
            for k, v in counter_totals(step).items():
                self._totals[k] += v
        del self._pending[:steps]

    def cp_work_per_rank(self, reset: bool = False) -> dict[str, np.ndarray]:
        self._fold(len(self._pending))
        out = {k: v.copy() for k, v in self._totals.items()}
        if reset:
            for v in self._totals.values():
                v[:] = 0
        return out

    def check_ids(self, table_mla, table_index) -> None:
        """The pool's arrays hold kv_ranks x num_blocks pages, so a larger block id would address another
        rank's slice on the host but fall off the end of this rank's shard."""
        if max(table_mla.max(initial=-1), table_index.max(initial=-1)) >= self.r.num_blocks:
            raise ValueError(f"block id beyond the pool's {self.r.num_blocks} blocks")

    def forward(self, tok, pos, cache, window, form, *, keep_all=False, lower=False):
        """As OneDevice's, hidden of every position in token order (the mesh's forward returns them all);
        the form is decided for the step's whole width (inside shard_map a PCP rank sees only its share of
        the tokens and "auto" would decide on that)."""
        form = attention_form(form, window, self.r.model.cfg.index_topk, tok.shape[1])
        if lower:
            return self._run(tok, pos, cache, window, form, lower=True)
        hidden, cache = self._run(tok, pos, cache, window, form)
        if keep_all:
            last_R = np.maximum((pos >= 0).sum(axis=1) - 1, 0)
            return (_take_rows(hidden, jnp.asarray(last_R)), hidden), cache
        return hidden, cache

    def verify(self, tok, pos, cache, window, form, batched):
        """DCP: queries go to the KV shards (the "mqa" form, as a decode step's)."""
        if batched:
            return self._run(tok, pos, cache, window, "mqa")
        hidden, cp = parallel_model.verify(self.r.state, jnp.asarray(tok), jnp.asarray(pos), self.cp_cache(cache, False),
                                           **self._kw(window, "mqa"))
        return hidden, cp.local

    def mtp(self, hidden, nxt, mpos, cache, window, form, per_position):
        fn = parallel_model.mtp_verify if per_position else parallel_model.mtp_forward
        h, cp = fn(self.r.state, hidden, jnp.asarray(nxt), jnp.asarray(mpos), self.cp_cache(cache, False),
                   **self._kw(window, "mqa"))
        return h, cp.local

    def draft(self, h, d, pos, cache, window, form):
        h, cp = parallel_model.mtp_forward(self.r.state, h, d, jnp.asarray(pos[:, None]), self.cp_cache(cache, False),
                                           **self._kw(window, "mqa"))
        return h, cp.local

    def _run(self, tok, pos, cache: PagedKVCache, window: int, form: str, *, lower: bool = False):
        """parallel.model.forward. Prefill rows (width > 1) under PCP are split into the balanced 2N-chunk
        layout and their hidden states restored to token order; decode rows run replicated.

        The split is over the group's longest chunk L (`parallel.pcp.PcpSplit(L, N)`: rank g holds chunks
        g and 2N-1-g of every row), not over the padded bucket width W, so a chunk much shorter than its
        bucket stays balanced; each rank's slots are padded to those of a W-token split, so the shapes
        (and compiled programs) depend on the bucket only."""
        d = self.r.deploy
        split = d.prefill_context_parallel_size > 1 and tok.shape[1] > 1
        if self.kv_ranks > 1 and not split:
            form = "mqa"  # queries go to the KV shards; the dense form would need the whole context here
        order = None
        if split:
            n, width = d.context_parallel_size, tok.shape[1]
            slots = PcpSplit(width, n).tokens_per_rank
            real = PcpSplit(max(int((pos >= 0).sum(axis=1).max()), 1), n).positions()  # [n, <= slots]
            src = np.full((n, slots), -1, np.int32)
            src[:, : real.shape[1]] = real
            src = src.reshape(-1)  # the row-relative token each slot holds (-1 = padding)
            tok = np.where(src >= 0, tok[:, np.maximum(src, 0)], 0)
            pos = np.where(src >= 0, pos[:, np.maximum(src, 0)], -1)
            order = np.zeros(width, np.int32)  # token j's slot; tokens past the longest chunk read slot 0
            order[src[src >= 0]] = np.nonzero(src >= 0)[0]
        args = (self.r.state, jnp.asarray(tok), jnp.asarray(pos), self.cp_cache(cache, split), self._zero)
        if lower:
            return parallel_model.forward.trace(*args, **self._kw(window, form)).lower()
        hidden, cp = parallel_model.forward(*args, **self._kw(window, form))
        self._pending.append(cp.counters)
        if len(self._pending) > 256:
            self._fold(len(self._pending) - 1)  # all but this step's, which may still run
        if order is not None:
            hidden = _take_tokens(hidden, jnp.asarray(order))
        return hidden, cp.local


class TensorParallel(ContextMesh):
    """A mesh tp x cp of devices_per_replica devices (parallel.tp): DCP on its inner "cp" axis, the
    weights split over both."""

    def __init__(self, runner, devices):
        self.tp = runner.deploy.tensor_parallel_size
        super().__init__(runner, devices)

    def _mesh(self, devices):
        return make_mesh(**parallel_tp.mesh_sizes(self.tp, self.r.deploy.decode_context_parallel_size),
                         devices=devices)

    def _state(self, state):
        return parallel_tp.place_state(state, self.r.model.cfg, self.mesh, self.r.deploy.enable_expert_parallel)


class DataParallelExperts(OneDevice):
    """DP x EP (`DeployConfig.experts_across_ranks`): N = data_parallel_size ranks of one device each on
    a "dp" mesh, sharing the routed experts (1/N each, parallel.model.place_state) and running every
    forward together (parallel.model.forward_dp: attention on each rank's own rows and pool, the MoE's
    all-to-all dispatch over "dp").

    Layout: a batch of N x R rows is rank-major (rank r's rows are [r R, (r + 1) R), padding rows where a
    rank has fewer or none); the pool is N slices of num_blocks pages (`ranks`: block ids in a table are
    local to its rank's slice), every pool and table array split on its first axis over "dp". The
    runner's rows per program are therefore multiples of N (`ModelRunner.bucket_shapes`). A policy's
    views (HiSparse) travel in the cache split the same way (`parallel.model.dp_cache_specs`): each rank
    resolves and stages against its own host slice and hot buffers."""

    def __init__(self, runner, devices):
        super().__init__(runner, devices)
        self.ranks = len(devices)
        self.mesh = make_mesh(dp=self.ranks, devices=devices)
        self._pending: list = []  # per forward: (its MoE rounds' slots, device int32 [N L, 2]; bytes per slot)
        self._all2all = 0
        self._count_lock = threading.Lock()  # a server's /metrics reads the count beside the stepping thread

    def place(self, cache: PagedKVCache, state):
        """The one-rank pool `cache` tiled N times on its first axis (zeros: nothing is copied from the
        host) and split over "dp"; weights replicated but the routed experts, split over "dp"."""
        specs = parallel_model.dp_cache_specs(cache)
        tile = jax.jit(lambda c: jax.tree.map(lambda a: jnp.tile(a, (self.ranks,) + (1,) * (a.ndim - 1)), c),
                       out_shardings=jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs))
        return tile(cache), parallel_model.place_state(state, self.mesh, True, axis="dp")

    def memory(self):
        return (NamedSharding(self.mesh, P("dp"), memory_kind="pinned_host"),
                NamedSharding(self.mesh, P("dp"), memory_kind="device"))

    def check_ids(self, table_mla, table_index) -> None:
        if max(table_mla.max(initial=-1), table_index.max(initial=-1)) >= self.r.num_blocks:
            raise ValueError(f"block id beyond a rank's {self.r.num_blocks} blocks")

    def forward(self, tok, pos, cache, window, form, *, keep_all=False, lower=False):
        """As OneDevice's on N x R rank-major rows (hidden [N R, 1, D]: each row's last real token for a
        prefill width; with keep_all also every position's). The form is the model's own "auto" choice,
        which each rank makes on the whole width of its rows, as one device would."""
        r = self.r
        args = (r.state, jnp.asarray(tok), jnp.asarray(pos), cache)
        kw = self._kw(window, form)
        if lower:
            return parallel_model.forward_dp.trace(*args, **kw, last_only=tok.shape[1] > 1).lower()
        last_only = keep_all or tok.shape[1] > 1
        return self._counted(parallel_model.forward_dp(*args, **kw, last_only=last_only, keep_all=keep_all,
                                                       count_rounds=True))

    def verify(self, tok, pos, cache, window, form, batched):
        """A verify group: batched as one forward of every position, or sequential (GLM53.verify)."""
        r = self.r
        args = (r.state, jnp.asarray(tok), jnp.asarray(pos), cache)
        fn = parallel_model.forward_dp if batched else parallel_model.verify_dp
        return self._counted(fn(*args, **self._kw(window, form), count_rounds=True))

    def mtp(self, hidden, nxt, mpos, cache, window, form, per_position):
        fn = parallel_model.mtp_verify_dp if per_position else parallel_model.mtp_forward_dp
        return self._counted(fn(self.r.state, self._rows(hidden), jnp.asarray(nxt), jnp.asarray(mpos), cache,
                                **self._kw(window, form), count_rounds=True))

    def draft(self, h, d, pos, cache, window, form):
        return self._counted(parallel_model.mtp_forward_dp(self.r.state, self._rows(h), self._rows(d),
                                                           jnp.asarray(pos[:, None]), cache, **self._kw(window, form),
                                                           count_rounds=True))

    def _rows(self, x):
        """Device rows split over the ranks (a no-op for the outputs of the ranks' programs; the warm-up's
        zeros start on one device)."""
        return jax.device_put(x, NamedSharding(self.mesh, P("dp")))

    def _kw(self, window: int, form: str) -> dict:
        r = self.r
        return dict(graphdef=r.c.graphdef, mesh=self.mesh, window=window, form=form, impl=r.deploy.attention_impl)

    def _counted(self, out):
        """(hidden, cache, rounds) of a program -> (hidden, cache); its rounds' slots pending as bytes."""
        hidden, cache, rounds = out
        h = hidden[0] if isinstance(hidden, tuple) else hidden
        with self._count_lock:
            self._pending.append((rounds, parallel_ep.all2all_bytes_per_slot(self.ranks, h.shape[-1], h.dtype.itemsize)))
            if len(self._pending) > 256:
                self._fold(len(self._pending) - 1)  # all but this step's, which may still run
        return hidden, cache

    def _fold(self, steps: int) -> None:
        for rounds, per_slot in self._pending[:steps]:
            mine = np.asarray(rounds)[: rounds.shape[0] // self.ranks]  # rank 0's: every rank took the same rounds
            self._all2all += int(mine.sum()) * per_slot
        del self._pending[:steps]

    def all2all_bytes(self, reset: bool = False) -> int:
        """Bytes one device sent to the others by all-to-all since the start (or the last reset): every MoE
        layer's first round and the second rounds taken (read from the programs' device counts lazily)."""
        with self._count_lock:
            self._fold(len(self._pending))
            out = self._all2all
            if reset:
                self._all2all = 0
        return out


def strategy_for(runner, devices) -> OneDevice:
    """The forward strategy of `runner`'s deployment, chosen once: TP, a context mesh, DP x EP, or one
    device."""
    d = runner.deploy
    if d.experts_across_ranks:
        return DataParallelExperts(runner, devices)
    if d.tensor_parallel_size > 1:
        return TensorParallel(runner, devices)
    if d.context_parallel_size > 1:
        return ContextMesh(runner, devices)
    return OneDevice(runner, devices)
