"""The asyncio client of kvstore-server: the same operations as :class:`~kvstore.client.Client`.

>>> async with AsyncClient(layout, ClientOptions(address="unix:/run/kvstore.sock")) as client:
...     await client.put(keys, blocks)
...     await client.get(keys, outs)

Connections come from a pool of at most ``pool_size`` (each serves one
request at a time), every request runs under ``timeout``, a dead pooled
connection is replaced once at once, and after an outage one probe per
``retry_interval`` looks for the server (the shared backoff helper's
policy). Bytes move over the socket and are verified on arrival; shared
memory is the blocking client's (:class:`~kvstore.client.Client`).

Loop-only: use one AsyncClient from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch

from kvstore.client._common import (
    FATAL_STATUSES,
    ClientOptions,
    auth_meta,
    batches,
    check_layers,
    check_reply,
    handshake,
    hello_meta,
    hint_answer,
    hint_request,
    open_meta,
    same_length,
)
from kvstore.copies import engine_for
from kvstore.errors import (
    ClosedError,
    CorruptBlockError,
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    TierError,
)
from kvstore.format import Codec, encode_block
from kvstore.hints import Hint, HintAnswer
from kvstore.keys import BlockKey, check_keys
from kvstore.layout import KVLayout
from kvstore.runtime import Backoff, Breaker, retry_async
from kvstore.wire import (
    FRAME,
    Flag,
    Frame,
    Op,
    SlotStatus,
    decode_count,
    decode_get_reply,
    decode_json,
    decode_put_reply,
    encode_count,
    encode_get_request,
    encode_keys,
    read_header,
    verify_span,
    wire_nbytes,
)

__all__ = ["AsyncClient", "AsyncConnection", "open_connection"]

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
_STALE = Backoff(base=0.005, cap=0.02, max_attempts=2, deadline=1.0)
_HELD = (SlotStatus.STORED, SlotStatus.PRESENT)


class _Dead(TierError):
    """The connection broke mid-request."""


class AsyncConnection:
    """One asyncio connection to kvstore-server (made by :func:`open_connection`):
    frames out and replies in, one request at a time. A connection that breaks
    mid-request raises a :class:`~kvstore.errors.TierError` and must not be used again.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.ids = 0
        #: The server's HELLO answer ({} until the handshake is done).
        self.hello: dict[str, Any] = {}

    @property
    def limits(self) -> dict[str, Any]:
        """The server's limits (frame and batch sizes)."""
        limits = self.hello.get("limits")
        return limits if isinstance(limits, dict) else {}

    async def send(
        self, op: int, meta: bytes = b"", payload: Sequence[Buffer] = (), flags: int = 0
    ) -> int:
        """Send a request (header, meta and payload); its id."""
        self.ids = (self.ids + 1) & 0xFFFFFFFF
        size = sum(memoryview(p).nbytes for p in payload)
        try:
            self.writer.write(Frame(op, flags, 0, self.ids, len(meta), size).pack() + meta)
            for part in payload:
                self.writer.write(part)
            await self.writer.drain()
        except OSError as exc:
            raise _Dead(f"kvstore-server connection lost while sending: {exc}") from None
        return self.ids

    async def recv(self, nbytes: int) -> bytes:
        """Exactly ``nbytes``."""
        try:
            return await self.reader.readexactly(nbytes)
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise _Dead(f"kvstore-server connection lost while reading: {exc}") from None

    async def reply(self, rid: int, op: int) -> tuple[Frame, bytes]:
        """Read the reply to ``rid``: its header and meta (the payload is left to
        read). Raises its error."""
        frame = Frame.unpack(await self.recv(FRAME.size))
        meta = await self.recv(frame.meta_len)
        try:
            check_reply(frame, rid, op, meta)
        except KVStoreError:
            if frame.status in FATAL_STATUSES or frame.payload_len:
                self.close()
            raise
        return frame, meta

    async def call(self, op: int, meta: bytes = b"") -> bytes:
        """A request without payload, and its reply's meta (the reply must carry none)."""
        frame, reply = await self.reply(await self.send(op, meta), op)
        if frame.payload_len:
            raise ProtocolError(f"unexpected payload in the reply to {Op(op).name}")
        return reply

    async def call_json(self, op: int, meta: bytes = b"") -> dict[str, Any]:
        """A control request and its JSON reply."""
        return decode_json(await self.call(op, meta))

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with contextlib.suppress(Exception):
            self.writer.close()


async def open_connection(options: ClientOptions, layout: KVLayout | None) -> AsyncConnection:
    """Connect to the server of ``options``, say HELLO, AUTH with its token (if any) and,
    given a ``layout``, OPEN that store of ``options.namespace``; ``layout`` None makes a
    control connection that opens no store (STATS, ADMIN). Used by :class:`AsyncClient`
    and :class:`~kvstore.client.admin.AsyncAdminClient`. Raises
    :class:`~kvstore.errors.TierError` when the server cannot be reached."""
    try:
        if options.unix_path is not None:
            connecting = asyncio.open_unix_connection(options.unix_path)
        else:
            host, port = options.host_port
            context = options.ssl_context()
            name = (options.tls_server_name or host) if context else None
            connecting = asyncio.open_connection(host, port, ssl=context, server_hostname=name)
        reader, writer = await asyncio.wait_for(connecting, options.connect_timeout)
    except (OSError, TimeoutError) as exc:
        raise TierError(f"cannot connect to kvstore-server at {options.address}: {exc}") from None
    conn = AsyncConnection(reader, writer)
    with handshake(options, conn.close):
        conn.hello = await conn.call_json(Op.HELLO, hello_meta())
        answer = auth_meta(conn.hello, options.token)
        if answer is not None:
            await conn.call(Op.AUTH, answer)
        if layout is not None:
            await conn.call(Op.OPEN, open_meta(options.namespace, layout))
    return conn


class AsyncClient:
    """A pool of asyncio connections to one (namespace, layout) store of a server."""

    def __init__(self, layout: KVLayout, options: ClientOptions | None = None) -> None:
        self.layout = layout
        self.options = options or ClientOptions()
        self._idle: list[AsyncConnection] = []
        self._slots = asyncio.Semaphore(self.options.pool_size)
        self._breaker = Breaker(self.options.retry_interval)
        self._limits: dict[str, Any] = {}
        self._closed = False

    async def _open(self) -> AsyncConnection:
        conn = await open_connection(self.options, self.layout)
        self._limits = conn.limits
        return conn

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection]:
        async with self._slots:
            if self._closed:
                raise ClosedError("the client is closed")
            conn = self._idle.pop() if self._idle else await self._open()
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)

    async def _run(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """``fn(conn)`` under the timeout; a dead pooled connection is replaced once;
        outages trip the breaker."""
        if not self._breaker.allow():
            raise TierError(f"kvstore-server at {self.options.address} is unavailable")

        async def attempt() -> T:
            async with self._connection() as conn:
                return await asyncio.wait_for(fn(conn), self.options.timeout)

        try:
            result = await retry_async(
                attempt, lambda e: isinstance(e, _Dead), _STALE, on_retry=self._drop_idle
            )
        except (TierError, OSError, TimeoutError) as exc:
            self._breaker.failed()
            raise TierError(f"kvstore-server at {self.options.address}: {exc}") from None
        self._breaker.succeeded()
        return result

    def _drop_idle(self, attempt: int, exc: BaseException) -> None:
        """A pooled connection died: the others went stale with it."""
        for stale in self._idle:
            stale.close()
        self._idle.clear()

    # -- blocks -------------------------------------------------------------------
    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]``; True where stored or already there."""
        keys = check_keys(keys)
        same_length(keys, blocks, "blocks")
        flags = Flag.DURABLE if self.options.durable else 0
        done = [False] * len(keys)
        for idx in batches(len(keys), self.layout, self._limits):
            chunk_keys, chunk = [keys[i] for i in idx], [blocks[i] for i in idx]

            async def one(
                c: AsyncConnection, k: list[BlockKey] = chunk_keys, b: list[torch.Tensor] = chunk
            ) -> list[int]:
                parts: list[Buffer] = []
                for key, block in zip(k, b, strict=True):
                    parts += encode_block(key, self.layout, block, Codec.RAW).parts()
                _, meta = await c.reply(await c.send(Op.PUT, encode_keys(k), parts, flags), Op.PUT)
                return decode_put_reply(meta, len(k))

            for i, status in zip(idx, await self._run(one), strict=True):
                done[i] = status & 0x7F in _HELD
        return done

    async def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: tuple[int, int] | None = None,
    ) -> list[bool]:
        """Read each stored block (or ``layers``) into ``outs[i]``, verified."""
        keys = check_keys(keys)
        same_length(keys, outs, "output tensors")
        layers = check_layers(self.layout, layers)
        done = [False] * len(keys)
        for idx in batches(len(keys), self.layout, self._limits, layers):
            chunk_keys, chunk = [keys[i] for i in idx], [outs[i] for i in idx]

            async def one(
                c: AsyncConnection, k: list[BlockKey] = chunk_keys, o: list[torch.Tensor] = chunk
            ) -> list[bool]:
                return await self._get_batch(c, k, o, layers)

            for i, ok in zip(idx, await self._run(one), strict=True):
                done[i] = ok
        return done

    async def _get_batch(
        self,
        conn: AsyncConnection,
        keys: list[BlockKey],
        outs: list[torch.Tensor],
        layers: tuple[int, int] | None,
    ) -> list[bool]:
        rid = await conn.send(Op.GET, encode_get_request(keys, layers))
        frame, meta = await conn.reply(rid, Op.GET)
        _, slots = decode_get_reply(meta, len(keys))
        per = wire_nbytes(self.layout, layers)
        inline = sum(1 for s, _ in slots if s == SlotStatus.INLINE)
        if frame.payload_len != inline * per or any(s == SlotStatus.SHM for s, _ in slots):
            conn.close()
            raise ProtocolError("GET reply does not match what was asked")
        head_len = wire_nbytes(self.layout) - self.layout.block_nbytes
        done = [False] * len(keys)
        for i, (key, out, (status, _)) in enumerate(zip(keys, outs, slots, strict=True)):
            if status != SlotStatus.INLINE:
                continue
            data = await conn.recv(per)
            done[i] = self._decode(key, data[:head_len], data[head_len:], out, layers)
        return done

    def _decode(
        self,
        key: BlockKey,
        head: bytes,
        body: bytes,
        out: torch.Tensor,
        layers: tuple[int, int] | None,
    ) -> bool:
        host = torch.frombuffer(bytearray(body), dtype=self.layout.dtype).view(tuple(out.shape))
        try:
            verify_span(read_header(head, self.layout, key), host, layers)
        except (CorruptBlockError, LayoutMismatchError):
            return False
        engine_for(out.device).copy_all([(out, host)])
        return True

    # -- queries ------------------------------------------------------------------
    async def _key_calls(self, op: Op, keys: list[BlockKey]) -> AsyncIterator[tuple[range, bytes]]:
        """One request of ``op`` per batch of ``keys``: each batch and its reply's meta."""
        step = int(self._limits.get("max_batch_blocks", 1024))
        for start in range(0, len(keys), step):
            chunk = keys[start : start + step]
            meta = await self._run(lambda c, k=chunk: c.call(op, encode_keys(k)))  # type: ignore[misc]
            yield range(start, start + len(chunk)), meta

    async def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` the server stores."""
        found: list[bool] = []
        async for idx, meta in self._key_calls(Op.EXISTS, check_keys(keys)):
            if len(meta) != 4 + len(idx):
                raise TierError("kvstore-server: EXISTS reply has the wrong length")
            found += [b == 1 for b in meta[4:]]
        return found

    async def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the server stores."""
        total = 0
        async for idx, meta in self._key_calls(Op.LOOKUP, check_keys(keys)):
            n = decode_count(meta)
            total += n
            if n < len(idx):
                break
        return total

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys``; how many were stored."""
        total = 0
        async for _, meta in self._key_calls(Op.DELETE, check_keys(keys)):
            total += decode_count(meta)
        return total

    async def hint(
        self,
        keys: Sequence[BlockKey] | None = None,
        *,
        session: str | None = None,
        retain_s: float | None = None,
        priority: int = 0,
        prefetch: bool = False,
        demote: bool = False,
    ) -> HintAnswer:
        """:meth:`KVStore.hint <kvstore.KVStore.hint>` on the server's store: retain,
        demote or prefetch ``keys`` (or, alone, ``session``'s keys); the server's answer.
        Malformed arguments raise :class:`InvalidInputError` before anything is sent."""
        meta = hint_request(keys, session, Hint(retain_s, priority, prefetch, demote), self._limits)
        return hint_answer(await self._run(lambda c: c.call(Op.HINT, meta)))

    async def list_keys(self, limit: int = 1 << 24) -> list[BlockKey]:
        """Up to ``limit`` stored keys of this namespace and layout."""

        async def listing(conn: AsyncConnection) -> list[BlockKey]:
            frame, meta = await conn.reply(await conn.send(Op.LIST, encode_count(limit)), Op.LIST)
            if frame.payload_len != 16 * decode_count(meta):
                conn.close()
                raise ProtocolError("LIST reply payload does not hold its keys")
            raw = await conn.recv(frame.payload_len)
            return [BlockKey(raw[i : i + 16]) for i in range(0, len(raw), 16)]

        return await self._run(listing)

    async def server_stats(self) -> dict[str, Any]:
        """The server's counters and this namespace's stores."""
        return decode_json(await self._run(lambda c: c.call(Op.STATS)))

    async def ping(self) -> None:
        """Round trip to the server."""
        await self._run(lambda c: c.call(Op.PING))

    async def close(self) -> None:
        """Close every connection (idempotent)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
