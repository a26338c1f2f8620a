"""The stored form of one chunk, shared by every tier that keeps chunks as named blobs (the filesystem
tier's files, the object tier's objects): an 88-byte little-endian header, then the payload.

    magic b"GLM53KV\\0" | format version u32 | the chunk's 32-byte key | payload length u64 | CRC-32 u32 |
    MAC (32 bytes: kvcache.tiers.auth.chunk_mac of the key and payload; zeros when written without a secret)

A reader that asked for `key` and `size` bytes accepts a blob only if every field agrees: the magic and
version (not some other file), the key (not another chunk stored under this name), the length (not
truncated, not padded) and the CRC-32 of the payload (no flipped byte); a reader that holds the
shared secret also requires the MAC, so a blob written by anyone without it (planted in a shared root or
bucket) is refused like a damaged one. One format and one check for every tier, so a chunk copied between a filesystem root and a bucket (`aws s3 sync`) reads the same, and
no tier verifies less than another.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from kvcache.tiers.auth import NO_MAC, chunk_mac, chunk_ok

MAGIC = b"GLM53KV\0"
VERSION = 2
HEADER = struct.Struct("<8sI32sQI32s")  # magic, version, key, payload length, CRC-32 of the payload, MAC
SUFFIX = ".kv"


def chunk_name(fingerprint: str, key: bytes) -> str:
    """A chunk's name relative to a tier's root (a directory or a bucket prefix): the fingerprint's
    first 32 hex digits, the key's first byte (fan-out), the key in hex."""
    h = key.hex()
    return f"{fingerprint[:32]}/{h[:2]}/{h}{SUFFIX}"


def as_bytes(payload) -> memoryview:
    """A payload (bytes, memoryview, a contiguous numpy array) as a flat byte view."""
    return memoryview(np.ascontiguousarray(payload)).cast("B")


def encode_header(key: bytes, payload, secret: bytes | None = None) -> bytes:
    """The header of `payload` (a byte buffer) stored under `key`, its MAC with `secret` (None: zeros)."""
    data = as_bytes(payload)
    mac = chunk_mac(secret, key, data) if secret is not None else NO_MAC
    return HEADER.pack(MAGIC, VERSION, key, data.nbytes, zlib.crc32(data), mac)


def header_ok(head: bytes, key: bytes, payload, secret: bytes | None = None) -> bool:
    """Whether `head` is the header of exactly `payload` (a byte buffer of the size the reader asked for)
    stored under `key`, written by a holder of `secret` when one is given."""
    if len(head) != HEADER.size:
        return False
    magic, version, k, length, crc, mac = HEADER.unpack(head)
    data = as_bytes(payload)
    return (magic == MAGIC and version == VERSION and k == key and length == data.nbytes and zlib.crc32(data) == crc
            and chunk_ok(secret, key, data, mac))


def decode(blob, key: bytes, size: int, secret: bytes | None = None) -> np.ndarray | None:
    """The verified payload of a whole stored blob (np.uint8 [size], a read-only view of `blob`), or None
    if the blob is not `key`'s chunk of `size` bytes, whole, intact and (given `secret`) authentic."""
    view = memoryview(blob).cast("B")
    if view.nbytes != HEADER.size + size:
        return None
    payload = np.frombuffer(view, np.uint8, count=size, offset=HEADER.size)
    return payload if header_ok(bytes(view[:HEADER.size]), key, payload, secret) else None
