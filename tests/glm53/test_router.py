"""`python -m glm53.router` in front of real prefill and decode servers on loopback (vLLM's two-leg
protocol): greedy completions, streamed or not, equal `Engine.generate`'s; a user's salt keeps its decode
server; a decode server killed mid-stream loses no request (the router re-sends the prompt and the
tokens so far elsewhere), for a chat stream too; bad requests get 400 and a server's error answer,
whatever its status, is the request's answer and never marks the server down; /metrics carries every
server's series under a `server` label. The openai-client cases of tests/glm53/openai_cases.py run
against the router (its servers serve a checkpoint with a chat template, through
tests.glm53.faulty_serve). The routing rules themselves (`Picker`) are tested without servers."""

import contextlib
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import httpx
import numpy as np
import openai
import pytest

from glm53 import DeployConfig, Engine
from glm53.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from glm53.router import MISSED_POLLS, NoServer, Picker, PrefixIndex, RouterState, Server, parse_load, poll
from kvcache.block_pool import block_hashes
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from parallel.launch import free_port
from tests.glm53.openai_cases import *  # noqa: F403 - the shared cases run against this module's `api`
from tests.glm53.faulty_serve import FAULT_PROMPT
from tests.glm53.openai_cases import Api
from tests.glm53.test_serve import FLAGS, NAME, REPO, TIMEOUT_S, save_checkpoint
from tests.glm53.test_serve import Server as Process


def test_picker_salt_sticks_load_decides_ties_take_turns():
    a, b, c = (Server(u, "decode") for u in ("http://a", "http://b", "http://c"))
    p = Picker([a, b, c])
    assert [p.pick().url for _ in range(3)] == ["http://a", "http://b", "http://c"]  # equal load: in turn
    a.polled_load, b.polled_load, c.polled_load = 5, 0, 2  # a poll resets what was sent
    for s in (a, b, c):
        s.sent = 0
    assert p.pick().url == "http://b" and p.pick().url == "http://b"  # b: 0, then 1 sent
    b.sent = 9
    assert p.pick("user1").url == "http://c"  # least loaded, and the salt remembers it
    c.sent = 50
    assert p.pick("user1").url == "http://c"  # stays while c is up, however loaded
    c.up = False
    assert p.pick("user1").url == "http://a"  # c down: the salt moves
    assert p.pick("user1", exclude={"http://a"}).url == "http://b"
    a.up = b.up = False
    with pytest.raises(NoServer, match="no decode server is up"):
        p.pick()


def test_a_server_that_answers_its_polls_late_stays_up_until_it_misses_several_in_a_row():
    """The poll (`glm53.router.poll`, httpx's mock transport as the servers): a decode server busy with
    long steps answers /health late; the only decode server of a deployment must not be dropped for one
    late answer (every request would get a 503), only after MISSED_POLLS late polls in a row, and an
    answer in time brings it back and resets the count. A refused connection is down at once."""
    import asyncio

    behaviour = {"http://slow": "late", "http://gone": "refused"}

    def handler(request):
        mode = behaviour.get(f"{request.url.scheme}://{request.url.host}", "ok")
        if mode == "late":
            raise httpx.ReadTimeout("late", request=request)
        if mode == "refused":
            raise httpx.ConnectError("refused", request=request)
        body = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n" if request.url.path == "/metrics" else "{}"
        return httpx.Response(200, text=body)

    slow, gone, pre = Server("http://slow", "decode"), Server("http://gone", "decode"), Server("http://p", "prefill")
    st = RouterState(Picker([pre]), Picker([slow, gone]), PrefixIndex(), {}, 0.5, 10.0,
                     client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))

    async def polls(n):
        for _ in range(n):
            await poll(st)

    asyncio.run(polls(MISSED_POLLS - 1))
    assert slow.up and slow.late_polls == MISSED_POLLS - 1 and not gone.up and pre.up and pre.polled_load == 3
    assert st.dec.pick().url == "http://slow"
    asyncio.run(polls(1))
    assert not slow.up
    with pytest.raises(NoServer, match="no decode server is up"):
        st.dec.pick()
    behaviour["http://slow"] = "ok"
    asyncio.run(polls(1))
    assert slow.up and slow.late_polls == 0 and slow.polled_load == 3
    behaviour["http://slow"] = "late"
    asyncio.run(polls(MISSED_POLLS - 1))
    assert slow.up  # the count starts again after an answer in time


def test_picker_leaves_unhealthy_servers_out_while_a_healthy_one_is_up():
    a, b = Server("http://a", "decode"), Server("http://b", "decode")
    p = Picker([a, b])
    assert p.pick("user").url == "http://a"
    a.healthy = False  # its /health answered 503: the salt moves, ties and prefixes do not bring it back
    assert p.pick("user").url == "http://b" and p.pick(hits={"http://a": 64, "http://b": 0}).url == "http://b"
    b.up = False  # the unhealthy one is all there is: it gets the request (a step that succeeds heals it)
    assert p.pick("user").url == "http://a"
    a.up = False
    with pytest.raises(NoServer):
        p.pick()


def test_prefix_index_follows_events_and_rehashes_prompts():
    """Pages stored (MLA group) on any medium count until removed from every medium; the prompt is hashed
    with each server's page size and the salt; the indexer group and cleared servers hold nothing."""
    prompt = list(range(100, 140))  # 5 pages of 8
    plain, salted = block_hashes(prompt, 8), block_hashes(prompt, 8, ("alice",))

    def stored(hashes, medium="GPU", group=0, page=8):
        return BlockStored(list(hashes), None, [], page, None, medium, None, group_idx=group)

    idx = PrefixIndex()
    idx.apply("a", KVEventBatch(0.0, [stored(plain[:3]), stored(plain[3:], group=1)]))
    idx.apply("b", KVEventBatch(0.0, [stored(plain[:2], "CPU"), stored(salted)]))
    assert idx.hits(prompt) == {"a": 24, "b": 16}
    assert idx.hits(prompt, "alice") == {"a": 0, "b": 40}
    assert idx.hits(prompt[:7]) == {"a": 0, "b": 0}  # no full page
    idx.apply("a", KVEventBatch(0.0, [stored(plain[:1], "CPU"), BlockRemoved(plain[:1], "GPU")]))
    assert idx.hits(prompt)["a"] == 24  # still on the host
    idx.apply("a", KVEventBatch(0.0, [BlockRemoved(plain[:1], "CPU")]))
    assert idx.hits(prompt)["a"] == 0 and idx.pages("a") == 2  # the chain breaks at its first page
    idx.apply("b", KVEventBatch(0.0, [AllBlocksCleared()]))
    assert idx.hits(prompt, "alice")["b"] == 0 and idx.pages("b") == 0
    servers = [Server("a", "decode"), Server("b", "decode")]
    p = Picker(servers)
    servers[0].polled_load = 9
    assert p.pick(hits={"a": 24, "b": 0}).url == "a"  # the longest prefix beats load
    assert p.pick(hits={"a": 0, "b": 0}).url == "b"  # none: load decides


def test_parse_load_sums_running_and_waiting():
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            '# TYPE vllm:other gauge\nvllm:other 7.0\n')
    assert parse_load(text) == 6.0


class Router:
    def __init__(self, tmp, prefill: list[str], decode: list[str], events: dict[str, str]):
        self.port = free_port()
        self.log = tmp / "router.log"
        args = [sys.executable, "-m", "glm53.router", "--port", str(self.port), "--poll-interval", "0.5",
                "--prefill", *prefill, "--decode", *decode,
                *(["--kv-events", *[f"{u}={e}" for u, e in events.items()]] if events else [])]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"router did not come up: {self.log.read_text()[-2000:]}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, body, raw: bytes | None = None, headers: dict | None = None, path: str = "/v1/completions"):
        """-> (status, JSON); `headers`: filled with the answer's headers."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        conn.request("POST", path, raw if raw is not None else json.dumps(body),
                     {"content-type": "application/json"})
        r = conn.getresponse()
        out = r.status, json.loads(r.read())
        if headers is not None:
            headers.update((k.lower(), v) for k, v in r.getheaders())
        conn.close()
        return out

    def health(self) -> dict:
        """The /health body, also when it is a 503 (a role has no server up)."""
        try:
            return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10).read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def stream(self, body: dict, on_event=None, path: str = "/v1/completions"):
        """-> (decode server the stream started on, parsed events); on_event(i, event) after each."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        first, events = r.getheader("x-decode-server"), []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if on_event:
                    on_event(len(events), events[-1])
        conn.close()
        return first, events


@contextlib.contextmanager
def servers_and_router(tmp, model: str, flags: dict, prefill: list[str], decode: list[str], events: dict | None = None,
                       module: str = "glm53.serve"):
    """Start a server of `model` (a preset or a checkpoint directory) per entry of `flags` (name -> extra
    flags), at once, as `module`, and a router over the `prefill` and `decode` names (events: name ->
    KV-event port) -> (router, {name: server}); every process stops on exit."""
    procs: dict = {}
    failed: dict = {}

    def start(name):
        try:
            procs[name] = Process(model, tmp, *flags[name], module=module)
        except Exception as e:  # noqa: BLE001 - reported below, with the server's log
            failed[name] = e

    threads = [threading.Thread(target=start, args=(n,)) for n in flags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if failed:
            raise RuntimeError("servers did not start: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
        router = Router(tmp, [procs[n].url("") for n in prefill], [procs[n].url("") for n in decode],
                        {procs[n].url(""): f"tcp://127.0.0.1:{port}" for n, port in (events or {}).items()})
        yield router, procs
        router.proc.send_signal(signal.SIGTERM)
        router.proc.wait(30)
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def pd(tmp_path_factory, serving_model):
    """One prefill and two decode servers (the servers' weights as a checkpoint with a chat template,
    served by tests.glm53.faulty_serve under test_serve's deployment; the decode servers publish KV events)
    and a router that follows them."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(serving_model, ckpt)
    events = {name: free_port() for name in ("decode0", "decode1")}
    flags = {"prefill": ()} | {n: ("--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                                     "endpoint": f"tcp://*:{port}"}))
                               for n, port in events.items()}
    with servers_and_router(tmp_path_factory.mktemp("pd"), str(ckpt), flags, ["prefill"], ["decode0", "decode1"],
                            events, module="tests.glm53.faulty_serve") as pair:
        yield pair


@pytest.fixture(scope="module")
def api(pd):
    """The shared openai-client cases' view of the router."""
    return Api(pd[0].url(""), NAME, "router", None, FLAGS["max_model_len"])


@pytest.fixture(scope="module")
def ref_engine(serving_model):
    """One engine on the servers' weights and deployment: the tokens a request must get."""
    return Engine(serving_model, DeployConfig(**FLAGS))


@pytest.fixture(scope="module")
def reference(ref_engine):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 30, 17)]
    lengths = (6, 6, 90)
    outs = [ref_engine.generate([np.asarray(p)], max_new_tokens=n)[0].token_ids.tolist()
            for p, n in zip(prompts, lengths)]
    return prompts, lengths, outs


def test_two_legs_give_one_engines_greedy_tokens(pd, reference):
    router, _ = pd
    prompts, lengths, want = reference
    code, r = router.post({"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == want[0]
    code, r = router.post({"prompt": [prompts[1]], "max_tokens": 6, "temperature": 0})
    assert code == 200 and "token_ids" not in r["choices"][0] and r["usage"]["completion_tokens"] == 6
    first, events = router.stream({"prompt": prompts[1], "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                                   "cache_salt": "alice", "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    assert [c["choices"][0]["token_ids"][0] for c in events[:-2]] == want[1]
    again, _ = router.stream({"prompt": prompts[0], "max_tokens": 2, "temperature": 0, "cache_salt": "alice"})
    assert again == first  # a user's requests stay on one decode server


def test_a_prompt_goes_where_its_prefix_is(pd, reference):
    """Without a salt, the decode leg of a prompt that extends an earlier one goes to the server whose KV
    events said it holds that prefix, although load alone (a tie) would pick the other one."""
    router, _ = pd
    prompts, _, _ = reference
    headers: dict = {}
    base = prompts[1]  # 30 tokens: 3 full pages of 8
    assert router.post({"prompt": base, "max_tokens": 2, "temperature": 0}, headers=headers)[0] == 200
    holder = headers["x-decode-server"]
    deadline = time.monotonic() + 60
    while router.health()["indexed_pages"][holder] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert router.health()["indexed_pages"][holder] >= 3
    for extra in ([7, 8, 9], [1, 2, 3, 4, 5]):  # the holder was picked last: a tie would go to the other
        headers.clear()
        assert router.post({"prompt": base + extra, "max_tokens": 2, "temperature": 0}, headers=headers)[0] == 200
        assert headers["x-decode-server"] == holder


def test_bad_requests_and_prefill_errors(pd):
    router, _ = pd
    code, r = router.post(None, raw=b"{not json")
    assert code == 400 and "not JSON" in r["error"]["message"]
    code, r = router.post({"prompt": [[1, 2], [3]], "max_tokens": 2})
    assert code == 400 and "one prompt per request" in r["error"]["message"]
    code, r = router.post({"prompt": list(range(200)), "max_tokens": 2})  # over max_model_len: the prefill's 400
    assert code == 400 and "max_model_len" in json.dumps(r)


def test_chat_goes_in_two_legs_and_gives_one_engines_tokens(pd, ref_engine):
    router, procs = pd
    messages = [{"role": "user", "content": "hello there"}]
    ids = httpx.post(router.url("/tokenize"), json={"messages": messages}, timeout=60).json()["tokens"]
    want = ref_engine.generate([np.asarray(ids)], max_new_tokens=6)[0].token_ids.tolist()
    client = openai.OpenAI(base_url=router.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want and r.usage.prompt_tokens == len(ids)
    text = httpx.post(router.url("/detokenize"), json={"tokens": want}, timeout=60).json()["prompt"]
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=6,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text


def test_a_servers_error_answer_is_the_answer_and_the_server_stays_up(pd):
    """A decode leg's 400 (min_tokens over max_tokens passes the 1-token prefill leg) and a prefill leg's 500
    (its step failed), whole and streamed: each is the client's answer with the server's JSON body; no
    server is marked down and nothing is sent again."""
    router, procs = pd
    before = router.health()
    for stream in (False, True):
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "min_tokens": 5, "stream": stream}
        code, r = router.post(body)
        assert code == 400 and r["error"]["param"] == "min_tokens", r
        code, r = router.post({"prompt": FAULT_PROMPT, "max_tokens": 2, "stream": stream})
        assert code == 500 and r["error"]["code"] == 500 and "injected" in r["error"]["message"], r
    after = router.health()
    assert after["resends"] == before["resends"] and after["decode"] == before["decode"]
    assert after["prefill"] == before["prefill"] == [procs["prefill"].url("")]


def test_metrics_carry_every_servers_series_under_a_server_label(pd):
    from prometheus_client.parser import text_string_to_metric_families

    router, procs = pd
    assert router.post({"prompt": [4, 5, 6], "max_tokens": 2, "temperature": 0})[0] == 200
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(router.url("/metrics"), timeout=60).text)}
    urls = {p.url("") for p in procs.values()}
    success = [s for s in fams["vllm:request_success"].samples if s.name == "vllm:request_success_total"]
    assert {s.labels["server"] for s in success} == urls and fams["vllm:request_success"].type == "counter"
    # the router's sum of a counter is the servers' own figures added up (no request runs meanwhile)
    own = 0.0
    for p in procs.values():
        for f in text_string_to_metric_families(httpx.get(p.url("/metrics"), timeout=60).text):
            own += sum(s.value for s in f.samples if s.name == "vllm:generation_tokens_total")
    routed = sum(s.value for s in fams["vllm:generation_tokens"].samples if s.name == "vllm:generation_tokens_total")
    assert routed == own > 0
    assert {s.labels["server"]: s.value for s in fams["glm53:router_server_up"].samples} == dict.fromkeys(urls, 1.0)
    assert fams["vllm:e2e_request_latency_seconds"].type == "histogram"


def test_a_prompt_with_ids_no_engine_can_hash_is_the_servers_400(pd):
    """Once the router knows the decode servers' pages (KV events), a prompt of at least one full page is
    hashed for the prefix lookup, unless an id lies outside [0, 2^63): then the request goes on
    unhashed, and the server's 400 naming the prompt is the answer (not a 500 of the router's)."""
    router, procs = pd
    assert router.post({"prompt": list(range(40, 60)), "max_tokens": 2, "temperature": 0})[0] == 200
    deadline = time.monotonic() + 60
    while not any(router.health()["indexed_pages"].values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(router.health()["indexed_pages"].values())
    for bad in ([2**63] + [1] * 8, [1] * 8 + [2**64 + 5], [-1] * 9):
        code, r = router.post({"prompt": bad, "max_tokens": 2, "temperature": 0})
        assert code == 400 and r["error"]["param"] == "prompt", (bad, r)
    assert router.post({"prompt": list(range(40, 60)), "max_tokens": 2, "temperature": 0})[0] == 200


def test_a_server_answering_503_is_left_out_of_routing_until_healthy(pd):
    """A decode server whose last steps all failed answers /health with 503: the router (polling /health
    with /metrics) sends the requests of a salt that stuck to it to the other decode server; once a
    step of its own succeeds its /health is 200 and it is routed to again."""
    router, procs = pd
    first, _ = router.stream({"prompt": [3, 1, 4], "max_tokens": 1, "temperature": 0, "cache_salt": "carol"})
    victim = next(p for p in procs.values() if p.url("") == first)
    other = next(p.url("") for n, p in procs.items() if n.startswith("decode") and p.url("") != first)
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):  # straight to it: its prefill leg must fail there
        assert victim.post("/v1/completions", {"prompt": FAULT_PROMPT, "max_tokens": 2})[0] == 500
    assert httpx.get(victim.url("/health"), timeout=30).status_code == 503

    def wait_for(cond):
        deadline = time.monotonic() + 30
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.1)
        return cond()

    assert wait_for(lambda: router.health()["unhealthy"] == [first])
    for _ in range(3):
        headers: dict = {}
        code, _ = router.post({"prompt": [3, 1, 4], "max_tokens": 2, "temperature": 0, "cache_salt": "carol"},
                              headers=headers)
        assert code == 200 and headers["x-decode-server"] == other
    assert victim.post("/v1/completions", {"prompt": [2, 7], "max_tokens": 1})[0] == 200  # a step succeeds
    assert wait_for(lambda: router.health()["unhealthy"] == [])


def test_a_decode_server_killed_mid_stream_loses_no_request(pd, reference, ref_engine):
    """Kill the decode server a 90-token greedy completion stream and a 100-token chat stream run on once
    both have two events: the router sends each prompt's token ids and the tokens so far, as a
    completion, to the other one, and each client's stream carries exactly one engine's tokens (the chat
    stream in chat chunks)."""
    router, procs = pd
    prompts, lengths, want = reference
    by_url = {p.url(""): p for p in procs.values()}
    messages = [{"role": "user", "content": "tell me"}]
    chat_ids = httpx.post(router.url("/tokenize"), json={"messages": messages}, timeout=60).json()["tokens"]
    want_chat = ref_engine.generate([np.asarray(chat_ids)], max_new_tokens=100)[0].token_ids.tolist()
    # learn which server the salt lands on, so the kill hits the streams' server
    first, _ = router.stream({"prompt": prompts[0], "max_tokens": 1, "temperature": 0, "cache_salt": "bob"})
    victim = by_url[first]
    reached = [threading.Event(), threading.Event()]
    killed = threading.Event()

    def hold_at_two(k):
        def on_event(i, event):
            if i == 2:  # wait (not reading further) until the server is gone
                reached[k].set()
                killed.wait(60)
        return on_event

    out = {}
    streams = [threading.Thread(target=lambda: out.__setitem__(0, router.stream(
                   {"prompt": prompts[2], "max_tokens": lengths[2], "temperature": 0, "return_token_ids": True,
                    "cache_salt": "bob"}, hold_at_two(0)))),
               threading.Thread(target=lambda: out.__setitem__(1, router.stream(
                   {"messages": messages, "max_completion_tokens": 100, "temperature": 0, "return_token_ids": True,
                    "cache_salt": "bob", "model": NAME}, hold_at_two(1), path="/v1/chat/completions")))]
    for t in streams:
        t.start()
    assert all(e.wait(TIMEOUT_S) for e in reached)
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.proc.wait(30) == -signal.SIGKILL
    killed.set()
    for t in streams:
        t.join(TIMEOUT_S)
    (served, events), (chat_served, chat_events) = out[0], out[1]
    assert served == chat_served == first
    assert events[-1] == "[DONE]" and chat_events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert tokens == want[2]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    chat = [e for e in chat_events[:-1] if e["choices"]]
    assert all(e["object"] == "chat.completion.chunk" and "delta" in e["choices"][0] for e in chat)
    assert [t for e in chat for t in e["choices"][0].get("token_ids") or []] == want_chat
    text = httpx.post(router.url("/detokenize"), json={"tokens": want_chat}, timeout=60).json()["prompt"]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chat) == text
    assert chat[-1]["choices"][0]["finish_reason"] == "length"
    # the survivor takes new requests; /health lists only what is up
    code, r = router.post({"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == want[0]
    health = router.health()
    assert health["decode"] == [u for u in by_url if u != first and procs["prefill"].url("") != u]
    assert health["resends"] >= 2  # both streams did break (not finished before the kill) and were re-sent

