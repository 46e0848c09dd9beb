"""Background moves between tiers.

Write-through copies, promotions on hit, hot-block replication and eviction
down to the low watermark run here, on a few threads, off the caller's path.
A job is a callable; jobs with the same key run once at a time (a second
submission while one is queued is dropped), so a hot block read a thousand
times is promoted once. ``drain`` waits until every queued job finished
(``flush`` and ``close`` use it).

A job may wait for its time (``submit_later``): work that would compete with the
engine, such as a restore plan's warming, waits until the compute the plan expects
has ended. Its ``not_before`` is asked again when that time comes (a later plan may
have moved it); ``drain`` starts every waiting job at once, and any job queued to wait
while it drains.

Lock ownership: ``_cond`` guards ``_pending``, ``_keys``, ``_waiting``, ``_draining``
and ``_timer``; jobs run without it. The timer thread only moves due jobs to the pool.
"""

from __future__ import annotations

import logging
import threading
import time
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
        self._waiting: list[tuple[Callable[[], object], Hashable | None, Callable[[], float]]] = []
        self._timer: threading.Thread | None = None
        self._draining = 0  # drains in progress: a job queued to wait starts at once
        self._name = name
        self.failures = 0

    def submit(self, job: Callable[[], object], key: Hashable | None = None) -> bool:
        """Queue ``job``; False if closed or a job with ``key`` is already queued."""
        with self._cond:
            if not self._claim(key):
                return False
        self._start(job, key)
        return True

    def _claim(self, key: Hashable | None) -> bool:
        """Under ``_cond``: count a new job in; False if closed or ``key`` is queued."""
        if self._closed or (key is not None and key in self._keys):
            return False
        if key is not None:
            self._keys.add(key)
        self._pending += 1
        return True

    def _start(self, job: Callable[[], object], key: Hashable | None) -> None:
        """Hand a queued job to the pool; where the pool refuses it (the interpreter is
        exiting: its thread pools are shut down before ``atexit`` handlers, such as the
        flush of a store left open, run), run it in this thread: dropped, it would stay
        counted as pending and the flush's ``drain`` would wait forever."""
        try:
            self._pool.submit(self._run, job, key)
        except RuntimeError:
            self._run(job, key)

    def submit_later(
        self,
        job: Callable[[], object],
        not_before: Callable[[], float],
        key: Hashable | None = None,
    ) -> bool:
        """Queue ``job`` to start once ``time.monotonic()`` reaches ``not_before()``
        (asked again then: it may have moved); False as :meth:`submit`."""
        with self._cond:
            if not self._claim(key):
                return False
            now = self._draining > 0  # a drain waits for it: it cannot wait for its time
            if not now:
                self._waiting.append((job, key, not_before))
                if self._timer is None:
                    self._timer = threading.Thread(
                        target=self._wait_loop, name=f"{self._name}-timer", daemon=True
                    )
                    self._timer.start()
                self._cond.notify_all()
        if now:
            self._start(job, key)
        return True

    def _wait_loop(self) -> None:
        """Hand each waiting job to the pool when its time comes; ends when none waits."""
        while True:
            with self._cond:
                if not self._waiting:
                    self._timer = None
                    return
                now = time.monotonic()
                due = [w for w in self._waiting if w[2]() <= now]
                for item in due:
                    self._waiting.remove(item)
                if not due:
                    wake = min(w[2]() for w in self._waiting)
                    self._cond.wait(max(0.001, wake - now))
            for job, key, _ in due:  # outside the lock: a job may run in this thread
                self._start(job, key)

    def _release_waiting(self) -> None:
        """Start every waiting job now (a drain, a close)."""
        with self._cond:
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for job, key, _ in waiting:  # outside the lock: a job may run in this thread
            self._start(job, key)

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
        """Start the jobs waiting for their time, then wait until no job is queued or
        running; False on timeout."""
        with self._cond:
            self._draining += 1
        try:
            self._release_waiting()
            with self._cond:
                return self._cond.wait_for(lambda: self._pending == 0, timeout)
        finally:
            with self._cond:
                self._draining -= 1

    def close(self) -> None:
        """Stop taking jobs, finish the queued ones, stop the threads. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.drain()
        self._pool.shutdown(wait=True)
