"""An OpenAI-compatible server with vLLM's flags and metrics.

    python -m glm53.serve tiny --port 8000 --max-model-len 4096           # a preset's random weights
    python -m glm53.serve /path/to/hf_checkpoint --kv-policy offload --cpu-offload-bytes 8589934592
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}'

Flags: `--host`, `--port`, `--served-model-name` (default: the model argument as given), `--seed` (a
preset's random weights, as `glm53.init(preset, seed)`), `--dtype`, `--quantization fp8` (a checkpoint's fp8
block-quantised weights kept in fp8), and one flag per `DeployConfig`
field in vLLM's spelling (`--max-model-len`, `--max-num-seqs`, `--max-num-batched-tokens`,
`--block-size`, `--kv-cache-dtype`, `--enable-prefix-caching` / `--no-enable-prefix-caching`,
`--prefill-context-parallel-size`, `--decode-context-parallel-size`, `--dcp-comm-backend`,
`--enable-expert-parallel`, `--data-parallel-size`, `--tensor-parallel-size`, JSON `--kv-transfer-config`
and `--kv-events-config`, and the project's own: `--kv-policy`, `--cpu-offload-bytes`,
`--hisparse-host-pool-bytes`, ...). A flag left out takes DeployConfig's default; a HiSparse server
without `--hisparse-host-pool-bytes` gets a host pool for max_num_seqs requests of max_model_len. On CPU
the server simulates the devices its parallel sizes need.

Endpoints:
- POST /v1/completions: `prompt` as text (the checkpoint's tokenizer.json; the byte tokenizer for
  presets), token ids, or a batch of either (one choice per prompt); `max_tokens` (16), `temperature`
  (0 = greedy), `top_p`, `seed`, `stop` (strings: the text ends before the first one), vLLM's
  `stop_token_ids`, `ignore_eos`, `min_tokens`, `cache_salt`, `return_token_ids`; `stream` sends
  server-sent events, one chunk per token, `data: [DONE]` last (`stream_options.include_usage` adds a
  usage chunk). `usage.prompt_tokens_details.cached_tokens` counts prompt tokens served from a cache.
  A checkpoint's EOS ends generation unless `ignore_eos`; presets have none.
- POST /v1/chat/completions: when the checkpoint ships a chat template (rendered with jinja2 as HF
  does); otherwise 400.
- GET /v1/models, GET /health, GET /metrics (glm53.engine.prometheus: vLLM's names), POST
  /reset_prefix_cache (vLLM's development endpoint: forget every cached prefix, between benchmark runs).

Bad requests (wrong types, unknown model, a prompt over max_model_len, token ids outside the vocabulary)
get HTTP 400 with an OpenAI-style error naming the field. A client that disconnects aborts its request
(its blocks are freed at the next step boundary). SIGTERM stops accepting requests, lets running ones
finish for up to --shutdown-timeout seconds, aborts the rest and shuts the engine down (uvicorn then
re-raises the signal, so the exit status is that of SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from glm53.engine.config import DeployConfig

# a P/D producer answers once the prompt's pages are in its peer tier, or after this many seconds with
# what is there (the consumer computes the rest)
PD_STORE_WAIT_S = 30.0

# ------------------------------------------------------------------------------------------- flags
_RESERVED = {"host", "port", "served_model_name", "seed", "dtype", "quantization", "shutdown_timeout",
             "warmup"}


def _flag_type(annotation: str):
    if "dict" in annotation:
        return json.loads
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m glm53.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint directory (HF layout) or a preset name (tiny, mid, glm-5.3)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (vLLM listens on every interface "
                    "by default; pass --host 0.0.0.0 for that)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    ap.add_argument("--seed", type=int, default=0, help="random weights of a preset (glm53.init(preset, seed))")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights' dtype")
    ap.add_argument("--quantization", default=None, choices=("fp8",),
                    help="fp8: keep a block-quantised fp8 checkpoint's weights in fp8 (vLLM's --quantization fp8; "
                         "glm53.from_pretrained(quantization='fp8')); default: dequantise them to --dtype on load")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds running requests may finish after SIGTERM before they are aborted")
    ap.add_argument("--warmup", action="store_true",
                    help="compile every bucket shape before serving (as vLLM captures its CUDA graphs at start), so "
                         "no request waits for a compilation; minutes on CPU with large limits")
    for f in dataclasses.fields(DeployConfig):
        if f.name in _RESERVED:
            raise AssertionError(f"DeployConfig.{f.name} clashes with a server flag")
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        resolved = ", resolved for the model and machine" if default is None else ""
        help_ = f"DeployConfig.{f.name} (default: {default!r}{resolved})"
        if f.type == "bool":
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            ap.add_argument(flag, type=_flag_type(f.type), default=None, metavar=f.name.upper(), help=help_)
    return ap


def deploy_from_args(args: argparse.Namespace, cfg, dtype: str) -> DeployConfig:
    """The DeployConfig the flags name (flags left out keep DeployConfig's defaults). HiSparse without
    --hisparse-host-pool-bytes: a host pool for max_num_seqs requests of max_model_len. The PdConnector
    without cpu_bytes_to_use or --cpu-offload-bytes: a host tier of the same size (every group's pages)."""
    from kvcache.layout import page_bytes

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(DeployConfig)
             if getattr(args, f.name) is not None}
    ktc = given.get("kv_transfer_config")
    pd_default = (isinstance(ktc, dict) and ktc.get("kv_connector") == "PdConnector" and "cpu_offload_bytes" not in given
                  and "cpu_bytes_to_use" not in (ktc.get("kv_connector_extra_config") or {}))
    if (given.get("kv_policy") == "hisparse" and "hisparse_host_pool_bytes" not in given) or pd_default:
        base = {k: v for k, v in given.items() if k != "kv_transfer_config"}
        d = DeployConfig(**{**base, "kv_policy": "preempt"}).resolved(cfg, dtype)
        kv_dtype = dtype if d.kv_cache_dtype == "auto" else d.kv_cache_dtype
        pages = page_bytes(cfg, kv_dtype, d.block_size, d.index_block_size, dcp=d.decode_context_parallel_size,
                           include_mtp=bool(d.num_speculative_tokens))
        if given.get("kv_policy") == "hisparse" and "hisparse_host_pool_bytes" not in given:
            given["hisparse_host_pool_bytes"] = d.max_num_seqs * d.max_blocks_per_seq * pages["mla"]
        if pd_default:
            given["cpu_offload_bytes"] = d.max_num_seqs * d.max_blocks_per_seq * sum(pages.values())
    return DeployConfig(**given)


# ---------------------------------------------------------------------------------- request shapes
class CompletionRequest(BaseModel):
    """OpenAI's completions request with vLLM's extras; unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    return_token_ids: bool = False
    n: int = Field(default=1, ge=1, le=1)
    logprobs: int | None = None
    echo: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's P/D fields (the PdConnector; see `pd_leg`)


class ChatRequest(CompletionRequest):
    prompt: None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _error(message: str, param: str | None, status: int = 400) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _param_of(message: str) -> str:
    """The request field an engine ValueError is about."""
    if "stop_token_ids" in message:
        return "stop_token_ids"
    if "min_tokens" in message:
        return "min_tokens"
    if "max_model_len" in message or "max_new_tokens" in message:
        return "max_tokens"
    return "prompt"


# -------------------------------------------------------------------------------------- detokenizing
class TextStream:
    """One choice's text as its tokens arrive: `add(token) -> (delta, stopped)`, `flush() -> delta`.
    EOS tokens add no text; a stop string ends the text before it (stopped=True); text that could still
    become a stop string, or an incomplete UTF-8 character (U+FFFD at the end), is held back until the
    next token or the flush, so the deltas always add up to the final text."""

    def __init__(self, tokenizer, stop: list[str], eos: tuple[int, ...]):
        self.tok, self.stop, self.eos = tokenizer, [s for s in stop if s], set(eos)
        self.ids: list[int] = []
        self.text = ""  # sent so far
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def _full(self) -> str:
        return self.tok.decode(self.ids)

    def add(self, token: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if token not in self.eos:
            self.ids.append(token)
        full = self._full()
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._send(full[:cut]), True
        safe = len(full) - self.hold
        while safe > len(self.text) and full[safe - 1] == "\ufffd":
            safe -= 1
        return self._send(full[:max(safe, len(self.text))]), False

    def flush(self) -> str:
        return "" if self.stopped else self._send(self._full())

    def _send(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text = upto
        return delta


# ------------------------------------------------------------------------------------------- the app
def create_app(engine, tokenizer, served_model_name: str, *, metrics=None) -> FastAPI:
    """The FastAPI app over a started `glm53.engine.async_engine.AsyncEngine`; the app's shutdown (after
    uvicorn's graceful wait) aborts what still runs and shuts the engine down."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()
        print("glm53.serve: engine shut down", flush=True)

    app = FastAPI(title="glm53", version="0.1.0", lifespan=lifespan)
    max_model_len = engine.engine.deploy.max_model_len
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        field = loc[0] if loc else None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}"
                        for e in exc.errors())
        return _error(msg or "invalid request", field)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return _error(str(exc), exc.param, exc.status)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return _error(f"engine stopped: {engine.error!r}", None, 503)
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's (development) endpoint: forget every cached prefix, e.g. between benchmark runs."""
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "glm53", "root": served_model_name,
                                            "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(metrics.text() if metrics is not None else "", media_type=CONTENT_TYPE_LATEST)

    def check_model(body: CompletionRequest) -> None:
        if body.model is not None and body.model != served_model_name:
            raise BadRequest(f"The model `{body.model}` does not exist (this server serves `{served_model_name}`).",
                             "model")
        if body.logprobs is not None:
            raise BadRequest("logprobs are not supported", "logprobs")
        if body.echo:
            raise BadRequest("echo is not supported", "echo")

    def prompts_of(body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            return [tokenizer.encode(p)]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return [tokenizer.encode(x) if isinstance(x, str) else list(x) for x in p]

    def sampling(body: CompletionRequest, max_tokens: int, i: int):
        from glm53.engine.request import SamplingParams

        stops = tuple(body.stop_token_ids or ()) + (() if body.ignore_eos else tuple(tokenizer.eos_token_ids))
        seed = body.seed + i if body.seed is not None else random.getrandbits(31)
        try:
            return SamplingParams(max_tokens, greedy=body.temperature == 0, temperature=body.temperature or 1.0,
                                  top_p=body.top_p, seed=seed, stop_token_ids=tuple(dict.fromkeys(stops)),
                                  min_tokens=body.min_tokens)
        except ValueError as e:
            raise BadRequest(str(e), _param_of(str(e))) from None

    async def start(body: CompletionRequest, prompts: list[list[int]], max_tokens: int | None,
                    kv_peer: str | None = None, kv_lease: int = 0) -> list:
        handles = []
        try:
            for i, ids in enumerate(prompts):
                n = max_tokens if max_tokens is not None else max(1, max_model_len - len(ids))
                handles.append(await engine.add(ids, sampling(body, n, i), salt=body.cache_salt or "",
                                                kv_peer=kv_peer, kv_lease=kv_lease))
        except ValueError as e:
            for h in handles:
                engine.abort_nowait(h.req_id)
            raise BadRequest(str(e), _param_of(str(e))) from None
        return handles

    def stops_of(body: CompletionRequest) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    def usage(handles, prompts) -> dict:
        done = [engine.finished_request(h.req_id) for h in handles]
        out = sum(len(r.output_ids) for r in done)
        n_prompt = sum(len(p) for p in prompts)
        return {"prompt_tokens": n_prompt, "completion_tokens": out, "total_tokens": n_prompt + out,
                "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in done)}}

    role = engine.engine.deploy.kv_role

    def pd_leg(body: CompletionRequest, prompts) -> tuple[bool, str | None, int]:
        """What a request's kv_transfer_params ask of this server -> (produce: answer with the params a
        consumer needs, kv_peer: the producer to take the prompt's KV from, kv_lease: its lease on that
        KV, 0 if none). Without the PdConnector in
        the matching role both are ignored (the prompt is computed here, as by an aggregated server)."""
        ktp = body.kv_transfer_params or {}
        produce = bool(ktp.get("do_remote_decode")) and role in ("kv_producer", "kv_both")
        if produce and (body.stream or len(prompts) != 1):
            raise BadRequest("kv_transfer_params.do_remote_decode takes one prompt and stream false (the prefill "
                             "leg of a P/D pair)", "kv_transfer_params")
        if not (ktp.get("do_remote_prefill") and role in ("kv_consumer", "kv_both")):
            return produce, None, 0
        host, port = ktp.get("remote_host"), ktp.get("remote_port")
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
                or not 1 <= port <= 65535:
            raise BadRequest(f"kv_transfer_params.do_remote_prefill needs remote_host (an address) and remote_port "
                             f"(1-65535), got {host!r} and {port!r}", "kv_transfer_params")
        lease = ktp.get("remote_lease", 0)  # optional: without it the producer's lease lapses at its expiry
        if isinstance(lease, bool) or not isinstance(lease, int) or not 0 <= lease < 1 << 63:
            raise BadRequest(f"kv_transfer_params.remote_lease must be the producer's lease id (an integer >= 0), "
                             f"got {lease!r}", "kv_transfer_params")
        return produce, f"{host}:{port}", lease

    async def produced(req_id: str) -> dict:
        """The P/D producer's answer for finished `req_id`, once its prompt's pages are parked in the
        PdConnector's peer tier (the parking runs in the engine's next plan and the tier stores
        asynchronously) or PD_STORE_WAIT_S have passed: where to fetch them, and how many leading prompt
        tokens it holds, leased for DeployConfig.pd_lease_s."""
        eng = engine.engine
        r = eng.replica_of(req_id)
        tier = eng.pd_tier(r)
        tpb, blocks = eng.prompt_chunk_keys(req_id)
        keys = [k for b in blocks for _, k in b]
        deadline = time.monotonic() + PD_STORE_WAIT_S
        held = None
        while time.monotonic() < deadline and engine.error is None:
            if eng.parked(req_id) and (held := tier.held_prefix(keys)) is not None:
                break
            await asyncio.sleep(0.005)
        held = tier.held_prefix(keys) or 0  # a store still in flight at the deadline: what is there
        n, total = 0, 0  # hash blocks whose every page is held
        for b in blocks:
            total += len(b)
            if total > held:
                break
            n += 1
        lease = tier.lease(keys[:held], eng.deploy.pd_lease_s)
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": f"{served_model_name}@{tier.address}",
                "remote_host": tier.host, "remote_port": tier.port, "remote_num_tokens": n * tpb,
                "remote_lease": lease, "remote_lease_s": eng.deploy.pd_lease_s}

    async def run(raw: Request, body: CompletionRequest, prompts, max_tokens, chat: bool):
        produce, kv_peer, kv_lease = pd_leg(body, prompts)
        handles = await start(body, prompts, max_tokens, kv_peer, kv_lease)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        texts = [TextStream(tokenizer, stops_of(body), tokenizer.eos_token_ids) for _ in handles]
        if body.stream:
            return StreamingResponse(_stream(raw, body, handles, prompts, texts, rid, chat),
                                     media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(handles, texts))
        while not collect.done():
            await asyncio.wait({collect}, timeout=0.2)
            if not collect.done() and await raw.is_disconnected():
                collect.cancel()
                for h in handles:
                    engine.abort_nowait(h.req_id)
                return Response(status_code=499)
        results = collect.result()
        if engine.error is not None:
            raise BadRequest(f"the engine stopped: {engine.error!r}", None, 500)
        choices = []
        for i, (h, (tokens, text, reason)) in enumerate(zip(handles, results)):
            c = {"index": i, "finish_reason": reason, "logprobs": None}
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            if body.return_token_ids:
                c["token_ids"] = tokens
                c["prompt_token_ids"] = prompts[i]
            choices.append(c)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": served_model_name, "choices": choices, "usage": usage(handles, prompts)}
        if produce:
            out["kv_transfer_params"] = await produced(handles[0].req_id)
        return out

    async def _collect(handles, texts):
        async def one(h, t):
            tokens, text, reason = [], "", None
            async for tok, fin in h:
                tokens.append(tok)
                delta, stopped = t.add(tok)
                text += delta
                if stopped:
                    engine.abort_nowait(h.req_id)
                    return tokens, text, "stop"
            text += t.flush()
            reason = "abort" if h.aborted else engine.finished_request(h.req_id).finish_reason
            return tokens, text, reason

        return await asyncio.gather(*(one(h, t) for h, t in zip(handles, texts)))

    async def _stream(raw, body, handles, prompts, texts, rid, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            async for tok, fin in h:
                await merged.put((i, tok, fin))
            await merged.put((i, None, True))

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        live, finished = set(range(len(handles))), set()

        def chunk(i, text=None, tok=None, reason=None, role=False):
            c: dict = {"index": i, "finish_reason": reason, "logprobs": None}
            if chat:
                c["delta"] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            else:
                c["text"] = text or ""
            if body.return_token_ids and tok is not None:
                c["token_ids"] = [tok]
            return "data: " + json.dumps({"id": rid, "object": kind, "created": int(time.time()),
                                          "model": served_model_name, "choices": [c]}) + "\n\n"

        try:
            if chat:
                for i in range(len(handles)):
                    yield chunk(i, role=True)
            while live:
                i, tok, fin = await merged.get()
                if i not in live:
                    continue
                if tok is None:  # its stream ended without a finishing token: aborted
                    live.discard(i)
                    yield chunk(i, texts[i].flush(), reason="abort")
                    continue
                delta, stopped = texts[i].add(tok)
                if stopped:
                    engine.abort_nowait(handles[i].req_id)
                    live.discard(i)
                    yield chunk(i, delta, tok, "stop")
                    continue
                if fin:
                    live.discard(i)
                    finished.add(i)
                    delta += texts[i].flush()
                    reason = engine.finished_request(handles[i].req_id).finish_reason
                    yield chunk(i, delta, tok, reason)
                else:
                    yield chunk(i, delta, tok)
            if (body.stream_options or {}).get("include_usage"):
                yield "data: " + json.dumps({"id": rid, "object": kind, "created": int(time.time()),
                                             "model": served_model_name, "choices": [],
                                             "usage": usage(handles, prompts)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): abort what still runs
            for p in pumps:
                p.cancel()
            for i in live:
                engine.abort_nowait(handles[i].req_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body)
        return await run(raw, body, prompts_of(body), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, raw: Request):
        check_model(body)
        from glm53.tokenizer import render_chat

        try:
            text = render_chat(tokenizer, body.messages)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - a template error is the request's messages' fault
            raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await run(raw, body, [tokenizer.encode(text)], max_tokens, chat=True)

    return app


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    name = args.served_model_name or args.model
    # on CPU, simulate the devices the parallel sizes need (before JAX creates its backend)
    dp = args.data_parallel_size or 1
    n = max((args.tensor_parallel_size or 1) * (args.prefill_context_parallel_size or 1),
            args.decode_context_parallel_size or 1)  # DeployConfig.devices_per_replica
    if dp * n > 1 and os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
        from parallel.mesh import set_cpu_device_count

        set_cpu_device_count(dp * n)
    import uvicorn

    import glm53
    from glm53.config import PRESETS
    from glm53.engine.async_engine import AsyncEngine
    from glm53.engine.prometheus import ServingMetrics
    from glm53.tokenizer import load_tokenizer

    if args.model in PRESETS:
        if args.quantization:
            raise SystemExit(f"glm53.serve: --quantization {args.quantization} needs a checkpoint directory, not the "
                             f"preset {args.model!r}")
        model = glm53.init(args.model, seed=args.seed, dtype=args.dtype)
    elif os.path.isdir(args.model):
        # over several devices the weights stay on the host until each device takes its shard (or copy)
        spread = any((getattr(args, f, None) or 1) > 1 for f in ("tensor_parallel_size", "data_parallel_size",
                                                                  "prefill_context_parallel_size",
                                                                  "decode_context_parallel_size"))
        model = glm53.from_pretrained(args.model, dtype=args.dtype, quantization=args.quantization, on_host=spread)
    else:
        raise SystemExit(f"glm53.serve: {args.model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                         "checkpoint directory")
    deploy = deploy_from_args(args, model.cfg, args.dtype)
    engine = glm53.Engine(model, deploy)
    metrics = ServingMetrics(engine, model_name=name)
    if args.warmup:
        t0 = time.perf_counter()
        shapes = sum(rep.runner.warmup() for rep in engine.replicas)
        print(f"glm53.serve: compiled {shapes} bucket shapes in {time.perf_counter() - t0:.0f} s", flush=True)
    async_engine = AsyncEngine(engine).start()
    app = create_app(async_engine, load_tokenizer(args.model), name, metrics=metrics)
    print(f"glm53.serve: {name} on http://{args.host}:{args.port} ({engine.deploy.max_model_len} tokens, "
          f"{engine.deploy.num_gpu_blocks} blocks, kv_policy {engine.deploy.kv_policy})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.shutdown_timeout)


if __name__ == "__main__":
    main()
