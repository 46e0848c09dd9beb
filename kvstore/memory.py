"""Slab allocation over one preallocated buffer per tier.

Every block of a layout has the same size, so a memory tier is one big
buffer cut into fixed slots: allocation is popping slot numbers off a free
stack, with no per-block ``malloc``/``cudaMalloc``/``cudaHostAlloc`` on the
hot path (pinned allocations cost milliseconds each, which is how peers end
up leaking or fragmenting pinned memory). Freed slots return to the stack at
once, so capacity comes back exactly after deletes and evictions.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import torch

from kvstore.errors import CapacityError, ClosedError, InvalidInputError

__all__ = ["SlabAllocator", "cuda_available"]


def cuda_available() -> bool:
    """True when a CUDA device is usable (pinned host memory then pays off)."""
    return bool(torch.cuda.is_available())


class SlabAllocator:
    """``num_slots`` slots of ``slot_nbytes`` bytes in one buffer on ``device``.

    Thread-safe: ``_lock`` (owned here, held only for free-list updates)
    guards the free stack and the used bitmap. ``alloc`` is all-or-nothing.
    """

    def __init__(
        self,
        slot_nbytes: int,
        num_slots: int,
        device: str | torch.device = "cpu",
        pinned: bool = False,
        shared: bool = False,
    ) -> None:
        if slot_nbytes <= 0 or num_slots <= 0:
            raise InvalidInputError(
                f"slab needs slot_nbytes > 0 and num_slots > 0, got {slot_nbytes}, {num_slots}"
            )
        self.slot_nbytes = slot_nbytes
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.pinned = bool(pinned and self.device.type == "cpu")
        self._mmap: mmap.mmap | None = None
        nbytes = slot_nbytes * num_slots
        self.buffer: torch.Tensor | None
        #: The memfd behind a ``shared`` buffer (other processes map it), else None.
        self.shared_fd: int | None = None
        if shared:
            if self.device.type != "cpu" or self.pinned:
                raise InvalidInputError("only unpinned host memory can be shared")
            self.shared_fd, self._mmap = _shared_map(nbytes)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        elif self.device.type == "cpu" and not self.pinned:
            self._mmap = _anonymous_hugepage_map(nbytes)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            self.buffer = torch.empty(
                nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pinned
            )
        # Low slot numbers first: a lightly used tier touches only the start of the buffer.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = bytearray(num_slots)
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Slots not allocated."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots allocated."""
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` slots, or raise :class:`CapacityError` and take none."""
        if type(n) is not int or n < 0:
            raise InvalidInputError(f"slot count must be an int >= 0, got {n!r}")
        with self._lock:
            if self.buffer is None:
                raise ClosedError("slab allocator is closed")
            if n > len(self._free):
                raise CapacityError(f"need {n} slots, {len(self._free)} of {self.num_slots} free")
            slots = [self._free.pop() for _ in range(n)]
            for slot in slots:
                self._used[slot] = 1
            return slots

    def free(self, slots: list[int]) -> None:
        """Return ``slots`` (all or none).

        Freeing a slot that is not allocated (twice, or never) would let two
        blocks share memory, so it raises :class:`RuntimeError` -- not an
        ``assert``, which ``python -O`` would remove -- and frees nothing.
        """
        with self._lock:
            if len(set(slots)) != len(slots):
                raise RuntimeError(f"slab: slots {slots} listed twice in one free")
            for slot in slots:
                if type(slot) is not int or not 0 <= slot < self.num_slots:
                    raise RuntimeError(f"slab: slot {slot!r} out of range [0, {self.num_slots})")
                if not self._used[slot]:
                    raise RuntimeError(f"slab: slot {slot} freed but not allocated")
            for slot in slots:
                self._used[slot] = 0
                self._free.append(slot)

    def view(self, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` (a uint8 view into the buffer)."""
        if type(slot) is not int or not 0 <= slot < self.num_slots:
            raise InvalidInputError(f"slot {slot!r} out of range [0, {self.num_slots})")
        if self.buffer is None:
            raise ClosedError("slab allocator is closed")
        start = slot * self.slot_nbytes
        return self.buffer[start : start + self.slot_nbytes]

    def close(self) -> None:
        """Release the buffer (pinned memory goes back to the OS now, not at GC)."""
        with self._lock:
            self.buffer = None
            self._free.clear()
            if self._mmap is not None:
                # Views handed out earlier keep the mapping alive until they die.
                with contextlib.suppress(BufferError):
                    self._mmap.close()
                self._mmap = None
            if self.shared_fd is not None:
                os.close(self.shared_fd)  # the memory goes when the last mapping does
                self.shared_fd = None


def _anonymous_hugepage_map(nbytes: int) -> mmap.mmap:
    """Anonymous host memory, backed by transparent huge pages where the kernel allows.

    Huge pages cut first-touch page faults 512-fold and TLB misses on every
    copy; with THP in ``madvise`` mode (a common default) only an explicit
    ``MADV_HUGEPAGE`` gets them. Pages are still committed lazily.
    """
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            region.madvise(advice)
    return region


def _shared_map(nbytes: int) -> tuple[int, mmap.mmap]:
    """Host memory other processes can map: a memfd (no name in any file system, so
    nothing is left behind if the process is killed), mapped shared here."""
    fd = os.memfd_create("kvstore-slab", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:  # honoured where shmem_enabled allows it
        with contextlib.suppress(OSError):
            region.madvise(advice)
    return fd, region
