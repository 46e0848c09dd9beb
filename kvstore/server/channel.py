"""Byte transport of one server connection, on the server's asyncio loop.

:class:`RawChannel` drives a plain TCP or Unix socket with the loop's socket
methods, so payloads are received straight into the memory they go to
(``sock_recv_into`` a slab slot) and sent from where they live (a memoryview
of the slot), with no copy in between. :class:`StreamChannel` carries TLS
connections through asyncio streams (the cipher copies anyway).

Every receive and send runs under a deadline set by the connection, so a
client that sends or reads too slowly is cut off instead of holding the
server's memory.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import select
import socket
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

__all__ = ["Channel", "RawChannel", "StreamChannel"]

Buffer = bytes | bytearray | memoryview
_COALESCE = 64 * 1024  # smaller pieces are joined into one write (streams)
_SCRATCH = 1024 * 1024
_IOV_MAX = 1024  # buffers per sendmsg (Linux's IOV_MAX)
_THREADED = 1024 * 1024  # transfers this big are copied by a thread (see RawChannel)
_PATIENCE_MS = 5  # how long a copying thread waits for a socket before handing back


class Channel(ABC):
    """Receive into buffers and send buffers, each before a deadline (loop time)."""

    #: The peer, for logs ("127.0.0.1:5555" or "unix").
    peer: str = ""
    #: True for a Unix socket (file descriptors can be passed over it).
    unix: bool = False
    #: The peer process's pid, where the socket tells it (a Unix socket's credentials).
    peer_pid: int | None = None

    @abstractmethod
    async def _recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly; ConnectionError if the peer closes first."""

    @abstractmethod
    async def _send(self, parts: Sequence[Buffer]) -> None:
        """Send every byte of ``parts``."""

    async def recv_into(self, buf: Buffer, deadline: float) -> None:
        """Fill ``buf`` before ``deadline`` (``loop.time()``), else TimeoutError."""
        view = memoryview(buf).cast("B")
        if view.nbytes:
            await _before(self._recv_into(view), deadline)

    async def recv(self, nbytes: int, deadline: float) -> bytes:
        """``nbytes`` bytes before ``deadline``."""
        buf = bytearray(nbytes)
        await self.recv_into(buf, deadline)
        return bytes(buf)

    async def discard(self, nbytes: int, deadline: float) -> None:
        """Read and drop ``nbytes`` (the payload of a refused request)."""
        scratch = bytearray(min(nbytes, _SCRATCH))
        while nbytes:
            step = min(nbytes, len(scratch))
            await self.recv_into(memoryview(scratch)[:step], deadline)
            nbytes -= step

    async def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        """Send ``parts`` in order before ``deadline``."""
        await _before(self._send(parts), deadline)

    async def send_fd(self, data: bytes, fd: int, deadline: float) -> None:
        """Send ``data`` with file descriptor ``fd`` attached (Unix sockets only)."""
        raise OSError("file descriptors can only be passed over a Unix socket")

    @abstractmethod
    def abort(self) -> None:
        """Cut the connection now: a receive in progress ends as if the peer closed."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent); after the reader has stopped."""


async def _before(awaitable: object, deadline: float) -> None:
    timeout = deadline - asyncio.get_running_loop().time()
    if timeout <= 0:
        raise TimeoutError("deadline passed")
    await asyncio.wait_for(awaitable, timeout)  # type: ignore[arg-type]


def _wait(sock: socket.socket, events: int) -> bool:
    """Wait up to ``_PATIENCE_MS`` for ``events`` on ``sock``: a peer draining or filling
    its socket at speed is served without a trip through the loop; a slow one costs a
    copying thread that long at most."""
    poller = select.poll()
    poller.register(sock.fileno(), events)
    return bool(poller.poll(_PATIENCE_MS))


def _push(sock: socket.socket, views: list[memoryview], i: int) -> int:
    """Send from ``views[i:]`` what the (non-blocking) socket takes soon; the index of
    the first view not sent whole (``views`` is trimmed in place where one was cut)."""
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + _IOV_MAX])
        except (BlockingIOError, InterruptedError):
            if _wait(sock, select.POLLOUT):
                continue
            return i
        while sent and i < len(views):
            if sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            else:
                views[i], sent = views[i][sent:], 0
    return i


def _pull(sock: socket.socket, view: memoryview, got: int) -> int:
    """Receive into ``view[got:]`` what the (non-blocking) socket holds now; the new fill."""
    while got < view.nbytes:
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            if _wait(sock, select.POLLIN):
                continue
            return got
        if n == 0:
            raise ConnectionResetError("the client closed the connection")
        got += n
    return got


def _coalesce(parts: Sequence[Buffer]) -> list[Buffer]:
    """Join runs of small parts (headers, metas) into pieces of at most ``_COALESCE``
    bytes, so each costs no write of its own (for transports without ``sendmsg``)."""
    out: list[Buffer] = []
    small: list[Buffer] = []
    size = 0
    for part in parts:
        n = memoryview(part).nbytes
        if small and (n >= _COALESCE or size + n > _COALESCE):
            out.append(b"".join(small))
            small, size = [], 0
        if n >= _COALESCE:
            out.append(part)
        elif n:
            small.append(part)
            size += n
    if small:
        out.append(b"".join(small))
    return out


class RawChannel(Channel):
    """A plain socket, zero-copy both ways.

    Small transfers run on the loop. Big ones (a block or more) are copied by a
    thread of ``copier`` -- the kernel's copies run there, with the GIL released, so
    several connections' bytes move on several cores while the loop serves the
    others. A copying thread waits for a socket at most a few milliseconds: then it
    hands back and the loop waits for the socket to be ready again. So a slow
    client costs no thread, only its own connection's time.
    """

    def __init__(self, sock: socket.socket, copier: Executor | None = None) -> None:
        self._sock = sock
        self._copier = copier
        self._loop = asyncio.get_running_loop()
        self.unix = sock.family == socket.AF_UNIX
        if not self.unix:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = sock.getpeername()
            self.peer = f"{peer[0]}:{peer[1]}"
        else:
            self.peer = "unix"
            self.peer_pid = peer_pid(sock)
        sock.setblocking(False)

    async def _recv_into(self, view: memoryview) -> None:
        if self._copier is None or view.nbytes < _THREADED:
            await self._recv_on_loop(view)
            return
        got = 0
        while got < view.nbytes:
            got = await self._loop.run_in_executor(self._copier, _pull, self._sock, view, got)
            if got < view.nbytes:
                await self._ready(self._loop.add_reader, self._loop.remove_reader)

    async def _recv_on_loop(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = await self._loop.sock_recv_into(self._sock, view[got:])
            if n == 0:
                raise ConnectionResetError("the client closed the connection")
            got += n

    async def _send(self, parts: Sequence[Buffer]) -> None:
        """``sendmsg`` of up to ``_IOV_MAX`` buffers at a time, straight from where they
        live (no joining, no copy); big payloads by the copier (see the class)."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        left = sum(v.nbytes for v in views)
        i = 0
        while i < len(views):
            if self._copier is not None and left >= _THREADED:
                i = await self._loop.run_in_executor(self._copier, _push, self._sock, views, i)
            else:
                i = _push(self._sock, views, i)
            if i < len(views):
                left = sum(v.nbytes for v in views[i:])
                await self._ready(self._loop.add_writer, self._loop.remove_writer)

    async def _ready(self, add: Any, remove: Any) -> None:
        """Wait until the socket can be read (``add_reader``) or written (``add_writer``)."""
        future: asyncio.Future[None] = self._loop.create_future()
        fd = self._sock.fileno()
        if fd < 0:
            raise ConnectionResetError("the connection was closed")

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        add(fd, wake)
        try:
            await future
        finally:
            remove(fd)

    async def send_fd(self, data: bytes, fd: int, deadline: float) -> None:
        if not self.unix:
            await super().send_fd(data, fd, deadline)
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while True:  # a small message: the socket buffer takes it at once but when full
            try:
                sent = self._sock.sendmsg([data], fds)
                break
            except (BlockingIOError, InterruptedError):
                if self._loop.time() > deadline:
                    raise TimeoutError("deadline passed") from None
                await asyncio.sleep(0.001)
        if sent < len(data):
            await self._send([memoryview(data)[sent:]])

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class StreamChannel(Channel):
    """A TLS connection through asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "tls"

    async def _recv_into(self, view: memoryview) -> None:
        try:
            got = 0
            while got < view.nbytes:
                chunk = await self._reader.read(min(view.nbytes - got, 4 * _SCRATCH))
                if not chunk:
                    raise ConnectionResetError("the client closed the connection")
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("the client closed the connection") from None

    async def _send(self, parts: Sequence[Buffer]) -> None:
        for part in _coalesce(parts):
            self._writer.write(part)
        await self._writer.drain()

    def abort(self) -> None:
        self._writer.transport.abort()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()


def peer_pid(sock: object) -> int | None:
    """The pid of a Unix socket's peer (``SO_PEERCRED``); None elsewhere."""
    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
        return None
    with contextlib.suppress(OSError, AttributeError):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", raw)[0]
        return pid if pid > 0 else None
    return None
