"""The memory plan (experiments.memory_plan) against what the code actually allocates, on the tiny preset.

- Weights: the plan sizes the fp8 / bf16 model from ShapeDtypeStructs on an abstract mesh; the model
  runner's own placement (parallel.tp.place_state for TP8, parallel.model.place_state for the context
  mesh with EP8) of real arrays on 8 simulated devices must hold exactly that many bytes on its fullest
  device (a subprocess: the device count is fixed when JAX starts).
- KV pool: for a budget, the plan's blocks, pool arrays, HiSparse resolver state and host pools must equal
  the arrays a real Engine allocates for the same budget.
- The committed results/memory_plan/results.json: the four published deployments at the 142K limit, each
  pool = 0.9 x HBM - weights - workspace (- HiSparse state), the published budget beside the TP8 one.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from experiments import memory_plan as mp

REPO = mp.REPO

_WEIGHTS_SCRIPT = r"""
import json, jax
from flax import nnx
import glm53
from glm53 import fp8
from glm53.model import compiled
from experiments import memory_plan as mp
from parallel import model as pmodel, tp as ptp
from parallel.mesh import make_mesh

cfg = glm53.get_preset("tiny")
deps = {d.name: d for d in mp.deployments(limits=(256,), max_num_batched_tokens=64, max_num_seqs=4, host_scale=1e-4)}
out = {}
# TP8 in bfloat16 (the tiny model's fp8 blocks do not split 8 ways: parallel.tp refuses them)
model = glm53.init("tiny", seed=0, dtype="bfloat16")
placed = ptp.place_state(compiled(model).state, cfg, make_mesh(**ptp.mesh_sizes(8)), False)
plan = mp.weights_per_gpu(nnx.state(mp.abstract_fp8_model(cfg, "bfloat16", fp8=False)), cfg, deps["tp8_hisparse"])
out["tp8"] = [max(ptp.bytes_on_each_device(placed).values()), plan["bytes_per_gpu"], plan["engine_bytes_per_gpu"]]
# PCP8 x DCP8 x EP8 with the fp8 checkpoint's layers in fp8 (as from_pretrained(quantization="fp8"))
fp8.convert(model, fp8.eligible_modules(model))
assert fp8.fp8_modules(model)
placed = pmodel.place_state(compiled(model).state, make_mesh(cp=8), True)
plan = mp.weights_per_gpu(nnx.state(mp.abstract_fp8_model(cfg, "bfloat16")), cfg, deps["pcp8_dcp8_ep8_prefill"])
out["ep8_fp8"] = [max(ptp.bytes_on_each_device(placed).values()), plan["bytes_per_gpu"], plan["engine_bytes_per_gpu"],
                  plan["model_bytes"], sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))]
print("RESULT" + json.dumps(out))
"""


def test_weights_per_gpu_equal_the_runners_placed_arrays():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    proc = subprocess.run([sys.executable, "-c", _WEIGHTS_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    placed, plan, engine = got["tp8"]
    assert placed == plan == engine
    placed, plan, engine, model_bytes, real_bytes = got["ep8_fp8"]
    assert placed == plan == engine
    assert model_bytes == real_bytes  # the abstract fp8 model is the converted model, byte for byte
    assert plan < model_bytes  # the routed experts are split


def test_pool_equals_what_the_engine_allocates(tiny_model):
    """One DP-rank-like HiSparse replica on one device: for the same budget the plan's blocks, pool arrays,
    hot-buffer state and host pools are the engine's."""
    from glm53 import DeployConfig, Engine

    cfg = tiny_model.cfg
    d = DeployConfig(kv_cache_dtype="fp8_ds_mla", block_size=16, index_block_size=64, max_model_len=512,
                     max_num_batched_tokens=64, max_num_seqs=64, kv_policy="hisparse",
                     hisparse_host_pool_bytes=4 << 20, cpu_offload_bytes=1 << 20)
    dep = mp.Deployment("one", "one device", d, "ep", "dp", "decode", 1)
    budget = 1_234_567  # fewer blocks than 64 requests of 512 tokens: the engine takes all of it
    plan = mp.pool_plan(dep, cfg, budget)
    assert plan["fits"] and plan["engine_admits_max_model_len"]
    eng = Engine(tiny_model, dataclasses.replace(d, kv_cache_memory_bytes=budget))
    run = eng.replicas[0].runner
    # the plan's pool is the shared buffer's; the engine prices a block at its runner's arrays (a page of
    # every group), so it takes fewer blocks, and its arrays fit the budget
    assert eng.deploy.num_gpu_blocks == plan["engine_num_gpu_blocks"] < plan["kv_pool_blocks"]
    assert plan["kv_pool_blocks"] * plan["kv_block_bytes_per_gpu"] <= budget
    nbytes = lambda arrays: sum(int(x.nbytes) for x in jax.tree.leaves(arrays))  # noqa: E731
    assert nbytes((run.cache.mla, run.cache.index)) == plan["engine_kv_arrays_bytes_per_gpu"] <= budget
    per_block = plan["engine_kv_arrays_bytes_per_gpu"] // plan["engine_num_gpu_blocks"]
    assert plan["runner_kv_arrays_bytes_per_gpu"] == plan["kv_pool_blocks"] * per_block > budget
    assert nbytes(run.half.hot_state) == plan["hisparse_state_bytes_per_gpu"]
    assert nbytes(run.host.host_tables) == plan["host_pool_bytes"]
    hot = plan["hot_buffers"]["num_speculative_tokens=0"]
    assert hot["rows"] == run.sizes.hot_rows
    assert plan["hot_buffer_bytes_per_gpu"] == d.max_num_seqs * hot["lease_blocks"] * plan["kv_block_bytes_per_gpu"]


def test_committed_plan():
    path = REPO / "results/memory_plan/results.json"
    res = json.loads(path.read_text())
    batch = res["deployments"][0]["max_num_batched_tokens"]  # Part 1's; the DP8 rows again at 8,192
    rows = {(r["name"], r["max_model_len"]): r for r in res["deployments"] if r["max_num_batched_tokens"] == batch}
    keys = {"name", "weights_bytes_per_gpu", "kv_pool_bytes_per_gpu", "hot_buffer_bytes_per_gpu",
            "workspace_bytes_per_gpu", "host_pool_bytes", "fits", "max_model_len"}
    assert res["gpu_memory_utilization"] == 0.9 and res["weights"] == "fp8" and res["preset"] == "glm-5.3"
    for name in ("tp8_hisparse", "pcp8_dcp8_ep8_prefill", "dp8_ep8_decode", "dp8_prefill"):
        r = rows[(name, 142_000)]
        assert keys <= set(r)
        assert r["kv_pool_bytes_per_gpu"] == (int(0.9 * res["hbm_bytes"]) - r["weights_bytes_per_gpu"]
                                              - r["workspace_bytes_per_gpu"] - r.get("hisparse_state_bytes_per_gpu", 0))
        assert r["weights_bytes_per_gpu"] == sum(r["weights_by_component"].values())
    assert rows[("tp8_hisparse", 142_000)]["weights_bytes_per_gpu"] < rows[("dp8_prefill", 142_000)]["weights_bytes_per_gpu"]
    assert any(m == 1_048_576 for _, m in rows)  # the 1M rows
    # BRIEF §8: at 1M a DP8 prefill rank cannot hold one request, whatever its batch
    assert not any(r["fits"] for r in res["deployments"] if r["name"] == "dp8_prefill" and r["max_model_len"] == 1_048_576)
    g = res["published_vs_derived"]
    assert g["published_kv_budget_bytes_per_gpu"] == 15 * 2**30
    assert g["derived_kv_pool_bytes_per_gpu"] == rows[("tp8_hisparse", 142_000)]["kv_pool_bytes_per_gpu"]
    assert mp.kv_budget(path) == g["derived_kv_pool_bytes_per_gpu"]


def test_fp8_weights_split_over_tp8_at_full_size_only():
    """parallel.tp lays out GLM-5.3's fp8 blocks at TP8 (whole 128 x 128 blocks per rank) and refuses the
    tiny model's (its slices are not whole blocks)."""
    from flax import nnx

    import glm53
    from parallel import tp as ptp

    for preset, ok in (("glm-5.3", True), ("tiny", False)):
        cfg = glm53.get_preset(preset)
        state = nnx.state(mp.abstract_fp8_model(cfg, "bfloat16"))
        if ok:
            shapes = jax.eval_shape(lambda s: ptp.prepare_state(s, cfg, 8, False), state)
            assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), state)
        else:
            with pytest.raises(NotImplementedError, match="whole 128 x 128 blocks"):
                jax.eval_shape(lambda s: ptp.prepare_state(s, cfg, 8, False), state)


def test_committed_plan_is_what_the_code_gives(tmp_path):
    """results/memory_plan is regenerated whenever the plan's code or the engine's sizing changes: the
    plan rebuilt from the committed programs' memory analyses (`--reuse-programs`, no compile) equals the
    committed one in every field but the run's own metadata."""
    committed = REPO / "results/memory_plan/results.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.memory_plan", "--out", str(tmp_path),
                           "--reuse-programs", str(committed)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiling 0 step programs" in proc.stdout + proc.stderr  # the committed programs are current
    meta = {"date", "git_revision", "machine", "versions", "command", "wall_s", "programs_reused_from"}
    got, want = (json.loads(p.read_text()) for p in (tmp_path / "results.json", committed))
    assert set(got) == set(want)
    for key in sorted(set(want) - meta):
        assert got[key] == want[key], f"results/memory_plan/results.json[{key!r}] is stale: rerun experiments.memory_plan"


def test_published_deployments_are_described_once():
    """experiments.deployments is the one description of each published deployment: a planned one's KV
    budget is its memory-plan pool, a baseline that differs only in its KV policy shares its plan row
    (less HiSparse's resolver state), and the Part 1 / Part 2 configs build their engines from the
    descriptions with those budgets (no pool size copied)."""
    from experiments import deployments as D
    from experiments.common import load_config

    res = json.loads((REPO / "results/memory_plan/results.json").read_text())
    for r in res["deployments"]:
        dep = D.published(r["name"], max_model_len=r["max_model_len"], max_num_batched_tokens=r["max_num_batched_tokens"])
        assert D.kv_budget(dep) == r["kv_pool_bytes_per_gpu"]
    hs = D.plan_row("dp8_ep8_decode", 142_000, D.PART2_BATCHED_TOKENS)
    off = D.published("dp8_ep8_offload_decode", max_model_len=142_000, max_num_batched_tokens=D.PART2_BATCHED_TOKENS)
    assert D.kv_budget(off) == hs["kv_pool_bytes_per_gpu"] + hs["hisparse_state_bytes_per_gpu"]
    for path, limit in (("configs/paper/part2.py", 142_000), ("configs/paper/part2_1m.py", 1_048_576)):
        pairs = load_config(str(REPO / path)).pd.deployments
        for pair in pairs:
            for side, name in zip(("prefill", "decode"), D.PART2_PAIRS[pair]):
                got = pairs[pair][side].to_dict()
                # part2_1m re-splits the HiSparse decode ranks' host memory (a 1M request's MLA pages)
                own = {k: v for k, v in D.fields(name).items() if limit == 142_000 or not k.endswith("_bytes")}
                assert {k: got[k] for k in own} == own
                dep = D.published(name, max_model_len=limit, max_num_batched_tokens=D.PART2_BATCHED_TOKENS)
                assert got["kv_cache_memory_bytes"] == D.kv_budget(dep)
    part1 = load_config(str(REPO / "configs/paper/part1.py"))
    for name in ("tp8_hisparse", "tp8_offload"):
        own = D.fields(name)
        assert part1.deploy.tensor_parallel_size == own.pop("tensor_parallel_size")
        got = part1.policy_deploy[own.pop("kv_policy")].to_dict()
        # the memory plan's budget, one at 142K and at 1M; HiSparse's own, the others' the deploy field
        budgets = {D.kv_budget(D.published(name, max_model_len=limit, max_num_batched_tokens=32_768)) for limit in D.LIMITS}
        assert got.pop("kv_cache_memory_bytes", part1.deploy.kv_cache_memory_bytes) == budgets.pop() and not budgets
        assert got == own
    assert part1.policy_deploy.hisparse.kv_cache_memory_bytes < part1.deploy.kv_cache_memory_bytes
    with pytest.raises(ValueError, match="unknown published deployment"):
        D.fields("tp16")


def test_vllm_pages_pool_holds_the_tokens_of_vllms_layout():
    """The emulation of vLLM's page layout (experiments.deployments.vllm_pages: 64-token indexer pages, the
    budget scaled) gives each engine a pool that holds, at full residency, the 64-token spans vLLM's one
    cache group holds in the same bytes (a block id for both groups' pages: 78 x 656 B of MLA rows and
    21 x 132 B of indexer keys a token, 79 and 22 with the MTP layer): two blocks a span here, priced at
    the larger page."""
    import glm53
    from experiments import serve
    from experiments.common import load_config
    from glm53.engine.config import DeployConfig

    cfg = glm53.get_preset("glm-5.3")
    vllm_bytes_per_token = {False: 78 * 656 + 21 * 132, True: 79 * 656 + 22 * 132}  # with MTP's layer

    def spans(d: DeployConfig, budget: int) -> tuple[int, float]:  # (emulated pool's spans, vLLM's in budget)
        r = d.resolved(cfg, "bfloat16")
        assert r.index_block_size in (None, r.block_size) and r.kv_cache_dtype == "fp8_ds_mla"
        return r.num_gpu_blocks // 2, budget / (r.block_size * vllm_bytes_per_token[r.num_speculative_tokens > 0])

    base, emu = (load_config(str(REPO / p)) for p in ("configs/paper/part1.py", "configs/ablations/part1_vllm_pages.py"))
    got, want = spans(serve._deploy(emu, "offload"), base.deploy.kv_cache_memory_bytes)
    assert abs(got - want) <= 1 and got > 7000
    base, emu = (load_config(str(REPO / p)) for p in ("configs/paper/part2.py", "configs/ablations/part2_vllm_pages.py"))
    (pair,) = emu.pd.deployments
    for side in ("prefill", "decode"):
        fields = emu.pd.deployments[pair][side].to_dict()
        d = dataclasses.replace(serve._deploy(emu, "preempt"), **{**fields, "data_parallel_size": 1})  # one rank
        assert d.num_speculative_tokens == 3
        got, want = spans(d, base.pd.deployments[pair][side]["kv_cache_memory_bytes"])
        assert abs(got - want) <= 1
