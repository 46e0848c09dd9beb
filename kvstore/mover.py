"""Background moves between tiers.

Write-through copies, promotions on hit, hot-block replication and eviction
down to the low watermark run here, on a few threads, off the caller's path.
A job is a callable; jobs with the same key run once at a time (a second
submission while one is queued is dropped), so a hot block read a thousand
times is promoted once. ``drain`` waits until every queued job finished
(``flush`` and ``close`` use it).

Lock ownership: ``_cond`` guards ``_pending`` and ``_keys`` only; jobs run
without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Mover"]

log = logging.getLogger(__name__)


class Mover:
    """Runs jobs on ``threads`` background threads."""

    def __init__(self, threads: int, name: str = "kvstore-mover") -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._cond = threading.Condition()
        self._pending = 0
        self._keys: set[Hashable] = set()
        self._closed = False
        self.failures = 0

    def submit(self, job: Callable[[], object], key: Hashable | None = None) -> bool:
        """Queue ``job``; False if closed or a job with ``key`` is already queued."""
        with self._cond:
            if self._closed or (key is not None and key in self._keys):
                return False
            if key is not None:
                self._keys.add(key)
            self._pending += 1
        self._pool.submit(self._run, job, key)
        return True

    def _run(self, job: Callable[[], object], key: Hashable | None) -> None:
        try:
            job()
        except Exception:  # a failed move is a missed optimisation, never an error to users
            log.exception("background move failed")
            with self._cond:
                self.failures += 1
        finally:
            with self._cond:
                self._pending -= 1
                if key is not None:
                    self._keys.discard(key)
                self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return self._pending

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Stop taking jobs, finish the queued ones, stop the threads. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.drain()
        self._pool.shutdown(wait=True)
