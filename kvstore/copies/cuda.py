"""The CUDA copy engine: the contract of ``base.py`` on CUDA streams and events.

One engine per CUDA device (:func:`kvstore.copies.engine_for`). Each lane is a
persistent CUDA stream made once; :meth:`CudaLane.submit` queues the batch's
copies on it at once, on the submitting thread, and records a CUDA event after
them -- nothing waits for a worker to pick the batch up. Copies are coalesced
(adjacent blocks become one copy) and then, where :func:`~kvstore.copies.rows.plan_rows`
finds rows, issued as ``cudaMemcpy2DAsync`` DMA copies straight between pinned
host memory and the device (``cudart.py``); otherwise ``copy_(non_blocking=True)``.

Completion: a lane has one completion thread that sleeps in
``cudaEventSynchronize`` on blocking-sync events (no spinning), then runs the
batch's ``on_done`` and marks its :class:`CudaEvent` done for CPU waiters,
in queue order. It also holds the batch's tensors until then, so the caching
allocator cannot hand their memory to anyone while a copy still reads it.
:meth:`CudaEvent.wait_stream` and :meth:`CudaLane.after` wait on the GPU:
``stream.wait_event``; the calling thread returns at once.

:meth:`CudaCopyEngine.copy_all` (synchronous) orders its copies after the
caller's current stream (the producer of a GPU source, the last user of a GPU
destination), runs them on a stream per direction, and sleeps until they are
done. :meth:`CudaCopyEngine.mark` is an event on the caller's current stream,
for lanes to order after (a GPU tensor produced there).

Locking: each lane's ``_cond`` guards its queue of pending batches, its counts
and its state, and is held while a batch is queued on the stream (so the
stream order is the lock order); the completion thread never holds it while it
waits for the GPU or runs ``on_done``. The engine's ``_lock`` guards its lanes
and direction streams.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.copies import cudart, kernel
from kvstore.copies.base import CopyEngine, Event, Lane, OnDone, WorkerLane
from kvstore.copies.coalescing import (
    CopyPair,
    coalesce,
    copy_pairs,
    needs_inference_mode,
    touches_cuda,
)
from kvstore.copies.rows import plan_rows

__all__ = ["CudaCopyEngine", "CudaEvent", "CudaLane"]

log = logging.getLogger(__name__)


def _blocking_event() -> torch.cuda.Event:
    """A CUDA event whose host waits sleep (``cudaEventBlockingSync``), without timing."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


def _wait_cuda(event: torch.cuda.Event, timeout: float | None) -> bool:
    """Sleep until ``event`` completes (blocking-sync event); with a timeout, poll it
    with growing sleeps (CUDA has no timed wait)."""
    if timeout is None:
        event.synchronize()
        return True
    deadline, pause = time.monotonic() + timeout, 20e-6
    while not event.query():  # type: ignore[no-untyped-call]
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1e-3)
    return True


class CudaEvent(Event):
    """A point on a CUDA stream.

    A lane's event (``tracked``) is done for CPU waiters once the lane's
    completion thread saw the CUDA event complete and ran the batch's
    ``on_done``. A mark (:meth:`CudaCopyEngine.mark`) is only the CUDA event: its
    CPU waits go to CUDA. ``cuda_event`` None: done from the start.
    """

    def __init__(self, cuda_event: torch.cuda.Event | None, tracked: bool) -> None:
        #: The CUDA event (public so that lanes of the engine can order on it).
        self.cuda_event = cuda_event
        self._flag: threading.Event | None = threading.Event() if tracked else None
        self._error: BaseException | None = None
        if cuda_event is None and self._flag is not None:
            self._flag.set()

    def set_done(self, error: BaseException | None) -> None:
        """Mark a tracked event done (its lane's completion thread calls this once)."""
        assert self._flag is not None
        self._error = error
        self._flag.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag is not None:
            return self._flag.wait(timeout)
        return self.cuda_event is None or _wait_cuda(self.cuda_event, timeout)

    def done(self) -> bool:
        if self._flag is not None:
            return self._flag.is_set()
        return self.cuda_event is None or bool(self.cuda_event.query())  # type: ignore[no-untyped-call]

    @property
    def error(self) -> BaseException | None:
        return self._error if self.done() else None

    def wait_stream(self, stream: object | None = None) -> None:
        """Make ``stream`` (None: the current stream) wait on the GPU; returns at once."""
        if self.cuda_event is None:
            return
        target = stream if stream is not None else torch.cuda.current_stream()
        assert isinstance(target, torch.cuda.Stream)
        target.wait_event(self.cuda_event)


class _Copier:
    """Queues a batch's copies on a stream: DMA rows where a plan exists, else ``copy_``.

    ``bytes_dma`` / ``copies_dma`` / ``copies_torch`` count what went which way
    (read under no lock: figures for benchmarks, not invariants).
    """

    def __init__(self, runtime: cudart.CudaRuntime | None) -> None:
        self.runtime = runtime
        #: Device-to-device copies: ``rows`` (our rows kernel, ``kernel.py``, for a
        #: batch of many rows where Triton is installed; the others where it is not or
        #: may not take the batch), ``kernel`` (torch's copy kernel over the widest
        #: element the views allow) or ``dma`` (row copies, as between host and device).
        self.d2d = "rows"
        self.copies_dma = 0
        self.bytes_dma = 0
        self.copies_torch = 0
        self.batches_rows = 0
        self.bytes_rows = 0

    def enqueue(self, pairs: Sequence[CopyPair], stream: torch.cuda.Stream) -> None:
        merged = coalesce(pairs, strided=self.runtime is not None)
        mode = torch.inference_mode() if needs_inference_mode(merged) else contextlib.nullcontext()
        handle = stream.cuda_stream
        with torch.cuda.stream(stream), mode:
            if self.d2d == "rows" and all(d.is_cuda and s.is_cuda for d, s in merged):
                nbytes = kernel.try_copy(merged)
                if nbytes:
                    self.batches_rows += 1
                    self.bytes_rows += nbytes
                    return
            for dst, src in merged:
                if self.d2d != "dma" and dst.is_cuda and src.is_cuda:
                    wide_dst, wide_src = _widened(dst, src)
                    wide_dst.copy_(wide_src)
                    self.copies_torch += 1
                    continue
                plan = plan_rows(dst, src) if self.runtime is not None else None
                if plan is None:
                    dst.copy_(src, non_blocking=True)
                    self.copies_torch += 1
                    continue
                for rows in plan:
                    self.runtime.copy(rows, handle)  # type: ignore[union-attr]
                    self.bytes_dma += rows.width * rows.height
                self.copies_dma += len(plan)


_WIDE = (torch.complex128, torch.int64, torch.int32)


def _widened(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` seen as the widest element (16, 8, 4 bytes) both allow, for
    a copy of the same bytes in fewer, wider loads and stores (a strided bf16 copy
    spends its time computing offsets); as they are where no wider view exists."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.dim() == 0:
        return dst, src
    if dst.stride(-1) != 1 or src.stride(-1) != 1 or type(dst) is not torch.Tensor:
        return dst, src
    for wide in _WIDE:
        if wide.itemsize <= dst.element_size():
            break
        try:
            return dst.view(wide), src.view(wide)
        except RuntimeError:  # sizes, strides or offsets not multiples of the wider element
            continue
    return dst, src


@dataclass(eq=False)
class _Pending:
    """A batch (or a record) queued on a lane's stream, not yet seen complete."""

    cuda_event: torch.cuda.Event
    event: CudaEvent
    pairs: list[CopyPair] = field(default_factory=list)
    on_done: OnDone | None = None
    error: BaseException | None = None


class CudaLane(WorkerLane):
    """A persistent CUDA stream, with a completion thread for CPU waiters and ``on_done``.

    ``_cond`` (see :class:`~kvstore.copies.base.WorkerLane`) also guards ``_pending``."""

    def __init__(self, name: str, device: torch.device, copier: _Copier) -> None:
        super().__init__(name, "kvstore-cuda")
        self.device = device
        self._copier = copier
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._pending: deque[_Pending] = deque()

    def __repr__(self) -> str:
        return f"CudaLane({self.name!r}, {self.device})"

    def submit(self, pairs: Sequence[CopyPair], on_done: OnDone | None = None) -> Event:
        batch = list(pairs)
        if batch and not touches_cuda(batch):
            return self._submit_host(batch, on_done)
        with self._cond:
            self._check_open()
            error: BaseException | None = None
            try:
                with torch.cuda.device(self.device):
                    self._copier.enqueue(batch, self.stream)
            except BaseException as exc:  # delivered through the event, as the contract says
                error = exc
            cuda_event = self._record()
            item = _Pending(cuda_event, CudaEvent(cuda_event, True), batch, on_done, error)
            self._push(item)
        return item.event

    def _submit_host(self, pairs: list[CopyPair], on_done: OnDone | None) -> Event:
        """A batch without a GPU tensor has nothing to order it on the stream: it runs
        now, on the caller's thread, once everything queued before it is done."""
        with self._cond:
            self._check_open()
        self.drain()
        error: BaseException | None = None
        try:
            copy_pairs(pairs)
        except BaseException as exc:
            error = exc
        if on_done is not None:
            try:
                on_done(error)
            except BaseException:
                log.exception("copy lane %r: on_done callback raised", self.name)
        event = CudaEvent(None, True)
        event.set_done(error)
        return event

    def record(self) -> Event:
        with self._cond:
            self._check_open()
            if self._finished == self._queued:
                return CudaEvent(None, True)
            cuda_event = self._record()
            event = CudaEvent(cuda_event, True)
            self._push(_Pending(cuda_event, event))
        return event

    def after(self, event: Event) -> None:
        with self._cond:
            self._check_open()
            if isinstance(event, CudaEvent):
                if event.cuda_event is not None:
                    self.stream.wait_event(event.cuda_event)
                return
        event.wait()  # an event of another engine: nothing the GPU can wait on

    # -- internals -----------------------------------------------------------------
    def _record(self) -> torch.cuda.Event:
        """A blocking-sync CUDA event after everything queued so far. ``_cond`` held."""
        cuda_event = _blocking_event()
        cuda_event.record(self.stream)
        return cuda_event

    def _push(self, item: _Pending) -> None:
        """Hand ``item`` to the completion thread. ``_cond`` held."""
        self._pending.append(item)
        self._counted()

    def _work(self) -> None:
        """Completion thread: in queue order, wait for each batch, run on_done, mark it."""
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                item = self._pending[0]
            error = item.error
            try:
                item.cuda_event.synchronize()
            except BaseException as exc:  # a CUDA error surfaced here belongs to the batch
                error = error or exc
            item.pairs = []  # the copies are over: the tensors may go
            if item.on_done is not None:
                try:
                    item.on_done(error)
                except BaseException:
                    log.exception("copy lane %r: on_done callback raised", self.name)
            item.event.set_done(error)
            with self._cond:
                self._pending.popleft()
                self._finished += 1
                self._cond.notify_all()


class CudaCopyEngine(CopyEngine):
    """The copy engine of one CUDA device: lanes on persistent streams, DMA row copies.

    ``dma=False`` copies with torch's ``copy_`` only (for comparisons and tests).
    """

    def __init__(self, device: torch.device | str, dma: bool = True) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__()
        self.device = dev
        self._copier = _Copier(cudart.load() if dma else None)
        self._streams: dict[str, torch.cuda.Stream] = {}  # guarded by _lock

    def __repr__(self) -> str:
        dma = "dma" if self._copier.runtime is not None else "copy_"
        return f"CudaCopyEngine({self.device}, {dma}, lanes={sorted(self._lanes)})"

    @property
    def dma(self) -> bool:
        """True when copies go through ``cudaMemcpy2DAsync`` where they can."""
        return self._copier.runtime is not None

    @property
    def d2d(self) -> str:
        """How device-to-device copies run: ``rows`` (the default: the rows kernel
        where Triton is installed and the batch has many rows, else ``kernel``),
        ``kernel`` (torch's copy kernel) or ``dma`` (2-D DMA row copies)."""
        return self._copier.d2d

    @d2d.setter
    def d2d(self, how: str) -> None:
        if how not in ("rows", "kernel", "dma"):
            raise ValueError(f"d2d: rows, kernel or dma, got {how!r}")
        self._copier.d2d = how

    def stats(self) -> dict[str, Any]:
        """What went which way: DMA calls and bytes, ``copy_`` calls."""
        c = self._copier
        return {
            "dma": self.dma,
            "copies_dma": c.copies_dma,
            "bytes_dma": c.bytes_dma,
            "copies_torch": c.copies_torch,
            "d2d": c.d2d,
            "rows_kernel": kernel.reason(),
            "batches_rows": c.batches_rows,
            "bytes_rows": c.bytes_rows,
        }

    def copy_all(self, pairs: Sequence[CopyPair]) -> None:
        batch = list(pairs)
        if not batch:
            return
        if not touches_cuda(batch):
            copy_pairs(batch)
            return
        with torch.cuda.device(self.device):
            stream = self._direction_stream(batch)
            stream.wait_stream(torch.cuda.current_stream())
            done = _blocking_event()
            try:
                self._copier.enqueue(batch, stream)
            finally:  # what was queued must land before the caller may drop its tensors
                done.record(stream)
                done.synchronize()

    def _direction_stream(self, pairs: Sequence[CopyPair]) -> torch.cuda.Stream:
        """The stream for synchronous copies of this direction (made once)."""
        dst, src = next((d, s) for d, s in pairs if d.is_cuda or s.is_cuda)
        name = {(True, False): "h2d", (False, True): "d2h"}.get((dst.is_cuda, src.is_cuda), "d2d")
        with self._lock:
            stream = self._streams.get(name)
            if stream is None:
                stream = self._streams[name] = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            return stream

    def mark(self) -> Event:
        """An event after the work queued so far on the caller's current stream."""
        with torch.cuda.device(self.device):
            cuda_event = _blocking_event()
            cuda_event.record(torch.cuda.current_stream())
        return CudaEvent(cuda_event, tracked=False)

    def _make_lane(self, name: str) -> Lane:
        return CudaLane(name, self.device, self._copier)
