"""kvcache.relayout: a request's KV moved between engines that page it differently (DCP round robin with
its interleave, other page sizes and block ids), per cache group with its own row size, against a
token-by-token reference built from parallel.dcp.DcpLayout."""

import numpy as np
import pytest

import glm53
from attention.formats import IndexKeyFormat, MLARowFormat
from kvcache.relayout import (PagedLayout, assemble_page, canonical_rows, gather_tokens, page_parts, relayout,
                              scatter_tokens)
from parallel.dcp import DcpLayout

GLM = glm53.get_preset("glm-5.3")
# (group, row format, page rows): GLM-5.3's fp8 MLA rows (656 B) in 64-token pages and fp8 index keys
# (132 B) in 256-token pages, and the MTP layer's rows as one more MLA array
GROUPS = {"mla": (MLARowFormat("fp8_ds_mla", GLM.kv_lora_rank, GLM.qk_rope_head_dim), 2),
          "indexer": (IndexKeyFormat("fp8", GLM.index_head_dim), 1)}


def _random_arrays(rng, layout: PagedLayout, fmt, n_arrays: int):
    return tuple(rng.integers(0, 2**32, (layout.num_rows, fmt.width), dtype=np.uint32) for _ in range(n_arrays))


def _reference_rows(layout: PagedLayout, table, n: int) -> np.ndarray:
    """Token by token with DcpLayout: token p's block is table[p // (B D)], its rank owner(p), its row in
    that rank's page local_position(p) mod B."""
    dcp = DcpLayout(layout.ranks, layout.page_rows, layout.interleave)
    out = []
    for p in range(n):
        block = table[p // layout.tokens_per_block]
        rank = int(dcp.owner(p))
        out.append(rank * layout.pool_pages * layout.page_rows + block * layout.page_rows
                   + int(dcp.local_position(p)) % layout.page_rows)
    return np.asarray(out)


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("ranks,interleave", [(1, 1), (2, 1), (4, 16), (8, 1), (8, 64)])
def test_dcp_prefill_layout_to_a_decode_rank_per_cache_group(group, ranks, interleave):
    """A producer under DCP (64-token pages, `ranks` ranks, interleave 1 or the page size) hands a request
    of 1,000 tokens (not a whole block) to a consumer with 16-token pages and other block ids: every
    token's row, of every array of the group, lands where the consumer reads it; nothing else changes."""
    fmt, n_arrays = GROUPS[group]
    rng = np.random.default_rng(ranks * 100 + interleave)
    n = 1000
    src = PagedLayout(64, 20, ranks, interleave)
    dst = PagedLayout(16, 80, 1, 1)
    src_table = rng.permutation(src.pool_pages)[: src.blocks_for(n)]
    dst_table = rng.permutation(dst.pool_pages)[: dst.blocks_for(n)]
    src_arrays = _random_arrays(rng, src, fmt, n_arrays)
    dst_arrays = _random_arrays(rng, dst, fmt, n_arrays)
    before = [a.copy() for a in dst_arrays]
    got = relayout(src_arrays, src, src_table, dst_arrays, dst, dst_table, n)
    want_src, want_dst = _reference_rows(src, src_table, n), _reference_rows(dst, dst_table, n)
    assert fmt.row_bytes == {"mla": 656, "indexer": 132}[group]
    for a, g, b in zip(src_arrays, got, before, strict=True):
        g = np.asarray(g)
        np.testing.assert_array_equal(g[want_dst], a[want_src])
        untouched = np.setdiff1d(np.arange(dst.num_rows), want_dst)
        np.testing.assert_array_equal(g[untouched], b[untouched])


def test_round_trip_and_the_token_order_is_layout_free():
    """gather_tokens reads the same token-order rows from a request whatever its layout (the wire
    format), and scattering them back into the producer's layout restores it."""
    rng = np.random.default_rng(0)
    fmt = GROUPS["mla"][0]
    n = 300
    pos = np.arange(512, dtype=np.int32)
    pos[n:] = -1
    layouts = [PagedLayout(64, 8, 1), PagedLayout(64, 8, 4, 1), PagedLayout(64, 8, 4, 64), PagedLayout(32, 16, 2, 8)]
    tokens = rng.integers(0, 2**32, (n, fmt.width), dtype=np.uint32)
    for layout in layouts:
        table = rng.permutation(layout.pool_pages)[: layout.blocks_for(512)]
        empty = (np.zeros((layout.num_rows, fmt.width), np.uint32),)
        filled = scatter_tokens(empty, layout, table, pos, (np.pad(tokens, ((0, 512 - n), (0, 0))),))
        (back,) = gather_tokens(filled, layout, table, pos)
        back = np.asarray(back)
        np.testing.assert_array_equal(back[:n], tokens)
        assert (back[n:] == 0).all()  # padding reads zeros
        assert int((np.asarray(filled[0]) != 0).any(axis=1).sum()) == n  # exactly n rows written


@pytest.mark.parametrize("ranks,rows,interleave", [(1, 8, 1), (2, 4, 1), (4, 8, 2), (8, 16, 4), (2, 8, 8)])
def test_canonical_rows_follow_the_dcp_round_robin(ranks, rows, interleave):
    """The canonical order of a block's rows (what tiers store) against parallel.dcp's placement: token p
    of the block sits on rank owner(p) at local row local_position(p) mod rows."""
    layout = DcpLayout(ranks, rows, interleave)
    p = np.arange(ranks * rows)
    want = np.asarray(layout.owner(p)) * rows + np.asarray(layout.local_position(p)) % rows
    np.testing.assert_array_equal(canonical_rows(ranks, rows, interleave), want)
    assert sorted(canonical_rows(ranks, rows, interleave)) == list(range(ranks * rows))  # a permutation


def test_bad_tables_and_layouts_are_refused():
    """The P/D failure matrix's layout half: an id outside the pool, a missing page, a table too short
    and mismatched arrays raise before anything is read or written."""
    layout = PagedLayout(16, 4, 2)
    ok = np.array([3, 0], np.int32)
    np.testing.assert_array_equal(layout.check(ok, 40), ok)  # 40 tokens: 2 blocks of 32
    with pytest.raises(ValueError, match="block id 4 out of range"):
        layout.check(np.array([0, 4]), 40)
    with pytest.raises(ValueError, match="page 1 of the first 2 is missing"):
        layout.check(np.array([0, -1]), 40)
    with pytest.raises(ValueError, match="need 2 pages"):
        layout.check(np.array([0]), 40)
    with pytest.raises(ValueError, match="must divide page_rows"):
        PagedLayout(16, 4, 2, 3)
    a = (np.zeros((layout.num_rows, 4), np.uint32),)
    with pytest.raises(ValueError, match="arrays differ"):
        relayout(a, layout, ok, (np.zeros((layout.num_rows, 5), np.uint32),), layout, ok, 40)
    with pytest.raises(ValueError, match="destination block table: block id 9"):
        relayout(a, layout, ok, a, layout, np.array([9, 0]), 40)


# ------------------------------------------------------------------ chunks of another page span (issue 48)
WIDTHS = (5, 5, 3)  # bytes per token of each array of a group (layers of unequal rows included)


def _canonical(rows, tokens: int, page: int) -> np.ndarray:
    """Page `page` of `tokens` tokens in the canonical layout: each array's rows in token order, in turn."""
    return np.concatenate([r[page * tokens:(page + 1) * tokens].reshape(-1) for r in rows])


@pytest.mark.parametrize("src,dst", [(4, 8), (4, 12), (16, 4), (8, 8), (4, 6), (6, 4), (12, 8)],
                         ids=lambda v: str(v))
def test_pages_of_one_span_assemble_from_pages_of_another(src, dst):
    """Concat (a page = k source pages), split (1/k of one), the lcm cases (6 from 4, 4 from 6, 8 from 12)
    and the identity: every full destination page equals the canonical page cut from token-order rows."""
    rng = np.random.default_rng(src * 100 + dst)
    n = 48
    rows = [rng.integers(0, 256, (n, w), dtype=np.uint8) for w in WIDTHS]
    for page in range(n // dst):
        parts = page_parts(dst, src, page)
        assert sum(hi - lo for _, lo, hi in parts) == dst
        got = assemble_page([(_canonical(rows, src, j), lo, hi) for j, lo, hi in parts], WIDTHS, src)
        np.testing.assert_array_equal(got, _canonical(rows, dst, page))
    assert page_parts(8, 4, 1) == [(2, 0, 4), (3, 0, 4)]
    assert page_parts(4, 16, 2) == [(0, 8, 12)]
    assert page_parts(6, 4, 1) == [(1, 2, 4), (2, 0, 4)]


def test_assemble_page_refuses_a_page_of_the_wrong_size():
    with pytest.raises(ValueError, match="13 bytes need 52"):
        assemble_page([(np.zeros(12, np.uint8), 0, 4)], WIDTHS, 4)
    with pytest.raises(ValueError, match="not within a page"):
        assemble_page([(np.zeros(52, np.uint8), 2, 6)], WIDTHS, 4)
