"""Sparse MQA over rows staged from a host pool: a HiSparse prefill chunk whose selected positions lie
partly on pages that live only in host memory reads them through a small per-tile workspace, never by
copying the whole prefix to the device (vLLM's temporary device cache for HiSparse prefill).

The op is pure: the host pool arrives as a function that hands rows to the device (kvcache.host's
`take_shared_rows` in the engine), so only the rows it is asked for cross the link. The data the step
carries between layers (pools, host page tables, counts) is kvcache.views.StagingView.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention.sparse_mla import SlotRows, sparse_mqa

_NO_ROW = jnp.iinfo(jnp.int32).max  # sort key of "no host row to stage" (after every real host slot)


def staged_sparse_mqa(device_table, host_table_RM, host_rows, slots_BTK, pos_BTK, q_lat_BTHR, q_pe_BTHP,
                      scale: float, fmt, block_size: int, *, tile: int, impl: str):
    """Sparse MQA of the queries over their selected positions pos [B, T, K] (-1 = none) of one MLA layer,
    whose device rows (`device_table` [N, W]) are at slots [B, T, K] (-1: not on the device); the others
    are read from the host pool, whose block of each page of the rows is `host_table_RM` [B, M] int32 (-1:
    no host copy), through `host_rows(idx [n] int32) -> rows [n, W]` (host slots in range).
    -> (out [B, T, H, R] f32, staged [B] int32: host rows copied for each row, lost [B] int32: selected
    positions with neither a device row nor a host copy).

    The host rows go through a workspace of u = tile x top-k rows per request, tile after tile (a scan):
    a tile's distinct host rows that the workspace already holds (staged for an earlier tile of this
    chunk) are hits; the others take the least recently used rows no hit claimed and are copied
    (compacted over the batch, in one of three static sizes R*K/64, /8, /1 as HiSparse's decode copies).
    Sorting, not [u, u] comparisons, finds the hits, so a tile costs O(u log u)."""
    b, t, k = pos_BTK.shape
    tq = min(tile, t)
    nt = -(-t // tq)
    pad = nt * tq - t
    page = jnp.maximum(pos_BTK, 0) // block_size
    hpage = jnp.take_along_axis(host_table_RM, jnp.minimum(page, host_table_RM.shape[1] - 1).reshape(b, -1),
                                axis=1).reshape(pos_BTK.shape)
    need = (pos_BTK >= 0) & (slots_BTK < 0)
    hslot = jnp.where(need & (hpage >= 0), hpage * block_size + pos_BTK % block_size, _NO_ROW)
    lost = need & (hpage < 0)
    read = (pos_BTK >= 0) & ~lost

    def tiles(x, fill):  # [B, T, ...] -> [nt, B, tq, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(b, nt, tq, *x.shape[2:]), 1, 0)

    u = tq * k  # workspace rows per request row and tile
    n = b * u
    sizes = sorted({max(1, n >> s) for s in (6, 3, 0)})

    def assign(uniq, wpos, wlast, step):
        """One request's tile: its distinct host rows `uniq` [u] (ascending, _NO_ROW padded) against
        the workspace rows' host slots `wpos` [u] (-1 empty) -> (workspace row of each uniq entry,
        copies: whether it misses, new wpos, new wlast). A hit keeps its row; a miss takes the least
        recently used row no hit of this tile claimed (there are enough: the tile has at most u)."""
        valid = uniq != _NO_ROW
        order_w = jnp.argsort(wpos)
        sorted_w = wpos[order_w]
        at = jnp.clip(jnp.searchsorted(sorted_w, uniq), 0, u - 1)
        hit = valid & (sorted_w[at] == uniq)
        hit_row = order_w[at]
        miss = valid & ~hit
        claimed = jnp.zeros((u,), bool).at[jnp.where(hit, hit_row, u)].set(True, mode="drop")
        lru = jnp.argsort(jnp.where(claimed, jnp.iinfo(jnp.int32).max, wlast), stable=True)
        miss_row = lru[jnp.clip(jnp.cumsum(miss) - 1, 0, u - 1)]
        row = jnp.where(hit, hit_row, jnp.where(miss, miss_row, -1))
        wpos = wpos.at[jnp.where(miss, row, u)].set(uniq, mode="drop")
        wlast = wlast.at[jnp.where(valid, row, u)].set(step, mode="drop")
        return row, miss, wpos, wlast

    def one_tile(carry, args):
        ws, wpos, wlast, step = carry
        q_l, q_p, hs, dev, ok = args  # [B, tq, ...]
        key = hs.reshape(b, u)
        uniq = jax.vmap(lambda x: jnp.unique(x, size=u, fill_value=_NO_ROW))(key)  # [B, u] ascending
        row, miss, wpos, wlast = jax.vmap(assign, in_axes=(0, 0, 0, None))(uniq, wpos, wlast, step)
        base = jnp.arange(b, dtype=jnp.int32)[:, None] * u
        src = jnp.where(miss, uniq, -1).reshape(-1)  # host slot -> workspace row, misses only
        dst = (base + row).reshape(-1)
        order = jnp.argsort(src < 0, stable=True)  # the copies first
        count = jnp.sum(miss)
        branch = jnp.where(count == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes), count))

        def copy(m, ws):
            s_, d_ = src[order[:m]], dst[order[:m]]
            rows = host_rows(jnp.maximum(s_, 0))
            return ws.at[jnp.where(s_ >= 0, d_, n)].set(rows, mode="drop")

        ws = jax.lax.switch(branch, [lambda w: w] + [functools.partial(copy, m) for m in sizes], ws)
        from_ws = key != _NO_ROW
        at = jax.vmap(jnp.searchsorted)(uniq, key)  # [B, u]: each selection's entry in uniq
        at_ws = base + jnp.take_along_axis(row, jnp.minimum(at, u - 1), axis=1)
        rows = jnp.where(from_ws[..., None], ws[jnp.maximum(at_ws, 0).reshape(-1)].reshape(b, u, -1),
                         device_table[jnp.maximum(dev, 0).reshape(b, u)])
        local = jnp.where(ok, jnp.arange(n, dtype=jnp.int32).reshape(b, tq, k), -1)
        out, _ = sparse_mqa(q_l, q_p, SlotRows(rows.reshape(n, -1), local, fmt), scale, impl=impl)
        return (ws, wpos, wlast, step + 1), (out, jnp.sum(miss, axis=1).astype(jnp.int32))

    init = (jnp.zeros((n, device_table.shape[1]), device_table.dtype), jnp.full((b, u), -1, jnp.int32),
            jnp.full((b, u), jnp.iinfo(jnp.int32).min, jnp.int32), jnp.int32(0))
    _, (out, per_tile) = jax.lax.scan(one_tile, init, (tiles(q_lat_BTHR, 0), tiles(q_pe_BTHP, 0),
                                                       tiles(hslot, _NO_ROW), tiles(slots_BTK, -1),
                                                       tiles(read, False)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, nt * tq, *out.shape[3:])[:, :t]
    return out, jnp.sum(per_tile, axis=0), jnp.sum(lost, axis=(1, 2)).astype(jnp.int32)
