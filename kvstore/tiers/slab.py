"""Shared implementation of the memory media (host DRAM, device HBM).

A memory tier is a :class:`~kvstore.runtime.memory.SlabAllocator` with one slot per
block and a map from key to slot. Copies run outside the lock, so many
threads move blocks at once; ``_lock`` (owned by the tier) guards only the
map, the reader counts and the allocator calls. Bytes move through the copy
engine (:mod:`kvstore.copies`), coalesced: blocks in consecutive slots move in
one copy; the engine is the one of the batch's GPU, if any (a host slab's
copies into a GPU tensor run on the CUDA engine, as DMA from pinned memory).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.config import TierConfig
from kvstore.copies import engine_for_pairs
from kvstore.errors import CapacityError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.runtime import SlabAllocator
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["SharedSegment", "SlabTier"]


@dataclass(frozen=True)
class SharedSegment:
    """A slab other processes can map: its memfd, address here, and size."""

    fd: int
    address: int
    nbytes: int

    def offset_of(self, view: torch.Tensor) -> int | None:
        """Where ``view``'s bytes start in the segment; None if they lie outside it."""
        start = view.data_ptr() - self.address
        end = start + view.numel() * view.element_size()
        return start if start >= 0 and end <= self.nbytes else None


class SlabTier(Tier):
    """Blocks in fixed slots of one preallocated buffer on ``device``."""

    def __init__(
        self,
        config: TierConfig,
        layout: KVLayout,
        device: str | torch.device,
        pinned: bool = False,
        shared: bool = False,
        prefault: bool = False,
    ) -> None:
        super().__init__(config, layout)
        num_slots = self.blocks_in(config.capacity)
        self._slab = SlabAllocator(
            layout.block_nbytes, num_slots, device, pinned, shared, prefault=prefault
        )
        assert self._slab.buffer is not None
        self._blocks = self._slab.buffer.view(layout.dtype).view(num_slots, *layout.block_shape)
        self._slots: dict[BlockKey, int] = {}
        self._reserved: dict[BlockKey, int] = {}  # two-step stores not yet committed
        # slot -> readers copying out of it; a delete of such a slot is deferred.
        self._readers: dict[int, int] = {}
        self._deferred: set[int] = set()
        self._lock = threading.Lock()

    @property
    def capacity_blocks(self) -> int:
        return self._slab.num_slots

    @property
    def free_blocks(self) -> int:
        """Slots free now (neither holding a block nor reserved for one being written)."""
        return self._slab.num_free

    @property
    def device(self) -> torch.device:
        return self._slab.device

    @property
    def pinned(self) -> bool:
        """True when the buffer is page-locked host memory."""
        return self._slab.pinned

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def segment(self) -> SharedSegment | None:
        """The shared memory behind this tier's slab (None unless ``shared``)."""
        fd, buffer = self._slab.shared_fd, self._slab.buffer
        if fd is None or buffer is None:
            return None
        return SharedSegment(fd, buffer.data_ptr(), buffer.numel())

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        with self._lock:
            new = [i for i, key in enumerate(keys) if key not in self._slots]
            try:
                slots = self._slab.alloc(len(new))
            except CapacityError:
                slots = self._slab.alloc(min(len(new), self._slab.num_free))
        done = [True] * len(keys)
        for i in new[len(slots) :]:
            done[i] = False
        try:
            with self._slab.writing(slots):  # the prefault thread waits meanwhile if need be
                pairs = [
                    (self._blocks[slot], blocks[i]) for i, slot in zip(new, slots, strict=False)
                ]
                engine_for_pairs(pairs).copy_all(pairs)
        except BaseException:
            with self._lock:  # no key points at them yet: give the slots back
                self._slab.free(slots)
            raise
        with self._lock:
            dupes = []
            for i, slot in zip(new, slots, strict=False):
                if keys[i] in self._slots:  # a concurrent put of the same key won
                    dupes.append(slot)
                else:
                    self._slots[keys[i]] = slot
            self._slab.free(dupes)
        return done

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
    ) -> list[bool]:
        slots = self._acquire(keys)
        try:
            lo, hi = layers if layers is not None else (0, self.layout.num_layers)
            pairs = [
                (out, self._blocks[slot][lo:hi])
                for slot, out in zip(slots, outs, strict=True)
                if slot is not None
            ]
            engine_for_pairs(pairs).copy_all(pairs)
        finally:
            self._release([s for s in slots if s is not None])
        return [slot is not None for slot in slots]

    @contextmanager
    def reading(self, keys: Sequence[BlockKey]) -> Iterator[list[bool]]:
        """Hold ``keys``' slots as a read in flight does, for the ``with`` block; yields
        which keys are stored. A delete meanwhile drops the key at once but frees its
        slot only when the block exits, so a :meth:`view` taken inside stays valid."""
        slots = self._acquire(keys)
        try:
            yield [slot is not None for slot in slots]
        finally:
            self._release([s for s in slots if s is not None])

    def _acquire(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """The keys' slots (None where absent), each counted as read until released."""
        with self._lock:
            slots = [self._slots.get(key) for key in keys]
            for slot in slots:
                if slot is not None:
                    self._readers[slot] = self._readers.get(slot, 0) + 1
        return slots

    def _release(self, slots: list[int]) -> None:
        with self._lock:
            to_free = []
            for slot in slots:
                left = self._readers[slot] - 1
                if left:
                    self._readers[slot] = left
                    continue
                del self._readers[slot]
                if slot in self._deferred:
                    self._deferred.discard(slot)
                    to_free.append(slot)
            self._slab.free(to_free)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            to_free = []
            for key in keys:
                slot = self._slots.pop(key, None)
                if slot is None:
                    continue
                if slot in self._readers:
                    self._deferred.add(slot)
                else:
                    to_free.append(slot)
            self._slab.free(to_free)

    def reserve(self, keys: Sequence[BlockKey]) -> list[torch.Tensor | None]:
        with self._lock:
            wanted = [k for k in dict.fromkeys(keys) if k not in self._reserved]
            slots = self._slab.alloc(min(len(wanted), self._slab.num_free))
            self._reserved.update(zip(wanted, slots, strict=False))
            return [self._blocks[self._reserved[k]] if k in self._reserved else None for k in keys]

    def commit(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            done = []
            for key in keys:
                slot = self._reserved.pop(key, None)
                if slot is None:
                    done.append(key in self._slots)
                    continue
                if key in self._slots:  # stored meanwhile by a plain put: keep one copy
                    self._slab.free([slot])
                else:
                    self._slots[key] = slot
                done.append(True)
            return done

    def abort(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._slab.free([s for k in keys if (s := self._reserved.pop(k, None)) is not None])

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [key in self._slots for key in keys]

    def stored_keys(self) -> Iterator[BlockKey]:
        with self._lock:
            snapshot = list(self._slots)
        return iter(snapshot)

    def view(self, key: BlockKey) -> torch.Tensor | None:
        with self._lock:
            slot = self._slots.get(key)
        return None if slot is None else self._blocks[slot]

    def stats(self) -> dict[str, Any]:
        return {
            "slots": self._slab.num_slots,
            "slots_used": self._slab.num_used,
            "device": str(self.device),
            "pinned": self.pinned,
            **self._slab.prefault_stats(),
        }

    def wait_prefault(self, timeout: float | None = None) -> bool:
        """Wait until the slab's pages are faulted in; True if they all are."""
        return self._slab.wait_prefault(timeout)

    def prepare_close(self) -> None:
        """Stop faulting pages in: the flush at close needs the memory bandwidth."""
        self._slab.stop_prefault()

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
            self._reserved.clear()
            self._readers.clear()
            self._deferred.clear()
            self._slab.close()
