"""``EventPublisher``: KV event batches over ZMQ, the way vLLM's ``ZmqEventPublisher`` sends them.

Wire protocol (vLLM 0.32.0's, so vLLM-speaking consumers need no change):

- **PUB** socket (``events.endpoint``): each batch is a multipart message
  ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian counter, one per
  batch, without gaps; ``payload`` is a msgpack ``KVEventBatch``
  (:mod:`kvstore.events.format`). Unlike vLLM's, the counter starts at the
  microseconds since the epoch (:attr:`EventPublisher.first_seq`), so a
  restarted publisher goes on above the last sequence a consumer saw: Dynamo's
  indexer silently drops a batch whose sequence is not above the last it
  applied, and asks the replay socket for the gap instead.
- **ROUTER** replay socket (``events.replay_endpoint``, optional): a client
  (DEALER or REQ) sends ``[b"", start_seq]`` (REQ adds the empty frame itself),
  ``start_seq`` 8 bytes big-endian; it gets every buffered batch with
  ``seq >= start_seq`` as ``[b"", topic, seq, payload]``, then the end marker
  ``[b"", b"", -1 as 8 signed bytes, b""]``. The last ``buffer_steps``
  batches are kept.

What kvstore adds:

- The first batch a publisher sends (``first_seq``) is ``[AllBlocksCleared]``: "this
  worker (re)started, forget what it announced before". Stores then announce
  what they hold (:class:`~kvstore.events.source.StoreEvents` does on start).
- **Heartbeats.** With nothing to publish for ``events.heartbeat_s``, an empty
  batch goes out: a subscriber that connected late, or reconnected to a
  restarted publisher, and missed the batches sent before, sees the gap in the
  sequence within that time and asks the replay socket for it (Dynamo's
  indexer does), instead of waiting for the next change.
- **Late subscribers.** A replay request for a sequence older than the buffer
  keeps, once the buffer has wrapped (while it holds every batch since
  ``first_seq``, replaying it is the whole story), is answered first with a
  full *snapshot*: ``AllBlocksCleared`` then a
  ``BlockStored`` for every block held, from the sources registered with
  :meth:`EventPublisher.add_source`, in one batch labelled with the sequence
  just before the oldest buffered one (one batch: subscribers drop a second
  batch of a sequence number they applied); then the buffered batches, then the
  end marker. Applying the buffered batches after the snapshot is safe: each is
  idempotent against the state the snapshot shows, and the last event of a
  block in the buffer agrees with it. :meth:`EventPublisher.publish_snapshot`
  sends the same snapshot as ordinary live batches.

:meth:`EventPublisher.publish` never blocks: batches go to a sender thread
(one thread owns both sockets), woken through a pipe the ZMQ poller watches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore.config import EventsConfig, is_loopback
from kvstore.errors import ClosedError, ConfigError
from kvstore.events.format import AllBlocksCleared, Event, encode_batch

try:
    import zmq
except ImportError:  # pragma: no cover - depends on the install
    from kvstore.events._deps import INSTALL_HINT, EventsUnavailableError

    raise EventsUnavailableError(
        f"events: publishing KV events needs 'pyzmq'; install it with: {INSTALL_HINT}"
    ) from None

from kvstore.events.zap import Check, ZapHandler, require_plain

__all__ = ["END_SEQ", "SNAPSHOT_BATCH_EVENTS", "EventPublisher", "Source"]

log = logging.getLogger(__name__)

#: The sequence frame of the replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Events per batch of a snapshot published live (each batch its own sequence number).
SNAPSHOT_BATCH_EVENTS = 512
#: A callable listing the events that announce everything a store holds now.
Source = Callable[[], Iterable[Event]]

_LOOPBACK = ("*", "0.0.0.0", "::", "[::]", "127.0.0.1", "localhost", "[::1]")
_SNAPSHOT = object()  # a queued request for a live snapshot
_LINGER_MS = 200


def _binds(endpoint: str) -> bool:
    """Bind wildcard, loopback, port-0, ipc and inproc endpoints; connect to the rest."""
    if not endpoint.startswith("tcp://"):
        return True
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return host in _LOOPBACK or "*" in host or port == "0"


def _beyond_loopback(endpoint: str) -> bool:
    """Whether a bound ``endpoint`` is reachable from other hosts: TCP on a wildcard or an
    interface's address (``ipc://`` and ``inproc://`` stay on this host)."""
    if not endpoint.startswith("tcp://"):
        return False
    return not is_loopback(endpoint[len("tcp://") :])


def _chunks(events: list[Event], size: int) -> list[list[Event]]:
    return [events[i : i + size] for i in range(0, len(events), size)] or [[]]


class EventPublisher:
    """Publishes batches of KV events on a ZMQ PUB socket, with vLLM's replay protocol.

    ``EventPublisher(config)`` binds nothing until :meth:`start`; :meth:`close`
    sends what is queued, joins the thread and closes the sockets. Several
    stores may share one publisher (each registers its snapshot source).
    """

    def __init__(self, config: EventsConfig, authenticate: Check | None = None) -> None:
        self.config = config
        #: ``authenticate(user, password)``: subscribers must connect with ZMQ PLAIN
        #: credentials it accepts (:mod:`kvstore.events.zap`); None: anyone may connect.
        self.authenticate = authenticate
        self._zap: ZapHandler | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._sources: list[Source] = []
        self._topic = config.topic.encode("utf-8")
        #: The first sequence number: microseconds since the epoch, above any earlier run's.
        self.first_seq = time.time_ns() // 1000
        self._seq = self.first_seq
        self._last_send = 0.0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._counts = {"batches": 0, "events": 0, "bytes": 0, "replays": 0, "snapshots": 0}
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> EventPublisher:
        """Bind (or connect) the sockets and start the sender thread; idempotent.

        Raises :class:`~kvstore.errors.ConfigError` when an endpoint cannot be used
        (address in use, bad interface)."""
        with self._lock:
            if self._closed:
                raise ClosedError("event publisher is closed")
            if self._thread is not None:
                return self
            self._ctx = zmq.Context()
            try:
                self._open_sockets()
            except BaseException:
                self._close_sockets()
                raise
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
            self._thread.start()
        return self

    def _open_sockets(self) -> None:
        assert self._ctx is not None
        config = self.config
        if self.authenticate is not None:  # ZAP's handler before any socket binds
            self._zap = ZapHandler(self._ctx, self.authenticate)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, _LINGER_MS)
        if self._zap is not None:
            require_plain(self._pub)
        self.bound_endpoint = self._attach(self._pub, config.endpoint, "endpoint")
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by the buffer
            self._replay.setsockopt(zmq.LINGER, _LINGER_MS)
            if self._zap is not None:
                require_plain(self._replay)
            self.bound_replay_endpoint = self._attach(
                self._replay, config.replay_endpoint, "replay_endpoint", bind=True
            )
        if self._zap is None:
            self._warn_exposed()

    def _warn_exposed(self) -> None:
        """Say once that a socket bound beyond loopback lets anyone subscribe: the events
        carry the token ids of every prompt stored (a kvstore-server refuses to listen
        beyond loopback without a token; its events are not refused, as vLLM's are not,
        but not kept quiet either)."""
        config = self.config
        bound = [config.endpoint] if _binds(config.endpoint) else []
        bound += [config.replay_endpoint] if config.replay_endpoint is not None else []
        exposed = [endpoint for endpoint in bound if _beyond_loopback(endpoint)]
        if exposed:
            log.warning(
                "KV events on %s reach every host that reaches this one, unauthenticated: "
                "whoever connects reads the token ids of every prompt stored; bind "
                "tcp://127.0.0.1:PORT or ipc:// where the routers run on this host, keep the "
                "port behind a firewall, or give tenants an events_endpoint with events_auth",
                " and ".join(exposed),
            )

    @staticmethod
    def _attach(sock: zmq.Socket[bytes], endpoint: str, name: str, bind: bool = False) -> str:
        """Bind or connect ``sock``; the endpoint actually used (the real port for port 0)."""
        host = endpoint.partition("://")[2].rpartition(":")[0]
        if endpoint.startswith("tcp://") and (host.startswith("[") or host == "::"):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if bind or _binds(endpoint):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"events.{name} {endpoint!r}: {exc}") from None
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) and last else endpoint

    def close(self) -> None:
        """Send what is queued, stop the sender thread, close the sockets; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            self._wake()
            thread.join()
            with self._lock:
                fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                os.close(fd)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=_LINGER_MS)
        self._pub = self._replay = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> EventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what callers use ------------------------------------------------------------
    def add_source(self, source: Source) -> None:
        """Register a snapshot source: a callable listing ``BlockStored`` events for
        everything a store holds (parent first), called on the sender thread."""
        with self._lock:
            self._sources.append(source)

    def remove_source(self, source: Source) -> None:
        """Unregister a snapshot source (no-op if it is not registered)."""
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def publish(self, events: Sequence[Event]) -> None:
        """Queue ``events`` as one batch (stamped now) for the sender thread; never
        blocks. Raises :class:`~kvstore.errors.ClosedError` after :meth:`close`."""
        if self._closed:
            raise ClosedError("event publisher is closed")
        self._queue.put((time.time(), list(events)))
        self._wake()

    def publish_snapshot(self) -> None:
        """Queue a full snapshot (``AllBlocksCleared``, then every source's blocks) as
        live batches: what the owner of a store sends after clearing it."""
        if self._closed:
            raise ClosedError("event publisher is closed")
        self._queue.put(_SNAPSHOT)
        self._wake()

    def stats(self) -> dict[str, int]:
        """Batches, events and payload bytes published; replays served; snapshots taken;
        the next sequence number."""
        zap = self._zap.counts if self._zap is not None else {}
        subscribers = {f"subscribers_{name}": n for name, n in zap.items()}
        return {**self._counts, **subscribers, "next_seq": self._seq, "buffered": len(self._buffer)}

    def _wake(self) -> None:
        with self._lock:  # close() must not close the pipe under a write
            if self._wake_w < 0:
                return
            with contextlib.suppress(OSError):  # a full pipe: a wake-up is pending anyway
                os.write(self._wake_w, b"\0")

    # -- the sender thread ---------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.socket, zmq.POLLIN)
        self._send(time.time(), [AllBlocksCleared()])
        running = True
        while running:
            ready = dict(poller.poll(100))
            if self._wake_r in ready:
                self._clear_wakeups()
            while self._zap is not None and self._zap.socket.poll(0):
                self._zap.answer()
            running = self._drain_queue()
            beat = self.config.heartbeat_s
            if running and beat and time.monotonic() - self._last_send >= beat:
                self._send(time.time(), [])  # lets a (re)connected subscriber see its gap
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()

    def _clear_wakeups(self) -> None:
        """Empty the wake-up pipe (non-blocking: stops when nothing is left)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                continue

    def _drain_queue(self) -> bool:
        """Send every queued batch; False once the close sentinel was reached."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            try:
                if item is _SNAPSHOT:
                    for batch in _chunks(self._snapshot_events(), SNAPSHOT_BATCH_EVENTS):
                        self._send(time.time(), batch)
                else:
                    self._send(*item)
            except Exception:
                log.exception("KV events: a batch could not be published")

    def _send(self, ts: float, events: list[Event]) -> None:
        assert self._pub is not None
        payload = encode_batch(ts, events, self.config.data_parallel_rank)
        seq = self._seq
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._last_send = time.monotonic()
        self._buffer.append((seq, payload))
        self._seq = seq + 1
        counts = self._counts
        counts["batches"] += 1
        counts["events"] += len(events)
        counts["bytes"] += len(payload)

    def _snapshot_events(self) -> list[Event]:
        """``AllBlocksCleared`` and every source's events now."""
        self._counts["snapshots"] += 1
        with self._lock:
            sources = list(self._sources)
        events: list[Event] = [AllBlocksCleared()]
        for source in sources:
            try:
                events.extend(source())
            except Exception:
                log.exception("KV events: a snapshot source failed")
        return events

    def _serve_replay(self) -> None:
        """Answer one replay request (vLLM's protocol, plus the snapshot for old ones)."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: invalid replay request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        buffered = list(self._buffer)
        self._counts["replays"] += 1
        if buffered and start < buffered[0][0] and buffered[0][0] != self.first_seq:
            # One batch, however large: it has one sequence number (just before the
            # buffer), and a subscriber drops a second batch of the same number as
            # stale, so chunks past the first were lost (every block past the 512th).
            label = (buffered[0][0] - 1).to_bytes(8, "big")
            events = self._snapshot_events()
            payload = encode_batch(time.time(), events, self.config.data_parallel_rank)
            self._replay.send_multipart((client, b"", self._topic, label, payload))
        for seq, payload in buffered:
            if seq >= start:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
