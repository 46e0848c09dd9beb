"""What the books say, read under their lock and changing nothing.

:class:`QueryBooks` is the ledger :class:`~kvstore.datapath.books.Books` keeps as
``books.queries``: each method takes the books' lock (the
:class:`~kvstore.datapath.guard.Guard` the books own and hand to it), reads the index,
the levels or the heat, and returns plain values. It never changes an entry, so a
query may run at any time from any piece of the data path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.datapath.contracts import Medium
from kvstore.datapath.guard import Guard
from kvstore.datapath.index import READY, Entry, HeatClock, Index, lowest_bit
from kvstore.keys import BlockKey
from kvstore.placement import Placement

__all__ = ["QueryBooks"]


class QueryBooks:
    """Read-only questions to the books (see the module docstring)."""

    def __init__(self, guard: Guard, index: Index, placement: Placement, heat: HeatClock) -> None:
        self._guard = guard
        self._index = index
        self._levels = index.levels
        self._placement = placement
        self._heat = heat

    def leading(self, keys: Sequence[BlockKey], local: bool = False, without: int = 0) -> int:
        """Leading ``keys`` readable (from a tier of this machine, with ``local``; from a
        tier not in the bit mask ``without``)."""
        with self._guard.locked():
            self._guard.check_open()
            return self._index.leading(keys, (self._index.local if local else -1) & ~without)

    def readable(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` are readable."""
        with self._guard.locked():
            return [self._index.ready(k) is not None for k in keys]

    def where(self, key: BlockKey) -> list[int]:
        """Indexes of the tiers holding a copy of ``key`` (fastest first)."""
        with self._guard.locked():
            entry = self._index.ready(key)
            if entry is None:
                return []
            return [lv.index for lv in self._levels if entry.tiers & lv.bit]

    def heat_of(self, key: BlockKey) -> int:
        """The decayed access count of ``key`` (0 if not stored)."""
        with self._guard.locked():
            entry = self._index.get(key)
            return 0 if entry is None else self._heat.heat(entry)

    def ready_count(self) -> int:
        """Blocks readable now."""
        with self._guard.locked():
            return sum(1 for _, e in self._index.items() if e.state == READY)

    def stored_keys(self, local: bool = False) -> list[BlockKey]:
        """Readable keys (with a copy in a tier of this machine, with ``local``)."""
        mask = self._index.local if local else -1
        with self._guard.locked():
            return [k for k, e in self._index.items() if e.state == READY and e.tiers & mask]

    def stored_media(self) -> list[tuple[BlockKey, Medium]]:
        """Each readable key with a copy in a tier of this machine or a shared
        persistent one, and its nearest :class:`Medium` (what a cluster node publishes)."""
        with self._guard.locked():
            media = (
                (k, self._index.medium(e.tiers)) for k, e in self._index.items() if e.state == READY
            )
            return [(k, m) for k, m in media if m != Medium.NONE]

    def shared_keys(self) -> list[BlockKey]:
        """Each readable key with a copy in a shared persistent tier (S3)."""
        shared = self._index.shared
        with self._guard.locked():
            return [k for k, e in self._index.items() if e.state == READY and e.tiers & shared]

    def unpersisted(self) -> int:
        """Readable blocks no persistent tier holds (kept as a count, not scanned)."""
        with self._guard.locked():
            return max(0, self._index.unpersisted)

    def unpersisted_keys(self) -> list[BlockKey]:
        """The readable keys no persistent tier holds."""
        persistent = self._index.persistent
        with self._guard.locked():
            return [
                k
                for k, e in self._index.items()
                if e.state == READY and e.tiers and not e.tiers & persistent
            ]

    def persisted(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a copy in a persistent tier."""
        persistent = self._index.persistent
        with self._guard.locked():
            return [bool((e := self._index.get(k)) and e.tiers & persistent) for k in keys]

    def entries(self, keys: Sequence[BlockKey]) -> list[Entry | None]:
        """The entries of ``keys`` (None where absent)."""
        with self._guard.locked():
            return [self._index.get(k) for k in keys]

    def sources(
        self, entries: Sequence[Entry], pending: Sequence[int], tried: Sequence[int]
    ) -> dict[int, list[int]]:
        """Group the positions ``pending`` by the fastest tier holding the entry that
        ``tried[i]`` (a bitmask) has not been tried in; entries with no copy left out."""
        groups: dict[int, list[int]] = {}
        with self._guard.locked():
            for i in pending:
                untried = entries[i].tiers & ~tried[i]
                if untried:
                    groups.setdefault(lowest_bit(untried), []).append(i)
        return groups

    def tiers_of(self, entries: Sequence[Entry]) -> list[int]:
        """The bitmask of the tiers holding each entry."""
        with self._guard.locked():
            return [entry.tiers for entry in entries]

    def fastest(self, entries: Sequence[Entry]) -> list[int]:
        """The fastest tier holding each entry (-1: none)."""
        with self._guard.locked():
            return [lowest_bit(e.tiers) for e in entries]

    def promotions(
        self, keys: Sequence[BlockKey], entries: Sequence[Entry], promotable: Callable[[int], bool]
    ) -> list[tuple[BlockKey, int]]:
        """``(key, target tier)`` for blocks just read that the rules copy upwards.

        ``promotable(level)``: whether the manager may copy blocks of that tier up by
        itself (not another node's).
        """
        jobs = []
        persistent = self._index.persistent
        with self._guard.locked():
            for key, entry in zip(keys, entries, strict=True):
                if not entry.tiers or entry.state != READY:
                    continue
                fastest = lowest_bit(entry.tiers)
                if not promotable(fastest):
                    continue
                copies = bin(entry.tiers & ~persistent).count("1")
                target = self._placement.promotion_target(fastest, self._heat.heat(entry), copies)
                if target is not None:
                    jobs.append((key, target))
        return jobs
