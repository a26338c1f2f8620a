"""Ablation, not a published point: Part 1 at the 1M limit with sessions that grow toward 1M tokens
(configs/paper/part1.py's 1M point serves the published OpenHands conversations, which end at 86K tokens,
so the limit only admits requests there).

The same deployment, 128 conversations of 13 turns with the published first turn (74,160 tokens) and 220
output tokens per turn, but each later turn adds OPENHANDS_LATER_INPUT new tokens instead of 753, so the
last turn's prompt and output end just under max_model_len (1,048,576): the context a conversation
carries grows by about 81K tokens a turn. HiSparse only: offload cannot hold a 1M request (17,408 blocks
at once against the TP8 pool's 7,781; Engine refuses it).

    python -m experiments.serve --config configs/paper/part1_1m_growing.py --out results/paper/part1_1m_growing
"""

from pathlib import Path

from experiments.common import load_config

MAX_MODEL_LEN = 1_048_576
TURNS, FIRST_INPUT, OUTPUT = 13, 74_160, 220
# the largest multiple of 64 tokens a later turn can add with the last turn's prompt + output <= the limit
OPENHANDS_LATER_INPUT = (MAX_MODEL_LEN - FIRST_INPUT - TURNS * OUTPUT) // (TURNS - 1) // 64 * 64


def get_config():
    c = load_config(str(Path(__file__).with_name("part1.py")))  # configs are loaded by path, not imported
    c.name = "paper_part1_1m_growing"
    c.deploy.max_model_len = MAX_MODEL_LEN
    c.workload.openhands_later_input = OPENHANDS_LATER_INPUT
    c.sweep.kv_policy = ("hisparse",)
    return c
