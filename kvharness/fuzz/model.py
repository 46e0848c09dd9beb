"""The wire fuzzer's model of a server and its connections (:mod:`kvharness.fuzz.run`).

What the protocol's description says of each op (:data:`SPECS`: the handshake step it
needs, whether it carries a payload; every op of :class:`~kvstore.wire.protocol.Op` has an
entry), a frame header with any field values (:class:`Header`), what the protocol allows
in reply to a frame (:class:`Expect`), what the server stores (:class:`Truth`), a
connection's state (:class:`Peer`), and the judges of replies that carry or place blocks:
every block served, inline or in shared memory, must be bytes that were stored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstore.errors import KVStoreError
from kvstore.format import header_size, parse_header
from kvstore.layout import KVLayout
from kvstore.wire import (
    FRAME,
    MAGIC,
    MAX_JSON_META,
    VERSION,
    Mapping,
    Op,
    SlotStatus,
    Status,
    read_header,
    verify_span,
)

__all__ = [
    "SPECS",
    "Check",
    "Expect",
    "Header",
    "OpSpec",
    "Peer",
    "Phase",
    "Truth",
    "judge_served",
    "judge_stored",
    "verified",
    "wire_blocks",
]


class Phase(enum.IntEnum):
    """How far a connection is through the handshake."""

    NEW = 0
    GREETED = 1
    AUTHED = 2
    OPEN = 3


@dataclass(frozen=True)
class OpSpec:
    """What the protocol's description says of an op: the handshake step it needs,
    whether its request carries a payload."""

    phase: Phase
    payload: bool = False


#: Every op of the protocol (docs/protocol.md); the fuzzer's tests check none is missing.
SPECS: dict[Op, OpSpec] = {
    Op.HELLO: OpSpec(Phase.NEW),
    Op.AUTH: OpSpec(Phase.GREETED),
    Op.OPEN: OpSpec(Phase.AUTHED),
    Op.SHM_ATTACH: OpSpec(Phase.OPEN),
    Op.PING: OpSpec(Phase.GREETED),
    Op.STATS: OpSpec(Phase.AUTHED),
    Op.ADMIN: OpSpec(Phase.AUTHED),
    Op.PUT: OpSpec(Phase.OPEN, payload=True),
    Op.RESERVE: OpSpec(Phase.OPEN),
    Op.COMMIT: OpSpec(Phase.OPEN, payload=True),
    Op.GET: OpSpec(Phase.OPEN),
    Op.RELEASE: OpSpec(Phase.OPEN),
    Op.EXISTS: OpSpec(Phase.OPEN),
    Op.LOOKUP: OpSpec(Phase.OPEN),
    Op.DELETE: OpSpec(Phase.OPEN),
    Op.LIST: OpSpec(Phase.OPEN),
    Op.TOKENS: OpSpec(Phase.OPEN, payload=True),
    Op.HINT: OpSpec(Phase.OPEN),
}

#: A check of a successful reply (meta, payload): what is wrong with it, or None.
Check = Callable[[bytes, bytes], str | None]


@dataclass(frozen=True)
class Header:
    """A frame header's fields as sent (any values: :meth:`pack` uses :data:`FRAME`)."""

    op: int
    flags: int = 0
    meta_len: int = 0
    payload_len: int = 0
    request_id: int = 0
    status: int = 0
    magic: bytes = MAGIC
    version: int = VERSION

    def pack(self) -> bytes:
        """The header's bytes."""
        return FRAME.pack(
            self.magic,
            self.version,
            self.op,
            self.flags,
            self.status,
            self.request_id,
            self.meta_len,
            self.payload_len,
        )


@dataclass
class Expect:
    """What the protocol allows in reply to one frame."""

    allowed: frozenset[int]  # reply statuses allowed (Status.OK among them: success allowed)
    fatal: bool = False  # a refusal closes the connection
    check: Check | None = None  # checks a successful reply
    answered: bool = True  # a success is answered (False: NO_REPLY)
    header_error: bool = False  # refused before its header was read (request id 0, op 0)

    @property
    def must_refuse(self) -> bool:
        """True when the protocol allows no success."""
        return Status.OK not in self.allowed


class Truth:
    """What the server was told to store, per (namespace, key): the bytes it may hold."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._held: dict[tuple[str, bytes], set[bytes]] = {}

    def stored(self, namespace: str, key: bytes, data: bytes, also: bool = False) -> None:
        """``key`` now holds ``data`` (``also``: or what it held; ``b""``: bytes nobody
        knows, such as a shared-memory slot committed unwritten)."""
        held = self._held.setdefault((namespace, bytes(key)), set())
        if not also:
            held.clear()
        held.add(bytes(data))

    def forget(self, namespace: str, key: bytes) -> None:
        """``key`` was deleted."""
        self._held.pop((namespace, bytes(key)), None)

    def holds(self, namespace: str, key: bytes) -> bool:
        """Whether ``key`` may be stored."""
        return (namespace, bytes(key)) in self._held

    def compare(
        self, namespace: str, key: bytes, data: bytes, layers: tuple[int, int]
    ) -> str | None:
        """A problem if ``data`` (the bytes of ``layers``) is not what ``key`` holds."""
        held = self._held.get((namespace, bytes(key)))
        if not held:
            return f"served bytes of key {bytes(key).hex()}, which was never stored here"
        step = self.layout.layer_nbytes
        lo, hi = layers[0] * step, layers[1] * step
        if b"" in held or any(whole[lo:hi] == data for whole in held):
            return None
        return f"served bytes of key {bytes(key).hex()} layers {layers} other than those stored"


@dataclass
class Peer:
    """A connection as the fuzzer models it."""

    truth: Truth
    secrets: dict[str, tuple[bytes, frozenset[str] | None]]  # name -> (token, namespaces)
    limits: dict[str, int]
    phase: Phase = Phase.NEW
    nonce: bytes = b""
    allowed: frozenset[str] | None = None  # namespaces the credential opens (None: all)
    namespace: str = ""
    foreign: bool = False  # opened a store of another layout: no data ops are judged
    segment: int = 0  # bytes of the store's shared memory (0: none)
    mapping: Mapping | None = None
    reservations: dict[int, list[tuple[list[bytes], list[tuple[int, int]]]]] = field(
        default_factory=dict
    )
    leases: dict[int, list[bytes]] = field(default_factory=dict)  # lease -> the keys it pins
    writes: dict[int, dict[int, bytes]] = field(default_factory=dict)  # reservation -> SHM data

    @property
    def meta_limit(self) -> int:
        """A meta length no request needs: the server must refuse it (TOO_LARGE)."""
        return MAX_JSON_META + 32 * self.limits["max_batch_blocks"] + 64


def verified(layout: KVLayout, key: bytes, block: bytes) -> bool:
    """Whether a wire block passes the receiver's checks (:mod:`kvstore.wire.blocks`)."""
    hs = header_size(layout.num_layers)
    try:
        header = read_header(block[:hs], layout, key)
        data = torch.frombuffer(bytearray(block[hs:]), dtype=layout.dtype)
        verify_span(header, data.view(layout.block_shape))
    except KVStoreError:
        return False
    return True


def wire_blocks(peer: Peer, payload: bytes, keys: list[bytes]) -> list[tuple[bytes, bool]]:
    """Each wire block of ``payload`` and whether it passes the receiver's verification."""
    each = header_size(peer.truth.layout.num_layers) + peer.truth.layout.block_nbytes
    out = []
    for i, key in enumerate(keys):
        block = payload[i * each : (i + 1) * each]
        out.append((block, verified(peer.truth.layout, key, block)))
    return out


def judge_stored(
    peer: Peer, keys: list[bytes], blocks: list[tuple[bytes, bool] | None], statuses: list[int]
) -> str | None:
    """Judge PUT/COMMIT statuses per key; note what was stored."""
    hs = header_size(peer.truth.layout.num_layers)
    dup = {k for k in keys if keys.count(k) > 1}
    for key, sent, status in zip(keys, blocks, statuses, strict=True):
        base = status & ~SlotStatus.DURABLE
        if base not in (SlotStatus.STORED, SlotStatus.PRESENT, SlotStatus.MISS, SlotStatus.CORRUPT):
            return f"per-key status {status} in a PUT/COMMIT reply"
        if base == SlotStatus.STORED:
            if sent is None:
                return f"key {key.hex()} STORED though its bytes were never sent"
            if not sent[1]:
                return f"key {key.hex()} STORED though its block fails verification"
            peer.truth.stored(peer.namespace, key, sent[0][hs:], also=key in dup)
        if base == SlotStatus.CORRUPT and sent is not None and sent[1] and key not in dup:
            return f"a good block of key {key.hex()} answered CORRUPT"
    return None


def judge_served(
    peer: Peer,
    keys: list[bytes],
    span: tuple[int, int],
    answer: tuple[int, list[tuple[int, int]], bool],
    data: bytes,
) -> str | None:
    """Judge a GET reply: every block served, inline or in shared memory, is the bytes stored."""
    lease, slots, shared = answer
    layout = peer.truth.layout
    hs = header_size(layout.num_layers)
    nbytes = (span[1] - span[0]) * layout.layer_nbytes
    at = 0
    for key, (status, offset) in zip(keys, slots, strict=True):
        if status == SlotStatus.INLINE:
            block = data[at : at + hs + nbytes]
            at += hs + nbytes
            if len(block) != hs + nbytes:
                return "GET payload shorter than its INLINE slots"
            try:
                parse_header(block, layout, key)
            except KVStoreError as exc:
                return f"GET sent a bad header for key {key.hex()}: {exc}"
            problem = peer.truth.compare(peer.namespace, key, block[hs:], span)
        elif status == SlotStatus.SHM:
            if not shared or lease == 0 or offset + nbytes > peer.segment:
                return f"GET answered SHM at {offset} (flag {shared}, lease {lease})"
            problem = None
            if peer.mapping is not None:
                raw = peer.mapping.slot(offset, nbytes).numpy().tobytes()
                problem = peer.truth.compare(peer.namespace, key, raw, span)
        elif status != SlotStatus.MISS:
            return f"GET answered slot status {status}"
        else:
            problem = None
        if problem:
            return problem
    if at != len(data):
        return f"GET payload has {len(data) - at} bytes beyond its INLINE slots"
    if any(s == SlotStatus.SHM for s, _ in slots):  # the lease pins every block found
        peer.leases[lease] = [k for k, (s, _) in zip(keys, slots, strict=True) if s]
    return None
