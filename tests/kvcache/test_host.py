"""The host room (kvcache.host): row copies move exactly the planned rows through the one function that
copies them, and `HostMemory` executes transfer operations exactly (values, untouched neighbours,
bytes as kvcache.layout counts them)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm53
from kvcache import host as host_mod
from kvcache.host import HostMemory, copy_host_rows
from kvcache.layout import page_bytes
from kvcache.paged import PagedKVCache
from kvcache.transfer import LoadKV, PageCopy, SaveKV, bytes_moved

DEV = jax.devices()[0]
HOST = jax.sharding.SingleDeviceSharding(DEV, memory_kind="pinned_host")
DEVICE = jax.sharding.SingleDeviceSharding(DEV, memory_kind="device")


def test_copy_moves_only_the_planned_rows_from_pinned_host(monkeypatch):
    crossed = []
    take = host_mod._take_host_rows

    def counting(table, idx):  # the one function that moves rows host -> device
        crossed.append(np.asarray(idx).tolist())
        return take(table, idx)

    monkeypatch.setattr(host_mod, "_take_host_rows", counting)
    host = jax.device_put(jnp.arange(40, dtype=jnp.float32).reshape(20, 2), HOST)
    device = jnp.full((10, 2), -1.0)
    out, n = copy_host_rows(device, host, jnp.asarray([[4, -1, 7]]), jnp.asarray([[1, -1, 8]]))
    assert n == 2 and crossed == [[4, 7]]  # only the two planned rows crossed, nothing for the -1 slot
    want = np.full((10, 2), -1.0)
    want[1], want[8] = [8, 9], [14, 15]
    np.testing.assert_array_equal(np.asarray(out), want)
    assert copy_host_rows(device, host, jnp.asarray([[-1, -1]]), jnp.asarray([[-1, -1]]))[1] == 0
    assert len(crossed) == 1  # a plan without copies moves nothing
    with pytest.raises(IndexError, match="out of range"):
        copy_host_rows(device, host, jnp.asarray([[25]]), jnp.asarray([[0]]))


CFG = glm53.get_preset("tiny")
BS, IBS, NUM_BLOCKS = 4, 8, 12


def _cache(fmt="float32"):
    cache = PagedKVCache.create(CFG, NUM_BLOCKS, BS, np.full((1, 4), -1, np.int32), kv_cache_dtype=fmt,
                                include_mtp=False, index_block_size=IBS, index_block_table=np.full((1, 2), -1, np.int32))
    rng = np.random.default_rng(0)

    def fill(a):  # distinct values everywhere, so a row in the wrong place shows
        if a.dtype == jnp.uint32:
            return jnp.asarray(rng.integers(0, 2**32, a.shape, dtype=np.uint32))
        return jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype))

    return PagedKVCache(tuple(fill(a) for a in cache.mla), tuple(fill(a) for a in cache.index), cache.block_table,
                        cache.index_block_table, cache.mla_layers, cache.index_layers, cache.block_size,
                        cache.mla_format, cache.index_format, index_block_size=cache.index_block_size)


def _memory(cache, max_copy_pages=64, host_blocks=None):
    return HostMemory(cache, page_rows={"mla": BS, "indexer": IBS}, kv_ranks=1, num_blocks=NUM_BLOCKS, host=HOST,
                      device=DEVICE, host_blocks=host_blocks, max_copy_pages=max_copy_pages)


def _pages(arrays, blocks, rows):
    return [np.concatenate([np.asarray(a[b * rows:(b + 1) * rows]) for b in blocks]) for a in arrays]


@pytest.mark.parametrize("fmt", ["float32", "fp8_ds_mla"])
def test_page_bytes_of_the_arrays_equal_the_layout(fmt):
    """What the policies plan with (kvcache.layout) is what the device arrays hold per block, and both are
    BRIEF §2's row sizes (fp8: e4m3 latent + one fp32 scale per 128 values + bf16 rope = 656 B for
    GLM-5.3; keys: e4m3 + one fp32 scale = 132 B)."""
    mem = _memory(_cache(fmt))
    r, p, d = CFG.kv_lora_rank, CFG.qk_rope_head_dim, CFG.index_head_dim
    mla_row, key = ((r + 4 * -(-r // 128) + 2 * p), d + 4) if fmt == "fp8_ds_mla" else ((r + p) * 4, d * 4)
    full = [i for i in CFG.full_indexer_layers if i < CFG.num_hidden_layers]
    want = {"mla": CFG.num_hidden_layers * mla_row * BS, "indexer": len(full) * key * IBS}
    assert mem.page_bytes == page_bytes(CFG, fmt, BS, IBS) == want
    glm = glm53.get_preset("glm-5.3")
    assert page_bytes(glm, "fp8_ds_mla", 1)["mla"] == glm.num_hidden_layers * 656
    assert page_bytes(glm, "fp8_ds_mla", 1)["indexer"] == 21 * 132
    assert page_bytes(glm, "fp8_ds_mla", 64, 256, dcp=8)["indexer"] == 21 * 132 * 256 * 8


def test_page_copies_round_trip_in_chunks_and_touch_nothing_else():
    cache = _cache()
    mem = _memory(cache, max_copy_pages=2, host_blocks={"mla": 6, "indexer": 3})
    src, dst = (7, 2, 9), (5, 0, 3)
    before = _pages(cache.mla, range(NUM_BLOCKS), BS)
    cache, d2h, h2d = mem.apply((PageCopy("mla", "d2h", src, dst),), cache)  # 3 pages in chunks of 2
    assert (d2h, h2d) == (3 * mem.page_bytes["mla"], 0) == bytes_moved(PageCopy("mla", "d2h", src, dst), mem.page_bytes)
    for got, want in zip(_pages(mem.host_tables["mla"], dst, BS), _pages(cache.mla, src, BS)):
        np.testing.assert_array_equal(got, want)
    # back into other device blocks: exactly those pages change
    cache, d2h, h2d = mem.apply((PageCopy("mla", "h2d", (5, 0), (1, 11)),), cache)
    assert (d2h, h2d) == (0, 2 * mem.page_bytes["mla"])
    after = _pages(cache.mla, range(NUM_BLOCKS), BS)
    for layer in range(len(before)):
        b, a = before[layer].reshape(NUM_BLOCKS, BS, -1), after[layer].reshape(NUM_BLOCKS, BS, -1)
        np.testing.assert_array_equal(a[1], b[7])
        np.testing.assert_array_equal(a[11], b[2])
        keep = [i for i in range(NUM_BLOCKS) if i not in (1, 11)]
        np.testing.assert_array_equal(a[keep], b[keep])
    with pytest.raises(ValueError, match="no host pool"):
        _memory(cache).apply((PageCopy("mla", "d2h", (1,), (0,)),), cache)


def test_offload_save_and_load_restore_the_pages_into_new_blocks():
    cache = _cache()
    mem = _memory(cache)
    before = {g: _pages(getattr(cache, f), range(NUM_BLOCKS), r)
              for g, f, r in (("mla", "mla", BS), ("indexer", "index", IBS))}
    save = SaveKV("r1", {"mla": (3, 4, 6), "indexer": (2,)})
    cache, d2h, _ = mem.apply((save,), cache)
    assert d2h == 3 * mem.page_bytes["mla"] + mem.page_bytes["indexer"] == bytes_moved(save, mem.page_bytes)[0]
    with pytest.raises(ValueError, match="already exists"):
        mem.apply((save,), cache)
    load = LoadKV("r1", {"mla": (0, 10, 1), "indexer": (5,)})
    cache, _, h2d = mem.apply((load,), cache)
    assert h2d == d2h and "r1" not in mem.saved
    for g, f, r, src, dst in (("mla", "mla", BS, (3, 4, 6), (0, 10, 1)), ("indexer", "index", IBS, (2,), (5,))):
        after = _pages(getattr(cache, f), range(NUM_BLOCKS), r)
        for layer in range(len(after)):
            b = before[g][layer].reshape(NUM_BLOCKS, r, -1)
            a = after[layer].reshape(NUM_BLOCKS, r, -1)
            np.testing.assert_array_equal(a[list(dst)], b[list(src)])
            keep = [i for i in range(NUM_BLOCKS) if i not in dst]
            np.testing.assert_array_equal(a[keep], b[keep])


def _host_copies(cache, full, host_table):
    """Host pools (pinned_host, 3 blocks) of each MLA layer holding the device pages `full` [R, M] that
    host_table [R, M] names a host block for."""
    out = []
    for a in cache.mla:
        h = np.zeros((3 * BS, a.shape[1]), a.dtype)
        for r in range(full.shape[0]):
            for p, hb in enumerate(host_table[r]):
                if hb >= 0:
                    h[hb * BS:(hb + 1) * BS] = np.asarray(a[full[r, p] * BS:(full[r, p] + 1) * BS])
        out.append(jax.device_put(jnp.asarray(h), HOST))
    return out


@pytest.mark.parametrize("fmt", ["float32", "fp8_ds_mla"])
def test_staging_reads_host_only_pages_per_tile_and_counts_the_distinct_rows(fmt, monkeypatch):
    """A prefill step over host-only pages (StagingView.attend): attention equals reading every page on
    the device, and each tile copies exactly the distinct host rows its queries select that the
    workspace does not hold from an earlier tile (an LRU over tile x top-k rows, `_staged_lru`; counted
    per request, `copied` also per layer, and rows cross only through `take_host_rows`). With tiles of
    one query the workspace (5 rows) is smaller than a request's host rows, so rows are evicted and
    staged again."""
    from kvcache.base import default_attend
    from kvcache.views import StagingView

    cache = _cache(fmt)
    full = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)  # two requests, 4 pages of BS rows each
    index_table = np.array([[8, 9], [10, 11]], np.int32)
    cache = cache.with_block_table(full, index_table)
    # host copies of pages: request 0's pages 0, 1 in host blocks 2, 0; request 1's page 2 in host block 1
    host_table = np.array([[2, 0, -1, -1], [-1, -1, 1, -1]], np.int32)
    mla = _host_copies(cache, full, host_table)
    hidden = np.where(host_table >= 0, -1, full)  # those pages are host-only in the step's table
    staged = cache.with_block_table(hidden, index_table)
    rng = np.random.default_rng(1)
    t, k, h, r_dim, p_dim = 7, 5, CFG.num_attention_heads, CFG.kv_lora_rank, CFG.qk_rope_head_dim
    pos = np.stack([np.stack([rng.choice(16, k, replace=False) for _ in range(t)]) for _ in range(2)]).astype(np.int32)
    pos[0, 3, 1] = -1  # no selection
    q_lat = jnp.asarray(rng.standard_normal((2, t, h, r_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((2, t, h, p_dim)), jnp.float32)
    crossed = []
    take = host_mod.take_host_rows

    def counting(table, idx):
        crossed.append(idx.shape[0])
        return take(table, idx)

    monkeypatch.setattr(host_mod, "take_host_rows", counting)
    view = StagingView.create(mla, host_table, tile=3, groups=4)
    layer = cache.mla_layers[0]
    want, _ = default_attend(cache, layer, q_lat, q_pe, jnp.asarray(pos), 0.1, window=16, full=True, impl="reference")
    got, out = dataclasses_replace(staged, view).attend(layer, q_lat, q_pe, jnp.asarray(pos), 0.1, window=16,
                                                        full=True, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    expect = [_staged_lru(pos[r], hidden[r], tile=3, k=k) for r in range(2)]
    assert np.asarray(out.staging.staged).tolist() == [[e, 0, 0, 0] for e in expect] and sum(expect) > 0
    assert np.asarray(out.staging.copied).tolist() == expect
    assert np.asarray(out.staging.unserved).tolist() == [0, 0]
    assert crossed  # traced: the copy program moves rows host -> device only through take_host_rows
    one = StagingView.create(mla, host_table, tile=1, groups=4)  # a 5-row workspace: rows are evicted
    got1, out1 = dataclasses_replace(staged, one).attend(layer, q_lat, q_pe, jnp.asarray(pos), 0.1, window=16,
                                                         full=True, impl="reference")
    np.testing.assert_allclose(np.asarray(got1), np.asarray(want), rtol=1e-6, atol=1e-6)
    expect1 = [_staged_lru(pos[r], hidden[r], tile=1, k=k) for r in range(2)]
    assert np.asarray(out1.staging.staged)[:, 0].tolist() == expect1 and expect1[0] > expect[0]
    # a shared layer (3, of the group of full layer 2) copies again but does not count as staged
    _, out2 = out.attend(3, q_lat, q_pe, jnp.asarray(pos), 0.1, window=16, full=False,
                         impl="reference")
    assert np.asarray(out2.staging.staged).tolist() == [[e, 0, 0, 0] for e in expect]
    assert np.asarray(out2.staging.copied).tolist() == [2 * e for e in expect]
    # a selected position on a page with no device block and no host copy is reported, never read as junk
    lost = np.where(np.arange(4)[None] == 3, -1, full)  # page 3 of both requests: gone everywhere
    _, bad = dataclasses_replace(cache.with_block_table(lost, index_table), view).attend(
        layer, q_lat, q_pe, jnp.asarray(pos), 0.1, window=16, full=True, impl="reference")
    assert np.asarray(bad.staging.unserved).tolist() == [int((pos[r] >= 12).sum()) for r in range(2)]


def test_a_batched_verify_step_resolves_the_union_of_its_positions_selections_once():
    """HiSparse's decode view with T = 2 queries per row (a batched MTP verify step, PagedKVCache.
    sparse_slots): one plan per group for the union of the queries' selections. Each query reads its own
    selected rows (the values full residency reads), a position two queries select is resolved, counted
    and copied once, and the next step finds the union in the hot buffer (all hits, nothing copied)."""
    from attention.hisparse import NEVER_USED
    from kvcache.views import HiSparseView
    from kvcache.paged import union_selections

    cache = _cache()
    full = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    index_table = np.array([[8, 9], [10, 11]], np.int32)
    cache = cache.with_block_table(full, index_table)
    host_table = np.array([[2, 0, -1, -1], [-1, -1, 1, -1]], np.int32)  # as in the staging test above
    host = _host_copies(cache, full, host_table)
    hidden = np.where(host_table >= 0, -1, full)
    t, k = 2, 4
    pos = np.array([[[0, 5, 9, -1], [5, 0, 12, 1]],  # row 0: 0, 1, 5 on host-only pages; 0 and 5 twice
                    [[8, 9, 2, 15], [9, 10, 8, 3]]], np.int32)  # row 1: 8, 9, 10 host-only; 8, 9 twice
    want_misses = [3, 3]
    uniq, inverse = union_selections(jnp.asarray(pos.reshape(2, t * k)))
    uniq = np.asarray(uniq)
    assert [sorted(u[u >= 0].tolist()) for u in uniq] == [sorted(set(p[p >= 0].tolist())) for p in pos.reshape(2, -1)]
    np.testing.assert_array_equal(np.take_along_axis(uniq, np.asarray(inverse), 1), pos.reshape(2, -1))
    groups, h = len(cache.index_layers), t * k
    hot_rows = jnp.asarray(NUM_BLOCKS * BS - 2 * h + np.arange(2 * h).reshape(2, h), jnp.int32)  # past the pages
    view = HiSparseView.create(host, host_table, np.array([0, 1], np.int32), jnp.full((2, groups, h), -1, jnp.int32),
                               jnp.full((2, groups, h), NEVER_USED, jnp.int32), hot_rows, 1, t * k)
    layer = cache.mla_layers[0]
    want = cache.mla_slots(layer, jnp.asarray(pos))
    got, out = dataclasses.replace(cache.with_block_table(hidden, index_table), hisparse=view).sparse_slots(
        layer, jnp.asarray(pos), full=True, impl="reference")
    valid = pos >= 0
    np.testing.assert_array_equal(np.asarray(got.table[got.slots])[valid], np.asarray(want.table[want.slots])[valid])
    hs = out.hisparse
    assert np.asarray(hs.misses)[:, 0].tolist() == want_misses and np.asarray(hs.hits).sum() == 0
    assert np.asarray(hs.copied).tolist() == want_misses and np.asarray(hs.unserved).tolist() == [0, 0]
    # the next step: the same selections hit the rows this one copied
    again = HiSparseView.create(host, host_table, np.array([0, 1], np.int32), hs.hot_pos, hs.hot_last, hs.hot_rows, 2,
                                t * k)
    got2, out2 = dataclasses.replace(out, hisparse=again).sparse_slots(layer, jnp.asarray(pos), full=True,
                                                                       impl="reference")
    np.testing.assert_array_equal(np.asarray(got2.table[got2.slots])[valid], np.asarray(want.table[want.slots])[valid])
    assert np.asarray(out2.hisparse.hits)[:, 0].tolist() == want_misses
    assert np.asarray(out2.hisparse.misses).sum() == 0 and np.asarray(out2.hisparse.copied).sum() == 0


def _staged_lru(pos_TK, table_M, *, tile: int, k: int) -> int:
    """Rows a request's staging copies: per tile, its distinct selected positions on host-only pages
    (table -1) that a workspace of tile x k rows does not hold; the misses, in ascending position, take
    the rows no hit of the tile claimed, least recently used first (ties: the lower row)."""
    rows = [(-1, -(2**31))] * (tile * k)  # per workspace row: (position, last tile that used it)
    copies = 0
    for i, start in enumerate(range(0, len(pos_TK), tile)):
        need = sorted({int(q) for q in pos_TK[start:start + tile].reshape(-1) if q >= 0 and table_M[q // BS] < 0})
        held = {p: r for r, (p, _) in enumerate(rows) if p >= 0}
        claimed = {held[q] for q in need if q in held}
        free = sorted((r for r in range(len(rows)) if r not in claimed), key=lambda r: (rows[r][1], r))
        for q, r in zip([q for q in need if q not in held], free):
            rows[r] = (q, i)
            copies += 1
        for q in need:
            if q in held:
                rows[held[q]] = (q, i)
    return copies


def dataclasses_replace(cache, view):
    import dataclasses

    return dataclasses.replace(cache, staging=view)
