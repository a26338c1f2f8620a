"""Deployment: PCP8 x DCP8 x EP8 on one context axis of 8 devices (simulated on CPU), the prefill engine of
BRIEF §7, serving the smoke workload (2 OpenHands-style sessions of 4 turns at 1/128 scale).

Prompts split over the 8 devices by token (balanced 2N chunks), the KV cache split round-robin (a block
id is 16 slots on each device, covering 128 tokens), the 8 routed experts of the tiny model one per
device. Greedy tokens equal one device's (tests/parallel/test_model_cp.py); on CPU this measures the
pipeline, not speed: 8 simulated devices share the host's cores.

    python -m experiments.serve --config configs/deployments/pcp8_dcp8.py --out out/pcp8_dcp8
"""

from experiments.serve import default_config


def get_config():
    c = default_config()
    c.name = "pcp8_dcp8"
    c.deploy.prefill_context_parallel_size = 8
    c.deploy.decode_context_parallel_size = 8
    c.deploy.enable_expert_parallel = True
    c.deploy.dcp_comm_backend = "ag_rs"
    c.deploy.max_num_seqs = 2
    c.workload.sessions = 2
    c.workload.turns = 4
    c.sweep.concurrency = (2,)
    c.warmup = "none"
    return c
