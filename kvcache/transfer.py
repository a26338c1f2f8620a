"""KV transfer operations: what a step plan asks its runner to move between the device pool and host
memory, and the counters of what moved.

KV policies (kvcache.policies) decide on the block pool and emit these operations; a
runner (glm53.engine) executes them. They are plain values: a runner that holds no arrays (a simulator,
a test) can execute them too, and the bytes an operation moves follow from the page sizes alone
(`bytes_moved`, with kvcache.layout.page_bytes).

Ordering contract: a runner executes a plan's operations in order, before the step's forward. So an
operation sees every KV write of earlier steps and every earlier operation of its plan; a block that
one decision frees and the next hands out is copied out before anything overwrites it.

Block ids: "device" blocks are ids of the device pool (kvcache.block_pool); "host" blocks are ids of the
cache group's host pool (HiSparse's MLA pool, the idle indexer-key pool). A page is one block of one
cache group in every layer of that group (on every DCP rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

DIRECTIONS = ("d2h", "h2d")


def _blocks(name: str, blocks) -> tuple[int, ...]:
    out = tuple(int(b) for b in blocks)
    if any(b < 0 for b in out):
        raise ValueError(f"{name}: block ids must be >= 0, got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """Whole pages of cache group `group` (every layer): "d2h" copies device block src[i] to host block
    dst[i]; "h2d" copies host block src[i] to device block dst[i]."""

    group: str  # "mla" | "indexer"
    direction: str  # "d2h" | "h2d"
    src: tuple[int, ...]
    dst: tuple[int, ...]

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"PageCopy.direction must be one of {DIRECTIONS}, got {self.direction!r}")
        object.__setattr__(self, "src", _blocks("PageCopy.src", self.src))
        object.__setattr__(self, "dst", _blocks("PageCopy.dst", self.dst))
        if len(self.src) != len(self.dst):
            raise ValueError(f"PageCopy: {len(self.src)} source blocks but {len(self.dst)} destinations")


def _group_blocks(name: str, blocks) -> tuple[tuple[str, tuple[int, ...]], ...]:
    items = blocks.items() if isinstance(blocks, Mapping) else blocks
    return tuple((str(g), _blocks(name, b)) for g, b in items)


@dataclasses.dataclass(frozen=True)
class SaveKV:
    """The offload policy's swap-out: copy a request's pages (per group, device blocks in position order)
    to a new host copy named `key`. The key must not name a live copy."""

    key: str
    blocks: tuple[tuple[str, tuple[int, ...]], ...]  # ((group, device blocks), ...)

    def __post_init__(self):
        object.__setattr__(self, "blocks", _group_blocks("SaveKV.blocks", self.blocks))


@dataclasses.dataclass(frozen=True)
class LoadKV:
    """The swap-in: copy host copy `key` back into these device blocks (the same count per group as it
    was saved from) and drop the copy."""

    key: str
    blocks: tuple[tuple[str, tuple[int, ...]], ...]

    def __post_init__(self):
        object.__setattr__(self, "blocks", _group_blocks("LoadKV.blocks", self.blocks))


@dataclasses.dataclass(frozen=True)
class ResetLease:
    """HiSparse: hot-buffer slot `lease` now keeps its rows in these device blocks (leased from the pool);
    every IndexShare group's hot state of that slot starts empty. Moves no KV."""

    lease: int
    blocks: tuple[int, ...]

    def __post_init__(self):
        if self.lease < 0:
            raise ValueError(f"ResetLease.lease must be >= 0, got {self.lease}")
        object.__setattr__(self, "blocks", _blocks("ResetLease.blocks", self.blocks))


@dataclasses.dataclass(frozen=True)
class TierStore:
    """Pass host pages (host blocks of `group`, just written by an earlier operation of the plan) on to
    every secondary tier (kvcache.tiers) under `keys`: the runner snapshots their bytes when it executes
    this and the tiers write them asynchronously. Moves nothing over the device link."""

    group: str
    host_blocks: tuple[int, ...]
    keys: tuple[bytes, ...]

    def __post_init__(self):
        object.__setattr__(self, "host_blocks", _blocks("TierStore.host_blocks", self.host_blocks))
        if len(self.keys) != len(self.host_blocks):
            raise ValueError(f"TierStore: {len(self.host_blocks)} host blocks but {len(self.keys)} keys")


@dataclasses.dataclass(frozen=True)
class TierLoad:
    """Start loading chunks `keys` from secondary tier number `tier` into host blocks of `group` (reserved
    by the policy; nothing reads them until the load is reported). Asynchronous: the runner reports each
    job's outcome (jobs[i] for keys[i]) in the StepResult of a later step (`tier_loads`)."""

    tier: int
    group: str
    keys: tuple[bytes, ...]
    host_blocks: tuple[int, ...]
    jobs: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "host_blocks", _blocks("TierLoad.host_blocks", self.host_blocks))
        if not len(self.keys) == len(self.host_blocks) == len(self.jobs):
            raise ValueError(f"TierLoad: {len(self.keys)} keys, {len(self.host_blocks)} host blocks and "
                             f"{len(self.jobs)} jobs")


Transfer = PageCopy | SaveKV | LoadKV | ResetLease | TierStore | TierLoad


def bytes_moved(op: Transfer, page_bytes: Mapping[str, int]) -> tuple[int, int]:
    """(device->host, host->device) bytes `op` moves, from the bytes of one page per cache group."""
    if isinstance(op, PageCopy):
        n = len(op.src) * page_bytes[op.group]
        return (n, 0) if op.direction == "d2h" else (0, n)
    if isinstance(op, (SaveKV, LoadKV)):
        n = sum(len(b) * page_bytes[g] for g, b in op.blocks)
        return (n, 0) if isinstance(op, SaveKV) else (0, n)
    if isinstance(op, (ResetLease, TierStore, TierLoad)):  # host <-> storage: not the device link
        return 0, 0
    raise TypeError(f"not a transfer operation: {op!r}")


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
