"""The object-store tier (kvcache.tiers.obj) against a real S3-compatible server: moto's server in a
process of its own on loopback, which a test can stop, start again (empty: moto keeps objects in
memory) or pause with SIGSTOP (a hung server: connections accepted, never answered). First the tier
alone (names, verification, its index, capacity, outages, credentials), then behind the offload host
tier in the engine, where every request must give the same greedy tokens as an engine without tiers
whatever the server did, with the counters saying what happened."""

import itertools
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import boto3
import numpy as np
import pytest

from glm53 import DeployConfig, Engine, SamplingParams
from kvcache.tiers import Lookup, LoadJob, StoreJob, make_tier
from kvcache.tiers.format import HEADER, chunk_name
from kvcache.tiers.fs import FileTier
from kvcache.tiers.obj import ObjectTier
from parallel.launch import free_port
from tests import processes
from tests.kvcache.test_tiers import BASE, FP, HIT_BLOCKS, STORED, _key, _load, _payload, _store, _wait

# fast failure settings for tests: a dead server is found out in well under a second
FAST = dict(timeout_s=1.0, max_attempts=2, backoff_s=0.01, down_s=0.3, refresh_s=None)


class MotoServer:
    """`python -m moto.server` on a free loopback port, in its own process."""

    def __init__(self, log_dir):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"moto-{self.port}.log"
        self.proc = None

    def start(self, timeout: float = 60.0) -> "MotoServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                opener.open(self.url + "/", timeout=1.0).close()
                return self
            except urllib.error.HTTPError:  # an answer, so it is up
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto server did not answer within {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            processes.resume(self.proc)  # a paused server dies too
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        processes.pause(self.proc)

    def resume(self) -> None:
        processes.resume(self.proc)

    def client(self):
        return boto3.session.Session().client("s3", endpoint_url=self.url, region_name="us-east-1")

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="module", autouse=True)
def aws_env():
    """Dummy credentials from the environment (the tier's default), and nothing of the machine's AWS
    setup: no config files, no instance metadata lookups, no proxy for loopback."""
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
                  "AWS_ENDPOINT_URL_S3"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing-env-key")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing-env-secret")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One server for the tests that do not stop it (each uses buckets of its own)."""
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.stop()


@pytest.fixture
def own_s3(tmp_path):
    """A server of this test's own, to stop, pause and start again."""
    server = MotoServer(tmp_path).start()
    yield server
    server.stop()


_names = itertools.count()


@pytest.fixture
def bucket(s3):
    return s3.bucket(f"kv-test-{next(_names)}")


def _tier(server, bucket, **kw) -> ObjectTier:
    """A tier whose first listing has finished (its lookups answer from the index)."""
    tier = ObjectTier(fingerprint=FP, bucket=bucket, endpoint_override=server.url, **{**FAST, **kw})
    _ready(tier)
    return tier


def _ready(tier, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while tier.lookup(b"\0" * 32) is Lookup.RETRY:
        assert time.monotonic() < end, "the tier's first listing never finished"
        time.sleep(0.005)


def _requests(tier) -> list:
    """Every request the tier's client sends from now on: (operation, Authorization header)."""
    seen = []

    def record(request, event_name, **_):
        seen.append((event_name.rsplit(".", 1)[-1], request.headers.get("Authorization", b"")))

    tier._client.meta.events.register("before-send.s3", record)
    return seen


def _objects(server, bucket) -> dict:
    """name -> bytes of every object in the bucket."""
    c = server.client()
    names = [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", ())]
    return {n: c.get_object(Bucket=bucket, Key=n)["Body"].read() for n in names}


# ----------------------------------------------------------------------------------- the tier alone
def test_obj_roundtrip_names_blobs_and_lookup_without_network(s3, bucket, tmp_path):
    tier = _tier(s3, bucket)
    sent = _requests(tier)
    assert tier.lookup(_key(0)) is Lookup.MISS
    assert _store(tier, [0, 1]) == ("ok", "ok")
    assert tier.lookup(_key(0)) is Lookup.HIT and tier.lookup(_key(2)) is Lookup.MISS
    assert [op for op, _ in sent] == ["PutObject"] * 2  # lookups answer from the index
    r = _load(tier, [1, 0, 2])
    assert r.status == ("ok", "ok", "miss") and r.payloads[2] is None
    np.testing.assert_array_equal(r.payloads[0], _payload(1))
    np.testing.assert_array_equal(r.payloads[1], _payload(0))
    assert tier.stats.stored_chunks == 2 and tier.stats.store_bytes == 2 * 4096
    assert tier.stats.loaded_chunks == 2 and tier.stats.load_bytes == 2 * 4096 and tier.stats.io_errors == 0
    # one object per chunk, named and laid out byte for byte as the filesystem tier's files
    fs = FileTier(fingerprint=FP, root_dir=tmp_path)
    _store(fs, [0, 1])
    files = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*.kv")}
    assert _objects(s3, bucket) == files and len(files) == 2
    # a chunk stored again is not sent again (its name is its content)
    assert _store(tier, [0]) == ("ok",) and [op for op, _ in sent].count("PutObject") == 2
    tier.shutdown()
    fs.shutdown()


def test_obj_reads_a_filesystem_root_synced_to_the_bucket(s3, bucket, tmp_path):
    """`aws s3 sync ROOT s3://BUCKET`: the same names and blobs, so the object tier loads them."""
    fs = FileTier(fingerprint=FP, root_dir=tmp_path)
    _store(fs, [3, 4])
    c = s3.client()
    for p in tmp_path.rglob("*.kv"):
        c.put_object(Bucket=bucket, Key=p.relative_to(tmp_path).as_posix(), Body=p.read_bytes())
    tier = _tier(s3, bucket)
    assert tier.stats.listed_chunks == 2 and tier.lookup(_key(3)) is Lookup.HIT
    r = _load(tier, [4, 3])
    assert r.status == ("ok", "ok")
    np.testing.assert_array_equal(r.payloads[0], _payload(4))
    fs.shutdown()
    tier.shutdown()


def test_obj_lookup_answers_retry_while_its_store_is_in_flight(s3, bucket):
    import threading

    tier = _tier(s3, bucket, write_threads=1)
    gate = threading.Event()
    tier._client.meta.events.register("before-send.s3.PutObject", lambda **_: gate.wait(10) and None)
    tier.submit_store(StoreJob(1, (_key(0),), (_payload(0),)))
    assert tier.lookup(_key(0)) is Lookup.RETRY and tier.pending_stores() == 1
    gate.set()
    _wait(tier, "store", 1)
    assert tier.lookup(_key(0)) is Lookup.HIT and tier.pending_stores() == 0
    tier.shutdown()


def test_obj_chunks_of_one_job_are_requests_in_parallel(s3, bucket):
    """A store job of three chunks is three PUTs in flight at once (a host store of 64 pages is one job)."""
    import threading

    tier = _tier(s3, bucket, write_threads=3)
    gate, held = threading.Event(), []
    tier._client.meta.events.register("before-send.s3.PutObject", lambda **_: held.append(1) or gate.wait(10) and None)
    tier.submit_store(StoreJob(1, tuple(_key(i) for i in range(3)), tuple(_payload(i) for i in range(3))))
    end = time.monotonic() + 10
    while len(held) < 3 and time.monotonic() < end:
        time.sleep(0.005)
    assert len(held) == 3 and tier.pending_stores() == 3 and tier.get_finished_jobs() == []
    gate.set()
    assert _wait(tier, "store", 1)[0].status == ("ok",) * 3
    np.testing.assert_array_equal(_load(tier, [2]).payloads[0], _payload(2))
    tier.shutdown()


def test_obj_listing_finds_other_writers_chunks_of_its_fingerprint_only(s3, bucket):
    """A tier lists the bucket at start (lookups answer RETRY until it has) and every refresh_s: it finds
    what another engine stored, and forgets what another engine deleted; another fingerprint's chunks
    are not its own."""
    a = _tier(s3, bucket)
    _store(a, [0, 1])
    b = _tier(s3, bucket, refresh_s=0.05)
    other = ObjectTier(fingerprint="cd" * 32, bucket=bucket, endpoint_override=s3.url, **FAST)
    _ready(other)
    assert b.lookup(_key(0)) is Lookup.HIT and other.lookup(_key(0)) is Lookup.MISS
    assert b.stats.listed_chunks == 2 and other.stats.listed_chunks == 0
    np.testing.assert_array_equal(_load(b, [1]).payloads[0], _payload(1))
    _store(a, [2])
    s3.client().delete_object(Bucket=bucket, Key=a.object_name(_key(0)))
    end = time.monotonic() + 10
    while (b.lookup(_key(2)), b.lookup(_key(0))) != (Lookup.HIT, Lookup.MISS):  # a lookup starts a due refresh
        assert time.monotonic() < end, "the refresh never showed the other writer's changes"
        time.sleep(0.01)
    for t in (a, b, other):
        t.shutdown()


def test_obj_first_listing_answers_retry_until_done(own_s3):
    """While the first listing runs, lookups of unknown keys answer RETRY and stores wait for it: a chunk
    the bucket holds (stored by another engine) is not uploaded again, one it lacks is."""
    bucket = own_s3.bucket("kv-listing")
    seed = _tier(own_s3, bucket)
    _store(seed, [0])
    seed.shutdown()
    own_s3.pause()  # the listing's request waits until the server runs again
    try:
        tier = ObjectTier(fingerprint=FP, bucket=bucket, endpoint_override=own_s3.url, **{**FAST, "timeout_s": 5.0})
        assert tier.lookup(_key(0)) is Lookup.RETRY and tier.lookup(_key(1)) is Lookup.RETRY
        tier.submit_store(StoreJob(1, (_key(0), _key(2)), (_payload(0), _payload(2))))
        time.sleep(0.2)
        assert tier.stats.stored_chunks == 0  # waiting for the listing
    finally:
        own_s3.resume()
    assert _wait(tier, "store", 1)[0].status == ("ok", "ok")
    assert tier.stats.stored_chunks == 1 and len(_objects(own_s3, bucket)) == 2  # key 2 only was uploaded
    assert tier.lookup(_key(0)) is Lookup.HIT and tier.lookup(_key(1)) is Lookup.MISS
    tier.shutdown()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "foreign", "other_key", "empty"])
def test_obj_unverifiable_object_is_a_corrupt_miss_and_deleted(s3, bucket, damage):
    tier = _tier(s3, bucket)
    _store(tier, [0, 1])
    c, name = s3.client(), tier.object_name(_key(0))
    data = bytearray(c.get_object(Bucket=bucket, Key=name)["Body"].read())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip_payload":
        data[HEADER.size + 1000] ^= 0x40
    elif damage == "flip_header":
        data[20] ^= 0x01  # inside the key
    elif damage == "foreign":
        data = bytearray(b"not a chunk at all" * 300)
    elif damage == "other_key":
        data = bytearray(c.get_object(Bucket=bucket, Key=tier.object_name(_key(1)))["Body"].read())
    else:
        data = bytearray()
    c.put_object(Bucket=bucket, Key=name, Body=bytes(data))
    r = _load(tier, [0, 1])
    assert r.status == ("corrupt", "ok") and r.payloads[0] is None
    np.testing.assert_array_equal(r.payloads[1], _payload(1))
    assert name not in _objects(s3, bucket) and tier.stats.corrupt == 1
    assert tier.lookup(_key(0)) is Lookup.MISS  # the next lookup recomputes instead
    tier.shutdown()


def test_obj_capacity_evicts_least_recently_used(s3, bucket):
    size = HEADER.size + 4096
    tier = _tier(s3, bucket, max_bytes=3 * size)
    tier.log_removals()  # KV events: what the tier drops is reported
    for i in (0, 1, 2):  # one at a time: the chunks of one job are stored in parallel, in no set order
        _store(tier, [i])
    _load(tier, [0])  # 0 is now the most recently used
    _store(tier, [3])
    assert [tier.lookup(_key(i)) for i in range(4)] == [Lookup.HIT, Lookup.MISS, Lookup.HIT, Lookup.HIT]
    assert tier.stats.evicted_chunks == 1 and len(_objects(s3, bucket)) == 3
    assert tier.take_removed() == [_key(1)] and tier.take_removed() == []
    # a tier started later on the bucket knows the objects there and keeps the bound
    again = _tier(s3, bucket, max_bytes=3 * size)
    _store(again, [4])
    assert len(_objects(s3, bucket)) == 3 and again.stats.evicted_chunks == 1
    tier.shutdown()
    again.shutdown()


def test_obj_a_missing_bucket_fails_stores_without_an_outage(s3):
    tier = _tier(s3, "kv-no-such-bucket")
    assert _store(tier, [0]) == ("failed",) and _load(tier, [0]).status == ("miss",)
    assert tier.stats.store_failed == 1 and tier.stats.io_errors >= 2 and tier.stats.outages == 0
    assert tier.stats.io_retries == 0 and not tier.is_down()  # an answer, not a transient failure: not retried
    tier.shutdown()


def test_obj_server_stopped_then_restarted(own_s3):
    """A dead server: the first request that cannot connect is retried, then the tier is down for
    down_s (lookups MISS, loads "miss", stores "failed", all without the network); no exception escapes.
    The server back (empty: moto keeps objects in memory): stores work again, and a chunk the index
    still names is a plain miss that the index drops."""
    bucket = own_s3.bucket("kv-restart")
    tier = _tier(own_s3, bucket, down_s=0.5)
    assert _store(tier, [0]) == ("ok",)
    own_s3.stop()
    assert _load(tier, [0]).status == ("miss",)
    st = tier.stats
    assert st.outages == 1 and st.io_retries == 1 and st.io_errors == 1 and tier.is_down()
    sent = _requests(tier)
    assert tier.lookup(_key(0)) is Lookup.MISS  # known, but the tier is down
    assert _load(tier, [0]).status == ("miss",) and _store(tier, [2]) == ("failed",)
    assert sent == [] and st.down_skips == 3 and st.io_errors == 1
    own_s3.start()
    own_s3.bucket(bucket)
    time.sleep(0.5)  # down_s
    assert tier.lookup(_key(0)) is Lookup.HIT  # the index still names it
    assert _load(tier, [0]).status == ("miss",)  # gone with the old server: a plain miss, forgotten
    assert _store(tier, [2]) == ("ok",) and not tier.is_down()
    assert tier.lookup(_key(0)) is Lookup.MISS and tier.lookup(_key(2)) is Lookup.HIT
    np.testing.assert_array_equal(_load(tier, [2]).payloads[0], _payload(2))
    assert st.outages == 1 and st.corrupt == 0
    tier.shutdown()


def test_obj_hung_server_costs_a_bounded_wait_then_misses(own_s3):
    """A paused server (SIGSTOP) accepts connections and never answers: requests time out, the tier goes
    down and answers at once; shutdown with stores pending returns; once the server runs again and
    down_s has passed, the tier works again."""
    bucket = own_s3.bucket("kv-hung")
    tier = _tier(own_s3, bucket, timeout_s=0.3, down_s=0.5)
    _store(tier, [0])
    own_s3.pause()
    try:
        tier.submit_load(LoadJob(7, (_key(0),), (4096,)))
        tier.submit_store(StoreJob(8, (_key(1), _key(2)), (_payload(1), _payload(2))))
        done, end = {}, time.monotonic() + 15
        while len(done) < 2 and time.monotonic() < end:
            done.update((r.kind, r) for r in tier.get_finished_jobs())
            time.sleep(0.005)
        assert done["load"].status == ("miss",) and done["store"].status == ("failed", "failed")
        assert tier.stats.outages == 1 and tier.is_down()
        sent = _requests(tier)
        assert [tier.lookup(_key(i)) for i in range(3)] == [Lookup.MISS] * 3 and sent == []
        late = ObjectTier(fingerprint=FP, bucket=bucket, endpoint_override=own_s3.url, **{**FAST, "timeout_s": 0.3})
        late.submit_store(StoreJob(9, (_key(3),), (_payload(3),)))
        t0 = time.monotonic()
        late.shutdown(wait=True)  # waits for the store: bounded by its attempts, then it fails
        assert time.monotonic() - t0 < 15 and late.stats.store_failed == 1
    finally:
        own_s3.resume()
    time.sleep(0.5)
    np.testing.assert_array_equal(_load(tier, [0]).payloads[0], _payload(0))
    assert not tier.is_down() and _store(tier, [1]) == ("ok",)
    tier.shutdown()


def test_obj_credentials_come_from_the_environment_unless_given(s3, bucket, monkeypatch):
    tier = _tier(s3, bucket)
    sent = _requests(tier)
    _store(tier, [0])
    assert sent and all(b"Credential=testing-env-key/" in auth for _, auth in sent)
    given = _tier(s3, bucket, access_key="given-key", secret_key="given-secret")
    sent = _requests(given)
    _load(given, [0])
    assert sent and all(b"Credential=given-key/" in auth for _, auth in sent)
    # empty strings are no credentials: the environment's again (vLLM's convention)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "other-env-key")
    empty = _tier(s3, bucket, access_key="", secret_key="", session_token="")
    sent = _requests(empty)
    _load(empty, [0])
    assert sent and all(b"Credential=other-env-key/" in auth for _, auth in sent)
    for t in (tier, given, empty):
        t.shutdown()


def test_obj_specs_are_checked(s3, bucket):
    ok = {"type": "obj", "bucket": bucket, "endpoint_override": f"127.0.0.1:{s3.port}", "scheme": "http"}
    bad = [({"bucket": None}, "needs bucket"), ({"bucket": "B!"}, "needs bucket"),
           ({"bucket_name": "x"}, r"unknown keys \['bucket_name'\] \(allowed: \['access_key', 'backoff_s', 'bucket'"),
           ({"scheme": "ftp"}, r"scheme must be one of \('http', 'https'\)"),
           ({"endpoint_override": "https://127.0.0.1:1"}, "contradicts endpoint_override"),
           ({"endpoint_override": "ftp://h"}, "endpoint_override's scheme"),
           ({"access_key": "a"}, "access_key and secret_key go together"),
           ({"session_token": "t"}, "session_token needs access_key"),
           ({"ca_bundle": "/x.pem"}, "plain http"),
           ({"scheme": "https", "ca_bundle": "/no/such.pem"}, "is not a file"),
           ({"max_bytes": 0}, "max_bytes must be a positive int"), ({"max_attempts": 0}, "max_attempts"),
           ({"timeout_s": float("inf")}, "timeout_s must be a positive number"), ({"backoff_s": -1}, "backoff_s"),
           ({"refresh_s": 0}, "refresh_s"), ({"read_threads": True}, "read_threads"), ({"prefix": "/kv"}, "prefix")]
    for change, match in bad:
        spec = {k: v for k, v in {**ok, **change}.items() if v is not None}
        with pytest.raises(ValueError, match=match):
            make_tier(spec, FP)
        with pytest.raises(ValueError, match=match):  # at configuration time, before any engine
            DeployConfig(kv_transfer_config=_ktc(spec))
    assert DeployConfig(kv_transfer_config=_ktc(ok)).offload_options["secondary_tiers"] == [ok]
    # 'host:port' with scheme="http" names the same server; a prefix puts the chunks under it
    tier = make_tier({**ok, "prefix": "kv/", **FAST}, FP)
    _ready(tier)
    _store(tier, [0])
    assert list(_objects(s3, bucket)) == ["kv/" + chunk_name(FP, _key(0))]
    assert _load(tier, [0]).status == ("ok",)
    tier.shutdown()


# --------------------------------------------------------------------------------- behind the host tier
def _ktc(tier: dict, cpu: int = 1 << 20) -> dict:
    return {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu, "secondary_tiers": [tier]}}


def _engine(model, server, bucket, **kw) -> Engine:
    spec = {"type": "obj", "bucket": bucket, "endpoint_override": server.url, **FAST, **kw}
    return Engine(model, DeployConfig(**BASE, kv_transfer_config=_ktc(spec)))


def _obj(eng) -> ObjectTier:
    return eng.tiers[0].tiers[0]


def _gen(eng, prompts, **kw) -> list:
    return [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5, **kw)]


def _settle(tier, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while tier.pending_stores():
        assert time.monotonic() < end, "stores never finished"
        time.sleep(0.005)


def _copy(src, src_bucket, dst, dst_bucket) -> None:
    """Every object of one bucket into another (possibly on another server)."""
    c = dst.client()
    for name, data in _objects(src, src_bucket).items():
        c.put_object(Bucket=dst_bucket, Key=name, Body=data)


@pytest.fixture(scope="module")
def stored(small_model, small_reference, s3):
    """A bucket holding every chunk of the reference prompts, and the engine that stored them."""
    bucket = s3.bucket("kv-engine-stored")
    eng = _engine(small_model, s3, bucket)
    assert _gen(eng, small_reference[0]) == small_reference[1]
    eng.shutdown()
    return bucket, eng


def test_an_engine_stores_every_full_page_and_a_new_engine_reloads_them(small_model, small_reference, s3, stored, bucket):
    """Engine 1 stored every full page through its host tier to the bucket; engine 2 (empty device pool
    and host tier) loads each prompt's full pages from there and prefills only the last partial page:
    the same tokens, the hits counted in chunks and bytes."""
    prompts, want = small_reference
    src, first = stored
    m = first.metrics()["kv_offload"]
    assert m["obj"]["stored_chunks"] == m["cpu"]["stored_pages"] == STORED == len(_objects(s3, src))
    assert m["obj"]["store_bytes"] == m["cpu"]["store_bytes"] and m["obj"]["store_failed"] == 0
    assert m["obj"]["io_errors"] == m["obj"]["outages"] == 0
    _copy(s3, src, s3, bucket)
    # the counts are the subject, not the time bounds: FAST's 1 s would let a loaded machine's first
    # listing (lookups answer from it) or a load outlast its bound, and those pages be recomputed
    second = _engine(small_model, s3, bucket, timeout_s=10.0)
    assert _gen(second, prompts) == want
    second.shutdown()
    m = second.metrics()["kv_offload"]
    assert m["obj"]["hits"] == m["obj"]["loaded_chunks"] == 2 * HIT_BLOCKS and m["obj"]["corrupt"] == 0
    assert m["obj"]["load_bytes"] == HIT_BLOCKS * sum(second.sizes.page_bytes.values())
    assert m["obj"]["lost"] == 0 and m["obj"]["stored_chunks"] == 0  # every page it stored was there already
    assert second.scheduler.stats.prefix_hit_tokens == 8 * HIT_BLOCKS
    assert m["cpu"]["hits"] == HIT_BLOCKS  # then loaded host -> device


def test_corrupt_objects_are_recomputed_and_replaced(small_model, small_reference, s3, stored, bucket):
    """Flipped bytes in every other object and one truncated: the same tokens, each damaged object it
    read counted corrupt and deleted, its page recomputed and stored again; a third engine then reads
    only whole chunks."""
    prompts, want = small_reference
    _copy(s3, stored[0], s3, bucket)
    c = s3.client()
    for i, (name, data) in enumerate(sorted(_objects(s3, bucket).items())):
        if i % 2 == 0:
            data = bytearray(data)
            data[-7] ^= 0xFF
            c.put_object(Bucket=bucket, Key=name, Body=bytes(data) if i else bytes(data[:-500]))
    eng = _engine(small_model, s3, bucket)
    assert _gen(eng, prompts[:2]) == want[:2]
    eng.shutdown()
    obj = eng.metrics()["kv_offload"]["obj"]
    assert obj["corrupt"] >= 1 and obj["hits"] >= 1 and obj["corrupt"] == _obj(eng).stats.corrupt
    assert obj["stored_chunks"] == obj["corrupt"]  # the pages it recomputed, stored whole again
    again = _engine(small_model, s3, bucket)
    assert _gen(again, prompts[:2]) == want[:2]
    again.shutdown()
    obj = again.metrics()["kv_offload"]["obj"]
    assert obj["corrupt"] == 0 and obj["hits"] == 2 * sum((n - 1) // 8 for n in (37, 5))


def test_the_server_stopped_mid_run_and_restarted(small_model, small_reference, own_s3):
    """The bucket holds prompt 0's chunks when the engine starts. Prompt 2 runs; after its first pages
    are stored the server dies: its later pages fail to store, its tokens do not change. Prompt 0 then
    finds the tier down, or fails its loads (its chunks are in the index) and finds it down after: it
    recomputes. The server comes back empty: prompt 3's pages are stored, and a new engine hits on
    them. Every request gives the reference tokens throughout; nothing hangs, nothing corrupt is read."""
    prompts, want = small_reference
    bucket = own_s3.bucket("kv-engine-restart")
    seed = _engine(small_model, own_s3, bucket)
    assert _gen(seed, prompts[:1]) == want[:1]
    seed.shutdown()
    eng = _engine(small_model, own_s3, bucket)
    tier = _obj(eng)
    rid = eng.add_request(prompts[2], SamplingParams(max_new_tokens=5))
    for _ in range(20):  # step until the first of its pages are in the bucket
        eng.step()
        _settle(tier)
        if tier.stats.stored_chunks:
            break
    assert tier.stats.stored_chunks and eng.has_unfinished()
    own_s3.stop()  # mid-request
    while eng.has_unfinished():
        eng.step()
    assert eng.output(rid).token_ids.tolist() == want[2]
    _settle(tier)
    st = tier.stats
    assert st.store_failed >= 1 and st.outages == 1 and st.io_errors >= 1
    assert _gen(eng, prompts[:1]) == want[:1]  # its chunks are in the index, the server is not there
    obj = eng.metrics()["kv_offload"]["obj"]
    assert obj["hits"] == obj["corrupt"] == 0 and obj["lost"] + obj["down_skips"] >= 1
    before = st.stored_chunks
    own_s3.start()
    own_s3.bucket(bucket)
    time.sleep(FAST["down_s"])
    assert _gen(eng, prompts[3:]) == want[3:]
    _settle(tier)
    eng.shutdown()
    assert st.stored_chunks - before == 2 * ((20 + 4) // 8) == len(_objects(own_s3, bucket))
    assert not tier.is_down() and st.outages == 1
    fresh = _engine(small_model, own_s3, bucket)
    assert _gen(fresh, prompts[3:]) == want[3:]
    fresh.shutdown()
    assert fresh.metrics()["kv_offload"]["obj"]["hits"] == 2 * ((20 - 1) // 8)
