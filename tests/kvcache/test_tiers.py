"""Secondary KV tiers (kvcache.tiers) with real files: the filesystem tier's format, verification,
capacity and crash safety on its own, then behind the offload host tier in the engine, where every
request must give the same greedy tokens as an engine without tiers whatever the tier did, with the
counters saying what happened."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine
from kvcache.tiers import Lookup, LoadJob, StoreJob, TierSet, chunk_key, make_tier
from kvcache.tiers.fs import HEADER, TMP_MAX_AGE_S, FileTier
from tests import models

REPO = Path(__file__).resolve().parents[2]
FP = "ab" * 32  # a fingerprint


def _key(i: int) -> bytes:
    return chunk_key(FP, "mla", i.to_bytes(32, "little"))


def _payload(i: int, n: int = 4096) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def _wait(tier, kind: str, n: int, timeout: float = 10.0) -> list:
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += [r for r in tier.get_finished_jobs() if r.kind == kind]
        time.sleep(0.002)
    assert len(out) == n, f"{len(out)} of {n} {kind} jobs finished"
    return out


def _store(tier, items) -> list:
    keys = tuple(_key(i) for i in items)
    tier.submit_store(StoreJob(1, keys, tuple(_payload(i) for i in items)))
    return _wait(tier, "store", 1)[0].status


def _load(tier, items, n: int = 4096):
    tier.submit_load(LoadJob(2, tuple(_key(i) for i in items), (n,) * len(items)))
    return _wait(tier, "load", 1)[0]


# ------------------------------------------------------------------------------------ the fs tier alone
def test_fs_roundtrip_and_lookup(tmp_path):
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    assert tier.lookup(_key(0)) is Lookup.MISS
    assert _store(tier, [0, 1]) == ("ok", "ok")
    assert tier.lookup(_key(0)) is Lookup.HIT and tier.lookup(_key(2)) is Lookup.MISS
    r = _load(tier, [1, 0, 2])
    assert r.status == ("ok", "ok", "miss")
    np.testing.assert_array_equal(r.payloads[0], _payload(1))
    np.testing.assert_array_equal(r.payloads[1], _payload(0))
    assert tier.stats.stored_chunks == 2 and tier.stats.loaded_chunks == 2 and tier.stats.load_bytes == 2 * 4096
    # one file per chunk, named by its key, under a directory named by the fingerprint
    files = sorted(p.name for p in tmp_path.rglob("*.kv"))
    assert files == sorted(_key(i).hex() + ".kv" for i in (0, 1))
    assert all(p.parent.parent.name == FP[:32] for p in tmp_path.rglob("*.kv"))
    tier.shutdown()


def test_fs_lookup_answers_retry_while_its_store_is_in_flight(tmp_path, monkeypatch):
    tier = FileTier(fingerprint=FP, root_dir=tmp_path, write_threads=1)
    gate = threading.Event()
    write = tier._write
    monkeypatch.setattr(tier, "_write", lambda key, payload: (gate.wait(10), write(key, payload))[1])
    tier.submit_store(StoreJob(1, (_key(0),), (_payload(0),)))
    assert tier.lookup(_key(0)) is Lookup.RETRY
    gate.set()
    _wait(tier, "store", 1)
    assert tier.lookup(_key(0)) is Lookup.HIT
    tier.shutdown()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "foreign", "other_key", "empty"])
def test_fs_unverifiable_chunk_is_a_corrupt_miss_and_deleted(tmp_path, damage):
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    _store(tier, [0, 1])
    path = tier.path(_key(0))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip_payload":
        data[HEADER.size + 1000] ^= 0x40
    elif damage == "flip_header":
        data[20] ^= 0x01  # inside the key
    elif damage == "foreign":
        data = bytearray(b"not a chunk at all" * 300)
    elif damage == "other_key":
        data = bytearray(tier.path(_key(1)).read_bytes())  # a valid chunk under the wrong name
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    r = _load(tier, [0, 1])
    assert r.status == ("corrupt", "ok") and r.payloads[0] is None
    assert not path.exists() and tier.stats.corrupt == 1
    assert tier.lookup(_key(0)) is Lookup.MISS  # the next lookup recomputes instead
    tier.shutdown()


def test_fs_capacity_evicts_least_recently_used(tmp_path):
    size = HEADER.size + 4096
    tier = FileTier(fingerprint=FP, root_dir=tmp_path, max_bytes=3 * size)
    _store(tier, [0, 1, 2])
    _load(tier, [0])  # 0 is now the most recently used
    _store(tier, [3])
    assert [tier.lookup(_key(i)) for i in range(4)] == [Lookup.HIT, Lookup.MISS, Lookup.HIT, Lookup.HIT]
    assert tier.stats.evicted_chunks == 1 and sum(1 for _ in tmp_path.rglob("*.kv")) == 3
    # a tier started later on the same root knows the files there and keeps the bound
    again = FileTier(fingerprint=FP, root_dir=tmp_path, max_bytes=3 * size)
    _store(again, [4])
    assert sum(1 for _ in tmp_path.rglob("*.kv")) == 3
    tier.shutdown()
    again.shutdown()


def test_fs_two_tiers_on_one_root_share_only_their_fingerprint(tmp_path):
    a = FileTier(fingerprint=FP, root_dir=tmp_path)
    b = FileTier(fingerprint=FP, root_dir=tmp_path)
    other = FileTier(fingerprint="cd" * 32, root_dir=tmp_path)
    _store(a, [0])
    assert b.lookup(_key(0)) is Lookup.HIT and other.lookup(_key(0)) is Lookup.MISS
    np.testing.assert_array_equal(_load(b, [0]).payloads[0], _payload(0))
    for t in (a, b, other):
        t.shutdown()


def test_fs_failed_write_is_a_failed_store_not_an_error(tmp_path):
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    sub = tier.path(_key(0)).parent
    sub.write_bytes(b"")  # a file where the chunk's directory would be: every write there fails
    assert _store(tier, [0]) == ("failed",)
    assert tier.stats.store_failed == 1 and tier.lookup(_key(0)) is Lookup.MISS
    assert [p for p in tmp_path.rglob("*.tmp")] == []
    tier.shutdown()


_WRITER = """
import sys, numpy as np
from kvcache.tiers import StoreJob, chunk_key
from kvcache.tiers.fs import FileTier
tier = FileTier(fingerprint=sys.argv[2], root_dir=sys.argv[1], write_threads=2)
big = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
for i in range(10 ** 6):
    tier.submit_store(StoreJob(i, (chunk_key(sys.argv[2], "mla", i.to_bytes(32, "little")),), (big,)))
    if i == 4:
        print("writing", flush=True)
"""


def test_fs_writer_killed_mid_file_leaves_only_whole_chunks(tmp_path):
    """SIGKILL a process while it writes 8 MiB chunks: every chunk file left verifies, and a tier started
    afterwards deletes the dead writer's temporary files once they are older than TMP_MAX_AGE_S (by age,
    not by their pid: tests/kvcache/test_tiers_trust.py)."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), FP], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "writing"
    deadline = time.monotonic() + 30
    while not list(tmp_path.rglob("*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert list(tmp_path.rglob("*.tmp")), "the writer never had a file half-written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.rglob("*.tmp"))  # it died mid-file
    then = time.time() - TMP_MAX_AGE_S - 1
    for p in tmp_path.rglob("*.tmp"):  # as a restart that long after finds them
        os.utime(p, (then, then))
    tier = FileTier(fingerprint=FP, root_dir=tmp_path)
    assert list(tmp_path.rglob("*.tmp")) == []
    whole = sorted(tmp_path.rglob("*.kv"))
    keys = [bytes.fromhex(p.name[:-3]) for p in whole]
    if keys:
        tier.submit_load(LoadJob(1, tuple(keys), (8 << 20,) * len(keys)))
        assert set(_wait(tier, "load", 1)[0].status) == {"ok"}
    tier.shutdown()


def test_tier_specs_are_checked():
    with pytest.raises(ValueError, match="root_dir"):
        make_tier({"type": "fs"}, FP)
    with pytest.raises(ValueError, match="unknown keys"):
        make_tier({"type": "fs", "root_dir": "/tmp/x", "size": 1}, FP)
    with pytest.raises(ValueError, match="type must be one of"):
        make_tier({"type": "tape"}, FP)
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        DeployConfig(kv_transfer_config=_ktc("/tmp/x", kv_load_failure_policy="ignore"))
    with pytest.raises(ValueError, match="max_bytes"):
        DeployConfig(kv_transfer_config=_ktc("/tmp/x", max_bytes=-1))


# --------------------------------------------------------------------------------- behind the host tier
# test_offload's deployment (the same compiled programs) and the session's reference prompts: 37, 5, 70
# and 20 tokens, 5 greedy tokens each
BASE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
STORED = 2 * sum((n + 4) // 8 for n in (37, 5, 70, 20))  # full pages once each request is done, both groups
HIT_BLOCKS = sum((n - 1) // 8 for n in (37, 5, 70, 20))  # full pages short of each prompt's last token


def _ktc(root, kv_load_failure_policy="recompute", cpu=1 << 20, **fs):
    tier = {"type": "fs", "root_dir": str(root), **fs}
    return {"kv_connector": "OffloadingConnector", "kv_load_failure_policy": kv_load_failure_policy,
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu, "secondary_tiers": [tier]}}


@pytest.fixture
def runs(small_reference):
    return small_reference


@pytest.fixture(scope="module")
def stored(small_model, small_reference, tmp_path_factory):
    """A root holding every chunk of the reference prompts, and the metrics of the engine that stored them."""
    import shutil

    root = tmp_path_factory.mktemp("stored")
    eng, out = _run(small_model, small_reference[0], root)
    assert out == small_reference[1]

    def copy(dst):
        shutil.copytree(root, dst, dirs_exist_ok=True)
        return dst

    return copy, eng


def _run(model, prompts, root, **kw):
    eng = Engine(model, DeployConfig(**BASE, kv_transfer_config=_ktc(root, **kw)))
    out = [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5)]
    eng.shutdown()
    return eng, out


def test_a_new_engine_on_the_same_root_reloads_every_full_page(small_model, runs, stored, tmp_path):
    """Engine 1 stored every full page through its host tier to the filesystem; engine 2 (empty device
    pool and host tier) loads each prompt's full pages from there and prefills only the last partial
    page: the same tokens, the hits counted in chunks and bytes. Another model's KV never meets it."""
    prompts, want = runs
    copy, first = stored
    m = first.metrics()["kv_offload"]
    assert m["fs"]["stored_chunks"] == m["cpu"]["stored_pages"] == STORED
    assert m["fs"]["store_bytes"] == m["cpu"]["store_bytes"] and m["fs"]["store_failed"] == 0
    second, out = _run(small_model, prompts, copy(tmp_path))
    assert out == want
    m = second.metrics()["kv_offload"]
    assert m["fs"]["hits"] == m["fs"]["loaded_chunks"] == 2 * HIT_BLOCKS and m["fs"]["corrupt"] == 0
    assert m["fs"]["load_bytes"] == HIT_BLOCKS * sum(second.sizes.page_bytes.values())
    assert second.scheduler.stats.prefix_hit_tokens == 8 * HIT_BLOCKS
    assert second.metrics()["kv_offload"]["cpu"]["hits"] == HIT_BLOCKS  # then loaded host -> device
    # each job's I/O time, in the engine's metrics and as vLLM-named Prometheus histograms per tier
    assert m["fs"]["load_jobs"] >= 1 and m["fs"]["load_time_s"] > 0
    assert first.metrics()["kv_offload"]["fs"]["store_jobs"] >= 1
    from prometheus_client.parser import text_string_to_metric_families

    from glm53.engine.prometheus import ServingMetrics

    samples = {(x.name, x.labels.get("tier")): x.value
               for f in text_string_to_metric_families(ServingMetrics(second, "tiny").text()) for x in f.samples}
    assert samples[("vllm:kv_offload_load_time_seconds_count", "fs")] == m["fs"]["load_jobs"]
    assert samples[("vllm:kv_offload_load_time_seconds_sum", "fs")] == pytest.approx(m["fs"]["load_time_s"])
    assert samples[("vllm:kv_offload_hits_total", "fs")] == m["fs"]["hits"]
    # other weights of the same architecture, or another layout, name another directory
    from glm53.engine.build import kv_fingerprint

    other = models.small_model(seed=1)
    assert kv_fingerprint(other, second.deploy, second.sizes) != second.fingerprint
    d = DeployConfig(**BASE, kv_transfer_config=_ktc(tmp_path), kv_cache_dtype="bfloat16").resolved(small_model.cfg)
    assert kv_fingerprint(small_model, d, d.kv_sizes(small_model.cfg)) != second.fingerprint
    assert kv_fingerprint(small_model, second.deploy, second.sizes) == second.fingerprint


def test_an_engine_of_other_page_spans_reads_the_root_through_read_page_tokens(small_model, runs, stored, tmp_path):
    """The root engine 1 wrote with 8-token pages, read by an engine of 16-token pages (block_size 16: the
    spans, and so the chunks, of a DCP2 engine with block_size 8, whose fingerprint is the same) that lists
    the writer's spans (`read_page_tokens`): each of its pages within a prompt's all-but-last tokens is
    assembled from two of the writer's chunks, the same greedy tokens. Its own keys name nothing there."""
    prompts, want = runs
    read = [{"mla": 8, "indexer": 8}]
    kw = dict(BASE, block_size=16)
    eng = Engine(small_model, DeployConfig(**kw, kv_transfer_config=_ktc(stored[0](tmp_path), read_page_tokens=read)))
    out = [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5)]
    eng.shutdown()
    assert out == want
    pages = sum((n - 1) // 16 for n in (37, 5, 70, 20))
    assert eng.scheduler.stats.prefix_hit_tokens == 16 * pages
    m = eng.metrics()["kv_offload"]["fs"]
    assert m["hits"] == 2 * pages and m["loaded_chunks"] == 0  # every page assembled, none under our own keys
    ((spans, reader),) = eng.tiers[0].tiers[0].also  # the root opened under the writer's fingerprint
    assert spans.fingerprint == stored[1].fingerprint
    assert reader.stats.loaded_chunks == 2 * 2 * pages and reader.stats.corrupt == 0  # two per page and group
    from glm53.engine.build import kv_fingerprint

    dcp2 = DeployConfig(**BASE, decode_context_parallel_size=2).resolved(small_model.cfg)
    assert kv_fingerprint(small_model, dcp2, dcp2.kv_sizes(small_model.cfg)) == eng.fingerprint != stored[1].fingerprint


def test_corrupt_chunks_are_recomputed_or_fail_by_policy(small_model, runs, stored, tmp_path):
    prompts, want = runs
    root = stored[0](tmp_path)
    files = sorted(root.rglob("*.kv"))
    for p in files[::2]:  # flip one payload byte in every other chunk
        data = bytearray(p.read_bytes())
        data[-7] ^= 0xFF
        p.write_bytes(bytes(data))
    eng, out = _run(small_model, prompts[:2], root)
    assert out == want[:2]
    fs = eng.metrics()["kv_offload"]["fs"]
    assert fs["corrupt"] >= 1 and fs["hits"] >= 1
    # each corrupt chunk it read was deleted, its tokens recomputed and stored again: a third engine reads
    # only whole chunks (the last full page of each prompt is never looked up, so never checked)
    again, out = _run(small_model, prompts[:2], root)
    assert out == want[:2] and again.metrics()["kv_offload"]["fs"]["corrupt"] == 0
    assert again.metrics()["kv_offload"]["fs"]["hits"] == 2 * sum((n - 1) // 8 for n in (37, 5))
    for p in sorted(root.rglob("*.kv"))[::2]:
        data = bytearray(p.read_bytes())
        data[-7] ^= 0xFF
        p.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="kv_load_failure_policy='fail'"):
        _run(small_model, prompts[:2], root, kv_load_failure_policy="fail")


class _Evicting:
    """A custom tier (module_path) around the fs tier that deletes a chunk right after answering HIT for
    it: eviction between lookup and load."""

    def __init__(self, *, fingerprint, root_dir):
        self.inner = FileTier(fingerprint=fingerprint, root_dir=root_dir)
        self.name, self.stats = "evicting", self.inner.stats

    def lookup(self, key, ctx=None):
        r = self.inner.lookup(key)
        if r is Lookup.HIT:
            self.inner.path(key).unlink()
        return r

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _custom_tier_engine(model, cls: str, root, kv_load_failure_policy: str = "recompute") -> Engine:
    """An engine whose one secondary tier is this module's class `cls` on `root` (loaded by module_path)."""
    spec = {"type": "custom", "module_path": f"{__name__}:{cls}", "root_dir": str(root)}
    ktc = {"kv_connector": "OffloadingConnector", "kv_load_failure_policy": kv_load_failure_policy,
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [spec]}}
    return Engine(model, DeployConfig(**BASE, kv_transfer_config=ktc))


def test_a_chunk_evicted_between_lookup_and_load_is_recomputed(small_model, runs, stored, tmp_path):
    prompts, want = runs
    stored[0](tmp_path)
    eng = _custom_tier_engine(small_model, "_Evicting", tmp_path)
    assert [o.token_ids.tolist() for o in eng.generate(prompts[:1], max_new_tokens=5)] == want[:1]
    tier = eng.metrics()["kv_offload"]["evicting"]
    assert tier["lost"] >= 1 and tier["hits"] == 0
    eng.shutdown()


def test_a_lost_chunk_under_fail_ends_only_the_requests_that_needed_it(small_model, runs, stored, tmp_path):
    """kv_load_failure_policy "fail", every chunk of a prompt evicted between lookup and load: that
    request ends "error" with no token, its error naming the policy, the tier and a lost chunk; no host
    page stays pinned or reserved for it (every host page is free), and no step raised. The request
    beside it completes with its greedy tokens, and the engine serves on: the same prompt again finds
    nothing in the tier and recomputes its reference tokens."""
    prompts, want = runs
    stored[0](tmp_path)
    eng = _custom_tier_engine(small_model, "_Evicting", tmp_path, kv_load_failure_policy="fail")
    a = eng.add_request(prompts[0], glm53.SamplingParams(5))
    b = eng.add_request(prompts[1], glm53.SamplingParams(5))
    while eng.has_unfinished():
        eng.step()  # a StepError here would be the whole step failing
    ra = eng.finished[a]
    assert ra.finish_reason == "error" and ra.output_ids == [], (ra.finish_reason, ra.output_ids)
    assert "kv_load_failure_policy='fail'" in ra.error and "'evicting'" in ra.error and "(miss)" in ra.error
    assert eng.finished[b].finish_reason == "length" and eng.output(b).token_ids.tolist() == want[1]
    ht = eng.scheduler.policy.host_tier
    assert not ht.tier_pins and not ht.jobs and not ht.loading and not ht.inflight
    assert all(p.num_free == p.num_blocks for p in ht.pools.values())
    assert eng.metrics()["kv_offload"]["evicting"]["lost"] == 2 * ((len(prompts[0]) - 1) // 8)
    assert [o.token_ids.tolist() for o in eng.generate(prompts[:1], max_new_tokens=5)] == want[:1]
    eng.shutdown()


class _Busy(_Evicting):
    """A custom tier that answers RETRY to its first three lookups (as for stores in flight)."""

    def __init__(self, *, fingerprint, root_dir):
        super().__init__(fingerprint=fingerprint, root_dir=root_dir)
        self.name, self.asked = "busy", 0

    def lookup(self, key, ctx=None):
        self.asked += 1
        return Lookup.RETRY if self.asked <= 3 else self.inner.lookup(key)


def test_retry_answers_keep_the_request_waiting_then_it_hits(small_model, runs, stored, tmp_path):
    """The admission waits while the tier answers RETRY (other requests run meanwhile), then loads."""
    prompts, want = runs
    stored[0](tmp_path)
    eng = _custom_tier_engine(small_model, "_Busy", tmp_path)
    assert [o.token_ids.tolist() for o in eng.generate(prompts, max_new_tokens=5)] == want
    tier = eng.metrics()["kv_offload"]["busy"]
    assert tier["retries"] == 3 and tier["hits"] == 2 * HIT_BLOCKS and tier["lost"] == tier["corrupt"] == 0
    eng.shutdown()


class _Held(_Evicting):
    """A custom tier whose loads wait until the test lets them go (`release`)."""

    def __init__(self, *, fingerprint, root_dir):
        super().__init__(fingerprint=fingerprint, root_dir=root_dir)
        self.name, self.held = "held", []

    def lookup(self, key, ctx=None):
        return self.inner.lookup(key)

    def submit_load(self, job):
        self.held.append(job)

    def release(self):
        for job in self.held:
            self.inner.submit_load(job)
        self.held = []


def test_aborting_a_request_that_waits_for_tier_loads_releases_its_host_pages(small_model, runs, stored, tmp_path):
    """A request whose prefix is loading from a tier is aborted: its pinned host pages are freed; the
    loads still land in the host tier, unpinned, where the same prompt later hits them (no second
    load); nothing stays pinned."""
    prompts, want = runs
    stored[0](tmp_path)
    eng = _custom_tier_engine(small_model, "_Held", tmp_path)
    tier, pol = eng.tiers[0].tiers[0], eng.scheduler.policy
    a = eng.add_request(prompts[0], glm53.SamplingParams(5))
    other = eng.add_request(prompts[1], glm53.SamplingParams(5))
    for _ in range(50):
        eng.step()
        if tier.held:
            break
    req = eng.requests[a]
    assert tier.held and pol.waiting_for(req) and a in pol.host_tier.tier_pins or a in pol.host_tier.loading
    eng.abort_request(a)
    assert a not in pol.host_tier.loading and a not in pol.host_tier.tier_pins
    assert eng.finished[a].finish_reason == "abort"
    tier.release()
    while eng.has_unfinished():
        eng.step()
    assert eng.output(other).token_ids.tolist() == want[1]
    assert all(p.num_free == p.num_blocks for p in pol.host.values())  # nothing pinned
    loads = eng.metrics()["kv_offload"]["held"]["hits"]
    assert loads >= 1
    again = eng.generate(prompts[:1], max_new_tokens=5)  # from the host tier now, no new tier load
    assert again[0].token_ids.tolist() == want[0] and eng.metrics()["kv_offload"]["held"]["hits"] == loads
    assert eng.metrics()["kv_offload"]["cpu"]["hits"] >= loads // 2
    eng.shutdown()


def test_tier_set_answers_in_order(tmp_path):
    a = FileTier(fingerprint=FP, root_dir=tmp_path / "a", name="a")
    b = FileTier(fingerprint=FP, root_dir=tmp_path / "b", name="b")
    tiers = TierSet([a, b])
    _store(b, [0])
    assert tiers.lookup(_key(0)) == (1, Lookup.HIT) and tiers.lookup(_key(1)) == (-1, Lookup.MISS)
    tiers.shutdown()


_PEER = """
import sys, json, numpy as np, glm53
from glm53 import DeployConfig, Engine
sys.path.insert(0, sys.argv[2])
from tests.kvcache.test_tiers import BASE, _ktc
from tests.models import small_model
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
model = small_model()
prompts = [np.array(p, np.int32) for p in json.loads(sys.argv[3])]  # the reference prompts
def run(ps):
    eng = Engine(model, DeployConfig(**BASE, kv_transfer_config=_ktc(sys.argv[1])))
    out = [o.token_ids.tolist() for o in eng.generate(ps, max_new_tokens=5)]
    eng.shutdown()
    return out, eng.metrics()["kv_offload"]["fs"]["hits"]
print(json.dumps(run(prompts[:2])), flush=True)
sys.stdin.readline()  # the other process has run
print(json.dumps(run(prompts[2:])), flush=True)
"""


@pytest.mark.slow
def test_two_engine_processes_on_one_root_both_hit(small_model, runs, tmp_path):
    """Process A stores prompts 0-1; this process runs all four (hits on A's two, stores 2-3); A then runs
    2-3 and hits on what this process stored."""
    prompts, want = runs
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("GLM53_TEST_COMPILE_CACHE", "")}  # shared by peers (conftest)
    proc = subprocess.Popen([sys.executable, "-c", _PEER, str(tmp_path), str(REPO),
                             json.dumps([p.tolist() for p in prompts])], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        out, hits = json.loads(proc.stdout.readline())
        assert out == want[:2] and hits == 0
        eng, out = _run(small_model, prompts, tmp_path)
        assert out == want
        first = 2 * sum((n - 1) // 8 for n in (37, 5))
        assert eng.metrics()["kv_offload"]["fs"]["hits"] == first
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, hits = json.loads(proc.stdout.readline())
        assert out == want[2:] and hits == 2 * HIT_BLOCKS - first
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def small_disk(tmp_path):
    """A 96 KiB tmpfs (real ENOSPC): needs root (CI and the dev machines run as root)."""
    d = tmp_path / "disk"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(d)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_fails_stores_not_requests(small_model, runs, small_disk):
    """The disk holds a few of the 36 chunks: the rest fail with ENOSPC, every request still finishes
    with the same tokens, no partial file is left, and a second engine hits on the chunks that fit. The
    tier is unbounded here (max_bytes None), so the disk, not max_bytes="auto", is what fills."""
    prompts, want = runs
    first, out = _run(small_model, prompts, small_disk, max_bytes=None)
    assert out == want
    fs = first.metrics()["kv_offload"]["fs"]
    assert fs["store_failed"] > 0 and fs["stored_chunks"] > 0
    assert fs["stored_chunks"] + fs["store_failed"] == first.metrics()["kv_offload"]["cpu"]["stored_pages"]
    assert list(small_disk.rglob("*.tmp")) == []
    second, out = _run(small_model, prompts, small_disk, max_bytes=None)
    assert out == want and second.metrics()["kv_offload"]["fs"]["corrupt"] == 0


def test_host_page_bytes_round_trip_in_every_kv_format(small_model, tmp_path):
    """read_host_pages / write_host_pages (what a tier stores and loads) are inverse on every array of
    both groups, fp8 MLA rows (bytes of several dtypes per row) included, and touch no other page."""
    for fmt in ("fp8_ds_mla", "bfloat16"):
        eng = Engine(small_model, DeployConfig(**BASE, kv_cache_dtype=fmt, kv_transfer_config=_ktc(tmp_path / fmt)))
        host = eng.runner.host
        rng = np.random.default_rng(0)
        for g in ("mla", "indexer"):
            before = [np.asarray(t).copy() for t in host.host_tables[g]]
            pages = [rng.integers(0, 256, host.page_bytes[g], dtype=np.uint8) for _ in range(3)]
            host.write_host_pages(g, [5, 2, 7], pages)
            got = host.read_host_pages(g, [2, 7, 5])
            for a, b in zip(got, [pages[1], pages[2], pages[0]]):
                np.testing.assert_array_equal(a, b)
            rows = host.page_rows[g]
            for t, old in zip(host.host_tables[g], before):  # the other pages are as they were
                new = np.asarray(t)
                keep = np.ones(len(new), bool)
                for b in (5, 2, 7):
                    keep[b * rows:(b + 1) * rows] = False
                np.testing.assert_array_equal(new[keep].view(np.uint8), old[keep].view(np.uint8))
        eng.shutdown()


def test_a_store_never_names_one_host_page_twice():
    """With one free host page and two new full pages, one is stored and the other skipped: the copy
    lists each host page once (freeing a page as soon as it was taken would hand it out again)."""
    from kvcache.block_pool import KVCacheManager
    from kvcache.policies.offload import OffloadPolicy
    from kvcache.transfer import PageCopy, TierStore

    class Req:
        req_id, extra_keys, num_computed_tokens = "r", (), 0
        tokens = list(range(17))
        num_tokens = 17

    kv = KVCacheManager(8, 8, ("mla",))
    pol = OffloadPolicy({"mla": 1}, {"mla": 1}, tiers=TierSet([]), fingerprint=FP)
    pol.admit(kv, Req)
    kv.allocate("r", 17)
    pol.prepare(kv, Req, 17)
    kv.cache_full_blocks("r", Req.tokens, 16, ())
    pol.after_step(kv, [Req])
    ops = pol.take_transfers()
    copies = [op for op in ops if isinstance(op, PageCopy)]
    assert len(copies) == 1 and len(copies[0].dst) == len(set(copies[0].dst)) == 1
    assert pol.stats.store_skipped_pages == 1 and not any(isinstance(op, TierStore) for op in ops)
    pol.host["mla"].check()



# ------------------------------------------------------------ pages of another span (RelayoutTier, issue 48)
@pytest.mark.parametrize("prod,cons", [
    ((4, {"mla": 4, "indexer": 8}), (8, {"mla": 8, "indexer": 16})),  # ours = 2 of theirs (concat)
    ((16, {"mla": 16, "indexer": 16}), (4, {"mla": 4, "indexer": 8})),  # ours = 1/4 or 1/2 of one (split)
    ((6, {"mla": 6, "indexer": 12}), (4, {"mla": 4, "indexer": 8})),  # neither divides (lcm)
], ids=["concat", "split", "lcm"])
@pytest.mark.parametrize("tails", [False, True], ids=["full-pages", "with-tails"])
@pytest.mark.parametrize("how", ["pd", "listed"])
def test_relayout_tier_assembles_our_pages_from_another_spans_chunks(tmp_path, prod, cons, tails, how):
    """A producer's chunks (its spans, its fingerprint, its chained hashes) in a filesystem tier; a
    consumer of other spans asks for its own keys through RelayoutTier with the producer's spans in the
    lookup context ("pd": a P/D producer's RemoteSource) or listed on the tier ("listed": a storage tier's
    read_page_tokens, the request's tokens in the context): every page of ours within the producer's full
    pages, and with the producer's tail chunks (a P/D producer's last partial page,
    kvcache.tiers.tail_chunk) every page of ours within the first n tokens, is a HIT and loads as the
    canonical page cut from the same token-order rows (a tail chunk's rows past n are junk that must not
    show); a page past them is a MISS; each producer chunk is loaded once however many of our pages share
    it; without the context the lookup is the inner tier's."""
    from kvcache.block_pool import block_hashes
    from kvcache.tiers import LookupContext, PageSpans, RemoteSource, tail_chunk
    from kvcache.tiers.remote import RelayoutTier

    widths = {"mla": (5, 5, 3), "indexer": (2, 2)}
    src = PageSpans("p" * 64, prod[0], tuple(prod[1].items()))
    own = PageSpans("c" * 64, cons[0], tuple(cons[1].items()))
    rng = np.random.default_rng(48)
    # KV of all but the last token may come; 41 is no multiple of any span here, so a tail matters for some
    tokens, salt, n = rng.integers(0, 1000, 42).tolist(), ("s",), 41
    rows = {g: [rng.integers(0, 256, (len(tokens), w), dtype=np.uint8) for w in ws] for g, ws in widths.items()}

    def page(g, t, i):
        return np.concatenate([r[i * t:(i + 1) * t].reshape(-1) for r in rows[g]])

    inner = FileTier(fingerprint=src.fingerprint, root_dir=str(tmp_path))
    hs = block_hashes(tokens, src.hash_block_tokens, salt, upto=n)
    keys, payloads, held = [], [], {}
    for g, t in src.page_tokens:
        held[g] = len(hs) * src.hash_block_tokens // t * t
        for i in range(held[g] // t):
            keys.append(chunk_key(src.fingerprint, g, hs[(i + 1) * t // src.hash_block_tokens - 1]))
            payloads.append(page(g, t, i))
        tail = tail_chunk(src.fingerprint, g, t, src.hash_block_tokens, tokens, salt, n, hs) if tails else None
        if tail is not None:  # the partial page: rows below n are KV, the rest junk no page of ours may show
            assert tail[0] == held[g] and tail[1] not in keys
            junk = [np.concatenate([r[tail[0]:n], rng.integers(0, 256, (tail[0] + t - n, r.shape[1]), dtype=np.uint8)])
                    for r in rows[g]]
            keys.append(tail[1])
            payloads.append(np.concatenate([j.reshape(-1) for j in junk]))
            held[g] = n
    inner.submit_store(StoreJob(1, tuple(keys), tuple(payloads)))
    assert _wait(inner, "store", 1)[0].status == ("ok",) * len(keys)
    loads = []
    submit = inner.submit_load
    inner.submit_load = lambda job: (loads.extend(job.keys), submit(job))[1]
    if how == "pd":
        tier = RelayoutTier(inner, own, widths)
        ctx = LookupContext("r", (), remote=RemoteSource(src, tokens, salt, n))
    else:  # a writer of other spans listed first, which holds nothing of this request: tried, then the next
        other = PageSpans("q" * 64, prod[0], tuple(prod[1].items()))
        mine = FileTier(fingerprint=own.fingerprint, root_dir=str(tmp_path))  # our own chunks: none
        tier = RelayoutTier(mine, own, widths, also=((other, FileTier(fingerprint=other.fingerprint,
                                                                      root_dir=str(tmp_path))), (src, inner)))
        ctx = LookupContext("r", (), tokens=(tokens, salt, n))
    hd = block_hashes(tokens, own.hash_block_tokens, salt, upto=n)
    want, job = {}, 10
    for g, t in own.page_tokens:
        for i in range(len(hd) * own.hash_block_tokens // t):
            key = chunk_key(own.fingerprint, g, hd[(i + 1) * t // own.hash_block_tokens - 1])
            assert tier.lookup(key) is Lookup.MISS  # no context: the inner tier's answer (it has no such key)
            if (i + 1) * t > held[g]:
                assert tier.lookup(key, ctx) is Lookup.MISS, (g, i)
                continue
            assert tier.lookup(key, ctx) is Lookup.HIT, (g, i)
            job += 1
            tier.submit_load(LoadJob(job, (key,), (t * sum(widths[g]),)))
            want[job] = page(g, t, i)
    # every page of ours below n with the tails (the count); without, those within the full pages
    assert len(want) == sum((n if tails else len(hs) * src.hash_block_tokens // src.tokens(g) * src.tokens(g)) // t
                            for g, t in own.page_tokens)
    got = _wait(tier, "load", len(want))
    assert sorted(r.job_id for r in got) == sorted(want)
    for r in got:
        assert r.status == ("ok",)
        np.testing.assert_array_equal(r.payloads[0], want[r.job_id])
    assert len(loads) == len(set(loads))  # a chunk two of our pages share is fetched once
    tier.shutdown()


def test_a_listed_span_is_tried_only_where_our_own_key_misses_and_the_option_is_checked(tmp_path):
    """RelayoutTier(also=): a page the storage holds under our own key is the inner tier's HIT and loads
    as stored (no relayout); the listed spans are not tried without the request's tokens in the context.
    `read_page_tokens` is the engine's option of any tier type: checked with the tier specs, never
    handed to the tier itself."""
    from kvcache.tiers import LookupContext, PageSpans, check_tier_specs, read_page_tokens
    from kvcache.tiers.remote import RelayoutTier

    own, src = PageSpans("c" * 64, 8, (("mla", 8),)), PageSpans("p" * 64, 4, (("mla", 4),))
    inner = FileTier(fingerprint=own.fingerprint, root_dir=str(tmp_path))
    reader = FileTier(fingerprint=src.fingerprint, root_dir=str(tmp_path))
    _store(inner, [1])
    tier = RelayoutTier(inner, own, {"mla": (8,)}, also=((src, reader), (own, inner)))
    assert tier.also == ((src, reader),)  # our own spans are the inner tier's keys
    ctx = LookupContext("r", (), tokens=(list(range(20)), (), 19))
    assert tier.lookup(_key(1), ctx) is Lookup.HIT and not tier._plans  # our key: no plan, no relayout
    tier.submit_load(LoadJob(7, (_key(1),), (4096,)))
    (got,) = _wait(tier, "load", 1)
    np.testing.assert_array_equal(got.payloads[0], _payload(1))
    assert tier.lookup(_key(2), LookupContext("r", ())) is Lookup.MISS and not tier._plans  # no tokens: not tried
    assert tier.lookup(_key(2), ctx) is Lookup.MISS and tier._plans  # tried, and the writer has nothing
    tier.shutdown()
    spec = {"type": "fs", "root_dir": str(tmp_path), "read_page_tokens": [{"mla": 8, "indexer": 8}]}
    check_tier_specs([spec])
    assert read_page_tokens(spec) == [{"mla": 8, "indexer": 8}] and read_page_tokens({"type": "fs"}) == []
    t = make_tier(spec, "f" * 64)  # FileTier refuses unknown keys: the option stayed with the engine
    t.shutdown()
    for bad in ({"mla": 8}, [{"mla": 0}], [{"mla": "8"}], [{}], [8]):
        with pytest.raises(ValueError, match="read_page_tokens"):
            check_tier_specs([{**spec, "read_page_tokens": bad}])
    with pytest.raises(ValueError, match="read_page_tokens is for storage tiers"):
        check_tier_specs([{"type": "p2p", "read_page_tokens": [{"mla": 8, "indexer": 8}]}])


def test_tail_chunk_keys_name_the_tokens_salt_and_length_and_never_a_full_page():
    """kvcache.tiers.tail_chunk: a page's leading tokens where the page is not full. It is None on a page
    boundary; it starts at the page's first token; its key depends on the fingerprint, group, every token
    before its end (through the chain and its own tokens), the salt and how many tokens it holds; and it
    is never the key of the full page its tokens begin, even when that page's tokens are the same."""
    from kvcache.block_pool import block_hashes
    from kvcache.tiers import tail_chunk

    rng = np.random.default_rng(51)
    tokens, salt = rng.integers(0, 1000, 40).tolist(), ("s",)

    def tail(toks=tokens, n=27, ex=salt, fp="f" * 64, g="mla", page=16, hb=8):
        return tail_chunk(fp, g, page, hb, toks, ex, n, block_hashes(toks, hb, ex, upto=n))

    assert tail(n=32) is None and tail(n=16) is None and tail(n=0) is None
    start, key = tail()
    assert start == 16 and tail() == (16, key)  # from tokens and salt alone, the same every time
    other = tokens[:]
    other[3] += 1  # a token of an earlier page: another chain
    changed = [tail(n=26), tail(n=28), tail(ex=("t",)), tail(fp="e" * 64), tail(g="indexer"), tail(toks=other)]
    other = tokens[:]
    other[20] += 1  # a token of the tail itself
    changed.append(tail(toks=other))
    assert all(c is not None and c[1] != key for c in changed) and len({c[1] for c in changed}) == len(changed)
    other = tokens[:]
    other[30] += 1  # past its end: not part of it
    assert tail(toks=other) == (16, key)
    hs = block_hashes(tokens, 8, salt)
    full = {chunk_key("f" * 64, "mla", h) for h in hs}
    assert not {t[1] for t in (tail(n=m, hb=8, page=8) for m in range(1, 40)) if t is not None} & full


@pytest.mark.parametrize("produce", [26, 0], ids=["prefill-leg", "not-a-prefill-leg"])
def test_a_prefill_legs_finish_stores_its_last_partial_pages_under_their_tail_keys(tmp_path, produce):
    """HostTier.store_tail through the offload policy's finish: a P/D prefill leg (kv_produce = 26 of its
    27-token prompt) copies, per cache group, the device page holding tokens up to 26 (MLA: 16-token pages,
    page 1; indexer: 32-token pages, page 0) to a host page and stores it under kvcache.tiers.tail_chunk's
    key, after the full pages' write-through; the host page is not registered and is free again. A request
    that is not a prefill leg stores only its full pages."""
    from kvcache.block_pool import KVCacheManager
    from kvcache.policies.offload import OffloadPolicy
    from kvcache.tiers import tail_chunk
    from kvcache.transfer import PageCopy, TierStore

    class Req:
        req_id, extra_keys, num_computed_tokens = "r", ("salt",), 0
        tokens = list(range(100, 128))  # 27 prompt tokens and one generated
        num_tokens = 28
        kv_produce = produce

    tiers = TierSet([FileTier(fingerprint=FP, root_dir=str(tmp_path))])
    kv = KVCacheManager(16, 16, ("mla", "indexer"), group_tokens_per_block={"indexer": 32})
    pol = OffloadPolicy({"mla": 4, "indexer": 4}, {"mla": 1, "indexer": 1}, tiers=tiers, fingerprint=FP)
    ops, tables, hs = _prefill_leg_finishes(pol, kv, Req)
    full = TierStore("mla", (ops[0].dst[0],), (chunk_key(FP, "mla", hs[0]),))  # the one full page: MLA page 0
    assert ops[:2] == [PageCopy("mla", "d2h", (tables["mla"][0],), ops[0].dst), full]
    tails = ops[2:]
    if not produce:
        assert tails == []
        return
    want = {g: tail_chunk(FP, g, t, 16, Req.tokens, Req.extra_keys, 26, hs) for g, t in (("mla", 16), ("indexer", 32))}
    assert [s for s, _ in want.values()] == [16, 0] and len(tails) == 4
    for (copy, store), g in zip(zip(tails[::2], tails[1::2]), ("mla", "indexer")):
        assert copy == PageCopy(g, "d2h", (tables[g][want[g][0] // kv.group_tokens_per_block[g]],), copy.dst)
        assert store == TierStore(g, copy.dst, (want[g][1],))
        assert pol.host[g].block_key[copy.dst[0]] is None and pol.host[g].num_free == 4
    tiers.shutdown()


def _prefill_leg_finishes(pol, kv, req):
    """`req` (28 tokens, 27 computed) admitted, prefilled and finished under `pol` on `kv` -> (the
    transfers its finish planned, its block tables, its chained hashes at 16 tokens per block)."""
    from kvcache.block_pool import block_hashes

    pol.admit(kv, req)
    kv.allocate("r", 28)
    pol.prepare(kv, req, 28)
    req.num_computed_tokens = 27
    kv.cache_full_blocks("r", req.tokens, 27, req.extra_keys)
    pol.on_finish(kv, req)
    return pol.take_transfers(), kv.requests["r"].tables, block_hashes(req.tokens, 16, req.extra_keys)


def test_a_hisparse_prefill_legs_finish_stores_its_last_partial_pages_too(tmp_path):
    """The same finish under kv_policy="hisparse" (its MLA pages live in its own host pool, its indexer
    keys in the offload pool): after parking the full pages (the MLA page 0 pre-copied and stored under
    its chain), per cache group the device page holding tokens up to kv_produce = 26 goes to a free host
    page and to the tiers under kvcache.tiers.tail_chunk's key, the keys a finer consumer's
    RelayoutTier asks for past the producer's full pages; the host page is not registered."""
    from kvcache.block_pool import KVCacheManager
    from kvcache.policies.hisparse import HiSparsePolicy
    from kvcache.tiers import tail_chunk
    from kvcache.transfer import PageCopy, TierStore

    class Req:
        req_id, extra_keys, num_computed_tokens = "r", ("salt",), 0
        tokens = list(range(100, 128))  # 27 prompt tokens and one generated
        num_tokens = 28
        kv_produce = 26

    tiers = TierSet([FileTier(fingerprint=FP, root_dir=str(tmp_path))])
    kv = KVCacheManager(16, 16, ("mla", "indexer"), group_tokens_per_block={"indexer": 32})
    pol = HiSparsePolicy(host_mla_blocks=4, host_index_blocks=4, block_size=16, hot_rows=16, max_leases=1,
                         num_device_blocks=16, page_bytes={"mla": 1, "indexer": 1}, tiers=tiers, fingerprint=FP)
    ops, tables, hs = _prefill_leg_finishes(pol, kv, Req)
    parked, tails = ops[:-4], ops[-4:]
    assert parked == [PageCopy("mla", "d2h", (tables["mla"][0],), parked[0].dst),
                      TierStore("mla", parked[0].dst, (chunk_key(FP, "mla", hs[0]),))]
    want = {g: tail_chunk(FP, g, t, 16, Req.tokens, Req.extra_keys, 26, hs) for g, t in (("mla", 16), ("indexer", 32))}
    assert [s for s, _ in want.values()] == [16, 0]
    for (copy, store), g in zip(zip(tails[::2], tails[1::2]), ("mla", "indexer")):
        assert copy == PageCopy(g, "d2h", (tables[g][want[g][0] // kv.group_tokens_per_block[g]],), copy.dst)
        assert store == TierStore(g, copy.dst, (want[g][1],))
        assert pol.host_tier.pools[g].block_key[copy.dst[0]] is None
    assert tails[0].dst != parked[0].dst  # the parked page 0 keeps its host page
    tiers.shutdown()
