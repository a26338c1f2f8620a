"""What a client written for vLLM sees, through the official `openai` client (non-streamed and streamed),
as test cases shared by tests/glm53/test_serve.py (one server) and tests/glm53/test_router.py (the router
in front of prefill and decode servers): each module imports them and gives the fixture `api` (an `Api`
on its real processes). The servers run tests.glm53.faulty_serve, whose step fails for FAULT_PROMPT.

- every bad field is a 400 (404 for an unknown model) naming it, and the next good request succeeds with
  nothing left running; lone UTF-16 surrogates in any text field among them (sent as JSON escapes, as
  clients other than the openai package can);
- parameters this server does not apply are a 400 naming them, never ignored;
- the sampler's parameters, logprobs (return_tokens_as_token_ids too), n and echo, completions and chat,
  streamed and not; prompt_logprobs and echo with logprobs;
- a stop string ends the request as a stop (finish_reason, stop_reason, usage, [DONE]), counted under
  vllm:request_success{finished_reason="stop"};
- int64 seeds: equal seeds, equal tokens; different seeds, different tokens;
- a failed step fails its request with a JSON 500 (a server streaming it: finish_reason "error") and
  the next request succeeds, /health stays 200, nothing is left running or holding blocks;
- one error shape for 400, 404, 405, 413; /tokenize, /detokenize, /version, /v1/models/{id};
- the histograms vLLM's dashboards read, with vLLM's buckets and labels."""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.parse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from glm53.engine.prometheus import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    _token_buckets,
)
from tests.glm53.faulty_serve import FAULT_PROMPT

TIMEOUT_S = 900  # a first request may compile the server's programs (minutes on a loaded 2-core machine)
GOOD = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}


class Api:
    """A target on 127.0.0.1: `kind` "server" or "router"; `name`: the served model; `key`: its API key
    (None: none needed); `max_model_len` of its servers."""

    def __init__(self, base: str, name: str, kind: str, key: str | None, max_model_len: int):
        self.base, self.name, self.kind, self.key, self.max_model_len = base, name, kind, key, max_model_len
        self.client = openai.OpenAI(base_url=base + "/v1", api_key=key or "unused", max_retries=0, timeout=TIMEOUT_S)
        # the same client on the routes outside /v1 (/tokenize, /detokenize, /version)
        self.root = openai.OpenAI(base_url=base, api_key=key or "unused", max_retries=0, timeout=TIMEOUT_S)

    @property
    def headers(self) -> dict:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}

    def completion(self, **body):
        return self.client.completions.create(model=self.name, **{**GOOD, **body})

    def metrics(self) -> dict:
        """{(sample name, labels but model_name, engine and server): (type, value summed over those)}."""
        text = httpx.get(self.base + "/metrics", timeout=60).text
        out: dict = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                            if k not in ("model_name", "engine", "server"))))
                out[key] = (fam.type, out.get(key, (None, 0.0))[1] + s.value)
        return out

    def value(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), (None, 0.0))[1]

    def idle(self, timeout_s: float = 60) -> dict:
        """Wait until no request runs or waits on any server -> the metrics then."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            busy = sum(v for (n, _), (_, v) in m.items() if n in ("vllm:num_requests_running",
                                                                   "vllm:num_requests_waiting"))
            if busy == 0 or time.monotonic() > deadline:
                assert busy == 0, "requests left running or waiting"
                return m
            time.sleep(0.05)

    def sse(self, path: str, body: dict) -> list:
        """POST with stream=true -> the parsed `data:` events ("[DONE]" as the string)."""
        events = []
        with httpx.stream("POST", self.base + path, json={"model": self.name, **body, "stream": True},
                          headers=self.headers, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        return events


def _status_error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def _check_error(e: openai.APIStatusError, status: int, param: str | None):
    body = e.response.json()
    assert e.status_code == status and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"], body
    if param is not None:
        assert err["param"] == param, body


# ------------------------------------------------------------------------------- bad fields, then good
BAD_COMPLETION = [  # (fields, the param the 400 names, status)
    ({"seed": 2**63}, "seed", 400), ({"seed": -(2**63) - 1}, "seed", 400), ({"seed": "7x"}, "seed", 400),
    ({"seed": True}, "seed", 400), ({"max_tokens": 0}, "max_tokens", 400), ({"max_tokens": "x"}, "max_tokens", 400),
    ({"max_tokens": 126}, "max_tokens", 400),  # 3 + 126 > max_model_len 128: the decode leg's 400 via a router
    ({"max_tokens": 2**70}, "max_tokens", 400), ({"temperature": -1}, "temperature", 400),
    ({"temperature": 1e39}, "temperature", 400), ({"top_p": 0}, "top_p", 400), ({"top_p": 1.5}, "top_p", 400),
    ({"min_tokens": -1}, "min_tokens", 400), ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", 400),
    ({"stop": 5}, "stop", 400), ({"stop_token_ids": [-1]}, "stop_token_ids", 400),
    ({"stop_token_ids": [9999]}, "stop_token_ids", 400), ({"prompt": [1, 600]}, "prompt", 400),
    ({"prompt": [-1]}, "prompt", 400), ({"prompt": [2**70]}, "prompt", 400), ({"prompt": []}, "prompt", 400),
    ({"prompt": ""}, "prompt", 400), ({"prompt": [[]]}, "prompt", 400), ({"prompt": None}, "prompt", 400),
    ({"prompt": [1.5]}, "prompt", 400), ({"prompt": list(range(128))}, "prompt", 400),  # no room under 128
    ({"prompt": [2**63] + [1] * 8}, "prompt", 400),  # a full page of ids no engine hashes (int64)
    ({"cache_salt": 5}, "cache_salt", 400), ({"ignore_eos": "maybe"}, "ignore_eos", 400),
    # lone UTF-16 surrogates: valid JSON escapes, no text (the openai client cannot send them: sent raw)
    ({"prompt": "a\ud800b"}, "prompt", 400), ({"prompt": ["ok", "\udfff"]}, "prompt", 400),
    ({"stop": ["\ud800"]}, "stop", 400), ({"cache_salt": "\ud800"}, "cache_salt", 400),
    ({"user": "\udc00"}, "user", 400),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "\ud800", "remote_port": 5}},
     "kv_transfer_params", 400),
    ({"model": "other"}, "model", 404),
    # the sampler's rules out of range
    ({"presence_penalty": 2.5}, "presence_penalty", 400), ({"frequency_penalty": -3}, "frequency_penalty", 400),
    ({"repetition_penalty": 0}, "repetition_penalty", 400), ({"top_k": -2}, "top_k", 400),
    ({"min_p": 1.5}, "min_p", 400), ({"logit_bias": {"x": 5}}, "logit_bias", 400),
    ({"logit_bias": {"600": 5}}, "logit_bias", 400), ({"logprobs": 21}, "logprobs", 400), ({"n": 0}, "n", 400),
    ({"n": 129}, "n", 400), ({"prompt_logprobs": 21}, "prompt_logprobs", 400),
    # parameters this server does not apply: a 400 naming them unless at their neutral value
    ({"best_of": 2}, "best_of", 400), ({"suffix": "x"}, "suffix", 400),
    ({"use_beam_search": True}, "use_beam_search", 400),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", 400),
    ({"response_format": {"type": "json_object"}}, "response_format", 400),
    ({"structured_outputs": {"json": {}}}, "structured_outputs", 400),
    ({"allowed_token_ids": [1]}, "allowed_token_ids", 400), ({"skip_special_tokens": False}, "skip_special_tokens", 400),
]
BAD_CHAT = [
    ({"messages": []}, "messages", 400), ({"messages": [{"content": "hi"}]}, "messages", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages", 400),
    ({"max_completion_tokens": 0}, "max_completion_tokens", 400), ({"seed": 2**64}, "seed", 400),
    ({"top_logprobs": 2}, "top_logprobs", 400), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
    ({"echo": True}, "echo", 400),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400), ({"tool_choice": "auto"}, "tool_choice", 400),
    ({"n": 0}, "n", 400), ({"continue_final_message": True}, "continue_final_message", 400),
    ({"chat_template": "{{ 1 }}"}, "chat_template", 400), ({"model": "other"}, "model", 404),
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages", 400), ({"stop": "\udc00"}, "stop", 400),
    ({"cache_salt": "\ud800"}, "cache_salt", 400),
]
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "top_k": -1, "min_p": 0,
           "n": 1, "best_of": 1, "echo": False, "logit_bias": {}, "logprobs": None, "suffix": "", "user": "someone",
           "skip_special_tokens": True}


def _ids(fields: dict) -> str:
    return ",".join(f"{k}={ascii(v)[:20]}" for k, v in fields.items())


def _sendable(body: dict) -> bool:
    """Whether the openai client can send `body` (it encodes JSON as UTF-8: no lone surrogates)."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _raw_error(api: Api, path: str, body: dict) -> openai.APIStatusError:
    """POST `body` as ASCII JSON (lone surrogates as \\u escapes, as other clients send them) -> the error
    answer, as the openai client would raise it."""
    r = httpx.post(api.base + path, content=json.dumps(body), timeout=TIMEOUT_S,
                   headers={"content-type": "application/json", **api.headers})
    assert r.status_code >= 400, r.text
    return openai.APIStatusError(r.text, response=r, body=r.json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fields,param,status", BAD_COMPLETION, ids=[_ids(f) for f, _, _ in BAD_COMPLETION])
def test_a_bad_completion_field_is_named_and_the_next_request_succeeds(api, fields, param, status, stream):
    # every field in extra_body: the client sends it as it is, whatever its own types say
    body = {**GOOD, **fields}
    if _sendable(body):
        e = _status_error(lambda: api.client.completions.create(model=api.name, prompt=GOOD["prompt"], stream=stream,
                                                                extra_body=body))
    else:
        e = _raw_error(api, "/v1/completions", {"model": api.name, **body, "stream": stream})
    _check_error(e, status, param)
    r = api.completion(stream=stream)
    if stream:
        r = list(r)
        assert r[-1].choices[0].finish_reason == "length"
    else:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    m = api.idle()
    assert m[("vllm:kv_cache_usage_perc", ())][1] == 0.0  # nothing holds a block


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fields,param,status", BAD_CHAT, ids=[_ids(f) for f, _, _ in BAD_CHAT])
def test_a_bad_chat_field_is_named_and_the_next_request_succeeds(api, fields, param, status, stream):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, **fields}
    if _sendable(body):
        e = _status_error(lambda: api.client.chat.completions.create(
            model=fields.get("model", api.name), messages=body.pop("messages"), stream=stream,
            extra_body={k: v for k, v in body.items() if k != "model"}))
    else:
        e = _raw_error(api, "/v1/chat/completions", {"model": api.name, **body, "stream": stream})
    _check_error(e, status, param)
    assert api.completion().choices[0].finish_reason == "length"
    api.idle()


def test_unapplied_parameters_at_their_neutral_values_are_served(api):
    r = api.completion(extra_body=NEUTRAL)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    body = {**GOOD, "model": api.name, **NEUTRAL, "temperature": 0, "stream": True}
    assert api.sse("/v1/completions", body)[-1] == "[DONE]"
    # a body that is not JSON, JSON that is not an object, NaN: 400 with the same body
    for raw in (b"{not json", b"[1, 2]", b'{"prompt": [1], "temperature": NaN}'):
        r = httpx.post(api.base + "/v1/completions", content=raw, headers=api.headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (raw, r.text)
    assert r.json()["error"]["param"] == "temperature"


# ------------------------------------------------------------------------- sampling, logprobs, n, echo
def _by_choice(chunks) -> dict:
    """A stream's chunks -> {choice index: [its choice objects]}."""
    out: dict = {}
    for ch in chunks:
        for c in ch.choices:
            out.setdefault(c.index, []).append(c)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_with_n_greedy_choices(api, stream):
    """n=2 greedy choices of one prompt: equal tokens, each with its logprobs (the sampled token first in
    top_logprobs, being the most likely: rank 1), text offsets that follow the tokens' texts; usage counts
    the prompt once; return_tokens_as_token_ids names tokens "token_id:N"."""
    kw = dict(model=api.name, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, logprobs=3, n=2,
              extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    if stream:
        chunks = list(api.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        choices = {}
        for i, cs in _by_choice(chunks).items():
            lps = [c.logprobs for c in cs if c.logprobs is not None]
            assert all(len(lp.tokens) == 1 for lp in lps)  # one token per chunk
            ids = [t for c in cs for t in (getattr(c, "token_ids", None) or [])]
            choices[i] = (ids, [x for lp in lps for x in lp.tokens], [x for lp in lps for x in lp.token_logprobs],
                          [x for lp in lps for x in lp.top_logprobs], [x for lp in lps for x in lp.text_offset])
    else:
        r = api.client.completions.create(**kw)
        usage = r.usage
        choices = {c.index: (c.token_ids, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs,
                             c.logprobs.text_offset) for c in r.choices}
    assert sorted(choices) == [0, 1] and usage.prompt_tokens == 4 and usage.completion_tokens == 8
    assert choices[0][0] == choices[1][0] and len(choices[0][0]) == 4
    for ids, tokens, lps, tops, offsets in choices.values():
        assert tokens == [f"token_id:{t}" for t in ids]
        for t, lp, top in zip(ids, lps, tops):
            assert len(top) == 3 and list(top)[0] == f"token_id:{t}" and all(k.startswith("token_id:") for k in top)
            assert lp <= 0 and lp == top[f"token_id:{t}"] == max(top.values())
        assert offsets == [sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_with_n_sampled_choices(api, stream):
    """A chat with logprobs and top_logprobs 2, n=2 sampled choices (seed + choice index: their own draws,
    and the same again for the same seed): each token's entry has 2 alternatives and a logprob <= 0."""
    kw = dict(model=api.name, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=1.0,
              seed=11, n=2, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})

    def run():
        if stream:
            got = {}
            for i, cs in _by_choice(api.client.chat.completions.create(**kw, stream=True)).items():
                got[i] = ([t for c in cs for t in (getattr(c, "token_ids", None) or [])],
                          [e for c in cs if c.logprobs is not None for e in c.logprobs.content])
            return got
        r = api.client.chat.completions.create(**kw)
        return {c.index: (c.token_ids, c.logprobs.content) for c in r.choices}

    first = run()
    assert sorted(first) == [0, 1]
    for ids, content in first.values():
        assert len(ids) == len(content) == 5
        for e in content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode("utf-8"))
            assert e.top_logprobs[0].token == e.token  # vLLM's order: the sampled token first
    assert first[0][0] != first[1][0]  # two draws, not one
    assert {i: ids for i, (ids, _) in run().items()} == {i: ids for i, (ids, _) in first.items()}


def test_logit_bias_top_k_penalties_and_echo_are_applied(api):
    """logit_bias +100 on a token makes it every greedy token; top_k=1 sampling is greedy whatever the
    seed; a presence penalty of 2 with a repetition penalty of 3 changes the greedy output of a repeating
    prompt; echo puts the prompt's text before the output (streamed: in the first chunk)."""
    prompt = [9, 10, 11, 9, 10, 11, 9, 10]
    greedy = api.completion(prompt=prompt, max_tokens=6, extra_body={"return_token_ids": True}).choices[0].token_ids
    biased = api.completion(prompt=prompt, max_tokens=6, logit_bias={"77": 100},
                            extra_body={"return_token_ids": True}).choices[0].token_ids
    assert biased == [77] * 6 != greedy
    for seed in (1, 2):
        top1 = api.completion(prompt=prompt, max_tokens=6, temperature=1.0, seed=seed,
                              extra_body={"top_k": 1, "return_token_ids": True}).choices[0].token_ids
        assert top1 == greedy
    penalized = api.completion(prompt=prompt, max_tokens=6, presence_penalty=2.0, extra_body={
        "return_token_ids": True, "repetition_penalty": 3.0}).choices[0].token_ids
    assert penalized != greedy
    r = api.completion(prompt="echo me", max_tokens=2, echo=True)
    text = api.completion(prompt="echo me", max_tokens=2).choices[0].text
    assert r.choices[0].text == "echo me" + text
    chunks = list(api.client.completions.create(model=api.name, prompt="echo me", max_tokens=2, temperature=0,
                                                echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("echo me") and "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_prompt_logprobs_and_echo_with_logprobs(api):
    """vLLM's prompt_logprobs (extra_body): null for the first prompt token, then per token {id: {logprob,
    rank, decoded_token}} of the token and its top alternatives; a prompt extended by its own greedy output
    gives those tokens the logprobs their decode gave them (the prefill and decode paths agree); echo with
    logprobs puts the prompt's entries (the first null) before the output's, whole and streamed alike;
    chat's prompt_logprobs sit on the response. A stream cannot carry prompt_logprobs > 0 (vLLM's 400)."""
    prompt = [5, 9, 14, 3, 8, 8, 2, 30, 7]
    out = api.completion(prompt=prompt, max_tokens=3, logprobs=2, extra_body={"return_token_ids": True}).choices[0]
    full = prompt + out.token_ids[:2]
    plp = api.completion(prompt=full, max_tokens=1, extra_body={"prompt_logprobs": 3}).choices[0].prompt_logprobs
    assert len(plp) == len(full) and plp[0] is None
    for q in range(1, len(full)):
        entry = plp[q]
        mine = entry[str(full[q])]
        top = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in top[:3]] == [1, 2, 3] and (len(entry) == 3 or len(entry) == 4 and mine["rank"] > 3)
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:])) and mine["logprob"] <= 0
    detok = api.root.post("/detokenize", cast_to=object, body={"tokens": [full[1]]})["prompt"]
    assert plp[1][str(full[1])]["decoded_token"] == detok
    for j in range(2):  # the output's tokens, as prompt tokens of the longer request
        assert plp[len(prompt) + j][str(full[len(prompt) + j])]["logprob"] == pytest.approx(
            out.logprobs.token_logprobs[j], abs=2e-3)
    whole = api.completion(prompt=prompt, max_tokens=3, logprobs=2, echo=True).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[: len(prompt)] == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(prompt))]
    for q in range(1, len(prompt)):
        assert lp.token_logprobs[q] == pytest.approx(plp[q][str(prompt[q])]["logprob"], abs=2e-3)
        assert len(lp.top_logprobs[q]) <= 3 and lp.tokens[q] in lp.top_logprobs[q]
    assert lp.token_logprobs[len(prompt):] == pytest.approx(out.logprobs.token_logprobs, abs=2e-3)
    assert len(whole.prompt_logprobs) == len(prompt)  # echo with logprobs computes them, as vLLM's
    chunks = list(api.client.completions.create(model=api.name, prompt=prompt, max_tokens=3, temperature=0,
                                                logprobs=2, echo=True, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    e = _status_error(lambda: api.completion(prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1}))
    _check_error(e, 400, "prompt_logprobs")
    chat = api.client.chat.completions.create(model=api.name, messages=[{"role": "user", "content": "hi"}],
                                              max_completion_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and chat.prompt_logprobs[0] is None
    assert all(len(e) == 1 for e in chat.prompt_logprobs[1:])  # 0 alternatives: the token alone
    api.idle()


# -------------------------------------------------------------------------------------- stop strings
def _stop_case(api, prompt: list[int]):
    """Greedy tokens of `prompt` and a stop string that first ends in the text at token k >= 1 -> (tokens,
    stop, k), or None when its text offers none."""
    r = api.completion(prompt=prompt, max_tokens=10, extra_body={"return_token_ids": True})
    tokens = r.choices[0].token_ids
    texts = [api.root.post("/detokenize", cast_to=object, body={"tokens": tokens[:k]})["prompt"]
             for k in range(len(tokens) + 1)]
    for k in range(1, len(tokens) - 1):
        new = texts[k + 1][len(texts[k]):]
        if texts[k + 1].startswith(texts[k]) and new and "\ufffd" not in new and texts[k + 1].find(new) == len(texts[k]):
            return tokens, new, k, texts[k]
    return None


@pytest.fixture(scope="module")
def stop_cases(api):
    cases = []
    for p in ([11, 12, 13, 14, 15], [40, 41, 42], [200, 100, 50, 25], [1, 2, 3, 4], [300, 301, 302, 303, 304, 305]):
        case = _stop_case(api, p)
        if case is not None:
            cases.append((p, *case))
        if len(cases) == 2:
            return cases
    pytest.fail("no greedy output of the candidate prompts holds a usable stop string")


def test_a_stop_string_ends_the_request_as_a_stop_in_every_mode(api, stop_cases):
    (p, tokens, stop, k, text), (p2, tokens2, stop2, k2, text2) = stop_cases
    before = api.idle()
    stops = 0
    # whole
    r = api.completion(prompt=p, max_tokens=10, stop=[stop], extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert (c.finish_reason, c.stop_reason, c.text, c.token_ids) == ("stop", stop, text, tokens[:k + 1])
    assert r.usage.completion_tokens == k + 1 and r.usage.prompt_tokens == len(p)
    stops += 1
    # streamed, with usage: the text adds up, the last token's chunk says stop, then usage, then [DONE]
    events = api.sse("/v1/completions", {"prompt": p, "max_tokens": 10, "temperature": 0, "stop": stop,
                                         "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == k + 1 and events[-2]["choices"] == []
    chunks = [e["choices"][0] for e in events[:-2]]
    assert "".join(ch["text"] for ch in chunks) == text
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)
    assert all(ch["finish_reason"] is None for ch in chunks[:-1])
    stops += 1
    # continuous_usage_stats (guidellm asks for it): every chunk carries the usage so far, as vLLM's
    events = api.sse("/v1/completions", {"prompt": p, "max_tokens": 10, "temperature": 0, "stop": stop,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [*range(1, k + 2), k + 1]
    assert all(e["usage"]["prompt_tokens"] == len(p) for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == text
    stops += 1
    # the openai client's stream
    got = list(api.client.completions.create(model=api.name, prompt=p, max_tokens=10, temperature=0, stop=stop,
                                             stream=True, stream_options={"include_usage": True}))
    assert got[-1].usage.completion_tokens == k + 1 and got[-2].choices[0].finish_reason == "stop"
    assert "".join(g.choices[0].text for g in got[:-1]) == text
    stops += 1
    if api.kind == "server":  # batched (the router takes one prompt per request)
        r = api.completion(prompt=[p, p2], max_tokens=10, stop=[stop, stop2])
        assert [(c.finish_reason, c.stop_reason) for c in r.choices] == [("stop", stop), ("stop", stop2)]
        assert [c.text for c in r.choices] == [text, text2] and r.usage.completion_tokens == k + k2 + 2
        events = api.sse("/v1/completions", {"prompt": [p, p2], "max_tokens": 10, "temperature": 0,
                                             "stop": [stop, stop2], "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == k + k2 + 2
        last = {e["choices"][0]["index"]: e["choices"][0] for e in events[:-2]}
        assert [(last[i]["finish_reason"], last[i]["stop_reason"]) for i in (0, 1)] == [("stop", stop), ("stop", stop2)]
        stops += 4
    after = api.idle()
    key = ("vllm:request_success_total", (("finished_reason", "stop"),))
    assert after[key][1] - before[key][1] == stops
    assert after[("vllm:kv_cache_usage_perc", ())][1] == 0.0


def test_a_stop_token_ends_the_request_without_its_text(api):
    """vLLM drops the text of the token that terminated a request (its id stays in token_ids and is the
    stop_reason), whole and streamed."""
    def detok(ids):
        return api.root.post("/detokenize", cast_to=object, body={"tokens": ids})["prompt"]

    # a prompt whose greedy output has a token k >= 1 not seen before it that adds text
    for p in ([21, 22, 23, 24], [11, 12, 13, 14, 15], [40, 41, 42], [200, 100, 50, 25], [300, 301, 302, 303]):
        tokens = api.completion(prompt=p, max_tokens=8, extra_body={"return_token_ids": True}).choices[0].token_ids
        k = next((k for k in range(1, len(tokens))
                  if tokens[k] not in tokens[:k] and detok(tokens[:k + 1]) != detok(tokens[:k])), None)
        if k is not None:
            break
    else:
        pytest.fail("no candidate prompt's greedy output has a new token that adds text")
    text = detok(tokens[:k])
    r = api.completion(prompt=p, max_tokens=8, extra_body={"return_token_ids": True, "stop_token_ids": [tokens[k]]})
    c = r.choices[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("stop", tokens[k], tokens[:k + 1], text)
    events = api.sse("/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0, "stop_token_ids": [tokens[k]]})
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(ch["text"] for ch in chunks) == text and chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["stop_reason"] == tokens[k]


def test_seeds_anywhere_in_int64_give_equal_tokens_for_equal_seeds_and_other_tokens_for_others(api):
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 1.0, "extra_body": {"return_token_ids": True}}
    seeds = (-1, 2**63 - 1, -(2**63), 2**32, 0, 1)
    outs = {}
    for seed in seeds:
        a = api.completion(seed=seed, **body).choices[0].token_ids
        b = api.completion(seed=seed, **body).choices[0].token_ids
        assert a == b and len(a) == 5, seed
        events = api.sse("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 1.0, "seed": seed,
                                             "return_token_ids": True})
        assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []] == a, seed
        outs[seed] = tuple(a)
    # a server that ignored the seed (one fixed draw for all) would give one sequence; the servers' model's
    # temperature-1 draws of 5 tokens over 512 ids differ between these seeds
    assert len(set(outs.values())) == len(seeds), outs


# ------------------------------------------------------------------------------------- a failed step
def test_a_failed_step_fails_its_request_and_the_server_serves_on(api):
    before = api.idle()
    e = _status_error(lambda: api.completion(prompt=FAULT_PROMPT, max_tokens=4))
    _check_error(e, 500, None)
    assert "injected" in e.response.json()["error"]["message"]
    failed = 1
    if api.kind == "server":  # streamed, the request's last chunk says "error"; usage and [DONE] follow
        events = api.sse("/v1/completions", {"prompt": FAULT_PROMPT, "max_tokens": 4,
                                             "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 0
        assert events[-3]["choices"][0]["finish_reason"] == "error"
    else:  # through a router the prefill leg fails before any stream opens: its JSON 500 is the answer
        _check_error(_status_error(lambda: list(api.completion(prompt=FAULT_PROMPT, stream=True))), 500, None)
    failed += 1
    r = api.completion(prompt=FAULT_PROMPT[:4] + [1], max_tokens=3)  # the next request is served
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert httpx.get(api.base + "/health", timeout=30).status_code == 200
    after = api.idle()
    key = ("vllm:request_success_total", (("finished_reason", "error"),))
    assert after[key][1] - before[key][1] == failed
    assert after[("vllm:kv_cache_usage_perc", ())][1] == 0.0  # the failed requests' blocks are back


# ----------------------------------------------------------------------------- the rest of the surface
def test_one_error_shape_for_every_status(api):
    for method, path, status in (("GET", "/no/such/route", 404), ("GET", "/v1/completions", 405),
                                 ("POST", "/health", 405)):
        r = httpx.request(method, api.base + path, headers=api.headers, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert r.json()["error"]["code"] == status
    # a body over the limit: refused by its Content-Length, before it is sent
    u = urllib.parse.urlsplit(api.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in {"content-type": "application/json", "content-length": str(1 << 30), **api.headers}.items():
        conn.putheader(k, v)
    conn.endheaders()
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    assert r.status == 413 and body["error"]["code"] == 413
    _check_error(_status_error(lambda: api.client.models.retrieve("no-such-model")), 404, "model")


def test_models_tokenize_detokenize_and_version(api):
    models = api.client.models.list()
    assert [m.id for m in models.data] == [api.name]
    card = api.client.models.retrieve(api.name)
    assert card.id == api.name and card.model_extra["max_model_len"] == api.max_model_len
    out = api.root.post("/tokenize", cast_to=object, body={"model": api.name, "prompt": "tokens, please",
                                                           "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 0 and out["max_model_len"] == api.max_model_len
    back = api.root.post("/detokenize", cast_to=object, body={"model": api.name, "tokens": out["tokens"]})
    assert back == {"prompt": "tokens, please"}
    r = api.completion(prompt="tokens, please", max_tokens=1)
    assert r.usage.prompt_tokens == out["count"]  # /tokenize encodes as the completions endpoint does
    for body, param in (({"tokens": [1, 99999]}, "tokens"), ({"tokens": [-1]}, "tokens"), ({"prompt": 5}, "prompt")):
        path = "/detokenize" if "tokens" in body else "/tokenize"
        _check_error(_status_error(lambda: api.root.post(path, cast_to=object, body=body)), 400, param)
    for body, param in (({"prompt": "x\ud800"}, "prompt"), ({"messages": [{"role": "user", "content": "\udfff"}]},
                                                            "messages")):
        _check_error(_raw_error(api, "/tokenize", body), 400, param)
    assert api.root.post("/tokenize", cast_to=object, body={"prompt": "ok"})["count"] == 2
    version = api.root.get("/version", cast_to=object)
    assert set(version) == {"version"} and version["version"]


def test_vllms_histograms_with_their_buckets_and_labels(api):
    before = api.idle()
    api.completion(prompt=[9, 8, 7, 6], max_tokens=5)
    m = api.idle()
    le = {}
    for (name, labels), (kind, _) in m.items():
        if name.endswith("_bucket"):
            assert kind == "histogram", name
            le.setdefault(name[:-len("_bucket")], set()).add(dict(labels)["le"])

    def bounds(values):
        return {str(float(v)) for v in values} | {"+Inf"}

    tokens = _token_buckets(api.max_model_len)
    for name, want in (("vllm:request_time_per_output_token_seconds", ITL_BUCKETS),
                       ("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS),
                       ("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS),
                       ("vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS),
                       ("vllm:request_params_max_tokens", tokens), ("vllm:request_params_n", N_BUCKETS),
                       ("vllm:iteration_tokens_total", ITERATION_TOKENS_BUCKETS)):
        assert le.get(name) == bounds(want), name

    def grew(name):
        return m[(name, ())][1] - before.get((name, ()), (None, 0.0))[1]

    assert grew("vllm:request_params_max_tokens_count") >= 1 and grew("vllm:request_params_n_sum") >= 1
    assert grew("vllm:request_params_max_tokens_sum") >= 5 and grew("vllm:iteration_tokens_total_sum") >= 4 + 5
    assert grew("vllm:request_time_per_output_token_seconds_count") >= 1
    assert math.isfinite(m[("vllm:request_decode_time_seconds_sum", ())][1])
