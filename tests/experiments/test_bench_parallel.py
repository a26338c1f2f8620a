"""The context-parallelism benchmark runs end to end on small settings (its numbers are checked for
consistency, not speed). It runs in a subprocess: it needs several simulated CPU devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.common import FAST_COMPILE_XLA_FLAGS
from glm53.config import get_preset

REPO = Path(__file__).resolve().parents[2]


def test_bench_parallel_small(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=FAST_COMPILE_XLA_FLAGS)
    cmd = [sys.executable, "-m", "experiments.bench_parallel", "--out", str(tmp_path), "--ns", "4", "--lengths",
           "64", "--block", "8", "--topk", "8", "--dcp-ns", "8", "--contexts", "4096,65536",
           "--prefill-chunk", "256", "--engine-n", "4", "--engine-length", "64"]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert (tmp_path / "bench_parallel.png").stat().st_size > 0
    assert res["git_commit"] and res["date"] and res["machine"]["cores"] >= 1

    runs = {(r["length"], r["split"]): r for r in res["load_balance"]}
    assert set(runs) == {(64, "naive"), (64, "balanced")}
    bal, naive = runs[64, "balanced"], runs[64, "naive"]  # 4 ranks, chunks of 8 tokens, tiles of 8
    assert bal["load_balance_max_over_mean"]["indexer_pairs_causal"] == 1.0
    assert bal["load_balance_max_over_mean"]["indexer_pairs_computed"] == 1.0
    assert sum(bal["per_rank"]["indexer_pairs_causal"]) == 64 * 65 // 2
    assert naive["load_balance_max_over_mean"]["indexer_pairs_causal"] > 1.5
    assert len(bal["per_rank"]["mla_rows_attended"]) == 4

    # the engine's counters (tiny model, 4 full indexer layers): the 64-token prompt splits evenly, each
    # rank 2080 / 4 causal pairs per layer
    eng = res["engine_load_balance"]
    full_layers = sum(1 for i in get_preset("tiny").full_indexer_layers if i < get_preset("tiny").num_hidden_layers)
    assert full_layers == 4
    assert eng["per_rank"]["indexer_pairs_causal"] == [full_layers * 64 * 65 // 2 // 4] * 4
    assert eng["load_balance_max_over_mean"]["indexer_pairs_computed"] == 1.0

    for row in res["formula_check"]:
        assert row["measured_bytes"] == row["formula_bytes"], row
    small, large = res["comm"]
    assert small["decode_ag_rs_bytes_per_layer"] == large["decode_ag_rs_bytes_per_layer"] > 0  # no KV moves
    assert large["prefill_full_copy_allgather_bytes_per_full_layer"] == \
        16 * small["prefill_full_copy_allgather_bytes_per_full_layer"]  # grows with the context
