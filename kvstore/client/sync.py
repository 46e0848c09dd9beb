"""The blocking client of kvstore-server, thread-safe, with a pool of connections.

>>> client = Client(layout, ClientOptions(address="127.0.0.1:7070", namespace="team-a"))
>>> client.put(keys, blocks)          # one bool per key: stored (or already there)
>>> client.get(keys, outs)            # one bool per key: read and verified into outs[i]

Bytes move straight between the caller's tensors and the socket (``sendall``
from the tensor's memory, ``recv_into`` it) and every block received is
verified against its header before ``get`` reports it. On the same host the
client maps the server's shared memory and copies blocks in and out of their
slots itself. A server that is down or restarting costs a bounded wait and a
:class:`~kvstore.errors.TierError` (the store turns it into a miss); after an
outage the client probes once per ``retry_interval`` and reconnects by itself.

A server that refuses the token raises :class:`~kvstore.errors.AccessDeniedError`,
one line naming the server and namespace; like an outage, the refusal is then
answered from memory and probed once per ``retry_interval``.

Lock ownership: ``_lock`` guards the idle-connection list and the latest
refusal; ``_slots`` bounds the connections in use to ``pool_size``. A
connection is used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from kvstore.client._common import (
    ClientOptions,
    batches,
    check_layers,
    hint_answer,
    hint_request,
    same_length,
)
from kvstore.client.connection import Connection, Dead
from kvstore.client.receive import RECV_GROUP, copy_from_shm, receive, slot_tensor
from kvstore.copies import engine_for
from kvstore.errors import (
    AccessDeniedError,
    ClosedError,
    InvalidInputError,
    LayoutMismatchError,
    ProtocolError,
    ScopeError,
    StoreLimitError,
    TierError,
)
from kvstore.format import Codec, encode_block
from kvstore.hints import Hint, HintAnswer
from kvstore.keys import BlockKey, ChunkTokens, check_keys
from kvstore.layout import KVLayout
from kvstore.runtime import Backoff, Breaker, retry_call
from kvstore.wire import (
    Flag,
    Op,
    SlotStatus,
    decode_count,
    decode_get_reply,
    decode_put_reply,
    decode_reserve_reply,
    encode_commit_request,
    encode_count,
    encode_get_request,
    encode_keys,
    encode_tokens,
    encode_u64,
    wire_nbytes,
)
from kvstore.wire import Mapping as ShmMapping

__all__ = ["Client"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
# A pooled connection found dead (the server restarted) is replaced once, at once.
_STALE = Backoff(base=0.005, cap=0.02, max_attempts=2, deadline=1.0)


class Client:
    """A pool of connections to one (namespace, layout) store of a kvstore-server."""

    def __init__(
        self, layout: KVLayout, options: ClientOptions | None = None, *, quiet: bool = False
    ) -> None:
        """``quiet``: outages and recoveries are logged at DEBUG, for a caller that says
        them itself (a store's tier I/O logs each once, naming the tier)."""
        self.layout = layout
        self.options = options or ClientOptions()
        self._quiet = quiet
        #: Why the server was last found unreachable: what calls the breaker holds back
        #: raise, so that whoever reports them says why, not only "unavailable".
        self._outage = ""
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.options.pool_size)
        self._breaker = Breaker(self.options.retry_interval)
        # Segment id -> this client's mapping of it (None: this host cannot map it). A
        # server restart brings a new segment; connections to it use the new mapping.
        self._mappings: dict[str, ShmMapping | None] = {}
        self._limits: dict[str, Any] = {}
        # The server's latest refusal of this client's token or store (None: it accepted
        # them, or it was not reached): what calls raise while the breaker holds them back.
        self._refusal: AccessDeniedError | StoreLimitError | None = None
        self._closed = False
        self.stats: dict[str, int] = {
            "reconnects": 0,
            "shm_blocks": 0,
            "socket_blocks": 0,
            "corrupt_retries": 0,
            # blocks copied out of shared memory too late to trust, or not written into
            # reserved slots given back too late to write
            "shm_late": 0,
        }

    # -- connections ------------------------------------------------------------
    @contextlib.contextmanager
    def _connection(self) -> Iterator[Connection]:
        if not self._slots.acquire(timeout=self.options.timeout):
            raise TierError("no kvstore-server connection free within the timeout")
        conn: Connection | None = None
        try:
            with self._lock:
                if self._closed:
                    raise ClosedError("the client is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._new_connection()
            yield conn
            with self._lock:
                if not self._closed:
                    self._idle.append(conn)
                    conn = None
        finally:
            if conn is not None:
                conn.close()
            self._slots.release()

    def _new_connection(self) -> Connection:
        try:
            conn = Connection(self.options, self.layout)
        except ProtocolError as exc:  # the address answers in another protocol
            self._not_understood(exc)
            raise
        self._limits = conn.limits
        ident = conn.segment_id
        if self.options.shared_memory and ident is not None:
            with self._lock:
                known = ident in self._mappings
                mapping = self._mappings.get(ident)
            if not known:
                mapping = conn.attach_shared_memory()
                with self._lock:
                    mapping = self._mappings.setdefault(ident, mapping)
            conn.shm = mapping
        return conn

    def _run(self, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)``; a dead pooled connection is replaced once; outages trip the breaker."""
        if not self._breaker.allow():
            with self._lock:
                refusal, outage = self._refusal, self._outage
            if refusal is not None:  # still refused, as far as this client knows
                raise type(refusal)(str(refusal))
            why = f" (last try: {outage})" if outage else ""
            raise TierError(f"kvstore-server at {self.options.address} is unavailable{why}")

        def attempt() -> T:
            with self._connection() as conn:
                return fn(conn)

        try:
            result = retry_call(
                attempt, lambda e: isinstance(e, Dead), _STALE, on_retry=self._retry
            )
        except ScopeError:
            raise  # this op only: the token is good for the others
        except (AccessDeniedError, StoreLimitError) as exc:
            # A refused token, or a store the server will not open (max_stores), is not
            # retried on every call (each try is a handshake the server logs): one probe
            # per retry_interval, like an outage. Whoever called says so (the store's
            # tier I/O logs it once), as what it is, not as an outage.
            with self._lock:
                self._refusal = exc
            self._breaker.failed()
            raise
        except (TierError, OSError) as exc:
            with self._lock:
                self._refusal = None
            with self._lock:
                self._outage = str(exc)
            if self._breaker.failed():
                level = logging.DEBUG if self._quiet else logging.WARNING
                log.log(level, "kvstore-server at %s unavailable: %s", self.options.address, exc)
            raise TierError(str(exc)) from None
        with self._lock:
            self._refusal = None
        if self._breaker.succeeded():
            level = logging.DEBUG if self._quiet else logging.INFO
            log.log(level, "kvstore-server at %s is reachable again", self.options.address)
        return result

    def _not_understood(self, exc: ProtocolError) -> None:
        """The handshake was answered in another protocol (a server of another release
        took the address): like an outage, probed once per ``retry_interval`` rather than
        a handshake per call, and said once."""
        with self._lock:
            self._refusal, self._outage = None, str(exc)
        if self._breaker.failed():
            log.log(logging.DEBUG if self._quiet else logging.WARNING, "%s", exc)

    def _retry(self, attempt: int, exc: BaseException) -> None:
        self.stats["reconnects"] += 1
        with self._lock:  # the others in the pool went stale with it
            stale, self._idle = self._idle, []
        for conn in stale:
            conn.close()

    # -- blocks -------------------------------------------------------------------
    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], durable: bool | None = None
    ) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]``; True where stored or already there.

        ``durable`` (default: the options'): acknowledged only once on the
        server's persistent tier (see :meth:`put_statuses` for which were).
        """
        return [s & 0x7F in _HELD for s in self.put_statuses(keys, blocks, durable)]

    def put_statuses(
        self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], durable: bool | None = None
    ) -> list[int]:
        """Like :meth:`put`, with the server's :class:`SlotStatus` per key (STORED,
        PRESENT, MISS, CORRUPT; or-ed with DURABLE when on a persistent tier)."""
        keys = check_keys(keys)
        same_length(keys, blocks, "blocks")
        for block in blocks:
            if tuple(block.shape) != self.layout.block_shape or block.dtype != self.layout.dtype:
                raise LayoutMismatchError(
                    f"block of shape {tuple(block.shape)} / {block.dtype} does not match layout "
                    f"{self.layout.block_shape} / {self.layout.dtype}"
                )
        flags = Flag.DURABLE if (self.options.durable if durable is None else durable) else 0
        out: list[int] = [SlotStatus.MISS] * len(keys)
        for idx in self._batches(len(keys), None):
            part_keys, part_blocks = [keys[i] for i in idx], [blocks[i] for i in idx]

            def batch(
                c: Connection, k: list[BlockKey] = part_keys, b: list[torch.Tensor] = part_blocks
            ) -> list[int]:
                return self._put_batch(c, k, b, flags)

            for i, status in zip(idx, self._run(batch), strict=True):
                out[i] = status
        return out

    def _put_batch(
        self, conn: Connection, keys: list[BlockKey], blocks: list[torch.Tensor], flags: int
    ) -> list[int]:
        if conn.shm is not None:
            return self._put_shared(conn, keys, blocks, flags)
        # The header goes first (the payload's size is known), then the blocks a few MiB
        # at a time, each group checksummed just before it goes: the server receives one
        # group while this thread hashes the next.
        rid = conn.send_head(Op.PUT, encode_keys(keys), len(keys) * wire_nbytes(self.layout), flags)
        group: list[Buffer] = []
        size = 0
        for key, block in zip(keys, blocks, strict=True):
            encoded = encode_block(key, self.layout, block, Codec.RAW)
            group += encoded.parts()
            size += encoded.nbytes
            if size >= RECV_GROUP:
                conn.send_parts(group)
                group, size = [], 0
        conn.send_parts(group)
        _, meta = conn.reply(rid, Op.PUT)
        self.stats["socket_blocks"] += len(keys)
        return decode_put_reply(meta, len(keys))

    def _put_shared(
        self, conn: Connection, keys: list[BlockKey], blocks: list[torch.Tensor], flags: int
    ) -> list[int]:
        """RESERVE slots, copy into them through shared memory, COMMIT."""
        assert conn.shm is not None
        asked = time.monotonic()
        _, meta = conn.call(Op.RESERVE, encode_keys(keys))
        ident, slots = decode_reserve_reply(meta, len(keys))
        if not _within_loan(conn.reserve_s, asked):
            return self._reserved_too_late(conn, ident, slots)
        written = [False] * len(keys)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        inline: list[Buffer] = []
        try:
            for i, (key, block, (status, offset)) in enumerate(
                zip(keys, blocks, slots, strict=True)
            ):
                if status == SlotStatus.SHM:
                    pairs.append((slot_tensor(conn.shm, self.layout, offset, block.shape), block))
                elif status == SlotStatus.INLINE:
                    inline += encode_block(key, self.layout, block, Codec.RAW).parts()
                written[i] = status in (SlotStatus.SHM, SlotStatus.INLINE)
            engine_for("cpu").copy_all(pairs)
        except BaseException:
            conn.reply(
                conn.send(Op.COMMIT, encode_commit_request(ident, [False] * len(keys))), Op.COMMIT
            )
            raise
        rid = conn.send(Op.COMMIT, encode_commit_request(ident, written), inline, flags)
        _, meta = conn.reply(rid, Op.COMMIT)
        self.stats["shm_blocks"] += len(pairs)
        return decode_put_reply(meta, len(keys))

    def _reserved_too_late(
        self, conn: Connection, ident: int, slots: list[tuple[int, int]]
    ) -> list[int]:
        """A reservation whose reply came so late that the server may have dropped it
        (a thread starved of CPU): its slots may go to other blocks, so nothing is
        written. Its COMMIT of nothing tells the server; none is stored."""
        shared = sum(1 for status, _ in slots if status == SlotStatus.SHM)
        self.stats["shm_late"] += shared
        log.warning(
            "kvstore client: a reservation of %d slots came back after its time (%.3g s) "
            "may have ended; not written",
            shared,
            conn.reserve_s,
        )
        commit = encode_commit_request(ident, [False] * len(slots))
        with contextlib.suppress(InvalidInputError):  # dropped indeed: the server says so
            conn.reply(conn.send(Op.COMMIT, commit), Op.COMMIT)
        return [
            SlotStatus.PRESENT if status == SlotStatus.PRESENT else SlotStatus.MISS
            for status, _ in slots
        ]

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: tuple[int, int] | None = None,
    ) -> list[bool]:
        """Read each stored block (or its ``layers``) into ``outs[i]``, verified; False
        where the server has none (``outs[i]`` untouched) or its bytes failed twice.

        A block that arrives damaged is asked for once more before it counts as
        lost: damage on the wire is usually transient, and a miss makes the
        store drop the server's (good) copy.
        """
        keys = check_keys(keys)
        same_length(keys, outs, "output tensors")
        layers = check_layers(self.layout, layers)
        done = self._get_once(keys, outs, layers)
        again = [i for i, ok in enumerate(done) if ok is None]
        if again:
            self.stats["corrupt_retries"] += len(again)
            retried = self._get_once([keys[i] for i in again], [outs[i] for i in again], layers)
            for i, ok in zip(again, retried, strict=True):
                done[i] = ok
        return [ok is True for ok in done]

    def _get_once(
        self, keys: list[BlockKey], outs: Sequence[torch.Tensor], layers: tuple[int, int] | None
    ) -> list[bool | None]:
        """One pass of :meth:`get`: True read, False a miss, None damaged on arrival."""
        done: list[bool | None] = [False] * len(keys)
        for idx in self._batches(len(keys), layers):
            part_keys, part_outs = [keys[i] for i in idx], [outs[i] for i in idx]

            def batch(
                c: Connection, k: list[BlockKey] = part_keys, o: list[torch.Tensor] = part_outs
            ) -> list[bool | None]:
                return self._get_batch(c, k, o, layers)

            for i, ok in zip(idx, self._run(batch), strict=True):
                done[i] = ok
        return done

    def _get_batch(
        self,
        conn: Connection,
        keys: list[BlockKey],
        outs: list[torch.Tensor],
        layers: tuple[int, int] | None,
    ) -> list[bool | None]:
        flags = Flag.SHM if conn.shm is not None else 0
        asked = time.monotonic()  # the loan starts after this: a bound on its age
        rid = conn.send(Op.GET, encode_get_request(keys, layers), (), flags)
        frame, meta = conn.reply(rid, Op.GET)
        lease, slots = decode_get_reply(meta, len(keys))
        inline = sum(1 for s, _ in slots if s == SlotStatus.INLINE)
        if frame.payload_len != inline * wire_nbytes(self.layout, layers):
            conn.close()
            raise ProtocolError("GET reply payload does not match its inline blocks")
        done: list[bool | None] = [False] * len(keys)
        pairs: list[tuple[torch.Tensor, int]] = []
        first, last = layers if layers is not None else (0, self.layout.num_layers)
        span = (last - first) * self.layout.layer_nbytes
        arriving: list[int] = []
        for i, (out, (status, offset)) in enumerate(zip(outs, slots, strict=True)):
            if status == SlotStatus.INLINE:
                arriving.append(i)
            elif status == SlotStatus.SHM:
                pairs.append((out, offset))
                done[i] = True
        if pairs and conn.shm is None:
            raise ProtocolError("the server answered with shared memory not asked for")
        try:
            if conn.shm is not None:  # first: the loan is ticking
                copy_from_shm(conn.shm, self.layout, pairs, span)
            if pairs and not _within_loan(conn.loan_s, asked):
                self.stats["shm_late"] += len(pairs)
                log.warning(
                    "kvstore client: %d blocks copied out of shared memory after their "
                    "loan (%.3g s) may have ended; asked again",
                    len(pairs),
                    conn.loan_s,
                )
                for i, (status, _) in enumerate(slots):
                    if status == SlotStatus.SHM:
                        done[i] = None  # as if damaged: get() asks once more
            for i, ok in zip(
                arriving, receive(conn, self.layout, keys, outs, arriving, layers), strict=True
            ):
                done[i] = ok
        finally:
            if lease:
                conn.send(Op.RELEASE, encode_u64(lease), (), Flag.NO_REPLY)
        self.stats["shm_blocks"] += len(pairs)
        self.stats["socket_blocks"] += inline
        return done

    # -- queries ------------------------------------------------------------------
    def _key_calls(self, op: Op, keys: list[BlockKey]) -> Iterator[tuple[range, bytes]]:
        """One request of ``op`` per batch of ``keys``; each batch and its reply's meta."""
        for idx in self._batches(len(keys), None, by_bytes=False):
            chunk = [keys[i] for i in idx]
            yield idx, self._run(functools.partial(_call_meta, op=op, keys=chunk))

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` the server stores."""
        found: list[bool] = []
        for idx, meta in self._key_calls(Op.EXISTS, check_keys(keys)):
            if len(meta) != 4 + len(idx):
                raise TierError("kvstore-server: EXISTS reply has the wrong length")
            found += [b == 1 for b in meta[4:]]
        return found

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the server stores."""
        total = 0
        for idx, meta in self._key_calls(Op.LOOKUP, check_keys(keys)):
            n = decode_count(meta)
            total += n
            if n < len(idx):
                break
        return total

    def note_tokens(self, tokens: ChunkTokens) -> int:
        """Tell the server which tokens the chunks ``tokens.keys`` hold (its KV events
        carry them); how many chunks it recorded."""
        if tokens.block_tokens != self.layout.block_tokens:
            raise InvalidInputError(
                f"tokens of {tokens.block_tokens}-token chunks; this layout's chunks have "
                f"{self.layout.block_tokens}"
            )
        step = 4 * tokens.block_tokens
        total = 0
        for idx in self._batches(len(tokens.keys), None, by_bytes=False):
            part = ChunkTokens(
                tuple(tokens.keys[i] for i in idx),
                tokens.tokens[idx[0] * step : (idx[-1] + 1) * step],
                tokens.parent_of(idx[0]),
                tokens.block_tokens,
            )
            total += decode_count(self._run(functools.partial(_note_tokens, tokens=part)))
        return total

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys``; how many were stored."""
        return sum(decode_count(m) for _, m in self._key_calls(Op.DELETE, check_keys(keys)))

    def hint(
        self,
        keys: Sequence[BlockKey] | None = None,
        *,
        session: str | None = None,
        retain_s: float | None = None,
        priority: int = 0,
        prefetch: bool = False,
        demote: bool = False,
    ) -> HintAnswer:
        """:meth:`KVStore.hint <kvstore.KVStore.hint>` on the server's store of this
        namespace and layout: retain, demote or prefetch ``keys`` (or, alone,
        ``session``'s keys); the server's answer. Malformed arguments raise
        :class:`InvalidInputError` before anything is sent."""
        meta = hint_request(keys, session, Hint(retain_s, priority, prefetch, demote), self._limits)
        return hint_answer(self._run(lambda c: c.call(Op.HINT, meta)[1]))

    def list_keys(self, limit: int = 1 << 24) -> list[BlockKey]:
        """Up to ``limit`` keys the server stores in this namespace and layout."""

        def listing(conn: Connection) -> list[BlockKey]:
            rid = conn.send(Op.LIST, encode_count(limit))
            frame, meta = conn.reply(rid, Op.LIST)
            n = decode_count(meta)
            if frame.payload_len != 16 * n:
                conn.close()
                raise ProtocolError("LIST reply payload does not hold its keys")
            raw = conn.recv(frame.payload_len)
            return [BlockKey(raw[i : i + 16]) for i in range(0, len(raw), 16)]

        return self._run(listing)

    def server_stats(self) -> dict[str, Any]:
        """The server's counters and this namespace's stores."""
        return self._run(lambda c: c.call_json(Op.STATS))

    def ping(self) -> None:
        """Round trip to the server (raises TierError when it is unreachable)."""
        self._run(lambda c: c.call(Op.PING))

    @property
    def shared_memory(self) -> bool:
        """True when blocks move through the server's shared memory (as of the latest
        connection made)."""
        with self._lock:
            return any(m is not None for m in self._mappings.values())

    def _batches(
        self, n: int, layers: tuple[int, int] | None, by_bytes: bool = True
    ) -> Iterator[range]:
        limits = self._limits or {}
        if not by_bytes:
            step = int(limits.get("max_batch_blocks", 1024))
            return iter(range(s, min(n, s + step)) for s in range(0, n, step))
        return batches(n, self.layout, limits, layers)

    def close(self) -> None:
        """Close every connection and unmap shared memory (idempotent)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        with self._lock:
            mappings, self._mappings = list(self._mappings.values()), {}
        for mapping in mappings:
            if mapping is not None:
                mapping.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_HELD = (SlotStatus.STORED, SlotStatus.PRESENT)
#: The share of a loan a copy out of shared memory may take: the rest covers clock
#: steps and the server's own expiry rounding.
_LOAN_SHARE = 0.9


def _within_loan(loan_s: float | None, asked: float) -> bool:
    """Whether blocks lent at or after ``asked`` (monotonic) and copied out by now were
    surely still lent: a server that keeps them ``loan_s`` may give an expired slot to
    another block at once. Same host (shared memory), so one monotonic clock."""
    return loan_s is None or time.monotonic() - asked < loan_s * _LOAN_SHARE


def _note_tokens(conn: Connection, tokens: ChunkTokens) -> bytes:
    rid = conn.send_head(Op.TOKENS, encode_tokens(tokens), len(tokens.tokens))
    conn.send_parts([tokens.tokens])
    return conn.reply(rid, Op.TOKENS)[1]


def _call_meta(conn: Connection, op: Op, keys: list[BlockKey]) -> bytes:
    return conn.call(op, encode_keys(keys))[1]
