"""Batch building: the width buckets a serving run compiles, how a step's rows group into padded
forwards, and the padded arrays of one group (tokens, positions, block tables)."""

from __future__ import annotations

import numpy as np

from attention.common import pow2_at_least
from glm53.api import window_bucket
from glm53.engine.config import DeployConfig

MIN_PREFILL_WIDTH = 16  # narrowest prefill bucket: shorter chunks pad to it (fewer programs)


def width_buckets(max_tokens: int, verify_width: int = 0) -> list[int]:
    """Tokens per row of the compiled programs: 1 (decode) and powers of two from MIN_PREFILL_WIDTH up to
    `max_tokens` (a power of two: the step's token budget, or max_model_len if smaller). Under MTP the
    first bucket is `verify_width` (1 + num_speculative_tokens: a decoding row and its drafts) instead
    of 1."""
    w = min(MIN_PREFILL_WIDTH, max_tokens)
    prefill = [w << i for i in range((max_tokens // w).bit_length())]
    if verify_width in prefill:
        raise NotImplementedError(f"a verify width of {verify_width} tokens (1 + num_speculative_tokens) must be "
                                  f"below the narrowest prefill width {w} (min(16, max_num_batched_tokens))")
    return [verify_width or 1] + prefill


def shortest_row(width: int, widths: list[int]) -> int:
    """Fewest tokens of a row in a forward group of `width` (`forward_groups`): a prefill width holds
    rows of more than the next narrower width's tokens (2 or more in the narrowest prefill bucket, whose
    one-token rows decode or verify); the decode (or verify) bucket rows of 1."""
    return 1 if width == widths[0] else 2 if width == widths[1] else width // 2 + 1


def group_rows_limit(width: int, widths: list[int], budget: int, max_num_seqs: int) -> int:
    """The most rows a forward group of `width` tokens per row can hold before padding: max_num_seqs,
    and in a prefill width no more than the step's token budget holds of its shortest rows."""
    if width == widths[0]:
        return max_num_seqs
    return max(1, min(max_num_seqs, budget // shortest_row(width, widths)))


def bucket_shapes(deploy: DeployConfig, verify_width: int = 0, ranks: int = 1) -> list[tuple[int, int, int]]:
    """Every (rows, tokens per row, window) program a runner of the resolved `deploy` can run
    (`forward_groups` of any step the scheduler can form, ranks x rows under DP x EP): rows padded to
    powers of two up to max_num_seqs', windows `window_bucket`s up to the block tables' positions,
    except the groups no step forms: a prefill width with more rows than `group_rows_limit`, or a window
    narrower than its rows' fewest tokens."""
    max_tokens, capacity = step_limits(deploy)
    widths = width_buckets(max_tokens, verify_width)
    windows = sorted({window_bucket(1 << i, capacity) for i in range(capacity.bit_length() + 1)})
    shapes = []
    for w in widths:
        most = pow2_at_least(group_rows_limit(w, widths, deploy.max_num_batched_tokens, deploy.max_num_seqs))
        narrowest = window_bucket(shortest_row(w, widths), capacity)
        shapes += [(ranks * r, w, win) for r in (1 << i for i in range(most.bit_length()))
                   for win in windows if win >= narrowest]
    return sorted(shapes)


def step_limits(deploy: DeployConfig) -> tuple[int, int]:
    """(widest row bucket, positions a block table addresses) of a runner of the resolved `deploy`: no
    chunk is wider than the budget or than a whole request; max_model_len rounded up to whole pages."""
    return (pow2_at_least(min(deploy.max_num_batched_tokens, deploy.max_model_len)),
            deploy.max_blocks_per_seq * deploy.tokens_per_block)


def forward_groups(rows, max_tokens: int, capacity: int, verify_width: int = 0) -> list[tuple[int, list[int], int, int]]:
    """How a step's rows (anything with `start`, `num_tokens` and `num_draft_tokens`) run as padded
    forwards: one forward per width bucket -> [(width, indices of its rows, padded rows, window)], in
    order of first appearance. Padded rows: a power of two; window: the attention window bucket of the
    group's last position (`glm53.api.window_bucket` under `capacity`). Under MTP (`verify_width`) a row
    with drafts, or of one token, goes to the verify bucket, every other row to a prefill width. The
    model runner executes exactly these shapes and the simulator prices them
    (`glm53.engine.sim.SimRunner(pad_like_runner=True)`)."""
    widths = width_buckets(max_tokens, verify_width)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if verify_width and (row.num_draft_tokens or row.num_tokens == 1):
            w = verify_width
        else:
            w = next(w for w in widths[1 if verify_width else 0:] if w >= row.num_tokens)
        groups.setdefault(w, []).append(i)
    return [(w, idx, pow2_at_least(len(idx)), window_bucket(max(rows[i].start + rows[i].num_tokens for i in idx),
                                                            capacity))
            for w, idx in groups.items()]


def block_table(deploy: DeployConfig, group: str, rows: int, tables, window: int | None = None) -> np.ndarray:
    """Block tables [rows, pages] int32 (-1 padded) of cache group `group` covering positions < `window`
    (None: the whole max_model_len): a step reads no page past its window, so its tables cost O(window)
    per step, not O(max_model_len), and their width follows the window bucket (no extra programs)."""
    d = deploy
    pages = d.max_blocks_per_seq if window is None else -(-window // d.tokens_per_block)
    if group == "indexer":
        pages = -(-pages * d.tokens_per_block // d.index_tokens_per_block)
    out = np.full((rows, pages), -1, np.int32)
    for i, t in enumerate(tables):
        t = t[:pages]  # pages past the window (MTP's lookahead slots) are not this forward's
        out[i, : len(t)] = t
    return out


def padded_rows(rows, r: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and positions [r, width] int32 of `rows` (PlanRows), padding -1 positions (token 0)."""
    tok = np.zeros((r, width), np.int32)
    pos = np.full((r, width), -1, np.int32)
    for i, row in enumerate(rows):
        tok[i, : row.num_tokens] = row.token_ids
        pos[i, : row.num_tokens] = np.arange(row.start, row.start + row.num_tokens)
    return tok, pos
