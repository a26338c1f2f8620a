"""Serving over HTTP against serving in process: the same OpenHands-style closed-loop workload through
`python -m glm53.serve` (a real server process on loopback) and through `glm53.Engine` directly.

    python -m experiments.bench_http --out results/bench_http [--concurrency 1 4] [--sessions 8]

The workload is the serve experiment's default (8 OpenHands sessions of 13 turns at 1/128 scale) with 24
output tokens per turn instead of 2, so that each request's TPOT averages 23 gaps.

The client is the serve experiment's `experiments.workloads.ClosedLoopClient`, unchanged: in process it
drives the engine; over HTTP it drives `HttpEngine`, which has the engine's interface (add_request /
step / has_unfinished / clock) and sends each request as a streamed /v1/completions call with token-id
prompts, collecting each token's arrival time on the client. Both sides then summarise the run with
`glm53.engine.metrics.summarize` (TTFT, TPOT, throughput on wall time), so the difference is what HTTP,
JSON, the server's event loop and its engine thread cost on this machine. The server and the client
share the machine's cores (on 2 cores they compete).

Every bucket shape is compiled first (`runner.warmup()` in process; the server's `--warmup` loads
them from the compilation cache that filled), and each point runs once untimed on each side; the
compilations during the timed runs are counted (in process, and the server's `glm53:xla_compilations`)
and should be 0. Then the prefix cache is emptied
(`Engine.reset_prefix_cache`, the server's POST /reset_prefix_cache) and the timed run starts cold. The server uses a preset's random weights
(`--seed`), and the in-process engine the same; at concurrency 1 the prompts are identical on both sides
and so are the greedy tokens (`tokens_equal`); at higher concurrency the client's random new inputs
follow the order in which turns happen to be sent, so only the counts compare.

Writes OUT/results.json (runs: per concurrency, `in_process` and `http` metrics and `http_overhead`) and
OUT/http_vs_in_process.png. A benchmark: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from experiments import workloads
from experiments.common import REPO, cpu_name, git_revision
from glm53.engine.plan import WallClock
from parallel.launch import free_port

DEPLOY = {"max_model_len": 1024, "max_num_batched_tokens": 256, "max_num_seqs": 4, "block_size": 16}
METRICS = ("ttft_median_s", "ttft_p90_s", "tpot_mean_s", "throughput_tok_s_per_device", "interactivity_tok_s_user",
           "requests", "output_tokens", "duration_s")


class HttpEngine:
    """The Engine interface ClosedLoopClient needs, over a server's streamed /v1/completions: each request
    runs in a thread of its own; `step` returns the tokens that arrived since the last call (waiting for
    at least one while any request is in flight)."""

    def __init__(self, port: int, model_name: str):
        self.port, self.model_name = port, model_name
        self.clock = WallClock()
        self._events: queue.Queue = queue.Queue()
        self._live: set[str] = set()
        self._n = 0
        self.records: dict[str, dict] = {}
        self.errors: list[str] = []

    def add_request(self, prompt, params, salt: str = "") -> str:
        rid = f"http-{self._n}"
        self._n += 1
        self._live.add(rid)
        self.records[rid] = {"prompt": np.asarray(prompt, np.int32), "arrival_s": self.clock.now(), "tokens": [],
                             "times": []}
        body = {"model": self.model_name, "prompt": [int(t) for t in prompt], "max_tokens": params.max_new_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                "cache_salt": salt or None}
        threading.Thread(target=self._run, args=(rid, body), daemon=True).start()
        return rid

    def _run(self, rid: str, body: dict) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            for line in resp:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                c = json.loads(line[6:])["choices"][0]
                fin = c["finish_reason"] is not None
                self._events.put((rid, c["token_ids"][0], fin, self.clock.now()))
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported by step, never a hang
            self.errors.append(f"{rid}: {e!r}")
            self._events.put((rid, None, True, self.clock.now()))

    def step(self) -> list[tuple[str, int, bool]]:
        out = [self._events.get(timeout=600)]
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                break
        result = []
        for rid, tok, fin, t in out:
            if tok is None:
                raise RuntimeError(f"request failed: {self.errors}")
            rec = self.records[rid]
            rec["tokens"].append(tok)
            rec["times"].append(t)
            if fin:
                self._live.discard(rid)
            result.append((rid, tok, fin))
        return result

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def outputs(self, ids):
        from glm53.engine.request import RequestOutput

        return [RequestOutput(r, self.records[r]["prompt"], np.asarray(self.records[r]["tokens"], np.int32),
                              self.records[r]["arrival_s"], self.records[r]["times"][0], self.records[r]["times"][-1],
                              tuple(self.records[r]["times"]), 0) for r in ids]


def start_server(preset: str, seed: int, cache_dir: str, log: Path, flags: list[str] | None = None
                 ) -> tuple[subprocess.Popen, int]:
    """`python -m glm53.serve PRESET --warmup` on a free port with `flags` (default: DEPLOY's), its
    compilation cache in `cache_dir` -> (process, port) once /health answers."""
    port = free_port()
    flags = [x for k, v in DEPLOY.items() for x in (f"--{k.replace('_', '-')}", str(v))] if flags is None else flags
    args = [sys.executable, "-m", "glm53.serve", preset, "--seed", str(seed), "--port", str(port), "--warmup", *flags]
    # its /reset_prefix_cache (between the warm-up and the timed run) is routed only in development mode
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir, "PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1"}
    proc = subprocess.Popen(args, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 1800  # --warmup: every bucket shape, loaded from the cache the client filled
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not come up: {log.read_text()[-2000:]}")


def scrape_metrics(port: int) -> dict[str, float]:
    """A server's /metrics -> {sample name: value summed over its label sets}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _server_compilations(port: int) -> int:
    return int(scrape_metrics(port)["glm53:xla_compilations_total"])


def run_point(engine, sessions, concurrency: int, vocab: int, max_model_len: int = DEPLOY["max_model_len"]
              ) -> tuple[list[str], float]:
    import glm53

    client = workloads.ClosedLoopClient(engine, sessions, concurrency, vocab_size=vocab, seed=0,
                                        make_params=lambda n: glm53.SamplingParams(max_new_tokens=n),
                                        think_time_scale=0.0, salt_prefix="user:",
                                        max_model_len=max_model_len)
    t0 = time.perf_counter()
    res = client.run()
    return res.request_ids, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench_http")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=13)
    ap.add_argument("--scale", type=float, default=1 / 128)
    ap.add_argument("--output-tokens", type=int, default=24,
                    help="output tokens per turn (the scaled OpenHands turn has 2: too few to time streaming)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import jax

    import glm53
    from glm53.engine.metrics import summarize
    from glm53.engine.runner import CompileCounter

    cache = tempfile.mkdtemp(prefix="bench-http-jax-cache-")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    model = glm53.init(args.preset, seed=args.seed)
    vocab = model.cfg.vocab_size
    t0 = time.perf_counter()
    shapes = glm53.Engine(model, glm53.DeployConfig(**DEPLOY)).runner.warmup()  # fills the shared cache
    print(f"compiled {shapes} bucket shapes in {time.perf_counter() - t0:.0f} s", flush=True)
    proc, port = start_server(args.preset, args.seed, cache, out / "server.log")
    runs = []
    try:
        for c in args.concurrency:
            sessions = workloads.openhands_sessions(args.sessions, scale=args.scale, turns=args.turns,
                                                    output=round(args.output_tokens / args.scale))
            point = {"concurrency": c, "sessions": len(sessions)}
            for side in ("in_process", "http"):
                # one engine per side and point: a first run compiles (in process) or loads (server) its
                # programs, then the prefix cache is emptied and the timed run starts as cold as the first
                eng = (glm53.Engine(model, glm53.DeployConfig(**DEPLOY)) if side == "in_process"
                       else HttpEngine(port, args.preset))
                run_point(eng, sessions, c, vocab)
                if side == "in_process":
                    eng.reset_prefix_cache()
                else:
                    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache",
                                                                  method="POST"), timeout=60)
                before = _server_compilations(port)
                with CompileCounter() as compiles:
                    ids, wall = run_point(eng, sessions, c, vocab)
                point[f"{side}_compilations"] = (compiles.count if side == "in_process"
                                                 else _server_compilations(port) - before)
                if side == "in_process":
                    m = eng.metrics(ids)
                    tokens = [eng.output(r).token_ids.tolist() for r in ids]
                else:
                    outs = eng.outputs(ids)
                    m = summarize(outs, duration_s=max(o.finish_s for o in outs) - min(o.arrival_s for o in outs))
                    tokens = [o.token_ids.tolist() for o in outs]
                point[side] = {k: m[k] for k in METRICS} | {"wall_s": wall}
                point[f"{side}_tokens"] = tokens
            a, b = point["in_process"], point["http"]
            point["tokens_equal"] = point.pop("in_process_tokens") == point.pop("http_tokens") if c == 1 else None
            point["http_overhead"] = {
                "throughput_frac": b["throughput_tok_s_per_device"] / a["throughput_tok_s_per_device"] - 1,
                "tpot_frac": b["tpot_mean_s"] / a["tpot_mean_s"] - 1,
                "ttft_median_delta_s": b["ttft_median_s"] - a["ttft_median_s"]}
            runs.append(point)
            print(f"c={c}: in process {a['throughput_tok_s_per_device']:.0f} tok/s, TPOT {a['tpot_mean_s'] * 1e3:.1f} ms, "
                  f"TTFT p50 {a['ttft_median_s'] * 1e3:.0f} ms | HTTP {b['throughput_tok_s_per_device']:.0f} tok/s, "
                  f"TPOT {b['tpot_mean_s'] * 1e3:.1f} ms, TTFT p50 {b['ttft_median_s'] * 1e3:.0f} ms", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = {"benchmark": "bench_http", "date": time.strftime("%Y-%m-%d"), "git_commit": git_revision(),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count()}, "preset": args.preset, "deploy": DEPLOY,
              "workload": {"kind": "openhands", "sessions": args.sessions, "turns": args.turns, "scale": args.scale,
                           "output_tokens_per_turn": args.output_tokens, "think_time_scale": 0.0},
              "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "http_vs_in_process.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    cs = [r["concurrency"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label, scale in ((axes[0], "throughput_tok_s_per_device", "throughput (tok/s)", 1),
                                  (axes[1], "tpot_mean_s", "mean TPOT (ms)", 1e3),
                                  (axes[2], "ttft_median_s", "median TTFT (ms)", 1e3)):
        x = np.arange(len(cs))
        ax.bar(x - 0.2, [r["in_process"][key] * scale for r in runs], 0.4, label="in process")
        ax.bar(x + 0.2, [r["http"][key] * scale for r in runs], 0.4, label="HTTP")
        ax.set_xticks(x, [f"c={c}" for c in cs])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"{result['preset']}: glm53.serve over loopback vs in-process Engine ({result['date']}, "
                 f"{result['git_commit'][:8]}, {result['machine']['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
