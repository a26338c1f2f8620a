"""The GLM-5.3 forward on a device mesh: one `jax.shard_map` over the context axis around the unchanged model.

Inside the map every rank runs `GLM53.__call__` on its tokens against a `parallel.cp_cache.CpKVCache`,
which does the attention-side communication (PCP all-gathers of new KV, DCP top-k and LSE merges,
PCP x DCP full copies). Weights are replicated, except the routed experts under expert parallelism
(`ep=True`): split over the context axis, which then serves as the expert axis ("PCP8 x DCP8 x EP8" is 8
devices). The MoE layers of the merged model are swapped for their EP forms: all-to-all dispatch when the
ranks hold different tokens (PCP prefill, `parallel.ep.moe_local`), one all-reduce when they hold the same
ones (decode, `parallel.ep.moe_local_replicated`).

Tensor parallelism (`tensor_parallel=True`, `parallel.tp`): the weights are split over the TP axes
("tp", "cp") (heads, MLP widths, experts; `parallel.tp.place_state`), each layer's o_proj, MLP and MoE
all-reduce over them, and the cache (`CpKVCache(gather_queries=True, heads_split=True)`) is replicated
over "tp" and, under DCP, split over "cp". Tokens are replicated (no PCP under TP).

MTP (`verify`, `mtp_forward`, `mtp_verify`; on DP x EP ranks `verify_dp`, `mtp_forward_dp`,
`mtp_verify_dp`): the sequential verify step and the MTP layer's passes run in the same
kind of shard_map with the tokens replicated, under DCP and under TP (`tensor_parallel=True`: the MTP
layer's heads and MLP split like every layer's).

Data parallelism with expert parallelism (`forward_dp`): N ranks on a "dp" axis, each with its own
requests and KV pool (and under HiSparse its own host pool, hot buffers and resolver clock, the views
split over the ranks), sharing the routed experts (all-to-all dispatch); no other weight is split.

Token layouts (`CpKVCache.tokens_split`): split, tokens [B, N * Tl] in the `parallel.pcp.PcpSplit`
order (rank-major; each rank's Tl = 2C tokens of every row), sharded on axis 1; or replicated, [B, T] on
every rank. The hidden states come back in the same layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm53.layers import MoE
from parallel import ep
from parallel import tp as tp_ops
from kvcache.paged import PagedKVCache
from parallel.cp_cache import CpKVCache


class _ExpertParallel:
    """A MoE layer's forward under expert parallelism (see the module docstring)."""

    def __init__(self, moe: MoE, axis: str, tokens_split: bool, valid_BT=None, rounds=None):
        self.moe, self.axis, self.tokens_split, self.valid_BT = moe, axis, tokens_split, valid_BT
        self.rounds = rounds  # None, or the list `ep.moe_local` reports its rounds' slots to

    def __call__(self, x_BTD):
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        if not self.tokens_split:
            return ep.moe_local_replicated(self.moe, x_ND, axis=self.axis).reshape(x_BTD.shape)
        # padding tokens (position -1) are not dispatched; a layer that runs on fewer tokens than the
        # step's (the last layer under last_only) dispatches all of them
        valid = self.valid_BT
        valid_N = valid.reshape(-1) if valid is not None and valid.shape == x_BTD.shape[:2] else None
        return ep.moe_local(self.moe, x_ND, axis=self.axis, valid_N=valid_N, rounds=self.rounds).reshape(x_BTD.shape)


def cache_specs(cache: CpKVCache):
    """PartitionSpecs for a CpKVCache pytree: KV arrays split over the axis under DCP (replicated
    otherwise), block tables and HiSparse's views (hot state, plans; TP alone) replicated, the views'
    host pools split by rows over their `host_axis` when the TP ranks share one (kvcache.host.HostMemory)."""
    kv = P(cache.axis) if cache.dcp else P()
    loc = cache.local

    def replicated(view):
        if view is None:
            return None
        specs = jax.tree.map(lambda _: P(), view)
        pool = P(view.host_axis) if view.host_axis else P()
        return dataclasses.replace(specs, host_mla=tuple(pool for _ in view.host_mla))

    local = dataclasses.replace(loc, mla=tuple(kv for _ in loc.mla), index=tuple(kv for _ in loc.index),
                                block_table=P(), index_block_table=None if loc.index_block_table is None else P(),
                                hisparse=replicated(loc.hisparse), staging=replicated(loc.staging))
    counters = None if cache.counters is None else {k: P(cache.axis) for k in cache.counters}
    return dataclasses.replace(cache, local=local, counters=counters)


def place(cache: CpKVCache, mesh) -> CpKVCache:
    """The cache's arrays put on `mesh` with `cache_specs` (global arrays: under DCP, rank r's table is
    the r-th slice of each KV array's first axis)."""
    shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    return jax.tree.map(shard, cache, cache_specs(cache))


def place_state(state, mesh, expert_parallel: bool, axis: str = "cp"):
    """Model weights put on `mesh` once (replicated; the routed experts split under EP), so steps do not
    move them."""
    specs = state_specs(state, axis, expert_parallel)
    return jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), state, specs)


def state_specs(state, axis: str, expert_parallel: bool):
    if expert_parallel:
        return ep.state_specs(state, axis)
    return jax.tree.map(lambda _: P(), state)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "window", "form", "impl", "expert_parallel",
                                             "tensor_parallel"),
                   donate_argnames=("cache",))
def forward(state, tokens, positions, cache: CpKVCache, counters=None, *, graphdef, mesh, window: int, form: str,
            impl: str, expert_parallel: bool = False, tensor_parallel: bool = False):
    """`GLM53.__call__` on `mesh` -> (hidden [B, T', D] in the tokens' layout, cache). tokens / positions
    [B, T'] int32 (-1 = padding) in the layout `cache.tokens_split` says; the cache is donated.
    counters: None, or {name: int32 [N, 2]} split over the axis (`parallel.cp_cache.zero_counters(N)`; not
    donated, so one zero set serves every step): the returned cache's `counters` add this forward's
    work per rank. tensor_parallel: `state` is `parallel.tp.place_state`'s (split over the TP axes) and
    expert_parallel says how its routed experts are split there (whole experts, or each one's width)."""
    axis = cache.axis
    tok = P(None, axis) if cache.tokens_split else P()
    if cache.counters is not None:
        raise ValueError("pass the counters as forward's `counters` argument, not inside the (donated) cache")
    specs = cache_specs(cache)
    counter_specs = None if counters is None else {k: P(axis) for k in counters}
    out_specs = dataclasses.replace(specs, counters=counter_specs)

    def body(state, tokens, positions, cache, counters):
        cache = dataclasses.replace(cache, counters=counters)
        model = nnx.merge(graphdef, state)
        if tensor_parallel:
            tp_ops.local_modules(model, expert_parallel=expert_parallel)
        elif expert_parallel:
            for layer in model.layers:
                if isinstance(layer.mlp, MoE):
                    layer.mlp = _ExpertParallel(layer.mlp, axis, cache.tokens_split, positions >= 0)
        hidden, cache, _ = model(tokens, positions, cache, window=window, form=form, impl=impl)
        return hidden, cache

    if tensor_parallel:
        if cache.tokens_split:
            raise NotImplementedError("tensor parallelism with PCP (tokens split over the context axis)")
        if axis != tp_ops.AXES[-1]:
            raise ValueError(f"under tensor parallelism the cache's axis is the TP group's inner axis "
                             f"{tp_ops.AXES[-1]!r}, got {axis!r}")
        weights = tp_ops.state_specs(state, expert_parallel)
    else:
        weights = state_specs(state, axis, expert_parallel)
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(weights, tok, tok, specs, counter_specs),
                         out_specs=(tok, out_specs), check_vma=False)(state, tokens, positions, cache, counters)


def dp_cache_specs(cache: PagedKVCache, axis: str = "dp"):
    """PartitionSpecs of the caches of `forward_dp`'s ranks held as one global PagedKVCache: every array
    split on its first axis over `axis` (rank r's pool is the r-th slice of each KV array, its requests
    the r-th slice of the block tables' rows; page ids in a table are local to its rank's pool). HiSparse's
    views (`kvcache.views`) alike: each rank's host pool slice, hot buffers and rows; their scalars (the
    LRU clock, the copy branch) one per rank, [N] (`_dp_views`)."""
    for view in (cache.hisparse, cache.staging):
        if view is not None and view.host_axis is not None:
            raise NotImplementedError("a host pool shared by several devices under data parallelism with "
                                      "expert parallelism (each rank holds its own)")
    return jax.tree.map(lambda _: P(axis), cache)


def _dp_views(cache: PagedKVCache, ranks: int) -> PagedKVCache:
    """The global cache with its HiSparse view's scalars made one per rank ([N]; a scalar is every rank's),
    so that `dp_cache_specs` splits them like every other field."""
    if cache.hisparse is None:
        return cache
    v = cache.hisparse
    per_rank = {k: jax.numpy.broadcast_to(getattr(v, k), (ranks,)) for k in ("step", "copy_branch")}
    return dataclasses.replace(cache, hisparse=dataclasses.replace(v, **per_rank))


def _rank_views(cache: PagedKVCache, inside: bool) -> PagedKVCache:
    """Inside the ranks' shard_map: a rank's view scalars [1] -> scalars (`inside`), or back."""
    if cache.hisparse is None:
        return cache
    v = cache.hisparse
    f = (lambda x: x[0]) if inside else (lambda x: x[None])  # noqa: E731
    return dataclasses.replace(cache, hisparse=dataclasses.replace(v, step=f(v.step), copy_branch=f(v.copy_branch)))


_DP_STATIC = ("graphdef", "mesh", "window", "form", "impl", "axis", "count_rounds")


@functools.partial(jax.jit, static_argnames=_DP_STATIC + ("last_only", "keep_all"), donate_argnames=("cache",))
def forward_dp(state, tokens, positions, cache: PagedKVCache, *, graphdef, mesh, window: int, form: str, impl: str,
               axis: str = "dp", last_only: bool = False, keep_all: bool = False, count_rounds: bool = False):
    """N data-parallel ranks that share their routed experts (BRIEF §3's "DP8 decode ranks with EP8"):
    `GLM53.__call__` in one shard_map over `axis`, each rank on its own requests and its own KV pool
    (attention entirely local, no collective), the routed experts split over the ranks (`place_state`
    with expert_parallel) and each MoE layer's assignments sent to their expert's rank and back by
    all-to-all (`parallel.ep.moe_local`). -> (hidden [N * B, T or 1, D], cache), rank-major like the
    inputs: tokens / positions [N * B, T] int32 (-1 = padding), cache as `dp_cache_specs` lays it out
    (donated). Every rank runs every step (a rank without work passes padding rows, as vLLM's DP ranks
    run dummy batches): the all-to-alls need all N. Equal, per rank, to one device running that rank's
    batch alone, up to float summation order (tests/parallel/test_model_cp.py). keep_all (with
    last_only): hidden is the pair (last tokens' [N * B, 1, D], every position's [N * B, T, D]), as MTP's
    prefill reads it.

    count_rounds: also return int32 [N * L, 2], each rank's (first-round slots, second-round slots taken)
    of the L MoE layers the program ran, in order (`parallel.ep.moe_local`'s `rounds`; the same on every
    rank, since every rank takes a round together), from which the engine counts the all-to-all bytes."""
    fn = lambda m, t, p, c: m(t, p, c, window=window, form=form, impl=impl, last_only=last_only,  # noqa: E731
                              keep_all=keep_all)[:2]
    return _dp_map(fn, state, (tokens,), positions, cache, graphdef=graphdef, mesh=mesh, axis=axis,
                   count_rounds=count_rounds)


@functools.partial(jax.jit, static_argnames=_DP_STATIC, donate_argnames=("cache",))
def verify_dp(state, tokens, positions, cache: PagedKVCache, *, graphdef, mesh, window: int, form: str, impl: str,
              axis: str = "dp", count_rounds: bool = False):
    """`GLM53.verify` (each position a one-token decode step, lax.scan) on the ranks of `forward_dp` ->
    (hidden [N * B, T, D], cache[, rounds]). Its rounds are counted from the shapes: each position's
    first round per MoE layer (a second round taken inside the scan is not seen)."""
    fn = lambda m, t, p, c: m.verify(t, p, c, window=window, form=form, impl=impl)  # noqa: E731
    return _dp_map(fn, state, (tokens,), positions, cache, graphdef=graphdef, mesh=mesh, axis=axis,
                   count_rounds=count_rounds, scanned=True)


@functools.partial(jax.jit, static_argnames=_DP_STATIC, donate_argnames=("cache",))
def mtp_forward_dp(state, h_prev, next_tokens, positions, cache: PagedKVCache, *, graphdef, mesh, window: int,
                   form: str, impl: str, axis: str = "dp", count_rounds: bool = False):
    """`GLM53.mtp_forward(0, ...)` on the ranks of `forward_dp` -> (hidden [N * B, T, D], cache[, rounds]):
    the MTP layer's KV written to and read from each rank's own pool, its MoE dispatched over `axis`."""
    fn = lambda m, h, t, p, c: m.mtp_forward(0, h, t, p, c, window=window, form=form, impl=impl)  # noqa: E731
    return _dp_map(fn, state, (h_prev, next_tokens), positions, cache, graphdef=graphdef, mesh=mesh, axis=axis,
                   count_rounds=count_rounds)


@functools.partial(jax.jit, static_argnames=_DP_STATIC, donate_argnames=("cache",))
def mtp_verify_dp(state, h_prev, next_tokens, positions, cache: PagedKVCache, *, graphdef, mesh, window: int,
                  form: str, impl: str, axis: str = "dp", count_rounds: bool = False):
    """`GLM53.mtp_verify(0, ...)` (the MTP pass one position at a time, lax.scan: HiSparse's sequential
    verify, each position resolving its own selection) on the ranks of `forward_dp` -> (hidden
    [N * B, T, D], cache[, rounds]); its rounds counted from the shapes as `verify_dp`'s (the MTP layer's
    MoE, each position's first round)."""
    fn = lambda m, h, t, p, c: m.mtp_verify(0, h, t, p, c, window=window, form=form, impl=impl)  # noqa: E731
    return _dp_map(fn, state, (h_prev, next_tokens), positions, cache, graphdef=graphdef, mesh=mesh, axis=axis,
                   count_rounds=count_rounds, scanned="mtp")


def _dp_map(method, state, args, positions, cache: PagedKVCache, *, graphdef, mesh, axis: str, count_rounds: bool,
            scanned: str | bool = False):
    """`method(model, *args, positions, cache)` -> (hidden, cache) in one shard_map over `axis`, every
    argument split on its first axis (rank-major rows), the routed experts split over the ranks and every
    MoE layer (the MTP layer's too) dispatching the tokens at positions >= 0 by all-to-all. scanned: the
    method runs its positions one at a time inside a lax.scan (True: GLM53.verify over the main layers;
    "mtp": GLM53.mtp_verify over the MTP layer), where the rounds cannot be collected: they are counted as
    each position's first round of each of those layers' MoEs."""
    cache = _dp_views(cache, mesh.shape[axis])
    specs = dp_cache_specs(cache, axis)

    def body(state, args, positions, cache):
        cache = _rank_views(cache, True)
        model = nnx.merge(graphdef, state)
        rounds = []
        for layer in (*model.layers, *model.mtp):
            if isinstance(layer.mlp, MoE):
                layer.mlp = _ExpertParallel(layer.mlp, axis, True, positions >= 0, None if scanned else rounds)
        hidden, cache = method(model, *args, positions, cache)
        cache = _rank_views(cache, False)
        if scanned:
            scan_layers = model.mtp if scanned == "mtp" else model.layers
            moes = [layer.mlp.moe for layer in scan_layers if isinstance(layer.mlp, _ExpertParallel)]
            rounds = [jax.numpy.array([positions.shape[1] * ep.first_round_capacity(
                positions.shape[0], moe.gate.cfg.num_experts_per_tok, moe.experts.gate_up_proj.shape[0], mesh.shape[axis]), 0],
                jax.numpy.int32) for moe in moes]
        if count_rounds:
            return hidden, cache, jax.numpy.stack(rounds) if rounds else jax.numpy.zeros((0, 2), jax.numpy.int32)
        return hidden, cache

    out_specs = (P(axis), specs, P(axis)) if count_rounds else (P(axis), specs)
    return jax.shard_map(body, mesh=mesh, in_specs=(state_specs(state, axis, True), P(axis), P(axis), specs),
                         out_specs=out_specs, check_vma=False)(state, args, positions, cache)


def _replicated_map(method, state, args, cache: CpKVCache, *, graphdef, mesh, expert_parallel: bool,
                    tensor_parallel: bool = False):
    """`method(model, *args, cache)` -> (hidden, cache) inside one shard_map over the mesh, its array
    arguments replicated (decode-shaped work: DCP, tokens not split) and the cache donated as in
    `forward`. The MTP layer's KV lives in the same CpKVCache as the other layers', so it is sharded
    (DCP) exactly like theirs. tensor_parallel: `state` is `parallel.tp.place_state`'s, and the model
    (its MTP layers included) runs with `parallel.tp.local_modules`, as `forward` does."""
    axis = cache.axis
    if cache.tokens_split:
        raise NotImplementedError("MTP passes and sequential verification with PCP (tokens split over the "
                                  "context axis) are not built; DCP is")
    if cache.counters is not None:
        raise ValueError("the cache's counters must be None here")
    if tensor_parallel and axis != tp_ops.AXES[-1]:
        raise ValueError(f"under tensor parallelism the cache's axis is the TP group's inner axis "
                         f"{tp_ops.AXES[-1]!r}, got {axis!r}")
    specs = cache_specs(cache)

    def body(state, args, cache):
        model = nnx.merge(graphdef, state)
        if tensor_parallel:
            tp_ops.local_modules(model, expert_parallel=expert_parallel)
        elif expert_parallel:
            for layer in (*model.layers, *model.mtp):
                if isinstance(layer.mlp, MoE):
                    layer.mlp = _ExpertParallel(layer.mlp, axis, False)
        return method(model, *args, cache)

    weights = tp_ops.state_specs(state, expert_parallel) if tensor_parallel else state_specs(state, axis, expert_parallel)
    return jax.shard_map(body, mesh=mesh, in_specs=(weights, P(), specs),
                         out_specs=(P(), specs), check_vma=False)(state, args, cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "window", "form", "impl", "expert_parallel",
                                             "tensor_parallel"),
                   donate_argnames=("cache",))
def verify(state, tokens, positions, cache: CpKVCache, *, graphdef, mesh, window: int, form: str, impl: str,
           expert_parallel: bool = False, tensor_parallel: bool = False):
    """`GLM53.verify` (each position a one-token decode step, lax.scan) on `mesh` -> (hidden [B, T, D], cache)."""
    fn = lambda m, t, p, c: m.verify(t, p, c, window=window, form=form, impl=impl)  # noqa: E731
    return _replicated_map(fn, state, (tokens, positions), cache, graphdef=graphdef, mesh=mesh,
                           expert_parallel=expert_parallel, tensor_parallel=tensor_parallel)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "window", "form", "impl", "expert_parallel",
                                             "tensor_parallel"),
                   donate_argnames=("cache",))
def mtp_verify(state, h_prev, next_tokens, positions, cache: CpKVCache, *, graphdef, mesh, window: int, form: str,
               impl: str, expert_parallel: bool = False, tensor_parallel: bool = False):
    """`GLM53.mtp_verify(0, ...)` on `mesh` (the MTP pass one position at a time, lax.scan: what HiSparse's
    sequential verify runs, each position resolving its own selection) -> (hidden [B, T, D], cache)."""
    fn = lambda m, h, t, p, c: m.mtp_verify(0, h, t, p, c, window=window, form=form, impl=impl)  # noqa: E731
    return _replicated_map(fn, state, (h_prev, next_tokens, positions), cache, graphdef=graphdef, mesh=mesh,
                           expert_parallel=expert_parallel, tensor_parallel=tensor_parallel)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "window", "form", "impl", "expert_parallel",
                                             "tensor_parallel"),
                   donate_argnames=("cache",))
def mtp_forward(state, h_prev, next_tokens, positions, cache: CpKVCache, *, graphdef, mesh, window: int, form: str,
                impl: str, expert_parallel: bool = False, tensor_parallel: bool = False):
    """`GLM53.mtp_forward(0, ...)` on `mesh` -> (hidden [B, T, D], cache): the MTP layer's KV and indexer
    keys written and read through the CpKVCache like every layer's."""
    fn = lambda m, h, t, p, c: m.mtp_forward(0, h, t, p, c, window=window, form=form, impl=impl)  # noqa: E731
    return _replicated_map(fn, state, (h_prev, next_tokens, positions), cache, graphdef=graphdef, mesh=mesh,
                           expert_parallel=expert_parallel, tensor_parallel=tensor_parallel)
