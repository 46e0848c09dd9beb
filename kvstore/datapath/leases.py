"""Leases: pins that expire.

A pin keeps a block from being evicted or deleted while someone uses it. A
pin held by code that dies or forgets it (a prefetch nobody waits for, a
layerwise write the engine abandoned, a remote reader that disconnected)
would keep the block -- and its memory -- forever; peers leak pinned memory
exactly this way. So long-lived pins are leases: they end when released, or
when they expire, whichever comes first, and expiries are counted.

:class:`LeaseTable` is plain data, not thread-safe; :class:`LeaseBooks` is the ledger
:class:`~kvstore.datapath.books.Books` keeps it in (``books.leases``): its methods take the
books' lock (the :class:`~kvstore.datapath.guard.Guard` the books own and hand to it),
pin or unpin the entries, record the lease in the table, and return.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.datapath import contracts
from kvstore.datapath.index import Entry
from kvstore.datapath.ledger import LedgerParts
from kvstore.datapath.pins import pin_leading_locked, touch_locked, unpin_locked
from kvstore.keys import BlockKey

__all__ = ["Lease", "LeaseBooks", "LeaseKeeper", "LeaseTable", "Pin"]


@dataclass(eq=False)
class Lease:
    """A set of pinned entries, held until ``expiry`` (clock seconds)."""

    id: int
    entries: list[Entry]
    expiry: float
    released: bool = field(default=False)


class LeaseTable:
    """Live leases, with their expiries in a heap."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._live: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def add(self, entries: list[Entry], duration: float) -> Lease:
        """Record a lease on ``entries`` (already pinned by the caller)."""
        lease = Lease(next(self._ids), entries, self.clock() + duration)
        self._live[lease.id] = lease
        heapq.heappush(self._heap, (lease.expiry, lease.id))
        return lease

    def renew(self, lease: Lease, duration: float) -> bool:
        """Extend a live lease to ``duration`` from now; False if it already ended."""
        if lease.released:
            return False
        lease.expiry = self.clock() + duration
        heapq.heappush(self._heap, (lease.expiry, lease.id))
        return True

    def release(self, lease: Lease) -> list[Entry]:
        """End ``lease``; return the entries to unpin (empty if it had already ended)."""
        if lease.released:
            return []
        lease.released = True
        self._live.pop(lease.id, None)
        return lease.entries

    def expired(self) -> list[Lease]:
        """End and return every lease whose expiry has passed."""
        now = self.clock()
        ended = []
        while self._heap and self._heap[0][0] <= now:
            expiry, lease_id = heapq.heappop(self._heap)
            lease = self._live.get(lease_id)
            if lease is not None and lease.expiry == expiry:  # not renewed since
                lease.released = True
                del self._live[lease_id]
                ended.append(lease)
        return ended

    def expired_all(self) -> list[Lease]:
        """End and return every live lease (at close)."""
        ended = list(self._live.values())
        for lease in ended:
            lease.released = True
        self._live.clear()
        self._heap.clear()
        return ended

    def next_expiry(self) -> float | None:
        """Clock time of the next expiry, or None."""
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._live)


class LeaseBooks:
    """Leases taken, renewed, released and reaped under the books' lock (see the
    module docstring). The ``*_locked`` methods are for the books' other ledgers,
    which call them with the lock held."""

    def __init__(self, parts: LedgerParts, clock: Callable[[], float] = time.monotonic) -> None:
        self._guard = parts.guard
        self._index = parts.index
        self._heat = parts.heat
        self._counters = parts.counters
        self._table = LeaseTable(clock)

    def lease(self, keys: Sequence[BlockKey], duration: float) -> Lease:
        """Pin the leading readable ``keys`` under a lease of ``duration`` seconds."""
        with self._guard.locked():
            self._guard.check_open()
            self.reap_locked()
            return self._table.add(pin_leading_locked(self._index, self._heat, keys), duration)

    def lease_stored(
        self, keys: Sequence[BlockKey], duration: float
    ) -> tuple[Lease, dict[int, Entry]]:
        """Pin every readable key among ``keys`` under one lease; ``{position: entry}``."""
        with self._guard.locked():
            self._guard.check_open()
            self.reap_locked()
            pinned: dict[int, Entry] = {}
            for i, key in enumerate(keys):
                entry = self._index.ready(key)
                if entry is None or i in pinned:
                    continue
                entry.pins += 1
                touch_locked(self._index, self._heat, key, entry)
                pinned[i] = entry
            return self._table.add(list(pinned.values()), duration), pinned

    def renew(self, lease: Lease, duration: float) -> bool:
        """Extend a lease; False if it already ended."""
        with self._guard.locked():
            return self._table.renew(lease, duration)

    def release(self, lease: Lease) -> None:
        """End a lease (idempotent)."""
        with self._guard.locked():
            unpin_locked(self._guard, self._table.release(lease))

    def reap_locked(self) -> None:
        """End (and count) the expired leases, unpinning their entries; lock held."""
        for lease in self._table.expired():
            self._counters.leases_expired += 1
            unpin_locked(self._guard, lease.entries)

    def wait_pins_locked(self, entry: Entry | None, allowed: int = 0) -> None:
        """End expired leases; then, with an ``entry``, wait until it has no more than
        ``allowed`` pins (lock held, released while waiting)."""
        self.reap_locked()
        while entry is not None and entry.pins > allowed:
            self._guard.wait(0.05)  # wakes for lease expiry as well as unpins
            self.reap_locked()

    def end_all_locked(self) -> None:
        """End every live lease, unpinning its entries (at close); lock held."""
        for lease in self._table.expired_all():
            unpin_locked(self._guard, lease.entries)

    def live_locked(self) -> int:
        """How many leases are live; lock held."""
        return len(self._table)


class LeaseKeeper(Protocol):
    """What a :class:`Pin` needs of the store: renewing and releasing its lease."""

    def renew(self, lease: Lease, duration: float | None = None) -> bool:
        """Extend ``lease`` by ``duration`` seconds (the store's default if None)."""

    def release(self, lease: Lease) -> None:
        """End ``lease`` (idempotent)."""


class Pin(contracts.Pin):
    """The :class:`~kvstore.datapath.contracts.Pin` a store hands out: a lease renewed
    and released through the store's :class:`LeaseKeeper`."""

    def __init__(self, keeper: LeaseKeeper, lease: Lease) -> None:
        self._keeper = keeper
        self._lease = lease

    @property
    def count(self) -> int:
        return len(self._lease.entries)

    @property
    def active(self) -> bool:
        return not self._lease.released

    def renew(self, seconds: float | None = None) -> bool:
        return self._keeper.renew(self._lease, seconds)

    def release(self) -> None:
        self._keeper.release(self._lease)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
