"""``StoreEvents``: a store's block changes, published as KV events.

One thread drains the store's change feed (``manager.watch()``) every
``events.interval_s`` and publishes what changed as one batch:

- a key whose nearest copy left a medium -> ``BlockRemoved`` at that medium;
- a key whose nearest copy is now in a medium -> ``BlockStored`` there, with
  the tokens the :class:`~kvstore.events.book.TokenBook` holds for it (keys
  without recorded tokens wait up to ``_WAIT_S`` for them, then are counted in
  ``skipped_without_tokens``);

so a demotion (host -> disk) is a store at the lower medium and a removal at
the upper. Removals come first in a batch and stores parent-first: a consumer
that does not keep media apart then still holds a demoted block, and one that
drops a block whose parent it does not know sees parents first.

:meth:`StoreEvents.start` announces everything the store holds already (e.g.
what a restarted disk tier kept, with tokens from the book's journal) and
registers :meth:`StoreEvents.snapshot` with the publisher for late subscribers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from typing import Protocol

from kvstore.config import EventsConfig
from kvstore.datapath.contracts import ChangeFeed, DataPath, EngineSide, Medium
from kvstore.errors import ClosedError, ConfigError
from kvstore.events.blocks import BlockMapper, parent_first
from kvstore.events.book import TokenBook
from kvstore.events.format import BlockStored, Event
from kvstore.events.publisher import SNAPSHOT_BATCH_EVENTS, EventPublisher
from kvstore.keys import BlockKey


class HasEngine(Protocol):
    """A store (``KVStore``): what :class:`StoreEvents` needs of it is its engine side's
    data path."""

    @property
    def engine(self) -> EngineSide: ...


__all__ = ["StoreEvents"]

log = logging.getLogger(__name__)

#: Seconds a key stored without recorded tokens waits for them before it is skipped.
_WAIT_S = 1.0
#: How often the token book drops the tokens of chunks the store does not hold (noted for
#: puts that never stored them: no room, a client gone mid-put), sparing those noted in
#: the last ``_TOKENS_GRACE_S`` (a put on its way: RESERVE to COMMIT may take that long).
_TRIM_S = 60.0
_TOKENS_GRACE_S = 120.0


class StoreEvents:
    """Publishes the block changes of ``store`` (a ``KVStore`` or its data path).

    ``book``: the tokens of stored keys (its ``block_tokens`` must be the layout's).
    ``publisher``: where batches go (may be shared by several stores; not closed
    here). ``config``: the ``events:`` section (default: ``publisher.config``).
    Raises :class:`~kvstore.errors.ConfigError` unless ``config.block_size``
    divides the layout's ``block_tokens``.
    """

    def __init__(
        self,
        store: HasEngine | DataPath,
        book: TokenBook,
        publisher: EventPublisher,
        config: EventsConfig | None = None,
    ) -> None:
        manager: DataPath = store.engine.datapath if hasattr(store, "engine") else store
        self.config = publisher.config if config is None else config
        block_tokens = manager.layout.block_tokens
        if book.block_tokens != block_tokens:
            raise ConfigError(
                f"events: the token book has {book.block_tokens}-token chunks, "
                f"the store's layout {block_tokens}"
            )
        self.mapper = BlockMapper(block_tokens, self.config)
        self.book = book
        self.publisher = publisher
        self._manager = manager
        self._feed: ChangeFeed | None = None
        self._waiting: dict[BlockKey, tuple[Medium, float]] = {}
        # Keys removed from every tier, their tokens forgotten only once they stay gone
        # until the deadline (see _forget_later).
        self._forgetting: dict[BlockKey, float] = {}
        self._next_trim = 0.0  # the first flush trims
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counts = {
            "batches": 0,
            "events_published": 0,
            "stored_events": 0,
            "removed_events": 0,
            "skipped_without_tokens": 0,
        }

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> StoreEvents:
        """Watch the store, start the publisher (if not yet), announce what the store
        holds, and start publishing its changes every ``interval_s``; idempotent.

        The book is first trimmed to the keys the store holds (stale journal entries)."""
        with self._lock:
            if self._thread is not None:
                return self
            self._feed = self._manager.watch()
            self.book.retain(self._manager.stored_keys())
            self.publisher.add_source(self.snapshot)
            self.publisher.start()
            held = self.snapshot()
            for i in range(0, len(held), SNAPSHOT_BATCH_EVENTS):
                self._publish(held[i : i + SNAPSHOT_BATCH_EVENTS])
            self._thread = threading.Thread(
                target=self._run, name="kvstore-store-events", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Publish the last changes, stop the thread and the feed; the publisher stays open."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        with contextlib.suppress(ClosedError):  # the store closed first
            self.flush()
        self.publisher.remove_source(self.snapshot)
        feed, self._feed = self._feed, None
        if feed is not None:
            self._manager.unwatch(feed)

    def __enter__(self) -> StoreEvents:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.flush()
            except ClosedError:
                return
            except Exception:
                log.exception("KV events: publishing the store's changes failed")

    # -- what the owner calls ----------------------------------------------------------
    def flush(self) -> int:
        """Publish the changes since the last flush now (the thread does this every
        ``interval_s``); returns the number of events published."""
        with self._lock:
            if self._feed is None:
                return 0
            events = self._changes(self._feed.drain(), time.monotonic())
        if events:
            self._publish(events)
        return len(events)

    def cleared(self) -> None:
        """Call after ``store.clear()``: publishes ``AllBlocksCleared`` followed by what
        the publisher's stores still hold (nothing, for a publisher of one store)."""
        with self._lock:
            if self._feed is not None:
                self._feed.drain()  # the snapshot states where every key is now
            self._waiting.clear()
            self._forgetting.clear()
        self.book.retain(self._manager.stored_keys())
        self.publisher.publish_snapshot()

    def snapshot(self) -> list[Event]:
        """``BlockStored`` for every block the store holds whose tokens are known,
        parent first, at the medium of its nearest copy (the publisher's snapshot source)."""
        media = dict(self._manager.stored_media())
        keys = parent_first([k for k in media if k in self.book], self.book.parent)
        events: list[Event] = []
        for key in keys:
            entry = self.book.get(key)
            if entry is not None:
                events.append(self.mapper.stored(key, entry[0], entry[1], media[key]))
        return events

    def stats(self) -> dict[str, int]:
        """Events and batches this store published, stores and removals among them, keys
        skipped for want of tokens, keys waiting for tokens, and the (shared) publisher's
        ``bytes`` and ``next_seq``."""
        published = self.publisher.stats()
        return {
            **self._counts,
            "waiting_for_tokens": len(self._waiting),
            "bytes": published["bytes"],
            "next_seq": published["next_seq"],
        }

    # -- turning changes into events -------------------------------------------------------
    def _publish(self, events: list[Event]) -> None:
        self.publisher.publish(events)
        counts = self._counts
        counts["batches"] += 1
        counts["events_published"] += len(events)
        stores = sum(isinstance(e, BlockStored) for e in events)
        counts["stored_events"] += stores
        counts["removed_events"] += len(events) - stores

    def _changes(self, changes: dict[BlockKey, tuple[Medium, Medium]], now: float) -> list[Event]:
        """The events of one drain (under the lock): removals first, then stores."""
        removed: dict[Medium, list[BlockKey]] = defaultdict(list)
        stored: dict[BlockKey, Medium] = {}
        gone: list[BlockKey] = []
        for key, (before, after) in changes.items():
            self._waiting.pop(key, None)
            if before != Medium.NONE and key in self.book:
                removed[before].append(key)
            if after != Medium.NONE:
                stored[key] = after
            else:
                gone.append(key)
        for key, (medium, deadline) in list(self._waiting.items()):
            if key in self.book:
                stored[key] = medium
                del self._waiting[key]
            elif now > deadline:
                del self._waiting[key]
                self._counts["skipped_without_tokens"] += 1
        events: list[Event] = [self.mapper.removed(keys, m) for m, keys in removed.items()]
        events.extend(self._stored_events(stored, now))
        self._forget_later(gone, stored, now)
        if now >= self._next_trim:  # tokens of chunks never stored: the book would grow
            self._next_trim = now + _TRIM_S
            self.book.retain(self._manager.stored_keys(), grace_s=_TOKENS_GRACE_S)
        return events

    def _forget_later(
        self, gone: list[BlockKey], stored: dict[BlockKey, Medium], now: float
    ) -> None:
        """Forget the tokens of keys removed from every tier, once they have stayed gone
        for ``_WAIT_S``. Not at once: a client puts a chunk again by recording its tokens
        first, then storing it, and a drain that saw its earlier removal between the two
        forgot the tokens just recorded, so the stored chunk was never announced (and,
        after a restart, announced by no one: the convergence test's missed blocks)."""
        for key in stored:
            self._forgetting.pop(key, None)
        for key in gone:
            self._forgetting[key] = now + _WAIT_S
        due = [k for k, deadline in self._forgetting.items() if now >= deadline]
        if not due:
            return
        for key in due:
            del self._forgetting[key]
        self.book.forget([k for k in due if not self._manager.contains(k)])

    def _stored_events(self, stored: dict[BlockKey, Medium], now: float) -> list[Event]:
        """``BlockStored`` of ``stored`` parent-first; keys without tokens start waiting."""
        events: list[Event] = []
        for key in parent_first(list(stored), self.book.parent):
            entry = self.book.get(key)
            if entry is None:
                self._waiting[key] = (stored[key], now + _WAIT_S)
                continue
            events.append(self.mapper.stored(key, entry[0], entry[1], stored[key]))
        return events
