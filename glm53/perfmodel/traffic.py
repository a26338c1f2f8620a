"""Bytes the parallel schemes send: one formula per collective pattern, the single source for both the
performance model (`glm53.perfmodel.ops` prices these bytes on a link) and `parallel.comm`, whose tests
check each formula against the collectives of the traced program that the engine runs
(tests/parallel/test_comm.py).

Accounting unit: bytes one rank *sends* per call (equal to what it receives), for the standard
algorithms over an axis of N ranks with per-rank operand size s bytes:
- all-gather: (N - 1) s (it forwards its s to every other rank);
- reduce-scatter: (N - 1) / N * s (it sends all but its own 1/N of the operand);
- all-to-all: (N - 1) / N * s (it keeps its own 1/N);
- all-reduce (psum): 2 (N - 1) / N * s (ring: reduce-scatter + all-gather).
The formulas describe the layer-level drivers of `parallel.layers` (DCP decode, PCP and PCP x DCP
prefill) exactly at their float32 test shapes and predict GLM-5.3's traffic when given its dimensions
and storage formats (bf16 queries and outputs, fp32 LSE, 656 B fp8_ds_mla rows, 132 B fp8 indexer keys).
Pure Python: the simulator imports it without JAX.
"""

from __future__ import annotations

SENT_FACTOR = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
               "all_to_all": lambda n: (n - 1) / n, "psum": lambda n: 2 * (n - 1) / n}


def sent_bytes(kind: str, operand_bytes: float, n: int) -> float:
    """Bytes one rank sends in one collective of `kind` over n ranks with a per-rank operand of
    `operand_bytes` (the accounting above)."""
    return SENT_FACTOR[kind](n) * operand_bytes


def padded_heads(heads: int, n: int) -> int:
    return -(-heads // n) * n


def dcp_decode_bytes(backend: str, *, n: int, tokens: int, heads: int, kv_lora: int, rope: int, q_bytes: float = 2,
                     out_bytes: float = 2, lse_bytes: float = 4) -> dict[str, float]:
    """Bytes one rank sends per decode layer for `tokens` query tokens (batch x query length) under DCP N.

    Both backends all-gather the query (each rank holds H/N heads of q_lat [R] and q_pe [P]). "ag_rs" then
    all-gathers the LSEs [H] and reduce-scatters the scaled outputs [H, R] by head; "a2a" sends one packed
    [H, R + 1] buffer (outputs + LSE; the LSE is sized `lse_bytes`). Heads are padded to a multiple of N.
    Independent of the context length: DCP moves queries and results, never KV.
    """
    hp = padded_heads(heads, n)
    q = (n - 1) * tokens * (hp // n) * (kv_lora + rope) * q_bytes
    if backend == "ag_rs":
        lse = (n - 1) * tokens * hp * lse_bytes
        rs = (n - 1) / n * tokens * hp * kv_lora * out_bytes
        return {"query_all_gather": q, "lse_all_gather": lse, "output_reduce_scatter": rs, "total": q + lse + rs,
                "collectives": 3}
    if backend == "a2a":
        a2a = (n - 1) / n * tokens * hp * (kv_lora * out_bytes + lse_bytes)
        return {"query_all_gather": q, "output_all_to_all": a2a, "total": q + a2a, "collectives": 2}
    raise ValueError(f"backend must be 'ag_rs' or 'a2a', got {backend!r}")


def dcp_topk_merge_bytes(*, n: int, tokens: int, local_k: int, score_bytes: float = 4, pos_bytes: float = 4) -> float:
    """Bytes one rank sends to merge the sparse top-k: all-gather of `local_k` (score, position) candidates
    per query token (local_k = min(top-k, the rank's local positions))."""
    return (n - 1) * tokens * local_k * (score_bytes + pos_bytes)


def pcp_prefill_bytes(*, n: int, new_tokens: int, row_bytes: float, key_bytes: float = 0,
                      pos_bytes: float = 4) -> float:
    """Bytes one rank sends per layer to all-gather the new tokens' cache rows (and indexer keys) under
    PCP N, each write with the tokens' positions (int32; `parallel.cp_cache.CpKVCache.write_packed`);
    new_tokens is the padded prompt length (a multiple of 2N)."""
    groups = 2 if key_bytes else 1
    return (n - 1) * (new_tokens // n) * (row_bytes + key_bytes + groups * pos_bytes)


def dcp_full_copy_bytes(*, n: int, local_slots: int, row_bytes: float, key_bytes: float = 0) -> float:
    """Bytes one rank sends per layer to build the temporary full-context copy in PCP x DCP prefill: an
    all-gather of its share of the request (local_slots = the request's blocks x block size, about context / N)."""
    return (n - 1) * local_slots * (row_bytes + key_bytes)
