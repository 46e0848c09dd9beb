"""The books' lock: a condition variable that knows which thread holds it.

Created by :class:`~kvstore.datapath.books.Books`, which owns it, and handed only to
the books' own ledgers (``books.pins``, ``leases``, ``queries``, ``removals``,
``discovery``, ``room``, ``partials``): nothing else in the data path takes it.
Knowing the holder lets TierIO and the tests check the rule that tier I/O never runs
under it (:meth:`Guard.held_by_me`). The store's lifecycle
(``closing``, ``closed``) is kept here too, read and written under the lock.
"""

from __future__ import annotations

import threading

from kvstore.errors import ClosedError

__all__ = ["Guard"]


class Guard:
    """One :class:`threading.Condition` over a plain lock, with its holder recorded."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        #: close() has begun: background write-back stops early.
        self.closing = False
        #: The store is closed: operations raise :class:`ClosedError`.
        self.closed = False

    def check_open(self) -> None:
        """Raise :class:`ClosedError` after close."""
        if self.closed:
            raise ClosedError("the store is closed")

    def locked(self) -> Guard:
        """Hold the lock for a ``with`` block: ``with guard.locked(): ...``."""
        return self

    def __enter__(self) -> None:
        self._cond.acquire()
        self._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._cond.release()

    def wait(self, timeout: float | None = None) -> None:
        """Wait to be notified (lock held; released while waiting)."""
        self._owner = None
        try:
            self._cond.wait(timeout)
        finally:
            self._owner = threading.get_ident()

    def notify(self) -> None:
        """Wake every waiter (lock held)."""
        self._cond.notify_all()

    def held_by_me(self) -> bool:
        """True while the calling thread holds the lock."""
        return self._owner == threading.get_ident()
