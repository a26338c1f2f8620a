"""The step workspace and a pool sized from device memory (vLLM's profile run): on a device that reports
its memory (a GPU; here the CPU device made to report some), the KV pool gets gpu_memory_utilization of
it less the weights and the largest step's workspace, which the runner reads from XLA's memory analysis
of its compiled step programs. On the 2-layer model of tests/engine/conftest.py (what is measured is the
runner's programs, whatever the depth)."""

import pytest

import glm53
from glm53 import DeployConfig, Engine
from glm53.engine import config as config_mod
from glm53.engine import build as build_mod
from glm53.engine.runner import ModelRunner
from kvcache.layout import runner_block_bytes

MiB = 1 << 20


def _deploy(**kw):
    return DeployConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, block_size=16, **kw)


def _runner(model, d):
    d = d.resolved(model.cfg, "float32")
    return ModelRunner(model, d, d.kv_sizes(model.cfg, "float32"))


def test_workspace_is_positive_grows_with_the_token_budget_and_ignores_the_pool(small_model):
    """Per program (the profile is the most over its programs: the next test): the whole budget's chunk at
    the max_model_len window."""
    r = _runner(small_model, _deploy(num_gpu_blocks=8))
    chunk = (1, 64, r.capacity)
    assert chunk in r.workspace_shapes()
    small = r.step_workspace_bytes([chunk])
    assert small > 0
    # the cache is donated and aliased: a pool 8x larger leaves the workspace as it is
    assert _runner(small_model, _deploy(num_gpu_blocks=64)).step_workspace_bytes([chunk]) == small
    # a chunk of 256 tokens instead of 64: more activations at once
    wide = DeployConfig(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4, num_gpu_blocks=8)
    assert _runner(small_model, wide).step_workspace_bytes([(1, 256, r.capacity)]) > small


def test_workspace_covers_the_widest_groups_the_runner_forms(small_model):
    """Eight 9-16-token prompts under a 64-token budget run as one 8 x 16 group (rows and widths pad to
    powers of two): 128 padded tokens, twice the budget. The profile takes such groups, not only a chunk
    of the budget, and its figure is the most over every program it names."""
    r = _runner(small_model, DeployConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                         num_gpu_blocks=8))
    full = r.capacity
    assert {(8, 16, full), (4, 32, full), (1, 64, full), (8, 1, full)} <= set(r.workspace_shapes())
    each = {s: r.step_workspace_bytes([s]) for s in r.workspace_shapes()}
    assert r.step_workspace_bytes() == max(each.values())
    assert each[8, 16, full] > each[1, 64, full]  # the budget's own chunk would under-count


def _report_memory(monkeypatch, limit):
    """Make every device report `limit` bytes (as a GPU's memory_stats does; the CPU reports none)."""
    fake = lambda device: 0 if device is None else limit  # noqa: E731
    monkeypatch.setattr(config_mod, "device_memory_bytes", fake)
    monkeypatch.setattr(build_mod, "device_memory_bytes", fake)


def test_pool_from_device_memory_leaves_out_weights_and_workspace(small_model, monkeypatch):
    limit = 5 * MiB  # the 2-layer model, float32: ~1.8 MB of weights, ~1.4 MB of workspace, 20 KB blocks: ~70 fit
    _report_memory(monkeypatch, limit)
    eng = Engine(small_model, _deploy())
    out = eng.generate([[1, 2, 3, 4, 5]], max_new_tokens=3)
    assert len(out[0].token_ids) == 3
    m = eng.metrics()
    ws, weights = m["workspace_bytes_per_device"], m["weights_bytes_per_device"]
    assert ws > 0 and weights > 0
    assert ws == eng.replicas[0].runner.step_workspace_bytes()  # the serving runner's own programs agree
    # a block is priced at what the runner allocates for it (a page of every group), so the arrays fit
    budget = int(0.9 * limit) - weights - ws
    fit = budget // runner_block_bytes(eng.sizes.page_bytes)
    assert 32 <= fit < 4 * 32  # the budget binds (one request of 256 tokens: 16 + 16 pages; at most 4)
    assert eng.deploy.num_gpu_blocks == fit
    cache = eng.replicas[0].runner.cache
    assert sum(x.nbytes for x in (*cache.mla, *cache.index)) <= budget
    # an explicit budget is taken as is: no profile run, nothing left out
    assert Engine(small_model, _deploy(num_gpu_blocks=16)).workspace_bytes == 0


def test_memory_too_small_for_weights_and_workspace_says_so(small_model, monkeypatch):
    _report_memory(monkeypatch, 3 * MiB)
    with pytest.raises(ValueError, match="less .* of weights and .* of step workspace.*max_num_batched_tokens.*"
                       "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        Engine(small_model, _deploy())


def test_unresolved_budget_needs_reported_memory():
    d = DeployConfig()
    assert not d.budget_from_device_memory(None)
    gpu = type("Gpu", (), {"platform": "gpu", "device_kind": "NVIDIA H200",
                           "memory_stats": lambda self: {"bytes_limit": 100 << 30}})()
    assert d.budget_from_device_memory(gpu) and not DeployConfig(num_gpu_blocks=4).budget_from_device_memory(gpu)
    assert d.kv_budget_bytes(gpu, weights_bytes=30 << 30, workspace_bytes=5 << 30) == 55 << 30
    assert glm53.DeployConfig(kv_cache_memory_bytes=7).kv_budget_bytes(gpu, 1, 1) == 7


def test_check_engine_memory_cli_on_cpu(tmp_path):
    """The device check's engine-memory step (experiments/device_check.sh) runs here too: on a device
    without memory statistics it records the compiler's estimate and says that is all it has. What it
    records is the run's: the deployment it was given, the tiny model's float32 weight bytes (counted here
    from the parameters), the bucket shapes the run compiled (the whole-budget prompt's prefill and the
    decode), and their workspace within the engine's, which is the most over every bucket shape."""
    import json

    import jax
    from flax import nnx

    from experiments import check_engine_memory

    check_engine_memory.main(["--out", str(tmp_path), "--max-model-len", "64", "--batched-tokens", "16",
                              "--max-num-seqs", "2"])
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["device_reports_memory"] is False and "measured_workspace_bytes" not in got and "note" in got
    assert got["deploy"] == {"max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 2,
                             "num_gpu_blocks": 64, "kv_cache_dtype": "fp8_ds_mla"}
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(glm53.init("tiny", seed=0, std=0.1))))
    assert got["weights_bytes_per_device"] == weights
    widths = {w for _, w, _ in got["shapes_run"]}
    assert {r for r, _, _ in got["shapes_run"]} == {1} and 1 in widths and max(widths) >= 15
    assert 0 < got["workspace_bytes_of_shapes_run"] <= got["workspace_bytes_per_device"]
