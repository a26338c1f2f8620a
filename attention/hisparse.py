"""The HiSparse resolver: where each row sparse MLA selects lives, on device, with static shapes.

A request in mixed residency keeps its newest pages on the device and the rest only in the host pool;
rows the indexer selects from host-only pages are served from a per-request **hot buffer** of H device
rows (leased from the same block pool, so one row-id space covers resident and hot data). Per decode
step and per IndexShare group (the full layer resolves, its shared layers replay the plan):

- a selected position whose page is on the device is read in place;
- else, if a hot slot holds it, it is a **hit** and the slot becomes most recently used;
- else it is a **miss**: it takes the least-recently-used hot slot not hit in this step (empty slots
  first, then oldest, ties to the lowest slot) and that one row is copied from the host pool.

Everything is jnp over fixed shapes, so the resolver runs inside the jitted decode step with no host
decision. Because H >= K (top-k) and the K selected positions are distinct, a step's misses always find
free slots, and a miss never evicts a row hit or filled in the same step. BRIEF §6 recommends H = 2K
(with exactly K slots the LRU has no slack and thrashes).

The copy itself (`copy_host_rows`) is the one host->device path of HiSparse: it takes the plan's
(source host row, destination device row) pairs and moves only those rows; `ResolvePlan.copied_rows`
counts them (bytes = rows x row bytes x layers of the group).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

_NEVER = jnp.iinfo(jnp.int32).min  # last_use of an empty slot: older than any step


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pos", "last_use", "rows"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HotBuffer:
    """Hot slots of B requests. pos [B, H] int32: request-relative position a slot holds (-1 empty);
    last_use [B, H] int32: step of its last hit or fill; rows [B, H] int32: the device row (global slot)
    each hot slot occupies, fixed for the lease (-1: slot not leased, never used)."""

    pos: jax.Array
    last_use: jax.Array
    rows: jax.Array

    @staticmethod
    def create(rows_BH) -> HotBuffer:
        rows_BH = jnp.asarray(rows_BH, jnp.int32)
        return HotBuffer(jnp.full(rows_BH.shape, -1, jnp.int32), jnp.full(rows_BH.shape, _NEVER, jnp.int32), rows_BH)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["rows", "copy_src", "copy_dst", "hits", "misses", "resident", "lost"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ResolvePlan:
    """rows [B, K]: the device row sparse MLA reads for each selected position (-1 where the selection
    is -1); copy_src / copy_dst [B, K]: host row -> device row copies to make first (-1 = none);
    hits, misses, resident [B]: per-request counts; lost [B]: selected positions found neither on the
    device nor on the host (a bookkeeping bug upstream; their rows are -1, never a stale row)."""

    rows: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    hits: jax.Array
    misses: jax.Array
    resident: jax.Array
    lost: jax.Array

    @property
    def copied_rows(self) -> jax.Array:
        """Rows this plan copies host->device per layer of its group (int32 scalar)."""
        return jnp.sum(self.copy_src >= 0)


def resolve_reference(sel_BK, device_pages_BM, host_pages_BM, block_size: int, hot: HotBuffer, step):
    """Resolve selected positions against residency and the hot buffer.

    sel_BK int32 [B, K]: selected request-relative positions, distinct per row, -1 = none.
    device_pages_BM int32 [B, M]: device block of each page, -1 where the page is not on the device
        (host-only, or released and since reused by another request: the host side clears it then).
    host_pages_BM int32 [B, M]: host-pool block of each page, -1 where the host has no copy.
    step: int32 scalar, the LRU clock (increasing across calls).
    -> (ResolvePlan, updated HotBuffer).
    """
    b, k = sel_BK.shape
    h = hot.pos.shape[1]
    if h < k:
        raise ValueError(f"the hot buffer needs at least top-k = {k} slots per request, got {h}")
    step = jnp.asarray(step, jnp.int32)

    def one(sel_K, dev_M, host_M, hpos_H, hlast_H, hrows_H):
        valid = sel_K >= 0
        page = jnp.where(valid, sel_K // block_size, 0)
        off = sel_K % block_size
        dev_blk, host_blk = dev_M[page], host_M[page]
        resident = valid & (dev_blk >= 0)
        need = valid & ~resident
        match_KH = (hpos_H[None, :] == sel_K[:, None]) & need[:, None]
        hit = match_KH.any(1)
        miss = need & ~hit
        lost = miss & (host_blk < 0)
        miss = miss & ~lost
        # LRU order over the slots no hit claimed this step; a hit slot sorts last and is never taken
        key_H = jnp.where(match_KH.any(0), jnp.iinfo(jnp.int32).max, hlast_H)
        order_H = jnp.argsort(key_H, stable=True)
        miss_slot = order_H[jnp.clip(jnp.cumsum(miss) - 1, 0, h - 1)]
        slot_K = jnp.where(hit, jnp.argmax(match_KH, 1), jnp.where(miss, miss_slot, -1))
        hot_row = hrows_H[jnp.maximum(slot_K, 0)]
        rows = jnp.where(resident, dev_blk * block_size + off, jnp.where(hit | miss, hot_row, -1))
        src = jnp.where(miss, host_blk * block_size + off, -1)
        dst = jnp.where(miss, hot_row, -1)
        used = jnp.where(hit | miss, slot_K, h)  # h: out of range, dropped
        hpos_H = hpos_H.at[jnp.where(miss, slot_K, h)].set(sel_K, mode="drop")
        hlast_H = hlast_H.at[used].set(step, mode="drop")
        counts = [jnp.sum(x).astype(jnp.int32) for x in (hit, miss, resident, lost)]
        return rows, src, dst, *counts, hpos_H, hlast_H

    rows, src, dst, hits, misses, resident, lost, hpos, hlast = jax.vmap(one)(
        sel_BK, device_pages_BM, host_pages_BM, hot.pos, hot.last_use, hot.rows)
    return ResolvePlan(rows, src, dst, hits, misses, resident, lost), HotBuffer(hpos, hlast, hot.rows)


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
    if src.max() >= host_table.shape[0] or dst.max() >= device_table.shape[0]:
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
                                "plan_rows", "plan_src", "plan_dst", "hits", "misses", "copied"],
                   meta_fields=[])
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
    hits / misses [R, G] int32: per row and group, counted by the full layer's resolve.
    copied [R] int32: host->device rows copied for the row over all layers (checked against
        sum over groups of misses x layers in the group).
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
    hits: jax.Array
    misses: jax.Array
    copied: jax.Array

    @staticmethod
    def create(host_mla, host_table, lease, hot_pos, hot_last, hot_rows, step, topk: int) -> HiSparseView:
        r = host_table.shape[0]
        g = hot_pos.shape[1]
        # distinct buffers: the step donates the whole view, and one buffer may not be donated twice
        none = [jnp.full((r, topk), -1, jnp.int32) for _ in range(3)]
        return HiSparseView(tuple(host_mla), jnp.asarray(host_table, jnp.int32), jnp.asarray(lease, jnp.int32),
                            hot_pos, hot_last, hot_rows, jnp.asarray(step, jnp.int32), *none,
                            jnp.zeros((r, g), jnp.int32), jnp.zeros((r, g), jnp.int32), jnp.zeros((r,), jnp.int32))

    def resolve(self, group: int, sel_RK, device_table_RM, block_size: int) -> HiSparseView:
        """The full layer of `group`: resolve its selection [R, K] against residency and the leases' hot
        buffers; keep the plan for the group's shared layers."""
        n_lease = self.hot_pos.shape[0]
        has = self.lease >= 0
        lease = jnp.maximum(self.lease, 0)
        hot = HotBuffer(jnp.where(has[:, None], self.hot_pos[lease, group], -1),
                        jnp.where(has[:, None], self.hot_last[lease, group], _NEVER),
                        jnp.where(has[:, None], self.hot_rows[lease], -1))
        plan, hot = resolve_reference(sel_RK, device_table_RM, self.host_table, block_size, hot, self.step)
        # a row without a lease must never need one: its misses would have no slot to land in
        rows = jnp.where(has[:, None] | (plan.copy_src < 0), plan.rows, -1)
        back = jnp.where(has, lease, n_lease)  # rows without a lease write nothing back
        return dataclasses.replace(
            self,
            hot_pos=self.hot_pos.at[back, group].set(hot.pos, mode="drop"),
            hot_last=self.hot_last.at[back, group].set(hot.last_use, mode="drop"),
            plan_rows=rows, plan_src=jnp.where(has[:, None], plan.copy_src, -1),
            plan_dst=jnp.where(has[:, None], plan.copy_dst, -1),
            hits=self.hits.at[:, group].set(plan.hits), misses=self.misses.at[:, group].set(plan.misses))

    def copy_rows(self, layer_index: int, device_table):
        """Apply the current plan's host->device copies to one layer's table (the one host->device path
        of the decode step). -> (view with `copied` counted, new device table)."""
        src, dst = self.plan_src.reshape(-1), self.plan_dst.reshape(-1)
        host = self.host_mla[layer_index]
        rows = take_host_rows(host, jnp.maximum(src, 0))
        dst = jnp.where(src >= 0, dst, device_table.shape[0])  # no copy: dropped
        table = device_table.at[dst].set(rows, mode="drop")
        return dataclasses.replace(self, copied=self.copied + jnp.sum(self.plan_src >= 0, axis=1)), table


@jax.jit
def _take_host_rows(host_table, idx):
    return take_host_rows(host_table, idx)


def take_host_rows(host_table, idx):
    """Rows `idx` (device int32 [N], in range) of a pinned_host table, gathered on the host and
    delivered to device memory; usable inside jit. Only these N rows cross (the GPU check confirms)."""
    return _gather_on_host(host_table, jax.device_put(idx, jax.memory.Space.Host))


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
