"""Part 1 of the published results at H200 scale, in the simulator (../shared/BRIEF.md §8; issue 19).

GLM-5.3 on one 8 x H200 node, TP8, fp8 KV cache (fp8_ds_mla rows, fp8 indexer keys, 64-token blocks),
max_num_batched_tokens 32,768, max_num_seqs 256, prefix caching on; OpenHands sessions (13 turns;
74,160 first-turn tokens, 753 new tokens per later turn, 220 output tokens), 128 conversations;
concurrency 1, 8, 16, 24, 32, each point serving all 128 conversations start to end (its window is those
conversations: `sweep.measure = "full"`); HiSparse (384 GiB HiSparse host pool + 128 GiB offload pool for idle
indexer keys) against offload (512 GiB): experiments.deployments' "tp8_hisparse" and "tp8_offload", whose
layout (64-token MLA pages, 1,024-token indexer pages) and batch limits this config takes. Context limit 142K (142,000 tokens, vLLM's "142k"); the 1M
point is the same config (the same conversations) with --config.deploy.max_model_len=1048576; sessions
that grow toward 1M tokens are a separate ablation, configs/paper/part1_1m_growing.py.

Device KV budget per GPU: the memory plan's derivation (experiments.deployments.kv_budget: usable HBM - fp8
weights - the step's workspace, from results/memory_plan; the same at either limit, since the workspace
follows the batched tokens): `deploy.kv_cache_memory_bytes` is the offload deployment's (23.73 GiB, what
any policy without HiSparse gets here) and HiSparse's own field in `policy_deploy` is that less its
resolver state (23.56 GiB), so a run that sets the budget sets both:
--config.deploy.kv_cache_memory_bytes=B --config.policy_deploy.hisparse.kv_cache_memory_bytes=B.
BRIEF §2's published ~15 GiB (glm53.perfmodel.PUBLISHED_KV_BUDGET_BYTES_TP8) is the other value of
experiments.sensitivity's kv_budget sweep. One token per decode step (num_speculative_tokens 0 in every run); configs/paper/part1_mtp3.py is this sweep with MTP3 as published. `offload` is the host
tier of tiered offloading (a CPU prefix cache, kvcache.policies.offload; vLLM's offloading baseline); its stores
run before the forward, not beside it.
Every step is priced by the performance model on the H200 spec (docs/simulator.md lists what is
assumed).

    python -m experiments.serve --config configs/paper/part1.py --out results/paper/part1
"""

from experiments.deployments import LAYOUT, PART1_LIMITS, fields, part1_kv_budgets
from experiments.serve import default_config

MAX_MODEL_LEN = 142_000


def get_config():
    c = default_config()
    c.name = "paper_part1"
    c.runner.kind = "sim"
    c.runner.hardware = "h200"
    c.model.preset = "glm-5.3"
    d = c.deploy
    # the published deployments (experiments.deployments): TP8 with HiSparse, and the offloading baseline
    hisparse, offload = fields("tp8_hisparse"), fields("tp8_offload")
    d.tensor_parallel_size = hisparse.pop("tensor_parallel_size")
    offload.pop("tensor_parallel_size")
    d.update(LAYOUT)
    d.update(PART1_LIMITS)
    d.max_model_len = MAX_MODEL_LEN
    d.kv_cache_memory_bytes, hisparse["kv_cache_memory_bytes"] = part1_kv_budgets(MAX_MODEL_LEN)
    c.policy_deploy = {hisparse.pop("kv_policy"): hisparse, offload.pop("kv_policy"): offload}
    c.workload.kind = "openhands"
    c.workload.sessions = 128
    c.workload.scale = 1.0
    c.workload.turns = 13
    c.sweep.kv_policy = ("hisparse", "offload")
    c.sweep.concurrency = (1, 8, 16, 24, 32)
    # the published workload is the window: every point serves all 128 conversations to their end
    c.sweep.sessions_per_user = 0
    c.sweep.measure = "full"
    c.warmup = "none"
    return c
