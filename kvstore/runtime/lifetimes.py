"""Stores still open when the interpreter exits are closed then, so nothing that only
memory held is lost: a script that forgets ``close()`` (or ``with``) still finds its
blocks on disk in the next process, as python-diskcache's users expect.

The set is weak: a store that is garbage collected is not kept alive by it. ``_lock``
(module-level) guards the set and the one-time registration.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

__all__ = ["close_at_exit", "forget"]

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` when the interpreter exits, unless :func:`forget` came first."""
    global _registered
    with _lock:
        _open.add(obj)
        if not _registered:
            atexit.register(_close_all)
            _registered = True


def forget(obj: Closable) -> None:
    """``obj`` was closed: nothing to do for it at exit."""
    with _lock:
        _open.discard(obj)


def _close_all() -> None:
    with _lock:
        left = list(_open)
    for obj in left:
        try:
            obj.close()
        except Exception:  # one store's failure must not keep the others from flushing
            log.exception("closing %r at exit failed", obj)
