"""What the wire protocol says a server must answer: the wire fuzzer's oracle.

:func:`expect` takes a frame exactly as the fuzzer (:mod:`kvharness.fuzz.run`) sends it
-- header fields, meta, payload -- and the connection's state as the fuzzer models it
(:class:`Peer`), and returns what docs/protocol.md allows in reply (:class:`Expect`):
which statuses, whether a refusal closes the connection, and a check of a successful
reply. It decides with the protocol's own code: the header is :data:`FRAME`, the ops are
:class:`Op`, and a request's fields are valid exactly when the protocol's decoders
(``decode_keys``, ``decode_get_request``, ...) accept them, so a mutated request is
judged the way the server must judge it. The one thing written by hand is
:data:`~kvharness.fuzz.model.SPECS`: which handshake step each op needs and whether
it carries a payload (the docs' table).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvharness.fuzz.model import (
    SPECS,
    Check,
    Expect,
    Header,
    Peer,
    Phase,
    judge_served,
    judge_stored,
    wire_blocks,
)
from kvstore.config import check_namespace
from kvstore.errors import KVStoreError, ProtocolError
from kvstore.format import header_size
from kvstore.layout import KVLayout
from kvstore.wire import (
    MAGIC,
    VERSION,
    Flag,
    Op,
    SlotStatus,
    Status,
    answer,
    attach,
    decode_commit_request,
    decode_count,
    decode_get_reply,
    decode_get_request,
    decode_hint_request,
    decode_json,
    decode_keys,
    decode_put_reply,
    decode_reserve_reply,
    decode_tokens,
    decode_u64,
)

__all__ = ["expect"]

_KNOWN = frozenset(int(op) for op in Op)
Rule = Callable[[Peer, Header, bytes, bytes, bool], Expect]


def _refuse(status: Status, fatal: bool = False) -> Expect:
    return Expect(frozenset({status}), fatal)


def _maybe(check: Check | None, strict: bool, *others: Status) -> Expect:
    """Success allowed (checked); a request the fuzzer mutated (not ``strict``) may also
    be refused as a bad request, since its fields may mean nothing to the store."""
    allowed = {Status.OK, *others}
    if not strict:
        allowed.add(Status.BAD_REQUEST)
    return Expect(frozenset(allowed), check=check)


def expect(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool = False) -> Expect:
    """What the protocol allows in reply to this frame on ``peer`` (``strict``: a request
    built valid, never mutated)."""
    if head.magic != MAGIC:
        return Expect(frozenset({Status.BAD_FRAME}), True, header_error=True)
    if head.version != VERSION:
        return Expect(frozenset({Status.UNSUPPORTED_VERSION}), True, header_error=True)
    if head.flags & Flag.REPLY or head.status:
        return _refuse(Status.BAD_FRAME, True)
    if head.meta_len > peer.meta_limit or head.payload_len > peer.limits["max_frame_bytes"]:
        return _refuse(Status.TOO_LARGE, True)
    spec = SPECS.get(Op(head.op)) if head.op in _KNOWN else None
    if head.payload_len and (spec is None or not spec.payload):
        return _refuse(Status.BAD_FRAME, True)
    if spec is None:
        return _refuse(Status.UNKNOWN_OP, peer.phase < Phase.AUTHED)
    op = Op(head.op)
    if op in (Op.HELLO, Op.AUTH):
        if peer.phase != spec.phase:
            return _refuse(Status.BAD_REQUEST, True)
    elif peer.phase < Phase.GREETED or (op != Op.PING and peer.phase < Phase.AUTHED):
        return _refuse(Status.UNAUTHENTICATED, True)
    elif spec.phase == Phase.OPEN and peer.phase < Phase.OPEN:
        return _refuse(Status.NOT_OPEN, True)
    return _RULES[op](peer, head, meta, payload, strict)


def _hello(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        decode_json(meta)
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)

    def check(reply: bytes, _: bytes) -> str | None:
        info = decode_json(reply)
        if info.get("auth") != ("token" if peer.secrets else "none"):
            return f"HELLO answered auth {info.get('auth')!r}"
        peer.nonce = bytes.fromhex(info["nonce"])
        peer.phase = Phase.GREETED if peer.secrets else Phase.AUTHED
        return None

    return Expect(frozenset({Status.OK}), check=check)


def _auth(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    match = [
        spaces
        for token, spaces in peer.secrets.values()
        if peer.nonce and meta == answer(token, peer.nonce)
    ]
    if not match:
        return _refuse(Status.UNAUTHENTICATED, True)

    def check(reply: bytes, _: bytes) -> str | None:
        decode_json(reply)
        peer.phase, peer.allowed = Phase.AUTHED, match[0]
        return None

    return Expect(frozenset({Status.OK}), check=check)


def _open(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    if peer.phase == Phase.OPEN:
        return _refuse(Status.BAD_REQUEST)
    try:
        request = decode_json(meta)
        namespace = check_namespace(request.get("namespace"), "namespace")
    except KVStoreError:
        return _refuse(Status.BAD_REQUEST)
    if peer.allowed is not None and namespace not in peer.allowed:
        return _refuse(Status.FORBIDDEN)
    try:
        layout = KVLayout.from_description(request.get("layout"))
        fingerprint = layout.fingerprint_hex
    except Exception:  # whatever a described layout raises, it opens nothing
        return _refuse(Status.BAD_REQUEST)
    if request.get("fingerprint") != fingerprint:
        return _refuse(Status.BAD_REQUEST)

    def check(reply: bytes, _: bytes) -> str | None:
        info = decode_json(reply)
        peer.phase, peer.namespace = Phase.OPEN, namespace
        peer.foreign = layout != peer.truth.layout
        shared = info.get("shared_memory")
        peer.segment = int(shared["nbytes"]) if isinstance(shared, dict) else 0
        return None

    return _maybe(check, strict, Status.BUSY)  # a layout too big for the tiers: BAD_REQUEST


def _json_reply(reply: bytes, _: bytes) -> str | None:
    decode_json(reply)
    return None


def _empty_reply(reply: bytes, payload: bytes) -> str | None:
    return None if not reply and not payload else "PING answered with bytes"


def _ping(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    return Expect(frozenset({Status.OK}), check=_empty_reply)


def _stats(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    """A STATS request: answered in JSON; a meta that names a namespace (JSON
    ``{"namespace": NS}``) is refused when malformed, or when the token does not open it."""
    if not meta:
        return Expect(frozenset({Status.OK}), check=_json_reply)
    try:
        asked = decode_json(meta).get("namespace")
        if asked is not None:
            check_namespace(asked, "namespace")
    except KVStoreError:
        return _refuse(Status.BAD_REQUEST)
    return Expect(frozenset({Status.OK, Status.FORBIDDEN}), check=_json_reply)


def _admin(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    """An ADMIN request: answered in JSON, refused as malformed (or by a server that
    takes none), or refused to a token without the admin scope; never fatal."""
    allowed = frozenset({Status.OK, Status.BAD_REQUEST, Status.NOT_PERMITTED})
    return Expect(allowed, check=_json_reply)


def _attach(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    def check(reply: bytes, _: bytes) -> str | None:
        info = decode_json(reply)
        if int(info.get("nbytes", -1)) != peer.segment:
            return f"SHM_ATTACH names {info.get('nbytes')} bytes, OPEN said {peer.segment}"
        if peer.mapping is None:
            try:  # over TCP on this host: the server's memfd through /proc
                peer.mapping = attach(info, None)
            except (OSError, KVStoreError):
                peer.mapping = None
        return None

    return Expect(frozenset({Status.OK, Status.BAD_REQUEST}), check=check)


def _put(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        keys = [bytes(k) for k in decode_keys(meta, 0, peer.limits["max_batch_blocks"])]
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)
    each = header_size(peer.truth.layout.num_layers) + peer.truth.layout.block_nbytes
    if head.payload_len != len(keys) * each or len(payload) != head.payload_len:
        return _refuse(Status.BAD_REQUEST)
    sent: list[tuple[bytes, bool] | None] = list(wire_blocks(peer, payload, keys))

    def check(reply: bytes, _: bytes) -> str | None:
        return judge_stored(peer, keys, sent, decode_put_reply(reply, len(keys)))

    return _maybe(check, strict, Status.BUSY)


def _reserve(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        keys = [bytes(k) for k in decode_keys(meta, 0, peer.limits["max_batch_blocks"])]
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)

    def check(reply: bytes, _: bytes) -> str | None:
        ident, slots = decode_reserve_reply(reply, len(keys))
        for status, offset in slots:
            if status not in (SlotStatus.SHM, SlotStatus.INLINE, SlotStatus.PRESENT):
                return f"RESERVE answered slot status {status}"
            if status == SlotStatus.SHM and offset + peer.truth.layout.block_nbytes > peer.segment:
                return f"RESERVE offset {offset} outside the {peer.segment}-byte segment"
        if ident in peer.reservations:
            return f"RESERVE handed out reservation {ident} twice"
        peer.reservations[ident] = [(keys, slots)]
        return None

    return _maybe(check, strict, Status.BUSY)


def _commit(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        ident, written = decode_commit_request(meta, peer.limits["max_batch_blocks"])
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)
    held = peer.reservations.get(ident)
    if held is None or len(written) != len(held[0][1]):
        return _refuse(Status.BAD_REQUEST)
    keys, slots = held[0]
    inline = [i for i, (s, _) in enumerate(slots) if s == SlotStatus.INLINE and written[i]]
    each = header_size(peer.truth.layout.num_layers) + peer.truth.layout.block_nbytes
    if head.payload_len != len(inline) * each:
        return _refuse(Status.BAD_REQUEST)
    got = iter(wire_blocks(peer, payload, [keys[i] for i in inline]))
    shm = peer.writes.get(ident, {})
    hs = header_size(peer.truth.layout.num_layers)
    sent: list[tuple[bytes, bool] | None] = []
    for i, (status, _) in enumerate(slots):
        if i in inline:
            sent.append(next(got))
        elif status == SlotStatus.SHM and written[i]:
            # shared memory is trusted, unverified: what the fuzzer wrote there, if it did
            sent.append((b"\0" * hs + shm.get(i, b""), True))
        else:
            sent.append(None)

    def check(reply: bytes, _: bytes) -> str | None:
        del peer.reservations[ident]
        return judge_stored(peer, keys, sent, decode_put_reply(reply, len(keys)))

    return _maybe(check, strict, Status.BUSY)


def _get(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    layout = peer.truth.layout
    try:
        keys, layers = decode_get_request(meta, layout.num_layers, peer.limits["max_batch_blocks"])
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)
    span = layers if layers is not None else (0, layout.num_layers)
    shared = bool(head.flags & Flag.SHM)

    def check(reply: bytes, data: bytes) -> str | None:
        lease, slots = decode_get_reply(reply, len(keys))
        return judge_served(peer, [bytes(k) for k in keys], span, (lease, slots, shared), data)

    return _maybe(check, strict, Status.BUSY)


def _release(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        lease = decode_u64(meta)
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)
    peer.leases.pop(lease, None)
    return Expect(
        frozenset({Status.OK}), check=_empty_reply, answered=not head.flags & Flag.NO_REPLY
    )


def _keys_op(op: Op) -> Rule:
    def rule(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
        try:
            keys = [bytes(k) for k in decode_keys(meta, 0, peer.limits["max_batch_blocks"])]
        except ProtocolError:
            return _refuse(Status.BAD_REQUEST)
        leased = {k for pinned in peer.leases.values() for k in pinned}
        if op == Op.DELETE and leased.intersection(keys):
            return _refuse(Status.BUSY)  # its own lease: a delete would wait for this client
        return _maybe(_KEY_CHECKS[op](peer, keys), strict)

    return rule


def _exists_check(peer: Peer, keys: list[bytes]) -> Check:
    def check(reply: bytes, _: bytes) -> str | None:
        if len(reply) != 4 + len(keys) or decode_count(reply[:4]) != len(keys):
            return "EXISTS reply of the wrong size"
        for key, found in zip(keys, reply[4:], strict=True):
            if found not in (0, 1) or (found and not peer.truth.holds(peer.namespace, key)):
                return f"EXISTS says key {key.hex()} is stored; it never was"
        return None

    return check


def _lookup_check(peer: Peer, keys: list[bytes]) -> Check:
    def check(reply: bytes, _: bytes) -> str | None:
        found = decode_count(reply)
        if found > len(keys) or any(not peer.truth.holds(peer.namespace, k) for k in keys[:found]):
            return f"LOOKUP says {found} of {len(keys)} leading keys are stored; they never were"
        return None

    return check


def _delete_check(peer: Peer, keys: list[bytes]) -> Check:
    def check(reply: bytes, _: bytes) -> str | None:
        if decode_count(reply) > len(set(keys)):
            return f"DELETE of {len(keys)} keys deleted {decode_count(reply)}"
        for key in keys:
            peer.truth.forget(peer.namespace, key)
        return None

    return check


_KEY_CHECKS = {Op.EXISTS: _exists_check, Op.LOOKUP: _lookup_check, Op.DELETE: _delete_check}


def _list(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        limit = decode_count(meta)
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)

    def check(reply: bytes, data: bytes) -> str | None:
        n = decode_count(reply)
        if n > limit or len(data) != 16 * n:
            return f"LIST of at most {limit} answered {n} keys in {len(data)} bytes"
        for i in range(n):
            if not peer.truth.holds(peer.namespace, data[16 * i : 16 * i + 16]):
                return f"LIST names key {data[16 * i : 16 * i + 16].hex()}, never stored here"
        return None

    return _maybe(check, strict)


def _tokens(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    layout = peer.truth.layout
    try:
        block_tokens, _parent, keys = decode_tokens(meta, peer.limits["max_batch_blocks"])
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)
    if block_tokens != layout.block_tokens or head.payload_len != 4 * block_tokens * len(keys):
        return _refuse(Status.BAD_REQUEST)

    def check(reply: bytes, _: bytes) -> str | None:
        n = decode_count(reply)
        return None if n == len(keys) else f"TOKENS of {len(keys)} chunks answered {n}"

    return _maybe(check, strict)


def _hint(peer: Peer, head: Header, meta: bytes, payload: bytes, strict: bool) -> Expect:
    try:
        decode_hint_request(meta, peer.limits["max_batch_blocks"])
    except ProtocolError:
        return _refuse(Status.BAD_REQUEST)

    def check(reply: bytes, _: bytes) -> str | None:
        answer: dict[str, Any] = decode_json(reply)
        if answer.get("status") not in ("accepted", "clipped", "rejected"):
            return f"HINT answered {json.dumps(answer)[:200]}"
        return None

    return _maybe(check, strict)


_RULES: dict[Op, Rule] = {
    Op.HELLO: _hello,
    Op.AUTH: _auth,
    Op.OPEN: _open,
    Op.SHM_ATTACH: _attach,
    Op.PING: _ping,
    Op.STATS: _stats,
    Op.ADMIN: _admin,
    Op.PUT: _put,
    Op.RESERVE: _reserve,
    Op.COMMIT: _commit,
    Op.GET: _get,
    Op.RELEASE: _release,
    Op.EXISTS: _keys_op(Op.EXISTS),
    Op.LOOKUP: _keys_op(Op.LOOKUP),
    Op.DELETE: _keys_op(Op.DELETE),
    Op.LIST: _list,
    Op.TOKENS: _tokens,
    Op.HINT: _hint,
}
