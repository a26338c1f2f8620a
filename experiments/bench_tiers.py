"""Speed of the offload tiers (issue 20, item 9): the filesystem tier's write and read bandwidth against a
plain sequential copy of the same bytes on the same disk, and the host tier's planning rate (prefix
lookups and stores per second: the policy's work per page, not the copies, which the runner does).

    python -m experiments.bench_tiers --out results/bench_tiers

The filesystem tier writes one file per chunk (temporary file, header with CRC-32, rename) on a pool of
writer threads and reads on a pool of readers; the baseline writes the same chunks one after the other
into one file with `write` and reads them back with `readinto`. Both go through the page cache; before
each read pass the page cache is dropped when the process may (root: /proc/sys/vm/drop_caches), and the
results say whether it was; every write pass starts after a sync, so no pass pays for an earlier
one's write-back. The issue's goal: the tier at least half the baseline's bandwidth. Chunk
sizes: 1 and 4 MiB (a GLM-5.3 MLA page of 64 tokens over 78 layers in fp8 is 3.3 MB). Writes
OUT/results.json and OUT/table.md. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.common import cpu_name, git_revision, out_dir_from_cli

MiB = 1 << 20


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def baseline(root: Path, chunks: list[np.ndarray]) -> dict:
    """One file, written chunk after chunk and read back the same way."""
    path = root / "sequential.bin"
    _drop_caches()  # each write pass starts with no dirty pages of an earlier pass being written back
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for c in chunks:
            f.write(memoryview(c))
    write_s = time.perf_counter() - t0
    dropped = _drop_caches()
    buf = np.empty_like(chunks[0])
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        for _ in chunks:
            f.readinto(memoryview(buf))
    read_s = time.perf_counter() - t0
    path.unlink()
    n = sum(c.nbytes for c in chunks)
    return {"write_GBps": n / write_s / 1e9, "read_GBps": n / read_s / 1e9, "cache_dropped": dropped}


def fs_tier(root: Path, chunks: list[np.ndarray], threads: int) -> dict:
    from kvcache.tiers import LoadJob, StoreJob, chunk_key
    from kvcache.tiers.fs import FileTier

    fp = "be" * 32
    tier = FileTier(fingerprint=fp, root_dir=root, read_threads=threads, write_threads=threads)
    keys = [chunk_key(fp, "mla", i.to_bytes(32, "little")) for i in range(len(chunks))]
    _drop_caches()

    def wait(kind, n):
        done = []
        while len(done) < n:
            done += [r for r in tier.get_finished_jobs() if r.kind == kind]
            time.sleep(0.0002)
        return done

    t0 = time.perf_counter()
    for i, (k, c) in enumerate(zip(keys, chunks)):
        tier.submit_store(StoreJob(i, (k,), (c,)))
    stored = wait("store", len(chunks))
    write_s = time.perf_counter() - t0
    dropped = _drop_caches()
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        tier.submit_load(LoadJob(i, (k,), (chunks[0].nbytes,)))
    loaded = wait("load", len(chunks))
    read_s = time.perf_counter() - t0
    tier.shutdown()
    ok = all(r.status == ("ok",) for r in stored + loaded)
    n = sum(c.nbytes for c in chunks)
    return {"write_GBps": n / write_s / 1e9, "read_GBps": n / read_s / 1e9, "cache_dropped": dropped, "all_ok": ok}


def host_tier_rate(pages: int = 4096, tokens_per_page: int = 16, requests: int = 64) -> dict:
    """The offload policy's planning work per page: stores (after_step over requests whose pages all
    filled) and prefix lookups (admissions that hit every page on the host), in pages per second."""
    from kvcache.block_pool import KVCacheManager
    from kvcache.policies.offload import OffloadPolicy

    class Req:
        def __init__(self, i, toks):
            self.req_id, self._t, self.extra_keys, self.num_computed_tokens = f"r{i}", toks, (), 0

        @property
        def num_tokens(self):
            return len(self._t)

        @property
        def tokens(self):
            return self._t

    per_req = pages // requests
    rng = np.random.default_rng(0)
    reqs = [Req(i, rng.integers(0, 1 << 20, per_req * tokens_per_page + 1).tolist()) for i in range(requests)]
    groups = ("mla", "indexer")
    kv = KVCacheManager((pages + requests) * 2 + 16, tokens_per_page, groups, enable_prefix_caching=False)
    pol = OffloadPolicy({g: pages + 16 for g in groups}, {g: 1 for g in groups})
    for r in reqs:  # every page computed
        pol.admit(kv, r)
        kv.allocate(r.req_id, r.num_tokens)
        pol.prepare(kv, r, r.num_tokens)
        kv.cache_full_blocks(r.req_id, r.tokens, r.num_tokens, ())
    t0 = time.perf_counter()
    pol.after_step(kv, reqs)
    store_s = time.perf_counter() - t0
    stored = pol.stats.stored_pages
    for r in reqs:
        pol.on_finish(kv, r)
        kv.free(r.req_id)
    pol.take_transfers()
    t0 = time.perf_counter()
    looked = 0
    for r in reqs:
        looked += pol.admit(kv, r) // tokens_per_page * len(groups)
        pol.forget(kv, r)
        kv.free(r.req_id, keep_hashes=True)
    lookup_s = time.perf_counter() - t0
    return {"stores_per_s": stored / store_s, "lookups_per_s": looked / lookup_s, "pages_stored": stored,
            "pages_looked_up": looked}


def main(argv=None) -> int:
    out = out_dir_from_cli(argv, "experiments.bench_tiers", __doc__, "results/bench_tiers")
    total = int(os.environ.get("BENCH_TIERS_BYTES", 512 * MiB))
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=os.environ.get("BENCH_TIERS_DIR")))
    try:
        for size in (1 * MiB, 4 * MiB):
            rng = np.random.default_rng(size)
            chunks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(total // size)]
            base = baseline(work, chunks)
            for threads in (1, 4):
                sub = work / f"fs-{size}-{threads}"
                tier = fs_tier(sub, chunks, threads)
                shutil.rmtree(sub)
                rows.append({"chunk_bytes": size, "chunks": len(chunks), "threads": threads,
                             "baseline": base, "fs": tier,
                             "write_fraction_of_baseline": tier["write_GBps"] / base["write_GBps"],
                             "read_fraction_of_baseline": tier["read_GBps"] / base["read_GBps"]})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    host = host_tier_rate()
    result = {"experiment": "bench_tiers", "date": time.strftime("%Y-%m-%d"), "commit": git_revision(),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "disk_dir": str(work.parent)},
              "bytes_per_run": total, "fs_vs_sequential": rows, "host_tier_planning": host}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| chunk | threads | seq write GB/s | fs write GB/s | ratio | seq read GB/s | fs read GB/s | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['chunk_bytes'] // MiB} MiB | {r['threads']} | {r['baseline']['write_GBps']:.2f} | "
                     f"{r['fs']['write_GBps']:.2f} | {r['write_fraction_of_baseline']:.2f} | "
                     f"{r['baseline']['read_GBps']:.2f} | {r['fs']['read_GBps']:.2f} | "
                     f"{r['read_fraction_of_baseline']:.2f} |")
    lines += ["", f"Host tier planning: {host['stores_per_s']:,.0f} page stores/s, "
                  f"{host['lookups_per_s']:,.0f} page lookups/s (policy work only).",
              f"Page cache dropped before reads: {rows[0]['baseline']['cache_dropped']}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
