"""Prefill context parallelism (PCP): a prompt's tokens split over the ranks of a mesh axis.

Split (`PcpSplit`): pad the prompt of T tokens to T_pad = 2N * C (C = ceil(T / 2N), or a larger bucket
`min_chunk`), cut it into 2N chunks of C tokens, and give rank g chunks g and 2N-1-g ("balanced",
arXiv 2411.01783). Under causal attention the queries of chunk c score c C^2 + C (C + 1) / 2 (query, key)
pairs, so every rank scores exactly 2N C^2 + C pairs (before padding is dropped), whatever g. The
"naive" split (rank g takes tokens [2gC, 2(g+1)C)) is kept for comparison: its last rank does
(4NC - 2C + 1) / (2NC + 1), about 2 - 1/N, times the mean.
Each rank's tokens sit in one [2C] row of a [N, 2C] layout (`positions`); `shard` permutes a
per-token array into that layout (rank-major, padded with zeros), `unshard` restores the original order.

This module holds the split only (it imports nothing from `parallel.cp_cache`). One layer run through
`parallel.cp_cache.CpKVCache` (tokens_split), the cache the engine's PCP steps use, is
`parallel.layers.prefill_layer`; the engine itself runs the same class inside its model step.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

SPLITS = ("balanced", "naive")


@dataclasses.dataclass(frozen=True)
class PcpSplit:
    """How a prompt of `length` tokens is split over `n` ranks ("balanced" or "naive").

    Invariants: every rank holds `tokens_per_rank` = 2C slots; the slots hold each position of
    [0, length) exactly once, the rest (padded_length - length of them) are padding (position -1).
    """

    length: int
    n: int
    kind: str = "balanced"
    min_chunk: int = 1  # chunk size floor: bucket prompt lengths so that they share one compiled program

    def __post_init__(self):
        for name in ("length", "n", "min_chunk"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PcpSplit.{name} must be a positive int, got {v!r}")
        if self.kind not in SPLITS:
            raise ValueError(f"PcpSplit.kind must be one of {SPLITS}, got {self.kind!r}")

    @property
    def chunk(self) -> int:
        """C: tokens per chunk (2N chunks): max(ceil(length / 2N), min_chunk)."""
        return max(-(-self.length // (2 * self.n)), self.min_chunk)

    @property
    def tokens_per_rank(self) -> int:
        return 2 * self.chunk

    @property
    def padded_length(self) -> int:
        return 2 * self.n * self.chunk

    def positions(self, start: int = 0) -> np.ndarray:
        """int32 [n, 2C]: the position (start + prompt index) each rank's slot holds, -1 = padding."""
        n, c = self.n, self.chunk
        g = np.arange(n)[:, None]
        j = np.arange(c)[None, :]
        if self.kind == "balanced":
            idx = np.concatenate([g * c + j, (2 * n - 1 - g) * c + j], axis=1)
        else:
            idx = g * 2 * c + np.arange(2 * c)[None, :]
        return np.where(idx < self.length, idx + start, -1).astype(np.int32)

    def shard(self, x_T):
        """x [T, ...] (numpy or jax) in prompt order -> [n * 2C, ...] in split order (rank-major), zeros at
        padding slots. Shard the result's first axis over the context axis to give each rank its tokens."""
        if x_T.shape[0] != self.length:
            raise ValueError(f"expected {self.length} tokens on axis 0, got shape {x_T.shape}")
        xp = np if isinstance(x_T, np.ndarray) else jnp
        pos = self.positions().reshape(-1)
        x_pad = xp.concatenate([x_T, xp.zeros((1,) + x_T.shape[1:], x_T.dtype)])
        return x_pad[np.where(pos >= 0, pos, self.length)]

    def unshard(self, y_L):
        """y [n * 2C, ...] in split order -> [T, ...] in prompt order (padding dropped)."""
        if y_L.shape[0] != self.n * self.tokens_per_rank:
            raise ValueError(f"expected {self.n * self.tokens_per_rank} slots on axis 0, got shape {y_L.shape}")
        pos = self.positions().reshape(-1)
        slot_of = np.empty(self.length, np.int64)
        slot_of[pos[pos >= 0]] = np.nonzero(pos >= 0)[0]
        return y_L[slot_of]
