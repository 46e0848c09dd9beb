"""Thread-pool calls that still work while the interpreter exits.

``concurrent.futures`` refuses new work once the interpreter starts to exit, before
``atexit`` handlers run. A store closed from such a handler (its own exit hook, or a
user's ``atexit.register(store.close)``) must still flush memory to disk, so the
tiers' batch calls fall back to running their items one after another in the caller's
thread then: slower, never lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["map_or_inline", "call_or_inline"]

T = TypeVar("T")
R = TypeVar("R")


def _exiting(exc: RuntimeError) -> bool:
    # Once the interpreter exits, the main thread counts as stopped (before any atexit
    # handler runs); a pool whose workers already quit then says "after shutdown", one
    # that never started any "after interpreter shutdown". Earlier, while the exit hook
    # of concurrent.futures joins the pools' workers (the main thread still alive), each
    # worker it woke has marked its own pool shut down: a thread still working (a flush
    # job writing to a disk tier) hears "after shutdown" from a pool nobody closed. A
    # fresh pool tells that apart from a pool its owner shut down: it refuses too.
    if not threading.main_thread().is_alive() or "interpreter shutdown" in str(exc):
        return True
    probe = ThreadPoolExecutor(1, thread_name_prefix="kvstore-exit-probe")
    try:
        probe.submit(int).result()
    except RuntimeError:
        return True
    finally:
        probe.shutdown(wait=False)
    return False


def map_or_inline(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``list(pool.map(fn, items))``, or the calls in this thread while the interpreter
    exits."""
    futures: list[Future[R]] = []
    for i, item in enumerate(items):
        try:
            futures.append(pool.submit(fn, item))
        except RuntimeError as exc:
            if not _exiting(exc):
                raise
            return [f.result() for f in futures] + [fn(x) for x in items[i:]]
    return [f.result() for f in futures]


def call_or_inline(pool: Executor, fn: Callable[[], R]) -> R:
    """``pool.submit(fn).result()``, or the call in this thread while the interpreter
    exits."""
    try:
        future = pool.submit(fn)
    except RuntimeError as exc:
        if not _exiting(exc):
            raise
        return fn()
    return future.result()
