"""Removals: deletes, copies dropped from this machine's tiers, copies a tier lost.

:class:`RemovalBooks` is the ledger :class:`~kvstore.datapath.books.Books` keeps as
``books.removals``. Each removal is two steps around the tier calls, which run with
the lock released: ``begin_*`` (or :meth:`RemovalBooks.lose_copy`) takes the copies off
the books under the lock (the books' :class:`~kvstore.datapath.guard.Guard`, handed to
it) and returns what the tiers must delete; the caller deletes them, then
:meth:`RemovalBooks.end_delete` or :meth:`RemovalBooks.end_drop` gives their room back.
A block is deleted only once no pin but the deleter's is left on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.datapath.counters import ManagerCounters
from kvstore.datapath.guard import Guard
from kvstore.datapath.index import DELETING, Entry, Index
from kvstore.datapath.room import Victims
from kvstore.keys import BlockKey

__all__ = ["RemovalBooks"]


class RemovalBooks:
    """Copies taken off the books and given back as room (see the module docstring).

    ``pins(entry, allowed)``: the lease ledger's wait, run with the lock held, until
    ``entry`` has no more than ``allowed`` pins
    (:meth:`~kvstore.datapath.leases.LeaseBooks.wait_pins_locked`).
    """

    def __init__(
        self,
        guard: Guard,
        index: Index,
        counters: ManagerCounters,
        pins: Callable[[Entry | None, int], None],
    ) -> None:
        self._guard = guard
        self._index = index
        self._levels = index.levels
        self._counters = counters
        self._pins = pins

    def begin_delete(self, keys: Sequence[BlockKey]) -> tuple[Victims, dict[int, Victims]]:
        """Mark readable ``keys`` deleted, wait for their readers, take every copy off
        the books. Returns the targets and, per tier, the copies to delete."""
        with self._guard.locked():
            self._guard.check_open()
            targets: Victims = []
            for key in dict.fromkeys(keys):
                entry = self._index.ready(key)
                if entry is not None:
                    self._index.set_state(entry, DELETING)
                    targets.append((key, entry))
            for _, entry in targets:
                self._pins(entry, 0)
            groups: dict[int, Victims] = {}
            for key, entry in targets:
                for lv in self._levels:
                    if self._index.begin_drop(lv, key, entry):
                        groups.setdefault(lv.index, []).append((key, entry))
            return targets, groups

    def begin_drop_local(self, keys: Sequence[BlockKey]) -> tuple[Victims, dict[int, Victims]]:
        """Take the copies in this machine's tiers of readable, unpinned ``keys`` off
        the books; copies in shared remote tiers (S3) stay. Returns the keys left with
        no copy at all (forgotten) and, per tier, the copies to delete; the caller
        deletes them from the tiers, then calls :meth:`end_drop` for each tier."""
        with self._guard.locked():
            self._guard.check_open()
            gone: Victims = []
            groups: dict[int, Victims] = {}
            for key in dict.fromkeys(keys):
                entry = self._index.ready(key)
                if entry is None or entry.pins:  # being read: its copies stay for now
                    continue
                for lv in self._levels:
                    if lv.bit & self._index.local and self._index.begin_drop(lv, key, entry):
                        groups.setdefault(lv.index, []).append((key, entry))
                if not entry.tiers:
                    self._index.set_state(entry, DELETING)
                    self._index.remove(key, entry)
                    gone.append((key, entry))
            return gone, groups

    def end_delete(self, targets: Victims, groups: dict[int, Victims]) -> int:
        """The tiers deleted the copies: give their room back, forget the keys."""
        with self._guard.locked():
            for level, dropped in groups.items():
                self._index.end_drop(self._levels[level], [k for k, _ in dropped])
            for key, entry in targets:
                self._index.remove(key, entry)
            self._counters.blocks_deleted += len(targets)
            self._guard.notify()
            return len(targets)

    def lose_copy(self, level: int, key: BlockKey, entry: Entry) -> bool:
        """A tier failed to produce ``key``: forget that copy (and the block if it was
        the last); False if the books had no such copy. The caller deletes it from
        the tier, then calls :meth:`end_drop`."""
        with self._guard.locked():
            if not self._index.begin_drop(self._levels[level], key, entry):
                return False
            self._counters.copies_lost += 1
            if not entry.tiers:
                self._index.set_state(entry, DELETING)
                self._index.remove(key, entry)
            return True

    def end_drop(self, level: int, keys: Sequence[BlockKey]) -> None:
        """The tier deleted these copies: give their room back."""
        with self._guard.locked():
            self._index.end_drop(self._levels[level], keys)
            self._guard.notify()
