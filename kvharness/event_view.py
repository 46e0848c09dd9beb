"""A KV-event subscriber's view, and what the stores really hold, to compare them.

:class:`EventView` is what a router learns from a publisher's KV events alone
(docs/events.md): a SUB socket on ``events.endpoint``, gaps in the sequence
filled from the ROUTER replay socket, ``AllBlocksCleared`` honoured. Its
:meth:`EventView.restart` forgets everything and subscribes again, as a
restarted router does: it asks the replay socket for every batch from 0, which
the publisher answers with its buffer, or a snapshot once the buffer wrapped.

:func:`held_media` reads the truth from the tiers themselves (``stored_keys``
of each), not from any index; :func:`compare` says where a view and the truth
differ: *phantom* blocks (announced, not held), *missed* ones (held, not
announced) and blocks announced at another medium than their nearest copy.

Lock ownership: ``_lock`` guards ``_view``, ``_last_seq`` and ``_counts``; the
receiving thread owns both sockets (created, used and closed by it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvstore.datapath.contracts import Medium
from kvstore.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockMapper,
    BlockRemoved,
    BlockStored,
    decode_batch,
    medium_of,
)
from kvstore.keys import BlockKey
from kvstore.tiers.base import Tier

__all__ = ["Differences", "EventView", "compare", "held_media"]

#: Milliseconds the receiving thread waits on its socket before checking for a stop.
_POLL_MS = 50


class EventView:
    """Block hash -> medium, built only from the events of one publisher."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        #: ``(user, password)`` for a publisher that checks tokens (ZMQ PLAIN).
        self.credentials = credentials
        self._lock = threading.Lock()
        self._view: dict[int | bytes, str] = {}
        self._last_seq: int | None = None
        self._counts = {"batches": 0, "replays": 0, "restarts": 0, "gaps_unfilled": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> EventView:
        """Subscribe; the view fills in the background. Idempotent."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="event-view", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop receiving (the view keeps what it has)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def restart(self) -> None:
        """Forget everything and subscribe again (a restarted router)."""
        self.close()
        with self._lock:
            self._view.clear()
            self._last_seq = None
            self._counts["restarts"] += 1
        self.start()

    def __enter__(self) -> EventView:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a test reads ---------------------------------------------------------------
    def view(self) -> dict[int | bytes, str]:
        """A copy of the view: block hash -> medium."""
        with self._lock:
            return dict(self._view)

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch applied (None: none yet)."""
        with self._lock:
            return self._last_seq

    def stats(self) -> dict[str, int]:
        """Batches applied, replays asked, restarts, gaps the replay could not fill."""
        with self._lock:
            return dict(self._counts)

    # -- the receiving thread --------------------------------------------------------------
    def _sign(self, sock: Any) -> None:
        if self.credentials is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, self.credentials[0].encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.credentials[1].encode())

    def _run(self) -> None:
        ctx: Any = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        self._sign(sub)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(_POLL_MS):
                    continue
                _topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                last = self.last_seq
                if last is None or seq > last + 1:
                    # the first batch seen, or a gap: everything from there (0: all of it)
                    self._replay(ctx, 0 if last is None else last + 1)
                self._apply(seq, payload)
        finally:
            sub.close(0)

    def _replay(self, ctx: Any, start: int) -> None:
        """Ask the replay socket for every batch from ``start`` and apply them."""
        if self.replay_endpoint is None:
            with self._lock:
                self._counts["gaps_unfilled"] += 1
            return
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 5000)  # a DEALER left with no peer blocks its send
        self._sign(sock)
        sock.connect(self.replay_endpoint)
        try:
            try:
                sock.send_multipart([b"", start.to_bytes(8, "big")])
            except zmq.Again:  # refused, or nobody there: the gap stays
                with self._lock:
                    self._counts["gaps_unfilled"] += 1
                return
            with self._lock:
                self._counts["replays"] += 1
            while sock.poll(5000):
                frames = sock.recv_multipart()
                if frames[2] == END_SEQ:
                    return
                self._apply(int.from_bytes(frames[2], "big"), frames[3])
            with self._lock:  # no end marker: the publisher went away mid-replay
                self._counts["gaps_unfilled"] += 1
        finally:
            sock.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch unless it is not above the last one applied (stale)."""
        batch = decode_batch(payload)
        with self._lock:
            if self._last_seq is not None and seq <= self._last_seq:
                return
            self._last_seq = seq
            self._counts["batches"] += 1
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self._view.clear()
                elif isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        self._view[h] = event.medium or "GPU"
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        if self._view.get(h) == (event.medium or "GPU"):
                            del self._view[h]


def held_media(
    tiers: Sequence[tuple[Tier, Medium]], mapper: BlockMapper, announced: Iterable[BlockKey]
) -> dict[int | bytes, str]:
    """What the tiers hold (listed by each tier, in order: nearest first), as the view
    of a perfect subscriber: each sub-block hash of an ``announced`` key (one with known
    tokens) -> the event medium of its nearest copy."""
    wanted = set(announced)
    nearest: dict[BlockKey, Medium] = {}
    for tier, medium in tiers:
        for key in tier.stored_keys():
            if key in wanted:
                nearest.setdefault(key, medium)
    out: dict[int | bytes, str] = {}
    for key, medium in nearest.items():
        name = medium_of(medium)[0]
        for h in mapper.hashes(key):
            out[h] = name
    return out


@dataclass(frozen=True)
class Differences:
    """Where a view differs from the truth (sub-block hashes)."""

    phantom: tuple[int | bytes, ...]
    missed: tuple[int | bytes, ...]
    wrong_medium: tuple[int | bytes, ...]

    @property
    def none(self) -> bool:
        """The view equals the truth."""
        return not (self.phantom or self.missed or self.wrong_medium)

    def counts(self) -> dict[str, int]:
        """How many of each (what a soak reports)."""
        return {
            "phantom": len(self.phantom),
            "missed": len(self.missed),
            "wrong_medium": len(self.wrong_medium),
        }


def compare(view: dict[int | bytes, str], truth: dict[int | bytes, str]) -> Differences:
    """Phantom (in the view only), missed (in the truth only), and wrong-medium blocks."""
    return Differences(
        phantom=tuple(h for h in view if h not in truth),
        missed=tuple(h for h in truth if h not in view),
        wrong_medium=tuple(h for h in view if h in truth and view[h] != truth[h]),
    )
