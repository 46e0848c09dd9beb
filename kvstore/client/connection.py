"""One blocking connection to kvstore-server: connect, HELLO, AUTH, OPEN, then frames.

Used by :class:`~kvstore.client.sync.Client`, one thread at a time per connection.
A connection that breaks mid-request raises :class:`Dead` (a
:class:`~kvstore.errors.TierError`) and must not be used again.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import Sequence
from typing import Any

from kvstore.client._common import (
    FATAL_STATUSES,
    ClientOptions,
    auth_meta,
    check_reply,
    handshake,
    hello_meta,
    open_meta,
)
from kvstore.errors import KVStoreError, ProtocolError, TierError
from kvstore.layout import KVLayout
from kvstore.wire import FRAME, Frame, Op, attach, decode_json, receive_fd
from kvstore.wire import Mapping as ShmMapping

__all__ = ["Connection", "Dead"]

log = logging.getLogger(__name__)
Buffer = bytes | bytearray | memoryview
_IOV_MAX = 1024  # buffers per recvmsg_into / sendmsg (Linux's IOV_MAX)


class Dead(TierError):
    """The connection broke mid-request (it is dropped; the request may be retried)."""


class Connection:
    """One authenticated connection with a store opened (used by one thread at a time).

    ``layout`` None: no store is opened (a control connection: STATS, ADMIN).
    """

    def __init__(self, options: ClientOptions, layout: KVLayout | None) -> None:
        self.options = options
        self.layout = layout
        self._ids = 0
        #: The client's mapping of this server's shared memory (None: move bytes by socket).
        self.shm: ShmMapping | None = None
        #: The AUTH reply: the token's name, tenant, scopes, namespaces ({}: no token).
        self.identity: dict[str, Any] = {}
        self.opened: dict[str, Any] = {}
        self.sock = self._connect()
        with handshake(options, self.close):
            self.hello = self._handshake()
            if layout is not None:
                self.opened = self.call_json(Op.OPEN, open_meta(options.namespace, layout))

    def _connect(self) -> socket.socket:
        opts = self.options
        try:
            if opts.unix_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(opts.connect_timeout)
                sock.connect(opts.unix_path)
            else:
                sock = socket.create_connection(opts.host_port, timeout=opts.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            context = opts.ssl_context()
            if context is not None:
                host = opts.tls_server_name or opts.host_port[0]
                sock = context.wrap_socket(sock, server_hostname=host)
        except OSError as exc:
            raise TierError(f"cannot connect to kvstore-server at {opts.address}: {exc}") from None
        sock.settimeout(opts.timeout)
        return sock

    def _handshake(self) -> dict[str, Any]:
        hello = self.call_json(Op.HELLO, hello_meta())
        answer = auth_meta(hello, self.options.token)
        if answer is not None:
            self.identity = decode_json(self.call(Op.AUTH, answer)[1])
        return hello

    @property
    def limits(self) -> dict[str, Any]:
        """The server's limits (frame and batch sizes)."""
        limits = self.hello.get("limits")
        return limits if isinstance(limits, dict) else {}

    @property
    def unix(self) -> bool:
        """True over a Unix socket."""
        return self.options.unix_path is not None

    # -- frames ---------------------------------------------------------------
    def send(
        self, op: int, meta: bytes = b"", payload: Sequence[Buffer] = (), flags: int = 0
    ) -> int:
        """Send a request (header, meta and payload); its id."""
        size = sum(memoryview(p).nbytes for p in payload)
        rid = self.send_head(op, meta, size, flags)
        self.send_parts(payload)
        return rid

    def send_head(self, op: int, meta: bytes, payload_nbytes: int, flags: int = 0) -> int:
        """Send a request's header and meta; its payload must follow (:meth:`send_parts`)."""
        self._ids = (self._ids + 1) & 0xFFFFFFFF
        head = Frame(op, flags, 0, self._ids, len(meta), payload_nbytes).pack()
        self.send_parts([head + meta])
        return self._ids

    def send_parts(self, parts: Sequence[Buffer]) -> None:
        """Send ``parts`` in order, straight from their memory: ``sendmsg`` of up to 1024
        buffers at a time (one ``sendall`` each over TLS)."""
        try:
            if isinstance(self.sock, ssl.SSLSocket):
                for part in parts:
                    self.sock.sendall(part)
                return
            views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
            i = 0
            while i < len(views):
                sent = self.sock.sendmsg(views[i : i + _IOV_MAX])
                while sent and i < len(views):
                    if sent >= views[i].nbytes:
                        sent -= views[i].nbytes
                        i += 1
                    else:
                        views[i], sent = views[i][sent:], 0
        except OSError as exc:
            raise Dead(f"kvstore-server connection lost while sending: {exc}") from None

    def reply(self, request_id: int, op: int, first: bytes | None = None) -> tuple[Frame, bytes]:
        """Read the reply to ``request_id``: its header and meta (the payload is left
        to read). ``first``: the header, if already read. Raises its error."""
        try:
            head = first if first is not None else self.recv(FRAME.size)
            frame = Frame.unpack(head)
            meta = self.recv(frame.meta_len)
        except OSError as exc:
            raise Dead(f"kvstore-server connection lost while reading: {exc}") from None
        try:
            check_reply(frame, request_id, op, meta)
        except KVStoreError:
            if frame.status in FATAL_STATUSES or frame.payload_len:
                self.close()
            raise
        return frame, meta

    def call(self, op: int, meta: bytes = b"", flags: int = 0) -> tuple[Frame, bytes]:
        """A request without payload, and its reply (which must carry none)."""
        frame, meta = self.reply(self.send(op, meta, (), flags), op)
        if frame.payload_len:
            raise ProtocolError(f"unexpected payload in the reply to {Op(op).name}")
        return frame, meta

    def call_json(self, op: int, meta: bytes = b"") -> dict[str, Any]:
        """A control request and its JSON reply."""
        return decode_json(self.call(op, meta)[1])

    def recv(self, nbytes: int) -> bytes:
        """Exactly ``nbytes``."""
        buf = bytearray(nbytes)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly."""
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise Dead(f"kvstore-server connection lost while reading: {exc}") from None
            if not n:
                raise Dead("kvstore-server closed the connection")
            got += n

    @property
    def segment_id(self) -> str | None:
        """The id of the shared memory the server offers on this connection (None: none)."""
        offered = self.opened.get("shared_memory")
        return str(offered.get("id")) if isinstance(offered, dict) else None

    @property
    def loan_s(self) -> float | None:
        """How long the server keeps a GET's shared-memory slots lent (None: not said).
        A slot copied out after that may already hold another block."""
        offered = self.opened.get("shared_memory")
        loan = offered.get("loan_s") if isinstance(offered, dict) else None
        return float(loan) if isinstance(loan, int | float) and loan > 0 else None

    @property
    def reserve_s(self) -> float | None:
        """How long the server waits for a RESERVE's COMMIT before it drops the
        reservation (None: not said). Slots are not written after that."""
        offered = self.opened.get("shared_memory")
        hold = offered.get("reserve_s") if isinstance(offered, dict) else None
        return float(hold) if isinstance(hold, int | float) and hold > 0 else None

    def recv_scatter(self, views: list[memoryview]) -> None:
        """Fill each of ``views`` in order, with as few reads as the socket allows
        (``recvmsg_into`` of up to 1024 buffers; one buffer at a time over TLS)."""
        if isinstance(self.sock, ssl.SSLSocket):
            for view in views:
                self.recv_into(view)
            return
        views = [v for v in views if v.nbytes]
        i = 0
        while i < len(views):
            try:
                got = self.sock.recvmsg_into(views[i : i + _IOV_MAX])[0]
            except OSError as exc:
                raise Dead(f"kvstore-server connection lost while reading: {exc}") from None
            if not got:
                raise Dead("kvstore-server closed the connection")
            while got and i < len(views):
                if got >= views[i].nbytes:
                    got -= views[i].nbytes
                    i += 1
                else:
                    views[i], got = views[i][got:], 0

    def attach_shared_memory(self) -> ShmMapping | None:
        """Map the store's shared memory, if the server offers it and this host can."""
        if self.segment_id is None:
            return None
        rid = self.send(Op.SHM_ATTACH)
        fd = None
        if self.unix:
            head, fd = receive_fd(self.sock, FRAME.size)
            if len(head) < FRAME.size:
                head += self.recv(FRAME.size - len(head))
            _, meta = self.reply(rid, Op.SHM_ATTACH, head)
        else:
            _, meta = self.reply(rid, Op.SHM_ATTACH)
        try:
            mapping = attach(decode_json(meta), fd)
        except (OSError, ProtocolError, KeyError, ValueError) as exc:
            log.info("kvstore client: no shared memory with the server (%s)", exc)
            return None
        if mapping.ident != self.segment_id:
            mapping.close()
            raise ProtocolError("the server attached another segment than it offered")
        return mapping

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with contextlib.suppress(OSError):
            self.sock.close()
