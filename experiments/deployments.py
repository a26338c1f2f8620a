"""The published deployments (BRIEF §8), described once.

Each is a `Deployment`: one replica's `DeployConfig` (parallelism, KV policy, the published host pools, the
published KV layout and limits), how its weights are laid out, which step program it runs and its role.
The memory plan (experiments.memory_plan) plans the memory of these descriptions; the Part 1 and Part 2
configs (configs/paper/) build their engines from them, so the simulator runs them; and a deployment's
device KV budget is `kv_budget`: read from the memory plan's committed results, where it is derived
(usable HBM - weights - workspace - HiSparse's resolver state), never copied as a number.

    dep = published("dp8_ep8_decode", max_model_len=142_000, max_num_batched_tokens=8192)
    dep.deploy                     # its DeployConfig (no KV budget: DeployConfig sizes the pool from it)
    kv_budget(dep)                 # bytes per GPU, from results/memory_plan/results.json

Part 1 is one 8 x H200 node, TP8, HiSparse against offloading on the same host budget. Part 2 is P/D on
two nodes: the published PCP8 x DCP8 x EP8 prefill engine with 8 HiSparse decode ranks, and two baselines
on the same GPUs and host memory (`PART2_PAIRS`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from experiments.common import REPO

GiB = 1 << 30
LIMITS = (142_000, 1_048_576)  # BRIEF §8's two context limits ("142K" as vLLM's 142k, and 1M)
# BRIEF §8's KV format, and the page layout of this project's engine for it: 64-token MLA pages and
# 1,024-token indexer pages (21 layers x 1,024 x 132 B = 2.84 MB, about an MLA page's 78 x 64 x 656 B =
# 3.27 MB, so a block, priced at the larger page, is seldom half idle). vLLM's indexer pages are 64 tokens,
# so its prefix hits end on 64-token boundaries where these end on 1,024 (docs/simulator.md, "Page layout:
# vLLM's and this engine's"; configs/ablations/part2_vllm_pages.py emulates its layout)
LAYOUT = dict(kv_cache_dtype="fp8_ds_mla", block_size=64, index_block_size=1024, enable_prefix_caching=True)
PART1_LIMITS = dict(max_num_batched_tokens=32_768, max_num_seqs=256)  # BRIEF §8, Part 1
# Part 2's token budget per step: the brief gives no Part 2 batch limits; vLLM's API server defaults to
# 8,192 on an H100 / H200 (EngineArgs.get_batch_defaults), and at Part 1's 32,768 a DP8 rank's workspace
# leaves no pool (results/memory_plan)
PART2_BATCHED_TOKENS = 8192
PLAN_RESULTS = REPO / "results" / "memory_plan" / "results.json"


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One published deployment at one context limit.

    deploy: one replica's DeployConfig (limits, block layout, KV policy and host pools: the engine's).
    weights: how the weights are laid out: "tp" (parallel.tp over the replica's 8 GPUs), "ep" (every
        weight replicated but the routed experts, split over 8 GPUs: the context mesh's expert
        parallelism, and vLLM's DP + EP, where the 8 DP ranks form the expert group).
    program: the per-rank step program: "tp" (TP shard_map), "cp" (context mesh shard_map), "dp" (one
        device; its share of the routed experts under EP8).
    role: "aggregated" (prefill and decode), "prefill" (P/D prefill engine) or "decode" (P/D decode rank).
    replicas_per_node: replicas on one 8-GPU node (8 for DP ranks).
    plan_row: the memory plan row with its weights and step programs ("": its own name). A deployment
        that differs from a planned one only in its KV policy shares that row's weights and workspace."""

    name: str
    title: str
    deploy: object
    weights: str
    program: str
    role: str
    replicas_per_node: int
    ep: int = 8
    published: str = ""
    plan_row: str = ""

    @property
    def max_model_len(self) -> int:
        return self.deploy.max_model_len


# name -> (title, role, weights, program, replicas per node, DeployConfig fields of one replica, what BRIEF
# §8 says, the plan row it shares); host pools are the published budgets per replica
_PUBLISHED = {
    "tp8_hisparse": (
        "Part 1: TP8 with HiSparse (one node, aggregated)", "aggregated", "tp", "tp", 1,
        dict(tensor_parallel_size=8, kv_policy="hisparse", hisparse_host_pool_bytes=384 * GiB,
             cpu_offload_bytes=128 * GiB),
        "TP8, MTP3, FP8 KV, 142K, 32,768 batched tokens, 256 sequences; 384 GiB HiSparse host pool + 128 GiB "
        "offload", ""),
    "tp8_offload": (
        "Part 1 baseline: TP8 with offloading (one node, aggregated)", "aggregated", "tp", "tp", 1,
        dict(tensor_parallel_size=8, kv_policy="offload", cpu_offload_bytes=512 * GiB),
        "ordinary offloading with a 512 GiB pool (the same host budget)", "tp8_hisparse"),
    "pcp8_dcp8_ep8_prefill": (
        "Part 2 prefill: PCP8 x DCP8 x EP8 (one node)", "prefill", "ep", "cp", 1,
        dict(prefill_context_parallel_size=8, decode_context_parallel_size=8, enable_expert_parallel=True,
             kv_policy="offload", cpu_offload_bytes=512 * GiB),
        "one PCP8 x DCP8 x EP8 engine, 512 GiB CPU offload pool", ""),
    "dp8_ep8_decode": (
        "Part 2 decode: 8 DP ranks with EP8 and HiSparse (one node)", "decode", "ep", "dp", 8,
        dict(data_parallel_size=8, enable_expert_parallel=True, kv_policy="hisparse",
             hisparse_host_pool_bytes=48 * GiB, cpu_offload_bytes=16 * GiB),
        "8 DP ranks, HiSparse with 48 GiB host pool + 16 GiB offload per rank", ""),
    "dp8_ep8_offload_decode": (
        "Part 2 baseline decode: 8 DP ranks with EP8 and offloading (one node)", "decode", "ep", "dp", 8,
        dict(data_parallel_size=8, enable_expert_parallel=True, kv_policy="offload", cpu_offload_bytes=64 * GiB),
        "ordinary offloading on the decode node (the same 64 GiB of host memory per rank)", "dp8_ep8_decode"),
    "dp8_prefill": (
        "Part 2 baseline prefill: 8 DP ranks (EP8)", "prefill", "ep", "dp", 8,
        dict(data_parallel_size=8, enable_expert_parallel=True, kv_policy="offload", cpu_offload_bytes=64 * GiB),
        "DP8 prefill, 8 ranks x 64 GiB offload", ""),
}
NAMES = tuple(_PUBLISHED)
# Part 2's pairs of a prefill and a decode deployment (BRIEF §8): the published one and its two baselines
PART2_PAIRS = {"pcp_dcp+hisparse": ("pcp8_dcp8_ep8_prefill", "dp8_ep8_decode"),
               "dp+hisparse": ("dp8_prefill", "dp8_ep8_decode"),
               "pcp_dcp+offload": ("pcp8_dcp8_ep8_prefill", "dp8_ep8_offload_decode")}


def fields(name: str) -> dict:
    """The DeployConfig fields that make a replica of `name` (parallelism, KV policy, published host pools)."""
    if name not in _PUBLISHED:
        raise ValueError(f"unknown published deployment {name!r}; choose from {list(NAMES)}")
    return dict(_PUBLISHED[name][5])


def published(name: str, *, max_model_len: int, max_num_batched_tokens: int | None = None,
              max_num_seqs: int | None = None, host_scale: float = 1.0) -> Deployment:
    """`name` at one context limit, on the published layout with Part 1's batch limits unless given
    (max_num_batched_tokens / max_num_seqs); host_scale scales the host pools (tests of small presets)."""
    from glm53 import DeployConfig

    own = {k: int(v * host_scale) if k.endswith("_bytes") else v for k, v in fields(name).items()}
    title, role, weights, program, replicas, _, text, row = _PUBLISHED[name]
    limits = dict(PART1_LIMITS, max_model_len=max_model_len)
    if max_num_batched_tokens:
        limits["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs:
        limits["max_num_seqs"] = max_num_seqs
    return Deployment(name, title, DeployConfig(**LAYOUT, **limits, **own), weights, program, role, replicas,
                      published=text, plan_row=row)


def plan_row(name: str, max_model_len: int, max_num_batched_tokens: int | None = None,
             results: str | Path = PLAN_RESULTS) -> dict:
    """The memory plan's row of deployment `name` at `max_model_len` (and max_num_batched_tokens; None:
    the first such row, Part 1's batch) in a plan's results.json."""
    rows = json.loads(Path(results).read_text())["deployments"]
    for r in rows:
        if r["name"] == name and r["max_model_len"] == max_model_len and max_num_batched_tokens in (
                None, r.get("max_num_batched_tokens")):
            return r
    raise ValueError(f"memory plan {results} has no row {name!r} at max_model_len={max_model_len}"
                     + (f", max_num_batched_tokens={max_num_batched_tokens}" if max_num_batched_tokens else ""))


def kv_budget(dep: Deployment, results: str | Path = PLAN_RESULTS) -> int:
    """`dep`'s device KV budget per GPU (bytes) as the memory plan derives it: usable HBM - weights -
    workspace of its plan row (at its limit and batch), less HiSparse's resolver state when `dep` runs
    HiSparse (the planned pool itself for a planned deployment)."""
    d = dep.deploy
    row = plan_row(dep.plan_row or dep.name, d.max_model_len, d.max_num_batched_tokens, results)
    state = row.get("hisparse_state_bytes_per_gpu", 0) if d.kv_policy == "hisparse" else 0
    budget = row["usable_bytes"] - row["weights_bytes_per_gpu"] - row["workspace_bytes_per_gpu"] - state
    if budget <= 0:
        raise ValueError(f"memory plan {results}: {dep.name} at {d.max_model_len} leaves no KV pool")
    return int(budget)


def part1_kv_budgets(max_model_len: int = LIMITS[0], results: str | Path = PLAN_RESULTS) -> tuple[int, int]:
    """Part 1's device KV budgets per GPU (bytes), as the memory plan derives them: (the TP8 offload
    deployment's, which any policy without HiSparse gets on that node; the TP8 HiSparse one's: the same
    less HiSparse's resolver state)."""
    return tuple(kv_budget(published(name, max_model_len=max_model_len,
                                     max_num_batched_tokens=PART1_LIMITS["max_num_batched_tokens"]), results)
                 for name in ("tp8_offload", "tp8_hisparse"))


# what a simulated P/D pair (glm53.engine.pd_sim) adds to the published descriptions: pages that cover the
# same tokens on both sides (a DCP8 engine's block of 8 rows per rank covers 64 tokens, its indexer block of
# 128 keys per rank 1,024: other spans are served too, with the producer pages read priced, but the published
# figures were made with matched ones), and the prefill engines' sequences (a prefill engine holds a turn
# only while it computes it)
PD_DCP8_PAGES = dict(block_size=8, index_block_size=128)
PD_PREFILL_SEQS = 32


def part2_pd_deployments(max_model_len: int, max_num_batched_tokens: int = PART2_BATCHED_TOKENS,
                         results: str | Path = PLAN_RESULTS) -> dict:
    """experiments.serve's `pd.deployments` for Part 2 (`PART2_PAIRS`): {pair: {"prefill": DeployConfig
    fields, "decode": ..., "prefill_name", "decode_name"}}, each side a published deployment with the
    memory plan's KV budget (`kv_budget`) at this limit and batch, and what the simulated pair needs
    (`PD_DCP8_PAGES`, `PD_PREFILL_SEQS`)."""
    def side(name: str, **extra) -> dict:
        dep = published(name, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
        return dict(fields(name), **extra, kv_cache_memory_bytes=kv_budget(dep, results))

    out = {}
    for pair, (pre, dec) in PART2_PAIRS.items():
        pages = PD_DCP8_PAGES if fields(pre).get("decode_context_parallel_size", 1) > 1 else {}
        out[pair] = dict(prefill=side(pre, max_num_seqs=PD_PREFILL_SEQS, **pages), decode=side(dec),
                         prefill_name=pre, decode_name=dec)
    return out


def vllm_pages(side: dict, base, cfg) -> dict:
    """DeployConfig fields `side` (over the DeployConfig fields `base` for what it leaves out) with vLLM's
    page layout emulated (configs/ablations/*_vllm_pages.py): indexer pages of the MLA pages' span, so
    prefix hits end where vLLM's do (docs/simulator.md, "Page layout: vLLM's and this engine's"), and the
    device KV budget times 2 x MLA page / (MLA page + indexer page). This engine prices a block at the
    larger page and gives the groups separate blocks, so a token whose pages are all on the device then
    costs what it costs in vLLM's one group (both pages under one block id): the pool holds the tokens
    vLLM's holds. Exact at full residency only: under HiSparse, which keeps the indexer pages and
    releases MLA pages, each indexer page would cost an MLA page. The budget returned is already scaled:
    a later override of `kv_cache_memory_bytes` replaces it unscaled."""
    from kvcache.layout import page_bytes

    block = side.get("block_size", base.block_size)
    spec = side.get("speculative_config", base.get("speculative_config")) or {}
    mtp = spec.get("num_speculative_tokens") or side.get("num_speculative_tokens", base.get("num_speculative_tokens", 0))
    pages = page_bytes(cfg, side.get("kv_cache_dtype", base.kv_cache_dtype), block, block, include_mtp=mtp > 0)
    scale = 2 * pages["mla"] / (pages["mla"] + pages["indexer"])
    budget = side.get("kv_cache_memory_bytes", base.kv_cache_memory_bytes)
    return dict(side, index_block_size=block, kv_cache_memory_bytes=int(budget * scale))
