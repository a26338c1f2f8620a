"""Smoke run: the serve pipeline end to end in about a minute on 2 CPU cores (cold compile cache).

    python -m experiments.serve --config configs/smoke.py --out out/smoke
"""

from experiments.serve import default_config


def get_config():
    c = default_config()
    c.name = "smoke"
    c.workload.sessions = 2
    c.workload.turns = 4
    c.deploy.max_num_seqs = 2
    c.sweep.concurrency = (1, 2)
    c.warmup = "none"  # compile only the shapes it uses: this is a pipeline check, not a measurement
    return c
