"""Trust and bad days at the tiers (issue 51), host-side, with real processes on loopback where a peer or a
server is involved: a producer process whose chunks carry a valid CRC but a MAC made without the shared
secret, or with another one; a chunk planted in a shared filesystem root by a writer without the secret;
requests naming 300 peers nobody listed; a flood of data connections against a producer's memory; an
S3-compatible server (written here) that trickles an object's body; and a filesystem root that cannot be
written, a corrupt chunk that cannot be deleted, a killed writer's temporary files, max_bytes "auto"."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvcache.tiers import LoadJob, Lookup, LookupContext, StoreJob, chunk_key, make_tier
from kvcache.tiers import fs as fs_mod
from kvcache.tiers.fs import AUTO_FRACTION, TMP_MAX_AGE_S, FileTier
from kvcache.tiers.p2p import MAX_DATA_CONNECTIONS, MAX_REQUEST, REQUEST, PeerTier

REPO = Path(__file__).resolve().parents[2]
FP = "cd" * 32
N = 4096
HOST = "127.0.0.1"


def _key(i: int) -> bytes:
    return chunk_key(FP, "mla", i.to_bytes(32, "little"))


def _payload(i: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def _secret(tmp_path, name: str, value: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(value)
    return str(p)


def _wait_job(tier, kind: str, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while not (done := [r for r in tier.get_finished_jobs() if r.kind == kind]):
        assert time.monotonic() < end, f"no {kind} finished in {timeout} s"
        time.sleep(0.002)
    return done[0]


def _answer(tier, i: int, ctx, timeout: float = 10.0) -> Lookup:
    end = time.monotonic() + timeout
    while (r := tier.lookup(_key(i), ctx)) is Lookup.RETRY:
        assert time.monotonic() < end
        time.sleep(0.002)
    return r


# A producer process: a peer tier (options from argv) holding chunks 0..3. "forge" replaces chunk i's bytes
# with others and recomputes their CRC (a liar, not damage) but not their MAC; it prints its port and RSS.
_PRODUCER = """
import json, sys, time, zlib
import numpy as np
from kvcache.tiers import StoreJob, chunk_key
from kvcache.tiers.p2p import PeerTier, _Entry
FP = "cd" * 32
key = lambda i: chunk_key(FP, "mla", i.to_bytes(32, "little"))
tier = PeerTier(fingerprint=FP, host="127.0.0.1", port=0, **json.loads(sys.argv[1]))
tier.submit_store(StoreJob(1, tuple(key(i) for i in range(4)),
                           tuple(np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(4))))
while not tier.get_finished_jobs():
    time.sleep(0.001)
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
print(json.dumps({"port": tier.port, "data_port": tier.data_port}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "forge":
        with tier._lock:
            k = key(cmd["i"]); e = tier._store[k]
            data = bytes(255 - b for b in e.data)
            tier._store[k] = _Entry(data, zlib.crc32(data), e.mac)
    elif cmd["op"] == "rss":
        pass
    elif cmd["op"] == "stats":
        with tier._lock:
            print(json.dumps({k: v for k, v in tier.stats.__dict__.items() if isinstance(v, int)}), flush=True)
            continue
    print(json.dumps({"rss": rss()}), flush=True)
"""


class Producer:
    def __init__(self, **opts):
        self.proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, json.dumps(opts)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        info = json.loads(self.proc.stdout.readline())
        self.port, self.data_port = info["port"], info["data_port"]
        self.address = f"{HOST}:{self.port}"

    def cmd(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def procs():
    made = []
    yield made
    for p in made:
        p.close()


def _named(i: int, peer: str) -> LookupContext:
    return LookupContext(f"req-{i}-{peer}", [_key(i)], peer=peer)


def test_a_listed_producer_with_a_valid_crc_but_a_wrong_mac_is_refused(tmp_path, procs, tiers):
    """A producer with the shared secret serves its chunks; after it replaces chunk 1's bytes and their
    CRC (the CRC proves nothing: the sender computes it), the consumer refuses them ("corrupt", counted in
    auth_failures), never returns them. A producer with another secret is never believed: its answers
    fail their MAC, so every lookup is a miss and nothing is fetched."""
    good = _secret(tmp_path, "good", b"s" * 32)
    prod = Producer(secret_file=good)
    procs.append(prod)
    cons = tiers(producers=[prod.address], secret_file=good)
    assert _answer(cons, 0, _named(0, prod.address)) is Lookup.HIT
    cons.submit_load(LoadJob(1, (_key(0),), (N,)))
    r = _wait_job(cons, "load")
    assert r.status == ("ok",)
    np.testing.assert_array_equal(r.payloads[0], _payload(0))
    prod.cmd("forge", i=1)
    assert _answer(cons, 1, _named(1, prod.address)) is Lookup.HIT
    cons.submit_load(LoadJob(2, (_key(1),), (N,)))
    r = _wait_job(cons, "load")
    assert r.status == ("corrupt",) and r.payloads == (None,) and cons.stats.auth_failures == 1

    liar = Producer(secret_file=_secret(tmp_path, "other", b"o" * 32))
    procs.append(liar)
    cons2 = tiers(producers=[liar.address], secret_file=good, lookup_timeout_s=0.5)
    assert _answer(cons2, 2, _named(2, liar.address)) is Lookup.MISS  # it holds chunk 2, but cannot say so
    assert cons2.stats.named_peer_failures == 1 and cons2.stats.fetches == 0 and cons2.stats.loaded_chunks == 0
    liar_stats = liar.cmd("stats")
    assert liar_stats["auth_failures"] >= 1 and liar_stats["pinned_chunks"] == 0  # our lookup was not its to read
    stranger = tiers(producers=[prod.address], secret_file=_secret(tmp_path, "third", b"t" * 32),
                     lookup_timeout_s=0.5)
    assert _answer(stranger, 0, _named(0, prod.address)) is Lookup.MISS  # a peer without our secret gets nothing
    st = prod.cmd("stats")
    assert st["auth_failures"] >= 1 and st["served_chunks"] == 2  # 0 and the forged 1, both to `cons` alone


def test_peers_off_loopback_need_a_secret(tmp_path):
    """Without a shared secret the peer tier refuses to listen or dial anywhere but loopback; the secret
    comes from a file (secret_file or $GLM53_KV_SECRET_FILE) of at least 16 bytes."""
    with pytest.raises(ValueError, match="not a loopback address.*GLM53_KV_SECRET_FILE"):
        PeerTier(fingerprint=FP, host=HOST, port=0, producers=["10.1.2.3:5000"])
    with pytest.raises(ValueError, match="holds 3 bytes"):
        PeerTier(fingerprint=FP, host=HOST, port=0, secret_file=_secret(tmp_path, "short", b"abc\n"))
    with pytest.raises(ValueError, match="cannot read the shared secret file"):
        PeerTier(fingerprint=FP, host=HOST, port=0, secret_file=str(tmp_path / "absent"))


def test_300_request_named_peers_change_nothing(procs, tiers):
    """300 requests each naming a peer nobody listed (one of them a port that listens): each is a miss,
    nothing is dialled, the peer table does not grow, and the listed producer still serves."""
    prod = Producer()
    procs.append(prod)
    cons = tiers(producers=[prod.address])
    trap = socket.socket()
    trap.bind((HOST, 0))
    trap.listen(16)
    trap.settimeout(0.5)
    peers = [f"{HOST}:{trap.getsockname()[1]}"] + [f"127.0.0.{1 + i // 200}:{20000 + i}" for i in range(299)]
    for i, peer in enumerate(peers):
        assert cons.lookup(_key(100 + i), _named(100 + i, peer)) is Lookup.MISS
    assert cons.stats.unlisted_peers == 300 and cons.stats.lookup_messages == 0 and len(cons._peers) == 0
    with pytest.raises(socket.timeout):
        trap.accept()  # nobody dialled it
    trap.close()
    assert _answer(cons, 3, _named(3, prod.address)) is Lookup.HIT
    cons.submit_load(LoadJob(1, (_key(3),), (N,)))
    assert _wait_job(cons, "load").status == ("ok",)


def test_a_connection_flood_stays_within_a_memory_bound(procs, tiers):
    """Connections to a producer's data socket that announce huge fetch requests (64 MiB, the old limit)
    or the largest allowed one and then send nothing cost at most MAX_DATA_CONNECTIONS x MAX_REQUEST
    bytes and threads: the producer's RSS grows by less than 64 MiB under 60 of them (before the bound,
    8 connections grew it by 256 MiB). Once they are gone a consumer fetches again."""
    prod = Producer(transfer_timeout_s=30.0)  # a flooding connection holds its slot for the whole test
    procs.append(prod)
    before = prod.cmd("rss")["rss"]
    flood = []
    for i in range(60):
        s = socket.create_connection((HOST, prod.data_port), timeout=5)
        n = (64 << 20) if i % 4 == 0 else MAX_REQUEST
        try:
            s.sendall(REQUEST.pack(b"GKVF", n) + b"\x00" * 64)
        except OSError:  # refused at once: the producer is full
            pass
        flood.append(s)
    time.sleep(1.0)  # every accepted one has read its header and allocated what it would
    grown = prod.cmd("rss")["rss"] - before
    assert grown < 64 << 20, f"the producer's RSS grew by {grown / 2**20:.0f} MiB under the flood"
    assert prod.cmd("stats")["connections_refused"] >= 45 - MAX_DATA_CONNECTIONS  # 45 hold a slot until their deadline
    for s in flood:
        s.close()
    cons = tiers(producers=[prod.address])
    end = time.monotonic() + 15
    while True:  # the producer's slots free as their connections close
        assert _answer(cons, 2, _named(2, prod.address)) is Lookup.HIT
        cons.submit_load(LoadJob(1, (_key(2),), (N,)))
        if _wait_job(cons, "load").status == ("ok",):
            break
        assert time.monotonic() < end
        time.sleep(0.5)


# ------------------------------------------------------------------------------------- shared roots
def test_a_chunk_planted_in_a_shared_fs_root_is_refused(tmp_path):
    """Two engines share a root and a secret. A writer without the secret (its own tier on the same root)
    plants a chunk under a key a victim will look up: well formed, its CRC right, its MAC absent. The
    reader holding the secret refuses it ("corrupt", deleted) and reads a holder's chunk."""
    secret = _secret(tmp_path, "kv.secret", b"k" * 40)
    root = tmp_path / "shared"
    attacker = FileTier(fingerprint=FP, root_dir=root)
    attacker.submit_store(StoreJob(1, (_key(7),), (_payload(99),)))
    assert _wait_job(attacker, "store").status == ("ok",)
    holder = FileTier(fingerprint=FP, root_dir=root, secret_file=secret)
    holder.submit_store(StoreJob(2, (_key(8),), (_payload(8),)))
    assert _wait_job(holder, "store").status == ("ok",)
    reader = FileTier(fingerprint=FP, root_dir=root, secret_file=secret)
    assert reader.lookup(_key(7)) is Lookup.HIT  # a stat: the file is there until a load verifies it
    reader.submit_load(LoadJob(3, (_key(7), _key(8)), (N, N)))
    r = _wait_job(reader, "load")
    assert r.status == ("corrupt", "ok") and r.payloads[0] is None
    np.testing.assert_array_equal(r.payloads[1], _payload(8))
    assert reader.lookup(_key(7)) is Lookup.MISS and not reader.path(_key(7)).exists()
    for t in (attacker, holder, reader):
        t.shutdown()


def test_an_unwritable_root_disables_the_tier_with_one_warning(caplog):
    """A root the process cannot write (here under /sys, read-only in any container or host) disables
    the tier instead of failing the engine's start: lookups miss, stores fail, loads miss."""
    if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("/sys is writable here")
    tier = make_tier({"type": "fs", "root_dir": "/sys/glm53-kv-test"}, FP)  # as the engine builds it: no error
    assert tier.disabled and tier.max_bytes is None
    assert sum("the tier is disabled" in r.getMessage() for r in caplog.records) == 1
    assert tier.lookup(_key(1)) is Lookup.MISS
    tier.submit_store(StoreJob(1, (_key(1),), (_payload(1),)))
    assert _wait_job(tier, "store").status == ("failed",)
    tier.submit_load(LoadJob(2, (_key(1),), (N,)))
    assert _wait_job(tier, "load").status == ("miss",)
    tier.shutdown()


def test_a_corrupt_chunk_that_cannot_be_deleted_is_remembered_as_a_miss(tmp_path, monkeypatch):
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    tier.submit_store(StoreJob(1, (_key(1),), (_payload(1),)))
    _wait_job(tier, "store")
    p = tier.path(_key(1))
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    monkeypatch.setattr(fs_mod, "_unlink", lambda path: False)  # a read-only directory
    assert tier.lookup(_key(1)) is Lookup.HIT
    tier.submit_load(LoadJob(2, (_key(1),), (N,)))
    assert _wait_job(tier, "load").status == ("corrupt",)
    assert p.exists() and tier.lookup(_key(1)) is Lookup.MISS
    tier.shutdown()


def test_temp_files_are_reclaimed_by_age_and_owner_not_pid(tmp_path):
    """A killed writer's temporary file carries a pid that is alive again (here: ours, as a restarted
    container's); once older than TMP_MAX_AGE_S it is reclaimed at start. A young one stays (a writer may
    be at it)."""
    d = tmp_path / FP[:32] / "ab"
    d.mkdir(parents=True)
    old, young = d / f".{'ab' * 32}.kv.{os.getpid()}.1.tmp", d / f".{'ac' * 32}.kv.{os.getpid()}.2.tmp"
    old.write_bytes(b"x" * 100)
    young.write_bytes(b"x" * 100)
    then = time.time() - TMP_MAX_AGE_S - 10
    os.utime(old, (then, then))
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    assert not old.exists() and young.exists()
    tier.shutdown()


def test_fs_max_bytes_auto_is_a_fraction_of_the_free_space(tmp_path):
    lo = shutil.disk_usage(tmp_path).free
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    hi = shutil.disk_usage(tmp_path).free
    assert int(AUTO_FRACTION * min(lo, hi)) - (1 << 20) <= tier.max_bytes <= int(AUTO_FRACTION * max(lo, hi)) + (1 << 20)
    assert FileTier(fingerprint=FP, root_dir=tmp_path, max_bytes=None).max_bytes is None
    tier.shutdown()


# ------------------------------------------------------------------------------- a trickling server
# An S3-compatible server that lists an empty bucket and answers every GET of an object with its full
# Content-Length, then one byte every 0.2 s: each wait for bytes is well within a read timeout.
_TRICKLE = """
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        if "list-type" in self.path:
            body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                    b'2006-03-01/"><Name>b</Name><Prefix></Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>'
                    b'<IsTruncated>false</IsTruncated></ListBucketResult>')
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", sys.argv[1])
        self.end_headers()
        try:
            for _ in range(int(sys.argv[1])):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def test_a_trickling_s3_server_is_a_miss_within_its_deadline():
    """The read timeout bounds each wait for bytes, not the body: a server trickling a byte every 0.2 s
    would hold a load for hours. deadline_s bounds the whole load: it is a miss, counted in
    deadline_misses, within the deadline (plus the scheduling slack of a loaded machine)."""
    from kvcache.tiers.format import HEADER
    from kvcache.tiers.obj import ObjectTier

    server = subprocess.Popen([sys.executable, "-c", _TRICKLE, str(HEADER.size + N)], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())
        tier = ObjectTier(fingerprint=FP, bucket="trickle", endpoint_override=f"http://127.0.0.1:{port}",
                          access_key="k", secret_key="s", region="us-east-1", timeout_s=1.0, max_attempts=2,
                          deadline_s=2.0, refresh_s=None)
        t0 = time.monotonic()
        tier.submit_load(LoadJob(1, (_key(1),), (N,)))
        r = _wait_job(tier, "load", timeout=30)
        took = time.monotonic() - t0
        assert r.status == ("miss",) and tier.stats.deadline_misses == 1
        assert took < 2.0 + 2.0, f"the load took {took:.1f} s with a 2 s deadline"
        tier.shutdown(wait=False)
    finally:
        server.kill()
        server.wait(10)


def test_a_load_past_the_fs_deadline_is_a_miss_and_its_late_result_dropped(tmp_path, monkeypatch):
    """A read that blocks (a hung network mount; here the reader waits on an event) is answered "miss"
    by deadline_s, counted, and the request goes on; the read's own result, when it comes, is dropped."""
    tier = FileTier(fingerprint=FP, root_dir=tmp_path, deadline_s=0.3)
    tier.submit_store(StoreJob(1, (_key(1),), (_payload(1),)))
    _wait_job(tier, "store")
    hung, read = threading.Event(), tier._read
    monkeypatch.setattr(tier, "_read", lambda key, size: hung.wait(30) and read(key, size))
    tier.submit_load(LoadJob(2, (_key(1),), (N,)))
    r = _wait_job(tier, "load", timeout=10)
    assert r.status == ("miss",) and tier.stats.deadline_misses == 1
    hung.set()
    time.sleep(0.2)
    assert tier.get_finished_jobs() == []  # the late result is not a second answer
    tier.submit_load(LoadJob(3, (_key(1),), (N,)))  # the mount is back
    assert _wait_job(tier, "load").status == ("ok",)
    tier.shutdown()


def test_a_store_begins_no_write_past_the_fs_deadline(tmp_path, monkeypatch):
    """A store whose first write blocks (a hung mount) past deadline_s writes nothing more: its other
    chunks are "failed", counted in store_failed and deadline_misses, and their keys are free again
    (lookups stop answering RETRY for them); a store after the mount is back writes them."""
    tier = FileTier(fingerprint=FP, root_dir=tmp_path, deadline_s=0.3)
    hung, write = threading.Event(), tier._write
    monkeypatch.setattr(tier, "_write", lambda key, data: hung.wait(30) and write(key, data))
    keys = tuple(_key(i) for i in range(3))
    tier.submit_store(StoreJob(1, keys, tuple(_payload(i) for i in range(3))))
    time.sleep(0.5)  # past the deadline, the first write still blocked
    hung.set()
    r = _wait_job(tier, "store")
    assert r.status == ("ok", "failed", "failed"), r.status
    assert tier.stats.deadline_misses == 2 and tier.stats.store_failed == 2
    assert [tier.lookup(k) for k in keys] == [Lookup.HIT, Lookup.MISS, Lookup.MISS]
    monkeypatch.setattr(tier, "_write", write)
    tier.submit_store(StoreJob(2, keys[1:], tuple(_payload(i) for i in (1, 2))))
    assert _wait_job(tier, "store").status == ("ok", "ok")
    tier.shutdown()
