"""Discovery: copies other processes wrote, or freed, recorded in the books.

A shared tier (a disk another engine process writes, S3) may gain or lose blocks the
books never saw change. The :class:`~kvstore.datapath.finder.Finder` asks the tiers with
the lock released and records their answers here: :class:`DiscoveryBooks` is the ledger
:class:`~kvstore.datapath.books.Books` keeps as ``books.discovery``, whose methods take
the books' lock (the :class:`~kvstore.datapath.guard.Guard` handed to it), change the
index and return.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.datapath.guard import Guard
from kvstore.datapath.index import READY, Entry, Index
from kvstore.keys import BlockKey

__all__ = ["DiscoveryBooks"]


class DiscoveryBooks:
    """Copies found in, or gone from, the shared tiers (see the module docstring)."""

    def __init__(self, guard: Guard, index: Index) -> None:
        self._guard = guard
        self._index = index
        self._levels = index.levels

    def adopt(self, found: Sequence[tuple[BlockKey, int]]) -> None:
        """Record copies found in tiers (``(key, bits)``): other processes wrote them."""
        with self._guard.locked():
            for key, bits in found:
                entry = self._index.get(key)
                if entry is None:
                    entry = self._index.add(key, READY)
                elif entry.state != READY:
                    continue
                for lv in self._levels:
                    if bits & lv.bit and not entry.tiers & lv.bit:
                        self._index.note_copy(key, entry, lv.bit)
                        lv.policy.insert(key)
                        lv.resident += 1

    def forget_gone(
        self, keys: Sequence[BlockKey], entries: Sequence[Entry], verdicts: dict[int, list[bool]]
    ) -> int | None:
        """Forget copies the shared tiers said they no longer hold (``verdicts[level][i]``);
        the position of the first block left with none, or None."""
        first_gone = None
        with self._guard.locked():
            for i, (key, entry) in enumerate(zip(keys, entries, strict=True)):
                for level, present in verdicts.items():
                    lv = self._levels[level]
                    gone = entry.tiers & lv.bit and not present[i]
                    if gone and self._index.begin_drop(lv, key, entry):
                        self._index.end_drop(lv, [key])  # the other process freed it
                if not entry.tiers:
                    first_gone = i if first_gone is None else first_gone
                    if entry.state == READY and entry.pins == 0:
                        self._index.remove(key, entry)
            self._guard.notify()
        return first_gone
