"""glm53.parsers on fixed texts (GLM-4.5-family tool calls and `<think>` reasoning) and the presets' chat
templates: whole outputs, the same outputs split into two pieces at every position and one character at a
time (the joined pieces must equal the whole answer, and a call's `arguments` must only grow), malformed
text, several calls, no call; the template renders what the parser reads back."""

import json

import pytest

from glm53.parsers import ChatOutput, Glm45ToolParser
from glm53.tokenizer import ByteTokenizer, load_tokenizer, render_chat

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}, "env": {"type": "object"}}}}},
]

# (output text, think_open, expected (reasoning, content, [(name, arguments object)]))
CASES = {
    "one call, GLM-5.3 form": (
        '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris "FR"</arg_value>'
        '<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>', None,
        (None, None, [("get_weather", {"city": 'Paris "FR"', "days": 3})])),
    "GLM-4.5 form with newlines, content before": (
        "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Köln ☃</arg_value>\n</tool_call>",
        None, (None, "Let me look.\n", [("get_weather", {"city": "Köln ☃"})])),
    "several calls, JSON and Python literals": (
        "<tool_call>run<arg_key>cmd</arg_key><arg_value>ls -la</arg_value><arg_key>env</arg_key>"
        '<arg_value>{"A": [1, 2.5, null]}</arg_value></tool_call>\n<tool_call>get_weather'
        "<arg_key>city</arg_key><arg_value>  Oslo </arg_value><arg_key>days</arg_key><arg_value> True </arg_value>"
        "<arg_key>extra</arg_key><arg_value>not json</arg_value></tool_call>", None,
        (None, None, [("run", {"cmd": "ls -la", "env": {"A": [1, 2.5, None]}}),
                      ("get_weather", {"city": "  Oslo ", "days": True, "extra": "not json"})])),
    "no call": ("Just an answer, with a < and a <tool but no call.", None,
                (None, "Just an answer, with a < and a <tool but no call.", [])),
    "reasoning then a call (the prompt opened <think>)": (
        "Paris is in France.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
        "</arg_value></tool_call>", True,
        ("Paris is in France.", "Checking.", [("get_weather", {"city": "Paris"})])),
    "reasoning the model opens itself": (
        "\n<think>a <tool_call>inside thinking is reasoning</tool_call></think>The answer.", False,
        ("a <tool_call>inside thinking is reasoning</tool_call>", "The answer.", [])),
    "reasoning cut off by max_tokens": ("still thinking </thi", True, ("still thinking </thi", None, [])),
    "a <think> later in the text is content": (
        "Answer: <think>x</think>", False, (None, "Answer: <think>x</think>", [])),
    "a call without a name is content": (
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>ok", None,
        (None, "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>ok", [])),
    "junk between arguments, a key without a value, no arguments": (
        "<tool_call>get_weather junk<arg_key>city</arg_key>noise<arg_value>x</arg_value>"
        "<arg_key>days</arg_key>\n <arg_value>2</arg_value><arg_key>orphan</arg_key></tool_call>"
        "<tool_call>run</tool_call>", None,
        (None, None, [("get_weather junk", {"days": 2}), ("run", {})])),
    "a call cut off in a string value": (
        "<tool_call>run<arg_key>cmd</arg_key><arg_value>echo hi</arg_va", None,
        (None, None, [("run", {"cmd": "echo hi</arg_va"})])),
    "a call cut off in a non-string value": (
        "<tool_call>get_weather<arg_key>days</arg_key><arg_value>1", None,
        (None, None, [("get_weather", {"days": 1})])),
    "a call cut off in its name is content": ("Calling <tool_call>get_wea", None,
                                              (None, "Calling <tool_call>get_wea", [])),
    "content between and after calls": (
        "a<tool_call>run</tool_call>b<tool_call>run</tool_call>c<tool_cal", None,
        (None, "abc<tool_cal", [("run", {}), ("run", {})])),
}


def _output(think_open, tools=TOOLS, forced=""):
    return ChatOutput(think_open, Glm45ToolParser(tools) if tools is not None else None, forced)


def _whole(text, think_open, tools=TOOLS):
    o = _output(think_open, tools)
    o.feed(text, final=True)
    return o.reasoning_content, o.final_content, [(n, json.loads(a)) for _, n, a in o.calls], o


def _streamed(pieces, think_open, tools=TOOLS):
    """Feed the pieces -> (reasoning, content, calls as (name, arguments)) joined from the deltas alone."""
    o = _output(think_open, tools)
    reasoning, content, calls = "", "", []
    for i, p in enumerate(pieces + [""]):
        d = o.feed(p, final=i == len(pieces))
        reasoning += d.reasoning
        content += d.content
        for t in d.tool_calls:
            if t.id is not None:
                assert t.index == len(calls) and t.name
                calls.append([t.id, t.name, ""])
            else:
                assert t.name is None and 0 <= t.index < len(calls)
            calls[t.index][2] += t.arguments
    assert [c[0] for c in calls] == [c[0] for c in o.calls]
    return reasoning, content, [(n, a) for _, n, a in calls], o


@pytest.mark.parametrize("name", list(CASES))
def test_a_whole_output(name):
    text, think_open, (reasoning, content, calls) = CASES[name]
    got_r, got_c, got_calls, o = _whole(text, think_open)
    assert (got_r, got_c, got_calls) == (reasoning, content, calls)
    for _, _, args in o.calls:  # arguments are JSON text as json.dumps writes it
        assert args == json.dumps(json.loads(args), ensure_ascii=False)


@pytest.mark.parametrize("name", list(CASES))
def test_split_at_every_position_and_char_by_char_equals_the_whole(name):
    text, think_open, _ = CASES[name]
    _, _, _, whole = _whole(text, think_open)
    want = (whole.reasoning, whole.content, [(n, a) for _, n, a in whole.calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        r, c, calls, o = _streamed(pieces, think_open)
        assert (r, c, calls) == want, pieces
        assert (o.reasoning_content, o.final_content) == (whole.reasoning_content, whole.final_content)


def test_arguments_stream_as_they_become_certain():
    """A string value goes out character by character; a number waits for its </arg_value>; the closing
    brace waits for </tool_call>; a partial closing tag is held back, then released if it was not one."""
    o = _output(None)
    seen = []
    prefix = '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa'
    for piece in [prefix, "ris</arg_v", "x</arg_value><arg_key>days</arg_key><arg_value>1", "2</arg_value>",
                  "</tool_call>"]:
        d = o.feed(piece)
        seen.append("".join(t.arguments for t in d.tool_calls))
    assert seen == ['{"city": "Pa', "ris", '</arg_vx", ', '"days": 12', "}"]
    assert json.loads(o.calls[0][2]) == {"city": "Paris</arg_vx", "days": 12}


def test_without_tools_everything_is_content_and_without_a_reasoning_parser_no_split():
    text = "<think>r</think><tool_call>run</tool_call>"
    r, c, calls, o = _whole(text, None, tools=None)
    assert (r, c, calls) == (None, text, [])
    r, c, calls, o = _whole(text, False, tools=None)
    assert (r, c, calls) == ("r", "<tool_call>run</tool_call>", [])


def test_a_forced_call_is_parsed_from_the_prompts_tail():
    suffix, parsed = Glm45ToolParser.forced("...<|assistant|><think>", "run")
    assert (suffix, parsed) == ("</think><tool_call>run", "<tool_call>run")
    assert Glm45ToolParser.forced("...<|assistant|></think>", None) == ("<tool_call>", "<tool_call>")
    o = _output(False, forced=parsed)
    d = o.feed("<arg_key>cmd</arg_key><arg_value>make</arg_value></tool_call>", final=True)
    assert d.tool_calls[0].name == "run" and json.loads(o.calls[0][2]) == {"cmd": "make"}
    assert o.final_content is None


# ------------------------------------------------------------------------------------------ templates
def test_every_preset_has_the_glm53_template_and_a_checkpoints_own_or_the_flags_wins(tmp_path):
    from glm53.config import PRESETS

    rendered = set()
    for preset in PRESETS:
        tok = load_tokenizer(preset)
        assert isinstance(tok, ByteTokenizer) and tok.chat_template
        rendered.add(render_chat(tok, [{"role": "user", "content": "hi"}]))
    assert rendered == {"[gMASK]<sop><|user|>hi<|assistant|><think>"}
    own = tmp_path / "t.jinja"
    own.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert render_chat(load_tokenizer("tiny", own), [{"role": "user", "content": "hi"}]) == "[user]hi"


def test_the_template_renders_a_tool_loop_that_the_parser_reads_back():
    """The assistant's call, rendered as the template writes it, parses back to the same call; the tools
    block is JSON (no HTML escaping); tool results follow one <|observation|>; reasoning is kept only after
    the last user turn; enable_thinking false closes the thinking in the generation prompt."""
    tok = load_tokenizer("tiny")
    call = {"name": "get_weather", "arguments": {"city": "Paris <1>", "days": 2, "units": "metric"}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "old", "reasoning_content": "dropped"},
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "need data",
             "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "content": "22C"}]
    text = render_chat(tok, msgs, True, TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text and "\\u003c" not in text
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert "<|assistant|></think>old<|user|>Paris?<|assistant|><think>need data</think><tool_call>" in text
    assert text.endswith("</tool_call><|observation|><tool_response>sunny</tool_response>"
                         "<tool_response>22C</tool_response><|assistant|><think>")
    rendered_call = text[text.index("<tool_call>get_weather"):text.index("</tool_call><|observation|>") + 12]
    _, content, calls, _ = _whole(rendered_call, None)
    assert content is None and calls == [(call["name"], call["arguments"])]
    assert render_chat(tok, msgs[:2], True, None, enable_thinking=False).endswith("<|assistant|></think>")
    with pytest.raises(Exception, match="role"):
        render_chat(tok, [{"role": "robot", "content": "x"}])


def test_an_answer_of_no_text_is_empty_content_not_none():
    """vLLM's message.content: "" for an answer with no text (the byte tokenizer decodes ids >= 256 to
    nothing), None only beside tool calls or reasoning."""
    for think_open in (None, False):
        o = _output(think_open)
        o.feed("", final=True)
        assert o.final_content == "" and o.reasoning_content is None
    o = _output(True)
    o.feed("only thoughts</think>", final=True)
    assert (o.reasoning_content, o.final_content) == ("only thoughts", None)
