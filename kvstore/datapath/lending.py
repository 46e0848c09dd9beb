"""Lender: zero-copy access to the store's memory, for servers that move blocks themselves.

A server sends a stored block straight from the memory tier that holds it
(``sendmsg`` of the slot's bytes, or a same-host client copying it out of
shared memory) and receives a new block straight into the slot it will live
in. Two objects make that safe:

- :class:`Loan` -- the stored blocks among ``keys``, pinned under one lease:
  for each, a view of the host memory tier that holds it, or None when only
  slower tiers do (:meth:`Loan.read_into` then makes a verified read). Pinned
  blocks are never evicted or deleted, so the views stay valid until
  :meth:`Loan.release` -- or until the lease expires, so a client that died
  holding a loan frees nothing late.
- :class:`PendingPut` -- room reserved for new blocks: a slot of the first
  tier where it hands out its memory, else a staging buffer. The caller fills
  ``views[i]`` in place; :meth:`PendingPut.commit` publishes the good ones
  (they become visible to lookups then, never before) and gives back the room
  of the others. Keys already stored, or being written, get no view.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from kvstore.datapath import contracts
from kvstore.datapath.books import Books
from kvstore.datapath.finder import Finder
from kvstore.datapath.index import Entry
from kvstore.datapath.layerwrites import LayerWrites
from kvstore.datapath.leases import Lease
from kvstore.datapath.partials import Partial
from kvstore.datapath.reader import Reader
from kvstore.datapath.tierio import TierIO
from kvstore.datapath.writer import FollowUps
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import LayerRange

__all__ = ["Lender", "Loan", "PendingPut"]


class Loan(contracts.Loan):
    """The :class:`~kvstore.datapath.contracts.Loan` a :class:`Lender` makes: the pinned
    entries under one lease, read through the store's :class:`Reader`."""

    def __init__(
        self,
        lender: Lender,
        keys: list[BlockKey],
        lease: Lease,
        pinned: dict[int, Entry],
        views: list[torch.Tensor | None],
    ) -> None:
        self._lender = lender
        self.layout: KVLayout = lender.layout
        self.keys = keys
        self._lease = lease
        self._pinned = pinned
        self.found = [i in pinned for i in range(len(keys))]
        self.views = views
        self._released = False
        self._lock = threading.Lock()

    def read_into(self, i: int, out: torch.Tensor, layers: LayerRange = None) -> bool:
        return self.read_many([i], [out], layers)[0]

    def read_many(
        self, idxs: list[int], outs: list[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        found = [i for i in idxs if i in self._pinned]
        done = dict.fromkeys(idxs, False)
        if found:
            keys = [self.keys[i] for i in found]
            entries = [self._pinned[i] for i in found]
            targets = [outs[idxs.index(i)] for i in found]
            read = self._lender.reader.read(keys, entries, targets, layers)
            for i, ok in zip(found, read, strict=True):
                done[i] = ok
        return [done[i] for i in idxs]

    def renew(self) -> bool:
        return self._lender.books.leases.renew(self._lease, self._lender.lease_s)

    @property
    def released(self) -> bool:
        with self._lock:
            return self._released

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._lender.books.leases.release(self._lease)

    def __enter__(self) -> Loan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PendingPut(contracts.PendingPut):
    """The :class:`~kvstore.datapath.contracts.PendingPut` a :class:`Lender` makes: the
    partial writes reserved for the keys, finished by the lender at the commit."""

    def __init__(
        self,
        keys: Sequence[BlockKey],
        parts: list[Partial | None],
        finish: Callable[[list[Partial], list[bool]], int],
    ) -> None:
        self.keys = list(keys)
        self._parts = parts
        self._finish = finish
        self.views: list[torch.Tensor | None] = [p.view if p else None for p in parts]
        self._ended = False
        self._lock = threading.Lock()

    def commit(self, ok: Sequence[bool] | None = None) -> int:
        good = [True] * len(self.keys) if ok is None else list(ok)
        if len(good) != len(self.keys):
            raise ValueError(f"{len(good)} flags for {len(self.keys)} keys")
        with self._lock:
            if self._ended:
                return 0
            self._ended = True
        parts = [p for p in self._parts if p is not None]
        flags = [g for p, g in zip(self._parts, good, strict=True) if p is not None]
        return self._finish(parts, flags)

    def abort(self) -> None:
        self.commit([False] * len(self.keys))

    def __enter__(self) -> PendingPut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # a no-op after commit


class Lender:
    """Makes loans and pending puts for one store (see the module docstring)."""

    def __init__(
        self,
        reader: Reader,
        layer_writes: LayerWrites,
        schedule: Callable[[FollowUps], None],
        lease_s: float,
    ) -> None:
        # The books, tier calls and finder are the reader's: a loan pins and reads
        # through the same pieces as a get (and a prefetch).
        self.reader = reader
        self.books: Books = reader.books
        self.io: TierIO = reader.io
        self.finder: Finder = reader.finder
        self.layer_writes = layer_writes
        self.schedule = schedule
        self.lease_s = lease_s
        self.layout = self.io.layout
        self._host = [level for level in range(len(self.io.tiers)) if self.io.host_memory(level)]

    def lend(self, keys: Sequence[BlockKey], duration: float | None = None) -> Loan:
        """Pin every stored key of ``keys`` under one lease; views where host memory
        holds it (taken with the books' lock released: the pins keep them valid)."""
        keys = list(keys)
        self.finder.discover(keys)  # blocks other processes wrote to shared tiers count
        lease, pinned = self.books.leases.lease_stored(keys, duration or self.lease_s)
        self.books.count(gets=1, blocks_read=len(pinned), blocks_missed=len(keys) - len(pinned))
        masks = dict(zip(pinned, self.books.queries.tiers_of(list(pinned.values())), strict=True))
        views = [
            self._host_view(keys[i], masks[i]) if i in pinned else None for i in range(len(keys))
        ]
        return Loan(self, keys, lease, pinned, views)

    def _host_view(self, key: BlockKey, tiers: int) -> torch.Tensor | None:
        """A view of ``key`` in the fastest host-memory tier among ``tiers`` (a bitmask)."""
        for level in self._host:
            if tiers & (1 << level):
                view = self.io.view(level, key)
                if view is not None:
                    return view
        return None

    def begin_put(self, keys: Sequence[BlockKey]) -> PendingPut:
        """Reserve room for new blocks to be filled in place."""
        parts, follow = self.layer_writes.begin(keys)
        self.schedule(follow)
        return PendingPut(keys, parts, self._finish)

    def _finish(self, parts: list[Partial], ok: list[bool]) -> int:
        stored, follow = self.layer_writes.finish(parts, ok)
        self.schedule(follow)
        return stored
