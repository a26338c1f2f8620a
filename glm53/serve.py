"""An OpenAI-compatible server with vLLM's flags and metrics.

    python -m glm53.serve tiny --port 8000 --max-model-len 4096           # a preset's random weights
    python -m glm53.serve /path/to/hf_checkpoint --kv-policy offload --cpu-offload-bytes 8589934592
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}'

Flags: `--host`, `--port`, `--served-model-name` (default: the model argument as given), `--api-key`
(default: $VLLM_API_KEY), the limits `--max-request-bytes`, `--max-prompts-per-request` and
`--max-waiting-requests`, `--shutdown-timeout`, `--seed` (a
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

Endpoints (request and response bodies: glm53.protocol, vLLM's models):
- POST /v1/completions: `prompt` as text (the checkpoint's tokenizer.json; the byte tokenizer for
  presets), token ids, or a batch of either (one choice per prompt); `max_tokens` (16), `temperature`
  (below 1e-5 = greedy), `top_p`, `seed` (any int64), `stop` (strings: the request finishes "stop" on the
  token that completes one, the text ends before it, `stop_reason` names it), vLLM's `stop_token_ids`,
  `ignore_eos`, `min_tokens`, `add_special_tokens`, `cache_salt`, `return_token_ids`; the sampler's `top_k`,
  `min_p`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`; `logprobs` (raw,
  vLLM's order; `return_tokens_as_token_ids`), `n` choices per prompt (one prefill), `echo`; `stream` sends
  server-sent events, one chunk per token, `data: [DONE]` last (`stream_options.include_usage` adds a
  usage chunk). `usage.prompt_tokens_details.cached_tokens` counts prompt tokens served from a cache.
  A checkpoint's EOS ends generation unless `ignore_eos`; presets have none.
- POST /v1/chat/completions: the messages under the chat template (--chat-template PATH, else the
  checkpoint's own, else the preset's glm53/templates/<preset>.jinja; rendered with jinja2 as HF does,
  text content parts joined; `chat_template_kwargs` reach it); `tools` and `tool_choice` as vLLM takes
  them, the output's calls parsed into `tool_calls` by --tool-call-parser (glm45, glm47) and its
  `<think>` into `reasoning_content` by --reasoning-parser (glm45), streamed too (glm53.parsers).
- GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /version (vLLM's schemas),
  GET /health, GET /metrics (glm53.engine.prometheus: vLLM's names), POST /reset_prefix_cache (vLLM's
  development endpoint: forget every cached prefix, between benchmark runs; routed only with
  VLLM_SERVER_DEV_MODE=1, as vLLM's, since it empties every user's cache).

Every answer other than 200 has one JSON body, {"error": {"message", "type", "param", "code"}}: 400 for a
bad request (naming the field: wrong types or ranges, a prompt over max_model_len, token ids outside the
vocabulary, a parameter this server does not apply set to anything but its neutral value), 401 without
the --api-key, 404 for an unknown model or route, 405, 413 for a body over --max-request-bytes, 500 when
the step that ran the request failed or its KV failed to load under kv_load_failure_policy "fail"
(streamed: finish_reason "error"), 503 once the engine has stopped, and 503 with Retry-After when
--max-waiting-requests are waiting or the server is shutting down.
No request stops the engine (glm53.engine.async_engine); /health is 503 while its last steps all failed.
A client that disconnects aborts its request (its blocks are freed at the next step boundary). SIGTERM
(`ServerState.drain`) stops admission at once (503 with Retry-After; /health 503), lets requests in flight
run for up to --shutdown-timeout seconds, then answers every remaining client from the event loop within
a second (streams: finish_reason "abort", usage, [DONE]; others: a JSON 503), whatever the engine thread
is doing, shuts the engine down if it stops within a second more, and re-raises the signal (the exit
status is that of SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import random
import re
import secrets
import signal
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from glm53.engine.config import DeployConfig
from glm53.engine.request import SEED_RANGE, RequestError
from glm53.engine.runner.compilation import memory_maps
from kvcache.tiers import PageSpans
from kvcache.tiers.p2p import peer_address
from glm53.protocol import (
    MAX_REQUEST_BYTES,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobContent,
    ChatLogprobs,
    ChatMessageOut,
    PromptLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    HTTPError,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
    VersionResponse,
    error_response,
    install_error_answers,
    new_id,
    parse_body,
    send_error,
    unapplied_field,
)
from glm53.parsers import REASONING_PARSERS, THINK_START, TOOL_PARSERS, ChatOutput
from glm53.tokenizer import TextStream, render_chat

# a P/D producer answers once the prompt's pages are in its peer tier, or after this many seconds with
# what is there (the consumer computes the rest)
PD_STORE_WAIT_S = 30.0
# temperatures below this sample greedily (vLLM's rule: dividing logits by ~0 overflows float32)
GREEDY_BELOW = 1e-5
# the limits' defaults (--max-prompts-per-request, --max-waiting-requests): each prompt of a batch is an
# engine request, and a queue without a bound turns a burst into unbounded memory and latency
MAX_PROMPTS_PER_REQUEST = 256
MAX_WAITING_REQUESTS = 1024
# the engine history a server keeps (Engine.max_finished, max_timeline): a finished request holds its
# prompt's ids (400 KB at 100k tokens), and a server runs for months
MAX_FINISHED_KEPT = 4096
MAX_TIMELINE_KEPT = 1 << 16
# Retry-After (seconds) on a 503 that a later try may not get: a full queue, a server shutting down
RETRY_AFTER_S = 1
# after --shutdown-timeout, the clients still waiting are answered within this many seconds
SHUTDOWN_ANSWER_S = 1.0
SHUTDOWN_FLUSH_S = 2.0  # after a drain: what the tiers' pending stores get before the process exits

# ------------------------------------------------------------------------------------------- flags
_RESERVED = {"host", "port", "served_model_name", "seed", "dtype", "quantization", "shutdown_timeout",
             "max_request_bytes", "max_prompts_per_request", "max_waiting_requests",
             "warmup", "api_key", "chat_template", "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser"}


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
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                    help="require `Authorization: Bearer KEY` on the /v1 routes, /tokenize, /detokenize and "
                         "/reset_prefix_cache (default: $VLLM_API_KEY; unset: no key)")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="after SIGTERM (new requests: 503 with Retry-After), seconds the requests in flight may "
                         "run; then each is answered within a second (streams: finish_reason \"abort\", usage, "
                         "[DONE]; others: 503) and the process exits (default: %(default)s)")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                    help="a request body over this many bytes is a 413 (default: %(default)s)")
    ap.add_argument("--max-prompts-per-request", type=int, default=MAX_PROMPTS_PER_REQUEST,
                    help="a /v1/completions batch of more prompts is a 400 naming `prompt` (default: %(default)s)")
    ap.add_argument("--max-waiting-requests", type=int, default=MAX_WAITING_REQUESTS,
                    help="a request that would make more than this many requests wait for the engine (added and "
                         "not running yet) is a 503 with Retry-After; one of more prompts than this, which no wait "
                         "would admit, a 400 naming `prompt` (default: %(default)s)")
    ap.add_argument("--chat-template", default=None, metavar="PATH",
                    help="a jinja2 chat template file for /v1/chat/completions (default: the checkpoint's own, else "
                         "the preset's glm53/templates/<preset>.jinja, GLM-5.3's conversation format)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='let the model decide when to call the request\'s tools (tool_choice "auto", the default when '
                         "tools are given); needs --tool-call-parser")
    ap.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                    help="turn the model's tool-call text into `tool_calls` (glm45 and glm47: GLM-4.5's family, "
                         "glm53.parsers); needed by every tool_choice but none")
    ap.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                    help="split the model's <think>...</think> into `reasoning_content` (glm45)")
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
        sized = {}
        if given.get("kv_policy") == "hisparse" and "hisparse_host_pool_bytes" not in given:
            sized["hisparse_host_pool_bytes"] = d.max_num_seqs * d.max_blocks_per_seq * pages["mla"]
        if pd_default:
            sized["cpu_offload_bytes"] = d.max_num_seqs * d.max_blocks_per_seq * sum(pages.values())
        have, ranks = host_memory_bytes(), d.data_parallel_size  # every DP rank allocates its own host pools
        if have and sum(sized.values()) * ranks > have:  # fail here, not by the OOM killer while allocating
            flags = " and ".join("--" + k.replace("_", "-") for k in sized)
            each = f" on each of {ranks} data-parallel ranks" if ranks > 1 else ""
            raise ValueError(f"the default host pools for {d.max_num_seqs} requests of {d.max_model_len} tokens{each} "
                             f"({', '.join(f'{k}={v:,}' for k, v in sized.items())} bytes) exceed this machine's "
                             f"{have:,} bytes of memory: give {flags}, or lower --max-model-len / --max-num-seqs")
        given.update(sized)
    return DeployConfig(**given)


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


# ------------------------------------------------------------------------------------------ the key
class ApiKey:
    """--api-key: the /v1 routes, /tokenize, /detokenize and /reset_prefix_cache answer 401 unless the
    request carries `Authorization: Bearer KEY` (vLLM's scheme); /health, /metrics and /version stay open
    (probes and scrapers hold no key). The key is compared in constant time."""

    GUARDED = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and (
                scope["path"] == "/v1" or scope["path"].startswith(self.GUARDED)):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                return await send_error(send, 401, "a valid API key is required (Authorization: Bearer KEY)")
        return await self.app(scope, receive, send)


# -------------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class ServerState:
    """What the handlers share (app.state.server): the engine, its tokenizer, the served name and the chat
    output's parsers (names in glm53.parsers' TOOL_PARSERS / REASONING_PARSERS, or None)."""

    engine: Any  # glm53.engine.async_engine.AsyncEngine, started
    tokenizer: Any
    served_model_name: str
    metrics: Any = None  # glm53.engine.prometheus.ServingMetrics
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST
    max_waiting_requests: int = MAX_WAITING_REQUESTS
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # the shutdown (`drain`): admission stopped; every client answered from here (set on the event loop)
    draining: bool = False
    ending: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    live: set = dataclasses.field(default_factory=set)  # handles of requests whose clients wait for them
    pending_adds: int = 0  # prompts admitted here and not yet queued in the engine (AsyncEngine.add)
    starting: int = 0  # requests admitted and not yet `live` (their adds on their way)

    def admit(self, n: int) -> None:
        """Admission of a request of `n` prompts, counted in `pending_adds` until each is added: a 503 with
        Retry-After once the shutdown began, or when the requests waiting for the engine (its queued adds
        and waiting queues, and the prompts admitted here not yet queued) would exceed
        max_waiting_requests; a 400 naming "prompt" for a request of more prompts than that, which no wait
        would admit."""
        if self.draining:
            raise HTTPError(503, "the server is shutting down", headers=_RETRY)
        if n > self.max_waiting_requests:  # could never be admitted: retrying would not help
            raise HTTPError(400, f"{n} prompts in one request exceed --max-waiting-requests "
                                 f"{self.max_waiting_requests}", "prompt")
        waiting = self.engine.num_waiting + self.pending_adds
        if waiting + n > self.max_waiting_requests:
            raise HTTPError(503, f"{waiting} requests are waiting for the engine, {n} more would exceed "
                                 f"--max-waiting-requests {self.max_waiting_requests}", headers=_RETRY)
        self.pending_adds += n

    async def drain(self, timeout_s: float) -> None:
        """The shutdown after SIGTERM (admission already stopped: `draining`): the requests in flight run
        for up to `timeout_s`; then every client still waiting is answered from here, not by the engine
        thread, which may be inside a long step (`RequestHandle.end_now`: a stream ends "abort", a
        non-streamed request is a 503), and this returns once they are (SHUTDOWN_ANSWER_S at most)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while (self.live or self.starting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.ending.set()  # adds still on their way answer 503 (`_add`)
        for handle in list(self.live):
            handle.end_now()
            self.engine.abort_nowait(handle.req_id)
        deadline = time.monotonic() + SHUTDOWN_ANSWER_S
        while (self.live or self.starting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    @property
    def deploy(self) -> DeployConfig:
        return self.engine.engine.deploy

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.cfg.vocab_size

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise HTTPError(404, f"The model `{model}` does not exist (this server serves "
                                 f"`{self.served_model_name}`).", "model")

    def check_tokens(self, ids: list[int], field: str) -> None:
        if ids and max(ids) >= self.vocab_size:
            raise HTTPError(400, f"token ids must lie in [0, {self.vocab_size}), got {max(ids)}", field)

    def card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, created=self.created, root=self.served_model_name,
                         max_model_len=self.deploy.max_model_len)


_RETRY = {"Retry-After": str(RETRY_AFTER_S)}


def _state(raw: Request) -> ServerState:
    return raw.app.state.server


async def _parse(raw: Request, model: type[BaseModel], kind: str | None = None, data: dict | None = None):
    """The request's JSON body (or `data`, read from it already by protocol.parse_body) as `model`: 400
    for what is not a JSON object or carries what the engine cannot take (NaN, lone surrogates), for a
    field of UNAPPLIED[kind] set to a value this server would ignore, and for any invalid field (named)."""
    if data is None:
        data = parse_body(await raw.body())
    if kind is not None and (bad := unapplied_field(kind, data)) is not None:
        raise HTTPError(400, bad[1], bad[0])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


# ------------------------------------------------------------------------------------------ routes
routes = APIRouter()


@routes.get("/health")
async def health(raw: Request):
    """200 while the engine serves and its last steps did not all fail (AsyncEngine.healthy), else 503;
    503 from SIGTERM on (a load balancer stops sending requests)."""
    st = _state(raw)
    if st.draining:
        return error_response(503, "the server is shutting down")
    if not st.engine.healthy:
        return error_response(503, st.engine.unhealthy_reason or "the engine is unhealthy")
    return Response(status_code=200)


@routes.get("/version")
async def version(raw: Request):
    return VersionResponse(version=_version()).model_dump()


@routes.get("/metrics")
async def prometheus(raw: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    st = _state(raw)
    return PlainTextResponse(st.metrics.text() if st.metrics is not None else "", media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(raw: Request):
    """vLLM's development endpoint: forget every cached prefix, e.g. between benchmark runs. Routed only
    with VLLM_SERVER_DEV_MODE=1, as vLLM's (`create_app`): any client could otherwise empty every other
    user's cache."""
    await _engine_call(_state(raw).engine.reset_prefix_cache())
    return Response(status_code=200)


@routes.get("/v1/models")
async def models(raw: Request):
    return ModelList(data=[_state(raw).card()]).model_dump()


@routes.get("/v1/models/{model_id:path}")
async def model(model_id: str, raw: Request):
    st = _state(raw)
    st.check_model(model_id)
    return st.card().model_dump()


@routes.post("/tokenize")
async def tokenize(raw: Request):
    """vLLM's /tokenize: a prompt (as /v1/completions encodes it) or messages (as /v1/chat/completions
    renders them) -> its token ids and count, beside max_model_len."""
    st = _state(raw)
    data = parse_body(await raw.body())
    is_chat = "messages" in data  # the two request shapes differ by this key (vLLM's union)
    body = await _parse(raw, TokenizeChatRequest if is_chat else TokenizeCompletionRequest, data=data)
    st.check_model(body.model)
    if is_chat:
        text = await _render(st, body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs)
        ids = await _encode(st, text, body.add_special_tokens)
    else:
        ids = await _encode(st, body.prompt, body.add_special_tokens)
    strs = st.tokenizer.token_strs(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=st.deploy.max_model_len, tokens=ids,
                            token_strs=strs).model_dump()


@routes.post("/detokenize")
async def detokenize(raw: Request):
    st = _state(raw)
    body = await _parse(raw, DetokenizeRequest)
    st.check_model(body.model)
    st.check_tokens(body.tokens, "tokens")
    return DetokenizeResponse(prompt=st.tokenizer.decode(body.tokens)).model_dump()


@routes.post("/v1/completions")
async def completions(raw: Request):
    st = _state(raw)
    body = await _parse(raw, CompletionRequest, "completion")
    st.check_model(body.model)
    return await _generate(st, raw, body, await _prompts(st, body), body.max_tokens, chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(raw: Request):
    st = _state(raw)
    body = await _parse(raw, ChatCompletionRequest, "chat")
    st.check_model(body.model)
    tools, parser, force = _tool_choice(st, body)
    text = await _render(st, body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs)
    forced = ""
    if force is not None:
        suffix, forced = parser.forced(text, force or None)
        text += suffix
    prompt = await _encode(st, text, body.add_special_tokens)
    if not prompt or len(prompt) >= st.deploy.max_model_len:
        raise HTTPError(400, f"the rendered chat has {len(prompt)} tokens; it must have 1 to "
                             f"max_model_len - 1 = {st.deploy.max_model_len - 1}", "messages")
    think_open = text.endswith(THINK_START) if st.reasoning_parser else None
    return await _generate(st, raw, body, [prompt], body.max_completion_tokens or body.max_tokens, chat=True,
                           output=lambda: ChatOutput(think_open, parser, forced))


def _tool_choice(st: ServerState, body: ChatCompletionRequest):
    """The request's tools for the template, the parser of the output's calls (None: the output is content)
    and the call the prompt forces (None: none; "": some call, tool_choice "required"; else that function's),
    by vLLM's rules: tool_choice defaults to "auto" with tools, "none" without; "auto" needs
    --enable-auto-tool-choice, "required" and a named function --tool-call-parser (this server has no guided
    decoding: the prompt ends inside the call's opening tag instead, so the model can only continue it)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise HTTPError(400, f"tool_choice {_choice_name(choice)} needs `tools`", "tool_choice")
    if choice == "none":
        return tools, None, None
    parser = TOOL_PARSERS[st.tool_call_parser](tools) if st.tool_call_parser else None
    if choice == "auto":
        if not st.enable_auto_tool_choice or parser is None:
            raise HTTPError(400, 'tool_choice "auto" (the default when tools are given) needs the server started with '
                                 "--enable-auto-tool-choice and --tool-call-parser",
                            "tool_choice" if body.tool_choice is not None else "tools")
        return tools, parser, None
    if parser is None:
        raise HTTPError(400, f"tool_choice {_choice_name(choice)} needs the server started with --tool-call-parser",
                        "tool_choice")
    if choice == "required":
        return tools, parser, ""
    if choice.function.name not in {t["function"]["name"] for t in tools}:
        raise HTTPError(400, f"tool_choice names the function {choice.function.name!r}, which is not among `tools`",
                        "tool_choice")
    return tools, parser, choice.function.name


def _choice_name(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


# -------------------------------------------------------------------------------- generation: helpers
def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("glm53-jax")
    except PackageNotFoundError:
        return "unknown"


async def _engine_call(awaitable):
    """An AsyncEngine call; an engine that has stopped is a 503."""
    try:
        return await awaitable
    except RuntimeError as e:
        raise HTTPError(503, str(e)) from None


# texts longer than this are tokenized (and chats rendered) in a worker thread, not on the event loop
OFF_LOOP_CHARS = 1 << 16


async def _off_loop(size: int, fn, *args):
    """fn(*args), in a worker thread when `size` (characters) is large enough to hold up other clients."""
    return await asyncio.to_thread(fn, *args) if size > OFF_LOOP_CHARS else fn(*args)


async def _encode(st: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    return await _off_loop(len(text), st.tokenizer.encode, text, add_special_tokens)


async def _render(st: ServerState, messages, add_generation_prompt: bool, tools: list | None = None,
                  kwargs: dict | None = None) -> str:
    """The chat's prompt text under the model's template, with the request's tools and
    chat_template_kwargs (400 naming messages without a template or when the template fails on them)."""
    if not st.tokenizer.chat_template:
        raise HTTPError(400, "this model has no chat template: use /v1/completions", "messages")
    if tools and isinstance(tools[0], BaseModel):
        tools = [t.model_dump(exclude_none=True) for t in tools]
    msgs = [m.for_template() for m in messages]
    size = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
    try:
        return await _off_loop(size, lambda: render_chat(st.tokenizer, msgs, add_generation_prompt, tools,
                                                         **(kwargs or {})))
    except Exception as e:  # noqa: BLE001 - a template error is the request's messages' fault
        raise HTTPError(400, f"the chat template failed on these messages: {e}", "messages") from None


async def _prompts(st: ServerState, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    elif p and isinstance(p[0], int):
        p = [p]
    if not p:
        raise HTTPError(400, "prompt must not be empty", "prompt")
    if len(p) > st.max_prompts_per_request:
        raise HTTPError(400, f"a batch of {len(p)} prompts is over --max-prompts-per-request "
                             f"{st.max_prompts_per_request}", "prompt")
    out = [await _encode(st, x, body.add_special_tokens) if isinstance(x, str) else list(x) for x in p]
    limit = st.deploy.max_model_len
    for i, ids in enumerate(out):
        which = f"prompt {i}" if len(out) > 1 else "the prompt"
        if not ids:
            raise HTTPError(400, f"{which} is empty", "prompt")
        if len(ids) >= limit:
            raise HTTPError(400, f"{which} has {len(ids)} tokens: max_model_len={limit} leaves no room for "
                                 "one generated token", "prompt")
        st.check_tokens(ids, "prompt")
    return out


# the request field each engine field (glm53.engine.request.RequestError.field) comes from
_FIELDS = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens", "salt": "cache_salt",
           "kv_peer": "kv_transfer_params"}


def _field(body, engine_field: str) -> str:
    """The request field an engine RequestError about `engine_field` names."""
    field = _FIELDS.get(engine_field, engine_field)
    if isinstance(body, ChatCompletionRequest):
        if field == "prompt":
            return "messages"
        if field == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field == "logprobs" and body.top_logprobs is not None:
            return "top_logprobs"
    return field


def _sampling(st: ServerState, body, max_tokens: int, i: int):
    """The SamplingParams of the request's i-th choice (prompt p's choice j is i = p * n + j: seed + i, so
    each prompt and each of its n choices its own draws, wrapped into int64). logit_bias values are clamped
    to [-100, 100] and its keys must be token ids, as vLLM takes them."""
    from glm53.engine.request import LOGIT_BIAS_RANGE, SamplingParams

    stops = tuple(body.stop_token_ids or ()) + (() if body.ignore_eos else tuple(st.tokenizer.eos_token_ids))
    lo, hi = SEED_RANGE
    seed = (body.seed + i - lo) % (hi - lo) + lo if body.seed is not None else random.getrandbits(31)
    temperature = 1.0 if body.temperature is None else body.temperature
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not re.fullmatch(r"\d{1,10}", key.strip()):
            raise HTTPError(400, f"logit_bias keys must be token ids, got {key!a}"[:200], "logit_bias")
        bias.append((int(key), min(max(value, LOGIT_BIAS_RANGE[0]), LOGIT_BIAS_RANGE[1])))
    rules = {name: getattr(body, name) for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                                                    "repetition_penalty") if getattr(body, name) is not None}
    try:
        return SamplingParams(max_tokens, greedy=temperature < GREEDY_BELOW, temperature=max(temperature, GREEDY_BELOW),
                              top_p=1.0 if body.top_p is None else body.top_p, seed=seed,
                              stop_token_ids=tuple(dict.fromkeys(stops)), min_tokens=body.min_tokens,
                              logit_bias=tuple(bias), logprobs=_logprobs_asked(body),
                              prompt_logprobs=_prompt_logprobs_asked(body), **rules)
    except RequestError as e:
        raise HTTPError(400, str(e), _field(body, e.field)) from None


def _logprobs_asked(body) -> int | None:
    """Alternatives per token the request asks for (None: no logprobs): completions' `logprobs`, a chat's
    `top_logprobs` (0 by default) when its `logprobs` is true."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _prompt_logprobs_asked(body) -> int | None:
    """Alternatives per prompt token the engine computes (None: no prompt logprobs), vLLM's: `prompt_logprobs`,
    else with completions' echo and logprobs the `logprobs` count (the prompt's entries lead the choice's
    logprobs). A stream has no place for them: prompt_logprobs > 0 with stream is a 400, 0 is not computed."""
    k = body.prompt_logprobs
    if body.stream and k:
        raise HTTPError(400, "prompt_logprobs are not available with stream=true", "prompt_logprobs")
    if body.stream:
        k = None
    if k is None and not isinstance(body, ChatCompletionRequest) and body.echo and body.logprobs is not None:
        k = body.logprobs
    return k


def _stops(body) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


@dataclasses.dataclass
class _Choice:
    """One prompt's generation: its handle, text stream, and what has arrived."""

    index: int
    prompt: list[int]
    handle: Any  # glm53.engine.async_engine.RequestHandle
    text: TextStream
    chat: ChatOutput | None = None  # a chat's reasoning and tool calls, parsed as the text arrives
    tokens: list[int] = dataclasses.field(default_factory=list)
    out: str = ""
    sibling: int = 0  # which of its prompt's n choices (usage counts a prompt once)
    request: Any = None  # the engine's Request (its output_logprobs, appended before each token is delivered)
    echo: str = ""  # completions' echo: the prompt's text, before the output
    offset: int = 0  # completions' logprobs: the text length of the tokens so far (their text_offset)

    def finish_reason(self) -> str:
        """vLLM's: a chat that stopped after calling tools finished "tool_calls"."""
        reason = self.handle.ended.finish_reason
        return "tool_calls" if reason == "stop" and self.chat is not None and self.chat.calls else reason

    def stop_reason(self, body) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop token id that ended it; None for EOS and length."""
        if self.handle.ended is None or self.handle.ended.finish_reason != "stop":
            return None
        if self.text.stopped_by is not None:
            return self.text.stopped_by
        last = self.tokens[-1] if self.tokens else None
        return last if last in (body.stop_token_ids or ()) else None


async def _start(st: ServerState, body, prompts: list[list[int]], max_tokens: int | None, kv_peer, kv_lease,
                 output=None, kv_remote=None, kv_produce: bool = False) -> list[_Choice]:
    """Admit (`ServerState.admit`) and add one engine request per prompt and choice -> the choices, whose
    handles are `live` (the caller discards them once it answered). A prompt's n choices are siblings: the
    2nd to n-th are admitted once the first computed the prompt, whose pages they then take from the
    prefix cache."""
    choices: list[_Choice] = []
    n = body.n
    if kv_peer is not None or kv_produce:  # a P/D leg: the consumer does not compute the prompt it fetches
        asked = body.prompt_logprobs is not None or _prompt_logprobs_asked(body) is not None
        field = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        if asked:
            raise HTTPError(400, f"{field} needs the prompt's logprobs, which a disaggregated prefill/decode "
                                 "request (kv_transfer_params) does not compute on one server", field)
    echoes = _echo_texts(st, body, prompts)
    st.admit(len(prompts) * n)
    left = len(prompts) * n  # adds still counted in pending_adds
    st.starting += 1
    try:
        for p, ids in enumerate(prompts):
            lead = None
            for j in range(n):
                i = p * n + j
                m = max_tokens if max_tokens is not None else max(1, st.deploy.max_model_len - len(ids))
                params = _sampling(st, body, m, i)
                text = TextStream(st.tokenizer, _stops(body), params.stop_token_ids, body.min_tokens)
                # a P/D consumer's first choice fetches the prompt's KV (and frees the producer's lease); its
                # siblings take it from this server's prefix cache
                adding = st.engine.add(ids, params, salt=body.cache_salt or "",
                                       kv_peer=kv_peer if lead is None else None,
                                       kv_lease=kv_lease if lead is None else 0, kv_remote=kv_remote,
                                       kv_produce=kv_produce, text=text,
                                       # a choice computing prompt logprobs shares no pages: nothing to wait for
                                       prefill_after=lead if params.prompt_logprobs is None else None)
                left -= 1  # queued: counted in the engine's num_waiting from here on
                st.pending_adds -= 1
                handle = await _add(st, adding)
                lead = lead or handle.req_id
                eng = st.engine.engine  # a dict lookup from this thread: the engine thread only adds and moves it
                req = eng.requests.get(handle.req_id) or eng.finished.get(handle.req_id)
                choices.append(_Choice(i, ids, handle, text, output() if output is not None else None, sibling=j,
                                       request=req, echo=echoes[p], offset=len(echoes[p])))
    except BaseException as e:
        st.pending_adds -= left
        for c in choices:
            st.engine.abort_nowait(c.handle.req_id)
        if isinstance(e, RequestError):
            raise HTTPError(400, str(e), _field(body, e.field)) from None
        if isinstance(e, RuntimeError):
            raise HTTPError(503, str(e)) from None
        raise
    finally:
        st.starting -= 1
    st.live.update(c.handle for c in choices)
    return choices


async def _add(st: ServerState, adding):
    """Await `adding` (an AsyncEngine.add) -> its handle; a 503 if the shutdown answers every client first
    (the engine thread may be inside a long step, not taking commands): the request, if it is added
    later, is aborted then."""

    def abort(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is None:
            st.engine.abort_nowait(t.result().req_id)

    task = asyncio.ensure_future(adding)
    ending = asyncio.ensure_future(st.ending.wait())
    try:
        await asyncio.wait({task, ending}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ending.cancel()
        if not task.done():  # the shutdown answered first, or the client went away meanwhile
            task.add_done_callback(abort)
    if task.done():
        return task.result()
    raise HTTPError(503, "the server shut down before this request was started", headers=_RETRY)


def _echo_texts(st: ServerState, body, prompts: list[list[int]]) -> list[str]:
    """completions' echo: each prompt's text (as sent, or its token ids decoded); "" without echo. With
    logprobs the prompt's entries lead the choice's logprobs (`_echo_logprobs`)."""
    if not getattr(body, "echo", False):
        return [""] * len(prompts)
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], str):
        return list(p)
    return [st.tokenizer.decode(ids) for ids in prompts]


def _token_text(st: ServerState, body, tok: int) -> str:
    """A token as logprobs name it: its text, or "token_id:N" with return_tokens_as_token_ids (vLLM's, so
    tokens with equal text stay apart)."""
    return f"token_id:{tok}" if body.return_tokens_as_token_ids else st.tokenizer.decode([tok])


def _alternatives(st: ServerState, body, tok: int, lp) -> list[tuple[str, float]]:
    """vLLM's order of a token's logprobs entries: the sampled token first, then the top alternatives, each
    token once; logprobs clamped to -9999 (JSON has no -inf)."""
    seen, out = set(), []
    for t, v in ((tok, lp.logprob), *lp.top):
        if t not in seen:
            seen.add(t)
            out.append((_token_text(st, body, t), max(v, -9999.0)))
    return out


def _prompt_logprobs(st: ServerState, c: _Choice):
    """vLLM's `prompt_logprobs` of c's prompt (None when the engine computed none): None for the first token,
    then per token {token id: PromptLogprob} of the token itself (its rank) and its top alternatives (ranks
    1..k), each token once; logprobs clamped to -9999."""
    req = c.request
    if req is None or req.params.prompt_logprobs is None:
        return None
    out: list = [None]
    for tok, lp in zip(c.prompt[1:], req.prompt_logprobs):
        entry = {str(tok): PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                                         decoded_token=st.tokenizer.decode([tok]))}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=max(v, -9999.0), rank=rank,
                                                   decoded_token=st.tokenizer.decode([t])))
        out.append(entry)
    return out


def _echo_logprobs(st: ServerState, body, c: _Choice) -> CompletionLogprobs:
    """completions' echo with logprobs: the prompt tokens' entries, vLLM's (the first token's logprob and
    top_logprobs null, text offsets from 0), from the prompt logprobs the engine computed for the choice."""
    k = body.logprobs
    out, offset = CompletionLogprobs(), 0
    lps = [None, *c.request.prompt_logprobs]
    for t, lp in zip(c.prompt, lps):
        text = _token_text(st, body, t)
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else max(lp.logprob, -9999.0))
        out.top_logprobs.append(None if lp is None else dict(_alternatives(st, body, t, lp)[: k + 1]))
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs | None) -> CompletionLogprobs:
    if tail is not None:
        for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(head, f).extend(getattr(tail, f))
    return head


def _logprobs(st: ServerState, body, c: _Choice, start: int, chat: bool):
    """The logprobs of c's tokens from index `start` on (None when not asked): completions' OpenAI legacy
    form (top_logprobs: the sampled token and the `logprobs` best), a chat's `content` list (top_logprobs:
    the first `top_logprobs` entries in vLLM's order)."""
    k = c.request.params.logprobs if c.request is not None else None
    if k is None:
        return None
    toks, lps = c.tokens[start:], c.request.output_logprobs[start:len(c.tokens)]
    if chat:
        return ChatLogprobs(content=[ChatLogprobContent(
            token=(text := _token_text(st, body, t)), logprob=max(lp.logprob, -9999.0),
            bytes=list(text.encode("utf-8", errors="replace")),
            top_logprobs=[ChatLogprob(token=a, logprob=v, bytes=list(a.encode("utf-8", errors="replace")))
                          for a, v in _alternatives(st, body, t, lp)[:k]]) for t, lp in zip(toks, lps)])
    out = CompletionLogprobs()
    for t, lp in zip(toks, lps):
        text = _token_text(st, body, t)
        out.tokens.append(text)
        out.token_logprobs.append(max(lp.logprob, -9999.0))
        out.top_logprobs.append(dict(_alternatives(st, body, t, lp)[: k + 1]))
        out.text_offset.append(c.offset)
        c.offset += len(text)
    return out


def _usage(choices: list[_Choice], live=frozenset()) -> UsageInfo:
    """The choices' usage so far: an ended choice's counts, a running one's tokens that arrived (a stream's
    continuous_usage_stats); cached tokens are known once a choice ends. live: the indices of the choices
    whose end the stream has not sent yet; they count what was sent, even where the engine (another
    thread) has already ended them, so each chunk's usage counts exactly the tokens sent up to it."""
    ended = [c.handle.ended if c.index not in live else None for c in choices]
    prompt = sum(len(c.prompt) for c in choices if c.sibling == 0)
    out = sum(e.num_output_tokens if e is not None else len(c.tokens) for c, e in zip(choices, ended))
    cached = sum(e.num_cached_tokens for e in ended if e is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=out, total_tokens=prompt + out,
                     prompt_tokens_details={"cached_tokens": cached})


# ------------------------------------------------------------------------------ generation: P/D legs
def _pd_leg(st: ServerState, body, prompts) -> tuple[bool, str | None, int, PageSpans | None]:
    """What a request's kv_transfer_params ask of this server -> (produce: answer with the params a
    consumer needs, kv_peer: the producer to take the prompt's KV from, kv_lease: its lease on that
    KV, 0 if none, kv_remote: the page spans it announced, None if none). Without the PdConnector in the
    matching role both are ignored (the prompt is computed here, as by an aggregated server)."""
    ktp = body.kv_transfer_params or {}
    role = st.deploy.kv_role
    produce = bool(ktp.get("do_remote_decode")) and role in ("kv_producer", "kv_both")
    if produce and (body.stream or len(prompts) != 1 or body.n != 1):
        raise HTTPError(400, "kv_transfer_params.do_remote_decode takes one prompt, n 1 and stream false (the "
                             "prefill leg of a P/D pair)", "kv_transfer_params")
    if not (ktp.get("do_remote_prefill") and role in ("kv_consumer", "kv_both")):
        return produce, None, 0, None
    host, port = ktp.get("remote_host"), ktp.get("remote_port")
    if not _is_host(host) or isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise HTTPError(400, f"kv_transfer_params.do_remote_prefill needs remote_host (a host name or IP address) and "
                             f"remote_port (1-65535), got {host!a} and {port!a}", "kv_transfer_params")
    lease = ktp.get("remote_lease", 0)  # optional: without it the producer's lease lapses at its expiry
    if isinstance(lease, bool) or not isinstance(lease, int) or not 0 <= lease < 1 << 63:
        raise HTTPError(400, f"kv_transfer_params.remote_lease must be the producer's lease id (an integer >= 0), "
                             f"got {lease!r}", "kv_transfer_params")
    spans = _page_spans(ktp.get("remote_page_spans"))
    if peer_address(f"{host}:{port}") not in {peer_address(a) for a in st.deploy.pd_producers}:
        # refused here, before the engine sees it: a client cannot make this server dial an address
        raise HTTPError(400, f"kv_transfer_params names the producer {host!a}:{port}, which is not one of this "
                             "server's producers (kv_connector_extra_config producers); nothing was fetched",
                        "kv_transfer_params")
    return produce, f"{host}:{port}", lease, spans


def _page_spans(spans) -> PageSpans | None:
    """kv_transfer_params' remote_page_spans (`_produced`: {"fingerprint": hex, "hash_block_tokens": n,
    "page_tokens": {group: n}}) -> kvcache.tiers.PageSpans; None when absent (a producer that says
    nothing of its spans is taken to share ours); a 400 naming the field when malformed."""
    if spans is None:
        return None
    try:
        if not isinstance(spans, dict) or set(spans) != {"fingerprint", "hash_block_tokens", "page_tokens"}:
            raise ValueError("it must have exactly fingerprint, hash_block_tokens and page_tokens")
        fp, pages = spans["fingerprint"], spans["page_tokens"]
        if not isinstance(fp, str) or not re.fullmatch(r"[0-9a-f]{64}", fp):
            raise ValueError("fingerprint must be 64 hex digits")
        if not isinstance(pages, dict) or not pages or not all(isinstance(g, str) for g in pages):
            raise ValueError("page_tokens must map cache group names to tokens per page")
        if any(isinstance(v, bool) for v in (spans["hash_block_tokens"], *pages.values())):
            raise ValueError("tokens must be integers")
        return PageSpans(fp, spans["hash_block_tokens"], tuple(pages.items()))
    except ValueError as e:
        raise HTTPError(400, f"kv_transfer_params.remote_page_spans is malformed ({e}): got {spans!a}"[:400],
                        "kv_transfer_params") from None


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _is_host(host) -> bool:
    """An IP address, or an ASCII host name (RFC 1123 labels): what the peer tier may dial. Anything else
    (a lone surrogate, a space, a URL) would fail inside the tier's control thread, not here."""
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(_HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split("."))


async def _produced(st: ServerState, req_id: str) -> dict:
    """The P/D producer's answer for finished `req_id`, once its prompt's pages are parked in the
    PdConnector's peer tier (the parking runs in the engine's next plan and the tier stores
    asynchronously) or PD_STORE_WAIT_S have passed: where to fetch them, and how many leading prompt
    tokens it holds (all but the last once its full pages and its last partial pages, the tail chunks,
    are held), leased for DeployConfig.pd_lease_s."""
    eng = st.engine.engine
    r = eng.replica_of(req_id)
    tier = eng.pd_tier(r)
    tpb, blocks = eng.prompt_chunk_keys(req_id)
    upto, tails = eng.prompt_tail_keys(req_id)
    keys = [k for b in blocks for _, k in b] + [k for _, k in tails]
    deadline = time.monotonic() + PD_STORE_WAIT_S
    while time.monotonic() < deadline and st.engine.error is None:
        if eng.parked(req_id) and tier.held_prefix(keys) is not None:
            break
        await asyncio.sleep(0.005)
    held = tier.held_prefix(keys) or 0  # a store still in flight at the deadline: what is there
    n, total = 0, 0  # hash blocks whose every page is held
    for b in blocks:
        total += len(b)
        if total > held:
            break
        n += 1
    held_tokens = upto if held == len(keys) else n * tpb
    lease = tier.lease(keys[:held], eng.deploy.pd_lease_s)
    spans = eng.page_spans()
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": f"{st.served_model_name}@{tier.address}", "remote_host": tier.host,
            "remote_port": tier.port, "remote_num_tokens": held_tokens, "remote_lease": lease,
            "remote_lease_s": eng.deploy.pd_lease_s,
            "remote_page_spans": {"fingerprint": spans.fingerprint, "hash_block_tokens": spans.hash_block_tokens,
                                  "page_tokens": dict(spans.page_tokens)}}


# --------------------------------------------------------------------------------- generation: answers
async def _generate(st: ServerState, raw: Request, body, prompts: list[list[int]], max_tokens: int | None,
                    chat: bool, output=None):
    """output: makes each chat choice's ChatOutput (its parsers)."""
    produce, kv_peer, kv_lease, kv_remote = _pd_leg(st, body, prompts)
    choices = await _start(st, body, prompts, max_tokens, kv_peer, kv_lease, output, kv_remote, produce)
    rid = new_id(chat)
    if body.stream:
        return _Stream(st, choices, _stream(st, raw, body, choices, rid, chat))
    try:
        if not await _collect(st, raw, choices):
            return Response(status_code=499)  # the client went away: its requests were aborted
    finally:
        st.live.difference_update(c.handle for c in choices)
    failed = [c for c in choices if c.handle.ended.finish_reason == "error"]
    if failed:
        raise HTTPError(500, f"the engine failed while running this request: {failed[0].handle.ended.error}")
    if st.ending.is_set() and any(c.handle.ended.finish_reason == "abort" for c in choices):
        raise HTTPError(503, "the server shut down before this request finished (--shutdown-timeout)",
                        headers=_RETRY)
    ids = {"token_ids": None, "prompt_token_ids": None}
    if chat:
        for c in choices:
            c.chat.feed(c.out, final=True)
        reasons = [(c.finish_reason(), c.stop_reason(body)) for c in choices]
        out = ChatCompletionResponse(id=rid, model=st.served_model_name, usage=_usage(choices), choices=[
            ChatChoice(index=c.index, message=_message(c.chat), finish_reason=reason, stop_reason=why,
                       logprobs=_logprobs(st, body, c, 0, True), **(_ids(c) if body.return_token_ids else ids))
            for c, (reason, why) in zip(choices, reasons)], prompt_logprobs=_prompt_logprobs(st, choices[0]))
    else:
        reasons = [(c.handle.ended.finish_reason, c.stop_reason(body)) for c in choices]
        out = CompletionResponse(id=rid, model=st.served_model_name, usage=_usage(choices), choices=[
            CompletionChoice(index=c.index, text=c.echo + c.out, finish_reason=reason, stop_reason=why,
                             logprobs=_completion_logprobs(st, body, c), prompt_logprobs=_prompt_logprobs(st, c),
                             **(_ids(c) if body.return_token_ids else ids))
            for c, (reason, why) in zip(choices, reasons)])
    if produce:
        out.kv_transfer_params = await _produced(st, choices[0].handle.req_id)
    return out.model_dump()


def _completion_logprobs(st: ServerState, body, c: _Choice):
    """A whole completion choice's logprobs: with echo the prompt's entries, then the output's."""
    lps = _logprobs(st, body, c, 0, False)
    return _join_logprobs(_echo_logprobs(st, body, c), lps) if lps is not None and body.echo else lps


def _message(o: ChatOutput) -> ChatMessageOut:
    return ChatMessageOut(content=o.final_content, reasoning_content=o.reasoning_content, tool_calls=[
        ToolCall(id=i, function=FunctionCall(name=name, arguments=args)) for i, name, args in o.calls])


def _delta(o: ChatOutput, text: str, final: bool) -> DeltaMessage:
    """A chat chunk's delta: what `text` completes of the reasoning, the content and the tool calls."""
    d = o.feed(text, final)
    calls = [DeltaToolCall(index=t.index, id=t.id, type="function" if t.id else None,
                           function=DeltaFunctionCall(name=t.name, arguments=t.arguments)) for t in d.tool_calls]
    return DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)


def _ids(c: _Choice) -> dict:
    return {"token_ids": c.tokens, "prompt_token_ids": c.prompt}


async def _collect(st: ServerState, raw: Request, choices: list[_Choice]) -> bool:
    """Wait for every choice to end -> False if the client went away first (its requests are aborted)."""
    async def one(c: _Choice):
        async for tok, text, _ in c.handle:
            c.tokens.append(tok)
            c.out += text
        c.out += c.handle.ended.text

    collect = asyncio.ensure_future(asyncio.gather(*(one(c) for c in choices)))
    while not collect.done():
        await asyncio.wait({collect}, timeout=0.2)
        if not collect.done() and await raw.is_disconnected():
            collect.cancel()
            for c in choices:
                st.engine.abort_nowait(c.handle.req_id)
            return False
    collect.result()
    return True


class _Stream(StreamingResponse):
    """An event stream whose requests are aborted (those still running) and forgotten (`ServerState.live`)
    however the response ends: also when the client went away before its first chunk, where Starlette
    cancels the response before it ever starts `_stream`, whose own cleanup then never runs."""

    def __init__(self, st: ServerState, choices: list[_Choice], content):
        super().__init__(content, media_type="text/event-stream")
        self._st, self._choices = st, choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for c in self._choices:
                if c.handle.ended is None:  # not read to its end here (a no-op in the engine if it finished)
                    self._st.engine.abort_nowait(c.handle.req_id)
            self._st.live.difference_update(c.handle for c in self._choices)


async def _stream(st: ServerState, raw: Request, body, choices: list[_Choice], rid: str, chat: bool):
    """Server-sent events: one chunk per token (its text, its id with return_token_ids), the finishing
    chunk with finish_reason and stop_reason ("abort" or "error" on a chunk of its own when a request
    ended without a finishing token), a usage chunk with stream_options.include_usage, `[DONE]` last.
    With include_usage and continuous_usage_stats every chunk carries the usage so far too, as vLLM's
    (guidellm asks for it to count tokens per chunk)."""
    merged: asyncio.Queue = asyncio.Queue()
    so = body.stream_options
    continuous = so is not None and bool(so.include_usage) and bool(so.continuous_usage_stats)

    async def pump(c: _Choice):
        async for tok, text, fin in c.handle:
            await merged.put((c, tok, text, fin))
        await merged.put((c, None, "", True))

    def event(model: BaseModel) -> str:
        if continuous and model.usage is None:
            model.usage = _usage(choices, live)
        return f"data: {json.dumps(model.model_dump())}\n\n"

    def chunk(c: _Choice, text: str, tok: int | None = None, reason: str | None = None, why=None) -> str | None:
        """None: a chat chunk that would carry nothing (its text is held back by a parser, say), as vLLM
        skips those; with return_token_ids every token has its chunk."""
        ids = [tok] if body.return_token_ids and tok is not None else None
        lps = _logprobs(st, body, c, len(c.tokens) - 1, chat) if tok is not None else None
        if c.echo:  # completions' echo: the prompt's text (and its logprobs) lead the choice's first chunk
            if lps is not None:
                lps = _join_logprobs(_echo_logprobs(st, body, c), lps)
            text, c.echo = c.echo + text, ""
        if chat:
            delta = _delta(c.chat, text, reason is not None)
            if reason is None and ids is None and lps is None and not delta.model_dump():
                return None
            return event(ChatCompletionStreamResponse(id=rid, model=st.served_model_name, choices=[ChatChunkChoice(
                index=c.index, delta=delta, finish_reason=c.finish_reason() if reason is not None else None,
                stop_reason=why, token_ids=ids, logprobs=lps)]))
        return event(CompletionStreamResponse(id=rid, model=st.served_model_name, choices=[CompletionChoice(
            index=c.index, text=text, finish_reason=reason, stop_reason=why, token_ids=ids, logprobs=lps)]))

    pumps = [asyncio.ensure_future(pump(c)) for c in choices]
    live = {c.index for c in choices}
    try:
        if chat:
            for c in choices:
                yield event(ChatCompletionStreamResponse(id=rid, model=st.served_model_name, choices=[ChatChunkChoice(
                    index=c.index, delta=DeltaMessage(role="assistant", content=""))]))
        while live:
            c, tok, text, fin = await merged.get()
            if c.index not in live:
                continue
            if tok is not None:
                c.tokens.append(tok)
            if fin:
                live.discard(c.index)
                ended = c.handle.ended
                yield chunk(c, text + ended.text, tok, ended.finish_reason, c.stop_reason(body))
            elif (out := chunk(c, text, tok)) is not None:
                yield out
        if body.stream_options is not None and body.stream_options.include_usage:
            kind = ChatCompletionStreamResponse if chat else CompletionStreamResponse
            yield event(kind(id=rid, model=st.served_model_name, choices=[], usage=_usage(choices)))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or we are done): abort what still runs
        for p in pumps:
            p.cancel()
        for c in choices:
            if c.index in live:
                st.engine.abort_nowait(c.handle.req_id)
        st.live.difference_update(c.handle for c in choices)


# ------------------------------------------------------------------------------------------- the app
@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    st = app.state.server
    # after a drain the engine thread gets a moment to stop between steps, not the length of a compilation,
    # and the tiers' flush a bounded one (timeout + 1 s answering + 1 s stopping + this < timeout + 5 s)
    if st.engine.shutdown(timeout_s=SHUTDOWN_ANSWER_S if st.draining else 30.0,
                          flush_s=SHUTDOWN_FLUSH_S if st.draining else None) is False:
        print("glm53.serve: the engine is still inside a step or flushing its tiers; exiting without waiting "
              "for it", flush=True)
    else:
        print("glm53.serve: engine shut down", flush=True)


def create_app(engine, tokenizer, served_model_name: str, *, metrics=None, api_key: str | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, tool_call_parser: str | None = None,
               enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
               max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
               max_waiting_requests: int = MAX_WAITING_REQUESTS, dev_mode: bool | None = None) -> FastAPI:
    """The FastAPI app over a started `glm53.engine.async_engine.AsyncEngine` (handlers: the module's
    `routes`, over `ServerState` in app.state.server); the app's shutdown (after uvicorn's graceful
    wait) aborts what still runs and shuts the engine down. api_key: required as a Bearer token on the
    /v1 routes, /tokenize, /detokenize and /reset_prefix_cache (`ApiKey`). The parsers and limits: the
    flags'. dev_mode (default: $VLLM_SERVER_DEV_MODE == "1"): route vLLM's development endpoint
    POST /reset_prefix_cache (without it: 404, as vLLM)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    for name, v in (("max_request_bytes", max_request_bytes), ("max_prompts_per_request", max_prompts_per_request),
                    ("max_waiting_requests", max_waiting_requests)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    app = FastAPI(title="glm53", version=_version(), lifespan=_lifespan)
    app.state.server = ServerState(engine, tokenizer, served_model_name, metrics, tool_call_parser,
                                   enable_auto_tool_choice, reasoning_parser, max_prompts_per_request,
                                   max_waiting_requests)
    app.include_router(routes)
    if dev_mode if dev_mode is not None else os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    install_error_answers(app, max_request_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # outermost: a request without the key is not even read
    return app


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        ap.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        ap.error(f"--chat-template {args.chat_template}: no such file")
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
    engine.max_finished, engine.max_timeline = MAX_FINISHED_KEPT, MAX_TIMELINE_KEPT
    metrics = ServingMetrics(engine, model_name=name)
    if args.warmup:
        t0 = time.perf_counter()
        shapes = engine.warmup(prompt_logprobs=True)
        print(f"glm53.serve: compiled {shapes} bucket shapes in {time.perf_counter() - t0:.0f} s "
              f"({memory_maps()} memory mappings held)", flush=True)
    async_engine = AsyncEngine(engine).start()
    app = create_app(async_engine, load_tokenizer(args.model, args.chat_template), name, metrics=metrics,
                     api_key=args.api_key, tool_call_parser=args.tool_call_parser,
                     enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
                     max_request_bytes=args.max_request_bytes, max_prompts_per_request=args.max_prompts_per_request,
                     max_waiting_requests=args.max_waiting_requests)
    print(f"glm53.serve: {name} on http://{args.host}:{args.port} ({engine.deploy.max_model_len} tokens, "
          f"{engine.deploy.num_gpu_blocks} blocks, kv_policy {engine.deploy.kv_policy})", flush=True)
    server = _draining_server(uvicorn)(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                                      timeout_graceful_shutdown=SHUTDOWN_ANSWER_S),
                                       app.state.server, args.shutdown_timeout)
    server.run()
    if server.signal is not None:  # exit as the signal would have (uvicorn.run's behaviour)
        signal.signal(server.signal, signal.SIG_DFL)
        signal.raise_signal(server.signal)


def _draining_server(uvicorn):
    """uvicorn.Server whose first SIGTERM / SIGINT starts `ServerState.drain` (the server keeps listening,
    so new requests get their 503) and exits once it returns; a second signal exits at once (uvicorn's)."""

    class DrainingServer(uvicorn.Server):
        def __init__(self, config, state: ServerState, timeout_s: float):
            super().__init__(config)
            self.state, self.timeout_s = state, timeout_s
            self.signal: int | None = None
            self._loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            if self.signal is not None or self._loop is None:  # a second signal, or one before serving
                return super().handle_exit(sig, frame)
            self.signal = sig
            self.state.draining = True  # at once: the signal handler runs on the event loop's thread
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self) -> None:
            await self.state.drain(self.timeout_s)
            self.should_exit = True

    return DrainingServer


if __name__ == "__main__":
    main()
