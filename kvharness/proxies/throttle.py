"""A TCP proxy that imposes a slow link, for tests and benchmarks of remote tiers.

:class:`ThrottlingProxy` listens on 127.0.0.1 and forwards each connection to
a real server, over a link with a download bandwidth and a request latency
that can be changed while connections are open (a benchmark throttles, then
unthrottles). The server and the client are real; only the wire is slow.

The link model:

- ``gbps`` (1e9 bytes a second; None: unlimited) paces the server-to-client
  direction, shared by every connection of the proxy as one link. The link is
  a virtual clock: a chunk of ``n`` bytes occupies it for ``n / rate`` seconds
  after the previous chunk (of any connection) is done, and is delivered when
  its slot ends, so a transfer of ``N`` bytes takes ``N / rate`` seconds however
  many connections share it (and one that starts on an idle link never less: a
  chunk on an idle link starts its slot when it arrives, idle time earns no
  credit). A chunk that comes less
  than 5 ms after the previous slot ended continues from that end, so the
  pumps' own overhead between chunks does not slow the link. Chunks are cut to
  about 2 ms of link time, so pacing is smooth; waits are sleeps (a condition
  variable), never spins. A change of ``gbps`` restarts the clock and
  wakes chunks waiting on the old rate.
- ``latency_ms`` is added once per request: the first client-to-server chunk of
  a connection, and the first one after the server has sent anything back, are
  held for ``latency_ms`` before they are forwarded. The chunks that follow in
  the same burst (a request's body) are not, so an upload pays the latency once,
  as a request/response round trip over a real link would; pipelined requests
  sent with no answer between them pay it once for all. Uploads are unpaced.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

__all__ = ["ThrottlingProxy"]

HOST = "127.0.0.1"
_MAX_CHUNK = 1 << 16
_MIN_CHUNK = 4096
_SLICE_S = 0.002  # link time per chunk while throttled
_EARLY_S = 0.0002  # a wait this short is skipped (the debt stays on the link clock)
_GAP_S = 0.005  # a chunk this soon after the last slot ended continues it (pump overhead)


class _Unset:
    """The type of :data:`_UNSET`: an argument not given (None means unlimited)."""


_UNSET = _Unset()


@dataclass(eq=False)
class _Link:
    """One proxied connection: its two sockets, and whether the server has answered
    since the client's last burst (the next client chunk starts a new request)."""

    client: socket.socket
    upstream: socket.socket
    answered: bool = True  # set by the down pump, cleared by the up pump (GIL-atomic)
    pumps_left: int = 2
    #: Why a pump ended early (a side closed or reset the connection; None: a clean end).
    error: OSError | None = None


class ThrottlingProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (HOST:PORT) over a slow link; a context
    manager. See the module docstring for the link model.

    Locking: ``_cond`` (a condition on one re-entrant lock) guards the link clock
    (``_next_free``, ``_epoch``, ``_gbps``, ``_latency_ms``), the counters, ``_links`` and
    ``_threads``; pumps wait on it for their slot and never hold it across socket I/O
    (they read ``_gbps`` and ``_latency_ms`` unlocked: one attribute load each).
    The accept loop registers a connection and starts its pumps in one hold, so
    :meth:`close` sees either all of it or none.
    """

    def __init__(self, target: str, gbps: float | None = None, latency_ms: float = 0.0) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self._cond = threading.Condition(threading.RLock())
        self._gbps: float | None = None
        self._latency_ms = 0.0
        self._next_free = 0.0  # monotonic time the link is free for the next chunk
        self._epoch = 0  # bumped by set(): chunks waiting on the old rate go at once
        self.set(gbps=gbps, latency_ms=latency_ms)
        #: Bytes forwarded (or being handed on) server-to-client, client-to-server; connections
        #: accepted. A count is never behind what the receiving side already holds.
        self.bytes_down = 0
        self.bytes_up = 0
        self.connections = 0
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.05)  # so the accept loop sees close() promptly
        self.port = int(self._listener.getsockname()[1])
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def address(self) -> str:
        """Where clients connect: ``127.0.0.1:<port>``."""
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, for HTTP clients (an S3 endpoint, say)."""
        return f"http://{self.address}"

    @property
    def gbps(self) -> float | None:
        """Download bandwidth in 1e9 bytes a second; None: unlimited."""
        return self._gbps

    @gbps.setter
    def gbps(self, value: float | None) -> None:
        self.set(gbps=value)

    @property
    def latency_ms(self) -> float:
        """Milliseconds added once per request (see the module docstring)."""
        return self._latency_ms

    @latency_ms.setter
    def latency_ms(self, value: float) -> None:
        self.set(latency_ms=value)

    def set(
        self, gbps: float | _Unset | None = _UNSET, latency_ms: float | _Unset = _UNSET
    ) -> ThrottlingProxy:
        """Change the link now, open connections included; an argument not given stays."""
        if not isinstance(gbps, _Unset) and gbps is not None and not gbps > 0:
            raise ValueError(f"gbps must be > 0 or None, got {gbps!r}")
        if not isinstance(latency_ms, _Unset) and not latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms!r}")
        with self._cond:
            if not isinstance(latency_ms, _Unset):
                self._latency_ms = float(latency_ms)
            if not isinstance(gbps, _Unset):
                self._gbps = None if gbps is None else float(gbps)
                self._epoch += 1
                self._next_free = 0.0  # the link starts idle at the new rate
                self._cond.notify_all()
        return self

    def start(self) -> ThrottlingProxy:
        """Accept connections on a thread."""
        self._spawn(self._accept)
        return self

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):  # chunks go out as paced: no Nagle stalls
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            with self._cond:
                if self._stop.is_set():  # close() ran meanwhile: it will not see this one
                    client.close()
                    upstream.close()
                    return
                self._links.add(link)
                self.connections += 1
                self._spawn(self._pump_up, link)
                self._spawn(self._pump_down, link)

    def _pump_up(self, link: _Link) -> None:
        """Client to server: hold the first chunk of each request for the latency."""
        try:
            while True:
                data = link.client.recv(_MAX_CHUNK)
                if not data:
                    break
                if link.answered:
                    link.answered = False
                    latency_s = self._latency_ms / 1e3
                    if latency_s > 0 and self._stop.wait(latency_s):
                        break
                with self._cond:  # counted before it is handed on: never behind the peer
                    self.bytes_up += len(data)
                link.upstream.sendall(data)
        except OSError as exc:  # either side went away (closed, reset): the pump ends
            link.error = exc
        finally:
            self._finish(link, link.upstream)

    def _pump_down(self, link: _Link) -> None:
        """Server to client: each chunk waits for its slot on the shared link."""
        try:
            while True:
                data = link.upstream.recv(self._chunk_size())
                if not data:
                    break
                self._pace(len(data))
                link.answered = True  # before the client can see it and send again
                with self._cond:  # counted before the client can hold it
                    self.bytes_down += len(data)
                link.client.sendall(data)
        except OSError as exc:  # either side went away: the pump ends
            link.error = exc
        finally:
            self._finish(link, link.client)

    def _chunk_size(self) -> int:
        """Bytes a server-to-client chunk may have: about ``_SLICE_S`` of link time."""
        gbps = self._gbps
        if gbps is None:
            return _MAX_CHUNK
        return min(_MAX_CHUNK, max(_MIN_CHUNK, int(gbps * 1e9 * _SLICE_S)))

    def _pace(self, nbytes: int) -> None:
        """Take the next ``nbytes`` slot of the link and sleep until it ends."""
        with self._cond:
            if self._gbps is None:
                return
            now = time.monotonic()
            start = self._next_free if now - self._next_free < _GAP_S else now
            due = start + nbytes / (self._gbps * 1e9)
            self._next_free = due
            epoch = self._epoch
            while not self._stop.is_set() and epoch == self._epoch:
                left = due - time.monotonic()
                if left <= _EARLY_S:
                    return
                self._cond.wait(left)

    def _finish(self, link: _Link, dst: socket.socket) -> None:
        """A pump ended: pass the end of stream on; the last one closes the link."""
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._cond:
            link.pumps_left -= 1
            if link.pumps_left > 0:
                return
            self._links.discard(link)
        link.client.close()
        link.upstream.close()

    def close(self) -> None:
        """Stop accepting, cut every connection, join the threads. Idempotent."""
        self._stop.set()
        self._listener.close()
        with self._cond:
            self._cond.notify_all()  # pumps waiting for a slot
            links, threads = list(self._links), list(self._threads)
        for link in links:
            for sock in (link.client, link.upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=5)
        for link in links:  # normally closed by their pumps already
            link.client.close()
            link.upstream.close()

    def __enter__(self) -> ThrottlingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
