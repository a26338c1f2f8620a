"""Analytic figures of GLM-5.3 serving on H200, from the performance model (glm53/perfmodel/) on the calibrated
H200 spec (`H200_CALIBRATED`; the datasheet spec's time-dependent values are repeated under `datasheet_spec`).

    python -m experiments.roofline --out results/roofline

Pure arithmetic over the model config and `HardwareSpec` (no GPU, about a second). Writes
OUT/roofline.json (units in key names; every formula is in docs/perfmodel.md) and five PNGs:
- kv_bytes_by_component.png: KV bytes per token by cache component;
- kv_per_gpu_vs_context.png: per-GPU KV vs context for DCP 1..16 against the KV budget, and the longest
  context per GPU each DCP size allows;
- sparse_mla_intensity.png: FLOP/byte of sparse MLA vs heads per GPU against the ridge point;
- indexer_vs_mla_flops.png: cumulative per-GPU indexer and sparse-MLA prefill FLOPs vs prompt length under
  TP8 and PCP8, with the crossovers (`crossover_prompt_len_tp8`, `crossover_prompt_len_pcp8`);
- dcp8_prefill_overhead.png: (step with DCP8 - without) / without for a 2K-token chunk on a PCP8 engine
  against cached contexts of 8K..1M tokens (`dcp8_prefill_overhead`): under vLLM's schedule (its bf16-shard
  gather, nothing overlapped) and the ablation: each gather form never overlapped or prefetched a layer ahead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

from experiments.bench_model import cpu_name, git_revision
from glm53 import perfmodel as pm
from glm53.config import get_preset
from kvcache.layout import index_key_bytes, kv_bytes_per_token, mla_row_bytes

DCP_SIZES = (1, 2, 4, 8, 16)
# keys whose values depend on the spec's efficiencies (repeated under "datasheet_spec")
DATASHEET_KEYS = ("dcp8_prefill_overhead", "dcp8_prefill_step_breakdown_s", "crossover_prompt_len_tp8_time",
                  "crossover_prompt_len_tp8_padded_time", "crossover_prompt_len_pcp8_time",
                  "flashmla_sparse_decode_prediction_tflops", "ridge_point_achievable_flop_per_byte",
                  "sparse_mla_decode_us_per_layer_vs_batch")
DECODE_BATCHES = (1, 8, 32, 64, 128, 256, 512)
N_GPUS = 8  # one H200 node: TP8 or PCP8
OVERLAP_NOTE = (
    "overhead_frac_vllm: vLLM's schedule (docs/perfmodel.md 'The DCP gather as vLLM schedules it'): per layer "
    "the rank up-converts its shard of the request (cached + new tokens) to bf16, all-gathers those rows "
    "(1,152 B a token) with a blocking collective on the compute stream, then runs attention; the indexer "
    "scores the rank's key shard and merges top-k candidates; nothing overlaps (StepCost.time_s('none')). "
    "overhead_frac_vllm_dcp_prefetch: the same bytes with each layer's gather hidden behind the previous "
    "layer's kernels (time_s('dcp_prefetch'), a lower bound no vLLM code path reaches). overhead_frac / "
    "overhead_frac_dcp_prefetch: the fp8_rows form (this project's engine: the cached context's fp8 cache rows "
    "and indexer keys gathered, the whole context up-converted), never overlapped / prefetched. Both engines: "
    "PCP8 x EP8 on one 8-GPU node, 2N-chunk load-balanced query split, MTP layer included, fp8 KV and fp8 "
    "weights; the DCP8 engine stores 1/8 of the cache."
)


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


def _indexer_and_mla_s(cfg, hw: pm.HardwareSpec, prompt_len: float, layout: str, pad: bool) -> tuple[float, float]:
    par = {"tp": dict(tp=N_GPUS), "pcp": dict(pcp=N_GPUS)}[layout]
    by = pm.prefill_step(cfg, hw, int(prompt_len), 0, pad_heads=pad, **par).by_name()
    idx = sum(by[n].time_s for n in ("indexer_scores", "indexer_topk") if n in by)
    return idx, sum(c.time_s for n, c in by.items() if n.startswith("sparse_mla"))  # with the fp8 up-convert


def time_crossover(cfg, hw: pm.HardwareSpec, layout: str, pad: bool = False, lo: float = 2048,
                   hi: float = 2**26) -> float | None:
    """Prompt length (tokens, to 0.1%) where the indexer's time equals sparse MLA's in a whole-prompt
    prefill (`pm.prefill_step`, one chunk); None if the indexer is not yet slower at `hi` tokens."""
    def gap(n):
        i, m = _indexer_and_mla_s(cfg, hw, n, layout, pad)
        return i - m
    if gap(lo) >= 0:
        return lo
    if gap(hi) < 0:
        return None
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return (lo * hi) ** 0.5


def compute(cfg, hw: pm.HardwareSpec, *, kv_budget_bytes: float, chunk_tokens: int, block_size: int) -> dict:
    bpt = kv_bytes_per_token(cfg)
    one_m = 2**20
    res: dict = {
        "kv_bytes_per_token": bpt,
        "kv_bytes_per_token_by_component": pm.kv_bytes_by_component(cfg),
        "kv_gib_for_1048576_tokens": pm.kv_bytes_per_gpu(cfg, one_m) / pm.GiB,
        "kv_gib_per_gpu_1048576_tokens_dcp8": pm.kv_bytes_per_gpu(cfg, one_m, 8) / pm.GiB,
        "kv_budget_gib_per_gpu": kv_budget_bytes / pm.GiB,
    }

    # Per-GPU KV vs context, and the longest context per GPU budget.
    contexts = _powers_of_two(8192, one_m)
    res["kv_gib_per_gpu_vs_context"] = {
        "context_tokens": contexts,
        **{f"dcp{n}": [pm.kv_bytes_per_gpu(cfg, c, n) / pm.GiB for c in contexts] for n in DCP_SIZES},
    }
    res["max_context_tokens"] = {f"dcp{n}": pm.max_context_tokens(cfg, kv_budget_bytes, n) for n in DCP_SIZES}
    res["max_context_tokens_whole_blocks"] = {
        f"dcp{n}": pm.max_context_tokens(cfg, kv_budget_bytes, n, block_size=block_size) for n in DCP_SIZES}
    res["max_context_tokens_pcp8_alone"] = res["max_context_tokens"]["dcp1"]
    res["weights_gib_per_gpu"] = {"tp8_ep8": pm.weight_bytes_per_gpu(cfg, tp=8, ep=8) / pm.GiB,
                                  "pcp8_ep8": pm.weight_bytes_per_gpu(cfg, tp=1, ep=8) / pm.GiB}

    # Arithmetic intensity of sparse MLA vs heads per GPU.
    res["sparse_mla_intensity"] = {
        "heads_8": pm.sparse_mla_intensity(cfg, 8, hw=hw),
        "heads_64": pm.sparse_mla_intensity(cfg, 64, hw=hw),
        "heads_8_padded_to_kernel": pm.sparse_mla_intensity(cfg, 8, hw=hw, pad_heads=True),
        "curve": [{"heads": h,
                   "useful_flop_per_byte": pm.sparse_mla_intensity(cfg, h, hw=hw)["useful_flop_per_byte"],
                   "padded_executed_flop_per_byte":
                       pm.sparse_mla_intensity(cfg, h, hw=hw, pad_heads=True)["executed_flop_per_byte"]}
                  for h in (1, 2, 4, 8, 16, 32, 64, 128)],
        "flops_per_row_per_head": pm.sparse_mla_flops_per_row_head(cfg),
        "qo_bytes_per_head": pm.sparse_mla_qo_bytes_per_head(cfg),
    }
    res["ridge_point_flop_per_byte"] = hw.ridge_point("bf16")
    res["ridge_point_achievable_flop_per_byte"] = hw.ridge_point("bf16", achievable=True)
    res["ridge_point_fp8_flop_per_byte"] = hw.ridge_point("fp8")

    # Indexer vs sparse-MLA prefill FLOPs per GPU and the crossovers.
    for layout, key in (("tp", "tp8"), ("pcp", "pcp8")):
        res[f"crossover_prompt_len_{key}"] = pm.crossover_prompt_len(cfg, layout, N_GPUS, hw=hw)
        res[f"crossover_prompt_len_{key}_padded"] = pm.crossover_prompt_len(cfg, layout, N_GPUS, padded=True, hw=hw)
    res["crossover_without_mtp_layer"] = {
        f"crossover_prompt_len_{key}{suffix}": pm.crossover_prompt_len(cfg, layout, N_GPUS, padded=pad,
                                                                         include_mtp=False, hw=hw)
        for layout, key in (("tp", "tp8"), ("pcp", "pcp8")) for pad, suffix in ((False, ""), (True, "_padded"))}
    rows = []
    for length in _powers_of_two(1024, one_m):
        row = {"prompt_len": length}
        for layout, key in (("tp", "tp8"), ("pcp", "pcp8")):
            idx, mla = pm.prefill_flops_per_gpu(cfg, length, layout, N_GPUS, hw=hw)
            _, mla_pad = pm.prefill_flops_per_gpu(cfg, length, layout, N_GPUS, padded=True, hw=hw)
            row.update({f"{key}_indexer_flops": idx, f"{key}_sparse_mla_flops": mla,
                        f"{key}_sparse_mla_flops_padded": mla_pad})
        rows.append(row)
    res["prefill_flops_per_gpu_vs_prompt_len"] = rows

    # The same crossover in time: the prompt length at which a whole-prompt prefill spends as long in
    # the indexer (scores + top-k) as in sparse MLA, per GPU, on this spec (one chunk, no cached context).
    for layout, key, pad in (("tp", "tp8", False), ("tp", "tp8_padded", True), ("pcp", "pcp8", False)):
        res[f"crossover_prompt_len_{key}_time"] = time_crossover(cfg, hw, layout, pad)

    # Per-step overhead of DCP8's per-layer all-gather in a PCP8 prefill step.
    fits = pm.max_context_tokens(cfg, kv_budget_bytes, 1)
    overhead, breakdown = [], {}
    for ctx in contexts:
        base = pm.prefill_step(cfg, hw, chunk_tokens, ctx, pcp=N_GPUS)
        dcp = pm.prefill_step(cfg, hw, chunk_tokens, ctx, pcp=N_GPUS, dcp=8)
        vllm = pm.prefill_step(cfg, hw, chunk_tokens, ctx, pcp=N_GPUS, dcp=8, dcp_gather="bf16_shard")
        t0, t1, t1p = base.time_s(), dcp.time_s(), dcp.time_s("dcp_prefetch")
        tv, tvp = vllm.time_s(), vllm.time_s("dcp_prefetch")
        gather, vgather = dcp.by_name()[pm.DCP_GATHER], vllm.by_name()[pm.DCP_GATHER]
        overhead.append({"cached_context": ctx, "overhead_frac": (t1 - t0) / t0,
                         # max(0, .): the fp8_rows form never shortens a step; only float rounding goes below 0
                         "overhead_frac_dcp_prefetch": max(0.0, (t1p - t0) / t0),
                         # the bf16_shard form can: its rank up-converts 1/8 of the context (no clamp)
                         "overhead_frac_vllm": (tv - t0) / t0, "overhead_frac_vllm_dcp_prefetch": (tvp - t0) / t0,
                         "step_s_without_dcp": t0, "step_s_with_dcp8": t1, "step_s_with_dcp8_prefetch": t1p,
                         "step_s_with_dcp8_vllm": tv, "step_s_with_dcp8_vllm_prefetch": tvp,
                         "dcp_gather_s": gather.time_s, "dcp_gather_nvlink_bytes_per_gpu": gather.nvlink_bytes,
                         "dcp_gather_s_vllm": vgather.time_s,
                         "dcp_gather_nvlink_bytes_per_gpu_vllm": vgather.nvlink_bytes,
                         "without_dcp_kv_fits_budget": ctx + chunk_tokens <= fits})
        if ctx in (contexts[0], contexts[-1]):
            breakdown[str(ctx)] = {n: c.time_s for n, c in dcp.by_name().items()}
            breakdown[f"{ctx}_vllm"] = {n: c.time_s for n, c in vllm.by_name().items()}
    res["dcp8_prefill_overhead"] = overhead
    res["dcp8_prefill_overhead_setup"] = {"chunk_tokens": chunk_tokens, "pcp": N_GPUS, "dcp": 8, "ep": N_GPUS,
                                          "overlap_assumption": OVERLAP_NOTE}
    res["dcp8_prefill_step_breakdown_s"] = breakdown
    res["dcp8_prefill_temp_copy_bytes_per_layer_at_1m"] = one_m * (
        mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim) + index_key_bytes(cfg.index_head_dim))

    # The sparse-decode kernel model against FlashMLA's published H800 configuration (128 heads, 2 query
    # tokens per request x 128 requests, top-k 2048): with and without the two-CTA "crossover" sharing.
    h800 = dataclasses.replace(hw, name="H800 SXM5", hbm_bandwidth=3.35e12)
    dsv = cfg.replace(num_attention_heads=128)
    predicted = {}
    for name, hpd in (("no_crossover_64_heads_per_dequant", 64), ("crossover_128_heads_per_dequant", 128)):
        c = pm.sparse_mla(dsv, h800, 256, cfg.index_topk, 128, heads_per_dequant=hpd, tokens_per_request=2)
        predicted[name] = c.useful_flops / c.time_s / 1e12
    res["flashmla_sparse_decode_prediction_tflops"] = predicted

    # One layer's sparse-MLA decode kernel (one query token per request, top-k rows each) against the batch:
    # TP8 (8 heads per GPU, which FlashMLA runs as 64) and 64 heads (DP / DCP-gathered heads)
    res["sparse_mla_decode_us_per_layer_vs_batch"] = {
        "batch": list(DECODE_BATCHES), "topk": cfg.index_topk,
        **{f"heads_{h}": [1e6 * pm.sparse_mla(cfg, hw, b, cfg.index_topk, h, pad_heads=True).time_s
                          for b in DECODE_BATCHES] for h in (8, 64)}}
    return res


def plot(res: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    paths = []

    def tokens(n, _pos=None):
        return f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 2**10:g}K" if n >= 2**10 else f"{n:g}"

    def plain(v, _pos=None):
        return f"{v:g}"

    def log_axes(ax, x_tokens=True, y_log=True, y_plain=False):
        # Plain-text tick labels: matplotlib's default log labels go through mathtext, which is slow.
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(tokens if x_tokens else plain))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        if y_log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(plain) if y_plain else ticker.LogFormatter(labelOnlyBase=True))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())

    def save(fig, name):
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)

    # 1. KV bytes per token by component.
    comp = res["kv_bytes_per_token_by_component"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    bars = ax.bar(list(comp), list(comp.values()), color=["C0", "C0", "C1", "C1"])
    ax.bar_label(bars, labels=[f"{v:,}" for v in comp.values()], fontsize=8)
    ax.set_ylabel("bytes per token")
    ax.set_title(f"KV cache per token: {res['kv_bytes_per_token']:,} B (fp8 formats)")
    save(fig, "kv_bytes_by_component.png")

    # 2. Per-GPU KV vs context for DCP 1..16.
    kv = res["kv_gib_per_gpu_vs_context"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in DCP_SIZES:
        ax.plot(kv["context_tokens"], kv[f"dcp{n}"], "o-", ms=3,
                label=f"DCP{n}: max {res['max_context_tokens'][f'dcp{n}'] / 1e3:,.0f}K tokens")
    ax.axhline(res["kv_budget_gib_per_gpu"], color="k", ls="--", lw=1,
               label=f"KV budget {res['kv_budget_gib_per_gpu']:.0f} GiB/GPU")
    log_axes(ax, y_plain=True)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("KV GiB per GPU")
    ax.set_title("Per-GPU KV cache vs context (round-robin DCP sharding)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "kv_per_gpu_vs_context.png")

    # 3. Sparse MLA intensity vs heads per GPU.
    si = res["sparse_mla_intensity"]
    h = [r["heads"] for r in si["curve"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(h, [r["useful_flop_per_byte"] for r in si["curve"]], "o-", label="useful FLOP/byte")
    ax.plot(h, [r["padded_executed_flop_per_byte"] for r in si["curve"]], "s--", alpha=0.7,
            label="executed FLOP/byte, heads padded to 64 (fp8 kernel)")
    ax.axhline(res["ridge_point_flop_per_byte"], color="k", ls="--", lw=1,
               label=f"ridge (peak) {res['ridge_point_flop_per_byte']:.0f}")
    ax.axhline(res["ridge_point_achievable_flop_per_byte"], color="grey", ls=":", lw=1,
               label=f"ridge (achievable) {res['ridge_point_achievable_flop_per_byte']:.0f}")
    for key, txt in (("heads_8", "TP8"), ("heads_64", "PCP")):
        v = si[key]
        ax.annotate(f"{txt}: {v['heads']} heads, {v['useful_flop_per_byte']:.0f}", (v["heads"], v["useful_flop_per_byte"]),
                    textcoords="offset points", xytext=(6, -12), fontsize=8)
    log_axes(ax, x_tokens=False, y_plain=True)
    ax.set_xlabel("query heads per GPU")
    ax.set_ylabel("FLOP per HBM byte")
    ax.set_title("Sparse MLA (2,048 rows x 660 B per query token) vs ridge point")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "sparse_mla_intensity.png")

    # 4. Indexer vs sparse-MLA FLOPs per GPU vs prompt length.
    rows = res["prefill_flops_per_gpu_vs_prompt_len"]
    n = [r["prompt_len"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key in zip(axes, ("tp8", "pcp8")):
        ax.plot(n, [r[f"{key}_indexer_flops"] for r in rows], "o-", ms=3, label="indexer (quadratic)")
        ax.plot(n, [r[f"{key}_sparse_mla_flops"] for r in rows], "s-", ms=3, label="sparse MLA, useful (linear)")
        ax.plot(n, [r[f"{key}_sparse_mla_flops_padded"] for r in rows], ":", label="sparse MLA, heads padded to 64")
        x = res[f"crossover_prompt_len_{key}"]
        ax.axvline(x, color="k", ls="--", lw=1, label=f"crossover {x / 1e3:,.1f}K tokens")
        xp = res[f"crossover_prompt_len_{key}_padded"]
        if abs(xp - x) > 1:
            ax.axvline(xp, color="grey", ls=":", lw=1, label=f"padded crossover {xp / 1e3:,.1f}K")
        log_axes(ax)
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{key.upper()}: per-GPU prefill FLOPs of the whole prompt")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("FLOPs per GPU")
    save(fig, "indexer_vs_mla_flops.png")

    # 5. DCP8 prefill overhead.
    ov = res["dcp8_prefill_overhead"]
    c = [r["cached_context"] for r in ov]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    axes[0].plot(c, [100 * r["overhead_frac_vllm"] for r in ov], "o-", color="C3", lw=2,
                 label="vLLM's schedule: bf16 shard gathered, no overlap")
    axes[0].plot(c, [100 * r["overhead_frac_vllm_dcp_prefetch"] for r in ov], "s--", color="C3",
                 label="bf16 shard, gather prefetched a layer ahead (bound)")
    axes[0].plot(c, [100 * r["overhead_frac"] for r in ov], "o-", color="C0", label="fp8 rows gathered, no overlap")
    axes[0].plot(c, [100 * r["overhead_frac_dcp_prefetch"] for r in ov], "s--", color="C0",
                 label="fp8 rows, gather prefetched a layer ahead (bound)")
    axes[0].axhline(0, color="k", lw=0.5)
    axes[0].set_ylabel("step-time overhead of DCP8 (%)")
    axes[0].set_title(f"PCP8 prefill of a {res['dcp8_prefill_overhead_setup']['chunk_tokens']:,}-token chunk: DCP8 overhead")
    axes[1].plot(c, [1e3 * r["step_s_without_dcp"] for r in ov], "o-", color="k",
                 label="PCP8 (whole cache on every GPU)")
    for key, gather, color, label in (("step_s_with_dcp8_vllm", "dcp_gather_s_vllm", "C3", "vLLM's schedule"),
                                      ("step_s_with_dcp8", "dcp_gather_s", "C0", "fp8 rows, no overlap")):
        axes[1].plot(c, [1e3 * r[key] for r in ov], "s-", color=color, label=f"PCP8 x DCP8, {label}")
        axes[1].plot(c, [1e3 * r[gather] for r in ov], "^:", color=color,
                     label="of which " + ("bf16 shard" if color == "C3" else "fp8 row") + " all-gathers")
    axes[1].set_ylabel("step time (ms)")
    log_axes(axes[0], y_log=False)
    log_axes(axes[1], y_plain=True)
    for ax in axes:
        ax.set_xlabel("cached context tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, "dcp8_prefill_overhead.png")
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="glm-5.3")
    ap.add_argument("--kv-budget-gib", type=float, default=pm.PUBLISHED_KV_BUDGET_BYTES_TP8 / pm.GiB,
                    help="KV bytes per GPU after weights and activations (published: ~15 GiB on H200 at TP8)")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="prefill chunk of the DCP overhead figure")
    ap.add_argument("--block-size", type=int, default=64, help="KV block size (tokens) for whole-block limits")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = get_preset(args.preset)
    hw = pm.H200_CALIBRATED
    budget = args.kv_budget_gib * pm.GiB
    old = compute(cfg, pm.H200, kv_budget_bytes=budget, chunk_tokens=args.chunk_tokens, block_size=args.block_size)
    results = {
        "figure": "roofline",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "note": "analytic model: the numbers do not depend on this machine"},
        "git_commit": git_revision(),
        "preset": args.preset,
        "hardware": {**dataclasses.asdict(hw), "nvlink_bandwidth_one_direction": hw.nvlink_bandwidth,
                     "clock_hz": hw.clock_hz, "dequant_values_per_s": hw.dequant_values_per_s},
        "formulas": "docs/perfmodel.md",
        **compute(cfg, hw, kv_budget_bytes=budget, chunk_tokens=args.chunk_tokens, block_size=args.block_size),
        # the time-dependent figures on the datasheet spec (the numbers before calibration), for comparison
        "datasheet_spec": {"hardware": pm.H200.name, **{k: old[k] for k in DATASHEET_KEYS}},
    }
    (out / "roofline.json").write_text(json.dumps(results, indent=1))
    paths = plot(results, out)
    print(f"KV {results['kv_bytes_per_token']:,} B/token; 1M tokens {results['kv_gib_for_1048576_tokens']:.1f} GiB, "
          f"{results['kv_gib_per_gpu_1048576_tokens_dcp8']:.1f} GiB/GPU at DCP8")
    si = results["sparse_mla_intensity"]
    print(f"sparse MLA {si['heads_8']['useful_flop_per_byte']:.1f} / {si['heads_64']['useful_flop_per_byte']:.1f} "
          f"FLOP/byte at 8 / 64 heads; ridge {results['ridge_point_flop_per_byte']:.0f}")
    print(f"crossover TP8 {results['crossover_prompt_len_tp8']:,.0f} tokens (padded "
          f"{results['crossover_prompt_len_tp8_padded']:,.0f}), PCP8 {results['crossover_prompt_len_pcp8']:,.0f}")
    print(f"time crossover TP8 {results['crossover_prompt_len_tp8_time'] or 0:,.0f} (padded "
          f"{results['crossover_prompt_len_tp8_padded_time'] or 0:,.0f}), PCP8 {results['crossover_prompt_len_pcp8_time'] or 0:,.0f} tokens")
    ov = results["dcp8_prefill_overhead"]
    print(f"DCP8 prefill overhead under vLLM's schedule {100 * ov[0]['overhead_frac_vllm']:.1f}% at "
          f"{ov[0]['cached_context']:,} cached tokens -> {100 * ov[-1]['overhead_frac_vllm']:.0f}% at "
          f"{ov[-1]['cached_context']:,}; fp8 rows {100 * ov[0]['overhead_frac']:.1f}% -> "
          f"{100 * ov[-1]['overhead_frac']:.0f}% (no overlap), {100 * ov[0]['overhead_frac_dcp_prefetch']:.1f}% -> "
          f"{100 * ov[-1]['overhead_frac_dcp_prefetch']:.0f}% (prefetched)")
    print(f"wrote {out / 'roofline.json'} and {len(paths)} PNGs")
    return results


if __name__ == "__main__":
    main()
