"""Trust at the server (issue 51 item 1), real processes on loopback: one PdConnector server (`kv_both`, the
default role, which takes KV from producers) with a shared secret from $GLM53_KV_SECRET_FILE and no
producers listed, and an attacker's fake producer.

The attack: a client's kv_transfer_params named an address of its choosing; the server dialled it, took
the "KV" it answered (the CRC is the sender's, so it proves nothing) and kept it in the shared prefix
cache under the prompt's hash, so a later victim request without transfer params or salt attended to the
attacker's KV. The fake producer here is a real peer tier holding junk under exactly the chunk keys the
victim's prompt has on this server (the fingerprint read from the server's own prefill-leg answer, the
chained hashes recomputed, the sizes from the deployment), as an attacker would build it. Now a request
may name only a listed producer: anything else is a 400 naming kv_transfer_params, nothing is dialled,
and the victim keeps its greedy tokens. What a listed producer without the secret gets (its messages
and chunks refused): tests/kvcache/test_tiers_trust.py."""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from glm53 import DeployConfig
from kvcache.block_pool import block_hashes
from kvcache.tiers import chunk_key
from tests.glm53.test_serve import FLAGS
from tests.glm53.test_serve import Server as Process

REPO = Path(__file__).resolve().parents[2]

# The attacker's producer: a peer tier on loopback holding a chunk of random bytes (small normal floats)
# under each key it is given; it reports what it was asked (pinned) and served.
_FAKE = """
import json, sys, time
import numpy as np
from kvcache.tiers import StoreJob
from kvcache.tiers.p2p import PeerTier
chunks = json.loads(sys.stdin.readline())
tier = PeerTier(fingerprint="00" * 32, host="127.0.0.1", port=0, max_bytes=None)
rng = np.random.default_rng(0)
keys = tuple(bytes.fromhex(k) for k, _ in chunks)
junk = tuple(rng.standard_normal(n // 4).astype(np.float32).view(np.uint8) for _, n in chunks)
tier.submit_store(StoreJob(1, keys, junk))
while not tier.get_finished_jobs():
    time.sleep(0.001)
print(tier.port, flush=True)
for line in sys.stdin:
    with tier._lock:
        print(json.dumps({"pinned": tier.stats.pinned_chunks, "served": tier.stats.served_chunks}), flush=True)
"""

# A plain listener that counts the connections it accepts: the address 300 more requests name.
_TRAP = """
import socket, sys, threading
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(64)
got = []
def serve():
    while True:
        got.append(s.accept())
threading.Thread(target=serve, daemon=True).start()
print(s.getsockname()[1], flush=True)
for line in sys.stdin:
    print(len(got), flush=True)
"""


class _Proc:
    def __init__(self, script: str, first_line: str = ""):
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        if first_line:
            self.proc.stdin.write(first_line + "\n")
            self.proc.stdin.flush()
        self.port = int(self.proc.stdout.readline())

    def ask(self) -> str:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def close(self):
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory, serving_dir):
    tmp = tmp_path_factory.mktemp("trust")
    (tmp / "kv.secret").write_bytes(os.urandom(32).hex().encode())
    ktc = {"kv_connector": "PdConnector", "kv_role": "kv_both"}
    os.environ["GLM53_KV_SECRET_FILE"] = str(tmp / "kv.secret")  # the server process inherits it
    try:
        proc = Process(serving_dir, tmp, "--kv-transfer-config", json.dumps(ktc))
    finally:
        del os.environ["GLM53_KV_SECRET_FILE"]
    yield proc
    proc.stop()


def _tokens(server, prompt, **kw) -> list[int]:
    code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "return_token_ids": True, **kw})
    assert code == 200, out
    return out["choices"][0]["token_ids"]


def _victim_chunks(server, serving_model, prompt) -> list[tuple[str, int]]:
    """(key hex, bytes) of every chunk the server would look up for `prompt` without a salt, as an
    attacker derives them: the fingerprint and page spans from the server's answer to a prefill leg of
    another salt, the chained hashes of the prompt, the page sizes of the deployment."""
    code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "probe",
                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 200, out
    spans = out["kv_transfer_params"]["remote_page_spans"]
    sizes = DeployConfig(**FLAGS).kv_sizes(serving_model.cfg, np.dtype(serving_model.dtype).name).page_bytes
    hb = spans["hash_block_tokens"]
    out = []
    for c, h in enumerate(block_hashes(prompt, hb, (), upto=len(prompt) - 1)):
        for g, tokens in spans["page_tokens"].items():
            if not (c + 1) % (tokens // hb):
                out.append((chunk_key(spans["fingerprint"], g, h).hex(), sizes[g]))
    return out


def test_a_client_cannot_make_the_server_dial_or_poison_the_prefix_cache(server, serving_model):
    """The poisoning attack: a request with the victim's prompt naming the fake producer, which holds junk
    under every one of the prompt's chunk keys, is a 400 naming kv_transfer_params; the producer is never
    asked; the victim's later request (no salt, no transfer params) gives the greedy tokens the prompt
    gives under a salt of its own (no cache entry of the attack can reach that). 300 more requests, each
    naming another unlisted address (a live listener's port), are 400s, nothing dials it, and the server
    serves on with the same tokens."""
    prompt = np.random.default_rng(51).integers(0, 512, 41).tolist()
    want = _tokens(server, prompt, cache_salt="reference")
    fake = _Proc(_FAKE, json.dumps(_victim_chunks(server, serving_model, prompt)))
    trap = _Proc(_TRAP)
    try:
        attack = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": fake.port}
        code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "kv_transfer_params": attack})
        assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
        assert _tokens(server, prompt) == want
        assert json.loads(fake.ask()) == {"pinned": 0, "served": 0}  # never asked for anything

        def name(i):
            named = {"do_remote_prefill": True, "remote_host": f"127.0.{i // 250}.{1 + i % 250}",
                     "remote_port": trap.port}
            return server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": named})

        with ThreadPoolExecutor(8) as pool:
            for code, out in pool.map(name, range(300)):
                assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
        time.sleep(0.5)  # a dial, had one been made, has reached the listener by now
        assert int(trap.ask()) == 0
        assert _tokens(server, prompt) == want
    finally:
        fake.close()
        trap.close()
    assert "no shared secret" not in server.log.read_text()  # its peer tier runs with the file's secret


# --------------------------------------------------- a failed load, the limits, the shutdown (items 2-4)
# tests.glm53.faulty_serve: glm53.serve whose steps with a row of seed SLOW_SEED take SLOW_S longer (as a
# compilation would), which holds the engine thread while the HTTP side is watched
LIMITS = {"max_request_bytes": 4096, "max_prompts_per_request": 2, "max_waiting_requests": 3, "shutdown_timeout": 2}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, serving_dir):
    """The second server of this module: the offload host tier over an fs tier under
    kv_load_failure_policy "fail", LIMITS, and VLLM_SERVER_DEV_MODE=1 (its /reset_prefix_cache). The
    module's last test stops it with SIGTERM."""
    tmp = tmp_path_factory.mktemp("guarded")
    ktc = {"kv_connector": "OffloadingConnector", "kv_load_failure_policy": "fail",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20,
                                         "secondary_tiers": [{"type": "fs", "root_dir": str(tmp / "tier")}]}}
    flags = [x for k, v in LIMITS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the server process inherits it
    try:
        proc = Process(serving_dir, tmp, "--kv-transfer-config", json.dumps(ktc), *flags,
                       module="tests.glm53.faulty_serve")
    finally:
        del os.environ["VLLM_SERVER_DEV_MODE"]
    proc.root = tmp / "tier"
    yield proc
    proc.stop()


def _post(server, body: dict | bytes, path: str = "/v1/completions"):
    import httpx

    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.url(path), timeout=120, **kw)


def _sse(server, body: dict) -> list:
    """A streamed completion's parsed `data:` events ("[DONE]" as is)."""
    import httpx

    events = []
    with httpx.stream("POST", server.url("/v1/completions"), json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def _stable_chunks(root: Path, before: set, timeout: float = 60.0) -> set:
    """The chunk files written under `root` since `before`, once their count stopped changing for 1 s (the
    write-through stores run after a request finished)."""
    seen, since, end = set(), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        now = set(root.rglob("*.kv")) - before
        if now != seen:
            seen, since = now, time.monotonic()
        elif seen and time.monotonic() - since > 1.0:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"no stable set of stored chunks under {root}: {len(seen)}")


def test_a_failed_load_under_fail_fails_its_requests_only_and_the_server_serves_on(guarded):
    """Two prompts' chunks stored in the fs tier, the prefix cache reset (dev mode), every stored chunk
    damaged: under kv_load_failure_policy "fail" the non-streamed request for the first is a JSON 500
    naming the policy and one of its chunks, the stream for the second ends with finish_reason "error"
    and [DONE], and a third prompt beside them completes; /health stays 200 and the first prompt, asked
    again, gets its greedy tokens (the damaged chunks were deleted, its KV recomputed)."""
    rng = np.random.default_rng(512)
    p1, p2, other = (rng.integers(0, 512, 41).tolist() for _ in range(3))
    want = _tokens(guarded, p1)
    chunks = _stable_chunks(guarded.root, set())
    _tokens(guarded, p2)
    chunks |= _stable_chunks(guarded.root, chunks)
    assert _post(guarded, {}, "/reset_prefix_cache").status_code == 200
    for path in chunks:
        data = bytearray(path.read_bytes())
        data[-7] ^= 0xFF
        path.write_bytes(bytes(data))
    greedy = {"max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, guarded, {"prompt": p1, **greedy})
        second = pool.submit(_sse, guarded, {"prompt": p2, **greedy})
        third = pool.submit(_post, guarded, {"prompt": other, **greedy, "return_token_ids": True})
        first, second, third = first.result(), second.result(), third.result()
    assert first.status_code == 500, first.text
    message = first.json()["error"]["message"]
    assert "kv_load_failure_policy='fail'" in message and "'fs'" in message, message
    assert any(p.stem in message for p in chunks), message
    assert second[-1] == "[DONE]" and second[-2]["choices"][0]["finish_reason"] == "error", second[-3:]
    assert third.status_code == 200 and len(third.json()["choices"][0]["token_ids"]) == 8, third.text
    import httpx

    assert httpx.get(guarded.url("/health"), timeout=30).status_code == 200
    assert _tokens(guarded, p1) == want


def test_each_limit_is_a_clear_error(guarded, server):
    """--max-request-bytes: a larger body is a 413. --max-prompts-per-request: a batch of more is a 400
    naming `prompt` (as many is served). /reset_prefix_cache is routed only with VLLM_SERVER_DEV_MODE=1
    (404 on the module's other server). --max-waiting-requests: while a slow step holds the engine, five
    requests arrive; three wait, the two over the limit are 503s with Retry-After naming the flag, and
    the three complete once the step ends."""
    r = _post(guarded, json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode())
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError", r.text
    r = _post(guarded, {"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "--max-prompts-per-request 2" in r.json()["error"]["message"]
    r = _post(guarded, {"prompt": [[1, 2], [3, 4]], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = _post(server, {}, "/reset_prefix_cache")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text
    from tests.glm53.faulty_serve import SLOW_SEED

    with ThreadPoolExecutor(6) as pool:
        slow = pool.submit(_post, guarded, {"prompt": [7, 7, 7], "max_tokens": 1, "seed": SLOW_SEED})
        time.sleep(1.0)  # its step has begun: the engine thread takes no command until it ends (SLOW_S)
        rest = [pool.submit(_post, guarded, {"prompt": [1, 2, 3, i], "max_tokens": 2, "temperature": 0})
                for i in range(5)]
        answers = [f.result() for f in rest]
        assert slow.result().status_code == 200
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 200, 200, 503, 503], [a.text for a in answers]
    for a in answers:
        if a.status_code == 503:
            assert a.headers["retry-after"] == "1" and "--max-waiting-requests 3" in a.json()["error"]["message"]


def test_the_maps_clients_grow_are_bounded(monkeypatch):
    """Salts are client-chosen strings: the router's sticky map and the engine's salt -> replica map keep
    the most recently used MAX entries; a forgotten salt is routed as a new one. A server's engine keeps
    the newest max_finished finished requests (and their replicas) and max_timeline timeline rows."""
    from glm53 import Engine, SamplingParams
    from glm53.engine import engine as engine_mod
    from glm53.engine.synthetic import SyntheticRunner
    from glm53.router import Picker, Server
    from glm53 import router as router_mod
    from tests.engine.test_abort import _Model

    monkeypatch.setattr(router_mod, "MAX_STICKY_SALTS", 4)
    picker = Picker([Server("http://a", "decode"), Server("http://b", "decode")])
    for i in range(300):
        picker.pick(f"salt-{i}")
    assert list(picker.sticky) == [f"salt-{i}" for i in range(296, 300)]
    monkeypatch.setattr(engine_mod, "MAX_SALTS", 4)
    d = DeployConfig(max_model_len=64, max_num_seqs=4, block_size=4, num_gpu_blocks=40)
    eng = Engine(_Model(), d, runner=SyntheticRunner(lambda row: 7))
    for i in range(12):
        eng.add_request([1, 2], SamplingParams(4), salt=f"salt-{i}")
    assert list(eng._by_salt) == [f"salt-{i}" for i in range(8, 12)]
    eng.max_finished, eng.max_timeline = 5, 2
    while eng.has_unfinished():
        eng.step()
    assert list(eng.finished) == [f"req-{i}" for i in range(7, 12)] and set(eng._owner) == set(eng.finished)
    assert 0 < len(eng.timeline) <= 4 and eng._steps > 4
    assert eng.parked("req-0")  # forgotten: finished long ago


def test_sigterm_stops_admission_and_answers_every_client_in_time(guarded):
    """SIGTERM with a streamed and a non-streamed request in flight, both in batches with a request whose
    every step takes SLOW_S (a compilation's length), so neither can finish within the 2 s
    --shutdown-timeout: a request right after the signal is a 503 with Retry-After; by the timeout plus
    one second the stream has ended with finish_reason "abort", its usage and [DONE] (/health is 503
    meanwhile), and the
    non-streamed request (and the slow one) got a JSON 503; the process has exited (status -SIGTERM)
    within the timeout plus 5 s, the engine thread still inside its step."""
    import signal

    import httpx

    from tests.glm53.faulty_serve import SLOW_SEED

    timeout = LIMITS["shutdown_timeout"]
    long = {"max_tokens": 120, "temperature": 0}
    events, t = [], {}
    stream_started = threading.Event()

    def stream():
        body = {"prompt": [5, 6, 7, 8], **long, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", guarded.url("/v1/completions"), json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                    stream_started.set()
        t["stream"] = time.monotonic()

    def plain(body):
        r = _post(guarded, body)
        t[body["prompt"][0]] = time.monotonic()
        return r

    with ThreadPoolExecutor(4) as pool:
        s = pool.submit(stream)
        assert stream_started.wait(60)  # its first token arrived: it runs
        n = pool.submit(plain, {"prompt": [9, 10, 11], **long})
        slow = pool.submit(plain, {"prompt": [12, 13], **long, "seed": SLOW_SEED})
        seen, still = len(events), time.monotonic()
        while time.monotonic() - still < 1.0:  # no token for 1 s: the slow step holds the engine (for 6 s)
            time.sleep(0.1)
            if len(events) != seen:
                seen, still = len(events), time.monotonic()
        sent = time.monotonic()
        guarded.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = _post(guarded, {"prompt": [1, 2], "max_tokens": 1})
        assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
        assert httpx.get(guarded.url("/health"), timeout=30).status_code == 503  # a balancer stops routing here
        s.result()
        n, slow = n.result(), slow.result()
    try:
        guarded.proc.wait(max(0.1, timeout + 5 - (time.monotonic() - sent)))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {time.monotonic() - sent:.1f} s after SIGTERM") from None
    exited = time.monotonic()
    assert guarded.proc.returncode == -signal.SIGTERM
    for name, r in (("non-streamed", n), ("slow", slow)):
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", (name, r.text)
    assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "abort", events[-3:]
    usage = events[-2]["usage"]
    got = sum(1 for e in events[:-3] if e["choices"])
    assert usage["completion_tokens"] == got and usage["prompt_tokens"] == 4, (usage, got)
    assert all(v - sent < timeout + 1.5 for v in t.values()), {k: v - sent for k, v in t.items()}
    assert exited - sent < timeout + 5
    assert "still inside a step" in guarded.log.read_text()  # it did not wait for the slow step (SLOW_S)


def test_admission_counts_waiting_prompts():
    """ServerState.admit, without a server: prompts admitted and not yet queued count as waiting beside
    the engine's own; over --max-waiting-requests is a 503 with Retry-After (a wait may admit it), a single
    request of more prompts than the limit a 400 naming `prompt` (no wait would), a draining server 503s."""
    import types

    from glm53.protocol import HTTPError
    from glm53.serve import ServerState

    engine = types.SimpleNamespace(num_waiting=2)
    st = ServerState(engine=engine, tokenizer=None, served_model_name="m", max_waiting_requests=4)
    st.admit(2)
    assert st.pending_adds == 2
    with pytest.raises(HTTPError) as e:
        st.admit(1)
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    with pytest.raises(HTTPError) as e:
        st.admit(5)
    assert e.value.status == 400 and e.value.param == "prompt" and "--max-waiting-requests 4" in str(e.value)
    engine.num_waiting = 0
    st.admit(2)
    st.draining = True
    with pytest.raises(HTTPError) as e:
        st.admit(1)
    assert e.value.status == 503


def test_a_stream_whose_client_left_before_its_first_chunk_is_aborted_and_forgotten():
    """Starlette cancels an event stream whose client disconnects before it starts (ASGI spec < 2.4: a
    disconnect listener beside the body), so the body generator's own cleanup never runs: the response
    (`serve._Stream`) aborts the requests still running and drops their handles from `ServerState.live`
    (which would otherwise grow with every such client and hold every drain for its whole timeout)."""
    import asyncio
    import types

    from glm53.serve import ServerState, _Stream

    aborted = []
    engine = types.SimpleNamespace(abort_nowait=aborted.append)
    st = ServerState(engine=engine, tokenizer=None, served_model_name="m")
    class Handle:  # hashable, as RequestHandle is
        def __init__(self, req_id, ended):
            self.req_id, self.ended = req_id, ended

    done, running = Handle("done", object()), Handle("running", None)
    choices = [types.SimpleNamespace(handle=h) for h in (done, running)]
    st.live.update((done, running))
    started = []

    async def body():
        started.append(True)
        await asyncio.sleep(3600)
        yield "never"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):  # the response's start is still on its way when the client leaves
        await asyncio.sleep(3600)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(_Stream(st, choices, body())(scope, receive, send))
    assert aborted == ["running"] and st.live == set() and not started
