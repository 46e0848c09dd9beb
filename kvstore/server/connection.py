"""One client connection of kvstore-server: frames, the handshake, limits, dispatch.

A connection goes NEW -> (HELLO) GREETED -> (AUTH, or no token configured)
AUTHED -> (OPEN a namespace and layout) OPEN. Data ops need OPEN; anything
out of order is refused. A frame that is not of this protocol, oversized, or
unauthenticated gets an error reply and the connection is closed: the stream
cannot be trusted past it. A well-framed request with bad fields gets an
error reply, changes nothing, and the connection goes on.

Limits: each frame must arrive whole before ``io_timeout_s`` plus its size
at ``min_rate`` (slow clients are cut off), an idle connection closes after
``idle_timeout_s``, at most ``max_inflight_requests`` requests run at once
per connection (the reader waits for a slot: back-pressure), and payload
bytes in flight are bounded for the whole server (:class:`ByteBudget`).

Everything here runs on the server's one asyncio loop; store calls run on
the server's worker threads (:meth:`Connection.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvstore.config import Credential, check_namespace
from kvstore.datapath.contracts import Loan
from kvstore.errors import (
    AccessDeniedError,
    CapacityError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    KVStoreError,
    ProtocolError,
    ScopeError,
)
from kvstore.layout import KVLayout
from kvstore.server import handlers
from kvstore.server.channel import Buffer, Channel
from kvstore.server.orphans import ProcessId, process_id
from kvstore.server.session import Refused, Reservation, ServerContext
from kvstore.server.stores import HostedStore
from kvstore.server.tenants import check_scope
from kvstore.version import __version__
from kvstore.wire import (
    FRAME,
    MAGIC,
    MAX_JSON_META,
    Flag,
    Frame,
    Op,
    Status,
    decode_json,
    describe_segment,
    encode_json,
    new_nonce,
)

__all__ = ["Connection"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class State(enum.IntEnum):
    """Where a connection is in its handshake."""

    NEW = 0
    GREETED = 1
    AUTHED = 2
    OPEN = 3


_ERRORS: tuple[tuple[type[Exception], Status], ...] = (
    (ScopeError, Status.NOT_PERMITTED),  # before its base class: the first match answers
    (AccessDeniedError, Status.FORBIDDEN),
    (ProtocolError, Status.BAD_REQUEST),
    (InvalidInputError, Status.BAD_REQUEST),
    (ConfigError, Status.BAD_REQUEST),
    (CapacityError, Status.BUSY),
    (ClosedError, Status.SHUTTING_DOWN),
)
_PAYLOAD_OPS = (Op.PUT, Op.COMMIT, Op.TOKENS)
#: Every op of the protocol (IntEnum members hash as their values: ``5 in _KNOWN_OPS``).
_KNOWN_OPS = frozenset(Op)
#: Connection numbers (tags of held reservations: ids repeat across connections).
_SERIALS = itertools.count(1)


class Connection:
    """Serves one client until it leaves, misbehaves or the server drains."""

    def __init__(self, ctx: ServerContext, chan: Channel) -> None:
        self.ctx = ctx
        self.chan = chan
        self.loop = asyncio.get_running_loop()
        self.state = State.NEW
        self.nonce = new_nonce()
        self.credential: Credential | None = None
        self.hosted: HostedStore | None = None
        self.loans: dict[int, Loan] = {}
        self.reservations: dict[int, Reservation] = {}
        self.ids = itertools.count(1)
        #: This connection's number, unique in the server.
        self.serial = next(_SERIALS)
        #: The client process (from the Unix socket, else as OPEN states it).
        self.writer: ProcessId | None = None
        #: Whether the client mapped the shared memory through this connection (only
        #: then can it write into the slots it reserves).
        self.attached = False
        self._send_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(ctx.server.max_inflight_requests)
        self._tasks: set[asyncio.Task[bool]] = set()
        #: Requests being received or served (a draining server waits for 0).
        self.busy = 0
        #: Why the server cuts this connection off (None: it ends normally); logged once.
        self.why: str | None = None

    # -- plumbing for handlers ------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread (store calls never block the loop)."""
        return await self.loop.run_in_executor(self.ctx.executor, functools.partial(fn, *args))

    def deadline(self, nbytes: int = 0) -> float:
        """When ``nbytes`` more must have moved: ``io_timeout_s`` plus them at ``min_rate``."""
        cfg = self.ctx.server
        return self.loop.time() + cfg.io_timeout_s + nbytes / cfg.min_rate

    async def reply(
        self,
        request: Frame,
        meta: bytes = b"",
        payload: Sequence[Buffer] = (),
        flags: int = 0,
    ) -> None:
        """Send the reply to ``request`` (unless it asked for none)."""
        if request.flags & Flag.NO_REPLY:
            return
        size = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in payload)
        head = Frame(request.op, Flag.REPLY | flags, 0, request.request_id, len(meta), size)
        async with self._send_lock:
            await self.chan.send([head.pack(), meta, *payload], self.deadline(size))
        self.ctx.metrics.add("bytes_sent", size)

    async def error(self, request: Frame, status: Status, message: str) -> None:
        """Send an error reply (even to a NO_REPLY request: the client must learn why)."""
        # at most 4 KiB, cut at a character: the message stays UTF-8
        data = message.encode()[:4096].decode("utf-8", "ignore").encode()
        head = Frame(request.op, Flag.REPLY, status, request.request_id, len(data), 0)
        self.ctx.metrics.error(status.name.lower())
        async with self._send_lock:
            await self.chan.send([head.pack(), data], self.deadline())

    @property
    def store(self) -> HostedStore:
        """The store this connection opened."""
        assert self.hosted is not None
        return self.hosted

    # -- the loop -------------------------------------------------------------
    async def serve(self) -> None:
        """Read and dispatch frames until the client leaves or must be cut off."""
        self.ctx.metrics.gauge("connections_open", 1)
        self.ctx.metrics.add("connections")
        try:
            while not self.ctx.draining:
                frame = await self._next_frame()
                if frame is None:
                    break
                keep = await self._handle(frame)
                if not keep:
                    break
        except (ConnectionError, TimeoutError, OSError) as exc:
            self.cut(_broken(exc))  # the stream ended (or stalled) mid-frame or mid-reply
        finally:
            await self._teardown()
            if self.why is not None:  # one line per connection cut off, whatever the cause
                log.warning("closed connection from %s: %s", self.chan.peer, self.why)

    def cut(self, why: str) -> None:
        """Note why this connection is being cut off (the first reason counts)."""
        if self.why is None:
            self.why = why[:300]  # the reason may quote the client's bytes: keep it short

    async def _next_frame(self) -> Frame | None:
        """The next request's header; None when the client leaves or idles out."""
        head = bytearray(FRAME.size)
        idle = self.loop.time() + self.ctx.server.idle_timeout_s
        try:
            await self.chan.recv_into(memoryview(head)[:1], idle)
        except (ConnectionError, TimeoutError):
            return None
        self.busy += 1  # from the first byte of a frame until its request is served
        await self.chan.recv_into(memoryview(head)[1:], self.deadline(FRAME.size))
        try:
            return Frame.unpack(head)
        except ProtocolError as exc:
            ours = head[:2] == MAGIC
            status = Status.UNSUPPORTED_VERSION if ours else Status.BAD_FRAME
            bad = Frame(0, 0, 0, 0, 0, 0)
            self.cut(f"{status.name}: {exc}")
            with contextlib.suppress(ConnectionError, TimeoutError, OSError):
                await self.error(bad, status, str(exc))
            return None

    def _check_limits(self, frame: Frame) -> None:
        cfg = self.ctx.server
        meta_limit = max(MAX_JSON_META, 64 + 17 * cfg.max_batch_blocks)
        if frame.flags & Flag.REPLY or frame.status:
            raise Refused(Status.BAD_FRAME, "clients send requests, not replies", fatal=True)
        if frame.meta_len > meta_limit:
            raise Refused(
                Status.TOO_LARGE, f"meta of {frame.meta_len} bytes (at most {meta_limit})", True
            )
        if frame.payload_len > cfg.max_frame_bytes:
            raise Refused(
                Status.TOO_LARGE,
                f"payload of {frame.payload_len} bytes (server.max_frame_bytes is "
                f"{cfg.max_frame_bytes})",
                fatal=True,
            )
        if frame.payload_len and frame.op not in _PAYLOAD_OPS:
            raise Refused(Status.BAD_FRAME, f"op {frame.op} carries no payload", fatal=True)

    async def _handle(self, frame: Frame) -> bool:
        """Serve one request; False when the connection must close."""
        started = time.perf_counter()  # its header is in: the request's latency starts
        try:
            self._check_limits(frame)
            meta = await self.chan.recv(frame.meta_len, self.deadline(frame.meta_len))
            self._check_state(frame)
        except Refused as refused:
            self.busy -= 1
            if refused.fatal:
                self.cut(f"{refused.status.name}: {refused}")
            elif frame.payload_len:  # refused for its scope: its payload is skipped
                await self.chan.discard(frame.payload_len, self.deadline(frame.payload_len))
            await self.error(frame, refused.status, str(refused))
            return not refused.fatal
        self.ctx.metrics.request(_op_name(frame.op))
        self.ctx.metrics.add("bytes_received", frame.meta_len + frame.payload_len)
        if frame.op in _PAYLOAD_OPS or frame.op == Op.RELEASE or self.state < State.OPEN:
            try:
                return await self._guarded(frame, self._inline(frame, meta), started)
            finally:
                self.busy -= 1
        await self._slots.acquire()  # back-pressure: at most max_inflight_requests at once
        work = self._concurrent(frame, meta)
        task = asyncio.create_task(self._guarded(frame, work, started))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return True

    def _task_done(self, task: asyncio.Task[bool]) -> None:
        self._tasks.discard(task)
        self._slots.release()
        self.busy -= 1
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None or task.result() is False:
            if isinstance(exc, Exception):
                self.cut(_broken(exc))
            self.chan.abort()  # the reader sees the end of the stream and leaves

    async def _guarded(self, frame: Frame, work: Awaitable[None], started: float) -> bool:
        """Run one request; turn refusals and store errors into error replies.

        Every request the handshake lets through ends here, so this is where its latency
        (``started``: :func:`time.perf_counter` when its header arrived) is recorded, by op
        and outcome, once its reply (or error reply) is sent.
        """
        outcome = "aborted"  # the connection broke (or the server stopped) mid-request
        try:
            await work
            outcome = "ok"
            return True
        except Refused as refused:
            outcome = _status_name(refused.status)
            if refused.fatal:
                self.cut(f"{refused.status.name}: {refused}")
            await self.error(frame, refused.status, str(refused))
            return not refused.fatal
        except KVStoreError as exc:
            status = next((s for cls, s in _ERRORS if isinstance(exc, cls)), Status.INTERNAL)
            outcome = _status_name(status)
            await self.error(frame, status, str(exc))
            return True
        except (ConnectionError, TimeoutError, OSError):
            raise
        except Exception as exc:  # a bug: answer, log, keep serving the others
            outcome = _status_name(Status.INTERNAL)
            log.exception("request %s from %s failed", _op_name(frame.op), self.chan.peer)
            await self.error(frame, Status.INTERNAL, f"internal error: {type(exc).__name__}")
            return True
        finally:
            elapsed = time.perf_counter() - started
            self.ctx.metrics.latency.observe(_op_name(frame.op), outcome, elapsed)

    def _check_state(self, frame: Frame) -> None:
        """Refuse a request the handshake has not reached (fatal before authentication)."""
        if frame.op not in _KNOWN_OPS:
            fatal = bool(frame.payload_len) or self.state < State.AUTHED
            raise Refused(Status.UNKNOWN_OP, f"unknown op {frame.op}", fatal)
        op = Op(frame.op)
        if op in (Op.HELLO, Op.AUTH):
            if self.state != (State.NEW if op == Op.HELLO else State.GREETED):
                raise Refused(Status.BAD_REQUEST, f"{op.name} out of order", fatal=True)
            return
        if self.state < State.GREETED:
            raise Refused(Status.UNAUTHENTICATED, "say HELLO first", fatal=True)
        if op == Op.PING:
            return
        if self.state < State.AUTHED:
            raise Refused(Status.UNAUTHENTICATED, "authenticate first (AUTH)", fatal=True)
        self._check_token(op)
        if op in (Op.OPEN, Op.STATS, Op.ADMIN):
            return
        if self.state < State.OPEN:
            raise Refused(Status.NOT_OPEN, "OPEN a namespace and layout first", fatal=True)

    def _check_token(self, op: Op) -> None:
        """The token as the server's tokens stand now: still accepted, its scopes cover
        ``op``, and it still opens the namespace this connection opened."""
        if self.credential is None:
            if self.ctx.authenticator.required:  # tokens were added since this one connected
                raise Refused(Status.UNAUTHENTICATED, "this server now requires a token", True)
            return
        try:
            self.credential = check_scope(self.ctx.authenticator, self.credential, op)
        except AccessDeniedError as exc:
            gone = self.ctx.authenticator.current(self.credential) is None
            status = Status.UNAUTHENTICATED if gone else Status.NOT_PERMITTED
            raise Refused(status, str(exc), fatal=gone) from None
        if self.hosted is not None and not self.ctx.authenticator.allows(
            self.credential, self.hosted.namespace
        ):
            raise Refused(
                Status.FORBIDDEN,
                f"this token no longer opens namespace {self.hosted.namespace!r}",
                fatal=True,
            )

    # -- requests ---------------------------------------------------------------
    async def _inline(self, frame: Frame, meta: bytes) -> None:
        """Requests served in the reader: handshake, payload-carrying ones, RELEASE."""
        op = frame.op
        if op == Op.HELLO:
            await self._hello(frame, meta)
        elif op == Op.AUTH:
            await self._auth(frame, meta)
        elif op == Op.PING:
            await self.reply(frame)
        elif op == Op.OPEN:
            await self._open(frame, meta)
        elif op == Op.STATS:
            await self._stats(frame, meta)
        elif op == Op.ADMIN:
            await self._admin(frame, meta)
        elif op == Op.PUT:
            await handlers.put(self, frame, meta)
        elif op == Op.COMMIT:
            await handlers.commit(self, frame, meta)
        elif op == Op.TOKENS:
            await handlers.note_tokens(self, frame, meta)
        elif op == Op.RELEASE:
            await handlers.release(self, frame, meta)
        else:
            raise Refused(Status.NOT_OPEN, "OPEN a namespace and layout first", fatal=True)

    async def _concurrent(self, frame: Frame, meta: bytes) -> None:
        """Requests without payload, run beside the reader (pipelining)."""
        handler = handlers.CONCURRENT.get(frame.op)
        if handler is not None:
            await handler(self, frame, meta)
        elif frame.op == Op.SHM_ATTACH:
            await self._attach(frame)
        elif frame.op == Op.STATS:
            await self._stats(frame, meta)
        elif frame.op == Op.ADMIN:
            await self._admin(frame, meta)
        elif frame.op == Op.PING:
            await self.reply(frame)
        else:
            raise Refused(Status.BAD_REQUEST, f"{_op_name(frame.op)} after OPEN")

    async def _hello(self, frame: Frame, meta: bytes) -> None:
        hello = decode_json(meta)
        cfg = self.ctx.server
        self.state = State.GREETED
        if not self.ctx.authenticator.required:
            self.state = State.AUTHED
        log.debug("hello from %s: %s", self.chan.peer, str(hello.get("client", ""))[:64])
        info = {
            "server": f"kvstore/{__version__}",
            "protocol": 1,
            "auth": "token" if self.ctx.authenticator.required else "none",
            "nonce": self.nonce.hex(),
            "limits": {
                "max_frame_bytes": cfg.max_frame_bytes,
                "max_batch_blocks": cfg.max_batch_blocks,
                "max_inflight_requests": cfg.max_inflight_requests,
            },
        }
        await self.reply(frame, encode_json(info))

    async def _auth(self, frame: Frame, meta: bytes) -> None:
        cred = self.ctx.authenticator.verify(self.nonce, meta)
        if cred is None:
            self.ctx.metrics.add("auth_failures")  # logged as the connection closes
            raise Refused(Status.UNAUTHENTICATED, "authentication failed", fatal=True)
        self.credential = cred
        self.state = State.AUTHED
        names = None if cred.namespaces is None else sorted(cred.namespaces)
        scopes = sorted(cred.scopes)
        info = {"name": cred.name, "namespaces": names, "tenant": cred.tenant, "scopes": scopes}
        await self.reply(frame, encode_json(info))

    async def _open(self, frame: Frame, meta: bytes) -> None:
        if self.state == State.OPEN:
            raise Refused(Status.BAD_REQUEST, "this connection already opened a store")
        request = decode_json(meta)
        namespace = check_namespace(request.get("namespace"), "namespace")
        auth = self.ctx.authenticator
        if not auth.allows(self.credential, namespace):
            raise AccessDeniedError(auth.refusal(self.credential, namespace))
        layout = KVLayout.from_description(request.get("layout"))
        if request.get("fingerprint") != layout.fingerprint_hex:
            raise InvalidInputError("the layout's fingerprint differs from the client's")
        self.hosted = await self.run(self.ctx.registry.open, namespace, layout)
        self.state = State.OPEN
        stated = request.get("pid")
        self.writer = process_id(self.chan.peer_pid or (stated if type(stated) is int else None))
        hosted = self.hosted
        shared = None
        writes = self.credential is None or self.credential.may("write")
        if hosted.segment is not None and writes:  # a mapping is writable: not for readers
            # loan_s: how long a GET's loan of shared memory lasts; a client that copies
            # out later may read a slot already given to another block, so it checks.
            # reserve_s: how long a RESERVE waits for its COMMIT; a client that would
            # start its copies later does not start them.
            shared = {
                "id": hosted.segment_id,
                "nbytes": hosted.segment.nbytes,
                "loan_s": hosted.store.config.lease_s,
                "reserve_s": self.ctx.server.io_timeout_s,
            }
        reply = {
            "capacity_blocks": max(t.capacity_blocks for t in hosted.store.engine.datapath.tiers),
            "shared_memory": shared,
        }
        await self.reply(frame, encode_json(reply))

    async def _attach(self, frame: Frame) -> None:
        segment = self.store.segment
        if segment is None:
            raise Refused(Status.BAD_REQUEST, "this store has no shared memory")
        described = describe_segment(segment.fd, segment.nbytes)
        info = encode_json({**described, "id": self.store.segment_id})
        self.attached = True
        if self.chan.unix:
            head = Frame(frame.op, Flag.REPLY, 0, frame.request_id, len(info), 0)
            async with self._send_lock:
                await self.chan.send_fd(head.pack() + info, segment.fd, self.deadline())
            return
        await self.reply(frame, info)

    async def _stats(self, frame: Frame, meta: bytes) -> None:
        """The stores and figures the token may see. A meta naming a ``namespace`` (what
        ``kvstore stats --namespace`` asks as) is refused unless the token opens it: a
        token of another tenant would see none of its stores and nothing would say why."""
        cred, auth = self.credential, self.ctx.authenticator
        asked = decode_json(meta).get("namespace") if meta else None
        if asked is not None:
            namespace = check_namespace(asked, "namespace")
            if not auth.allows(cred, namespace):
                raise AccessDeniedError(auth.refusal(cred, namespace))
        allowed = None
        if cred is not None:
            hosted = self.ctx.registry.hosted()
            allowed = frozenset(h.namespace for h in hosted if auth.allows(cred, h.namespace))
        stores = await self.run(self.ctx.registry.stats, allowed)
        body: dict[str, Any] = {"stores": stores}
        operator = cred is None or cred.may("admin")
        if operator or cred is None or cred.tenant not in self.ctx.tenant_names():
            body["server"] = self.ctx.metrics.snapshot()  # every tenant's traffic: not theirs
        if self.ctx.quotas is not None and self.ctx.tenant_names():
            figures = self.ctx.quotas.figures(stores)
            if not operator and cred is not None:
                figures = {t: f for t, f in figures.items() if t == cred.tenant}
            body["tenants"] = figures
        await self.reply(frame, encode_json(body))

    async def _admin(self, frame: Frame, meta: bytes) -> None:
        if self.ctx.admin is None:
            raise Refused(Status.BAD_REQUEST, "this server takes no ADMIN requests")
        answer = self.ctx.admin.handle(decode_json(meta), self.credential)
        await self.reply(frame, encode_json(answer))

    # -- the end --------------------------------------------------------------
    async def _teardown(self) -> None:
        """Let requests in flight finish, then give back every loan and reservation."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        loans, self.loans = list(self.loans.values()), {}
        for loan in loans:
            loan.release()  # on the loop: workers may be waiting for these pins
        # The client's threads may still be copying into these: held, not aborted.
        dropped = {i: r.pending for i, r in self.reservations.items()}
        self.reservations = {}
        if dropped:
            await handlers.hold_dropped(self, dropped)
        self.chan.close()
        self.ctx.metrics.gauge("connections_open", -1)


def _broken(exc: BaseException) -> str:
    """Why a connection broke, for its one log line."""
    if isinstance(exc, TimeoutError):
        return "too slow: a frame (or the read of a reply) took longer than io_timeout_s"
    return f"the stream broke mid-frame: {exc or type(exc).__name__}"


#: Label values, made once (not a string per request).
_OP_NAMES = {int(op): op.name.lower() for op in Op}
_STATUS_NAMES = {int(status): status.name.lower() for status in Status}


def _op_name(op: int) -> str:
    name = _OP_NAMES.get(op)
    return name if name is not None else f"op{op}"


def _status_name(status: Status) -> str:
    return _STATUS_NAMES[status]
