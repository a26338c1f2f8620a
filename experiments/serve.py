"""Serve a workload on the engine and measure it: the project's main job.

    python -m experiments.serve                                   # built-in default: tiny model, OpenHands sessions
    python -m experiments.serve --config configs/smoke.py --out out/smoke
    python -m experiments.serve --config configs/ablations/preempt_vs_offload.py --config.sweep.concurrency='(2, 4)'
    python -m experiments.serve --metrics-port 9400               # live vLLM-named Prometheus metrics while it runs

A config file defines `get_config() -> ml_collections.ConfigDict` (start from `default_config()` here):
`model` (preset + seed, or an HF checkpoint), `deploy` (DeployConfig fields), `workload` (kind
"openhands" | "synthetic" | "trace"), `sweep` (lists of `kv_policy` and `concurrency`: one run per
pair, each on a fresh engine; `measure="steady"` reports the window in which the closed loop kept all
`concurrency` sessions running and skips the drain after it, "full" the whole run), and `runner` (kind "model": the model runs; "sim": the simulator prices
every step on `runner.hardware` with no weights and a virtual clock, docs/simulator.md). `--config.KEY=VALUE` overrides a field (VALUE is a Python literal, else a
string).

Writes DIR/results.json: `runs: [{kv_policy, concurrency, ...metrics}]` with the keys of
glm53.engine.metrics (units in their names) plus running requests over time; with one run its metrics
also sit at the top level. With more than one concurrency it draws throughput vs interactivity to
DIR/throughput_vs_interactivity.png and running requests vs concurrency to
DIR/running_requests_vs_concurrency.png (`plot` redraws both from results.json's runs alone).

Each sweep point is first served once untimed (`warmup="replay"`), so the measured run finds its
programs compiled; `warmup="buckets"` compiles every bucket shape up front instead (seconds per shape on
CPU). `compilations_during_run` counts the XLA compilations inside each measured run to show it.
Compiled programs are also cached on disk (JAX's persistent compilation cache, `--compile-cache`), so
only the first run of a config pays for compiling.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from ml_collections import ConfigDict
from tqdm import tqdm

from experiments import workloads
from experiments.common import REPO, bound_memory_maps, cpu_name, git_revision, load_config, sweep_map_budget
from kvcache.layout import block_bytes, runner_block_bytes


def default_config() -> ConfigDict:
    """The built-in default: a few-minute run on 2 CPU cores (README's main command)."""
    c = ConfigDict()
    c.name = "default"
    # layers > 0 keeps only the preset's first `layers` layers (quick runs; 0: all of them)
    # overrides: ModelConfig fields replaced on the preset (e.g. index_topk, indexer_types)
    c.model = ConfigDict(dict(preset="tiny", checkpoint="", seed=0, dtype="float32", init_std=0.1, layers=0,
                              overrides={}))
    c.deploy = ConfigDict(dict(block_size=16, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4,
                               kv_cache_dtype="auto", num_gpu_blocks=0, cpu_offload_bytes=0,
                               hisparse_host_pool_bytes=0, hisparse_device_buffer_size=0, index_block_size=0,
                               enable_prefix_caching=True, attention_impl="auto", host_link_bytes_per_s=50e9,
                               data_parallel_size=1, dp_routing="salt", prefill_context_parallel_size=1,
                               decode_context_parallel_size=1,
                               dcp_comm_backend="ag_rs", cp_kv_cache_interleave_size=1,
                               enable_expert_parallel=False, tensor_parallel_size=1, kv_cache_memory_bytes=0))
    # openhands_later_input: the new input tokens of each OpenHands turn after the first (BRIEF §8: 753)
    c.workload = ConfigDict(dict(kind="openhands", sessions=8, scale=1 / 128, turns=13, trace_path="",
                                 median_turns=43.0, mean_input=142_000.0, think_time_scale=0.0, seed=0,
                                 openhands_later_input=753))
    # sessions_per_user: serve concurrency x this many sessions (0: all the workload's)
    # measure: "full" reports the whole run, drain included (the closed loop's last sessions finishing with
    # fewer and fewer beside them); "steady" stops when the drain begins and reports its window
    # (`steady_window_s`: from the start to the first time a freed slot finds no session to take it;
    # ClosedLoopClient.run)
    # window_warmup_s, window_s (simulated seconds, measure "steady" only): the window starts window_warmup_s
    # after the start (every session starts at once, on cold caches) and, with window_s > 0, lasts
    # window_s; the pool must stay full over both (the point fails otherwise: serve more sessions)
    c.sweep = ConfigDict(dict(kv_policy=("preempt",), concurrency=(1, 2, 4), sessions_per_user=0, measure="full",
                              window_warmup_s=0.0, window_s=0.0))
    # P/D deployments (simulator only): a sweep entry naming one of these runs a prefill and a decode engine
    # coupled by the PdConnector (glm53.engine.pd_sim): {name: {"prefill": {DeployConfig fields over
    # `deploy`}, "decode": {...}}}; each side's kv_policy is its own ("offload", or "hisparse" on decode)
    # consumer_waits: a decode side waits for host pages to stage its producer's KV rather than compute it
    # (vLLM's behaviour; False computes what it cannot stage, counted as kv_offload.pd.unstaged)
    # decode_prompt: how a decode leg's prompt is priced, "computed" (this engine: the decode side computes
    # what it takes from neither its pages nor the producer's full pages) or "loaded" (vLLM's NIXL consumer:
    # every prompt token but the last loaded; a pricing ablation, glm53.engine.pd_sim.PdPair)
    c.pd = ConfigDict(dict(deployments={}, consumer_waits=True, decode_prompt="computed"))
    # "model": run the model; "sim": price each step with the performance model on `hardware` (a name in
    # glm53.perfmodel.HARDWARE) on a virtual clock; step_overhead_s and hisparse_miss_fraction are the
    # simulator's assumptions (glm53.engine.sim)
    # tier_bandwidth_scale: multiplies the read and write bandwidth of every simulated secondary tier's medium
    # (glm53.perfmodel.STORAGE; "fs": one NVMe SSD), for asking how fast the storage must be; tier_latency_scale
    # its fixed time per chunk (0: none; the P/D connector's 20 us a chunk on "p2p" is assumed)
    # expert_load_imbalance: the busiest EP rank's routed tokens over the mean (1.0: balanced; glm53.engine.sim)
    # host_copy_overlap: the fraction of a step's host <-> device KV copies hidden behind its forward (0: serial)
    # dp_pacing: how DP x EP ranks are priced, "lockstep" (this project's engine: one forward per width on
    # every rank's padded rows) or "vllm" (vLLM on Hopper: each rank its own forward, experts on real tokens)
    c.runner = ConfigDict(dict(kind="model", hardware="h200", step_overhead_s=0.0, hisparse_miss_fraction=0.1,
                               tier_bandwidth_scale=1.0, tier_latency_scale=1.0, expert_load_imbalance=1.0,
                               host_copy_overlap=0.0, dp_pacing="lockstep"))
    # "replay": serve each sweep point once untimed first (the schedule is deterministic without think
    # time, so the measured run reuses its programs); "buckets": compile every bucket shape up front
    # (exact, slower: rows x widths x windows programs); "none": compile as they go
    c.warmup = "replay"
    return c


def build_sessions(w: ConfigDict, max_model_len: int | None = None) -> list[workloads.Session]:
    """The workload's sessions; synthetic sessions end at `max_model_len` (workloads.synthetic_trace)."""
    if w.kind == "openhands":
        return workloads.openhands_sessions(w.sessions, scale=w.scale, turns=w.turns,
                                            later_input=w.get("openhands_later_input", 753))
    if w.kind == "synthetic":
        return workloads.synthetic_trace(w.sessions, seed=w.seed, scale=w.scale, median_turns=w.median_turns,
                                         mean_input=w.get("mean_input", 142_000.0), max_context=max_model_len)
    if w.kind == "trace":
        if not w.trace_path:
            raise ValueError("workload.kind='trace' needs workload.trace_path")
        return workloads.read_trace(w.trace_path)  # ours, Mooncake JSONL or Weka / SemiAnalysis (detected)
    raise ValueError(f"workload.kind must be 'openhands', 'synthetic' or 'trace', got {w.kind!r}")


def _model(m: ConfigDict, weights: bool = True):
    """(model, description): a GLM53 with weights, or with weights=False (the simulator) its ModelConfig."""
    import glm53

    if m.checkpoint and not weights:
        from glm53.config import from_hf_config

        cfg = from_hf_config(json.loads((Path(m.checkpoint) / "config.json").read_text()))
        return cfg, f"checkpoint {m.checkpoint} (its config only: simulated)"
    if m.checkpoint:
        return glm53.from_pretrained(m.checkpoint, dtype=m.dtype), f"checkpoint {m.checkpoint}"
    cfg = glm53.get_preset(m.preset)
    if m.layers:
        if not 0 < m.layers <= cfg.num_hidden_layers:
            raise ValueError(f"model.layers must be in [1, {cfg.num_hidden_layers}], got {m.layers}")
        cfg = cfg.replace(num_hidden_layers=m.layers, indexer_types=cfg.indexer_types[: m.layers],
                          mlp_layer_types=cfg.mlp_layer_types[: m.layers])
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in m.get("overrides", {}).items()}
    if overrides:
        cfg = cfg.replace(**overrides)
    desc = (f"preset {m.preset}" + (f", first {m.layers} layers" if m.layers else "")
            + (f", with {overrides}" if overrides else ""))
    if not weights:
        return cfg, desc + " (no weights: simulated)"
    return glm53.init(cfg, seed=m.seed, dtype=m.dtype, std=m.init_std), desc + " (random weights)"


def simulated(cfg: ConfigDict) -> bool:
    kind = cfg.get("runner", {}).get("kind", "model")
    if kind not in ("model", "sim"):
        raise ValueError(f"runner.kind must be 'model' or 'sim', got {kind!r}")
    return kind == "sim"


def _pd_deployment(cfg: ConfigDict, name: str) -> dict | None:
    """The P/D deployment sweep entry `name` names (cfg.pd.deployments), or None."""
    deps = cfg.get("pd", {}).get("deployments", {})
    return deps[name].to_dict() if isinstance(deps.get(name), ConfigDict) else deps.get(name)


def _hardware(name: str):
    """The simulator's HardwareSpec for `runner.hardware` (glm53.perfmodel.hardware_spec), its error naming
    the field."""
    from glm53.perfmodel import hardware_spec

    try:
        return hardware_spec(name)
    except ValueError as e:
        raise ValueError(f"runner.hardware: {e}") from None


def _engine(model, cfg: ConfigDict, kv_policy: str, tier_root: str = ""):
    import glm53

    pd = _pd_deployment(cfg, kv_policy)
    if pd is not None:
        if not simulated(cfg):
            raise ValueError(f"sweep entry {kv_policy!r} is a P/D deployment: the simulator runs those "
                             "(runner.kind='sim'); with the model, start a prefill and a decode server (README)")
        from glm53.engine.pd_sim import build_pd

        r = cfg.runner
        return build_pd(model, _deploy(cfg, kv_policy, own=pd["prefill"]), _deploy(cfg, kv_policy, own=pd["decode"]),
                        _hardware(r.hardware), step_overhead_s=r.step_overhead_s,
                        hisparse_miss_fraction=r.hisparse_miss_fraction, tier_storage=_tier_storage(cfg),
                        expert_load_imbalance=r.get("expert_load_imbalance", 1.0),
                        host_copy_overlap=r.get("host_copy_overlap", 0.0), dp_pacing=r.get("dp_pacing", "lockstep"),
                        consumer_waits=cfg.pd.get("consumer_waits", True),
                        decode_prompt=cfg.pd.get("decode_prompt", "computed"))
    if not simulated(cfg):
        return glm53.Engine(model, _deploy(cfg, kv_policy, tier_root))
    from glm53.engine import sim

    r = cfg.runner
    # a filesystem tier is simulated (kvcache.tiers.sim): its root_dir is never written
    return sim.build_engine(model, _deploy(cfg, kv_policy, tier_root or "unused"), _hardware(r.hardware),
                            step_overhead_s=r.step_overhead_s, hisparse_miss_fraction=r.hisparse_miss_fraction,
                            tier_storage=_tier_storage(cfg), expert_load_imbalance=r.get("expert_load_imbalance", 1.0),
                            host_copy_overlap=r.get("host_copy_overlap", 0.0), dp_pacing=r.get("dp_pacing", "lockstep"))


def _tier_storage(cfg: ConfigDict) -> dict:
    """The media of the simulated secondary tiers: glm53.perfmodel.STORAGE, bandwidths times
    runner.tier_bandwidth_scale and fixed times per chunk times runner.tier_latency_scale."""
    from glm53.perfmodel import STORAGE

    scale = cfg.runner.get("tier_bandwidth_scale", 1.0)
    if not scale > 0:
        raise ValueError(f"runner.tier_bandwidth_scale must be > 0, got {scale!r}")
    late = cfg.runner.get("tier_latency_scale", 1.0)
    if not late >= 0:
        raise ValueError(f"runner.tier_latency_scale must be >= 0, got {late!r}")
    return {kind: dataclasses.replace(m, read_bandwidth=m.read_bandwidth * scale, write_bandwidth=m.write_bandwidth * scale,
                                      read_latency_s=m.read_latency_s * late, write_latency_s=m.write_latency_s * late)
            for kind, m in STORAGE.items()}


def _deploy(cfg: ConfigDict, kv_policy: str, tier_root: str = "", own: dict | None = None):
    """The DeployConfig of sweep entry `kv_policy`: a policy name, or a variant named in policy_deploy
    whose fields include its own "kv_policy" (e.g. "offload+fs": offload with a filesystem tier). A
    filesystem tier with root_dir "" gets `tier_root` (run_one passes a fresh directory per point).
    own: the entry's fields instead of policy_deploy's (one side of a P/D deployment)."""
    import glm53

    d = dict(cfg.deploy.to_dict())
    d["num_gpu_blocks"] = d["num_gpu_blocks"] or None  # 0: what the KV memory budget holds (DeployConfig)
    d["hisparse_device_buffer_size"] = d.get("hisparse_device_buffer_size") or None  # 0: 2 x top-k
    d["index_block_size"] = d.get("index_block_size") or None  # 0: block_size
    d["kv_cache_memory_bytes"] = d.get("kv_cache_memory_bytes") or None  # 0: the machine's budget
    if own is None:
        own = cfg.get("policy_deploy", {}).get(kv_policy, {})  # this policy's own fields, e.g. its host pools
    own = copy.deepcopy(own.to_dict() if isinstance(own, ConfigDict) else dict(own))
    policy = own.pop("kv_policy", kv_policy)
    d.update(own)
    ktc = d.get("kv_transfer_config")
    for tier in (ktc or {}).get("kv_connector_extra_config", {}).get("secondary_tiers", []):
        if tier.get("type") == "fs" and not tier.get("root_dir"):
            if not tier_root:
                raise ValueError(f"sweep entry {kv_policy!r}: a filesystem tier with root_dir '' needs a directory")
            tier["root_dir"] = tier_root
    if ktc:
        policy = "offload"
    return glm53.DeployConfig(**d, kv_policy=policy)


def point_sessions(cfg: ConfigDict, concurrency: int) -> list[workloads.Session]:
    """The sessions one sweep point serves: the workload's, or concurrency x sweep.sessions_per_user of them."""
    sessions = build_sessions(cfg.workload, cfg.deploy.max_model_len)
    per_user = cfg.sweep.sessions_per_user
    if per_user:  # as many sessions as users: each point serves concurrency x per_user sessions
        sessions = sessions[: concurrency * per_user]
    return sessions


def make_client(eng, cfg: ConfigDict, sessions, concurrency: int) -> workloads.ClosedLoopClient:
    """The closed-loop client of one sweep point on `eng` (greedy requests of each turn's output length)."""
    import glm53

    return workloads.ClosedLoopClient(
        eng, sessions, concurrency, vocab_size=eng.cfg.vocab_size, seed=cfg.workload.seed,
        make_params=lambda n: glm53.SamplingParams(max_new_tokens=n), think_time_scale=cfg.workload.think_time_scale,
        salt_prefix="user:", max_model_len=eng.deploy.max_model_len)


def _collections(cfg: ConfigDict):
    """The garbage collector's setting for a point: the simulator's (glm53.engine.sim.fewer_collections),
    or as it is where the model runs."""
    if not simulated(cfg):
        return contextlib.nullcontext()
    from glm53.engine.sim import fewer_collections

    return fewer_collections()


def run_one(model, cfg: ConfigDict, kv_policy: str, concurrency: int, *, exporter=None, progress=True) -> dict:
    """One sweep point on a fresh engine: the workload at `concurrency` -> metrics dict."""
    from glm53.engine.runner import CompileCounter

    sessions = point_sessions(cfg, concurrency)
    tiers = tempfile.TemporaryDirectory(prefix="serve-tiers-")  # a fresh filesystem tier per point
    eng = _engine(model, cfg, kv_policy, tiers.name)
    client = make_client(eng, cfg, sessions, concurrency)
    total = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=total, desc=f"{kv_policy} c={concurrency}", unit="req", disable=not progress, leave=False)

    if exporter is not None:
        from glm53.engine.prometheus import ServingMetrics

        exporter.attach(ServingMetrics(eng, model_name=cfg.name))

    def on_step(e):
        bar.update(len(e.finished) - bar.n)

    measure = cfg.sweep.measure
    if measure not in ("full", "steady"):
        raise ValueError(f"sweep.measure must be 'full' or 'steady', got {measure!r}")
    warmup_s, window_s = cfg.sweep.get("window_warmup_s", 0.0), cfg.sweep.get("window_s", 0.0)
    if (warmup_s or window_s) and measure != "steady":
        raise ValueError(f"sweep.window_warmup_s={warmup_s} / sweep.window_s={window_s} bound a steady window: "
                         "they need sweep.measure='steady'")
    t0 = time.perf_counter()
    with CompileCounter() as compiles, _collections(cfg):
        # a pool that runs short inside the window is ClosedLoopClient's ValueError ("serve more sessions":
        # workload.sessions, sweep.sessions_per_user)
        res = client.run(on_step=on_step, stop_at_drain=measure == "steady", warmup_s=warmup_s, window_s=window_s)
    wall = time.perf_counter() - t0
    bar.close()
    eng.shutdown()
    tiers.cleanup()
    if measure == "steady":  # the figures over the steady window; requests sent after it are left unfinished
        m = eng.metrics([r for r in res.request_ids if r in eng.finished], window=res.steady_window)
    else:
        m = eng.metrics(res.request_ids)
    m.update(measure=measure, steady_window_s=list(res.steady_window) if res.steady_window else None,
             window_warmup_s=warmup_s, window_s=window_s, sessions_started=res.sessions_started)
    pd = _pd_deployment(cfg, kv_policy)
    if pd is not None:  # what follows reads the decode engine; the pair's own figures are in m already
        m.update(prefill=pd.get("prefill_name", "prefill"), decode=pd.get("decode_name", "decode"),
                 prefill_deployment=_describe(eng.prefill.deploy))
        eng = eng.decode
    d = eng.deploy
    m.update(kv_policy=kv_policy, concurrency=concurrency, sessions=len(sessions), engine_steps=res.steps,
             wall_s=wall, num_gpu_blocks=sum(r.scheduler.kv.pool.num_blocks for r in eng.replicas),
             compilations_during_run=compiles.count,
             bucket_shapes_used=len(set().union(*(getattr(r.runner, "compiled_shapes", ()) for r in eng.replicas))),
             runner="sim" if simulated(cfg) else "model", max_model_len=d.max_model_len,
             num_speculative_tokens=d.num_speculative_tokens,
             deployment=_describe(d), throughput_tok_s_per_gpu=m["throughput_tok_s_per_device"],
             # over the measured window (steady) or the whole run; the decode node's under P/D
             step_mix=step_mix(eng.timeline, res.steady_window if measure == "steady" else None),
             # the bytes the pool takes: the shared buffer's price in the simulator, the runner's arrays
             # (a page of every group per block) where the model runs
             device_kv_budget_bytes_per_gpu=int(d.num_gpu_blocks * (block_bytes if simulated(cfg) else runner_block_bytes)(
                 eng.sizes.page_bytes) // d.decode_context_parallel_size))
    if simulated(cfg):
        busy = [r.runner.busy_s for r in eng.replicas]
        ops: dict[str, float] = {}
        for r in eng.replicas:
            for k, v in r.runner.time_by_op.items():
                ops[k] = ops.get(k, 0.0) + v
        # sim_step_mean_s: this engine's mean step in simulated seconds (its timeline: one row per step that
        # scheduled requests, from scheduling to the clock after it), what a fixed per-step cost is read against
        m.update(simulated_s=eng.clock.now(), busy_frac=max(busy) / max(eng.clock.now(), 1e-12),
                 sim_step_mean_s=sum(r[4] - r[0] for r in eng.timeline) / max(len(eng.timeline), 1),
                 hardware=cfg.runner.hardware, sim_steps_per_wall_s=res.steps / max(wall, 1e-9),
                 sim_time_by_op_s=dict(sorted(ops.items(), key=lambda kv: -kv[1])),
                 assumed_hisparse_miss_fraction=cfg.runner.hisparse_miss_fraction,
                 assumed_step_overhead_s=cfg.runner.step_overhead_s,
                 assumed_expert_load_imbalance=cfg.runner.get("expert_load_imbalance", 1.0),
                 assumed_host_copy_overlap=cfg.runner.get("host_copy_overlap", 0.0),
                 assumed_dp_pacing=cfg.runner.get("dp_pacing", "lockstep"),
                 sim_hot_miss_rows=sum(r.runner.hot_miss_rows for r in eng.replicas),
                 sim_staged_rows=sum(r.runner.staged_rows for r in eng.replicas))
        tiers = [t for r in eng.replicas if r.runner.tiers is not None for t in r.runner.tiers.tiers]
        if tiers:  # each simulated tier's device: seconds its read / write channel was busy, per simulated second
            span = max(eng.clock.now(), 1e-12)
            m["sim_tier_busy_frac"] = {t.name: {"read": t.reads.busy_s / span, "write": t.writes.busy_s / span}
                                       for t in tiers}
            m["assumed_tier_storage"] = {k: dataclasses.asdict(v) for k, v in _tier_storage(cfg).items()}
    return m


def step_mix(timeline, window: tuple[float, float] | None = None) -> dict:
    """An engine's steps split by what they carry: "decode_only" (every row one token and its drafts) and
    "with_prefill" (some row a prompt chunk), each {"steps", "mean_s", "time_s"}, with_prefill also
    "prefill_tokens_mean"; "span_s", from the first step's start to the last one's end (span_s minus the
    steps' time is what ran between steps: a serving loop's own work); over the steps starting inside
    `window` [t0, t1] (engine clock s, as the metrics' window; None: every step). Why: a step's mean
    hides its mix; a fixed per-step cost lengthens each decode-only step by itself, while
    prefill-carrying steps may merge (fewer, each with more prompt tokens)."""
    rows = [r for r in timeline if window is None or window[0] <= r[0] <= window[1]]
    out = {"span_s": rows[-1][4] - rows[0][0] if rows else 0.0}
    prefill = [r for r in rows if r[5]]
    for kind, rows_k in (("decode_only", [r for r in rows if not r[5]]), ("with_prefill", prefill)):
        time_s = sum(r[4] - r[0] for r in rows_k)
        out[kind] = {"steps": len(rows_k), "mean_s": time_s / len(rows_k) if rows_k else None, "time_s": time_s}
    out["with_prefill"]["prefill_tokens_mean"] = sum(r[5] for r in prefill) / len(prefill) if prefill else None
    return out


def _describe(d) -> str:
    return (f"DP{d.data_parallel_size} TP{d.tensor_parallel_size} PCP{d.prefill_context_parallel_size} "
            f"DCP{d.decode_context_parallel_size}" + (" EP" if d.enable_expert_parallel else ""))


def warm_up(model, cfg: ConfigDict) -> float:
    """Compile every bucket shape the engine can use (padding-only steps) and every policy's copy
    programs -> seconds. Forward shapes do not depend on the policy or the concurrency, and compiled
    programs are shared by every engine on the model (the first policy's warm-up compiles them, the
    others' find them), so the measured runs compile nothing."""
    import glm53

    t0 = time.perf_counter()
    if simulated(cfg):
        return 0.0
    for policy in cfg.sweep.kv_policy:
        with tempfile.TemporaryDirectory() as root:
            eng = glm53.Engine(model, _deploy(cfg, policy, root))
            eng.warmup()  # each data-parallel replica compiles for its own devices
            eng.shutdown()
    return time.perf_counter() - t0


def plot(runs: list[dict], out: Path) -> None:
    """Redraw a sweep's figures from its runs alone (results.json's "runs"): out/throughput_vs_interactivity.png,
    out/running_requests_vs_concurrency.png, and out/throughput_vs_concurrency.png and
    out/prefix_hit_rate_vs_concurrency.png (log-scale x); with MTP also out/acceptance_per_position.png
    (the measured acceptance rate of each draft position, one line per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    policies = {p: sorted((r for r in runs if r["kv_policy"] == p), key=lambda r: r["concurrency"])
                for p in dict.fromkeys(r["kv_policy"] for r in runs)}
    # (file, x key, y key, x label, y label)
    figures = (("throughput_vs_interactivity.png", "interactivity_tok_s_user", "throughput_tok_s_per_device",
                "interactivity (output tok/s per user = 1000 / mean TPOT ms)",
                "throughput (tok/s per device, cached input included)"),
               ("running_requests_vs_concurrency.png", "concurrency", "running_requests_mean", "concurrency (users)",
                "running requests (mean over the run)"),
               ("throughput_vs_concurrency.png", "concurrency", "throughput_tok_s_per_device", "concurrency (users)",
                "throughput (tok/s per device, cached input included)"),
               ("prefix_hit_rate_vs_concurrency.png", "concurrency", "prefix_hit_rate", "concurrency (users)",
                "prefix hit rate (prompt tokens served from a cache)"))
    for name, xk, yk, xlabel, ylabel in figures:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for policy, rs in policies.items():
            ax.plot([r[xk] for r in rs], [r[yk] for r in rs], "o-", label=policy)
            if xk != "concurrency":
                for r in rs:
                    ax.annotate(f"c{r['concurrency']}", (r[xk], r[yk]), textcoords="offset points", xytext=(4, 4),
                                fontsize=8)
        if name.endswith("_vs_concurrency.png") and name != "running_requests_vs_concurrency.png":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(title="kv_policy")
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    spec = [r for r in runs if r.get("spec_acceptance_rate_per_pos")]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for r in spec:
            rates = r["spec_acceptance_rate_per_pos"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", alpha=0.7,
                    label=f"{r['kv_policy']} c{r['concurrency']} (length {r['spec_acceptance_length_mean']:.2f})")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (accepted / drafted at that position)")
        ax.set_xticks(range(1, max(len(r["spec_acceptance_rate_per_pos"]) for r in spec) + 1))
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "acceptance_per_position.png", dpi=120)
        plt.close(fig)


def _enable_compile_cache(path: str) -> None:
    import jax

    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="configs/PATH.py defining get_config() (default: the built-in default)")
    ap.add_argument("--out", default="out/serve", help="directory for results.json and plots")
    ap.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    ap.add_argument("--compile-cache", default=os.environ.get("GLM53_COMPILE_CACHE", str(REPO / ".cache" / "jax")),
                    help="JAX persistent compilation cache directory ('' to disable)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="keep the points an unfinished OUT/results.json of the same config measured and run only "
                         "the missing ones (a sweep that stopped)")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        ap.error(f"unrecognised arguments: {' '.join(bad)}")
    cfg = load_config(args.config, overrides, default=default_config)
    get = cfg.deploy.get  # DeployConfig.devices_per_replica x data_parallel_size, before JAX starts
    per_replica = max(get("tensor_parallel_size", 1) * get("prefill_context_parallel_size", 1),
                      get("decode_context_parallel_size", 1))
    devices = get("data_parallel_size", 1) * per_replica
    if devices > 1 and not simulated(cfg):  # a parallel deployment: on CPU, simulate its devices (before JAX starts)
        from parallel.mesh import set_cpu_device_count

        set_cpu_device_count(devices)
    if args.compile_cache:
        _enable_compile_cache(args.compile_cache)

    import jax

    exporter = None
    if args.metrics_port:
        from glm53.engine.prometheus import MetricsEndpoint

        exporter = MetricsEndpoint()
        exporter.serve(args.metrics_port)
        print(f"Prometheus metrics on http://127.0.0.1:{args.metrics_port}/metrics")
    model, source = _model(cfg.model, weights=not simulated(cfg))
    sessions = build_sessions(cfg.workload, cfg.deploy.max_model_len)
    print(f"{cfg.name}: {source}; {len(sessions)} sessions ({cfg.workload.kind}), "
          f"policies {tuple(cfg.sweep.kv_policy)}, concurrency {tuple(cfg.sweep.concurrency)}")
    if cfg.warmup not in ("replay", "buckets", "none"):
        raise ValueError(f"warmup must be 'replay', 'buckets' or 'none', got {cfg.warmup!r}")
    warmup_s = warm_up(model, cfg) if cfg.warmup == "buckets" else 0.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    planned = [(p, c) for p in cfg.sweep.kv_policy for c in cfg.sweep.concurrency]
    revision = git_revision()  # the code this process runs (commits made during a long sweep do not count)

    def save(runs: list[dict]) -> dict:
        """results.json after every sweep point (atomically), so a long sweep that stops keeps what it
        measured; `complete` says whether every planned point ran."""
        results = {
            "config_name": cfg.name,
            "config": cfg.to_dict(),
            "model": source,
            "workload": dataclasses.asdict(_workload_summary(sessions)),
            "runs": runs,
            "complete": len(runs) == len(planned),
            "planned": [{"kv_policy": p, "concurrency": c} for p, c in planned],
            "warmup_s": warmup_s,
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "device": str(jax.devices()[0]),
                        "device_count": jax.device_count()},
            "git_revision": revision,
        }
        if len(runs) == 1:
            results.update({k: v for k, v in runs[0].items() if k not in results})
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=_jsonable))
        os.replace(tmp, out / "results.json")
        if len({r["concurrency"] for r in runs}) > 1:
            plot(runs, out)
        return results

    runs = _resumed(out / "results.json", cfg) if args.resume else []
    done = {(r["kv_policy"], r["concurrency"]) for r in runs}
    map_budget = sweep_map_budget()
    for policy, conc in planned:
        if (policy, conc) in done:
            continue
        # a long sweep compiles thousands of programs: past vm.max_map_count XLA:CPU aborts a compile
        if bound_memory_maps(map_budget) and cfg.warmup == "buckets" and not simulated(cfg):
            # the programs the warm-up compiled went with the caches: compile them again (from the disk
            # cache when it has them), so that the measured run compiles nothing
            print(f"  dropped JAX's caches before {policy} c={conc} (past {map_budget:,} memory "
                  "mappings): warming the bucket shapes up again", flush=True)
            warmup_s += warm_up(model, cfg)
        if cfg.warmup == "replay" and not simulated(cfg):  # a simulated run compiles nothing
            t0 = time.perf_counter()
            run_one(model, cfg, policy, conc, progress=False)
            warmup_s += time.perf_counter() - t0
        m = run_one(model, cfg, policy, conc, exporter=exporter, progress=not args.no_progress)
        m.update(git_revision=revision, date=time.strftime("%Y-%m-%d"), process=os.getpid())
        runs.append(m)
        runs.sort(key=lambda r: planned.index((r["kv_policy"], r["concurrency"])))
        print(f"  {policy:8s} c={conc:<3d} throughput {m['throughput_tok_s_per_device']:8.1f} tok/s/dev   "
              f"interactivity {m['interactivity_tok_s_user']:7.1f} tok/s/user   TTFT p50 {m['ttft_median_s']:.3f} s"
              f"   running {m['running_requests_mean']:.1f}   preemptions {m['preemptions']}"
              f"   prefix hit {m['prefix_hit_rate']:.1%}", flush=True)
        results = save(runs)
    print(f"wrote {out / 'results.json'}")
    return results


# config keys whose default changed after they were added, each with the behaviour a results.json that
# predates the key was measured with (a file without pd.consumer_waits computed what it could not stage)
DEFAULTS_BEFORE_KEY = {("pd", "consumer_waits"): False}


def _resumed(path: Path, cfg) -> list[dict]:
    """The runs of an earlier results.json of this config (none if there is no file); each keeps the code
    revision and date it was measured with (`git_revision`, `date`). `process`: the pid of the sweep process
    that measured a point (points of one process share compiled programs); None for the kept points of a
    file that predates the key."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    now = json.loads(json.dumps(cfg.to_dict(), default=_jsonable))
    for (section, key), value in DEFAULTS_BEFORE_KEY.items():  # what a file from before the key ran with
        if isinstance(old.get("config", {}).get(section), dict):
            old["config"][section].setdefault(key, value)
    if old.get("config") != _without_new_defaults(now, old.get("config"),
                                                  json.loads(json.dumps(default_config().to_dict(), default=_jsonable))):
        raise SystemExit(f"--resume: {path} was measured with another config; move it away or drop --resume")
    runs = old["runs"]
    for r in runs:
        r.setdefault("git_revision", old.get("git_revision"))
        r.setdefault("date", old.get("date"))
        r.setdefault("process", None)
    print(f"resuming {path}: {len(runs)} point(s) kept")
    return runs


def _without_new_defaults(now, old, default):
    """`now` (a config as plain dicts) less the keys `old` lacks whose value is the built-in default's: a
    knob added after `old` was measured, left at its default, does not change what a point measures."""
    if not isinstance(now, dict) or not isinstance(old, dict):
        return now
    out = {}
    for k, v in now.items():
        if k not in old:
            if isinstance(default, dict) and k in default and default[k] == v:
                continue
            out[k] = v
        else:
            out[k] = _without_new_defaults(v, old[k], default.get(k) if isinstance(default, dict) else None)
    return out


@dataclasses.dataclass(frozen=True)
class _WorkloadSummary:
    sessions: int
    requests: int
    prompt_tokens_first_turn_mean: float
    output_tokens_mean: float
    max_context_tokens: int


def _workload_summary(sessions) -> _WorkloadSummary:
    turns = [t for s in sessions for t in s.turns]
    return _WorkloadSummary(len(sessions), len(turns), sum(s.turns[0].input_tokens for s in sessions) / len(sessions),
                            sum(t.output_tokens for t in turns) / len(turns),
                            max(s.max_context_tokens() for s in sessions))


def _jsonable(x):
    if isinstance(x, tuple):
        return list(x)
    return float(x) if hasattr(x, "__float__") else str(x)


if __name__ == "__main__":
    main()
