"""Zero-copy access to the store's memory, for servers that move blocks themselves.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.discovery import discover
from kvstore.index import READY, Entry
from kvstore.keys import BlockKey
from kvstore.leases import Lease
from kvstore.tiers.base import LayerRange

if TYPE_CHECKING:
    from kvstore.manager import BlockManager
    from kvstore.prefetch import Partial

__all__ = ["Loan", "PendingPut", "lend"]


class Loan:
    """Stored blocks lent out for zero-copy reads (see the module docstring).

    ``found[i]``: key ``i`` is stored and pinned. ``views[i]``: its bytes in
    host memory (a tensor of ``layout.block_shape``), or None.
    """

    def __init__(
        self,
        manager: BlockManager,
        keys: list[BlockKey],
        lease: Lease,
        pinned: dict[int, Entry],
        views: list[torch.Tensor | None],
    ) -> None:
        self._m = manager
        self.layout = manager.layout
        self.keys = keys
        self._lease = lease
        self._pinned = pinned
        self.found = [i in pinned for i in range(len(keys))]
        self.views = views
        self._released = False
        self._lock = threading.Lock()

    def read_into(self, i: int, out: torch.Tensor, layers: LayerRange = None) -> bool:
        """Verified read of lent block ``i`` (or its ``layers``) into ``out``; False if
        every copy failed (the block is then no longer stored)."""
        return self.read_many([i], [out], layers)[0]

    def read_many(
        self, idxs: list[int], outs: list[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        """:meth:`read_into` for several blocks in one batch per tier (one round trip
        to a disk's thread pool, a peer or S3 for all of them)."""
        found = [i for i in idxs if i in self._pinned]
        done = dict.fromkeys(idxs, False)
        if found:
            keys = [self.keys[i] for i in found]
            entries = [self._pinned[i] for i in found]
            targets = [outs[idxs.index(i)] for i in found]
            for i, ok in zip(found, self._m.read(keys, entries, targets, layers), strict=True):
                done[i] = ok
        return [done[i] for i in idxs]

    def renew(self) -> bool:
        """Extend the lease by the store's ``lease_s``; False if it already ended."""
        return self._m.renew(self._lease)

    @property
    def released(self) -> bool:
        """True once released (the views must not be used any more)."""
        with self._lock:
            return self._released

    def release(self) -> None:
        """Unpin the blocks (idempotent). The views must not be used afterwards."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._m.release(self._lease)

    def __enter__(self) -> Loan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lend(m: BlockManager, keys: Sequence[BlockKey], duration: float | None = None) -> Loan:
    """Pin every stored key of ``keys`` under one lease; views where host memory holds it."""
    keys = list(keys)
    discover(m, keys)  # blocks other processes wrote to shared tiers count as stored
    pinned: dict[int, Entry] = {}
    with m._cond:
        m._check_open()
        m._reap_leases()
        for i, key in enumerate(keys):
            entry = m._index.get(key)
            if entry is None or entry.state != READY or i in pinned:
                continue
            entry.pins += 1
            m._touch(key, entry)
            pinned[i] = entry
        lease = m._leases.add(list(pinned.values()), duration or m.config.lease_s)
        m.counters.gets += 1
        m.counters.blocks_read += len(pinned)
        m.counters.blocks_missed += len(keys) - len(pinned)
        views = [
            _host_view(m, keys[i], pinned[i]) if i in pinned else None for i in range(len(keys))
        ]
    return Loan(m, keys, lease, pinned, views)


def _host_view(m: BlockManager, key: BlockKey, entry: Entry) -> torch.Tensor | None:
    """A view of ``key`` in the fastest host-memory tier holding it. Lock held."""
    for level in m._levels:
        device = level.tier.device
        if entry.tiers & level.bit and device is not None and device.type == "cpu":
            view = level.tier.view(key)
            if view is not None:
                return view
    return None


class PendingPut:
    """Room for new whole blocks, filled in place, then committed (module docstring).

    ``views[i]``: where block ``i`` goes (``layout.block_shape``, contiguous),
    or None when key ``i`` is already stored or being written (nothing to do).
    """

    def __init__(self, manager: BlockManager, keys: Sequence[BlockKey]) -> None:
        self._m = manager
        self.keys = list(keys)
        self._parts: list[Partial | None] = manager._layer_writes.begin(self.keys)
        self.views: list[torch.Tensor | None] = [p.view if p else None for p in self._parts]
        self._ended = False
        self._lock = threading.Lock()

    def commit(self, ok: Sequence[bool] | None = None) -> int:
        """Publish the blocks whose ``ok[i]`` is true (all by default); abort the others.

        Returns how many blocks this put stored. Idempotent: a second call (or
        one after :meth:`abort`) stores nothing.
        """
        good = [True] * len(self.keys) if ok is None else list(ok)
        if len(good) != len(self.keys):
            raise ValueError(f"{len(good)} flags for {len(self.keys)} keys")
        with self._lock:
            if self._ended:
                return 0
            self._ended = True
        parts = [p for p in self._parts if p is not None]
        flags = [g for p, g in zip(self._parts, good, strict=True) if p is not None]
        return self._m._layer_writes.finish(parts, flags)

    def abort(self) -> None:
        """Give back every reserved room; nothing is stored (idempotent)."""
        self.commit([False] * len(self.keys))

    def __enter__(self) -> PendingPut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # a no-op after commit
