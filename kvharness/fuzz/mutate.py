"""Mutations of valid frames for the wire fuzzer (:mod:`kvharness.fuzz.cases`):
fields cut, grown, flipped or replaced with lengths kept consistent, JSON metas with odd
values, and header fields the protocol refuses. Nothing here judges: the oracle
(:mod:`kvharness.fuzz.oracle`) decides what the server must answer to each.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import replace
from typing import Any

from kvharness.fuzz.model import SPECS, Header, Peer
from kvstore.wire import MAGIC, VERSION, Flag, Op

__all__ = ["bad_header", "mutate_fields", "mutate_json"]

#: Ops whose success changes nothing the fuzzer models, so they may ask for no reply.
_QUIET = (Op.PING, Op.EXISTS, Op.LOOKUP, Op.LIST, Op.STATS, Op.RELEASE)
_ODD: list[Any] = [
    None,
    -1,
    0,
    4096,
    2**20,
    2**31,
    2**32,
    2**64,
    1e308,
    True,
    "",
    "x" * 70,
    "ü" * 3000,
    [],
    {},
    [1, 2],
    {"a": 1},
]
_COUNTS = (0, 1, 2, 3, 65, 1024, 2**31, 2**32 - 1)


def _flip(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return rng.randbytes(1)
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _field(rng: random.Random, data: bytes) -> bytes:
    """``data`` cut, grown, flipped, given another leading count, or replaced."""
    kind = rng.randrange(5)
    if kind == 0:
        return data[: rng.randint(0, max(0, len(data) - 1))]
    if kind == 1:
        return data + rng.randbytes(rng.randint(1, 40))
    if kind == 2:
        return _flip(rng, data)
    if kind == 3 and len(data) >= 4:
        return struct.pack("<I", rng.choice(_COUNTS)) + data[4:]
    return rng.randbytes(rng.randint(0, 100))


def mutate_fields(
    rng: random.Random, meta: bytes, payload: bytes, head: Header
) -> tuple[bytes, bytes, int]:
    """``(meta, payload, flags)`` of a request with its fields mutated."""
    flags = head.flags
    roll = rng.random()
    if roll < 0.55 or not payload:
        meta = _field(rng, meta)
    elif roll < 0.85:
        payload = _field(rng, payload)
    else:
        meta, payload = _field(rng, meta), _field(rng, payload)
    if rng.random() < 0.2:
        flags = rng.choice([0, Flag.SHM, Flag.DURABLE, Flag.SHM | Flag.DURABLE])
        if head.op in _QUIET and rng.random() < 0.3:
            flags |= Flag.NO_REPLY
    return meta, payload, int(flags)


def mutate_json(rng: random.Random, meta: bytes) -> bytes:
    """A JSON object meta with a field dropped, set to an odd value, or added (nested
    objects too); the text may carry non-ASCII characters."""
    try:
        obj: Any = json.loads(meta)
    except ValueError:
        return rng.randbytes(rng.randint(0, 64))
    target = obj
    nested = [v for v in obj.values() if isinstance(v, dict)] if isinstance(obj, dict) else []
    if nested and rng.random() < 0.5:
        target = rng.choice(nested)
    if not isinstance(target, dict):
        return json.dumps(rng.choice(_ODD)).encode()
    roll = rng.random()
    if target and roll < 0.3:
        del target[rng.choice(list(target))]
    elif target and roll < 0.8:
        target[rng.choice(list(target))] = rng.choice(_ODD)
    else:
        target[rng.choice(["extra", "ñ", "order"])] = rng.choice(_ODD)
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()


def bad_header(
    rng: random.Random, head: Header, meta: bytes, payload: bytes, peer: Peer
) -> tuple[Header, bytes, bytes]:
    """A frame whose header the protocol refuses (or, for an unknown op after
    authentication, answers UNKNOWN_OP and goes on)."""
    kind = rng.randrange(9)
    if kind == 0:
        return (
            replace(head, version=rng.choice([v for v in (0, 2, 7, 255) if v != VERSION])),
            meta,
            payload,
        )
    if kind == 1:
        magic = rng.choice([b"VK", b"kv", b"\0\0", b"K\0", b"\xffV"])
        return replace(head, magic=magic if magic != MAGIC else b"VK"), meta, payload
    if kind == 2:
        known = {int(op) for op in Op}
        op = rng.choice([n for n in range(256) if n not in known])
        if rng.random() < 0.5:
            payload = b""
        return replace(head, op=op, payload_len=len(payload)), meta, payload
    if kind == 3:
        return replace(head, flags=head.flags | Flag.REPLY), meta, payload
    if kind == 4:
        return replace(head, status=rng.randint(1, 0xFFFF)), meta, payload
    if kind == 5:  # a meta no request needs: only the header goes
        size = rng.choice([peer.meta_limit + 1, 2**24, 2**32 - 1])
        return replace(head, meta_len=size, payload_len=0), b"", b""
    if kind == 6:  # a payload over max_frame_bytes: only the header goes
        size = rng.choice([peer.limits["max_frame_bytes"] + 1, 2**40, 2**64 - 1])
        return replace(head, meta_len=0, payload_len=size), b"", b""
    if kind == 7:  # a payload on an op that carries none
        plain = [op for op, spec in SPECS.items() if not spec.payload]
        junk = rng.randbytes(rng.randint(1, 64))
        return replace(head, op=int(rng.choice(plain)), payload_len=len(junk)), meta, junk
    flags = rng.randint(0, 0xFFFF) | Flag.REPLY
    return replace(head, flags=flags, status=rng.randint(0, 0xFFFF)), meta, payload
