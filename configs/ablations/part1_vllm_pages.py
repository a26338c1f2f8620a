"""Ablation: Part 1's offloading baseline with vLLM's page layout for a sparse-attention model, emulated
(issue 53; configs/ablations/part2_vllm_pages.py says what is emulated and why only without HiSparse).

configs/paper/part1.py's offload points with 64-token indexer pages and the device KV budget scaled so
that a token costs its bytes under vLLM's layout (experiments.deployments.vllm_pages). The scaled budget
is written into the config: a `--config.deploy.kv_cache_memory_bytes` override replaces it unscaled.

    python -m experiments.serve --config configs/ablations/part1_vllm_pages.py --out results/paper/part1_vllm_pages
"""

from pathlib import Path

from experiments.common import load_config


def get_config():
    import glm53
    from experiments.deployments import vllm_pages

    c = load_config(str(Path(__file__).parents[1] / "paper" / "part1.py"))
    c.name = "part1_vllm_pages"
    c.deploy.update(vllm_pages({}, c.deploy, glm53.get_preset(c.model.preset)))
    c.sweep.kv_policy = ("offload",)
    c.sweep.concurrency = (8, 32)
    return c
