"""Background moves of the block manager: write-through, promotion, eviction, flush.

Each move is a job on the manager's :class:`~kvstore.mover.Mover` threads, so
the engine's put and get return without waiting for it. A job pins what it
moves (so nothing frees the source under it), copies with the manager's lock
released, and publishes the new copy through the manager's placement path --
the same path a put takes, with the same admission, room-making and demotion.

This is the manager's own machinery split out by concern; it uses the
manager's internals freely.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING

import torch

from kvstore.index import DELETING, READY, Entry, Level, Move
from kvstore.keys import BlockKey
from kvstore.progress import FlushProgress
from kvstore.reads import tier_get

if TYPE_CHECKING:
    from kvstore.manager import BlockManager

__all__ = ["Migrations"]

Victims = list[tuple[BlockKey, Entry]]

log = logging.getLogger(__name__)


class Migrations:
    """Schedules and runs the moves that keep blocks in the right tiers."""

    def __init__(self, manager: BlockManager) -> None:
        self.m = manager

    # -- scheduling (callable with or without the manager's lock) ----------------
    def evict_down_later(self, level: Level) -> None:
        """Bring ``level`` from above its high watermark down to its low one, in the background."""
        self.m._mover.submit(lambda: self._evict_down(level), key=("evict", level.index))

    def copy_down_later(self, keys: list[BlockKey], source: int, target: int) -> None:
        """Write-through: copy ``keys`` from tier ``source`` into tier ``target`` (or below)."""
        self.m._mover.submit(lambda: self._copy_down(keys, source, target))

    def write_back_later(self, level: Level) -> None:
        """Copy ``level``'s least recently used dirty blocks down until no more than its low
        watermark's worth is dirty, in the background (one job per tier at a time)."""
        self.m._mover.submit(lambda: self._write_back(level), key=("write_back", level.index))

    def track_copies(self, key: BlockKey, before: int, after: int) -> None:
        """Keep the write-back books of ``key`` as its copies change from the tiers of
        ``before`` to those of ``after`` (bitmasks). Called with the lock held."""
        for level in self.m._write_back_levels:
            below = ~((level.bit << 1) - 1)
            was_dirty = bool(before & level.bit) and not before & below
            is_dirty = bool(after & level.bit) and not after & below
            if not after & level.bit:  # gone from this tier
                level.dirty.pop(key, None)
                level.written_back.discard(key)
            elif is_dirty and not was_dirty:  # landed here alone, or lost its copy below
                level.dirty[key] = None
                level.written_back.discard(key)
            elif was_dirty and not is_dirty:  # copied down from here
                del level.dirty[key]
                level.written_back.add(key)

    def promote_later(self, keys: list[BlockKey], entries: list[Entry]) -> None:
        """After a read, copy blocks served from slow tiers up where the rules say so."""
        m = self.m
        jobs: list[tuple[BlockKey, int]] = []
        with m._cond:
            for key, entry in zip(keys, entries, strict=True):
                if not entry.tiers or entry.state != READY:
                    continue
                fastest = (entry.tiers & -entry.tiers).bit_length() - 1
                if not m._levels[fastest].tier.promotable:
                    continue  # another node's block: the cluster decides where copies go
                copies = bin(entry.tiers & ~m._persistent).count("1")
                target = m.placement.promotion_target(fastest, m.heat.heat(entry), copies)
                if target is not None:
                    jobs.append((key, target))
        for key, target in jobs:
            m._mover.submit(functools.partial(self._copy_up, key, target), key=("up", key))

    # -- eviction ---------------------------------------------------------------
    def pick_victims(self, level: Level, n: int) -> Victims:
        """Up to ``n`` unpinned readable blocks of ``level`` to evict. Called with the lock held.

        In the policy's order, but cooled extra copies (blocks with a copy
        further down) go first and hot blocks last, looking a bounded distance
        ahead for the cheaper ones.
        """
        m = self.m
        m._reap_leases()
        if n <= 0:
            return []
        below = ~((level.bit << 1) - 1)
        ranked: tuple[Victims, Victims, Victims] = ([], [], [])
        horizon = 4 * n + 64
        for seen, key in enumerate(level.policy.candidates()):
            entry = m._index.get(key)
            if entry is not None and entry.pins == 0 and entry.state == READY:
                hot = m.placement.is_hot(m.heat.heat(entry))
                # A replica (copied here from below) is an extra copy; a block written
                # back from here is not: it keeps its place in the policy's order.
                extra = entry.tiers & below and key not in level.written_back
                ranked[2 if hot else (0 if extra else 1)].append((key, entry))
            found = sum(len(r) for r in ranked)
            if len(ranked[0]) >= n or (seen >= horizon and found >= n):
                break
        return (ranked[0] + ranked[1] + ranked[2])[:n]

    def evict_victims(self, level: Level, victims: Victims) -> None:
        """Demote (or drop) pinned ``victims`` out of ``level`` and unpin them.

        The caller counted the victims in ``level.leaving``; their room is
        given back only once the tier has freed it.
        """
        m = self.m
        below = ~((level.bit << 1) - 1)
        moves = [
            Move(key, entry, src)
            for key, entry in victims
            if not entry.tiers & below and (src := self.source(level, key)) is not None
        ]
        placed: set[BlockKey] = set()
        if moves and level.index + 1 < len(m._levels):
            left = {id(m) for m in m._place(level.index + 1, moves)}
            placed = {m.key for m in moves if id(m) not in left}
        dropped: list[Entry] = []
        with m._cond:
            for key, entry in victims:
                m._wait_pins(entry, 1)  # readers of this copy finish first
                if m._begin_drop(level, key, entry):
                    dropped.append(entry)
                if key in placed:
                    m.counters.demotions[level.index] += 1
                if not entry.tiers:
                    entry.state = DELETING
            m.counters.evictions[level.index] += len(victims)
        m._tier_delete(level, [key for key, _ in victims])
        with m._cond:
            m._end_drop(level, dropped)
            level.leaving -= len(victims)
            for key, entry in victims:
                entry.pins -= 1
                if not entry.tiers and m._index.get(key) is entry:
                    del m._index[key]
                    m.counters.blocks_dropped += 1
            m._cond.notify_all()

    def source(self, level: Level, key: BlockKey) -> torch.Tensor | None:
        """The bytes of ``key`` in ``level`` as a tensor (zero-copy where possible)."""
        m = self.m
        view = level.tier.view(key)
        if view is not None:
            return view
        staging = torch.empty(m.layout.block_shape, dtype=m.layout.dtype)
        ok = tier_get(m, level, [key], [staging], None)
        return staging if ok and ok[0] else None

    # -- jobs -------------------------------------------------------------------
    def _write_back(self, level: Level, batch: int = 8) -> None:
        """Copy the least recently used dirty blocks of ``level`` down, ``batch`` at a
        time, while more than its low watermark's worth is dirty (and the store is not
        closing: the flush at close writes the rest, reporting its progress). Each
        block is tried once per run: one the disk refused stays for eviction."""
        m = self.m
        tried: set[BlockKey] = set()
        while True:
            with m._cond:
                picked = self._pick_dirty(level, batch, tried)
            if not picked:
                return
            try:
                done = self._copy([k for k, _ in picked], [e for _, e in picked], level.index + 1)
                with m._cond:
                    m.counters.writebacks[level.index] += done
            finally:
                with m._cond:
                    m._unpin([entry for _, entry in picked])

    def _pick_dirty(self, level: Level, batch: int, tried: set[BlockKey]) -> Victims:
        """Up to ``batch`` dirty blocks of ``level`` to write back now, pinned; none once
        it is within its low watermark. Skips blocks pinned (read, or evicted: the
        eviction writes those), not admitted below yet, or tried already. Lock held."""
        m = self.m
        want = min(batch, len(level.dirty) - level.marks.low)
        picked: Victims = []
        if m._closing or want <= 0:
            return picked
        for key in itertools.islice(level.dirty, 4 * want + 64 + len(tried)):
            entry = m._index.get(key)
            if key in tried or entry is None or entry.pins or entry.state != READY:
                continue
            tried.add(key)
            if not m.placement.admits(level.index + 1, m.heat.heat(entry)):
                continue  # eviction decides about it
            entry.pins += 1
            picked.append((key, entry))
            if len(picked) >= want:
                break
        return picked

    def _evict_down(self, level: Level) -> None:
        m = self.m
        with m._cond:
            staying = level.resident - level.leaving
            if m._closed or staying <= level.marks.high:
                return
            victims = self.pick_victims(level, staying - level.marks.low)
            for _, entry in victims:
                entry.pins += 1
            level.leaving += len(victims)
        if victims:
            self.evict_victims(level, victims)

    def promote_now(self, keys: list[BlockKey], target: int) -> int:
        """Copy ``keys`` into tier ``target`` on the caller's thread; how many landed."""
        return sum(self._copy_up(key, target) for key in keys)

    def _copy_up(self, key: BlockKey, target: int) -> bool:
        """Promote (or replicate) ``key`` into tier ``target``, if still worth it; True
        if a copy landed."""
        m = self.m
        bit = m._levels[target].bit
        with m._cond:
            entry = m._index.get(key)
            if m._closed or entry is None or entry.state != READY or entry.tiers & bit:
                return False
            entry.pins += 1
        try:
            landed = bool(self._copy([key], [entry], target, target + 1))
            if landed:
                with m._cond:
                    m.counters.promotions[target] += 1
            return landed
        finally:
            with m._cond:
                m._unpin([entry])

    def _copy_down(self, keys: list[BlockKey], source: int, target: int) -> None:
        """Copy blocks that ``source`` holds (and ``target`` does not) into ``target`` or below."""
        m = self.m
        src_bit, below = m._levels[source].bit, ~((m._levels[source].bit << 1) - 1)
        with m._cond:
            pinned = []
            for key in keys:
                entry = m._index.get(key)
                if entry is None or entry.state != READY:
                    continue
                if entry.tiers & src_bit and not entry.tiers & below:
                    entry.pins += 1
                    pinned.append((key, entry))
        try:
            done = self._copy([k for k, _ in pinned], [e for _, e in pinned], target, None)
            with m._cond:
                m.counters.write_through_copies[target] += done
        finally:
            with m._cond:
                m._unpin([entry for _, entry in pinned])

    def _copy(
        self, keys: list[BlockKey], entries: list[Entry], start: int, stop: int | None = None
    ) -> int:
        """Write pinned blocks from their fastest copies into tiers ``start..stop``."""
        m = self.m
        moves = []
        for key, entry in zip(keys, entries, strict=True):
            fastest = (entry.tiers & -entry.tiers).bit_length() - 1
            if fastest < 0:
                continue
            src = self.source(m._levels[fastest], key)
            if src is not None:
                moves.append(Move(key, entry, src))
        left = m._place(start, moves, stop) if moves else []
        return len(moves) - len(left)

    # -- flush ------------------------------------------------------------------
    def flush(self, batch: int = 32, progress: FlushProgress | None = None) -> int:
        """Finish background moves, then copy every block held only in memory
        tiers into the first persistent tier; return how many were written.

        ``progress`` hears the bytes to write (counted before the background
        moves finish: they may be writing some of them) and what is left.
        """
        m = self.m
        if not m._persistent:
            m._mover.drain()
            return 0
        target = next(lv.index for lv in m._levels if lv.bit & m._persistent)
        if progress is not None:
            progress.begin(self._unpersisted() * m.layout.block_nbytes, _describe(m, target))
            while not m._mover.drain(timeout=0.25):
                progress.update(self._unpersisted() * m.layout.block_nbytes)
        m._mover.drain()
        with m._cond:
            todo = [
                k for k, e in m._index.items() if e.state == READY and not e.tiers & m._persistent
            ]
        done = 0
        for start in range(0, len(todo), batch):
            done += self._persist(todo[start : start + batch], target)
            if progress is not None:
                left = max(0, len(todo) - start - batch)
                progress.update(left * m.layout.block_nbytes)
        if progress is not None:  # what is left now: blocks no persistent tier took
            progress.update(self._unpersisted() * m.layout.block_nbytes, force=True)
            progress.end()
        return done

    def _unpersisted(self) -> int:
        """Readable blocks no persistent tier holds."""
        m = self.m
        with m._cond:
            return sum(
                1 for e in m._index.values() if e.state == READY and not e.tiers & m._persistent
            )

    def persist(self, keys: list[BlockKey]) -> list[bool]:
        """Copy ``keys`` into the first persistent tier now, where only memory holds them;
        True for each key on a persistent tier afterwards."""
        m = self.m
        if m._persistent:
            target = next(lv.index for lv in m._levels if lv.bit & m._persistent)
            self._persist(keys, target)
        with m._cond:
            return [
                (e := m._index.get(k)) is not None and bool(e.tiers & m._persistent) for k in keys
            ]

    def _persist(self, keys: list[BlockKey], target: int) -> int:
        m = self.m
        with m._cond:
            pinned = []
            for key in keys:
                entry = m._index.get(key)
                if entry is not None and entry.state == READY and not entry.tiers & m._persistent:
                    entry.pins += 1
                    pinned.append((key, entry))
        try:
            return self._copy([k for k, _ in pinned], [e for _, e in pinned], target, None)
        finally:
            with m._cond:
                m._unpin([entry for _, entry in pinned])


def _describe(m: BlockManager, index: int) -> str:
    """A tier as a person knows it: its kind, and its directory where it has one."""
    tier = m._levels[index].tier
    path = getattr(tier, "path", None)
    return f"the {tier.kind} tier" + (f" ({path})" if path is not None else "")
