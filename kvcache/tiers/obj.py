"""The object-store tier: one object per chunk in an S3-compatible bucket (boto3), named as the
filesystem tier names its files, `<prefix><fingerprint[:32]>/<key[0] hex>/<key hex>.kv`
(kvcache.tiers.format.chunk_name), holding the same blob (a header with the key, the payload length and
its CRC-32, then the payload), so a filesystem root synced to a bucket, or back, reads the same. Every
chunk of a job is a request of its own on a reader or writer thread pool.

Lookups answer from a local index, never from the network. The tier keeps the set of chunks it knows
to be in the bucket: what a listing of the fingerprint's prefix found (one asynchronous LIST at start,
again every `refresh_s` seconds and after an outage, so chunks other engines store show up), what it
stored and what it loaded. `lookup` answers under a lock, in microseconds: HIT if known; RETRY while
the chunk's store is in flight, or while the first listing runs (at most `timeout_s` after start; then
the index answers as it stands; stores wait for it as long, so that a chunk the bucket holds is not
uploaded again); MISS otherwise. Why not a HEAD per lookup, answered RETRY and resolved
asynchronously: the offload policy walks a prompt's pages in order, stops at the first that is not a
HIT, and a tier sees one key per call, so each page would cost a scheduler round: a 142K-token prompt
(2,200 pages of 64 tokens, two cache groups) would need thousands, past the policy's
`max_retry_rounds`. A stale index is safe either way: a stale HIT (the object deleted since) is a load
that answers "miss" (the policy counts it `lost` and recomputes those tokens) and drops the key; a
stale MISS (another engine's chunk not listed yet) is recomputed.

Failures. Each request has connect and read timeouts of `timeout_s` and runs up to `max_attempts`
times: transient errors (connection refused or reset, timeouts, truncated bodies, HTTP 5xx, throttling)
are retried after an exponential, jittered backoff (`backoff_s * 2**i`). botocore's own retries and its
one-second wait for "100-continue" before a PUT body are off, so this is the only retry loop and the
bound is ours. The read timeout bounds each wait for bytes, not a body, so every load also has a
deadline for the whole operation, `deadline_s` (default `max_attempts * 2 * timeout_s`), from the job's
submission: no attempt starts past it, and a body still arriving at it (a server that trickles bytes)
is cut; the chunk is a miss, counted in `deadline_misses`, and the tier goes down as below (the server
is not keeping up). Stores and deletes start no attempt past a deadline of their own. A
chunk that exhausts its attempts marks the tier *down* for `down_s` seconds: lookups answer MISS, loads
"miss" and stores "failed" at once, without the network (`down_skips`); so a dead or hung server costs
one bounded wait per chunk in flight, then misses, never a loop. After `down_s` the next request tries
the network again; the first answer marks the tier up and starts a listing (a restarted server may have
lost what the index names). A 404 on a load is a plain miss (the key leaves the index); a blob that
fails verification is a "corrupt" miss and the object is deleted; access denied or a missing bucket
fail at once (`io_errors`), are not retried and do not take the tier down. No error reaches the engine:
a failed load leaves its tokens to be recomputed, a failed store leaves the chunk out of the bucket.

Capacity: `max_bytes` (None: unbounded) over the objects the index holds, least recently used deleted
first (what the listing finds included, other engines' objects too), as the filesystem tier bounds the
files it knows. A store skips a chunk the index holds: its name is its content. A delete that races a
store of the same chunk can leave the index naming a deleted object: a lost hit, recomputed.

Credentials: `access_key`, `secret_key`, `session_token` when given; empty or absent: boto3's chain
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN in the environment, shared files,
instance roles). `endpoint_override` names an S3-compatible server (MinIO, Ceph, moto; path-style
addressing), as a URL or as host:port with `scheme` (https by default); `region` the signing region
(absent: boto3's default); `ca_bundle` the CA file that verifies an https endpoint's certificate.
Ours besides vLLM's fields: `prefix` (a key prefix inside the bucket), `max_bytes`, `read_threads` /
`write_threads`, `timeout_s`, `max_attempts`, `backoff_s`, `down_s`, `refresh_s` (None: list at start
and after outages only), `deadline_s`, `secret_file` (kvcache.tiers.auth: with a shared secret every
object carries a MAC and one without a valid MAC is refused as corrupt, so a writer to the bucket without
the secret cannot plant KV) and `name` (the metrics key, "obj").
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvcache.tiers.auth import check_secret_file, load_secret
from kvcache.tiers.base import JobResult, LoadJob, Lookup, StoreJob, TierBookkeeping, TierStats
from kvcache.tiers.format import HEADER, SUFFIX, as_bytes, chunk_name, decode, encode_header

__all__ = ["OPTIONS", "ObjTierStats", "ObjectTier", "check_options"]

OPTIONS = {"bucket": None, "endpoint_override": None, "access_key": None, "secret_key": None,
           "session_token": None, "region": None, "scheme": None, "ca_bundle": None,  # vLLM's fields
           "prefix": "", "max_bytes": None, "read_threads": 4, "write_threads": 4, "timeout_s": 5.0,
           "max_attempts": 3, "backoff_s": 0.1, "down_s": 10.0, "refresh_s": 60.0, "name": "obj",
           "deadline_s": None, "secret_file": None}
READ_PIECE = 1 << 20  # bytes asked of one read of a body (a read returns what has arrived, up to this)
SCHEMES = ("http", "https")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")  # S3's bucket naming rules (the common part)
_NAME = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{64})" + re.escape(SUFFIX) + "$")
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded"}


@dataclasses.dataclass
class ObjTierStats(TierStats):
    """TierStats and the object tier's own: how its requests fared."""

    io_retries: int = 0  # requests sent again after a transient error
    io_errors: int = 0  # operations that failed for good (attempts exhausted, or access denied, no bucket, ...)
    outages: int = 0  # times the tier went down (an operation exhausted its attempts while the tier was up)
    down_skips: int = 0  # lookups, loads and stores answered without the network while down
    listed_chunks: int = 0  # chunks the latest complete listing found under the fingerprint's prefix


def _bad(msg: str) -> ValueError:
    return ValueError(f"secondary tier 'obj': {msg}")


def _positive(v, *, integer: bool) -> bool:
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        return False
    return v > 0 and math.isfinite(v)


def check_options(opts: dict) -> None:
    """Validate an obj tier's options (its secondary_tiers entry less "type")."""
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise _bad(f"unknown keys {sorted(unknown)} (allowed: {sorted(OPTIONS)})")
    bucket = opts.get("bucket")
    if not isinstance(bucket, str) or not _BUCKET.match(bucket) or ".." in bucket:
        raise _bad(f"needs bucket, an S3 bucket name (3-63 characters: lowercase letters, digits, '.' and '-', "
                   f"starting and ending with a letter or digit), got {bucket!r}")
    for k in ("access_key", "secret_key", "session_token", "region", "ca_bundle"):
        if opts.get(k) is not None and not isinstance(opts[k], str):
            raise _bad(f"{k} must be a string (empty or absent: boto3's credential chain / defaults), got {opts[k]!r}")
    if bool(opts.get("access_key")) != bool(opts.get("secret_key")):
        raise _bad("access_key and secret_key go together (give both, or neither for the environment's credentials)")
    if opts.get("session_token") and not opts.get("access_key"):
        raise _bad("session_token needs access_key and secret_key")
    scheme = opts.get("scheme")
    if scheme is not None and scheme not in SCHEMES:
        raise _bad(f"scheme must be one of {SCHEMES} or None, got {scheme!r}")
    ep = opts.get("endpoint_override")
    if ep is not None:
        if not isinstance(ep, str) or not ep:
            raise _bad(f"endpoint_override must be a non-empty string ('host:port' or a URL), got {ep!r}")
        if "://" in ep:
            given = ep.split("://", 1)[0]
            if given not in SCHEMES:
                raise _bad(f"endpoint_override's scheme must be one of {SCHEMES}, got {ep!r}")
            if scheme is not None and scheme != given:
                raise _bad(f"scheme={scheme!r} contradicts endpoint_override={ep!r}")
    if opts.get("ca_bundle"):
        if endpoint_url(opts).startswith("http://"):
            raise _bad(f"ca_bundle verifies TLS, but the endpoint is plain http: {endpoint_url(opts)!r}")
        if not os.path.isfile(opts["ca_bundle"]):
            raise _bad(f"ca_bundle {opts['ca_bundle']!r} is not a file")
    prefix = opts.get("prefix", "")
    if not isinstance(prefix, str) or prefix.startswith("/"):
        raise _bad(f"prefix must be a string not starting with '/', got {prefix!r}")
    mb = opts.get("max_bytes")
    if mb is not None and not _positive(mb, integer=True):
        raise _bad(f"max_bytes must be a positive int or None, got {mb!r}")
    for k in ("read_threads", "write_threads", "max_attempts"):
        if not _positive(opts.get(k, OPTIONS[k]), integer=True):
            raise _bad(f"{k} must be a positive int, got {opts.get(k)!r}")
    for k in ("timeout_s", "down_s"):
        if not _positive(opts.get(k, OPTIONS[k]), integer=False):
            raise _bad(f"{k} must be a positive number of seconds, got {opts.get(k)!r}")
    d = opts.get("deadline_s")
    if d is not None and not _positive(d, integer=False):
        raise _bad(f"deadline_s must be a positive number of seconds or None (max_attempts * 2 * timeout_s), got {d!r}")
    check_secret_file(opts.get("secret_file"), "secondary tier 'obj'")
    b = opts.get("backoff_s", OPTIONS["backoff_s"])
    if not (b == 0 or _positive(b, integer=False)):
        raise _bad(f"backoff_s must be a number of seconds >= 0, got {b!r}")
    r = opts.get("refresh_s", OPTIONS["refresh_s"])
    if r is not None and not _positive(r, integer=False):
        raise _bad(f"refresh_s must be a positive number of seconds or None (list only at start), got {r!r}")
    name = opts.get("name", OPTIONS["name"])
    if not isinstance(name, str) or not name:
        raise _bad(f"name must be a non-empty string, got {name!r}")


def endpoint_url(opts: dict) -> str | None:
    """The endpoint URL boto3 gets: endpoint_override with its scheme (or `scheme`, https by default);
    None: AWS itself."""
    ep = opts.get("endpoint_override")
    if ep is None:
        return None
    return ep if "://" in ep else f"{opts.get('scheme') or 'https'}://{ep}"


class _Missing(Exception):
    """The object is not there (404 / NoSuchKey): a plain miss, not an error."""


class _Failed(Exception):
    """The operation failed for good (counted in io_errors)."""


class _Late(Exception):
    """The operation's deadline passed (counted in deadline_misses)."""


class _Pending:
    """A job whose chunks are running: their statuses and payloads so far, and how many are left."""

    def __init__(self, job_id: int, kind: str, n: int):
        self.job_id, self.kind, self.left = job_id, kind, n
        self.t0 = time.perf_counter()  # submitted
        self.status: list[str | None] = [None] * n
        self.payloads: list = [None] * n


class ObjectTier(TierBookkeeping):
    """A SecondaryTier (kvcache.tiers) on an S3 bucket. See the module docstring."""

    def __init__(self, *, fingerprint: str, bucket: str, endpoint_override: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, session_token: str | None = None,
                 region: str | None = None, scheme: str | None = None, ca_bundle: str | None = None,
                 prefix: str = "", max_bytes: int | None = None, read_threads: int = 4, write_threads: int = 4,
                 timeout_s: float = 5.0, max_attempts: int = 3, backoff_s: float = 0.1, down_s: float = 10.0,
                 refresh_s: float | None = 60.0, name: str = "obj", deadline_s: float | None = None,
                 secret_file=None):
        opts = {k: v for k, v in locals().items() if k in OPTIONS}
        check_options(opts)
        import boto3  # here, not at module import: `import kvcache.tiers` must not need the SDK
        from botocore.config import Config

        self.name, self.bucket, self.fingerprint = name, bucket, fingerprint
        self.dir = f"{prefix}{fingerprint[:32]}/"  # the listing prefix: this layout's chunks only
        self._prefix = prefix
        self.max_bytes, self.max_attempts, self.backoff_s = max_bytes, max_attempts, backoff_s
        self.timeout_s, self.down_s, self.refresh_s = timeout_s, down_s, refresh_s
        self.deadline_s = float(deadline_s) if deadline_s is not None else max_attempts * 2 * timeout_s
        self._secret = load_secret(secret_file, who=f"secondary tier {name!r}")
        self.endpoint = endpoint_url(opts)
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1},
                        max_pool_connections=read_threads + write_threads + 2,
                        s3={"addressing_style": "path"} if self.endpoint else None)
        # a session of its own: boto3's default session is shared module state; the client is thread-safe
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=region or None, aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None, aws_session_token=session_token or None,
            use_ssl=(scheme or "https") == "https",  # without endpoint_override (a URL carries its own)
            verify=ca_bundle or None, config=config)
        # botocore sends PUT bodies with "Expect: 100-continue" and waits up to 1 s for the answer: a second
        # per attempt on a hung server, outside timeout_s. Chunks are small enough to send straight away.
        from botocore.handlers import add_expect_header

        self._client.meta.events.unregister("before-call.s3", add_expect_header)
        self.stats = ObjTierStats()
        super().__init__()  # the lock, the finished jobs, the removal log
        self._inflight: collections.Counter[bytes] = collections.Counter()  # keys being stored
        # the chunks known to be in the bucket: key -> (object bytes, when last confirmed), LRU first
        self._index: collections.OrderedDict[bytes, tuple[int, float]] = collections.OrderedDict()
        self._bytes = 0
        self._down_until = 0.0  # monotonic time until which the tier is down
        self._up = True
        self._listing = True  # a listing is running
        # until the first listing ends (or this deadline passes), lookups answer RETRY for unknown keys and
        # stores wait: a chunk the bucket holds already is then neither recomputed nor uploaded again
        self._first_listing_until = time.monotonic() + timeout_s
        self._first_listing_done = threading.Event()
        self._next_list = math.inf
        self._closed = self._abort = False
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix=f"{name}-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix=f"{name}-write")
        self._meta = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-list")
        self._meta.submit(self._list)

    # --------------------------------------------------------------------------------------- layout
    def object_name(self, key: bytes) -> str:
        return self._prefix + chunk_name(self.fingerprint, key)

    def _key_of(self, name: str) -> bytes | None:
        m = _NAME.match(name[len(self.dir):]) if name.startswith(self.dir) else None
        return bytes.fromhex(m.group(2)) if m and m.group(2).startswith(m.group(1)) else None

    # ---------------------------------------------------------------------------------- the interface
    def lookup(self, key: bytes, ctx: object = None) -> Lookup:
        """From the index, no network (module docstring); may start a background listing when one is due."""
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self.stats.down_skips += 1
                return Lookup.MISS
            if self._inflight[key]:
                return Lookup.RETRY
            if key in self._index:
                return Lookup.HIT
            first = self._listing and now < self._first_listing_until
            due = not self._listing and now >= self._next_list and not self._closed
            if due:
                self._listing = True
        if due:
            try:
                self._meta.submit(self._list)
            except RuntimeError:  # shut down meanwhile
                pass
        return Lookup.RETRY if first else Lookup.MISS

    def submit_store(self, job: StoreJob) -> None:
        """Each chunk is a request of its own on the writer pool (a store of 64 pages is 64 PUTs in
        parallel, not in a row); the job finishes when its last chunk does."""
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        with self._lock:
            self._inflight.update(job.keys)
        state = _Pending(job.job_id, "store", len(job.keys))
        self._finish_if_empty(state)
        for i, (key, payload) in enumerate(zip(job.keys, job.payloads)):
            self._writers.submit(self._store_one, state, i, key, payload)

    def submit_load(self, job: LoadJob) -> None:
        """Each chunk is a request of its own on the reader pool; the job finishes when its last one does."""
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        state = _Pending(job.job_id, "load", len(job.keys))
        self._finish_if_empty(state)
        deadline = time.monotonic() + self.deadline_s  # the job's: a chunk queued behind others has less left
        # a backstop for what the body's deadline cannot cut (a request still waiting for its headers)
        if job.keys:
            self._load_due(job, self.deadline_s + 2 * self.timeout_s)
        for i, (key, size) in enumerate(zip(job.keys, job.sizes)):
            self._readers.submit(self._load_one, state, i, key, size, deadline)

    def shutdown(self, wait: bool = True) -> None:
        """wait=True: finish pending stores and loads (each bounded by the retry budget; once the tier is
        down the rest fail at once). wait=False: drop them and stop retrying. A listing is never waited for."""
        if self._closed:
            return
        self._closed = True
        self._abort = not wait
        self._meta.shutdown(wait=False, cancel_futures=True)
        self._writers.shutdown(wait=wait, cancel_futures=not wait)
        self._readers.shutdown(wait=wait, cancel_futures=not wait)

    def is_down(self) -> bool:
        """Whether the tier answers without the network now (an outage less than down_s ago)."""
        return time.monotonic() < self._down_until

    def pending_stores(self) -> int:
        """Chunks submitted for storing and not finished yet."""
        with self._lock:
            return sum(self._inflight.values())

    def known_chunks(self) -> int:
        """Chunks the index holds (what lookups answer HIT for)."""
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------------------------ requests, retries
    def _call(self, fn, *args, _deadline: float = math.inf, **kwargs):
        """fn(*args, **kwargs) (one S3 request; reading a body included) with the retry policy: transient
        errors are retried after a backoff up to max_attempts in all, then the tier goes down and this
        raises _Failed; a 404 raises _Missing; any other error raises _Failed at once. No attempt starts
        past `_deadline` (monotonic s): _Late, the tier down. A success marks the tier up."""
        err = None
        for attempt in range(self.max_attempts):
            if attempt:
                if self._abort or self.is_down():  # another request found it down meanwhile: do not pile on
                    break
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5),
                               max(_deadline - time.monotonic(), 0.0)))
                with self._lock:
                    self.stats.io_retries += 1
            try:
                if time.monotonic() >= _deadline:
                    raise _Late()
                out = fn(*args, **kwargs)
            except _Late:
                with self._lock:
                    self.stats.deadline_misses += 1
                    if self._up and not self._abort:
                        self.stats.outages += 1
                    self._up = False
                    self._down_until = max(self._down_until, time.monotonic() + self.down_s)
                raise
            except Exception as e:  # noqa: BLE001 - sorted below: every failure is a miss or a failed store
                kind = _classify(e)
                if kind == "missing":
                    self._mark_up()
                    raise _Missing() from e
                if kind == "fatal":
                    with self._lock:
                        self.stats.io_errors += 1
                    raise _Failed(repr(e)) from e
                err = e
                continue
            self._mark_up()
            return out
        with self._lock:
            self.stats.io_errors += 1
            if self._abort:  # shut down without waiting: not an outage
                raise _Failed(repr(err))
            if self._up:
                self.stats.outages += 1
            self._up = False
            self._down_until = max(self._down_until, time.monotonic() + self.down_s)
        raise _Failed(repr(err))

    def _mark_up(self) -> None:
        """The server answered. Back from an outage, list the bucket again: it may have lost chunks the
        index still names (a restarted server) or gained some."""
        with self._lock:
            back = not self._up and not self._listing and not self._closed
            self._up, self._down_until = True, 0.0
            if back:
                self._listing = True
        if back:
            try:
                self._meta.submit(self._list)
            except RuntimeError:  # shut down meanwhile
                pass

    def _skip_if_down(self) -> bool:
        with self._lock:
            if time.monotonic() < self._down_until:
                self.stats.down_skips += 1
                return True
        return False

    # ------------------------------------------------------------------------------------ the workers
    def _list(self) -> None:
        """List the fingerprint's prefix into the index: keys found are added (oldest first in LRU order),
        keys known from before the listing began and no longer there are dropped (another engine evicted
        them). A failed listing changes nothing and is tried again after down_s."""
        started, found, complete = time.monotonic(), [], False
        try:
            if not self._skip_if_down():
                token = None
                while not self._abort:
                    kw = {"Bucket": self.bucket, "Prefix": self.dir, "MaxKeys": 1000}
                    if token:
                        kw["ContinuationToken"] = token
                    page = self._call(self._client.list_objects_v2, **kw)
                    for o in page.get("Contents", ()):
                        if (k := self._key_of(o["Key"])) is not None:
                            found.append((o["LastModified"], k, int(o["Size"])))
                    if not page.get("IsTruncated"):
                        complete = True
                        break
                    token = page["NextContinuationToken"]
        except (_Failed, _Missing):
            pass
        except Exception:  # noqa: BLE001 - a listing that cannot be read is no listing
            with self._lock:
                self.stats.io_errors += 1
        with self._lock:
            if complete:
                listed = {k for _, k, _ in found}
                for k in [k for k, (_, t) in self._index.items() if t < started and k not in listed]:
                    self._bytes -= self._index.pop(k)[0]
                for _, k, n in sorted(found, reverse=True):  # newest first, each to the LRU end: oldest leads
                    if k not in self._index:
                        self._index[k] = (n, started)
                        self._index.move_to_end(k, last=False)
                        self._bytes += n
                self.stats.listed_chunks = len(found)
            self._listing = False
            self._first_listing_until = 0.0
            self._first_listing_done.set()
            if not complete:  # try again once a down tier may be up again
                self._next_list = time.monotonic() + self.down_s
            else:
                self._next_list = math.inf if self.refresh_s is None else time.monotonic() + self.refresh_s
        self._evict()

    def _finish_if_empty(self, state: "_Pending") -> None:
        if not state.left:
            with self._lock:
                self._finished.append(JobResult(state.job_id, state.kind, ()))

    def _done(self, state: "_Pending", i: int, status: str, payload=None) -> None:
        """Chunk i of a job is done (under the lock: the last one reports the job)."""
        with self._lock:
            state.status[i], state.payloads[i] = status, payload
            state.left -= 1
            if not state.left:
                getattr(self.stats, f"{state.kind}_latency").observe(time.perf_counter() - state.t0)
                result = JobResult(state.job_id, state.kind, tuple(state.status),
                                   tuple(state.payloads) if state.kind == "load" else ())
                if state.kind == "load":
                    self._finish_load(result)
                else:
                    self._finished.append(result)

    def _store_one(self, state: "_Pending", i: int, key: bytes, payload) -> None:
        try:
            status = self._put(key, payload)
        except Exception:  # noqa: BLE001 - a failed store is a chunk not stored, never an engine error
            with self._lock:
                self.stats.store_failed += 1
                self.stats.io_errors += 1
            status = "failed"
        with self._lock:
            self._inflight[key] -= 1
            if not self._inflight[key]:
                del self._inflight[key]
        self._done(state, i, status)

    def _put(self, key: bytes, payload) -> str:
        self._first_listing_done.wait(max(self._first_listing_until - time.monotonic(), 0.0))
        with self._lock:
            if key in self._index:  # held already: its name is its content
                self._index.move_to_end(key)
                return "ok"
        if self._skip_if_down():
            with self._lock:
                self.stats.store_failed += 1
            return "failed"
        data = as_bytes(payload)
        body = b"".join((encode_header(key, data, self._secret), data))
        try:
            self._call(self._client.put_object, Bucket=self.bucket, Key=self.object_name(key), Body=body,
                       _deadline=time.monotonic() + self.deadline_s)
        except (_Failed, _Missing, _Late):  # unreachable, refused (no such bucket, access denied), too slow
            with self._lock:
                self.stats.store_failed += 1
            return "failed"
        with self._lock:
            self.stats.stored_chunks += 1
            self.stats.store_bytes += data.nbytes
            self._remember(key, len(body))
        self._evict()
        return "ok"

    def _remember(self, key: bytes, nbytes: int) -> None:
        """`key` is in the bucket, most recently used (under the lock)."""
        old = self._index.pop(key, None)
        if old is not None:
            self._bytes -= old[0]
        self._index[key] = (nbytes, time.monotonic())
        self._bytes += nbytes

    def _forget(self, key: bytes) -> None:
        """`key` is gone from the bucket (found missing, or deleted as corrupt): out of the index, noted
        for KV events."""
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old[0]
                self._note_removed_key(key)

    def _evict(self) -> None:
        """Delete least recently used objects past max_bytes. The index drops them first (a lookup answers
        MISS from then on); a delete that fails leaves an object the next listing finds again."""
        if self.max_bytes is None:
            return
        victims = []
        with self._lock:
            while self._bytes > self.max_bytes and len(self._index) > 1:
                k, (n, _) = self._index.popitem(last=False)
                self._bytes -= n
                victims.append(k)
                self.stats.evicted_chunks += 1
                self._note_removed_key(k)
        for k in victims:
            self._delete(k)

    def _delete(self, key: bytes) -> None:
        try:
            self._call(self._client.delete_object, Bucket=self.bucket, Key=self.object_name(key),
                       _deadline=time.monotonic() + self.deadline_s)
        except (_Failed, _Missing, _Late):
            pass

    def _load_one(self, state: "_Pending", i: int, key: bytes, size: int, deadline: float = math.inf) -> None:
        try:
            data = self._get(key, size, deadline)
        except Exception:  # noqa: BLE001 - an unreadable chunk is a miss, never an engine error
            with self._lock:
                self.stats.io_errors += 1
            data = "miss"
        self._done(state, i, data if isinstance(data, str) else "ok", None if isinstance(data, str) else data)

    def _get(self, key: bytes, size: int, deadline: float = math.inf):
        """The verified payload of `key` (np.uint8 [size], read-only), or "miss" (not there, or the
        server unreachable: the key stays known) / "corrupt" (the object deleted)."""
        if self._skip_if_down():
            return "miss"
        try:
            blob = self._call(self._read_object, self.object_name(key), HEADER.size + size, deadline,
                              _deadline=deadline)
        except _Missing:
            self._forget(key)
            return "miss"
        except (_Failed, _Late):
            return "miss"
        data = decode(blob, key, size, self._secret) if blob is not None else None
        if data is None:  # wrong length, another format, another key's blob, flipped bytes
            self._forget(key)
            with self._lock:
                self.stats.corrupt += 1
            self._delete(key)
            return "corrupt"
        with self._lock:
            self.stats.loaded_chunks += 1
            self.stats.load_bytes += size
            self._remember(key, HEADER.size + size)
        return data

    def _read_object(self, name: str, expect: int, deadline: float = math.inf) -> bytes | None:
        """The object's bytes, or None when its length is not `expect` (not read: it cannot verify).
        _Late when the body has not arrived by `deadline`: each read returns what has arrived and the
        socket's timeout is cut to what is left, so a trickling body cannot hold the thread past it."""
        r = self._client.get_object(Bucket=self.bucket, Key=name)
        body, n = r["Body"], r.get("ContentLength")
        sock = None
        try:
            if n is not None and int(n) != expect:
                return None
            raw = getattr(body, "_raw_stream", None)
            if raw is None or not hasattr(raw, "read1"):
                return body.read()
            sock = getattr(getattr(raw, "connection", None), "sock", None)
            out, got = bytearray(expect), 0
            while got < expect:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Late()
                if sock is not None:
                    sock.settimeout(min(self.timeout_s, left))
                try:
                    piece = raw.read1(min(READ_PIECE, expect - got))
                except Exception:  # noqa: BLE001 - a timeout at the deadline is the deadline's, anything else the caller's
                    if time.monotonic() >= deadline:
                        raise _Late() from None
                    raise
                if not piece:
                    raise ConnectionResetError(f"the body ended after {got} of {expect} bytes")  # transient: retried
                out[got:got + len(piece)] = piece
                got += len(piece)
            if n is None and raw.read1(1):  # no length announced, and more than a chunk's blob
                return None
            return bytes(out)
        finally:
            if sock is not None:  # the pooled connection's next request starts with the configured timeout
                try:
                    sock.settimeout(self.timeout_s)
                except OSError:
                    pass
            body.close()


def _classify(e: Exception) -> str:
    """"missing" (a 404 for the object), "transient" (worth another attempt) or "fatal"."""
    from botocore.exceptions import (ClientError, ConnectionError, HTTPClientError, IncompleteReadError,
                                     SSLError)

    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            return "missing"
        if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return "transient"
        return "fatal"
    if isinstance(e, SSLError):  # a certificate the CA bundle does not verify: retrying will not help
        return "fatal"
    if isinstance(e, (ConnectionError, HTTPClientError, IncompleteReadError)):
        return "transient"
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(e, (Urllib3Error, OSError)):  # a body read below botocore: a timeout, a reset, a short body
        return "transient"
    return "fatal"

