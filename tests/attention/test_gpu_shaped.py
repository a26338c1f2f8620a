"""The GPU-shaped path (`attention.common.gpu_shaped`): where code is shaped for a GPU the references
run batched gathers and vectorised tiles instead of XLA:CPU's sequential loops, and must compute the
same values; "auto" routes to the Pallas kernels there only once they are verified; the engine's
HiSparse decode reaches the Pallas resolver under the same decision.

Every comparison calls the ops eagerly or through a fresh jit: the shape is decided at trace time, and a
cached program keeps the shape it was traced with."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention.common as common
from attention import dense_mla, formats, gpu_aot, hisparse, indexer, sparse_mla
from attention.common import gpu_shaped, resolve_impl, shaped_for


def both(fn):
    """fn() traced shaped for the CPU and for a GPU -> (cpu result, gpu result) as numpy trees."""
    out = []
    for backend in ("cpu", "gpu"):
        with shaped_for(backend):
            out.append(jax.tree.map(np.asarray, fn()))
    return out


# ------------------------------------------------------------------------------------ the decision
def test_decision_follows_backend_lowering_and_override(monkeypatch):
    assert gpu_shaped() == (jax.default_backend() == "gpu")
    with gpu_aot.gpu_lowering():
        assert gpu_shaped()
    with shaped_for("gpu"):
        assert gpu_shaped()
        with shaped_for("cpu"):
            assert not gpu_shaped()
    monkeypatch.setattr(common, "on_gpu", lambda: True)  # what a GPU backend reports
    assert gpu_shaped()
    with pytest.raises(ValueError, match="backend must be"):
        with shaped_for("tpu"):
            pass


def test_auto_picks_pallas_only_where_gpu_shaped_and_verified(monkeypatch):
    # set after the H200 run of 2026-12-04 passed the kernel tests (results/device_check_2026-12-04b)
    assert common.PALLAS_VERIFIED_ON_GPU
    monkeypatch.setattr(common, "PALLAS_VERIFIED_ON_GPU", False)  # unverified kernels: the references
    with shaped_for("gpu"):
        assert resolve_impl("auto") == "reference"
    monkeypatch.setattr(common, "PALLAS_VERIFIED_ON_GPU", True)
    with shaped_for("cpu"):
        assert resolve_impl("auto") == "reference"  # CPU: the references, verified or not
    with shaped_for("gpu"):
        assert resolve_impl("auto") == "pallas" and resolve_impl("auto", "sparse_mqa") == "pallas"
        # a verified kernel measured slower than its reference: "auto" keeps the reference
        assert resolve_impl("auto", "hisparse_resolve") == "reference"
        assert resolve_impl("pallas", "hisparse_resolve") == "pallas"
        monkeypatch.setattr(common, "SLOWER_THAN_REFERENCE_ON_GPU", frozenset())
        assert resolve_impl("auto", "hisparse_resolve") == "pallas"
    with gpu_aot.gpu_lowering():
        assert resolve_impl("auto") == "pallas"
    assert resolve_impl("reference") == "reference" and resolve_impl("pallas") == "pallas"


@pytest.mark.parametrize("machine", ["this", "gpu"])
def test_model_form_follows_the_decision(machine, monkeypatch):
    """The code shape decides, not the machine: on a GPU (faked here by its backend name, as on the
    H200 run of 2026-12-04 where this failed) shaped_for("cpu") still picks XLA:CPU's form."""
    from glm53.model import attention_form

    if machine == "gpu":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    # a 1024-token prefill chunk over a window of 4 x top-k: dense on XLA:CPU, sparse on a GPU (vLLM's rule)
    with shaped_for("cpu"):
        assert attention_form("auto", 1024, 256, 1024) == "mha"
    with shaped_for("gpu"):
        assert attention_form("auto", 1024, 256, 1024) == "mqa"
        assert attention_form("auto", 256, 256, 1024) == "mha"  # window <= top-k: dense everywhere


# --------------------------------------------------------------------------- same values, both shapes
@pytest.mark.parametrize("name", ["float32", "fp8_ds_mla"])
@pytest.mark.parametrize("b,t,k", [(1, 1, 5), (3, 1, 16), (2, 7, 9), (2, 5, 33)])
def test_sparse_mqa_batched_equals_query_blocks(name, b, t, k):
    """One gather over every query (GPU) vs lax.map over blocks of 4 (CPU): the same values, with -1
    padding, a query without any row, and B*T not a multiple of the block."""
    r, p, h, n = 128, 16, 4, 70
    fmt = formats.MLARowFormat(name, r, p)
    rng = np.random.default_rng(b * 100 + t * 10 + k)
    table = fmt.pack(jnp.asarray(rng.normal(size=(n, r)), jnp.float32), jnp.asarray(rng.normal(size=(n, p)), jnp.float32))
    slots = rng.integers(-1, n, size=(b, t, k)).astype(np.int32)
    slots[0, 0] = -1
    q_lat = jnp.asarray(rng.normal(size=(b, t, h, r)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(b, t, h, p)), jnp.float32)
    rows = sparse_mla.SlotRows(table, jnp.asarray(slots), fmt)
    (o_c, l_c), (o_g, l_g) = both(lambda: sparse_mla.sparse_mqa(q_lat, q_pe, rows, r ** -0.5, impl="reference"))
    np.testing.assert_allclose(o_g, o_c, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l_g, l_c, rtol=1e-6, atol=1e-6)
    assert np.all(l_g[0, 0] == -np.inf) and np.all(o_g[0, 0] == 0)


def _keys(rng, b, window, bs, di, fmt_name="float32"):
    fmt = formats.IndexKeyFormat(fmt_name, di)
    pages = window // bs
    n_blocks = b * pages + 3
    table = fmt.pack(jnp.asarray(rng.normal(size=(n_blocks * bs, di)), jnp.float32))
    bt = rng.permutation(n_blocks)[: b * pages].reshape(b, pages).astype(np.int32)
    bt[-1, -1] = -1  # an unallocated page
    return indexer.PagedKeys(table, jnp.asarray(bt), bs, fmt)


@pytest.mark.parametrize("b,t,window,topk", [(3, 6, 32, 8), (2, 17, 48, 64), (4, 1, 32, 5)])
def test_indexer_topk_batched_equals_row_loop(b, t, window, topk):
    """One batched score + top-k (GPU) vs one request row at a time (CPU): identical selections, with
    padding queries (-1), a top-k larger than the window and rows of different lengths."""
    rng = np.random.default_rng(t + window)
    hi, di, bs = 4, 16, 8
    keys = _keys(rng, b, window, bs, di)
    q = jnp.asarray(rng.normal(size=(b, t, hi, di)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, hi)), jnp.float32)
    pos = np.stack([np.arange(window - t - 3 * i, window - 3 * i) for i in range(b)]).astype(np.int32)
    pos[0, -1] = -1
    sel_c, sel_g = both(lambda: indexer.topk(q, w, keys, jnp.asarray(pos), topk, window=window, impl="reference"))
    np.testing.assert_array_equal(sel_g, sel_c)


@pytest.mark.parametrize("impl,shape", [("reference", "cpu"), ("reference", "gpu"), ("pallas", "gpu")])
def test_indexer_topk_in_query_tiles_equals_whole_chunk(monkeypatch, impl, shape):
    """A chunk whose scores exceed MAX_SCORE_BYTES is scored and selected in query tiles (17 queries in
    tiles of 4, the last one padded): the same selection as the whole chunk at once."""
    rng = np.random.default_rng(7)
    b, t, window, topk, hi, di, bs = 2, 17, 48, 8, 4, 16, 8
    keys = _keys(rng, b, window, bs, di)
    q = jnp.asarray(rng.normal(size=(b, t, hi, di)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, hi)), jnp.float32)
    pos = np.stack([np.arange(window - t - 5 * i, window - 5 * i) for i in range(b)]).astype(np.int32)
    pos[1, 3] = -1
    untiled, widths = indexer._topk_untiled, []

    def spy(q_, *a, **k):  # the query width each untiled call scores
        widths.append(q_.shape[1])
        return untiled(q_, *a, **k)

    monkeypatch.setattr(indexer, "_topk_untiled", spy)
    with shaped_for(shape):
        whole = np.asarray(indexer.topk(q, w, keys, jnp.asarray(pos), topk, window=window, impl=impl))
        monkeypatch.setattr(indexer, "MAX_SCORE_BYTES", b * 5 * window * 4)  # room for 5 queries: tiles of 4
        assert indexer.query_tile(b, t, window) == 4 and indexer.query_tile(b, 5, window) == 5
        tiled = np.asarray(indexer.topk(q, w, keys, jnp.asarray(pos), topk, window=window, impl=impl))
    assert widths == [t, 4]  # the whole chunk, then one tile traced inside lax.map
    np.testing.assert_array_equal(tiled, whole)
    assert np.all(tiled[1, 3] == -1) and tiled.shape == (b, t, topk)


@pytest.mark.parametrize("t,block", [(13, 4), (32, 8), (5, 8)])
def test_causal_blocked_topk_vmapped_tiles_equal_loop(t, block):
    """The PCP indexer's causal tiles vectorised (GPU) vs one after the other (CPU): the same selection
    and the same work counters (a finished tile keeps its carry in the batched while loop)."""
    rng = np.random.default_rng(t)
    b, hi, di, bs, window, topk = 2, 4, 16, 8, 40, 6
    keys = _keys(rng, b, window, bs, di)
    q = jnp.asarray(rng.normal(size=(b, t, hi, di)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, hi)), jnp.float32)
    pos = np.stack([np.arange(window - t, window), np.arange(t) * 2 % window]).astype(np.int32)
    pos[1, : t // 2] = -1  # a row with padding queries: some tiles visit nothing
    (sel_c, work_c), (sel_g, work_g) = both(lambda: indexer.topk_causal_blocked(
        q, w, keys, jnp.asarray(pos), topk, window=window, block=block))
    np.testing.assert_array_equal(sel_g, sel_c)
    for name in indexer.COUNTERS:
        np.testing.assert_array_equal(work_g[name], work_c[name])


@pytest.mark.parametrize("t,s,block", [(37, 45, 16), (5, 70, 32), (64, 64, 16)])
def test_tiled_mha_vmapped_items_equal_loop(t, s, block):
    """dense MHA's (row, query tile) items vectorised (GPU) vs lax.map (CPU), with padding queries and
    rows whose items visit different numbers of key tiles."""
    rng = np.random.default_rng(t + s)
    b, h = 2, 3
    f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
    q_nope, q_pe, k_nope, pe, vv = f(b, t, h, 8), f(b, t, h, 4), f(b, s, h, 8), f(b, s, 4), f(b, s, h, 6)
    pos = np.broadcast_to(np.arange(s - t, s), (b, t)).copy()
    pos[1, -max(3, t // 3):] = -1
    scores = np.where(np.arange(s)[None, None] <= pos[:, :, None], rng.normal(size=(b, t, s)), -np.inf)
    mask = dense_mla.topk_mask(indexer.select_topk(jnp.asarray(scores, jnp.float32), 9), s)
    (o_c, l_c), (o_g, l_g) = both(lambda: dense_mla.mha(q_nope, q_pe, k_nope, pe, vv, mask, 0.3, block=block))
    np.testing.assert_allclose(o_g, o_c, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l_g, l_c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,e,k", [(1, 8, 2), (6, 8, 3), (37, 16, 4)])
def test_moe_grouped_gemm_equals_expert_loop(n, e, k):
    """The MoE's GPU form (one `ragged_dot` per projection over expert-sorted assignments) vs the expert
    loop, with an expert used twice by one token at weight 0 (what EP's routing to other ranks makes)."""
    from glm53.layers import grouped_experts

    rng = np.random.default_rng(n + e)
    x = jnp.asarray(rng.normal(size=(n, 24)), jnp.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    w = rng.random((n, k)).astype(np.float32)
    idx[0, -1], w[0, -1] = idx[0, 0], 0.0
    gu = jnp.asarray(rng.normal(size=(e, 24, 24)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(e, 12, 24)), jnp.float32)
    y_c, y_g = both(lambda: grouped_experts(x, jnp.asarray(idx), jnp.asarray(w), gu, down))
    np.testing.assert_allclose(y_g, y_c, rtol=1e-5, atol=1e-5 * np.abs(y_c).max())
    with shaped_for("gpu"):
        assert "ragged_dot" in str(jax.make_jaxpr(lambda a: grouped_experts(a, jnp.asarray(idx), jnp.asarray(w), gu,
                                                                             down))(x))


def test_gpu_shaped_reference_has_no_query_block_loop():
    """The GPU shape really is loop-free: the sparse reference's jaxpr holds no scan (lax.map) there."""
    b, t, h, r, p, k = 2, 9, 4, 128, 16, 8
    fmt = formats.MLARowFormat("float32", r, p)
    args = (jnp.zeros((b, t, h, r)), jnp.zeros((b, t, h, p)),
            sparse_mla.SlotRows(jnp.zeros((32, r + p)), jnp.zeros((b, t, k), jnp.int32), fmt))

    def jaxpr():  # a fresh function each time: make_jaxpr caches traces by function (module docstring)
        return str(jax.make_jaxpr(lambda q, pe, rows: sparse_mla.sparse_mqa(q, pe, rows, 0.1, impl="reference"))(*args))

    with shaped_for("cpu"):
        assert "scan" in jaxpr()
    with shaped_for("gpu"):
        assert "scan" not in jaxpr()


# ----------------------------------------------------------------------------------- the engine
class Count:
    """A stand-in for a Pallas op that counts its calls (at trace time) and runs `impl`."""

    def __init__(self, impl):
        self.impl, self.calls = impl, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.impl(*args, **kwargs)


def _sparse_ref(q_lat, q_pe, rows, scale, **_):
    return sparse_mla.sparse_mqa(q_lat, q_pe, rows, scale, impl="reference")


def _scores_ref(q, w, keys, q_pos, *, window, **_):
    return indexer.index_scores_reference(q, w, keys.gather(window), q_pos)


@contextlib.contextmanager
def _counting(monkeypatch, resolver):
    counts = {"sparse_mqa": Count(_sparse_ref), "index_scores": Count(_scores_ref), "resolve": Count(resolver)}
    monkeypatch.setattr(sparse_mla, "sparse_mqa_pallas", counts["sparse_mqa"])
    monkeypatch.setattr(indexer, "index_scores_pallas", counts["index_scores"])
    monkeypatch.setattr(hisparse, "resolve_pallas", counts["resolve"])
    yield counts


def _hisparse_runner(impl: str):
    """A HiSparse engine on a fresh object of the tiny preset's 2-layer cut (fresh jitted programs; a full
    and a shared indexer layer, dense and MoE: tests/models.py) -> its model runner."""
    import glm53
    from glm53 import DeployConfig, Engine
    from tests.models import two_layers

    model = glm53.init(two_layers("tiny"), seed=0, std=0.1)
    deploy = DeployConfig(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2, block_size=8,
                          kv_policy="hisparse", hisparse_host_pool_bytes=1 << 24, cpu_offload_bytes=1 << 22,
                          num_gpu_blocks=24, attention_impl=impl)
    return Engine(model, deploy).runner


@pytest.mark.parametrize("impl,verified,shape,resolver_kernel",
                         [("auto", True, "gpu", False), ("pallas", False, "cpu", True)])
def test_engine_hisparse_decode_reaches_pallas_resolver(monkeypatch, impl, verified, shape, resolver_kernel):
    """The model runner's HiSparse decode program (the one a step with hot buffers runs) calls the sparse
    MLA and indexer kernels with "auto" where code is shaped for a GPU once the kernels are verified, and
    with DeployConfig(attention_impl="pallas") anywhere, where it calls the Pallas resolver too ("auto"
    keeps the resolver's reference: its kernel is slower on the H200). Before, the paged cache called
    the resolver with no impl, so the engine never reached the Pallas resolver. (Counted while the
    programs trace; the sparse MLA and indexer stand-ins run their references, the resolver is the
    real kernel in interpret mode. Its values equal the reference's: tests/attention/test_hisparse.py.)"""
    monkeypatch.setattr(common, "PALLAS_VERIFIED_ON_GPU", verified)
    with _counting(monkeypatch, hisparse.resolve_pallas) as counts, shaped_for(shape):
        runner = _hisparse_runner(impl)
        runner.warmup([(2, 1, 32)])  # one decode shape: with and without a hot-buffer view
    cfg = runner.model.cfg
    full = [i for i in cfg.full_indexer_layers if i < cfg.num_hidden_layers]
    # once per IndexShare group (its full layer resolves), or never
    assert counts["resolve"].calls == (len(full) if resolver_kernel else 0)
    assert counts["sparse_mqa"].calls > 0 and counts["index_scores"].calls > 0


def test_engine_auto_on_cpu_runs_the_references(monkeypatch):
    with _counting(monkeypatch, hisparse.resolve_pallas) as counts, shaped_for("cpu"):
        _hisparse_runner("auto").warmup([(2, 1, 32)])
    assert all(c.calls == 0 for c in counts.values())


def test_model_logits_equal_in_both_shapes():
    """The tiny preset's 2-layer cut (a full and a shared indexer layer, dense and MoE) over a paged cache
    (ragged chunked prefill and batched decode), traced shaped for the CPU and for a GPU on fresh model
    objects (sparse MLA's query blocks, the indexer's row loop, dense MHA's tiles and the MoE's grouped
    GEMMs batched): the logits agree."""
    import glm53
    from tests.models import two_layers

    prompts = [np.random.default_rng(i).integers(0, 512, n).tolist() for i, n in enumerate((70, 23, 45))]
    out = []
    for shape in ("cpu", "gpu"):
        with shaped_for(shape):
            model = glm53.init(two_layers("tiny"), seed=0, std=0.1)
            out.append(glm53.score_batch(model, prompts, kv_cache_dtype="float32", prefill_lens=[40, 23, 20],
                                         prefill_chunk=16))
    for c, g in zip(*out):
        assert np.abs(g - c).max() <= 1e-4 * np.abs(c).max()
