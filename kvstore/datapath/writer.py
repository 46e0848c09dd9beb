"""Writer: placing new copies of blocks in tiers, and making room for them.

A put (and every background move, which is a put into a lower or upper tier)
goes through :meth:`Writer.place`: each tier from the first admits what its
rules let in, reserves room, evicts just the victims that room needs --
demoting them into the tiers below with the same placement, so eviction is a
placement one tier down -- writes, and publishes what landed. Nothing here
calls back up: what should follow in the background (bringing a tier down to
its low watermark, write-through copies, write-back ahead of eviction) is
collected in :class:`FollowUps` and returned, for the caller to hand to
:class:`~kvstore.datapath.migrations.Migrations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstore.datapath.books import Books, Reservation, Victims
from kvstore.datapath.index import Entry, Move
from kvstore.datapath.tierio import TierIO
from kvstore.keys import BlockKey

__all__ = ["FIRST", "FollowUps", "Writer"]

#: The first tier: layerwise writes and in-place puts reserve their room there.
FIRST = 0


@dataclass
class FollowUps:
    """Background work a write leaves behind (see :meth:`Migrations.schedule`).

    ``evict_down``: tiers past their high watermark, with how many of their older
    blocks may go (see :class:`~kvstore.datapath.room.Reservation`); ``write_back``: write-back
    tiers with too many blocks only they hold; ``copy_down``: write-through
    copies ``(keys, source tier, target tier)``.
    """

    evict_down: dict[int, int] = field(default_factory=dict)
    write_back: set[int] = field(default_factory=set)
    copy_down: list[tuple[list[BlockKey], int, int]] = field(default_factory=list)

    def note_excess(self, level: int, excess: int) -> None:
        """Tier ``level`` may shed ``excess`` blocks in the background (if > 0)."""
        if excess > 0:
            self.evict_down[level] = max(excess, self.evict_down.get(level, 0))

    def __bool__(self) -> bool:
        return bool(self.evict_down or self.write_back or self.copy_down)


class Writer:
    """Places blocks in the tiers of ``books`` through ``io``."""

    def __init__(self, books: Books, io: TierIO) -> None:
        self.books = books
        self.io = io

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]
    ) -> tuple[int, FollowUps]:
        """Store ``blocks[i]`` under ``keys[i]``; how many of the keys are stored, and
        the follow-up work. Keys already stored are not written again."""
        srcs: dict[BlockKey, torch.Tensor] = {}
        for key, block in zip(keys, blocks, strict=True):
            srcs.setdefault(key, block)
        fresh, present = self.books.pins.claim(keys)
        moves = [Move(key, entry, srcs[key]) for key, entry in fresh]
        follow = FollowUps()
        left = self.place(0, moves, None, follow) if moves else []
        self.books.pins.settle([m.entry for m in moves], [(m.key, m.entry) for m in left])
        self.books.count(blocks_stored=len(moves) - len(left), blocks_not_stored=len(left))
        return present + len(moves) - len(left), follow

    def place(
        self, start: int, moves: list[Move], stop: int | None, follow: FollowUps
    ) -> list[Move]:
        """Write ``moves`` into the first tiers from ``start`` (up to ``stop``) that admit
        them and have room; return the moves no tier took, in their original order."""
        pending = moves
        for level in range(start, self.books.num_levels if stop is None else stop):
            if not pending:
                break
            taken = self.books.room.admit(
                level, [m.key for m in pending], [m.entry for m in pending]
            )
            if not taken:
                continue
            admitted = [pending[i] for i in taken]
            room = self._reserve(level, len(admitted))
            follow.note_excess(level, room.excess)
            if room.victims:
                self.evict(level, room.victims, follow)
            batch = admitted[: room.grant]
            if batch:
                self.books.room.wait_room(level)
                done = self.io.put(level, [m.key for m in batch], [m.src for m in batch])
                landed = self.publish(level, batch, done, follow)
                pending = [m for m in pending if id(m) not in landed]
        return pending

    def publish(
        self, level: int, batch: Sequence[Move], done: Sequence[bool], follow: FollowUps
    ) -> set[int]:
        """Publish the copies tier ``level`` wrote (releasing the room of the others);
        the ids of the moves that landed."""
        positions, behind = self.books.room.commit_writes(
            level, [m.key for m in batch], [m.entry for m in batch], done
        )
        landed = [batch[i] for i in positions]
        target = self.books.placement.write_through_target(level)
        if landed and target is not None:
            follow.copy_down.append(([m.key for m in landed], level, target))
        if behind:
            follow.write_back.add(level)
        return {id(m) for m in landed}

    def make_room(self, level: int, n: int, follow: FollowUps) -> int:
        """Reserve room for ``n`` blocks to be written into tier ``level`` in place;
        evict what that needs first; how many blocks got room."""
        room = self._reserve(level, n)
        follow.note_excess(level, room.excess)
        if room.victims:
            self.evict(level, room.victims, follow)
        self.books.room.wait_room(level)
        return room.grant

    def _reserve(self, level: int, n: int) -> Reservation:
        self.reap()  # expired layerwise writes give their room back first
        return self.books.room.reserve(level, n)

    def reap(self) -> None:
        """Abort layerwise writes past their expiry; tier 0 gives back their room."""
        reserved = self.books.partials.reap()
        if reserved:
            self.io.abort(FIRST, reserved)
            self.books.room.give_back(FIRST, len(reserved))

    def evict(self, level: int, victims: Victims, follow: FollowUps) -> None:
        """Demote (or drop) pinned, claimed ``victims`` out of tier ``level`` and unpin them.

        Their room is given back only once the tier has freed it.
        """
        moves = []
        for key, entry in self.books.room.without_copy_below(level, victims):
            src = self.io.source(level, key)
            if src is not None:
                moves.append(Move(key, entry, src))
        demoted: set[BlockKey] = set()
        if moves and level + 1 < self.books.num_levels:
            left = {id(m) for m in self.place(level + 1, moves, None, follow)}
            demoted = {m.key for m in moves if id(m) not in left}
        dropped = self.books.room.drop_victims(level, victims, demoted)
        self.io.delete(level, [key for key, _ in victims])
        self.books.room.end_eviction(level, victims, dropped)

    def evict_exactly(self, level: int, n: int, follow: FollowUps) -> list[BlockKey]:
        """Evict exactly ``n`` unpinned blocks from tier ``level``, or raise
        :class:`~kvstore.errors.CapacityError` changing nothing."""
        self.reap()
        victims = self.books.room.take_victims(level, n)
        self.evict(level, victims, follow)
        return [key for key, _ in victims]

    def copy(
        self,
        pinned: Sequence[tuple[BlockKey, Entry]],
        start: int,
        stop: int | None,
        follow: FollowUps,
    ) -> int:
        """Write pinned blocks, from their fastest copies, into tiers ``start..stop``;
        how many landed."""
        moves = []
        fastest = self.books.queries.fastest([entry for _, entry in pinned])
        for (key, entry), level in zip(pinned, fastest, strict=True):
            src = self.io.source(level, key) if level >= 0 else None
            if src is not None:
                moves.append(Move(key, entry, src))
        left = self.place(start, moves, stop, follow) if moves else []
        return len(moves) - len(left)
