"""Slab allocation over one preallocated buffer per tier.

Every block of a layout has the same size, so a memory tier is one big
buffer cut into fixed slots: allocation is popping slot numbers off a free
stack, with no per-block ``malloc``/``cudaMalloc``/``cudaHostAlloc`` on the
hot path (pinned allocations cost milliseconds each, which is how peers end
up leaking or fragmenting pinned memory). Freed slots return to the stack at
once, so capacity comes back exactly after deletes and evictions.

Host memory that is not pinned is committed lazily by the kernel, one page
fault at a time, and first-touch faults run at ~1 GB/s on the machines we
measured, against ~20 GB/s for a copy into memory already touched. With
``prefault=True`` a background thread faults the slab in, front to back,
while the store is already serving (see :class:`_Prefaulter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvstore.errors import CapacityError, ClosedError, InvalidInputError

__all__ = ["SlabAllocator", "cuda_available", "madvise", "trim_heap"]

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
#: Linux >= 5.14: fault pages in as if written, without changing their bytes.
#: Python's mmap module names it only from 3.13 on; the value is part of the ABI.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Bytes faulted per madvise call: small enough that close() stops the thread
#: within milliseconds even at the slowest fault rates seen (~0.3 GB/s: ~25 ms).
PREFAULT_CHUNK = 8 << 20
#: Chunk of the fallback (one byte written per page, with the allocator's lock
#: held so no slot is handed out under it): small, as allocations wait for it.
TOUCH_CHUNK = 2 << 20


def cuda_available() -> bool:
    """True when a CUDA device is usable (pinned host memory then pays off)."""
    return bool(torch.cuda.is_available())


class SlabAllocator:
    """``num_slots`` slots of ``slot_nbytes`` bytes in one buffer on ``device``.

    Thread-safe: ``_lock`` (owned here, held only for free-list updates and,
    on kernels without ``MADV_POPULATE_WRITE``, while the prefault thread
    touches never-allocated pages) guards the free stack, the used bitmap,
    ``_fresh`` and ``_cold_writers``. ``alloc`` is all-or-nothing.

    ``prefault``: fault the buffer's pages in on a background thread, front to
    back (host memory that is neither pinned nor on a device only: those are
    committed when allocated). Slots are handed out lowest first and freed
    slots are reused before fresh ones, so allocations land in the part
    already faulted in; the thread skips slots already handed out (their
    writers fault them) and waits while copies fault pages of their own
    (:meth:`writing`). :meth:`prefault_stats` reports progress.
    """

    def __init__(
        self,
        slot_nbytes: int,
        num_slots: int,
        device: str | torch.device = "cpu",
        pinned: bool = False,
        shared: bool = False,
        prefault: bool = False,
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
        # Low slot numbers first: a lightly used tier touches only the start of the
        # buffer, and a prefaulted one uses the part faulted in first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = bytearray(num_slots)
        #: Slots ``< _fresh`` have been handed out at least once (their pages are touched).
        self._fresh = 0
        #: Copies under way into slots past the prefaulted part (see :meth:`writing`).
        self._cold_writers = 0
        self._lock = threading.Lock()
        self._prefaulter: _Prefaulter | None = None
        self._prefault_wanted = prefault
        if prefault and self._mmap is not None:
            _PREFAULTING.add(self)  # first: a fork right after the thread starts must stop it
            self._prefaulter = _Prefaulter(self, _prefault_limit(nbytes))

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
            # ascending: slots freed together come back adjacent and in order, so a
            # batch over them stays one strided copy (the free list hands them out reversed)
            slots.sort()
            for slot in slots:
                self._used[slot] = 1
            if slots:
                self._fresh = max(self._fresh, max(slots) + 1)
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

    @contextlib.contextmanager
    def writing(self, slots: Sequence[int]) -> Iterator[None]:
        """Wrap copies into ``slots``: while any lies past the part already faulted in,
        the prefault thread waits, so those copies fault their own pages with the
        machine to themselves (side by side, both ran slower: first puts right after
        open took 0.64 GB/s against 1.02 with no prefault at all, on cold memory)."""
        pre = self._prefaulter
        end = (max(slots) + 1) * self.slot_nbytes if slots else 0
        if pre is None or not pre.running or end <= pre.ready:
            yield
            return
        with self._lock:
            self._cold_writers += 1
        try:
            yield
        finally:
            with self._lock:
                self._cold_writers -= 1

    def prefault_stats(self) -> dict[str, Any]:
        """Progress of the background prefault.

        ``prefault``: ``off`` (not asked for), ``committed`` (pinned or device
        memory: committed when allocated, nothing to do), ``running``, ``done``
        or ``stopped`` (closed, or this is a forked child: the thread did not
        survive the fork). ``prefault_bytes_ready``: bytes from the front of the
        buffer faulted in (or handed out to writers, who fault them);
        ``prefault_bytes_total``: bytes the prefault covers (less than the
        buffer when memory was short at open).
        """
        nbytes = self.slot_nbytes * self.num_slots
        pre = self._prefaulter
        if pre is not None:
            ready, total = pre.ready, pre.total
            state = "done" if ready >= total else ("running" if pre.running else "stopped")
        elif self._prefault_wanted and self._mmap is None:  # pinned, or device memory
            ready, total, state = nbytes, nbytes, "committed"
        else:
            ready, total, state = 0, 0, "off"
        return {
            "prefault": state,
            "prefault_bytes_ready": ready,
            "prefault_bytes_total": total,
            "prefault_done": ready >= total and state != "off",
        }

    def wait_prefault(self, timeout: float | None = None) -> bool:
        """Wait until the prefault thread ends; True if it finished (or had nothing to do)."""
        pre = self._prefaulter
        if pre is None:
            return True
        pre.join(timeout)
        return pre.ready >= pre.total

    def stop_prefault(self) -> None:
        """Stop the prefault thread after the step in flight (and wait for it)."""
        if self._prefaulter is not None:
            self._prefaulter.stop()

    def close(self) -> None:
        """Release the buffer (pinned memory goes back to the OS now, not at GC)."""
        self.stop_prefault()  # before unmapping: it must not fault a closed mapping
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

    def _after_fork_in_child(self) -> None:
        """The prefault thread did not survive the fork; a lock it held is gone with it."""
        self._lock = threading.Lock()
        if self._prefaulter is not None:
            self._prefaulter.forked()


class _Prefaulter:
    """Faults a host slab's pages in, front to back, on a daemon thread.

    Each step commits one chunk with ``madvise(MADV_POPULATE_WRITE)`` through
    ctypes (which releases the GIL; ``mmap.madvise`` holds it for the whole
    call, stalling every Python thread). On kernels without it (Linux < 5.14,
    other systems) a step writes a zero byte per page of slots never handed out
    -- their bytes are zero already -- holding the allocator's lock so no slot
    is handed out meanwhile. A step starts past the slots already handed out:
    their writers fault those pages, and faulting them twice would only
    compete with the writers for the same page-table locks.

    ``ready`` is written by the thread only and read without a lock (an int).
    """

    def __init__(self, slab: SlabAllocator, total: int) -> None:
        self._slab = weakref.ref(slab)  # no cycle keeping a closed slab's buffer alive
        assert slab.buffer is not None
        self._base = slab.buffer.data_ptr()
        self.total = total
        self.ready = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="kvstore-prefault", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        """True while the thread works (in this process)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self) -> None:
        """Ask the thread to stop after its current chunk and wait for it."""
        self._stopping.set()
        self.join(None)

    def join(self, timeout: float | None) -> None:
        """Wait for the thread to end (at most ``timeout`` seconds)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def forked(self) -> None:
        """In a forked child: the thread is not there (only the forking thread is)."""
        self._stopping.set()
        self._thread = None

    def _run(self) -> None:
        populate = sys.platform.startswith("linux")
        while self.ready < self.total and not self._stopping.is_set():
            chunk = PREFAULT_CHUNK if populate else TOUCH_CHUNK
            handed_out = self._handed_out()
            if handed_out is None:
                return
            if self._writers_faulting():
                self._stopping.wait(0.002)  # let them have the machine; then skip their slots
                continue
            start = max(self.ready, handed_out)
            end = min(self.total, (start // chunk + 1) * chunk)
            if start < end:
                if populate:
                    done = self._populate(start, end)
                    if done is None:
                        return
                    if not done:  # no MADV_POPULATE_WRITE here: touch pages instead
                        populate = False
                        continue
                elif not self._touch(start, end):
                    return
            self.ready = max(self.ready, end)

    def _writers_faulting(self) -> bool:
        slab = self._slab()
        return slab is not None and slab._cold_writers > 0

    def _handed_out(self) -> int | None:
        """Bytes from the front of the buffer already handed out; None once closed."""
        slab = self._slab()
        if slab is None or slab.buffer is None:
            return None
        return slab._fresh * slab.slot_nbytes

    def _populate(self, start: int, end: int) -> bool | None:
        """Fault ``[start, end)`` in; False if the kernel lacks the advice, None on failure."""
        if madvise(self._base + start, end - start, MADV_POPULATE_WRITE) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS):
            return False
        log.debug("prefault stopped at byte %d: %s", start, os.strerror(err))
        return None

    def _touch(self, start: int, end: int) -> bool:
        """Write a zero byte per page of ``[start, end)`` where no slot was handed out."""
        slab = self._slab()
        if slab is None:
            return False
        with slab._lock:
            buffer = slab.buffer
            if buffer is None:
                return False
            start = max(start, slab._fresh * slab.slot_nbytes)
            if start < end:  # never handed out: its bytes are still the kernel's zeros
                first = -(-start // PAGE) * PAGE
                buffer[first:end:PAGE].zero_()
        return True


#: Allocators with a prefault thread, told about forks (their thread does not survive one).
_PREFAULTING: weakref.WeakSet[SlabAllocator] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for slab in list(_PREFAULTING):
        slab._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path, use_errno=True)  # CDLL calls release the GIL
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_LIBC_MADVISE = _libc_madvise()


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` without the GIL; 0, or -1 with ``ctypes.get_errno()`` set (``ENOSYS``
    where libc cannot be loaded). The prefault thread faults each chunk in through this
    module-level name, looked up at each call, so a test can replace it to slow or
    refuse the faults."""
    if _LIBC_MADVISE is None:
        ctypes.set_errno(errno.ENOSYS)
        return -1
    return _LIBC_MADVISE(address, length, advice)


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError):  # no glibc: musl, macOS
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Give the C heap's free memory back to the OS (glibc's ``malloc_trim(0)``, which
    trims every thread's arena); False where the C library has none (musl, macOS).

    A store calls it when it closes. Its threads allocate from glibc's per-thread
    arenas, which keep what is freed; a process that reopened stores grew with each
    reopening (+4.1% RSS over 25 reopenings of a store with three worker threads, +0.9%
    with the trim; the memory soak's embedded store restarts every 45 s)."""
    fn = _libc_malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def _prefault_limit(nbytes: int) -> int:
    """Bytes to prefault: all of them, unless memory is short.

    Committing more than the machine (or this cgroup) has left would get the
    process killed at open, where lazily committed memory only fails once the
    tier fills; so leave 10% of what is available untouched.
    """
    room = _available_memory()
    if room is None:
        return nbytes
    return max(0, min(nbytes, room - room // 10))


def _available_memory() -> int | None:
    """Bytes this process may still commit: MemAvailable, within a cgroup v2 limit."""
    rooms = [r for r in (_mem_available(), _cgroup_room()) if r is not None]
    return min(rooms) if rooms else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2); None if unlimited."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            group = next(line for line in f if line.startswith("0::")).strip()[3:]
        base = f"/sys/fs/cgroup{group.rstrip('/')}"
        with open(f"{base}/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{base}/memory.current", encoding="ascii") as f:
            return int(limit) - int(f.read())
    except (OSError, ValueError, StopIteration):
        return None


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
