"""The chat endpoint's output parsers, GLM-4.5-family format: tool calls (`--tool-call-parser glm45` or
`glm47`) and reasoning (`--reasoning-parser glm45`), as vLLM's parsers of those names expose them.

The model writes

    <think>REASONING</think>CONTENT<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>

(GLM-4.5 puts a newline after NAME and between the tags; GLM-4.7 and GLM-5.3 do not: both parse alike,
so "glm45" and "glm47" name one parser). The client sees `reasoning_content`, `content`, and `tool_calls`
whose `arguments` is a JSON object: a value whose parameter the request's tool declares `"type":
"string"` stays the text between the tags; any other is read as JSON (else as a Python literal, else kept
as text).

Streaming is the contract here: `ChatOutput.feed` takes a choice's text in any pieces and returns what
each piece completes; the reasoning, content and each call's name and `arguments` strings, joined over
the pieces, are the same whatever the split, and equal what one call on the whole text returns (that is
how the non-streamed answer is made). A call's name goes out once the name ends (at a newline, an
`<arg_key>` or `</tool_call>`), its `arguments` as they become certain: "{" at once, a string value
character by character, any other value once its `</arg_value>` arrives, "}" at `</tool_call>`. Text
that may be the start of a tag is held back until the next piece tells.

Malformed text (the rules, stream and whole alike): a `<tool_call>` whose name is empty is content; one
left open at the end of the output (max_tokens, a stop) is a call if its name ended, its arguments closed
with what had arrived (a value without `</arg_value>` taken as complete); junk between argument tags is
skipped; a `<think>` that is not the first thing the model writes is content. Reasoning is split off
first, so a tool call inside `<think>` is reasoning, as in vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"

_KEY = re.escape(KEY_START) + r"((?:(?!" + re.escape(KEY_END) + r").)*?)" + re.escape(KEY_END)  # one key: no </arg_key>
_PAIR = re.compile(_KEY + r"\s*" + re.escape(VALUE_START) + r"(.*?)" + re.escape(VALUE_END), re.DOTALL)
_OPEN_PAIR = re.compile(_KEY + r"\s*" + re.escape(VALUE_START) + r"(.*)\Z", re.DOTALL)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what must wait for more text)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _read_value(text: str) -> Any:
    """A non-string argument's text -> its value: JSON, else a Python literal (True, None, 'x'), else the
    text itself; only values JSON can write back."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    if len(text) <= 100_000:  # literal_eval's parser recurses: bound what a model's output may make it do
        try:
            value = ast.literal_eval(text)
            _json(value)
            return value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return text


# ------------------------------------------------------------------------------------------ tool calls
@dataclasses.dataclass
class ToolCallDelta:
    """A piece of call `index`: its id, name (once) and the next piece of its `arguments` string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Glm45ToolParser:
    """GLM-4.5-family tool calls (the module docstring). tools: the request's `tools` (OpenAI's dicts),
    read for which arguments are strings."""

    names = ("glm45", "glm47")

    def __init__(self, tools: list[dict] | None):
        self.string_args: dict[str, set[str]] = {}
        for t in tools or []:
            fn = t.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties") or {}
            self.string_args[fn.get("name")] = {k for k, p in props.items() if isinstance(p, dict) and (
                p.get("type") == "string" or isinstance(p.get("type"), list) and p["type"] == ["string"])}

    @staticmethod
    def forced(prompt: str, function: str | None) -> tuple[str, str]:
        """tool_choice "required" (function None) or a named function: what to append to the rendered prompt so
        the model continues inside a call (thinking, if the prompt opened it, closed first), and the part of
        it that belongs to the model's output (for the parser)."""
        call = CALL_START + (function or "")
        return (THINK_END if prompt.endswith(THINK_START) else "") + call, call

    def region(self, inner: str, complete: bool) -> tuple[str | None, str]:
        """One call's text between `<tool_call>` and `</tool_call>` (all of it if `complete`, else what has
        arrived, a possible partial `</tool_call>` removed) -> (its name, or None while the name has not
        ended or when it is empty; the longest start of its `arguments` that more text cannot change)."""
        ends = [i for i in (inner.find("\n"), inner.find(KEY_START)) if i >= 0]
        if not ends and not complete:
            return None, ""
        cut = min(ends) if ends else len(inner)
        name = inner[:cut].strip()
        if not name:
            return None, ""
        body = inner[cut:]
        strings = self.string_args.get(name, set())

        def value(key: str, text: str) -> str:
            return _json(text) if key in strings else _json(_read_value(text))

        parts, last = [], 0
        for m in _PAIR.finditer(body):
            parts.append(f"{_json(m.group(1).strip())}: {value(m.group(1).strip(), m.group(2))}")
            last = m.end()
        tail = _OPEN_PAIR.search(body, last)
        if tail is not None:
            key, text = tail.group(1).strip(), tail.group(2)
            if complete:  # a value the output never closed: what there is
                parts.append(f"{_json(key)}: {value(key, text)}")
            elif key in strings:
                text = text[:len(text) - _partial_tag(text, VALUE_END)]
                parts.append(f"{_json(key)}: {_json(text)[:-1]}")  # JSON escapes character by character
        out = "{" + ", ".join(parts)
        if complete:
            return name, out + "}"
        if tail is not None and tail.group(1).strip() not in strings:
            # a non-string value waits whole; what precedes it is certain, and so is the comma after it
            return name, out + (", " if parts else "")
        return name, out


class ToolCallStream:
    """One output's tool calls as its content arrives: `feed(piece)` -> (content, [ToolCallDelta]);
    `feed("", final=True)` at the end."""

    def __init__(self, parser: Glm45ToolParser):
        self.parser = parser
        self.text = ""
        self.pos = 0  # text[:pos] is done: content sent, calls closed
        self.calls: list[list[str]] = []  # per call: [id, arguments sent]
        self.open = False  # calls[-1] is the call that starts at pos, still open

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.text += piece
        content, deltas = [], []
        while self.pos < len(self.text):
            start = self.text.find(CALL_START, self.pos)
            if start < 0:
                keep = 0 if final else _partial_tag(self.text[self.pos:], CALL_START)
                content.append(self.text[self.pos:len(self.text) - keep])
                self.pos = len(self.text) - keep
                break
            content.append(self.text[self.pos:start])
            self.pos = start
            inner_at = start + len(CALL_START)
            end = self.text.find(CALL_END, inner_at)
            complete = end >= 0 or final
            inner = self.text[inner_at:end] if end >= 0 else self.text[inner_at:]
            if not complete:
                inner = inner[:len(inner) - _partial_tag(inner, CALL_END)]
            name, args = self.parser.region(inner, complete)
            if end < 0 and final and self.parser.region(inner, False)[0] is None:
                name = None  # left open before its name ended: not a call
            stop = end + len(CALL_END) if end >= 0 else len(self.text)
            if name is None:
                if not complete:
                    break
                content.append(self.text[start:stop])  # no name: not a call
            else:
                if not self.open:
                    self.calls.append([f"chatcmpl-tool-{uuid.uuid4().hex}", ""])
                    self.open = True
                    deltas.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1][0], name))
                sent = self.calls[-1][1]
                if len(args) > len(sent):
                    if deltas and deltas[-1].index == len(self.calls) - 1:
                        deltas[-1].arguments += args[len(sent):]
                    else:
                        deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=args[len(sent):]))
                    self.calls[-1][1] = args
                if not complete:
                    break
                self.open = False
            self.pos = stop
        return "".join(content), deltas


# ------------------------------------------------------------------------------------------- reasoning
class ReasoningStream:
    """`<think>...</think>` split off an output as it arrives: `feed(piece)` -> (reasoning, content).
    think_open: the prompt ends inside a `<think>` (GLM-5.3's template opens it for the model), so the
    output starts as reasoning; otherwise reasoning only if the output starts with `<think>` (leading
    whitespace allowed)."""

    def __init__(self, think_open: bool):
        self.mode = "think" if think_open else "start"
        self.buf = ""
        self.thought = think_open

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        if self.mode == "start":
            lead = self.buf.lstrip()
            if lead.startswith(THINK_START):
                self.mode, self.thought, self.buf = "think", True, lead[len(THINK_START):]
            elif THINK_START.startswith(lead) and not final:
                return "", ""
            else:
                self.mode = "content"
        if self.mode == "think":
            i = self.buf.find(THINK_END)
            if i >= 0:
                reasoning, self.buf, self.mode = self.buf[:i], self.buf[i + len(THINK_END):], "content"
            else:
                keep = 0 if final else _partial_tag(self.buf, THINK_END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if self.mode == "content":
            content, self.buf = self.buf, ""
        return reasoning, content


class Glm45ReasoningParser:
    names = ("glm45",)

    @staticmethod
    def stream(think_open: bool) -> ReasoningStream:
        return ReasoningStream(think_open)


TOOL_PARSERS = {n: Glm45ToolParser for n in Glm45ToolParser.names}
REASONING_PARSERS = {n: Glm45ReasoningParser for n in Glm45ReasoningParser.names}


# ----------------------------------------------------------------------------------------- one choice
@dataclasses.dataclass
class Delta:
    """What one piece of output adds: reasoning text, content text, tool call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutput:
    """One choice's text through the reasoning split (if `think_open` is not None: a reasoning parser is on)
    then the tool-call parser (if `tools`), piece by piece; the totals so far in `reasoning`, `content`
    and `calls` ([id, name, arguments] each). forced: output the prompt already holds (a forced call's
    start, `Glm45ToolParser.forced`), parsed before the first piece."""

    def __init__(self, think_open: bool | None = None, tools: Glm45ToolParser | None = None, forced: str = ""):
        self.reasoning_stream = ReasoningStream(think_open) if think_open is not None else None
        self.tool_stream = ToolCallStream(tools) if tools is not None else None
        self.reasoning = ""
        self.content = ""
        self.calls: list[list[str]] = []
        self.pending = forced  # goes in with the first piece (its deltas belong to the first chunk)

    def feed(self, piece: str, final: bool = False) -> Delta:
        piece, self.pending = self.pending + piece, ""
        reasoning, content = self.reasoning_stream.feed(piece, final) if self.reasoning_stream else ("", piece)
        calls: list[ToolCallDelta] = []
        if self.tool_stream is not None:
            content, calls = self.tool_stream.feed(content, final)
        self.reasoning += reasoning
        self.content += content
        for d in calls:
            if d.index == len(self.calls):
                self.calls.append([d.id, d.name, ""])
            self.calls[d.index][2] += d.arguments
        return Delta(reasoning, content, calls)

    @property
    def reasoning_content(self) -> str | None:
        """None when the output did not reason (no parser, or no `<think>`)."""
        if self.reasoning_stream is None or not self.reasoning_stream.thought:
            return None
        return self.reasoning

    @property
    def final_content(self) -> str | None:
        """The content of the whole answer, as vLLM gives it: None beside tool calls when only whitespace, and
        beside reasoning when empty; otherwise the text, "" included (an answer of no text is "", not None)."""
        if (self.calls and not self.content.strip()) or (not self.content and self.reasoning_content is not None):
            return None
        return self.content
