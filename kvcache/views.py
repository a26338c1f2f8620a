"""Cache views: what a HiSparse step carries in the paged cache (kvcache.paged.PagedKVCache's `hisparse`
and `staging` fields) between its layers, as data. `HiSparseView`: a decode step's host pool tables,
hot buffers and the resolver's plan, with the per-layer row copy (`copy_rows`). `StagingView`: a prefill
chunk's host pool and per-tile staging counts; its attention op is attention.staging. Rows cross from
the host only through kvcache.host's `take_shared_rows`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attention.hisparse import NEVER_USED, HotBuffer, resolve
from attention.staging import staged_sparse_mqa
from kvcache import host as host_rows


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
            rows = host_rows.take_shared_rows(host, jnp.maximum(src, 0), self.host_axis)
            return table.at[jnp.where(src >= 0, dst, table.shape[0])].set(rows, mode="drop")  # -1: dropped

        branches = [lambda t: t] + [functools.partial(copy, k) for k in self.copy_sizes]
        table = jax.lax.switch(self.copy_branch, branches, device_table)
        return dataclasses.replace(self, copied=self.copied + jnp.sum(self.plan_src >= 0, axis=1)), table


# ------------------------------------------------------------------------------ HiSparse prefill staging
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
        slots [B, T, K] (-1: not on the device) -> (out [B,T,H,R] f32, view with the counts added). The
        op is attention.staging.staged_sparse_mqa (per tile of `tile` queries, only the distinct host
        rows they select cross, through `take_shared_rows`); `staged` counts the copies."""
        host = self.host_mla[layer_index]
        out, staged, lost = staged_sparse_mqa(
            device_table, self.host_table, lambda idx: host_rows.take_shared_rows(host, idx, self.host_axis),
            slots_BTK, pos_BTK, q_lat_BTHR, q_pe_BTHP, scale, fmt, block_size, tile=self.tile, impl=impl)
        view = dataclasses.replace(self, staged=self.staged.at[:, group].add(staged if full else 0),
                                   copied=self.copied + staged, unserved=self.unserved + lost)
        return out, view

