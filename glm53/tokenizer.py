"""Tokenizers: a checkpoint's own (`tokenizer.json` through HF `tokenizers`, with its end-of-sequence
ids and chat template) or, for presets without one, a byte-level tokenizer (token id = UTF-8 byte value;
ids >= 256, the rest of a larger vocabulary, decode to U+FFFD: it only makes a preset's input and output
readable).

`load_tokenizer(model)`: a checkpoint directory -> `HFTokenizer`; a preset name -> `ByteTokenizer`.
Both have `encode(text) -> [ids]`, `decode(ids) -> str`, `eos_token_ids` (tuple; () for presets, which
have no end-of-sequence token) and `chat_template` (a jinja2 source or None).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class ByteTokenizer:
    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    bos_token = eos_token = ""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return b"".join(bytes([i]) if 0 <= i < 256 else "\ufffd".encode() for i in map(int, ids)).decode(
            "utf-8", errors="replace")


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

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _token_text(t) -> str:
    return t.get("content", "") if isinstance(t, dict) else (t or "")


def load_tokenizer(model: str | os.PathLike):
    """A checkpoint directory with a tokenizer.json -> HFTokenizer; anything else (a preset) -> ByteTokenizer."""
    p = Path(model)
    return HFTokenizer(p) if (p / "tokenizer.json").exists() else ByteTokenizer()


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text of a chat under the tokenizer's template, with the generation prompt appended (as
    HF's apply_chat_template(add_generation_prompt=True) renders it). ValueError without a template."""
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template: use /v1/completions")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(tokenizer.chat_template).render(
        messages=messages, add_generation_prompt=True, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
