"""Ablation: HiSparse vs offload-only when agent sessions outgrow the device KV pool (issue 4).

Fixed so that it measures the mechanism, not a sizing knob:
- workload: OpenHands-style sessions at 1/16 scale (first turn 4,635 tokens, then 12 turns of 47 new
  tokens, 14 output tokens per turn; 5,381 tokens at the end), one session per concurrent user;
- model: the tiny preset reshaped to GLM-5.3's proportions: top-k 128 (2.8% of the first turn, like
  2,048 of 74,160) and 2 full indexer layers out of 8, so indexer keys are 5.3% of a token's KV bytes
  (8 x 576 B of float32 MLA rows, 2 x 128 B of keys; GLM-5.3 with fp8: 22 x 132 of 54,728 = 5.3%);
- device pool: 4 full-length sessions (4 x (337 MLA pages of 16 tokens + 85 indexer-key pages of 64
  tokens)); indexer pages of 4 blocks keep the block count close to bytes (an indexer page is 16 KB
  here, an MLA page 72 KB) while prefix hits still end on the 64-token boundaries agentic traces hash;
- hot buffer 2 x top-k = 256 rows per request (16 blocks leased from the same pool);
- equal host bytes for both policies (enough for every session's KV): offload gets all of it as its
  host tier (a CPU prefix cache, kvcache.policies.offload: vLLM's offloading baseline); HiSparse splits it into
  its MLA pool and an ordinary offload pool for idle indexer keys;
- concurrency 4, 8, 16, 32 (max_num_seqs 32);
- a token budget (max_num_batched_tokens 8,192, vLLM's default for online serving) larger than a first
  turn, so a first turn prefills in one step and the running requests are bounded by KV memory, the
  thing under test. With a budget of 1,024 the first wave of 4,635-token prompts is budget-bound for a
  third of the run under either policy (3 decoding + 1 prefilling request); that run is kept in
  results/hisparse_vs_offload_budget1024 (HiSparse 10.7 vs offload 3.8 running requests on average,
  13-14 vs 4 once the first wave is through; measured when `offload` was the swap policy).

    python -m experiments.serve --config configs/ablations/hisparse_vs_offload.py --out results/hisparse_vs_offload
"""

from experiments.serve import default_config

SESSIONS_MAX = 32
SESSION_TOKENS = 4635 + 12 * 47 + 13 * 14  # 5,381
BLOCK = 16
SESSION_BLOCKS = -(-SESSION_TOKENS // BLOCK)  # 337
INDEX_BLOCK = 64
SESSION_INDEX_BLOCKS = -(-SESSION_TOKENS // INDEX_BLOCK)  # 85
MLA_BYTES_PER_TOKEN = 8 * 144 * 4  # 8 layers x (128 latent + 16 rope) float32
INDEX_BYTES_PER_TOKEN = 2 * 32 * 4  # 2 full layers x 32-wide float32 keys
HISPARSE_INDEX_BYTES = SESSIONS_MAX * SESSION_INDEX_BLOCKS * INDEX_BLOCK * INDEX_BYTES_PER_TOKEN
HOST_BYTES = SESSIONS_MAX * SESSION_BLOCKS * BLOCK * MLA_BYTES_PER_TOKEN + HISPARSE_INDEX_BYTES


def get_config():
    c = default_config()
    c.name = "hisparse_vs_offload"
    c.model.overrides = dict(index_topk=128, indexer_types=("full", "shared", "shared", "shared",
                                                            "full", "shared", "shared", "shared"))
    c.workload.sessions = SESSIONS_MAX  # trimmed to the concurrency by the sweep (see below)
    c.workload.scale = 1 / 16
    c.workload.turns = 13
    c.deploy.max_model_len = (SESSION_BLOCKS + 1) * BLOCK
    c.deploy.max_num_seqs = SESSIONS_MAX
    c.deploy.max_num_batched_tokens = 8192
    c.deploy.index_block_size = INDEX_BLOCK
    c.deploy.num_gpu_blocks = 4 * (SESSION_BLOCKS + SESSION_INDEX_BLOCKS)
    c.policy_deploy = dict(offload=dict(cpu_offload_bytes=HOST_BYTES),
                           hisparse=dict(cpu_offload_bytes=HISPARSE_INDEX_BYTES,
                                         hisparse_host_pool_bytes=HOST_BYTES - HISPARSE_INDEX_BYTES))
    c.sweep.kv_policy = ("offload", "hisparse")
    c.sweep.concurrency = (4, 8, 16, 32)
    c.sweep.sessions_per_user = 1  # sessions = concurrency: every user runs one 13-turn session
    # each point is served once untimed first (the default "replay"): a point compiling as it went
    # measured its compiles too (114 programs in HiSparse c=32's run at aef257a)
    return c
