"""A byte-level tokenizer for models without one (the tiny preset): token id = UTF-8 byte value.

Ids >= 256 (the rest of a larger vocabulary) decode to U+FFFD. Real checkpoints come with an HF tokenizer;
this one only makes the tiny model's input and output readable.
"""

from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return b"".join(bytes([i]) if 0 <= i < 256 else "\ufffd".encode() for i in map(int, ids)).decode(
            "utf-8", errors="replace")
