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
ranks' do: matched spans, so no relayout is priced, docs/simulator.md "P/D"); MTP3 with
acceptance fixed at 2.99 (vLLM's synthetic rule, as configs/paper/part1_mtp3.py); agentic-coding
sessions (experiments.workloads.synthetic_trace: about 43 turns, about 444 output tokens per turn,
> 95% prefix reuse, a salt per user). The published mean of about 142K input tokens per request cannot
run under a 142K limit (a session's prompts grow to about 1.7x their mean), so at 142K the mean input is
80K (prompts grow to about 133K; a session, or a subagent, that reaches the limit ends there) and at 1M
it is the published 142K.

Each point is measured over a full simulated hour of steady state (sweep.measure = "steady",
window_s = 3,600) after a warm-up of WARMUP_S = 600 simulated seconds that is not counted: every session
starts at t = 0 on cold caches, and 600 s is longer than a session lasts at any point of the sweep, so the
sessions in the window started at staggered times. The closed loop keeps all `concurrency` sessions
running over warm-up and window (a point fails if its pool runs short: serve more sessions); it stops
when the requests in flight at the window's end have finished and does not run the drain. Every point
draws its sessions from one trace of SESSIONS sessions (and their subagents), about twice what the
busiest point starts in 70 minutes (docs/simulator.md "Part 2 at H200 scale").

Every engine runs Part 2's 8,192 batched tokens (experiments.deployments.PART2_BATCHED_TOKENS: vLLM's
API-server default on an H100 / H200; the brief gives no Part 2 batch limits, and at Part 1's 32,768 a
DP8 rank does not fit at all). The deployments are experiments.deployments' published descriptions
(`PART2_PAIRS`, `part2_pd_deployments`), each with the device KV budget per GPU the memory plan derives for
it at this batch and limit (`kv_budget`, from results/memory_plan/results.json); for the simulated P/D
pair the DCP8 prefill engine runs 8-row MLA blocks and 128-key indexer blocks (its pages must cover the
decode ranks' 64 and 1,024 tokens) and each prefill engine 32 sequences. Throughput counts
every token of every request (cached ones too) over all 16 GPUs.

    python -m experiments.serve --config configs/paper/part2.py --out results/paper/part2

At 1M: configs/paper/part2_1m.py.
"""

from pathlib import Path

from experiments.common import load_config
from experiments.deployments import PART2_BATCHED_TOKENS, PART2_PAIRS, part2_pd_deployments

WINDOW_S = 3_600.0  # the published points are an hour each
WARMUP_S = 600.0
SESSIONS = 512  # top-level sessions (about 1,040 with subagents); points take them in order

MTP3 = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.99}


def get_config():
    c = load_config(str(Path(__file__).with_name("part1.py")))  # configs are loaded by path, not imported
    c.name = "paper_part2"
    d = c.deploy
    d.tensor_parallel_size = 1
    d.max_num_batched_tokens = PART2_BATCHED_TOKENS
    d.speculative_config = MTP3
    c.policy_deploy = {}
    c.pd.deployments = part2_pd_deployments(d.max_model_len)
    c.workload.kind = "synthetic"
    c.workload.sessions = SESSIONS
    c.workload.scale = 1.0
    c.workload.median_turns = 43.0
    c.workload.mean_input = 80_000.0
    c.sweep.kv_policy = tuple(PART2_PAIRS)
    c.sweep.concurrency = (8, 16, 32, 48, 64)
    # each point: an hour while all `concurrency` sessions run, after a warm-up (sweep.measure "steady"): with
    # ~43-turn, heavy-tailed sessions and subagents that wait on their parents, the drain after the pool
    # first runs short was most of a full run (c=64: 25 of 64 running on average)
    c.sweep.sessions_per_user = 0
    c.sweep.measure = "steady"
    c.sweep.window_warmup_s = WARMUP_S
    c.sweep.window_s = WINDOW_S
    return c
