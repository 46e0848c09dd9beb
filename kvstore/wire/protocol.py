"""The kvstore-server wire protocol, version 1 (docs/protocol.md). Encoding only; no I/O.

Every message is a frame: a fixed 24-byte header, then ``meta_len`` bytes of
*meta* (the request's fields), then ``payload_len`` bytes of *payload* (block
bytes). All integers are little-endian::

    offset size field
    0      2    magic b"KV"
    2      1    protocol version (1)
    3      1    op
    4      2    flags (REPLY, NO_REPLY, DURABLE, SHM)
    6      2    status: 0 in requests and successful replies, else an error code
    8      4    request id (a reply carries its request's)
    12     4    meta length
    16     8    payload length

Control ops (HELLO, AUTH's reply, OPEN, SHM_ATTACH, STATS) carry a small JSON
object as meta; data ops carry packed binary (key lists are ``u32 count`` then
``count`` raw 16-byte keys); HINT carries both (its fields as JSON, then keys).
An error reply carries a UTF-8 message as meta. Block bytes on the wire are a
block header of :mod:`kvstore.format.codec` (raw codec) followed by the payload, so
both ends verify what they receive.

Nothing read off the wire is unpickled or evaluated: every decoder checks
lengths and ranges and raises :class:`~kvstore.errors.ProtocolError`.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ProtocolError
from kvstore.keys import KEY_BYTES, BlockKey, ChunkTokens

__all__ = [
    "FRAME",
    "MAGIC",
    "MAX_JSON_META",
    "VERSION",
    "Flag",
    "Frame",
    "Op",
    "SlotStatus",
    "Status",
    "decode_count",
    "decode_tokens",
    "decode_get_reply",
    "decode_get_request",
    "decode_hint_request",
    "decode_json",
    "decode_keys",
    "decode_put_reply",
    "decode_reserve_reply",
    "decode_commit_request",
    "decode_u64",
    "encode_count",
    "encode_tokens",
    "encode_get_reply",
    "encode_get_request",
    "encode_hint_request",
    "encode_json",
    "encode_keys",
    "encode_put_reply",
    "encode_reserve_reply",
    "encode_commit_request",
    "encode_u64",
]

MAGIC = b"KV"
VERSION = 1
FRAME = struct.Struct("<2sBBHHIIQ")
#: JSON metas are small control messages; anything bigger is refused unparsed.
MAX_JSON_META = 64 * 1024
_COUNT = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_GET = struct.Struct("<IHH")
_SLOT = struct.Struct("<BQ")
_LEASE = struct.Struct("<QI")


class Op(enum.IntEnum):
    """What a frame asks for."""

    HELLO = 1  # JSON {client, protocol} -> JSON {server, nonce, auth, limits, host}
    AUTH = 2  # 32-byte HMAC-SHA256(token, "kvstore-auth-v1|" + nonce) -> JSON {name, namespaces}
    OPEN = 3  # JSON {namespace, layout, fingerprint} -> JSON {capacity_blocks, shared_memory}
    SHM_ATTACH = 4  # -> JSON {pid, fd, nbytes, inode, boot_id}; the memfd itself over Unix sockets
    PING = 5
    STATS = 6  # -> JSON
    ADMIN = 7  # JSON {action, ...} -> JSON (tokens with the admin scope only)
    PUT = 16  # keys; payload: header + block per key -> per-key status
    RESERVE = 17  # keys -> reservation id, per key (status, shared-memory offset)
    COMMIT = 18  # reservation id, per-key written flags; payload: inline blocks -> statuses
    GET = 32  # count, layers, keys -> lease id, per key (status, offset); payload: inline blocks
    RELEASE = 33  # lease id (NO_REPLY)
    EXISTS = 48  # keys -> one byte per key
    LOOKUP = 49  # keys -> u32 leading keys stored
    DELETE = 50  # keys -> u32 deleted
    LIST = 51  # u32 limit -> payload: keys
    TOKENS = 52  # u32 block_tokens, parent flag + key, keys; payload: int32 tokens -> u32
    HINT = 53  # u32 len + JSON hint fields, keys flag (+ keys) -> JSON answer


class Flag(enum.IntFlag):
    """Frame flags."""

    NONE = 0
    REPLY = 1  # this frame answers a request
    NO_REPLY = 2  # the request expects no answer (RELEASE)
    DURABLE = 4  # PUT/COMMIT: acknowledge once on a persistent tier; in replies: it is
    SHM = 8  # GET: the client may read blocks out of shared memory


class Status(enum.IntEnum):
    """Error codes of replies (0: success)."""

    OK = 0
    BAD_FRAME = 1  # not a frame of this protocol: the connection is closed
    UNSUPPORTED_VERSION = 2
    UNAUTHENTICATED = 3
    FORBIDDEN = 4  # the token does not open that namespace
    BAD_REQUEST = 5  # malformed fields: nothing was changed
    TOO_LARGE = 6  # over a frame, batch or meta limit
    BUSY = 7  # over the in-flight limits: retry later
    NOT_OPEN = 8  # a data op before OPEN
    UNKNOWN_OP = 9
    SHUTTING_DOWN = 10
    INTERNAL = 11
    NOT_PERMITTED = 12  # the token's scopes do not cover this op


class SlotStatus(enum.IntEnum):
    """Per-key outcome in GET, PUT, RESERVE and COMMIT replies."""

    MISS = 0  # GET: not stored; PUT/COMMIT: not stored (no room, or a tier failed)
    INLINE = 1  # GET: bytes follow in the payload; RESERVE: send them in COMMIT's payload
    SHM = 2  # GET: read them at the offset; RESERVE: write them at the offset
    STORED = 3  # PUT/COMMIT: stored now
    PRESENT = 4  # PUT/RESERVE/COMMIT: already stored (nothing to send)
    CORRUPT = 5  # PUT/COMMIT: the bytes failed verification and were dropped
    DURABLE = 0x80  # PUT/COMMIT, or-ed in: the block is on a persistent tier


@dataclass(frozen=True)
class Frame:
    """A frame header."""

    op: int
    flags: int
    status: int
    request_id: int
    meta_len: int
    payload_len: int

    def pack(self) -> bytes:
        """The 24 header bytes."""
        return FRAME.pack(
            MAGIC,
            VERSION,
            self.op,
            self.flags,
            self.status,
            self.request_id,
            self.meta_len,
            self.payload_len,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Frame:
        """Parse a header; ProtocolError for a wrong size, magic or version."""
        if len(data) != FRAME.size:
            raise ProtocolError(f"a frame header has {FRAME.size} bytes, got {len(data)}")
        magic, version, op, flags, status, rid, meta_len, payload_len = FRAME.unpack(data)
        if magic != MAGIC:
            raise ProtocolError(f"not a kvstore frame (magic {bytes(magic)!r})")
        if version != VERSION:
            raise ProtocolError(
                f"a frame of protocol version {version}; this side speaks version {VERSION}"
            )
        return cls(op, flags, status, rid, meta_len, payload_len)

    @property
    def is_reply(self) -> bool:
        """True for a reply frame."""
        return bool(self.flags & Flag.REPLY)


# -- JSON metas ----------------------------------------------------------------
def encode_json(obj: dict[str, Any]) -> bytes:
    """A control meta."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(meta: bytes | memoryview) -> dict[str, Any]:
    """A control meta: a JSON object of at most :data:`MAX_JSON_META` bytes."""
    if len(meta) > MAX_JSON_META:
        raise ProtocolError(f"control meta of {len(meta)} bytes (at most {MAX_JSON_META})")
    try:
        obj = json.loads(bytes(meta).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"control meta is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control meta must be a JSON object")
    return obj


# -- small binary fields -------------------------------------------------------
def encode_u64(value: int) -> bytes:
    """One u64 (a lease or reservation id)."""
    return _U64.pack(value)


def decode_u64(meta: bytes | memoryview) -> int:
    """One u64 (exactly 8 bytes)."""
    if len(meta) != _U64.size:
        raise ProtocolError(f"expected an 8-byte id, got {len(meta)} bytes")
    return int(_U64.unpack(meta)[0])


def encode_count(value: int) -> bytes:
    """One u32."""
    return _COUNT.pack(value)


def decode_count(meta: bytes | memoryview) -> int:
    """One u32 (exactly 4 bytes)."""
    if len(meta) != _COUNT.size:
        raise ProtocolError(f"expected a 4-byte count, got {len(meta)} bytes")
    return int(_COUNT.unpack(meta)[0])


def encode_tokens(tokens: ChunkTokens) -> bytes:
    """TOKENS's meta: ``u32 block_tokens``, a parent byte (1: a 16-byte parent key
    follows), then :func:`encode_keys`. The tokens travel as the payload."""
    parent = b"\x00" if tokens.parent is None else b"\x01" + tokens.parent
    return _COUNT.pack(tokens.block_tokens) + parent + encode_keys(tokens.keys)


def decode_tokens(
    meta: bytes | memoryview, max_keys: int
) -> tuple[int, BlockKey | None, list[BlockKey]]:
    """``(block_tokens, parent, keys)`` of a TOKENS meta."""
    view = memoryview(meta)
    if len(view) < _COUNT.size + 1 or view[_COUNT.size] not in (0, 1):
        raise ProtocolError("TOKENS meta truncated or with a bad parent flag")
    (block_tokens,) = _COUNT.unpack_from(view)
    at = _COUNT.size + 1
    parent = None
    if view[_COUNT.size] == 1:
        if len(view) < at + KEY_BYTES:
            raise ProtocolError("TOKENS meta truncated in its parent key")
        parent = BlockKey(bytes(view[at : at + KEY_BYTES]))
        at += KEY_BYTES
    return block_tokens, parent, decode_keys(view, at, max_keys)


def encode_hint_request(fields: dict[str, Any], keys: Sequence[bytes] | None) -> bytes:
    """HINT's meta: ``u32`` length and a JSON object of the hint's fields (``retain_s``,
    ``priority``, ``prefetch``, ``demote``, ``session``), then a keys byte (0: no keys --
    the session's last hint's; 1: :func:`encode_keys` follows)."""
    body = encode_json(fields)
    tail = b"\x00" if keys is None else b"\x01" + encode_keys(keys)
    return _COUNT.pack(len(body)) + body + tail


def decode_hint_request(
    meta: bytes | memoryview, max_keys: int
) -> tuple[dict[str, Any], list[BlockKey] | None]:
    """``(fields, keys)`` of a HINT meta (keys None: none given). The fields are only
    decoded here; whether they make a hint is :func:`kvstore.hints.parse_hint`'s call."""
    view = memoryview(meta)
    if len(view) < _COUNT.size:
        raise ProtocolError("HINT meta truncated")
    (size,) = _COUNT.unpack_from(view)
    at = _COUNT.size + size
    if len(view) < at + 1 or view[at] not in (0, 1):
        raise ProtocolError("HINT meta truncated or with a bad keys flag")
    fields = decode_json(view[_COUNT.size : at])
    if view[at] == 0:
        if len(view) != at + 1:
            raise ProtocolError("HINT meta has bytes after its fields")
        return fields, None
    return fields, decode_keys(view, at + 1, max_keys)


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """``u32 count`` then the raw keys."""
    return _COUNT.pack(len(keys)) + b"".join(keys)


def decode_keys(
    meta: bytes | memoryview, offset: int = 0, max_keys: int = 1 << 20
) -> list[BlockKey]:
    """Keys encoded by :func:`encode_keys` at ``offset`` (which must end the meta)."""
    view = memoryview(meta)[offset:]
    if len(view) < _COUNT.size:
        raise ProtocolError("key list truncated")
    (count,) = _COUNT.unpack_from(view)
    if count > max_keys:
        raise ProtocolError(f"{count} keys in one request (at most {max_keys})")
    if len(view) != _COUNT.size + count * KEY_BYTES:
        raise ProtocolError(f"{count} keys need {count * KEY_BYTES} bytes, got {len(view) - 4}")
    raw = bytes(view[_COUNT.size :])
    return [BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]


# -- GET -----------------------------------------------------------------------
def encode_get_request(keys: Sequence[bytes], layers: tuple[int, int] | None) -> bytes:
    """GET meta: the keys and a layer range ``(0, 0)`` for whole blocks."""
    first, last = layers if layers is not None else (0, 0)
    return _GET.pack(len(keys), first, last) + b"".join(keys)


def decode_get_request(
    meta: bytes | memoryview, num_layers: int, max_keys: int
) -> tuple[list[BlockKey], tuple[int, int] | None]:
    """Keys and layer range (None: whole blocks) of a GET; ranges are checked."""
    if len(meta) < _GET.size:
        raise ProtocolError("GET meta truncated")
    count, first, last = _GET.unpack_from(meta)
    if (first, last) == (0, 0):
        layers = None
    elif not 0 <= first < last <= num_layers:
        raise ProtocolError(f"layer range [{first}, {last}) outside [0, {num_layers})")
    else:
        layers = (first, last)
    keys = decode_keys(_COUNT.pack(count) + bytes(memoryview(meta)[_GET.size :]), 0, max_keys)
    return keys, layers


def encode_get_reply(lease_id: int, slots: Sequence[tuple[int, int]]) -> bytes:
    """GET reply meta: the lease and, per key, ``(SlotStatus, shared-memory offset)``."""
    return _LEASE.pack(lease_id, len(slots)) + b"".join(_SLOT.pack(s, o) for s, o in slots)


def decode_get_reply(meta: bytes | memoryview, count: int) -> tuple[int, list[tuple[int, int]]]:
    """Lease id and per-key ``(status, offset)`` of a GET reply for ``count`` keys."""
    return _decode_slots(meta, count, "GET")


def _decode_slots(
    meta: bytes | memoryview, count: int, what: str
) -> tuple[int, list[tuple[int, int]]]:
    if len(meta) != _LEASE.size + count * _SLOT.size:
        raise ProtocolError(f"{what} reply meta has {len(meta)} bytes for {count} keys")
    ident, n = _LEASE.unpack_from(meta)
    if n != count:
        raise ProtocolError(f"{what} reply lists {n} keys, {count} were asked")
    slots = [_SLOT.unpack_from(meta, _LEASE.size + i * _SLOT.size) for i in range(count)]
    return int(ident), [(int(s), int(o)) for s, o in slots]


# -- PUT, RESERVE, COMMIT ------------------------------------------------------
def encode_put_reply(statuses: Sequence[int]) -> bytes:
    """PUT / COMMIT reply meta: one :class:`SlotStatus` byte per key."""
    return _COUNT.pack(len(statuses)) + bytes(statuses)


def decode_put_reply(meta: bytes | memoryview, count: int) -> list[int]:
    """Per-key statuses of a PUT / COMMIT reply for ``count`` keys."""
    if len(meta) != _COUNT.size + count or _COUNT.unpack_from(meta)[0] != count:
        raise ProtocolError(f"PUT reply meta does not list {count} keys")
    return list(bytes(memoryview(meta)[_COUNT.size :]))


def encode_reserve_reply(reservation: int, slots: Sequence[tuple[int, int]]) -> bytes:
    """RESERVE reply meta: reservation id and per key ``(SlotStatus, offset)``."""
    return encode_get_reply(reservation, slots)


def decode_reserve_reply(meta: bytes | memoryview, count: int) -> tuple[int, list[tuple[int, int]]]:
    """Reservation id and per-key ``(status, offset)`` of a RESERVE reply."""
    return _decode_slots(meta, count, "RESERVE")


def encode_commit_request(reservation: int, written: Sequence[bool]) -> bytes:
    """COMMIT meta: the reservation and, per key, whether the client wrote it."""
    return _LEASE.pack(reservation, len(written)) + bytes(1 if w else 0 for w in written)


def decode_commit_request(meta: bytes | memoryview, max_keys: int) -> tuple[int, list[bool]]:
    """Reservation id and per-key written flags of a COMMIT."""
    if len(meta) < _LEASE.size:
        raise ProtocolError("COMMIT meta truncated")
    ident, count = _LEASE.unpack_from(meta)
    if count > max_keys or len(meta) != _LEASE.size + count:
        raise ProtocolError(f"COMMIT meta does not hold {count} flags")
    flags = bytes(memoryview(meta)[_LEASE.size :])
    if any(f > 1 for f in flags):
        raise ProtocolError("COMMIT flags must be 0 or 1")
    return int(ident), [f == 1 for f in flags]
