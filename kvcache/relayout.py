"""Re-layout of one request's KV between engines that page it differently (pure jnp; P/D, tiers).

A prefill engine under DCP keeps a token's row on one of its D ranks (round robin, `interleave`
consecutive tokens per rank turn, parallel.dcp.DcpLayout), in a page of `page_rows` rows that one block
id names on every rank; a decode rank keeps it in its own pages, of another size and with other block
ids. `PagedLayout` says where an engine's arrays hold each position of a request; `gather_tokens` reads
a request's rows in token order (the wire and tier format: nothing of the producer's parallelism is
left in it), `scatter_tokens` writes token-order rows into another layout, and `relayout` is the two.
Each cache group is laid out on its own (MLA rows of 656 B with `block_size` pages, indexer keys of
132 B with `index_block_size` pages for GLM-5.3; the MTP layer's rows are one more MLA array), so a
transfer moves every group and every array of it, whatever their row sizes.

PCP needs nothing here: a PCP x DCP prefill writes its KV in the DCP layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Where one cache group of an engine holds a request's tokens.

    page_rows: rows one block id names on each rank (the group's block_size / index_block_size).
    pool_pages: pages per rank (the group's arrays hold ranks x pool_pages x page_rows rows, rank r's
        pages from row r x pool_pages x page_rows on: the runner's global arrays, split over "cp").
    ranks, interleave: DCP's round robin (1, 1: one device). A block id covers page_rows x ranks tokens.
    """

    page_rows: int
    pool_pages: int
    ranks: int = 1
    interleave: int = 1

    def __post_init__(self):
        for name in ("page_rows", "pool_pages", "ranks", "interleave"):
            if getattr(self, name) < 1:
                raise ValueError(f"PagedLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.page_rows % self.interleave:
            raise ValueError(f"interleave ({self.interleave}) must divide page_rows ({self.page_rows}): a rank's "
                             "run of interleaved tokens must not cross a page")

    @property
    def tokens_per_block(self) -> int:
        return self.page_rows * self.ranks

    @property
    def num_rows(self) -> int:
        """Rows of the group's arrays (first axis)."""
        return self.ranks * self.pool_pages * self.page_rows

    def blocks_for(self, num_tokens: int) -> int:
        """Block ids a request of `num_tokens` tokens holds in this group."""
        return -(-num_tokens // self.tokens_per_block)

    def rows(self, block_table, positions):
        """The row of the group's arrays holding each of `positions` (int32, any shape; < 0: padding) of a
        request whose block table is `block_table` [M] (-1: no page) -> int32, positions' shape; -1 for
        padding, positions past the table and pages it does not hold. numpy or jnp (inside jit)."""
        xp = jnp if isinstance(block_table, jax.Array) or isinstance(positions, jax.Array) else np
        table = xp.asarray(block_table, xp.int32).reshape(-1)
        pos = xp.asarray(positions, xp.int32)
        i, d, b = self.interleave, self.ranks, self.page_rows
        index = pos // self.tokens_per_block
        block = table[xp.clip(index, 0, max(table.shape[0] - 1, 0))] if table.shape[0] else xp.full(pos.shape, -1)
        ok = (pos >= 0) & (index < table.shape[0]) & (block >= 0)
        within = pos % self.tokens_per_block
        rank = (within // i) % d
        local = (within // (i * d)) * i + within % i
        return xp.where(ok, rank * (self.pool_pages * b) + block * b + local, -1).astype(xp.int32)

    def check(self, block_table, num_tokens: int, what: str = "block table") -> np.ndarray:
        """A request's block table checked against this layout on the host -> int32 [M]: ValueError if it
        has too few pages for `num_tokens`, a page -1 within them, or a block id outside the pool (the
        P/D failure matrix: garbage ids must never read another request's rows)."""
        table = np.asarray(block_table).reshape(-1)
        if table.dtype.kind not in "iu":
            raise ValueError(f"{what}: block ids must be integers, got {table.dtype}")
        need = self.blocks_for(num_tokens)
        if table.size < need:
            raise ValueError(f"{what}: {num_tokens} tokens need {need} pages of {self.tokens_per_block} tokens, "
                             f"the table has {table.size}")
        used = table[:need]
        if (used < 0).any():
            raise ValueError(f"{what}: page {int(np.argmax(used < 0))} of the first {need} is missing (-1)")
        if (used >= self.pool_pages).any():
            raise ValueError(f"{what}: block id {int(used.max())} out of range (the pool has {self.pool_pages} "
                             "pages)")
        return used.astype(np.int32)


def canonical_rows(ranks: int, page_rows: int, interleave: int = 1) -> np.ndarray:
    """For the ranks x page_rows tokens one block covers, in token order, the index of each token's row
    among the block's rows stored rank-major (rank r's page_rows rows at r x page_rows): `PagedLayout.
    rows` of a one-page pool. The order tiers store a page's rows in (kvcache.host). Identity for one rank."""
    layout = PagedLayout(page_rows, 1, ranks, interleave)
    return layout.rows(np.zeros(1, np.int32), np.arange(layout.tokens_per_block)).astype(np.int64)


@functools.partial(jax.jit, static_argnames=("layout",))
def gather_tokens(arrays, layout: PagedLayout, block_table, positions):
    """Rows of `positions` [T] (int32, -1: padding) of a request in token order: for each array of a
    cache group ([layout.num_rows, W_a], any dtype), its rows [T, W_a] (zeros for padding and for
    positions whose page is missing). Outside this function, check the table (`PagedLayout.check`):
    a row index here is clamped, never out of bounds, so an unchecked id reads a wrong row."""
    rows = layout.rows(block_table, positions)
    return tuple(jnp.where((rows >= 0)[:, None], a[jnp.maximum(rows, 0)], jnp.zeros((), a.dtype)) for a in arrays)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=0)
def scatter_tokens(arrays, layout: PagedLayout, block_table, positions, rows):
    """`arrays` (a cache group's, donated) with token-order `rows` (`gather_tokens`' output: one [T, W_a]
    per array) written at `positions` [T] of a request with `block_table` in `layout`; padding and
    positions without a page write nothing."""
    at = layout.rows(block_table, positions)
    return tuple(a.at[jnp.where(at >= 0, at, a.shape[0])].set(r.astype(a.dtype), mode="drop")
                 for a, r in zip(arrays, rows, strict=True))


def relayout(src_arrays, src: PagedLayout, src_table, dst_arrays, dst: PagedLayout, dst_table, num_tokens: int,
             *, bucket: int | None = None):
    """Copy the first `num_tokens` tokens of a request from `src_arrays` in layout `src` (block table
    `src_table`) into `dst_arrays` in layout `dst` (`dst_table`) -> new dst arrays (donated). Both
    tables are checked first (ValueError: too short, a missing page, an id outside its pool), and both
    sides must have the same arrays (count, width, dtype). Positions are padded to `bucket` (default:
    the next power of two), so requests of similar length share one compiled program."""
    if len(src_arrays) != len(dst_arrays) or any(a.shape[1:] != b.shape[1:] or a.dtype != b.dtype
                                                 for a, b in zip(src_arrays, dst_arrays)):
        raise ValueError("relayout: the two sides' arrays differ: "
                         f"{[(a.shape[1:], a.dtype) for a in src_arrays]} vs {[(b.shape[1:], b.dtype) for b in dst_arrays]}")
    st = src.check(src_table, num_tokens, "source block table")
    dt = dst.check(dst_table, num_tokens, "destination block table")
    width = bucket or 1 << max(0, num_tokens - 1).bit_length()
    if width < num_tokens:
        raise ValueError(f"relayout: bucket {width} < num_tokens {num_tokens}")
    pos = np.where(np.arange(width) < num_tokens, np.arange(width), -1).astype(np.int32)
    rows = gather_tokens(tuple(src_arrays), src, _pad(st, src.blocks_for(width)), pos)
    return scatter_tokens(tuple(dst_arrays), dst, _pad(dt, dst.blocks_for(width)), pos, rows)


def _pad(table: np.ndarray, n: int) -> jnp.ndarray:
    """A checked table padded with -1 to n entries (a static shape per bucket)."""
    out = np.full(max(n, table.size), -1, np.int32)
    out[: table.size] = table
    return jnp.asarray(out)


# ---------------------------------------------------------------------- chunks of another page span
def page_parts(dst_tokens: int, src_tokens: int, page: int) -> list[tuple[int, int, int]]:
    """Which pages of `src_tokens` tokens make page `page` of `dst_tokens` tokens (both in token order from
    token 0) -> [(source page, first token, end token within it)], in order. One part when the destination
    page lies in one source page (a split: dst_tokens divides src_tokens, or an lcm case), k parts when it
    is k source pages (a concat), a mix otherwise (e.g. 6-token pages from 4-token ones: page 1 is tokens
    6..12 = source page 1's tokens 2..4 and page 2's 0..4)."""
    if dst_tokens < 1 or src_tokens < 1 or page < 0:
        raise ValueError(f"page_parts: tokens per page must be >= 1 and page >= 0, got {dst_tokens}, {src_tokens}, "
                         f"{page}")
    lo, end = page * dst_tokens, (page + 1) * dst_tokens
    return [(j, max(lo, j * src_tokens) - j * src_tokens, min(end, (j + 1) * src_tokens) - j * src_tokens)
            for j in range(lo // src_tokens, (end - 1) // src_tokens + 1)]


def assemble_page(parts, row_bytes, src_tokens: int) -> np.ndarray:
    """One canonical page from slices of canonical pages of another span (`page_parts`) -> np.uint8
    [sum(row_bytes) x tokens]. parts: [(payload, first token, end token)], each payload a canonical page of
    `src_tokens` tokens (np.uint8 [sum(row_bytes) x src_tokens] or any buffer: every array of the group in
    order, `row_bytes[a]` bytes per token of array a, its rows in token order; kvcache.host.HostMemory.
    read_host_pages). The canonical layout is array-major, so a page is not a byte range of its sources:
    each array's rows are cut and joined on their own."""
    row_bytes = [int(w) for w in row_bytes]
    per_token = sum(row_bytes)
    srcs = []
    for payload, lo, hi in parts:
        buf = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload.reshape(-1)
        if buf.size != per_token * src_tokens:
            raise ValueError(f"assemble_page: a source page has {buf.size} bytes, {src_tokens} tokens of "
                             f"{per_token} bytes need {per_token * src_tokens}")
        if not 0 <= lo < hi <= src_tokens:
            raise ValueError(f"assemble_page: tokens [{lo}, {hi}) are not within a page of {src_tokens}")
        srcs.append((buf, lo, hi))
    out, off = [], 0
    for w in row_bytes:
        for buf, lo, hi in srcs:
            out.append(buf[off: off + w * src_tokens].reshape(src_tokens, w)[lo:hi].reshape(-1))
        off += w * src_tokens
    return np.concatenate(out) if out else np.zeros(0, np.uint8)
