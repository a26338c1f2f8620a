"""The peer tier (kvcache.tiers.p2p) with real processes over loopback: a producer process holds chunks and
serves them; the tier in this process looks them up and fetches them. Faults are real: the producer is
SIGKILLed mid-transfer, SIGSTOPped (a missed deadline), its stored bytes flipped. Then behind the offload
host tier in the engine, where every request must give the reference's greedy tokens whatever the peers
did, with the counters saying what happened."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from glm53 import DeployConfig, Engine
from kvcache.tiers import LoadJob, Lookup, LookupContext, StoreJob, TierSet, chunk_key, make_tier
from kvcache.tiers.p2p import FRAME, REQUEST, PeerTier
from parallel.launch import free_port
from tests import processes

REPO = Path(__file__).resolve().parents[2]
FP = "ab" * 32
N = 4096  # payload bytes in the tier-alone tests
HOST = "127.0.0.1"


def _key(i: int) -> bytes:
    return chunk_key(FP, "mla", i.to_bytes(32, "little"))


def _payload(i: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


# A producer: a peer tier in its own process, driven by JSON lines on stdin (one reply line each on stdout;
# {"event": ...} lines may come in between). Fault hooks: "stall" makes the next n chunk sends write their
# header and half the payload, report {"event": "stalled"} and hang; "corrupt" flips one byte of stored
# chunks and keeps their CRC (memory gone bad after the store).
_PRODUCER = """
import json, sys, threading, time
import numpy as np
from kvcache.tiers import StoreJob, chunk_key
from kvcache.tiers.p2p import DATA, FRAME, FRAME_MAGIC, PeerTier, _Entry
FP = "ab" * 32
key = lambda i: chunk_key(FP, "mla", i.to_bytes(32, "little"))
payload = lambda i, n: np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
tier = PeerTier(fingerprint=FP, host="127.0.0.1", port=0, **json.loads(sys.argv[1]))
out = threading.Lock()
def say(**msg):
    with out:
        print(json.dumps(msg), flush=True)
stalls = []
send = tier._send_chunk
def send_chunk(sock, k, entry):
    if not stalls:
        return send(sock, k, entry)
    stalls.pop()
    sock.sendall(FRAME.pack(FRAME_MAGIC, DATA, k, len(entry.data), entry.crc, entry.mac))
    sock.sendall(entry.data[: len(entry.data) // 2])
    say(event="stalled", key=k.hex())
    time.sleep(3600)
tier._send_chunk = send_chunk
def store(keys, payloads):
    tier.submit_store(StoreJob(1, tuple(keys), tuple(payloads)))
    while not (done := tier.get_finished_jobs()):
        time.sleep(0.001)
    return list(done[0].status)
say(port=tier.port)
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "store":
        say(reply=store([key(i) for i in cmd["items"]], [payload(i, cmd.get("n", 4096)) for i in cmd["items"]]))
    elif op == "store_file":
        chunks = np.load(cmd["path"])
        say(reply=store([bytes.fromhex(k) for k in chunks.files], [chunks[k] for k in chunks.files]))
    elif op == "corrupt":
        with tier._lock:
            ks = [key(i) for i in cmd["items"]] if "items" in cmd else sorted(tier._store)[:: cmd["every"]]
            for k in ks:
                e = tier._store[k]
                data = bytearray(e.data)
                data[len(data) // 3] ^= 0x10
                tier._store[k] = _Entry(bytes(data), e.crc, e.mac)
        say(reply=len(ks))
    elif op == "stall":
        stalls.extend([1] * cmd["n"])
        say(reply="armed")
    elif op == "stats":
        with tier._lock:
            counts = {k: v for k, v in tier.stats.__dict__.items() if isinstance(v, int)}
            say(reply={**counts, "held": sorted(k.hex() for k in tier._store)})
"""


class Producer:
    """A producer process (the script above); every wait on it is bounded."""

    def __init__(self, **opts):
        self.proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, json.dumps(opts)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.replies, self.events = queue.Queue(), queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = self._get(self.replies, 20)["port"]
        self.address = f"{HOST}:{self.port}"

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            (self.events if "event" in msg else self.replies).put(msg)
        self.replies.put(None)  # it exited
        self.events.put(None)

    @staticmethod
    def _get(q, timeout):
        try:
            msg = q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the producer said nothing for {timeout} s") from None
        if msg is None:
            q.put(None)
            raise AssertionError("the producer exited")
        return msg

    def cmd(self, op, **kw):
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._get(self.replies, 20)["reply"]

    def event(self, timeout=20):
        return self._get(self.events, timeout)

    def signal(self, sig):
        self.proc.send_signal(sig)

    def pause(self):
        processes.pause(self.proc)

    def resume(self):
        processes.resume(self.proc)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def producer():
    made = []

    def make(**opts):
        made.append(Producer(**opts))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _ask(i: int) -> LookupContext:
    """The context of a request whose walk asks for chunk i alone."""
    return LookupContext(f"req-{i}", [_key(i)])


def _answer(tier, i, ctx=None, timeout=10.0) -> Lookup:
    """Ask (as a request whose walk is `ctx`, default chunk i alone) until the tier stops answering RETRY."""
    ctx = ctx or _ask(i)
    end = time.monotonic() + timeout
    while (r := tier.lookup(_key(i), ctx)) is Lookup.RETRY:
        assert time.monotonic() < end, f"lookup of {i} answered RETRY for {timeout} s"
        time.sleep(0.002)
    return r


def _load(tier, items, timeout=10.0, n=N):
    tier.submit_load(LoadJob(7, tuple(_key(i) for i in items), (n,) * len(items)))
    end = time.monotonic() + timeout
    while not (done := [r for r in tier.get_finished_jobs() if r.kind == "load"]):
        assert time.monotonic() < end, f"a load of {items} did not finish in {timeout} s"
        time.sleep(0.002)
    return done[0]


def _settles(pred, timeout=5.0) -> bool:
    """Whether `pred()` holds within `timeout` s. A producer counts a chunk served after its last byte is
    sent, and a consumer's load finishes when that byte arrives, so the producer's count may trail the load
    by a moment; a count that overshoots still fails the caller's exact assertion."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


# ------------------------------------------------------------------------------------ the tier alone
def _store_here(tier, items, job_id=1) -> list:
    tier.submit_store(StoreJob(job_id, tuple(_key(i) for i in items), tuple(_payload(i) for i in items)))
    end = time.monotonic() + 10
    while not (done := [r for r in tier.get_finished_jobs() if r.kind == "store"]):
        assert time.monotonic() < end
        time.sleep(0.002)
    return list(done[0].status)


def test_p2p_a_request_names_its_producer_which_leases_its_chunks(tiers):
    """P/D (the PdConnector): a lookup whose context names a peer asks that peer alone, though the tier
    lists none; the producer's `held_prefix` counts what it holds from the first key, and a lease keeps
    chunks past pin_s (a store that needs their room fails instead) until it lapses."""
    prod = tiers(pin_s=0.2, max_bytes=4 * N)
    assert _store_here(prod, [0, 1, 2, 3]) == ["ok"] * 4
    assert prod.held_prefix([_key(0), _key(1), _key(5), _key(2)]) == 2
    assert prod.lease([_key(0), _key(1), _key(9)], 3.0) > 0 and prod.lease([_key(9)], 3.0) == 0
    time.sleep(0.3)  # past pin_s: only the lease holds 0 and 1
    assert _store_here(prod, [4, 5], job_id=2) == ["ok", "ok"]  # 2 and 3 evicted: 0 and 1 are leased
    assert prod.held_prefix([_key(0), _key(1)]) == 2 and prod.held_prefix([_key(2)]) == 0
    assert prod.lease([_key(4), _key(5)], 0.3) > 0
    assert _store_here(prod, [6], job_id=3) == ["failed"]  # every chunk leased: no room
    time.sleep(0.4)  # the short lease lapsed
    assert _store_here(prod, [7], job_id=4) == ["ok"] and prod.held_prefix([_key(0), _key(1), _key(7)]) == 3
    gone_addr = f"{HOST}:{free_port()}"
    cons = tiers(producers=[prod.address, gone_addr])  # no static peers; the producers requests may name
    assert cons.lookup(_key(0), _ask(0)) is Lookup.MISS and cons.stats.lookup_messages == 0
    named = LookupContext("req-pd", [_key(0), _key(1), _key(2)], peer=prod.address)
    assert _answer(cons, 0, named) is Lookup.HIT
    assert [cons.lookup(_key(i), named) for i in (1, 2)] == [Lookup.HIT, Lookup.MISS]
    r = _load(cons, [0, 1])
    assert r.status == ("ok", "ok")
    np.testing.assert_array_equal(r.payloads[1], _payload(1))
    assert cons.stats.lookup_messages == 1 and _settles(lambda: prod.stats.served_chunks >= 2)
    assert prod.stats.served_chunks == 2
    assert cons.stats.named_peer_failures == 0  # its MISS for key 2 is "never stored there": not a failure
    # a named peer that is not up: a miss once the lookup deadline passes, never a hang; counted once for
    # the request, and once for the next request that names it while it is skipped
    gone = LookupContext("req-gone", [_key(3)], peer=gone_addr)
    t0 = time.monotonic()
    assert _answer(cons, 3, gone) is Lookup.MISS and time.monotonic() - t0 < 5  # by the 1 s lookup deadline
    assert cons.lookup(_key(3), gone) is Lookup.MISS and cons.stats.named_peer_failures == 1
    assert cons.lookup(_key(4), LookupContext("req-gone-2", [_key(4)], peer=gone.peer)) is Lookup.MISS
    assert cons.stats.named_peer_failures == 2


def test_p2p_a_named_peer_that_is_no_address_is_a_miss_and_the_control_thread_goes_on(tiers):
    """A request naming a "peer" whose host no socket can dial (a lone surrogate, which zmq cannot encode)
    gets a miss; the control thread that owns every socket stays up and answers the next request's
    lookup at a real producer."""
    prod = tiers()
    assert _store_here(prod, [0, 1]) == ["ok", "ok"]
    cons = tiers(producers=[prod.address])
    for i, peer in ((5, "\ud800:5000"), (6, "\x00:5000")):
        assert _answer(cons, i, LookupContext(f"req-{peer!a}", [_key(i)], peer=peer)) is Lookup.MISS
    assert cons.stats.unlisted_peers == 2 and cons.stats.lookup_messages == 0  # not listed: never dialled
    assert _answer(cons, 1, LookupContext("req-good", [_key(1)], peer=prod.address)) is Lookup.HIT
    assert all(t.is_alive() for t in cons._threads)
    assert _load(cons, [1]).status == ("ok",)


def test_p2p_a_lookup_naming_the_lease_takes_it_over_and_the_fetch_frees_the_chunks(tiers):
    """A P/D consumer's lookup names its producer's lease (LookupContext.lease, the request's remote_lease):
    the producer moves those chunks from the lease to the lookup's pin, so the fetch frees them at once,
    not when the lease lapses; a chunk the lookup did not ask stays leased, and a lookup naming another
    lease (or none) takes nothing over."""
    prod = tiers(pin_s=0.2, max_bytes=4 * N)
    assert _store_here(prod, [0, 1, 2, 3]) == ["ok"] * 4
    lease = prod.lease([_key(0), _key(1), _key(2)], 30.0)
    cons = tiers(producers=[prod.address])
    other = LookupContext("req-other", [_key(2)], peer=prod.address, lease=lease + 1)
    assert _answer(cons, 2, other) is Lookup.HIT and prod.stats.lease_handovers == 0
    named = LookupContext("req-pd", [_key(0), _key(1)], peer=prod.address, lease=lease)
    assert _answer(cons, 0, named) is Lookup.HIT and cons.lookup(_key(1), named) is Lookup.HIT
    assert prod.stats.lease_handovers == 2
    r = _load(cons, [0, 1])
    assert r.status == ("ok", "ok") and _settles(lambda: prod.stats.served_chunks >= 2)
    assert prod.stats.served_chunks == 2
    np.testing.assert_array_equal(r.payloads[0], _payload(0))
    # 0 and 1 are free (the fetch released the lookup's pin); 2 is still leased and 3 was never leased
    time.sleep(0.3)  # past pin_s: the other lookup's pin on 2 lapsed, the lease has not
    assert _store_here(prod, [4, 5, 6], job_id=2) == ["ok"] * 3
    assert [prod.held_prefix([_key(i)]) for i in range(7)] == [0, 0, 1, 0, 1, 1, 1]


def test_p2p_lookup_retry_then_hit_or_miss_and_roundtrip(producer, tiers):
    """The first lookup is RETRY and sends the request's whole walk in one message; then hits and misses;
    a load brings the bytes in one fetch; the tier's own store answers at once."""
    p = producer()
    assert p.cmd("store", items=[0, 1, 2]) == ["ok"] * 3
    t = tiers(peers=[p.address])
    ctx = LookupContext("req-1", lambda: [_key(i) for i in range(5)])
    assert t.lookup(_key(0), ctx) is Lookup.RETRY
    assert _answer(t, 0, ctx) is Lookup.HIT
    assert [t.lookup(_key(i), ctx) for i in range(5)] == [Lookup.HIT] * 3 + [Lookup.MISS] * 2
    assert t.stats.lookup_messages == 1  # one message per (peer, request)
    assert t.lookup(_key(7)) is Lookup.MISS and t.stats.lookup_messages == 1  # no request: no round trip
    r = _load(t, [1, 0, 3])
    assert r.status == ("ok", "ok", "miss") and r.payloads[2] is None
    np.testing.assert_array_equal(r.payloads[0], _payload(1))
    np.testing.assert_array_equal(r.payloads[1], _payload(0))
    assert t.stats.fetches == 1 and t.stats.loaded_chunks == 2 and t.stats.load_bytes == 2 * N
    assert _settles(lambda: p.cmd("stats")["served_chunks"] >= 2)
    s = p.cmd("stats")
    assert s["pinned_chunks"] == 3 and s["served_chunks"] == 2 and s["served_bytes"] == 2 * N
    # what this tier stores it serves itself: a hit with no round trip
    t.submit_store(StoreJob(1, (_key(9),), (_payload(9),)))
    assert _answer(t, 9) is Lookup.HIT and t.stats.lookup_messages == 1
    np.testing.assert_array_equal(_load(t, [9]).payloads[0], _payload(9))


def test_p2p_pins_hold_against_eviction_until_the_deadline(producer, tiers):
    """A producer with room for three chunks pins the three a lookup hit: a store that needs their room
    fails rather than evict them; a fetch releases its pins; the rest lapse at the deadline, after which
    the chunk may go and its load is a miss."""
    p = producer(max_bytes=3 * N, pin_s=3.0)  # room for what runs under the pins on a busy machine
    p.cmd("store", items=[0, 1, 2])
    t = tiers(peers=[p.address])
    ctx = LookupContext("r", [_key(i) for i in range(3)])
    assert [_answer(t, i, ctx) for i in range(3)] == [Lookup.HIT] * 3
    looked = time.monotonic()
    assert p.cmd("store", items=[3]) == ["failed"]  # all three pinned: nothing evicted
    assert p.cmd("stats")["evicted_chunks"] == 0
    r = _load(t, [0, 1])
    assert r.status == ("ok", "ok")
    np.testing.assert_array_equal(r.payloads[1], _payload(1))
    assert p.cmd("store", items=[3]) == ["ok"]  # 0 and 1 are unpinned now: the least recently used goes
    s = p.cmd("stats")
    assert s["evicted_chunks"] == 1 and _key(2).hex() in s["held"] and s["pins_expired"] == 0
    time.sleep(max(0.0, looked + 3.1 - time.monotonic()))  # the pin on 2 lapses
    assert p.cmd("store", items=[4, 5]) == ["ok", "ok"]
    s = p.cmd("stats")
    assert _key(2).hex() not in s["held"] and s["pins_expired"] == 1
    assert _load(t, [2]).status == ("miss",)  # the hit lapsed with its pin, and the chunk is gone
    assert _answer(t, 2) is Lookup.MISS


def test_p2p_peer_killed_mid_transfer_is_a_miss_in_bounded_time(producer, tiers):
    """SIGKILL the producer after it sent half a chunk: the load ends at once (not at the 60 s transfer
    deadline) with every chunk a miss, and the dead peer is a miss for later lookups, without waiting."""
    p = producer()
    p.cmd("store", items=[0, 1, 2])
    t = tiers(peers=[p.address], transfer_timeout_s=60.0, lookup_timeout_s=0.5)
    ctx = LookupContext("r", [_key(i) for i in range(3)])
    assert [_answer(t, i, ctx) for i in range(3)] == [Lookup.HIT] * 3
    assert p.cmd("stall", n=1) == "armed"
    t.submit_load(LoadJob(7, tuple(_key(i) for i in range(3)), (N,) * 3))
    assert p.event()["event"] == "stalled"
    p.signal(signal.SIGKILL)
    end = time.monotonic() + 10
    while not (done := t.get_finished_jobs()):
        assert time.monotonic() < end, "the load hung on a dead peer"
        time.sleep(0.002)
    assert done[0].status == ("miss",) * 3 and done[0].payloads == (None,) * 3
    assert t.stats.fetch_failures == 1 and t.stats.loaded_chunks == 0 and t.stats.corrupt == 0
    assert t.lookup(_key(7), _ask(7)) is Lookup.MISS  # the peer is skipped for a while: no RETRY round


def test_p2p_missed_deadlines_are_misses(producer, tiers):
    """A producer that stalls mid-chunk makes the fetch a miss at transfer_timeout_s; a producer that is
    stopped (SIGSTOP: alive, its sockets open, nobody answering) makes the lookup a miss at
    lookup_timeout_s. Neither is a hang or a RETRY loop."""
    p = producer()
    p.cmd("store", items=[0, 1])
    t = tiers(peers=[p.address], transfer_timeout_s=0.5)
    assert [_answer(t, i, LookupContext("r", [_key(0), _key(1)])) for i in (0, 1)] == [Lookup.HIT] * 2
    p.cmd("stall", n=1)
    t0 = time.monotonic()
    r = _load(t, [0, 1])
    assert r.status == ("miss", "miss") and time.monotonic() - t0 < 5
    assert t.stats.transfer_timeouts == 1
    assert t.lookup(_key(0), _ask(0)) is Lookup.MISS  # a failed load is not fetched again at once
    p.pause()
    try:
        fresh = tiers(peers=[p.address], lookup_timeout_s=0.3)
        assert fresh.lookup(_key(1), _ask(1)) is Lookup.RETRY
        t0 = time.monotonic()
        assert _answer(fresh, 1) is Lookup.MISS and time.monotonic() - t0 < 5
        assert fresh.stats.lookup_timeouts == 1
    finally:
        p.resume()


def test_p2p_corrupted_payload_is_a_corrupt_miss(producer, tiers):
    """Bytes that changed after the producer stored them fail the CRC: a "corrupt" miss, never returned,
    and not fetched again; the chunks around it load."""
    p = producer()
    p.cmd("store", items=[0, 1, 2])
    assert p.cmd("corrupt", items=[1]) == 1
    t = tiers(peers=[p.address])
    assert [_answer(t, i, LookupContext("r", [_key(i) for i in range(3)])) for i in range(3)] == [Lookup.HIT] * 3
    r = _load(t, [0, 1, 2])
    assert r.status == ("ok", "corrupt", "ok") and r.payloads[1] is None
    np.testing.assert_array_equal(r.payloads[2], _payload(2))
    assert t.stats.corrupt == 1 and t.stats.loaded_chunks == 2
    assert t.lookup(_key(1), _ask(1)) is Lookup.MISS


def test_p2p_malformed_requests_are_dropped_and_serving_goes_on(tiers):
    """Garbage on the control socket and on the data socket is counted and dropped; the tier still
    answers a real lookup and fetch afterwards."""
    a = tiers()
    a.submit_store(StoreJob(1, (_key(0),), (_payload(0),)))
    while not a.get_finished_jobs():
        time.sleep(0.001)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{a.address}")
        dealer.send(b"\x93not msgpack at all")
        dealer.send(msgspec.msgpack.encode({"type": "lookup", "lookup_id": 1, "req_id": "r", "keys": [b"short"]}))
    finally:
        ctx.destroy(linger=2000)  # delivered, or dropped after 2 s
    for junk in (b"GKVF" + (1 << 31).to_bytes(4, "little"), REQUEST.pack(b"GKVF", 5) + b"\xc1\xc1\xc1\xc1\xc1",
                 b"GET / HTTP/1.0\r\n\r\n"):
        with socket.create_connection((HOST, a.data_port), timeout=5) as s:
            s.sendall(junk)
            try:
                s.shutdown(socket.SHUT_WR)
                got = s.recv(FRAME.size)
            except OSError:  # it hung up first
                got = b""
            assert got == b""  # nothing served, the connection closed
    end = time.monotonic() + 5
    while a.stats.bad_messages < 5 and time.monotonic() < end:
        time.sleep(0.01)
    assert a.stats.bad_messages == 5
    b = tiers(peers=[a.address])
    assert _answer(b, 0) is Lookup.HIT
    np.testing.assert_array_equal(_load(b, [0]).payloads[0], _payload(0))


def test_p2p_kv_events_announce_stores_and_evictions_without_pins(tiers):
    """With KV events on, the tier set confirms each finished store with a bare lookup: the chunk is
    announced, nothing is pinned (a pin would hold it against eviction) and no peer is asked; chunks the
    store evicts are reported removed."""
    class Sink:
        def __init__(self):
            self.stored, self.removed = [], []

        def tier_store_finished(self, tier, key, held):
            self.stored.append((key, held))

        def tier_removed(self, tier, keys):
            self.removed += keys

    t = tiers(max_bytes=2 * N, peers=[f"{HOST}:{free_port()}"])  # nobody there: a bare lookup must not ask
    assert (t.kv_event_medium, t.kv_event_locality, t.kv_event_ownership) == ("CPU", "LOCAL", "p2p")
    ts, sink = TierSet([t]), Sink()
    ts.attach_events(sink)
    for i in range(3):
        ts.store([_key(i)], [_payload(i)])
        end = time.monotonic() + 10
        while len(sink.stored) <= i:
            assert time.monotonic() < end, "a store was never reported"
            ts.poll()
            time.sleep(0.002)
    assert sink.stored == [(_key(i), True) for i in range(3)] and sink.removed == [_key(0)]
    assert not t._pinned and t.stats.lookup_messages == 0 and t.stats.evicted_chunks == 1


def test_p2p_options_are_checked():
    with pytest.raises(ValueError, match=r"unknown keys \['peer'\] \(allowed: .*'peers'"):
        make_tier({"type": "p2p", "host": HOST, "port": 5710, "peer": "x:1"}, FP)
    with pytest.raises(ValueError, match="needs host"):
        make_tier({"type": "p2p", "port": 5710}, FP)
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\]"):
        make_tier({"type": "p2p", "host": HOST, "port": "5710"}, FP)
    with pytest.raises(ValueError, match="each of peers must be 'host:port'"):
        make_tier({"type": "p2p", "host": HOST, "port": 0, "peers": ["10.0.0.1"]}, FP)
    with pytest.raises(ValueError, match="pin_s must be a positive number"):
        make_tier({"type": "p2p", "host": HOST, "port": 0, "pin_s": 0}, FP)
    with pytest.raises(ValueError, match="max_bytes"):
        DeployConfig(kv_transfer_config=_ktc({"type": "p2p", "host": HOST, "port": 0, "max_bytes": -1}))
    a = make_tier({"type": "p2p", "host": HOST, "port": 0}, FP)
    try:
        with pytest.raises(ValueError, match=f"cannot bind its control socket on {HOST}:{a.port}"):
            make_tier({"type": "p2p", "host": HOST, "port": a.port}, FP)
        assert isinstance(a, PeerTier) and a.name == "p2p"
    finally:
        a.shutdown()
        a.shutdown()  # idempotent


# --------------------------------------------------------------------------------- behind the host tier
# test_tiers' deployment (the same compiled programs) and the session's reference prompts: 37, 5, 70 and
# 20 tokens, 5 greedy tokens each
BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
STORED = 2 * sum((n + 4) // 8 for n in (37, 5, 70, 20))  # full pages once each request is done, both groups
HIT_BLOCKS = sum((n - 1) // 8 for n in (37, 5, 70, 20))  # full pages short of each prompt's last token


def _ktc(tier: dict) -> dict:
    return {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}}


def _p2p(**opts) -> dict:
    return {"type": "p2p", "host": HOST, "port": 0, **opts}


def _generate(model, prompts, tier: dict):
    eng = Engine(model, DeployConfig(**BASE, kv_transfer_config=_ktc(tier)))
    try:
        out = [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5)]
    finally:
        eng.shutdown()
    return eng, out


@pytest.fixture(scope="module")
def first(small_model, small_reference):
    """Engine A: runs the reference prompts with a peer tier and no peers; it stays up, serving every
    chunk it stored, for the module."""
    prompts, want = small_reference
    eng = Engine(small_model, DeployConfig(**BASE, kv_transfer_config=_ktc(_p2p())))
    assert [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5)] == want
    # the last pages' stores are still on the peer tier's thread when generate returns (a loaded machine
    # showed 34 of 36): the tests below read what A holds once they have landed
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and first_stored(eng) < eng.metrics()["kv_offload"]["cpu"]["stored_pages"]:
        time.sleep(0.05)
    yield eng
    eng.shutdown()


def first_stored(eng) -> int:
    return eng.metrics()["kv_offload"]["p2p"]["stored_chunks"]


def test_a_second_engine_fetches_every_full_page_from_the_first(small_model, small_reference, first):
    """A stored every full page through its host tier to its peer tier; B (empty pools, A as its one peer)
    looks each prompt's pages up in one message, fetches them and prefills only the last partial page:
    the reference's tokens, the hits counted in chunks and bytes on both sides."""
    prompts, want = small_reference
    a_tier = first.tiers[0].tiers[0]
    m = first.metrics()["kv_offload"]
    assert m["p2p"]["stored_chunks"] == m["cpu"]["stored_pages"] == STORED
    assert m["p2p"]["store_bytes"] == m["cpu"]["store_bytes"]
    second, out = _generate(small_model, prompts, _p2p(peers=[a_tier.address]))
    assert out == want
    p2p = second.metrics()["kv_offload"]["p2p"]
    assert p2p["hits"] == p2p["loaded_chunks"] == 2 * HIT_BLOCKS
    assert p2p["misses"] == p2p["corrupt"] == p2p["lost"] == 0
    assert p2p["load_bytes"] == HIT_BLOCKS * sum(second.sizes.page_bytes.values())
    assert p2p["lookup_messages"] == 3  # one per prompt with a full page (the 5-token one has none)
    assert p2p["load_jobs"] == 2 * HIT_BLOCKS and p2p["load_time_s"] > 0  # the host side submits a job per chunk
    assert second.scheduler.stats.prefix_hit_tokens == 8 * HIT_BLOCKS
    served = first.metrics()["kv_offload"]["p2p"]
    assert served["served_chunks"] == served["pinned_chunks"] == 2 * HIT_BLOCKS


@pytest.fixture(scope="module")
def chunks(first, tmp_path_factory):
    """Every chunk A's peer tier holds, in a file a producer process loads."""
    path = tmp_path_factory.mktemp("chunks") / "chunks.npz"
    a_tier = first.tiers[0].tiers[0]
    with a_tier._lock:
        held = {k.hex(): np.frombuffer(e.data, np.uint8) for k, e in a_tier._store.items()}
    np.savez(path, **held)
    return path, len(held)


@pytest.mark.parametrize("fault", ["kill", "deadline", "corrupt"])
def test_engine_requests_survive_peer_faults(small_model, small_reference, chunks, producer, fault):
    """B's one peer is a producer process holding A's chunks, and it fails: killed while sending the first
    chunk, stalled past the transfer deadline, or serving chunks whose bytes went bad. Every request
    finishes with the reference's tokens, and the counters say what happened."""
    prompts, want = small_reference
    path, count = chunks
    p = producer()
    assert p.cmd("store_file", path=str(path)) == ["ok"] * count
    if fault == "corrupt":
        assert p.cmd("corrupt", every=2) == (count + 1) // 2
    else:
        p.cmd("stall", n=1)
    if fault == "kill":  # SIGKILL as soon as it has sent half of a chunk
        threading.Thread(target=lambda: (p.event(timeout=120), p.signal(signal.SIGKILL)), daemon=True).start()
    tier = _p2p(peers=[p.address], lookup_timeout_s=0.5, transfer_timeout_s=60.0 if fault == "kill" else 1.0)
    eng, out = _generate(small_model, prompts[:2], tier)
    assert out == want[:2]
    m = eng.metrics()["kv_offload"]["p2p"]
    asked = 2 * ((37 - 1) // 8)  # the 37-token prompt's full pages; the 5-token one has none
    if fault == "corrupt":
        assert m["corrupt"] >= 1 and m["hits"] >= 1 and m["lost"] == 0
        assert m["hits"] + m["corrupt"] <= asked
    else:
        assert m["lost"] >= 1 and m["corrupt"] == 0 and m["hits"] + m["lost"] <= asked
        assert m["transfer_timeouts" if fault == "deadline" else "fetch_failures"] >= 1
    if fault == "kill":
        assert p.proc.wait(10) == -signal.SIGKILL


_ENGINE_A = """
import json, sys, numpy as np, jax, glm53
from glm53 import DeployConfig, Engine
from tests.models import small_model
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
tier = {"type": "p2p", "host": "127.0.0.1", "port": 0}
ktc = {"kv_connector": "OffloadingConnector",
       "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}}
eng = Engine(small_model(), DeployConfig(**BASE, kv_transfer_config=ktc))
prompts = [np.array(p, np.int32) for p in json.loads(sys.argv[1])]
out = [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5)]
print(json.dumps({"out": out, "address": eng.tiers[0].tiers[0].address}), flush=True)
sys.stdin.readline()  # serve until the other engine is done
print(json.dumps(eng.metrics()["kv_offload"]["p2p"]), flush=True)
"""


@pytest.mark.slow
def test_two_engine_processes_share_kv_through_peers(small_model, small_reference):
    """Engine A in its own process runs the prompts and serves; this process's engine, with A as its peer,
    gets every full page from it and the same tokens."""
    prompts, want = small_reference
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("GLM53_TEST_COMPILE_CACHE", "")}  # shared by peers (conftest)
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE_A, json.dumps([p.tolist() for p in prompts])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        a = json.loads(lines.get(timeout=600))
        assert a["out"] == want
        eng, out = _generate(small_model, prompts, _p2p(peers=[a["address"]]))
        assert out == want
        m = eng.metrics()["kv_offload"]["p2p"]
        assert m["hits"] == 2 * HIT_BLOCKS and m["misses"] == m["corrupt"] == m["lost"] == 0
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert json.loads(lines.get(timeout=60))["served_chunks"] == 2 * HIT_BLOCKS
    finally:
        proc.kill()
        proc.wait(10)
