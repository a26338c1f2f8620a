"""The memory plan: what one GPU of each published deployment holds (issue 24 item 3).

    python -m experiments.memory_plan --out results/memory_plan          # ~10 minutes on 2 cores

For each deployment of BRIEF §8 (TP8 with HiSparse; PCP8 x DCP8 x EP8 prefill; DP8 decode ranks with
EP8; DP8 prefill), at the 142K limit and at 1M (and Part 2's rows, DP8 and PCP8 x DCP8 x EP8, again at 8,192 batched tokens), it reports per GPU the bytes of the weights, the
activation workspace of the step program, the KV pool that is left, the part of that pool the HiSparse
hot buffers take, the host pools, and whether a request of max_model_len fits. Nothing is a restated
formula and the KV budget is not an input:

- **Weights**: the full-size GLM-5.3 as the fp8 loader keeps it (`glm53.weights.abstract_model` with the
  modules `glm53.fp8.eligible_modules` names in fp8 + float32 block scales; the rest bfloat16), as
  jax.ShapeDtypeStructs, laid out by the project's own functions (`parallel.tp.prepare_state` and
  `state_specs` for TP8; `parallel.ep.state_specs` for the expert-parallel layouts: routed experts split
  over 8, everything else replicated) and sized per device by `parallel.mesh.shard_bytes` on an abstract
  mesh.
- **Workspace**: the peak of the step programs the deployment runs, compiled by XLA (in a subprocess with
  8 simulated CPU devices): the per-rank program the model runner calls (`parallel.model.forward` in its
  shard_map for TP and the context mesh; `glm53.model.compiled(...).forward` for a one-device DP rank),
  at full width with one decoder layer of the heaviest kind (a full-indexer MoE layer; nothing but the
  hidden state and a top-k crosses a layer boundary), for a prefill chunk of max_num_batched_tokens tokens (window = the chunk:
  a fresh prompt, what vLLM's profile run measures) and a decode step of max_num_seqs rows at the
  max_model_len window. Peak = XLA's temp + outputs not aliased to the donated cache, plus the outputs
  the other 77 layers add (jax.eval_shape of the full-size program: a one-device step returns every full
  layer's top-k). The attention ops run their Pallas kernels (`attention_impl="pallas"`, interpreted on
  CPU: the kernels' own outputs and blocks); the reference ops (`attention_impl="reference"`; what
  `"auto"` picked on a GPU until the kernels were verified on an H200) are reported beside them. The programs hold
  bfloat16 weights (arguments, not workspace; fp8 weights, which the runner now takes under TP too, would
  add the temporaries of their dequantisation, which this figure leaves out). Checks (results.json `checks`): 1, 2 and 3 layers and the whole 78-layer
  decoder compiled the same way (XLA:CPU's peak grows with depth through a scheduling artefact; the
  whole-depth compile takes ~4 minutes), and a 4x larger pool (the workspace must not change).
- **KV pool** = gpu_memory_utilization (0.9, vLLM's default, DeployConfig's) x the HBM an H200 reports
  (see H200_TOTAL_MEMORY_BYTES) - weights - workspace - HiSparse's resolver state; the engine's own
  resolution (`DeployConfig.resolved` with that budget as kv_cache_memory_bytes; `kvcache.layout`'s
  page and block bytes) turns it into blocks and tokens, and `kvcache.paged.PagedKVCache.create` (under
  jax.eval_shape) gives what the runner's arrays for those blocks take.
- **Hot buffers**: HiSparse leases ceil(hot rows / block_size) blocks per decoding request from the pool
  (`kvcache.policies.hisparse.hot_buffer_rows`, counted as `DeployConfig.resolved` counts a lease): their bytes
  at max_num_seqs are part of the pool, not added to it.
- **Host pools**: the published host budgets per replica (BRIEF §8), in the pages the engine allocates
  (`DeployConfig.kv_sizes`).
- **fits**: one request of max_model_len can be held: fully resident in the pool; under HiSparse its
  device part (indexer keys, the newest pages, a hot buffer) in the pool and the rest of its MLA pages in
  the HiSparse host pool. The engine's own admission check (`engine_admits_max_model_len`:
  `DeployConfig.resolved`) is stricter: it asks the pool for the whole request even under HiSparse, and
  it prices a block at what its runner allocates today, a page of every group
  (`engine_num_gpu_blocks`, `engine_kv_arrays_bytes_per_gpu`; the pool above is the shared buffer's).

Writes OUT/results.json (`deployments`: one row per deployment and limit; `published_vs_derived`: BRIEF
§2's ~15 GiB beside the derived TP8 budget, with the gap explained; `programs`: every compiled program),
OUT/report.md and OUT/memory_plan.png. docs/memory.md discusses the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import REPO, cpu_name, git_revision
from experiments.deployments import LIMITS, PART2_BATCHED_TOKENS as _PART2_TOKENS, Deployment, plan_row, published

GiB = 1 << 30
# The memory an H200 SXM reports to CUDA: torch.cuda.get_device_properties(0).total_memory = 143,156 MiB
# (139.8 GiB; cudaMemGetInfo's total), which vLLM multiplies by gpu_memory_utilization. nvidia-smi lists
# 143,771 MiB of framebuffer; the datasheet says "141 GB" (glm53.perfmodel.H200.hbm_capacity_bytes = 141e9,
# 131.3 GiB), reported beside it.
H200_TOTAL_MEMORY_BYTES = 143_156 * 2**20
GPUS_PER_NODE = 8
PUBLISHED_MTP = 3  # the published runs use MTP3; the pool is planned without the MTP layer's KV (docs/memory.md)
# Part 2's rows (DP8, PCP8 x DCP8 x EP8) are also planned at Part 2's token budget (experiments.deployments)
PART2_BATCHED_TOKENS = (_PART2_TOKENS,)
# the deployments planned (experiments.deployments): the baselines that differ from one of these in their
# KV policy alone share its row (Deployment.plan_row)
PLANNED = ("tp8_hisparse", "pcp8_dcp8_ep8_prefill", "dp8_ep8_decode", "dp8_prefill")
IMPL = "pallas"  # the attention implementation of the main workspace figure (see the module docstring)
WORKER_DEVICES = 8
WORKSPACE_METHOD = (
    "XLA:CPU's memory analysis (temp + outputs not aliased to the donated cache) of the per-rank step program "
    "compiled at full width and batch with ONE decoder layer of the heaviest kind (full indexer + MoE), plus "
    "the outputs the other layers add; not the whole 78-layer program, whose XLA:CPU peak grows with depth "
    "through a CPU scheduling artefact (results.json checks; docs/memory.md)")


def deployments(limits=LIMITS, *, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                host_scale: float = 1.0, part2_batched_tokens: tuple[int, ...] = PART2_BATCHED_TOKENS,
                names: tuple[str, ...] = PLANNED) -> list[Deployment]:
    """The published deployments `names` (experiments.deployments) at each limit, with Part 1's batch
    limits unless given (the brief gives no Part 2 batch limits, so Part 1's are used), then Part 2's rows
    (the DP8 ranks and the PCP8 x DCP8 x EP8 prefill engine) again at each of `part2_batched_tokens` (a
    smaller token budget per step, hence a smaller workspace: the rows carry their own
    max_num_batched_tokens). host_scale scales the published host budgets (tests)."""
    out = [published(name, max_model_len=limit, max_num_batched_tokens=max_num_batched_tokens,
                     max_num_seqs=max_num_seqs, host_scale=host_scale) for limit in limits for name in names]
    for tokens in part2_batched_tokens:
        out += [dataclasses.replace(dep, deploy=dataclasses.replace(dep.deploy, max_num_batched_tokens=tokens))
                for dep in out if dep.role != "aggregated" and dep.deploy.max_num_batched_tokens != tokens]
    return out


# ------------------------------------------------------------------------------------------------ weights
def abstract_fp8_model(cfg, dtype: str = "bfloat16", fp8: bool = True):
    """The model as `from_pretrained(quantization="fp8")` keeps a block-quantised checkpoint of it: the
    modules glm53.fp8.eligible_modules names hold fp8 values and float32 block scales, the rest `dtype`.
    ShapeDtypeStructs only (nothing is allocated). fp8=False: every weight in `dtype`."""
    from glm53 import fp8 as fp8_mod
    from glm53.weights import abstract_model

    model = abstract_model(cfg, dtype)
    return abstract_model(cfg, dtype, fp8_mod.eligible_modules(model)) if fp8 else model


def _category(path) -> str:
    names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
    if names[0] == "mtp":
        return "mtp_layer"
    if names[0] in ("embed_tokens", "lm_head"):
        return "embed_lm_head"
    for key, cat in (("experts", "routed_experts"), ("shared_experts", "shared_experts"), ("indexer", "indexer"),
                     ("self_attn", "attention"), ("gate", "router")):
        if key in names:
            return cat
    return "dense_mlp" if "mlp" in names else "norms"


def weights_per_gpu(state, cfg, dep: Deployment) -> dict:
    """Bytes of weights on one GPU of `dep`, by component, from the layout functions the runner places
    weights with (module docstring). `engine_bytes_per_gpu`: what the engine's KV budget leaves out for
    a replica today (glm53.engine.build.weights_bytes_per_device): the same for TP and the context
    mesh; all weights for a DP replica, whose one device holds every expert (the engine does not split
    experts across DP replicas)."""
    import jax

    from glm53.engine.build import weights_bytes_per_device
    from parallel import ep as parallel_ep
    from parallel import mesh as parallel_mesh
    from parallel import tp as parallel_tp

    d = dep.deploy
    if dep.weights == "tp":
        shapes = jax.eval_shape(lambda s: parallel_tp.prepare_state(s, cfg, d.tensor_parallel_size,
                                                                    d.enable_expert_parallel), state)
        specs = parallel_tp.state_specs(shapes, d.enable_expert_parallel)
        sizes = parallel_tp.mesh_sizes(d.tensor_parallel_size, d.decode_context_parallel_size)
    else:
        shapes, specs, sizes = state, parallel_ep.state_specs(state, "ep"), {"ep": dep.ep}
    per_leaf = parallel_mesh.shard_bytes(shapes, specs, sizes)
    by = {}
    for (path, _), n in zip(jax.tree_util.tree_leaves_with_path(shapes), per_leaf):
        by[_category(path)] = by.get(_category(path), 0) + n
    total = sum(per_leaf)
    return {"bytes_per_gpu": total, "by_component": dict(sorted(by.items())),
            "engine_bytes_per_gpu": weights_bytes_per_device(state, cfg, d),
            "model_bytes": sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state))}


# ---------------------------------------------------------------------------------------------- workspace
def _layer_config(cfg, layers: int, experts: int):
    """Full width, `layers` decoder layers: the first a full-indexer MoE layer (the heaviest kind), then
    shared-indexer MoE layers; no MTP layer (the engine's step runs none); `experts` routed experts."""
    return cfg.replace(num_hidden_layers=layers, indexer_types=("full",) + ("shared",) * (layers - 1),
                       mlp_layer_types=("sparse",) * layers, num_nextn_predict_layers=0, n_routed_experts=experts)


def programs_for(dep: Deployment, cfg, impl: str = IMPL) -> dict[str, dict]:
    """The step programs `dep` runs, as compile specs {key: spec} (keys shared between deployments that
    run the same per-rank program). "prefill": a chunk of max_num_batched_tokens at the window of a fresh
    prompt (vLLM's profile run); "last_chunk": the same chunk at the max_model_len window (the last chunk
    of a max_model_len prompt); "decode": max_num_seqs rows of one token at the max_model_len window."""
    from attention.common import pow2_at_least
    from glm53.api import window_bucket
    from glm53.engine.runner import step_limits

    d = dep.deploy
    width, capacity = step_limits(d)
    experts = cfg.n_routed_experts
    if dep.program == "dp":  # a DP rank's share of the experts under EP (at least top-k of them)
        experts = max(experts // dep.ep, cfg.num_experts_per_tok)
    base = dict(program=dep.program, layers=1, experts=experts, impl=impl, block_size=d.block_size,
                index_block_size=d.index_block_size or d.block_size, kv_cache_dtype=d.kv_cache_dtype,
                tp=d.tensor_parallel_size, cp=d.context_parallel_size, dcp=d.decode_context_parallel_size,
                pcp=d.prefill_context_parallel_size, ep=d.enable_expert_parallel, num_blocks=1024,
                backend=d.dcp_comm_backend, interleave=d.cp_kv_cache_interleave_size)
    shapes = {}
    if dep.role in ("aggregated", "prefill", "decode"):  # vLLM profiles a max_num_batched_tokens chunk on every role
        shapes["prefill"] = (1, width, window_bucket(width, capacity))
    if dep.role in ("aggregated", "prefill"):
        shapes["last_chunk"] = (1, width, window_bucket(d.max_model_len, capacity))
    if dep.role in ("aggregated", "decode"):
        shapes["decode"] = (pow2_at_least(d.max_num_seqs), 1, window_bucket(d.max_model_len, capacity))
    out = {}
    for kind, (rows, tokens, window) in shapes.items():
        spec = dict(base, rows=rows, tokens=tokens, window=window)
        out[kind] = dict(spec, key=_key(spec))
    return out


def _key(spec: dict) -> str:
    mesh = {"tp": f"tp{spec['tp']}", "cp": f"pcp{spec['pcp']}xdcp{spec['dcp']}", "dp": f"dp_rank_e{spec['experts']}"}
    return (f"{mesh[spec['program']]}/r{spec['rows']}xt{spec['tokens']}@w{spec['window']}/L{spec['layers']}"
            f"/{spec['impl']}/b{spec['num_blocks']}")


def _abstract_cache(cfg, spec: dict, rows: int, window: int):
    """The runner's paged pool (spec["num_blocks"] blocks, on every DCP rank) with block tables of `rows`
    rows covering `window` positions (ModelRunner._table's widths), as ShapeDtypeStructs."""
    import jax
    import numpy as np

    from kvcache.paged import PagedKVCache

    bs, ibs, dcp = spec["block_size"], spec["index_block_size"], spec["dcp"]
    pages = -(-window // (bs * dcp))
    ipages = -(-pages * bs // ibs)
    return jax.eval_shape(lambda: PagedKVCache.create(
        cfg, spec["num_blocks"] * dcp, bs, np.full((rows, pages), -1, np.int32), index_block_size=ibs,
        index_block_table=np.full((rows, ipages), -1, np.int32), kv_cache_dtype=spec["kv_cache_dtype"],
        include_mtp=False))


def compile_program(spec: dict, cfg_full) -> dict:
    """Compile one per-rank step program (a `programs_for` spec) on this process's devices and read XLA's
    memory analysis -> {temp, output, alias, argument bytes (per device), extra_output_bytes, peak_bytes}.
    Nothing is allocated: every input is a ShapeDtypeStruct (with its sharding on a mesh)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm53.model import compiled
    from parallel import model as parallel_model
    from parallel import tp as parallel_tp
    from parallel.cp_cache import CpKVCache
    from parallel.mesh import make_mesh
    from parallel.pcp import PcpSplit

    t0 = time.perf_counter()
    if spec.get("structure") == "model":  # every decoder layer of the model as it is (the depth check)
        cfg = cfg_full.replace(num_nextn_predict_layers=0, n_routed_experts=spec["experts"])
    else:
        cfg = _layer_config(cfg_full, spec["layers"], spec["experts"])
    c = compiled(abstract_fp8_model(cfg, "bfloat16", fp8=False))  # bf16 weights: docs/memory.md, Method
    rows, tokens, window, dcp, tp = spec["rows"], spec["tokens"], spec["window"], spec["dcp"], spec["tp"]
    cache = _abstract_cache(cfg, spec, rows, window)
    # the form the runner's "auto" takes on a GPU: dense MHA while the window is within top-k (DSA is
    # dense attention there), sparse MQA beyond; DCP decode always MQA (queries go to the KV shards)
    split = spec["pcp"] > 1 and tokens > 1
    form = "mha" if window <= cfg.index_topk and not (dcp > 1 and not split) else "mqa"
    sds = lambda shape, dtype=jnp.int32, sharding=None: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    extra = 0
    if spec["program"] == "dp":
        tok = sds((rows, tokens))
        # last_only=False: the compiled layer stands for an inner layer (the runner's last_only skips only
        # the last layer's query side); the full step's outputs are added below
        lowered = c.forward.trace(c.state, tok, tok, cache, window=window, form=form, impl=spec["impl"],
                                  last_only=False).lower()
        full = cfg_full.replace(num_nextn_predict_layers=0, n_routed_experts=cfg.n_routed_experts)
        extra = _selection_bytes(full, spec, form, tokens > 1) - _selection_bytes(cfg, spec, form, False)
    else:
        if tp > 1:
            mesh = make_mesh(**parallel_tp.mesh_sizes(tp, dcp))
            shapes = jax.eval_shape(lambda s: parallel_tp.prepare_state(s, cfg, tp, spec["ep"]), c.state)
            specs = parallel_tp.state_specs(shapes, spec["ep"])
        else:
            mesh = make_mesh(cp=spec["cp"])
            shapes, specs = c.state, parallel_model.state_specs(c.state, "cp", spec["ep"])
        state = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, NamedSharding(mesh, s)), shapes, specs)
        width = PcpSplit(tokens, spec["cp"]).tokens_per_rank * spec["cp"] if split else tokens
        cp = CpKVCache(cache, "cp", spec["cp"], tokens_split=split, dcp=dcp > 1, interleave=spec["interleave"],
                       backend=spec["backend"], heads_split=tp > 1, gather_queries=tp > 1)
        cp = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, NamedSharding(mesh, s)), cp,
                          parallel_model.cache_specs(cp))
        tok = sds((rows, width), jnp.int32, NamedSharding(mesh, P(None, "cp") if split else P()))
        lowered = parallel_model.forward.trace(state, tok, tok, cp, None, graphdef=c.graphdef, mesh=mesh,
                                               window=window, form=form, impl=spec["impl"],
                                               expert_parallel=spec["ep"], tensor_parallel=tp > 1).lower()
    exe = lowered.compile()
    ma = exe.memory_analysis()
    out = {"temp_bytes": int(ma.temp_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
           "alias_bytes": int(ma.alias_size_in_bytes), "argument_bytes": int(ma.argument_size_in_bytes),
           "extra_output_bytes": int(extra), "form": form, "layers": cfg.num_hidden_layers,
           "largest_arrays": largest_arrays(exe.as_text()), "compile_s": round(time.perf_counter() - t0, 1)}
    out["peak_bytes"] = out["temp_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["extra_output_bytes"]
    return out


_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
              "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def largest_arrays(hlo: str, n: int = 6) -> list[dict]:
    """The largest arrays an optimised program makes (`compiled.as_text()`): instruction results in any of
    its computations, one per (source op, shape), the program's parameters (weights, caches, tokens) and
    arrays of their shapes (the caches' in-place updates) left out. What the workspace is made of; not a
    liveness analysis (XLA's temp size is)."""
    import re

    lines = hlo.splitlines()
    entry = next((ln for ln in lines if ln.startswith("ENTRY")), "")
    params = set(re.findall(r"(\w+\[[\d,]*\])", entry.split("->")[0]))
    # a fusion's inner instructions are not buffers: only its result is
    fused = set(re.findall(r" fusion\(.*?calls=(%[\w.\-]+)", hlo))
    found: dict[tuple, int] = {}
    inside = False
    for ln in lines:
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) .*\{$", ln)
        if head:
            inside = head.group(1) in fused
            continue
        m = None if inside else re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]", ln)
        if not m or m.group(1) not in _HLO_BYTES or " parameter(" in ln:
            continue
        shape = f"{m.group(1)}[{m.group(2)}]"
        if shape in params:
            continue
        size = math.prod(int(d) for d in m.group(2).split(",") if d) * _HLO_BYTES[m.group(1)]
        op = re.search(r'op_name="([^"]*)"', ln)
        name = op.group(1).replace("jit(forward)/", "").replace("shard_map/", "") if op else "?"
        found[(name, shape)] = max(found.get((name, shape), 0), size)
    top = sorted(found.items(), key=lambda kv: -kv[1])[:n]
    return [{"op": k[0], "shape": k[1], "bytes": v} for k, v in top]


def _selection_bytes(cfg, spec: dict, form: str, last_only: bool) -> int:
    """Bytes of the top-k selections the one-device step of `cfg` returns (GLM53.__call__ returns every
    full-indexer layer's; the runner drops them, but the jitted step materialises them): jax.eval_shape."""
    import jax
    import jax.numpy as jnp

    from glm53.model import compiled

    c = compiled(abstract_fp8_model(cfg, "bfloat16", fp8=False))
    tok = jax.ShapeDtypeStruct((spec["rows"], spec["tokens"]), jnp.int32)
    out = jax.eval_shape(lambda s, t, ch: c.forward(s, t, t, ch, window=spec["window"], form=form, impl=spec["impl"],
                                                    last_only=last_only),
                         c.state, tok, _abstract_cache(cfg, spec, spec["rows"], spec["window"]))
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(out[2]))


def compile_all(specs: list[dict], preset: str, *, progress: bool = True) -> dict[str, dict]:
    """Compile `specs` in a fresh process with WORKER_DEVICES simulated CPU devices (the device count is
    fixed when JAX starts; the meshes need 8) -> {key: compile_program's result}."""
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as tmp:
        inp, outp = Path(tmp) / "specs.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps({"preset": preset, "specs": specs}))
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                          f" --xla_force_host_platform_device_count={WORKER_DEVICES}").strip(),
                   JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "experiments.memory_plan", "--compile-worker", str(inp), str(outp)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=None if progress else subprocess.PIPE,
                              stderr=subprocess.STDOUT if not progress else None, text=True)
        if proc.returncode:
            raise RuntimeError(f"compile worker failed ({proc.returncode}): {proc.stdout or ''}"[-4000:])
        return json.loads(outp.read_text())


def _worker(inp: str, outp: str) -> None:
    import glm53

    job = json.loads(Path(inp).read_text())
    cfg = glm53.get_preset(job["preset"])
    res = {}
    for i, spec in enumerate(job["specs"]):
        res[spec["key"]] = compile_program(spec, cfg)
        print(f"[memory_plan] {i + 1}/{len(job['specs'])} {spec['key']}: peak "
              f"{res[spec['key']]['peak_bytes'] / GiB:.2f} GiB ({res[spec['key']]['compile_s']} s)", flush=True)
    Path(outp).write_text(json.dumps(res))


# --------------------------------------------------------------------------------------------------- pool
def _request_blocks(d, tokens: int) -> int:
    """Blocks one request of `tokens` tokens holds fully resident (DeployConfig.resolved's count, without
    a hot buffer): MLA pages plus indexer pages."""
    from glm53.engine.config import GROUPS

    return sum(-(-tokens // n) for n in d.group_tokens_per_block(GROUPS).values())


def _tokens_in(d, blocks: int) -> int:
    """The longest request (tokens) whose full residency fits `blocks` blocks."""
    lo, hi = 0, max(1, blocks) * d.tokens_per_block
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _request_blocks(d, mid) <= blocks else (lo, mid - 1)
    return lo


def pool_plan(dep: Deployment, cfg, budget: int) -> dict:
    """The KV pool a per-GPU budget of `budget` bytes gives `dep`: blocks and tokens by the engine's own
    resolution, the runner's arrays for them, HiSparse's hot buffers in it, host pools, and what fits."""
    import jax
    import numpy as np

    from glm53.engine.config import GROUPS
    from kvcache.policies.hisparse import TAIL_PAGES, hot_buffer_rows
    from kvcache.policies.hisparse.device import new_hot_state
    from kvcache.layout import block_bytes, page_bytes
    from kvcache.paged import PagedKVCache

    d = dep.deploy
    dcp = d.decode_context_parallel_size
    pages = page_bytes(cfg, d.kv_cache_dtype, d.block_size, d.index_block_size, dcp=dcp)
    per_block = -(-block_bytes(pages) // dcp)  # one block's share of one GPU (DeployConfig.resolved)
    blocks = max(budget, 0) // per_block
    out = {"kv_pool_blocks": int(blocks), "kv_block_bytes_per_gpu": int(per_block), "page_bytes": pages,
           "kv_pool_tokens_per_gpu": _tokens_in(d, blocks)}
    # the engine's resolution of this budget (raises when one request of max_model_len cannot be held),
    # at the price of the runner's arrays today (a page of every group per block id: runner_block_bytes)
    try:
        r = dataclasses.replace(d, kv_cache_memory_bytes=max(budget, 1)).resolved(cfg, "bfloat16", runner_arrays=True)
        out["engine_num_gpu_blocks"] = r.num_gpu_blocks
        out["engine_admits_max_model_len"] = True
    except ValueError as e:
        r = dataclasses.replace(d, num_gpu_blocks=max(int(blocks), 1))
        out["engine_num_gpu_blocks"] = None
        out["engine_admits_max_model_len"] = False
        out["engine_refusal"] = str(e)
    # what the runner's arrays for the pool take: PagedKVCache.create holds num_blocks pages of *every*
    # group (the shared buffer of kvcache.layout.block_bytes is not built), split over the DCP ranks
    table = np.full((1, 1), -1, np.int32)
    one = jax.eval_shape(lambda: PagedKVCache.create(cfg, dcp, d.block_size, table, index_block_size=d.index_block_size,
                                                     index_block_table=table, kv_cache_dtype=d.kv_cache_dtype,
                                                     include_mtp=False))
    per_runner_block = sum(int(x.size) * x.dtype.itemsize for x in (*one.mla, *one.index)) // dcp
    out["runner_kv_arrays_bytes_per_gpu"] = int(blocks * per_runner_block)
    out["runner_kv_arrays_fit_budget"] = bool(blocks * per_runner_block <= max(budget, 0))
    out["engine_kv_arrays_bytes_per_gpu"] = int((out["engine_num_gpu_blocks"] or 0) * per_runner_block)
    # one request of max_model_len: fully resident, or (HiSparse) the device part the mechanism keeps
    full = _request_blocks(d, d.max_model_len)
    need, hot = full, {}
    if d.kv_policy == "hisparse":
        for spec in (0, PUBLISHED_MTP):
            rows = hot_buffer_rows(d.hisparse_device_buffer_size, spec, cfg.index_topk)
            lease = -(-rows // d.block_size)  # as DeployConfig.resolved counts a lease
            hot[spec] = {"rows": rows, "lease_blocks": lease,
                         "bytes_per_request": lease * per_block,
                         "bytes_at_max_num_seqs": d.max_num_seqs * lease * per_block,
                         "leases_the_pool_holds": int(blocks // lease)}
        lease = hot[0]["lease_blocks"]
        index_blocks = -(-d.max_model_len // d.group_tokens_per_block(GROUPS)["indexer"])
        need = index_blocks + TAIL_PAGES + lease  # indexer keys, the newest MLA pages, the hot buffer
        groups = sum(1 for i in cfg.full_indexer_layers if i < cfg.num_hidden_layers)
        state = jax.eval_shape(lambda: new_hot_state(d.max_num_seqs, groups, hot[0]["rows"]))
        out["hisparse_state_bytes_per_gpu"] = sum(int(x.size) * x.dtype.itemsize for x in state)
    out.update({
        "hot_buffer_bytes_per_gpu": hot[0]["bytes_at_max_num_seqs"] if hot else 0,
        "hot_buffer_bytes_per_gpu_mtp3": hot[PUBLISHED_MTP]["bytes_at_max_num_seqs"] if hot else 0,
        "hot_buffers": {f"num_speculative_tokens={k}": v for k, v in hot.items()},
        "request_blocks_full_residency": full, "request_blocks_on_device": need,
        "requests_that_fit": int(blocks // need) if need else 0,
    })
    out["fits"] = bool(budget > 0 and blocks >= need)
    out["fits_max_num_seqs"] = bool(out["requests_that_fit"] >= d.max_num_seqs)
    # host pools: the published budgets in the pages the engine allocates (DeployConfig.kv_sizes)
    try:
        sizes = dataclasses.replace(r, num_gpu_blocks=max(int(blocks), 1)).kv_sizes(cfg, "bfloat16")
        host_blocks = dict(sizes.host_blocks)
        out["host_pool_holds_max_model_len"] = True
    except ValueError as e:  # a HiSparse host pool smaller than one request of max_model_len
        if d.kv_policy != "hisparse":
            raise
        out["host_pool_holds_max_model_len"] = False
        out["host_pool_refusal"] = str(e)
        host_blocks = {"mla": d.hisparse_host_pool_bytes // pages["mla"], "indexer": d.cpu_offload_bytes // pages["indexer"]}
    host = {g: n * pages[g] for g, n in host_blocks.items()}
    budgets = ({"hisparse": d.hisparse_host_pool_bytes, "offload": d.cpu_offload_bytes} if d.kv_policy == "hisparse"
               else {"offload": d.cpu_offload_bytes})
    out["host_pool_budget_bytes"] = budgets
    out["host_pool_bytes"] = int(sum(host.values()))
    out["host_pool_pages"] = host_blocks
    if d.kv_policy == "hisparse":
        # HiSparse releases a request's older MLA pages to its host pool: one request of max_model_len is
        # served when its device part fits (above) and the host pool holds the MLA pages the device pool
        # cannot keep (the engine's own check, DeployConfig.kv_sizes, asks the host pool for all of them)
        mla_pages = -(-d.max_model_len // d.tokens_per_block)
        on_device = max(int(blocks) - (need - TAIL_PAGES), TAIL_PAGES)  # pool less the keys and the hot buffer
        out["request_mla_pages"] = mla_pages
        out["host_pool_holds_the_rest"] = bool(host_blocks["mla"] >= mla_pages - min(on_device, mla_pages))
        out["fits"] = out["fits"] and out["host_pool_holds_the_rest"]
    out["host_pool_bytes_per_node"] = int(sum(host.values()) * dep.replicas_per_node)
    return out


# --------------------------------------------------------------------------------------------------- plan
def plan(deps: list[Deployment], cfg, compiled_programs: dict, *, hbm_bytes: int, weights_fp8: bool = True) -> list[dict]:
    """One row per deployment (module docstring)."""
    from flax import nnx

    from glm53.engine.config import DeployConfig

    util = DeployConfig.gpu_memory_utilization
    state = nnx.state(abstract_fp8_model(cfg, "bfloat16", fp8=weights_fp8))
    weights_cache, rows = {}, []
    for dep in deps:
        wkey = (dep.weights, dep.deploy.tensor_parallel_size, dep.deploy.decode_context_parallel_size, dep.ep)
        if wkey not in weights_cache:
            weights_cache[wkey] = weights_per_gpu(state, cfg, dep)
        w = weights_cache[wkey]
        progs = {kind: compiled_programs[p["key"]] for kind, p in programs_for(dep, cfg).items()}
        ref = {kind: compiled_programs.get(p["key"]) for kind, p in programs_for(dep, cfg, "reference").items()}
        step_kinds = [k for k in ("prefill", "decode") if k in progs]
        workspace = max(progs[k]["peak_bytes"] for k in step_kinds)
        usable = int(util * hbm_bytes)
        first = pool_plan(dep, cfg, usable - w["bytes_per_gpu"] - workspace)
        state_bytes = first.get("hisparse_state_bytes_per_gpu", 0)
        budget = usable - w["bytes_per_gpu"] - workspace - state_bytes
        pool = pool_plan(dep, cfg, budget)
        row = {"name": dep.name, "title": dep.title, "max_model_len": dep.max_model_len, "role": dep.role,
               "published": dep.published, "gpus_per_replica": dep.deploy.devices_per_replica,
               "replicas_per_node": dep.replicas_per_node,
               "weights_bytes_per_gpu": w["bytes_per_gpu"], "weights_by_component": w["by_component"],
               "engine_weights_bytes_per_gpu": w["engine_bytes_per_gpu"],
               "kv_pool_bytes_per_gpu": int(budget),
               "hot_buffer_bytes_per_gpu": pool["hot_buffer_bytes_per_gpu"],
               "workspace_bytes_per_gpu": int(workspace),
               "host_pool_bytes": pool["host_pool_bytes"],
               "fits": pool["fits"],
               "workspace_by_step": {k: v["peak_bytes"] for k, v in progs.items()},
               "workspace_reference_impl_by_step": {k: v["peak_bytes"] for k, v in ref.items() if v},
               "workspace_step": max(step_kinds, key=lambda k: progs[k]["peak_bytes"]),
               "workspace_largest_arrays": progs[max(step_kinds, key=lambda k: progs[k]["peak_bytes"])]["largest_arrays"],
               "workspace_method": WORKSPACE_METHOD,
               "max_num_batched_tokens": dep.deploy.max_num_batched_tokens, "max_num_seqs": dep.deploy.max_num_seqs,
               "gpu_memory_utilization": util, "hbm_bytes": hbm_bytes, "usable_bytes": usable}
        row.update({k: v for k, v in pool.items() if k not in row})
        hot = pool["hot_buffers"].get("num_speculative_tokens=0")
        if hot:  # leased from the pool: at max_num_seqs they may take more than it holds
            row["hot_buffers_fit_pool_at_max_num_seqs"] = bool(0 < row["hot_buffer_bytes_per_gpu"] <= max(budget, 0))
            row["hot_buffers_the_pool_holds"] = hot["leases_the_pool_holds"]
            row["hot_buffers_the_pool_holds_mtp3"] = pool["hot_buffers"][f"num_speculative_tokens={PUBLISHED_MTP}"][
                "leases_the_pool_holds"]
        # the most workspace that would still leave room for one request of max_model_len (its device part)
        need = pool["request_blocks_on_device"] * pool["kv_block_bytes_per_gpu"]
        row["max_workspace_bytes_for_one_request"] = int(usable - w["bytes_per_gpu"] - state_bytes - need)
        if budget <= 0:
            row["why_not"] = (f"weights {_gib(w['bytes_per_gpu'])} GiB + workspace {_gib(workspace)} GiB "
                              f"({row['workspace_step']} step) exceed {util} x HBM = {_gib(usable)} GiB")
        if "last_chunk" in progs:  # the worst chunk: the last of a max_model_len prompt
            last = usable - w["bytes_per_gpu"] - progs["last_chunk"]["peak_bytes"] - state_bytes
            lp = pool_plan(dep, cfg, last)
            row["kv_pool_bytes_per_gpu_last_chunk"] = int(last)
            row["fits_last_chunk"] = lp["fits"]
        rows.append(row)
    return rows


def depth_checks(got: dict, checks: dict, cfg) -> dict:
    """What the one-layer programs stand for: XLA:CPU's peak of 1, 2 and 3 layers (and of the whole
    depth) and whether the pool size changes the workspace (it must not: the cache is donated)."""
    peak = {k: v["peak_bytes"] for k, v in got.items()}
    growth = [peak["two_layers"] - peak["one_layer"], peak["three_layers"] - peak["two_layers"]]
    out = {"program": checks["one_layer"]["key"],
           "peak_bytes_1_2_3_layers": [peak["one_layer"], peak["two_layers"], peak["three_layers"]],
           "xla_cpu_peak_growth_per_layer_bytes": growth,
           "linear_extrapolation_to_model_depth_bytes": peak["one_layer"] + (cfg.num_hidden_layers - 1) * growth[-1],
           "workspace_pool_independent": got["pool_x1"]["temp_bytes"] == got["pool_x4"]["temp_bytes"],
           "temp_bytes_pool_x1_x4": [got["pool_x1"]["temp_bytes"], got["pool_x4"]["temp_bytes"]]}
    if "full_depth" in got:
        out["full_depth_program"] = checks["full_depth"]["key"]
        out["full_depth_layers"] = got["full_depth"]["layers"]
        out["full_depth_xla_cpu_peak_bytes"] = peak["full_depth"]
        out["full_depth_compile_s"] = got["full_depth"]["compile_s"]
    out["why_one_layer"] = (
        "Nothing but the hidden state [tokens, hidden] and the top-k of the last full-indexer layer crosses "
        "a layer boundary, so a compiler that reuses buffers between layers needs one layer's temporaries. "
        "XLA:CPU does not: it merges the layers' identical zero-initialised buffers (e.g. every MoE layer's "
        "dispatch buffer [T x top-k + padding, hidden], 3.2 GiB at 32,768 tokens) into one broadcast and gives "
        "each layer a copy of it, scheduled before the first layer runs, so its peak grows with depth "
        "(above; more per full-indexer layer). The whole-depth figure is that artefact of the CPU compiler, "
        "not the step's need; what XLA:GPU schedules is to be checked on an H200 (no GPU in this run).")
    return out


def published_vs_derived(rows: list[dict]) -> dict:
    """BRIEF §2's ~15 GiB per GPU under TP8 beside the derived TP8 pool at 142K, what the published figure
    implies for everything else on the GPU, and the named differences (signed bytes each would add to
    the derived pool). docs/memory.md discusses them."""
    from glm53.perfmodel import H200, PUBLISHED_KV_BUDGET_BYTES_TP8

    tp8 = next(r for r in rows if r["name"] == "tp8_hisparse" and r["max_model_len"] == LIMITS[0])
    emb = tp8["weights_by_component"].get("embed_lm_head", 0)
    derived = tp8["kv_pool_bytes_per_gpu"]
    util = tp8["gpu_memory_utilization"]
    vllm_weights = tp8["weights_bytes_per_gpu"] - (emb - emb // 8)  # vLLM splits embed / lm_head over TP
    datasheet_usable = int(util * H200.hbm_capacity_bytes)
    return {
        "published_kv_budget_bytes_per_gpu": PUBLISHED_KV_BUDGET_BYTES_TP8,
        "published_source": "BRIEF §2: 'An H200 has about 15 GiB left for KV after GLM-5.3's FP8 weights (TP8)'",
        "derived_kv_pool_bytes_per_gpu": derived,
        "gap_bytes": derived - PUBLISHED_KV_BUDGET_BYTES_TP8,
        "parts_bytes": {
            "embed_lm_head_split_over_tp_as_vllm": int(emb - emb // 8),
            "hbm_datasheet_141e9_instead_of_reported": int(datasheet_usable - tp8["usable_bytes"]),
            "workspace_reference_impl_instead_of_kernels": int(
                tp8["workspace_by_step"]["prefill"] - tp8["workspace_reference_impl_by_step"].get("prefill", 0)),
            "hisparse_resolver_state": -tp8.get("hisparse_state_bytes_per_gpu", 0),
        },
        # what the published 15 GiB leaves for activations, CUDA graphs, NCCL and the rest, with these
        # weights laid out as vLLM lays them out (embeddings split)
        "implied_other_bytes_reported_hbm": tp8["usable_bytes"] - vllm_weights - PUBLISHED_KV_BUDGET_BYTES_TP8,
        "implied_other_bytes_datasheet_hbm": datasheet_usable - vllm_weights - PUBLISHED_KV_BUDGET_BYTES_TP8,
        "our_workspace_bytes": tp8["workspace_bytes_per_gpu"],
        "our_workspace_largest_arrays": tp8["workspace_largest_arrays"],
        "hot_buffers_at_max_num_seqs_bytes": tp8["hot_buffer_bytes_per_gpu"],
        "mtp3_hot_buffers_at_max_num_seqs_bytes": tp8["hot_buffer_bytes_per_gpu_mtp3"],
        "explanation": (
            f"The derived pool is {_gib(abs(derived - PUBLISHED_KV_BUDGET_BYTES_TP8))} GiB "
            f"{'above' if derived >= PUBLISHED_KV_BUDGET_BYTES_TP8 else 'below'} the published one. Against "
            f"ours: our TP replicates the embeddings and lm_head (vLLM splits them over the 8 ranks: "
            f"{_gib(emb - emb // 8)} GiB more for its pool). For ours: the plan models the step's workspace "
            "alone (the indexer's float32 scores of a query tile, at most 1 GiB, and their top-k; the MoE "
            "dispatch buffer; one layer's temporaries), while vLLM's 0.9 x HBM also pays for CUDA graphs, NCCL "
            "buffers, its kernels' workspaces and the CUDA context, which the plan does not model. "
            f"Taking vLLM's weight layout, the published 15 GiB leaves {_gib(tp8['usable_bytes'] - vllm_weights - PUBLISHED_KV_BUDGET_BYTES_TP8)}"
            f" GiB for all of that on the HBM CUDA reports ({_gib(datasheet_usable - vllm_weights - PUBLISHED_KV_BUDGET_BYTES_TP8)} "
            "GiB on the datasheet's 141 GB); ours is the workspace alone."),
        "not_modelled": ["NCCL / custom all-reduce buffers (vLLM counts non-torch allocations after its profile run)",
                         "CUDA graphs (captured after the KV cache is sized; they come out of the remaining 10%)",
                         "DeepGEMM / FlashMLA / cuBLAS workspaces and vLLM's own indexer buffers",
                         "the allocator's fragmentation and the CUDA context"],
    }


# ------------------------------------------------------------------------------------------------- output
def kv_budget(results: str | Path = REPO / "results/memory_plan/results.json", name: str = "tp8_hisparse",
              max_model_len: int = LIMITS[0], max_num_batched_tokens: int | None = None) -> int:
    """The derived per-GPU KV budget of deployment `name` at `max_model_len` (and max_num_batched_tokens;
    None: the first row, Part 1's batch) from a memory plan's results.json (a published deployment's own:
    experiments.deployments.kv_budget)."""
    r = plan_row(name, max_model_len, max_num_batched_tokens, results)
    if r["kv_pool_bytes_per_gpu"] <= 0:
        raise ValueError(f"memory plan {results}: {name} at {max_model_len} leaves no KV pool")
    return int(r["kv_pool_bytes_per_gpu"])


def _gib(n) -> str:
    return f"{n / GiB:,.2f}"


def report(res: dict) -> str:
    lines = ["# Memory plan", "", f"{res['date']}, commit {res['git_revision']}; `{res['command']}`.", "",
             f"Per GPU, GiB. Usable = gpu_memory_utilization {res['gpu_memory_utilization']} x {_gib(res['hbm_bytes'])} GiB "
             f"({res['hbm_source']}). Pool = usable - weights - workspace (- HiSparse state). Hot buffers are part "
             "of the pool (MTP3 figure: the published runs' (3 + 2) x top-k rows).", "",
             "| deployment | max_model_len | batched tokens | weights | workspace | pool | pool (last chunk) | blocks | "
             "tokens | hot buffers (MTP3) | host pools/replica | fits | requests | runner arrays |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["deployments"]:
        lines.append(
            f"| {r['name']} | {r['max_model_len']:,} | {r['max_num_batched_tokens']:,} | {_gib(r['weights_bytes_per_gpu'])} | "
            f"{_gib(r['workspace_bytes_per_gpu'])} | "
            f"{_gib(r['kv_pool_bytes_per_gpu'])} | {_gib(r['kv_pool_bytes_per_gpu_last_chunk']) if 'kv_pool_bytes_per_gpu_last_chunk' in r else '-'} | "
            f"{r['kv_pool_blocks']:,} | {r['kv_pool_tokens_per_gpu']:,} | "
            f"{_gib(r['hot_buffer_bytes_per_gpu'])} ({_gib(r['hot_buffer_bytes_per_gpu_mtp3'])}) | "
            f"{_gib(r['host_pool_bytes'])} | {r['fits']} | {r['requests_that_fit']} | "
            f"{_gib(r['runner_kv_arrays_bytes_per_gpu'])} |")
    g = res["published_vs_derived"]
    lines += ["", f"Published TP8 budget {_gib(g['published_kv_budget_bytes_per_gpu'])} GiB ({g['published_source']}), "
                  f"derived {_gib(g['derived_kv_pool_bytes_per_gpu'])} GiB (gap {_gib(g['gap_bytes'])} GiB); our "
                  f"workspace is {_gib(g['our_workspace_bytes'])} GiB. " + g["explanation"],
              "", f"Workspace: {res['workspace_method']}."]
    c = res.get("checks") or {}
    if c:
        lines += ["", f"Checks ({c['program']}): XLA:CPU peak of 1 / 2 / 3 layers "
                      f"{' / '.join(_gib(x) for x in c['peak_bytes_1_2_3_layers'])} GiB"
                  + (f"; the whole {c['full_depth_layers']}-layer program {_gib(c['full_depth_xla_cpu_peak_bytes'])} GiB"
                     if "full_depth_xla_cpu_peak_bytes" in c else "")
                  + f"; workspace independent of the pool size: {c['workspace_pool_independent']}. " + c["why_one_layer"]]
    lines.append("")
    return "\n".join(lines) + "\n"


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["deployments"]
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.6))
    labels = [f"{r['name']} @ {r['max_model_len']:,}, {r['max_num_batched_tokens'] // 1024}K batch" for r in rows]
    for i, r in enumerate(rows):
        left = 0.0
        pool = max(r["kv_pool_bytes_per_gpu"], 0) / GiB
        hot = min(r["hot_buffer_bytes_per_gpu"] / GiB, pool)
        for val, color, name in ((r["weights_bytes_per_gpu"] / GiB, "tab:blue", "weights"),
                                 (r["workspace_bytes_per_gpu"] / GiB, "tab:orange", "workspace"),
                                 (pool - hot, "tab:green", "KV pool"),
                                 (hot, "tab:olive", "hot buffers at max_num_seqs (leased from the pool; clipped to it)")):
            ax.barh(i, val, left=left, color=color, label=name if i == 0 else None)
            left += val
    ax.axvline(res["usable_bytes"] / GiB, color="k", ls="--", lw=1, label="0.9 x HBM")
    ax.axvline(res["hbm_bytes"] / GiB, color="k", lw=1, label="HBM")
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU")
    ax.set_title("Memory plan per GPU (workspace above 0.9 x HBM: the step does not fit)")
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.08), fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "memory_plan.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.memory_plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/memory_plan")
    ap.add_argument("--preset", default="glm-5.3", help="model preset (tests: tiny)")
    ap.add_argument("--limits", default=",".join(map(str, LIMITS)), help="context limits (max_model_len), comma-separated")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: Part 1's")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: Part 1's")
    ap.add_argument("--part2-batched-tokens", "--dp-batched-tokens", default=",".join(map(str, PART2_BATCHED_TOKENS)),
                    help="further max_num_batched_tokens Part 2's rows (DP8 ranks, PCP8 x DCP8 x EP8 prefill) are "
                         "planned at, comma-separated ('' for none)")
    ap.add_argument("--hbm-bytes", type=int, default=H200_TOTAL_MEMORY_BYTES)
    ap.add_argument("--host-scale", type=float, default=1.0, help="scale the published host budgets (tests)")
    ap.add_argument("--weights", choices=("fp8", "bfloat16"), default="fp8",
                    help="weights as the fp8 loader keeps them, or all bfloat16 (small presets: fp8 blocks do not split)")
    ap.add_argument("--deployments", default="", help="comma-separated names (default: all)")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference-impl workspace programs")
    ap.add_argument("--no-checks", action="store_true",
                    help="skip the method's checks (two and three layers, the whole depth, a larger pool)")
    ap.add_argument("--no-full-depth", action="store_true", help="skip the whole-depth compile among the checks")
    ap.add_argument("--reuse-programs", default="", metavar="RESULTS_JSON",
                    help="take the compiled programs' memory analyses from an earlier results.json (compile only "
                         "what it lacks): the plan without the compiles, e.g. experiments.reproduce --quick")
    ap.add_argument("--compile-worker", nargs=2, metavar=("SPECS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_worker:
        _worker(*args.compile_worker)
        return {}
    import jax

    import glm53

    t0 = time.perf_counter()
    cfg = glm53.get_preset(args.preset)
    limits = tuple(int(x) for x in args.limits.split(","))
    deps = deployments(limits=limits, max_num_batched_tokens=args.max_num_batched_tokens or None,
                       max_num_seqs=args.max_num_seqs or None, host_scale=args.host_scale,
                       part2_batched_tokens=tuple(int(x) for x in args.part2_batched_tokens.split(",") if x))
    names = [n for n in args.deployments.split(",") if n]
    unknown = set(names) - {d.name for d in deps}
    if unknown:
        ap.error(f"unknown deployments {sorted(unknown)}; choose from {sorted({d.name for d in deps})}")
    deps = [d for d in deps if not names or d.name in names]
    specs = {}
    for dep in deps:
        for impl in (IMPL,) + (() if args.no_reference else ("reference",)):
            for kind, p in programs_for(dep, cfg, impl).items():
                if impl == IMPL or kind == "prefill":
                    specs[p["key"]] = p
    # checks of the method: a second layer (does XLA's temp grow per layer?) and a larger pool (does the
    # step copy the cache?), both on the TP8 programs
    checks = {}
    if not args.no_checks:
        base = next((d for d in deps if d.role == "aggregated"), deps[0])
        progs = programs_for(base, cfg)
        decode = progs.get("decode", progs["prefill"])
        checks = {"one_layer": progs["prefill"], "two_layers": dict(progs["prefill"], layers=2),
                  "three_layers": dict(progs["prefill"], layers=3),
                  "pool_x1": decode, "pool_x4": dict(decode, num_blocks=4 * decode["num_blocks"])}
        if not args.no_full_depth:  # the whole decoder as it is (~4 minutes of compiling at full size)
            checks["full_depth"] = dict(progs["prefill"], layers=cfg.num_hidden_layers, structure="model")
    for k, p in checks.items():
        p["key"] = _key(p) + ("/model" if p.get("structure") == "model" else "")
        specs[p["key"]] = p
    reused = {}
    if args.reuse_programs:  # an earlier run's compiled programs (same keys: same shapes, impl and layers)
        earlier = json.loads(Path(args.reuse_programs).read_text())
        if earlier.get("preset") != args.preset:
            ap.error(f"--reuse-programs {args.reuse_programs} is of preset {earlier.get('preset')!r}")
        reused = {k: v for k, v in earlier["programs"].items() if k in specs}
    todo = [p for k, p in specs.items() if k not in reused]
    print(f"[memory_plan] compiling {len(todo)} step programs (full width; {len(reused)} reused)", flush=True)
    compiled_programs = {**reused, **(compile_all(todo, args.preset) if todo else {})}
    rows = plan(deps, cfg, compiled_programs, hbm_bytes=args.hbm_bytes, weights_fp8=args.weights == "fp8")
    from glm53.engine.config import DeployConfig

    util = DeployConfig.gpu_memory_utilization
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    got = {k: compiled_programs[p["key"]] for k, p in checks.items()}
    res = {
        "date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
        "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "note": "compiled for XLA:CPU with 8 simulated devices; nothing allocated"},
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "command": "python -m experiments.memory_plan " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset, "weights": args.weights,
        "hbm_bytes": args.hbm_bytes,
        "hbm_source": ("an H200 SXM's total memory as CUDA reports it (torch total_memory 143,156 MiB), which vLLM "
                       "multiplies by gpu_memory_utilization" if args.hbm_bytes == H200_TOTAL_MEMORY_BYTES else "--hbm-bytes"),
        "hbm_datasheet_bytes": 141_000_000_000,
        "gpu_memory_utilization": util, "utilization_source": "vLLM's default (DeployConfig.gpu_memory_utilization)",
        "usable_bytes": int(util * args.hbm_bytes),
        "programs_reused_from": ({"path": args.reuse_programs, "count": len(reused), "git_revision": earlier.get(
            "git_revision"), "date": earlier.get("date")} if args.reuse_programs else None),
        "workspace_impl": IMPL,
        "workspace_method": WORKSPACE_METHOD,
        "deployments": rows,
        "published_vs_derived": published_vs_derived(rows) if args.preset == "glm-5.3" and any(
            r["name"] == "tp8_hisparse" and r["max_model_len"] == LIMITS[0] for r in rows) else {},
        "checks": {} if not got else depth_checks(got, checks, cfg),
        "programs": compiled_programs,
    }
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if not res["published_vs_derived"]:
        res.pop("published_vs_derived")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    if "published_vs_derived" in res:
        (out / "report.md").write_text(report(res))
    plot(res, out)
    print(f"[memory_plan] wrote {out / 'results.json'} in {res['wall_s']} s")
    return res


if __name__ == "__main__":
    main()
