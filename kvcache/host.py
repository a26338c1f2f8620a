"""Device <-> host movement of KV: host pools in `pinned_host` memory, page copies, the host-row gather
HiSparse's decode step uses, and the counts of what moved. The one room where KV crosses the link.

- `take_host_rows` / `put_host_rows`: rows of a pinned_host table to device memory and back, usable
  inside jit (the gather / scatter runs on the host, so only the selected rows cross).
- `copy_host_rows`: a resolver plan's (host row -> device row) copies, outside jit (tests, checks).
- `HiSparseView`: what a HiSparse decode step carries in the paged cache (host pool tables, hot
  buffers, the resolver's plan) and the per-layer row copy (`copy_rows`).
- `HostMemory`: one replica's host side: executes a plan's transfer operations (kvcache.transfer) in
  order against the device cache and counts the bytes each moves.

On CPU both memory kinds are the same RAM: everything here runs, and its bytes are counted exactly,
but their time is modelled (kvcache.transfer.TransferStats); that only the counted bytes cross a PCIe
link is for the GPU device check (experiments/check_hisparse_copy.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention.common import pow2_at_least
from attention.hisparse import NEVER_USED, HotBuffer, resolve
from attention.sparse_mla import SlotRows, sparse_mqa
from kvcache.relayout import canonical_rows
from kvcache.transfer import LoadKV, PageCopy, ResetLease, SaveKV, TierLoad, TierStore, Transfer


# ------------------------------------------------------------------------------------ row primitives
@jax.jit
def _take_host_rows(host_table, idx):
    return take_host_rows(host_table, idx)


def take_host_rows(host_table, idx):
    """Rows `idx` (device int32 [N], in range) of a pinned_host table, gathered on the host and
    delivered to device memory; usable inside jit. Only these N rows cross (the GPU check confirms)."""
    return _gather_on_host(host_table, jax.device_put(idx, jax.memory.Space.Host))


def take_shared_rows(host_table, idx, axis: str | None):
    """`take_host_rows` of a host pool split by rows over the mesh axis `axis` (inside shard_map; None:
    the whole pool is here): each rank gathers the rows of `idx` (global rows, in range) that its shard
    holds, zeros for the others, and one all-reduce over `axis` hands every rank all of them, so a row
    crosses the host link once, on the rank that holds it. The sum runs on the rows' bits as unsigned
    integers: exact for every dtype (x + 0 is not bitwise x in floating point when x is -0.0)."""
    if axis is None:
        return take_host_rows(host_table, idx)
    n = host_table.shape[0]
    local = idx - jax.lax.axis_index(axis) * n
    own = (local >= 0) & (local < n)
    rows = take_host_rows(host_table, jnp.where(own, local, 0))
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[rows.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(rows, uint)
    bits = jax.lax.psum(jnp.where(own.reshape(own.shape + (1,) * (rows.ndim - 1)), bits, 0), axis)
    return jax.lax.bitcast_convert_type(bits, rows.dtype)


@functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Device)
def _gather_on_host(table, idx):
    return table.at[idx].get(mode="promise_in_bounds")


@functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _scatter_on_host(table, idx, rows):
    return table.at[idx].set(rows, mode="drop")


def put_host_rows(host_table, idx, rows):
    """host_table[idx] = rows for a pinned_host table, rows from device memory (device->host path);
    idx out of range (e.g. host_table.shape[0]) drops the row. Usable inside jit."""
    return _scatter_on_host(host_table, jax.device_put(idx, jax.memory.Space.Host),
                            jax.device_put(rows, jax.memory.Space.Host))


def copy_host_rows(device_table, host_table, copy_src, copy_dst):
    """Copy the plan's rows host -> device: device_table[dst] = host_table[src] for every pair with
    src >= 0. device_table [N, W] (device memory), host_table [N_host, W] (pinned_host memory kind).
    -> (new device_table, rows copied).

    How only those rows move: the source indices go to pinned_host memory (a few KB) and the gather runs
    on the host (`compute_on("device_host")`), producing its result in device memory, so the pool itself
    never crosses. Two JAX traps on the way (docs/kernels.md): a gather whose operand is in pinned_host
    and whose indices are on the device is rejected ("memory_space of all inputs ... must be the same"),
    and `jnp.take` / `x[i]` fail even with host indices because their bounds checks add device-side
    constants; `x.at[i].get(mode="promise_in_bounds")` does not (the indices are checked here instead).
    `device_put(pool)[idx]` would work but copies the whole pool. On CPU both memories are the same RAM:
    this proves semantics; that only these rows cross a PCIe link is for the GPU device check.
    """
    src = np.asarray(copy_src).reshape(-1)
    dst = np.asarray(copy_dst).reshape(-1)
    keep = src >= 0
    if not keep.any():
        return device_table, 0
    src, dst = src[keep], dst[keep]
    if src.max() >= host_table.shape[0] or dst.max() >= device_table.shape[0] or dst.min() < 0:
        raise IndexError(f"copy plan out of range: host rows < {host_table.shape[0]}, device rows < "
                         f"{device_table.shape[0]}, got {src.max()} / {dst.max()}")
    rows = _take_host_rows(host_table, jnp.asarray(src.astype(np.int32)))
    return _put_rows(device_table, jnp.asarray(dst), rows), int(src.size)


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(table, idx, rows):
    return table.at[idx].set(rows)


# ------------------------------------------------------------------------------ the decode step's view
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["host_mla", "host_table", "lease", "hot_pos", "hot_last", "hot_rows", "step",
                                "plan_rows", "plan_src", "plan_dst", "copy_src", "copy_dst", "copy_branch", "hits",
                                "misses", "copied", "unserved"],
                   meta_fields=["host_axis"])
@dataclasses.dataclass(frozen=True)
class HiSparseView:
    """What a decode step needs to resolve sparse-MLA reads under HiSparse (a field of the paged cache).

    host_mla: per MLA layer, the host pool table [N_host * block_size, width] (pinned_host memory kind).
    host_table [R, M] int32: host-pool block of each page of the batch's requests (-1: no host copy).
    lease [R] int32: the row's hot-buffer lease (-1: none; such a row must have every selected page on
        the device, which the host side guarantees).
    hot_pos / hot_last [L, G, H] int32: per lease and IndexShare group, the hot slots' positions and
        last-use steps; hot_rows [L, H] int32: the device rows (global slots) of each lease, one set of
        rows shared by all layers (each layer's table holds its own data in them).
    step: int32 scalar LRU clock.
    plan_rows / plan_src / plan_dst [R, K]: the plan the current group's full layer made; its shared
        layers replay it on their own tables.
    copy_src / copy_dst [R * K]: the plan's copies compacted to the front; copy_branch: which static
        copy size (`copy_sizes`) covers them, 0 = nothing to copy. Each layer copies that many rows, so
        a step moves at most 8x its misses (rounded up to R * K / 64), and nothing when none miss.
    hits / misses [R, G] int32: per row and group, counted by the full layer's resolve (summed over the
        positions of an MTP verify step, which resolve one after the other: GLM53.verify).
    copied [R] int32: host->device rows copied for the row over all layers (checked against
        sum over groups of misses x layers in the group).
    unserved [R] int32: selected positions with no row to read (no device page, no host copy, or no
        lease for a miss): a bookkeeping bug upstream; the runner raises if any.
    host_axis: the mesh axis host_mla's rows are split over (one pool shared by a replica's tensor-
        parallel ranks: `take_shared_rows`), or None (each device holds the whole pool).
    """

    host_mla: tuple
    host_table: jax.Array
    lease: jax.Array
    hot_pos: jax.Array
    hot_last: jax.Array
    hot_rows: jax.Array
    step: jax.Array
    plan_rows: jax.Array
    plan_src: jax.Array
    plan_dst: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    copy_branch: jax.Array
    hits: jax.Array
    misses: jax.Array
    copied: jax.Array
    unserved: jax.Array
    host_axis: str | None = None

    @staticmethod
    def create(host_mla, host_table, lease, hot_pos, hot_last, hot_rows, step, topk: int,
               host_axis: str | None = None) -> HiSparseView:
        r = host_table.shape[0]
        g = hot_pos.shape[1]
        # distinct buffers: the step donates the whole view, and one buffer may not be donated twice
        none = [jnp.full((r, topk), -1, jnp.int32) for _ in range(3)]
        flat = [jnp.full((r * topk,), -1, jnp.int32) for _ in range(2)]
        return HiSparseView(tuple(host_mla), jnp.asarray(host_table, jnp.int32), jnp.asarray(lease, jnp.int32),
                            hot_pos, hot_last, hot_rows, jnp.asarray(step, jnp.int32), *none, *flat,
                            jnp.zeros((), jnp.int32), jnp.zeros((r, g), jnp.int32), jnp.zeros((r, g), jnp.int32),
                            jnp.zeros((r,), jnp.int32), jnp.zeros((r,), jnp.int32), host_axis)

    @property
    def copy_sizes(self) -> list[int]:
        """Static copy sizes (rows per layer) the decode step chooses among: R*K/64, /8, /1."""
        n = self.plan_src.size
        return sorted({max(1, n >> k) for k in (6, 3, 0)})

    def resolve(self, group: int, sel_RK, device_table_RM, block_size: int, *, impl: str = "auto") -> HiSparseView:
        """The full layer of `group`: resolve its selection [R, K] against residency and the leases' hot
        buffers (`resolve(..., impl=)`); keep the plan for the group's shared layers."""
        n_lease = self.hot_pos.shape[0]
        has = self.lease >= 0
        lease = jnp.maximum(self.lease, 0)
        hot = HotBuffer(jnp.where(has[:, None], self.hot_pos[lease, group], -1),
                        jnp.where(has[:, None], self.hot_last[lease, group], NEVER_USED),
                        jnp.where(has[:, None], self.hot_rows[lease], -1))
        plan, hot = resolve(sel_RK, device_table_RM, self.host_table, block_size, hot, self.step, impl=impl)
        # a row without a lease must never need one: its misses would have no slot to land in
        rows = jnp.where(has[:, None] | (plan.copy_src < 0), plan.rows, -1)
        back = jnp.where(has, lease, n_lease)  # rows without a lease write nothing back
        src = jnp.where(has[:, None], plan.copy_src, -1)
        dst = jnp.where(has[:, None], plan.copy_dst, -1)
        order = jnp.argsort(src.reshape(-1) < 0, stable=True)  # the copies first
        count = jnp.sum(src >= 0)
        branch = jnp.where(count == 0, 0, 1 + jnp.searchsorted(jnp.asarray(self.copy_sizes), count))
        return dataclasses.replace(
            self,
            hot_pos=self.hot_pos.at[back, group].set(hot.pos, mode="drop"),
            hot_last=self.hot_last.at[back, group].set(hot.last_use, mode="drop"),
            plan_rows=rows, plan_src=src, plan_dst=dst, copy_src=src.reshape(-1)[order],
            copy_dst=dst.reshape(-1)[order], copy_branch=branch.astype(jnp.int32),
            hits=self.hits.at[:, group].add(plan.hits),
            misses=self.misses.at[:, group].add(jnp.where(has, plan.misses, 0)),
            unserved=self.unserved + plan.lost + jnp.where(has, 0, plan.misses))

    def copy_rows(self, layer_index: int, device_table):
        """Apply the current plan's host->device copies to one layer's table (the one host->device path
        of the decode step). -> (view with `copied` counted, new device table)."""
        host = self.host_mla[layer_index]

        def copy(k, table):
            src, dst = self.copy_src[:k], self.copy_dst[:k]
            rows = take_shared_rows(host, jnp.maximum(src, 0), self.host_axis)
            return table.at[jnp.where(src >= 0, dst, table.shape[0])].set(rows, mode="drop")  # -1: dropped

        branches = [lambda t: t] + [functools.partial(copy, k) for k in self.copy_sizes]
        table = jax.lax.switch(self.copy_branch, branches, device_table)
        return dataclasses.replace(self, copied=self.copied + jnp.sum(self.plan_src >= 0, axis=1)), table


# ------------------------------------------------------------------------------ HiSparse prefill staging
_NO_ROW = jnp.iinfo(jnp.int32).max  # sort key of "no host row to stage" (after every real host slot)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["host_mla", "host_table", "staged", "copied", "unserved"],
                   meta_fields=["tile", "host_axis"])
@dataclasses.dataclass(frozen=True)
class StagingView:
    """What a HiSparse prefill step needs to read MLA rows that live only in the host pool (a field of
    the paged cache, `staging`). The step's MLA block table holds -1 for host-only pages; each layer's
    sparse attention runs its queries in tiles of `tile` tokens, and per tile stages only the distinct
    host rows those queries select into a workspace of at most rows x tile x top-k rows outside the
    block pool (vLLM's temporary device cache), never the whole prefix.

    host_mla: per MLA layer, the host pool table [N_host * block_size, width] (pinned_host memory kind).
    host_table [R, M] int32: host-pool block of each page of the rows' requests (-1: no host copy).
    staged [R, G] int32: per IndexShare group, distinct rows staged per tile summed over tiles, counted
        by the group's full indexer layer (its shared layers stage the same positions).
    copied [R] int32: rows copied host->device over all layers (= staged @ layers per group).
    unserved [R] int32: selected positions with neither a device page nor a host copy (a bookkeeping
        bug upstream; the runner raises if any).
    tile: queries per staging tile (static).
    host_axis: as HiSparseView's (static)."""

    host_mla: tuple
    host_table: jax.Array
    staged: jax.Array
    copied: jax.Array
    unserved: jax.Array
    tile: int = 64
    host_axis: str | None = None

    @staticmethod
    def create(host_mla, host_table, tile: int, groups: int, host_axis: str | None = None) -> StagingView:
        r = host_table.shape[0]
        # distinct buffers (the step donates them)
        return StagingView(tuple(host_mla), jnp.asarray(host_table, jnp.int32), jnp.zeros((r, groups), jnp.int32),
                           jnp.zeros((r,), jnp.int32), jnp.zeros((r,), jnp.int32), tile=tile, host_axis=host_axis)

    def attend(self, layer_index: int, device_table, slots_BTK, pos_BTK, q_lat_BTHR, q_pe_BTHP, scale: float,
               fmt, block_size: int, *, group: int, full: bool, impl: str):
        """Sparse MQA of the queries over their selected positions pos [B, T, K] (-1 = none) of MLA layer
        `layer_index` (of IndexShare group `group`; `full`: its indexer layer), whose device rows are at
        slots [B, T, K] (-1: not on the device) -> (out [B,T,H,R] f32, view with the counts added).

        Rows not on the device come from the host pool through a workspace of u = tile x top-k rows per
        request, tile after tile (a scan): a tile's distinct host rows that the workspace already holds
        (staged for an earlier tile of this chunk) are hits; the others take the least recently used
        rows no hit claimed and are copied (compacted over the batch, in one of three static sizes as
        the decode resolver's copies, `HiSparseView.copy_sizes`). Sorting, not [u, u] comparisons, finds
        the hits, so a tile costs O(u log u). `staged` counts the copies."""
        b, t, k = pos_BTK.shape
        tq = min(self.tile, t)
        nt = -(-t // tq)
        pad = nt * tq - t
        host = self.host_mla[layer_index]
        page = jnp.maximum(pos_BTK, 0) // block_size
        hpage = jnp.take_along_axis(self.host_table, jnp.minimum(page, self.host_table.shape[1] - 1).reshape(b, -1),
                                    axis=1).reshape(pos_BTK.shape)
        need = (pos_BTK >= 0) & (slots_BTK < 0)
        hslot = jnp.where(need & (hpage >= 0), hpage * block_size + pos_BTK % block_size, _NO_ROW)
        lost = need & (hpage < 0)
        read = (pos_BTK >= 0) & ~lost

        def tiles(x, fill):  # [B, T, ...] -> [nt, B, tq, ...]
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
            return jnp.moveaxis(x.reshape(b, nt, tq, *x.shape[2:]), 1, 0)

        u = tq * k  # workspace rows per request row and tile
        n = b * u
        sizes = sorted({max(1, n >> s) for s in (6, 3, 0)})

        def assign(uniq, wpos, wlast, step):
            """One request's tile: its distinct host rows `uniq` [u] (ascending, _NO_ROW padded) against
            the workspace rows' host slots `wpos` [u] (-1 empty) -> (workspace row of each uniq entry,
            copies: whether it misses, new wpos, new wlast). A hit keeps its row; a miss takes the least
            recently used row no hit of this tile claimed (there are enough: the tile has at most u)."""
            valid = uniq != _NO_ROW
            order_w = jnp.argsort(wpos)
            sorted_w = wpos[order_w]
            at = jnp.clip(jnp.searchsorted(sorted_w, uniq), 0, u - 1)
            hit = valid & (sorted_w[at] == uniq)
            hit_row = order_w[at]
            miss = valid & ~hit
            claimed = jnp.zeros((u,), bool).at[jnp.where(hit, hit_row, u)].set(True, mode="drop")
            lru = jnp.argsort(jnp.where(claimed, jnp.iinfo(jnp.int32).max, wlast), stable=True)
            miss_row = lru[jnp.clip(jnp.cumsum(miss) - 1, 0, u - 1)]
            row = jnp.where(hit, hit_row, jnp.where(miss, miss_row, -1))
            wpos = wpos.at[jnp.where(miss, row, u)].set(uniq, mode="drop")
            wlast = wlast.at[jnp.where(valid, row, u)].set(step, mode="drop")
            return row, miss, wpos, wlast

        def one_tile(carry, args):
            ws, wpos, wlast, step = carry
            q_l, q_p, hs, dev, ok = args  # [B, tq, ...]
            key = hs.reshape(b, u)
            uniq = jax.vmap(lambda x: jnp.unique(x, size=u, fill_value=_NO_ROW))(key)  # [B, u] ascending
            row, miss, wpos, wlast = jax.vmap(assign, in_axes=(0, 0, 0, None))(uniq, wpos, wlast, step)
            base = jnp.arange(b, dtype=jnp.int32)[:, None] * u
            src = jnp.where(miss, uniq, -1).reshape(-1)  # host slot -> workspace row, misses only
            dst = (base + row).reshape(-1)
            order = jnp.argsort(src < 0, stable=True)  # the copies first
            count = jnp.sum(miss)
            branch = jnp.where(count == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes), count))

            def copy(m, ws):
                s_, d_ = src[order[:m]], dst[order[:m]]
                rows = take_shared_rows(host, jnp.maximum(s_, 0), self.host_axis)
                return ws.at[jnp.where(s_ >= 0, d_, n)].set(rows, mode="drop")

            ws = jax.lax.switch(branch, [lambda w: w] + [functools.partial(copy, m) for m in sizes], ws)
            from_ws = key != _NO_ROW
            at = jax.vmap(jnp.searchsorted)(uniq, key)  # [B, u]: each selection's entry in uniq
            at_ws = base + jnp.take_along_axis(row, jnp.minimum(at, u - 1), axis=1)
            rows = jnp.where(from_ws[..., None], ws[jnp.maximum(at_ws, 0).reshape(-1)].reshape(b, u, -1),
                             device_table[jnp.maximum(dev, 0).reshape(b, u)])
            local = jnp.where(ok, jnp.arange(n, dtype=jnp.int32).reshape(b, tq, k), -1)
            out, _ = sparse_mqa(q_l, q_p, SlotRows(rows.reshape(n, -1), local, fmt), scale, impl=impl)
            return (ws, wpos, wlast, step + 1), (out, jnp.sum(miss, axis=1).astype(jnp.int32))

        init = (jnp.zeros((n, device_table.shape[1]), device_table.dtype), jnp.full((b, u), -1, jnp.int32),
                jnp.full((b, u), jnp.iinfo(jnp.int32).min, jnp.int32), jnp.int32(0))
        _, (out, per_tile) = jax.lax.scan(one_tile, init, (tiles(q_lat_BTHR, 0), tiles(q_pe_BTHP, 0),
                                                           tiles(hslot, _NO_ROW), tiles(slots_BTK, -1),
                                                           tiles(read, False)))
        out = jnp.moveaxis(out, 0, 1).reshape(b, nt * tq, *out.shape[3:])[:, :t]
        staged = jnp.sum(per_tile, axis=0)
        view = dataclasses.replace(self, staged=self.staged.at[:, group].add(staged if full else 0),
                                   copied=self.copied + staged,
                                   unserved=self.unserved + jnp.sum(lost, axis=(1, 2)).astype(jnp.int32))
        return out, view


# ---------------------------------------------------------------------------------------- page copies
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


@functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _gather_host_to_host(table, idx):
    return table.at[idx].get(mode="promise_in_bounds")


@jax.jit
def _host_gather(host_tables, slots):
    """Rows `slots` of each host table (-1: padding, any row), gathered on the host into host memory (a
    tier store reads host pages: nothing crosses the device link)."""
    idx = jax.device_put(jnp.maximum(slots, 0), jax.memory.Space.Host)
    return tuple(_gather_host_to_host(t, idx) for t in host_tables)


@functools.partial(jax.jit, donate_argnums=0)
def _host_scatter(host_tables, slots, rows):
    """host_table[slots] = rows for each host table (-1 slots dropped)."""
    return tuple(put_host_rows(t, jnp.where(slots >= 0, slots, t.shape[0]), r) for t, r in zip(host_tables, rows))


@jax.jit
def _gather_rows(arr, slots):
    return arr[jnp.maximum(slots, 0)]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(arr, slots, rows):
    return arr.at[jnp.where(slots >= 0, slots, arr.shape[0])].set(rows, mode="drop")  # -1: padding, dropped


def new_hot_state(leases: int, groups: int, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """HiSparse's device state of `leases` empty hot buffers of `rows` rows (HiSparseView's hot_pos,
    hot_last [L, G, H] and hot_rows [L, H], int32): device memory beside the KV pool, which the memory
    plan (experiments/memory_plan.py) sizes with jax.eval_shape of this function."""
    return (jnp.full((leases, groups, rows), -1, jnp.int32), jnp.full((leases, groups, rows), NEVER_USED, jnp.int32),
            jnp.full((leases, rows), -1, jnp.int32))


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _reset_lease(hot_pos, hot_last, hot_rows, lease, rows_H):
    return (hot_pos.at[lease].set(-1), hot_last.at[lease].set(NEVER_USED), hot_rows.at[lease].set(rows_H))


@dataclasses.dataclass(frozen=True)
class HostKV:
    """A request's KV pages saved by the swap policy (kvcache.policy.SwapPolicy): per group, per layer,
    rows [padded pages x page rows, width] in pinned_host memory; `nbytes`: the bytes of its real pages."""

    arrays: dict[str, tuple[jax.Array, ...]]
    nbytes: int


GROUP_FIELDS = {"mla": "mla", "indexer": "index"}  # cache group -> the PagedKVCache field of its arrays


class HostMemory:
    """The host side of one replica's KV cache, and every copy between it and the device pool.

    cache: the replica's paged cache (kvcache.paged.PagedKVCache, or its rank-local arrays on a mesh),
        for array shapes, dtypes and page sizes. A block id names one page of `page_rows[group]` slots in
        every layer of the group on each of `kv_ranks` DCP ranks; rank r's pages start at r x num_blocks.
    host / device: shardings of host-resident and device-resident copies (memory kinds pinned_host and
        device, laid out like the pool).
    host_blocks: host pools, pages per group ({"mla": N, "indexer": M}: HiSparse's pools or the offload
        host tier's; None: none).
    hot: HiSparse's hot buffers (leases, IndexShare groups, rows per lease), device int32 state.
    tiers: the secondary tiers behind the host pools (kvcache.tiers.TierSet) or None: `TierStore` gathers
        host pages' bytes in the canonical layout (page-major: per page, each array of the group in order,
        its rows in token order: under DCP the ranks' rows are interleaved back, `interleave` tokens per
        rank turn, so any parallel layout reads what another wrote) and hands them to every tier;
        `TierLoad` submits loads, and `poll_tiers` writes what they read into the reserved host pages.
    max_copy_pages: pages per page-copy program; a larger copy runs in several (a bounded set of
        programs, all compiled by `warmup`).
    shared: (mesh axis, its size) the host pools are split over, or None. One pool per replica shared by
        its tensor-parallel ranks (MLA KV and indexer keys are the same on every TP rank): the pool's
        pages are padded to a multiple of the size and each rank holds 1/size of them (pinned_host,
        rows split over the axis after `host`'s own split), so a replica holds one copy, not one per
        rank. Host block b lives on rank b % size (`host_pages`), so consecutive blocks, and a decode
        step's misses, spread over the ranks; the decode step gathers a miss on the rank that holds it
        (`take_shared_rows`). Page copies and tier reads are ordinary sharded programs.

    `apply(ops, cache)` runs a plan's operations in order and returns the new cache with the bytes moved
    each way (real pages only; padding to a program's width moves nothing that is counted)."""

    def __init__(self, cache, *, page_rows: dict[str, int], kv_ranks: int, num_blocks: int, host, device,
                 host_blocks: dict[str, int] | None = None, hot: tuple[int, int, int] | None = None,
                 tiers=None, max_copy_pages: int = 64, interleave: int = 1,
                 shared: tuple[str, int] | None = None):
        self.page_rows = dict(page_rows)
        self.kv_ranks = kv_ranks
        # per group: for each token of a page in order, the index of its row among the page's rank-major
        # rows (rank r's rows r x page_rows ... ; DCP's round robin, `interleave` tokens per rank turn)
        self.token_rows = {g: canonical_rows(kv_ranks, rows, interleave) for g, rows in self.page_rows.items()}
        self.num_blocks = num_blocks
        self._host, self._device = host, device
        self.max_copy_pages = max_copy_pages
        self.page_bytes = {g: sum(a.shape[1] * a.dtype.itemsize for a in self._arrays(cache, g)) * rows * kv_ranks
                           for g, rows in self.page_rows.items()}
        self.row_bytes_mla = cache.mla[0].shape[1] * cache.mla[0].dtype.itemsize
        self.saved: dict[str, HostKV] = {}
        self.host_tables: dict[str, tuple[jax.Array, ...]] = {}
        # a host pool is laid out like the device pool: kv_ranks x n pages, rank r's n pages r-th (its
        # shard); shared by `shared`'s ranks, each DCP rank's n pages split once more over them
        self.host_axis, self.host_shards = shared if shared is not None and shared[1] > 1 else (None, 1)
        pool = host
        if self.host_axis is not None:
            outer = host.spec[0] if len(host.spec) else None
            outer = () if outer is None else (outer,) if isinstance(outer, str) else tuple(outer)
            pool = NamedSharding(host.mesh, P(outer + (self.host_axis,)), memory_kind="pinned_host")
        self.host_blocks = {g: -(-max(n, 1) // self.host_shards) * self.host_shards
                            for g, n in (host_blocks or {}).items()}
        for g, n in self.host_blocks.items():
            self.host_tables[g] = tuple(jax.device_put(jnp.zeros((kv_ranks * n * self.page_rows[g], a.shape[1]), a.dtype),
                                                       pool) for a in self._arrays(cache, g))
        self.hot_state = None
        if hot is not None:
            leases, groups, rows = hot
            # committed to the device from the start, like every later version (a step's outputs): an
            # uncommitted first version would compile the decode step once more
            self.hot_state = tuple(jax.device_put(x, device) for x in new_hot_state(leases, groups, rows))
        self.lru_step = 0  # the resolver's LRU clock, one tick per decode group that resolves
        self.tiers = tiers
        self._tier_loads: dict[int, tuple[str, int]] = {}  # job -> (group, host block) awaiting its bytes

    @staticmethod
    def _arrays(cache, group: str) -> tuple:
        return getattr(cache, GROUP_FIELDS[group])

    def host_pages(self, group: str, blocks) -> np.ndarray:
        """Where host blocks `blocks` of `group` (the policy's ids; -1 padding) sit in its host tables
        (int32, same shape): block b on rank b % S at local page b // S of a pool shared by S ranks
        (`shared`); the identity otherwise."""
        b = np.asarray(blocks, np.int32)
        s = self.host_shards
        if s == 1:
            return b
        return np.where(b >= 0, (b % s) * (self.host_blocks[group] // s) + b // s, -1).astype(np.int32)

    @property
    def host_bytes_per_device(self) -> int:
        """Bytes of the host pools on the fullest device (1/S of one pool when shared by S ranks)."""
        out: dict = {}
        for tables in self.host_tables.values():
            for t in tables:
                for shard in t.addressable_shards:
                    out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
        return max(out.values(), default=0)

    def page_slots(self, group: str, blocks, *, host: bool = False) -> np.ndarray:
        """Slots of the whole pages `blocks` of `group` in the device pool (or, `host`, the group's host
        pool): int32 [len(blocks) x page rows (x DCP ranks)], -1 for block -1 (padding)."""
        b = self.page_rows[group]
        blk = np.asarray(blocks, np.int32).reshape(-1, 1)
        if host:
            blk = self.host_pages(group, blk)
        slots = np.where(blk >= 0, blk * b + np.arange(b, dtype=np.int32), -1).reshape(-1)
        if self.kv_ranks > 1:  # DCP: the page on every rank; rank r's table starts at r x (pool pages) x b
            pages = self.host_blocks[group] if host else self.num_blocks
            ranks = np.arange(self.kv_ranks, dtype=np.int32)[:, None] * (pages * b)
            slots = np.where(slots >= 0, slots[None, :] + ranks, -1).reshape(-1)
        return slots

    # ------------------------------------------------------------------------------------- operations
    def apply(self, ops: tuple[Transfer, ...], cache):
        """Execute `ops` in order -> (new cache, device->host bytes, host->device bytes)."""
        d2h = h2d = 0
        for op in ops:
            if isinstance(op, PageCopy):
                cache, n = self._copy_pages(cache, op)
                d2h, h2d = (d2h + n, h2d) if op.direction == "d2h" else (d2h, h2d + n)
            elif isinstance(op, SaveKV):
                n = self._save(cache, op)
                d2h += n
            elif isinstance(op, LoadKV):
                cache, n = self._load(cache, op)
                h2d += n
            elif isinstance(op, ResetLease):
                self._reset(op)
            elif isinstance(op, TierStore):
                for lo in range(0, len(op.keys), self.max_copy_pages):  # the warmed-up widths
                    self.tiers.store(op.keys[lo: lo + self.max_copy_pages],
                                     self.read_host_pages(op.group, op.host_blocks[lo: lo + self.max_copy_pages]))
            elif isinstance(op, TierLoad):
                for job, key, hb in zip(op.jobs, op.keys, op.host_blocks):
                    self.tiers.load(op.tier, job, (key,), (self.page_bytes[op.group],))
                    self._tier_loads[job] = (op.group, hb)  # once submitted (a failed submit is never polled)
            else:
                raise TypeError(f"not a transfer operation: {op!r}")
        return cache, d2h, h2d

    def _copy_pages(self, cache, op: PageCopy, *, pad_to: int | None = None):
        """Whole pages between the device pool and the group's host pool, every layer of the group; at
        most max_copy_pages per program, each padded to a power of two. -> (cache, bytes)."""
        if op.group not in self.host_tables:
            raise ValueError(f"no host pool for cache group {op.group!r} (neither HiSparse nor the offload tier is on)")
        field = GROUP_FIELDS[op.group]
        for lo in range(0, max(len(op.src), 1 if pad_to else 0), self.max_copy_pages):
            src, dst = op.src[lo:lo + self.max_copy_pages], op.dst[lo:lo + self.max_copy_pages]
            width = pad_to or pow2_at_least(len(src))
            d2h = op.direction == "d2h"
            src_s = jnp.asarray(self.page_slots(op.group, list(src) + [-1] * (width - len(src)), host=not d2h))
            dst_s = jnp.asarray(self.page_slots(op.group, list(dst) + [-1] * (width - len(dst)), host=d2h))
            if op.direction == "d2h":
                self.host_tables[op.group] = _pages_d2h(self.host_tables[op.group], getattr(cache, field), src_s, dst_s)
            else:
                cache = dataclasses.replace(cache, **{field: _pages_h2d(getattr(cache, field),
                                                                        self.host_tables[op.group], src_s, dst_s)})
        return cache, len(op.src) * self.page_bytes[op.group]

    # ------------------------------------------------------------------------------- secondary tiers
    def _host_page_slots(self, group: str, blocks) -> np.ndarray:
        """Host-pool slots of whole pages, page-major (each page's rows on every rank together), padded
        with -1 to a power of two pages."""
        blocks = list(blocks)
        blocks += [-1] * (pow2_at_least(len(blocks)) - len(blocks))
        return np.concatenate([self.page_slots(group, [b], host=True) for b in blocks])

    def read_host_pages(self, group: str, blocks) -> list[np.ndarray]:
        """The bytes of host pages `blocks` of `group` in the canonical layout -> one np.uint8 [page_bytes]
        per page (a snapshot): each array of the group in order, its rows in token order."""
        n, slots = len(blocks), self._host_page_slots(group, blocks)
        per = len(slots) // pow2_at_least(n)
        order = self.token_rows[group]
        out = np.empty((n, self.page_bytes[group]), np.uint8)
        off = 0
        for rows in _host_gather(self.host_tables[group], jnp.asarray(slots)):
            a = np.asarray(rows)[: n * per].reshape(n, per, -1)[:, order].reshape(n, -1).view(np.uint8)
            out[:, off: off + a.shape[1]] = a
            off += a.shape[1]
        assert off == self.page_bytes[group], (off, self.page_bytes[group])
        return list(out)

    def write_host_pages(self, group: str, blocks, payloads) -> None:
        """Host pages `blocks` of `group` = payloads (np.uint8 [page_bytes] each, `read_host_pages`' layout)."""
        n, slots = len(blocks), self._host_page_slots(group, blocks)
        width = pow2_at_least(n)
        per = len(slots) // width
        place = np.argsort(self.token_rows[group])  # rank-major row i holds token place[i]
        data = np.zeros((width, self.page_bytes[group]), np.uint8)
        data[:n] = np.stack(payloads)
        rows, off = [], 0
        for t in self.host_tables[group]:
            per_page = per * t.shape[1] * t.dtype.itemsize
            tokens = data[:, off: off + per_page].copy().view(t.dtype).reshape(width, per, t.shape[1])
            rows.append(tokens[:, place].reshape(-1, t.shape[1]))
            off += per_page
        self.host_tables[group] = _host_scatter(self.host_tables[group], jnp.asarray(slots), tuple(rows))

    def poll_tiers(self, wait_s: float = 0.0) -> tuple[tuple[int, str], ...]:
        """Finished secondary-tier loads: their bytes written into the reserved host pages -> ((job,
        status), ...) with status "ok", "miss" or "corrupt". wait_s: wait up to this long for the first
        one when loads are pending and none has finished (an idle engine waiting for a load)."""
        if self.tiers is None:
            return ()
        results = self.tiers.poll()
        deadline = time.monotonic() + wait_s
        while not results and self._tier_loads and time.monotonic() < deadline:
            time.sleep(0.001)
            results = self.tiers.poll()
        if not results and not self._tier_loads and wait_s:
            time.sleep(min(wait_s, 0.002))  # a request waits on a tier's RETRY (a store in flight): do not spin
        out, ok = [], {}
        for r in results:
            group, hb = self._tier_loads.pop(r.job_id)
            if r.status[0] == "ok":
                ok.setdefault(group, []).append((hb, r.payloads[0]))
            out.append((r.job_id, r.status[0]))
        for group, pages in ok.items():
            for lo in range(0, len(pages), self.max_copy_pages):
                part = pages[lo: lo + self.max_copy_pages]
                self.write_host_pages(group, [hb for hb, _ in part], [p for _, p in part])
        return tuple(out)

    def _padded_slots(self, group: str, blocks) -> jax.Array:
        blocks = list(blocks)
        return jnp.asarray(self.page_slots(group, blocks + [-1] * (pow2_at_least(len(blocks)) - len(blocks))))

    def _save(self, cache, op: SaveKV) -> int:
        """A request's pages to host memory (pages padded to a power of two per group). The only
        device->host path of the swap policy."""
        if op.key in self.saved:
            raise ValueError(f"a host copy named {op.key!r} already exists")
        arrays, nbytes = {}, 0
        for g, blocks in op.blocks:
            slots = self._padded_slots(g, blocks)
            # on a mesh, first lay the rows out like the pool (rank r's pages on rank r; `page_slots` is
            # rank-major): device_put cannot change the layout and the memory kind in one go
            arrays[g] = tuple(jax.device_put(jax.device_put(_gather_rows(a, slots), self._device), self._host)
                              for a in self._arrays(cache, g))
            nbytes += len(blocks) * self.page_bytes[g]
        self.saved[op.key] = HostKV(arrays, nbytes)
        return nbytes

    def _load(self, cache, op: LoadKV):
        """A saved copy back into the blocks `op` names (same page counts) -> (cache, bytes); the copy is
        dropped. The only host->device path of the swap policy."""
        saved = self.saved.pop(op.key)
        fields = {}
        for g, blocks in op.blocks:
            slots = self._padded_slots(g, blocks)
            fields[GROUP_FIELDS[g]] = tuple(_scatter_rows(a, slots, jax.device_put(h, self._device))
                                            for a, h in zip(self._arrays(cache, g), saved.arrays[g]))
        return dataclasses.replace(cache, **fields), saved.nbytes

    def _reset(self, op: ResetLease) -> None:
        if self.hot_state is None:
            raise ValueError("ResetLease without HiSparse hot buffers")
        rows = self.page_slots("mla", op.blocks)[: self.hot_state[2].shape[1]]
        self.hot_state = _reset_lease(*self.hot_state, op.lease, jnp.asarray(rows))

    # ------------------------------------------------------------------------------ HiSparse decode view
    def view(self, host_table_RM: np.ndarray, lease_R: np.ndarray, topk: int) -> HiSparseView:
        """The HiSparse view of one decode group: rows' host pages [R, M] and leases [R] (-1: none). Takes
        the host MLA tables and hot state (the step donates them); `absorb` takes them back."""
        self.lru_step += 1
        return HiSparseView.create(self.host_tables["mla"], self.host_pages("mla", host_table_RM), lease_R,
                                   *self.hot_state, self.lru_step, topk, host_axis=self.host_axis)

    def staging_view(self, host_table_RM: np.ndarray, tile: int) -> StagingView:
        """The staging view of one prefill group: rows' host pages [R, M], `tile` queries per staging tile.
        Takes the host MLA tables (the step donates them); `absorb_staging` takes them back."""
        groups = self.hot_state[0].shape[1] if self.hot_state is not None else 1
        return StagingView.create(self.host_tables["mla"], self.host_pages("mla", host_table_RM), tile, groups,
                                  host_axis=self.host_axis)

    def absorb_staging(self, view: StagingView) -> None:
        self.host_tables["mla"] = view.host_mla

    def absorb(self, view: HiSparseView) -> None:
        """Take back the host tables and hot state a decode step returned in its view."""
        self.host_tables["mla"] = view.host_mla
        self.hot_state = (view.hot_pos, view.hot_last, view.hot_rows)

    # ------------------------------------------------------------------------------------------ warm-up
    def warmup(self, cache, max_blocks_per_seq: dict[str, int]):
        """Compile every copy program a serving run can use, with copies that move nothing (all slots
        -1): page copies of every width up to max_copy_pages per host pool and direction, saves and loads
        of every padded page count up to a request's pages (max_blocks_per_seq per group), the lease
        reset. -> cache (unchanged values)."""
        for g in self.host_tables:
            for width in _widths(min(self.max_copy_pages, pow2_at_least(self.num_blocks))):
                for direction in ("d2h", "h2d"):
                    cache, _ = self._copy_pages(cache, PageCopy(g, direction, (), ()), pad_to=width)
        for g, n in max_blocks_per_seq.items():
            for width in _widths(pow2_at_least(n)):
                slots = jnp.asarray(np.full(width * self.page_rows[g] * self.kv_ranks, -1, np.int32))
                for a in self._arrays(cache, g)[:1]:  # one program per group: its layers share a shape
                    rows = jax.device_put(jax.device_put(_gather_rows(a, slots), self._device), self._host)
                    fields = list(self._arrays(cache, g))
                    fields[0] = _scatter_rows(fields[0], slots, jax.device_put(rows, self._device))
                    cache = dataclasses.replace(cache, **{GROUP_FIELDS[g]: tuple(fields)})
        if self.tiers is not None:  # the tier gathers and scatters, every padded width
            for g in self.host_tables:
                for width in _widths(self.max_copy_pages):
                    slots = jnp.asarray(np.full(width * self.page_rows[g] * self.kv_ranks, -1, np.int32))
                    rows = _host_gather(self.host_tables[g], slots)
                    self.host_tables[g] = _host_scatter(self.host_tables[g], slots,
                                                        tuple(np.asarray(r) for r in rows))
        if self.hot_state is not None:
            empty = np.full(self.hot_state[2].shape[1], -1, np.int32)
            self.hot_state = _reset_lease(*self.hot_state, 0, jnp.asarray(empty))
        return cache


def _widths(largest: int) -> list[int]:
    """Powers of two from 1 to `largest` (a power of two)."""
    return [1 << i for i in range(largest.bit_length())]
