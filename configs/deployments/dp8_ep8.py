"""Deployment: DP8 x EP8, eight data-parallel ranks of one device each that share the routed experts
(simulated on CPU; vLLM's `--data-parallel-size 8 --enable-expert-parallel`, Part 2's decode node), serving
what configs/deployments/dp8.py serves: 8 OpenHands-style sessions of 4 turns at 1/128 scale, one per user
at concurrency 8.

Each rank has its own scheduler and KV pool and a user's turns stick to one rank, as in dp8; the ranks
step together, one program per width over every rank's rows (a rank without work passes padding rows),
with the tiny model's 8 routed experts one per rank and the MoE's all-to-alls between them
(docs/parallel.md "DP x EP in the engine"). `experiments.validate_sim` runs it both ways and compares each
rank's scheduled tokens and idle steps.

    python -m experiments.serve --config configs/deployments/dp8_ep8.py --out out/dp8_ep8
"""

from pathlib import Path

from experiments.common import load_config


def get_config():
    c = load_config(str(Path(__file__).with_name("dp8.py")))  # configs are loaded by path, not imported
    c.name = "dp8_ep8"
    c.deploy.enable_expert_parallel = True
    return c
