"""A router in front of prefill and decode servers, speaking vLLM's disaggregated-serving protocol.

    python -m glm53.router --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        http://127.0.0.1:8201

Each of --prefill / --decode takes one or more base URLs and may be repeated. Endpoints: GET /health
(200 while at least one prefill and one decode server answer and report themselves healthy, else 503; the
body lists the servers up, those of them unhealthy, and counts `resends`, requests sent again after a
server broke them, and `prefill_fallbacks`); POST /v1/completions
and POST /v1/chat/completions (streamed or not, in two legs); GET /v1/models, GET /v1/models/{id}, POST
/tokenize, POST /detokenize and GET /version, forwarded to one server that is up; GET /metrics, every
server's metrics with a `server` label (sum over it for the deployment) and the router's own
(`glm53:router_*`). The client's Authorization header goes on to the servers (they check --api-key).
Errors have the servers' shape (glm53.protocol.error_body).

A completion (one prompt per request) or chat completion goes in two legs, as vLLM's proxy sends them:
1. to a prefill server, with `max_tokens: 1` (chat: `max_completion_tokens: 1` too), `stream: false` and
   `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false, ...}`. A server's answer,
   whatever its status, is the request's answer: a 4xx / 5xx goes back to the client as it is, and the
   server stays up; only a server that cannot be reached is marked down and the next one tried. With none
   up (a prefill server restarting) the leg is skipped (`prefill_fallbacks`) and the decode server computes
   the prompt, as an aggregated server would; a text prompt's or a chat's token ids then come from a
   decode server's /tokenize;
2. to a decode server, the client's request with the `kv_transfer_params` the prefill answered (with
   the PdConnector, where to fetch the prompt's KV from; a server without a KV connector answers none:
   the decode server then prefills the prompt itself, vLLM's "recompute"), streamed back chunk by chunk.
   A decode server takes KV only from the producers its `kv_connector_extra_config["producers"]` lists:
   list there the KV address (`kv_ip:kv_port`) of every --prefill server (README "P/D"); an answer naming
   another is refused with a 400, which the router passes on.

Where a leg goes (`Picker`): a request with a `cache_salt` (a user) goes back to the server its salt
went to last while that server is up; otherwise to the server that holds the longest prefix of the
prompt, if any does; otherwise to the server with the least load, ties in turn; among the servers
that are healthy, while any of the role is (a server whose /health answers 503 is left out, and gets
requests again only when no other can take them: its engine stopped, or its last steps all failed and
only a step that succeeds can make it healthy again). Prefixes come from the
servers' KV events (`--kv-events URL=ENDPOINT`, a server's base URL and the ZMQ endpoint of its
`--kv-events-config`, e.g. http://127.0.0.1:8200=tcp://127.0.0.1:5557): `PrefixIndex` follows which MLA
pages each server holds on any medium (device or host) and re-hashes the prompt's token ids with the
server's page size and the request's salt, as the engine chains them (kvcache.block_pool). The prefill
leg knows the token ids when the prompt is given as ids (and looks them up only when every id is one an
engine could hash, in [0, 2^63); any other prompt goes on, for the server to refuse); the decode leg
always does (the prefill leg returns them). Load is the running + waiting requests each server's /metrics
reported at the last poll (every --poll-interval seconds) plus the requests this router sent it since;
the same poll reads its /health. A server whose poll fails is down until a poll succeeds (one that only
answers late, MISSED_POLLS polls in a row); one that answers 503 (its /health, or a request) is unhealthy
until its /health answers 200.

A decode server that dies does not lose the request: before any token the request is sent again to
another decode server; mid-stream the router sends the prompt's token ids followed by the tokens already
streamed, as a completion with the remaining max_tokens, to another one and carries on with the same
stream (a chat stream gets that completion's chunks as chat chunks; the decode legs ask for
`return_token_ids`; the router removes them unless the client asked). Under greedy
decoding the client sees exactly the tokens one server would have produced; with sampling the
continuation draws fresh randomness; a stop string that straddles the break is not seen by the second
server (its text starts at the break).

Not built yet: a replay of missed event batches (a subscriber that joins late or drops a batch knows less
than the server holds: it routes worse, never wrongly).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import threading
import uuid

import httpx
import msgspec
import zmq
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from glm53.protocol import error_body, error_response, install_error_answers, parse_body
from kvcache.block_pool import block_hashes
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, decoder

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
ID_LIMIT = 1 << 63  # token ids hash as int64 (kvcache.block_pool.hash_block)


class NoServer(RuntimeError):
    """No server of the role is up (or every one was tried)."""


@dataclasses.dataclass
class Server:
    url: str
    role: str  # "prefill" or "decode"
    up: bool = True  # it answered a recent poll (and no request since found it unreachable)
    late_polls: int = 0  # polls in a row it did not answer in time (MISSED_POLLS of them: down)
    healthy: bool = True  # its /health answered 200 at the last poll (and no request since got a 503)
    polled_load: float = 0.0  # running + waiting at the last poll
    sent: int = 0  # requests this router sent since that poll
    last_pick: int = -1  # when it was last picked (ties go to the one picked longest ago)

    @property
    def load(self) -> float:
        return self.polled_load + self.sent


# salts the router remembers the server of (LRU): each entry is a client-chosen string
MAX_STICKY_SALTS = 1 << 16


class Picker:
    """Which server of a role gets a request, among those up and healthy (those up, if none is healthy):
    the salt's server while it is among them, else the one holding the longest prefix, else the least
    loaded, ties to the one picked longest ago (in turn). Pure bookkeeping (no I/O), so it is tested on
    its own."""

    def __init__(self, servers: list[Server]):
        if not servers:
            raise ValueError("Picker needs at least one server")
        self.servers = servers
        # salt -> its server, least recently picked first; bounded (MAX_STICKY_SALTS) because clients name
        # the salts: a salt forgotten is routed as a new one, never an error
        self.sticky: collections.OrderedDict[str, Server] = collections.OrderedDict()
        self._turn = itertools.count()

    def pick(self, salt: str | None = None, exclude: set[str] | frozenset = frozenset(),
             hits: dict[str, int] | None = None) -> Server:
        """hits: prefix tokens each server holds for this request (`PrefixIndex.hits`), or None."""
        up = [s for s in self.servers if s.up and s.url not in exclude]
        if not up:
            raise NoServer(f"no {self.servers[0].role} server is up"
                           + (f" (tried {', '.join(sorted(exclude))})" if exclude else ""))
        up = [s for s in up if s.healthy] or up
        best = max((hits or {}).get(s.url, 0) for s in up)
        if salt and salt in self.sticky and self.sticky[salt] in up:
            chosen = self.sticky[salt]
        elif best > 0:
            chosen = min((s for s in up if hits.get(s.url, 0) == best), key=lambda s: (s.load, s.last_pick))
        else:
            chosen = min(up, key=lambda s: (s.load, s.last_pick))
        if salt:
            self.sticky[salt] = chosen
            self.sticky.move_to_end(salt)
            if len(self.sticky) > MAX_STICKY_SALTS:
                self.sticky.popitem(last=False)
        chosen.sent += 1
        chosen.last_pick = next(self._turn)
        return chosen


class PrefixIndex:
    """Which MLA pages (by chain hash) each server holds, from its KV events; thread-safe.

    `apply(url, batch)` folds one decoded KVEventBatch in: BlockStored of group 0 (MLA rows) adds its
    hashes on its medium and records the server's page size, BlockRemoved takes them off that medium,
    AllBlocksCleared forgets the server's pages. `hits(token_ids, salt)` -> {url: prefix tokens held}:
    the prompt's full pages hashed with each server's page size and the salt (vLLM's extra_keys), and
    the longest run of them from the start that the server holds on any medium."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, dict[bytes, set[str]]] = {}
        self._page: dict[str, int] = {}
        self.bad = 0  # batches that did not decode (skipped)

    def apply(self, url: str, batch) -> None:
        with self._lock:
            held = self._held.setdefault(url, {})
            for ev in batch.events:
                if isinstance(ev, AllBlocksCleared):
                    held.clear()
                elif getattr(ev, "group_idx", 0) not in (0, None):
                    continue
                elif isinstance(ev, BlockStored):
                    self._page[url] = ev.block_size
                    for h in ev.block_hashes:
                        held.setdefault(_key(h), set()).add(ev.medium or "GPU")
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        media = held.get(_key(h))
                        if media is not None:
                            media.discard(ev.medium or "GPU")
                            if not media:
                                del held[_key(h)]

    def pages(self, url: str) -> int:
        with self._lock:
            return len(self._held.get(url, {}))

    def hits(self, token_ids, salt: str | None = None) -> dict[str, int]:
        with self._lock:
            servers = [(u, self._page[u], set(self._held.get(u, {}))) for u in self._page]
        out = {}
        for url, page, held in servers:
            n = 0
            for h in block_hashes(token_ids, page, (salt,) if salt else ()):
                if _key(h) not in held:
                    break
                n += 1
            out[url] = n * page
        return out


def _key(h) -> bytes:
    """A wire hash as bytes (vLLM allows an int: the digest's last 8 bytes; we publish the digest)."""
    return h if isinstance(h, bytes) else int(h).to_bytes(8, "big")


def subscribe(index: PrefixIndex, url: str, endpoint: str, stop: threading.Event) -> threading.Thread:
    """A thread that follows `endpoint`'s KV event batches (ZMQ SUB, every topic) into `index` for
    `url` until `stop` is set. A batch it cannot decode is skipped (and counted in `index.bad`)."""
    def run():
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        dec = decoder()
        try:
            while not stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    index.apply(url, dec.decode(frames[-1]))
                except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
                    index.bad += 1
        finally:
            sock.close()

    t = threading.Thread(target=run, name=f"kv-events {url}", daemon=True)
    t.start()
    return t


def parse_load(text: str) -> float:
    """Running + waiting requests from a server's /metrics text (summed over label sets)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in LOAD_METRICS:
                total += s.value
    return total


def _answer(r: httpx.Response) -> dict:
    """A server's answer as JSON; a body that is not JSON (a proxy's page, say) becomes the error shape
    with the answer's status. Either way it is the request's answer, not a sign the server is down."""
    try:
        return r.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_body(r.status_code, f"the server answered {r.status_code}: {r.text[:500]}")


# the fields of a request that carry over to the completion that continues a broken stream elsewhere: the
# sampling rules that do not depend on which tokens are output (the penalties would count the tokens already
# out as prompt, so a continued stream samples without them; docs/engine.md)
CONTINUE_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "logit_bias", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "cache_salt", "stream_options", "user")


@dataclasses.dataclass
class RouterState:
    """What the router's handlers share (app.state.router)."""

    pre: Picker
    dec: Picker
    index: PrefixIndex
    events: dict[str, str]  # server base URL -> ZMQ endpoint of its KV events
    poll_interval_s: float
    timeout_s: float
    client: httpx.AsyncClient | None = None
    resends: int = 0  # requests sent again after a server broke them
    prefill_fallbacks: int = 0  # requests a decode server prefilled: no prefill server was up

    @property
    def everyone(self) -> list[Server]:
        return self.pre.servers + self.dec.servers

    def hits(self, token_ids, salt):
        """Prefix tokens each server holds (PrefixIndex.hits), or None: no KV events, no token ids, or ids
        an engine could not hash (the request goes on, and its server answers what is wrong with it)."""
        if not (self.events and token_ids and all(type(t) is int and 0 <= t < ID_LIMIT for t in token_ids)):
            return None
        return self.index.hits(token_ids, salt if isinstance(salt, str) else None)


def _state(raw: Request) -> RouterState:
    return raw.app.state.router


def _auth(raw: Request) -> dict:
    """The client's credentials, passed on to the servers (they check --api-key, the router does not)."""
    key = raw.headers.get("authorization")
    return {"authorization": key} if key else {}


# polls in a row a server may answer late before it is down: a server busy with a long step (or on
# cores it shares) answers slowly but is not gone; a refused connection or a bad answer is down at once
MISSED_POLLS = 3


async def poll(st: RouterState) -> None:
    """One poll of every server: its /health (healthy: 200) and its load from /metrics (up: both answered;
    a server whose engine stopped still serves /metrics, so /health is what tells). A server that does
    not answer within the poll's timeout keeps its state until MISSED_POLLS polls in a row were late."""
    async def one(s: Server):
        timeout = max(st.poll_interval_s, 1.0)
        try:
            health, metrics = await asyncio.gather(st.client.get(s.url + "/health", timeout=timeout),
                                                   st.client.get(s.url + "/metrics", timeout=timeout))
            metrics.raise_for_status()
            s.polled_load, s.sent, s.up, s.healthy = parse_load(metrics.text), 0, True, health.status_code == 200
            s.late_polls = 0
        except httpx.TimeoutException:
            s.late_polls += 1
            s.up = s.up and s.late_polls < MISSED_POLLS
        except (httpx.HTTPError, ValueError):
            s.up = False

    await asyncio.gather(*(one(s) for s in st.everyone))


async def _poll_forever(st: RouterState) -> None:
    while True:
        await poll(st)
        await asyncio.sleep(st.poll_interval_s)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    st: RouterState = app.state.router
    st.client = httpx.AsyncClient(timeout=httpx.Timeout(st.timeout_s, connect=5.0))
    poller = asyncio.ensure_future(_poll_forever(st))
    stop = threading.Event()
    threads = [subscribe(st.index, url, endpoint, stop) for url, endpoint in st.events.items()]
    try:
        yield
    finally:
        poller.cancel()
        stop.set()
        for t in threads:
            t.join(2)
        await st.client.aclose()


# ------------------------------------------------------------------------------------------- routes
routes = APIRouter()


@routes.get("/health")
async def health(raw: Request):
    st = _state(raw)
    body = {role: [s.url for s in p.servers if s.up] for role, p in (("prefill", st.pre), ("decode", st.dec))}
    ok = all(any(s.up and s.healthy for s in p.servers) for p in (st.pre, st.dec))
    body["unhealthy"] = [s.url for s in st.everyone if s.up and not s.healthy]
    body["resends"] = st.resends
    body["prefill_fallbacks"] = st.prefill_fallbacks
    body["indexed_pages"] = {url: st.index.pages(url) for url in st.events}  # MLA pages known from KV events
    return JSONResponse(body, status_code=200 if ok else 503)


@routes.get("/metrics")
async def metrics(raw: Request):
    """Every server's /metrics in one exposition, each sample with a `server` label (its base URL), so a
    sum over that label is the deployment's figure; plus the router's own counters. A server that does
    not answer is left out."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

    st = _state(raw)

    async def fetch(s: Server) -> str | None:
        try:
            r = await st.client.get(s.url + "/metrics", timeout=10.0)
            return r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    texts = await asyncio.gather(*(fetch(s) for s in st.everyone))
    families: dict[str, Metric] = {}
    for s, text in zip(st.everyone, texts):
        for fam in text_string_to_metric_families(text or ""):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples += [x._replace(labels={**x.labels, "server": s.url}) for x in fam.samples]
    up = GaugeMetricFamily("glm53:router_server_up", "1 while the router counts the server as up.",
                           labels=["server", "role"])
    healthy = GaugeMetricFamily("glm53:router_server_healthy", "1 while the server's /health answered 200 "
                                "(the router prefers healthy servers).", labels=["server", "role"])
    for s in st.everyone:
        up.add_metric([s.url, s.role], float(s.up))
        healthy.add_metric([s.url, s.role], float(s.up and s.healthy))
    own = [up, healthy, CounterMetricFamily("glm53:router_resends", "Requests sent again after a server broke them.",
                                   value=st.resends),
           CounterMetricFamily("glm53:router_prefill_fallbacks", "Requests a decode server prefilled because no "
                               "prefill server was up.", value=st.prefill_fallbacks)]

    class Collect:
        def collect(self):
            yield from families.values()
            yield from own

    registry = CollectorRegistry()
    registry.register(Collect())
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(raw: Request):
    return await _forward(raw, "GET", "/v1/models")


@routes.get("/v1/models/{model_id:path}")
async def model(model_id: str, raw: Request):
    return await _forward(raw, "GET", f"/v1/models/{model_id}")


@routes.get("/version")
async def version(raw: Request):
    return await _forward(raw, "GET", "/version")


@routes.post("/tokenize")
async def tokenize(raw: Request):
    return await _forward(raw, "POST", "/tokenize", await raw.body())


@routes.post("/detokenize")
async def detokenize(raw: Request):
    return await _forward(raw, "POST", "/detokenize", await raw.body())


@routes.post("/v1/completions")
async def completions(raw: Request):
    return await _two_legs(raw, chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(raw: Request):
    return await _two_legs(raw, chat=True)


# ----------------------------------------------------------------------------------------- forwarding
async def _forward(raw: Request, method: str, path: str, content: bytes | None = None) -> Response:
    """A request every server answers alike (models, tokenizer, version): to the first decode server that
    is up (a prefill server if none is), its answer as it is."""
    st = _state(raw)
    headers = {**_auth(raw), "content-type": raw.headers.get("content-type", "application/json")}
    for s in st.dec.servers + st.pre.servers:
        if not s.up:
            continue
        try:
            r = await st.client.request(method, s.url + path, content=content, headers=headers)
        except httpx.TransportError:
            s.up = False
            continue
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
    return error_response(503, "no server is up")


async def _post(st: RouterState, picker: Picker, path: str, body: dict, salt, hits=None, headers=None):
    """POST to servers of the picker's role until one answers -> (server, status, JSON). Any answer counts,
    4xx and 5xx included; only a server that cannot be reached is marked down and skipped. One that answers
    503 is unhealthy until its /health says otherwise (its answer is still the request's)."""
    tried: set[str] = set()
    while True:
        s = picker.pick(salt, tried, hits)
        try:
            r = await st.client.post(s.url + path, json=body, headers=headers)
        except httpx.TransportError:
            s.up = False
            tried.add(s.url)
            st.resends += 1
            continue
        if r.status_code == 503:
            s.healthy = False
        return s, r.status_code, _answer(r)


async def _tokenize(st: RouterState, body: dict, chat: bool, headers: dict) -> tuple[int, dict]:
    """A decode server's /tokenize of the request's prompt (its messages, for a chat) -> (status, JSON)."""
    if chat:
        req = {"messages": body.get("messages"), "add_generation_prompt": body.get("add_generation_prompt", True),
               "add_special_tokens": body.get("add_special_tokens", False), "tools": body.get("tools"),
               "chat_template_kwargs": body.get("chat_template_kwargs")}
    else:
        req = {"prompt": body.get("prompt"), "add_special_tokens": body.get("add_special_tokens", True)}
    _, status, answer = await _post(st, st.dec, "/tokenize", req, None, headers=headers)
    return status, answer


async def _two_legs(raw: Request, chat: bool):
    """A completion (chat: a chat completion) as vLLM's proxy sends it: the prefill leg, then the decode
    leg with the prefill's kv_transfer_params (see the module docstring)."""
    st = _state(raw)
    body = parse_body(await raw.body())  # the servers' rules: NaN, infinities and lone surrogates are a 400
    path = "/v1/chat/completions" if chat else "/v1/completions"
    ids = None
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return error_response(400, "the router takes one prompt per request", "prompt")
            prompt = body["prompt"] = prompt[0]
        ids = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
    salt, headers = body.get("cache_salt"), _auth(raw)
    salt = salt if isinstance(salt, str) else None  # any other is the server's 400 to answer; not a routing key
    # the prefill leg computes the prompt once for all n choices, and answers nothing a client reads
    first = {**body, "max_tokens": 1, "min_tokens": 0, "stream": False, "stream_options": None,
             "return_token_ids": True, "kv_transfer_params": dict(PREFILL_PARAMS), "n": 1, "echo": False,
             "logprobs": False if chat else None, "top_logprobs": None}
    if chat:
        first["max_completion_tokens"] = 1
    try:
        try:
            p, status, answer = await _post(st, st.pre, path, first, salt, st.hits(ids, salt), headers)
        except NoServer:
            # no prefill server is up (restarting, say): the decode server computes the prompt, as an
            # aggregated server would, so no request is lost meanwhile; its token ids (for a stream that
            # breaks) come from a decode server's /tokenize unless the prompt is token ids
            p = None
            if ids is None:
                status, answer = await _tokenize(st, body, chat, headers)
                if status == 200:
                    ids = answer["tokens"]
            if ids is not None:
                st.prefill_fallbacks += 1
                status, answer = 200, {"choices": [{"prompt_token_ids": ids}]}
        if status != 200:
            return JSONResponse(answer, status_code=status)
        prompt_ids = answer["choices"][0]["prompt_token_ids"]
        leg = {**body, "kv_transfer_params": answer.get("kv_transfer_params"), "return_token_ids": True}
        routed = {"x-prefill-server": p.url if p is not None else "none"}
        if not body.get("stream"):
            d, status, out = await _post(st, st.dec, path, leg, salt, st.hits(prompt_ids, salt), headers)
            if status == 200 and not body.get("return_token_ids"):
                for c in out.get("choices", []):
                    c.pop("token_ids", None)
                    c.pop("prompt_token_ids", None)
            return JSONResponse(out, status_code=status, headers={**routed, "x-decode-server": d.url})
    except NoServer as e:
        return error_response(503, str(e))
    return await _stream(st, body, leg, prompt_ids, salt, routed, chat, headers)


def _as_chat_chunk(chunk: dict) -> dict:
    """A completion chunk (from the completion that continues a broken chat stream) as a chat chunk."""
    chunk["object"] = "chat.completion.chunk"
    for c in chunk.get("choices", []):
        text = c.pop("text", "")
        c["delta"] = {"content": text} if text else {}
    return chunk


async def _stream(st: RouterState, body: dict, leg: dict, prompt_ids: list[int], salt, routed: dict, chat: bool,
                  headers: dict):
    """Open the first decode stream here (its errors become the answer's status), then carry it on,
    re-sending after the tokens so far to another decode server when one breaks: a completion of the
    prompt's token ids and those tokens, whose chunks a chat stream receives as chat chunks."""
    client = st.client
    want_ids = bool(body.get("return_token_ids"))
    limit = (body.get("max_completion_tokens") or body.get("max_tokens")) if chat else body.get("max_tokens", 16)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    tried: set[str] = set()

    async def open_leg(got: list[int]):
        while True:
            s = st.dec.pick(salt, tried, st.hits(prompt_ids + got, salt))
            if not got:
                url, part = s.url + path, leg
            else:
                url = s.url + "/v1/completions"
                part = {**{k: body[k] for k in CONTINUE_FIELDS if k in body}, "prompt": prompt_ids + got,
                        "max_tokens": limit - len(got) if limit is not None else None, "stream": True,
                        "min_tokens": max(0, int(body.get("min_tokens") or 0) - len(got)), "return_token_ids": True}
            try:
                r = await client.send(client.build_request("POST", url, json=part, headers=headers), stream=True)
                return s, r
            except httpx.TransportError:
                s.up = False
                tried.add(s.url)

    try:
        s, r = await open_leg([])
    except NoServer as e:
        return error_response(503, str(e))
    if r.status_code != 200:
        if r.status_code == 503:
            s.healthy = False
        content = await r.aread()
        await r.aclose()
        return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type"))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

    async def chunks():
        nonlocal s, r
        got: list[int] = []
        while True:
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        yield "data: [DONE]\n\n"
                        return
                    chunk = json.loads(line[6:])
                    if chat and chunk.get("object") == "text_completion":
                        chunk = _as_chat_chunk(chunk)
                    chunk["id"] = rid
                    for c in chunk.get("choices", []):
                        got.extend(c.get("token_ids") or [])
                        if not want_ids:
                            c.pop("token_ids", None)
                    if chunk.get("usage"):  # counted over both legs' outputs, against the client's prompt
                        chunk["usage"].update(prompt_tokens=len(prompt_ids), completion_tokens=len(got),
                                              total_tokens=len(prompt_ids) + len(got))
                    yield "data: " + json.dumps(chunk) + "\n\n"
            except (httpx.TransportError, httpx.StreamError):
                pass
            finally:
                await r.aclose()
            s.up = False  # it broke the stream (or closed it without [DONE]): send the rest elsewhere
            tried.add(s.url)
            st.resends += 1
            try:
                s, r = await open_leg(got)
            except NoServer as e:
                yield "data: " + json.dumps(error_body(503, str(e))) + "\n\n"
                return
            if r.status_code != 200:
                answer = _answer(httpx.Response(r.status_code, content=await r.aread()))
                yield "data: " + json.dumps(answer) + "\n\n"
                return

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={**routed, "x-decode-server": s.url})


def build_app(prefill: list[str], decode: list[str], *, poll_interval_s: float = 1.0,
              timeout_s: float = 600.0, kv_events: dict[str, str] | None = None) -> FastAPI:
    """The router's app (handlers: the module's `routes`, over `RouterState` in app.state.router).
    kv_events: {server base URL: ZMQ endpoint of its KV events} (servers left out route by load)."""
    pre = Picker([Server(u.rstrip("/"), "prefill") for u in prefill])
    dec = Picker([Server(u.rstrip("/"), "decode") for u in decode])
    events = {u.rstrip("/"): e for u, e in (kv_events or {}).items()}
    unknown = set(events) - {s.url for s in pre.servers + dec.servers}
    if unknown:
        raise ValueError(f"--kv-events names servers that are neither --prefill nor --decode: {sorted(unknown)}")
    app = FastAPI(lifespan=_lifespan)
    app.state.router = RouterState(pre, dec, PrefixIndex(), events, poll_interval_s, timeout_s)
    app.include_router(routes)
    install_error_answers(app)
    return app


def main(argv=None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m glm53.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL")
    ap.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL")
    ap.add_argument("--kv-events", nargs="+", action="extend", default=[], metavar="URL=ENDPOINT",
                    help="a server's base URL and the ZMQ endpoint of its KV events (prefix-aware routing)")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="seconds between /metrics polls")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a leg may take")
    args = ap.parse_args(argv)
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            ap.error(f"{url!r} is not an http(s) URL")
    events = {}
    for pair in args.kv_events:
        url, sep, endpoint = pair.partition("=")
        if not sep or not endpoint.startswith(("tcp://", "ipc://")):
            ap.error(f"--kv-events takes URL=ENDPOINT (e.g. http://127.0.0.1:8200=tcp://127.0.0.1:5557), got {pair!r}")
        events[url] = endpoint
    try:
        app = build_app(args.prefill, args.decode, poll_interval_s=args.poll_interval, timeout_s=args.timeout,
                        kv_events=events)
    except ValueError as e:
        ap.error(str(e))
    print(f"router on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
