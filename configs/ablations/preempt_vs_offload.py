"""Ablation: what the engine does when the device KV pool runs out, preempt (drop KV, recompute it
later) vs offload (move it to the pinned_host pool, bring it back), on the same OpenHands-style
sessions at 1/128 scale.

The device pool holds two full-length sessions (2 x 43 blocks per cache group), so concurrency 4 must
evict; the host pool is large enough never to refuse an offload. Everything else is the default.

    python -m experiments.serve --config configs/ablations/preempt_vs_offload.py --out out/preempt_vs_offload
"""

from experiments.serve import default_config


def get_config():
    c = default_config()
    c.name = "preempt_vs_offload"
    c.deploy.num_gpu_blocks = 2 * 2 * 43  # 2 sessions x 2 cache groups x ceil(677 / 16) blocks
    c.deploy.cpu_offload_bytes = 256 << 20
    c.sweep.kv_policy = ("preempt", "offload")
    c.sweep.concurrency = (1, 2, 4)
    return c
