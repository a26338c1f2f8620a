"""Lower every Pallas kernel for an H200 and compile it to a cubin, on a machine without a GPU.

    python -m experiments.check_gpu_lowering --out results/gpu_lowering \
        [--triton-python /path/to/python-with-triton]     # compile step; default: this interpreter if
                                                          # it has `triton`, else lowering only

1. Lowering (needs only JAX): each kernel case below is traced for the "cuda" platform with the H200
   named as the abstract device (`attention.gpu_aot.lower_triton`), through Pallas' Triton lowering, at
   GLM-5.3's dimensions and at the tiny preset's. A failure here is what a GPU user would hit first.
2. Compilation (needs the pip `triton` package, ~1 GB, so not part of CI): the TTIR of every kernel is
   compiled for sm_90 with the warps and stages XLA would use (experiments/triton_compile_worker.py),
   and ptxas reports registers, spills and shared memory. A kernel fails the check if it does not
   compile or needs more shared memory than an H200 block can have (227 KB); spills are reported.

This proves the kernels lower and compile for the GPU; it does not run them. The numerical check on a
GPU is still `pytest tests/attention` and `python -m experiments.bench_attention` there. Saves
OUT/results.json (date, machine, versions) and exits 1 if any kernel fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from attention import fp8_gemm, gpu_aot, hisparse, indexer, sparse_mla
from attention.formats import FP8, IndexKeyFormat, MLARowFormat, num_groups
from attention.hisparse import HotBuffer, resolve_pallas
from experiments.bench_gpu import LINEARS, linear_dims
from experiments.bench_model import run_metadata
from glm53.config import get_preset

H200_SHARED_MEMORY_BYTES = 227 * 1024  # the most one thread block may opt into on sm_90
H200_CAPABILITY = 90

def _preset_dims(name: str, block_size: int, context: int) -> tuple:
    c = get_preset(name)
    return (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.index_topk, c.index_n_heads,
            c.index_head_dim, block_size, context)


# name -> (heads, latent R, rope P, top-k, indexer heads, indexer dim, block size, context): the model
# presets, and "edge", the kernel tests' odd shapes (heads padded 20 -> 32, 37 slots in 64-row steps,
# 8-key blocks, a 40-position window).
DIMS = {"glm-5.3": _preset_dims("glm-5.3", 64, 131072), "tiny": _preset_dims("tiny", 16, 256),
        "edge": (20, 128, 16, 37, 8, 32, 8, 40)}


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def sparse_case(dims: str, fmt_name: str, batch: int, queries: int, block_sizes=None):
    h, r, p, k, *_ = DIMS[dims]
    fmt = MLARowFormat(fmt_name, r, p)
    n = batch * 4096

    def fn(q_lat, q_pe, table, slots):
        return sparse_mla.sparse_mqa_pallas(q_lat, q_pe, sparse_mla.SlotRows(table, slots, fmt), r ** -0.5,
                                            block_sizes=block_sizes)

    args = (_sds((batch, queries, h, r), jnp.bfloat16), _sds((batch, queries, h, p), jnp.bfloat16),
            _sds((n, fmt.width), fmt.storage_dtype), _sds((batch, queries, k), jnp.int32))
    return fn, args


def index_case(dims: str, fmt_name: str, batch: int, queries: int, block_sizes=None):
    *_, hi, di, bs, context = DIMS[dims]
    fmt = IndexKeyFormat(fmt_name, di)
    pages = context // bs

    def fn(q, w, table, block_table, q_pos):
        return indexer.index_scores_pallas(q, w, indexer.PagedKeys(table, block_table, bs, fmt), q_pos, window=context,
                                           block_sizes=block_sizes)

    args = (_sds((batch, queries, hi, di), jnp.bfloat16), _sds((batch, queries, hi), jnp.float32),
            _sds((batch * pages * bs, fmt.width), fmt.storage_dtype), _sds((batch, pages), jnp.int32),
            _sds((batch, queries), jnp.int32))
    return fn, args


def resolve_case(dims: str, batch: int, block_sizes=None):
    *_, k, _, _, bs, context = DIMS[dims]
    hot, pages = 2 * k, context // bs

    def fn(sel, dev, host, pos, last, rows, step):
        return resolve_pallas(sel, dev, host, bs, HotBuffer(pos, last, rows), step, block_sizes=block_sizes)

    i32 = jnp.int32
    args = (_sds((batch, k), i32), _sds((batch, pages), i32), _sds((batch, pages), i32),
            _sds((batch, hot), i32), _sds((batch, hot), i32), _sds((batch, hot), i32), _sds((), i32))
    return fn, args


def kernel_cases() -> dict:
    """name -> (fn, abstract args): every Pallas kernel at GLM-5.3's and the tiny preset's dimensions and
    at the kernel tests' edge shapes, decode (batch 4, one query each) and, for sparse MLA, a prefill
    chunk (64 queries)."""
    cases = {}
    for dims in DIMS:
        for fmt in ("fp8_ds_mla", "bfloat16", "float16", "float32"):
            cases[f"sparse_mqa/{dims}/{fmt}/decode"] = sparse_case(dims, fmt, 4, 1)
        cases[f"sparse_mqa/{dims}/fp8_ds_mla/prefill"] = sparse_case(dims, "fp8_ds_mla", 1, 64)
        for fmt in ("fp8", "bfloat16", "float16", "float32"):
            cases[f"index_scores/{dims}/{fmt}/decode"] = index_case(dims, fmt, 4, 1)
        cases[f"hisparse_resolve/{dims}"] = resolve_case(dims, 4)
    return cases


def candidate_cases() -> dict:
    """name -> (fn, abstract args): every tile candidate of every kernel (`CANDIDATES` beside each, the ones
    experiments.bench_gpu times) at GLM-5.3's dimensions with fp8 caches, at the bench's decode shape
    (batch 64), so a candidate that cannot lower or compile is known before device time is spent on it."""
    cases = {}
    for i, bs in enumerate(sparse_mla.CANDIDATES):
        cases[f"sparse_mqa/glm-5.3/fp8_ds_mla/decode64/candidate{i}"] = sparse_case("glm-5.3", "fp8_ds_mla", 64, 1, bs)
    for i, bs in enumerate(indexer.CANDIDATES):
        cases[f"index_scores/glm-5.3/fp8/decode64/candidate{i}"] = index_case("glm-5.3", "fp8", 64, 1, bs)
    for i, bs in enumerate(hisparse.CANDIDATES):
        cases[f"hisparse_resolve/glm-5.3/candidate{i}"] = resolve_case("glm-5.3", 64, bs)
    return cases


def fp8_linear_case(tokens: int, din: int, dout: int, parts: int = 1, block_sizes=None):
    """`fp8_gemm.gemm`: activations quantised per 128 values [tokens, din] times fp8 blocks [din, dout]."""
    def fn(xq, xs, wq, ws):
        return fp8_gemm.gemm(xq, xs, wq, ws, parts=parts, block_sizes=block_sizes)

    gk = num_groups(din)
    args = (_sds((tokens, din), FP8), _sds((tokens, gk), jnp.float32), _sds((din, dout), FP8),
            _sds((gk, parts * num_groups(dout // parts)), jnp.float32))
    return fn, args


def fp8_experts_case(rows: int, experts: int, din: int, dout: int, parts: int = 1, block_sizes=None):
    """`fp8_gemm.grouped_gemm`: `rows` routed rows sorted by expert times `experts` fp8 weights [din, dout]."""
    def fn(xq, xs, wq, ws, sizes):
        return fp8_gemm.grouped_gemm(xq, xs, wq, ws, sizes, parts=parts, block_sizes=block_sizes)

    gk = num_groups(din)
    args = (_sds((rows, din), FP8), _sds((rows, gk), jnp.float32), _sds((experts, din, dout), FP8),
            _sds((experts, gk, parts * num_groups(dout // parts)), jnp.float32), _sds((experts,), jnp.int32))
    return fn, args


def fp8_cases() -> dict:
    """name -> (fn, abstract args): the fp8 GEMM kernels at experiments.bench_gpu's linear and moe shapes
    (every fp8 linear layer of GLM-5.3 at 64 and 8,192 tokens; EP8's 32 local experts at 512 and 4,096
    routed rows, all 256 at 4,096; gate|up and down), the tiny preset's and the kernel tests' odd shapes,
    and every tile candidate (`fp8_gemm.CANDIDATES`) at a decode linear and an EP8 expert shape."""
    glm, tiny = get_preset("glm-5.3"), get_preset("tiny")
    cases = {}
    for name in LINEARS:
        din, dout = linear_dims(glm, name)
        for tokens in (64, 8192):
            cases[f"fp8_gemm/glm-5.3/{name}/{tokens}"] = fp8_linear_case(tokens, din, dout)
    d, f = glm.hidden_size, glm.moe_intermediate_size
    for experts, rows in ((32, 512), (32, 4096), (256, 4096)):
        cases[f"fp8_grouped_gemm/glm-5.3/gate_up/{experts}x{rows}"] = fp8_experts_case(rows, experts, d, 2 * f, 2)
        cases[f"fp8_grouped_gemm/glm-5.3/down/{experts}x{rows}"] = fp8_experts_case(rows, experts, f, d)
    td, tf = tiny.hidden_size, tiny.moe_intermediate_size
    cases["fp8_gemm/tiny/q_a_proj/16"] = fp8_linear_case(16, td, tiny.q_lora_rank)
    cases["fp8_grouped_gemm/tiny/gate_up/16"] = fp8_experts_case(16, tiny.n_routed_experts, td, 2 * tf, 2)
    cases["fp8_gemm/edge/300x130x200"] = fp8_linear_case(300, 130, 200)
    cases["fp8_grouped_gemm/edge/45x200x192"] = fp8_experts_case(45, 4, 200, 192, 2)
    for i, bs in enumerate(fp8_gemm.CANDIDATES):
        cases[f"fp8_gemm/glm-5.3/q_b_proj/64/candidate{i}"] = fp8_linear_case(64, *linear_dims(glm, "q_b_proj"),
                                                                              block_sizes=bs)
        cases[f"fp8_grouped_gemm/glm-5.3/gate_up/32x512/candidate{i}"] = fp8_experts_case(512, 32, d, 2 * f, 2, bs)
    return cases


def lower_all(cases: dict) -> dict:
    """name -> {"ok", "kernels": [TritonKernel]} or {"ok": False, "error"}."""
    out = {}
    for name, (fn, args) in cases.items():
        try:
            out[name] = {"ok": True, "kernels": gpu_aot.lower_triton(fn, *args)}
        except Exception as e:  # noqa: BLE001 - every case is reported
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def default_triton_python() -> str | None:
    return sys.executable if importlib.util.find_spec("triton") else None


def compile_all(lowered: dict, triton_python: str, workdir: Path) -> dict:
    """Compile every lowered kernel with the worker under `triton_python` -> name -> [compile report]."""
    jobs = []
    for name, entry in lowered.items():
        for i, kern in enumerate(entry.get("kernels", [])):
            path = workdir / f"{name.replace('/', '__')}__{i}.ttir"
            path.write_text(kern.ttir)
            jobs.append({"name": name, "ttir_path": str(path), "num_warps": kern.num_warps,
                         "num_stages": kern.num_stages, "capability": H200_CAPABILITY})
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    worker = Path(__file__).with_name("triton_compile_worker.py")
    subprocess.run([triton_python, str(worker), str(workdir / "jobs.json"), str(workdir / "compiled.json")],
                   check=True, timeout=1800)
    reports: dict = {}
    for rep in json.loads((workdir / "compiled.json").read_text()):
        reports.setdefault(rep.pop("name"), []).append(rep)
    return reports


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--triton-python", default=None,
                    help="interpreter with the pip `triton` package for the compile step (default: this one "
                         "if it has triton; 'none' skips the step)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    triton_python = default_triton_python() if args.triton_python is None else args.triton_python
    if triton_python == "none":
        triton_python = None

    lowered = lower_all(kernel_cases() | candidate_cases() | fp8_cases())
    compiled = {}
    if triton_python:
        with tempfile.TemporaryDirectory() as tmp:
            compiled = compile_all(lowered, triton_python, Path(tmp))

    cases, failures = {}, []
    for name, entry in lowered.items():
        rec = {"lowered": entry["ok"]}
        if not entry["ok"]:
            rec["error"] = entry["error"]
            failures.append(f"{name}: lowering failed")
        else:
            rec["kernels"] = [{"name": k.name, "grid": list(k.grid), "num_warps": k.num_warps,
                               "num_stages": k.num_stages, "ttir_lines": k.ttir.count("\n"),
                               "dots": sorted(set(k.dots()))} for k in entry["kernels"]]
            reports = compiled.get(name, [])
            if triton_python and len(reports) != len(rec["kernels"]):
                failures.append(f"{name}: {len(rec['kernels'])} kernels but {len(reports)} compile reports")
            for kern, rep in zip(rec["kernels"], reports):
                kern["compile"] = rep
                if not rep["ok"]:
                    failures.append(f"{name}: compile failed")
                elif rep["shared_memory_bytes"] > H200_SHARED_MEMORY_BYTES:
                    failures.append(f"{name}: {rep['shared_memory_bytes']} B of shared memory")
        cases[name] = rec
        print(f"{name:48s} {'ok' if rec['lowered'] else 'LOWERING FAILED'}", end="")
        for kern in rec.get("kernels", []):
            c = kern.get("compile")
            if c and c["ok"]:
                print(f"  smem {c['shared_memory_bytes']:>6} B  regs {c['registers']:>3}  "
                      f"spill {c['spill_store_bytes']}/{c['spill_load_bytes']} B", end="")
            elif c:
                print("  COMPILE FAILED", end="")
        print()

    results = {**run_metadata("check_gpu_lowering"), "target": {"device_kind": gpu_aot.H200,
               "capability": H200_CAPABILITY, "shared_memory_limit_bytes": H200_SHARED_MEMORY_BYTES},
               "compiled": bool(triton_python), "cases": cases, "failures": failures}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{len(cases)} cases, {len(failures)} failures; wrote {out / 'results.json'}")
    if not triton_python:
        print("compile step skipped: no interpreter with `triton` (pass --triton-python)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
