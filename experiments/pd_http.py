"""Part 2 at laptop scale over HTTP (issue 23 item 5): two P/D deployments as real processes on loopback,
driven through `python -m glm53.router` by the closed-loop agentic client.

    python -m experiments.pd_http --out results/paper/part2_laptop     # about an hour on 2 cores
    python -m experiments.pd_http --fit-each-point --out DIR            # and the simulator's spec fitted
                                                                        # before each point (validate_sim)

Deployments (a preset's random weights, 4 simulated devices each; no MTP: its warm-up compiles several
programs per bucket shape, which on 2 cores cost more than a whole point; MTP over P/D is tested in
tests/glm53/test_pd.py and priced at H200 scale by configs/paper/part2.py):
- `pcp_dcp+hisparse`: one prefill server on 2 devices (PCP2 x DCP2, EP2; `kv_producer`) and two decode
  devices with `--kv-policy hisparse` (`kv_consumer`): the published Part 2 shape.
- `dp+offload`: two prefill servers of one device each (`kv_producer`) and two decode devices with the
  offload policy (`kv_consumer`).
The two decode devices are one decode server of two DP ranks that share the routed experts
(`--decode-layout dp_ep`, the default: `--data-parallel-size 2 --enable-expert-parallel`, the published
decode node's layout) or two servers of one device each (`--decode-layout replicas`); results.json's
`decode_layout` records which.

Every server compiles its bucket shapes before it answers, and on CPU each compiled kernel holds memory
mappings: the HiSparse decode server of two DP ranks holds about 129,000 after its warm-up
(docs/testing.md), twice the kernel's default `vm.max_map_count` of 65,530, so the run first checks for
`MIN_MAP_COUNT` (and says how to raise it: `sysctl -w vm.max_map_count=262144`; several current
distributions default to 1,048,576).
Both sides use the PdConnector: the decode servers take each prompt's KV from the producer that
prefilled it (counted in `glm53:kv_transfer_received_tokens`) instead of computing it. The producers'
pages hold `block_size` tokens over their DCP ranks, as the consumers' do.

The workload is `experiments.workloads.synthetic_trace` (agentic-coding sessions: median `--turns` turns,
prompts growing to a mean of 142K tokens, 444 output tokens, all times `--scale`; `--output-tokens` per
turn instead, so that each request's TPOT averages enough gaps; sessions end at max_model_len), each
session a user with its own salt, no think time. The client is `experiments.bench_http.HttpEngine`
pointed at the router, in a closed loop of `concurrency` sessions (`workloads.ClosedLoopClient`). Every
process starts afresh for each concurrency point (`--warmup`: each server compiles its bucket shapes
before it answers /health, into a compilation cache all share) and stops after it.

Per point (results.json `runs`): the client-side summary (`glm53.engine.metrics.summarize` over
wall time: TTFT median / p90, TPOT, interactivity, P90 end-to-end per-user tok/s, throughput per device
over all 4 devices), and what the servers counted: prompt tokens the decode servers received from a
producer and the prefix-cache hits on each role, the decode servers' host <-> device bytes and
HiSparse hot-buffer hits and misses, preemptions, XLA compilations after warm-up (should be 0), and the
router's `prefill_fallbacks` and `resends` (should be 0). results.json and table.md (the points side by
side) are rewritten after every point (`complete`: every point ran); `--redraw DIR` rewrites table.md
and pd_http.png from DIR/results.json. At concurrency 1 the sessions' greedy tokens
must be the same on both deployments (`tokens_equal`): P/D and HiSparse change the speed, never the
tokens. A benchmark: it asserts nothing about speed, and on a laptop the five
processes share its cores (the numbers compare the deployments' mechanisms, not H200 speed: for that,
configs/paper/part2.py in the simulator).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from experiments import workloads
from experiments.bench_http import HttpEngine, run_point, scrape_metrics, start_server
from experiments.common import REPO, child_env, compile_flags, cpu_name, git_revision, with_fast_compile
from parallel.launch import free_port

DEPLOY = {"max_model_len": 512, "max_num_batched_tokens": 128, "max_num_seqs": 2, "block_size": 16}
DEVICES = 4  # per deployment: 2 prefill + 2 decode


def _ktc(role: str, **kw) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, **kw})


DECODE_LAYOUTS = ("dp_ep", "replicas")
MIN_MAP_COUNT = 262_144  # vm.max_map_count the decode servers' warm-up needs, with room (module docstring)


def deployments(deploy: dict, decode_layout: str = "dp_ep") -> dict[str, dict[str, list[list[str]]]]:
    """{name: {"prefill": [server flags...], "decode": [...]}}; each server's flags beyond `deploy`. Each
    producer gets a KV port of its own (free now) and the consumers list them all (a consumer takes KV
    only from the producers it lists). decode_layout: "dp_ep", one decode server of two DP ranks sharing
    the routed experts (`--data-parallel-size 2 --enable-expert-parallel`, the published decode node's
    layout; each rank its own host tier and P/D tier and, under HiSparse, its own hot buffers and host
    pool), or "replicas", two decode servers of one device each."""
    if decode_layout not in DECODE_LAYOUTS:
        raise ValueError(f"decode_layout must be one of {DECODE_LAYOUTS}, got {decode_layout!r}")
    half = ["--block-size", str(deploy["block_size"] // 2)]  # DCP2: a page of block_size tokens over 2 ranks

    def producer(port: int) -> list[str]:
        return ["--kv-transfer-config", _ktc("kv_producer", kv_port=port)]

    def consumer(ports: list[int]) -> list[str]:
        extra = {"producers": [f"127.0.0.1:{p}" for p in ports]}
        return ["--kv-transfer-config", _ktc("kv_consumer", kv_connector_extra_config=extra)]

    ports = set()
    while len(ports) < 3:  # a port is free when asked, and may be handed out again: three distinct ones
        ports.add(free_port())
    pcp, *dp = sorted(ports)
    def decode(policy: str, ports: list[int]) -> list[list[str]]:
        if decode_layout == "dp_ep":
            return [["--data-parallel-size", "2", "--enable-expert-parallel", "--kv-policy", policy, *consumer(ports)]]
        return [["--kv-policy", policy, *consumer(ports)]] * 2

    return {
        "pcp_dcp+hisparse": {
            "prefill": [["--prefill-context-parallel-size", "2", "--decode-context-parallel-size", "2",
                         "--enable-expert-parallel", *half, *producer(pcp)]],
            "decode": decode("hisparse", [pcp])},
        "dp+offload": {
            "prefill": [producer(p) for p in dp],
            "decode": decode("offload", dp)},
    }


def _server_args(deploy: dict, extra: list[str]) -> list[str]:
    given = {a for a in extra if a.startswith("--")}
    flags = [x for k, v in deploy.items() if f"--{k.replace('_', '-')}" not in given
             for x in (f"--{k.replace('_', '-')}", str(v))]
    return flags + extra


def start_router(prefill: list[int], decode: list[int], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = [sys.executable, "-m", "glm53.router", "--port", str(port), "--poll-interval", "0.5",
            "--prefill", *[f"http://127.0.0.1:{p}" for p in prefill], "--decode", *[f"http://127.0.0.1:{p}" for p in decode]]
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited: {log.read_text()[-2000:]}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"router did not come up: {log.read_text()[-2000:]}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def _counters(ports: list[int]) -> dict[str, float]:
    names = ("glm53:kv_transfer_received_tokens_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:num_preemptions_total", "glm53:xla_compilations_total", "vllm:prompt_tokens_total",
             "vllm:hisparse_cache_hits_total", "vllm:hisparse_cache_misses_total", "glm53:host_to_device_bytes_total",
             "glm53:device_to_host_bytes_total")
    out = dict.fromkeys(names, 0.0)
    for port in ports:
        m = scrape_metrics(port)
        for n in names:
            out[n] += m.get(n, 0.0)
    return out


def run_deployment(name: str, spec: dict, deploy: dict, sessions, concurrency: int, *, preset: str, seed: int,
                   vocab: int, cache: str, logs: Path) -> tuple[dict, list]:
    """Start the deployment's servers and router, run one point, stop them -> (metrics, tokens per request)."""
    from glm53.engine.metrics import summarize

    procs, ports = {}, {}
    router = None
    try:
        # one at a time: a server's warm-up finds in the compilation cache what an identical one compiled
        for role in ("prefill", "decode"):
            for i, extra in enumerate(spec[role]):
                key = f"{role}{i}"
                procs[key], ports[key] = start_server(preset, seed, cache, logs / f"{name}-c{concurrency}-{key}.log",
                                                      _server_args(deploy, extra))
        pre = [ports[f"prefill{i}"] for i in range(len(spec["prefill"]))]
        dec = [ports[f"decode{i}"] for i in range(len(spec["decode"]))]
        router, rport = start_router(pre, dec, logs / f"{name}-c{concurrency}-router.log")
        warm = {"prefill": _counters(pre), "decode": _counters(dec)}
        eng = HttpEngine(rport, preset)
        ids, wall = run_point(eng, sessions, concurrency, vocab, deploy["max_model_len"])
        outs = eng.outputs(ids)
        m = summarize(outs, duration_s=max(o.finish_s for o in outs) - min(o.arrival_s for o in outs),
                      num_devices=DEVICES)
        del m["running_requests_mean"], m["running_requests_mean_per_step"]  # engine steps: an HTTP client sees none
        after = {"prefill": _counters(pre), "decode": _counters(dec)}
        d = {role: {k: after[role][k] - warm[role][k] for k in warm[role]} for role in warm}
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{rport}/health", timeout=10).read())
        m.update(wall_s=wall,
                 kv_transfer_received_tokens=int(d["decode"]["glm53:kv_transfer_received_tokens_total"]),
                 decode_prompt_tokens=int(d["decode"]["vllm:prompt_tokens_total"]),
                 decode_prefix_hit_rate=(d["decode"]["vllm:prefix_cache_hits_total"]
                                         / max(d["decode"]["vllm:prefix_cache_queries_total"], 1)),
                 prefill_prefix_hit_rate=(d["prefill"]["vllm:prefix_cache_hits_total"]
                                          / max(d["prefill"]["vllm:prefix_cache_queries_total"], 1)),
                 preemptions=int(d["decode"]["vllm:num_preemptions_total"] + d["prefill"]["vllm:num_preemptions_total"]),
                 compilations_after_warmup=int(d["decode"]["glm53:xla_compilations_total"]
                                               + d["prefill"]["glm53:xla_compilations_total"]),
                 # the decode servers' host -> device traffic: HiSparse's hot-buffer rows (its misses) and
                 # staged rows, or the offload tier's page loads; device -> host: parking and pre-copies
                 decode_h2d_bytes=int(d["decode"]["glm53:host_to_device_bytes_total"]),
                 decode_d2h_bytes=int(d["decode"]["glm53:device_to_host_bytes_total"]),
                 hisparse_hot_hits=int(d["decode"]["vllm:hisparse_cache_hits_total"]),
                 hisparse_hot_misses=int(d["decode"]["vllm:hisparse_cache_misses_total"]),
                 prefill_fallbacks=health["prefill_fallbacks"], resends=health["resends"])
        return m, [o.token_ids.tolist() for o in outs]
    finally:
        _stop(([router] if router else []) + list(procs.values()))


def fit_under(xla_flags: str) -> dict:
    """`experiments.validate_sim.fit_compiled_with(xla_flags)`, run in a child process (validate_sim prices
    this module's twins, so this module does not import it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fit.json"
        code = ("import json, sys; from experiments import validate_sim as v; "
                "json.dump(v.fit_compiled_with(sys.argv[1]), open(sys.argv[2], 'w'))")
        out = subprocess.run([sys.executable, "-c", code, xla_flags, str(path)], cwd=REPO, env=child_env(),
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"pd_http: the CPU spec fit failed (exit {out.returncode}): {out.stderr[-2000:]}")
        return json.loads(path.read_text())


def make_sessions(n: int, scale: float, median_turns: float, output_tokens: float, max_context: int) -> list:
    """The workload of a run (module docstring): `n` agentic-coding sessions of `synthetic_trace`, lengths
    times `scale`, `output_tokens` mean output tokens per turn, no think time, no subagents."""
    return workloads.synthetic_trace(n, scale=scale, median_turns=median_turns, mean_output=output_tokens / scale,
                                     think_mean_s=0.0, subagent_prob=0.0, max_context=max_context)


def sessions_of(result: dict) -> list:
    """The sessions the run of a results.json served (its `workload` and `deploy`)."""
    w = result["workload"]
    return make_sessions(w["sessions"], w["scale"], w["median_turns"], w["mean_output_tokens"],
                         result["deploy"]["max_model_len"])


def server_deploys(spec: dict, preset: str, deploy: dict = DEPLOY) -> dict[str, list]:
    """{"prefill": [...], "decode": [...]}: each server's DeployConfig, as `python -m glm53.serve` makes
    it from the flags `deployments` gives it (glm53.serve.deploy_from_args, float32 weights)."""
    import glm53
    from glm53.serve import build_parser, deploy_from_args

    cfg = glm53.get_preset(preset)
    parse = build_parser().parse_args
    return {role: [deploy_from_args(parse([preset, *_server_args(deploy, extra)]), cfg, "float32") for extra in flags]
            for role, flags in spec.items()}


# how the twin prices the servers' sharing of this machine's cores: "contended" (the model), and the two
# bounds around it, "alone" and "shared" (`twin`)
HOST_SHARING = ("contended", "alone", "shared")


def twin(spec: dict, sessions, concurrency: int, *, preset: str, host_specs, host: str, deploy: dict = DEPLOY,
         weight_bytes: int = 4) -> dict:
    """The simulated twin of one point of `run_deployment` (timings only; its counts depend on wall-clock
    routing): the deployment's servers as `server_deploys` makes them, one PdPair (glm53.engine.pd_sim)
    of a prefill engine (the producers as its data-parallel replicas: one server of two devices, or two
    of one) and a decode engine (the decode server, or the two as replicas), float32 KV and weights,
    priced on a fitted CPU spec as experiments.validate_sim prices its points (the runner's padded
    forwards, async dispatch, exact HiSparse misses not modelled: 0), served
    by the same closed-loop client -> the client-side metrics `run_deployment` reports. host_specs:
    devices -> (HardwareSpec, step_overhead_s, host_overlap_s) of one of that many devices sharing this
    host (`experiments.validate_sim.host_specs` of a fitted spec); weight_bytes: 4, the servers' float32.

    The servers are processes on one machine and share its cores; `host` says how the twin prices that:
    "contended" prices each step of an engine on the whole host (host_specs of its own devices) when the
    other engine is idle at the step's start, and on the deployment's share of it (host_specs of all its
    devices) when the other is still working then (`pd_sim.busy_until`) and has work left; a step keeps
    the price it started with. (An engine with nothing left counts as idle while its last step's host
    part ends: without that rule, at concurrency 1 each turn's prefill, sent when the last token is out,
    was priced shared for the decode server's last 2.5 ms of bookkeeping.) "alone" and "shared" are its
    bounds, each engine always alone on the host (exact when one server works at a time) and always
    sharing it (exact when both work all the time). The client, router and HTTP are not priced in any."""
    import glm53
    from glm53.engine.metrics import summarize
    from glm53.engine.pd_sim import build_pd, busy_until, sim_runners

    if host not in HOST_SHARING:
        raise ValueError(f"host must be one of {HOST_SHARING}, got {host!r}")
    made = server_deploys(spec, preset, deploy)

    def engine_deploy(role: str):
        # the role's servers as one engine: a server of several ranks as it is, one-device servers as replicas
        # (pd_deploy gives each its PdConnector role; the servers' own connector configs differ in ports only)
        ds = [dataclasses.replace(d, kv_transfer_config=None,
                                  kv_cache_dtype="float32" if d.kv_cache_dtype == "auto" else d.kv_cache_dtype)
              for d in made[role]]
        if len(ds) > 1:
            if any(d != ds[0] for d in ds) or ds[0].data_parallel_size != 1:
                raise ValueError(f"twin: the {role} servers differ, or have ranks of their own: {ds}")
            return dataclasses.replace(ds[0], data_parallel_size=len(ds))
        return ds[0]

    pre, dec = engine_deploy("prefill"), engine_deploy("decode")
    devices = {d.data_parallel_size * d.devices_per_replica for d in (pre, dec)}
    if len(devices) != 1:
        raise ValueError(f"twin: the prefill and decode engines have {devices} devices; one spec prices both")
    alone, shared = host_specs(devices.pop()), host_specs(DEVICES)

    def contend(engine, other):  # the step about to run: on the shared host while the other engine works
        spec = shared if other.has_unfinished() and busy_until(other) > engine.clock.now() else alone
        for runner in sim_runners(engine):
            runner.set_host(*spec)

    hw, before, after = alone if host == "alone" else shared
    pair = build_pd(glm53.get_preset(preset), pre, dec, hw, step_overhead_s=before, host_overlap_s=after,
                    weight_bytes=weight_bytes, hisparse_miss_fraction=0.0, pad_like_runner=True, async_dispatch=True,
                    before_step=contend if host == "contended" else None)
    ids, wall = run_point(pair, sessions, concurrency, pair.cfg.vocab_size, deploy["max_model_len"])
    outs = [pair.decode.output(r) for r in ids]
    m = summarize(outs, duration_s=max(o.finish_s for o in outs) - min(o.arrival_s for o in outs), num_devices=DEVICES)
    del m["running_requests_mean"], m["running_requests_mean_per_step"]  # as the HTTP client reports
    m.update(host=host, kv_transfer_received_tokens=pair.received_tokens(), sim_wall_s=wall)
    return m


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.pd_http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/pd_http")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deployments", nargs="+", default=None, choices=list(deployments(DEPLOY)),
                    help="default: both")
    ap.add_argument("--decode-layout", default="dp_ep", choices=DECODE_LAYOUTS,
                    help="decode side: one DP2 x EP2 server, as published (dp_ep), or two one-device servers (replicas)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=float, default=8, help="median turns per session")
    ap.add_argument("--scale", type=float, default=1 / 512, help="lengths of the 142K-token trace times this")
    ap.add_argument("--output-tokens", type=int, default=48, help="mean output tokens per turn")
    ap.add_argument("--cache-dir", default=None,
                    help="JAX compilation cache the servers share (default: a fresh temporary directory)")
    ap.add_argument("--fit-each-point", action="store_true",
                    help="before each point, fit the CPU spec its simulated twin is priced on, under the servers' XLA "
                         "flags (experiments.validate_sim.fit_compiled_with, 3-4 minutes a point), so that the twin "
                         "and the point see the machine at the same speed (`cpu_spec_fit` per run)")
    ap.add_argument("--redraw", metavar="DIR", default=None,
                    help="run nothing: rewrite DIR's table.md and pd_http.png from its results.json")
    args = ap.parse_args(argv)
    if args.redraw:
        result = json.loads((Path(args.redraw) / "results.json").read_text())
        (Path(args.redraw) / "table.md").write_text(table(result))
        if result["runs"]:
            plot(result, Path(args.redraw) / "pd_http.png")
        return result
    args.deployments = args.deployments or list(deployments(DEPLOY))
    from glm53.engine.runner.compilation import max_map_count

    limit = max_map_count()
    if limit is not None and limit < MIN_MAP_COUNT:
        raise SystemExit(f"experiments.pd_http: vm.max_map_count is {limit}, under the {MIN_MAP_COUNT} its servers' "
                         f"warm-up needs (each compiled XLA:CPU kernel holds memory mappings): raise it "
                         f"(sudo sysctl -w vm.max_map_count={MIN_MAP_COUNT}) and run again")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    import glm53

    vocab = glm53.init(args.preset, seed=args.seed).cfg.vocab_size
    sessions = make_sessions(args.sessions, args.scale, args.turns, args.output_tokens, DEPLOY["max_model_len"])
    cache = args.cache_dir or tempfile.mkdtemp(prefix="pd-http-jax-cache-")
    # the servers inherit these: compile at -O0 (as the tests do) and keep every program in the cache
    os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    specs = deployments(DEPLOY, args.decode_layout)
    runs = []
    result = {"benchmark": "pd_http", "date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count()}, "preset": args.preset, "deploy": DEPLOY,
              "deployments": {n: specs[n] for n in args.deployments}, "devices_per_deployment": DEVICES,
              "decode_layout": args.decode_layout, "vm_max_map_count": limit, "xla_flags": os.environ["XLA_FLAGS"],
              "workload": {"kind": "synthetic", "sessions": args.sessions, "median_turns": args.turns,
                           "scale": args.scale, "mean_output_tokens": args.output_tokens, "think_time_scale": 0.0,
                           **workloads.trace_stats(sessions)},
              "complete": False, "runs": runs}

    def save():  # after every point: a run that stops keeps the points it measured
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out / "results.json")
        (out / "table.md").write_text(table(result))

    for c in args.concurrency:
        tokens = {}
        for name in args.deployments:
            fit = fit_under(compile_flags(os.environ["XLA_FLAGS"])) if args.fit_each_point else None
            t0 = time.perf_counter()
            m, tokens[name] = run_deployment(name, specs[name], DEPLOY, sessions, c, preset=args.preset, seed=args.seed,
                                             vocab=vocab, cache=cache, logs=out / "logs")
            runs.append({"kv_policy": name, "concurrency": c, "point_wall_s": time.perf_counter() - t0, **m,
                         **({"cpu_spec_fit": fit} if fit else {})})
            print(f"{name} c={c}: {m['throughput_tok_s_per_device']:.0f} tok/s/device, TTFT p50 "
                  f"{m['ttft_median_s'] * 1e3:.0f} ms, TPOT {m['tpot_mean_s'] * 1e3:.1f} ms, received "
                  f"{m['kv_transfer_received_tokens']} of {m['decode_prompt_tokens']} prompt tokens, "
                  f"{m['compilations_after_warmup']} compilations", flush=True)
            save()
        if c == 1 and len(tokens) > 1:
            equal = len({json.dumps(t) for t in tokens.values()}) == 1
            for r in runs[-len(tokens):]:
                r["tokens_equal"] = equal
    result["complete"] = True
    save()
    plot(result, out / "pd_http.png")
    return result


# table.md's rows: (label, the results keys a cell reads, their values -> the cell; "" where a point
# does not have them)
TABLE_ROWS = (
    ("throughput, tok/s per device", ("throughput_tok_s_per_device",), "{:.0f}".format),
    ("P90 e2e tok/s per user", ("interactivity_p90_e2e_tok_s_user",), "{:.0f}".format),
    ("TTFT median, ms", ("ttft_median_s",), lambda s: f"{s * 1e3:.0f}"),
    ("TPOT mean, ms", ("tpot_mean_s",), lambda s: f"{s * 1e3:.1f}"),
    ("decode prompt tokens received from a producer", ("kv_transfer_received_tokens",), "{:,}".format),
    ("decode prompt tokens", ("decode_prompt_tokens",), "{:,}".format),
    ("decode prefix-cache hit rate", ("decode_prefix_hit_rate",), "{:.1%}".format),
    ("decode host->device MB", ("decode_h2d_bytes",), lambda b: f"{b / 1e6:.0f}"),
    # offload decode servers have no hot buffer: both counts 0
    ("hot-buffer hits / misses", ("hisparse_hot_hits", "hisparse_hot_misses"),
     lambda h, m: f"{h:,} / {m:,}" if h + m else ""),
    ("preemptions", ("preemptions",), str),
    ("compilations after warm-up", ("compilations_after_warmup",), str),
    ("router prefill fallbacks / resends", ("prefill_fallbacks", "resends"), "{} / {}".format),
    ("greedy tokens equal across deployments", ("tokens_equal",), str),
)


def table(result: dict) -> str:
    """The runs of a results.json side by side, one column per (concurrency, deployment), as markdown (a
    results.json without `complete` predates the key and was written only when every point had run)."""
    runs = result["runs"]
    head = (f"pd_http, {result['preset']}, decode layout {result.get('decode_layout', 'replicas')}: "
            f"{result['date']}, {result['git_revision'][:12]}, {result['machine']['cpu']} "
            f"({result['machine']['cores']} cores){'' if result.get('complete', True) else '; incomplete: a run that stopped'}\n\n")
    if not runs:
        return head
    lines = ["| | " + " | ".join(f"c{r['concurrency']} {r['kv_policy']}" for r in runs) + " |",
             "|---" * (len(runs) + 1) + "|"]
    for label, keys, cell in TABLE_ROWS:
        cells = [cell(*(r[k] for k in keys)) if all(k in r for k in keys) else "" for r in runs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["deployments"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label, scale in ((axes[0], "throughput_tok_s_per_device", "throughput (tok/s per device)", 1),
                                  (axes[1], "interactivity_p90_e2e_tok_s_user", "P90 e2e tok/s per user", 1),
                                  (axes[2], "ttft_median_s", "median TTFT (ms)", 1e3)):
        for n in names:
            rs = [r for r in result["runs"] if r["kv_policy"] == n]
            ax.plot([r["concurrency"] for r in rs], [r[key] * scale for r in rs], "o-", label=n)
        ax.set_xlabel("concurrency")
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"{result['preset']}: P/D over HTTP, router + prefill + decode processes on "
                 f"{result['machine']['cores']} cores ({result['date']}, {result['git_revision'][:8]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
