"""Tier byte I/O: host pages in and out of the canonical byte layout the secondary tiers store
(kvcache.tiers): per page, each array of the cache group in order, its rows in token order (under DCP
the ranks' rows interleaved back, kvcache.relayout.canonical_rows), so any parallel layout reads what
another wrote. `TierIO` is the part of `kvcache.host.HostMemory` that reads and writes those bytes and
collects finished tier loads; the gathers and scatters run on the host (nothing crosses the device
link: a tier reads and fills host pages).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from attention.common import pow2_at_least
@functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _scatter_on_host(table, idx, rows):
    return table.at[idx].set(rows, mode="drop")


def put_host_rows(host_table, idx, rows):
    """host_table[idx] = rows for a pinned_host table, rows from device memory (device->host path);
    idx out of range (e.g. host_table.shape[0]) drops the row. Usable inside jit."""
    return _scatter_on_host(host_table, jax.device_put(idx, jax.memory.Space.Host),
                            jax.device_put(rows, jax.memory.Space.Host))


@functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _gather_host_to_host(table, idx):
    return table.at[idx].get(mode="promise_in_bounds")


@jax.jit
def _host_gather(host_tables, slots):
    """Rows `slots` of each host table (-1: padding, any row), gathered on the host into host memory (a
    tier store reads host pages: nothing crosses the device link)."""
    idx = jax.device_put(jnp.maximum(slots, 0), jax.memory.Space.Host)
    return tuple(_gather_host_to_host(t, idx) for t in host_tables)


@functools.partial(jax.jit, donate_argnums=0)
def _host_scatter(host_tables, slots, rows):
    """host_table[slots] = rows for each host table (-1 slots dropped)."""
    return tuple(put_host_rows(t, jnp.where(slots >= 0, slots, t.shape[0]), r) for t, r in zip(host_tables, rows))


class TierIO:
    """The tier half of `kvcache.host.HostMemory` (a base class of it): reads `host_tables`,
    `page_slots`, `token_rows`, `page_bytes`, `max_copy_pages`, `tiers` and `_tier_loads` of the host
    memory it is part of."""

    def _host_page_slots(self, group: str, blocks) -> np.ndarray:
        """Host-pool slots of whole pages, page-major (each page's rows on every rank together), padded
        with -1 to a power of two pages."""
        blocks = list(blocks)
        blocks += [-1] * (pow2_at_least(len(blocks)) - len(blocks))
        return np.concatenate([self.page_slots(group, [b], host=True) for b in blocks])

    def read_host_pages(self, group: str, blocks) -> list[np.ndarray]:
        """The bytes of host pages `blocks` of `group` in the canonical layout -> one np.uint8 [page_bytes]
        per page (a snapshot): each array of the group in order, its rows in token order."""
        n, slots = len(blocks), self._host_page_slots(group, blocks)
        per = len(slots) // pow2_at_least(n)
        order = self.token_rows[group]
        out = np.empty((n, self.page_bytes[group]), np.uint8)
        off = 0
        for rows in _host_gather(self.host_tables[group], jnp.asarray(slots)):
            a = np.asarray(rows)[: n * per].reshape(n, per, -1)[:, order].reshape(n, -1).view(np.uint8)
            out[:, off: off + a.shape[1]] = a
            off += a.shape[1]
        assert off == self.page_bytes[group], (off, self.page_bytes[group])
        return list(out)

    def write_host_pages(self, group: str, blocks, payloads) -> None:
        """Host pages `blocks` of `group` = payloads (np.uint8 [page_bytes] each, `read_host_pages`' layout)."""
        n, slots = len(blocks), self._host_page_slots(group, blocks)
        width = pow2_at_least(n)
        per = len(slots) // width
        place = np.argsort(self.token_rows[group])  # rank-major row i holds token place[i]
        data = np.zeros((width, self.page_bytes[group]), np.uint8)
        data[:n] = np.stack(payloads)
        rows, off = [], 0
        for t in self.host_tables[group]:
            per_page = per * t.shape[1] * t.dtype.itemsize
            tokens = data[:, off: off + per_page].copy().view(t.dtype).reshape(width, per, t.shape[1])
            rows.append(tokens[:, place].reshape(-1, t.shape[1]))
            off += per_page
        self.host_tables[group] = _host_scatter(self.host_tables[group], jnp.asarray(slots), tuple(rows))

    def poll_tiers(self, wait_s: float = 0.0) -> tuple[tuple[int, str], ...]:
        """Finished secondary-tier loads: their bytes written into the reserved host pages -> ((job,
        status), ...) with status "ok", "miss" or "corrupt". wait_s: wait up to this long for the first
        one when loads are pending and none has finished (an idle engine waiting for a load)."""
        if self.tiers is None:
            return ()
        results = self.tiers.poll()
        deadline = time.monotonic() + wait_s
        while not results and self._tier_loads and time.monotonic() < deadline:
            time.sleep(0.001)
            results = self.tiers.poll()
        if not results and not self._tier_loads and wait_s:
            time.sleep(min(wait_s, 0.002))  # a request waits on a tier's RETRY (a store in flight): do not spin
        out, ok = [], {}
        for r in results:
            group, hb = self._tier_loads.pop(r.job_id)
            if r.status[0] == "ok":
                ok.setdefault(group, []).append((hb, r.payloads[0]))
            out.append((r.job_id, r.status[0]))
        for group, pages in ok.items():
            for lo in range(0, len(pages), self.max_copy_pages):
                part = pages[lo: lo + self.max_copy_pages]
                self.write_host_pages(group, [hb for hb, _ in part], [p for _, p in part])
        return tuple(out)
