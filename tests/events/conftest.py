"""Real ZMQ subscribers and replay clients for the KV events tests (skipped without pyzmq)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.config.events import EventsConfig
from kvstore.errors import KVStoreError

try:  # the tests that need them skip without (each module importorskips)
    import zmq

    from kvstore.events.format import KVEventBatch, decode_batch
    from kvstore.events.publisher import END_SEQ, EventPublisher
except (ImportError, KVStoreError):  # pragma: no cover - depends on the install
    pass

Message = tuple[int, "KVEventBatch"]


class Subscriber:
    """A SUB socket on a publisher's endpoint, decoding what arrives."""

    def __init__(self, ctx: Any, endpoint: str, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.topics: list[bytes] = []

    def recv(self, timeout: float = 5.0) -> Message | None:
        """The next message as (seq, batch), or None after ``timeout`` seconds."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        topic, seq, payload = self.sock.recv_multipart()
        self.topics.append(topic)
        return int.from_bytes(seq, "big"), decode_batch(payload)

    def join(self, publisher: EventPublisher, timeout: float = 10.0) -> int:
        """Publish empty batches until this subscriber gets one (ZMQ's slow joiner);
        returns the last sequence number received, with nothing left pending."""
        deadline = time.monotonic() + timeout
        msg = None
        while msg is None:
            if time.monotonic() > deadline:
                raise AssertionError("the subscriber never joined")
            publisher.publish([])
            msg = self.recv(0.05)
        time.sleep(0.1)
        last = msg[0]
        while (msg := self.recv(0.05)) is not None:
            last = msg[0]
        return last

    def until(self, done: Callable[[list[Message]], bool], timeout: float = 10.0) -> list[Message]:
        """Messages received until ``done(messages)`` holds (AssertionError on timeout)."""
        got: list[Message] = []
        deadline = time.monotonic() + timeout
        while not done(got):
            left = deadline - time.monotonic()
            msg = self.recv(max(0.0, left)) if left > 0 else None
            if msg is None:
                raise AssertionError(f"timed out; received {got!r}")
            got.append(msg)
        return got


def _replay(ctx: Any, endpoint: str, start: int, timeout: float = 10.0) -> list[Message]:
    """Ask a replay socket for batches from ``start`` (vLLM's protocol, DEALER side)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[Message] = []
        while sock.poll(int(timeout * 1000)):
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == END_SEQ:
                return got
            got.append((int.from_bytes(frames[2], "big"), decode_batch(frames[3])))
        raise AssertionError(f"no end marker; received {got!r}")
    finally:
        sock.close(linger=0)


@pytest.fixture
def zctx() -> Iterator[Any]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def events_config() -> EventsConfig:
    """Loopback, free ports, a fast tick, no heartbeats (tests count the batches)."""
    return EventsConfig(
        enabled=True,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        interval_s=0.005,
        heartbeat_s=0,
    )


@pytest.fixture
def subscribe(zctx: Any) -> Callable[..., Subscriber]:
    def make(endpoint: str, topic: bytes = b"") -> Subscriber:
        return Subscriber(zctx, endpoint, topic)

    return make


@pytest.fixture
def replay(zctx: Any) -> Callable[..., list[Message]]:
    """``replay(endpoint, start)``: the batches a replay socket sends back."""

    def ask(endpoint: str, start: int, timeout: float = 10.0) -> list[Message]:
        return _replay(zctx, endpoint, start, timeout)

    return ask
