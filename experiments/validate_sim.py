"""Validate the simulator against the real engine at laptop scale (issue 19, item 4).

    python -m experiments.validate_sim --out results/validate_sim             # hours on 2 idle cores
    python -m experiments.validate_sim --only smoke,tiered_scaling --out DIR   # held-out configs by name
    python -m experiments.validate_sim --only dp8 --fit-from DIR --out DIR2    # DIR's fitted spec, no refit
    python -m experiments.validate_sim --summarize DIR --merge DIR2,DIR3       # DIR's points + theirs
    python -m experiments.validate_sim --summarize results/validate_sim        # mape / table from its points
    python -m experiments.validate_sim --summarize DIR --reprice               # its simulated side priced again
    python -m experiments.validate_sim --grid-spread --out results/validate_sim  # the grid's timing noise

A run in parts: one invocation fits the spec (and runs what --only names), the others take that spec
(`--fit-from`) and run the rest, and `--summarize DIR --merge ...` gathers their points into DIR (runs
with different specs refuse to merge). `--override` shrinks a point (a smaller concurrency, say) to check
that it runs and that its counts are equal; such points do not make a run complete.

1. Calibrate a CPU HardwareSpec on this machine from the model runner's own forward timings: a grid of
   forward programs of the serve default's model (rows 1 and 4; 1 to 1,024 tokens per row; attention
   windows of 64 to 8,192 positions: the shapes every validated config runs), and the forwards the
   serve default itself executes (8 OpenHands sessions at 1/128 scale, concurrency 1, 2, 4; served
   twice per point, the first pass compiling, the second timed with each forward waited for). The
   simulator prices the shapes the model runner executes (`SimRunner(pad_like_runner=True)`: one
   padded forward per width bucket over its attention window), so each timed shape is fitted as
   `forward_latency_s + step_cost(its padded rows on the CPU spec)`: the CPU's FLOP rate and memory
   bandwidth on a log grid (all efficiencies 1: the rates are achieved ones), the forward latency the
   median residual, minimising the mean |log(predicted / measured)| over the distinct shapes (each at
   its median time). A step's host time splits where its first forward is dispatched: before it
   (scheduling, block tables: `step_before_forward_s`, the median) plus the serving loop's time between
   engine steps (`step_gap_s`, the median), together `step_overhead_s`, and the rest of its non-forward
   time (the sampling program, the tokens' bookkeeping: `host_overlap_s`, the median). The simulator
   dispatches like the runner (`SimRunner(async_dispatch=True)`): forwards queue on the device, a step
   waits only for the last forward it samples from, and the host time after dispatch follows that
   forward (sampling reads its result). A second fit, the same way, prices DP x EP
   (`lockstep`): its own grid of lock-step programs (every rank's rows in one program over the 8
   devices, `LOCKSTEP_GRID`) and the serve default's workload served on DP8 x EP8 ranks at concurrency 4
   (`TRAIN_LOCKSTEP`): the ranks' device computations share the host's cores and a step schedules every
   rank but samples once, which one device's spec divided by 8 (`shared_host`) misprices.
2. Re-run held-out configs (`HELD_OUT`) both ways, real (warmed: compile time excluded; nothing waited
   for beyond what the engine waits for) and simulated on the fitted spec (same deploy, float32 KV and
   weights, so the same pools and the same schedule): the KV policies (preempt, swap, offload: smoke,
   preempt_vs_offload; HiSparse: hisparse_vs_offload at concurrency 4 and 8, its 16 and 32 points take
   half an hour of real time), the host tier and a filesystem tier (tiered_scaling at 16 and 64
   conversations), MTP3 under each verify form (the runner's sequential, CPU's default, and batched),
   DP8, DP8 x EP8 (ranks sharing their experts) and PCP8 x DCP8 x EP8 on 8 simulated devices. Per
   point: median TTFT, mean TPOT, throughput per device, running requests, and the counts that do not
   depend on time (preemptions, prefix hits, engine steps; under DP each rank's scheduled tokens and
   idle steps), which must be equal: without think time the schedule is a function of the requests. Each
   point is called prefill-bound or decode-bound by where its real step time went.
3. P/D over HTTP, timings only (`--pd-http`, `pd_http_comparison`): the points of a committed
   experiments.pd_http run (its servers, router and client are processes on this machine; an hour of
   real time, so it is run on its own) against their simulated twins (`experiments.pd_http.twin`: the
   servers' own DeployConfigs as one PdPair), on one device's spec fitted as in 1 but with its programs
   compiled under the flags the servers compiled with (`pd_http_fits`; pd_http's servers compile at -O0),
   one twin per fit kept for that run (a run of `pd_http --fit-each-point` prices each point on the fit
   made just before it). The processes share the cores: the twin prices a step on the
   shared host while the other engine is busy ("contended"); each engine always alone and always sharing
   are its bounds. Its counts are not compared (they depend on wall-clock routing). Its "contended"
   timings count in `mape` only where each point was priced on its own fit (`pd_http_errors`): fits of
   the same code an hour apart on this machine moved the twin's TPOT by half (docs/simulator.md).

Writes OUT/results.json (the fitted spec, the fit's error on its own forwards and steps, every point
with real, simulated and relative error; `mape`: the mean |simulated / real - 1| over the held-out
points (and item 3's, where they count) of median TTFT, mean TPOT and throughput per device, fractions; `counts_equal`: every point's
counts equal; `complete`: the fit's points and every HELD_OUT config ran, none with an `--override`;
`pd_http`: item 3's comparison, with its spec; rewritten after every point) and OUT/table.md (the validation
table). A benchmark: it asserts nothing (tests/experiments/test_validate_sim.py bounds the committed
run's `mape`, requires `counts_equal` and every HELD_OUT config: `check`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from experiments import serve
from experiments.common import child_env, cpu_name, git_revision, load_config

METRICS = ("ttft_median_s", "tpot_mean_s", "throughput_tok_s_per_device", "running_requests_mean")
MAPE_METRICS = ("ttft_median_s", "tpot_mean_s", "throughput_tok_s_per_device")  # `summary`'s mape
# schedule counts (absent on both sides where the layout has no DP ranks)
COUNTS = ("preemptions", "prefix_hit_rate", "engine_steps", "output_tokens", "dp_rank_tokens", "dp_idle_rank_steps")
TRAIN = ("serve_default", None, ())
# the lock-step fit's points (`shared_host`): the serve default's workload on the held-out DP x EP layout's
# ranks (not its workload: dp8_ep8 serves 4 turns at concurrency 8 with 2 rows per rank)
TRAIN_LOCKSTEP = ("serve_default_dp8_ep8", None, ("--config.deploy.data_parallel_size=8",
                                                  "--config.deploy.enable_expert_parallel=True",
                                                  "--config.sweep.concurrency=(4,)"))
MAPE_BOUND = 0.25  # the largest committed MAPE of each metric the test accepts
GAP_NOTE = " (the serving loop's gap between steps included)"  # table text for fits that carry step_gap_s
_MTP3 = "configs/ablations/hisparse_vs_offload_mtp3.py"


def _verify(form: str) -> str:
    """The override that runs _MTP3's speculative_config with speculative_config["verify"] = form."""
    return "--config.deploy.speculative_config=" + repr({"method": "mtp", "num_speculative_tokens": 3,
                                                        "rejection_sample_method": "synthetic",
                                                        "synthetic_acceptance_length": 2.99, "verify": form})


HELD_OUT = (("smoke", "configs/smoke.py", ()),
            ("preempt_vs_offload", "configs/ablations/preempt_vs_offload.py", ()),
            ("hisparse_vs_offload", "configs/ablations/hisparse_vs_offload.py", ("--config.sweep.concurrency=(4, 8)",)),
            ("tiered_scaling", "configs/ablations/tiered_scaling.py", ("--config.sweep.concurrency=(16, 64)",)),
            ("mtp3_sequential", _MTP3, ("--config.sweep.concurrency=(4,)", _verify("sequential"))),
            ("mtp3_batched", _MTP3, ("--config.sweep.concurrency=(4,)", _verify("batched"))),
            ("dp8", "configs/deployments/dp8.py", ()),
            ("dp8_ep8", "configs/deployments/dp8_ep8.py", ()),
            ("pcp8_dcp8", "configs/deployments/pcp8_dcp8.py", ()))
DEVICES = 8  # simulated CPU devices of the process: the DP8 and PCP8 x DCP8 configs need them
WEIGHT_BYTES = 4  # float32 weights on CPU


def cpu_spec(flops: float, bandwidth: float, forward_latency_s: float = 0.0):
    """A HardwareSpec for this CPU: achieved FLOP/s (every dtype) and memory bandwidth, efficiencies 1,
    the host link as fast as memory (pinned host memory is the same DRAM), a fixed time per forward
    program, no other latencies; platform "cpu", so the simulator prices the runner's CPU choices (MTP's
    sequential verify under speculative_config verify="auto")."""
    from glm53.perfmodel import H200

    return dataclasses.replace(
        H200, name=f"cpu ({cpu_name()}, {os.cpu_count()} cores, fitted)", platform="cpu", bf16_flops=flops,
        fp8_flops=flops,
        hbm_bandwidth=bandwidth, host_link_bandwidth=bandwidth, matmul_efficiency=1.0, hbm_efficiency=1.0,
        sparse_attention_efficiency=1.0, dense_attention_efficiency=1.0, nvlink_efficiency=1.0,
        collective_latency_s=0.0, host_copy_latency_s=0.0, head_granularity=1, forward_latency_s=forward_latency_s)


def fitted_spec(fit: dict):
    """The CPU spec of a fit (`fit`'s dict, a run's cpu_spec_fit): `cpu_spec` of its rates and latency."""
    return cpu_spec(fit["flops"], fit["bandwidth"], fit["forward_latency_s"])


def _stamp(benchmark: str) -> dict:
    """What a results.json of this module says of its run: benchmark, date, git revision, machine."""
    return {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
            "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count()}}


class StepLog:
    """Wraps an engine so each step's plans, transfers and wall time are recorded; with `forwards=True`
    each forward program is also waited for and timed (its shape and seconds in `forwards`), and so is
    the step (calibration only: a serving engine does not wait for a forward whose logits it does not
    need).

    The hooks: `Engine.step` (the step's wall time) and each replica runner's public `execute` (DP x EP:
    replica 0's `execute_ranks`, which runs every rank's plan), so every replica's plan of a step is seen;
    the forward timing wraps `ModelRunner._forward`, the one call every non-MTP forward of
    `ModelRunner.execute` goes through (the calibration serves the serve default: one device, no MTP)."""

    def __init__(self, eng, forwards: bool = False):
        import jax

        self.steps: list[tuple] = []  # (plans, d2h bytes, h2d bytes, transfers, wall s): plans of every replica
        self.forwards: list[tuple] = []  # (step index, rows (per rank under DP x EP), width, window, s)
        self.before_forwards: dict[int, float] = {}  # step index -> host seconds before its first forward
        # host seconds between one engine step's return and the next one's call (the serving loop's own work:
        # outputs handed back, requests added), for each two consecutive engine steps that both ran plans
        self.gaps: list[float] = []
        step = eng.step
        last: dict = {"plans": [], "res": []}

        def wrap(runner, name):
            run = getattr(runner, name)

            def timed(plan):
                res = run(plan)
                plans, results = (plan, res) if name == "execute_ranks" else ([plan], [res])
                last["plans"] += [p for p in plans if p is not None]
                last["res"] += [r for r in results if r is not None]
                return res

            setattr(runner, name, timed)

        runners = [rep.runner for rep in eng.replicas]
        if eng._lockstep:
            wrap(runners[0], "execute_ranks")
        else:
            for runner in runners:
                wrap(runner, "execute")

        def timed_step():
            last["plans"], last["res"] = [], []
            t0 = last["t0"] = time.perf_counter()
            out = step()
            if forwards:
                jax.block_until_ready([r.cache for r in runners])
            t1 = time.perf_counter()
            dt = t1 - t0
            if last["plans"] and last.get("t1") is not None:
                self.gaps.append(t0 - last["t1"])
            last["t1"] = t1 if last["plans"] else None
            if last["plans"]:
                self.steps.append((tuple(last["plans"]), sum(r.d2h_bytes for r in last["res"]),
                                   sum(r.h2d_bytes for r in last["res"]),
                                   sum(len(p.transfers) for p in last["plans"]), dt))
            return out

        eng.step = timed_step
        if forwards:
            if (len(runners) != 1 and not eng._lockstep) or runners[0].k:
                raise ValueError("StepLog(forwards=True) times one runner without MTP (the calibration's serve "
                                 "default, on one device or as DP x EP ranks)")
            runner = runners[0]
            forward, ranks = runner._forward, runner.fwd.ranks

            def timed_forward(tok, pos, *a, **k):
                t0 = time.perf_counter()
                self.before_forwards.setdefault(len(self.steps), t0 - last["t0"])
                out = jax.block_until_ready(forward(tok, pos, *a, **k))
                window = a[2] if len(a) > 2 else k["window"]
                self.forwards.append((len(self.steps), tok.shape[0] // ranks, tok.shape[1], window,
                                      time.perf_counter() - t0))
                return out

            runner._forward = timed_forward


def _real(cfg, model, policy: str, conc: int, forwards: bool = False) -> tuple[dict, StepLog]:
    serve.run_one(model, cfg, policy, conc, progress=False)  # compiles (untimed)
    logs = []
    make = serve._engine

    def engine(*a, **k):
        e = make(*a, **k)
        logs.append(StepLog(e, forwards))
        return e

    serve._engine = engine
    try:
        m = serve.run_one(model, cfg, policy, conc, progress=False)
    finally:
        serve._engine = make
    return m, logs[0]


def shared_host(hw, overhead: float, overlap: float, devices: int, lockstep: dict | None = None,
                replicas: int | None = None, gap: float = 0.0) -> tuple:
    """(spec, step overhead s, host overlap s) of one of `devices` simulated CPU devices that share this
    host: every rate divided by `devices` and the fixed time per forward multiplied by it, the host parts
    multiplied by `replicas` (default `devices`). The real engine runs the devices on the same cores (DP
    replicas one after another, a mesh's device programs side by side on one thread pool), so a step that
    keeps each of N devices busy takes N times the host's time for one; the simulator prices devices that
    run in parallel. Exact when the devices carry equal work. The host parts are each replica's own loop
    (scheduling, the tokens' bookkeeping): DP replicas run theirs one after another, while a replica
    spread over a mesh (PCP x DCP) runs one loop for all its devices. `gap`, the serving loop's time
    between engine steps (part of `overhead`), comes once per engine step whatever the replicas.

    `lockstep` (the lock-step fit, `calibrate` on TRAIN_LOCKSTEP, for a DP x EP layout of its `devices`
    ranks): its rates, fixed time per program and host parts instead, each timed on that layout (programs
    that run every rank's rows at once over the ranks' devices, and steps that schedule every rank but
    sample once), where one device's rates / N and host parts x N misprice it; the host link still / N
    (the ranks' copies share this DRAM)."""
    replicas = devices if replicas is None else replicas
    if devices == 1:
        return hw, overhead, overlap
    if lockstep is not None:
        if lockstep["devices"] != devices:
            raise ValueError(f"the lock-step fit is for {lockstep['devices']} ranks, not {devices}")
        return (dataclasses.replace(
            hw, bf16_flops=lockstep["flops"], fp8_flops=lockstep["flops"], hbm_bandwidth=lockstep["bandwidth"],
            host_link_bandwidth=hw.host_link_bandwidth / devices, forward_latency_s=lockstep["forward_latency_s"]),
            lockstep["step_overhead_s"], lockstep["host_overlap_s"])
    return (dataclasses.replace(
        hw, bf16_flops=hw.bf16_flops / devices, fp8_flops=hw.fp8_flops / devices,
        hbm_bandwidth=hw.hbm_bandwidth / devices, host_link_bandwidth=hw.host_link_bandwidth / devices,
        forward_latency_s=hw.forward_latency_s * devices), (overhead - gap) * replicas + gap, overlap * replicas)


def host_specs(fit: dict):
    """devices -> `shared_host` of the CPU spec fitted as `fit` (cpu_spec_fit) for that many devices sharing
    this host, without the lock-step fit: what prices pd_http's twin (`experiments.pd_http.twin`)."""
    return functools.partial(shared_host, fitted_spec(fit),
                             fit["step_overhead_s"], fit["host_overlap_s"])


def _sim(cfg, policy: str, conc: int, hw, overhead: float, overlap: float = 0.0, lockstep: dict | None = None,
         gap: float = 0.0) -> dict:
    """The simulated twin of a real point; `lockstep`: the lock-step fit, which prices DP x EP layouts of
    its ranks (`shared_host`)."""
    from glm53.engine import sim

    sim_cfg, _ = serve._model(cfg.model, weights=False)
    make = serve._engine

    def engine(model, c, kv_policy, tier_root=""):
        d = serve._deploy(c, kv_policy, tier_root or "unused")  # a simulated filesystem tier writes nothing
        d = dataclasses.replace(d, kv_cache_dtype="float32" if d.kv_cache_dtype == "auto" else d.kv_cache_dtype)
        ls = lockstep if d.experts_across_ranks else None
        spec, before, after = shared_host(hw, overhead, overlap, d.data_parallel_size * d.devices_per_replica, ls,
                                          replicas=d.data_parallel_size, gap=gap)
        return sim.build_engine(model, d, spec, step_overhead_s=before, weight_bytes=WEIGHT_BYTES,
                                hisparse_miss_fraction=0.0, pad_like_runner=True, async_dispatch=True,
                                host_overlap_s=after, tier_storage=serve._tier_storage(c))

    serve._engine = engine
    try:
        return serve.run_one(sim_cfg, cfg, policy, conc, progress=False)
    finally:
        serve._engine = make


def _forward_price(cfg_model, dep, hw, shape) -> float:
    from glm53.engine.sim import forward_cost

    return forward_cost(cfg_model, hw, dep, *shape).time_s()


# the calibration grid: forward programs of the serve default's model (rows x tokens per row x attention
# window), spanning the shapes every validated config runs (decode batches, prefill chunks, windows up to
# the longest context)
GRID_ROWS = (1, 4)
GRID_WIDTHS = (1, 16, 64, 256, 1024)
GRID_WINDOWS = (64, 512, 2048, 8192)
# timings of each grid shape, taken in rounds over the whole grid (docs/simulator.md, "Timing the grid":
# why in rounds, and why this many)
GRID_REPEATS = 9


def grid_args(runner, rows: int, width: int, window: int) -> tuple:
    """`runner._forward`'s arguments for a grid shape: `rows` rows of `width` tokens ending at position
    `window`, every row on the same pages (a forward's time does not depend on what they hold)."""
    tpb, itpb = runner.deploy.tokens_per_block, runner.deploy.index_tokens_per_block
    return (np.zeros((rows, width), np.int32), np.tile(np.arange(window - width, window, dtype=np.int32), (rows, 1)),
            runner._table("mla", rows, [list(range(window // tpb))] * rows, window),
            runner._table("indexer", rows, [list(range(-(-window // itpb)))] * rows, window), window)


def grid_runner(model, deploy, rows, widths, windows):
    """A model runner of `deploy` widened to a grid of forward shapes: its widest window as max_model_len,
    its widest rows and width as the batch limits, a pool of every row's pages (they share them)."""
    import glm53

    d = dataclasses.replace(deploy, max_model_len=max(windows), max_num_batched_tokens=max(widths),
                            max_num_seqs=max(rows), num_gpu_blocks=2 * max(windows) // deploy.block_size)
    return glm53.Engine(model, d).replicas[0].runner


def time_forward(runner, args: tuple) -> float:
    """Seconds of one `runner._forward(*args)` (`grid_args`), its result waited for."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(runner._forward(*args))
    return time.perf_counter() - t0


def time_forward_grid(model, deploy, repeats: int = GRID_REPEATS, rows=GRID_ROWS, widths=GRID_WIDTHS,
                      windows=GRID_WINDOWS, in_rounds: bool = True) -> dict[tuple[int, int, int], float]:
    """Median seconds of each grid forward (rows, width, window) on a model runner of `deploy` widened to
    the grid (its widest window, its widest rows), each program compiled first; every row reads and writes
    the same pages (the timing does not depend on what they hold). Under DP x EP `rows` are per rank: the
    program runs ranks x rows rows, every rank the same (the lock-step a step of equal ranks runs).

    The shapes are timed in `repeats` rounds, each running every shape once: this machine's speed drifts
    over seconds, and a shape timed in one block would carry the drift of its moment as its own cost;
    spread over rounds, the drift is common to every shape, which the fit's rates absorb. `in_rounds=False`
    times each shape's runs back to back instead (the calibration before rounds; `grid_spread` compares)."""
    runner = grid_runner(model, deploy, rows, widths, windows)
    ranks = runner.fwd.ranks
    args = {(r, width, window): grid_args(runner, r * ranks, width, window)
            for r in rows for width in widths for window in windows if width <= window}

    def seconds(shape) -> float:
        return time_forward(runner, args[shape])

    for shape in args:  # compiles
        seconds(shape)
    if not in_rounds:
        return {shape: statistics.median([seconds(shape) for _ in range(repeats)]) for shape in args}
    times = {shape: [] for shape in args}
    for _ in range(repeats):
        for shape in args:
            times[shape].append(seconds(shape))
    return {shape: statistics.median(t) for shape, t in times.items()}


# grid_spread's timing protocols: (name, runs of each shape, in rounds)
GRID_PROTOCOLS = (("3 back to back", 3, False), ("9 back to back", 9, False), ("9 rounds", GRID_REPEATS, True),
                  ("21 rounds", 21, True))


def grid_spread(protocols=GRID_PROTOCOLS) -> dict:
    """How much the calibration grid's per-shape timings move between two timings of it one after the
    other, under each timing protocol ((name, runs, in rounds): `time_forward_grid`), on the fit's model
    and deploy (TRAIN) -> {name: {"log_ratio_abs_mean", "log_ratio_abs_max": of each shape's time in the
    second timing over the first, after removing the median log ratio (a speed change common to every
    shape, which the fit's rates absorb), "common_ratio", "seconds"}}. Compiled before the first timing."""
    cfg = load_config(TRAIN[1], list(TRAIN[2]), default=serve.default_config)
    model, _ = serve._model(cfg.model)
    deploy = serve._deploy(cfg, cfg.sweep.kv_policy[0])
    out = {}
    for name, runs, rounds in protocols:
        t0 = time.perf_counter()
        a, b = (time_forward_grid(model, deploy, runs, in_rounds=rounds) for _ in range(2))
        r = np.log(np.array([b[k] / a[k] for k in a]))
        dev = np.abs(r - np.median(r))
        out[name] = {"runs": runs, "in_rounds": rounds, "shapes": len(r), "common_ratio": float(np.exp(np.median(r))),
                     "log_ratio_abs_mean": float(dev.mean()), "log_ratio_abs_max": float(dev.max()),
                     "seconds": time.perf_counter() - t0}
        print(f"[validate_sim] grid spread, {name}: {out[name]['log_ratio_abs_mean']:.3f} mean |log ratio| per "
              f"shape (max {out[name]['log_ratio_abs_max']:.3f}; common ratio {out[name]['common_ratio']:.3f})",
              flush=True)
    return out


# the lock-step grid: DP x EP programs (every rank's rows in one program over the ranks' devices) at the
# shapes a DP8 x EP8 serve default runs: rows per rank, widths up to its budget, windows up to its
# max_model_len
LOCKSTEP_GRID = dict(rows=(1, 2), widths=(1, 16, 64, 256), windows=(64, 256, 1024))


def fit(cfg_model, deploy, times: dict[tuple[int, int, int], float], logs=()) -> dict:
    """Grid fit of (FLOP/s, B/s) with the forward latency as the median residual over the timed forward
    shapes `times` ({(rows, width, window): seconds}); from the steps of `logs` (StepLogs with forwards
    timed), the step overhead as the median host time before a step's first forward plus the median
    gap between steps (`step_before_forward_s` + `step_gap_s`) and the host overlap as the median of the
    rest of its non-forward time (see module docstring)."""
    from glm53.engine.sim import step_layout

    dep = step_layout(deploy, "float32", WEIGHT_BYTES)
    shapes = sorted(times)
    wall = np.array([times[k] for k in shapes])
    best = None
    for f in np.logspace(9, 12, 19):
        for b in np.logspace(8.5, 11.5, 19):
            kern = np.array([_forward_price(cfg_model, dep, cpu_spec(f, b), k) for k in shapes])
            a = max(0.0, float(np.median(wall - kern)))
            err = float(np.mean(np.abs(np.log((kern + a) / wall))))
            if best is None or err < best["mean_abs_log_error"]:
                best = {"flops": float(f), "bandwidth": float(b), "forward_latency_s": a, "mean_abs_log_error": err}
    hw = fitted_spec(best)
    pred = np.array([_forward_price(cfg_model, dep, hw, k) for k in shapes])
    before, after = [], []  # host seconds of a step before its first forward, and the rest of its host time
    for log in logs:
        fw = {}
        for i, *_, s in log.forwards:
            fw[i] = fw.get(i, 0.0) + s
        for i, st in enumerate(log.steps):
            if i in log.before_forwards:
                before.append(log.before_forwards[i])
                after.append(st[-1] - fw[i] - log.before_forwards[i])
    gaps = [g for log in logs for g in getattr(log, "gaps", ())]
    before_s = max(0.0, float(np.median(before))) if before else 0.0
    gap_s = max(0.0, float(np.median(gaps))) if gaps else 0.0
    best.update(step_overhead_s=before_s + gap_s, step_before_forward_s=before_s, step_gap_s=gap_s,
                host_overlap_s=max(0.0, float(np.median(after))) if after else 0.0, shapes=len(shapes),
                steps=sum(len(log.steps) for log in logs),
                forward_s={f"{r}x{w}@{win}": float(t) for (r, w, win), t in zip(shapes, wall)},
                forward_rel_error={f"{r}x{w}@{win}": float(p / t - 1) for (r, w, win), p, t in zip(shapes, pred, wall)},
                forward_abs_rel_error_mean=float(np.mean(np.abs(pred / wall - 1))))
    return best


def _with_sim(point: dict, cfg, fit: dict) -> dict:
    """`point` (its config, policy, concurrency, real metrics and counts) with its simulated side priced on
    the CPU spec `fit` (cpu_spec_fit): "sim", "rel_error", "counts_sim", "counts_equal"."""
    s = _sim(cfg, point["kv_policy"], point["concurrency"], fitted_spec(fit), fit["step_overhead_s"],
             fit["host_overlap_s"], fit.get("lockstep"), fit.get("step_gap_s", 0.0))
    counts_sim = {k: s.get(k) for k in COUNTS}
    return {**point, "sim": {k: s[k] for k in METRICS},
            "rel_error": {k: rel_error(s[k], point["real"][k]) for k in METRICS}, "counts_sim": counts_sim,
            "counts_equal": point["counts_real"] == counts_sim, "step_mix_sim": s["step_mix"]}


def reprice(res: dict) -> dict:
    """Validation run `res` (results.json) with every point's simulated side priced again by the simulator
    as it is now, on the run's own fitted spec (the real side kept), and its summary fields recomputed: a
    run whose pricing has since changed, brought up to date without its hour of real runs (`--reprice`)."""
    configs = {name: (path, overrides) for name, path, overrides in (TRAIN, TRAIN_LOCKSTEP, *HELD_OUT)}
    points = []
    for p in res["points"]:
        path, overrides = configs[p["config"]]
        cfg = load_config(path, [*overrides, *p["overrides"]], default=serve.default_config)
        points.append(_with_sim(p, cfg, res["cpu_spec_fit"]))
    return {**res, "points": points, **summary(points, res.get("pd_http"))}


def summary(points: list[dict], pd_http: dict | None = None) -> dict:
    """{"mape": {metric: mean |simulated / real - 1| over the held-out points and the P/D-over-HTTP points
    that count (`pd_http_errors`), where the metric is defined (fractions), for MAPE_METRICS}, "counts_equal":
    whether every point's counts are equal, simulated and real (P/D over HTTP is compared for timings
    only), "complete": whether the points cover the fit and every HELD_OUT config, none run with an extra
    override} (mape nan without such points)."""
    held = [p["rel_error"] for p in points if p["role"] == "held out"] + pd_http_errors(pd_http)
    mape = {k: float(np.mean(v)) if (v := _defined(held, k)) else float("nan") for k in MAPE_METRICS}
    return {"mape": mape, "counts_equal": all(p["counts_equal"] for p in points), "complete": not missing(points)}


def pd_http_errors(pd_http: dict | None) -> list[dict]:
    """The rel errors of P/D over HTTP that count in `mape`: each point's "contended" twin priced on the
    CPU spec fitted just before that point ran (`EACH_POINT`, pd_http --fit-each-point). A comparison
    without per-point fits counts for nothing: a fit made once, before or after an hour of real points on
    this machine, prices them at another speed (docs/simulator.md, "P/D over HTTP")."""
    if not pd_http or EACH_POINT not in pd_http["cpu_spec_fits"]:
        return []
    return [p["rel_error"][EACH_POINT]["contended"] for p in pd_http["points"]]


def rel_error(sim: float, real: float) -> float:
    """sim / real - 1; nan where the metric is undefined both ways (TPOT of one-token outputs: `summary`
    leaves it out), inf where only one side defines it (a divergence, never left out)."""
    if np.isnan(sim) and np.isnan(real):
        return float("nan")
    if np.isnan(sim) or np.isnan(real):
        return float("inf")
    return sim / real - 1


EACH_POINT = "before each point"  # pd_http_fits' name for the fits a pd_http --fit-each-point run made
PD_HTTP_REAL = "results/paper/part2_laptop"  # the committed P/D-over-HTTP run (experiments.pd_http) compared


def _pd_http_run(path: str) -> dict:
    """The results.json of the pd_http run in `path` (relative to the working directory, else to the repo)."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = serve.REPO / p
    return json.loads((p / "results.json").read_text())


def pd_http_comparison(real: dict, fits: dict[str, dict], source: str = PD_HTTP_REAL) -> dict:
    """P/D over HTTP, timings only: each point of `real` (an experiments.pd_http results.json, whose
    servers, router and client ran as processes on this machine) against its simulated twin
    (`experiments.pd_http.twin`) priced on each CPU spec of `fits` ({when it was fitted: fit}; a fit
    {"per_point": True, ...} stands for each run's own `cpu_spec_fit`, made just before it: pd_http
    --fit-each-point), each fitted under the compile flags the real servers ran with (`pd_http_flags`), under
    each of the twin's ways of pricing how the processes share the cores (`pd_http.HOST_SHARING`:
    "contended", the model; "alone" and "shared", its bounds). Its counts are not compared: which producer
    and decode rank a request meets, and so what each holds, depends on wall-clock routing. -> {"real":
    where the run is and its date / revision, "cpu_spec_fits": `fits`, "points": [{deployment,
    concurrency, real, sim: {fit: {host: metrics}}, rel_error: {fit: {host: {metric: simulated / real -
    1}}}, between: {fit: {metric: the real value lies between the bounds}}}], "mape": {fit: {host: {metric:
    mean |rel error|}}}, "between": {fit: the fraction of (point, metric) pairs the bounds bracket}}."""
    from experiments import pd_http

    def spec(r, fit):  # the fit that prices the twin of run r
        return r["cpu_spec_fit"] if fit.get("per_point") else fit

    for when, fit in fits.items():
        for r in real["runs"]:
            if spec(r, fit).get("xla_flags") != pd_http_flags(real):
                raise ValueError(f"pd_http_comparison: the spec of {when} was fitted under XLA_FLAGS="
                                 f"{spec(r, fit).get('xla_flags')!r}, the real servers compiled under "
                                 f"{pd_http_flags(real)!r}: fit it with fit_compiled_with")
    sessions = pd_http.sessions_of(real)
    specs = pd_http.deployments(real["deploy"], real.get("decode_layout", "replicas"))
    points = []
    for r in real["runs"]:
        sims = {when: {host: pd_http.twin(specs[r["kv_policy"]], sessions, r["concurrency"], preset=real["preset"],
                                          host_specs=host_specs(spec(r, fit)), host=host, deploy=real["deploy"],
                                          weight_bytes=WEIGHT_BYTES)
                       for host in pd_http.HOST_SHARING} for when, fit in fits.items()}
        points.append({"deployment": r["kv_policy"], "concurrency": r["concurrency"],
                       "real": {k: r[k] for k in MAPE_METRICS},
                       "sim": {w: {h: {k: m[k] for k in MAPE_METRICS} for h, m in by.items()} for w, by in sims.items()},
                       "rel_error": {w: {h: {k: rel_error(m[k], r[k]) for k in MAPE_METRICS} for h, m in by.items()}
                                     for w, by in sims.items()},
                       "between": {w: {k: min(by["alone"][k], by["shared"][k]) <= r[k]
                                       <= max(by["alone"][k], by["shared"][k]) for k in MAPE_METRICS}
                                   for w, by in sims.items()}})
    mape = {w: {h: {k: float(np.mean([abs(p["rel_error"][w][h][k]) for p in points])) for k in MAPE_METRICS}
                for h in pd_http.HOST_SHARING} for w in fits}
    between = {w: float(np.mean([b for p in points for b in p["between"][w].values()])) for w in fits}
    return {"real": {"dir": source, "date": real["date"], "git_revision": real["git_revision"],
                     "decode_layout": real.get("decode_layout", "replicas")}, "cpu_spec_fits": fits,
            "twin_git_revision": git_revision(), "points": points, "mape": mape, "between": between}


def pd_http_fits(real: dict, previous: dict | None = None) -> dict[str, dict]:
    """The CPU specs that price the twins of the pd_http run `real`, by when each was fitted: the fit each
    point made just before it ran (pd_http --fit-each-point: the protocol that sees the machine at the
    point's speed), else `previous`'s (an earlier `pd_http_comparison`) for the same real run, else one
    fitted now under the flags its servers compiled with (`fit_compiled_with`: minutes)."""
    if real["runs"] and all("cpu_spec_fit" in r for r in real["runs"]):
        return {EACH_POINT: {"per_point": True, "xla_flags": pd_http_flags(real)}}
    if previous and (previous["real"]["git_revision"], previous["real"]["date"]) == (real["git_revision"], real["date"]):
        return previous["cpu_spec_fits"]
    flags = pd_http_flags(real)
    print(f"[validate_sim] fitting the CPU spec under the pd_http servers' XLA_FLAGS={flags!r}", flush=True)
    fit = fit_compiled_with(flags)
    return {fit["fitted_at"]: fit}


def pd_http_flags(real: dict) -> str:
    """The XLA_FLAGS a pd_http run's servers compiled under (its `xla_flags`; a run that predates the key
    compiled them at -O0, FAST_COMPILE_XLA_FLAGS, as pd_http always has), without the device count."""
    from experiments.common import FAST_COMPILE_XLA_FLAGS, compile_flags

    return compile_flags(real.get("xla_flags", FAST_COMPILE_XLA_FLAGS))


def missing(points: list[dict]) -> list[str]:
    """What a run's points lack to be the full validation: the fits' points (one device's and the
    lock-step's), each HELD_OUT config by name, and points run with extra overrides (`--override`), which
    are not the held-out configs as committed."""
    ran = {p["config"] for p in points if not p.get("overrides")}
    fits = {p["config"] for p in points if p["role"] == "fit"}
    return [t[0] for t in (TRAIN, TRAIN_LOCKSTEP) if t[0] not in fits] + [
        h[0] for h in HELD_OUT if h[0] not in ran] + sorted(
        {f"{p['config']} (with {p['overrides']})" for p in points if p.get("overrides")})


def check(res: dict, bound: float = MAPE_BOUND) -> list[str]:
    """Why a validation run `res` (results.json) does not pass: its summary fields differ from what its
    points give, a MAPE above `bound` (or not a number), counts that differ, a HELD_OUT config it did not
    run -> problems ([] when it passes)."""
    problems = []
    got = summary(res["points"], res.get("pd_http"))
    if {k: res.get(k) for k in got} != got:
        problems.append(f"mape / counts_equal / complete {[res.get(k) for k in got]} are not its points' {list(got.values())}")
    problems += [f"mape {k} = {v!r} > {bound}" for k, v in got["mape"].items() if not v <= bound]
    problems += [f"counts differ: {p['config']} {p['kv_policy']} c={p['concurrency']}: real {p['counts_real']}, "
                 f"simulated {p['counts_sim']}" for p in res["points"] if not p["counts_equal"]]
    problems += [f"not run: {m}" for m in missing(res["points"])]
    return problems


def merge(res: dict, other: dict, name: str = "other") -> dict:
    """`res` with the points of run `other` added (a point of the same config, policy, concurrency and role
    replaces res's); both must carry the same fitted CPU spec (their simulated sides priced alike)."""
    if other["cpu_spec_fit"] != res["cpu_spec_fit"]:
        raise ValueError(f"--merge {name}: its cpu_spec_fit differs from the run it merges into (run it with "
                         "--fit-from that run)")
    key = lambda p: (p["config"], p["kv_policy"], p["concurrency"], p["role"])  # noqa: E731
    new = {key(p) for p in other["points"]}
    return {**res, "points": [p for p in res["points"] if key(p) not in new] + other["points"],
            "merged": [*res.get("merged", []), {"from": name, "date": other["date"],
                                                "git_revision": other["git_revision"]}]}


def _bound(steps) -> str:
    pre = sum(s[-1] for s in steps if any(r.num_tokens > 1 + r.num_draft_tokens for p in s[0] for r in p.rows))
    return "prefill-bound" if pre > 0.5 * sum(s[-1] for s in steps) else "decode-bound"


def _defined(errors, k) -> list[float]:
    """|error| of metric k in `errors` (points' `rel_error` dicts) where it is defined (`rel_error`)."""
    return [abs(e[k]) for e in errors if not np.isnan(e[k])]


def _median_abs(points, k) -> float:
    v = _defined([p["rel_error"] for p in points], k)
    return statistics.median(v) if v else float("nan")


def table(res: dict) -> str:
    f = res["cpu_spec_fit"]
    lines = ["# The simulator against the real engine at laptop scale", "",
             f"{res['date']}, commit {res['git_revision']}, {res['machine']['cpu']} x {res['machine']['cpu_count']}. "
             "`python -m experiments.validate_sim`. CPU spec fitted on timed forwards (a grid of shapes and the serve "
             f"default's own; {f['shapes']} shapes) and the serve default's {f['steps']} steps: {f['flops'] / 1e9:.1f} GFLOP/s, "
             f"{f['bandwidth'] / 1e9:.1f} GB/s, forward latency {f['forward_latency_s'] * 1e3:.2f} ms, host time per step "
             f"{f['step_overhead_s'] * 1e3:.2f} ms before its forwards"
             f"{GAP_NOTE if 'step_gap_s' in f else ''} and {f['host_overlap_s'] * 1e3:.2f} ms after the forwards "
             "they sample from; "
             f"per-shape |error| mean {f['forward_abs_rel_error_mean']:.1%}"
             + (f" (the spec of the run in {res['fit_from']})" if res.get("fit_from") else "")
             + "".join(f"; points of {m['from']} ({m['date']}, {m['git_revision']}) merged" for m in res.get("merged", []))
             + ".", "",
             "rel error = simulated / real - 1. Counts must be equal (the schedule does not depend on time).", "",
             "| config | policy | c | bound | role | TTFT p50 | TPOT mean | throughput/device | running | counts equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["points"]:
        e = p["rel_error"]
        lines.append(f"| {p['config']} | {p['kv_policy']} | {p['concurrency']} | {p['bound']} | {p['role']} | "
                     + " | ".join("n/a" if np.isnan(e[k]) else f"{e[k]:+.1%}" for k in METRICS) + f" | {'yes' if p['counts_equal'] else 'NO'} |")
    held = [p for p in res["points"] if p["role"] == "held out"]
    if held:
        pd_n = len(pd_http_errors(res.get("pd_http")))
        alone = (lambda m: ", ".join(f"{k} {v:.1%}" for k, v in m.items()))  # noqa: E731
        lines += ["", f"MAPE over the held-out points{f' and the {pd_n} of P/D over HTTP (below)' if pd_n else ''}: "
                  + alone(res["mape"])
                  + (f" (the held-out points alone: {alone(summary(res['points'])['mape'])}; P/D over HTTP alone: "
                     f"{alone(res['pd_http']['mape'][EACH_POINT]['contended'])})" if pd_n else "")
                  + f"; counts equal at every point: {'yes' if res['counts_equal'] else 'NO'}"]
        lines += ["", f"All held-out points ({len(held)}): median |error| " + ", ".join(
            f"{k} {_median_abs(held, k):.1%}" for k in METRICS)
            + "; within 25%: " + ", ".join(f"{k} {sum(abs(p['rel_error'][k]) <= 0.25 for p in held)}/"
                                          f"{len(_defined([p['rel_error'] for p in held], k))}" for k in METRICS)]
    for bound in ("prefill-bound", "decode-bound"):
        pts = [p for p in res["points"] if p["bound"] == bound and p["role"] == "held out"]
        if pts:
            lines.append("")
            lines.append(f"{bound}, held out ({len(pts)} points): median |error| " + ", ".join(
                f"{k} {_median_abs(pts, k):.1%}" for k in METRICS))
    if res.get("pd_http"):
        pd, hosts = res["pd_http"], ("contended", "alone", "shared")
        fits = pd["cpu_spec_fits"]
        counted = ("in the MAPE above: the contended twin, each point on its own fit" if pd_http_errors(pd) else
                   "not in the MAPE above: no per-point fits")
        lines += ["", f"## P/D over HTTP (timings only; {counted})", "",
                  f"The real side is {pd['real']['dir']} ({pd['real']['date']}, {pd['real']['git_revision'][:12]}, "
                  f"decode layout {pd['real']['decode_layout']}): prefill and decode servers, router and client as "
                  "processes on this machine, the servers compiled under XLA_FLAGS "
                  f"`{next(iter(fits.values()))['xla_flags']}`. Its simulated twin (experiments.pd_http.twin) is "
                  "priced on one device's spec fitted under the same flags, once per fit below, three ways: "
                  "contended (a step priced on the shared host while the other engine works, alone otherwise: "
                  "the model), alone (each engine always on the whole host) and shared (every device always on a "
                  "quarter of it). rel error = simulated / real - 1; * marks a real value the two bounds bracket.", ""]
        for w, f in fits.items():
            lines += [("Fitted before each point, each point priced on its own fit (the real run's `cpu_spec_fit`)."
                       if f.get("per_point") else
                       f"Fitted at {w}: {f['flops'] / 1e9:.1f} GFLOP/s, {f['bandwidth'] / 1e9:.2f} GB/s, forward latency "
                       f"{f['forward_latency_s'] * 1e3:.2f} ms, host {f['step_overhead_s'] * 1e3:.2f} ms before the "
                       f"forwards and {f['host_overlap_s'] * 1e3:.2f} ms after the forwards they sample from; per-shape |error| "
                       f"{f['forward_abs_rel_error_mean']:.1%}."), "",
                      "| deployment | c | " + " | ".join(f"{m} {h}" for m in ("TTFT p50", "TPOT mean", "throughput/device")
                                                          for h in hosts) + " |",
                      "|---|---|" + "---|" * 9]
            for p in pd["points"]:
                cells = [f"{p['rel_error'][w][h][k]:+.0%}" + ("*" if h == "contended" and p["between"][w][k] else "")
                         for k in MAPE_METRICS for h in hosts]
                lines.append(f"| {p['deployment']} | {p['concurrency']} | " + " | ".join(cells) + " |")
            lines += ["", "MAPE: " + "; ".join(f"{h}: " + ", ".join(f"{k} {v:.1%}" for k, v in pd["mape"][w][h].items())
                                                 for h in hosts)
                      + f". The bounds bracket {pd['between'][w]:.0%} of the real values.", ""]
        lines.pop()
    return "\n".join(lines) + "\n"


def time_lockstep_grid() -> dict[tuple[int, int, int], float]:
    """`time_forward_grid` on TRAIN_LOCKSTEP's DP x EP layout at LOCKSTEP_GRID, in a fresh process that
    does not use the persistent compilation cache: its 8-device programs, loaded from that cache, stopped
    in their MoE all-to-all with 6 of 8 devices arrived (XLA's CPU rendezvous aborts the process;
    docs/simulator.md "Validation at laptop scale")."""
    import subprocess
    import sys

    code = ("import json, sys; from experiments import validate_sim as v; "
            "json.dump([[*k, t] for k, t in v._lockstep_grid_here().items()], sys.stdout)")
    out = subprocess.run([sys.executable, "-c", code], cwd=serve.REPO, env=child_env(), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the lock-step grid failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return {(r, w, win): t for r, w, win, t in json.loads(out.stdout)}


def _lockstep_grid_here() -> dict[tuple[int, int, int], float]:
    """`time_lockstep_grid`'s child: the grid in this (fresh) process, on DEVICES CPU devices."""
    from parallel.mesh import set_cpu_device_count

    set_cpu_device_count(DEVICES)  # before JAX starts
    cfg = load_config(TRAIN_LOCKSTEP[1], list(TRAIN_LOCKSTEP[2]), default=serve.default_config)
    model, _ = serve._model(cfg.model)
    return time_forward_grid(model, serve._deploy(cfg, cfg.sweep.kv_policy[0]), **LOCKSTEP_GRID)


def fit_compiled_with(xla_flags: str) -> dict:
    """One device's CPU spec fit (`calibrate` on TRAIN's points and the forward grid), its programs compiled
    under `xla_flags` (an XLA_FLAGS value: the compile level of a real run to price, e.g. pd_http's servers'
    -O0), in a fresh process (the flags act when JAX starts) without the persistent compilation cache."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fit.json"
        code = f"from experiments import validate_sim as v; v._fit_here({str(path)!r})"
        env = child_env(XLA_FLAGS=xla_flags)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        out = subprocess.run([sys.executable, "-c", code], cwd=serve.REPO, env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the fit under XLA_FLAGS={xla_flags!r} failed (exit {out.returncode}): {out.stderr[-2000:]}")
        return {**json.loads(path.read_text()), "xla_flags": xla_flags,
                "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _fit_here(path: str) -> None:
    """`fit_compiled_with`'s child: TRAIN's points served (each forward timed) and the fit, written to `path`."""
    cfg = load_config(TRAIN[1], list(TRAIN[2]), default=serve.default_config)
    model, _ = serve._model(cfg.model)
    points = [(cfg, policy, conc, *_real(cfg, model, policy, conc, forwards=True), "fit")
              for policy in cfg.sweep.kv_policy for conc in cfg.sweep.concurrency]
    Path(path).write_text(json.dumps(calibrate(points), default=float))


def calibrate(train_points, grid=time_forward_grid) -> dict:
    """The CPU spec fit (`fit`) on a calibration grid (`grid(model, deploy)`: `time_forward_grid`, one
    device's, or `time_lockstep_grid`) and the forwards and steps of the fit's points `train_points`
    ((cfg, policy, concurrency, metrics, StepLog with forwards timed, role)), on their config's deploy:
    one device for TRAIN, DP x EP ranks for TRAIN_LOCKSTEP (then rows are per rank and the fit carries
    `devices`, the ranks)."""
    cfg0, policy = train_points[0][0], train_points[0][1]
    model0, _ = serve._model(cfg0.model)
    sim_model, _ = serve._model(cfg0.model, weights=False)
    deploy = serve._deploy(cfg0, policy)
    deploy0 = dataclasses.replace(deploy, kv_cache_dtype="float32").resolved(sim_model, "float32")
    print(f"[validate_sim] timing the calibration grid ({deploy.data_parallel_size} x {deploy.devices_per_replica} "
          f"devices)", flush=True)
    times = grid(model0, deploy)
    logs = [p[4] for p in train_points]
    served: dict[tuple, list[float]] = {}
    for log in logs:
        for _, rows, width, window, s in log.forwards:
            served.setdefault((rows, width, window), []).append(s)
    times.update({k: statistics.median(v) for k, v in served.items()})  # the serving rig's own shapes
    out = fit(sim_model, deploy0, times, logs)
    if deploy.experts_across_ranks:
        out["devices"] = deploy.data_parallel_size
    return out


def main(argv=None) -> dict:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m experiments.validate_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/validate_sim", help="directory for the results")
    ap.add_argument("--only", default="", help=f"held-out configs to run, comma-separated (of {[h[0] for h in HELD_OUT]})")
    ap.add_argument("--summarize", default="", metavar="DIR",
                    help="recompute DIR/results.json's mape, counts_equal and complete and DIR/table.md from its points "
                         "(with --merge, after adding the points of other runs); run no real point (the P/D "
                         "twins' spec is fitted, minutes, where DIR has none for the pd_http run's compile flags)")
    ap.add_argument("--merge", default="", metavar="DIR,...",
                    help="with --summarize: add these runs' points to DIR's (a point run again replaces DIR's); "
                         "each run must carry the same fitted CPU spec")
    ap.add_argument("--fit-from", default="", metavar="DIR",
                    help="take the CPU spec fitted by the run in DIR (its results.json) instead of fitting it: no "
                         "serve-default points, no grid; its held-out points can then be merged into DIR")
    ap.add_argument("--pd-http", default=PD_HTTP_REAL, metavar="DIR",
                    help="the experiments.pd_http run (its results.json) whose points are compared with their "
                         "simulated twins, timings only (`pd_http` in results.json; in `mape` where each point was priced "
                         "on its own fit, pd_http --fit-each-point; with --summarize, recomputed on the specs "
                         "DIR's pd_http was priced on); '' for none (default: %(default)s)")
    ap.add_argument("--override", action="append", default=[], metavar="--config.FIELD=VALUE",
                    help="an extra config override for every held-out config run (e.g. a smaller concurrency); the "
                         "points record it, and a run with any is not complete")
    ap.add_argument("--reprice", action="store_true",
                    help="with --summarize: price every point's simulated side again with the simulator as it is now, "
                         "on the run's own fitted spec (seconds; the real side kept): a run whose pricing changed since")
    ap.add_argument("--grid-spread", action="store_true",
                    help="only time the calibration grid twice under each timing protocol (GRID_PROTOCOLS) and write "
                         "how far its per-shape timings move between the two to OUT/grid_spread.json (minutes)")
    args = ap.parse_args(argv)
    if args.grid_spread:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = {**_stamp("validate_sim --grid-spread"), "protocols": grid_spread()}
        (out / "grid_spread.json").write_text(json.dumps(res, indent=1))
        return res
    if (args.merge or args.reprice) and not args.summarize:
        ap.error("--merge and --reprice need --summarize DIR")
    if args.summarize:
        path = Path(args.summarize) / "results.json"
        res = json.loads(path.read_text())
        for other in (d for d in args.merge.split(",") if d):
            res = merge(res, json.loads((Path(other) / "results.json").read_text()), other)
        if args.reprice:
            res = reprice(res)
        if args.pd_http:
            real = _pd_http_run(args.pd_http)
            res["pd_http"] = pd_http_comparison(real, pd_http_fits(real, res.get("pd_http")), args.pd_http)
        res.update(summary(res["points"], res.get("pd_http")))
        path.write_text(json.dumps(res, indent=1, default=str))
        (path.parent / "table.md").write_text(table(res))
        return res
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - {h[0] for h in HELD_OUT}
    if unknown:
        ap.error(f"--only: unknown configs {sorted(unknown)}; choose from {[h[0] for h in HELD_OUT]}")
    held_out = [h for h in HELD_OUT if not only or h[0] in only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fitted = json.loads((Path(args.fit_from) / "results.json").read_text()) if args.fit_from else None
    from parallel.mesh import set_cpu_device_count

    set_cpu_device_count(DEVICES)  # before JAX starts: the multi-device configs' meshes
    serve._enable_compile_cache(str(serve.REPO / ".cache" / "jax"))

    def points(name, path, overrides, role):
        cfg = load_config(path, list(overrides), default=serve.default_config)
        model, _ = serve._model(cfg.model)
        for policy in cfg.sweep.kv_policy:
            for conc in cfg.sweep.concurrency:
                print(f"[validate_sim] {name} {policy} c={conc} (real)", flush=True)
                m, log = _real(cfg, model, policy, conc, forwards=role == "fit")
                yield cfg, policy, conc, m, log, role

    if fitted is None:
        one = list(points(*TRAIN, "fit"))
        f = calibrate(one)
        lock = list(points(*TRAIN_LOCKSTEP, "fit"))
        f["lockstep"] = calibrate(lock, lambda model, deploy: time_lockstep_grid())
        fit_points = [(TRAIN[0], p) for p in one] + [(TRAIN_LOCKSTEP[0], p) for p in lock]
    else:
        fit_points, f = [], fitted["cpu_spec_fit"]
    hw = fitted_spec(f)
    lockstep = f.get("lockstep")
    print(f"[validate_sim] CPU spec: {f['flops'] / 1e9:.1f} GFLOP/s, {f['bandwidth'] / 1e9:.1f} GB/s, forward "
          f"{f['forward_latency_s'] * 1e3:.2f} ms, host {f['step_overhead_s'] * 1e3:.2f} ms before the forwards and "
          f"{f['host_overlap_s'] * 1e3:.2f} ms after the forwards they sample from; per-shape |error| {f['forward_abs_rel_error_mean']:.1%}"
          + (f" (fitted by {args.fit_from})" if fitted else ""), flush=True)
    if lockstep is not None:
        ls = lockstep
        print(f"[validate_sim] lock-step spec ({ls['devices']} ranks): {ls['flops'] / 1e9:.1f} GFLOP/s, "
              f"{ls['bandwidth'] / 1e9:.1f} GB/s, forward {ls['forward_latency_s'] * 1e3:.2f} ms, host "
              f"{ls['step_overhead_s'] * 1e3:.2f} ms before the forwards and {ls['host_overlap_s'] * 1e3:.2f} ms after "
              f"the forwards they sample from; per-shape |error| {ls['forward_abs_rel_error_mean']:.1%}", flush=True)
    else:
        print("[validate_sim] no lock-step fit: a DP x EP layout is priced on 1/N of the host (shared_host)", flush=True)

    res_points = []
    meta = {**_stamp("validate_sim"), "cpu_spec_fit": f,
            "cpu_spec": dataclasses.asdict(hw), "metrics": METRICS, "counts": COUNTS,
            "note": "real runs warmed (a first untimed pass compiles); the fit points wait for every forward, the "
                    "held-out ones run as served; HiSparse misses are exact in the real run and 0 in the simulator "
                    "(the sim's miss knob is off); the simulator prices the runner's padded forwards"}

    if fitted is not None:
        meta["fit_from"] = args.fit_from

    def save() -> dict:
        """results.json and table.md after every point (atomically): a run that stops keeps what it measured."""
        res = {**meta, "points": res_points, **summary(res_points, meta.get("pd_http"))}
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(res, indent=1, default=str))
        os.replace(tmp, out / "results.json")
        (out / "table.md").write_text(table(res))
        return res

    def compare(name, cfg, policy, conc, m, log, role, extra=()):
        counts_real = {k: m.get(k) for k in COUNTS}
        res_points.append(_with_sim({
            "config": name, "kv_policy": policy, "concurrency": conc, "role": role, "bound": _bound(log.steps),
            "real": {k: m[k] for k in METRICS}, "counts_real": counts_real, "real_wall_s": m["wall_s"],
            "step_mix_real": m["step_mix"],
            "overrides": list(extra)}, cfg, f))
        print(f"[validate_sim] {name} {policy} c={conc}: " + ", ".join(
            f"{k} {res_points[-1]['rel_error'][k]:+.1%}" for k in METRICS)
            + f"; counts equal {res_points[-1]['counts_equal']}", flush=True)
        save()

    for name, (cfg, policy, conc, m, log, _) in fit_points:
        compare(name, cfg, policy, conc, m, log, "fit")
    for name, path, overrides in held_out:
        for cfg, policy, conc, m, log, _ in points(name, path, (*overrides, *args.override), "held out"):
            compare(name, cfg, policy, conc, m, log, "held out", args.override)
    if args.pd_http:
        print(f"[validate_sim] P/D over HTTP: {args.pd_http} against its simulated twins", flush=True)
        real = _pd_http_run(args.pd_http)
        meta["pd_http"] = pd_http_comparison(real, pd_http_fits(real), args.pd_http)
    res = save()
    print(table(res))
    return res


if __name__ == "__main__":
    main()
