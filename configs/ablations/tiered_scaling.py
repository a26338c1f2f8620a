"""Ablation: the tiered-offload scaling study at laptop scale (issue 20, item 9): N conversations all in
flight (concurrency N, one session each), each a 290-token first turn and two follow-ups of 3 new tokens
(OpenHands-style at 1/256 scale), under four ways of keeping KV:

- recompute: nothing kept (preempt, prefix caching off): every turn prefills its whole context;
- device: the device prefix cache only (preempt);
- host: + the host tier (offload), a CPU prefix cache of 64 conversations;
- host_fs: + a filesystem tier behind the host tier (a fresh directory per point, unbounded).

The device pool holds 16 conversations (608 blocks: 19 pages in each of 2 cache groups), the host tier 64.
Expected regimes: at 16 conversations all but recompute alike (the device holds the working set); at 64
the host tier holds what the device cannot; at 256 the host saturates and the filesystem keeps the hit
rate. The published study used another model on 2 x H100: the comparison is of regimes, not numbers.

    python -m experiments.serve --config configs/ablations/tiered_scaling.py --out results/tiered_scaling
"""

from experiments.serve import default_config

CONVERSATION_BYTES = 19 * (73728 + 8192)  # 19 pages of each group (tiny preset, block 16, float32 KV)


def get_config():
    c = default_config()
    c.name = "tiered_scaling"
    c.workload.sessions = 256
    c.workload.scale = 1 / 256
    c.workload.turns = 3
    c.deploy.num_gpu_blocks = 16 * 2 * 19
    host = 64 * CONVERSATION_BYTES
    c.policy_deploy = dict(
        recompute=dict(kv_policy="preempt", enable_prefix_caching=False),
        device=dict(kv_policy="preempt"),
        host=dict(kv_policy="offload", cpu_offload_bytes=host),
        host_fs=dict(kv_transfer_config=dict(kv_connector="OffloadingConnector", kv_connector_extra_config=dict(
            cpu_bytes_to_use=host, secondary_tiers=[dict(type="fs", root_dir="")]))),
    )
    c.sweep.kv_policy = ("recompute", "device", "host", "host_fs")
    c.sweep.concurrency = (16, 64, 256)
    c.sweep.sessions_per_user = 1  # each point serves `concurrency` conversations, all at once
    c.warmup = "buckets"
    return c
