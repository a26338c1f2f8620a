"""Host pools and page copies: host pools in `pinned_host` memory, the row and page copies between them
and the device pool, and the counts of what moved. The one room where KV crosses the link (the views a
step carries are kvcache.views; the tiers' byte layout is kvcache.tier_io).

- `take_host_rows` / `put_host_rows`: rows of a pinned_host table to device memory and back, usable
  inside jit (the gather / scatter runs on the host, so only the selected rows cross).
- `copy_host_rows`: a resolver plan's (host row -> device row) copies, outside jit (tests, checks).
- `HostMemory`: one replica's host side: executes a plan's transfer operations (kvcache.transfer) in
  order against the device cache and counts the bytes each moves. An operation on a policy's own device
  state (HiSparse's `ResetLease`) goes, in its place in that order, to the policy's device half
  (kvcache.policies.device), which owns that state.

On CPU both memory kinds are the same RAM: everything here runs, and its bytes are counted exactly,
but their time is modelled (kvcache.transfer.TransferStats); that only the counted bytes cross a PCIe
link is for the GPU device check (experiments/check_hisparse_copy.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention.common import pow2_at_least
from kvcache.relayout import canonical_rows
from kvcache.tier_io import TierIO, _host_gather, _host_scatter, put_host_rows
from kvcache.transfer import LoadKV, PageCopy, SaveKV, TierLoad, TierStore, Transfer


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


@jax.jit
def _gather_rows(arr, slots):
    return arr[jnp.maximum(slots, 0)]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(arr, slots, rows):
    return arr.at[jnp.where(slots >= 0, slots, arr.shape[0])].set(rows, mode="drop")  # -1: padding, dropped


@dataclasses.dataclass(frozen=True)
class HostKV:
    """A request's KV pages saved by the swap policy (kvcache.policies.swap.SwapPolicy): per group, per layer,
    rows [padded pages x page rows, width] in pinned_host memory; `nbytes`: the bytes of its real pages."""

    arrays: dict[str, tuple[jax.Array, ...]]
    nbytes: int


GROUP_FIELDS = {"mla": "mla", "indexer": "index"}  # cache group -> the PagedKVCache field of its arrays


class HostMemory(TierIO):
    """The host side of one replica's KV cache, and every copy between it and the device pool.

    cache: the replica's paged cache (kvcache.paged.PagedKVCache, or its rank-local arrays on a mesh),
        for array shapes, dtypes and page sizes. A block id names one page of `page_rows[group]` slots in
        every layer of the group on each of `kv_ranks` DCP ranks; rank r's pages start at r x num_blocks.
    host / device: shardings of host-resident and device-resident copies (memory kinds pinned_host and
        device, laid out like the pool).
    host_blocks: host pools, pages per group ({"mla": N, "indexer": M}: HiSparse's pools or the offload
        host tier's; None: none).
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

    `apply(ops, cache, others=)` runs a plan's operations in order and returns the new cache with the bytes
    moved each way (real pages only; padding to a program's width moves nothing that is counted)."""

    def __init__(self, cache, *, page_rows: dict[str, int], kv_ranks: int, num_blocks: int, host, device,
                 host_blocks: dict[str, int] | None = None, tiers=None, max_copy_pages: int = 64, interleave: int = 1,
                 shared: tuple[str, int] | None = None):
        self.page_rows = dict(page_rows)
        self.kv_ranks = kv_ranks
        # per group: for each token of a page in order, the index of its row among the page's rank-major
        # rows (rank r's rows r x page_rows ... ; DCP's round robin, `interleave` tokens per rank turn)
        self.token_rows = {g: canonical_rows(kv_ranks, rows, interleave) for g, rows in self.page_rows.items()}
        self.num_blocks = num_blocks
        self.host_sharding, self.device_sharding = host, device
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
    def apply(self, ops: tuple[Transfer, ...], cache, others=None):
        """Execute `ops` in order -> (new cache, device->host bytes, host->device bytes). `others(op)` runs
        each operation on state this host side does not hold (the policy's device half: `ResetLease`), at
        its place in the order; None: such an operation is an error."""
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
            elif isinstance(op, TierStore):
                for lo in range(0, len(op.keys), self.max_copy_pages):  # the warmed-up widths
                    self.tiers.store(op.keys[lo: lo + self.max_copy_pages],
                                     self.read_host_pages(op.group, op.host_blocks[lo: lo + self.max_copy_pages]))
            elif isinstance(op, TierLoad):
                for job, key, hb in zip(op.jobs, op.keys, op.host_blocks):
                    self.tiers.load(op.tier, job, (key,), (self.page_bytes[op.group],))
                    self._tier_loads[job] = (op.group, hb)  # once submitted (a failed submit is never polled)
            elif others is not None:
                others(op)
            else:
                raise TypeError(f"not a transfer operation the host side runs: {op!r}")
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
            arrays[g] = tuple(jax.device_put(jax.device_put(_gather_rows(a, slots), self.device_sharding),
                                             self.host_sharding) for a in self._arrays(cache, g))
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
            fields[GROUP_FIELDS[g]] = tuple(_scatter_rows(a, slots, jax.device_put(h, self.device_sharding))
                                            for a, h in zip(self._arrays(cache, g), saved.arrays[g]))
        return dataclasses.replace(cache, **fields), saved.nbytes

    # ------------------------------------------------------------------------------------------ warm-up
    def warmup(self, cache, max_blocks_per_seq: dict[str, int]):
        """Compile every copy program a serving run can use, with copies that move nothing (all slots
        -1): page copies of every width up to max_copy_pages per host pool and direction, saves and loads
        of every padded page count up to a request's pages (max_blocks_per_seq per group), the tiers'
        gathers and scatters. -> cache (unchanged values)."""
        for g in self.host_tables:
            for width in _widths(min(self.max_copy_pages, pow2_at_least(self.num_blocks))):
                for direction in ("d2h", "h2d"):
                    cache, _ = self._copy_pages(cache, PageCopy(g, direction, (), ()), pad_to=width)
        for g, n in max_blocks_per_seq.items():
            for width in _widths(pow2_at_least(n)):
                slots = jnp.asarray(np.full(width * self.page_rows[g] * self.kv_ranks, -1, np.int32))
                for a in self._arrays(cache, g)[:1]:  # one program per group: its layers share a shape
                    rows = _gather_rows(a, slots)
                    rows = jax.device_put(jax.device_put(rows, self.device_sharding), self.host_sharding)
                    fields = list(self._arrays(cache, g))
                    fields[0] = _scatter_rows(fields[0], slots, jax.device_put(rows, self.device_sharding))
                    cache = dataclasses.replace(cache, **{GROUP_FIELDS[g]: tuple(fields)})
        if self.tiers is not None:  # the tier gathers and scatters, every padded width
            for g in self.host_tables:
                for width in _widths(self.max_copy_pages):
                    slots = jnp.asarray(np.full(width * self.page_rows[g] * self.kv_ranks, -1, np.int32))
                    rows = _host_gather(self.host_tables[g], slots)
                    self.host_tables[g] = _host_scatter(self.host_tables[g], slots,
                                                        tuple(np.asarray(r) for r in rows))
        return cache


def _widths(largest: int) -> list[int]:
    """Powers of two from 1 to `largest` (a power of two)."""
    return [1 << i for i in range(largest.bit_length())]
