"""A TCP proxy that damages bytes in flight, for tests of what crosses a wire.

:class:`CorruptingProxy` listens on 127.0.0.1 and forwards each connection to
a real server. With ``corrupt = True`` it flips one byte in every ``stride``
bytes of each chunk of at least ``min_chunk`` bytes going from the server to
the client -- block bytes, never the small control frames -- which is what a
faulty NIC, a broken middlebox or memory corruption on the way does. The server and the client
are real; only the wire between them lies.
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["CorruptingProxy"]

HOST = "127.0.0.1"


class CorruptingProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (HOST:PORT); a context manager."""

    def __init__(self, target: str, min_chunk: int = 1024, stride: int = 4096) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.min_chunk = min_chunk
        self.stride = stride
        #: Flip bytes in big server-to-client chunks while True ...
        self.corrupt = False
        #: ... in at most this many chunks (None: no limit), then pass bytes intact.
        self.chunks_to_damage: int | None = None
        self.flipped = 0
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.05)  # so the accept loop sees close() promptly
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()  # guards _socks, _threads and flipped
        self._closed = False

    @property
    def address(self) -> str:
        """Where clients connect."""
        return f"{HOST}:{self.port}"

    def start(self) -> CorruptingProxy:
        """Accept connections on a thread."""
        self._spawn(self._accept)
        return self

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed:
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
            with self._lock:
                self._socks += [client, upstream]
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if to_client and self._damage_this(len(data)):
                    damaged = bytearray(data)
                    spots = range(len(damaged) - 1, -1, -self.stride)
                    for i in spots:
                        damaged[i] ^= 0x5A
                    data = bytes(damaged)
                    with self._lock:
                        self.flipped += len(spots)
                dst.sendall(data)
        except OSError:  # either side went away (closed, reset, cut by a test): pump ends
            return
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def _damage_this(self, nbytes: int) -> bool:
        if not self.corrupt or nbytes < self.min_chunk:
            return False
        with self._lock:
            if self.chunks_to_damage is None:
                return True
            if self.chunks_to_damage <= 0:
                return False
            self.chunks_to_damage -= 1
            return True

    def close(self) -> None:
        """Stop accepting, cut every connection, join the threads."""
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> CorruptingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
