"""The block manager: the index, pins, placement, eviction and demotion.

The manager knows, for every stored key, which tiers hold a copy (a bit per
tier), how many operations pin it, how hot it is, and whether it is being
written, readable, or being deleted. Tiers only move bytes; every decision is
made here (with the rules of :mod:`kvstore.policy.placement`).

Lock ownership: ``_cond`` (a :class:`threading.Condition`) is owned by the
manager and guards ``_index``, every :class:`~kvstore.index.Level`'s
``resident`` count and eviction policy, the leases, the pending layerwise
writes and the counters. Tier I/O never runs while it is held: an operation
pins its blocks under the lock, copies with the lock released, and unpins
under the lock. A copy is only freed when its block has no pins other than
the freeing operation's own (the freer waits on ``_cond``), so a block being
read or written is never evicted or deleted under a reader.

Placement: a new block goes to the first tier that admits it and has (or can
make) room. Making room evicts just what is needed, synchronously; bringing
a tier that passed its high watermark down to its low one happens in the
background (:mod:`kvstore.mover`), as do write-through copies and promotions.
Eviction demotes a block to the next tier unless it already has a copy
further down. ``evict(n)`` frees exactly ``n`` blocks or none.

Write-back ahead of eviction: a write-back memory tier in front of a local
disk keeps at most its low watermark's worth of blocks that only it holds;
past that, the least recently used are copied to the disk in the background.
Evictions take those first too, so they find them on disk already and free
their room without waiting for it: a put does not block on the disk unless it
outruns it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore import lending, reads
from kvstore.config import StoreConfig
from kvstore.discovery import adopt_persistent, discover
from kvstore.discovery import recheck as recheck_shared
from kvstore.errors import CapacityError, ClosedError, TierError
from kvstore.index import (
    DELETING,
    READY,
    WRITING,
    ChangeFeed,
    Entry,
    HeatClock,
    Level,
    ManagerCounters,
    Move,
)
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.leases import Lease, LeaseTable
from kvstore.lending import Loan, PendingPut
from kvstore.mover import Mover
from kvstore.moves import Migrations
from kvstore.policy import Watermarks, make_policy
from kvstore.policy.placement import Placement, TierRules
from kvstore.prefetch import LayerWrites, Prefetcher, PrefetchHandle
from kvstore.progress import FlushProgress
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["BlockManager", "ManagerCounters"]

log = logging.getLogger(__name__)

Victims = list[tuple[BlockKey, Entry]]


class BlockManager:
    """Index and movement of blocks across an ordered list of tiers (fastest first)."""

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers:
            raise ValueError("a block manager needs at least one tier")
        self.layout = layout
        self.config = config or StoreConfig(tiers=tuple(t.config for t in tiers))
        self.clock = clock
        self.placement = Placement([TierRules.of(t.config) for t in tiers], self.config.replication)
        self._levels = [_level(i, tier, clock) for i, tier in enumerate(tiers)]
        for upper, lower in itertools.pairwise(self._levels):
            upper.writes_back_ahead = _writes_back_ahead(upper, lower)
        self._write_back_levels = [lv for lv in self._levels if lv.writes_back_ahead]
        self.heat = HeatClock(
            self.config.replication.half_life_s, self._half_life_accesses(), clock
        )
        self._persistent = sum(lv.bit for lv in self._levels if lv.tier.persistent)
        self._local = sum(lv.bit for lv in self._levels if lv.tier.local)
        #: Changes of what local tiers hold, for a watcher (None until :meth:`watch`).
        self.changes: ChangeFeed | None = None
        self._index: dict[BlockKey, Entry] = {}
        self._cond = threading.Condition(threading.Lock())
        self._leases = LeaseTable(clock)
        self._closed = False
        self._closing = False  # close() has begun: background write-back stops early
        #: What close() wrote to the persistent tier: bytes, bytes_written, seconds.
        self.close_flush: dict[str, Any] | None = None
        self._mover = Mover(self.config.mover_threads)
        self._moves = Migrations(self)
        self._layer_writes = LayerWrites(self)
        self._prefetcher = Prefetcher(self, self.config.prefetch)
        self.counters = ManagerCounters.for_tiers(len(tiers))
        adopt_persistent(self)

    def _half_life_accesses(self) -> int:
        configured = self.config.replication.half_life_accesses
        if configured:
            return configured
        memory = sum(lv.marks.capacity for lv in self._levels if not lv.tier.persistent)
        return max(1024, 2 * memory)

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return [level.tier for level in self._levels]

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")

    # -- queries ------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], recheck: bool = False) -> int:
        """Number of leading ``keys`` that are stored and readable.

        With ``recheck``, blocks held only in shared tiers are confirmed with
        those tiers first (another process may have evicted them).
        """
        with self._cond:
            self._check_open()
            n = self._leading(keys)
        if n < len(keys) and discover(self, keys[n:]):
            with self._cond:
                n = self._leading(keys)
        if recheck and n:
            n = recheck_shared(self, keys[:n])
        with self._cond:
            self.counters.lookups += 1
            self.counters.lookup_blocks_hit += n
            self.counters.lookup_blocks_missed += len(keys) - n
        return n

    def _leading(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys indexed and readable. Called with the lock held."""
        n = 0
        for key in keys:
            entry = self._index.get(key)
            if entry is None or entry.state != READY:
                break
            n += 1
        return n

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored and readable."""
        with self._cond:
            self._check_open()
            entry = self._index.get(key)
            return entry is not None and entry.state == READY

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` are readable, after asking shared tiers about missing ones."""
        with self._cond:
            self._check_open()
            n = self._leading(keys)
        if n < len(keys):
            discover(self, keys[n:])
        with self._cond:
            return [(e := self._index.get(k)) is not None and e.state == READY for k in keys]

    def where(self, key: BlockKey) -> list[int]:
        """Indexes of the tiers holding a copy of ``key`` (fastest first)."""
        with self._cond:
            entry = self._index.get(key)
            if entry is None or entry.state != READY:
                return []
            return [lv.index for lv in self._levels if entry.tiers & lv.bit]

    def heat_of(self, key: BlockKey) -> int:
        """The decayed access count of ``key`` (0 if not stored)."""
        with self._cond:
            entry = self._index.get(key)
            return 0 if entry is None else self.heat.heat(entry)

    def __len__(self) -> int:
        with self._cond:
            return sum(1 for e in self._index.values() if e.state == READY)

    # -- put ----------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; return how many of the keys are stored.

        Keys already stored are not written again (same key, same content).
        Blocks that fit in no tier are not stored.
        """
        fresh: list[Move] = []
        present = 0
        with self._cond:
            self._check_open()
            self.counters.puts += 1
            seen: set[BlockKey] = set()
            for key, block in zip(keys, blocks, strict=True):
                if key in seen:
                    continue
                seen.add(key)
                entry = self._index.get(key)
                if entry is None:
                    entry = self._index[key] = Entry(WRITING, pins=1)
                    self.heat.touch(entry)
                    fresh.append(Move(key, entry, block))
                elif entry.state == READY:
                    present += 1
                    self._touch(key, entry)
                # WRITING: a concurrent put of the same content; DELETING: the delete wins.
        left = self._place(0, fresh) if fresh else []
        with self._cond:
            self._unpin([m.entry for m in fresh])
            self._drop_unwritten(left)
            self.counters.blocks_stored += len(fresh) - len(left)
            self.counters.blocks_already_present += present
            self.counters.blocks_not_stored += len(left)
        return present + len(fresh) - len(left)

    def _drop_unwritten(self, moves: list[Move]) -> None:
        """Forget new entries that no tier took. Called with the lock held."""
        for move in moves:
            if move.entry.state == WRITING and self._index.get(move.key) is move.entry:
                del self._index[move.key]

    def _place(self, start: int, moves: list[Move], stop: int | None = None) -> list[Move]:
        """Write ``moves`` into the first tiers from ``start`` that admit them and
        have room; return the moves no tier took, in their original order."""
        pending = moves
        for level in self._levels[start:stop]:
            if not pending:
                break
            with self._cond:
                admitted = self._admitted(level, pending)
                grant, victims = self._reserve(level, len(admitted)) if admitted else (0, [])
            if victims:
                self._moves.evict_victims(level, victims)
            batch = admitted[:grant]
            if batch:
                self._wait_room(level)
                placed = self._commit_writes(level, batch, self._write(level, batch))
                pending = [m for m in pending if id(m) not in placed]
        return pending

    def _admitted(self, level: Level, moves: list[Move]) -> list[Move]:
        """The moves ``level`` takes now: its admission rule, and no key whose delete
        from it is still in flight. Called with the lock held."""
        free = [m for m in moves if not m.entry.dropping & level.bit]
        admitted = [m for m in free if self.placement.admits(level.index, self.heat.heat(m.entry))]
        self.counters.admission_rejects[level.index] += len(free) - len(admitted)
        return admitted

    def _commit_writes(self, level: Level, batch: list[Move], done: list[bool]) -> set[int]:
        """Publish the copies a tier wrote; release the room of the others.

        Returns the ids of the moves that landed.
        """
        landed: list[Move] = []
        with self._cond:
            for move, ok in zip(batch, done, strict=True):
                if not ok:
                    level.resident -= 1
                    continue
                self.note_copy(move.key, move.entry, level.bit)
                if move.entry.state == WRITING:
                    move.entry.state = READY
                level.policy.insert(move.key)
                landed.append(move)
            behind = level.writes_back_ahead and len(level.dirty) > level.marks.low
        target = self.placement.write_through_target(level.index)
        if landed and target is not None:
            self._moves.copy_down_later([m.key for m in landed], level.index, target)
        if behind:
            self._moves.write_back_later(level)
        return {id(m) for m in landed}

    def _reserve(self, level: Level, n: int) -> tuple[int, Victims]:
        """Reserve room for up to ``n`` blocks in ``level``; pick (and pin) the victims
        that must go first. Called with the lock held.

        Only the room needed now is freed on the caller's path; if the tier
        passes its high watermark, a background job brings it down to the low one.
        """
        must, _ = level.marks.plan(level.resident, n)
        # Copies already on their way out will free room too: pick only the rest.
        need = max(0, must - level.leaving)
        victims = self._moves.pick_victims(level, need) if need else []
        short = need - len(victims)
        grant = max(0, n - short)
        for _, entry in victims:
            entry.pins += 1
        level.leaving += len(victims)
        level.resident += grant
        if level.resident - level.leaving > level.marks.high:
            self._moves.evict_down_later(level)
        return grant, victims

    def _tier_failed(self, level: Level, what: str, count: int, exc: Exception) -> None:
        """Count a tier call that raised; a dead medium is expected, a bug is not."""
        if isinstance(exc, TierError):
            log.warning(
                "tier %s unavailable (%s of %d blocks): %s", level.tier.kind, what, count, exc
            )
        else:
            log.error("tier %s failed to %s %d blocks", level.tier.kind, what, count, exc_info=exc)
        with self._cond:
            self.counters.tier_errors += 1

    def _write(self, level: Level, batch: list[Move]) -> list[bool]:
        start = time.perf_counter()
        try:
            done = level.tier.put([m.key for m in batch], [m.src for m in batch])
        except Exception as exc:  # a failing tier is a miss, never a crash
            self._tier_failed(level, "store", len(batch), exc)
            return [False] * len(batch)
        elapsed = time.perf_counter() - start
        with self._cond:
            self.counters.bytes_written += sum(done) * self.layout.block_nbytes
            self.counters.write_seconds += elapsed
        return done

    # -- eviction -----------------------------------------------------------
    def evict(self, tier_index: int, n: int) -> list[BlockKey]:
        """Evict exactly ``n`` unpinned blocks from tier ``tier_index``, or none.

        Raises :class:`CapacityError` (changing nothing) when fewer than ``n``
        blocks can be evicted.
        """
        level = self._levels[tier_index]
        with self._cond:
            self._check_open()
            victims = self._moves.pick_victims(level, n)
            if len(victims) < n:
                raise CapacityError(
                    f"cannot evict {n} blocks from tier {tier_index} ({level.tier.kind}): "
                    f"only {len(victims)} are unpinned"
                )
            for _, entry in victims:
                entry.pins += 1
            level.leaving += n
        self._moves.evict_victims(level, victims)
        return [key for key, _ in victims]

    def _tier_delete(self, level: Level, keys: list[BlockKey]) -> None:
        if not keys:
            return
        try:
            level.tier.delete(keys)
        except Exception as exc:
            self._tier_failed(level, "delete", len(keys), exc)

    # -- get ----------------------------------------------------------------
    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
        prefix: bool = False,
    ) -> int:
        """Copy blocks into ``outs``; return how many leading blocks were loaded.

        With ``prefix=False`` every key must be stored, else
        :class:`BlockNotFoundError` is raised. With ``prefix=True`` the
        longest loadable prefix is loaded and its length returned; ``outs``
        past it hold unspecified data.
        """
        return reads.load(self, keys, outs, layers, prefix)

    def _pin_leading(self, keys: Sequence[BlockKey]) -> list[Entry]:
        """Pin (and touch) the leading readable entries. Called with the lock held."""
        entries: list[Entry] = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None or entry.state != READY:
                break
            entry.pins += 1
            self._touch(key, entry)
            entries.append(entry)
        return entries

    def read(
        self,
        keys: Sequence[BlockKey],
        entries: list[Entry],
        outs: Sequence[torch.Tensor],
        layers: LayerRange,
    ) -> list[bool]:
        """Read each *pinned* entry from its fastest copy, falling back to slower ones."""
        return reads.read(self, keys, entries, outs, layers)

    # -- delete -------------------------------------------------------------
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys`` from every tier; return how many were stored."""
        with self._cond:
            self._check_open()
            targets: Victims = []
            for key in dict.fromkeys(keys):
                entry = self._index.get(key)
                if entry is not None and entry.state == READY:
                    entry.state = DELETING
                    targets.append((key, entry))
            for _, entry in targets:
                self._wait_pins(entry, 0)
            groups: dict[int, Victims] = {}
            for key, entry in targets:
                for level in self._levels:
                    if self._begin_drop(level, key, entry):
                        groups.setdefault(level.index, []).append((key, entry))
        for lvl, dropped in groups.items():
            self._tier_delete(self._levels[lvl], [key for key, _ in dropped])
        with self._cond:
            for lvl, dropped in groups.items():
                self._end_drop(self._levels[lvl], [entry for _, entry in dropped])
            for key, entry in targets:
                if self._index.get(key) is entry:
                    del self._index[key]
            self.counters.blocks_deleted += len(targets)
            self._cond.notify_all()
        return len(targets)

    # -- leases -------------------------------------------------------------
    def pin(self, keys: Sequence[BlockKey], duration: float | None = None) -> Lease:
        """Pin the leading stored ``keys`` under a lease of ``duration`` seconds
        (``config.lease_s`` by default); ``len(lease.entries)`` is how many."""
        with self._cond:
            self._check_open()
            self._reap_leases()
            entries = self._pin_leading(keys)
            return self._leases.add(entries, duration or self.config.lease_s)

    def renew(self, lease: Lease, duration: float | None = None) -> bool:
        """Extend a lease; False if it already ended (released or expired)."""
        with self._cond:
            return self._leases.renew(lease, duration or self.config.lease_s)

    def release(self, lease: Lease) -> None:
        """End a lease (idempotent)."""
        with self._cond:
            self._unpin(self._leases.release(lease))

    def _reap_leases(self) -> None:
        """End expired leases and abandoned layerwise writes. Called with the lock held."""
        for lease in self._leases.expired():
            self.counters.leases_expired += 1
            self._unpin(lease.entries)
        self._layer_writes._reap()

    # -- layer by layer -----------------------------------------------------
    def prefetch(
        self, keys: Sequence[BlockKey], views: list[torch.Tensor], order: str, step: int
    ) -> PrefetchHandle:
        """Start loading the stored prefix of ``keys`` into block ``views`` (see prefetch.py)."""
        with self._cond:
            self._check_open()
        if len(views) < len(keys):
            raise ValueError("one view per key")
        discover(self, keys)  # blocks other processes wrote count as stored
        return self._prefetcher.start(keys, views, order, step)

    def lend(self, keys: Sequence[BlockKey], duration: float | None = None) -> Loan:
        """Pin the stored ``keys`` for zero-copy reads of their memory (see lending.py)."""
        return lending.lend(self, keys, duration)

    def begin_put(self, keys: Sequence[BlockKey]) -> PendingPut:
        """Reserve room for new blocks to be filled in place (see lending.py)."""
        return PendingPut(self, keys)

    def persist(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Write ``keys`` to the first persistent tier now; which are there afterwards."""
        return self._moves.persist(list(keys))

    def stored_keys(self, local: bool = False) -> list[BlockKey]:
        """Every readable key the index knows (after :func:`~kvstore.discovery.rescan`:
        also what other processes stored in persistent tiers); with ``local``, only
        those with a copy in a tier of this machine (memory, local disk)."""
        mask = self._local if local else -1
        with self._cond:
            return [k for k, e in self._index.items() if e.state == READY and e.tiers & mask]

    def promote(self, keys: Sequence[BlockKey], tier: int = 0) -> int:
        """Copy ``keys`` into tier ``tier`` now (where they are stored and not there yet);
        how many were copied."""
        return self._moves.promote_now(list(keys), tier)

    def abort_layers(self, keys: Sequence[BlockKey]) -> int:
        """Give up unfinished layerwise writes of ``keys``; return how many."""
        with self._cond:
            return self._layer_writes.abort_keys(keys)

    def write_layer(
        self, keys: Sequence[BlockKey], layer: int, srcs: Sequence[torch.Tensor]
    ) -> int:
        """Write one layer of each block; return how many blocks this completed."""
        return self._layer_writes.write(keys, layer, srcs)

    def _wait_room(self, level: Level, timeout: float = 30.0) -> None:
        """Wait until evictions in flight have freed the room a grant counted on.

        ``resident`` includes copies still being deleted; once it is within
        capacity, every granted write has a free slot. Bounded: a stalled
        medium makes the writes fail (a miss), not the caller hang.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while level.resident > level.marks.capacity and level.leaving:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(timeout=min(left, 0.05))

    def _wait_pins(self, entry: Entry, allowed: int) -> None:
        """Wait (lock held, released while waiting) until ``entry`` has ``allowed`` pins."""
        while entry.pins > allowed:
            self._reap_leases()
            if entry.pins > allowed:
                self._cond.wait(timeout=0.05)  # wakes for lease expiry as well as unpins

    # -- helpers ------------------------------------------------------------
    def _begin_drop(self, level: Level, key: BlockKey, entry: Entry) -> bool:
        """Take ``level``'s copy of ``key`` off the books; False if it had none.

        The one place a tier bit is cleared. The copy's room still counts in
        ``resident``, and nothing may write ``key`` into ``level``
        (``entry.dropping``), until :meth:`_end_drop` -- after the tier has
        really deleted it -- so no put is granted room the medium has not
        freed, and no promotion lands a copy that the delete then removes.
        Called with the lock held.
        """
        if not entry.tiers & level.bit:
            return False
        before = entry.tiers
        entry.tiers &= ~level.bit
        if self._write_back_levels:
            self._moves.track_copies(key, before, entry.tiers)
        if self.changes is not None and level.bit & self._local and not entry.tiers & self._local:
            self.changes.record(key, False)
        entry.dropping |= level.bit
        level.policy.remove(key)
        return True

    def note_copy(self, key: BlockKey, entry: Entry, bit: int) -> None:
        """Record a new copy of ``key`` in the tier of ``bit``. Called with the lock held."""
        if self.changes is not None and bit & self._local and not entry.tiers & self._local:
            self.changes.record(key, True)
        before = entry.tiers
        entry.tiers |= bit
        if self._write_back_levels:
            self._moves.track_copies(key, before, entry.tiers)

    def watch(self) -> ChangeFeed:
        """Start recording which keys gain or lose their copies in local tiers."""
        with self._cond:
            if self.changes is None:
                self.changes = ChangeFeed()
            return self.changes

    def _end_drop(self, level: Level, entries: list[Entry]) -> None:
        """The tier deleted these copies: give their room back. Called with the lock held."""
        for entry in entries:
            entry.dropping &= ~level.bit
        level.resident -= len(entries)
        self._cond.notify_all()

    def _touch(self, key: BlockKey, entry: Entry) -> None:
        self.heat.touch(entry)
        for level in self._levels:
            if entry.tiers & level.bit:
                level.policy.touch(key)
        for level in self._write_back_levels:  # written back least recently used first
            if key in level.dirty:
                level.dirty.move_to_end(key)

    def _unpin(self, entries: list[Entry]) -> None:
        for entry in entries:
            entry.pins -= 1
        self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def pinned_blocks(self) -> int:
        """Blocks pinned right now (for tests and leak checks)."""
        with self._cond:
            self._reap_leases()
            return sum(1 for e in self._index.values() if e.pins)

    def flush(self, progress: FlushProgress | None = None) -> int:
        """Finish background moves, then copy every block that only memory tiers
        hold into the first persistent tier; return how many were written.

        After ``flush`` (and so after :meth:`close`) every stored block is on a
        medium that outlives the process, unless no persistent tier had room
        or admitted it. ``progress`` is told the bytes to write and written.
        """
        return self._moves.flush(progress=progress)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for background moves (write-through, promotions, evictions) to finish."""
        return self._mover.drain(timeout)

    def close(self) -> None:
        """Finish background moves, persist what only memory holds, end every
        lease, wait for operations in flight, close every tier. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
        for level in self._levels:
            try:
                level.tier.prepare_close()
            except Exception:  # an optimisation of the flush: never a reason to fail
                log.exception("tier %s failed to prepare for close", level.tier.kind)
        progress = FlushProgress()
        try:
            self.flush(progress=progress)
        except Exception:  # closing must not fail because a tier did
            log.exception("flush at close failed")
        self.close_flush = progress.summary()
        self._prefetcher.close()
        self._mover.close()
        with self._cond:
            self._closed = True
            self._layer_writes.abort_all()
            for lease in self._leases.expired_all():
                self._unpin(lease.entries)
            while any(e.pins for e in self._index.values()):
                self._cond.wait()
        for level in self._levels:
            try:
                level.tier.close()
            except Exception:
                log.exception("tier %s failed to close", level.tier.kind)


def _writes_back_ahead(upper: Level, lower: Level) -> bool:
    """Whether ``upper`` copies blocks down ahead of eviction: a write-back memory
    tier right in front of a local persistent one (a host tier over a disk)."""
    memory = not upper.tier.persistent and upper.tier.local
    disk = lower.tier.persistent and lower.tier.local
    return memory and disk and not upper.rules.write_through


def _level(index: int, tier: Tier, clock: Callable[[], float]) -> Level:
    config = tier.config
    capacity = tier.capacity_blocks
    return Level(
        index=index,
        tier=tier,
        marks=Watermarks.of(capacity, config.high_watermark, config.low_watermark),
        policy=make_policy(config.policy, capacity, clock),
        rules=TierRules.of(config),
    )
