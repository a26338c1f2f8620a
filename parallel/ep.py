"""Expert parallelism (EP): the routed experts of a MoE layer split over mesh axes, tokens moved by
all-to-all.

With E experts over N ranks, rank r holds experts [r E/N, (r+1) E/N). Every rank routes its own tokens
with the (replicated) router of `glm53.layers.MoE`, then (`moe_local`, inside `jax.shard_map`):
1. dispatch: each (token, chosen expert) assignment goes to the expert's rank. The send buffer is dense
   and padded, [N, cap, D]: a token's top-k experts are distinct, so at most min(top_k, E/N) of its
   assignments land on one rank, and cap = tokens * min(top_k, E/N) never overflows; but such buffers
   move N x the exact volume. So the first round has the mean load per destination plus four of its
   standard deviations (`first_round_capacity`) and a second round, taken by every rank only if some rank has assignments
   past it, carries the rest: nothing is ever dropped. One `lax.all_to_all` moves the rows (and one the
   local expert ids; -1 = empty slot). This padded form runs everywhere; `lax.ragged_all_to_all`
   (exact-size messages) does not run on XLA:CPU.
2. each rank runs its experts on what it received (the layer's `experts`, i.e. `glm53.layers.grouped_experts`
   over float or fp8 weights; empty slots weigh 0);
3. combine: a second all-to-all returns the expert outputs to the token's rank, which weighs them by
   the router weights and sums over the top-k; the shared expert runs locally on the rank's tokens.
The result equals the single-device `MoE` up to float summation order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from glm53.layers import MoE
from parallel.mesh import axis_size


def _axes(axis: str | Sequence[str]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def dispatch_capacity(tokens: int, top_k: int, experts_per_rank: int) -> int:
    """Slots per destination rank that can never overflow: tokens * min(top_k, experts_per_rank)."""
    return tokens * min(top_k, experts_per_rank)


# First-round slots per destination: the mean load (a rank's assignments / ranks) plus this many of its
# standard deviations (about its square root, for routing spread evenly), so that one round carries a
# balanced step and the padded buffers move ~1 + 4 / sqrt(mean) times the exact volume instead of the N x
# of the never-overflowing capacity (16 tokens, top-8 over 8 ranks: 32 slots, not 128; 2,048 tokens:
# 2,230, not 16,384). Assignments past it go in a second round, run only when some rank overflows.
FIRST_ROUND_SIGMAS = 4.0


def first_round_capacity(tokens: int, top_k: int, experts_per_rank: int, ranks: int,
                         sigmas: float = FIRST_ROUND_SIGMAS) -> int:
    """Slots per destination in the dispatch's first round: ceil(mean + sigmas x sqrt(mean)) for a mean load
    of tokens x top_k / ranks, at least 1 and at most `dispatch_capacity` (then there is no second round)."""
    mean = tokens * top_k / ranks
    return max(1, min(dispatch_capacity(tokens, top_k, experts_per_rank), math.ceil(mean + sigmas * math.sqrt(mean))))


def all2all_bytes_per_slot(ranks: int, hidden_size: int, itemsize: int) -> int:
    """Bytes one device sends to the others per dispatch slot of one round of `moe_local`: a slot is one
    row of the [N, slots, D] send buffer per destination, of which N - 1 leave the device, twice (the row
    out, its expert's output back), plus the int32 expert id that travels with it."""
    return (ranks - 1) * (2 * hidden_size * itemsize + 4)


def moe_local(moe: MoE, x_ND, *, axis, valid_N=None, sigmas: float | None = FIRST_ROUND_SIGMAS, rounds=None):
    """Expert-parallel MoE on one rank (inside `jax.shard_map` over `axis`, a name or tuple of names).

    `moe`: the layer with this rank's slice of the routed experts (gate_up_proj [E/N, D, 2F], down_proj
    [E/N, F, D], and their block scales when fp8) and replicated router / shared expert; x [n, D]: this
    rank's tokens -> y [n, D]. valid_N: bool [n], the tokens to dispatch (None: all); the others (padding:
    every padding token routes alike, which would pile them onto a few ranks) get only the shared expert.

    Two rounds of the padded exchange: the first with `first_round_capacity` slots per destination, the
    second, for the assignments whose slot is past it, with the rest of `dispatch_capacity`, inside a
    `lax.cond` that every rank takes or skips together (the overflow flag is summed over the axis).
    Every dispatched assignment is computed exactly once, so the result does not depend on `sigmas`,
    which only trades buffer bytes against how often the second round runs (None: one round of the full
    capacity, the N x volume).

    rounds: None, or a list this call appends one int32 [2] to: (slots of the first round, slots of the
    second round if it ran, else 0), per destination (`all2all_bytes_per_slot` turns them into bytes).
    """
    axes = _axes(axis)
    n_ranks = math.prod(jax.lax.axis_size(a) for a in axes)
    e_local = moe.experts.gate_up_proj.shape[0]
    n, d = x_ND.shape
    idx_NK, w_NK = moe.gate(x_ND)
    k = idx_NK.shape[1]
    cap = dispatch_capacity(n, k, e_local)
    cap1 = cap if sigmas is None else first_round_capacity(n, k, e_local, n_ranks, sigmas)

    # Slot of each assignment in its destination's buffer: how many earlier assignments go to that rank
    # (assignments of tokens not dispatched have no destination: rank index n_ranks, no slot).
    valid_A = jnp.ones((n * k,), bool) if valid_N is None else jnp.repeat(valid_N, k)
    dest_A = jnp.where(valid_A, (idx_NK // e_local).reshape(-1), n_ranks)
    onehot_AN = (dest_A[:, None] == jnp.arange(n_ranks)[None, :]).astype(jnp.int32)
    to_A = jnp.minimum(dest_A, n_ranks - 1)
    slot_A = jnp.take_along_axis(jnp.cumsum(onehot_AN, axis=0), to_A[:, None], axis=1)[:, 0] - 1
    tok_A = jnp.repeat(jnp.arange(n), k)
    x_AD = x_ND[tok_A]
    e_A = (idx_NK % e_local).reshape(-1)

    def exchange(first: int, size: int):
        """Assignments with slots [first, first + size) of each destination, through one round of
        all-to-alls -> their expert outputs [A, D] (zero rows for the other assignments)."""
        mine = valid_A & (slot_A >= first) & (slot_A < first + size)
        slot = jnp.where(mine, slot_A - first, size)  # others: out of range, dropped by the scatter
        send_x = jnp.zeros((n_ranks, size, d), x_ND.dtype).at[to_A, slot].set(x_AD, mode="drop")
        send_e = jnp.full((n_ranks, size), -1, jnp.int32).at[to_A, slot].set(e_A, mode="drop")
        recv_x = jax.lax.all_to_all(send_x, axes, 0, 0, tiled=True)  # [N (source), size, D]
        recv_e = jax.lax.all_to_all(send_e, axes, 0, 0, tiled=True).reshape(-1, 1)
        filled = (recv_e >= 0).astype(jnp.float32)
        y_rows = moe.experts(recv_x.reshape(-1, d), jnp.maximum(recv_e, 0), filled)
        back = jax.lax.all_to_all(y_rows.reshape(n_ranks, size, d), axes, 0, 0, tiled=True)  # [N (expert rank), size, D]
        return jnp.where(mine[:, None], back[to_A, jnp.minimum(slot, size - 1)], 0)

    y_AD = exchange(0, cap1)
    second = jnp.int32(0)
    if cap1 < cap:
        overflow = jax.lax.psum(jnp.any(valid_A & (slot_A >= cap1)).astype(jnp.int32), axes) > 0
        y_AD = y_AD + jax.lax.cond(overflow, lambda: exchange(cap1, cap - cap1), lambda: jnp.zeros_like(y_AD))
        second = overflow.astype(jnp.int32) * (cap - cap1)
    if rounds is not None:
        rounds.append(jnp.stack([jnp.int32(cap1), second]))
    y_AD = y_AD * w_NK.reshape(-1)[:, None].astype(y_AD.dtype)
    y_ND = jnp.sum(y_AD.reshape(n, k, d), axis=1).astype(x_ND.dtype)
    if moe.shared_experts is not None:
        y_ND = y_ND + moe.shared_experts(x_ND)
    return y_ND


def moe_local_replicated(moe: MoE, x_ND, *, axis):
    """Expert-parallel MoE when every rank holds the same tokens (decode steps, and prefill without PCP):
    each rank applies its own experts to the assignments that chose them and one all-reduce (psum) sums the
    ranks' parts -> y [n, D] on every rank. Assignments to other ranks' experts are routed to local expert
    0 with weight 0 (computed, never counted)."""
    axes = _axes(axis)
    e_local = moe.experts.gate_up_proj.shape[0]
    idx_NK, w_NK = moe.gate(x_ND)
    mine = idx_NK // e_local == jax.lax.axis_index(axes)
    y_ND = moe.experts(x_ND, jnp.where(mine, idx_NK % e_local, 0), jnp.where(mine, w_NK, 0.0))
    y_ND = jax.lax.psum(y_ND, axes)
    if moe.shared_experts is not None:
        y_ND = y_ND + moe.shared_experts(x_ND)
    return y_ND


def state_specs(state, axis: str | Sequence[str]):
    """PartitionSpecs for an `nnx.split` state of a MoE layer or a whole model: the routed experts (any
    parameter under an `experts` module) split on their expert axis over `axis`, everything else
    replicated."""
    axes = _axes(axis)

    def spec(path, _):
        keys = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        return P(axes) if "experts" in keys else P()

    return jax.tree_util.tree_map_with_path(spec, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "axes"))
def _moe_jit(state, x, *, graphdef, mesh, axes):
    def body(state, x):
        return moe_local(nnx.merge(graphdef, state), x, axis=axes)

    # check_vma=False as in parallel.model: grouped_experts' loops start their carries from plain zeros,
    # which the varying-axes check would reject against a body output that varies over the mesh axes
    return jax.shard_map(body, mesh=mesh, in_specs=(state_specs(state, axes), P(axes)), out_specs=P(axes),
                         check_vma=False)(state, x)


def moe(mesh, layer: MoE, x_ND, *, axis: str | Sequence[str] = "cp"):
    """Expert-parallel forward of `layer` on tokens x [n, D] split over `axis` (n divisible by the axis
    size, E divisible too) -> y [n, D], equal to `layer(x)`."""
    axes = _axes(axis)
    size = axis_size(mesh, axes)
    e = layer.experts.gate_up_proj.shape[0]
    if e % size:
        raise ValueError(f"n_routed_experts ({e}) must be divisible by the expert-parallel size ({size}, axes {axes})")
    if x_ND.shape[0] % size:
        raise ValueError(f"the number of tokens ({x_ND.shape[0]}) must be divisible by the expert-parallel size "
                         f"({size}); pad the batch")
    graphdef, state = nnx.split(layer)
    return _moe_jit(state, jnp.asarray(x_ND), graphdef=graphdef, mesh=mesh, axes=axes)
