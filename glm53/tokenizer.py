"""Tokenizers: a checkpoint's own (`tokenizer.json` through HF `tokenizers`, with its end-of-sequence
ids and chat template) or, for presets without one, a byte-level tokenizer (token id = UTF-8 byte value;
ids >= 256, the rest of a larger vocabulary, decode to U+FFFD: it only makes a preset's input and output
readable).

`load_tokenizer(model, chat_template=None)`: a checkpoint directory -> `HFTokenizer`; a preset name ->
`ByteTokenizer` with the preset's chat template (glm53/templates/<preset>.jinja, GLM-5.3's conversation
format written in bytes). The chat template is `chat_template` (a file's path: vLLM's --chat-template) if
given, else the checkpoint's own, else the preset's (a checkpoint without one: GLM-5.3's). Both have `encode(text, add_special_tokens=False) -> [ids]`, `decode(ids) -> str` (special tokens
skipped), `token_strs(ids) -> [str]` (each id's vocabulary entry), `eos_token_ids` (tuple; () for
presets, which have no end-of-sequence token) and `chat_template` (a jinja2 source or None).

`TextStream` turns one generated sequence's tokens into text as they arrive, and finds its stop strings.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable
from pathlib import Path

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that are not (yet) a whole UTF-8 character


class ByteTokenizer:
    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    bos_token = eos_token = ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens to add

    def decode(self, ids) -> str:
        return b"".join(bytes([i]) if 0 <= i < 256 else REPLACEMENT.encode() for i in map(int, ids)).decode(
            "utf-8", errors="replace")

    def token_strs(self, ids) -> list[str]:
        """Each id's byte as a Latin-1 character (a byte is its own vocabulary entry); ids >= 256: U+FFFD."""
        return [bytes([i]).decode("latin-1") if 0 <= i < 256 else REPLACEMENT for i in map(int, ids)]


class HFTokenizer:
    """A checkpoint directory's `tokenizer.json` (HF `tokenizers`), its EOS ids (generation_config.json,
    else config.json's eos_token_id; an int or a list) and its chat template (tokenizer_config.json's
    `chat_template`, or a `chat_template.jinja` file)."""

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer

        d = Path(directory)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        eos = None
        for name in ("generation_config.json", "config.json"):
            f = d / name
            if f.exists() and (eos := json.loads(f.read_text()).get("eos_token_id")) is not None:
                break
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        tc = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        self.chat_template = tc.get("chat_template")
        if self.chat_template is None and (d / "chat_template.jinja").exists():
            self.chat_template = (d / "chat_template.jinja").read_text()
        self.bos_token, self.eos_token = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: let tokenizer.json's post-processor add its special tokens (a BOS, say)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_strs(self, ids) -> list[str]:
        return [self.tok.id_to_token(int(i)) or "" for i in ids]


def _token_text(t) -> str:
    return t.get("content", "") if isinstance(t, dict) else (t or "")


TEMPLATES = Path(__file__).parent / "templates"  # one chat template per preset, <preset>.jinja
DEFAULT_TEMPLATE = "glm-5.3"


def load_tokenizer(model: str | os.PathLike, chat_template: str | os.PathLike | None = None):
    """A checkpoint directory with a tokenizer.json -> HFTokenizer; anything else (a preset) -> ByteTokenizer.
    Its chat_template: the file `chat_template` if given, else the checkpoint's own, else the preset's
    (TEMPLATES/<preset>.jinja; GLM-5.3's for a checkpoint without one or a name without a file)."""
    p = Path(model)
    tok = HFTokenizer(p) if (p / "tokenizer.json").exists() else ByteTokenizer()
    if chat_template is not None:
        tok.chat_template = Path(chat_template).read_text()
    elif not tok.chat_template:
        own = TEMPLATES / f"{p.name}.jinja"
        tok.chat_template = (own if own.exists() and not p.is_dir() else TEMPLATES / f"{DEFAULT_TEMPLATE}.jinja").read_text()
    return tok


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                **kwargs) -> str:
    """The prompt text of a chat under the tokenizer's template, with the generation prompt appended unless
    told not to (as HF's apply_chat_template renders it, `tools` and the template's own variables `kwargs`,
    e.g. enable_thinking, included). The sandbox includes only TEMPLATES' files; `tojson` writes JSON as
    HF's does (no HTML escaping, which would turn a tool's `<` into `\\u003c`). ValueError without a
    template."""
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template: use /v1/completions")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.FileSystemLoader(TEMPLATES))
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(tokenizer.chat_template).render(
        **kwargs, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


class TextStream:
    """One generated sequence's text as its tokens arrive, cut at its first stop string.

    `add(token)` once per token, in order -> the stop string the text now reaches, else None (a server
    hands `add` to the engine as `Request.stop_check`, so a stop string finishes the request on the token
    that completes it, as a stop token does). `take()` -> the text the oldest not yet taken token
    completed (one call per `add`), `flush()` -> what is left once the sequence has ended; together they
    give the whole text, each character once.

    Decoding is incremental (each token decodes a window of the last few tokens, so a sequence of n tokens
    costs O(n), not O(n^2)): the window starts at the last token whose text was released and grows until
    its text no longer ends in an incomplete character (U+FFFD), which waits for the next token. A token of
    `stop_token_ids` (the request's: its EOS and vLLM's stop_token_ids) that ends the sequence, i.e. one
    that comes once `min_tokens` tokens are out (the engine's rule, `Request.check_stop`), adds no text:
    vLLM drops the text of the token that terminated a request. A stop string counts only once more than
    `min_tokens` tokens are out (vLLM's rule) and only where it ends in the text the latest token added;
    the text ends before it (`stopped_by` names it). Text that could still be the start of a stop string
    (its last max(len) - 1 characters) is held back until the next token or the flush."""

    def __init__(self, tokenizer, stop: Iterable[str] = (), stop_token_ids: Iterable[int] = (), min_tokens: int = 0):
        self.tok = tokenizer
        self.stop = tuple(dict.fromkeys(s for s in stop if s))
        self.stop_token_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.start = self.done = 0  # the decode window is ids[start:]; ids[start:done] are already text
        self.text = ""  # decoded so far (cut at the stop string once one matched)
        self.sent = 0  # characters of `text` released to add's deltas
        self.count = 0  # tokens added (EOS included)
        self.stopped_by: str | None = None
        self._deltas: collections.deque[str] = collections.deque()

    def add(self, token: int) -> str | None:
        self.count += 1
        if self.stopped_by is None:
            new = ""
            if token not in self.stop_token_ids or self.count < self.min_tokens:
                self.ids.append(int(token))
                new = self._decode(final=False)
            self._grow(new)
            end = len(self.text) if self.stopped_by is not None else max(self.sent, len(self.text) - self.hold)
        else:
            end = self.sent
        self._deltas.append(self.text[self.sent:end])
        self.sent = end
        return self.stopped_by

    def take(self) -> str:
        return self._deltas.popleft() if self._deltas else ""

    def flush(self) -> str:
        if self.stopped_by is None:
            self._grow(self._decode(final=True))
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _decode(self, final: bool) -> str:
        """Text the window's new tokens add; "" while it ends in an incomplete character (unless final)."""
        before = self.tok.decode(self.ids[self.start:self.done])
        now = self.tok.decode(self.ids[self.start:])
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return now[len(before):]

    def _grow(self, new: str) -> None:
        self.text += new
        if not new or not self.stop or self.count <= self.min_tokens:
            return
        hits = [(i, s) for s in self.stop
                if (i := self.text.find(s, max(0, len(self.text) - len(new) - len(s) + 1))) >= 0]
        if hits:
            i, s = min(hits)
            self.text, self.stopped_by = self.text[:i], s
