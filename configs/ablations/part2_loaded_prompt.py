"""Ablation: Part 2 with each decode leg's prompt priced as vLLM's NIXL consumer serves it (issue 53).

vLLM's P/D decode (0.34.0 read) loads every prompt token the producer computed, its last partial page
included, and computes only the prompt's last token. This engine's decode leg takes the producer's full
pages below the last token and computes the rest: with configs/paper's 1,024-token indexer pages, from
its last 1,024-token boundary but one under MTP (docs/simulator.md, "Page layout: vLLM's and this
engine's"). Here every pair's decode engine schedules as in configs/paper/part2.py, but its forwards are
priced without the prompt rows below the last token (glm53.engine.pd_sim.PdPair, decode_prompt="loaded"),
and the producer's rows of the decode pages the prompt fills in part are read over the RDMA link. A
pricing ablation that reaches every pair, HiSparse's included; the prefill engines keep 1,024-token
indexer pages (their prefix hits end on 1,024-token boundaries, as in configs/paper, for every pair
alike). Everything else is configs/paper/part2.py's, but for a trace of three times its sessions: the
decode node runs so much faster here that at c64 part2.py's 512 top-level sessions ran out 3,479 s into
the 4,200 s a point needs. A point takes sessions in trace order and the trace is drawn in that order, so
a point that never reaches past part2.py's 512 runs the same with the longer trace.

    python -m experiments.serve --config configs/ablations/part2_loaded_prompt.py --out results/paper/part2_loaded_prompt
"""

from pathlib import Path

from experiments.common import load_config


def get_config():
    c = load_config(str(Path(__file__).parents[1] / "paper" / "part2.py"))
    c.name = "part2_loaded_prompt"
    c.pd.decode_prompt = "loaded"
    c.workload.sessions = 3 * c.workload.sessions
    return c
