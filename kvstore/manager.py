"""The block manager: the index, pins, placement, eviction and demotion.

The manager knows, for every stored key, which tiers hold a copy (a bit per
tier), how many operations pin it, and whether it is being written, readable,
or being deleted. Tiers only move bytes; every decision is made here.

Lock ownership: ``_cond`` (a :class:`threading.Condition`) is owned by the
manager and guards ``_index``, every :class:`_Level`'s ``resident`` count and
eviction policy, and the counters. Tier I/O never runs while it is held:
an operation pins its blocks under the lock, copies with the lock released,
and unpins under the lock. A copy is only freed when its block has no pins
other than the freeing operation's own (the freer waits on ``_cond``), so a
block being read or written is never evicted or deleted under a reader.

Placement: a new block goes to the first tier that has (or can make) room;
making room evicts the policy's candidates down to the low watermark,
demoting each to the next tier unless it already has a copy further down.
``evict(n)`` frees exactly ``n`` blocks or none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import BlockNotFoundError, CapacityError, ClosedError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.policy import EvictionPolicy, Watermarks, make_policy
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["BlockManager", "ManagerCounters"]

log = logging.getLogger(__name__)

WRITING, READY, DELETING = 0, 1, 2


class _Entry:
    """Index entry of one key. Mutated only under the manager's lock."""

    __slots__ = ("leaving", "pins", "state", "tiers")

    def __init__(self, state: int, pins: int = 0, tiers: int = 0) -> None:
        self.state = state
        self.pins = pins
        self.tiers = tiers  # bit i: tier i holds a copy
        self.leaving = 0  # bit i: an evictor already took this copy out of tier i's count


@dataclass
class _Level:
    """The manager's bookkeeping for one tier."""

    index: int
    tier: Tier
    marks: Watermarks
    policy: EvictionPolicy
    # Copies held, plus room reserved for writes in flight, minus copies an
    # evictor is already moving out (their entries have this level's bit in
    # ``leaving``). Planning uses it; ``len(policy)`` is the exact count held.
    resident: int = 0

    @property
    def bit(self) -> int:
        return 1 << self.index


@dataclass
class _Move:
    """A block on its way into a tier: its key, entry and source tensor."""

    key: BlockKey
    entry: _Entry
    src: torch.Tensor


@dataclass
class ManagerCounters:
    """Cumulative counters (guarded by the manager's lock)."""

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
    blocks_dropped: int = 0
    copies_lost: int = 0
    tier_errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


class BlockManager:
    """Index and movement of blocks across an ordered list of tiers."""

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[Tier],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers:
            raise ValueError("a block manager needs at least one tier")
        self.layout = layout
        self._levels = [
            _Level(
                index=i,
                tier=tier,
                marks=Watermarks.of(
                    tier.capacity_blocks, tier.config.high_watermark, tier.config.low_watermark
                ),
                policy=make_policy(tier.config.policy, tier.capacity_blocks, clock),
            )
            for i, tier in enumerate(tiers)
        ]
        self._index: dict[BlockKey, _Entry] = {}
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self.counters = ManagerCounters(evictions=[0] * len(tiers), demotions=[0] * len(tiers))
        self._adopt_persistent()

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return [level.tier for level in self._levels]

    def _adopt_persistent(self) -> None:
        """Index the blocks a persistent tier already holds (a restart)."""
        for level in self._levels:
            if not level.tier.persistent:
                continue
            for key in level.tier.stored_keys():
                self._adopt(key, level.bit)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")

    # -- queries ------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` that are stored and readable."""
        with self._cond:
            self._check_open()
            n = self._leading(keys)
        if n < len(keys) and self._discover(keys[n:]):
            with self._cond:
                n = self._leading(keys)
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

    def _discover(self, keys: Sequence[BlockKey], batch: int = 16) -> int:
        """Index the leading ``keys`` that shared tiers hold but the index lacks.

        Other processes may have written them (a reader sharing a disk
        directory). Probes in small batches and stops at the first key no
        shared tier has, so a miss costs one batch of existence checks.
        """
        shared = [lv for lv in self._levels if lv.tier.shared]
        adopted = 0
        for start in range(0, len(keys) if shared else 0, batch):
            chunk = list(keys[start : start + batch])
            found = [0] * len(chunk)
            for level in shared:
                for i, present in enumerate(self._tier_contains(level, chunk)):
                    found[i] |= level.bit if present else 0
            run = next((i for i, bits in enumerate(found) if not bits), len(chunk))
            with self._cond:
                for key, bits in zip(chunk[:run], found[:run], strict=True):
                    self._adopt(key, bits)
            adopted += run
            if run < len(chunk):
                break
        return adopted

    def _tier_contains(self, level: _Level, keys: list[BlockKey]) -> list[bool]:
        try:
            return level.tier.contains(keys)
        except Exception:
            log.exception("tier %s failed an existence check", level.tier.kind)
            with self._cond:
                self.counters.tier_errors += 1
            return [False] * len(keys)

    def _adopt(self, key: BlockKey, bits: int) -> None:
        """Record copies of ``key`` found in the tiers of ``bits``. Called with the lock held."""
        entry = self._index.get(key)
        if entry is None:
            entry = self._index[key] = _Entry(READY)
        elif entry.state != READY:
            return
        for level in self._levels:
            if bits & level.bit and not entry.tiers & level.bit:
                entry.tiers |= level.bit
                level.policy.insert(key)
                level.resident += 1

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored and readable."""
        with self._cond:
            self._check_open()
            entry = self._index.get(key)
            return entry is not None and entry.state == READY

    def where(self, key: BlockKey) -> list[int]:
        """Indexes of the tiers holding a copy of ``key`` (fastest first)."""
        with self._cond:
            entry = self._index.get(key)
            if entry is None or entry.state != READY:
                return []
            return [lv.index for lv in self._levels if entry.tiers & lv.bit]

    def __len__(self) -> int:
        with self._cond:
            return sum(1 for e in self._index.values() if e.state == READY)

    # -- put ----------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; return how many of the keys are stored.

        Keys already stored are not written again (same key, same content).
        Blocks that fit in no tier are not stored.
        """
        fresh: list[_Move] = []
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
                    entry = self._index[key] = _Entry(WRITING, pins=1)
                    fresh.append(_Move(key, entry, block))
                elif entry.state == READY:
                    present += 1
                    self._touch(key, entry)
                # WRITING: a concurrent put of the same content; DELETING: the delete wins.
        left = self._place(0, fresh) if fresh else []
        with self._cond:
            for move in fresh:
                move.entry.pins -= 1
            for move in left:
                if self._index.get(move.key) is move.entry:
                    del self._index[move.key]
            self.counters.blocks_stored += len(fresh) - len(left)
            self.counters.blocks_already_present += present
            self.counters.blocks_not_stored += len(left)
            self._cond.notify_all()
        return present + len(fresh) - len(left)

    def _place(self, start: int, moves: list[_Move]) -> list[_Move]:
        """Write ``moves`` into the first tiers from ``start`` with room; return the rest."""
        pending = moves
        for level in self._levels[start:]:
            if not pending:
                break
            with self._cond:
                grant, victims = self._reserve(level, len(pending))
            if victims:
                self._evict_victims(level, victims)
            batch, pending = pending[:grant], pending[grant:]
            if not batch:
                continue
            done = self._write(level, batch)
            with self._cond:
                for move, ok in zip(batch, done, strict=True):
                    if ok:
                        move.entry.tiers |= level.bit
                        if move.entry.state == WRITING:
                            move.entry.state = READY
                        level.policy.insert(move.key)
                    else:
                        level.resident -= 1
            pending = [m for m, ok in zip(batch, done, strict=True) if not ok] + pending
        return pending

    def _reserve(self, level: _Level, n: int) -> tuple[int, list[tuple[BlockKey, _Entry]]]:
        """Reserve room for up to ``n`` blocks in ``level``; pick (and pin) victims.

        Returns how many blocks were granted room and the victims that must be
        evicted first. Called with the lock held.
        """
        must, want = level.marks.plan(level.resident, n)
        victims = self._pick_victims(level, want) if want else []
        grant = n if len(victims) >= must else n - (must - len(victims))
        for _, entry in victims:
            entry.pins += 1
            entry.leaving |= level.bit
        level.resident += grant - len(victims)
        return grant, victims

    def _pick_victims(self, level: _Level, n: int) -> list[tuple[BlockKey, _Entry]]:
        victims: list[tuple[BlockKey, _Entry]] = []
        for key in level.policy.candidates():
            if len(victims) >= n:
                break
            entry = self._index.get(key)
            if entry is not None and entry.pins == 0 and entry.state == READY:
                victims.append((key, entry))
        return victims

    def _write(self, level: _Level, batch: list[_Move]) -> list[bool]:
        start = time.perf_counter()
        try:
            done = level.tier.put([m.key for m in batch], [m.src for m in batch])
        except Exception:  # a failing tier is a miss, never a crash
            log.exception("tier %s failed to store %d blocks", level.tier.kind, len(batch))
            with self._cond:
                self.counters.tier_errors += 1
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
            victims = self._pick_victims(level, n)
            if len(victims) < n:
                raise CapacityError(
                    f"cannot evict {n} blocks from tier {tier_index} ({level.tier.kind}): "
                    f"only {len(victims)} are unpinned"
                )
            for _, entry in victims:
                entry.pins += 1
                entry.leaving |= level.bit
            level.resident -= n
        self._evict_victims(level, victims)
        return [key for key, _ in victims]

    def _evict_victims(self, level: _Level, victims: list[tuple[BlockKey, _Entry]]) -> None:
        """Demote (or drop) pinned ``victims`` out of ``level`` and unpin them.

        The caller already took the victims out of ``level.resident``.
        """
        below = ~((level.bit << 1) - 1)
        moves = [
            _Move(key, entry, src)
            for key, entry in victims
            if not entry.tiers & below and (src := self._source(level, key)) is not None
        ]
        placed = set()
        if moves and level.index + 1 < len(self._levels):
            left = {id(m) for m in self._place(level.index + 1, moves)}
            placed = {m.key for m in moves if id(m) not in left}
        with self._cond:
            for key, entry in victims:
                while entry.pins > 1:  # readers of this copy finish first
                    self._cond.wait()
                self._forget_copy(level, key, entry)
                if key in placed:
                    self.counters.demotions[level.index] += 1
                if not entry.tiers:
                    entry.state = DELETING
            self.counters.evictions[level.index] += len(victims)
        self._tier_delete(level, [key for key, _ in victims])
        with self._cond:
            for key, entry in victims:
                entry.pins -= 1
                if not entry.tiers and self._index.get(key) is entry:
                    del self._index[key]
                    self.counters.blocks_dropped += 1
            self._cond.notify_all()

    def _source(self, level: _Level, key: BlockKey) -> torch.Tensor | None:
        """The bytes of ``key`` in ``level`` as a tensor (zero-copy where possible)."""
        view = level.tier.view(key)
        if view is not None:
            return view
        staging = torch.empty(self.layout.block_shape, dtype=self.layout.dtype)
        try:
            ok = level.tier.get([key], [staging])[0]
        except Exception:
            log.exception("tier %s failed to read a block for demotion", level.tier.kind)
            ok = False
        return staging if ok else None

    def _tier_delete(self, level: _Level, keys: list[BlockKey]) -> None:
        if not keys:
            return
        try:
            level.tier.delete(keys)
        except Exception:
            log.exception("tier %s failed to delete %d blocks", level.tier.kind, len(keys))
            with self._cond:
                self.counters.tier_errors += 1

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
        with self._cond:
            self._check_open()
            self.counters.gets += 1
            entries = self._pin_leading(keys)
        if len(entries) < len(keys) and self._discover(keys[len(entries) :]):
            with self._cond:
                self._unpin(entries)
                entries = self._pin_leading(keys)
        if not prefix and len(entries) < len(keys):
            with self._cond:
                self._unpin(entries)
                self.counters.blocks_missed += len(keys) - len(entries)
            missing = keys[len(entries)]
            raise BlockNotFoundError(f"block {len(entries)} (key {missing.hex()}) is not stored")
        try:
            done = self._read(keys[: len(entries)], entries, outs, layers)
        finally:
            with self._cond:
                self._unpin(entries)
        n = next((i for i, ok in enumerate(done) if not ok), len(done))
        with self._cond:
            self.counters.blocks_read += n
            self.counters.blocks_missed += len(keys) - n
        if not prefix and n < len(keys):
            raise BlockNotFoundError(
                f"block {n} (key {keys[n].hex()}) failed to load from every tier"
            )
        return n

    def _pin_leading(self, keys: Sequence[BlockKey]) -> list[_Entry]:
        """Pin (and touch) the leading readable entries. Called with the lock held."""
        entries: list[_Entry] = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None or entry.state != READY:
                break
            entry.pins += 1
            self._touch(key, entry)
            entries.append(entry)
        return entries

    def _read(
        self,
        keys: Sequence[BlockKey],
        entries: list[_Entry],
        outs: Sequence[torch.Tensor],
        layers: LayerRange,
    ) -> list[bool]:
        """Read each pinned entry from its fastest copy, falling back to slower ones."""
        done = [False] * len(entries)
        tried = [0] * len(entries)
        pending = list(range(len(entries)))
        while pending:
            groups: dict[int, list[int]] = {}
            with self._cond:
                for i in pending:
                    untried = entries[i].tiers & ~tried[i]
                    if untried:
                        lvl = (untried & -untried).bit_length() - 1
                        groups.setdefault(lvl, []).append(i)
            pending = []
            for lvl, idxs in groups.items():
                ok = self._tier_get(
                    self._levels[lvl], [keys[i] for i in idxs], [outs[i] for i in idxs], layers
                )
                for i, good in zip(idxs, ok, strict=True):
                    tried[i] |= 1 << lvl
                    if good:
                        done[i] = True
                    else:
                        self._lose_copy(self._levels[lvl], keys[i], entries[i])
                        pending.append(i)
        return done

    def _tier_get(
        self, level: _Level, keys: list[BlockKey], outs: list[torch.Tensor], layers: LayerRange
    ) -> list[bool]:
        start = time.perf_counter()
        try:
            ok = level.tier.get(keys, outs, layers)
        except Exception:
            log.exception("tier %s failed to read %d blocks", level.tier.kind, len(keys))
            with self._cond:
                self.counters.tier_errors += 1
            return [False] * len(keys)
        elapsed = time.perf_counter() - start
        nbytes = self.layout.block_nbytes
        if layers is not None:
            nbytes = (layers[1] - layers[0]) * self.layout.layer_nbytes
        with self._cond:
            self.counters.bytes_read += sum(ok) * nbytes
            self.counters.read_seconds += elapsed
        return ok

    def _lose_copy(self, level: _Level, key: BlockKey, entry: _Entry) -> None:
        """A tier failed to produce ``key``: forget that copy (and the block if it was the last)."""
        with self._cond:
            if not self._forget_copy(level, key, entry):
                return
            self.counters.copies_lost += 1
            if not entry.tiers:
                entry.state = DELETING
                if self._index.get(key) is entry:
                    del self._index[key]
        self._tier_delete(level, [key])

    # -- delete -------------------------------------------------------------
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys`` from every tier; return how many were stored."""
        with self._cond:
            self._check_open()
            targets: list[tuple[BlockKey, _Entry]] = []
            for key in dict.fromkeys(keys):
                entry = self._index.get(key)
                if entry is not None and entry.state == READY:
                    entry.state = DELETING
                    targets.append((key, entry))
            while any(entry.pins for _, entry in targets):
                self._cond.wait()
            groups: dict[int, list[BlockKey]] = {}
            for key, entry in targets:
                for level in self._levels:
                    if self._forget_copy(level, key, entry):
                        groups.setdefault(level.index, []).append(key)
        for lvl, lkeys in groups.items():
            self._tier_delete(self._levels[lvl], lkeys)
        with self._cond:
            for key, entry in targets:
                if self._index.get(key) is entry:
                    del self._index[key]
            self.counters.blocks_deleted += len(targets)
            self._cond.notify_all()
        return len(targets)

    # -- helpers ------------------------------------------------------------
    def _forget_copy(self, level: _Level, key: BlockKey, entry: _Entry) -> bool:
        """Drop ``level``'s copy of ``key`` from the books; False if it had none.

        The one place a tier bit is cleared, so the residency count stays
        exact whichever of evict, delete or a failed read gets there first.
        Called with the lock held; the caller deletes the bytes from the tier.
        """
        if not entry.tiers & level.bit:
            return False
        entry.tiers &= ~level.bit
        level.policy.remove(key)
        if entry.leaving & level.bit:
            entry.leaving &= ~level.bit
        else:
            level.resident -= 1
        return True

    def _touch(self, key: BlockKey, entry: _Entry) -> None:
        for level in self._levels:
            if entry.tiers & level.bit:
                level.policy.touch(key)

    def _unpin(self, entries: list[_Entry]) -> None:
        for entry in entries:
            entry.pins -= 1
        self._cond.notify_all()

    def tier_usage(self) -> list[dict[str, Any]]:
        """Per tier: kind, blocks held, capacity and watermarks (in blocks)."""
        with self._cond:
            return [
                {
                    "kind": lv.tier.kind,
                    "blocks": len(lv.policy),
                    "capacity_blocks": lv.marks.capacity,
                    "high_watermark_blocks": lv.marks.high,
                    "low_watermark_blocks": lv.marks.low,
                    "bytes": len(lv.policy) * self.layout.block_nbytes,
                    "capacity_bytes": lv.marks.capacity * self.layout.block_nbytes,
                    "evictions": self.counters.evictions[lv.index],
                    "demotions": self.counters.demotions[lv.index],
                    **lv.tier.stats(),
                }
                for lv in self._levels
            ]

    def counters_snapshot(self) -> dict[str, Any]:
        """A consistent copy of the counters."""
        with self._cond:
            return self.counters.snapshot()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def pinned_blocks(self) -> int:
        """Blocks pinned right now (for tests and leak checks)."""
        with self._cond:
            return sum(1 for e in self._index.values() if e.pins)

    def flush(self, batch: int = 32) -> int:
        """Copy every block held only in non-persistent tiers into the first
        persistent tier; return how many blocks were persisted.

        After ``flush`` (and so after :meth:`close`) every stored block is on a
        medium that outlives the process, unless no persistent tier had room.
        """
        persistent = [lv for lv in self._levels if lv.tier.persistent]
        if not persistent:
            return 0
        mask = sum(lv.bit for lv in persistent)
        with self._cond:
            todo = [k for k, e in self._index.items() if e.state == READY and not e.tiers & mask]
        done = 0
        for start in range(0, len(todo), batch):
            done += self._persist(todo[start : start + batch], persistent[0].index, mask)
        return done

    def _persist(self, keys: list[BlockKey], target: int, mask: int) -> int:
        """Write ``keys`` (if still memory-only) into tier ``target`` or below."""
        with self._cond:
            pinned = []
            for key in keys:
                entry = self._index.get(key)
                if entry is not None and entry.state == READY and not entry.tiers & mask:
                    entry.pins += 1
                    pinned.append((key, entry))
        try:
            moves = []
            for key, entry in pinned:
                level = self._levels[(entry.tiers & -entry.tiers).bit_length() - 1]
                src = self._source(level, key)
                if src is not None:
                    moves.append(_Move(key, entry, src))
            left = self._place(target, moves) if moves else []
        finally:
            with self._cond:
                self._unpin([entry for _, entry in pinned])
        return len(moves) - len(left)

    def close(self) -> None:
        """Persist what only memory holds, wait for operations in flight, close every tier.

        Idempotent.
        """
        with self._cond:
            if self._closed:
                return
        try:
            self.flush()
        except Exception:  # closing must not fail because a tier did
            log.exception("flush at close failed")
        with self._cond:
            self._closed = True
            while any(e.pins for e in self._index.values()):
                self._cond.wait()
        for level in self._levels:
            try:
                level.tier.close()
            except Exception:
                log.exception("tier %s failed to close", level.tier.kind)
