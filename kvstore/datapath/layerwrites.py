"""Layerwise writes: blocks stored one layer at a time, as prefill produces them.

``KVStore.put_layer(keys, layer, kv_layer)`` takes one layer of several
blocks at a time. The first layer of a block reserves its room -- a slot of
the first tier, written in place, where that tier hands out its memory (a
host or device slab), else a host staging buffer -- and the block becomes
visible to lookups only when every layer has arrived. A write abandoned half
way (a request that was aborted) expires after ``lease_s`` and gives its room
back. The same machinery backs whole-block two-step stores
(:class:`~kvstore.datapath.lending.PendingPut`): room first, filled in place by the
caller, then committed.

The partial writes themselves are kept in the books (under its lock); this
module makes room (through the :class:`~kvstore.datapath.writer.Writer`), copies layers
(through the copy engine of the batch's device) and publishes complete blocks.
Asynchronous writers (:mod:`kvstore.datapath.saves`) use its two halves,
:meth:`LayerWrites.start_layer` and :meth:`LayerWrites.end_layer`, around copies
they queue themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.copies import CopyPair, engine_for_pairs
from kvstore.datapath.books import Books
from kvstore.datapath.index import Move
from kvstore.datapath.partials import Partial, Room
from kvstore.datapath.tierio import TierIO
from kvstore.datapath.writer import FIRST, FollowUps, Writer
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout

__all__ = ["LayerWrites", "SlotRun", "WritePlan"]


@dataclass(frozen=True)
class SlotRun:
    """Parts ``[lo, hi)`` of a request whose slots lie a constant step apart and whose
    keys are consecutive from ``first`` on: ``slots`` is their views as one view with a
    block dimension in front (None for a single part)."""

    lo: int
    hi: int
    first: int
    slots: torch.Tensor | None
    parts: tuple[Partial, ...]

    def pairs(
        self, items: Sequence[tuple[int, Sequence[torch.Tensor]]], out: list[CopyPair]
    ) -> None:
        """Append the copies of ``items`` (``(layer, srcs)``, a source per key) into this
        run: one copy a layer where the sources lie evenly spaced too; else one per block
        and layer, block by block, each block's layers in order (so that a block's
        adjacent layers from adjacent sources still merge into one copy)."""
        if self.slots is not None:
            count = self.hi - self.lo
            stacks = [_stacked(srcs, self.first, count) for _, srcs in items]
            if all(stack is not None for stack in stacks):
                for (layer, _), stack in zip(items, stacks, strict=True):
                    assert stack is not None
                    out.append((self.slots[:, layer], stack))
                return
        for n, part in enumerate(self.parts):
            assert part.view is not None
            for layer, srcs in items:
                out.append((part.view[layer], srcs[self.first + n]))


@dataclass(frozen=True)
class WritePlan:
    """What a layerwise write precomputes per request: the parts it claimed, where each
    one's source is among the keys, and the runs of evenly spaced slots."""

    keys: tuple[BlockKey, ...]
    parts: tuple[Partial, ...]
    runs: tuple[SlotRun, ...]

    def fits(self, keys: Sequence[BlockKey], parts: Sequence[Partial]) -> bool:
        """True when this plan is the one of ``keys`` claimed as ``parts`` (the same
        objects, so the same rooms)."""
        return (
            len(parts) == len(self.parts)
            and tuple(keys) == self.keys
            and all(a is b for a, b in zip(parts, self.parts, strict=True))
        )

    @classmethod
    def of(cls, keys: Sequence[BlockKey], parts: Sequence[Partial]) -> WritePlan:
        at = {key: i for i, key in enumerate(keys)}
        runs: list[SlotRun] = []
        lo = 0
        while lo < len(parts):
            hi, step = lo + 1, None
            while hi < len(parts) and at[parts[hi].key] == at[parts[lo].key] + hi - lo:
                gap = _gap(parts[hi - 1], parts[hi])
                if gap is None or (step is not None and gap != step):
                    break
                step, hi = gap, hi + 1
            group = tuple(parts[lo:hi])
            slots = _slots(group, step) if step is not None else None
            runs.append(SlotRun(lo, hi, at[parts[lo].key], slots, group))
            lo = hi
        return cls(tuple(keys), tuple(parts), tuple(runs))


def _gap(a: Partial, b: Partial) -> int | None:
    """Elements from ``a``'s room to ``b``'s when both are contiguous slots of one
    storage, ``b`` past the end of ``a``; else None."""
    va, vb = a.view, b.view
    if va is None or vb is None or not (va.is_contiguous() and vb.is_contiguous()):
        return None
    if va.untyped_storage().data_ptr() != vb.untyped_storage().data_ptr():
        return None
    gap = int(vb.storage_offset()) - int(va.storage_offset())
    return gap if gap >= va.numel() else None


def _slots(group: tuple[Partial, ...], step: int) -> torch.Tensor:
    first = group[0].view
    assert first is not None
    return first.as_strided(
        (len(group), *first.shape), (step, *first.stride()), first.storage_offset()
    )


def _stacked(srcs: Sequence[torch.Tensor], first: int, count: int) -> torch.Tensor | None:
    """``srcs[first : first + count]`` as one view with a block dimension in front, where
    they are equal views a constant step apart inside the first one's storage (slices
    of one layer tensor, as put_layer makes them); else None. The stacked view then
    addresses exactly their bytes, whatever storage object each came from."""
    base = srcs[first]
    if count == 1:
        return base.unsqueeze(0)
    item, ptr = base.element_size(), base.data_ptr()
    step = srcs[first + 1].data_ptr() - ptr
    if step <= 0 or step % item:
        return None
    shape, stride, dtype = base.shape, base.stride(), base.dtype
    for n in range(1, count):
        src = srcs[first + n]
        if src.data_ptr() != ptr + n * step or src.stride() != stride or src.shape != shape:
            return None
        if src.dtype != dtype:
            return None
    try:  # raises where the run would leave the first one's storage
        return base.as_strided((count, *shape), (step // item, *stride), base.storage_offset())
    except RuntimeError:
        return None


class LayerWrites:
    """Blocks being written layer by layer or in place (see the module docstring)."""

    def __init__(self, books: Books, io: TierIO, writer: Writer, lease_s: float) -> None:
        self.books = books
        self.io = io
        self.writer = writer
        self.lease_s = lease_s
        self.layout: KVLayout = io.layout
        #: The last request's plan (replaced whole, never changed: no lock needed).
        self._last: WritePlan | None = None

    def write(
        self, keys: Sequence[BlockKey], layer: int, srcs: Sequence[torch.Tensor]
    ) -> tuple[int, FollowUps]:
        """Write ``layer`` of each block; how many blocks this completed, and the
        background work that follows. A copy that raises aborts these writes."""
        parts, pairs, follow = self.start_layer(keys, layer, srcs)
        try:
            engine_for_pairs(pairs).copy_all(pairs)
        except BaseException as exc:
            self.end_layer(parts, layer, follow, exc)
            raise
        return self.end_layer(parts, layer, follow, None), follow

    def start_layer(
        self, keys: Sequence[BlockKey], layer: int, srcs: Sequence[torch.Tensor]
    ) -> tuple[list[Partial], list[CopyPair], FollowUps]:
        """The first half of :meth:`write`, for writers that copy asynchronously: room
        for each block, a copy counted in flight into each, and the copies to make
        (``srcs[i]`` into layer ``layer`` of ``keys[i]``'s room). Call
        :meth:`end_layer` once they have landed (or failed)."""
        return self.start_layers(keys, [(layer, srcs)])

    def start_layers(
        self, keys: Sequence[BlockKey], items: Sequence[tuple[int, Sequence[torch.Tensor]]]
    ) -> tuple[list[Partial], list[CopyPair], FollowUps]:
        """:meth:`start_layer` for several layers of the same blocks at once: ``items``
        are ``(layer, srcs)``. The copies come block by block, each block's layers in
        order, so that a block's adjacent layers from adjacent sources merge into one
        copy. Call :meth:`end_layers` with the same layers."""
        follow = FollowUps()
        parts = self._claim(keys, follow)
        self.books.partials.begin_writing(parts, len(items))
        plan = self._plan(keys, parts)
        pairs: list[CopyPair] = []
        for run in plan.runs:
            run.pairs(items, pairs)
        return parts, pairs, follow

    def _plan(self, keys: Sequence[BlockKey], parts: list[Partial]) -> WritePlan:
        """The request's runs of slots, made on its first layer and kept for the next
        (a prefill calls with the same keys once a layer: only the check is per layer)."""
        last = self._last
        if last is not None and last.fits(keys, parts):
            return last
        plan = self._last = WritePlan.of(keys, parts)
        return plan

    def end_layer(
        self,
        parts: Sequence[Partial],
        layer: int,
        follow: FollowUps,
        error: BaseException | None,
    ) -> int:
        """The second half: ``layer`` landed in ``parts`` (publish the blocks now
        complete; how many), or the copies failed (abort these writes; 0)."""
        return self.end_layers(parts, [layer], follow, error)

    def end_layers(
        self,
        parts: Sequence[Partial],
        layers: Sequence[int],
        follow: FollowUps,
        error: BaseException | None,
    ) -> int:
        """:meth:`end_layer` for the layers of one :meth:`start_layers`."""
        if error is not None:
            for _ in layers:  # each layer counted a copy in flight
                self._give_back(self.books.partials.fail(parts))
            return 0
        done: list[Partial] = []
        for layer in layers:
            done.extend(self.books.partials.mark(parts, layer))
        if done:  # the request's blocks are complete: its plan is not needed again
            self._last = None
        return self._complete(done, follow)

    def begin(self, keys: Sequence[BlockKey]) -> tuple[list[Partial | None], FollowUps]:
        """Whole-block two-step store, step 1: room for each new key (None for keys
        stored, being written, or listed twice). Each part has a ``view`` to fill
        and counts as a writer until :meth:`finish`."""
        follow = FollowUps()
        parts = self._claim(keys, follow, only_new=True)
        self.books.partials.begin_writing(parts)
        fresh = {p.key: p for p in parts}
        return [fresh.pop(key, None) for key in keys], follow

    def finish(self, parts: Sequence[Partial], ok: Sequence[bool]) -> tuple[int, FollowUps]:
        """Step 2: publish the parts whose ``ok`` is true, abort the others; how many
        blocks were stored, and the background work that follows."""
        good = [p for p, flag in zip(parts, ok, strict=True) if flag]
        bad = [p for p, flag in zip(parts, ok, strict=True) if not flag]
        self._give_back(self.books.partials.fail(bad))
        done = self.books.partials.mark(good, None)  # parts aborted meanwhile are not done
        follow = FollowUps()
        return self._complete(done, follow), follow

    def abort(self, keys: Sequence[BlockKey]) -> int:
        """Give up unfinished layerwise writes of ``keys``; how many."""
        count, reserved = self.books.partials.abort(keys)
        self._give_back(reserved)
        return count

    def reap(self) -> None:
        """Abort layerwise writes past their expiry, giving their room back."""
        self.writer.reap()

    def _give_back(self, reserved: list[BlockKey]) -> None:
        """Tier 0 gives back the room reserved for ``reserved`` (aborted writes)."""
        if reserved:
            self.io.abort(FIRST, reserved)
            self.books.room.give_back(FIRST, len(reserved))

    def _claim(
        self, keys: Sequence[BlockKey], follow: FollowUps, only_new: bool = False
    ) -> list[Partial]:
        """The partial writes of ``keys``, with room made for the new ones."""
        parts, new, expired = self.books.partials.claim(keys, self.layout.num_layers, self.lease_s)
        self._give_back(expired)
        if new:
            self._make_room(new, follow)
        return new if only_new else parts

    def _make_room(self, new: list[Partial], follow: FollowUps) -> None:
        """Reserve slots in tier 0 for new blocks (host staging where it has none)."""
        views: list[torch.Tensor | None] = []
        try:
            grant = self.writer.make_room(FIRST, len(new), follow)
            views = self.io.reserve(FIRST, [p.key for p in new[:grant]]) if grant else []
            unused = sum(1 for view in views if view is None)
            if unused:  # the tier could not hand out memory: give that room back
                self.books.room.give_back(FIRST, unused)
        finally:
            rooms: list[Room] = []
            for i in range(len(new)):
                view = views[i] if i < len(views) else None
                rooms.append((view, True) if view is not None else (self._staging(), False))
            self.books.partials.place(new, rooms)

    def _staging(self) -> torch.Tensor:
        return torch.empty(self.layout.block_shape, dtype=self.layout.dtype)

    def _complete(self, done: list[Partial], follow: FollowUps) -> int:
        """Publish completed blocks: commit reserved slots, place staged ones."""
        if not done:
            return 0
        moves = {id(p): Move(p.key, p.entry, p.view) for p in done if p.view is not None}
        reserved = [moves[id(p)] for p in done if p.reserved]
        staged = [moves[id(p)] for p in done if not p.reserved]
        landed: set[int] = set()
        if reserved:
            ok = self.io.commit(FIRST, [mv.key for mv in reserved])
            landed = self.writer.publish(FIRST, reserved, ok, follow)
        left = self.writer.place(FIRST, staged, None, follow) if staged else []
        failed = [mv for mv in reserved if id(mv) not in landed] + left
        self.books.pins.settle([p.entry for p in done], [(mv.key, mv.entry) for mv in failed])
        self.books.count(
            blocks_stored=len(done) - len(failed),
            bytes_written_in_place=len(landed) * self.layout.block_nbytes,
        )
        return len(done) - len(failed)
