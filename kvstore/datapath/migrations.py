"""Migrations: the moves that keep blocks in the right tiers, in the background.

Bringing a tier from above its high watermark down to its low one, write-through
copies, write-back ahead of eviction, promotion on a hit and hot-block
replication run as jobs on the :class:`~kvstore.datapath.mover.Mover` threads, so the
engine's put and get return without waiting for them; persist and flush copy
what only memory holds to the first persistent tier on the caller's thread.

Each job pins what it moves in the books (so nothing frees the source under
it), copies with the lock released, and places the new copy through
:class:`~kvstore.datapath.writer.Writer` -- the same path a put takes, with the same
admission, room-making and demotion. Work that a job's writes leave behind
comes back as :class:`~kvstore.datapath.writer.FollowUps` and is scheduled here: the one
place background work is queued.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from kvstore.datapath.books import Books
from kvstore.datapath.index import Entry
from kvstore.datapath.mover import Mover
from kvstore.datapath.progress import FlushProgress
from kvstore.datapath.tierio import TierIO
from kvstore.datapath.writer import FollowUps, Writer
from kvstore.keys import BlockKey

__all__ = ["Migrations"]


class Migrations:
    """Schedules and runs background moves (see the module docstring)."""

    def __init__(self, books: Books, io: TierIO, writer: Writer, mover: Mover) -> None:
        self.books = books
        self.io = io
        self.writer = writer
        self.mover = mover
        persistent = io.persistent_levels()
        #: The first tier that outlives the process (None: none does).
        self.persistent_target = persistent[0] if persistent else None
        self._block_nbytes = io.layout.block_nbytes
        # Copies up in flight, as (key, target): a second promotion of the same block into
        # the same tier while one runs is refused. Both would pass the "not there yet"
        # check, both would claim room, and the tier, charged twice, evicted what it held
        # (three threads warming 15 blocks into room for 20 left 0-3 of them there).
        # Guarded by ``_promoting_lock``, held for a set operation.
        self._promoting: set[tuple[BlockKey, int]] = set()
        self._promoting_lock = threading.Lock()

    # -- scheduling ---------------------------------------------------------------
    def schedule(self, follow: FollowUps) -> None:
        """Queue the background work a write left behind (each kind once per tier)."""
        for level, most in follow.evict_down.items():
            job = functools.partial(self._evict_down, level, most)
            self.mover.submit(job, key=("evict", level))
        for level in follow.write_back:
            self.mover.submit(functools.partial(self._write_back, level), key=("back", level))
        for keys, source, target in follow.copy_down:
            self.mover.submit(functools.partial(self._copy_down, keys, source, target))

    def promote_later(self, keys: Sequence[BlockKey], entries: Sequence[Entry]) -> None:
        """After a read, copy blocks served from slow tiers up where the rules say so."""
        for key, target in self.books.queries.promotions(keys, entries, self.io.promotable):
            self.mover.submit(functools.partial(self._copy_up, key, target), key=("up", key))

    def warm(self, keys: Sequence[BlockKey], target: int = 0) -> int:
        """Copy ``keys`` into tier ``target`` in the background (what a restore plan left
        on slow tiers); how many copies were queued."""
        return sum(
            self.mover.submit(functools.partial(self._copy_up, key, target), key=("up", key))
            for key in keys
        )

    def demote_later(self, keys: Sequence[BlockKey], levels: Sequence[int]) -> int:
        """In the background: copy ``keys`` to the first persistent tier, then give up
        their copies in tiers ``levels`` (memory); how many blocks were queued."""
        if not keys or not levels:
            return 0
        job = functools.partial(self._demote, list(keys), list(levels))
        return len(keys) if self.mover.submit(job) else 0

    def _demote(self, keys: list[BlockKey], levels: list[int]) -> None:
        self.persist(keys)
        follow = FollowUps()
        for level in levels:
            victims = self.books.room.take_keys(level, keys)
            if victims:
                self.writer.evict(level, victims, follow)
        self.schedule(follow)

    def promote_now(self, keys: Sequence[BlockKey], target: int) -> int:
        """Copy ``keys`` into tier ``target`` on the caller's thread; how many landed."""
        return sum(self._copy_up(key, target) for key in keys)

    # -- jobs -----------------------------------------------------------------------
    def _evict_down(self, level: int, most: int) -> None:
        victims = self.books.room.excess_victims(level, most)
        if victims:
            follow = FollowUps()
            self.writer.evict(level, victims, follow)
            self.schedule(follow)

    def _write_back(self, level: int, batch: int = 8) -> None:
        """Copy the least recently used blocks only ``level`` holds down, ``batch`` at a
        time, while more than its low watermark's worth is dirty (and the store is not
        closing: the flush at close writes the rest, reporting its progress)."""
        tried: set[BlockKey] = set()
        while picked := self.books.room.pick_dirty(level, batch, tried):
            done = self._copy(picked, level + 1, None)
            self.books.count_level("writebacks", level, done)

    def _copy_up(self, key: BlockKey, target: int) -> bool:
        """Promote (or replicate) ``key`` into tier ``target`` if still worth it; True
        if a copy landed."""
        bit, job = 1 << target, (key, target)
        with self._promoting_lock:
            if job in self._promoting:
                return False
            self._promoting.add(job)
        try:
            pinned = self.books.pins.pin_where([key], lambda entry: not entry.tiers & bit)
            if not pinned:
                return False
            landed = bool(self._copy(pinned, target, target + 1))
        finally:
            with self._promoting_lock:
                self._promoting.discard(job)
        if landed:
            self.books.count_level("promotions", target)
        return landed

    def _copy_down(self, keys: list[BlockKey], source: int, target: int) -> None:
        """Write-through: copy blocks ``source`` holds (and no tier below it does) into
        ``target`` or below."""
        bit, below = 1 << source, ~((1 << (source + 1)) - 1)
        pinned = self.books.pins.pin_where(
            keys, lambda e: bool(e.tiers & bit) and not e.tiers & below
        )
        if pinned:
            done = self._copy(pinned, target, None)
            self.books.count_level("write_through_copies", target, done)

    def _copy(self, pinned: list[tuple[BlockKey, Entry]], start: int, stop: int | None) -> int:
        """Copy pinned blocks into tiers ``start..stop``, unpin them, schedule what follows."""
        follow = FollowUps()
        try:
            return self.writer.copy(pinned, start, stop, follow)
        finally:
            self.books.pins.unpin([entry for _, entry in pinned])
            self.schedule(follow)

    # -- re-encryption --------------------------------------------------------------
    def reencrypt(self, level: int, batch: int = 8) -> int:
        """Queue the background rewrite, under the active key, of the blocks tier
        ``level`` holds sealed under an older key (encryption at rest): every block
        the books list there is read back (which tells the tier its key id) and those
        under an older key are put again; how many blocks are queued to be checked."""
        cipher = self.io.tiers[level].cipher
        if cipher is None or not cipher.old_keys:  # one key: nothing can be under another
            return 0
        keys = self.books.queries.stored_keys()
        if not keys:
            return 0
        job = functools.partial(self._reencrypt, level, keys, batch)
        if not self.mover.submit(job, key=("reencrypt", level)):
            return 0
        cipher.count("reencrypt_pending", len(keys))
        return len(keys)

    def _reencrypt(self, level: int, keys: list[BlockKey], batch: int, rounds: int = 16) -> None:
        """Check ``rounds`` batches, then queue the rest as a new job (other moves run
        in between)."""
        bit, cipher = 1 << level, self.io.tiers[level].cipher
        for _ in range(rounds):
            if self.books.closing:  # the rest waits for the next open (it sweeps again)
                cipher.count("reencrypt_pending", -len(keys))
                return
            now, keys = keys[:batch], keys[batch:]
            pinned = self.books.pins.pin_where(now, lambda entry: bool(entry.tiers & bit))
            try:
                if pinned:
                    self._rewrite(level, [key for key, _ in pinned])
            finally:
                self.books.pins.unpin([entry for _, entry in pinned])
                cipher.count("reencrypt_pending", -len(now))
            if not keys:
                return
        if not self.mover.submit(functools.partial(self._reencrypt, level, keys, batch)):
            cipher.count("reencrypt_pending", -len(keys))  # closing: the rest waits for a reopen

    def _rewrite(self, level: int, keys: list[BlockKey]) -> None:
        """Read ``keys`` from tier ``level``; put back those it read under an older key."""
        layout = self.io.layout
        blocks = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in keys]
        got = self.io.get(level, keys, blocks) or [False] * len(keys)
        read = [key for key, ok in zip(keys, got, strict=True) if ok]
        stale = set(self.io.tiers[level].stale_keys(read))
        todo = [(key, block) for key, block in zip(keys, blocks, strict=True) if key in stale]
        if todo:
            done = self.io.put(level, [key for key, _ in todo], [block for _, block in todo])
            self.io.tiers[level].cipher.count("reencrypted", sum(done or []))

    # -- persist and flush ----------------------------------------------------------
    def persist(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Copy ``keys`` into the first persistent tier now, where only memory holds them;
        True for each key on a persistent tier afterwards."""
        if self.persistent_target is not None:
            self._persist(keys, self.persistent_target)
        return self.books.queries.persisted(keys)

    def _why_unwritten(self, target: int) -> tuple[str, bool]:
        """Why a flush left blocks unwritten in tier ``target``, as a person reads it, and
        whether that is news: a full tier is; a tier that refused writes has said so
        already (a read-only disk warns once, at open)."""
        level = self.books.level_usage()[target]
        if level["blocks"] >= level["high_watermark_blocks"]:
            return f"it is full ({level['blocks']} of its {level['capacity_blocks']} blocks)", True
        return "it did not take them: the warnings above say why", False

    def _persist(self, keys: Sequence[BlockKey], target: int) -> int:
        persistent = self.books.persistent
        pinned = self.books.pins.pin_where(keys, lambda entry: not entry.tiers & persistent)
        return self._copy(pinned, target, None) if pinned else 0

    def flush(self, batch: int = 32, progress: FlushProgress | None = None) -> int:
        """Finish background moves, then copy every block held only in memory tiers into
        the first persistent tier; return how many were written.

        ``progress`` hears the bytes to write (counted before the background
        moves finish: they may be writing some of them) and what is left, from
        the books' running counts (no scan of the index): the blocks no persistent
        tier holds, and those a full tier dropped to take others (eviction from the
        last tier), which did not fit either.
        """
        target = self.persistent_target
        if target is None:
            self.mover.drain()
            return 0
        queries, nbytes = self.books.queries, self._block_nbytes
        held = queries.ready_count()

        def left() -> int:
            return (queries.unpersisted() + max(0, held - queries.ready_count())) * nbytes

        if progress is not None:
            progress.begin(queries.unpersisted() * nbytes, self.io.describe(target))
            while not self.mover.drain(timeout=0.25):
                progress.update(left())
        self.mover.drain()
        todo = queries.unpersisted_keys()
        done = 0
        for start in range(0, len(todo), batch):
            done += self._persist(todo[start : start + batch], target)
            if progress is not None:
                progress.update(left())
        if progress is not None:  # what is left now did not fit
            remaining = left()
            progress.update(remaining, force=True)
            why, news = self._why_unwritten(target) if remaining else ("", False)
            progress.end(why, warn=news)
        return done
