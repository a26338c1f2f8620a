"""Regenerate every figure of the published posts that this codebase can produce, in one command.

    python -m experiments.reproduce --out out/reproduce --quick     # < 10 minutes on 2 cores
    python -m experiments.reproduce --out out/reproduce             # full: hours (the Part 1 sweep, real ablations)
    python -m experiments.reproduce --list                          # the manifest

`MANIFEST` maps each figure id to the experiment and config that make it, the published values (with
their source) it is compared with, the doc that discusses it, and, where the capability is missing, the
issue it waits for. Kinds:
- "analytic": the performance model alone (experiments.roofline, experiments.calibrate); always run.
- "real": a laptop-scale run of the real engine (tiny model); run in both modes.
- "real_heavy": a laptop-scale real run too slow for --quick: --quick redraws its committed
  results.json (marked as such in the report), the full mode re-runs it.
- "sim": the H200-scale simulator (runner.kind="sim"); --quick runs it over a short window (the
  `quick` overrides: fewer sessions, turns and concurrency points), the full mode runs the config as is.
- "not_built": listed with what it waits for; nothing runs.
Ablations are "sim" entries whose config is a small diff (`overrides`) over a base config.

Writes OUT/reproduce.json (every entry: status, wall time, the files it wrote, the metrics compared)
and OUT/report.md (each figure's PNGs, a published-vs-ours table, what is not built and why). Each
entry's own outputs go to OUT/<figure id>/, with the experiment's usual results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
import traceback
from pathlib import Path

from experiments.common import REPO, cpu_name, git_revision, pin_revision
from experiments.deployments import part1_kv_budgets
from glm53.config import get_preset

GLM53_LAYERS = get_preset("glm-5.3").num_hidden_layers  # the IndexShare-off ablation makes every one "full"

TIERED_PUBLISHED = ("up to ~64 conversations all strategies alike; 64-128 throughput collapses without offload while "
                    "CPU offload holds; beyond 128 the storage tier keeps >2x the throughput of full recomputation",)

# the short window of every simulated entry under --quick (on top of its own overrides)
QUICK_SIM = ("--config.workload.sessions=8", "--config.workload.turns=2")


@dataclasses.dataclass(frozen=True)
class Entry:
    id: str
    title: str
    kind: str  # analytic | real | real_heavy | sim | not_built
    source: str  # where the published figure or claim is (BRIEF section, post)
    published: tuple[str, ...] = ()  # the published values or claims, verbatim from the source
    experiment: str = ""  # module under experiments/
    config: str = ""  # config file (serve) or "" (analytic)
    overrides: tuple[str, ...] = ()  # --config.KEY=VALUE over `config`
    quick: tuple[str, ...] = ()  # further overrides under --quick (sim entries also get QUICK_SIM)
    committed: str = ""  # committed results dir (real_heavy under --quick)
    doc: str = ""
    waits_for: str = ""  # issue that builds the missing part
    compare: tuple[str, ...] = ()  # result keys shown in the report's table
    note: str = ""
    files: tuple[str, ...] = ()  # analytic: the experiment's output files that are this figure
    hardware: tuple[str, ...] = ()  # sim: one run per hardware spec (runner.hardware), side by side


SERVE_KEYS = ("kv_policy", "concurrency", "max_model_len", "throughput_tok_s_per_gpu", "interactivity_tok_s_user",
              "ttft_median_s", "running_requests_mean", "preemptions", "prefix_hit_rate")
PART1 = "configs/paper/part1.py"
PART1_MTP3 = "configs/paper/part1_mtp3.py"
PART1_KV_BUDGETS = part1_kv_budgets()  # (offload's, HiSparse's): what configs/paper/part1.py takes
MTP_KEYS = ("spec_acceptance_length_mean", "spec_acceptance_rate_per_pos")
TIERED_H200 = "configs/paper/tiered_scaling_h200.py"
PART1_PUBLISHED = (
    "BRIEF §8 Part 1: GLM-5.3 on one 8 x H200 node, TP8, MTP3, FP8 KV, max model len 142K, 32,768 batched tokens, "
    "256 sequences; HiSparse (384 GiB HiSparse host pool + 128 GiB offload) against ordinary offloading (512 GiB); "
    "OpenHands sessions (13 turns, 74,160 first-turn tokens, 753 later, 220 output), 128 conversations, "
    "concurrency 1-32; metrics interactivity, throughput per GPU (cached input included), running requests.",
    "The brief gives no Part 1 numbers: the comparison is qualitative (which policy holds more running "
    "requests and throughput at equal host memory).")
NO_MTP = ("One token per decode step (num_speculative_tokens 0); the same sweep with MTP3 is part1_mtp3.")
PART2 = "configs/paper/part2.py"
PD_KEYS = ("kv_policy", "prefill", "decode", "concurrency", "throughput_tok_s_per_gpu",
           "interactivity_p90_e2e_tok_s_user", "ttft_median_s", "pd_received_tokens")
PART2_PUBLISHED = (
    "PCP8 x DCP8 prefill: higher interactivity at equal throughput and lower median TTFT than DP8 while "
    "prefill-bound (up to ~c32)", "beyond c32 HiSparse decode pulls ahead, nearly doubling throughput at c64")
PD_HTTP_KEYS = ("kv_policy", "concurrency", "throughput_tok_s_per_device", "interactivity_p90_e2e_tok_s_user",
                "ttft_median_s", "tpot_mean_s", "kv_transfer_received_tokens", "decode_h2d_bytes", "tokens_equal")
# --quick's one c32 point of each part, so the quick report shows each published comparison's direction:
# Part 1 serves 32 conversations of 2 turns (all at once); Part 2 a short window of short sessions, with
# enough of them that the pool stays full over it
PART1_QUICK = ("--config.sweep.concurrency=(32,)", "--config.workload.sessions=32")
PART2_QUICK = ("--config.sweep.concurrency=(32,)", "--config.workload.median_turns=4.0",
               "--config.workload.mean_input=20000.0", "--config.workload.sessions=192",
               "--config.sweep.window_warmup_s=30.0", "--config.sweep.window_s=120.0")
# Part 2 at 1M under --quick: c8 until the pool first runs short (no hour, no warm-up)
PART2_1M_QUICK = ("--config.sweep.concurrency=(8,)", "--config.workload.median_turns=4.0",
                  "--config.sweep.window_warmup_s=0.0", "--config.sweep.window_s=0.0")
PART2_NOTE = ("P/D in the simulator (glm53.engine.pd_sim): the decode ranks read the producer's chunks over a 43 GB/s "
              "RDMA NIC each; at 142K the mean input is 80K tokens (the published 142K mean cannot run under a 142K "
              "limit); each point is measured over a simulated hour while all `concurrency` sessions run, after a "
              "600 s warm-up (sweep.measure = 'steady', sweep.window_s, sweep.window_warmup_s; --quick: 120 s after "
              "30 s)")
SENSITIVITY_KEYS = ("value", "figure", "kv_policy", "concurrency", "throughput_tok_s_per_gpu", "interactivity_tok_s_user",
                    "running_requests_mean")
DCP_TP8 = ("--config.deploy.decode_context_parallel_size=8", "--config.sweep.kv_policy=('offload',)")
ABLATION_WINDOW = ("--config.sweep.concurrency=(8,)",)

MEASURED_ID = "part1_c32_h200_vs_measured"
MEASURED_TITLE = ("Part 1 at c32 priced on the published-table spec (h200) and on this codebase's kernels as measured "
                  "on an H200 (h200_measured), side by side")


def measured_entry() -> Entry:
    """Part 1 at concurrency 32 on `h200` and `h200_measured`: a simulated entry once a committed H200 run has
    registered h200_measured (`python -m experiments.calibrate --measured`), else not built, saying what it
    waits for (glm53.perfmodel.hardware.MEASURED_PENDING)."""
    from glm53.perfmodel.hardware import HARDWARE, MEASURED_PENDING

    if "h200_measured" not in HARDWARE:
        return Entry(MEASURED_ID, MEASURED_TITLE, "not_built", "issue 45", doc="docs/perfmodel.md",
                     waits_for="issue 45 (a complete H200 run of experiments.bench_gpu committed under "
                               "results/gpu_speed/, then experiments.calibrate --measured)", note=MEASURED_PENDING)
    return Entry(MEASURED_ID, MEASURED_TITLE, "sim", "BRIEF §8; issue 45", PART1_PUBLISHED, "serve", PART1,
                 overrides=("--config.sweep.concurrency=(32,)",), doc="docs/perfmodel.md",
                 compare=("hardware",) + SERVE_KEYS, hardware=("h200", "h200_measured"),
                 note="the same scheduler and workload priced on two specs: the published-table calibration and the "
                      "fit on this codebase's own kernels (results/gpu_speed)")


MANIFEST: tuple[Entry, ...] = (
    # ------------------------------------------------------------------ analytic (performance model)
    Entry("kv_bytes_and_context", "KV bytes per token, per-GPU KV vs context, longest context per DCP size",
          "analytic", "BRIEF §2", ("54,728 bytes per token", "53.4 GiB for 1,048,576 tokens; 6.7 GiB per GPU with DCP8",
                                    "PCP8 alone: about 250K tokens in ~15 GiB per GPU"),
          "roofline", doc="docs/perfmodel.md", files=("kv_bytes_by_component.png", "kv_per_gpu_vs_context.png"),
          compare=("kv_bytes_per_token", "kv_gib_for_1048576_tokens", "kv_gib_per_gpu_1048576_tokens_dcp8",
                   "max_context_tokens_pcp8_alone")),
    Entry("sparse_mla_intensity", "Sparse MLA arithmetic intensity vs heads per GPU", "analytic", "BRIEF §3",
          ("8 heads: about 26 FLOP/byte", "64 heads: about 191 FLOP/byte", "ridge point 206 FLOP/byte"),
          "roofline", doc="docs/perfmodel.md", files=("sparse_mla_intensity.png",),
          compare=("sparse_mla_intensity", "ridge_point_flop_per_byte")),
    Entry("indexer_vs_mla_crossover", "Indexer vs sparse-MLA prefill cost: FLOP and time crossovers", "analytic",
          "BRIEF §3", ("indexer quadratic, sparse MLA linear in prompt length; under TP8 the indexer is repeated on "
                       "every GPU, under PCP8 split (no crossover length published)",),
          "roofline", doc="docs/perfmodel.md", files=("indexer_vs_mla_flops.png",),
          compare=("crossover_prompt_len_tp8", "crossover_prompt_len_pcp8", "crossover_prompt_len_tp8_time",
                   "crossover_prompt_len_pcp8_time")),
    Entry("dcp8_prefill_overhead", "DCP8 all-gather overhead of a 2K-token PCP8 prefill chunk, 8K-1M cached",
          "analytic", "BRIEF §5", ("the all-gather costs time that grows with context length (published "
                                   "measurements not in the brief)",),
          "roofline", doc="docs/perfmodel.md", files=("dcp8_prefill_overhead.png",), compare=("dcp8_prefill_overhead",)),
    Entry("kernel_calibration", "Kernels and links: calibrated model vs published tables", "analytic",
          "DeepGEMM, FlashMLA, DeepEP, NCCL, vLLM (glm53/perfmodel/published.json)",
          ("the published kernel tables themselves (results/calibration/table.md)",), "calibrate",
          doc="docs/perfmodel.md", files=("table.md",), compare=("holdout_mean_abs_rel_error",)),
    # ------------------------------------------------------------------ laptop-scale real runs
    Entry("memory_plan", "Per-GPU memory of each published deployment: weights, workspace, KV pool, hot buffers, "
          "host pools", "real_heavy", "BRIEF §2, §6, §8",
          ("An H200 has about 15 GiB left for KV after GLM-5.3's FP8 weights (TP8) (BRIEF §2)",
           "hot buffer about 212 MB per request at GLM-5.3 scale (BRIEF §6)",
           "at 1M context a DP8 prefill rank cannot hold one request; PCP x DCP prefill can (BRIEF §8)"),
          "memory_plan", committed="results/memory_plan", doc="docs/memory.md",
          compare=("name", "max_model_len", "max_num_batched_tokens", "weights_bytes_per_gpu",
                   "workspace_bytes_per_gpu", "kv_pool_bytes_per_gpu", "hot_buffer_bytes_per_gpu", "fits"),
          note="full-size GLM-5.3 sized on CPU: eval_shape of the sharded fp8 model, XLA:CPU memory analysis of "
               "the step (no H200 measured)"),
    Entry("smoke", "The serve pipeline end to end (tiny model, 2 sessions)", "real", "-",
          (), "serve", "configs/smoke.py", doc="docs/engine.md", compare=SERVE_KEYS,
          note="a pipeline check, not a published figure"),
    Entry("preempt_vs_offload", "Preemption vs swap vs the offload host tier at laptop scale", "real_heavy", "BRIEF §7",
          ("with offload, throughput holds where recomputation collapses once device memory saturates",),
          "serve", "configs/ablations/preempt_vs_offload.py", committed="results/serve_preempt_vs_offload",
          doc="docs/engine.md", compare=SERVE_KEYS),
    Entry("tiered_offload_scaling", "Tiered offload scaling at laptop scale: recompute / device / + host / + host "
          "+ filesystem, 16-256 conversations", "real_heavy", "BRIEF §7", TIERED_PUBLISHED, "serve",
          "configs/ablations/tiered_scaling.py", committed="results/tiered_scaling", doc="docs/engine.md",
          compare=SERVE_KEYS, note="the published study used another model on 2 x H100: regimes, not numbers"),
    Entry("hisparse_vs_offload", "HiSparse vs offload at laptop scale", "real_heavy", "BRIEF §6, §8",
          ("HiSparse holds more running requests than offloading at the same host budget",),
          "serve", "configs/ablations/hisparse_vs_offload.py", committed="results/hisparse_vs_offload",
          doc="docs/engine.md", compare=SERVE_KEYS),
    Entry("hisparse_vs_offload_mtp3", "HiSparse vs offload with MTP3 (synthetic acceptance 2.99) at laptop scale, "
          "and the acceptance per draft position", "real_heavy", "BRIEF §6, §8 (issue 21 item 7)",
          ("both published deployments run MTP3; HiSparse holds more running requests than offloading",),
          "serve", "configs/ablations/hisparse_vs_offload_mtp3.py", committed="results/hisparse_vs_offload_mtp3",
          doc="docs/engine.md", compare=SERVE_KEYS + MTP_KEYS),
    Entry("hisparse_blocks_by_use", "What holds the device pool in the HiSparse vs offload ablation (indexer keys, "
          "MLA pages, hot buffers), replayed on the simulator's runner", "sim", "BRIEF §6 (issue 21 item 2)", (),
          "serve", "configs/ablations/hisparse_vs_offload.py", overrides=("--config.runner.kind=sim",),
          quick=("--config.sweep.concurrency=(16,)",), committed="results/hisparse_vs_offload_blocks", doc="docs/engine.md",
          compare=SERVE_KEYS + ("device_blocks_by_use_mean",),
          note="block decisions are the model runner's (no think time, no dependence on token values); the times "
               "are H200 prices of the tiny model"),
    # ------------------------------------------------------------------ H200 scale, simulated
    Entry("part1_142k", "Part 1: throughput vs interactivity, running requests (142K limit)", "sim", "BRIEF §8",
          PART1_PUBLISHED, "serve", PART1, quick=PART1_QUICK,
          committed="results/paper/part1", doc="docs/simulator.md", compare=SERVE_KEYS,
          note=NO_MTP + " Each point serves the 128 conversations start to end (sweep.measure = 'full'); --quick "
                        "serves 32 of 2 turns at c32"),
    Entry("part1_1m", "Part 1 at a 1M context limit (HiSparse; offload cannot hold a 1M request)", "sim", "BRIEF §8",
          PART1_PUBLISHED, "serve", PART1,
          overrides=("--config.deploy.max_model_len=1048576", "--config.sweep.kv_policy=('hisparse',)"),
          quick=("--config.sweep.concurrency=(1, 8)",), committed="results/paper/part1_1m", doc="docs/simulator.md",
          compare=SERVE_KEYS,
          note=NO_MTP + " The published conversations (they end at 86K tokens) under a 1M limit; sessions that grow "
               "toward 1M are part1_1m_growing. Offload is not swept: a 1M request needs 17,408 blocks at once and "
               "the TP8 pool (the memory plan's 23.7 GiB per GPU) has 7,781, so Engine refuses it; HiSparse needs its indexer keys, a chunk, its "
               "newest pages and a hot buffer (1,603 blocks)"),
    Entry("part1_1m_growing", "Ablation: Part 1 at a 1M limit with conversations that grow toward 1M tokens "
          "(80,960 new tokens a turn instead of 753; HiSparse)", "sim", "BRIEF §8 (not a published workload)", (),
          "serve", "configs/paper/part1_1m_growing.py", quick=("--config.sweep.concurrency=(1, 8)",),
          committed="results/paper/part1_1m_growing", doc="docs/simulator.md", compare=SERVE_KEYS,
          note=NO_MTP + " Not the published Part 1 workload (that is part1_1m): the last of 13 turns reaches "
               "1,048,540 tokens"),
    Entry("part1_mtp3", "Part 1 with MTP3 (synthetic acceptance length 2.99), 142K limit", "sim", "BRIEF §8",
          PART1_PUBLISHED, "serve", PART1_MTP3, quick=("--config.sweep.concurrency=(1, 8)",),
          committed="results/paper/part1_mtp3", doc="docs/simulator.md", compare=SERVE_KEYS + MTP_KEYS,
          note="MTP3 as published: 3 drafts, acceptance fixed at vLLM's synthetic 2.99 (per-position rates 1.0, "
               "0.99, 0.0; spec_acceptance_rate_per_pos reports the measured acceptance per draft position); HiSparse's hot "
               "buffer is (3 + 2) x top-k rows"),
    Entry("part1_mtp3_1m", "Part 1 with MTP3 at a 1M context limit (HiSparse; offload cannot hold a 1M request)",
          "sim", "BRIEF §8", PART1_PUBLISHED, "serve", PART1_MTP3,
          overrides=("--config.deploy.max_model_len=1048576", "--config.sweep.kv_policy=('hisparse',)"),
          quick=("--config.sweep.concurrency=(1, 8)",), committed="results/paper/part1_mtp3_1m",
          doc="docs/simulator.md", compare=SERVE_KEYS + MTP_KEYS,
          note="as part1_mtp3 at a 1M limit: a prefill chunk over host-only pages, the MTP layer's pass over it "
               "and the drafts after a prompt's last chunk stage only the rows they select, so a 1M request "
               "needs its indexer keys, a chunk, its newest pages and a (3 + 2) x top-k hot buffer on the "
               "device, not all of its KV (17,408 blocks against the pool's 7,628)"),
    Entry("tiered_offload_scaling_sim", "Tiered offload scaling at GLM-5.3 / H200 scale: recompute / device / + host "
          "/ + host + filesystem (one NVMe SSD), 16-256 conversations", "sim", "BRIEF §7", TIERED_PUBLISHED, "serve",
          TIERED_H200, quick=("--config.workload.sessions=256", "--config.workload.turns=4",
                              "--config.sweep.concurrency=(16, 64, 256)"),
          committed="results/tiered_scaling_h200", doc="docs/simulator.md", compare=SERVE_KEYS,
          note="the published study used Qwen3.6-35B-A3B on 2 x H100: regimes, not numbers. --quick keeps the "
               "workload (the regimes need 256 conversations of 4 turns) and runs 3 of the 8 points"),
    # ablations the posts imply: one knob over the Part 1 base (simulated)
    Entry("ablation_kv_policy", "HiSparse vs offload vs preemption (Part 1 base)", "sim", "BRIEF §6-8", (),
          "serve", PART1, overrides=("--config.sweep.kv_policy=('hisparse', 'offload', 'preempt')",),
          quick=ABLATION_WINDOW, doc="docs/simulator.md", compare=SERVE_KEYS),
    Entry("ablation_hot_buffer", "HiSparse hot-buffer size: 2,048 rows (= top-k) instead of 2 x top-k", "sim",
          "BRIEF §6", (), "serve", PART1,
          overrides=("--config.sweep.kv_policy=('hisparse',)", "--config.deploy.hisparse_device_buffer_size=2048"),
          quick=ABLATION_WINDOW, doc="docs/engine.md", compare=SERVE_KEYS,
          note="the simulator's hot-buffer misses are an assumed fraction (runner.hisparse_miss_fraction)"),
    Entry("ablation_host_pool", "HiSparse host pool halved (192 GiB)", "sim", "BRIEF §8", (), "serve", PART1,
          overrides=("--config.sweep.kv_policy=('hisparse',)",
                     "--config.policy_deploy.hisparse.hisparse_host_pool_bytes=206158430208"),
          quick=ABLATION_WINDOW, doc="docs/engine.md", compare=SERVE_KEYS),
    Entry("ablation_device_pool", "Device KV budget doubled (2 x the memory plan's, per GPU)", "sim", "BRIEF §2", (),
          "serve", PART1, overrides=("--config.deploy.kv_cache_memory_bytes=%d" % (2 * PART1_KV_BUDGETS[0]),
                                     "--config.policy_deploy.hisparse.kv_cache_memory_bytes=%d" % (2 * PART1_KV_BUDGETS[1])),
          quick=ABLATION_WINDOW,
          doc="docs/simulator.md", compare=SERVE_KEYS),
    Entry("ablation_dcp_backend_ag_rs", "TP8 x DCP8 decode, ag_rs merge (offload policy)", "sim", "BRIEF §5", (),
          "serve", PART1, overrides=DCP_TP8 + ("--config.deploy.dcp_comm_backend='ag_rs'",), quick=ABLATION_WINDOW,
          doc="docs/parallel.md", compare=SERVE_KEYS, note="HiSparse under DCP is not built (one device so far)"),
    Entry("ablation_dcp_backend_a2a", "TP8 x DCP8 decode, a2a merge (offload policy)", "sim", "BRIEF §5", (),
          "serve", PART1, overrides=DCP_TP8 + ("--config.deploy.dcp_comm_backend='a2a'",), quick=ABLATION_WINDOW,
          doc="docs/parallel.md", compare=SERVE_KEYS),
    Entry("ablation_dp8", "DP8 (EP8) instead of TP8 (offload policy)", "sim", "BRIEF §8 Part 2 baseline", (),
          "serve", PART1, overrides=("--config.deploy.tensor_parallel_size=1", "--config.deploy.data_parallel_size=8",
                                     "--config.deploy.enable_expert_parallel=True", "--config.sweep.kv_policy=('offload',)"),
          quick=ABLATION_WINDOW, doc="docs/parallel.md", compare=SERVE_KEYS,
          note="each rank keeps Part 1's TP8 KV budget (the memory plan's 23.7 GiB), not a DP8 rank's (the plan's DP8 rows)"),
    Entry("ablation_pcp8_dcp8", "PCP8 x DCP8 x EP8 instead of TP8 (offload policy)", "sim", "BRIEF §4-5, §8", (),
          "serve", PART1, overrides=("--config.deploy.tensor_parallel_size=1",
                                     "--config.deploy.prefill_context_parallel_size=8",
                                     "--config.deploy.decode_context_parallel_size=8",
                                     "--config.deploy.enable_expert_parallel=True", "--config.sweep.kv_policy=('offload',)"),
          quick=ABLATION_WINDOW, doc="docs/parallel.md", compare=SERVE_KEYS),
    Entry("ablation_indexshare_off", "IndexShare off: every layer runs its own indexer", "sim", "BRIEF §1", (),
          "serve", PART1, overrides=("--config.sweep.kv_policy=('hisparse',)",
                                     "--config.model.overrides={'indexer_types': %r}" % (("full",) * GLM53_LAYERS,),
                                     "--config.deploy.index_block_size=256"),
          quick=ABLATION_WINDOW, doc="docs/perfmodel.md", compare=SERVE_KEYS,
          note="with every layer's indexer keys a 1,024-token indexer page (78 x 1,024 x 132 B = 10.5 MB) would be "
               "3x an MLA page, so this run uses 256-token indexer pages (2.6 MB; a block is the larger page, "
               "3.27 MB): a 142K request takes 2,774 of the 7,726 blocks"),
    Entry("ablation_vllm_pages_part1", "vLLM's page layout emulated: Part 1's offload baseline with 64-token indexer "
          "pages (prefix hits on 64-token boundaries, the pool holding the tokens vLLM's holds)", "sim",
          "vLLM 0.34 source (docs/simulator.md)", (), "serve", "configs/ablations/part1_vllm_pages.py",
          quick=PART1_QUICK, committed="results/paper/part1_vllm_pages", doc="docs/simulator.md", compare=SERVE_KEYS,
          note="configs/paper page indexer keys at 1,024 tokens, vLLM at 64; emulated only without HiSparse "
               "(experiments.deployments.vllm_pages)"),
    Entry("ablation_vllm_pages_part2", "vLLM's page layout emulated: Part 2's pcp_dcp+offload pair with 64-token "
          "indexer pages on both engines, c8-c64", "sim", "vLLM 0.34 source (docs/simulator.md)", (), "serve",
          "configs/ablations/part2_vllm_pages.py", quick=PART2_QUICK, committed="results/paper/part2_vllm_pages",
          doc="docs/simulator.md", compare=PD_KEYS,
          note="as ablation_vllm_pages_part1, for the P/D pair whose decode runs without HiSparse; " + PART2_NOTE),
    Entry("ablation_part2_loaded_prompt", "Part 2 with each decode leg's prompt priced as vLLM's NIXL consumer "
          "serves it (every prompt token but the last loaded), every pair, c8-c64", "sim",
          "vLLM 0.34 source (docs/simulator.md)", (), "serve", "configs/ablations/part2_loaded_prompt.py",
          quick=PART2_QUICK, committed="results/paper/part2_loaded_prompt", doc="docs/simulator.md", compare=PD_KEYS,
          note="a pricing ablation (glm53.engine.pd_sim.PdPair decode_prompt='loaded'): the decode engines schedule "
               "as in part2_pd_142k, their forwards are priced without the prompt rows below the last token; "
               + PART2_NOTE),
    # ------------------------------------------------------------------ P/D (issue 23), simulated
    Entry("part2_pd_142k", "Part 2: P/D disaggregated, PCP8 x DCP8 prefill + DP8 HiSparse decode vs DP8 prefill "
          "and offload decode, 142K, c8-c64", "sim", "BRIEF §8 Part 2",
          PART2_PUBLISHED, "serve", PART2, quick=PART2_QUICK, committed="results/paper/part2", doc="docs/simulator.md",
          compare=PD_KEYS, note=PART2_NOTE + ". --quick's c32 point (sessions of 20K tokens, 120 s) shows the prefill "
          "comparison (TTFT) but not the decode one, which needs full contexts over the hour: results/paper/part2 "
          "and, with each decode prompt priced as vLLM's consumer serves it, results/paper/part2_loaded_prompt"),
    Entry("part2_pd_laptop", "Part 2 at laptop scale over HTTP: PCP2 x DCP2 prefill + HiSparse decode vs DP prefill "
          "+ offload decode, router + prefill + decode processes, c1-c4", "real_heavy", "BRIEF §8 Part 2",
          PART2_PUBLISHED, "pd_http", committed="results/paper/part2_laptop", doc="docs/engine.md", compare=PD_HTTP_KEYS,
          note="the tiny model on 4 simulated devices (the decode side one DP2 x EP2 server) sharing 2 cores "
                    "with 3-4 processes: it shows the mechanisms "
               "(KV received over the PdConnector, equal greedy tokens), not H200 speed (that is part2_pd_142k)"),
    Entry("part2_pd_1m", "Part 2 at 1M context: PCP8 x DCP8 prefill + DP8 HiSparse decode, c8-c32", "sim",
          "BRIEF §8 Part 2", ("only PCP x DCP prefill + HiSparse decode can serve a 1M request at all",),
          "serve", "configs/paper/part2_1m.py", quick=PART2_1M_QUICK,
          committed="results/paper/part2_1m", doc="docs/simulator.md", compare=PD_KEYS,
          note="every engine at 8,192 batched tokens (the PCP8 x DCP8 x EP8 pool is 15.93 GiB there, 2.3 GiB at "
               "32,768: results/memory_plan); the decode ranks' 64 GiB host split 52 + 12 GiB (a 1M request's MLA "
               "pages are 50.6 GiB). The engine refuses DP8 prefill and offload decode at 1M "
               "(tests/engine/test_pd_sim.py), so only pcp_dcp+hisparse is swept"),
    measured_entry(),
    *(Entry(f"sensitivity_{knob}", f"Sensitivity of Part 1 (c32, 142K and 1M) and Part 2 (c64) to {knob}", "sim",
            "issue 53 item 2", (), "sensitivity", doc="docs/simulator.md", compare=SENSITIVITY_KEYS,
            note="each point over a window of simulated time (experiments.sensitivity); --quick: the default and "
                 "one other value over a 60 s window, Part 1 at 142K (expert_skew, which Part 1's TP8 does not "
                 "feel: Part 2 at c8)")
      for knob in ("hisparse_miss_fraction", "step_overhead_s", "kv_budget", "expert_skew", "host_copy_overlap")),
    # ------------------------------------------------------------------ not built yet
    Entry("ablation_mtp_topk_reuse", "MTP layer reusing the target's top-k (54,596 B/token) vs its own indexer",
          "not_built", "BRIEF §2", ("54,596 bytes per token with index_share_for_mtp_iteration",),
          waits_for="issue 21 (HiSparse beyond the pool, MTP)"),
)


def _run_entry(e: Entry, out: Path, quick: bool, cache: dict) -> dict:
    """Run one entry into out/ -> {status, files, metrics, ...}."""
    if e.kind == "not_built":
        return {"status": "not built", "waits_for": e.waits_for}
    out.mkdir(parents=True, exist_ok=True)
    if e.kind == "analytic":
        if e.experiment not in cache:  # one roofline run serves every roofline figure
            from experiments import calibrate, roofline

            d = out.parent / f"_{e.experiment}"
            mod = {"roofline": roofline, "calibrate": calibrate}[e.experiment]
            mod.main(["--out", str(d)])
            cache[e.experiment] = d
        d = cache[e.experiment]
        main_json = "roofline.json" if e.experiment == "roofline" else "gemm.json"
        for f in (main_json, *e.files):
            shutil.copy(d / f, out / f)
        res = json.loads((out / main_json).read_text())
        return {"status": "ran", "metrics": {k: res.get(k) for k in e.compare}}
    if e.experiment == "memory_plan":  # compiles for minutes: --quick reuses the committed programs' analyses
        from experiments import memory_plan

        argv = ["--out", str(out)] + (["--reuse-programs", str(REPO / e.committed / "results.json")] if quick else [])
        res = memory_plan.main(argv)
        return {"status": "ran" + (f" (step programs' memory analyses reused from committed {e.committed}/results.json)"
                                   if quick else ""),
                "runs": [{k: r.get(k) for k in e.compare} for r in res["deployments"]]}
    if e.kind == "real_heavy" and quick:
        res = json.loads((REPO / e.committed / "results.json").read_text())
        if e.experiment == "pd_http":  # its own figure
            from experiments import pd_http

            pd_http.plot(res, out / "pd_http.png")
        else:
            from experiments.serve import plot

            plot(res["runs"], out)
        (out / "results.json").write_text(json.dumps(res, indent=1))
        return {"status": f"redrawn from committed {e.committed}/results.json ({res.get('date', '?')}, "
                          f"commit {str(res.get('git_revision', '?'))[:10]})", "runs": _runs(res, e)}
    if e.experiment == "sensitivity":  # one knob of the sweep, its own runs
        from experiments import sensitivity

        knob = e.id.removeprefix("sensitivity_")
        res = sensitivity.main(["--out", str(out), "--knobs", knob, *(["--quick"] if quick else [])])
        return {"status": "ran" + (" (short window)" if quick else ""),
                "runs": [{k: r.get(k) for k in e.compare} for r in res["knobs"][knob]]}
    if e.experiment == "pd_http":  # its own processes (router, prefill and decode servers)
        from experiments import pd_http

        return {"status": "ran", "runs": _runs(pd_http.main(["--out", str(out), "--fit-each-point"]), e)}
    from experiments import serve

    argv = ["--config", e.config, "--out", str(out), "--no-progress", *e.overrides]
    if quick:
        argv += [*(QUICK_SIM if e.kind == "sim" else ()), *e.quick]
    status = "ran" + (" (short window)" if quick and e.kind == "sim" else "")
    if e.hardware:  # one run per spec, side by side
        runs = []
        for hw in e.hardware:
            res = serve.main([*argv[:3], str(out / hw), *argv[4:], f"--config.runner.hardware={hw}"])
            runs += [{**r, "hardware": hw} for r in _runs(res, e)]
        return {"status": status, "argv": argv, "runs": runs}
    return {"status": status, "argv": argv, "runs": _runs(serve.main(argv), e)}


def _runs(res: dict, e: Entry) -> list[dict]:
    return [{k: r.get(k) for k in e.compare} for r in res["runs"]]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, (dict, list)):
        s = json.dumps(v)
        return s if len(s) < 160 else s[:157] + "..."
    return str(v)


def report(entries: list[tuple[Entry, dict]], out: Path, quick: bool, meta: dict) -> str:
    lines = [f"# Reproduction report ({'quick' if quick else 'full'})", "",
             f"{meta['date']}, commit {meta['git_revision']}, {meta['machine']['cpu']} x {meta['machine']['cpu_count']}; "
             f"{meta['wall_s']:.0f} s. `python -m experiments.reproduce --out {out}{' --quick' if quick else ''}`.", "",
             "Simulated entries run the real scheduler and policies at GLM-5.3 scale on the calibrated H200 spec "
             "(docs/simulator.md lists what is assumed)." + (
                 " Under --quick they serve a short window (8 sessions, 2 turns, few concurrency points; Part 1 "
                 "and Part 2 one c32 point each, 32 conversations of 2 turns and 120 simulated seconds of short "
                 "sessions): the mechanisms and the direction of each comparison, not the published sweep."
                 if quick else ""),
             "", "| figure | kind | status | doc | waits for |", "|---|---|---|---|---|"]
    for e, r in entries:
        lines.append(f"| [{e.id}](#{e.id}) | {e.kind} | {r['status']} | {e.doc or '-'} | {e.waits_for or '-'} |")
    for e, r in entries:
        lines += ["", f"## {e.id}", "", f"**{e.title}** ({e.kind}; source: {e.source})", ""]
        if e.published:
            lines += ["Published:", *[f"- {p}" for p in e.published], ""]
        if e.note:
            lines += [f"Note: {e.note}", ""]
        lines.append(f"Status: {r['status']}" + (f" ({r['error']})" if "error" in r else ""))
        if r.get("argv"):
            lines += ["", f"`python -m experiments.serve {' '.join(r['argv'])}`"]
        pngs = sorted((out / e.id).glob("*.png")) if (out / e.id).exists() else []
        lines += [""] + [f"![{p.stem}]({e.id}/{p.name})" for p in pngs]
        if r.get("metrics"):
            lines += ["", "| key | ours |", "|---|---|", *[f"| {k} | {_fmt(v)} |" for k, v in r["metrics"].items()]]
        if r.get("runs"):
            keys = list(e.compare)
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(run.get(k)) for k in keys) + " |" for run in r["runs"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/reproduce")
    ap.add_argument("--quick", action="store_true", help="short simulation windows; heavy real runs redrawn")
    ap.add_argument("--only", default="", help="comma-separated figure ids (default: all)")
    ap.add_argument("--list", action="store_true", help="print the manifest and exit")
    args = ap.parse_args(argv)
    if args.list:
        for e in MANIFEST:
            print(f"{e.id:28s} {e.kind:10s} {e.config or e.experiment or '-':40s} {e.waits_for}")
        return {}
    ids = [s for s in args.only.split(",") if s]
    unknown = set(ids) - {e.id for e in MANIFEST}
    if unknown:
        ap.error(f"unknown figure ids {sorted(unknown)}; see --list")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    revision = git_revision()  # the code this run runs, before its entries write their results into the tree
    pin_revision(revision)  # and what every entry records
    done, cache = [], {}
    try:
        for e in MANIFEST:
            if ids and e.id not in ids:
                continue
            t = time.perf_counter()
            print(f"[reproduce] {e.id} ({e.kind})", flush=True)
            try:
                r = _run_entry(e, out / e.id, args.quick, cache)
            except Exception as exc:  # one broken entry is reported, the others still run
                r = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                print(r["traceback"], flush=True)
            r["wall_s"] = time.perf_counter() - t
            done.append((e, r))
    finally:
        pin_revision(None)
    meta = {"date": time.strftime("%Y-%m-%d"), "git_revision": revision, "quick": args.quick,
            "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count()}, "wall_s": time.perf_counter() - t0}
    for d in cache.values():
        shutil.rmtree(d, ignore_errors=True)
    result = {**meta, "figures": [{**dataclasses.asdict(e), **r} for e, r in done]}
    (out / "reproduce.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.md").write_text(report(done, out, args.quick, meta))
    failed = [e.id for e, r in done if r["status"] == "failed"]
    print(f"wrote {out / 'report.md'} and {out / 'reproduce.json'} in {meta['wall_s']:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
