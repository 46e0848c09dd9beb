"""Pins: what keeps a block from being evicted or deleted while someone uses it.

:class:`PinBooks` is the ledger :class:`~kvstore.datapath.books.Books` keeps as
``books.pins``: its methods take the books' lock (the
:class:`~kvstore.datapath.guard.Guard` the books own and hand to it), pin or unpin index
entries, and return; the caller does its I/O with the lock released and unpins after.
A put's new entries are born pinned here too (:meth:`PinBooks.claim`), and unpinned
when it settles. The functions below are the same steps for a caller that holds the
lock already (the lease ledger, :class:`~kvstore.datapath.leases.LeaseBooks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.datapath.guard import Guard
from kvstore.datapath.index import READY, WRITING, Entry, HeatClock, Index
from kvstore.datapath.ledger import LedgerParts
from kvstore.keys import BlockKey

__all__ = ["PinBooks", "Want", "pin_leading_locked", "touch_locked", "unpin_locked"]

#: A pure test of an entry, run under the lock (:meth:`PinBooks.pin_where`).
Want = Callable[[Entry], bool]


def touch_locked(index: Index, heat: HeatClock, key: BlockKey, entry: Entry) -> None:
    """Count an access of ``key`` (its heat, its place in each tier's policy); lock held."""
    heat.touch(entry)
    index.touch(key, entry)


def pin_leading_locked(index: Index, heat: HeatClock, keys: Sequence[BlockKey]) -> list[Entry]:
    """Pin and touch the leading readable entries of ``keys``; lock held."""
    entries: list[Entry] = []
    for key in keys:
        entry = index.ready(key)
        if entry is None:
            break
        entry.pins += 1
        touch_locked(index, heat, key, entry)
        entries.append(entry)
    return entries


def unpin_locked(guard: Guard, entries: Sequence[Entry]) -> None:
    """Drop one pin of each entry and wake whoever waits for pins to end; lock held."""
    for entry in entries:
        entry.pins -= 1
    guard.notify()


class PinBooks:
    """Pins taken and dropped under the books' lock (see the module docstring).

    ``reap()``: the books' own, run with the lock held; it ends expired leases (their
    pins too) before :meth:`pinned_count` counts.
    """

    def __init__(self, parts: LedgerParts, reap: Callable[[], None]) -> None:
        self._guard = parts.guard
        self._index = parts.index
        self._heat = parts.heat
        self._counters = parts.counters
        self._reap = reap

    def pin_leading(self, keys: Sequence[BlockKey], get: bool = False) -> list[Entry]:
        """Pin (and touch) the leading readable entries of ``keys`` (``get``: count a get)."""
        with self._guard.locked():
            self._guard.check_open()
            self._counters.gets += get
            return pin_leading_locked(self._index, self._heat, keys)

    def repin_leading(self, entries: list[Entry], keys: Sequence[BlockKey]) -> list[Entry]:
        """Unpin ``entries`` and pin the leading readable ``keys`` again (after discovery)."""
        with self._guard.locked():
            unpin_locked(self._guard, entries)
            return pin_leading_locked(self._index, self._heat, keys)

    def pin_where(self, keys: Sequence[BlockKey], want: Want) -> list[tuple[BlockKey, Entry]]:
        """Pin the readable ``keys`` whose entry ``want`` accepts (a pure test of the
        entry, run under the lock); skipped while closed."""
        with self._guard.locked():
            if self._guard.closed:
                return []
            pinned = []
            for key in dict.fromkeys(keys):
                entry = self._index.ready(key)
                if entry is not None and want(entry):
                    entry.pins += 1
                    pinned.append((key, entry))
            return pinned

    def unpin(self, entries: Sequence[Entry]) -> None:
        """Drop one pin of each entry."""
        with self._guard.locked():
            unpin_locked(self._guard, entries)

    def pinned_count(self) -> int:
        """Blocks pinned now (after ending expired leases)."""
        with self._guard.locked():
            self._reap()
            return sum(1 for _, e in self._index.items() if e.pins)

    def claim(self, keys: Sequence[BlockKey]) -> tuple[list[tuple[BlockKey, Entry]], int]:
        """Entries (being written, pinned) for the new ``keys``, and how many were stored.

        Keys already stored are touched, not written again; a key being
        written by someone else, or deleted, is left to them.
        """
        with self._guard.locked():
            self._guard.check_open()
            self._counters.puts += 1
            fresh, present = [], 0
            for key in dict.fromkeys(keys):
                entry = self._index.get(key)
                if entry is None:
                    entry = self._index.add(key, WRITING, pins=1)
                    self._heat.touch(entry)
                    fresh.append((key, entry))
                elif entry.state == READY:
                    present += 1
                    touch_locked(self._index, self._heat, key, entry)
            self._counters.blocks_already_present += present
            return fresh, present

    def settle(self, entries: Sequence[Entry], unwritten: Sequence[tuple[BlockKey, Entry]]) -> None:
        """Unpin a put's new entries and forget those no tier took."""
        with self._guard.locked():
            unpin_locked(self._guard, entries)
            for key, entry in unwritten:
                if entry.state == WRITING:
                    self._index.remove(key, entry)
