"""Part 1 with MTP3, as published (../shared/BRIEF.md §8: both deployments run MTP3): configs/paper/part1.py
with speculative_config MTP, 3 draft tokens, acceptance fixed at vLLM's synthetic length 2.99 (per-position
rates 1.0, 0.99, 0.0; the simulator has no draft model, so only the synthetic rule runs there). Each decode
row verifies 1 + 3 tokens per step and the MTP layer's passes are priced (glm53.perfmodel.step); the pool
holds the MTP layer's KV too (788 more bytes per token), and HiSparse's hot buffer is (3 + 2) x top-k rows
per request. Context limit 142K; at 1M (HiSparse only: prefill chunks, the MTP layer's pass and the
drafts stage the host rows they select, so a request need not fit the pool):

    python -m experiments.serve --config configs/paper/part1_mtp3.py --out results/paper/part1_mtp3
    python -m experiments.serve --config configs/paper/part1_mtp3.py --out results/paper/part1_mtp3_1m \
        --config.deploy.max_model_len=1048576 "--config.sweep.kv_policy=('hisparse',)"
"""

from pathlib import Path

from experiments.common import load_config

MTP3 = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.99}


def get_config():
    c = load_config(str(Path(__file__).with_name("part1.py")))  # configs are loaded by path, not imported
    c.name = "paper_part1_mtp3"
    c.deploy.speculative_config = MTP3
    return c
