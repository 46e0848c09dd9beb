"""The books: what is stored where, who uses it, and THE lock that guards it all.

:class:`Books` owns the index (:class:`~kvstore.datapath.index.Index`), the per-tier
levels, heat, the change feed, the counters and the one lock (a
:class:`~kvstore.datapath.guard.Guard`) that guards every one of them, and keeps the
store's lifecycle (open, closing, closed), the watchers and the counters itself. The
rest is done by its ledgers, each a small class that gets only the lock and the parts
of the books it needs, and keeps its state under that same lock:

=====================  ==============================================================
``books.pins``         :class:`~kvstore.datapath.pins.PinBooks`: pins taken and
                       dropped, a put's new entries (claim, settle)
``books.leases``       :class:`~kvstore.datapath.leases.LeaseBooks`: pins that expire
``books.queries``      :class:`~kvstore.datapath.queries.QueryBooks`: read-only
                       questions (where, leading, stored keys, fastest copy, ...)
``books.removals``     :class:`~kvstore.datapath.removals.RemovalBooks`: deletes, local
                       drops, lost copies
``books.discovery``    :class:`~kvstore.datapath.discovery.DiscoveryBooks`: copies other
                       processes wrote or freed in the shared tiers
``books.room``         :class:`~kvstore.datapath.room.RoomBooks`: room, eviction and
                       write-back in each tier
``books.partials``     :class:`~kvstore.datapath.partials.PartialBooks`: blocks being
                       written layer by layer
=====================  ==============================================================

Books is the only owner of the lock: it creates the Guard and hands it to its ledgers
only (the ledgers that pin, lease, make room and write layer by layer get it with the
index, heat clock and counters as one :class:`~kvstore.datapath.ledger.LedgerParts`);
every other piece of the data path calls a method here or on a ledger, which takes the
lock, changes the books and returns.

Books never calls a tier and never copies bytes: an operation pins its blocks
here, does its I/O with the lock released (through
:class:`~kvstore.datapath.tierio.TierIO` and the copy engine), and comes back to record
the outcome. So tier I/O never runs under the lock (:meth:`Books.held_by_me`
lets TierIO and the tests check it). A copy is freed only when its block has
no pins other than the freeing operation's own (the freer waits), so a block
being read or written is never evicted or deleted under a reader.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.datapath.contracts import ChangeFeed
from kvstore.datapath.counters import ManagerCounters
from kvstore.datapath.discovery import DiscoveryBooks
from kvstore.datapath.guard import Guard
from kvstore.datapath.index import HeatClock, Index, Level
from kvstore.datapath.leases import LeaseBooks
from kvstore.datapath.ledger import LedgerParts
from kvstore.datapath.partials import PartialBooks
from kvstore.datapath.pins import PinBooks
from kvstore.datapath.queries import QueryBooks
from kvstore.datapath.removals import RemovalBooks
from kvstore.datapath.room import Reservation, RetainedFn, RoomBooks, Victims, usage
from kvstore.keys import BlockKey
from kvstore.placement import Placement

__all__ = ["Books", "Reservation", "Victims"]


class Books:
    """The data path's bookkeeping under one lock (see the module docstring).

    ``levels``: one :class:`~kvstore.datapath.index.Level` per tier, fastest first.
    ``persistent`` / ``local`` / ``shared``: bitmasks of the tiers that
    outlive the process, that are of this machine, and that other processes
    write too. ``retained``: a session hint's retention priority of a key (None:
    not retained), which eviction honours (:func:`~kvstore.datapath.room.pick_victims`).
    """

    def __init__(
        self,
        levels: Sequence[Level],
        masks: tuple[int, int, int],
        placement: Placement,
        heat: HeatClock,
        clock: Callable[[], float] = time.monotonic,
        retained: RetainedFn | None = None,
    ) -> None:
        self.persistent, self.local, self.shared = masks
        self.placement = placement
        self.heat = heat
        self.clock = clock
        self.counters = ManagerCounters.for_tiers(len(levels))
        self._levels = list(levels)
        self._index = index = Index(self._levels, self.persistent, self.local)
        self._guard = guard = Guard()
        parts = LedgerParts(guard, index, heat, self.counters)
        #: Leases: pins that expire (under the same lock, as every ledger below).
        self.leases = LeaseBooks(parts, clock)
        #: Pins taken and dropped, a put's new entries among them.
        self.pins = PinBooks(parts, self.leases.reap_locked)
        #: Deletes, drops and lost copies, taken off the books around the tier calls.
        self.removals = RemovalBooks(guard, index, self.counters, self.leases.wait_pins_locked)
        #: Copies other processes wrote or freed in the shared tiers, recorded.
        self.discovery = DiscoveryBooks(guard, index)
        #: What the books say: read-only questions.
        self.queries = QueryBooks(guard, index, placement, heat)
        #: Room, eviction and write-back in each tier.
        self.room = RoomBooks(
            parts, placement, self.leases.wait_pins_locked, retained or (lambda key: None)
        )
        #: The blocks being written layer by layer.
        self.partials = PartialBooks(parts, clock)

    # -- the lock -----------------------------------------------------------------
    def _locked(self) -> Guard:
        return self._guard

    def held_by_me(self) -> bool:
        """True while the calling thread holds the books' lock (tier calls must not)."""
        return self._guard.held_by_me()

    # -- state --------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once the store closed."""
        return self._guard.closed

    @property
    def closing(self) -> bool:
        """True once the store began closing (background sweeps stop then)."""
        return self._guard.closing

    @property
    def num_levels(self) -> int:
        """How many tiers there are."""
        return len(self._levels)

    def check_open(self) -> None:
        """Raise :class:`ClosedError` after close."""
        self._guard.check_open()

    def begin_close(self) -> bool:
        """Mark the store closing; False if it is closed already."""
        with self._locked():
            self._guard.closing = True
            return not self._guard.closed

    def close(self) -> list[BlockKey]:
        """Close: end every lease and unfinished layerwise write, wait until no block
        is pinned. Returns the keys whose reserved room tier 0 must give back."""
        with self._locked():
            self._guard.closed = True
            reserved = self.partials.abort_idle_locked()
            self.leases.end_all_locked()
            while any(e.pins for _, e in self._index.items()):
                self._guard.wait()
            return reserved

    def watch(self, shared_copies: bool = False) -> ChangeFeed:
        """A new feed recording which keys gain or lose their copies in local tiers
        (each watcher drains its own; :meth:`unwatch` stops one); ``shared_copies``:
        also which gain or lose their copy in a shared persistent tier."""
        feed = ChangeFeed(shared_copies)
        with self._locked():
            self._index.changes.append(feed)
        return feed

    def unwatch(self, feed: ChangeFeed) -> None:
        """Stop recording into ``feed`` (no-op if it is not recording)."""
        with self._locked():
            if feed in self._index.changes:
                self._index.changes.remove(feed)

    # -- counters -----------------------------------------------------------------
    def count(self, **amounts: float) -> None:
        """Add to counters by name (``count(gets=1, blocks_read=n)``)."""
        with self._locked():
            self.counters.add(amounts)

    def count_level(self, name: str, level: int, n: int = 1) -> None:
        """Add ``n`` to tier ``level``'s slot of the per-tier counter ``name``."""
        with self._locked():
            self.counters.add_level(name, level, n)

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the counters, with the live leases."""
        with self._locked():
            snapshot = self.counters.snapshot()
            snapshot["leases_live"] = self.leases.live_locked()
            snapshot["blocks_memory_only"] = max(0, self._index.unpersisted)
            return snapshot

    def level_usage(self) -> list[dict[str, Any]]:
        """Per tier: blocks held, capacity and watermarks (blocks), policy, movements."""
        with self._locked():
            return [usage(lv, self.counters) for lv in self._levels]
