"""Saves that never block the caller: ``put`` and ``put_layer`` from GPU tensors.

With ``saves.mode: async`` (the default), a store saving from a CUDA tensor does
on the caller's thread only this:

1. takes a region of the GPU staging ring (:class:`StagingRing`) and copies the
   source into it on the caller's current stream: a device-to-device copy,
   microseconds next to the link, ordered after whatever produced the source;
   whatever the caller queues next on its stream runs after it, so the caller
   may overwrite its buffer at once. A full ring makes the caller wait for room
   (backpressure): a save is never dropped;
2. records an event after that copy and queues a job for the saver thread.

The saver thread (:class:`Saver`) takes jobs in order. A whole-block ``put``
waits for its snapshot and runs the ordinary write path from the ring (the
CUDA engine moves the blocks to host memory as DMA copies). A ``put_layer``
claims its blocks' room (:meth:`~kvstore.datapath.layerwrites.LayerWrites.start_layer`)
and queues the copies on the CUDA engine's ``saves`` lane after the snapshot's
event, without waiting; when they land, the lane's completion thread hands the
finish (:meth:`~kvstore.datapath.layerwrites.LayerWrites.end_layer`: the block is
published once its last layer is in) back to the saver thread. A ring region
goes back once its copies have landed.

A block becomes visible when its last copy has landed. :meth:`Saver.wait`
(``store.drain()``, ``flush()``, ``close()``) waits for every save queued;
reads of a key being saved (``lookup``, ``get``, ``prefetch``) first wait for
that key's save (:meth:`Saver.settle`), so a process reads its own writes.
A source larger than the whole ring is saved synchronously, on the caller's
thread. A caller that will never touch its source again may *donate* it
(``put_layer(..., donate=True)``: the vLLM connector does, with the layer it
has just gathered): no snapshot is taken, the saver holds the tensor until its
copies have landed, and donated bytes in flight count against the same
``staging_bytes`` budget. A save that fails is counted (``saves_failed``) and logged: a future
miss, never an error in the engine.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.copies import Event, engine_for
from kvstore.datapath.layerwrites import LayerWrites
from kvstore.datapath.partials import Partial
from kvstore.datapath.writer import FollowUps
from kvstore.keys import BlockKey

__all__ = ["SAVE_COUNTERS", "Region", "Saver", "StagingRing"]

log = logging.getLogger(__name__)

#: Regions start on this many bytes (the alignment CUDA's allocator gives).
ALIGN = 512


@dataclass(eq=False)
class Region:
    """``nbytes`` bytes of the ring from ``start`` on; ``freed`` once given back."""

    start: int
    nbytes: int
    freed: bool = False


class StagingRing:
    """GPU memory for snapshots of sources being saved: taken in order, given back in
    any order (the space is reused once every older region is back too).

    Locking: ``_cond`` guards ``_regions`` and ``_head``; takers wait on it for room.
    """

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.nbytes = nbytes - nbytes % ALIGN
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._cond = threading.Condition()
        self._regions: deque[Region] = deque()
        self._head = 0  # where the next region starts, if it fits there

    def take(self, nbytes: int, waited: Callable[[], None] | None = None) -> Region | None:
        """A region of ``nbytes``; waits while the ring is full. None if ``nbytes`` is
        more than the whole ring. ``waited`` is called once if the caller had to wait."""
        size = -(-nbytes // ALIGN) * ALIGN
        if size > self.nbytes:
            return None
        with self._cond:
            start = self._fit(size)
            if start is None and waited is not None:
                waited()
            while start is None:
                self._cond.wait()
                start = self._fit(size)
            region = Region(start, size)
            self._regions.append(region)
            self._head = start + size
            return region

    def _fit(self, size: int) -> int | None:
        """Where a region of ``size`` fits now, or None. ``_cond`` held."""
        if not self._regions:
            self._head = 0
            return 0
        tail, head = self._regions[0].start, self._head
        if head > tail:  # used: [tail, head); free: [head, end) and [0, tail)
            if self.nbytes - head >= size:
                return head
            return 0 if tail >= size else None
        if head < tail:  # wrapped; free: [head, tail)
            return head if tail - head >= size else None
        return None  # head == tail with regions held: full

    def give(self, region: Region) -> None:
        """Give ``region`` back (its copies have landed)."""
        with self._cond:
            region.freed = True
            while self._regions and self._regions[0].freed:
                self._regions.popleft()
            self._cond.notify_all()

    def view(self, region: Region, like: torch.Tensor) -> torch.Tensor:
        """The start of ``region`` as a contiguous tensor of ``like``'s shape and dtype."""
        nbytes = like.numel() * like.element_size()
        flat = self.buffer[region.start : region.start + nbytes]
        return flat.view(like.dtype).view(like.shape)

    @property
    def used(self) -> int:
        """Bytes held by regions not yet given back (and the ones behind them)."""
        with self._cond:
            return sum(r.nbytes for r in self._regions)


@dataclass(eq=False)
class _Job:
    """A save in the saver's queue. ``layer`` None: a whole-block put."""

    keys: list[BlockKey]
    staged: torch.Tensor
    region: Region | None  # None: a donated source (no snapshot, counted in the budget)
    ready: Event
    layer: int | None = None


@dataclass(eq=False)
class _Landed:
    """A batch of layer jobs whose copies have landed (or failed): finish it on the saver
    thread."""

    job: _Job
    parts: list[Partial]
    follow: FollowUps
    error: BaseException | None
    batch: list[_Job]


def _layer(job: _Job) -> int:
    assert job.layer is not None  # a layer job
    return job.layer


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``device`` made current for CUDA calls (nothing to do for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


#: The saver's counters (``stats()`` of a store adds them up over its savers).
SAVE_COUNTERS = ("saves_queued", "saves_failed", "save_ring_waits", "saves_in_line")

#: At most this many queued layer saves of the same blocks are handed on as one batch.
MERGE_LAYERS = 32


#: Stores whole blocks: ``put(keys, chunks)`` (the store's ordinary synchronous path).
PutBlocks = Callable[[Sequence[BlockKey], Sequence[torch.Tensor]], int]


@dataclass(frozen=True)
class SaverParts:
    """What a :class:`Saver` is handed: the write paths, the follow-up scheduler, and
    how a tensor of ``n`` blocks is cut into chunks."""

    put_blocks: PutBlocks
    layers: LayerWrites
    schedule: Callable[[FollowUps], None]
    chunks: Callable[[torch.Tensor, int], list[torch.Tensor]]
    block_tokens: int


class Saver:
    """Asynchronous saves from one device (see the module docstring): a CUDA device in
    a store; the CPU works too (the thread engine's lanes), which is how CI checks it.

    Locking: ``_cond`` guards ``_jobs``, ``_pending`` (keys being saved, with
    counts), ``_outstanding`` and ``_closed``. The saver thread never holds it
    while it copies, writes or waits.
    """

    def __init__(self, device: torch.device, staging_bytes: int, parts: SaverParts) -> None:
        self.device = device
        self.parts = parts
        self.engine = engine_for(device)
        self.ring = StagingRing(device, staging_bytes)
        self._cond = threading.Condition()
        self._jobs: deque[_Job | _Landed] = deque()
        self._pending: Counter[BlockKey] = Counter()
        self._outstanding = 0
        self._donated = 0  # bytes of donated sources in flight
        self._closed = False
        #: Saves queued, failed, callers that waited for room, sources saved in line.
        self.counts: Counter[str] = Counter(dict.fromkeys(SAVE_COUNTERS, 0))
        self._thread = threading.Thread(target=self._loop, name="kvstore-saver", daemon=True)
        self._thread.start()

    # -- the caller's side --------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], kv: torch.Tensor, donate: bool = False) -> int:
        """Save whole blocks of ``kv`` (``layout.tensor_shape(len(keys))``, on the GPU)."""
        return self._queue(keys, kv, None, donate)

    def put_layer(
        self, keys: Sequence[BlockKey], layer: int, kv_layer: torch.Tensor, donate: bool = False
    ) -> int:
        """Save ``layer`` of blocks from ``kv_layer`` (``layout.layer_shape(len(keys))``)."""
        return self._queue(keys, kv_layer, layer, donate)

    def _queue(
        self, keys: Sequence[BlockKey], src: torch.Tensor, layer: int | None, donate: bool
    ) -> int:
        nbytes = src.numel() * src.element_size()
        if donate:  # the caller hands the tensor over: no snapshot, only the budget
            region, staged = None, src
            self._take_budget(nbytes)
        else:
            region = self.ring.take(nbytes, self._waited)
            if region is None:  # larger than the ring: save it now, on this thread
                self._count("saves_in_line")
                return self._in_line(keys, src, layer)
            staged = self.ring.view(region, src)
            try:
                with _on(self.device):
                    staged.copy_(src)  # on the caller's stream: after the producer, before reuse
            except BaseException:
                self.ring.give(region)
                raise
        with _on(self.device):
            ready = self.engine.mark()
        job = _Job(list(keys), staged, region, ready, layer)
        with self._cond:
            self._pending.update(job.keys)
            self._outstanding += 1
            self._jobs.append(job)
            self.counts["saves_queued"] += 1
            self._cond.notify_all()
        return len(keys)

    def _count(self, name: str) -> None:
        with self._cond:
            self.counts[name] += 1

    def _waited(self) -> None:
        self._count("save_ring_waits")

    def _take_budget(self, nbytes: int) -> None:
        """Count a donated source against ``staging_bytes`` (wait while over it, unless
        nothing else is in flight: one source larger than the budget still goes)."""
        with self._cond:
            if self._donated and self._donated + nbytes > self.ring.nbytes:
                self.counts["save_ring_waits"] += 1
                self._cond.wait_for(
                    lambda: not self._donated or self._donated + nbytes <= self.ring.nbytes
                )
            self._donated += nbytes

    def _in_line(self, keys: Sequence[BlockKey], src: torch.Tensor, layer: int | None) -> int:
        if layer is None:
            return self.parts.put_blocks(keys, self.parts.chunks(src, len(keys)))
        completed, follow = self.parts.layers.write(keys, layer, self._split(src, len(keys)))
        self.parts.schedule(follow)
        return completed

    def _split(self, kv_layer: torch.Tensor, n: int) -> list[torch.Tensor]:
        step = self.parts.block_tokens
        return [kv_layer[:, i * step : (i + 1) * step] for i in range(n)]

    def settle(self, keys: Sequence[BlockKey], timeout: float | None = None) -> bool:
        """Wait until none of ``keys`` is being saved; False on timeout."""
        with self._cond:
            if not self._pending:
                return True
            return self._cond.wait_for(lambda: not any(k in self._pending for k in keys), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every save queued so far has landed (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._outstanding == 0, timeout)

    @property
    def outstanding(self) -> int:
        """Saves queued and not yet finished."""
        with self._cond:
            return self._outstanding

    def close(self) -> None:
        """Finish every save queued, then stop the thread. Idempotent."""
        self.wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # -- the saver thread -----------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # per thread: saves are not part of any graph
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                item = self._jobs.popleft()
                batch = self._more_layers(item)
            if isinstance(item, _Landed):
                self._finish_layers(item)
            elif item.layer is None:
                self._run_put(item)
            else:
                self._start_layers(batch)

    def _more_layers(self, item: _Job | _Landed) -> list[_Job]:
        """``item`` and the layer saves of the same blocks queued right behind it (a
        saver that fell behind catches up in one batch). ``_cond`` held."""
        if isinstance(item, _Landed) or item.layer is None:
            return []
        batch = [item]
        while self._jobs and len(batch) < MERGE_LAYERS:
            nxt = self._jobs[0]
            if isinstance(nxt, _Landed) or nxt.layer is None or nxt.keys != item.keys:
                break
            self._jobs.popleft()
            batch.append(nxt)
        return batch

    def _run_put(self, job: _Job) -> None:
        try:
            job.ready.wait()  # the snapshot is in the ring
            self.parts.put_blocks(job.keys, self.parts.chunks(job.staged, len(job.keys)))
        except Exception:  # a failed save is a future miss, never an engine error
            log.exception("kvstore: saving %d blocks failed", len(job.keys))
            self._count("saves_failed")
        self._done(job)

    def _start_layers(self, batch: list[_Job]) -> None:
        keys = batch[0].keys
        try:
            items = [(_layer(job), self._split(job.staged, len(keys))) for job in batch]
            parts, pairs, follow = self.parts.layers.start_layers(keys, items)
        except Exception:
            log.exception("kvstore: saving %d layers of %d blocks failed", len(batch), len(keys))
            for job in batch:
                self._count("saves_failed")
                self._done(job)
            return
        landed = _Landed(batch[0], parts, follow, None, batch)

        def on_done(error: BaseException | None) -> None:  # on the lane's completion thread
            landed.error = error
            with self._cond:
                self._jobs.append(landed)
                self._cond.notify_all()

        try:
            lane = self.engine.lane("saves")
            for job in batch:
                lane.after(job.ready)
            lane.submit(pairs, on_done=on_done)
        except Exception as exc:  # the engine closed under us: the copies never ran
            on_done(exc)

    def _finish_layers(self, landed: _Landed) -> None:
        layers = [_layer(job) for job in landed.batch]
        try:
            self.parts.layers.end_layers(landed.parts, layers, landed.follow, landed.error)
            self.parts.schedule(landed.follow)
        except Exception:
            log.exception("kvstore: finishing saved layers %s failed", layers)
            self._count("saves_failed")
        if landed.error is not None:
            log.error("kvstore: copying saved layers %s failed: %s", layers, landed.error)
            self._count("saves_failed")
        for job in landed.batch:
            self._done(job)

    def _done(self, job: _Job) -> None:
        if job.region is not None:
            self.ring.give(job.region)
        with self._cond:
            if job.region is None:
                self._donated -= job.staged.numel() * job.staged.element_size()
            job.staged = job.staged[:0]  # the copies are over: let a donated tensor go
            self._pending.subtract(job.keys)
            for key in job.keys:
                if self._pending[key] <= 0:
                    del self._pending[key]
            self._outstanding -= 1
            self._cond.notify_all()
