"""Ablation: HiSparse vs offload-only with MTP3 speculative decoding (issue 21 item 7), at laptop scale.

configs/ablations/hisparse_vs_offload.py (the same sessions, model, device pool and equal host bytes)
with vLLM's MTP configuration as both published deployments run it: 3 draft tokens, acceptance fixed at
the synthetic length 2.99 (per-position rates 1.0, 0.99, 0.0), so every decode row verifies 1 + 3 tokens
per step. HiSparse's hot buffer is then (3 + 2) x top-k = 640 rows per request (40 blocks leased from the
pool, against 16 without MTP), and the pool holds the MTP layer's KV and indexer keys too.

    python -m experiments.serve --config configs/ablations/hisparse_vs_offload_mtp3.py \\
        --out results/hisparse_vs_offload_mtp3
"""

from pathlib import Path

from experiments.common import load_config

MTP3 = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.99}


def get_config():
    c = load_config(str(Path(__file__).with_name("hisparse_vs_offload.py")))  # configs load by path
    c.name = "hisparse_vs_offload_mtp3"
    c.deploy.speculative_config = MTP3
    c.warmup = "none"  # as its committed run (results/hisparse_vs_offload_mtp3) was measured
    return c
