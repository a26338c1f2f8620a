"""Agentic-coding trace replay at CPU scale: synthetic sessions shaped like the published traces
(median ~43 turns, prompts growing to ~142K tokens with > 95% prefix reuse, ~444 output tokens, subagent
branches), every length times 1/128, each user isolated by a per-user salt.

    python -m experiments.serve --config configs/agentic_trace.py --out out/agentic_trace

Replay a trace file of your own (our JSON format, a Mooncake / aiperf `mooncake_trace` JSONL file, or
Weka / SemiAnalysis agentic-coding traces: a JSON or JSONL file or a directory of them; the format is
detected, experiments/workloads.py documents each) with
`--config.workload.kind=trace --config.workload.trace_path=PATH`.
"""

from experiments.serve import default_config


def get_config():
    c = default_config()
    c.name = "agentic_trace"
    c.workload.kind = "synthetic"
    c.workload.sessions = 4
    c.workload.scale = 1 / 128
    c.deploy.max_model_len = 2048
    c.sweep.concurrency = (2, 4)
    return c
