"""KV cache events in vLLM's wire format, so a prefix-aware router (llm-d's, Dynamo's) can follow which
blocks an engine holds on which medium (BRIEF §7, "structured KV events for every chunk move").

Wire format (vLLM `vllm/distributed/kv_events.py`, the layout since its map encoding of events):
- A ZMQ PUB socket sends one multipart message per batch: [topic, sequence number as 8-byte big-endian
  unsigned, msgpack payload]. Sequence numbers count batches from 0 and are assigned when a batch is
  queued, so a batch dropped on a full queue leaves a gap a subscriber can see.
- The payload is a `KVEventBatch`, encoded positionally (msgspec array_like): [ts, events,
  data_parallel_rank] (ts: wall-clock seconds when the batch was queued).
- Each event is a msgpack map tagged with its class name under "type" (msgspec tag=True), fields with a
  default left out when they hold it (omit_defaults): `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
  vLLM up to v0.23 encoded events as tagged arrays instead; consumers such as llm-d's read both.
- A ROUTER replay socket answers a request [client identity, b"", start sequence number (8 bytes,
  big-endian)] with every buffered batch from that number on, each as [identity, b"", sequence number,
  payload], then [identity, b"", -1 as 8 signed big-endian bytes, b""]. A REQ or DEALER socket that
  sends the 8 bytes (with the empty delimiter) receives (sequence number, payload) pairs.

What the engine reports (the media are vLLM's names):
- "GPU": a device page's hash registered in the prefix cache (BlockStored) and dropped when its block
  is reused (BlockRemoved);
- "CPU": pages stored into and evicted from a host pool (the offload host tier, kvcache.policies.offload; HiSparse's
  MLA pool and its pool of parked indexer pages, kvcache.policies.hisparse);
- "STORAGE": chunks a secondary tier (kvcache.tiers) reports written, and removed when it evicts or
  deletes them (the filesystem tier: locality "LOCAL");
- AllBlocksCleared: a reset of the engine's prefix caches (`glm53.Engine.reset_prefix_cache`).

Hashes go on the wire as the pool's 32-byte SHA-256 chain hashes (msgpack bin; vLLM's ExternalBlockHash
allows bytes or int; its int form is the digest's last 8 bytes, int.from_bytes(h[-8:], "big")). One hash
names one page of a cache group: `block_size` is the group's tokens per page (block_size x DCP size for
the MLA group, index_block_size x DCP size for the indexer group), `token_ids` the page's tokens, and a
page's hash is the chain from `parent_block_hash` over its tokens in chunks of the MLA group's page
(kvcache.block_pool.hash_block), so a consumer that re-hashes token_ids must use that size. `group_idx`:
0 = MLA rows, 1 = indexer keys (both vLLM "mla_attention" specs). `extra_keys`: per block, (salt,) when
the request has one (it enters every block's hash here), else None.

The sink: `KVEventRecorder` collects one replica's events during an engine step (the pools and the
tiers call it); the engine takes them after each step and hands them as one batch to the replica's
publisher (`ZmqEventPublisher`: a queue and a background thread, so the step never waits on a socket;
`NullEventPublisher` when publishing is off). This module imports no engine code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

from kvcache.block_pool import BlockHash, BlockInfo

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
PUBLISHERS = ("zmq", "null")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay stream's end marker


# ------------------------------------------------------------------------------------------ wire types
# Field names, order and struct options are vLLM's (so its own decoder, msgspec.msgpack.Decoder(
# KVEventBatch), reads our batches); omitted defaults keep optional fields off the wire.

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the event types; the tag (the class name) goes under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block in block_hashes
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" | "REMOTE": where a tier's storage is, seen from this engine
    ownership: str | None = None  # the secondary tier that generated the event, if it names itself


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder of payloads into KVEventBatch (what a subscriber in Python uses)."""
    return msgspec.msgpack.Decoder(KVEventBatch)


# ------------------------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (its KVEventsConfig keys and defaults).

    enable_kv_cache_events: record events at all (False: nothing is recorded, no socket is opened).
    publisher: "zmq" or "null" (record, publish nothing); None: "zmq" if enabled, else "null".
    endpoint: the PUB socket, by default bound on 127.0.0.1:5557 (vLLM's default, tcp://*:5557, publishes
        every cached prefix hash to every interface). An address with "*" (or "::"), a loopback host
        (127.x, ::1, localhost), ipc:// and inproc:// is bound, any other is connected to (vLLM's rule,
        but for loopback hosts, which vLLM connects to: bind a stable address, connect to a collector).
        Data-parallel replica i publishes on port + i (tcp; a "*" port stays "*") or on
        "<endpoint>_dp<i>" (inproc, ipc).
    replay_endpoint: the ROUTER socket for replays (bound; offset per replica likewise), None: none.
    buffer_steps: batches kept for replay. hwm: the PUB socket's send high-water mark (ZMQ drops
        messages past it for a slow subscriber). max_queue_size: batches waiting for the publisher
        thread; past it a batch is dropped (counted, logged), never waited for. topic: the first frame.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"kv_events_config {name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            bad("enable_kv_cache_events", "True or False")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            bad("publisher", f"one of {PUBLISHERS}")
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                bad(name, f"an int >= {low}")
        if not isinstance(self.topic, str):
            bad("topic", "a str")

    @classmethod
    def from_dict(cls, d: Mapping | KVEventsConfig | None) -> KVEventsConfig:
        """From vLLM's dict shape (None: events off); unknown keys are refused, not ignored."""
        if d is None:
            return cls()
        if isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"kv_events_config must be a dict of {sorted(_KEYS)}, got {type(d).__name__}")
        unknown = set(d) - _KEYS
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
        return cls(**d)

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_KEYS = {f.name for f in dataclasses.fields(KVEventsConfig)}
_SCHEMES = ("tcp", "ipc", "inproc")


def check_endpoint(name: str, endpoint) -> None:
    """A ZMQ endpoint: tcp://HOST:PORT (PORT an int or "*"), ipc://PATH or inproc://NAME."""
    allowed = "tcp://HOST:PORT (PORT an int or '*'), ipc://PATH or inproc://NAME"
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(f"kv_events_config {name} must be a ZMQ endpoint, {allowed}; got {endpoint!r}")
    scheme, _, rest = endpoint.partition("://")
    if scheme not in _SCHEMES or not rest:
        raise ValueError(f"kv_events_config {name} must use one of the schemes {_SCHEMES} ({allowed}); got "
                         f"{endpoint!r}")
    if scheme == "tcp":
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
            raise ValueError(f"kv_events_config {name} must be {allowed}; got {endpoint!r}")


def binds(endpoint: str) -> bool:
    """Whether a publisher binds `endpoint` (else it connects to it): a wildcard host ("*", "::"), a
    loopback host, ipc:// and inproc:// (KVEventsConfig.endpoint)."""
    if endpoint.startswith(("ipc://", "inproc://")) or "*" in endpoint or "::" in endpoint:
        return True
    host = endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel replica `rank` (vLLM's offset: tcp port + rank, a "_dp<rank>" suffix
    otherwise; rank 0 and a "*" port unchanged)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port == "*" else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


# ------------------------------------------------------------------------------------------ publishers

class NullEventPublisher:
    """Publishes nothing (publisher "null", or events off); opens no socket."""

    endpoint = replay_endpoint = None
    queued_batches = dropped_batches = sent_batches = 0

    def publish(self, batch: KVEventBatch) -> None:
        pass

    def close(self) -> None:
        pass

    shutdown = close


class ZmqEventPublisher:
    """A PUB socket (and a ROUTER replay socket if configured) fed by a background thread.

    `publish` gives the batch the next sequence number and queues it without waiting (a full queue drops
    it: `dropped_batches`); the thread encodes it, sends [topic, seq, payload], keeps (seq, payload) in a
    buffer of the last `buffer_steps` batches, and answers replay requests between sends. The sockets
    are made (and bound or connected) here, so a bad or busy address fails the constructor with the
    field named, and used only by the thread after that; `close` stops the thread after it sent what
    was queued (up to `timeout_s`) and closes both sockets. `endpoint` / `replay_endpoint`: the
    addresses actually bound (a "*" port resolved).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, *, timeout_s: float = 2.0):
        self.config = config
        self.rank = data_parallel_rank
        self.timeout_s = timeout_s
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.queued_batches = 0  # accepted by `publish`
        self.dropped_batches = 0  # refused by `publish` (queue full)
        self.sent_batches = 0  # sent by the thread
        self._ctx = zmq.Context.instance()
        self._pub = self._replay = None
        self._bound: list = []  # (socket, address): unbound explicitly at close, which frees the name at once
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            self.endpoint = self._open(self._pub, "endpoint", offset_endpoint(config.endpoint, self.rank))
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._open(self._replay, "replay_endpoint",
                                                  offset_endpoint(config.replay_endpoint, self.rank), bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{self.rank}", daemon=True)
        self._thread.start()

    def _open(self, sock, name: str, endpoint: str, bind: bool | None = None) -> str:
        if bind is None:
            bind = binds(endpoint)
        try:
            if bind:
                sock.bind(endpoint)
                bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self._bound.append((sock, bound))
                return bound
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            raise ValueError(f"kv_events_config {name} {endpoint!r}: cannot {'bind' if bind else 'connect'} "
                             f"({e})") from e

    def publish(self, batch: KVEventBatch) -> int | None:
        """Queue `batch` (stamped with this replica's rank if it has none). -> its sequence number, or
        None if the queue was full and the batch was dropped (its number is skipped all the same)."""
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.rank
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped_batches += 1
            log.warning("KV event queue full (max_queue_size=%d): batch %d dropped", self.config.max_queue_size, seq)
            return None
        self.queued_batches += 1
        return seq

    def close(self) -> None:
        """Send what is queued (waiting up to timeout_s), stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=self.timeout_s)
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            log.warning("KV event publisher thread did not stop within %.1f s; closing its sockets", self.timeout_s)
        self._close_sockets()

    shutdown = close  # vLLM's name

    def _close_sockets(self) -> None:
        """Unbind, then close: closing alone leaves the address to ZMQ's reaper thread, so an engine
        started right after this one could find it still taken."""
        for sock, address in self._bound:
            with contextlib.suppress(zmq.ZMQError):
                sock.unbind(address)
        self._bound.clear()
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    # --------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        wait = 0.01 if self._replay is not None else 0.5  # how long a replay request may wait for an answer
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.sent_batches += 1
            except Exception:  # noqa: BLE001 - a failed send loses a batch, never the engine
                log.exception("KV event batch %d not sent", seq)

    def _serve_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV event replay: ignored a malformed request of %d frames", len(frames))
                return
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
        except Exception:  # noqa: BLE001 - a broken replay request must not stop publishing
            log.exception("KV event replay failed")


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0):
    """The publisher `config` asks for: ZmqEventPublisher, or NullEventPublisher (events off or "null")."""
    return ZmqEventPublisher(config, data_parallel_rank) if config.publishing else NullEventPublisher()


# --------------------------------------------------------------------------------------- the recorder

@dataclasses.dataclass
class _Announced:
    """A chunk a secondary tier holds as far as events said: its group and hash."""

    group: str
    h: BlockHash


class KVEventRecorder:
    """One replica's event sink: the pools (kvcache.block_pool.BlockPool.attach_events), the offload
    policy and the secondary tiers (kvcache.tiers.TierSet.attach_events) call it during a step; `take`
    hands over what it recorded, in order.

    groups: the cache groups in group_idx order; block_sizes: per group, tokens per page; spec_kinds: per
    group, vLLM's kv_cache_spec_kind (None: not sent).

    Consecutive stores of one medium and group that continue a chain (each page's parent is the last
    hash of the event before) share one BlockStored, as vLLM's pool reports a request's newly full
    blocks; consecutive removals of one medium and group share one BlockRemoved.

    Secondary tiers: a stored chunk is announced once a tier reports its store finished and the tier
    still holds it (`lookup` answers HIT), and removed when the tier reports it gone; a tier's chunks
    are keyed by kvcache.tiers.chunk_key, so the recorder keeps, per chunk this engine stored and a tier
    holds, its group and hash (the memory is the tier's chunk count, no tokens).
    """

    def __init__(self, groups: Sequence[str], block_sizes: Mapping[str, int],
                 spec_kinds: Mapping[str, str | None] | None = None):
        self.group_idx = {g: i for i, g in enumerate(groups)}
        self.block_sizes = dict(block_sizes)
        self.spec_kinds = dict(spec_kinds or {})
        self.events: list[KVCacheEvent] = []
        self._pending: dict[bytes, list] = {}  # chunk key -> [group, hash, info, tier reports still due]
        self.announced: dict[str, dict[bytes, _Announced]] = {}  # tier name -> chunk key -> what it holds
        self._clearing: list | None = None  # removals held back during `clearing`

    # -------------------------------------------------------------------------------------- pools
    def stored(self, medium: str, group: str, h: BlockHash, info: BlockInfo, *, locality: str | None = None,
               ownership: str | None = None) -> None:
        tokens = np.asarray(info.token_ids).tolist()
        extra = tuple(info.extra_keys) or None
        gi = self.group_idx[group]
        last = self.events[-1] if self.events else None
        if (type(last) is BlockStored and last.medium == medium and last.group_idx == gi and last.locality == locality
                and last.ownership == ownership and info.parent_block_hash is not None
                and last.block_hashes[-1] == info.parent_block_hash):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            last.extra_keys.append(extra)
            return
        self.events.append(BlockStored(
            block_hashes=[h], parent_block_hash=info.parent_block_hash, token_ids=tokens,
            block_size=self.block_sizes[group], lora_id=None, medium=medium, lora_name=None, extra_keys=[extra],
            group_idx=gi, kv_cache_spec_kind=self.spec_kinds.get(group), locality=locality, ownership=ownership))

    def removed(self, medium: str, group: str, h: BlockHash, *, locality: str | None = None,
                ownership: str | None = None) -> None:
        if self._clearing is not None:
            self._clearing.append((medium, group, h, locality, ownership))
            return
        gi = self.group_idx[group]
        last = self.events[-1] if self.events else None
        if (type(last) is BlockRemoved and last.medium == medium and last.group_idx == gi and last.locality == locality
                and last.ownership == ownership):
            last.block_hashes.append(h)
            return
        self.events.append(BlockRemoved(block_hashes=[h], medium=medium, group_idx=gi, locality=locality,
                                        ownership=ownership))

    @contextlib.contextmanager
    def clearing(self):
        """A reset of every pool of the replica: the removals inside become one AllBlocksCleared, unless a
        secondary tier holds announced chunks (AllBlocksCleared would tell a consumer those are gone
        too); then they stay one removal per hash."""
        held, self._clearing = self._clearing, []
        try:
            yield
        finally:
            removals, self._clearing = self._clearing, held
            if any(self.announced.values()):
                for medium, group, h, locality, ownership in removals:
                    self.removed(medium, group, h, locality=locality, ownership=ownership)
            else:
                self.events.append(AllBlocksCleared())

    # ----------------------------------------------------------------------------- secondary tiers
    def tier_store_planned(self, key: bytes, group: str, h: BlockHash, info: BlockInfo, reports: int) -> None:
        """The offload policy planned a store of chunk `key` (page `h` of `group`) to `reports` tiers."""
        entry = self._pending.get(key)
        if entry is None:
            self._pending[key] = [group, h, info, reports]
        else:
            entry[3] += reports

    def tier_store_finished(self, tier, key: bytes, present: bool) -> None:
        """`tier` finished a store of `key`; present: it holds the chunk now (written, and not evicted
        since). Announces the chunk once per tier."""
        entry = self._pending.get(key)
        if entry is None:
            return  # a store this recorder did not see planned (events attached later)
        group, h, info, _ = entry
        entry[3] -= 1
        if entry[3] <= 0:
            del self._pending[key]
        held = self.announced.setdefault(tier.name, {})
        if present and key not in held:
            held[key] = _Announced(group, h)
            self.stored(_medium(tier), group, h, info, locality=_locality(tier), ownership=_ownership(tier))

    def tier_removed(self, tier, keys: Iterable[bytes]) -> None:
        """`tier` no longer holds `keys` (evicted, deleted as corrupt, found gone)."""
        held = self.announced.get(tier.name, {})
        for key in keys:
            a = held.pop(key, None)
            if a is not None:
                self.removed(_medium(tier), a.group, a.h, locality=_locality(tier), ownership=_ownership(tier))

    # ------------------------------------------------------------------------------------ handing over
    def take(self) -> list[KVCacheEvent]:
        out, self.events = self.events, []
        return out


def _medium(tier) -> str:
    return getattr(tier, "kv_event_medium", MEDIUM_STORAGE)


def _locality(tier) -> str | None:
    return getattr(tier, "kv_event_locality", None)


def _ownership(tier) -> str | None:
    return getattr(tier, "kv_event_ownership", None)


def batch(events: list, rank: int | None = None) -> KVEventBatch:
    """One engine step's events as a batch stamped with the wall clock now."""
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)
