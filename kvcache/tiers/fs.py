"""The filesystem tier: one file per chunk under `root_dir/<fingerprint>/`, named by the chunk's key.

File format: kvcache.tiers.format (a header with the key, the payload length and its CRC-32, then the
payload; the object tier stores the same blobs under the same names). A reader checks all of it against
the key and size it asked for; anything it cannot verify (truncated, flipped bytes, another format, a
foreign file under the chunk's name) is a "corrupt" miss and the file is deleted, never an error that
stops the engine.

Writes go to a temporary file in the same directory and are renamed into place, so a reader sees a
whole chunk or none, and a writer killed mid-file leaves only a temporary file. Temporary files are
reclaimed by age and owner, not by whether their writer's pid is alive (a restarted container reuses
pids): one owned by this process's user and older than TMP_MAX_AGE_S is deleted at start and on a
store once that long has passed since the last sweep. A write takes milliseconds, so such a file is
abandoned.

Bad days. A load not finished `deadline_s` (30 s) after its submission is answered "miss"
(kvcache.tiers.base.TierBookkeeping: a read blocked on a hung network mount cannot be interrupted, so
its result, when it comes, is dropped); a store begins no chunk's write past `deadline_s` after its
submission (those chunks are "failed", counted in `deadline_misses` too). A root that cannot be written (a read-only mount, no permission) disables the tier with one
warning: lookups miss, stores fail, and the engine starts and serves without it. A chunk that fails
verification is deleted; one that cannot be deleted (a read-only directory) is remembered as a miss, so
its lookups stop answering HIT. With a shared secret (`secret_file`, or $GLM53_KV_SECRET_FILE;
kvcache.tiers.auth) every chunk carries a MAC and a chunk without a valid one is refused like a damaged
one: a writer without the secret cannot plant KV in a shared root. Reads and writes run on
separate thread pools (file I/O and zlib.crc32 release the GIL), so loads are not queued behind stores.
No fsync: a finished rename survives the process (SIGKILL included), not a crash of the machine.

Capacity: `max_bytes` ("auto", the default: AUTO_FRACTION of the free space on the root's filesystem at
start plus the chunks found there, so a filled disk still leaves room for everything else; None:
unbounded) over the chunk files this tier knows (those it found at start and
those it wrote or read since), least recently used deleted first. Two engine processes (or two
data-parallel replicas, each with its own tier) may share one root: both find each other's chunks (a
lookup is a stat of the chunk's path); each bounds what it knows of, so together they may hold up to
twice `max_bytes`.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvcache.tiers.auth import check_secret_file, load_secret
from kvcache.tiers.base import JobResult, LoadJob, Lookup, StoreJob, TierBookkeeping, TierStats
from kvcache.tiers.format import HEADER, SUFFIX, as_bytes, chunk_name, encode_header, header_ok

__all__ = ["AUTO_FRACTION", "HEADER", "FileTier", "check_options"]
OPTIONS = {"root_dir": None, "max_bytes": "auto", "read_threads": 4, "write_threads": 4, "name": "fs",
           "secret_file": None, "deadline_s": 30.0}
AUTO_FRACTION = 0.5  # max_bytes="auto": this fraction of (free space at start + the chunks already there)
TMP_MAX_AGE_S = 120.0  # a temporary file this old is abandoned (its writer died): reclaimed
MAX_UNDELETABLE = 1 << 16  # corrupt chunks remembered as misses because they could not be deleted

_log = logging.getLogger(__name__)


def check_options(opts: dict) -> None:
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise ValueError(f"secondary tier 'fs': unknown keys {sorted(unknown)} (allowed: {sorted(OPTIONS)})")
    if not isinstance(opts.get("root_dir"), (str, os.PathLike)) or not str(opts["root_dir"]):
        raise ValueError("secondary tier 'fs' needs root_dir (a directory path)")
    mb = opts.get("max_bytes", OPTIONS["max_bytes"])
    if mb is not None and mb != "auto" and (not isinstance(mb, int) or isinstance(mb, bool) or mb <= 0):
        raise ValueError(f"secondary tier 'fs': max_bytes must be a positive int, 'auto' or None, got {mb!r}")
    check_secret_file(opts.get("secret_file"), "secondary tier 'fs'")
    d = opts.get("deadline_s", OPTIONS["deadline_s"])
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < float("inf"):
        raise ValueError(f"secondary tier 'fs': deadline_s must be a positive number of seconds, got {d!r}")
    for k in ("read_threads", "write_threads"):
        v = opts.get(k, OPTIONS[k])
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"secondary tier 'fs': {k} must be a positive int, got {v!r}")


class FileTier(TierBookkeeping):
    """A SecondaryTier (kvcache.tiers) on a directory. See the module docstring."""

    kv_event_locality = "LOCAL"  # KV events (kvcache.events): medium "STORAGE", a local filesystem

    def __init__(self, *, fingerprint: str, root_dir, max_bytes: int | str | None = "auto", read_threads: int = 4,
                 write_threads: int = 4, name: str = "fs", secret_file=None, deadline_s: float = 30.0):
        check_options({"root_dir": root_dir, "max_bytes": max_bytes, "read_threads": read_threads,
                       "write_threads": write_threads, "secret_file": secret_file, "deadline_s": deadline_s})
        self.name, self.deadline_s = name, float(deadline_s)
        self.root, self.fingerprint = Path(root_dir), fingerprint
        self.dir = self.root / fingerprint[:32]
        self._secret = load_secret(secret_file, who=f"secondary tier {name!r}")
        self.stats = TierStats()
        super().__init__()  # the lock, the finished jobs, the removal log
        self._inflight: collections.Counter[bytes] = collections.Counter()  # keys being written
        self._known: collections.OrderedDict[str, int] = collections.OrderedDict()  # path -> bytes, LRU first
        self._undeletable: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # corrupt, still there
        self._bytes = 0
        self.disabled = not self._writable()
        self._last_sweep = time.monotonic()
        if not self.disabled:
            self._scan()
        self.max_bytes = self._auto_bytes() if max_bytes == "auto" else max_bytes
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix=f"{name}-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix=f"{name}-write")
        self._closed = False

    # --------------------------------------------------------------------------------------- layout
    def path(self, key: bytes) -> Path:
        return self.root / chunk_name(self.fingerprint, key)

    def _writable(self) -> bool:
        """Whether this tier can write under its root (creating its directory); False, with one warning,
        for a read-only mount or a root without permission: the tier is then disabled, not an error."""
        probe = self.dir / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe.touch()
            probe.unlink()
            return True
        except OSError as e:
            _log.warning("secondary tier %r: cannot write under %s (%s): the tier is disabled, its lookups miss",
                         self.name, self.root, e.strerror or e)
            return False

    def _auto_bytes(self) -> int | None:
        """max_bytes="auto": AUTO_FRACTION of the free space at start plus the chunks this tier found."""
        if self.disabled:
            return None
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return None
        return max(int(AUTO_FRACTION * (free + self._bytes)), 1)

    def _scan(self) -> None:
        """Index the chunk files already under the root (oldest first) and reclaim abandoned temporary
        files."""
        found = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    _reclaim(entry, time.time())
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime, entry.path, st.st_size))
        for _, p, size in sorted(found):
            self._known[p] = size
            self._bytes += size

    def _sweep_temp(self) -> None:
        """Reclaim abandoned temporary files once TMP_MAX_AGE_S has passed since the last sweep (a writer
        thread: a killed process's files are reclaimed by its successor even when it got the same pid)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_sweep < TMP_MAX_AGE_S:
                return
            self._last_sweep = now
        wall = time.time()
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if sub.is_dir():
                for entry in os.scandir(sub):
                    if entry.name.endswith(".tmp"):
                        _reclaim(entry, wall)

    # ---------------------------------------------------------------------------------- the interface
    def lookup(self, key: bytes, ctx: object = None) -> Lookup:
        if self.disabled:
            return Lookup.MISS
        with self._lock:
            if self._inflight[key]:
                return Lookup.RETRY
            if key in self._undeletable:
                return Lookup.MISS
        return Lookup.HIT if self.path(key).is_file() else Lookup.MISS

    def submit_store(self, job: StoreJob) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        if self.disabled:
            with self._lock:
                self.stats.store_failed += len(job.keys)
                self._finished.append(JobResult(job.job_id, "store", ("failed",) * len(job.keys)))
            return
        with self._lock:
            self._inflight.update(job.keys)
        self._writers.submit(self._store, job, time.perf_counter(), time.monotonic() + self.deadline_s)

    def submit_load(self, job: LoadJob) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is shut down")
        if self.disabled:
            with self._lock:
                self._finished.append(JobResult(job.job_id, "load", ("miss",) * len(job.keys), (None,) * len(job.keys)))
            return
        self._load_due(job, self.deadline_s)  # a read blocked on a hung mount cannot hold the request longer
        self._readers.submit(self._load, job, time.perf_counter())

    def _note_removed(self, p: str) -> None:
        """Under the lock: chunk file `p` is gone."""
        self._note_removed_key(bytes.fromhex(os.path.basename(p)[: -len(SUFFIX)]))

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._writers.shutdown(wait=wait, cancel_futures=not wait)
        self._readers.shutdown(wait=wait, cancel_futures=not wait)

    # ------------------------------------------------------------------------------------ the workers
    def _store(self, job: StoreJob, t0: float, deadline: float) -> None:
        """Write the job's chunks in order; none is begun past `deadline` (monotonic s, deadline_s after
        submission): those are "failed", counted in store_failed and deadline_misses, so a store queued
        behind writes to a hung mount gives its keys back (lookups stop answering RETRY for them) instead
        of holding them for as long as the mount hangs."""
        self._sweep_temp()
        status = []
        for key, payload in zip(job.keys, job.payloads):
            try:
                if time.monotonic() >= deadline:
                    with self._lock:
                        self.stats.store_failed += 1
                        self.stats.deadline_misses += 1
                    status.append("failed")
                    continue
                status.append(self._write(key, payload))
            except Exception:  # noqa: BLE001 - a failed write is a chunk not stored, never an engine error
                with self._lock:
                    self.stats.store_failed += 1
                status.append("failed")
            finally:
                with self._lock:
                    self._inflight[key] -= 1
                    if not self._inflight[key]:
                        del self._inflight[key]
        with self._lock:
            self.stats.store_latency.observe(time.perf_counter() - t0)
            self._finished.append(JobResult(job.job_id, "store", tuple(status)))

    def _write(self, key: bytes, payload) -> str:
        path = self.path(key)
        if path.is_file():  # another writer got there first (same key, same bytes)
            self._touch(str(path), path.stat().st_size)
            return "ok"
        tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        data = as_bytes(payload)
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(encode_header(key, data, self._secret))
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            with self._lock:
                self.stats.store_failed += 1
            return "failed"
        size = HEADER.size + data.nbytes
        with self._lock:
            self.stats.stored_chunks += 1
            self.stats.store_bytes += data.nbytes
        self._touch(str(path), size)
        return "ok"

    def _touch(self, p: str, size: int) -> None:
        """`p` is now the most recently used file; evict past max_bytes. Under the lock, unlinks included:
        a victim's name cannot be rewritten by another thread between its eviction and its unlink."""
        with self._lock:
            if p in self._known:
                self._known.move_to_end(p)
            elif os.path.exists(p):  # not one another thread evicted meanwhile
                self._known[p] = size
                self._bytes += size
            while self.max_bytes is not None and self._bytes > self.max_bytes and len(self._known) > 1:
                old, n = self._known.popitem(last=False)
                self._bytes -= n
                _unlink(old)
                self._note_removed(old)
                self.stats.evicted_chunks += 1

    def _forget(self, p: str) -> None:
        with self._lock:
            n = self._known.pop(p, None)
            if n is not None:
                self._bytes -= n
            self._note_removed(p)

    def _load(self, job: LoadJob, t0: float) -> None:
        status, payloads = [], []
        for key, size in zip(job.keys, job.sizes):
            try:
                data = self._read(key, size)
            except Exception:  # noqa: BLE001 - an unreadable chunk is a miss, never an engine error
                self._drop_corrupt(key)
                data = "corrupt"
            if isinstance(data, str):
                status.append(data)
                payloads.append(None)
            else:
                status.append("ok")
                payloads.append(data)
        with self._lock:
            self.stats.load_latency.observe(time.perf_counter() - t0)
            self._finish_load(JobResult(job.job_id, "load", tuple(status), tuple(payloads)))

    def _read(self, key: bytes, size: int):
        """The verified payload of `key` (np.uint8 [size]), or "miss" / "corrupt" (the file deleted)."""
        path = self.path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            self._forget(str(path))
            return "miss"
        with f:
            head = f.read(HEADER.size)
            out = np.empty(size, np.uint8)
            n = f.readinto(memoryview(out)) if len(head) == HEADER.size else 0
            extra = f.read(1)
        if not (n == size and not extra and header_ok(head, key, out, self._secret)):
            self._drop_corrupt(key)
            return "corrupt"
        with self._lock:
            self.stats.loaded_chunks += 1
            self.stats.load_bytes += size
        self._touch(str(path), HEADER.size + size)
        return out


    def _drop_corrupt(self, key: bytes) -> None:
        """`key`'s file failed verification: delete it, or, where it cannot be deleted, remember it as a
        miss (else every lookup would answer HIT for a chunk every load refuses)."""
        path = self.path(key)
        if not _unlink(path) and path.exists():
            with self._lock:
                self._undeletable[key] = None
                if len(self._undeletable) > MAX_UNDELETABLE:
                    self._undeletable.popitem(last=False)
        self._forget(str(path))
        with self._lock:
            self.stats.corrupt += 1


def _unlink(p) -> bool:
    try:
        os.unlink(p)
        return True
    except OSError:
        return False


def _reclaim(entry: os.DirEntry, now: float) -> None:
    """Delete temporary file `entry` if this process's user owns it and it is older than TMP_MAX_AGE_S
    (another user's files are theirs to reclaim; a young one may be a live writer's)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return
    if st.st_uid == os.getuid() and now - st.st_mtime > TMP_MAX_AGE_S:
        _unlink(entry.path)
