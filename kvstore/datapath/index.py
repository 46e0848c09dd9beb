"""The books' plain data: index entries, per-tier levels, heat, moves, the change feed.

Nothing here locks or does I/O: every object is read and written under the one
lock of :class:`~kvstore.datapath.books.Books`, which is their only user. :class:`Index`
is the one place an entry's state or tier bits change, so what follows from a
change -- the change feed, the write-back books of memory tiers in front of a
disk, the count of blocks only memory holds -- is kept in step in one place.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.datapath.contracts import ChangeFeed, Medium
from kvstore.keys import BlockKey
from kvstore.policy import EvictionPolicy, Watermarks

__all__ = [
    "DELETING",
    "READY",
    "WRITING",
    "Entry",
    "HeatClock",
    "Index",
    "Level",
    "Move",
    "lowest_bit",
]

WRITING, READY, DELETING = 0, 1, 2
HEAT_CAP = 255  # small ints are shared objects in CPython: heat costs no memory per entry


def lowest_bit(bits: int) -> int:
    """Index of the lowest set bit of ``bits`` (the fastest tier of a mask); -1 for 0."""
    return (bits & -bits).bit_length() - 1


class Entry:
    """Index entry of one key.

    ``tiers``: bit i set while tier i holds a copy. ``heat`` and ``epoch``:
    the decayed access count (see :class:`HeatClock`). Five slots and no
    objects of its own (the ints are shared small ones): an entry costs 72
    bytes, which keeps the whole index within 256 bytes a block.
    """

    __slots__ = ("epoch", "heat", "pins", "state", "tiers")

    def __init__(self, state: int, pins: int = 0) -> None:
        self.state = state
        self.pins = pins
        self.tiers = 0
        self.heat = 0
        self.epoch = 0


class HeatClock:
    """Decay of access counts: heat halves every ``half_life_s`` seconds and
    every ``half_life_accesses`` accesses (store-wide).

    The second clock makes heat relative to the traffic: at a few hundred
    requests a second a wall-clock half-life alone would let every block read
    a few times count as hot for minutes, and "hot last" would override the
    eviction policy. Heat is kept as a small int plus the epoch it was last
    updated in, so an entry costs two references to shared int objects
    rather than two floats.
    """

    def __init__(
        self,
        half_life_s: float,
        half_life_accesses: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.half_life_s = half_life_s
        self.half_life_accesses = max(1, half_life_accesses)
        self.clock = clock
        self._start = clock()
        self._accesses = 0
        self._epoch = 0

    def now(self) -> int:
        """The current epoch (the same int object while it does not change)."""
        wall = int((self.clock() - self._start) / self.half_life_s)
        epoch = wall + self._accesses // self.half_life_accesses
        if epoch != self._epoch:
            self._epoch = epoch
        return self._epoch

    def heat(self, entry: Entry) -> int:
        """``entry``'s heat decayed to now (without updating it)."""
        elapsed = self.now() - entry.epoch
        return entry.heat >> elapsed if elapsed < 64 else 0

    def touch(self, entry: Entry) -> int:
        """Count one access; return the new heat."""
        self._accesses += 1
        heat = min(HEAT_CAP, self.heat(entry) + 1)
        entry.heat, entry.epoch = heat, self._epoch
        return heat


@dataclass
class Level:
    """The books of one tier: its room, eviction order and write-back state."""

    index: int
    kind: str
    marks: Watermarks
    policy: EvictionPolicy
    # Copies held plus room reserved for writes in flight. A copy being evicted
    # counts until its slot is really free (so no put is granted room that a
    # medium has not freed yet); ``leaving`` says how many of them are on their
    # way out. ``len(policy)`` is the exact count held.
    resident: int = 0
    leaving: int = 0
    #: Write-back ahead of eviction (a memory tier in front of a local disk): past
    #: the low watermark's worth of ``dirty`` blocks, the least recently used are
    #: copied down in the background (see :mod:`kvstore.datapath.migrations`).
    writes_back_ahead: bool = False
    #: Blocks only this tier holds (no copy below), least recently used first.
    dirty: OrderedDict[BlockKey, None] = field(default_factory=OrderedDict)
    #: Blocks held here that were copied down from here (by the write-back, a flush):
    #: primary copies with a copy below, unlike replicas; evicted in the policy's order.
    written_back: set[BlockKey] = field(default_factory=set)

    @property
    def bit(self) -> int:
        """This tier's bit in :attr:`Entry.tiers`."""
        return 1 << self.index

    @property
    def below(self) -> int:
        """The bits of every tier after this one."""
        return ~((self.bit << 1) - 1)


@dataclass
class Move:
    """A block on its way into a tier: its key, entry and source tensor."""

    key: BlockKey
    entry: Entry
    src: torch.Tensor


class Index:
    """Key -> :class:`Entry`, and every change of an entry's state or copies.

    ``persistent`` and ``local``: the bits of the tiers that outlive the
    process, and of the tiers of this machine. ``unpersisted`` counts the
    readable blocks no persistent tier holds (what a flush must write),
    kept up to date at each change rather than counted by a scan.
    """

    def __init__(self, levels: Sequence[Level], persistent: int, local: int) -> None:
        self.levels = list(levels)
        self.persistent = persistent
        self.local = local
        #: Tier masks of each :class:`Medium` (nearest first), for the change feed.
        self.media = (
            (local & ~persistent, Medium.MEMORY),
            (local & persistent, Medium.DISK),
            (persistent & ~local, Medium.SHARED),
        )
        #: The tiers of other machines that outlive the process (S3): a copy there is
        #: what every node can read (feeds made with ``shared_copies`` record it).
        self.shared = persistent & ~local
        self.entries: dict[BlockKey, Entry] = {}
        #: Key -> bits of the tiers a delete of it is in flight from: nothing may write
        #: the key there until the tier has deleted it (kept apart: it is rarely set).
        self.dropping: dict[BlockKey, int] = {}
        self.unpersisted = 0
        #: one feed per watcher (a cluster node, an event publisher): each drains its own
        self.changes: list[ChangeFeed] = []
        self._write_back = [lv for lv in self.levels if lv.writes_back_ahead]

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: BlockKey) -> Entry | None:
        """The entry of ``key``, in any state."""
        return self.entries.get(key)

    def ready(self, key: BlockKey) -> Entry | None:
        """The entry of ``key`` if it is readable."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.state == READY else None

    def leading(self, keys: Sequence[BlockKey], mask: int = -1) -> int:
        """Leading ``keys`` readable (with a copy in a tier of ``mask``)."""
        n = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or entry.state != READY or not entry.tiers & mask:
                break
            n += 1
        return n

    def items(self) -> Iterator[tuple[BlockKey, Entry]]:
        """Every (key, entry), in any state."""
        return iter(self.entries.items())

    def add(self, key: BlockKey, state: int, pins: int = 0) -> Entry:
        """A new entry for ``key`` (which has none)."""
        entry = self.entries[key] = Entry(state, pins)
        return entry

    def remove(self, key: BlockKey, entry: Entry) -> bool:
        """Forget ``key`` if ``entry`` is still its entry; True if it was."""
        if self.entries.get(key) is not entry:
            return False
        self._count(entry, -1)
        del self.entries[key]
        return True

    def set_state(self, entry: Entry, state: int) -> None:
        """Change ``entry``'s state."""
        self._count(entry, -1)
        entry.state = state
        self._count(entry, 1)

    def note_copy(self, key: BlockKey, entry: Entry, bit: int) -> None:
        """Record a new copy of ``key`` in the tier of ``bit``."""
        self._set_tiers(key, entry, entry.tiers | bit)

    def begin_drop(self, level: Level, key: BlockKey, entry: Entry) -> bool:
        """Take ``level``'s copy of ``key`` off the books; False if it had none.

        The copy's room still counts in ``level.resident``, and nothing may
        write ``key`` into ``level`` (:attr:`dropping`), until :meth:`end_drop`
        -- after the tier has really deleted it -- so no put is granted room
        the medium has not freed, and no promotion lands a copy that the
        delete then removes.
        """
        if not entry.tiers & level.bit:
            return False
        self._set_tiers(key, entry, entry.tiers & ~level.bit)
        self.dropping[key] = self.dropping.get(key, 0) | level.bit
        level.policy.remove(key)
        return True

    def end_drop(self, level: Level, keys: Sequence[BlockKey]) -> None:
        """The tier deleted these copies: give their room back."""
        for key in keys:
            left = self.dropping.pop(key, 0) & ~level.bit
            if left:
                self.dropping[key] = left
        level.resident -= len(keys)

    def _set_tiers(self, key: BlockKey, entry: Entry, tiers: int) -> None:
        before = entry.tiers
        if self.changes:
            was, now = self.medium(before), self.medium(tiers)
            copies = (bool(before & self.shared), bool(tiers & self.shared))
            if was != now or copies[0] != copies[1]:
                for feed in self.changes:
                    feed.record(key, was, now, copies)
        self._count(entry, -1)
        entry.tiers = tiers
        self._count(entry, 1)
        for level in self._write_back:
            _track_dirty(level, key, before, tiers)

    def medium(self, tiers: int) -> Medium:
        """The nearest :class:`Medium` among the tiers of ``tiers``."""
        return next((m for mask, m in self.media if tiers & mask), Medium.NONE)

    def _count(self, entry: Entry, sign: int) -> None:
        if entry.state == READY and entry.tiers and not entry.tiers & self.persistent:
            self.unpersisted += sign

    def touch(self, key: BlockKey, entry: Entry) -> None:
        """Tell every policy holding ``key`` that it was used (the heat is the caller's)."""
        for level in self.levels:
            if entry.tiers & level.bit:
                level.policy.touch(key)
        for level in self._write_back:  # written back least recently used first
            if key in level.dirty:
                level.dirty.move_to_end(key)


def _track_dirty(level: Level, key: BlockKey, before: int, after: int) -> None:
    """Keep ``level``'s write-back books as ``key``'s copies change from ``before``
    to ``after`` (bitmasks)."""
    below = level.below
    was_dirty = bool(before & level.bit) and not before & below
    is_dirty = bool(after & level.bit) and not after & below
    if not after & level.bit:  # gone from this tier
        level.dirty.pop(key, None)
        level.written_back.discard(key)
    elif is_dirty and not was_dirty:  # landed here alone, or lost its copy below
        level.dirty[key] = None
        level.written_back.discard(key)
    elif was_dirty and not is_dirty:  # copied down from here
        del level.dirty[key]
        level.written_back.add(key)
