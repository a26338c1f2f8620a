"""The OpenAI-compatible server's request and response bodies: pydantic models with vLLM's field names,
types and defaults (vllm/entrypoints/openai/protocol.py), so OpenAI's and vLLM's clients read and write
them unchanged. glm53.serve validates every request against these before anything reaches the engine.

- Requests: `CompletionRequest`, `ChatCompletionRequest`, `TokenizeCompletionRequest`,
  `TokenizeChatRequest`, `DetokenizeRequest`. Each field is checked against what the engine can hold
  (seed: an int64; temperature: finite, >= 0; top_p in (0, 1]; token ids: ints >= 0, the vocabulary is
  checked by the server) and a bad one is a 400 naming it. A field that OpenAI's or vLLM's API defines
  but this server does not apply yet (`UNAPPLIED`, checked by `unapplied_field` before the model) is
  accepted only at a value that means "off" (presence_penalty 0, top_k -1 or 0, n 1, ...): anything else
  is a 400 naming it, never ignored. Fields neither API defines are ignored, as vLLM ignores them.
- Responses: completions and chat completions, whole and streamed (one chunk per token, vLLM's
  `stop_reason` and `token_ids` extras), `UsageInfo`, `ModelCard` / `ModelList`, `TokenizeResponse`,
  `DetokenizeResponse`, `VersionResponse`.
- Bodies: `parse_body` reads a request body for the server and the router alike (a JSON object; NaN,
  infinities and lone UTF-16 surrogates, which JSON may spell but the engine cannot take, are a 400
  naming the field).
- Errors: every status the server and the router return (400, 401, 404, 405, 413, 500, 503) has one
  body, `ErrorResponse`: {"error": {"message", "type", "param", "code"}} (vLLM's and OpenAI's shape),
  built by `error_body`; `install_error_answers` makes a FastAPI app answer its own errors (unknown
  routes, wrong methods, invalid bodies, bodies over MAX_REQUEST_BYTES, exceptions) with it, and
  `HTTPError` raised by a handler becomes such an answer.

finish_reason values are vLLM's: "length", "stop", "abort", "error" (the step that ran the request
failed; always with HTTP 500 when not streamed).
"""

from __future__ import annotations

import json
import math
import time
import traceback
import uuid
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm53.engine.request import SEED_RANGE, is_utf8

# request bodies above this are a 413 (a 1M-token prompt as token ids is ~8 MB of JSON)
MAX_REQUEST_BYTES = 64 << 20
MAX_N = 128  # choices per prompt (n): each is a request of the engine
FLOAT32_MAX = 3.4028234663852886e38  # temperatures beyond it are infinite in the sampler's float32


def _no_bool(v):
    """JSON true is not an integer (pydantic's lax mode would read it as 1)."""
    if isinstance(v, bool):
        raise ValueError("must be an integer, not a boolean")
    return v


def _int64(v: int) -> int:
    if not SEED_RANGE[0] <= v < SEED_RANGE[1]:
        raise ValueError(f"must be an int64, in [-2^63, 2^63), got {v}")
    return v


Int = Annotated[int, BeforeValidator(_no_bool)]
Seed = Annotated[int, BeforeValidator(_no_bool), AfterValidator(_int64)]
TokenId = Annotated[int, BeforeValidator(_no_bool), Field(ge=0)]


class OpenAIBaseModel(BaseModel):
    """Unknown fields are ignored (vLLM's behaviour); NaN and infinities are rejected everywhere."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# -------------------------------------------------------------------------------------- unapplied
def _neutral(*values):
    return lambda v: v is None or any(v == x and type(v) is not bool or v is x for x in values)


# the fields OpenAI's and vLLM's sampling and output APIs define that this server does not apply yet:
# field -> whether a value means "off" (null always does)
_UNAPPLIED_COMMON = {
    "best_of": _neutral(1), "use_beam_search": _neutral(False), "length_penalty": _neutral(1),
    "include_stop_str_in_output": _neutral(False), "skip_special_tokens": _neutral(True),
    "spaces_between_special_tokens": _neutral(True), "truncate_prompt_tokens": _neutral(),
    "allowed_token_ids": _neutral(), "bad_words": _neutral([]), "logits_processors": _neutral(),
    "structured_outputs": _neutral(), "guided_json": _neutral(),
    "guided_regex": _neutral(), "guided_choice": _neutral(), "guided_grammar": _neutral(),
    "guided_decoding_backend": _neutral(), "guided_whitespace_pattern": _neutral(), "priority": _neutral(0),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "prompt_embeds": _neutral(), "vllm_xargs": _neutral(), "thinking_token_budget": _neutral(),
}
UNAPPLIED = {
    "completion": {**_UNAPPLIED_COMMON, "suffix": _neutral("")},
    "chat": {**_UNAPPLIED_COMMON, "echo": _neutral(False),
             "functions": _neutral([]), "function_call": _neutral("none"), "parallel_tool_calls": _neutral(True),
             "continue_final_message": _neutral(False), "chat_template": _neutral(), "documents": _neutral([]),
             "audio": _neutral(), "modalities": _neutral(["text"]), "prediction": _neutral(),
             "web_search_options": _neutral(), "reasoning_effort": _neutral()},
}


def unapplied_field(kind: str, data) -> tuple[str, str] | None:
    """(field, message) of the first field of `data` (a request body) in UNAPPLIED[kind] set to a value
    that is not neutral, else None."""
    if not isinstance(data, dict):
        return None
    for name, neutral in UNAPPLIED[kind].items():
        if name in data and not neutral(data[name]):
            return name, (f"`{name}` is not applied by this server yet (got {data[name]!r}); leave it unset "
                          "rather than have it ignored")
    return None


# ---------------------------------------------------------------------------------------- requests
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, a usage on every chunk too


class GenerationRequest(OpenAIBaseModel):
    """The fields completions and chat completions share: sampling, stops, streaming, vLLM's extras."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: recorded nowhere, nothing to apply
    # vLLM's extras
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0)
    cache_salt: str | None = None
    return_token_ids: bool | None = False
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's P/D fields (glm53.serve's pd_leg)
    # the sampler's rules (glm53.engine.request.SamplingParams checks their ranges and names the field)
    n: Int = Field(default=1, ge=1, le=MAX_N)
    top_k: Int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    return_tokens_as_token_ids: bool | None = False
    prompt_logprobs: Int | None = Field(default=None, ge=0)  # the engine names values past its MAX_LOGPROBS

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        return self


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. prompt: a text, token ids, or a batch of either (one choice per prompt)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Int | None = Field(default=16, ge=1)
    add_special_tokens: bool = True
    logprobs: Int | None = Field(default=None, ge=0)  # the engine names values past its MAX_LOGPROBS
    echo: bool | None = False


# the template's own inputs, which chat_template_kwargs may not replace
TEMPLATE_INPUTS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_kwargs(v: dict | None) -> dict | None:
    if v is not None and (clash := [k for k in TEMPLATE_INPUTS if k in v]):
        raise ValueError(f"sets the template's own inputs {clash}; give them as request fields")
    return v


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; its properties' "type" tells the parser strings


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions: the messages rendered with the model's chat template. tools and
    tool_choice as vLLM takes them (glm53.serve checks them against its --enable-auto-tool-choice and
    --tool-call-parser); chat_template_kwargs: the template's variables (enable_thinking: false turns
    GLM-5.3's thinking off)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(default=None, ge=0)  # with logprobs; the engine names values past its limit


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


def _json_object(v: str | dict) -> dict:
    """A tool call's arguments: OpenAI sends a JSON object as a string; templates read the object."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise ValueError("a tool call's arguments must be a JSON object") from None
    if not isinstance(v, dict):
        raise ValueError("a tool call's arguments must be a JSON object")
    return v


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Annotated[str | dict, AfterValidator(_json_object)] = Field(default_factory=dict)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One message. content: a text or a list of text parts (joined with newlines for the template, as
    vLLM's "string" content format does); other part types (images, audio) are not served. An assistant
    message's tool_calls reach the template with their arguments as objects (OpenAI sends JSON strings);
    other keys (name, tool_call_id, reasoning_content, ...) reach it as they are."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None

    def for_template(self) -> dict:
        out = self.model_dump(exclude_none=False)
        if isinstance(self.content, list):
            out["content"] = "\n".join(p.text for p in self.content)
        return out


ChatCompletionRequest.model_rebuild()


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionToolsParam] | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------------------------------- responses
def _drop_none(v) -> bool:
    return v is None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": prompt tokens served from a cache}


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, offset in the choice's text, logprob, and
    {token text: logprob} of the sampled token and the top `logprobs` alternatives."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob of a prompt token or an alternative to it (`prompt_logprobs`: per prompt token after the
    first, {token id: PromptLogprob} of the token itself and its top alternatives)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatLogprob(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: EOS, length)
    token_ids: list[int] | None = Field(default=None, exclude_if=_drop_none)  # return_token_ids
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_drop_none)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_drop_none)  # vLLM's, whole answers


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, exclude_if=_drop_none)  # --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_drop_none)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_drop_none)


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_drop_none)
    arguments: str | None = Field(default=None, exclude_if=_drop_none)


class DeltaToolCall(BaseModel):
    """A piece of tool call `index`: the first carries its id, type and name, the rest pieces of arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_drop_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_drop_none)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_drop_none)
    content: str | None = Field(default=None, exclude_if=_drop_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_drop_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_drop_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_drop_none)


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Response(BaseModel):
    """The fields every completion and chat response and chunk starts with, in OpenAI's order (`object`
    narrowed by each)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=_drop_none)


class CompletionStreamResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_drop_none)


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_drop_none)  # vLLM's: one prompt
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=_drop_none)


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_drop_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "glm53"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[dict] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, exclude_if=_drop_none)


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# ------------------------------------------------------------------------------------------ errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


def parse_body(raw: bytes) -> dict:
    """A request body -> the JSON object it holds. HTTPError 400 for a body that is not JSON (or not
    UTF-8), JSON that is not an object, and a value that JSON text may spell but the server cannot carry
    to the engine: NaN or an infinity (Python's json reads them) and a string with a lone UTF-16
    surrogate (`"\\ud800"` is valid JSON but no text UTF-8 can encode: it would fail wherever the text is
    encoded, e.g. when a cache_salt is hashed inside a step). Those name the top-level field they are in."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise HTTPError(400, "the request body is not JSON") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    for key, value in data.items():
        if (problem := _unencodable(key) or _unencodable(value)) is not None:
            field = key if is_utf8(key) else None  # an error body must itself be UTF-8
            raise HTTPError(400, f"{field or 'a field name'}: {problem}", field)
    return data


def _unencodable(value) -> str | None:
    """What in a parsed JSON value the engine cannot take (see parse_body), else None; iterative, so a
    deeply nested value cannot exhaust the stack."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if not is_utf8(v):
                return "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return "NaN and Infinity are not numbers JSON can carry"
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
    return None


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The JSON body of an error answer with HTTP `status` (ErrorResponse)."""
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


def new_id(chat: bool) -> str:
    return _id("chatcmpl" if chat else "cmpl")


class HTTPError(Exception):
    """Raised by a handler: the answer is HTTP `status` with the error body naming `param`, and `headers`
    (a 503's Retry-After, say)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.headers = status, param, headers


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


async def send_error(send, status: int, message: str) -> None:
    """An error answer sent from ASGI middleware (before any handler runs)."""
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def validation_error(errors) -> JSONResponse:
    """400 naming the first invalid field (pydantic's errors; "body" is FastAPI's root, not a field)."""
    def where(e) -> list[str]:
        return [str(x) for x in e.get("loc", ()) if x != "body"]

    first = where(errors[0]) if errors else []
    msg = "; ".join(f"{'.'.join(where(e)) or 'body'}: {e.get('msg')}" for e in errors)
    return error_response(400, msg or "invalid request", first[0] if first else None)


async def _on_http_error(request: Request, exc: HTTPError):
    return error_response(exc.status, str(exc), exc.param, exc.headers)


async def _on_starlette_error(request: Request, exc: StarletteHTTPException):
    return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")


async def _on_invalid(request: Request, exc: RequestValidationError):
    return validation_error(exc.errors())


async def _on_unexpected(request: Request, exc: Exception):
    traceback.print_exception(exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


class BodyLimit:
    """413 for a request body over `limit` bytes: by its Content-Length before reading it, or, without one,
    once that many bytes have arrived (the body is then buffered here and replayed to the app)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"the request body is over {self.limit} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                return await send_error(send, 413, too_large)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await send_error(send, 413, too_large)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def install_error_answers(app: FastAPI, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
    """Every error `app` answers gets the error body: HTTPError, unknown routes (404), wrong methods (405),
    invalid bodies (400), bodies over `max_request_bytes` (413), and any other exception (500)."""
    app.add_exception_handler(HTTPError, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(StarletteHTTPException, _on_starlette_error)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
