"""The peer tier ("p2p"): engines share host-tier chunks with each other over the network (BRIEF §7; vLLM's
P2P secondary tier). `{"type": "p2p", "host": H, "port": P, "peers": ["h:p", ...]}` in secondary_tiers.

Roles. Every peer tier is both a producer and a consumer, on one address.
- Producer: it keeps every chunk stored through it (write-through from its engine's host tier) in its
  own bounded in-memory store (`max_bytes`, least recently used evicted first, never a pinned chunk) and
  serves it to peers: a ZMQ ROUTER control socket bound on `host:port` (vLLM's two fields: the address
  this tier binds, which its peers dial) and a TCP data socket on a free port of the same host, which it
  names in every lookup answer. The store is a copy, not a view of the host tier: the host pool's pages
  are JAX arrays that the next store reuses, which a serving thread must not read.
- Consumer: it asks the control sockets in `peers` (each another tier's "host:port") for what its
  engine's prefix lookup wants, and fetches hits over their data sockets. A request that names its
  source (`LookupContext.peer`: a P/D consumer's producer, from its kv_transfer_params; the
  PdConnector, docs/engine.md) asks that peer alone when the operator listed it in `producers`
  (connected on first use; at most MAX_CONNECTED connected at once, the least recently asked closed
  first), and nobody otherwise: a request cannot make the tier dial an address of its choosing.
  Any other request asks every peer in `peers`.
  Chunks in its own store are hits at once, with no round trip (a memory tier of its own). A fetched
  chunk goes to the host tier, not into this store: a chunk is served by the engine that computed it.

Protocol (ANCHORS §3).
1. `lookup(key, ctx)` of a chunk no peer has answered for is RETRY. The tier registers the key and the
   keys the request's walk may ask after it (`ctx.keys`, kvcache.tiers.LookupContext) as pending, and its
   control thread sends one LookupMsg per (peer, request): one round trip per admission, not per chunk.
   A lookup with no context (no request: e.g. the KV-event check of a finished store) answers from what
   the tier knows (its store, the answers on record, else MISS), and pins and asks nothing.
2. The producer answers hit or miss for every key in one LookupRespMsg and pins its hits at once, under
   one pin id, for `pin_s` seconds: a pinned chunk is never evicted (a store that would need its room
   fails instead), so nothing it said it has goes before the fetch.
3. The next `lookup` answers HIT (a peer pinned it; the first hit wins, later peers' pins on it are
   released) or MISS (every asked peer answered miss or missed its deadline); RETRY while answers are due.
4. `submit_load`: the control thread groups the chunks of the loads submitted together (within a
   millisecond of each other) by the peer that pinned them, and a fetch thread opens one TCP connection
   per group: a FetchMsg (keys and pin ids), one frame per key, a done frame. Serving releases the pin.
A P/D producer leases a finished request's chunks (`lease`: a pin of its own length) after checking
they are stored (`held_prefix`), so they outlive the lookup pins until its consumer fetches them. The
consumer's lookup names the lease (`LookupContext.lease`, from the request's kv_transfer_params): the
producer pins the hits for that lookup and releases them from the lease in the same step, so a chunk
its consumer is about to fetch is held by the lookup pin alone, and the fetch frees it at once instead
of when the lease lapses.
Deadlines turn stragglers into misses, never into a wait or a loop: a peer that has not answered a lookup
within `lookup_timeout_s` is a miss; a fetch (connect, request, every frame) not done within
`transfer_timeout_s` makes what has not arrived a miss; a pin lapses `pin_s` after the producer got the
lookup, and the consumer trusts its hit until `pin_s` after it sent the lookup, which is never later (no
shared clock needed). A peer that missed a deadline or broke a connection is not asked for
10 x `lookup_timeout_s`. A chunk whose load failed, and a MISS answer, stay a MISS for `pin_s`, so a
request's next admission recomputes it instead of fetching it again.

Framing. Control messages are msgpack (msgspec structs, validated on decode; malformed ones are counted
and dropped). The data socket, little-endian: the request is REQUEST (b"GKVF", body length u32) and a
msgpack FetchMsg (at most MAX_FETCH_KEYS keys, MAX_REQUEST bytes: a consumer splits bigger batches); each
answer is FRAME (b"GKVC", status u8: 0 data, 1 gone, 2 done; the 32-byte key; payload length u64;
CRC-32 of the payload u32; a 32-byte MAC) and, for data, the payload. Frames come in request order,
then the done frame (its length: the data frames sent). The consumer checks the magic, the key and the
length against what it asked for, the MAC, and the CRC (both computed once, when the producer stored the
chunk) against the bytes: a mismatch is a "corrupt" miss; a frame it cannot trust ends the stream, the
rest missing. No corrupt or unauthenticated byte is returned.

Authentication (kvcache.tiers.auth; docs/engine.md "Trust model"). With a shared secret (`secret_file`,
else $GLM53_KV_SECRET_FILE) every control message carries an HMAC-SHA256 of its body in a domain naming
its kind, the fetch request one too, a data frame `chunk_mac` of its key and payload, and gone and done
frames one of their fields: a party without the secret can neither serve, fetch, pin nor release (its
messages are counted in `auth_failures` and dropped). Without a secret the MAC fields are zeros and the
tier refuses, at construction, any address that is not loopback (its own, its peers', its producers'),
with one warning. Producers: a request names its producer in its context, but the tier asks only those
the operator listed in `producers`; any other is a miss, counted in `unlisted_peers`, and nothing is
dialled (the server refuses such a request earlier, with a 400). Bounds: at most MAX_DATA_CONNECTIONS
fetches are served at once (more are closed at accept, `connections_refused`), each reads at most
MAX_REQUEST + 32 bytes before its MAC is checked, by `transfer_timeout_s`; a control message past
MAX_CONTROL_BYTES drops its sender (ZMQ's maxmsgsize) and one connection queues at most CONTROL_QUEUE
unread messages (ZMQ's receive high-water mark; the number of control connections is not bounded: see
docs/engine.md's "Trust model"); at most MAX_CONNECTED named producers hold a connected socket, the least
recently asked closed first.

Options (defaults): host, port (required; port 0 binds any free port, `PeerTier.address` names it), peers
([]), producers ([]: the "host:port" addresses requests may name), secret_file (None), max_bytes (1 GiB;
None: unbounded), pin_s (5), lookup_timeout_s (1), transfer_timeout_s (5),
fetch_threads (4), name ("p2p", the metrics key). Under data parallelism replica i binds port + i (as
vLLM); a peer lists every replica it should ask.

KV events: its chunks are reported as medium "CPU" (this engine's memory, readable by peers), locality
"LOCAL", ownership its name, and those it drops as removed.

Threads: one control thread owns every ZMQ socket; a TCP server thread (a short-lived thread per fetch
served); `fetch_threads` fetch threads; one store thread (copies and CRCs). `shutdown()` stops them all.
Not built: transfers straight between host pools (RDMA / NIXL); peer discovery; persistent data
connections; encryption (the MAC authenticates, it does not hide KV from a listener on the network);
replay protection across lookups (a recorded answer replayed names chunks by their content keys, so it can
make a consumer fetch, never take wrong bytes).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import ipaddress
import itertools
import logging
import math
import socket
import socketserver
import struct
import threading
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import msgspec
import numpy as np
import zmq

from kvcache.tiers.auth import MAC_BYTES, NO_MAC, check_secret_file, chunk_mac, chunk_ok, is_loopback, load_secret, seal, unseal
from kvcache.tiers.base import JobResult, LoadJob, Lookup, LookupContext, StoreJob, TierBookkeeping, TierStats

OPTIONS = {"host": None, "port": None, "peers": [], "producers": [], "max_bytes": 1 << 30, "pin_s": 5.0,
           "lookup_timeout_s": 1.0, "transfer_timeout_s": 5.0, "fetch_threads": 4, "name": "p2p", "secret_file": None}
DOWN_FACTOR = 10  # a peer that missed a deadline is skipped for DOWN_FACTOR x lookup_timeout_s
# loads are dispatched once none has come for LOAD_QUIET_S (at most LOAD_WAIT_S after the first): the host
# side submits one job per chunk, and a step's jobs should leave as one fetch per peer
LOAD_QUIET_S, LOAD_WAIT_S = 0.001, 0.005

REQUEST_MAGIC, FRAME_MAGIC = b"GKVF", b"GKVC"
REQUEST = struct.Struct("<4sI")
FRAME = struct.Struct("<4sB32sQI32s")  # magic, status, key, payload length, CRC-32, MAC (zeros without a secret)
DATA, GONE, DONE = 0, 1, 2
MAX_FETCH_KEYS = 16384  # keys of one fetch connection: a consumer splits bigger batches
MAX_REQUEST = 1 << 20  # bytes of one FetchMsg (MAX_FETCH_KEYS keys fit): more is not a request of ours
MAX_DATA_CONNECTIONS = 16  # fetches served at once (a thread and at most MAX_REQUEST bytes each); more are refused
MAX_CONTROL_BYTES = 16 << 20  # one control message (ZMQ drops a peer that sends more)
CONTROL_QUEUE = 8  # control messages one connection may have queued unread (ZMQ's receive high-water mark)
MAX_CONNECTED = 64  # named producers with a connected control socket at once, least recently asked closed first
MAX_NOTED = 4096  # requests remembered as counted in `named_peer_failures` (each is counted once)

_log = logging.getLogger(__name__)

Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class LookupMsg(msgspec.Struct, tag="lookup"):
    """consumer -> producer: which of `keys` do you hold? (pin the ones you do)"""

    lookup_id: int
    req_id: str
    keys: list[Key]
    lease: int = 0  # a P/D producer's lease on these keys, handed over to this lookup's pin (0: none)


class LookupRespMsg(msgspec.Struct, tag="lookup_resp"):
    """producer -> consumer: hits[i] for keys[i] of lookup `lookup_id`; the hits are pinned under `pin`
    for `pin_s` seconds; fetch them from the data socket on `data_port`."""

    lookup_id: int
    hits: list[bool]
    pin: int
    pin_s: float
    data_port: int


class ReleaseMsg(msgspec.Struct, tag="release"):
    """consumer -> producer: `keys` pinned under `pin` will not be fetched."""

    pin: int
    keys: list[Key]


class FetchMsg(msgspec.Struct, tag="fetch"):
    """consumer -> producer, on the data socket: send `keys` (pinned under pins[i]; 0: none) in order."""

    keys: list[Key]
    pins: list[int]


_ENCODE = msgspec.msgpack.Encoder()
_SERVER_DECODE = msgspec.msgpack.Decoder(LookupMsg | ReleaseMsg)
_CLIENT_DECODE = msgspec.msgpack.Decoder(LookupRespMsg)
_FETCH_DECODE = msgspec.msgpack.Decoder(FetchMsg)


@dataclasses.dataclass
class PeerStats(TierStats):
    """TierStats (with its store and load job times) plus the peer protocol's own counters (chunks unless
    named bytes)."""

    lookup_messages: int = 0  # LookupMsgs sent: one per (peer, request) batch of keys
    lookup_timeouts: int = 0  # LookupMsgs a peer did not answer within lookup_timeout_s
    fetches: int = 0  # fetch connections opened (one per peer and batch of loads)
    transfer_timeouts: int = 0  # fetches cut by transfer_timeout_s
    fetch_failures: int = 0  # fetches cut by a refused or broken connection or a frame that could not be trusted
    served_chunks: int = 0  # chunks this tier sent to peers
    served_bytes: int = 0
    pinned_chunks: int = 0  # hits this tier pinned for peers' lookups
    pins_expired: int = 0  # of those, released by the deadline rather than by a fetch
    lease_handovers: int = 0  # leased chunks a consumer's lookup took over from their P/D lease
    bad_messages: int = 0  # malformed control messages or fetch requests, dropped
    auth_failures: int = 0  # messages, fetch requests and chunks whose MAC did not verify (dropped; a chunk: "corrupt")
    unlisted_peers: int = 0  # lookups naming a peer not in `producers` (a miss; nothing dialled)
    connections_refused: int = 0  # data connections past MAX_DATA_CONNECTIONS, closed at once
    # requests whose named peer (a P/D producer) did not answer their lookup: not up, past its deadline,
    # skipped after missing one, or an address no socket reaches (each request once)
    named_peer_failures: int = 0
    control_errors: int = 0  # exceptions the control thread caught (printed) and went on after


def check_options(opts: dict) -> None:
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise ValueError(f"secondary tier 'p2p': unknown keys {sorted(unknown)} (allowed: {sorted(OPTIONS)})")
    host = opts.get("host")
    if not isinstance(host, str) or not host:
        raise ValueError(f"secondary tier 'p2p' needs host (the address its control socket binds and peers dial, "
                         f"e.g. '127.0.0.1'), got {host!r}")
    port = opts.get("port")
    if not _is_int(port) or not 0 <= port <= 65535:
        raise ValueError(f"secondary tier 'p2p': port must be an int in [0, 65535] (0: any free port), got {port!r}")
    for field in ("peers", "producers"):
        peers = opts.get(field, OPTIONS[field])
        if not isinstance(peers, (list, tuple)):
            raise ValueError(f"secondary tier 'p2p': {field} must be a list of 'host:port' strings, got {peers!r}")
        for p in peers:
            _split_addr(p, field)
    check_secret_file(opts.get("secret_file"), "secondary tier 'p2p'")
    mb = opts.get("max_bytes", OPTIONS["max_bytes"])
    if mb is not None and (not _is_int(mb) or mb <= 0):
        raise ValueError(f"secondary tier 'p2p': max_bytes must be a positive int or None, got {mb!r}")
    for k in ("pin_s", "lookup_timeout_s", "transfer_timeout_s"):
        v = opts.get(k, OPTIONS[k])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"secondary tier 'p2p': {k} must be a positive number of seconds, got {v!r}")
    v = opts.get("fetch_threads", OPTIONS["fetch_threads"])
    if not _is_int(v) or v < 1:
        raise ValueError(f"secondary tier 'p2p': fetch_threads must be a positive int, got {v!r}")
    name = opts.get("name", OPTIONS["name"])
    if not isinstance(name, str) or not name:
        raise ValueError(f"secondary tier 'p2p': name must be a non-empty str, got {name!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _split_addr(addr, field: str = "peers") -> tuple[str, int]:
    host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"secondary tier 'p2p': each of {field} must be 'host:port' (port in [1, 65535]), got {addr!r}")
    return host.strip("[]"), int(port)


def peer_address(addr: str, field: str = "peers") -> str:
    """The canonical form of a "host:port" peer address (host lower-cased, an IP address in its compressed
    form, IPv6 in brackets), so that one producer listed and named by a request in two spellings is one
    address. Host names are not resolved. ValueError when it is no such address."""
    host, port = _split_addr(addr, field)
    host = host.lower()
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        pass
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Entry:
    """A stored chunk: its bytes (immutable, so a serving thread may send them while the store evicts) and
    their CRC-32."""

    __slots__ = ("data", "crc", "mac")

    def __init__(self, data: bytes, crc: int, mac: bytes = NO_MAC):
        self.data, self.crc, self.mac = data, crc, mac


PENDING, HIT, MISS = "pending", "hit", "miss"


class _Answer:
    """What the consumer knows of one key: PENDING (waiting on `waiting` peers), HIT (pinned by `peer`
    under `pin`; peer None: this tier's own store) or MISS, each trusted until `expires`."""

    __slots__ = ("state", "expires", "waiting", "peer", "pin")

    def __init__(self, state: str, expires: float = math.inf, waiting=(), peer=None, pin: int = 0):
        self.state, self.expires, self.waiting, self.peer, self.pin = state, expires, set(waiting), peer, pin


@dataclasses.dataclass(eq=False)
class _Peer:
    index: int
    addr: str
    host: str
    port: int
    dealer: zmq.Socket | None  # None until the control thread connects it (a peer a request named)
    static: bool = True  # listed in `peers` (asked for every request), else named by requests' contexts
    data_port: int | None = None  # from its lookup answers
    down_until: float = 0.0  # not asked before this (monotonic s): it missed a deadline
    last_asked: float = 0.0  # monotonic s of its last LookupMsg (a named peer's socket is closed LRU first)


@dataclasses.dataclass(eq=False)
class _Outstanding:
    peer: _Peer
    items: list  # [(key, _Answer)] in message order
    sent_at: float
    deadline: float
    req: str = ""  # the request it asks for


@dataclasses.dataclass(eq=False)
class _JobState:
    job: LoadJob
    status: list
    payloads: list
    left: int
    t0: float  # submitted (time.perf_counter)


class PeerTier(TierBookkeeping):
    """A SecondaryTier (kvcache.tiers) shared with peer engines over the network. See the module docstring."""

    # KV events (kvcache.events): its chunks sit in this engine's host memory, which peers can read
    kv_event_medium, kv_event_locality = "CPU", "LOCAL"

    def __init__(self, *, fingerprint: str, host: str, port: int, peers=(), producers=(),
                 max_bytes: int | None = OPTIONS["max_bytes"], pin_s: float = OPTIONS["pin_s"],
                 lookup_timeout_s: float = OPTIONS["lookup_timeout_s"],
                 transfer_timeout_s: float = OPTIONS["transfer_timeout_s"],
                 fetch_threads: int = OPTIONS["fetch_threads"], name: str = "p2p", secret_file=None):
        check_options({"host": host, "port": port, "peers": peers, "producers": producers, "max_bytes": max_bytes,
                       "pin_s": pin_s, "lookup_timeout_s": lookup_timeout_s, "transfer_timeout_s": transfer_timeout_s,
                       "fetch_threads": fetch_threads, "name": name, "secret_file": secret_file})
        self._secret = load_secret(secret_file, who=f"secondary tier {name!r}")
        if self._secret is None:
            remote = [a for a in (f"{host}:1", *peers, *producers) if not is_loopback(_split_addr(a)[0])]
            if remote:
                raise ValueError(f"secondary tier {name!r}: {remote[0].rsplit(':', 1)[0]!r} is not a loopback address, "
                                 "and peers on other addresses need a shared secret (the tier's secret_file, or "
                                 "$GLM53_KV_SECRET_FILE)")
            _log.warning("peer tier %r: no shared secret (secret_file, $GLM53_KV_SECRET_FILE): its peers are not "
                         "authenticated, so it talks to loopback addresses only", name)
        self.producers = frozenset(peer_address(a, "producers") for a in producers)
        self.name, self.fingerprint, self.host = name, fingerprint, host
        self.kv_event_ownership = name  # tells its "CPU" chunks from the offload host tier's
        self.max_bytes, self.pin_s = max_bytes, float(pin_s)
        self.lookup_timeout_s, self.transfer_timeout_s = float(lookup_timeout_s), float(transfer_timeout_s)
        self.stats = PeerStats()
        super().__init__()  # the lock, the finished jobs, the removal log
        self._closed = False
        # producer side: the store, LRU first, and the pins on it
        self._store: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._storing: collections.Counter[bytes] = collections.Counter()  # keys whose store is in flight
        self._pins: dict[int, tuple[float, set[bytes]]] = {}  # pin -> (deadline, keys still pinned under it)
        self._leases: set[int] = set()  # the pins that are P/D leases (a lookup may take one over)
        self._pin_order: list[tuple[float, int]] = []  # a heap of (deadline, pin): lookups' pins and leases
        self._pinned: collections.Counter[bytes] = collections.Counter()  # key -> live pins holding it
        self._pin_ids = itertools.count(1)
        # consumer side
        self._answers: dict[bytes, _Answer] = {}
        self._to_ask: collections.deque[tuple[str, list]] = collections.deque()  # (request, [(key, answer)])
        self._to_load: collections.deque[tuple[LoadJob, float]] = collections.deque()  # (job, submitted)
        self._load_times = (0.0, 0.0)  # (first, last) submission of the loads in _to_load
        self._jobs: dict[int, _JobState] = {}
        self._outstanding: dict[int, _Outstanding] = {}  # lookup id -> what it asked (control thread only)
        self._lookup_ids = itertools.count(1)
        self._noted: collections.OrderedDict[str, None] = collections.OrderedDict()  # requests counted failed
        self._logged: set[str] = set()  # named peers whose failure was logged
        self._note_lock = threading.Lock()
        # sockets: bound here, so a taken port is an error of the constructor
        self._zmq = zmq.Context()
        self._router = self._socket(zmq.ROUTER)
        try:
            if port == 0:
                self.port = self._router.bind_to_random_port(f"tcp://{_zmq_host(host)}")
            else:
                self._router.bind(f"tcp://{_zmq_host(host)}:{port}")
                self.port = port
            self._server = _DataServer((host, 0), self)
        except (zmq.ZMQError, OSError) as e:
            self._zmq.destroy(linger=0)
            raise ValueError(f"secondary tier 'p2p': cannot bind its control socket on {host}:{port} ({e})") from e
        self.data_port = self._server.server_address[1]
        self._peers: list[_Peer] = []  # index = position; requests' named peers are appended by `lookup`
        self._by_addr: dict[str, _Peer] = {}
        for i, addr in enumerate(peers):
            h, p = _split_addr(addr)
            dealer = self._socket(zmq.DEALER)
            try:
                dealer.connect(f"tcp://{_zmq_host(h)}:{p}")
            except zmq.ZMQError as e:
                self._server.server_close()
                self._zmq.destroy(linger=0)
                raise ValueError(f"secondary tier 'p2p': cannot connect to peer {addr!r} ({e})") from e
            self._peers.append(_Peer(i, addr, h, p, dealer))
            self._by_addr.setdefault(addr, self._peers[-1])
        wake = f"inproc://p2p-wake-{id(self)}"
        self._wake_rx = self._socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = self._socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-store")
        self._fetchers = ThreadPoolExecutor(fetch_threads, thread_name_prefix=f"{name}-fetch")
        self._threads = [threading.Thread(target=self._control_loop, name=f"{name}-control", daemon=True),
                         threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                          name=f"{name}-serve", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def address(self) -> str:
        """"host:port" of this tier's control socket: what a peer lists in its `peers`."""
        return f"{self.host}:{self.port}"

    def _socket(self, kind) -> zmq.Socket:
        s = self._zmq.socket(kind)
        s.setsockopt(zmq.LINGER, 0)  # a close never waits for a peer that is gone
        if kind != zmq.PAIR:
            s.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)  # a bigger message drops its sender, unread
            # what one connection may queue unread before its sender blocks (ZMQ's default is 1,000 messages)
            s.setsockopt(zmq.RCVHWM, CONTROL_QUEUE)
        return s

    # ---------------------------------------------------------------------------------- the interface
    def lookup(self, key: bytes, ctx: LookupContext | None = None) -> Lookup:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return Lookup.MISS
            if self._storing[key]:
                return Lookup.RETRY
            if key in self._store:  # held here: pinned for the load that follows, like a peer's hit
                a = self._answers.get(key)
                if ctx is not None and (a is None or a.state is not HIT or a.peer is not None or a.expires <= now):
                    self._answers[key] = _Answer(HIT, now + self.pin_s, pin=self._pin([key], now))
                return Lookup.HIT
            known = self._known(key, now)
            if known is not None:
                return known
            if not self._asked(ctx, now):
                if ctx is not None and ctx.peer is not None and peer_address_or_none(ctx.peer) in self.producers:
                    self._named_peer_failed(ctx.peer, ctx.req_id, "it is skipped after missing a deadline, or "
                                                                  "its address cannot be asked")
                return Lookup.MISS
        ahead = ctx.keys
        if key in ahead:
            ahead = ahead[ahead.index(key) + 1:]
        req = ctx.req_id
        with self._lock:
            up = self._asked(ctx, now)
            if not up:  # every peer went down meanwhile: nobody would answer
                return Lookup.MISS
            batch = []
            for k in (key, *ahead):
                if k in self._store or self._storing[k] or self._known(k, now) is not None:
                    continue
                a = self._answers[k] = _Answer(PENDING, waiting=up)
                batch.append((k, a))
            if batch:
                self._to_ask.append((req, ctx.lease, batch))
        self._wake()
        return Lookup.RETRY

    def _asked(self, ctx: LookupContext | None, now: float) -> set[int]:
        """The peers a lookup in `ctx` asks (lock held), those up: the one the request names (`ctx.peer`, a
        P/D consumer's producer; added on first use), else every peer in `peers`; none without a context."""
        if ctx is None:
            return set()
        if ctx.peer is None:
            return {p.index for p in self._peers if p.static and p.down_until <= now}
        try:
            addr = peer_address(ctx.peer)
        except ValueError:
            addr = None
        if addr is None or addr not in self.producers:  # only the operator's producers are ever dialled
            self.stats.unlisted_peers += 1
            return set()
        p = self._by_addr.get(addr)
        if p is None:
            h, port = _split_addr(addr)
            p = self._by_addr[addr] = _Peer(len(self._peers), addr, h, port, None, static=False)
            self._peers.append(p)  # at most one per listed producer
        return {p.index} if p.down_until <= now else set()

    # ------------------------------------------------------------------------------- P/D producer
    def held_prefix(self, keys) -> int | None:
        """How many of `keys`, from the first, this tier's store holds; None while a store of one of them
        is still in flight (ask again)."""
        with self._lock:
            if any(self._storing[k] for k in keys):
                return None
            return next((i for i, k in enumerate(keys) if k not in self._store), len(keys))

    def lease(self, keys, seconds: float) -> int:
        """Pin those of `keys` held here for `seconds` (a P/D producer's hold on a finished request's chunks
        until its consumer has fetched them) -> the lease id, 0 if none is held. A consumer's lookup that
        names the lease takes its chunks over under the lookup's pin, which the fetch releases; what no
        such lookup takes lapses with the lease."""
        now = time.monotonic()
        with self._lock:
            self._expire_pins(now)
            held = [k for k in keys if k in self._store]
            if not held:
                return 0
            pin = self._pin(held, now, seconds)
            self._leases.add(pin)
            return pin

    def _known(self, key: bytes, now: float) -> Lookup | None:
        """The answer on record for `key` (lock held), None if none is current."""
        a = self._answers.get(key)
        if a is None:
            return None
        if a.state is PENDING:
            return Lookup.RETRY
        if now < a.expires:
            return Lookup.HIT if a.state is HIT else Lookup.MISS
        del self._answers[key]
        return None

    def submit_store(self, job: StoreJob) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        with self._lock:
            self._storing.update(job.keys)
        self._writer.submit(self._store_job, job, time.perf_counter())

    def submit_load(self, job: LoadJob) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        now = time.monotonic()
        with self._lock:
            self._load_times = (now if not self._to_load else self._load_times[0], now)
            self._to_load.append((job, time.perf_counter()))
        self._wake()

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        self._threads[0].join()
        self._server.shutdown()
        self._server.server_close()
        self._writer.shutdown(wait=wait, cancel_futures=not wait)
        self._fetchers.shutdown(wait=wait, cancel_futures=not wait)  # each fetch ends by its deadline
        with self._wake_lock:
            self._wake_tx.close()
        self._zmq.destroy(linger=0)  # every socket is closed by now; never wait on a peer

    def _count(self, stat: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, stat, getattr(self.stats, stat) + n)

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # the control thread has wake-ups queued already
                    pass

    # ------------------------------------------------------------------------------- producer: store
    def _store_job(self, job: StoreJob, t0: float) -> None:
        status = []
        for key, payload in zip(job.keys, job.payloads):
            try:
                status.append(self._put(key, payload))
            except Exception:  # noqa: BLE001 - a failed store is a chunk not stored, never an engine error
                with self._lock:
                    self.stats.store_failed += 1
                status.append("failed")
            finally:
                with self._lock:
                    self._storing[key] -= 1
                    if not self._storing[key]:
                        del self._storing[key]
        with self._lock:
            self._finished.append(JobResult(job.job_id, "store", tuple(status)))
            self.stats.store_latency.observe(time.perf_counter() - t0)

    def _put(self, key: bytes, payload) -> str:
        with self._lock:
            if key in self._store:  # same key, same bytes
                self._store.move_to_end(key)
                return "ok"
        data = payload.tobytes() if isinstance(payload, np.ndarray) else bytes(memoryview(payload).cast("B"))
        crc = zlib.crc32(data)
        mac = chunk_mac(self._secret, key, data) if self._secret is not None else NO_MAC  # once, as the CRC
        with self._lock:
            if key in self._store:
                self._store.move_to_end(key)
                return "ok"
            if not self._make_room(len(data)):
                self.stats.store_failed += 1
                return "failed"
            self._store[key] = _Entry(data, crc, mac)
            self._bytes += len(data)
            self.stats.stored_chunks += 1
            self.stats.store_bytes += len(data)
        return "ok"

    def _make_room(self, n: int) -> bool:
        """Evict unpinned chunks, least recently used first, until `n` more bytes fit (lock held); False
        (nothing evicted) if they cannot: a chunk larger than max_bytes, or the room is pinned."""
        if self.max_bytes is None:
            return True
        if n > self.max_bytes:
            return False
        self._expire_pins(time.monotonic())
        victims, free = [], self.max_bytes - self._bytes
        for k, e in self._store.items():
            if free >= n:
                break
            if not self._pinned[k]:
                victims.append(k)
                free += len(e.data)
        if free < n:
            return False
        for k in victims:
            self._drop(k)
            self.stats.evicted_chunks += 1
        return True

    def _drop(self, key: bytes) -> None:
        """Forget a stored chunk (lock held), noting it for `take_removed`."""
        self._bytes -= len(self._store.pop(key).data)
        self._note_removed_key(key)

    # -------------------------------------------------------------------------------- producer: pins
    def _pin(self, keys, now: float, seconds: float | None = None) -> int:
        """Pin `keys` (all held here) until now + `seconds` (default pin_s; lock held) -> the pin id."""
        pin = next(self._pin_ids)
        deadline = now + (self.pin_s if seconds is None else seconds)
        self._pins[pin] = (deadline, set(keys))
        heapq.heappush(self._pin_order, (deadline, pin))
        self._pinned.update(set(keys))
        for k in keys:
            self._store.move_to_end(k)
        return pin

    def _release(self, pin: int, key: bytes) -> None:
        rec = self._pins.get(pin)
        if rec is None or key not in rec[1]:
            return  # expired, released already, or never ours
        rec[1].discard(key)
        self._unpin(key)
        if not rec[1]:
            del self._pins[pin]
            self._leases.discard(pin)

    def _unpin(self, key: bytes) -> None:
        self._pinned[key] -= 1
        if self._pinned[key] <= 0:
            del self._pinned[key]

    def _expire_pins(self, now: float) -> None:
        while self._pin_order and self._pin_order[0][0] <= now:
            _, pin = heapq.heappop(self._pin_order)
            rec = self._pins.pop(pin, None)
            self._leases.discard(pin)
            if rec is not None:
                for k in rec[1]:
                    self._unpin(k)
                self.stats.pins_expired += len(rec[1])

    # ------------------------------------------------------------------------------ the control thread
    def _control_loop(self) -> None:
        poller = self._poller = zmq.Poller()
        for s in (self._router, self._wake_rx, *(p.dealer for p in self._peers)):
            poller.register(s, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    # loads wait out their coalescing window; deadlines are checked every 10 ms while lookups are out
                    events = dict(poller.poll(1 if self._to_load else 10 if self._outstanding else 200))
                    if self._wake_rx in events:
                        while _recv(self._wake_rx) is not None:
                            pass
                    if self._router in events:
                        self._serve_control()
                    for p in tuple(self._peers):
                        if p.dealer is not None and p.dealer in events:
                            self._on_answers(p)
                    self._send_lookups()
                    self._start_fetches()
                    now = time.monotonic()
                    self._lookup_deadlines(now)
                    if now - last_sweep > 1.0:
                        last_sweep = now
                        self._sweep(now)
                except Exception:  # noqa: BLE001 - one request's or message's fault must not end every lookup
                    # the thread owns every socket: without it no lookup is answered and no load finishes
                    self._count("control_errors")
                    traceback.print_exc()
                    time.sleep(0.01)  # a fault that repeats does not spin
        finally:
            for s in (self._router, self._wake_rx, *(p.dealer for p in self._peers if p.dealer is not None)):
                s.close()

    def _serve_control(self) -> None:
        """Answer peers' lookups (pinning the hits) and releases."""
        while (frames := _recv(self._router, multipart=True)) is not None:
            try:
                ident, wire = frames
            except ValueError:
                self._count("bad_messages")
                continue
            # a lookup and a release are told apart by their MAC's domain before anything is decoded
            body, kind = unseal(self._secret, b"lookup", wire), LookupMsg
            if body is None:
                body, kind = unseal(self._secret, b"release", wire), ReleaseMsg
            if body is None:
                self._count("auth_failures")
                continue
            try:
                msg = _SERVER_DECODE.decode(body)
                if self._secret is not None and not isinstance(msg, kind):
                    raise msgspec.ValidationError("the message is not of the kind its MAC names")
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._count("bad_messages")
                continue
            now = time.monotonic()
            with self._lock:
                self._expire_pins(now)
                if isinstance(msg, ReleaseMsg):
                    for k in msg.keys:
                        self._release(msg.pin, k)
                    continue
                hits = [k in self._store for k in msg.keys]
                held = [k for k, h in zip(msg.keys, hits) if h]
                pin = self._pin(held, now) if held else 0
                self.stats.pinned_chunks += len(set(held))
                if held and msg.lease in self._leases:  # the lookup's pin holds them now; the fetch releases it
                    lease = self._pins[msg.lease]
                    for k in set(held):
                        if k in lease[1]:
                            self._release(msg.lease, k)
                            self.stats.lease_handovers += 1
            reply = LookupRespMsg(msg.lookup_id, hits, pin, self.pin_s, self.data_port)
            try:
                self._router.send_multipart([ident, seal(self._secret, b"lookup_resp", _ENCODE.encode(reply))],
                                            zmq.NOBLOCK)
            except zmq.ZMQError:  # the consumer is gone or flooding us: its pins lapse
                pass

    def _send_lookups(self) -> None:
        """One LookupMsg per (peer, request) for the keys registered since the last call."""
        with self._lock:
            asks = list(self._to_ask)
            self._to_ask.clear()
        by_req: dict[tuple[str, int], list] = {}
        for req, lease, batch in asks:
            by_req.setdefault((req, lease), []).extend(batch)
        now = time.monotonic()
        for (req, lease), batch in by_req.items():
            for p in tuple(self._peers):
                items = [(k, a) for k, a in batch if p.index in a.waiting]
                if not items:
                    continue
                try:
                    self._ask_peer(p, req, lease, items, now)
                except Exception:  # noqa: BLE001 - this request's lookup at this peer fails alone: a miss from it
                    self._count("control_errors")
                    traceback.print_exc()
                    self._peer_failed(p, items, now)
                    if not p.static:
                        self._named_peer_failed(p.addr, req, "its lookup could not be sent")

    def _ask_peer(self, p: _Peer, req: str, lease: int, items, now: float) -> None:
        """Send `p` one LookupMsg for `items` of request `req` (connecting it first if a request named it)."""
        if p.dealer is None:  # a peer a request named: connected here, by the thread that owns the sockets
            self._close_idle_named()
            dealer = self._socket(zmq.DEALER)
            try:
                dealer.connect(f"tcp://{_zmq_host(p.host)}:{p.port}")
            except (zmq.ZMQError, UnicodeError, ValueError):  # an address that does not resolve: a miss from it
                dealer.close()
                self._peer_failed(p, items, now)
                self._named_peer_failed(p.addr, req, "its address cannot be dialled")
                return
            p.dealer = dealer
            self._poller.register(dealer, zmq.POLLIN)
        lid = next(self._lookup_ids)
        msg = LookupMsg(lid, req, [k for k, _ in items], lease)
        p.last_asked = now
        try:
            p.dealer.send(seal(self._secret, b"lookup", _ENCODE.encode(msg)), zmq.NOBLOCK)
        except zmq.ZMQError:  # its queue is full: it is not keeping up; a miss from it
            self._peer_failed(p, items, now)
            if not p.static:
                self._named_peer_failed(p.addr, req, "its queue is full")
            return
        self._count("lookup_messages")
        self._outstanding[lid] = _Outstanding(p, items, now, now + self.lookup_timeout_s, req)

    def _close_idle_named(self) -> None:
        """Keep at most MAX_CONNECTED - 1 named producers connected (control thread): close the least
        recently asked one with no lookup out (it is connected again when a request names it next)."""
        named = [p for p in self._peers if not p.static and p.dealer is not None]
        if len(named) < MAX_CONNECTED:
            return
        busy = {o.peer.index for o in self._outstanding.values()}
        idle = [p for p in named if p.index not in busy]
        if idle:
            victim = min(idle, key=lambda p: p.last_asked)
            self._poller.unregister(victim.dealer)
            victim.dealer.close()
            victim.dealer = None

    def _on_answers(self, peer: _Peer) -> None:
        while (wire := _recv(peer.dealer)) is not None:
            body = unseal(self._secret, b"lookup_resp", wire)
            if body is None:
                self._count("auth_failures")
                continue
            try:
                msg = _CLIENT_DECODE.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._count("bad_messages")
                continue
            out = self._outstanding.get(msg.lookup_id)
            if out is None:
                continue  # an answer after its deadline: its pins lapse
            if out.peer is not peer or len(msg.hits) != len(out.items):
                self._count("bad_messages")
                continue
            del self._outstanding[msg.lookup_id]
            peer.data_port = msg.data_port
            now = time.monotonic()
            unused = []
            with self._lock:
                for (k, a), hit in zip(out.items, msg.hits):
                    if a.state is PENDING and self._answers.get(k) is a:
                        if hit:
                            a.state, a.peer, a.pin = HIT, peer, msg.pin
                            a.expires = out.sent_at + msg.pin_s  # the producer's pin lapses later
                        else:
                            a.waiting.discard(peer.index)
                            if not a.waiting:
                                a.state, a.expires = MISS, now + self.pin_s
                    elif hit:  # another peer's hit came first, or the request moved on
                        unused.append(k)
            if unused:
                try:
                    peer.dealer.send(seal(self._secret, b"release", _ENCODE.encode(ReleaseMsg(msg.pin, unused))),
                                     zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _lookup_deadlines(self, now: float) -> None:
        for lid in [lid for lid, o in self._outstanding.items() if o.deadline <= now]:
            out = self._outstanding.pop(lid)
            self._count("lookup_timeouts")
            self._peer_failed(out.peer, out.items, now)
            if not out.peer.static:
                self._named_peer_failed(out.peer.addr, out.req, f"no answer within {self.lookup_timeout_s} s")

    def _named_peer_failed(self, addr: str, req: str, why: str) -> None:
        """Request `req`'s named peer `addr` (its P/D producer) gave it nothing for a reason other than not
        holding its chunks: counted once per request (`named_peer_failures`), logged once per peer. Any
        thread, lock held or not."""
        with self._note_lock:
            if req in self._noted:
                return
            self._noted[req] = None
            if len(self._noted) > MAX_NOTED:
                self._noted.popitem(last=False)
            self.stats.named_peer_failures += 1
            log = addr not in self._logged  # a listed producer: the set is bounded by the list
            self._logged.add(addr)
        if log:
            # %a: a peer or request named by a client may hold what no log handler can encode
            _log.warning("peer tier %r: the peer %a named by request %a gave nothing (%s); its prompts are computed",
                         self.name, addr, req, why)

    def _peer_failed(self, peer: _Peer, items, now: float) -> None:
        """`peer` missed a deadline: what it was asked is a miss from it, and it is skipped for a while."""
        with self._lock:
            peer.down_until = now + DOWN_FACTOR * self.lookup_timeout_s
            for _, a in items:
                if a.state is PENDING:
                    a.waiting.discard(peer.index)
                    if not a.waiting:
                        a.state, a.expires = MISS, now + self.pin_s

    def _sweep(self, now: float) -> None:
        with self._lock:
            for k in [k for k, a in self._answers.items() if a.state is not PENDING and a.expires <= now]:
                del self._answers[k]
            self._expire_pins(now)

    # -------------------------------------------------------------------------------- consumer: loads
    def _start_fetches(self) -> None:
        """Loads submitted since the last dispatch, once their coalescing window has passed: chunks held
        here are read at once; the rest go to one fetch per peer that pinned them (an expired hit is tried
        too: the chunk may still be there); a key no hit covers is a miss."""
        groups: dict[int, list] = {}
        local = []
        now = time.monotonic()
        with self._lock:
            first, last = self._load_times
            if not self._to_load or (now - last < LOAD_QUIET_S and now - first < LOAD_WAIT_S):
                return
            jobs = list(self._to_load)
            self._to_load.clear()
            for job, t0 in jobs:
                n = len(job.keys)
                self._jobs[job.job_id] = _JobState(job, [None] * n, [None] * n, n, t0)
                for i, (key, size) in enumerate(zip(job.keys, job.sizes)):
                    a = self._answers.pop(key, None)
                    if a is not None and a.state is HIT and a.peer is not None:
                        groups.setdefault(a.peer.index, []).append((job.job_id, i, key, size, a.pin))
                    else:
                        local.append((job.job_id, i, key, size, a.pin if a is not None and a.state is HIT else 0))
        for item in local:
            self._load_local(*item)
        for pi, items in groups.items():
            for at in range(0, len(items), MAX_FETCH_KEYS):  # a producer serves at most that many per connection
                self._count("fetches")
                self._fetchers.submit(self._fetch, self._peers[pi], items[at:at + MAX_FETCH_KEYS])

    def _load_local(self, job_id: int, i: int, key: bytes, size: int, pin: int) -> None:
        with self._lock:
            entry = self._store.get(key)
            self._release(pin, key)
        if entry is None:
            return self._resolve(job_id, i, key, "miss", None)
        if len(entry.data) != size or zlib.crc32(entry.data) != entry.crc:
            with self._lock:
                if self._store.get(key) is entry:  # our own memory failed verification: drop it
                    self._drop(key)
            return self._resolve(job_id, i, key, "corrupt", None)
        self._resolve(job_id, i, key, "ok", np.frombuffer(entry.data, np.uint8))

    def _fetch(self, peer: _Peer, items: list) -> None:
        """One fetch from `peer` (a fetch thread): request, a frame per key, the done frame; what has not
        arrived verified when the deadline passes or the connection breaks is a miss."""
        deadline = time.monotonic() + self.transfer_timeout_s
        done, sock = 0, None
        try:
            if peer.data_port is None:
                raise ConnectionError("no data port known")
            sock = socket.create_connection((peer.host, peer.data_port), timeout=self.transfer_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            body = seal(self._secret, b"fetch", _ENCODE.encode(FetchMsg([it[2] for it in items], [it[4] for it in items])))
            _send_all(sock, REQUEST.pack(REQUEST_MAGIC, len(body)) + body, deadline)
            head = bytearray(FRAME.size)
            for job_id, i, key, size, _ in items:
                _recv_into(sock, head, deadline)
                magic, status, k, length, crc, mac = FRAME.unpack(head)
                trusted = magic == FRAME_MAGIC and k == key and (status == GONE and self._frame_ok(head)
                                                                 or status == DATA and length == size)
                if not trusted:
                    done += 1
                    self._resolve(job_id, i, key, "corrupt", None)
                    raise _Untrusted(f"frame {FRAME.unpack(head)[:5]!r} for key {key.hex()} of {size} bytes")
                if status == GONE:
                    done += 1
                    self._resolve(job_id, i, key, "miss", None)
                    continue
                out = np.empty(size, np.uint8)
                _recv_into(sock, out, deadline)
                done += 1
                if not chunk_ok(self._secret, key, out, mac):  # a peer without the secret, or a forged chunk
                    self._count("auth_failures")
                    self._resolve(job_id, i, key, "corrupt", None)
                    raise _Untrusted(f"the MAC of chunk {key.hex()} does not verify")
                self._resolve(job_id, i, key, "ok" if zlib.crc32(out) == crc else "corrupt", out)
            _recv_into(sock, head, deadline)
            if FRAME.unpack(head)[:2] != (FRAME_MAGIC, DONE) or not self._frame_ok(head):
                raise _Untrusted("no done frame")
        except TimeoutError:
            self._count("transfer_timeouts")
            self._peer_failed(peer, (), time.monotonic())
        except (OSError, _Untrusted):
            self._count("fetch_failures")
            self._peer_failed(peer, (), time.monotonic())
        finally:
            if sock is not None:
                sock.close()
            for job_id, i, key, _, _ in items[done:]:
                self._resolve(job_id, i, key, "miss", None)

    def _resolve(self, job_id: int, i: int, key: bytes, status: str, payload) -> None:
        with self._lock:
            st = self._jobs[job_id]
            if status == "ok":
                self.stats.loaded_chunks += 1
                self.stats.load_bytes += payload.nbytes
            else:
                payload = None
                self.stats.corrupt += status == "corrupt"
                # not asked again (and fetched again) for a while: the request recomputes it
                self._answers[key] = _Answer(MISS, time.monotonic() + self.pin_s)
            st.status[i], st.payloads[i] = status, payload
            st.left -= 1
            if not st.left:
                del self._jobs[job_id]
                self._finished.append(JobResult(job_id, "load", tuple(st.status), tuple(st.payloads)))
                self.stats.load_latency.observe(time.perf_counter() - st.t0)

    # ------------------------------------------------------------------------------ producer: serving
    def _serve_fetch(self, sock: socket.socket) -> None:
        """One fetch from a peer (a server thread): frames in request order, then the done frame."""
        deadline = time.monotonic() + self.transfer_timeout_s
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = bytearray(REQUEST.size)
            _recv_into(sock, head, deadline)
            magic, n = REQUEST.unpack(head)
            if magic != REQUEST_MAGIC or n > MAX_REQUEST + MAC_BYTES:
                raise _Untrusted("not a fetch request")
            wire = bytearray(n)
            _recv_into(sock, wire, deadline)
            body = unseal(self._secret, b"fetch", bytes(wire))
            if body is None:  # a peer without the secret fetches nothing
                self._count("auth_failures")
                return
            msg = _FETCH_DECODE.decode(body)
            if len(msg.keys) > MAX_FETCH_KEYS:
                raise _Untrusted("too many keys")
            if len(msg.pins) != len(msg.keys):
                raise _Untrusted("keys and pins differ in length")
            sock.settimeout(self.transfer_timeout_s)
            sent = 0
            for key, pin in zip(msg.keys, msg.pins):
                with self._lock:
                    entry = self._store.get(key)
                    if entry is not None:
                        self._store.move_to_end(key)
                    self._release(pin, key)
                if entry is None:
                    sock.sendall(self._frame(GONE, key, 0))
                    continue
                self._send_chunk(sock, key, entry)
                sent += 1
                with self._lock:
                    self.stats.served_chunks += 1
                    self.stats.served_bytes += len(entry.data)
            sock.sendall(self._frame(DONE, bytes(32), sent))
        except (_Untrusted, msgspec.DecodeError, msgspec.ValidationError):
            self._count("bad_messages")
        except OSError:  # the consumer went away or stalled: its pins lapse
            pass

    def _send_chunk(self, sock: socket.socket, key: bytes, entry: _Entry) -> None:
        sock.sendall(FRAME.pack(FRAME_MAGIC, DATA, key, len(entry.data), entry.crc, entry.mac))
        sock.sendall(entry.data)

    def _frame(self, status: int, key: bytes, length: int) -> bytes:
        """A GONE or DONE frame, its MAC over its other fields (a forged one would end a fetch early)."""
        head = FRAME.pack(FRAME_MAGIC, status, key, length, 0, NO_MAC)[:-MAC_BYTES]
        return seal(self._secret, b"frame", head) if self._secret is not None else head + NO_MAC

    def _frame_ok(self, head) -> bool:
        return self._secret is None or unseal(self._secret, b"frame", bytes(head)) is not None


class _Untrusted(Exception):
    """A request or frame that does not follow the protocol."""


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.server.tier._serve_fetch(self.request)


class _DataServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the listen backlog: a burst of fetches is accepted (or refused) at once, not SYN-retried

    def __init__(self, addr, tier: PeerTier):
        self.tier = tier
        self._slots = threading.BoundedSemaphore(MAX_DATA_CONNECTIONS)
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):  # a flood of connections costs no thread and no buffer
            self.tier._count("connections_refused")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def peer_address_or_none(addr) -> str | None:
    try:
        return peer_address(addr)
    except ValueError:
        return None


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _recv(sock: zmq.Socket, multipart: bool = False):
    try:
        return sock.recv_multipart(zmq.NOBLOCK) if multipart else sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None


def _recv_into(sock: socket.socket, buf, deadline: float) -> None:
    """Fill `buf` from `sock` by `deadline` (TimeoutError) or raise ConnectionError at end of stream."""
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("transfer deadline passed")
        sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the peer closed the connection")
        got += n


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("transfer deadline passed")
    sock.settimeout(left)
    sock.sendall(data)
