"""The Pallas kernels (interpret mode on CPU) against the references, on edge shapes: ragged lengths,
-1 padding, top-k larger than the context, block boundaries, fp8 and plain caches.

Tolerances (relative to the largest reference value): every kernel with float32 matmul operands
(compute_dtype=float32, the default for float32 caches) within 1e-4 of the reference, measured ~1e-6;
this checks the kernel's logic exactly for every format. With their default 16-bit operands
(`attention.common.kernel_compute_dtype`: bfloat16 for bf16 and fp8 caches, float16 for float16 ones)
within BF16_RTOL: the query, the (scaled) rows and the softmax weights are rounded to 16 bits.
Measured: sparse MLA 3.4e-3 (bf16 rows), 9.4e-3 (fp8_ds_mla rows), 4.2e-4 (float16 rows); index
scores 2.1e-3 (bf16 and fp8 keys), 1.7e-4 (float16 keys)."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention import formats, indexer, sparse_mla

RTOL = 1e-4
BF16_RTOL = 2e-2


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    fin = np.isfinite(b)
    np.testing.assert_array_equal(np.isfinite(a), fin)  # same -inf pattern (empty rows, masked positions)
    np.testing.assert_array_equal(a[~fin], b[~fin])
    return float(np.abs(a[fin] - b[fin]).max() / max(np.abs(b[fin]).max(), 1e-30)) if fin.any() else 0.0


def _rows(fmt, n, seed):
    rng = np.random.default_rng(seed)
    lat = jnp.asarray(rng.normal(size=(n, fmt.kv_lora_rank)) * 2, jnp.float32)
    pe = jnp.asarray(rng.normal(size=(n, fmt.rope_dim)), jnp.float32)
    return lat, pe, fmt.pack(lat, pe)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "fp8_ds_mla"])
@pytest.mark.parametrize("k,h,r,p", [(1, 4, 128, 16), (37, 4, 128, 16), (64, 16, 128, 16), (65, 20, 512, 64)])
def test_sparse_mqa_kernel_matches_reference(name, k, h, r, p):
    """k=37, 65: slots not a multiple of the row block; h=20: heads padded to a multiple of 16; k=64:
    exactly one block; slot rows include -1 padding, a query with no row at all and the last table row."""
    fmt = formats.MLARowFormat(name, r, p)
    n = 90
    _, _, table = _rows(fmt, n, k)
    rng = np.random.default_rng(k + h)
    b, t = 2, 3
    slots = rng.integers(-1, n, size=(b, t, k)).astype(np.int32)
    slots[0, 0] = -1
    slots[1, 2, 0] = n - 1
    q_lat = jnp.asarray(rng.normal(size=(b, t, h, r)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(b, t, h, p)), jnp.float32)
    rows = sparse_mla.SlotRows(table, jnp.asarray(slots), fmt)
    ref_out, ref_lse = sparse_mla.sparse_mqa(q_lat, q_pe, rows, r ** -0.5, impl="reference")
    out, lse = sparse_mla.sparse_mqa_pallas(q_lat, q_pe, rows, r ** -0.5, compute_dtype=jnp.float32)
    assert _rel(out, ref_out) <= RTOL and _rel(lse, ref_lse) <= RTOL
    out, lse = sparse_mla.sparse_mqa(q_lat, q_pe, rows, r ** -0.5, impl="pallas")  # the format's default operands
    tol = RTOL if name == "float32" else BF16_RTOL
    assert _rel(out, ref_out) <= tol and _rel(lse, ref_lse) <= tol
    assert np.all(np.asarray(out)[0, 0] == 0) and np.all(np.asarray(lse)[0, 0] == -np.inf)


def test_default_splits():
    """Split a decode grid into one well-filled wave; never split a grid that fills a wave; no empty split."""
    assert sparse_mla.default_splits(16, 32) == 8  # GLM-5.3, 4 requests x 4 head blocks, 2048 slots / 64
    assert sparse_mla.default_splits(256, 32) == 1  # a 64-query prefill chunk
    assert sparse_mla.default_splits(6, 1) == 1
    for programs in (1, 3, 16, 40, 131):
        for blocks in (1, 2, 7, 32, 100):
            s = sparse_mla.default_splits(programs, blocks)
            per = -(-blocks // s)
            assert 1 <= s <= blocks and -(-blocks // per) == s  # every split holds rows
    with pytest.raises(ValueError, match="splits"):
        sparse_mla.sparse_mqa_pallas(jnp.zeros((1, 1, 4, 128)), jnp.zeros((1, 1, 4, 16)),
                                     sparse_mla.SlotRows(jnp.zeros((4, 144)), jnp.zeros((1, 1, 2), jnp.int32),
                                                         formats.MLARowFormat("float32", 128, 16)), 1.0,
                                     block_sizes=sparse_mla.BlockSizes(splits=0))


@pytest.mark.parametrize("splits", [1, 3, 4, 50])
def test_sparse_mqa_kernel_split_slots_merge_exactly(splits):
    """The slots split across programs (flash-decoding) and merged by LSE: equal to the reference for any
    split count, including a split whose slots are all -1 (weight 0) and a query with no slot at all.
    200 slots in 16-row blocks: 13 blocks; splits=3 -> 3 splits of 5, 5 and 3 blocks; 4 -> 4 of 4, 4, 4
    and 1 (partly full); 50 -> 13 splits of one block."""
    fmt = formats.MLARowFormat("fp8_ds_mla", 128, 16)
    _, _, table = _rows(fmt, 300, 3)
    rng = np.random.default_rng(splits)
    slots = rng.integers(0, 300, size=(2, 2, 200)).astype(np.int32)
    slots[0, 1, 64:128] = -1  # split 2 of 4 (rows 64-127) empty for this query
    slots[1, 0] = -1  # no row at all
    q_lat = jnp.asarray(rng.normal(size=(2, 2, 16, 128)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(2, 2, 16, 16)), jnp.float32)
    rows = sparse_mla.SlotRows(table, jnp.asarray(slots), fmt)
    ref_out, ref_lse = sparse_mla.sparse_mqa(q_lat, q_pe, rows, 128 ** -0.5, impl="reference")
    out, lse = sparse_mla.sparse_mqa_pallas(q_lat, q_pe, rows, 128 ** -0.5, compute_dtype=jnp.float32,
                                            block_sizes=sparse_mla.BlockSizes(row_block_f32=16, splits=splits))
    assert _rel(out, ref_out) <= RTOL and _rel(lse, ref_lse) <= RTOL
    assert np.all(np.asarray(out)[1, 0] == 0) and np.all(np.asarray(lse)[1, 0] == -np.inf)


def test_fp8_sparse_mla_output_within_5_percent_of_fp32_cache():
    """The same selected rows from an fp8_ds_mla cache and from a float32 cache (GLM-5.3 widths)."""
    r, p, h, k = 512, 64, 16, 128
    lat, pe, table8 = _rows(formats.MLARowFormat("fp8_ds_mla", r, p), 300, 0)
    table32 = formats.MLARowFormat("float32", r, p).pack(lat, pe)
    rng = np.random.default_rng(1)
    slots = jnp.asarray(rng.integers(0, 300, size=(1, 4, k)), jnp.int32)
    # Queries along the rows' directions, so the softmax is peaked and fp8 score errors matter.
    q_lat = jnp.asarray(np.asarray(lat)[rng.integers(0, 300, size=(1, 4, h))] * 0.3, jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(1, 4, h, p)), jnp.float32)
    for impl in ("reference", "pallas"):
        o8, _ = sparse_mla.sparse_mqa(q_lat, q_pe, sparse_mla.SlotRows(table8, slots, formats.MLARowFormat("fp8_ds_mla", r, p)),
                                      r ** -0.5, impl=impl)
        o32, _ = sparse_mla.sparse_mqa(q_lat, q_pe, sparse_mla.SlotRows(table32, slots, formats.MLARowFormat("float32", r, p)),
                                       r ** -0.5, impl="reference")
        rel = np.linalg.norm(np.asarray(o8 - o32)) / np.linalg.norm(np.asarray(o32))
        assert rel <= 0.05, rel


def _paged_keys(fmt, lens, block_size, seed):
    """Keys of requests with `lens` positions on shuffled pages (one spare page), plus the dense keys."""
    rng = np.random.default_rng(seed)
    need = [-(-n // block_size) for n in lens]
    perm = rng.permutation(sum(need) + 1)
    bt = np.full((len(lens), max(need) + 1), -1, np.int32)  # one extra unallocated column per request
    dense = rng.normal(size=(len(lens), bt.shape[1] * block_size, fmt.dim)).astype(np.float32)
    table = np.zeros(((sum(need) + 1) * block_size, fmt.dim), np.float32)
    start = 0
    for b, k in enumerate(need):
        bt[b, :k] = perm[start : start + k]
        start += k
        for j in range(k):
            table[bt[b, j] * block_size : (bt[b, j] + 1) * block_size] = dense[b, j * block_size : (j + 1) * block_size]
    keys = indexer.PagedKeys(fmt.pack(jnp.asarray(table)), jnp.asarray(bt), block_size, fmt)
    return keys, dense, bt


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "fp8"])
@pytest.mark.parametrize("block_size,window", [(16, 64), (8, 40), (64, 128)])
def test_index_score_kernel_matches_reference(name, block_size, window):
    """Ragged requests, queries at page boundaries, padding queries (-1), positions on unallocated pages."""
    fmt = formats.IndexKeyFormat(name, 32)
    lens = [window - 3, 5, block_size + 1]
    keys, _, _ = _paged_keys(fmt, lens, block_size, block_size)
    rng = np.random.default_rng(window)
    t = 4
    q_pos = np.array([[0, block_size - 1, block_size, lens[0] - 1], [4, -1, 2, 3], [block_size, 0, -1, 1]], np.int32)
    q = jnp.asarray(rng.normal(size=(3, t, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, t, 8)), jnp.float32)
    want = indexer.index_scores(q, w, keys, jnp.asarray(q_pos), window=window, impl="reference")
    exact = indexer.index_scores_pallas(q, w, keys, jnp.asarray(q_pos), window=window, compute_dtype=jnp.float32)
    assert exact.shape == (3, t, window)
    assert _rel(exact, want) <= RTOL
    got = indexer.index_scores(q, w, keys, jnp.asarray(q_pos), window=window, impl="pallas")  # default operands
    assert _rel(got, want) <= (RTOL if name == "float32" else BF16_RTOL)
    # top-k larger than the visible context: -1 padding beyond each query's position + 1 candidates
    np.testing.assert_array_equal(np.asarray(indexer.select_topk(exact, window)),
                                  np.asarray(indexer.topk(q, w, keys, jnp.asarray(q_pos), window, window=window,
                                                          impl="reference")))
    sel = np.asarray(indexer.topk(q, w, keys, jnp.asarray(q_pos), window, window=window, impl="pallas"))
    if name == "float32":  # float32 operands by default: the selection itself is the reference's
        np.testing.assert_array_equal(sel, np.asarray(indexer.select_topk(exact, window)))
    for b in range(3):
        for i in range(t):
            assert np.sum(sel[b, i] >= 0) == q_pos[b, i] + 1


@pytest.mark.parametrize("name", ["bfloat16", "fp8"])
def test_index_score_kernel_at_glm53_key_width(name):
    """GLM-5.3's 128-dim keys: 32-word fp8 planes, so every dot runs on 16-bit tensor-core operands (the
    tests above, at 32 dims, take the float32 fallback for fp8: attention.common.MIN_DOT_K). The case the
    H200 run of 2026-12-04 did not cover."""
    fmt = formats.IndexKeyFormat(name, 128)
    keys, _, _ = _paged_keys(fmt, [61, 17], 16, 5)
    rng = np.random.default_rng(5)
    q_pos = np.array([[0, 15, 16, 60], [3, 16, -1, 16]], np.int32)
    q = jnp.asarray(rng.normal(size=(2, 4, 4, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 4, 4)), jnp.float32)
    want = indexer.index_scores(q, w, keys, jnp.asarray(q_pos), window=64, impl="reference")
    got = indexer.index_scores(q, w, keys, jnp.asarray(q_pos), window=64, impl="pallas")
    assert _rel(got, want) <= BF16_RTOL


def test_paged_keys_gather_follows_the_block_table():
    fmt = formats.IndexKeyFormat("float32", 8)
    keys, dense, bt = _paged_keys(fmt, [20, 3], 4, 0)
    got = np.asarray(keys.gather(24))
    for b, n in enumerate([20, 3]):
        np.testing.assert_array_equal(got[b, :n], dense[b, :n])
    slots = np.asarray(keys.slots(jnp.asarray([[0, 5, 23, -1], [2, 3, 4, 100]])))
    assert slots[0, 0] == bt[0, 0] * 4 and slots[0, 1] == bt[0, 1] * 4 + 1
    assert slots[0, 2] == -1 and slots[0, 3] == -1  # unallocated page; padding position
    assert slots[1, 2] == -1 and slots[1, 3] == -1  # past the request's pages; past the table


def test_kernel_rejects_bad_blocks():
    fmt = formats.IndexKeyFormat("float32", 32)
    keys, _, _ = _paged_keys(fmt, [10], 8, 0)
    with pytest.raises(ValueError, match="key_block"):
        indexer.index_scores_pallas(jnp.zeros((1, 1, 8, 32)), jnp.zeros((1, 1, 8)), keys, jnp.zeros((1, 1), jnp.int32),
                                    window=16, block_sizes=indexer.BlockSizes(key_block=16))
    with pytest.raises(ValueError, match="query widths"):
        sparse_mla.sparse_mqa_pallas(jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 1, 4, 16)),
                                     sparse_mla.SlotRows(jnp.zeros((4, 144)), jnp.zeros((1, 1, 2), jnp.int32),
                                                         formats.MLARowFormat("float32", 128, 16)), 1.0)
