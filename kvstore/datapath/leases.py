"""Leases: pins that expire.

A pin keeps a block from being evicted or deleted while someone uses it. A
pin held by code that dies or forgets it (a prefetch nobody waits for, a
layerwise write the engine abandoned, a remote reader that disconnected)
would keep the block -- and its memory -- forever; peers leak pinned memory
exactly this way. So long-lived pins are leases: they end when released, or
when they expire, whichever comes first, and expiries are counted.

Not thread-safe: :class:`~kvstore.datapath.books.Books` calls the table under its
lock, and does the unpinning itself.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.datapath import contracts
from kvstore.datapath.index import Entry

__all__ = ["Lease", "LeaseKeeper", "LeaseTable", "Pin"]


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
