"""One pool of KV blocks shared by every cache group, with reference counts and prefix caching.

Terms
- A *block* is one page of `block_size` slots in the device arrays of one cache group (kvcache.paged).
  Under DCP with N ranks a block id names one page on each rank, so it covers `block_size * N` tokens
  of a request (`tokens_per_block`).
- *Cache groups*: the MLA rows of every attention layer form one group, the indexer keys of the full
  layers another. A request holds one block table per group, all drawn from this one pool, so a later
  policy can treat the groups differently (HiSparse offloads MLA blocks, never indexer keys).
- *Prefix caching*: a full block is identified by a chained hash: hash(parent block's hash, the block's
  token ids, extra keys such as a per-user salt). Equal hashes mean equal prefixes, so a new request
  whose leading blocks' hashes are cached reuses those blocks instead of recomputing them. Hashes are
  SHA-256 over a fixed byte encoding: stable across processes and runs (Python's hash() is not).

Pool invariants (checked by `BlockPool.check`, exercised by hypothesis tests):
- every block is either referenced (ref_count > 0) or in the free queue, never both, never neither;
- a free block may keep its hash (it is "cached"): a later lookup revives it; allocation takes free
  blocks least-recently-freed first and drops the hash of a block it hands out, so a cached block is
  never handed out while anyone references it, and never served from the cache after reuse;
- freeing a block more often than it was referenced raises (no double free).

KV events (kvcache.events): a pool given an event sink (`attach_events`) reports every hash it registers
(`cache`) and every hash it drops (reuse of a cached block in `allocate`, `reset_prefix_cache`) under its
medium ("GPU" for the device pool, "CPU" for a host pool). Registering needs what the event carries
beyond the hash (`BlockInfo`: parent hash, the page's tokens, extra keys), which only the caller knows,
so callers build it only when `pool.events` is set: with events off the pool and its callers do nothing
more than test that attribute.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

BlockHash = bytes
_EMPTY = b""
_IS_BLOCK = functools.partial(operator.is_not, None)  # a hash index lookup that found a block
_IS_BLOCK_ID = functools.partial(operator.le, 0)  # a block table entry naming a block (-1: none)
_ENTRY = {None: -1}.get  # (block or None, the same) -> the block, or -1 for None


def table_entries(blocks: Sequence[int | None]) -> map:
    """Block table entries for looked-up blocks (`BlockPool.lookup`'s answers): each block, -1 for None."""
    return map(_ENTRY, blocks, blocks)


def found(blocks: Sequence[int | None]) -> list[int]:
    """The blocks among lookup answers (the None dropped), in order."""
    return list(filter(_IS_BLOCK, blocks))


class BlockInfo(NamedTuple):
    """What a KV event says about a page beyond its hash (kvcache.events.BlockStored): the hash of the
    chunk before its first token (None for a request's first page), its token ids, and the extra keys
    its hash covers (the salt)."""

    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    extra_keys: tuple


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()) -> BlockHash:
    """Chained hash of one full block: SHA-256 over (parent hash, token ids as little-endian int64, extra
    keys). A list and an array of the same ids hash alike."""
    h = hashlib.sha256()
    h.update(parent or _EMPTY)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    for key in extra_keys:
        data = str(key).encode()
        h.update(struct.pack("<q", len(data)) + data)
    return h.digest()


_TAIL = b"glm53 partial page\0"  # no full block's hashed bytes begin so (token ids < 2^63 leave bytes 7 zero)


def tail_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()) -> BlockHash:
    """Hash of a page's leading `token_ids` where the page is not full (a P/D producer's last, partial page:
    kvcache.tiers.tail_chunk): SHA-256 over a marker, the parent hash (the chain at the page's first
    token, or none), the token count and ids (little-endian int64) and the extra keys. The marker keeps it
    from ever equalling a full block's `hash_block`; the count, from equalling another length's."""
    h = hashlib.sha256(_TAIL)
    h.update(parent or bytes(32))
    ids = np.asarray(token_ids, dtype="<i8")
    h.update(struct.pack("<q", ids.size) + ids.tobytes())
    for key in extra_keys:
        data = str(key).encode()
        h.update(struct.pack("<q", len(data)) + data)
    return h.digest()


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, extra_keys: Sequence[str | int] = (), *,
                 known: Sequence[BlockHash] = (), upto: int | None = None) -> list[BlockHash]:
    """Hashes of every full block of a token sequence (a trailing partial block has none), or of its
    first `upto` tokens. `known`: the hashes of its first blocks, computed before (the chain is extended
    from them, not rehashed; only the new blocks' tokens are sliced). Blocks whose hashes a recent call
    computed for the same leading tokens and extra keys are taken from `_CHAINS` (the same bytes: each
    is a hash of the parent's hash and the block's tokens, and both are equal)."""
    out, parent = list(known), (known[-1] if known else None)
    end = len(token_ids) if upto is None else min(upto, len(token_ids))
    first = len(known) * tokens_per_block
    n = (end - first) // tokens_per_block if end > first else 0
    if n <= 0:
        return out
    # hash_block's bytes, built once for all the new blocks (a serving run hashes millions of blocks:
    # one slice of the ids and one encoding instead of one per block)
    ids = np.ascontiguousarray(token_ids[first : first + n * tokens_per_block], dtype="<i8")
    data = memoryview(ids).cast("B")  # no copy: sha256 reads the array's buffer
    extra = b"".join(struct.pack("<q", len(k)) + k for k in (str(key).encode() for key in extra_keys))
    step = 8 * tokens_per_block
    sha256 = hashlib.sha256
    done = 0  # new blocks hashed (or taken from a recent chain)
    if not out:  # the first block's hash names the chain in `_CHAINS`
        h = sha256(_EMPTY)
        h.update(data[:step])
        h.update(extra)
        parent = h.digest()
        out.append(parent)
        done = 1
    key = (tokens_per_block, extra, out[0])
    chains = _CHAINS.get(key, ())
    have = len(out)  # blocks of the chain known here
    best, same = None, 0
    for chain in chains:  # the recent chain that shares the most blocks with this one past `have`
        if len(chain[1]) > have and chain[1][have - 1] == out[-1]:
            span = min(len(chain[1]), len(known) + n) * tokens_per_block
            mine, theirs = ids[have * tokens_per_block - first : span - first], chain[0][have * tokens_per_block : span]
            diff = np.flatnonzero(mine != theirs)
            k = (int(diff[0]) if diff.size else mine.size) // tokens_per_block
            if best is None or k > same:
                best, same = chain, k
    if same:
        out += best[1][have : have + same]
        done += same
        parent = out[-1]
    for i in range(done * step, n * step, step):
        h = sha256(parent or _EMPTY)
        h.update(data[i : i + step])
        h.update(extra)
        parent = h.digest()
        out.append(parent)
    if not known:  # an extension (`known`: a request's next blocks) is not kept: it would copy its context
        # `ids` are then exactly the chain's tokens; kept as they are where they are a converted copy
        # (not a view of the caller's array, which the caller may change)
        _remember(key, token_ids, out, best if best is not None and have + same == len(best[1]) else None,
                  ids if ids.base is None else None)
    return out


# recent chains: (tokens_per_block, extra keys' bytes, first block's hash) -> up to _CHAINS_PER_KEY chains
# (int64 tokens of its full blocks, their hashes), keys least recently used first. Why: a serving run
# hashes a request's prompt once per engine that admits it (a P/D pair: three times) and again at the
# session's next turn, which extends it; a user's sessions and subagents share leading blocks.
_CHAINS: OrderedDict[tuple, list[tuple[np.ndarray, list[BlockHash]]]] = OrderedDict()
_CHAINS_PER_KEY = 8
_CHAINS_LOCK = threading.Lock()
_CHAINS_MAX_TOKENS = 1 << 23  # 64 MiB of int64 tokens over all chains
_chains_tokens = 0


def _remember(key: tuple, token_ids: Sequence[int], hashes: list[BlockHash], prefix,
              tokens: np.ndarray | None = None) -> None:
    """Keep `hashes` (of token_ids' leading full blocks) among the chains under `key`, in place of
    `prefix` (a chain there that they extend or equal); a chain there that already holds them all is
    only marked recently used. tokens: those blocks' tokens as an int64 array no one else changes (kept
    as they are), else copied from token_ids."""
    global _chains_tokens
    with _CHAINS_LOCK:  # servers hash from several threads; readers only ever see whole, unchanging chains
        chains = _CHAINS.setdefault(key, [])
        _CHAINS.move_to_end(key)
        for c in chains:
            if len(c[1]) >= len(hashes) and c[1][len(hashes) - 1] == hashes[-1]:
                return
        if tokens is None:
            tokens = np.array(token_ids[: len(hashes) * key[0]], dtype="<i8")
        i = next((i for i, c in enumerate(chains) if c is prefix), None)
        if i is not None or len(chains) >= _CHAINS_PER_KEY:
            _chains_tokens -= chains.pop(0 if i is None else i)[0].size
        chains.append((tokens, hashes[:]))
        _chains_tokens += tokens.size
        while _chains_tokens > _CHAINS_MAX_TOKENS and len(_CHAINS) > 1:
            _chains_tokens -= sum(c[0].size for c in _CHAINS.popitem(last=False)[1])


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; nothing was allocated."""


class PrefixWalk:
    """Memos of the walks of one request's prefix through pools' hash indexes, kept between its admission
    attempts: a waiting request that does not fit is tried again step after step, while the indexes mostly
    change at other requests' pages.

    `hashes`: the request's block hashes (the list object; such lists are never changed in place) the walks
    looked up. A memo is named for its walk, keyed by the walk's other arguments (`args`), and names the
    pools it read. Contract of a walk: it reads nothing of those pools but the index entries of some of
    `hashes` (under any group: `BlockPool.cached`, the block each key names) and returns a value its caller
    never changes. Then the memo is exact: while none of those pools registered or dropped an entry of
    one of `hashes` since the memo was taken (`BlockPool.index_changes`), every lookup the walk made would
    answer alike, so the walk would return an equal value. A pool whose log no longer reaches back to
    the memo, or an entry of one of `hashes` that changed, makes `memo` walk again."""

    __slots__ = ("hashes", "_keys", "_memos")

    def __init__(self, hashes: Sequence[BlockHash]):
        self.hashes = hashes
        self._keys: frozenset | None = None  # set(hashes), built at the first memo
        self._memos: dict[str, tuple] = {}  # name -> (args, pools, their index epochs when checked, value)

    def memo(self, name: str, args: tuple, pools: Sequence[BlockPool], walk, verify: bool = False):
        """The value of `walk()` (a walk over `pools` as the class docstring says; `args`: whatever else
        it depends on), remembered under `name` while it holds. verify: walk anyway and check the memo
        against it (raises AssertionError on a difference)."""
        if self._keys is None:
            self._keys = frozenset(self.hashes)
        memo = self._memos.get(name)
        if memo is not None and memo[0] == args and self._unchanged(memo[1], memo[2]):
            if not verify:
                return memo[3]
            if (value := walk()) != memo[3]:
                raise AssertionError(f"the memo of walk {name!r} {args} differs from a fresh walk")
        else:
            value = walk()
        self._memos[name] = (args, tuple(pools), [p.index_epoch for p in pools], value)
        return value

    def _unchanged(self, pools: Sequence[BlockPool], epochs: list[int]) -> bool:
        """Whether no pool of `pools` changed an index entry of a hash of ours since its epoch in `epochs`
        (moved on to now where it did not: the next check reads only later changes)."""
        for k, pool in enumerate(pools):
            changed = pool.index_changes(epochs[k])
            if changed is None or not self._keys.isdisjoint(changed):
                return False
            epochs[k] = pool.index_epoch
        return True


@dataclasses.dataclass
class PoolStats:
    allocated: int = 0  # blocks handed out by `allocate`
    evicted: int = 0  # cached blocks whose hash was dropped to reuse them
    hits: int = 0  # blocks served from the prefix cache
    queries: int = 0  # blocks looked up in the prefix cache


class BlockPool:
    """`num_blocks` blocks (ids 0..num_blocks-1) with ref counts, an LRU free queue and a hash index.

    A block's key in the hash index is (group, hash): equal prefixes in different cache groups are
    different blocks.
    """

    # index changes the log behind `index_changes` keeps at most (then its older half goes): a memo of
    # lookups older than that is walked again
    index_log_max = 1 << 14

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple[str, BlockHash] | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # front = next out
        self.cached: dict[tuple[str, BlockHash], int] = {}
        # times each block was handed out by `allocate`: a holder that let a block go (HiSparse's unpinned
        # pages) knows its rows are still there iff the count has not moved since
        self.generation = [0] * num_blocks
        self.stats = PoolStats()
        self._cached_free = 0  # free blocks that still hold a cached prefix (counted as they come and go)
        # moves on every change of ref counts, the free queue or the hash index (not on lookups or empty
        # calls): a caller that saw a version knows nothing in the pool changed while it has not moved
        self.version = 0
        # the hashes whose index entry was registered or dropped, in order, the oldest trimmed past
        # index_log_max; `_index_base`: the index epoch (`index_epoch`) of its first entry
        self._index_log: list[BlockHash] = []
        self._index_base = 0
        self.events = None  # a KV event sink (kvcache.events.KVEventRecorder) or None: events off
        self.medium = "GPU"  # the medium the events name

    def attach_events(self, sink, medium: str) -> None:
        """Report hashes registered and dropped from now on to `sink` (its `stored` / `removed`), under
        `medium`. Hashes already registered are not reported: attach before the first `cache`."""
        if self.cached:
            raise RuntimeError("attach the event sink before the pool caches anything: its earlier hashes would "
                               "never be announced")
        self.events, self.medium = sink, medium

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def index_epoch(self) -> int:
        """Changes of the hash index so far (entries registered or dropped; a reset counts as one)."""
        return self._index_base + len(self._index_log)

    def index_changes(self, since: int) -> list[BlockHash] | None:
        """The hashes (of any group) whose index entry was registered or dropped since `index_epoch` was
        `since`, in order, possibly repeated; None when the log does not reach back that far (trimmed, or
        a `reset_prefix_cache` since: any entry may have changed). What a memo of lookups checks
        (`PrefixWalk`)."""
        i = since - self._index_base
        return self._index_log[i:] if i >= 0 else None

    def _trim_index_log(self) -> None:
        """Drop the older half of the index log (once it holds more than index_log_max entries)."""
        log = self._index_log
        self._index_base += len(log) // 2
        del log[: len(log) // 2]

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix (reclaimable, reused least recently freed first)."""
        return self._cached_free

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1, no hash), least recently freed first; all or nothing."""
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free_queue)} free of {self.num_blocks}")
        out = []
        self.version += n > 0
        log = self._index_log
        for _ in range(n):
            b = self._next_free()
            key = self.block_key[b]
            if key is not None:  # a cached block is reused: it no longer holds that prefix
                self._cached_free -= 1
                del self.cached[key]
                log.append(key[1])
                self.block_key[b] = None
                self.stats.evicted += 1
                if self.events is not None:
                    self.events.removed(self.medium, *key)
            self.ref_count[b] = 1
            self.generation[b] += 1
            out.append(b)
        self.stats.allocated += n
        if len(log) > self.index_log_max:
            self._trim_index_log()
        return out

    def _next_free(self) -> int:
        """Take the free block `allocate` hands out next out of the free queue: the least recently freed."""
        return self.free_queue.popitem(last=False)[0]

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. Blocks reaching 0 join the free queue in the given order
        (callers pass a request's blocks last first, so its tail, the least shared part, goes first)."""
        ref = self.ref_count
        if blocks and min(map(ref.__getitem__, blocks)) <= 0:  # checked before anything changes
            b = next(b for b in blocks if ref[b] <= 0)
            raise RuntimeError(f"block {b} freed more often than it was referenced (double free)")
        self.version += len(blocks) > 0
        free_queue, block_key, cached = self.free_queue, self.block_key, 0
        for b in blocks:  # locals: a failed admission frees thousands of prefix blocks, every step
            n = ref[b] - 1
            ref[b] = n
            if n == 0:
                free_queue[b] = None
                cached += block_key[b] is not None
        self._cached_free += cached

    def requeue(self, blocks: Sequence[int]) -> None:
        """The state `touch(blocks)` then `free(blocks)` leaves, in one pass (an admission given back before it
        took anything: `KVCacheManager.give_back`). Ref counts and the hash index stay as they are; each
        free block among `blocks` moves to the end of the free queue, in this order (touch takes free blocks
        out of the queue whatever its order, free puts them back in its own; a block listed twice ends up
        where its last mention puts it, as with touch and free)."""
        if not blocks:
            return
        self.version += 2  # a touch and a free
        queue = self.free_queue
        deque(map(queue.move_to_end, filter(queue.__contains__, blocks)), 0)  # a C-level loop

    def lookup(self, group: str, h: BlockHash) -> int | None:
        """The cached block holding prefix hash `h` in `group`, or None. Does not take a reference."""
        if not self.enable_prefix_caching:
            return None
        return self.cached.get((group, h))

    def lookup_all(self, group: str, hashes: Sequence[BlockHash]) -> list[int | None]:
        """`lookup` of each of `hashes`, in one C-level pass."""
        if not self.enable_prefix_caching:
            return [None] * len(hashes)
        return list(map(self.cached.get, zip(itertools.repeat(group), hashes)))

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (a prefix hit); a free one leaves the free queue."""
        self.version += len(blocks) > 0
        ref, free_queue, block_key, cached = self.ref_count, self.free_queue, self.block_key, 0
        for b in blocks:
            if ref[b] == 0:
                del free_queue[b]
                cached += block_key[b] is not None
            ref[b] += 1
        self._cached_free -= cached

    def cache(self, group: str, block: int, h: BlockHash, info: BlockInfo | None = None) -> None:
        """Record that referenced `block` now holds the full block with prefix hash `h` in `group`.
        If another block already holds that prefix, the index keeps the first (this one stays private).
        info: the page's event payload; required while an event sink is attached."""
        if not self.enable_prefix_caching or self.block_key[block] is not None:
            return
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} is not referenced: cannot cache it")
        key = (group, h)
        if key not in self.cached:
            self.cached[key] = block
            self.block_key[block] = key
            self._index_log.append(h)
            if len(self._index_log) > self.index_log_max:
                self._trim_index_log()
            self.version += 1
            if self.events is not None:
                if info is None:
                    raise ValueError(f"BlockPool.cache({group!r}, {block}): KV events are on, so the caller must pass "
                                     "the page's BlockInfo")
                self.events.stored(self.medium, group, h, info)

    def cache_all(self, group: str, blocks: Sequence[int], hashes: Sequence[BlockHash],
                  infos: Sequence[BlockInfo] | None = None) -> None:
        """`cache(group, blocks[k], hashes[k], infos[k])` for each k in order, in one pass (a P/D hand-off
        or a host load enters thousands of pages at once). infos: required while an event sink is attached."""
        if type(self).cache is not BlockPool.cache or self.events is not None:  # ARC's lists, events: one at a time
            for k, (b, h) in enumerate(zip(blocks, hashes)):
                self.cache(group, b, h, None if infos is None else infos[k])
            return
        if not self.enable_prefix_caching:
            return
        ref, block_key, cached, log, most = self.ref_count, self.block_key, self.cached, self._index_log, self.index_log_max
        for b, h in zip(blocks, hashes):
            if block_key[b] is not None:
                continue
            if ref[b] <= 0:
                raise RuntimeError(f"block {b} is not referenced: cannot cache it")
            key = (group, h)
            if key not in cached:
                cached[key] = b
                block_key[b] = key
                log.append(h)
                self.version += 1
                if len(log) > most:  # as `cache` trims: the log's base moves exactly as one call at a time
                    self._trim_index_log()
                    log = self._index_log

    def reset_prefix_cache(self) -> None:
        """Drop every hash (referenced blocks stay with their holders, unhashed; free ones become blank)."""
        if self.events is not None:
            for group, h in self.cached:
                self.events.removed(self.medium, group, h)
        self.version += 1
        for key, b in list(self.cached.items()):
            self.block_key[b] = None
            del self.cached[key]
        self._cached_free = 0
        self._index_base, self._index_log = self.index_epoch + 1, []  # every entry may have changed

    def state(self) -> tuple:
        """Everything the pool's decisions depend on (ref counts, free queue order, hash index, generations,
        stats), for tests that two paths leave it alike."""
        return (tuple(self.ref_count), tuple(self.free_queue), tuple(self.block_key), tuple(self.generation),
                dataclasses.astuple(self.stats), self._cached_free)

    def check(self) -> None:
        """Assert the pool invariants (see the module docstring)."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        for b in range(self.num_blocks):
            assert self.ref_count[b] >= 0, f"block {b}: negative ref count"
            assert (self.ref_count[b] == 0) == (b in free), f"block {b}: ref {self.ref_count[b]}, free={b in free}"
        for key, b in self.cached.items():
            assert self.block_key[b] == key, f"hash index and block {b} disagree"
        assert self._cached_free == sum(self.block_key[b] is not None for b in free), "cached-free count drifted"
        assert sum(k is not None for k in self.block_key) == len(self.cached)


@dataclasses.dataclass
class RequestBlocks:
    """One request's blocks: per cache group, its block table (block ids in position order)."""

    tables: dict[str, list[int]]
    hashes: list[BlockHash]  # hashes of the request's full blocks (of the tokens known so far)
    num_cached_blocks: int = 0  # leading hash chunks (tokens_per_block each) registered in / served from the cache
    num_computed_tokens_hit: int = 0  # tokens whose KV came from the prefix cache at admission
    extra_keys: tuple = ()  # the prefix-hash keys the hashes were made with
    walk: PrefixWalk | None = None  # while it is being admitted: the memos of its prefix walks (`admit`)


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, for the cache groups `groups`.

    A table entry of -1 is a page the request holds no device block for (HiSparse released it, or it
    lives only in the host pool); `free` and `check` skip such entries.

    `tokens_per_block` = block_size x DCP size: a block id names one page of `block_size` slots on each
    DCP rank. A group may use larger pages (`group_tokens_per_block`, a multiple of tokens_per_block):
    the indexer keys are ~5% of a token's KV bytes, so an indexer page of r x tokens_per_block tokens
    costs one block like an MLA page of tokens_per_block, which keeps the pool's block count close to
    bytes (vLLM keeps every group at the same tokens per page, one block id holding both groups' pages:
    docs/simulator.md, "Page layout: vLLM's and this engine's"). All groups of a request cover
    the same tokens: with n tokens it holds ceil(n / group tokens per block) blocks in each group.
    Prefix hashes are per `tokens_per_block` chunk; a group page is identified by the hash of its last
    chunk, and a prefix hit ends on a page boundary of every group.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, groups: Sequence[str] = ("mla", "indexer"), *,
                 enable_prefix_caching: bool = True, group_tokens_per_block: dict[str, int] | None = None,
                 drop_last_hit: bool = False):
        if not isinstance(tokens_per_block, int) or tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
        if not groups or len(set(groups)) != len(groups):
            raise ValueError(f"groups must be distinct names, got {groups!r}")
        tpb = {g: tokens_per_block for g in groups}
        for g, n in (group_tokens_per_block or {}).items():
            if g not in tpb:
                raise ValueError(f"group_tokens_per_block names unknown group {g!r}")
            if not isinstance(n, int) or n < tokens_per_block or n % tokens_per_block:
                raise ValueError(f"group_tokens_per_block[{g!r}] must be a multiple of {tokens_per_block}, got {n!r}")
            tpb[g] = n
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.tokens_per_block = tokens_per_block
        self.group_tokens_per_block = tpb
        self.ratio = {g: n // tokens_per_block for g, n in tpb.items()}  # hash chunks per page
        self.hit_multiple = math.lcm(*self.ratio.values())  # a prefix hit covers a multiple of this many chunks
        self.groups = tuple(groups)
        # MTP (speculative decoding): a prefix hit gives back its last page (vLLM 0.34 does so only with
        # disable_lookahead_block_hashes; by default it hashes a block with the drafter's lookahead tokens):
        # the MTP layer's KV at a page's last position pairs it with the token after the page, which a
        # request sharing only the page need not have
        self.drop_last_hit = drop_last_hit
        self.requests: dict[str, RequestBlocks] = {}
        self.leases: dict[str, list[int]] = {}  # per request: blocks held outside its tables (HiSparse hot buffer)
        # per request freed with keep_hashes: (extra keys, hashes of its full blocks) until it is admitted again
        self._kept_hashes: dict[str, tuple[tuple, list[BlockHash]]] = {}
        # per request there whose walk memos are for those hashes: its PrefixWalk (a waiting request's next
        # admission attempt walks only what changed; kept and dropped with its kept hashes)
        self._walks: dict[str, PrefixWalk] = {}
        # check every walk memo a lookup uses against a fresh walk (set by Scheduler.verify_skipped_admissions)
        self.verify_walks = False

    def blocks_needed(self, num_tokens: int, group: str | None = None) -> int:
        """Pages of `group` (default: a tokens_per_block group) that hold num_tokens tokens."""
        tpb = self.tokens_per_block if group is None else self.group_tokens_per_block[group]
        return -(-num_tokens // tpb)

    def blocks_needed_all(self, num_tokens: int) -> int:
        """Blocks over all groups that hold num_tokens tokens of one request."""
        return sum(self.blocks_needed(num_tokens, g) for g in self.groups)

    def page_hash_index(self, group: str, page: int) -> int:
        """Index in a request's chunk hashes of the hash that names `page` of `group` (its last chunk)."""
        return (page + 1) * self.ratio[group] - 1

    def attach_events(self, sink) -> None:
        """Report the device pool's hashes to a KV event sink (kvcache.events) under medium "GPU"."""
        self.pool.attach_events(sink, "GPU")

    def page_info(self, rb: RequestBlocks, token_ids: Sequence[int], group: str, page: int) -> BlockInfo:
        """The event payload of `page` of `group` of a request (its blocks `rb`, its tokens `token_ids`):
        the hash of the chunk before the page (a page of r chunks is named by its last chunk's hash, so
        the chain from that parent over the page's tokens, tokens_per_block at a time, ends at the
        page's hash), the page's tokens and the request's extra keys."""
        n, r = self.group_tokens_per_block[group], self.ratio[group]
        parent = rb.hashes[page * r - 1] if page else None
        return BlockInfo(parent, token_ids[page * n:(page + 1) * n], tuple(rb.extra_keys))

    def admit(self, req_id: str, token_ids: Sequence[int], extra_keys: Sequence[str | int] = (), *,
              use_prefix_cache: bool = True, take: bool = True) -> int:
        """Start tracking a request and take its longest cached prefix (every group must hold its pages
        for the hit to count). -> number of prompt tokens whose KV is already cached (a multiple of
        tokens_per_block x hit_multiple, and < len(token_ids) so at least one token is computed to
        produce logits). use_prefix_cache=False: take nothing (the caller restores the KV itself).
        take=False: the hit is in the request's tables but holds no reference yet: the caller either
        takes it (`take`) or gives the admission back (`give_back`) before the pool is used otherwise."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already admitted")
        kept = self._kept_hashes.pop(req_id, None)  # a request admitted before: its tokens only grew
        walk = self._walks.pop(req_id, None)
        known = kept[1] if kept is not None and kept[0] == tuple(extra_keys) else ()
        full = len(token_ids) // self.tokens_per_block
        if len(known) == full:  # nothing new to hash: the kept list is this admission's (no one else holds it)
            hashes = known
        else:
            hashes = block_hashes(token_ids, self.tokens_per_block, extra_keys, known=known[:full])
        if walk is None or walk.hashes is not hashes:
            walk = PrefixWalk(hashes)
        max_hit = (len(token_ids) - 1) // self.tokens_per_block if use_prefix_cache else 0
        # the walk over hash chunks [0, max_hit) that stops at the first chunk where a page of some group
        # ending there is not cached, done per group: the pages of group g end at chunks r - 1, 2r - 1, ...
        # (r = ratio[g]); the leading run of cached ones is found by one lookup per page
        found = walk.memo("device hit", (max_hit,), (self.pool,), functools.partial(self._hit_walk, hashes, max_hit),
                          self.verify_walks) if max_hit else self._hit_walk(hashes, max_hit)
        n_chunks = max_hit  # chunks [0, n_chunks) are covered by found pages of every group
        for g in self.groups:
            r = self.ratio[g]
            if len(found[g]) < max_hit // r:  # of its max_hit // r pages ending before max_hit
                n_chunks = min(n_chunks, (len(found[g]) + 1) * r - 1)  # the chunk that ends the missing page
        self.pool.stats.queries += n_chunks + (n_chunks < max_hit)  # chunks looked at, the failing one too
        n_chunks -= n_chunks % self.hit_multiple
        if self.drop_last_hit and n_chunks:
            n_chunks -= self.hit_multiple
        tables = {g: found[g][: n_chunks // self.ratio[g]] for g in self.groups}
        if take:
            for g in self.groups:
                self.pool.touch(tables[g])
        self.pool.stats.hits += n_chunks
        n = n_chunks * self.tokens_per_block
        self.requests[req_id] = RequestBlocks(tables, hashes, num_cached_blocks=n_chunks, num_computed_tokens_hit=n,
                                              extra_keys=tuple(extra_keys), walk=walk)
        return n

    def _hit_walk(self, hashes: Sequence[BlockHash], max_hit: int) -> dict[str, list[int]]:
        """`admit`'s lookups: per group, the blocks of its leading cached pages ending before hash chunk
        `max_hit` (a PrefixWalk walk: it reads the pool's index entries of `hashes` only)."""
        cached = self.pool.cached if self.pool.enable_prefix_caching else {}
        found = {}
        for g in self.groups:
            r = self.ratio[g]
            keys = zip(itertools.repeat(g), hashes[r - 1 : max_hit : r])
            found[g] = list(itertools.takewhile(_IS_BLOCK, map(cached.get, keys)))
        return found

    def take(self, req_id: str) -> None:
        """Take the prefix hit of a request admitted with take=False: what `admit` would have touched."""
        rb, tpb = self.requests[req_id], self.group_tokens_per_block
        for g in self.groups:
            self.pool.touch(rb.tables[g][: rb.num_computed_tokens_hit // tpb[g]])

    def give_back(self, req_id: str) -> None:
        """Forget a request admitted with take=False before anything was taken for it: its tables hold its
        hit and pages the caller found for it (-1: none on the device), none of them referenced for it.
        The pool ends up as taking each of those blocks and then `free(req_id, keep_hashes=True)` would
        leave it (`BlockPool.requeue` in free's order: each group's blocks last first), in one pass. (The
        manager's pool is a plain BlockPool, where the order of the touches moves nothing.)"""
        rb = self.requests.pop(req_id)
        self._keep_hashes(req_id, rb)
        self.pool.requeue(list(itertools.chain.from_iterable(filter(_IS_BLOCK_ID, reversed(rb.tables[g]))
                                                             for g in self.groups)))

    def free_in_tables(self, req_id: str) -> int:
        """Blocks of the request's tables that are in the free queue: those that taking them (an admission
        made with take=False) would take out of it. Each counts once."""
        queue = self.pool.free_queue
        return len(set(filter(queue.__contains__, itertools.chain.from_iterable(self.requests[req_id].tables.values()))))

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        return self.missing_blocks(req_id, num_tokens) <= self.pool.num_free

    def _missing(self, req_id: str, num_tokens: int) -> dict[str, int]:
        tables = self.requests[req_id].tables
        return {g: max(0, self.blocks_needed(num_tokens, g) - len(tables[g])) for g in self.groups}

    def missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks over all groups the request lacks to hold `num_tokens` tokens (`_missing`'s sum, without
        its dict: the scheduler asks this for every row of every step)."""
        tables, tpb = self.requests[req_id].tables, self.group_tokens_per_block
        return sum(max(0, -(-num_tokens // tpb[g]) - len(tables[g])) for g in self.groups)

    def allocate(self, req_id: str, num_tokens: int) -> None:
        """Grow the request's tables to cover `num_tokens` tokens in every group; all or nothing
        (raises NoFreeBlocks, leaving the pool unchanged)."""
        missing = self._missing(req_id, num_tokens)
        fresh = self.pool.allocate(sum(missing.values()))
        self.requests[req_id].walk = None  # it is in: its walk memos are not wanted again
        for g in self.groups:
            self.requests[req_id].tables[g].extend(fresh[: missing[g]])
            fresh = fresh[missing[g]:]

    def cache_full_blocks(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_keys: Sequence[str | int] = ()) -> None:
        """Register the request's blocks that are now full of computed KV in the prefix cache.
        `token_ids`: all tokens known for the request (prompt + generated)."""
        rb = self.requests[req_id]
        n_full = num_computed_tokens // self.tokens_per_block
        if len(rb.hashes) < n_full:  # extend the chain by the blocks filled since (no rehash of the rest)
            rb.hashes = block_hashes(token_ids, self.tokens_per_block, extra_keys, known=rb.hashes,
                                     upto=n_full * self.tokens_per_block)
        events = self.pool.events is not None
        for g in self.groups:
            r = self.ratio[g]
            for j in range(rb.num_cached_blocks // r, n_full // r):
                if rb.tables[g][j] >= 0:  # a page held only on the host has no device block to index
                    self.pool.cache(g, rb.tables[g][j], rb.hashes[self.page_hash_index(g, j)],
                                    self.page_info(rb, token_ids, g, j) if events else None)
        rb.num_cached_blocks = max(rb.num_cached_blocks, n_full)

    def free(self, req_id: str, *, keep_hashes: bool = False) -> None:
        """Release every block of the request (tail blocks first into the free queue). keep_hashes: the
        request will be admitted again (preempted, or not admitted this step): keep its block hashes so
        that admission extends them instead of rehashing its whole context."""
        rb = self.requests.pop(req_id)
        if keep_hashes:
            self._keep_hashes(req_id, rb)
        for g in self.groups:
            self.pool.free([b for b in reversed(rb.tables[g]) if b >= 0])
        self.end_lease(req_id)

    def _keep_hashes(self, req_id: str, rb: RequestBlocks) -> None:
        """Keep the hashes of a request leaving its tables for its next admission, with its walk memos while
        they are for those hashes."""
        self._kept_hashes[req_id] = (tuple(rb.extra_keys), rb.hashes)
        if rb.walk is not None and rb.walk.hashes is rb.hashes:
            self._walks[req_id] = rb.walk

    def drop_kept_hashes(self, req_id: str) -> None:
        """A request freed with keep_hashes will not come back (aborted while waiting)."""
        self._kept_hashes.pop(req_id, None)
        self._walks.pop(req_id, None)

    def lease(self, req_id: str, n: int) -> list[int]:
        """n blocks for the request outside its tables (a hot buffer), held until `end_lease` / `free`."""
        if req_id in self.leases:
            raise ValueError(f"request {req_id!r} already holds a lease")
        self.leases[req_id] = self.pool.allocate(n)
        return self.leases[req_id]

    def end_lease(self, req_id: str) -> None:
        self.pool.free(self.leases.pop(req_id, []))

    def release(self, req_id: str, group: str, page: int) -> int:
        """Give one page's block back to the pool while the request keeps running (its table entry
        becomes -1). -> the block id, whose rows stay readable until the pool hands it out again
        (`pool.generation` tells)."""
        table = self.requests[req_id].tables[group]
        b = table[page]
        if b < 0:
            raise ValueError(f"request {req_id!r} holds no block for page {page} of group {group!r}")
        table[page] = -1
        self.pool.free([b])
        return b

    def block_table(self, req_id: str, group: str) -> list[int]:
        return self.requests[req_id].tables[group]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def check(self) -> None:
        """Pool invariants, plus: every referenced block is held by exactly ref_count request tables."""
        self.pool.check()
        holders = [0] * self.pool.num_blocks
        for rb in self.requests.values():
            # every group covers the same number of hash chunks: ceil(C / ratio) pages for one C
            low = max((len(t) - 1) * self.ratio[g] for g, t in rb.tables.items())
            high = min(len(t) * self.ratio[g] for g, t in rb.tables.items())
            assert low < high, "groups of one request cover different numbers of tokens"
            for t in rb.tables.values():
                for b in t:
                    if b >= 0:
                        holders[b] += 1
        for blocks in self.leases.values():
            for b in blocks:
                holders[b] += 1
        assert holders == self.pool.ref_count, "ref counts differ from the request tables (leak or double count)"
        assert self._walks.keys() <= self._kept_hashes.keys(), "walk memos of requests that will not come back"


class ARCBlockPool(BlockPool):
    """A prefix-caching BlockPool whose free cached blocks are reused in ARC order (adaptive replacement
    cache, Megiddo and Modha, FAST 2003) instead of least recently freed: for a host tier where most
    blocks are cached and unreferenced, so reuse order is the eviction policy.

    T1 holds cached blocks used once (stored), T2 those used again (a hit: `touch`), each in recency
    order (least recent first); B1 / B2 remember the keys recently evicted from each (ghosts). A store
    of a key found in B1 means T1 was too small: the target size p of T1 grows; one found in B2 shrinks
    it; either way the block joins T2. A block to reuse is a blank free block if any, else the least
    recent unreferenced block of T1 while T1 is larger than p, else of T2 (a one-time scan of new
    prefixes therefore cycles through T1 and does not flush what was reused). `free` does not move a
    block in T1 / T2."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, enable_prefix_caching=True)
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[tuple[str, BlockHash], None] = OrderedDict()
        self.b2: OrderedDict[tuple[str, BlockHash], None] = OrderedDict()
        self.p = 0.0
        self._blank: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # free, no key

    def _next_free(self) -> int:
        if self._blank:
            b = self._blank.popitem(last=False)[0]
            del self.free_queue[b]
            return b
        order = ((self.t1, self.b1), (self.t2, self.b2))
        for lst, ghosts in (order if len(self.t1) > self.p else order[::-1]):  # the other list if all are pinned
            b = next((b for b in lst if self.ref_count[b] == 0), None)
            if b is not None:
                del lst[b]
                ghosts[self.block_key[b]] = None
                del self.free_queue[b]
                self._trim_ghosts()
                return b
        raise AssertionError("a free block is neither blank nor cached")  # allocate checked the count

    def _trim_ghosts(self) -> None:
        c = self.num_blocks
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def free(self, blocks: Sequence[int]) -> None:
        super().free(blocks)
        if len(set(blocks)) < len(blocks):  # a block listed twice reaches 0 at its last mention (as one free per block)
            blocks = list(dict.fromkeys(reversed(blocks)))[::-1]
        for b in blocks:
            if self.ref_count[b] == 0 and self.block_key[b] is None:
                self._blank[b] = None

    def touch(self, blocks: Sequence[int]) -> None:
        super().touch(blocks)
        for b in blocks:
            if b in self.t1:
                del self.t1[b]
                self.t2[b] = None
            elif b in self.t2:
                self.t2.move_to_end(b)

    def requeue(self, blocks: Sequence[int]) -> None:
        # a touch moves blocks between T1 and T2 in its order, and a free adds blank ones to `_blank`: both
        self.touch(blocks)
        self.free(blocks)

    def cache(self, group: str, block: int, h: BlockHash, info: BlockInfo | None = None) -> None:
        before = self.block_key[block]
        super().cache(group, block, h, info)
        key = self.block_key[block]
        if before is not None or key != (group, h):
            return  # not newly cached
        if key in self.b1:
            self.p = min(self.num_blocks, self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[key]
            self.t2[block] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[block] = None
        else:
            self.t1[block] = None
        self._trim_ghosts()

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.t1.clear(), self.t2.clear(), self.b1.clear(), self.b2.clear()
        self.p = 0.0
        self._blank = OrderedDict((b, None) for b in self.free_queue)

    def state(self) -> tuple:
        return super().state() + (tuple(self.t1), tuple(self.t2), tuple(self.b1), tuple(self.b2), self.p,
                                  tuple(self._blank))

    def check(self) -> None:
        super().check()
        cached = {b for b in range(self.num_blocks) if self.block_key[b] is not None}
        assert set(self.t1) | set(self.t2) == cached and not set(self.t1) & set(self.t2), "T1 / T2 drifted"
        resident = {self.block_key[b] for b in cached}
        assert not (set(self.b1) | set(self.b2)) & resident and not set(self.b1) & set(self.b2), "ghosts drifted"
        assert set(self._blank) == {b for b in self.free_queue if self.block_key[b] is None}
        assert len(self.t1) + len(self.b1) <= self.num_blocks and 0 <= self.p <= self.num_blocks
