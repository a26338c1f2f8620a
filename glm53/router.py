"""A router in front of prefill and decode servers, speaking vLLM's disaggregated-serving protocol.

    python -m glm53.router --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        http://127.0.0.1:8201

Each of --prefill / --decode takes one or more base URLs and may be repeated. Endpoints: GET /health
(200 while at least one prefill and one decode server answer, else 503; the body lists them and counts
`resends`, requests sent again after a server broke them), POST
/v1/completions (streamed or not).

A completion (one prompt per request) goes in two legs, as vLLM's proxy sends them:
1. to a prefill server, with `max_tokens: 1`, `stream: false` and `kv_transfer_params:
   {"do_remote_decode": true, "do_remote_prefill": false, ...}`; an error answer (4xx / 5xx) goes back to
   the client as it is; a server that cannot be reached is marked down and the next one is tried;
2. to a decode server, the client's request with the `kv_transfer_params` the prefill answered (a
   server without a KV connector answers none: the decode server then prefills the prompt itself,
   vLLM's "recompute"), streamed back chunk by chunk.

Where a leg goes (`Picker`): a request with a `cache_salt` (a user) goes back to the server its salt
went to last while that server is up; otherwise to the server with the least load, ties in turn. Load
is the running + waiting requests each server's /metrics reported at the last poll (every
--poll-interval seconds) plus the requests this router sent it since. A server whose poll fails is down
until a poll succeeds.

A decode server that dies does not lose the request: before any token the request is sent again to
another decode server; mid-stream the router sends the prompt's token ids followed by the tokens already
streamed, with the remaining max_tokens, to another one and carries on with the same stream (the decode
legs ask for `return_token_ids`; the router removes them unless the client asked). Under greedy
decoding the client sees exactly the tokens one server would have produced; with sampling the
continuation draws fresh randomness; a stop string that straddles the break is not seen by the second
server (its text starts at the break).

Not built yet (the P/D issue): prefix-aware routing from the engines' KV events; the KV connector
itself (the prefill server keeping the request's KV under a lease for the decode server to pull).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class NoServer(RuntimeError):
    """No server of the role is up (or every one was tried)."""


@dataclasses.dataclass
class Server:
    url: str
    role: str  # "prefill" or "decode"
    up: bool = True
    polled_load: float = 0.0  # running + waiting at the last poll
    sent: int = 0  # requests this router sent since that poll
    last_pick: int = -1  # when it was last picked (ties go to the one picked longest ago)

    @property
    def load(self) -> float:
        return self.polled_load + self.sent


class Picker:
    """Which server of a role gets a request: the salt's server while it is up, else the least loaded,
    ties to the one picked longest ago (in turn). Pure bookkeeping (no I/O), so it is tested on its own."""

    def __init__(self, servers: list[Server]):
        if not servers:
            raise ValueError("Picker needs at least one server")
        self.servers = servers
        self.sticky: dict[str, Server] = {}
        self._turn = itertools.count()

    def pick(self, salt: str | None = None, exclude: set[str] | frozenset = frozenset()) -> Server:
        up = [s for s in self.servers if s.up and s.url not in exclude]
        if not up:
            raise NoServer(f"no {self.servers[0].role} server is up"
                           + (f" (tried {', '.join(sorted(exclude))})" if exclude else ""))
        if salt and salt in self.sticky and self.sticky[salt] in up:
            chosen = self.sticky[salt]
        else:
            chosen = min(up, key=lambda s: (s.load, s.last_pick))
        if salt:
            self.sticky[salt] = chosen
        chosen.sent += 1
        chosen.last_pick = next(self._turn)
        return chosen


def parse_load(text: str) -> float:
    """Running + waiting requests from a server's /metrics text (summed over label sets)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in LOAD_METRICS:
                total += s.value
    return total


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error", "code": status}}, status_code=status)


def build_app(prefill: list[str], decode: list[str], *, poll_interval_s: float = 1.0,
              timeout_s: float = 600.0) -> FastAPI:
    pre = Picker([Server(u.rstrip("/"), "prefill") for u in prefill])
    dec = Picker([Server(u.rstrip("/"), "decode") for u in decode])
    everyone = pre.servers + dec.servers
    state: dict = {"resends": 0}

    async def poll_forever():
        client = state["client"]
        while True:
            async def one(s: Server):
                try:
                    r = await client.get(s.url + "/metrics", timeout=max(poll_interval_s, 1.0))
                    r.raise_for_status()
                    s.polled_load, s.sent, s.up = parse_load(r.text), 0, True
                except (httpx.HTTPError, ValueError):
                    s.up = False

            await asyncio.gather(*(one(s) for s in everyone))
            await asyncio.sleep(poll_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        poller = asyncio.ensure_future(poll_forever())
        try:
            yield
        finally:
            poller.cancel()
            await state["client"].aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        body = {role: [s.url for s in p.servers if s.up] for role, p in (("prefill", pre), ("decode", dec))}
        ok = all(body.values())
        body["resends"] = state["resends"]  # requests sent again after a server broke them
        return JSONResponse(body, status_code=200 if ok else 503)

    async def post_json(picker: Picker, body: dict, salt):
        """POST to servers of the picker's role until one answers -> (server, status, JSON)."""
        tried: set[str] = set()
        while True:
            s = picker.pick(salt, tried)
            try:
                r = await state["client"].post(s.url + "/v1/completions", json=body)
                return s, r.status_code, r.json()
            except (httpx.TransportError, json.JSONDecodeError):
                s.up = False
                tried.add(s.url)
                state["resends"] += 1

    @app.post("/v1/completions")
    async def completions(raw: Request):
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return _error(400, "prompt: the router takes one prompt per request")
            prompt = body["prompt"] = prompt[0]
        salt = body.get("cache_salt")
        try:
            first = {**body, "max_tokens": 1, "min_tokens": 0, "stream": False, "stream_options": None,
                     "return_token_ids": True, "kv_transfer_params": dict(PREFILL_PARAMS)}
            _, status, answer = await post_json(pre, first, salt)
            if status != 200:
                return JSONResponse(answer, status_code=status)
            prompt_ids = answer["choices"][0]["prompt_token_ids"]
            leg = {**body, "kv_transfer_params": answer.get("kv_transfer_params"), "return_token_ids": True}
            if not body.get("stream"):
                _, status, out = await post_json(dec, leg, salt)
                if status == 200 and not body.get("return_token_ids"):
                    for c in out.get("choices", []):
                        c.pop("token_ids", None)
                        c.pop("prompt_token_ids", None)
                return JSONResponse(out, status_code=status)
        except NoServer as e:
            return _error(503, str(e))
        return await stream(body, leg, prompt_ids, salt)

    async def stream(body: dict, leg: dict, prompt_ids: list[int], salt):
        """Open the first decode stream here (its errors become the answer's status), then carry it on,
        re-sending after the tokens so far to another decode server when one breaks."""
        client = state["client"]
        want_ids = bool(body.get("return_token_ids"))
        limit = body.get("max_tokens") or 16
        tried: set[str] = set()

        async def open_leg(got: list[int]):
            while True:
                s = dec.pick(salt, tried)
                part = leg if not got else {**leg, "prompt": prompt_ids + got, "max_tokens": limit - len(got),
                                            "min_tokens": max(0, int(body.get("min_tokens") or 0) - len(got)),
                                            "kv_transfer_params": None}
                try:
                    req = client.build_request("POST", s.url + "/v1/completions", json=part)
                    r = await client.send(req, stream=True)
                    return s, r
                except httpx.TransportError:
                    s.up = False
                    tried.add(s.url)

        try:
            s, r = await open_leg([])
        except NoServer as e:
            return _error(503, str(e))
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        rid = f"cmpl-{uuid.uuid4().hex}"

        async def events():
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
                        chunk["id"] = rid
                        for c in chunk.get("choices", []):
                            got.extend(c.get("token_ids", []))
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
                state["resends"] += 1
                try:
                    s, r = await open_leg(got)
                except NoServer as e:
                    yield "data: " + json.dumps({"error": {"message": str(e), "code": 503}}) + "\n\n"
                    return
                if r.status_code != 200:
                    detail = (await r.aread()).decode(errors="replace")
                    yield "data: " + json.dumps({"error": {"message": detail, "code": r.status_code}}) + "\n\n"
                    return

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-decode-server": s.url})

    app.state.pickers = (pre, dec)
    return app


def main(argv=None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m glm53.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL")
    ap.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="seconds between /metrics polls")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a leg may take")
    args = ap.parse_args(argv)
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            ap.error(f"{url!r} is not an http(s) URL")
    app = build_app(args.prefill, args.decode, poll_interval_s=args.poll_interval, timeout_s=args.timeout)
    print(f"router on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
