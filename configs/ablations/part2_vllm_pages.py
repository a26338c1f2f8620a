"""Ablation: Part 2 with vLLM's page layout for a sparse-attention model, emulated (issue 53).

vLLM (0.34.0 read) keeps a DeepSeek-V3.2-style model's MLA rows and indexer keys at 64-token pages, so a
prefix hit ends on a 64-token boundary. This engine gives the groups separate block ids priced at the
larger page (kvcache.layout.block_bytes), and configs/paper uses 1,024-token indexer pages so that an
indexer block is not mostly idle; its prefix hits then end on 1,024-token boundaries, and a P/D decode
leg computes the prompt from its last 1,024-token boundary but one (docs/simulator.md, "Page layout:
vLLM's and this engine's").

Emulated here (experiments.deployments.vllm_pages): 64-token indexer pages on both engines (8-key pages
on the DCP8 prefill engine: 64 tokens over its 8 ranks), each engine's device KV budget scaled so that a
token whose pages are all on the device costs its bytes under vLLM's layout. Exact at full residency
only, so only the offload-decode pair runs (HiSparse keeps the indexer pages and releases MLA pages).
Everything else is configs/paper/part2.py's. The scaled budgets are written into `pd.deployments`: an
override of them replaces them unscaled.

    python -m experiments.serve --config configs/ablations/part2_vllm_pages.py --out results/paper/part2_vllm_pages
"""

from pathlib import Path

from experiments.common import load_config

PAIRS = ("pcp_dcp+offload",)


def get_config():
    import glm53
    from experiments.deployments import vllm_pages

    c = load_config(str(Path(__file__).parents[1] / "paper" / "part2.py"))
    c.name = "part2_vllm_pages"
    cfg = glm53.get_preset(c.model.preset)
    c.pd.deployments = {pair: dict(d, prefill=vllm_pages(d["prefill"], c.deploy, cfg),
                                   decode=vllm_pages(d["decode"], c.deploy, cfg))
                        for pair, d in c.pd.deployments.items() if pair in PAIRS}
    c.sweep.kv_policy = PAIRS
    return c
