"""How much the published comparisons move with the simulator's assumed inputs (issue 53, item 2).

    python -m experiments.sensitivity --out results/sensitivity                    # every knob and figure
    python -m experiments.sensitivity --out DIR --knobs kv_budget --figures part1  # a subset (resumes DIR)
    python -m experiments.sensitivity --out DIR --quick                            # short window, one value each

Sweeps, on the published configs (configs/paper/part1.py at concurrency 32, 142K and 1M; part2.py at 64):
- `hisparse_miss_fraction` (runner.hisparse_miss_fraction, 0.02-0.3; assumed 0.1): HiSparse points only;
- `step_overhead_s` (runner.step_overhead_s, 0-2 ms and vLLM RFC 6854's profiled 4 ms per decode step,
  glm53/perfmodel/published.json; assumed 0);
- `kv_budget` (the device KV budget per GPU, kv_cache_memory_bytes: the memory plan's derivation for the
  deployment, experiments.deployments.kv_budget, which both figures' configs take, and BRIEF's 15 GiB);
- `host_copy_overlap` (runner.host_copy_overlap: the fraction of a step's host <-> device KV copies hidden
  behind its forward; assumed 0, serial as the runners execute them; 0.5 and 1);
- `expert_skew` (runner.expert_load_imbalance: balanced, and the busiest EP rank's routed tokens over the mean
  as TensorRT-LLM measured for DeepSeek-R1 on 32 GPUs, with and without EPLB); only where whole experts
  sit on ranks (Part 2's EP8): under TP8 (Part 1) every GPU holds a slice of each expert, so a skew
  leaves the GPUs balanced and the points would repeat the default's.
A point whose knob cannot act on it (a miss fraction without HiSparse, a skew without EP) is not run.
Every point is one `experiments.serve.run_one`. Part 1's points run over at most `--window-s` simulated
seconds from the start (`sweep.measure="steady"`, `sweep.window_s`: then the requests in flight finish and
the figures are over the window); Part 2's over the published hour of steady state its config measures
(600 s of warm-up, then 3,600 s: `Figure.own_window`), since a short window from the start moves its
figures by more than most knobs do (`--quick` cuts it to the short window too). The default point of each
(figure, policy) is run once and shared by every knob.

Writes OUT/results.json: {"knobs": {knob: [{"value", "figure", "concurrency", "kv_policy",
"running_requests_mean", "throughput_tok_s_per_gpu", "interactivity_tok_s_user", ...}]}, "knob_info" (each
knob's default, its source, the values cited), "window_s", "windows" (each figure's), "complete", "missing" (points not run yet),
date / commit / machine}, and OUT/<knob>.png (throughput and interactivity vs the knob, the default and the
cited values marked), OUT/table.md (each value's change from the default). Results are saved after each
point and a rerun skips the points already there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from experiments.common import REPO, cpu_name, git_revision, load_config
from glm53.perfmodel import PUBLISHED_KV_BUDGET_BYTES_TP8

GiB = 1 << 30
PART1, PART2 = "configs/paper/part1.py", "configs/paper/part2.py"
ENTRY_KEYS = ("running_requests_mean", "throughput_tok_s_per_gpu", "interactivity_tok_s_user")
EXTRA_KEYS = ("interactivity_p90_e2e_tok_s_user", "ttft_median_s", "tpot_mean_s", "requests", "simulated_s",
              "steady_window_s", "wall_s", "engine_steps", "device_kv_budget_bytes_per_gpu", "num_gpu_blocks",
              "preemptions", "sim_hot_miss_rows", "assumed_hisparse_miss_fraction", "assumed_step_overhead_s",
              "assumed_expert_load_imbalance", "assumed_host_copy_overlap")
# vLLM RFC 6854 (published.json "step_overheads"): about 4 ms of GPU bubble per decode step in its profiled trace
# (5-13 ms stated), before multi-step and asynchronous scheduling: an upper end for today's vLLM
CITED_STEP_OVERHEAD_S = 4e-3
# TensorRT-LLM, "Scaling Expert Parallelism in TensorRT-LLM (Part 1)", Table 1: DeepSeek-R1 on 32 GB200s (EP32),
# imbalance ratio (max - mean) / mean of the tokens each rank receives, averaged over layers and iterations:
# 1.564 without EPLB, 0.109 with it; as the busiest rank over the mean: 2.56 and 1.11
EPLB_SKEW, NO_EPLB_SKEW = 1.11, 2.56


@dataclasses.dataclass(frozen=True)
class Figure:
    config: str
    concurrency: int
    policies: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    experts_on_ranks: bool = False  # EP: whole experts per rank (a routing skew unbalances the GPUs)
    quick: tuple[str, ...] = ()  # further overrides under --quick
    quick_concurrency: int | None = None
    own_window: bool = False  # measured over the config's own steady window, not `window_s` (unless quick)


FIGURES = {
    "part1": Figure(PART1, 32, ("hisparse", "offload")),
    # the published 1M point is HiSparse alone (offload cannot hold a 1M request: reproduce's part1_1m)
    "part1_1m": Figure(PART1, 32, ("hisparse",), ("--config.deploy.max_model_len=1048576",)),
    "part2": Figure(PART2, 64, ("pcp_dcp+hisparse",), experts_on_ranks=True,
                    quick=("--config.workload.median_turns=4.0", "--config.workload.mean_input=20000.0"),
                    quick_concurrency=8, own_window=True),
}


@dataclasses.dataclass(frozen=True)
class Knob:
    default: float | None  # None: the figure's own (kv_budget)
    values: tuple[float, ...]  # besides the default (kv_budget: filled per point)
    source: str
    cited: tuple[float, ...] = ()


KNOBS = {
    "hisparse_miss_fraction": Knob(0.1, (0.02, 0.05, 0.2, 0.3), "assumed (docs/simulator.md): no indexer scores at "
                                   "scale to measure the resolver's hit rate"),
    "step_overhead_s": Knob(0.0, (0.5e-3, 1e-3, 2e-3, CITED_STEP_OVERHEAD_S),
                            "assumed 0; cited: vLLM RFC 6854's profiled ~4 ms GPU bubble per decode step (5-13 ms "
                            "stated; before multi-step and asynchronous scheduling), glm53/perfmodel/published.json",
                            (CITED_STEP_OVERHEAD_S,)),
    "kv_budget": Knob(None, (), "derived: the memory plan's budget for each deployment, which the configs take "
                      "(experiments.deployments.kv_budget: usable HBM - weights - workspace [- HiSparse state]); "
                      "cited: BRIEF §2's ~15 GiB per GPU at TP8", (PUBLISHED_KV_BUDGET_BYTES_TP8,)),
    "expert_skew": Knob(1.0, (EPLB_SKEW, NO_EPLB_SKEW),
                        "balanced (1.0) assumed; cited: TensorRT-LLM large-scale EP blog part 1, Table 1 (DeepSeek-R1, "
                        "EP32): busiest rank / mean 2.56 without EPLB, 1.11 with it (EP8 averages 32 experts per "
                        "rank, so its skew is likely lower)", (EPLB_SKEW, NO_EPLB_SKEW)),
}
KNOBS["host_copy_overlap"] = Knob(
    0.0, (0.5, 1.0), "assumed 0: a step's host <-> device KV copies (offload loads and stores, HiSparse pre-copies) "
    "run before its forward, as this project's runners execute them; 1: all of them beside the forward, up to its "
    "length (vLLM's offloading connector copies on a CUDA stream of its own): the bound the other way")
RUNNER_KEY = {"hisparse_miss_fraction": "hisparse_miss_fraction", "step_overhead_s": "step_overhead_s",
              "expert_skew": "expert_load_imbalance", "host_copy_overlap": "host_copy_overlap"}


def applies(knob: str, fig: Figure, policy: str) -> bool:
    """Whether `knob` can change a point (else the point would repeat the default's and is not run)."""
    if knob == "hisparse_miss_fraction":
        return "hisparse" in policy
    if knob == "expert_skew":
        return fig.experts_on_ranks
    return True


def base_config(fig: Figure, policy: str, window_s: float, quick: bool = False):
    """The published config of one (figure, policy) at its concurrency, over `window(fig, window_s, quick)`."""
    cfg = load_config(str(REPO / fig.config), fig.overrides + (fig.quick if quick else ()))
    cfg.sweep.kv_policy = (policy,)
    cfg.sweep.concurrency = (concurrency(fig, quick),)
    cfg.sweep.measure = "steady"
    cfg.sweep.window_warmup_s, cfg.sweep.window_s = window(fig, window_s, quick, cfg)
    return cfg


def window(fig: Figure, window_s: float, quick: bool, cfg=None) -> tuple[float, float]:
    """(warm-up, window) in simulated seconds of a figure's points: its config's own steady window where
    `fig.own_window` (and not quick), else `window_s` from the start. A point's `steady_window_s` is
    [warm-up, warm-up + window] (serve's closed loop keeps the pool full over both or fails)."""
    if fig.own_window and not quick:
        cfg = cfg if cfg is not None else load_config(str(REPO / fig.config), fig.overrides)
        if cfg.sweep.measure != "steady" or not cfg.sweep.window_s:
            raise ValueError(f"{fig.config} measures no steady window of its own")
        return float(cfg.sweep.window_warmup_s), float(cfg.sweep.window_s)
    return 0.0, float(window_s)


def concurrency(fig: Figure, quick: bool) -> int:
    return fig.quick_concurrency if quick and fig.quick_concurrency else fig.concurrency


def kv_budgets(cfg, policy: str) -> tuple[int, int]:
    """(the config's own device KV budget per GPU, BRIEF §2's 15 GiB) of a point: both figures' configs
    take the memory plan's derivation, Part 1 per policy (`policy_deploy`), a P/D pair (Part 2) per side
    (the decode side's is reported)."""
    pd = cfg.pd.deployments.get(policy)
    if pd is not None:
        return int(pd["decode"]["kv_cache_memory_bytes"]), PUBLISHED_KV_BUDGET_BYTES_TP8
    own = cfg.policy_deploy.get(policy, {}).get("kv_cache_memory_bytes") or cfg.deploy.kv_cache_memory_bytes
    return int(own), PUBLISHED_KV_BUDGET_BYTES_TP8


def set_kv_budget(cfg, policy: str, value: int) -> None:
    """The point's device KV budget per GPU: Part 1's deploy field and the policy's own, where it has one
    (HiSparse); a P/D pair's two sides at 15 GiB (its configs' own budgets are the plan's, per side)."""
    pd = cfg.pd.deployments.get(policy)
    if pd is None:
        cfg.deploy.kv_cache_memory_bytes = int(value)
        if "kv_cache_memory_bytes" in cfg.policy_deploy.get(policy, {}):
            cfg.policy_deploy[policy]["kv_cache_memory_bytes"] = int(value)
    elif value == PUBLISHED_KV_BUDGET_BYTES_TP8:
        for side in ("prefill", "decode"):
            pd[side]["kv_cache_memory_bytes"] = int(value)
    elif value != pd["decode"]["kv_cache_memory_bytes"]:
        raise ValueError(f"kv_budget: {value} is neither 15 GiB nor the plan's {pd['decode']['kv_cache_memory_bytes']}")


def points(figures, knobs, quick: bool):
    """[(knob, figure, policy, value, is_default)] to run (the default once per (figure, policy), listed under
    every knob): figure by figure, each (figure, policy)'s default first, then the knobs' values round-robin
    from the last listed (the extremes and the cited values) back, so a sweep cut short has each knob's ends."""
    out = []
    for fname in figures:
        fig = FIGURES[fname]
        rounds: list[list] = []
        for policy in fig.policies:
            for knob in knobs:
                if not applies(knob, fig, policy):
                    continue
                k = KNOBS[knob]
                if knob == "kv_budget":
                    own, other = kv_budgets(base_config(fig, policy, 1.0), policy)
                    default, values = own, (other,)
                else:
                    default, values = k.default, k.values
                if quick:
                    values = values[-1:]
                out.append((knob, fname, policy, default, True))
                for i, v in enumerate(reversed(values)):
                    while len(rounds) <= i:
                        rounds.append([])
                    rounds[i].append((knob, fname, policy, v, False))
        out += [p for r in rounds for p in r]
    return out


def point_key(fname: str, policy: str, knob: str, value, is_default: bool) -> str:
    """The run a point is: every default point of a (figure, policy) is one run."""
    return f"{fname}|{policy}|default" if is_default else f"{fname}|{policy}|{knob}={value!r}"


def run_point(fname: str, policy: str, knob: str, value, is_default: bool, window_s: float, quick: bool = False) -> dict:
    """One simulated serve point -> its metrics (experiments.serve.run_one)."""
    from experiments import serve

    fig = FIGURES[fname]
    cfg = base_config(fig, policy, window_s, quick)
    if not is_default:
        if knob == "kv_budget":
            set_kv_budget(cfg, policy, value)
        else:
            cfg.runner[RUNNER_KEY[knob]] = float(value)
    model, _ = serve._model(cfg.model, weights=False)
    return serve.run_one(model, cfg, policy, concurrency(fig, quick), progress=False)


def entry(knob: str, fname: str, policy: str, value, is_default: bool, m: dict) -> dict:
    return {"value": value, "figure": fname, "concurrency": m["concurrency"], "kv_policy": policy,
            **{k: m.get(k) for k in ENTRY_KEYS}, "default": is_default, "max_model_len": m.get("max_model_len"),
            **{k: m.get(k) for k in EXTRA_KEYS}}


def plot(res: dict, out: Path) -> list[Path]:
    """One PNG per knob: throughput per GPU and interactivity against the knob's value, a line per (figure,
    policy); the default marked by a dotted line (per line for kv_budget, whose defaults differ), cited values
    by dashed ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for knob, rows in res["knobs"].items():
        if not rows:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        scale = 1 / GiB if knob == "kv_budget" else (1e3 if knob == "step_overhead_s" else 1)
        unit = {"kv_budget": "GiB per GPU", "step_overhead_s": "ms"}.get(knob, "")
        for (fname, policy) in dict.fromkeys((r["figure"], r["kv_policy"]) for r in rows):
            mine = sorted((r for r in rows if r["figure"] == fname and r["kv_policy"] == policy),
                          key=lambda r: r["value"])
            xs = [r["value"] * scale for r in mine]
            for ax, key in zip(axes, ("throughput_tok_s_per_gpu", "interactivity_tok_s_user")):
                line, = ax.plot(xs, [r[key] for r in mine], "o-", label=f"{fname} {policy} c{mine[0]['concurrency']}")
                for r in mine:
                    if r["default"]:
                        ax.axvline(r["value"] * scale, color=line.get_color(), ls=":", lw=1)
        info = res["knob_info"][knob]
        for ax, title in zip(axes, ("throughput (tok/s per GPU)", "interactivity (tok/s per user)")):
            for v in info.get("cited", ()):
                ax.axvline(v * scale, color="grey", ls="--", lw=1)
            ax.set_xlabel(f"{knob} ({unit})" if unit else knob)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{knob}: dotted = default, dashed = cited; windows: {windows_text(res)}\n"
                     f"{res.get('date', '?')}, commit {short_revision(res.get('git_revision'))}, "
                     f"{machine_text(res.get('machine'))}", fontsize=9)
        fig.tight_layout()
        path = out / f"{knob}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def windows_text(res: dict) -> str:
    """The figures' windows of a results.json, e.g. "part1 0-300 s, part2 600-4200 s" (simulated)."""
    windows = res.get("windows") or {"every figure": [0.0, res["window_s"]]}  # a run before per-figure windows
    return ", ".join(f"{f} {a:.0f}-{b:.0f} s" for f, (a, b) in windows.items())


def short_revision(rev: str | None) -> str:
    """A results.json `git_revision` cut to 12 hex digits, keeping "+dirty"."""
    rev = rev or "?"
    return rev[:12] + ("+dirty" if rev.endswith("+dirty") else "")


def machine_text(machine: dict | None) -> str:
    """results.json's `machine` in words ("AMD EPYC x 2")."""
    return f"{machine.get('cpu', '?')} x {machine.get('cpu_count', '?')}" if machine else "machine unknown"


def table(res: dict) -> str:
    """results.json as markdown: per knob and (figure, policy), each value's figures and their change from the
    default point's."""
    out = [f"# Sensitivity of the simulated published points (windows in simulated time: {windows_text(res)})", "",
           f"{res.get('date', '?')}, commit {res.get('git_revision', '?')}, {machine_text(res.get('machine'))}. "
           "Generated by `python -m experiments.sensitivity`; change = value / default - 1."
           + ("" if res["complete"] else f" Incomplete: {len(res['missing'])} points not run (results.json "
                                          "`missing`)."), ""]
    for knob, rows in res["knobs"].items():
        info = res["knob_info"][knob]
        default = "each config's own" if info["default"] is None else info["default"]
        out += [f"## {knob}", "", f"Default: {default}; {info['source']}.", ""]
        if not rows:
            out += [f"Not run: {res['not_run'].get(knob, 'no point yet')}.", ""]
            continue
        out += ["| figure | kv_policy | c | value | throughput tok/s/GPU | change | interactivity tok/s/user | change | "
                "running requests | change |", "|---|---|---|---|---|---|---|---|---|---|"]
        for (fname, policy) in dict.fromkeys((r["figure"], r["kv_policy"]) for r in rows):
            mine = sorted((r for r in rows if r["figure"] == fname and r["kv_policy"] == policy), key=lambda r: r["value"])
            base = next((r for r in mine if r["default"]), None)
            for r in mine:
                cells = []
                for key in ENTRY_KEYS[1:] + ENTRY_KEYS[:1]:
                    cells.append(f"{r[key]:.1f}")
                    cells.append("default" if r["default"] else "-" if base is None else f"{r[key] / base[key] - 1:+.1%}")
                v = f"{r['value'] / GiB:.2f} GiB" if knob == "kv_budget" else f"{r['value']:g}"
                out.append(f"| {fname} | {policy} | {r['concurrency']} | {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def run(out: Path, figures=tuple(FIGURES), knobs=tuple(KNOBS), *, window_s: float = 300.0, quick: bool = False,
        budget_s: float | None = None, log=print) -> dict:
    """Run the sweep's points into out/results.json (resuming those of its runs measured over the window their
    figure takes now) -> results.
    budget_s: stop starting points after this much wall time (the rest listed as missing)."""
    for f in figures:
        if f not in FIGURES:
            raise ValueError(f"figure {f!r}: choose from {list(FIGURES)}")
    for k in knobs:
        if k not in KNOBS:
            raise ValueError(f"knob {k!r}: choose from {list(KNOBS)}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    todo = points(figures, knobs, quick)
    spans = {f: window(FIGURES[f], window_s, quick) for f in dict.fromkeys(p[1] for p in todo)}
    runs = {k: r for k, r in old.get("runs", {}).items()
            if r["figure"] not in spans or (r.get("steady_window_s") == [spans[r["figure"]][0], sum(spans[r["figure"]])]
                                            and r["concurrency"] == concurrency(FIGURES[r["figure"]], quick))}
    t0 = time.perf_counter()

    def save() -> dict:
        res = {"knobs": {k: [] for k in KNOBS}, "missing": []}
        for knob, fname, policy, value, is_default in todo:
            m = runs.get(point_key(fname, policy, knob, value, is_default))
            if m is None:
                res["missing"].append({"knob": knob, "figure": fname, "kv_policy": policy, "value": value})
            else:
                res["knobs"][knob].append(entry(knob, fname, policy, value, is_default, m))
        res.update(complete=not res["missing"], window_s=window_s, quick=quick,
                   windows={f: [a, a + w] for f, (a, w) in spans.items()},
                   knob_info={k: {"default": v.default, "source": v.source, "cited": list(v.cited)}
                              for k, v in KNOBS.items()},
                   not_run={"hisparse_miss_fraction": "offload points (no hot buffer)",
                            "expert_skew": "Part 1 (TP8: every GPU holds a slice of each expert, balanced under "
                                           "any skew)"},
                   window="each point: the published config at its concurrency over its figure's window (`windows`, "
                          "simulated s: serve's steady window, the pool kept full over warm-up and window; Part 1 from "
                          "the start for window_s, Part 2 its config's published hour after its warm-up), the requests "
                          "in flight then finished; figures over the window",
                   date=time.strftime("%Y-%m-%d"), git_revision=git_revision(),
                   machine={"cpu": cpu_name(), "cpu_count": os.cpu_count()}, runs=runs)
        path.write_text(json.dumps(res, indent=1))
        return res

    for knob, fname, policy, value, is_default in todo:
        key = point_key(fname, policy, knob, value, is_default)
        if key in runs:
            continue
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        t = time.perf_counter()
        runs[key] = entry(knob, fname, policy, value, is_default,
                          run_point(fname, policy, knob, value, is_default, window_s, quick)) | {"key": key}
        save()
        log(f"{key}: {time.perf_counter() - t:.0f} s wall; throughput {runs[key]['throughput_tok_s_per_gpu']:.0f} "
            f"tok/s/GPU, interactivity {runs[key]['interactivity_tok_s_user']:.1f} tok/s/user")
    res = save()
    plot(res, out)
    (out / "table.md").write_text(table(res))
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/sensitivity")
    ap.add_argument("--knobs", default=",".join(KNOBS), help=f"comma-separated, from {list(KNOBS)}")
    ap.add_argument("--figures", default=",".join(FIGURES), help=f"comma-separated, from {list(FIGURES)}")
    ap.add_argument("--window-s", type=float, default=300.0, help="simulated seconds measured per point")
    ap.add_argument("--budget-s", type=float, default=None, help="start no point after this much wall time")
    ap.add_argument("--quick", action="store_true", help="one value per knob, 60 s window: Part 1 at 142K (expert_skew: "
                                                           "Part 2 at c8 with short sessions)")
    a = ap.parse_args(argv)
    figures, window = a.figures.split(","), a.window_s
    if a.quick:
        figures, window = (["part2"] if a.knobs == "expert_skew" else ["part1"]), 60.0
    return run(Path(a.out), figures, a.knobs.split(","), window_s=window, quick=a.quick, budget_s=a.budget_s)


if __name__ == "__main__":
    main()
