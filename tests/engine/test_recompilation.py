"""After the runner's warm-up has compiled every bucket shape and every copy program of the KV policy, a
serving run compiles nothing: counted with JAX's own compilation events over a fixed 200-step run with
arrivals, finishes, sampling and pool pressure, under each policy (preemptions; offloads and their
restores; HiSparse pre-copies, releases, hot-buffer decode steps and the parking of finished requests'
indexer keys; staging host pages back for a prefill is compiled by the warm-up too but this run has no
follow-up turn that would stage). With MTP speculative decoding the same check runs beside the tokens of
each policy MTP runs with, one engine each: tests/engine/test_mtp.py (preempt, swap, offload: verify steps
that keep 0 to 3 drafts, prefill chunks that keep every position's hidden state, the MTP layer's passes)
and tests/engine/test_hisparse.py (HiSparse, both verify forms: those three with the decode view,
resolving rows from the host)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from glm53.engine.runner import CompileCounter
from tests.engine.serving_checks import check_buckets_used, count_compiles, random_arrivals, warm_up

# per policy: deploy fields, prompt lengths [lo, hi), and the finished requests the run must reach
POLICIES = {
    "preempt": ({}, (1, 90), 10),
    "offload": (dict(kv_policy="offload", cpu_offload_bytes=1 << 26), (1, 90), 10),
    # a host tier of 6 pages per group behind which the filesystem tier serves what it evicted (no device
    # prefix cache: a preempted request's prefix comes back from the tiers)
    "offload_fs": (dict(kv_transfer_config="fs"), (1, 90), 10),
    "swap": (dict(kv_policy="swap", cpu_offload_bytes=1 << 26), (1, 90), 10),
    # long requests that keep decoding under pressure, and a hot buffer of top-k rows (2 blocks, below the
    # watermark of 3 free blocks), so pages are released and decode steps read rows from the host
    "hisparse": (dict(kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26, cpu_offload_bytes=1 << 24,
                      index_block_size=16, hisparse_device_buffer_size=16, num_gpu_blocks=32), (40, 100), 8),
}
# rows 1, 2; tokens per row 1 (4 under MTP: a token and its 3 drafts), 16; windows 64, 128: 8 bucket shapes
SHAPES = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, block_size=8, num_gpu_blocks=28)


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_compilation_after_warmup(small_model, policy, tmp_path):
    fields, lens, min_finished = POLICIES[policy]
    if fields.get("kv_transfer_config") == "fs":
        fields = dict(enable_prefix_caching=False, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
            "cpu_bytes_to_use": 6 * (9216 + 1024), "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]}})
    deploy = DeployConfig(**{**SHAPES, **fields})
    eng = Engine(small_model, deploy)
    assert len(eng.runner.bucket_shapes()) == 2 * 2 * 2
    # HiSparse warms up as the server does: a prefill shape's keep_all forward with a staging view too
    warm_up(eng, prompt_logprobs=policy == "hisparse")
    if policy == "hisparse":
        eng.scheduler.policy.resolve.log = []
    compiles = count_compiles(eng)
    new = (lambda n, rng: rng.integers(8, 128 - n)) if policy == "hisparse" else (lambda n, rng: rng.integers(1, 12))
    with CompileCounter() as whole:  # inside the runner and out
        random_arrivals(eng, 200, lens, new)
    st = eng.scheduler.stats
    # the pool runs out (HiSparse releases pages, shortens chunks and stages rows instead of preempting)
    assert len(eng.finished) >= min_finished and (st.preemptions >= 1 or policy == "hisparse"), (
        len(eng.finished), st.preemptions)
    if policy == "swap":  # saves and loads ran, not only the fallback to preemption
        assert st.offloads >= 1 and eng.scheduler.transfers.h2d_bytes > 0
    if policy == "offload":  # pages were stored to the host tier and loaded back
        tier = eng.metrics()["kv_offload"]["cpu"]
        assert tier["stored_pages"] > 0 and tier["loaded_pages"] > 0
    if policy == "offload_fs":  # ... and the filesystem tier gave back pages the host tier had evicted,
        # under host pressure, with every request's tokens those of an engine without tiers
        assert eng.metrics()["kv_offload"]["fs"]["hits"] > 0, eng.metrics()["kv_offload"]
        plain = Engine(small_model, DeployConfig(**SHAPES))
        done = list(eng.finished.values())
        for r in done:
            plain.add_request(r.prompt_ids, r.params, req_id=r.req_id)
        while plain.has_unfinished():
            plain.step()
        assert all(plain.finished[r.req_id].output_ids == r.output_ids for r in done)
        pol = eng.scheduler.policy
        assert not any(pol.host_tier.tier_pins.values()) or eng.scheduler.waiting
    if policy == "hisparse":  # decode steps resolved rows from the host, pages moved both ways
        hs = eng.scheduler.policy.stats
        assert eng.scheduler.policy.resolve.log and eng.scheduler.policy.resolve.hot_misses > 0
        assert hs.precopied_pages > 0 and hs.released_pages > 0 and hs.leases > 0 and hs.parked_index_pages > 0
        assert eng.scheduler.transfers.d2h_bytes > 0 and eng.scheduler.transfers.h2d_bytes > 0
        # chunks over host-only pages ran the staging programs (compiled by warmup for every prefill shape)
        assert eng.runner.staging_shapes and eng.scheduler.policy.resolve.staged_rows > 0
    check_buckets_used(eng, {16})
    assert sum(compiles) == whole.count == 0, f"{whole.count} compilations during the run"
    with CompileCounter() as probe:  # the counter does see a compilation
        jax.jit(lambda x: x * 3 + 1)(np.arange(7)).block_until_ready()
    assert probe.count >= 1


def test_a_program_loaded_from_the_persistent_cache_counts_as_a_compilation(tmp_path):
    """What keeps a compilation count strict in processes that share the session's on-disk cache (the
    servers and peers the tests start, tests/conftest.py): a second process that loads a program the
    first one compiled still sees one compilation (JAX's backend-compile event wraps the
    cache lookup), so a shape missing from a warm-up cannot pass as a cache hit."""
    code = ("import sys, jax, jax.numpy as jnp, jax.monitoring\n"
            "jax.config.update('jax_compilation_cache_dir', sys.argv[1])\n"
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)\n"
            "from glm53.engine.runner import CompileCounter\n"
            "hits = []\n"
            "jax.monitoring.register_event_listener(\n"
            "    lambda e, **kw: hits.append(e) if e == '/jax/compilation_cache/cache_hits' else None)\n"
            "x = jnp.ones(7)\n"
            "n = len(hits)\n"
            "with CompileCounter() as c:\n"
            "    jax.jit(lambda x: jnp.sin(x) * 3)(x).block_until_ready()\n"
            "print('compiles', c.count, 'hits', len(hits) - n)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    seen = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(out.stdout.split()[-4:])
    # the first run compiled the program, the second loaded it from disk: one compilation each
    assert seen == [["compiles", "1", "hits", "0"], ["compiles", "1", "hits", "1"]], seen


def test_warmup_stops_with_a_clear_error_before_the_memory_map_limit(small_model, monkeypatch):
    """XLA:CPU aborts a compile once the process crosses vm.max_map_count (each compiled kernel holds
    about 3 mappings); warm-up checks before each shape and raises an error that names the limit and what
    to change, instead of dying inside LLVM. Here the limit is set just below what the process holds (the
    programs may already be in this worker's caches, so the warm-up need not add any mappings)."""
    from glm53.engine.runner import compilation

    eng = Engine(small_model, DeployConfig(**SHAPES))
    held = compilation.memory_maps()
    assert held > 0  # /proc is here: the check has something to read
    monkeypatch.setattr(compilation, "max_map_count", lambda: int(held / compilation.MAPS_HEADROOM) - 1)
    with pytest.raises(RuntimeError, match=r"after 0 of 8 bucket shapes.*vm\.max_map_count.*max_model_len"):
        eng.runner.warmup()
    monkeypatch.setattr(compilation, "max_map_count", lambda: 10 * held)  # far from it: the warm-up runs
    assert eng.runner.warmup() == 8
