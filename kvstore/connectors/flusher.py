"""The connectors' background flush: one thread that persists the store whenever asked
(``flush: background`` in the connector settings), requests coalescing while one runs."""

from __future__ import annotations

import logging
import threading

from kvstore.connectors.settings import Counters
from kvstore.store import KVStore

__all__ = ["Flusher", "flush_counted"]

log = logging.getLogger(__name__)


def flush_counted(store: KVStore, counters: Counters, what: str) -> None:
    """``store.flush()``, timed and counted in ``counters`` (``flushed_blocks``,
    ``flush_seconds``); a failure is logged as ``what`` and counted (``flush_errors``),
    never raised: a failed flush must not stop the engine."""
    try:
        with counters.timed("flush_seconds"):
            counters.add("flushed_blocks", store.flush())
    except Exception:
        log.exception("kvstore: %s failed", what)
        counters.add("flush_errors")


class Flusher:
    """One background thread that flushes the store whenever asked (requests coalesce)."""

    def __init__(self, store: KVStore, counters: Counters) -> None:
        self._store = store
        self._counters = counters
        self._wanted = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvstore-flush", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for a flush soon."""
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping:
                return
            flush_counted(self._store, self._counters, "background flush")

    def stop(self) -> None:
        """Finish the flush in progress and end the thread."""
        self._stopping = True
        self._wanted.set()
        self._thread.join()
