"""The Pallas kernels lower for an H200 through the Triton backend, on this CPU-only machine.

Interpret mode (test_kernels.py) accepts blocks and ops the GPU lowering rejects; this runs the real
lowering (`attention.gpu_aot`) on every kernel at GLM-5.3's, the tiny preset's and the kernel tests'
shapes, and checks the matmul operand types the numerics rely on. The cubin compile (registers, spills,
shared memory) needs the 1 GB `triton` package and is experiments/check_gpu_lowering.py's job."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from attention import common, formats, gpu_aot, hisparse, indexer, sparse_mla
from experiments import check_gpu_lowering


@pytest.fixture(scope="module")
def lowered():
    # conftest sets float32 matmuls to "highest" for every test; a user's program need not, and the
    # kernels must not depend on it, so they are lowered here under JAX's default precision.
    with jax.default_matmul_precision("default"):
        return check_gpu_lowering.lower_all(check_gpu_lowering.kernel_cases())


def test_a_plain_float32_dot_lowers_to_tf32():
    """The trap the kernels' explicit precision avoids (and proof that the fixture's context takes)."""
    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (0,)), ((), ())))

    def fn(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                              interpret=common.pallas_interpret())(a, b)

    sds = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    with jax.default_matmul_precision("default"):
        [kern] = gpu_aot.lower_triton(fn, sds, sds)
    assert kern.dots() == ["f32 x f32 -> f32 tf32"]


def test_every_kernel_lowers_to_one_triton_kernel(lowered):
    assert len(lowered) == 10 * len(check_gpu_lowering.DIMS)  # (5 sparse + 4 index + 1 resolver) x dims
    warps = {"sparse_mqa": sparse_mla.BlockSizes().num_warps, "index_scores": indexer.BlockSizes().num_warps,
             "hisparse_resolve": hisparse.BlockSizes().num_warps}
    for name, entry in lowered.items():
        assert entry["ok"], f"{name}: {entry.get('error')}"
        [kern] = entry["kernels"]
        assert "tt.func" in kern.ttir and kern.name == name.split("/")[0], name
        assert kern.num_warps == warps[kern.name], (name, kern.num_warps)
    # a GLM-5.3 decode batch of 4 (16 programs unsplit) is split into one well-filled wave of programs
    for fmt in ("fp8_ds_mla", "bfloat16", "float16", "float32"):
        x, y, z = lowered[f"sparse_mqa/glm-5.3/{fmt}/decode"]["kernels"][0].grid
        assert (x, y) == (4, 4) and z > 1 and common.H200_SMS / 2 < x * y * z <= common.H200_SMS, (fmt, z)
    assert lowered["sparse_mqa/glm-5.3/fp8_ds_mla/prefill"]["kernels"][0].grid[2] == 1  # 64 queries: no split


def test_every_tile_candidate_lowers_and_compiles_with_its_own_sizes():
    """Each kernel's tunables are one frozen BlockSizes beside it, with at most 6 candidates (the default
    first) that experiments.bench_gpu times on an H200: every candidate lowers at GLM-5.3's decode shape
    and the lowered kernel carries that candidate's warps and grid (a candidate that changed nothing
    would waste device time)."""
    for mod in (sparse_mla, indexer, hisparse):
        cands = mod.CANDIDATES
        assert 2 <= len(cands) <= 6 and cands[0] == mod.BlockSizes() and len(set(cands)) == len(cands), mod
    lowered = check_gpu_lowering.lower_all(check_gpu_lowering.candidate_cases())
    assert len(lowered) == sum(len(m.CANDIDATES) for m in (sparse_mla, indexer, hisparse))
    seen = {}
    for name, entry in lowered.items():
        assert entry["ok"], f"{name}: {entry.get('error')}"
        [kern] = entry["kernels"]
        mod = {"sparse_mqa": sparse_mla, "index_scores": indexer, "hisparse_resolve": hisparse}[kern.name]
        cand = mod.CANDIDATES[int(name.rsplit("candidate", 1)[1])]
        assert kern.num_warps == cand.num_warps, name
        seen.setdefault(kern.name, set()).add((kern.grid, kern.num_warps, kern.ttir))
    # distinct candidates lower to distinct programs
    assert all(len(v) == len(mod.CANDIDATES) for v, mod in zip(
        (seen["sparse_mqa"], seen["index_scores"], seen["hisparse_resolve"]), (sparse_mla, indexer, hisparse)))
    # head blocks of 16, 32, 64: a batch-64 decode at 64 heads runs 64 x 4 and 64 x 2 programs (a wave or
    # more: no split), or 64 x 1, which default_splits doubles to fill the 132 SMs
    grids = {c.head_block: k.grid for (k,), c in zip(
        (lowered[f"sparse_mqa/glm-5.3/fp8_ds_mla/decode64/candidate{i}"]["kernels"] for i in range(3)),
        sparse_mla.CANDIDATES[:3])}
    assert grids == {16: (64, 4, 1), 32: (64, 2, 1), 64: (64, 1, 2)}


def test_matmul_operands_follow_the_cache_format(lowered):
    """float32 caches: IEEE float32 products (the reference's numerics; Pallas' Triton default would
    be TF32). bf16 and fp8 caches: bf16 tensor-core operands, except contractions shorter than
    MIN_DOT_K, which are IEEE float32 (next test). The resolver has no matmul."""
    for name, entry in lowered.items():
        kern = entry["kernels"][0]
        if name.startswith("hisparse_resolve"):
            assert kern.dots() == [], name
            continue
        want = "f32" if "/float32/" in name else "f16" if "/float16/" in name else "bf16"
        for m, k, n, dtype in kern.dot_shapes():
            assert dtype == (want if k >= common.MIN_DOT_K else "f32"), (name, m, k, n, dtype)
        assert set(kern.dots()) <= {f"{want} x {want} -> f32" if want != "f32" else "f32 x f32 -> f32 ieee",
                                    "f32 x f32 -> f32 ieee"}, name


def test_tensor_core_dots_contract_at_least_16(lowered):
    """The H200 run of 2026-12-04 found every fp8 kernel case of the tests wrong with bf16 operands
    (index scores exactly 2x): their byte planes are 8 words wide, and a 16-bit tl.dot over 8 values
    counts every product twice. Every 16-bit dot of every kernel, at every preset's and the tests'
    shapes, now contracts >= 16 values; the edge and tiny shapes have 8-wide planes, so this is checked
    where it used to fail."""
    short = []
    for name, entry in lowered.items():
        kern = entry["kernels"][0]
        assert len(kern.dot_shapes()) == len(kern.dots()), name  # the two parsers see the same dots
        for (m, k, n, dtype), desc in zip(kern.dot_shapes(), kern.dots()):
            assert m >= 16, (name, m)  # heads are padded to 16
            if k < common.MIN_DOT_K and desc != "f32 x f32 -> f32 ieee":
                short.append((name, k, desc))
    assert short == []
    assert any(k < common.MIN_DOT_K for e in lowered.values() for _, k, _, _ in e["kernels"][0].dot_shapes())


def test_compute_dtype_float32_on_a_bf16_cache_is_ieee():
    fmt = formats.MLARowFormat("bfloat16", 128, 16)
    sds = jax.ShapeDtypeStruct

    def fn(q_lat, q_pe, table, slots):
        return sparse_mla.sparse_mqa_pallas(q_lat, q_pe, sparse_mla.SlotRows(table, slots, fmt), 1.0,
                                            compute_dtype=jnp.float32)

    with jax.default_matmul_precision("default"):
        [kern] = gpu_aot.lower_triton(fn, sds((1, 1, 16, 128), jnp.float32), sds((1, 1, 16, 16), jnp.float32),
                                      sds((64, 144), jnp.bfloat16), sds((1, 1, 32), jnp.int32))
    assert set(kern.dots()) == {"f32 x f32 -> f32 ieee"}


def test_gpu_lowering_turns_interpret_mode_off_and_restores_it():
    before = common.pallas_interpret()  # True on CPU, False on a GPU
    with pytest.raises(RuntimeError, match="inside"):
        with gpu_aot.gpu_lowering():
            assert not common.pallas_interpret()
            raise RuntimeError("inside")
    assert common.pallas_interpret() == before


def test_tiny_model_decode_step_with_the_kernels_lowers(tiny_model):
    """The whole jitted decode step of the tiny model on an fp8 paged cache with impl="pallas": one
    sparse-MLA kernel per layer and one index-score kernel per full indexer layer, in layer order."""
    from glm53.api import _shuffled_paged_cache, compiled

    c = compiled(tiny_model)
    cache = _shuffled_paged_cache(tiny_model.cfg, [40, 20], 16, 0, kv_cache_dtype="fp8_ds_mla")
    tok, pos = jnp.zeros((2, 1), jnp.int32), jnp.asarray([[39], [19]], jnp.int32)

    def step(state, tok, pos, cache):
        return c.forward(state, tok, pos, cache, window=64, impl="pallas")

    kernels = gpu_aot.lower_triton(step, c.state, tok, pos, cache)
    want = [name for kind in tiny_model.cfg.indexer_types
            for name in (["index_scores"] if kind == "full" else []) + ["sparse_mqa"]]
    assert [k.name for k in kernels] == want
