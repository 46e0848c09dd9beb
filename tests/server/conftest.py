"""A raw protocol connection, for tests that send what no well-behaved client would."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from kvstore.layout import KVLayout
from kvstore.wire import auth
from kvstore.wire.protocol import (
    FRAME,
    Flag,
    Frame,
    Op,
    Status,
    decode_json,
    encode_json,
)


class RawConnection:
    """A socket speaking frames by hand."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        if address.startswith("unix:"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(address[5:])
        else:
            host, _, port = address.rpartition(":")
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.rid = 0

    def send(
        self, op: int, meta: bytes = b"", payload: bytes = b"", flags: int = 0, **over: int
    ) -> int:
        self.rid += 1
        fields = {"meta_len": len(meta), "payload_len": len(payload), **over}
        head = Frame(op, flags, 0, self.rid, fields["meta_len"], fields["payload_len"])
        self.sock.sendall(head.pack() + meta + payload)
        return self.rid

    def read(self) -> tuple[Frame, bytes, bytes]:
        """The next reply: header, meta, payload. ConnectionError if the server closed."""
        frame = Frame.unpack(self.recv(FRAME.size))
        return frame, self.recv(frame.meta_len), self.recv(frame.payload_len)

    def call(
        self, op: int, meta: bytes = b"", payload: bytes = b"", **kw: Any
    ) -> tuple[Frame, bytes, bytes]:
        self.send(op, meta, payload, **kw)
        return self.read()

    def recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            buf += chunk
        return buf

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        """True once the server has closed its end (reads hit EOF or a reset)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionError, OSError):
            return True

    def handshake(
        self, layout: KVLayout | None = None, token: bytes | None = None, namespace: str = "default"
    ) -> dict[str, Any]:
        frame, meta, _ = self.call(Op.HELLO, encode_json({"client": "raw"}))
        assert frame.status == Status.OK and frame.flags & Flag.REPLY
        hello = decode_json(meta)
        if token is not None:
            frame, meta, _ = self.call(Op.AUTH, auth.answer(token, bytes.fromhex(hello["nonce"])))
            assert frame.status == Status.OK, meta
        if layout is not None:
            body = {
                "namespace": namespace,
                "layout": layout.describe(),
                "fingerprint": layout.fingerprint_hex,
            }
            frame, meta, _ = self.call(Op.OPEN, encode_json(body))
            assert frame.status == Status.OK, meta
        return hello

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw() -> Any:
    """``raw(address)``: a :class:`RawConnection`, closed at the end of the test."""
    made: list[RawConnection] = []

    def connect(address: str, timeout: float = 5.0) -> RawConnection:
        conn = RawConnection(address, timeout)
        made.append(conn)
        return conn

    yield connect
    for conn in made:
        conn.close()
