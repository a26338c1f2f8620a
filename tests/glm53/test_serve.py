"""`python -m glm53.serve` as a real server process on loopback: completions (batched, streamed,
concurrent) equal `Engine.generate`'s greedy tokens, a client that disconnects mid-stream frees its
blocks, the metrics parse with vLLM's names and types, the --api-key guards what it should, a checkpoint's
EOS and chat template work (through the openai client too), /health is 503 while the last steps all
failed and 200 again once one succeeds, and SIGTERM shuts down gracefully. The
openai-client cases of tests/glm53/openai_cases.py run against this module's server (bad fields, stop
strings, seeds, a failed step, error shapes, the rest of vLLM's surface)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import glm53
from glm53 import DeployConfig, Engine
from glm53.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from glm53.tokenizer import ByteTokenizer
from parallel.launch import free_port
from tests.glm53.openai_cases import *  # noqa: F403 - the shared cases run against this module's `api`
from tests.glm53.faulty_serve import FAULT_PROMPT
from tests.glm53.openai_cases import TIMEOUT_S, Api

REPO = Path(__file__).resolve().parents[2]
# the deployment of tests/engine/test_engine.py (its programs are in the session's compilation cache)
FLAGS = {"max_model_len": 128, "max_num_batched_tokens": 32, "max_num_seqs": 4, "block_size": 8}
NAME = "tiny-test"
KEY = "test-key"  # the module server's API key (given as VLLM_API_KEY)


class Server:
    """A server process on a free port (or `port`): `module` (glm53.serve, or tests.glm53.faulty_serve whose
    step fails for FAULT_PROMPT) serving `model` under FLAGS and `extra` flags; `api_key` as VLLM_API_KEY."""

    def __init__(self, model: str, tmp: Path, *extra: str, port: int | None = None, module: str = "glm53.serve",
                 api_key: str | None = None):
        self.port, self.extra, self.module, self.api_key = port or free_port(), extra, module, api_key
        self.log = tmp / f"server-{self.port}.log"
        args = [sys.executable, "-m", module, model, "--port", str(self.port), "--served-model-name", NAME,
                *[x for k, v in FLAGS.items() for x in (f"--{k.replace('_', '-')}", str(v))], *extra]
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": glm53_cache_dir(), "PYTHONPATH": str(REPO)}
        env.pop("VLLM_API_KEY", None)
        if api_key:
            env["VLLM_API_KEY"] = api_key
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600  # importing JAX and building the model, on a loaded machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(self.url("/health"), timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up: {self.log.read_text()[-3000:]}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def headers(self) -> dict:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body, timeout: float = TIMEOUT_S) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data, headers={"content-type": "application/json",
                                                                         **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, body: dict, stop_after: int | None = None) -> list:
        """POST with stream=true -> the parsed `data:` events (the last is "[DONE]"); stop_after: close the
        connection after that many events."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"content-type": "application/json", **self.headers})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        events = []
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if stop_after is not None and len(events) >= stop_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                return events
        conn.close()
        return events

    def metrics(self) -> dict:
        text = urllib.request.urlopen(self.url("/metrics"), timeout=60).read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))] = \
                    (fam.type, s.value)
        return out

    def stop(self, timeout: float = 60) -> bool:
        """SIGTERM -> whether the server shut down gracefully (its engine shut down, then uvicorn re-raised
        the signal, so the status is -SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode in (0, -signal.SIGTERM) and "engine shut down" in self.log.read_text()


def glm53_cache_dir() -> str:
    """The session's compilation cache shared by the servers the tests start (tests/conftest.py)."""
    return os.environ.get("GLM53_TEST_COMPILE_CACHE", "")


def _metric(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))][1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, serving_dir):
    s = Server(serving_dir, tmp_path_factory.mktemp("serve"), module="tests.glm53.faulty_serve", api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server):
    """The shared openai-client cases' view of this module's server."""
    return Api(server.url(""), NAME, "server", KEY, FLAGS["max_model_len"])


@pytest.fixture(scope="module")
def prompts_and_tokens(serving_model):
    """Five prompts and the greedy tokens `Engine.generate` gives them on the same weights and deployment."""
    model = serving_model
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 30, 3, 50, 17)]
    outs = Engine(model, DeployConfig(**FLAGS)).generate([np.asarray(p) for p in prompts], max_new_tokens=6)
    return prompts, [o.token_ids.tolist() for o in outs], model


def test_completions_equal_engine_generate(server, prompts_and_tokens):
    prompts, want, _ = prompts_and_tokens
    code, r = server.post("/v1/completions", {"model": NAME, "prompt": prompts[:3], "max_tokens": 6, "temperature": 0,
                                              "return_token_ids": True})
    assert code == 200 and r["object"] == "text_completion" and r["model"] == NAME
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in r["choices"]] == want[:3]
    assert all(c["finish_reason"] == "length" and c["text"] == ByteTokenizer().decode(c["token_ids"])
               for c in r["choices"])
    u = r["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"]) == (sum(map(len, prompts[:3])), 18)
    # the same prompt again: its full 8-token blocks come from the prefix cache
    code, r = server.post("/v1/completions", {"prompt": prompts[1], "max_tokens": 6, "temperature": 0})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 24 and code == 200
    models = httpx.get(server.url("/v1/models"), headers=server.headers, timeout=10).json()
    assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == 128


def test_streamed_chunks_add_up_to_the_completion(server, prompts_and_tokens):
    prompts, want, _ = prompts_and_tokens
    events = server.stream({"prompt": prompts[3], "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                            "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) == 6  # one chunk per token
    assert [c["choices"][0]["token_ids"][0] for c in chunks] == want[3]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ByteTokenizer().decode(want[3])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


def test_concurrent_clients_join_the_running_batch(server, prompts_and_tokens):
    prompts, want, _ = prompts_and_tokens
    results = {}

    def client(i):
        if i % 2:
            ev = server.stream({"prompt": prompts[i], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
            results[i] = [e["choices"][0]["token_ids"][0] for e in ev[:-1]]
        else:
            results[i] = server.post("/v1/completions", {"prompt": prompts[i], "max_tokens": 6, "temperature": 0,
                                                         "return_token_ids": True})[1]["choices"][0]["token_ids"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert [results[i] for i in range(5)] == want


def test_chat_on_a_preset_renders_glm53s_conversation_format(server):
    """The module's server serves a checkpoint without tokenizer.json, as a preset: the byte tokenizer and
    GLM-5.3's chat template (glm53/templates), as /tokenize renders it and as the chat endpoint prompts
    the model."""
    text = "[gMASK]<sop><|system|>be brief<|user|>hi<|assistant|><think>"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = httpx.post(server.url("/tokenize"), json={"model": NAME, "messages": msgs},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    assert r["tokens"] == ByteTokenizer().encode(text) and r["count"] == len(text)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    out = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == len(text) and out.usage.completion_tokens == 2


def test_the_api_key_guards_the_v1_routes_and_the_tokenizer_but_not_probes(server):
    wrong = openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0, timeout=60)
    for call in (wrong.models.list, lambda: wrong.completions.create(model=NAME, prompt=[1, 2], max_tokens=1)):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        assert info.value.response.json()["error"]["code"] == 401
    for path in ("/tokenize", "/detokenize", "/reset_prefix_cache", "/v1/chat/completions"):
        r = httpx.post(server.url(path), json={"prompt": "x", "tokens": [1]}, timeout=60)  # no key at all
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", path
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url(path), timeout=60).status_code == 200, path
    right = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    assert [m.id for m in right.models.list().data] == [NAME]


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    before = server.metrics()
    aborted = before.get(("vllm:request_success_total", (("finished_reason", "abort"),)), (None, 0))[1]
    events = server.stream({"prompt": list(range(20)), "max_tokens": 100, "temperature": 0}, stop_after=2)
    assert len(events) == 2
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = server.metrics()
        done = m.get(("vllm:request_success_total", (("finished_reason", "abort"),)), (None, 0))[1]
        if done == aborted + 1 and _metric(m, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert done == aborted + 1, "the disconnected request was not aborted"
    assert _metric(m, "vllm:kv_cache_usage_perc") == 0.0  # every block back in the pool
    assert _metric(m, "vllm:generation_tokens_total") < _metric(before, "vllm:generation_tokens_total") + 100


def test_metrics_have_vllms_names_and_types(server, prompts_and_tokens):
    prompts = prompts_and_tokens[0]
    hits = _metric(server.metrics(), "vllm:prefix_cache_hits_total")
    for _ in range(2):  # the second time, its 3 full blocks come from the prefix cache
        assert server.post("/v1/completions", {"prompt": prompts[1], "max_tokens": 2, "temperature": 0})[0] == 200
    m = server.metrics()
    types = {name: kind for (name, _), (kind, _) in m.items()}
    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:cache_config_info", "gauge"),
                       ("vllm:prefix_cache_queries_total", "counter"), ("vllm:prefix_cache_hits_total", "counter"),
                       ("vllm:num_preemptions_total", "counter"), ("vllm:prompt_tokens_total", "counter"),
                       ("vllm:generation_tokens_total", "counter"), ("vllm:request_success_total", "counter"),
                       ("vllm:time_to_first_token_seconds_count", "histogram"),
                       ("vllm:inter_token_latency_seconds_bucket", "histogram"),
                       ("vllm:e2e_request_latency_seconds_sum", "histogram"),
                       ("vllm:request_queue_time_seconds_count", "histogram")]:
        assert types.get(name) == kind, (name, types.get(name))
    info = [labels for (name, labels), _ in m.items() if name == "vllm:cache_config_info"]
    assert dict(info[0])["block_size"] == "8"
    assert _metric(m, "vllm:prefix_cache_hits_total") - hits >= 24


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_checkpoint(model, d: Path, eos: int | None = None):
    """`model` saved as an HF checkpoint in `d` with a byte-level tokenizer.json, a chat template and, if
    given, an EOS id -> the tokenizer (tokenizers.Tokenizer)."""
    from experiments.bench_clients import byte_level_tokenizer

    glm53.save_pretrained(model, d)
    tok = byte_level_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    if eos is not None:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, prompts_and_tokens):
    """The servers' weights (tests/glm53/conftest.py) saved as an HF checkpoint with a byte-level
    tokenizer.json, an EOS id (the first greedy token of some prompt that differs from the ones before it)
    and a chat template."""
    prompts, want, model = prompts_and_tokens
    p, k = next((p, k) for p, w in enumerate(want) for k in range(1, len(w)) if w[k] not in w[:k])
    d = tmp_path_factory.mktemp("ckpt")
    eos = want[p][k]
    return d, save_checkpoint(model, d, eos), eos, p, k


@pytest.mark.slow
def test_a_checkpoint_with_eos_and_chat_template(checkpoint, prompts_and_tokens, tmp_path):
    d, tok, eos, p, k = checkpoint
    prompts, want, model = prompts_and_tokens
    s = Server(str(d), tmp_path, module="tests.glm53.faulty_serve")
    try:
        code, r = s.post("/v1/completions", {"prompt": prompts[p], "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True})
        c = r["choices"][0]
        assert code == 200 and c["token_ids"] == want[p][:k + 1] and c["finish_reason"] == "stop"
        assert c["text"] == tok.decode(want[p][:k])  # EOS itself adds no text
        code, r = s.post("/v1/completions", {"prompt": prompts[p], "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True, "ignore_eos": True})
        assert r["choices"][0]["token_ids"] == want[p] and r["choices"][0]["finish_reason"] == "length"
        # a text prompt goes through tokenizer.json; the chat template renders the messages
        text = "<user>hello<assistant>"
        ids = tok.encode(text).ids
        ref = Engine(model, DeployConfig(**FLAGS)).generate([np.asarray(ids)], 4, on_token=None)
        expect = ref[0].token_ids.tolist()
        cut = expect.index(eos) + 1 if eos in expect else len(expect)
        code, r = s.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hello"}],
                                                  "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert code == 200 and r["object"] == "chat.completion" and r["choices"][0]["token_ids"] == expect[:cut]
        assert r["choices"][0]["message"]["role"] == "assistant"
        code, r = s.post("/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0,
                                             "return_token_ids": True})
        assert r["choices"][0]["token_ids"] == expect[:cut] and r["usage"]["prompt_tokens"] == len(ids)
        # the same chat through the openai client, whole and streamed, and its tokens through /tokenize
        client = openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]  # text parts: joined
        r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=4, temperature=0)
        want_text = tok.decode(expect[:cut][:-1] if eos in expect else expect)
        assert r.choices[0].message.content == want_text and r.usage.prompt_tokens == len(ids)
        assert r.choices[0].finish_reason == ("stop" if eos in expect else "length")
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=4,
                                                     temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == cut
        assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want_text
        tokenized = httpx.post(s.url("/tokenize"), json={"messages": messages}, timeout=60).json()
        assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
        # steps that fail one after another may mean a broken engine, not a bad batch: after the third in
        # a row the server reports itself unhealthy (503, the error body) but keeps serving, and the first
        # step that succeeds makes it healthy again; nothing is left running
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert httpx.get(s.url("/health"), timeout=10).status_code == 200
            assert s.post("/v1/completions", {"prompt": FAULT_PROMPT, "max_tokens": 2})[0] == 500
        health = httpx.get(s.url("/health"), timeout=10)
        assert health.status_code == 503 and health.json()["error"]["type"] == "ServiceUnavailableError"
        assert "steps failed" in health.json()["error"]["message"]
        code, r = s.post("/v1/completions", {"prompt": prompts[p], "max_tokens": 2, "temperature": 0,
                                             "return_token_ids": True})
        assert code == 200 and r["choices"][0]["token_ids"] == want[p][:2]
        assert httpx.get(s.url("/health"), timeout=10).status_code == 200
        m = s.metrics()
        assert _metric(m, "vllm:num_requests_running") == 0 and _metric(m, "vllm:kv_cache_usage_perc") == 0.0
    finally:
        assert s.stop()


def test_sigterm_lets_running_requests_finish_then_exits(server):
    """Last in this module (the fixture's server goes down): a stream in flight at SIGTERM still ends
    properly (finished, or aborted once --shutdown-timeout passes), and the engine shuts down."""
    out = {}

    def client():
        out["events"] = server.stream({"prompt": list(range(10)), "max_tokens": 40, "temperature": 0})

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _metric(server.metrics(), "vllm:num_requests_running") == 0:
        time.sleep(0.05)
    assert server.stop()
    t.join(TIMEOUT_S)
    events = out["events"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "abort")


def test_default_host_pools_larger_than_the_machine_are_refused_with_the_flags_to_give(monkeypatch):
    """A PdConnector or HiSparse server given no host pool size sizes it for max_num_seqs requests of
    max_model_len; where that exceeds the machine's memory it is a ValueError naming the sizes and the
    flags, not a process the OOM killer ends while allocating. Sized explicitly, or with limits that fit,
    it starts as given."""
    from glm53 import serve

    cfg = glm53.get_preset("tiny")
    pd = json.dumps({"kv_connector": "PdConnector", "kv_role": "kv_producer"})
    monkeypatch.setattr(serve, "host_memory_bytes", lambda: 1 << 30)
    for flags, named in ((["--kv-transfer-config", pd], "--cpu-offload-bytes"),
                         (["--kv-policy", "hisparse"], "--hisparse-host-pool-bytes")):
        args = serve.build_parser().parse_args(["tiny", *flags])  # 256 requests of 65,536 tokens
        with pytest.raises(ValueError, match=f"exceed this machine's 1,073,741,824 bytes.*{named}"):
            serve.deploy_from_args(args, cfg, "float32")
        small = serve.build_parser().parse_args(["tiny", *flags, "--max-model-len", "4096", "--max-num-seqs", "4"])
        d = serve.deploy_from_args(small, cfg, "float32")
        assert 0 < (d.cpu_offload_bytes or d.hisparse_host_pool_bytes) < 1 << 30
    given = serve.build_parser().parse_args(["tiny", "--kv-transfer-config", pd, "--cpu-offload-bytes", "1000000"])
    assert serve.deploy_from_args(given, cfg, "float32").cpu_offload_bytes == 1_000_000
    # each data-parallel rank allocates its own pools: four ranks of a size that fits once do not fit
    small = ["tiny", "--kv-policy", "hisparse", "--max-model-len", "4096", "--max-num-seqs", "4"]
    per_rank = serve.deploy_from_args(serve.build_parser().parse_args(small), cfg, "float32").hisparse_host_pool_bytes
    monkeypatch.setattr(serve, "host_memory_bytes", lambda: per_rank * 5 // 2)
    for dp in ("2", "4"):
        args = serve.build_parser().parse_args([*small, "--data-parallel-size", dp, "--enable-expert-parallel"])
        if dp == "2":
            assert serve.deploy_from_args(args, cfg, "float32").hisparse_host_pool_bytes == per_rank
        else:
            with pytest.raises(ValueError, match="on each of 4 data-parallel ranks"):
                serve.deploy_from_args(args, cfg, "float32")


def test_continuous_usage_counts_what_was_sent_even_when_the_engine_has_already_ended_the_request():
    """The engine runs in its own thread: it may end a request (a stop string two tokens on) before the
    stream has sent the first token's chunk. That chunk's continuous usage counts the one token sent, not
    the ended request's two; once the stream has sent the end (the choice no longer live) the ended
    request's counts are the usage."""
    import types

    from glm53 import serve

    ended = types.SimpleNamespace(num_output_tokens=2, num_cached_tokens=16)
    c = serve._Choice(index=0, prompt=list(range(20)), handle=types.SimpleNamespace(ended=ended), text=None,
                      tokens=[7])
    u = serve._usage([c], live={0})
    assert (u.completion_tokens, u.prompt_tokens, u.prompt_tokens_details["cached_tokens"]) == (1, 20, 0)
    u = serve._usage([c])
    assert (u.completion_tokens, u.total_tokens, u.prompt_tokens_details["cached_tokens"]) == (2, 22, 16)
