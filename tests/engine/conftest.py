"""Engine test helpers: a recorder of every block-pool decision (device pool and host
pools alike)."""

import pytest

from kvcache.block_pool import BlockPool


class PoolHistory:
    """Every allocate / free / touch / cache call on any BlockPool while active, as (pool, op, blocks):
    pools numbered in the order they first act, blocks as the call's result (allocate) or argument."""

    OPS = ("allocate", "free", "touch", "cache")

    def __init__(self):
        self.events: list[tuple[int, str, tuple[int, ...]]] = []
        self._pools: dict[int, int] = {}

    def record(self, pool, op, blocks):
        self.events.append((self._pools.setdefault(id(pool), len(self._pools)), op, tuple(int(b) for b in blocks)))

    def take(self) -> list:
        out, self.events, self._pools = self.events, [], {}
        return out


@pytest.fixture
def pool_history(monkeypatch):
    hist = PoolHistory()
    for op in PoolHistory.OPS:
        orig = getattr(BlockPool, op)

        def wrapped(self, *args, _orig=orig, _op=op, **kwargs):
            out = _orig(self, *args, **kwargs)
            hist.record(self, _op, out if _op == "allocate" else (args[1],) if _op == "cache" else args[0])
            return out

        monkeypatch.setattr(BlockPool, op, wrapped)
    return hist
