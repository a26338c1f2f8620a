"""The benchmark clients of the published AgentX family, guidellm and aiperf, run as shipped against
`python -m glm53.serve` and through `python -m glm53.router` in front of it.

    python -m experiments.bench_clients --out results/bench_clients [--requests 8] [--envs DIR]

Each client gets a virtual environment of its own with a pinned version (`CLIENTS`), built under
`--envs` (default ~/.cache/glm53/bench_clients) the first time and reused after: the clients are not
dependencies of the project, and their own dependency pins need not agree with it. Neither client is
patched or wrapped: each runs its command line with its default endpoint (/v1/chat/completions) and
streaming, so the server's chat template, SSE chunks and usage are what the clients parse.

The model is the tiny preset with random weights (seed 0), saved as a checkpoint beside a byte-level
HF `tokenizer.json` (and a `tokenizer_config.json` naming `PreTrainedTokenizerFast`), so that both
clients load their tokenizer from a local path (no network) and count tokens as the server does. The
checkpoint has no chat template of its own: the server renders GLM-5.3's (glm53/templates). The server
has no EOS for random weights, so every request produces the clients' requested output length.

For each client and each target ("server": the server alone; "router": the router with that server as
both its prefill and its decode server, which then recomputes the prompt as vLLM's "recompute") the
client sends `--requests` requests of synthetic text at a concurrency of 2, and OUT/{client}_{target}.json
records the run's header (date, machine, git commit), `versions` (the client's, jax's, python's),
`requests_ok`, `requests_failed` and
`latency`, the client's own summary read from the client's own output file (guidellm's benchmarks JSON,
aiperf's profile_export_aiperf.json), in seconds. The clients' own files and the processes' logs stay
under OUT/raw/ (not committed). A benchmark of compatibility: the figures are a tiny random model on a laptop's 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import venv
from pathlib import Path

from experiments.bench_http import start_server
from experiments.bench_model import run_metadata
from experiments.pd_http import _stop, start_router

CLIENTS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
MODEL_NAME = "glm53-tiny"
DEPLOY = {"max_model_len": 512, "max_num_batched_tokens": 128, "max_num_seqs": 2, "block_size": 16}
PROMPT_TOKENS, OUTPUT_TOKENS, CONCURRENCY = 64, 16, 2


def client_env(envs: Path, name: str) -> Path:
    """The bin/ directory of `name`'s pinned virtual environment under `envs`, built if missing."""
    d = envs / name
    marker = d / "installed.txt"
    if not marker.exists() or marker.read_text() != CLIENTS[name]:
        venv.create(d, with_pip=True, clear=True)
        subprocess.run([str(d / "bin" / "python"), "-m", "pip", "install", "-q", CLIENTS[name]], check=True)
        marker.write_text(CLIENTS[name])
    return d / "bin"


def byte_level_tokenizer():
    """A tokenizers.Tokenizer whose 256 ids are the bytes (GPT-2's byte alphabet, no merges): a checkpoint's
    tokenizer.json for the presets' byte vocabulary that HF-style clients can load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def make_checkpoint(d: Path) -> Path:
    """The tiny preset (seed 0) saved in `d` with a byte-level tokenizer.json the clients can load."""
    import glm53

    glm53.save_pretrained(glm53.init(glm53.get_preset("tiny"), seed=0), d)
    byte_level_tokenizer().save(str(d / "tokenizer.json"))
    # transformers' AutoTokenizer reads the class from here (config.json's model_type is not one it knows)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "model_max_length": DEPLOY["max_model_len"]}))
    return d


def run_guidellm(bin_dir: Path, url: str, tokenizer: Path, requests: int, raw: Path) -> dict:
    """guidellm's `run` at a fixed concurrency -> its benchmarks JSON (raw/benchmarks.json)."""
    raw.mkdir(parents=True, exist_ok=True)
    cmd = [str(bin_dir / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model={MODEL_NAME}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--profile", f"kind=concurrent,streams={CONCURRENCY}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={raw / 'benchmarks.json'}", "--disable-console-interactive"]
    _run(cmd, raw / "client.log")
    return json.loads((raw / "benchmarks.json").read_text())


def run_aiperf(bin_dir: Path, url: str, tokenizer: Path, requests: int, raw: Path) -> dict:
    """aiperf's `profile` at a fixed concurrency -> its profile_export_aiperf.json."""
    raw.mkdir(parents=True, exist_ok=True)
    cmd = [str(bin_dir / "aiperf"), "profile", "--model", MODEL_NAME, "--url", url, "--streaming",
           "--tokenizer", str(tokenizer), "--concurrency", str(CONCURRENCY), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", str(PROMPT_TOKENS), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--artifact-dir", str(raw), "--ui-type", "none"]
    _run(cmd, raw / "client.log")
    return json.loads(next(raw.rglob("profile_export_aiperf.json")).read_text())


def _dist(mean, p50, p90, p99, scale: float) -> dict:
    return {"mean": mean * scale, "p50": p50 * scale, "p90": p90 * scale, "p99": p99 * scale}


def guidellm_summary(raw: dict) -> dict:
    """guidellm's benchmarks JSON (one benchmark) -> requests_ok / requests_failed (errored + incomplete)
    and `latency`: its successful requests' TTFT, ITL and request latency (mean, p50, p90, p99 in s)."""
    (bench,) = raw["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]

    def ok(name: str, scale: float) -> dict:
        d = m[name]["successful"]
        q = d["percentiles"]
        return _dist(d["mean"], q["p50"], q["p90"], q["p99"], scale)

    return {"requests_ok": int(totals["successful"]), "requests_failed": int(totals["errored"] + totals["incomplete"]),
            "latency": {"ttft": ok("time_to_first_token_ms", 1e-3), "itl": ok("inter_token_latency_ms", 1e-3),
                        "request_latency": ok("request_latency", 1.0)},
            "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"]}


def aiperf_summary(raw: dict) -> dict:
    """aiperf's profile_export_aiperf.json -> requests_ok (its request_count: the requests that
    succeeded), requests_failed (the counts of its error_summary) and `latency`: TTFT, ITL and request
    latency (mean, p50, p90, p99 in s)."""
    def ms(name: str) -> dict:
        d = raw[name]
        assert d["unit"] == "ms", (name, d["unit"])
        return _dist(d["avg"], d["p50"], d["p90"], d["p99"], 1e-3)

    return {"requests_ok": int(raw["request_count"]["avg"]),
            "requests_failed": int(sum(e.get("count", 1) for e in raw.get("error_summary") or [])),
            "latency": {"ttft": ms("time_to_first_token"), "itl": ms("inter_token_latency"),
                        "request_latency": ms("request_latency")},
            "output_tokens_per_s": raw["output_token_throughput"]["avg"]}


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        # no HF_HUB_OFFLINE: aiperf 0.13.0 then looks every tokenizer up in the hub's cache, local paths too
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({rc}): {log.read_text()[-3000:]}")


def _pkg_version(bin_dir: Path, name: str) -> str:
    out = subprocess.run([str(bin_dir / "python"), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_clients", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench_clients", help="directory for the results")
    ap.add_argument("--requests", type=int, default=8, help="requests each client sends to each target")
    ap.add_argument("--envs", default=str(Path.home() / ".cache" / "glm53" / "bench_clients"),
                    help="where the clients' virtual environments are built (and the server's compilation cache)")
    ap.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    args = ap.parse_args(argv)
    out, envs = Path(args.out), Path(args.envs)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    envs.mkdir(parents=True, exist_ok=True)
    bins = {c: client_env(envs, c) for c in args.clients}
    runners = {"guidellm": (run_guidellm, guidellm_summary), "aiperf": (run_aiperf, aiperf_summary)}
    meta = run_metadata("bench_clients")  # date, machine, git commit, jax and python versions
    written = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt")
        flags = [x for k, v in DEPLOY.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        server, port = start_server(str(ckpt), 0, str(envs / "jax_cache"), out / "raw" / "server.log",
                                    [*flags, "--served-model-name", MODEL_NAME])
        procs = [server]
        try:
            router, rport = start_router([port], [port], out / "raw" / "router.log")
            procs.append(router)
            for client in args.clients:
                run, summary = runners[client]
                for target, p in (("server", port), ("router", rport)):
                    raw = run(bins[client], f"http://127.0.0.1:{p}", ckpt, args.requests, out / "raw" / f"{client}_{target}")
                    res = {**meta, "client": client, "target": target, "endpoint": "/v1/chat/completions",
                           "stream": True, "versions": {client: _pkg_version(bins[client], client), **meta["versions"]},
                           "model": {"preset": "tiny", "seed": 0, "tokenizer": "byte-level tokenizer.json"},
                           "deploy": DEPLOY, "concurrency": CONCURRENCY, "requests": args.requests,
                           "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, **summary(raw)}
                    path = out / f"{client}_{target}.json"
                    path.write_text(json.dumps(res, indent=2) + "\n")
                    written[f"{client}_{target}"] = res
                    print(f"{path}: ok {res['requests_ok']} failed {res['requests_failed']}", flush=True)
        finally:
            _stop(procs[::-1])
    return written


if __name__ == "__main__":
    main()
