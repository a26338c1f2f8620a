"""Deployment: DP8, eight independent replicas of one device each (simulated on CPU), the decode-side
baseline that BRIEF §7 compares PCP x DCP against, serving 8 OpenHands-style sessions of 4 turns at 1/128
scale, one per user at concurrency 8.

Each replica holds the whole model (routed experts included; configs/deployments/dp8_ep8.py splits them
over the ranks) and its own KV pool; a user's turns stick to one replica (its prefix cache). On CPU the
replicas step one after the other, so this measures the pipeline, not speed.

    python -m experiments.serve --config configs/deployments/dp8.py --out out/dp8
"""

from experiments.serve import default_config


def get_config():
    c = default_config()
    c.name = "dp8"
    c.deploy.data_parallel_size = 8
    c.deploy.max_num_seqs = 2
    c.workload.sessions = 8
    c.workload.turns = 4
    c.sweep.concurrency = (8,)
    c.warmup = "none"
    return c
