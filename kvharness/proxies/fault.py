"""A tiny fault-injecting HTTP proxy (stdlib only) for remote-tier fault tests.

:class:`FaultProxy` listens on 127.0.0.1 and forwards every request to a real
upstream server (moto's S3, say), except that it can answer the next N
requests with an error status (``fail_next``), stall them past any client
read timeout and then drop the connection (``stall_next``), or flip bytes in
the bodies of the next N object GETs it relays (``corrupt_next``). The faults
are real HTTP behaviour on a real socket, so the client's own timeout, retry
and verification machinery runs exactly as it would against a sick server.
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FaultProxy", "flip_bytes"]

HOST = "127.0.0.1"
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>injected by FaultProxy</Message>"
    "<RequestId>kvstore-fault</RequestId></Error>"
)


def _is_object(path: str) -> bool:
    """Whether a path-style request names an object (``/bucket/key``), not a bucket
    (a listing's XML is not a block: damaging it tests nothing about verification)."""
    return "/" in path.split("?", 1)[0].strip("/")


def _request_kind(method: str, path: str) -> str:
    """``method``, or ``DELETE`` for S3's batch delete (a POST to ``?delete``)."""
    query = path.partition("?")[2]
    if method == "POST" and "delete" in (q.partition("=")[0] for q in query.split("&")):
        return "DELETE"
    return method


def flip_bytes(data: bytes, stride: int = 4096) -> bytes:
    """``data`` with one byte in every ``stride`` (the last one first) XORed with 0x5A:
    the body keeps its length, so only a checksum can tell."""
    damaged = bytearray(data)
    for i in range(len(damaged) - 1, -1, -stride):
        damaged[i] ^= 0x5A
    return bytes(damaged)


class _Server(ThreadingHTTPServer):
    """Joins its handler threads on close and can cut their connections."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, proxy: FaultProxy, port: int) -> None:
        self.proxy = proxy
        self.live: set[socket.socket] = set()
        self.live_lock = threading.Lock()
        super().__init__((HOST, port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.live_lock:
            self.live.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.live_lock:
            self.live.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a killed process, a timeout) is normal here; anything
        else is reported as the standard library would."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def cut_connections(self) -> None:
        """Shut every client connection, so keep-alive handler threads end."""
        with self.live_lock:
            live = list(self.live)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue


class _Handler(BaseHTTPRequestHandler):
    """Forward one request upstream, unless the proxy says to fail or stall it."""

    protocol_version = "HTTP/1.1"  # keep-alive, as a client's connection pool expects
    server: _Server
    timeout = 30  # an idle keep-alive connection does not hold a thread forever

    def log_message(self, format: str, *args: Any) -> None:
        return None  # quiet: the tests assert on counters, not on access logs

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _relay(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        if body is None:  # the sender hung up mid-body (killed): S3 would store nothing
            proxy._cut_short()
            self.close_connection = True
            return
        fault = proxy._next_fault(_request_kind(self.command, self.path))
        try:
            if fault is None:
                self._forward(body)
            elif fault[0] == "stall":
                proxy._stopping.wait(fault[1])  # past the client's read timeout
                self.close_connection = True  # then hang up without an answer
            else:
                self._reply_error(int(fault[1]), str(fault[2]))
        except OSError:  # the client gave up (timeout) or the proxy is stopping
            self.close_connection = True

    def _read_body(self) -> bytes | None:
        """The request's whole body; None if the sender hung up before its end.

        A body cut short must never be forwarded as a complete one: S3 stores nothing
        of a request whose body ends early, and relaying the part that came as the whole
        would plant a truncated object in the bucket (a node SIGKILLed mid-PUT did, in
        the chaos soak: a "lost" block that no node could read)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                line = self.rfile.readline()
                if not line.endswith(b"\n"):
                    return None
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunk = self.rfile.read(size)
                if len(chunk) < size:
                    return None
                chunks.append(chunk)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        return body if len(body) == length else None

    def _forward(self, body: bytes) -> None:
        proxy = self.server.proxy
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            resp = upstream.getresponse()
            data = resp.read()
            self.send_response_only(resp.status, resp.reason)
            for name, value in resp.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command == "GET" and 200 <= resp.status < 300 and _is_object(self.path):
                data = proxy._maybe_corrupt(data)
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            upstream.close()

    def _reply_error(self, status: int, code: str) -> None:
        data = _ERROR_XML.format(code=code).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class FaultProxy:
    """HTTP proxy on 127.0.0.1 (``port``, or a free one) to ``upstream_host:upstream_port``,
    with switchable faults.

    ``fail_next(n, status, code)``: the next ``n`` requests get ``status``
    with an S3-style error body. ``stall_next(n, seconds)``: the next ``n``
    requests get no answer for ``seconds`` and then a closed connection.
    ``corrupt_next(n)``: the next ``n`` successful object GETs are relayed with
    bytes flipped in their bodies (same status, headers and length).
    ``requests`` and ``faults`` count what the proxy saw and injected
    (``corrupted``: the bodies it damaged, also counted in ``faults``; ``by_kind``:
    requests by method, S3's batch delete counted as ``DELETE``; ``cut_short``: requests
    whose sender hung up before the end of the body, never forwarded, as S3 stores
    nothing of them). ``n = 0`` ends a mode.
    """

    def __init__(self, upstream_port: int, upstream_host: str = HOST, port: int = 0) -> None:
        self.listen_port = port  # 0: any free port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.requests = 0
        self.faults = 0
        self._fail_left = 0
        self._fail: tuple[int, str] = (503, "SlowDown")
        self._stall_left = 0
        self._stall_s = 0.0
        self._corrupt_left = 0
        self.corrupted = 0
        self.cut_short = 0
        self.by_kind: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port the proxy listens on (after :meth:`start`)."""
        assert self._server is not None, "start() the proxy first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.port}"

    def fail_next(self, n: int, status: int = 503, code: str = "SlowDown") -> None:
        """Answer the next ``n`` requests with ``status`` and error ``code``."""
        with self._lock:
            self._fail_left, self._fail = n, (status, code)

    def stall_next(self, n: int, seconds: float) -> None:
        """Leave the next ``n`` requests unanswered for ``seconds``, then hang up."""
        with self._lock:
            self._stall_left, self._stall_s = n, seconds

    def corrupt_next(self, n: int) -> None:
        """Flip bytes in the bodies of the next ``n`` successful object GETs."""
        with self._lock:
            self._corrupt_left = n

    def _maybe_corrupt(self, data: bytes) -> bytes:
        """``data`` damaged if a ``corrupt_next`` budget is left (and spend one)."""
        if not data:
            return data
        with self._lock:
            if self._corrupt_left <= 0:
                return data
            self._corrupt_left -= 1
            self.corrupted += 1
            self.faults += 1
        return flip_bytes(data)

    def _cut_short(self) -> None:
        """Count a request whose sender hung up mid-body (nothing was forwarded)."""
        with self._lock:
            self.requests += 1
            self.cut_short += 1

    def _next_fault(self, kind: str) -> tuple[str, float, str] | tuple[str, int, str] | None:
        with self._lock:
            self.requests += 1
            self.by_kind[kind] += 1
            if self._stall_left > 0:
                self._stall_left -= 1
                self.faults += 1
                return ("stall", self._stall_s, "")
            if self._fail_left > 0:
                self._fail_left -= 1
                self.faults += 1
                return ("fail", self._fail[0], self._fail[1])
            return None

    def start(self) -> FaultProxy:
        """Listen on a free port and serve in a background thread."""
        self._stopping.clear()
        self._server = _Server(self, self.listen_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # stop() waits at most this long
            name="kvstore-fault-proxy",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, cut open connections, join every thread. Idempotent."""
        if self._server is None:
            return
        self._stopping.set()
        self._server.shutdown()
        self._server.cut_connections()
        self._server.server_close()  # joins the handler threads
        if self._thread is not None:
            self._thread.join()
        self._server = None
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
