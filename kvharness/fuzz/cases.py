"""The wire fuzzer's connections: valid frames built from the protocol's encoders, and
their mutations (:mod:`kvharness.fuzz.run` sends them, :mod:`kvharness.fuzz.oracle`
judges the answers).

A *case* is one connection, a generator of :class:`Step` s. It reads the connection's
model (:class:`~kvharness.fuzz.oracle.Peer`) as it goes, so a step built after a
reply sees what the reply taught (the nonce, a reservation, a lease). A step whose bytes
stay framed (``head`` set) is judged by the oracle; a step that leaves the stream mid-frame
or out of step (``head`` None: truncated frames, lying lengths, noise) ends its case, and
the server must close the connection without answering anything it should refuse.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvharness.fuzz.model import SPECS, Header, Peer, Phase
from kvharness.fuzz.mutate import bad_header, mutate_fields, mutate_json
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.layout import KVLayout
from kvstore.testing import make_keys, random_blocks
from kvstore.wire import (
    MAGIC,
    Flag,
    Op,
    SlotStatus,
    answer,
    encode_commit_request,
    encode_count,
    encode_get_request,
    encode_hint_request,
    encode_json,
    encode_keys,
    encode_span,
    encode_tokens,
    encode_u64,
    new_nonce,
)

__all__ = ["CASES", "Cases", "Pool", "Step"]

#: The namespace the reference blocks live in (the admin token's), and the one a
#: restricted token may open.
HOME, OTHER = "fuzz", "team-a"


@dataclass(frozen=True)
class Step:
    """One frame (or part of one) to send."""

    label: str  # the mutation kind
    head: Header | None = None  # judged by the oracle; None: ``raw`` leaves the stream out of step
    meta: bytes = b""
    payload: bytes = b""
    raw: bytes = b""  # the bytes of an unjudged step
    strict: bool = False  # built valid, never mutated
    shut: bool = True  # unjudged: half-close after it (False: close at once)

    def data(self) -> bytes:
        """The bytes on the wire."""
        if self.head is None:
            return self.raw
        return self.head.pack() + self.meta + self.payload


class Pool:
    """The blocks the fuzzer puts: reference keys (stored before it starts, never
    deleted), scratch keys (put, reserved, deleted by the fuzz) and their contents."""

    def __init__(self, layout: KVLayout, seed: int, reference: int = 16) -> None:
        self.layout = layout
        kv = random_blocks(layout, 32, seed)
        step = layout.block_tokens
        self.blocks = [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(32)]
        self.data = [b.view(torch.uint8).numpy().tobytes() for b in self.blocks]
        self.reference = [bytes(k) for k in make_keys(reference, salt=0xF00D)]
        self.scratch = [bytes(k) for k in make_keys(48, salt=0xBEEF)]

    def content(self, key: bytes) -> int:
        """Which block of the pool ``key`` is put with (when put honestly)."""
        for keys in (self.reference, self.scratch):
            if key in keys:
                return keys.index(key) % len(self.blocks)
        return key[0] % len(self.blocks)

    def wire_block(self, key: bytes, rng: random.Random, honest: bool = True) -> bytes:
        """``key``'s block on the wire; not ``honest``: another block's bytes under a
        consistent header, a flipped byte, or another key's header."""
        index = self.content(key)
        mode = "good" if honest else rng.choice(["other", "flip", "wrong_key"])
        if mode == "other":
            index = (index + 1 + rng.randrange(len(self.blocks) - 1)) % len(self.blocks)
        named = key if mode != "wrong_key" else bytes(rng.choice(self.scratch))
        header, pieces = encode_span(named, self.layout, self.blocks[index])  # type: ignore[arg-type]
        body = bytearray(b"".join(bytes(p) for p in pieces))
        if mode == "flip":
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        return header + bytes(body)


class Cases:
    """Makes the fuzzer's connections (see the module's docstring)."""

    def __init__(self, rng: random.Random, pool: Pool, tokens: dict[str, bytes]) -> None:
        self.rng = rng
        self.pool = pool
        self.tokens = tokens  # "admin" (opens HOME), "team" (opens OTHER only)
        self.layout = pool.layout

    # -- helpers ----------------------------------------------------------------------
    def frame(self, op: int, meta: bytes = b"", payload: bytes = b"", flags: int = 0) -> Header:
        """A header for ``meta`` and ``payload`` (request id set when sent)."""
        return Header(int(op), int(flags), len(meta), len(payload))

    def step(
        self, label: str, op: int, meta: bytes = b"", payload: bytes = b"", flags: int = 0
    ) -> Step:
        """A well-framed step (strict when ``label`` is "valid")."""
        head = self.frame(op, meta, payload, flags)
        return Step(label, head, meta, payload, strict=label == "valid")

    def keys(self, n: int, scratch_only: bool = False) -> list[bytes]:
        """``n`` keys: reference, scratch and never-stored ones (scratch only if asked)."""
        rng, out = self.rng, []
        for _ in range(n):
            roll = rng.random()
            if scratch_only or roll < 0.45:
                out.append(rng.choice(self.pool.scratch))
            elif roll < 0.85:
                out.append(rng.choice(self.pool.reference))
            else:
                out.append(rng.randbytes(16))
        return out

    def open_meta(self, namespace: str) -> bytes:
        """OPEN's meta for this layout."""
        body = {
            "namespace": namespace,
            "layout": self.layout.describe(),
            "fingerprint": self.layout.fingerprint_hex,
        }
        return encode_json(body)

    def handshake(self, peer: Peer, upto: Phase, who: str = "admin") -> Iterator[Step]:
        """Valid steps up to ``upto``."""
        if upto >= Phase.GREETED:
            yield self.step("valid", Op.HELLO, encode_json({"client": "fuzz", "protocol": 1}))
        if upto >= Phase.AUTHED:
            yield self.step("valid", Op.AUTH, answer(self.tokens[who], peer.nonce))
        if upto >= Phase.OPEN:
            yield self.step("valid", Op.OPEN, self.open_meta(HOME if who == "admin" else OTHER))

    # -- valid requests -------------------------------------------------------------
    def request(self, peer: Peer) -> Step:
        """A valid request for an open connection."""
        rng = self.rng
        if peer.reservations and rng.random() < 0.6:
            return self.commit(peer)
        if peer.segment and peer.mapping is None and rng.random() < 0.3:
            return self.step("valid", Op.SHM_ATTACH)
        op = rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()))[0]
        return _BUILDERS[op](self, peer)

    def put(self, peer: Peer, label: str = "valid") -> Step:
        keys = self.keys(self.rng.randint(1, 4), scratch_only=True)
        honest = label == "valid" or self.rng.random() < 0.5
        blocks = [self.pool.wire_block(k, self.rng, honest) for k in keys]
        flags = Flag.DURABLE if self.rng.random() < 0.1 else 0
        return self.step(label, Op.PUT, encode_keys(keys), b"".join(blocks), flags)

    def get(self, peer: Peer) -> Step:
        n = self.layout.num_layers
        first = self.rng.randrange(n)
        layers = None if self.rng.random() < 0.6 else (first, self.rng.randint(first + 1, n))
        flags = Flag.SHM if peer.segment and self.rng.random() < 0.5 else 0
        meta = encode_get_request(self.keys(self.rng.randint(1, 6)), layers)
        return self.step("valid", Op.GET, meta, flags=flags)

    def release(self, peer: Peer) -> Step:
        lease = next(iter(peer.leases)) if peer.leases else self.rng.getrandbits(64)
        flags = Flag.NO_REPLY if self.rng.random() < 0.8 else 0
        return self.step("valid", Op.RELEASE, encode_u64(lease), flags=flags)

    def tokens_step(self, peer: Peer) -> Step:
        keys = self.keys(self.rng.randint(1, 3), scratch_only=True)
        parent = self.rng.choice([None, self.rng.choice(self.pool.scratch)])
        per = self.layout.block_tokens
        ids = [self.rng.randrange(1 << 17) for _ in range(len(keys) * per)]
        chunk = ChunkTokens.of([BlockKey(k) for k in keys], ids, parent, per)
        return self.step("valid", Op.TOKENS, encode_tokens(chunk), chunk.tokens)

    def hint(self, peer: Peer) -> Step:
        rng = self.rng
        fields: dict[str, Any] = {"priority": rng.randint(0, 100)}
        if rng.random() < 0.5:
            fields["retain_s"] = rng.choice([None, 1.0, 30.0])
        if rng.random() < 0.5:
            fields["session"] = f"s{rng.randint(0, 3)}"
        keys = None if "session" in fields and rng.random() < 0.5 else self.keys(rng.randint(0, 4))
        return self.step("valid", Op.HINT, encode_hint_request(fields, keys))

    def reserve(self, peer: Peer) -> Step:
        keys = self.keys(self.rng.randint(1, 3), scratch_only=True)
        return self.step("valid", Op.RESERVE, encode_keys(keys))

    def commit(self, peer: Peer) -> Step:
        """COMMIT of a reservation: shared-memory slots written first, inline ones sent."""
        ident = self.rng.choice(list(peer.reservations))
        keys, slots = peer.reservations[ident][0]
        written, inline, shared = [], [], {}
        for i, (status, offset) in enumerate(slots):
            write = self.rng.random() < 0.85 and status != SlotStatus.PRESENT
            if status == SlotStatus.SHM and write and peer.mapping is not None:
                data = self.pool.data[self.pool.content(keys[i])]
                view = peer.mapping.slot(offset, len(data))
                view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                shared[i] = data
            elif status == SlotStatus.SHM:
                write = False
            if status == SlotStatus.INLINE and write:
                inline.append(self.pool.wire_block(keys[i], self.rng))
            written.append(write)
        peer.writes[ident] = shared
        meta = encode_commit_request(ident, written)
        return self.step("valid", Op.COMMIT, meta, b"".join(inline))

    # -- cases: one connection each ------------------------------------------------
    def valid(self, peer: Peer) -> Iterator[Step]:
        """A well-behaved client: the handshake, then valid requests."""
        yield from self.handshake(peer, Phase.OPEN)
        for _ in range(self.rng.randint(5, 30)):
            if peer.foreign or peer.phase < Phase.OPEN:
                return
            yield self.request(peer)

    def fields(self, peer: Peer) -> Iterator[Step]:
        """Valid frames whose metas and payloads are mutated (lengths kept consistent)."""
        if self.rng.random() < 0.1:
            yield self.mutate(self.step("valid", Op.HELLO, encode_json({"client": "fuzz"})))
        if peer.phase == Phase.NEW:
            yield from self.handshake(peer, Phase.AUTHED)
        elif peer.phase == Phase.GREETED:
            yield self.step("valid", Op.AUTH, answer(self.tokens["admin"], peer.nonce))
        if self.rng.random() < 0.3:
            yield self.mutate(self.step("valid", Op.OPEN, self.open_meta(HOME)))
        if peer.phase == Phase.AUTHED:
            yield self.step("valid", Op.OPEN, self.open_meta(HOME))
        for _ in range(self.rng.randint(5, 30)):
            if peer.foreign or peer.phase < Phase.OPEN:
                return
            if self.rng.random() < 0.3:
                yield self.request(peer)
                continue
            base = self.request(peer) if self.rng.random() < 0.8 else self.put(peer, "fields")
            yield self.mutate(base)

    def mutate(self, base: Step) -> Step:
        """``base`` with its meta (or payload) cut, extended, flipped or replaced."""
        assert base.head is not None
        meta, payload, flags = mutate_fields(self.rng, base.meta, base.payload, base.head)
        if base.head.op in (Op.OPEN, Op.HELLO, Op.STATS) and self.rng.random() < 0.7:
            meta = mutate_json(self.rng, base.meta)
            if base.head.op == Op.OPEN and self.rng.random() < 0.5:
                meta = _refingerprint(meta)
        if not SPECS[Op(base.head.op)].payload:
            payload = b""
        return Step("fields", self.frame(base.head.op, meta, payload, flags), meta, payload)

    def header(self, peer: Peer) -> Iterator[Step]:
        """Frames with a bad header field: version, magic, op, flags, status, lengths."""
        yield from self.handshake(peer, self.rng.choice(list(Phase)))
        for _ in range(self.rng.randint(1, 4)):
            base = self.request(peer) if peer.phase == Phase.OPEN else self.ping_or_hello(peer)
            assert base.head is not None
            head, meta, payload = bad_header(self.rng, base.head, base.meta, base.payload, peer)
            yield Step("header", head, meta, payload)

    def ping_or_hello(self, peer: Peer) -> Step:
        """A request valid for a connection before OPEN."""
        if peer.phase == Phase.NEW:
            return self.step("valid", Op.HELLO, encode_json({"client": "fuzz"}))
        return self.step("valid", Op.PING)

    def order(self, peer: Peer) -> Iterator[Step]:
        """Valid frames out of the handshake's order."""
        yield from self.handshake(peer, self.rng.choice(list(Phase)))
        opened = Peer(peer.truth, peer.secrets, peer.limits, Phase.OPEN, peer.nonce)
        for _ in range(self.rng.randint(1, 3)):
            roll = self.rng.random()
            if roll < 0.3:
                yield self.step("order", Op.HELLO, encode_json({"client": "again"}))
            elif roll < 0.45:
                yield self.step("order", Op.AUTH, answer(self.tokens["admin"], peer.nonce))
            elif roll < 0.6:
                yield self.step("order", Op.OPEN, self.open_meta(HOME))
            else:
                yield replace(self.request(opened), label="order", strict=False)

    def tokens_case(self, peer: Peer) -> Iterator[Step]:
        """Requests without a token, with a wrong one, a replayed answer; a token's
        forbidden namespace; another namespace's blocks."""
        yield from self.handshake(peer, Phase.GREETED)
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:  # no AUTH at all
            yield replace(self.request(Peer(peer.truth, {}, peer.limits, Phase.OPEN)), label="auth")
            return
        if roll < 0.6:
            wrong = rng.choice(
                [
                    answer(b"not-the-token-0123456789", peer.nonce),
                    answer(self.tokens["admin"], new_nonce()),  # a replayed answer
                    rng.randbytes(32),
                    rng.randbytes(rng.choice([0, 31, 33, 64])),
                ]
            )
            yield self.step("auth", Op.AUTH, wrong)
            return
        yield self.step("valid", Op.AUTH, answer(self.tokens["team"], peer.nonce))
        yield self.step("auth", Op.OPEN, self.open_meta(HOME))  # forbidden: FORBIDDEN, stays
        yield self.step("valid", Op.OPEN, self.open_meta(OTHER))
        for _ in range(rng.randint(1, 6)):  # HOME's blocks are not there
            yield self.get(peer) if rng.random() < 0.6 else self.request(peer)

    def truncated(self, peer: Peer) -> Iterator[Step]:
        """A valid frame cut short, then a close or a half-close."""
        yield from self.handshake(peer, self.rng.choice(list(Phase)))
        base = self.request(peer) if peer.phase == Phase.OPEN else self.ping_or_hello(peer)
        data = base.data()
        cut = self.rng.randint(1, len(data) - 1)
        yield Step("truncated", raw=data[:cut], shut=self.rng.random() < 0.5)

    def lengths(self, peer: Peer) -> Iterator[Step]:
        """A valid frame whose header says more (or fewer) bytes than follow."""
        yield from self.handshake(peer, self.rng.choice(list(Phase)))
        base = self.request(peer) if peer.phase == Phase.OPEN else self.ping_or_hello(peer)
        assert base.head is not None
        body = base.meta + base.payload
        for _ in range(8):
            d = self.rng.randint(1, 64)
            if self.rng.random() < 0.5 and base.head.meta_len >= d:
                head = replace(base.head, meta_len=base.head.meta_len - d)
                leftover = body[head.meta_len :]
            else:
                head = replace(base.head, meta_len=base.head.meta_len + d)
                leftover = b""
            if leftover[: len(MAGIC)] != MAGIC:  # the leftover must not read as a frame
                yield Step("lengths", raw=head.pack() + body)
                return

    def noise(self, peer: Peer) -> Iterator[Step]:
        """Random bytes where a frame should start."""
        yield from self.handshake(peer, self.rng.choice(list(Phase)))
        noise = bytearray(self.rng.randbytes(self.rng.randint(1, 200)))
        if noise[0] == MAGIC[0]:
            noise[0] ^= 0xFF
        yield Step("noise", raw=bytes(noise))


def _refingerprint(meta: bytes) -> bytes:
    """An OPEN meta whose fingerprint matches its (mutated) layout, where it has one:
    such an OPEN opens a store of another layout."""
    try:
        body = json.loads(meta)
        body["fingerprint"] = KVLayout.from_description(body["layout"]).fingerprint_hex
    except Exception:  # not a layout: left as it is
        return meta
    return encode_json(body)


def _key_query(cases: Cases, peer: Peer, op: Op) -> Step:
    """EXISTS, LOOKUP or DELETE (of scratch keys only: the reference blocks stay; blocks
    this connection holds a lease on among them, at times, which must be refused)."""
    keys = cases.keys(cases.rng.randint(0, 6), scratch_only=op == Op.DELETE)
    leased = [k for pinned in peer.leases.values() for k in pinned if k in cases.pool.scratch]
    if op == Op.DELETE and leased and cases.rng.random() < 0.2:
        keys.append(cases.rng.choice(leased))
    return cases.step("valid", op, encode_keys(keys))


_WEIGHTS = {
    Op.PUT: 14,
    Op.GET: 22,
    Op.RELEASE: 6,
    Op.EXISTS: 8,
    Op.LOOKUP: 6,
    Op.DELETE: 4,
    Op.LIST: 3,
    Op.TOKENS: 4,
    Op.HINT: 6,
    Op.RESERVE: 8,
    Op.STATS: 2,
    Op.ADMIN: 1,
    Op.PING: 3,
}
_BUILDERS: dict[Op, Callable[[Cases, Peer], Step]] = {
    Op.PUT: Cases.put,
    Op.GET: Cases.get,
    Op.RELEASE: Cases.release,
    Op.EXISTS: lambda c, p: _key_query(c, p, Op.EXISTS),
    Op.LOOKUP: lambda c, p: _key_query(c, p, Op.LOOKUP),
    Op.DELETE: lambda c, p: _key_query(c, p, Op.DELETE),
    Op.LIST: lambda c, p: c.step("valid", Op.LIST, encode_count(c.rng.randint(0, 64))),
    Op.TOKENS: Cases.tokens_step,
    Op.HINT: Cases.hint,
    Op.RESERVE: Cases.reserve,
    Op.STATS: lambda c, p: c.step("valid", Op.STATS),
    # read-only: a fuzzed change of the server's tokens would lock the fuzzer out
    Op.ADMIN: lambda c, p: c.step("valid", Op.ADMIN, encode_json({"action": "tenants"})),
    Op.PING: lambda c, p: c.step("valid", Op.PING),
}

#: Each case and its share of the connections.
CASES: dict[str, tuple[Callable[[Cases, Peer], Iterator[Step]], int]] = {
    "valid": (Cases.valid, 12),
    "fields": (Cases.fields, 24),
    "header": (Cases.header, 16),
    "order": (Cases.order, 12),
    "auth": (Cases.tokens_case, 12),
    "truncated": (Cases.truncated, 10),
    "lengths": (Cases.lengths, 8),
    "noise": (Cases.noise, 6),
}
