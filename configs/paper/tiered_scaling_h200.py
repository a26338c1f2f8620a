"""The tiered-offload scaling study at GLM-5.3 / H200 scale, in the simulator (issue 20, item 9; BRIEF §7):
N conversations all in flight (concurrency N, one session each), 16 to 256, under four ways of keeping
KV, over Part 1's deployment (configs/paper/part1.py: one 8 x H200 node, TP8, fp8 KV) with BRIEF §2's 15 GiB
of KV per GPU (Part 1's own configs take the memory plan's larger budget; the sizes below were set on this
one): 4,918 blocks of the larger of an MLA page and a 1,024-token indexer page:

- recompute: nothing kept (preempt, prefix caching off): every turn prefills its whole context;
- device: the device prefix cache only (preempt);
- host: + the host tier (offload), a CPU prefix cache of HOST_CONVERSATIONS conversations;
- host_fs: + a filesystem tier behind it (write-through, unbounded), simulated on one local NVMe SSD
  (glm53.perfmodel.NVME_GEN4: 6.8 GB/s read, 5.6 GB/s write, 0.2 ms per chunk).

Conversations are OpenHands sessions at 1/16 scale (a 4,635-token first turn, then 47 new input tokens
per turn, 14 output tokens per turn), 4 turns: 4,832 tokens at the end. The sizes put the regime
boundaries where the published study saw them: the device pool (about 296K tokens) holds about 60
conversations (the published "up to ~64 alike"), the host tier HOST_CONVERSATIONS = 112 (between 96 and
128: "beyond 128 the CPU cache saturates"); the filesystem tier holds everything (docs/simulator.md).
The published study used another model on 2 x H100 with a local NVMe tier: the comparison is of
regimes, not numbers.

    python -m experiments.serve --config configs/paper/tiered_scaling_h200.py --out results/tiered_scaling_h200
"""

from pathlib import Path

from experiments.common import load_config
from glm53.perfmodel import PUBLISHED_KV_BUDGET_BYTES_TP8

TURNS = 4
SCALE = 1 / 16
# bytes of one conversation at its end (4 turns: 4,635 + 3 x 47 input tokens, 4 x 14 outputs) in the host
# tier: 53,940 B per token (78 MLA layers x 656 B + 21 indexer layers x 132 B; no MTP layer)
CONVERSATION_TOKENS = 4_635 + (TURNS - 1) * 47 + TURNS * 14
CONVERSATION_BYTES = CONVERSATION_TOKENS * (78 * 656 + 21 * 132)
# the host tier holds 112 conversations (29 GB): 96 fit, 128 do not
HOST_CONVERSATIONS = 112


def get_config():
    c = load_config(str(Path(__file__).with_name("part1.py")))  # configs are loaded by path, not imported
    c.name = "tiered_scaling_h200"
    c.deploy.kv_cache_memory_bytes = PUBLISHED_KV_BUDGET_BYTES_TP8
    c.workload.sessions = 256
    c.workload.scale = SCALE
    c.workload.turns = TURNS
    host = HOST_CONVERSATIONS * CONVERSATION_BYTES
    c.policy_deploy = dict(
        recompute=dict(kv_policy="preempt", enable_prefix_caching=False),
        device=dict(kv_policy="preempt"),
        host=dict(kv_policy="offload", cpu_offload_bytes=host),
        host_fs=dict(kv_transfer_config=dict(kv_connector="OffloadingConnector", kv_connector_extra_config=dict(
            cpu_bytes_to_use=host, secondary_tiers=[dict(type="fs", root_dir="")]))),
    )
    c.sweep.kv_policy = ("recompute", "device", "host", "host_fs")
    c.sweep.concurrency = (16, 32, 48, 64, 96, 128, 192, 256)
    c.sweep.sessions_per_user = 1  # each point serves `concurrency` conversations, all at once
    return c
