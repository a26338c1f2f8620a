"""Part 2 of the published results at H200 scale, in the simulator (../shared/BRIEF.md §8; issue 23): P/D
disaggregation on 16 x H200, one 8-GPU node for prefill and one for decode, coupled by the PdConnector
(glm53.engine.pd_sim; the decode ranks read the producer's host memory over one 400 Gb/s RDMA NIC per
GPU, glm53.perfmodel.RDMA_CX7).

Deployments (sweep.kv_policy names them; results carry `prefill` and `decode`):
- "pcp_dcp+hisparse": one PCP8 x DCP8 x EP8 prefill engine with a 512 GiB CPU offload, and 8 DP decode
  ranks (EP8) with Hybrid HiSparse (48 GiB host pool + 16 GiB offload each), as published;
- "dp+hisparse": DP8 prefill (EP8, 64 GiB offload per rank) and the same HiSparse decode;
- "pcp_dcp+offload": the PCP8 x DCP8 x EP8 prefill and offload-only decode (64 GiB per rank).
GLM-5.3, fp8 KV (fp8_ds_mla rows, fp8 indexer keys), 64-token pages on both sides (the DCP8 prefill
engine runs 8-row blocks and 128-key indexer blocks, so its pages cover 64 and 1,024 tokens as the decode
ranks' do: a page must cover the same tokens on both, docs/simulator.md "P/D"); MTP3 with
acceptance fixed at 2.99 (vLLM's synthetic rule, as configs/paper/part1_mtp3.py); agentic-coding
sessions (experiments.workloads.synthetic_trace: about 43 turns, about 444 output tokens per turn,
> 95% prefix reuse, a salt per user). The published mean of about 142K input tokens per request cannot
run under a 142K limit (a session's prompts grow to about 1.7x their mean), so at 142K the mean input is
80K (prompts grow to about 133K; a session, or a subagent, that reaches the limit ends there) and at 1M
it is the published 142K.

Each point is measured over its steady window (sweep.measure = "steady", experiments/serve.py): from
the start until the closed loop first cannot fill a free slot; the drain after it is not run. Four
sessions per slot keep that window long (docs/simulator.md "Part 2 at H200 scale").

Every engine runs 8,192 batched tokens (vLLM's API-server default on an H100 / H200; the brief gives no
Part 2 batch limits, and at Part 1's 32,768 a DP8 rank does not fit at all). Device KV budgets per GPU
come from the memory plan's rows at that budget (`python -m experiments.memory_plan`,
results/memory_plan/results.json, fp8 weights): 15.94 GiB for the PCP8 x DCP8 x EP8 prefill engine
(its attention weights are whole on every GPU, its workspace 4.57 GiB), 15.59 GiB for a DP8 prefill
rank and 15.42 GiB for a DP8 x EP8 decode rank. Throughput counts every token of every request (cached ones too) over all 16 GPUs.

    python -m experiments.serve --config configs/paper/part2.py --out results/paper/part2

At 1M: configs/paper/part2_1m.py.
"""

from pathlib import Path

from experiments.common import load_config
from glm53.perfmodel import GiB

MTP3 = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.99}
# per-GPU device KV budgets derived by the memory plan (results/memory_plan/results.json, fp8 weights)
KV_PCP8_DCP8_EP8_PREFILL = int(15.9412 * GiB)
MAX_NUM_BATCHED_TOKENS = 8192
KV_DP8_PREFILL = int(15.5896 * GiB)
KV_DP8_EP8_DECODE = int(15.4217 * GiB)

PCP_DCP_PREFILL = dict(prefill_context_parallel_size=8, decode_context_parallel_size=8, enable_expert_parallel=True,
                       block_size=8, index_block_size=128, kv_policy="offload", cpu_offload_bytes=512 * GiB,
                       kv_cache_memory_bytes=KV_PCP8_DCP8_EP8_PREFILL, max_num_seqs=32)
DP_PREFILL = dict(data_parallel_size=8, enable_expert_parallel=True, kv_policy="offload", cpu_offload_bytes=64 * GiB,
                  kv_cache_memory_bytes=KV_DP8_PREFILL, max_num_seqs=32)
HISPARSE_DECODE = dict(data_parallel_size=8, enable_expert_parallel=True, kv_policy="hisparse",
                       hisparse_host_pool_bytes=48 * GiB, cpu_offload_bytes=16 * GiB,
                       kv_cache_memory_bytes=KV_DP8_EP8_DECODE)
OFFLOAD_DECODE = dict(data_parallel_size=8, enable_expert_parallel=True, kv_policy="offload",
                      cpu_offload_bytes=64 * GiB, kv_cache_memory_bytes=KV_DP8_EP8_DECODE)


def get_config():
    c = load_config(str(Path(__file__).with_name("part1.py")))  # configs are loaded by path, not imported
    c.name = "paper_part2"
    d = c.deploy
    d.tensor_parallel_size = 1
    d.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    d.speculative_config = MTP3
    c.policy_deploy = {}
    c.pd.deployments = {
        "pcp_dcp+hisparse": dict(prefill=PCP_DCP_PREFILL, decode=HISPARSE_DECODE,
                                 prefill_name="pcp8_dcp8_ep8", decode_name="dp8_ep8_hisparse"),
        "dp+hisparse": dict(prefill=DP_PREFILL, decode=HISPARSE_DECODE,
                            prefill_name="dp8_ep8", decode_name="dp8_ep8_hisparse"),
        "pcp_dcp+offload": dict(prefill=PCP_DCP_PREFILL, decode=OFFLOAD_DECODE,
                                prefill_name="pcp8_dcp8_ep8", decode_name="dp8_ep8_offload"),
    }
    c.workload.kind = "synthetic"
    c.workload.sessions = 128
    c.workload.scale = 1.0
    c.workload.median_turns = 43.0
    c.workload.mean_input = 80_000.0
    c.sweep.kv_policy = ("pcp_dcp+hisparse", "dp+hisparse", "pcp_dcp+offload")
    c.sweep.concurrency = (8, 16, 32, 48, 64)
    # each point: 4 sessions per concurrency slot, measured over the window in which all `concurrency`
    # sessions run (sweep.measure "steady"): with ~43-turn, heavy-tailed sessions and subagents that wait
    # on their parents, the drain after it was most of a full run (c=64: 25 of 64 running on average)
    c.sweep.sessions_per_user = 4
    c.sweep.measure = "steady"
    return c
