"""The HiSparse resolver against a loop-by-loop LRU model, and end to end: after the plan's copies, the
rows sparse MLA would read hold exactly the selected positions' KV, whatever the residency."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention.hisparse import BlockSizes, HotBuffer, resolve, resolve_pallas, resolve_reference
from kvcache.host import copy_host_rows

BS, M, K, H = 4, 8, 6, 12  # block size, pages per request, top-k, hot slots (2 x top-k)


class LRUModel:
    """One request's hot buffer as plain Python: what the resolver must do, written as loops."""

    def __init__(self, h):
        self.pos = [-1] * h
        self.last = [None] * h

    def step(self, sel, resident, t):
        hits, misses, slot_of = 0, 0, {}
        for p in sel:
            if p >= 0 and not resident(p) and p in self.pos:
                s = self.pos.index(p)
                slot_of[p] = s
                hits += 1
        hit_slots = set(slot_of.values())
        free = sorted((s for s in range(len(self.pos)) if s not in hit_slots),
                      key=lambda s: (-1 if self.last[s] is None else 0, self.last[s] or 0, s))
        for p in sel:
            if p >= 0 and not resident(p) and p not in slot_of:
                s = free.pop(0)
                slot_of[p] = s
                self.pos[s] = p
                misses += 1
        for s in slot_of.values():
            self.last[s] = t
        return hits, misses, slot_of


def test_resolver_matches_lru_model_and_serves_exact_rows():
    rng = np.random.default_rng(0)
    b = 2
    # device pool: rows [0, 64) hold resident pages, rows [64, 64 + b * H) are the hot slots
    hot_rows = (64 + np.arange(b * H)).reshape(b, H).astype(np.int32)
    hot = HotBuffer.create(hot_rows)
    truth = rng.normal(size=(b, M * BS, 3)).astype(np.float32)  # KV row of each (request, position)
    host_pages = np.arange(b * M, dtype=np.int32).reshape(b, M)  # every page has a host copy
    host = jax.device_put(truth.reshape(b * M * BS, 3),
                          jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    device = jnp.zeros((64 + b * H, 3), jnp.float32)
    models = [LRUModel(H) for _ in range(b)]
    resolve = jax.jit(resolve_reference, static_argnums=3)
    total_copied = total_hits = 0
    for t in range(40):
        # residency changes step to step; the last page is always resident (the tail is never released)
        dev_pages = np.full((b, M), -1, np.int32)
        free_blocks = list(rng.permutation(16))
        for r in range(b):
            res = rng.random(M) < (0.9 if t < 3 else 0.3)
            res[-1] = True
            for p in np.flatnonzero(res):
                blk = free_blocks.pop()
                dev_pages[r, p] = blk
                device = device.at[blk * BS : (blk + 1) * BS].set(truth[r, p * BS : (p + 1) * BS])
        sel = np.stack([np.where(rng.random(K) < 0.15, -1, rng.choice(M * BS, K, replace=False)) for _ in range(b)])
        sel = sel.astype(np.int32)
        plan, hot = resolve(jnp.asarray(sel), jnp.asarray(dev_pages), jnp.asarray(host_pages), BS, hot, t)
        device, n = copy_host_rows(device, host, plan.copy_src, plan.copy_dst)
        assert n == int(plan.copied_rows) == int(plan.misses.sum())
        total_copied += n
        total_hits += int(plan.hits.sum())
        rows = np.asarray(plan.rows)
        for r in range(b):
            hits, misses, _ = models[r].step(sel[r].tolist(), lambda p, r=r: dev_pages[r, p // BS] >= 0, t)
            assert (int(plan.hits[r]), int(plan.misses[r])) == (hits, misses), t
            assert int(plan.lost[r]) == 0 and int(plan.misses[r]) <= K
            assert np.asarray(hot.pos[r]).tolist() == models[r].pos
            for k in range(K):
                if sel[r, k] < 0:
                    assert rows[r, k] == -1
                else:  # the row read holds exactly the selected position's KV
                    np.testing.assert_array_equal(np.asarray(device[rows[r, k]]), truth[r, sel[r, k]])
    assert total_copied > 0 and total_hits > 0  # both paths ran


def test_nothing_is_copied_while_everything_is_resident():
    sel = jnp.asarray([[0, 5, 9, 13, -1, 30]], jnp.int32)
    dev = jnp.arange(M, dtype=jnp.int32)[None]
    plan, hot = resolve_reference(sel, dev, dev, BS, HotBuffer.create(jnp.arange(H)[None] + 100), 0)
    assert int(plan.copied_rows) == 0 and int(plan.resident[0]) == 5 and int(plan.hits[0]) == 0
    np.testing.assert_array_equal(plan.rows[0], [0, 5, 9, 13, -1, 30])
    assert (np.asarray(hot.pos) == -1).all()


def test_lost_rows_are_flagged_never_stale_and_small_buffers_are_rejected():
    sel = jnp.asarray([[3, 7]], jnp.int32)
    none = jnp.full((1, M), -1, jnp.int32)
    plan, _ = resolve_reference(sel, none, none, BS, HotBuffer.create(jnp.arange(4)[None]), 0)
    assert int(plan.lost[0]) == 2 and (np.asarray(plan.rows) == -1).all() and int(plan.copied_rows) == 0
    with pytest.raises(ValueError, match="top-k"):
        resolve_reference(jnp.zeros((1, 4), jnp.int32), none, none, BS, HotBuffer.create(jnp.arange(3)[None]), 0)


PLAN_FIELDS = ("rows", "copy_src", "copy_dst", "hits", "misses", "resident", "lost")


def _edge_case_steps(rng, b, m, bs, k, steps):
    """Per step (selection, device pages, host pages) for 4 requests: 0 always fully resident; 1 nothing
    resident at first (all misses) then drifting residency; 2 ragged residency with some pages lacking a
    host copy (lost); 3 mostly -1 selections (all -1 at one step). Selections come from a small drifting
    working set, so later steps mix hits with misses and evict."""
    out = []
    for t in range(steps):
        sel = np.full((b, k), -1, np.int32)
        dev = np.full((b, m), -1, np.int32)
        host = (np.arange(b * m, dtype=np.int32).reshape(b, m) * 3 + 1)  # host blocks, all distinct
        blocks = iter(rng.permutation(4 * b * m).astype(np.int32))
        for r in range(b):
            lo = min(2 * t, m * bs - 2 * k)
            sel[r] = rng.choice(np.arange(lo, lo + 2 * k), k, replace=False)
            if r == 0:
                resident = np.ones(m, bool)
            elif r == 1:
                resident = np.zeros(m, bool) if t < 2 else rng.random(m) < 0.3
            else:
                resident = rng.random(m) < 0.4
            for p in np.flatnonzero(resident):
                dev[r, p] = next(blocks)
            if r == 2:
                host[r, rng.random(m) < 0.3] = -1
            if r == 3:
                sel[r, rng.random(k) < 0.6] = -1
                if t == 2:
                    sel[r] = -1
        out.append((sel, dev, host))
    return out


@pytest.mark.parametrize("k,h,chunk", [(5, 5, None), (5, 10, 2)])  # H = K and H = 2K; one and several tiles
def test_pallas_resolver_matches_reference_exactly(k, h, chunk):
    rng = np.random.default_rng(k * 100 + h)
    b, m, bs = 4, 6, 4
    hot_rows = (200 + np.arange(b * h)).reshape(b, h).astype(np.int32)
    hot_ref = hot_pal = HotBuffer.create(hot_rows)
    ref = jax.jit(resolve_reference, static_argnums=3)
    pal = jax.jit(resolve_pallas, static_argnums=3, static_argnames=("interpret", "block_sizes"))
    totals = dict.fromkeys(PLAN_FIELDS[3:], 0)
    evictions = 0
    for t, (sel, dev, host) in enumerate(_edge_case_steps(rng, b, m, bs, k, steps=7)):
        step = jnp.int32(100 + 3 * t)  # the clock may jump
        plan_ref, new_ref = ref(sel, dev, host, bs, hot_ref, step)
        plan_pal, new_pal = pal(sel, dev, host, bs, hot_pal, step, interpret=True,
                                block_sizes=BlockSizes(chunk=chunk))
        for f in PLAN_FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(plan_pal, f)), np.asarray(getattr(plan_ref, f)),
                                          err_msg=f"{f} at step {t}")
        for f in ("pos", "last_use", "rows"):
            np.testing.assert_array_equal(np.asarray(getattr(new_pal, f)), np.asarray(getattr(new_ref, f)),
                                          err_msg=f"hot.{f} at step {t}")
        old, new = np.asarray(hot_ref.pos), np.asarray(new_ref.pos)
        evictions += int(((old >= 0) & (new != old)).sum())
        for f in totals:
            totals[f] += int(np.asarray(getattr(plan_ref, f)).sum())
        assert int(plan_ref.resident[0]) == int((sel[0] >= 0).sum()) and int(plan_ref.copied_rows) == int(plan_ref.misses.sum())
        if t == 0:
            assert int(plan_ref.misses[1]) == k  # nothing resident, empty buffer: all misses
        hot_ref, hot_pal = new_ref, new_pal
    # every path ran: hits, misses (with evictions of older rows), in-place reads and lost rows
    assert all(v > 0 for v in totals.values()) and evictions > 0, (totals, evictions)


def test_pallas_resolver_validates_shapes_and_dispatch():
    none = jnp.full((1, 3), -1, jnp.int32)
    with pytest.raises(ValueError, match="top-k"):
        resolve_pallas(jnp.zeros((1, 4), jnp.int32), none, none, 4, HotBuffer.create(jnp.arange(3)[None]), 0)
    with pytest.raises(ValueError, match="chunk"):
        resolve_pallas(jnp.zeros((1, 4), jnp.int32), none, none, 4, HotBuffer.create(jnp.arange(8)[None]), 0,
                       block_sizes=BlockSizes(chunk=3))
    with pytest.raises(ValueError, match="chunk"):  # a power of two, but more than K (4) padded
        resolve_pallas(jnp.zeros((1, 4), jnp.int32), none, none, 4, HotBuffer.create(jnp.arange(8)[None]), 0,
                       block_sizes=BlockSizes(chunk=8))
    with pytest.raises(ValueError, match="page tables"):
        resolve_pallas(jnp.zeros((1, 4), jnp.int32), none[:, :2], none, 4, HotBuffer.create(jnp.arange(8)[None]), 0)
    with pytest.raises(ValueError, match="impl"):
        resolve(jnp.zeros((1, 4), jnp.int32), none, none, 4, HotBuffer.create(jnp.arange(8)[None]), 0, impl="x")
    sel = jnp.asarray([[0, 5, -1]], jnp.int32)
    plan, _ = resolve(sel, jnp.arange(3, dtype=jnp.int32)[None], none, 4, HotBuffer.create(jnp.arange(4)[None]), 0,
                      impl="reference")
    np.testing.assert_array_equal(np.asarray(plan.rows), [[0, 5, -1]])
