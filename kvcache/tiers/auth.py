"""Shared-secret authentication of KV chunks and peer messages (docs/engine.md "Trust model").

Every deployment that shares KV between processes it does not fully trust (peer engines over a network,
a directory or bucket other writers can reach) gives each of them one secret: a file named by a tier's
`secret_file` option, else by $GLM53_KV_SECRET_FILE. Never a command-line value (a command line is
readable by every user of the machine, through /proc). With it, every chunk carries an HMAC-SHA256 that
binds the chunk's key and bytes (`chunk_mac`) and every peer protocol message carries one over its body
(`seal` / `unseal`), so a party without the secret can neither plant KV nor serve, fetch or pin it.
Without it a tier verifies CRCs only (damage, not a liar), and the peer tier then talks to loopback
addresses only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import struct

ENV = "GLM53_KV_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
NO_MAC = bytes(MAC_BYTES)  # the MAC field of a chunk written without a secret

_log = logging.getLogger(__name__)
_U64 = struct.Struct("<Q")


def load_secret(secret_file=None, *, who: str = "secondary tier") -> bytes | None:
    """The shared secret: the bytes of `secret_file`, else of the file $GLM53_KV_SECRET_FILE names
    (surrounding whitespace stripped), None when neither is set. A ValueError naming the file when it
    cannot be read or holds fewer than MIN_SECRET_BYTES bytes: a tier configured for authentication never
    runs without it."""
    path = secret_file if secret_file not in (None, "") else os.environ.get(ENV) or None
    if path is None:
        return None
    src = "secret_file" if secret_file not in (None, "") else f"${ENV}"
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as e:
        raise ValueError(f"{who}: cannot read the shared secret file {str(path)!r} ({src}): {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{who}: the shared secret file {str(path)!r} ({src}) holds {len(secret)} bytes; it needs "
                         f"at least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return secret


def check_secret_file(v, who: str) -> None:
    """Validate a `secret_file` option (a path, or None)."""
    if v is not None and (not isinstance(v, (str, os.PathLike)) or not str(v)):
        raise ValueError(f"{who}: secret_file must be a file path or None, got {v!r}")


def chunk_mac(secret: bytes, key: bytes, payload) -> bytes:
    """HMAC-SHA256 of one chunk: binds its 32-byte key (model, layout, group, tokens, salt) and its bytes,
    so a valid chunk cannot be replayed under another key nor its bytes altered."""
    data = memoryview(payload).cast("B") if not isinstance(payload, (bytes, bytearray)) else payload
    h = hmac.new(secret, b"glm53-kv-chunk\0", hashlib.sha256)
    h.update(key)
    h.update(_U64.pack(len(data)))
    h.update(data)
    return h.digest()


def chunk_ok(secret: bytes | None, key: bytes, payload, mac: bytes) -> bool:
    """Whether `mac` authenticates `payload` under `key` (always True without a secret: CRCs only)."""
    return secret is None or hmac.compare_digest(mac, chunk_mac(secret, key, payload))


def seal(secret: bytes | None, domain: bytes, body: bytes) -> bytes:
    """`body` followed by its MAC in `domain` (what kind of message it is, so one kind cannot pass for
    another); `body` itself without a secret."""
    if secret is None:
        return body
    return body + hmac.new(secret, domain + b"\0" + body, hashlib.sha256).digest()


def unseal(secret: bytes | None, domain: bytes, wire: bytes) -> bytes | None:
    """The body of a `seal`ed message, None when its MAC does not verify (or it is too short to hold one)."""
    if secret is None:
        return wire
    if len(wire) < MAC_BYTES:
        return None
    body, mac = wire[:-MAC_BYTES], wire[-MAC_BYTES:]
    want = hmac.new(secret, domain + b"\0" + body, hashlib.sha256).digest()
    return bytes(body) if hmac.compare_digest(mac, want) else None


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address ("localhost", 127.0.0.0/8, ::1); host names are not resolved."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
