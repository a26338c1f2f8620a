"""Part 2 at the 1M limit, in the simulator (../shared/BRIEF.md §8; issue 23 item 5): the published claim
is that at 1M only PCP x DCP prefill with HiSparse decode can serve a request at all.

configs/paper/part2.py's deployments, with what 1M changes:
- max_model_len 1,048,576 and the published mean input of 142K tokens per request (sessions grow past
  it and end at the limit);
- the memory plan's budgets at 1M (experiments.deployments.kv_budget): every engine runs 8,192 batched
  tokens as at 142K, where the PCP8 x DCP8 x EP8 engine's pool is 15.93 GiB and holds one 1M request
  (6.7 GiB per GPU under DCP8); at Part 1's 32,768 its workspace (18.2 GiB) would leave 2.3 GiB
  (results/memory_plan; docs/memory.md);
- the HiSparse decode ranks' 64 GiB of host memory split 52 GiB HiSparse pool + 12 GiB offload: a 1M
  request's MLA pages are 50.6 GiB, more than the published 48 GiB pool holds (the engine refuses a
  host pool that cannot hold one request of max_model_len).
Only "pcp_dcp+hisparse" is swept: the engine refuses the other two at 1M, each with the reason
(tests/engine/test_pd_sim.py checks it): a DP8 prefill rank's pool (15.59 GiB) holds 5,111 of the
17,408 blocks of one 1M request, and an offload decode rank (15.59 GiB, no DCP) cannot hold one either.
Concurrency 8 to 32, as published; each point measured as part2.py's: an hour of steady state after a
600 s warm-up, its sessions drawn from one trace.

    python -m experiments.serve --config configs/paper/part2_1m.py --out results/paper/part2_1m
"""

from pathlib import Path

from experiments.common import load_config
from experiments.deployments import GiB, part2_pd_deployments

MAX_MODEL_LEN = 1_048_576


def get_config():
    c = load_config(str(Path(__file__).with_name("part2.py")))  # configs are loaded by path, not imported
    c.name = "paper_part2_1m"
    c.deploy.max_model_len = MAX_MODEL_LEN
    c.workload.mean_input = 142_000.0
    deps = part2_pd_deployments(MAX_MODEL_LEN)  # the memory plan's budgets at 1M
    for dep in deps.values():
        if dep["decode"].get("kv_policy") == "hisparse":
            dep["decode"].update(hisparse_host_pool_bytes=52 * GiB, cpu_offload_bytes=12 * GiB)
    c.pd.deployments = deps
    c.sweep.kv_policy = ("pcp_dcp+hisparse",)
    c.sweep.concurrency = (8, 16, 32)
    return c
