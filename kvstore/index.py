"""The block manager's index: entries, per-tier levels, moves, heat and counters.

Plain data with no locking of its own: everything here is read and written
under the block manager's lock (see :mod:`kvstore.manager`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.keys import BlockKey
from kvstore.policy import EvictionPolicy, Watermarks
from kvstore.policy.placement import TierRules
from kvstore.tiers.base import Tier

__all__ = [
    "DELETING",
    "READY",
    "WRITING",
    "ChangeFeed",
    "Entry",
    "HeatClock",
    "Level",
    "ManagerCounters",
    "Move",
]

WRITING, READY, DELETING = 0, 1, 2
HEAT_CAP = 255  # small ints are shared objects in CPython: heat costs no memory per entry


class Entry:
    """Index entry of one key."""

    __slots__ = ("dropping", "epoch", "heat", "pins", "state", "tiers")

    def __init__(self, state: int, pins: int = 0, tiers: int = 0) -> None:
        self.state = state
        self.pins = pins
        self.tiers = tiers  # bit i: tier i holds a copy
        self.dropping = 0  # bit i: a delete from tier i is in flight (nothing may write it there)
        self.heat = 0  # decayed access count, see HeatClock
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
    """The manager's bookkeeping for one tier."""

    index: int
    tier: Tier
    marks: Watermarks
    policy: EvictionPolicy
    rules: TierRules
    # Copies held plus room reserved for writes in flight. A copy being evicted
    # counts until its slot is really free (so no put is granted room that a
    # medium has not freed yet); ``leaving`` says how many of them are on their
    # way out. ``len(policy)`` is the exact count held.
    resident: int = 0
    leaving: int = 0
    #: Write-back ahead of eviction (a memory tier in front of a local disk): past
    #: the low watermark's worth of ``dirty`` blocks, the least recently used are
    #: copied down in the background (see :mod:`kvstore.moves`).
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


class ChangeFeed:
    """Keys that gained their first copy in a local tier, or lost their last one.

    For a watcher outside the manager (a cluster node publishing what it holds):
    the manager records each change under its own lock; :meth:`drain` hands over
    the net change since the last drain (a key added and removed meanwhile is
    neither). ``_lock`` guards ``_state`` (drains come from the watcher's thread).
    """

    def __init__(self) -> None:
        self._state: dict[BlockKey, bool] = {}
        self._lock = threading.Lock()

    def record(self, key: BlockKey, held: bool) -> None:
        """``key`` is now held locally (True) or not (False)."""
        with self._lock:
            self._state[key] = held

    def drain(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """Keys added and keys removed since the last drain."""
        with self._lock:
            state, self._state = self._state, {}
        return [k for k, held in state.items() if held], [k for k, h in state.items() if not h]


@dataclass
class Move:
    """A block on its way into a tier: its key, entry and source tensor."""

    key: BlockKey
    entry: Entry
    src: torch.Tensor


@dataclass
class ManagerCounters:
    """Cumulative counters."""

    lookups: int = 0
    lookup_blocks_hit: int = 0
    lookup_blocks_missed: int = 0
    puts: int = 0
    blocks_stored: int = 0
    blocks_already_present: int = 0
    blocks_not_stored: int = 0
    gets: int = 0
    blocks_read: int = 0
    blocks_missed: int = 0
    blocks_deleted: int = 0
    evictions: list[int] = field(default_factory=list)
    demotions: list[int] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    write_through_copies: list[int] = field(default_factory=list)
    writebacks: list[int] = field(default_factory=list)
    admission_rejects: list[int] = field(default_factory=list)
    blocks_dropped: int = 0
    copies_lost: int = 0
    tier_errors: int = 0
    leases_expired: int = 0
    layer_writes_expired: int = 0
    bytes_written: int = 0
    #: Bytes writers copied themselves into room reserved in a tier (``begin_put``,
    #: layer writes, a server's shared-memory puts): not timed, so not in ``write_gbps``.
    bytes_written_in_place: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0

    @classmethod
    def for_tiers(cls, count: int) -> ManagerCounters:
        """Counters with one slot per tier in the per-tier lists."""
        counters = cls()
        for name in ("evictions", "demotions", "promotions", "write_through_copies", "writebacks"):
            setattr(counters, name, [0] * count)
        counters.admission_rejects = [0] * count
        return counters

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}
