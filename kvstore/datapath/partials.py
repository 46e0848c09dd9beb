"""The books of blocks being written layer by layer (or filled in place).

:class:`PartialTable` is plain data; :class:`PartialBooks` is the ledger the
books keep it in (``books.partials``): its methods take the books' lock (the
:class:`~kvstore.datapath.guard.Guard` that :class:`~kvstore.datapath.books.Books` owns and
hands to it), change the table and the index entries of the blocks being
written, and return. :mod:`kvstore.datapath.layerwrites` and :mod:`kvstore.datapath.lending`
drive it; the room a write reserved in tier 0 is given back by the caller,
outside the lock, with the keys these methods return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvstore.datapath.index import WRITING, Entry
from kvstore.datapath.ledger import LedgerParts
from kvstore.keys import BlockKey

__all__ = ["Partial", "PartialBooks", "PartialTable", "Room"]

#: Where a block written in place goes: a view, and whether it is a reserved slot of tier 0.
Room = tuple[torch.Tensor, bool]


@dataclass(eq=False)
class Partial:
    """A block arriving layer by layer (or whole, filled in place by its writer)."""

    key: BlockKey
    entry: Entry
    view: torch.Tensor | None  # where the layers go; None while room is being made
    reserved: bool  # view is a reserved slot of tier 0 (else host staging)
    missing: int  # bit l: layer l not written yet
    expiry: float
    writers: int = 0  # copies in flight into view


class PartialTable:
    """The partial writes by key."""

    def __init__(self) -> None:
        self._parts: dict[BlockKey, Partial] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def get(self, key: BlockKey) -> Partial | None:
        """The partial write of ``key``, if any."""
        return self._parts.get(key)

    def add(self, key: BlockKey, entry: Entry, num_layers: int, expiry: float) -> Partial:
        """A new partial write of ``key`` with every layer missing."""
        part = self._parts[key] = Partial(key, entry, None, False, (1 << num_layers) - 1, expiry)
        return part

    def remove(self, part: Partial) -> None:
        """Forget ``part`` (if it is still the write of its key)."""
        if self._parts.get(part.key) is part:
            del self._parts[part.key]

    def mark(self, parts: Sequence[Partial], layer: int | None) -> list[Partial]:
        """End one copy into each part, recording ``layer`` (None: all layers) as
        written; return (and forget) the parts now complete."""
        done = []
        for part in parts:
            part.writers -= 1
            part.missing = 0 if layer is None else part.missing & ~(1 << layer)
            if not part.missing and self._parts.get(part.key) is part:
                del self._parts[part.key]
                done.append(part)
        return done

    def expired(self, now: float) -> list[Partial]:
        """Parts past their expiry that no copy is in flight into."""
        return [p for p in self._parts.values() if p.expiry <= now and not p.writers]

    def idle(self, keys: Iterable[BlockKey] | None = None) -> list[Partial]:
        """Parts (of ``keys``, or all) that no copy is in flight into."""
        if keys is None:
            return [p for p in self._parts.values() if not p.writers]
        found = (self._parts.get(k) for k in dict.fromkeys(keys))
        return [p for p in found if p is not None and not p.writers]


class PartialBooks:
    """The partial writes, kept under the books' lock (see the module docstring)."""

    def __init__(self, parts: LedgerParts, clock: Callable[[], float]) -> None:
        self._guard = parts.guard
        self._index = parts.index
        self._heat = parts.heat
        self._counters = parts.counters
        self._clock = clock
        self._table = PartialTable()

    def __len__(self) -> int:
        with self._guard.locked():
            return len(self._table)

    def claim(
        self, keys: Sequence[BlockKey], num_layers: int, lease_s: float
    ) -> tuple[list[Partial], list[Partial], list[BlockKey]]:
        """The partial writes of ``keys`` (new ones for keys not stored or being
        written), their expiry pushed back. Returns the parts, the new parts, and
        the keys of expired writes whose reservations tier 0 must give back."""
        with self._guard.locked():
            self._guard.check_open()
            reserved = self._reap()
            parts, new = [], []
            expiry = self._clock() + lease_s
            for key in dict.fromkeys(keys):
                part = self._table.get(key)
                if part is None and self._index.get(key) is None:
                    entry = self._index.add(key, WRITING, pins=1)
                    self._heat.touch(entry)
                    part = self._table.add(key, entry, num_layers, expiry)
                    new.append(part)
                if part is not None:  # else stored already, or being written by a plain put
                    part.expiry = expiry
                    parts.append(part)
            return parts, new, reserved

    def place(self, new: Sequence[Partial], rooms: Sequence[Room]) -> None:
        """Give each new part its room -- ``(view, reserved)``: a reserved slot of tier 0,
        or a staging buffer -- and wake the writers waiting for it."""
        with self._guard.locked():
            for part, (view, reserved) in zip(new, rooms, strict=True):
                part.view, part.reserved = view, reserved
            self._guard.notify()

    def begin_writing(self, parts: Sequence[Partial], copies: int = 1) -> None:
        """Count ``copies`` copies in flight into each part, once every part has its room."""
        with self._guard.locked():
            while any(p.view is None for p in parts):
                self._guard.wait()
            for part in parts:
                part.writers += copies

    def mark(self, parts: Sequence[Partial], layer: int | None) -> list[Partial]:
        """Record ``layer`` (None: every layer) as written into each part; return (and
        forget) the parts now complete (not those aborted meanwhile)."""
        with self._guard.locked():
            return self._table.mark(parts, layer)

    def fail(self, parts: Sequence[Partial]) -> list[BlockKey]:
        """End a copy in flight into each part and abort them; the reserved keys."""
        with self._guard.locked():
            for part in parts:
                part.writers -= 1
            return self._abort([p for p in parts if self._table.get(p.key) is p])

    def reap(self) -> list[BlockKey]:
        """Abort writes past their expiry; the keys whose reservations tier 0 must give
        back (their room stays counted until the caller gives it back)."""
        with self._guard.locked():
            return self._reap()

    def _reap(self) -> list[BlockKey]:
        dead = self._table.expired(self._clock())
        self._counters.layer_writes_expired += len(dead)
        return self._abort(dead)

    def abort(self, keys: Sequence[BlockKey]) -> tuple[int, list[BlockKey]]:
        """Abort the writes of ``keys`` no copy is in flight into: how many, and the
        reserved keys."""
        with self._guard.locked():
            parts = self._table.idle(keys)
            return len(parts), self._abort(parts)

    def abort_idle_locked(self) -> list[BlockKey]:
        """Abort every write no copy is in flight into (at close; the caller holds the
        books' lock); the reserved keys."""
        return self._abort(self._table.idle())

    def _abort(self, parts: Sequence[Partial]) -> list[BlockKey]:
        for part in parts:
            self._table.remove(part)
            part.entry.pins -= 1
            if part.entry.state == WRITING:
                self._index.remove(part.key, part.entry)
        self._guard.notify()
        return [p.key for p in parts if p.reserved]
