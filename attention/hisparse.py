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
    host_idx = jax.device_put(src.astype(np.int32), host_table.sharding)
    rows = _take_host_rows(host_table, host_idx)
    return _put_rows(device_table, jnp.asarray(dst), rows), int(src.size)


@jax.jit
@functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Device)
def _take_host_rows(table, idx):
    """Rows `idx` of a pinned_host table, gathered on the host, delivered to device memory."""
    return table.at[idx].get(mode="promise_in_bounds")


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(table, idx, rows):
    return table.at[idx].set(rows)
