"""Room in a tier: reservations, admission, eviction victims, write-back picks.

The rules are plain functions over a :class:`~kvstore.datapath.index.Level` and the
:class:`~kvstore.datapath.index.Index`, with no lock and no I/O of their own;
:class:`RoomBooks` is the ledger that runs them under the books' lock
(``books.room``), for the :class:`~kvstore.datapath.writer.Writer` and
:class:`~kvstore.datapath.migrations.Migrations`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.datapath.counters import ManagerCounters
from kvstore.datapath.index import DELETING, READY, WRITING, Entry, HeatClock, Index, Level
from kvstore.datapath.ledger import LedgerParts
from kvstore.errors import CapacityError
from kvstore.keys import BlockKey
from kvstore.placement import Placement

if TYPE_CHECKING:
    from kvstore.datapath.contracts import QuotaSeat

#: How long a demotion waits for reads and copies of its blocks to end; blocks still
#: in use then keep their place (a demotion is a hint). Bounded: it waits on a mover
#: thread, which other background moves need.
_TAKE_WAIT_S = 10.0

__all__ = [
    "Reservation",
    "RetainedFn",
    "RoomBooks",
    "Victims",
    "claim",
    "pick_dirty",
    "pick_victims",
    "reserve",
    "usage",
]

Victims = list[tuple[BlockKey, Entry]]


@dataclass
class Reservation:
    """Room granted in one tier: ``grant`` blocks, once ``victims`` are evicted.

    ``excess``: the tier passed its high watermark; bringing it down to the
    low one is background work (:meth:`kvstore.datapath.migrations.Migrations.schedule`),
    evicting at most this many of the blocks it held before this reservation
    (a put never evicts, in the background, the blocks it just wrote).
    """

    grant: int
    victims: Victims = field(default_factory=list)
    excess: int = 0


def reserve(
    level: Level, n: int, find: Callable[[int], Victims], quota: QuotaSeat | None = None
) -> Reservation:
    """Reserve room for up to ``n`` blocks in ``level``; pick (and claim) the victims
    that must go first, with ``find(count)``.

    Only the room needed now is freed on the caller's path: copies already on
    their way out count as freed, and a tier past its high watermark is
    brought down to its low one later, in the background.

    ``quota``: the owner accounting of a store that shares its tiers with others
    (:mod:`kvstore.datapath.quota`): it may ask for more of this store's own blocks to go
    (its owner past its limit, or past its share under pressure); blocks that
    cannot be freed for it are not granted, and counted as refused.
    """
    must, _ = level.marks.plan(level.resident, n)
    owed = quota.must_evict(level, n) if quota is not None else 0
    need = max(0, max(must, owed) - level.leaving)
    victims = find(need) if need else []
    grant = max(0, n - (need - len(victims)))
    if quota is not None and owed > must and grant < n:
        quota.refuse(n - grant)
    claim(level, victims)
    older = len(level.policy) - level.leaving  # held before this reservation, not leaving
    level.resident += grant
    staying = level.resident - level.leaving
    excess = min(staying - level.marks.low, older) if staying > level.marks.high else 0
    return Reservation(grant, victims, max(0, excess))


def claim(level: Level, victims: Victims) -> None:
    """Pin ``victims`` and count them as leaving ``level``."""
    for _, entry in victims:
        entry.pins += 1
    level.leaving += len(victims)


#: ``retained(key)`` -> the key's retention priority (None: not retained).
RetainedFn = Callable[[BlockKey], int | None]


def _never(key: BlockKey) -> int | None:
    return None


def pick_victims(
    level: Level,
    n: int,
    index: Index,
    placement: Placement,
    heat: HeatClock,
    retained: RetainedFn = _never,
) -> Victims:
    """Up to ``n`` unpinned readable blocks of ``level`` to evict.

    In the policy's order, but cooled extra copies (blocks with a copy
    further down) go first and hot blocks last, looking a bounded distance
    ahead for the cheaper ones. Blocks a session hint retains come after all
    of those, lowest priority first (taken only when nothing else is left).
    """
    if n <= 0:
        return []
    below = level.below
    ranked: tuple[Victims, Victims, Victims] = ([], [], [])
    kept: list[tuple[int, int, BlockKey, Entry]] = []
    horizon = 4 * n + 64
    for seen, key in enumerate(level.policy.candidates()):
        entry = index.get(key)
        if entry is not None and entry.pins == 0 and entry.state == READY:
            priority = retained(key)
            if priority is not None:
                kept.append((priority, seen, key, entry))
                continue
            hot = placement.is_hot(heat.heat(entry))
            # A replica (copied here from below) is an extra copy; a block written
            # back from here is not: it keeps its place in the policy's order.
            extra = entry.tiers & below and key not in level.written_back
            ranked[2 if hot else (0 if extra else 1)].append((key, entry))
        found = sum(len(r) for r in ranked)
        if len(ranked[0]) >= n or (seen >= horizon and found >= n):
            break
    victims = (ranked[0] + ranked[1] + ranked[2])[:n]
    if len(victims) < n and kept:
        kept.sort(key=lambda k: (k[0], k[1]))
        victims += [(key, entry) for _, _, key, entry in kept[: n - len(victims)]]
    return victims


def pick_dirty(
    level: Level,
    batch: int,
    tried: set[BlockKey],
    index: Index,
    admits_below: Callable[[Entry], bool],
) -> Victims:
    """Up to ``batch`` blocks only ``level`` holds to write back now, pinned; none once
    it is within its low watermark. Skips blocks pinned (read, or evicted: the
    eviction writes those), not admitted below yet, or tried already (each is
    tried once per run: one the disk refused stays for eviction)."""
    want = min(batch, len(level.dirty) - level.marks.low)
    picked: Victims = []
    if want <= 0:
        return picked
    for key in itertools.islice(level.dirty, 4 * want + 64 + len(tried)):
        entry = index.get(key)
        if key in tried or entry is None or entry.pins or entry.state != READY:
            continue
        tried.add(key)
        if not admits_below(entry):
            continue  # eviction decides about it
        entry.pins += 1
        picked.append((key, entry))
        if len(picked) >= want:
            break
    return picked


def usage(level: Level, counters: ManagerCounters) -> dict[str, Any]:
    """The books' figures of one tier: blocks, capacity, watermarks, movements."""
    i = level.index
    return {
        "kind": level.kind,
        "blocks": len(level.policy),
        "resident_blocks": level.resident,  # held, plus room reserved or not yet freed
        "capacity_blocks": level.marks.capacity,
        "high_watermark_blocks": level.marks.high,
        "low_watermark_blocks": level.marks.low,
        "policy": level.policy.name,
        "evictions": counters.evictions[i],
        "demotions": counters.demotions[i],
        "promotions": counters.promotions[i],
        "admission_rejects": counters.admission_rejects[i],
        "write_through_copies": counters.write_through_copies[i],
        "writebacks": counters.writebacks[i],
    }


class RoomBooks:
    """Room, eviction and write-back in each tier, under the books' lock.

    The ledger :class:`~kvstore.datapath.books.Books` keeps as ``books.room``: its
    methods take the books' lock (the :class:`~kvstore.datapath.guard.Guard` handed to
    it), run the rules of this module over the levels and the index, and
    return. ``pins(entry, allowed)`` is the lease ledger's
    (:meth:`~kvstore.datapath.leases.LeaseBooks.wait_pins_locked`): it ends expired
    leases and waits, the lock held, until ``entry`` has no more than ``allowed`` pins
    (no entry: only the expiry).
    """

    def __init__(
        self,
        parts: LedgerParts,
        placement: Placement,
        pins: Callable[[Entry | None, int], None],
        retained: RetainedFn = _never,
    ) -> None:
        self._guard = parts.guard
        self._retained = retained
        self._index = parts.index
        self._levels = parts.index.levels
        self._placement = placement
        self._heat = parts.heat
        self._counters = parts.counters
        self._pins = pins
        #: Owner accounting shared with other stores (None: this store's tiers are its own).
        self._quota: QuotaSeat | None = None

    def use_quota(self, hook: QuotaSeat | None) -> None:
        """Grant room in every tier through ``hook`` from now on (:mod:`kvstore.datapath.quota`)."""
        with self._guard.locked():
            self._quota = hook

    @property
    def levels(self) -> list[Level]:
        """The tiers' books (a quota hook reads their room)."""
        return list(self._levels)

    def admit(self, level: int, keys: Sequence[BlockKey], entries: Sequence[Entry]) -> list[int]:
        """Positions of the blocks tier ``level`` takes now: its admission rule, and no
        key whose delete from it is still in flight."""
        lv = self._levels[level]
        with self._guard.locked():
            dropping = self._index.dropping
            free = [i for i, k in enumerate(keys) if not dropping.get(k, 0) & lv.bit]
            taken = [i for i in free if self._placement.admits(level, self._heat.heat(entries[i]))]
            self._counters.admission_rejects[level] += len(free) - len(taken)
            return taken

    def reserve(self, level: int, n: int) -> Reservation:
        """Room for up to ``n`` blocks in tier ``level``, and the victims (pinned,
        counted as leaving) that must go first; see :func:`kvstore.datapath.room.reserve`."""
        with self._guard.locked():
            self._pins(None, 0)
            quota = self._quota
            shared = quota.lock if quota is not None else contextlib.nullcontext()
            with shared:  # the books' lock, then the ledger's: never the other way
                return reserve(self._levels[level], n, self._victim_finder(level), quota)

    def give_back(self, level: int, n: int) -> None:
        """Release room reserved in tier ``level`` that no block used."""
        with self._guard.locked():
            self._levels[level].resident -= n
            self._guard.notify()

    def wait_room(self, level: int, timeout: float = 30.0) -> None:
        """Wait until evictions in flight have freed the room a grant counted on.

        ``resident`` includes copies still being deleted; once it is within
        capacity, every granted write has a free slot. Bounded: a stalled
        medium makes the writes fail (a miss), not the caller hang.
        """
        lv = self._levels[level]
        deadline = time.monotonic() + timeout
        with self._guard.locked():
            while lv.resident > lv.marks.capacity and lv.leaving:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._guard.wait(min(left, 0.05))

    def commit_writes(
        self, level: int, keys: Sequence[BlockKey], entries: Sequence[Entry], done: Sequence[bool]
    ) -> tuple[list[int], bool]:
        """Publish the copies tier ``level`` wrote; give back the room of the others.

        Returns the positions that landed, and whether the tier's write-back
        has fallen behind (more than its low watermark's worth only it holds).
        """
        lv = self._levels[level]
        landed = []
        with self._guard.locked():
            for i, (key, entry, ok) in enumerate(zip(keys, entries, done, strict=True)):
                if not ok:
                    lv.resident -= 1
                    continue
                self._index.note_copy(key, entry, lv.bit)
                if entry.state == WRITING:
                    self._index.set_state(entry, READY)
                lv.policy.insert(key)
                landed.append(i)
            self._guard.notify()
            return landed, lv.writes_back_ahead and len(lv.dirty) > lv.marks.low

    # -- eviction -----------------------------------------------------------------
    def _victim_finder(self, level: int) -> Callable[[int], Victims]:
        lv = self._levels[level]
        return lambda n: pick_victims(
            lv, n, self._index, self._placement, self._heat, self._retained
        )

    def take_victims(self, level: int, n: int) -> Victims:
        """Exactly ``n`` unpinned blocks of tier ``level``, pinned and counted as
        leaving, or :class:`CapacityError` (changing nothing)."""
        lv = self._levels[level]
        with self._guard.locked():
            self._guard.check_open()
            self._pins(None, 0)
            victims = pick_victims(lv, n, self._index, self._placement, self._heat, self._retained)
            if len(victims) < n:
                raise CapacityError(
                    f"cannot evict {n} blocks from tier {level} ({lv.kind}): "
                    f"only {len(victims)} are unpinned"
                )
            claim(lv, victims)
            return victims

    def take_keys(self, level: int, keys: Sequence[BlockKey]) -> Victims:
        """Those of ``keys`` that tier ``level`` holds readable, pinned and counted as
        leaving (the victims of a demotion a session hint asked for). Copies and reads
        in flight are waited for (up to ``_TAKE_WAIT_S``; blocks still in use then
        stay), and the victims are chosen and claimed at once, after the wait.

        Chosen one by one across the waits, a block picked before the wait could be
        claimed meanwhile by another eviction (of another tier: a disk's) and then be
        claimed a second time here: each eviction then waits, in ``drop_victims``, for
        the other's pin to drop, forever, and every put waiting for room behind them
        (``wait_room``) times out, so a kvstore-server stops answering.
        """
        lv, bit = self._levels[level], 1 << level
        unique = list(dict.fromkeys(keys))
        deadline = time.monotonic() + _TAKE_WAIT_S
        with self._guard.locked():
            self._guard.check_open()
            while True:
                self._pins(None, 0)  # expired leases end
                held = [(k, e) for k in unique if (e := self._index.get(k)) is not None]
                held = [(k, e) for k, e in held if e.state == READY and e.tiers & bit]
                busy = any(e.pins for _, e in held)
                if not busy or time.monotonic() >= deadline or self._guard.closed:
                    break
                self._guard.wait(0.05)  # nothing claimed while waiting
            victims = [(k, e) for k, e in held if not e.pins]
            claim(lv, victims)
            return victims

    def excess_victims(self, level: int, most: int) -> Victims:
        """Up to ``most`` victims that bring tier ``level`` from above its high watermark
        down to its low one (pinned, counted as leaving); none when it is not above."""
        lv = self._levels[level]
        with self._guard.locked():
            staying = lv.resident - lv.leaving
            if self._guard.closed or staying <= lv.marks.high:
                return []
            self._pins(None, 0)
            victims = pick_victims(
                lv,
                min(most, staying - lv.marks.low),
                self._index,
                self._placement,
                self._heat,
                self._retained,
            )
            claim(lv, victims)
            return victims

    def without_copy_below(self, level: int, victims: Victims) -> Victims:
        """The victims no tier after ``level`` holds (they must be demoted to stay)."""
        below = self._levels[level].below
        with self._guard.locked():
            return [(k, e) for k, e in victims if not e.tiers & below]

    def drop_victims(self, level: int, victims: Victims, demoted: set[BlockKey]) -> list[BlockKey]:
        """Take tier ``level``'s copies of pinned ``victims`` off the books, once their
        other readers are done; returns the keys whose copy was dropped."""
        lv = self._levels[level]
        dropped: list[BlockKey] = []
        with self._guard.locked():
            for key, entry in victims:
                self._pins(entry, 1)  # readers of this copy finish first
                if self._index.begin_drop(lv, key, entry):
                    dropped.append(key)
                if key in demoted:
                    self._counters.demotions[level] += 1
                if not entry.tiers:
                    self._index.set_state(entry, DELETING)
            self._counters.evictions[level] += len(victims)
        return dropped

    def end_eviction(self, level: int, victims: Victims, dropped: Sequence[BlockKey]) -> None:
        """The tier deleted the evicted copies: give their room back, unpin, forget
        blocks left with no copy."""
        lv = self._levels[level]
        with self._guard.locked():
            self._index.end_drop(lv, dropped)
            lv.leaving -= len(victims)
            for key, entry in victims:
                entry.pins -= 1
                if not entry.tiers and self._index.remove(key, entry):
                    self._counters.blocks_dropped += 1
            self._guard.notify()

    # -- write-back ---------------------------------------------------------------
    def pick_dirty(self, level: int, batch: int, tried: set[BlockKey]) -> Victims:
        """Up to ``batch`` blocks only tier ``level`` holds to write back now, pinned
        (see :func:`kvstore.datapath.room.pick_dirty`); none while closing."""
        with self._guard.locked():
            if self._guard.closing:
                return []
            return pick_dirty(
                self._levels[level], batch, tried, self._index, self._admits(level + 1)
            )

    def _admits(self, level: int) -> Callable[[Entry], bool]:
        return lambda entry: self._placement.admits(level, self._heat.heat(entry))
