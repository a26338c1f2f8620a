"""Ablation: what the engine does when the device KV pool runs out, on the same OpenHands-style sessions
at 1/128 scale: preempt (drop KV, recompute it later), swap (move a victim's KV to the pinned_host pool,
bring it back) and offload (the host tier: every full page is stored to a CPU prefix cache as it fills,
and a preempted request or a later turn loads what the device no longer holds; kvcache.policies.offload).

The device pool holds one and a half full-length sessions (129 blocks; a session reaches 43 blocks in
each of the 2 cache groups), so two running requests outgrow it and the scheduler must evict one; the
host pool is large enough never to refuse a swap and never to evict from the host tier. Everything else is the default. (A pool of two
whole sessions never preempts at this scale: admission waits for room, and with outputs of 2 tokens a
running request barely grows; the pressure then shows only as prefix-cache thrash at concurrency 4,
where LRU over a cycle of 4 sessions that fit 2 evicts exactly the prefix needed next.)

    python -m experiments.serve --config configs/ablations/preempt_vs_offload.py --out out/preempt_vs_offload
"""

from experiments.serve import default_config


def get_config():
    c = default_config()
    c.name = "preempt_vs_offload"
    c.deploy.num_gpu_blocks = 3 * 43  # 1.5 sessions x 2 cache groups x ceil(677 / 16) blocks
    c.deploy.cpu_offload_bytes = 256 << 20
    c.sweep.kv_policy = ("preempt", "swap", "offload")
    c.sweep.concurrency = (1, 2, 4)
    return c
