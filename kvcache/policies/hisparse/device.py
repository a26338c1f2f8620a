"""HiSparse's device half (kvcache.policies.device's interface), the one owner of its device state: the
hot buffers (`hot_state`, made by `new_hot_state`, pointed at a request's blocks by `ResetLease`) and
the resolver's LRU clock. A decode group whose rows hold a hot buffer resolves its sparse reads through
a `kvcache.views.HiSparseView` (the resolver, the hot buffers, the per-layer row copies); a prefill group
over host-only pages stages the rows its queries select through a `kvcache.views.StagingView`. The views
borrow the host memory's MLA pools and this half's hot state for one forward (the step donates them) and
give them back in `detach`; their counts become the step's ResolveRecords and StageRecords, checked: a
selected row with nowhere to read it from raises. The planner sums them (spec.py's `ResolveStats`).

Under DP x EP (`bind(ranks=N)`) one half serves N ranks that each have their own planner: N x max_leases
hot buffers split over "dp" (rank r's lease l is buffer r x max_leases + l, its rows local slots of its
own pool slice), one LRU clock per rank, and a group's rows rank-major (`group_views` gets None for a
padding row). A rank resolves (ticks its clock) or stages only where one device serving its rows alone
would, and only such a rank gets records (`take_rank_records`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention.hisparse import NEVER_USED
from kvcache.transfer import ResetLease
from kvcache.views import HiSparseView, StagingView


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
class ResolveRecord:
    """What one HiSparse decode forward's resolvers did: per row of `req_ids`, hits and misses [n, G]
    (G IndexShare groups) and rows copied host->device over all layers [n]."""

    req_ids: tuple[str, ...]
    hits: np.ndarray
    misses: np.ndarray
    copied: np.ndarray


@dataclasses.dataclass(frozen=True)
class StageRecord:
    """What one HiSparse prefill forward's row staging did (kvcache.views.StagingView): per row of
    `req_ids`, rows staged [n, G] (per IndexShare group, distinct host rows per tile of queries summed
    over tiles) and rows copied host->device over all layers [n]."""

    req_ids: tuple[str, ...]
    staged: np.ndarray
    copied: np.ndarray


class HiSparseDevice:
    """HiSparse at execute time. `max_leases` hot buffers of `hot_rows` rows each (per IndexShare group);
    decode plans of `index_topk` rows per query (under MTP, `k` > 0: queries x min(top-k, window), the
    union of a batched verify's positions); prefill staging when `stage_rows`, `tile` queries per
    staging tile."""

    has_views = True  # `kvcache.policies.device.DeviceHalf.has_views`

    def __init__(self, *, max_leases: int, hot_rows: int, index_topk: int, k: int, stage_rows: bool, tile: int):
        self.max_leases, self.hot_rows, self.topk, self.k = max_leases, hot_rows, index_topk, k
        self.stage_rows, self.tile = stage_rows, tile
        self.views: list = []
        self._made: list = []  # per view made, in order (as `views`): per rank, whether it resolves or stages
        self.hot_state = None  # (hot_pos, hot_last, hot_rows), made by `bind`
        self.ranks = 1
        self.lru_step = np.zeros(1, np.int64)  # per rank, the resolver's LRU clock: a tick per group it resolves

    def bind(self, host, table, *, index_groups: int, ranks: int = 1) -> None:
        """Also makes the hot buffers, `index_groups` IndexShare groups each, on the host memory's device
        sharding: committed there from the start like every later version (a step's outputs), since an
        uncommitted first version would compile the decode step once more. `ranks` > 1 (DP x EP): each
        rank's max_leases buffers, rank-major, split over the ranks like the pool."""
        self.host, self.table, self.groups, self.ranks = host, table, index_groups, ranks
        self.lru_step = np.zeros(ranks, np.int64)
        self.hot_state = tuple(jax.device_put(x, host.device_sharding)
                               for x in new_hot_state(self.max_leases * ranks, index_groups, self.hot_rows))

    def transfer(self, op, rank: int = 0) -> None:
        """`ResetLease` of rank `rank`'s planner: its hot buffer `op.lease` emptied and pointed at the MLA slots
        of `op.blocks` (its first `hot_rows`; block ids and slots local to the rank's pool slice, as the
        forward reads them inside the ranks' shard_map)."""
        if not isinstance(op, ResetLease):
            raise TypeError(f"not a transfer operation HiSparse's device half runs: {op!r}")
        rows = self.host.page_slots("mla", op.blocks)[: self.hot_rows]
        self.hot_state = _reset_lease(*self.hot_state, rank * self.max_leases + op.lease, jnp.asarray(rows))

    def verify_form(self, spec, platform: str) -> str:
        """Batched verify resolves one plan for the union of the 1 + k positions' selections, so the hot
        buffer must hold it; else "auto" resolves one position at a time."""
        return spec.verify_form(platform, rows_limit=self.hot_rows, index_topk=self.topk)

    def group_views(self, rows, *, decode: bool, tables_mla, padded: int):
        """A decode group resolves only when some row holds a hot buffer (without one every selected page
        is on the device and the plain step reads it); a prefill group stages only when some row has
        host-only pages (-1 in its MLA table). Under DP x EP `rows` and `tables_mla` are the `padded` rows
        of every rank, rank-major (None / () for a padding row): the group gets views when some rank
        would on its own, and the ranks that would not run them as padding would (no tick, no record)."""
        if rows is None:
            return None
        per = padded // self.ranks
        active = []
        for r in range(self.ranks):
            mine, tables = rows[r * per: (r + 1) * per], tables_mla[r * per: (r + 1) * per]
            if decode:
                active.append(any(h is not None and h.lease >= 0 for h in mine))
            else:
                active.append(self.stage_rows and any(-1 in t for t in tables))
        if not any(active):
            return None
        return self._views(rows, padded, decode, np.array(active))

    def empty_views(self, padded: int, *, decode: bool):
        if not decode and not self.stage_rows:
            return None
        return self._views([], padded, decode, np.zeros(self.ranks, bool))

    def _views(self, rows, r: int, decode: bool, active):
        """views(window, queries) of a group of `r` padded rows (`rows`: the policy rows of the first ones,
        None for padding rows); `active`: per rank, whether it resolves or stages (its clock ticks, its
        counts become records)."""
        host_blocks = [() if h is None else h.host_blocks for h in rows]

        def view(window: int, queries: int = 1):
            host = self.host
            pages = host.host_pages("mla", self.table("mla", r, host_blocks, window))
            if not decode:  # each forward stages the host rows its queries select, `tile` queries at a time
                v = StagingView.create(host.host_tables["mla"], pages, self.tile, self.groups,
                                       host_axis=host.host_axis)
            else:
                lease = np.full(r, -1, np.int32)
                lease[: len(rows)] = [-1 if h is None else h.lease for h in rows]
                topk = queries * min(self.topk, window) if self.k else self.topk
                self.lru_step += active
                # one device: the scalar clock; ranks: one per rank, split with the rows (parallel.model)
                step = self.lru_step[0] if self.ranks == 1 else self.lru_step.astype(np.int32)
                v = HiSparseView.create(host.host_tables["mla"], pages, lease, *self.hot_state, step, topk,
                                        host_axis=host.host_axis)
            self._made.append(active)
            return v

        return view

    def attach(self, cache, view):
        if view is None:
            return cache
        if isinstance(view, StagingView):
            return dataclasses.replace(cache, staging=view)
        return dataclasses.replace(cache, hisparse=view)

    def detach(self, cache):
        """The host tables go back to the host memory, the hot state to this half, the view to the group's
        records."""
        if cache.staging is not None:
            self.host.host_tables["mla"] = cache.staging.host_mla
            self.views.append(cache.staging)
            return dataclasses.replace(cache, staging=None)
        if cache.hisparse is None:
            return cache
        view = cache.hisparse
        self.host.host_tables["mla"] = view.host_mla
        self.hot_state = (view.hot_pos, view.hot_last, view.hot_rows)
        self.views.append(view)
        return dataclasses.replace(cache, hisparse=None)

    def take_records(self, req_ids: tuple[str, ...]):
        return self.take_rank_records([(req_ids, 0)])[0]

    def take_rank_records(self, parts):
        """`take_records` per rank of the group's views: `parts` [(req_ids, first row)], one per rank in
        rank order (the rank's rows are the len(req_ids) from its first row of the padded batch) -> per
        rank (resolves, stages, host->device bytes), only of the views in which that rank was active."""
        out = []
        for rank, (req_ids, at) in enumerate(parts):
            resolves, stages, nbytes = [], [], 0
            rows = slice(at, at + len(req_ids))
            for view, active in zip(self.views, self._made):
                if not active[rank]:
                    continue
                if isinstance(view, StagingView):
                    staged, copied, unserved = (np.asarray(x)[rows] for x in (view.staged, view.copied, view.unserved))
                    if unserved.any():  # never read fewer rows than selected without saying so
                        bad = {r: int(u) for r, u in zip(req_ids, unserved) if u}
                        raise RuntimeError(f"HiSparse: prefill rows selected positions with no device page or "
                                           f"host copy: {bad}")
                    stages.append(StageRecord(req_ids, staged, copied))
                else:
                    hits, misses, copied, unserved = (np.asarray(x)[rows] for x in (view.hits, view.misses,
                                                                                     view.copied, view.unserved))
                    if unserved.any():
                        bad = {r: int(u) for r, u in zip(req_ids, unserved) if u}
                        raise RuntimeError(f"HiSparse: selected rows with no device page, host copy or hot slot: "
                                           f"{bad}")
                    resolves.append(ResolveRecord(req_ids, hits, misses, copied))
                nbytes += int(copied.sum()) * self.host.row_bytes_mla
            out.append((tuple(resolves), tuple(stages), nbytes))
        self.views = []
        self._made = []
        return out

    def warmup_blocks(self) -> dict[str, int]:
        return {}

    def warmup(self) -> None:
        """Compiles the lease reset: slot 0 reset to no rows, the state it starts in."""
        empty = np.full(self.hot_rows, -1, np.int32)
        self.hot_state = _reset_lease(*self.hot_state, 0, jnp.asarray(empty))

    def end_warmup(self) -> None:
        self.views = []
        self._made = []
        self.lru_step[:] = 0
