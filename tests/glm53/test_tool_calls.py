"""Tool calls and reasoning end to end, through the official `openai` client, against a real server process
(`--enable-auto-tool-choice --tool-call-parser glm45 --reasoning-parser glm45` on the tiny preset's chat
template) and the router in front of it (its prefill and decode legs both on that server). The server's
runner replays the text each prompt asks for (tests/glm53/replay_serve.py: no model, nothing compiles),
so the test decides the model's output: a multi-turn agent loop (a call with reasoning, the tool's result,
the answer), whole and streamed; tool_choice "none", "required" and a named function; thinking turned off;
bad tool requests named."""

import json

import httpx
import openai
import pytest

from tests.glm53.replay_serve import say
from tests.glm53.test_router import Router
from tests.glm53.test_serve import NAME, Server

FLAGS = ("--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching",
         "--enable-auto-tool-choice", "--tool-call-parser", "glm45", "--reasoning-parser", "glm45")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}}}},
]
CALL = ("Paris needs a lookup.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris, Île-de-France</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
ANSWER = "The tool says 22 °C.</think>It is 22 °C and sunny in Paris."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("tiny", tmp_path_factory.mktemp("tools"), *FLAGS, module="tests.glm53.replay_serve")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    r = Router(tmp_path_factory.mktemp("tools_router"), [server.url("")], [server.url("")], {})
    yield r
    r.proc.terminate()
    r.proc.wait(30)


@pytest.fixture(params=["server", "router"])
def client(request, server, router):
    base = (server if request.param == "server" else router).url("/v1")
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def _ask(client, messages, stream: bool, **kw):
    """-> (reasoning_content, content, [(id, name, arguments)], finish_reason, argument pieces), whole or
    assembled from the stream's deltas as a client does."""
    if "chat_template_kwargs" in kw:  # vLLM's field, not the openai client's
        kw["extra_body"] = {"chat_template_kwargs": kw.pop("chat_template_kwargs")}
    if not stream:
        r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, **kw)
        m, reason = r.choices[0].message, r.choices[0].finish_reason
        calls = [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []]
        return getattr(m, "reasoning_content", None), m.content, calls, reason, None
    reasoning = content = None
    calls: list[list] = []
    pieces = 0
    reason = None
    for chunk in client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if (r := getattr(d, "reasoning_content", None)) is not None:
            reasoning = (reasoning or "") + r
        if d.content:
            content = (content or "") + d.content
        for t in d.tool_calls or []:
            if t.id is not None:
                assert t.index == len(calls) and t.function.name
                calls.append([t.id, t.function.name, ""])
            if t.function and t.function.arguments:
                calls[t.index][2] += t.function.arguments
                pieces += 1
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, [tuple(c) for c in calls], reason, pieces


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_agent_loop_calls_a_tool_reads_its_result_and_answers(client, stream):
    messages = [{"role": "system", "content": "You are a weather agent."},
                {"role": "user", "content": "Weather in Paris? " + say(CALL)}]
    reasoning, content, calls, reason, pieces = _ask(client, messages, stream, temperature=0)
    assert reasoning == "Paris needs a lookup." and content == "Let me check." and reason == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris, Île-de-France", "days": 2})]
    if stream:  # the arguments came as they were written, not in one piece at the end
        assert pieces > 10
    call_id = calls[0][0]
    messages += [
        {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": calls[0][1], "arguments": calls[0][2]}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 22, "sky": "sunny"} ' + say(ANSWER)}]
    reasoning, content, calls, reason, _ = _ask(client, messages, stream, temperature=0)
    assert (reasoning, content, calls, reason) == ("The tool says 22 °C.", "It is 22 °C and sunny in Paris.", [],
                                                   "stop")


def test_the_second_turns_prompt_holds_the_call_and_the_result(server):
    """The server renders the assistant's call (arguments sent as a JSON string) and the tool's result in
    GLM-5.3's format: what /tokenize gives the engine."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ids = httpx.post(server.url("/tokenize"), json={"messages": messages, "tools": TOOLS}, timeout=60).json()["tokens"]
    text = httpx.post(server.url("/detokenize"), json={"tokens": ids}, timeout=60).json()["prompt"]
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools") and '"name": "get_weather"' in text
    assert text.endswith("<|user|>Weather?<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key>"
                         "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
                         "<|observation|><tool_response>sunny</tool_response><|assistant|><think>")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_none_required_and_named(client, stream):
    text = "<tool_call>run<arg_key>cmd</arg_key><arg_value>ls</arg_value></tool_call>"
    # "none": the same text is content, nothing is parsed (the reasoning split still is)
    msgs = [{"role": "user", "content": say("ok</think>" + text)}]
    assert _ask(client, msgs, stream, tool_choice="none")[1:4] == (text, [], "stop")
    # "required": the prompt ends inside "<tool_call>" (thinking closed), the model writes the rest
    msgs = [{"role": "user", "content": say("run<arg_key>cmd</arg_key><arg_value>make test</arg_value></tool_call>")}]
    reasoning, content, calls, reason, _ = _ask(client, msgs, stream, tool_choice="required")
    assert (reasoning, content, reason) == (None, None, "tool_calls")
    assert [(n, json.loads(a)) for _, n, a in calls] == [("run", {"cmd": "make test"})]
    # a named function: the prompt ends after its name
    msgs = [{"role": "user", "content": say("<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>")}]
    _, _, calls, reason, _ = _ask(client, msgs, stream,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Rome"})] and reason == "tool_calls"


def test_thinking_off_and_several_calls(client):
    msgs = [{"role": "user", "content": say("Two calls:<tool_call>run<arg_key>cmd</arg_key><arg_value>a</arg_value>"
                                            "</tool_call><tool_call>run<arg_key>cmd</arg_key><arg_value>b</arg_value>"
                                            "</tool_call>")}]
    reasoning, content, calls, reason, _ = _ask(client, msgs, False, chat_template_kwargs={"enable_thinking": False})
    assert (reasoning, content, reason) == (None, "Two calls:", "tool_calls")
    assert [json.loads(a) for _, _, a in calls] == [{"cmd": "a"}, {"cmd": "b"}] and calls[0][0] != calls[1][0]


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "run", "arguments": "not json"}}]}]}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
])
def test_a_bad_tool_request_is_a_400_naming_the_field_and_the_next_succeeds(client, fields, param):
    body = {"messages": [{"role": "user", "content": say("fine")}], "tools": TOOLS, **fields}
    if body["tools"] is None:
        del body["tools"]
    if "chat_template_kwargs" in body:
        body["extra_body"] = {"chat_template_kwargs": body.pop("chat_template_kwargs")}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, **body)
    assert info.value.response.json()["error"]["param"] == param
    assert _ask(client, [{"role": "user", "content": say("x</think>fine")}], False)[1:4] == ("fine", [], "stop")
