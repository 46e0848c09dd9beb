"""Prefetch: asynchronous, layer-by-layer loads of a stored prefix.

``KVStore.prefetch(keys, out)`` pins the stored prefix of ``keys`` under a
lease and loads it into ``out`` in the background, a step of
``layers_per_step`` layers at a time for every block (``order="layer"``) --
so an engine can run layer ``i`` while layer ``i+1`` is still arriving -- or
a block at a time (``order="block"``), so a partial prefix is usable early.

Each block comes from its fastest copy. Blocks a memory tier holds are copied
straight from the tier's memory (a view, valid while the lease pins it) by
the copy engine, on the ``prefetch`` lane: the loader queues each step's copies
and the lane reports the step done when they are. Blocks only slower tiers
hold are read (verified, with fallback) by the :class:`~kvstore.datapath.reader.Reader`
on the loader's thread. The lease ends only once the last queued copy is done.

Into host memory, at most two steps are in flight, so a cancel takes effect
after the step in flight. Into a GPU, the copies are ordered on the GPU
instead: the destination's CUDA engine queues them after the point where the
caller's stream last used ``out`` (:meth:`CopyEngine.mark` at ``prefetch()``);
blocks only slower tiers hold are read first, whole, into pinned staging (two
buffers of ``prefetch.staging_bytes / 2`` in turn, so a group is read while the
one before is copied) and copied from there; then every step of the
memory-tier blocks is queued at once, each with its event, so
:meth:`PrefetchHandle.wait_layer_on` lets the engine's stream wait for a layer
on the GPU while the CPU goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvstore.config import PrefetchConfig
from kvstore.copies import BlockRun, CopyEngine, Event, block_runs, engine_for
from kvstore.datapath import contracts
from kvstore.datapath.books import Books
from kvstore.datapath.contracts import Step
from kvstore.datapath.index import Entry
from kvstore.datapath.leases import Lease
from kvstore.datapath.reader import Reader
from kvstore.datapath.tierio import TierIO
from kvstore.errors import BlockNotFoundError, InvalidInputError, KVStoreError
from kvstore.keys import BlockKey
from kvstore.runtime import cuda_available

__all__ = ["PrefetchHandle", "Prefetcher", "Step"]

log = logging.getLogger(__name__)

LANE = "prefetch"

#: ``loaded(keys, entries)``: the blocks a prefetch loaded, with their index entries.
Loaded = Callable[[Sequence[BlockKey], Sequence[Entry]], None]


class PrefetchHandle(contracts.PrefetchHandle):
    """The :class:`~kvstore.datapath.contracts.PrefetchHandle` a :class:`Prefetcher`
    returns: the loader and the copy lane report each step through the methods below
    the consumer's (``_progress``, ``_shrink``, ``_queued``, ``_finish``)."""

    def __init__(
        self, keys: Sequence[BlockKey], valid: int, num_layers: int, config: PrefetchConfig
    ) -> None:
        self.keys = list(keys)
        self.num_layers = num_layers
        self.config = config
        self.out: torch.Tensor | None = None  # the destination (set by KVStore.prefetch)
        # One lock guards every field below; layer waiters and whole-load waiters
        # wait on separate conditions so that wait() sleeps through per-layer progress.
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._end = threading.Condition(lock)
        self._valid = valid
        self._layers_done = 0
        self._blocks_done = 0
        self._done = False
        self._cancelled = False
        self._error: KVStoreError | None = None
        self._steps: list[Step] = []
        #: Per layer, the copy event after which it is in place (set once it is queued).
        self._layer_events: list[Event | None] = [None] * num_layers
        self._started = time.perf_counter()
        self._waited = 0.0  # seconds callers spent blocked in the waits
        #: Seconds from the start to the loader's end (None: not ended): what a restore
        #: plan's expected load time is compared with.
        self.load_s: float | None = None

    # -- progress (called by the loader and the copy lane) ----------------------------
    def _progress(self, step: Step, failed_at: int | None, whole_blocks: bool) -> None:
        with self._cond:
            if failed_at is not None and failed_at < self._valid:
                self._valid = failed_at
                key = self.keys[failed_at].hex()
                self._error = BlockNotFoundError(f"block {failed_at} ({key}) failed to load")
            if whole_blocks:
                reached = step.last_block if failed_at is None else failed_at
                self._blocks_done = max(self._blocks_done, min(reached, self._valid))
            else:
                self._layers_done = max(self._layers_done, step.last_layer)
            self._steps.append(step)
            self._cond.notify_all()

    def _shrink(self, failed_at: int) -> None:
        """Block ``failed_at`` could not be read: the prefix ends before it."""
        with self._cond:
            if failed_at < self._valid:
                self._valid = failed_at
                key = self.keys[failed_at].hex()
                self._error = BlockNotFoundError(f"block {failed_at} ({key}) failed to load")
            self._cond.notify_all()

    def _queued(self, first: int, last: int, event: Event) -> None:
        """Layers ``[first, last)`` of every valid block are queued, done with ``event``."""
        with self._cond:
            for layer in range(first, last):
                self._layer_events[layer] = event
            self._cond.notify_all()

    def _finish(self, layers_complete: bool) -> None:
        with self._cond:
            if layers_complete:
                self._layers_done = self.num_layers
                self._blocks_done = max(self._blocks_done, self._valid)
            self._done = True
            self.load_s = time.perf_counter() - self._started
            self._cond.notify_all()
            self._end.notify_all()

    # -- the consumer's side ---------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        with self._cond:
            return self._cancelled

    @property
    def done(self) -> bool:
        with self._cond:
            return self._done

    @property
    def valid_blocks(self) -> int:
        with self._cond:
            return self._valid

    @property
    def blocks_ready(self) -> int:
        with self._cond:
            return self._blocks_done

    @property
    def error(self) -> KVStoreError | None:
        with self._cond:
            return self._error

    @property
    def steps(self) -> list[Step]:
        with self._cond:
            return list(self._steps)

    @property
    def waited_s(self) -> float:
        with self._cond:
            return self._waited

    def _blocked(
        self, cond: threading.Condition, ready: Callable[[], bool], timeout: float | None
    ) -> bool:
        """``cond.wait_for(ready, timeout)`` (``cond`` held), its seconds counted."""
        start = time.perf_counter()
        try:
            return cond.wait_for(ready, timeout)
        finally:
            self._waited += time.perf_counter() - start

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        if not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer {layer} out of range [0, {self.num_layers})")

        def arrived() -> bool:
            return self._layers_done > layer or self._done

        with self._cond:
            return self._blocked(self._cond, arrived, timeout)

    def wait_layer_on(self, layer: int, stream: object | None = None) -> None:
        if not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer {layer} out of range [0, {self.num_layers})")

        def queued() -> bool:
            return self._layer_events[layer] is not None or self._done

        with self._cond:
            self._blocked(self._cond, queued, None)
            event = self._layer_events[layer]
        if event is not None:
            event.wait_stream(stream)
        else:  # the load ended without queueing this layer (cancelled, failed, block order)
            self.wait_layer(layer)

    def wait(self, timeout: float | None = None) -> bool:
        with self._end:
            return self._blocked(self._end, lambda: self._done, timeout)

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True

    def result(self, num_tokens: int | None = None) -> int:
        policy = self.config.policy
        if policy == "wait_complete":
            self.wait()
        elif policy == "timeout":
            tokens = num_tokens if num_tokens is not None else 0
            self.wait(self.config.deadline_s(tokens))
        if not self.done:
            self.cancel()
        return self.blocks_ready

    def __enter__(self) -> PrefetchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
        self.wait()


@dataclass
class _Load:
    """One prefetch in progress: its handle, lease, destination views and plan.

    ``engine`` copies it (the CUDA engine of a GPU destination); ``ready`` is the
    point on the caller's stream after which the destination may be written.
    """

    handle: PrefetchHandle
    lease: Lease
    views: list[torch.Tensor]
    order: str
    step: int
    engine: CopyEngine
    ready: Event | None = None
    sources: list[torch.Tensor | None] = field(default_factory=list)  # memory-tier views
    in_flight: list[Event] = field(default_factory=list)
    staging: list[tuple[torch.Tensor, Event | None]] = field(default_factory=list)
    queued: int = 0  # steps already queued (the first, on the caller's thread)
    slow_layers: int = 1  # layers read a call from slower tiers (layer order)
    slow_until: int = 0  # layers of the slower tiers' blocks read so far (layer order)
    runs: list[BlockRun] = field(default_factory=list)  # stacked views, made once a load


class Prefetcher:
    """Runs prefetches on ``config.threads`` loader threads and the copy engine's
    ``prefetch`` lane (the destination's CUDA engine for a GPU destination)."""

    def __init__(
        self,
        reader: Reader,
        copies: CopyEngine,
        config: PrefetchConfig,
        lease_s: float,
        loaded: Loaded | None = None,
    ) -> None:
        # The books and tier calls are the reader's: a prefetch pins and reads through
        # the same pieces as a get (and a loan).
        self.reader = reader
        #: Told the keys and entries of each prefetch's loaded blocks (the manager
        #: promotes those read from slow tiers, as after a get).
        self.loaded = loaded
        self.books: Books = reader.books
        self.io: TierIO = reader.io
        self.copies = copies
        self.config = config
        self.lease_s = lease_s
        self.num_layers = self.io.layout.num_layers
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-prefetch")
        self._live: set[PrefetchHandle] = set()
        self._lock = threading.Lock()  # guards _live

    def start(
        self,
        keys: Sequence[BlockKey],
        views: list[torch.Tensor],
        order: str,
        step: int,
        ordered: bool | None = None,
    ) -> PrefetchHandle:
        """Pin the stored prefix of ``keys`` and load it into the block ``views``.

        ``ordered``: queue every copy at once, ordered by the copy engine's events
        (slower tiers read first, through staging) -- what a GPU destination gets
        (None: ordered exactly for GPU destinations); else step by step, slower
        tiers read straight into ``views``, at most two steps in flight.
        """
        gpu = bool(views) and views[0].is_cuda
        engine = engine_for(views[0].device) if gpu else self.copies
        if ordered is None:
            ordered = gpu
        ready = engine.mark() if ordered else None  # the caller's last use of ``out``
        lease = self.books.leases.lease(keys, self.lease_s)
        handle = PrefetchHandle(keys, len(lease.entries), self.num_layers, self.config)
        with self._lock:
            self._live.add(handle)
        load = _Load(handle, lease, views, order, step, engine, ready)
        inference = bool(views) and views[0].is_inference()
        with torch.inference_mode(inference):
            if ordered:
                self._first_step(load)
            elif order == "layer":
                self._first_runs_step(load)
        self._pool.submit(self._run, load)
        return handle

    def _run(self, load: _Load) -> None:
        # An engine that made ``out`` under torch.inference_mode() (vLLM does) gets an
        # "inference tensor": copying into it in place is refused outside that mode, and
        # the mode is per thread. The loader runs in the mode its destination was made in.
        inference = bool(load.views) and load.views[0].is_inference()
        complete = False
        try:
            with torch.inference_mode(inference):
                complete = self._load_gpu(load) if load.ready is not None else self._load(load)
        except Exception:  # the loader outlives any load: what it queued still counts
            log.exception("prefetch of %d blocks failed", len(load.handle.keys))
            load.handle._shrink(load.handle.blocks_ready)
        finally:
            for event in load.in_flight:  # the lease keeps the sources alive until here
                event.wait()
            load.staging.clear()
            self.books.leases.release(load.lease)
            self._tell_loaded(load, complete)  # before the handle ends: a drain sees it
            load.handle._finish(complete)
            with self._lock:
                self._live.discard(load.handle)

    def _tell_loaded(self, load: _Load, complete: bool) -> None:
        """Hand the loaded blocks to :attr:`loaded` (every valid block of a load that ran
        to its end; a layer-order load's blocks count only then); a failure there is
        logged, never the prefetch's."""
        ready = load.handle.valid_blocks if complete else load.handle.blocks_ready
        if self.loaded is None or ready == 0:
            return
        try:
            self.loaded(load.handle.keys[:ready], load.lease.entries[:ready])
        except Exception:
            log.exception("after the prefetch of %d blocks", ready)

    def _load(self, load: _Load) -> bool:
        """Run every step; True if the load ran to its end (not cancelled)."""
        if load.runs:  # begun on the caller's thread (_first_runs_step)
            return self._load_runs(load)
        load.sources = self._sources(load)
        handle = load.handle
        valid = handle.valid_blocks
        if load.order == "layer" and valid and all(s is not None for s in load.sources[:valid]):
            load.runs = block_runs(load.views, load.sources, valid)
            return self._load_runs(load)
        if load.order == "layer":
            load.slow_layers = self._slow_layers(load)
            for first in range(0, self.num_layers, load.step):
                last = min(self.num_layers, first + load.step)
                if not self._step(load, (0, handle.valid_blocks), (first, last)):
                    return False
            return True
        for first in range(0, handle.valid_blocks, load.step):
            if not self._step(load, (first, min(handle.valid_blocks, first + load.step)), None):
                return False
        return True

    def _load_runs(self, load: _Load) -> bool:
        """Layer order, every block in a memory tier: the views of adjacent blocks are
        stacked once for the whole load (:func:`block_runs`), so a step costs a view per
        run, not a view per block and a coalescing pass; at most two steps in flight."""
        for index, step in enumerate(self._ranges(load)):
            if index < load.queued:
                continue
            if load.handle.cancelled:
                return False
            if len(load.in_flight) >= 2:
                load.in_flight.pop(0).wait()
            self._keep_alive(load)
            self._queue_step(load, load.runs, step)
        return True

    def _first_runs_step(self, load: _Load) -> None:
        """On the caller's thread, a layer-order load into host memory whose blocks memory
        tiers hold: find the sources, stack the runs and queue the first step now, so that
        the first layer's copy does not wait for a loader thread to be scheduled (the
        CPU twin of :meth:`_first_step`); the loader goes on from the second step."""
        try:
            valid = load.handle.valid_blocks
            if not valid:
                return
            sources = self._sources(load)
            if any(source is None for source in sources[:valid]):
                return  # slower tiers: the loader reads them, from the first step
            load.sources = sources
            load.runs = block_runs(load.views, sources, valid)
            self._queue_step(load, load.runs, self._ranges(load)[0])
            load.queued = 1
        except Exception:  # the loader starts over and reports it
            log.exception("prefetch: queueing the first step failed")
            load.sources, load.runs, load.queued = [], [], 0

    def _sources(self, load: _Load) -> list[torch.Tensor | None]:
        """For each pinned block, a view of its fastest copy where a memory tier holds it."""
        entries = load.lease.entries
        sources: list[torch.Tensor | None] = []
        for key, level in zip(load.handle.keys, self.books.queries.fastest(entries), strict=False):
            sources.append(self.io.view(level, key) if level >= 0 else None)
        return sources

    def _slow_layers(self, load: _Load) -> int:
        """Layers a call reads of the blocks only slower tiers hold: enough that a slow
        link's latency is paid once a block, not once a layer (the most any of their
        tiers wants: :meth:`SpeedEstimate.layers_per_call`)."""
        entries = load.lease.entries
        levels = {
            level
            for level, source in zip(
                self.books.queries.fastest(entries), load.sources, strict=False
            )
            if source is None and level >= 0
        }
        most = load.step
        for level in levels:
            speed = self.io.speed(level)
            if speed is not None:
                most = max(
                    most, speed.layers_per_call(self.io.layout.layer_nbytes, self.num_layers)
                )
        return most

    def _step(self, load: _Load, blocks: tuple[int, int], layers: tuple[int, int] | None) -> bool:
        """Queue one step; False when the load must stop (cancelled or nothing left)."""
        handle = load.handle
        lo, hi = blocks[0], min(blocks[1], handle.valid_blocks)
        if handle.cancelled or lo >= hi:
            return False
        if len(load.in_flight) >= 2:  # at most two steps in flight
            load.in_flight.pop(0).wait()
        self._keep_alive(load)
        began = time.perf_counter()
        pairs, bad = self._read_slow(load, lo, hi, layers)
        event = self._submit(load, pairs, (lo, hi, layers, began), bad)
        if layers is not None:
            handle._queued(layers[0], layers[1], event)
        return True

    def _keep_alive(self, load: _Load) -> None:
        if load.lease.expiry - self.books.clock() < self.lease_s / 2:  # rarely: keep it alive
            self.books.leases.renew(load.lease, self.lease_s)

    def _submit(
        self,
        load: _Load,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        where: tuple[int, int, tuple[int, int] | None, float],
        bad: int | None,
    ) -> Event:
        """Queue a step's copies on the prefetch lane; the handle hears when they land."""
        handle = load.handle
        lo, hi, layers, began = where
        first, last = layers if layers is not None else (0, self.num_layers)

        def finished(error: BaseException | None) -> None:
            failed = lo if error is not None else bad
            record = Step(lo, hi, first, last, began, time.perf_counter())
            handle._progress(record, failed, whole_blocks=layers is None)

        event = load.engine.lane(LANE).submit(pairs, on_done=finished)
        load.in_flight.append(event)
        return event

    def _read_slow(
        self, load: _Load, lo: int, hi: int, layers: tuple[int, int] | None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int | None]:
        """This step's copies from memory tiers (for the lane), after reading the blocks
        slower tiers hold on this thread; and the first block that failed, if any."""
        first, last = layers if layers is not None else (0, self.num_layers)
        pairs, slow = [], []
        for i in range(lo, hi):
            out = load.views[i][first:last]
            source = load.sources[i] if i < len(load.sources) else None
            if source is not None:
                pairs.append((out, source[first:last]))
            else:
                slow.append(i)
        bad = None
        if layers is not None:  # read ahead as many layers as a call of their tiers takes
            if first < load.slow_until:
                return pairs, None  # read with an earlier step's layers
            last = max(last, min(self.num_layers, first + load.slow_layers))
            load.slow_until = last
            layers = (first, last)
        if slow:
            keys = [load.handle.keys[i] for i in slow]
            entries = [load.lease.entries[i] for i in slow]
            outs = [load.views[i][first:last] for i in slow]
            ok = self.reader.read(keys, entries, outs, layers)
            bad = next((slow[n] for n, good in enumerate(ok) if not good), None)
        return pairs, bad

    # -- into a GPU: everything queued at once, ordered on the GPU ------------------
    def _load_gpu(self, load: _Load) -> bool:
        """A GPU destination: blocks only slower tiers hold are read first (whole, into
        pinned staging, double-buffered) and their copies queued; then every step of the
        memory-tier blocks is queued at once, an event per step. True unless cancelled.
        (The first step may already be queued, by :meth:`_first_step` in ``start``.)"""
        handle = load.handle
        if not load.sources:  # not begun on the caller's thread
            self._begin_ordered(load)
        slow = [i for i in range(handle.valid_blocks) if load.sources[i] is None]
        if slow and not self._stage_slow(load, slow):
            return False
        runs = block_runs(load.views, load.sources, handle.valid_blocks)
        for index, step in enumerate(self._ranges(load)):
            if index < load.queued:
                continue
            if handle.cancelled:
                return False
            self._queue_step(load, runs, step)
        return True

    def _begin_ordered(self, load: _Load) -> None:
        """Order the prefetch lane after the caller's use of ``out``; find the sources."""
        assert load.ready is not None
        load.engine.lane(LANE).after(load.ready)  # the caller's stream is done with ``out``
        load.sources = self._sources(load)

    def _first_step(self, load: _Load) -> None:
        """On the caller's thread, for a prefix that memory tiers hold entirely: queue the
        first step now, so that the copies start without waiting for a loader thread
        (which may wait for the GIL while the engine runs Python)."""
        try:
            self._begin_ordered(load)
            valid = load.handle.valid_blocks
            if not valid or any(source is None for source in load.sources[:valid]):
                return
            self._queue_step(
                load, block_runs(load.views, load.sources, valid), self._ranges(load)[0]
            )
            load.queued = 1
        except Exception:  # the loader starts over and reports it
            log.exception("prefetch: queueing the first step failed")
            load.sources = []

    def _ranges(self, load: _Load) -> list[tuple[tuple[int, int], tuple[int, int] | None]]:
        """The steps: ``((first block, end block), (first layer, end layer) or None)``."""
        valid, layers = load.handle.valid_blocks, self.num_layers
        if load.order == "layer":
            return [
                ((0, valid), (a, min(layers, a + load.step))) for a in range(0, layers, load.step)
            ]
        return [((a, min(valid, a + load.step)), None) for a in range(0, valid, load.step)]

    def _queue_step(
        self,
        load: _Load,
        runs: list[BlockRun],
        step: tuple[tuple[int, int], tuple[int, int] | None],
    ) -> None:
        """Queue one step's copies (a view per run of adjacent blocks) with its event."""
        (lo, hi), layers = step
        first, last = layers if layers is not None else (0, self.num_layers)
        hi = min(hi, load.handle.valid_blocks)
        pairs = [
            (dst[first:last, :, a - start : b - start], src[first:last, :, a - start : b - start])
            for start, end, dst, src in runs
            if (a := max(start, lo)) < (b := min(end, hi))
        ]
        event = self._submit(load, pairs, (lo, hi, layers, time.perf_counter()), None)
        if layers is not None:
            load.handle._queued(first, last, event)

    def _stage_slow(self, load: _Load, slow: list[int]) -> bool:
        """Read the blocks ``slow`` from slower tiers into pinned staging, a group at a
        time (two groups' buffers in turn), queueing each group's copies as it lands.
        A block that fails ends the prefix. False if cancelled."""
        handle = load.handle
        block = self.io.layout.block_nbytes
        group = max(1, self.config.staging_bytes // (2 * block))
        for n, start in enumerate(range(0, len(slow), group)):
            idxs = [i for i in slow[start : start + group] if i < handle.valid_blocks]
            if handle.cancelled:
                return False
            if not idxs:
                break
            self._keep_alive(load)
            staging = self._staging(load, n % 2, len(idxs))
            keys = [handle.keys[i] for i in idxs]
            entries = [load.lease.entries[i] for i in idxs]
            ok = self.reader.read(keys, entries, list(staging), None)
            good = next((j for j, flag in enumerate(ok) if not flag), len(idxs))
            pairs = [(load.views[i], staging[j]) for j, i in enumerate(idxs[:good])]
            event = load.engine.lane(LANE).submit(pairs)
            load.in_flight.append(event)
            load.staging[n % 2] = (load.staging[n % 2][0], event)
            if good < len(idxs):
                handle._shrink(idxs[good])
                break
        return True

    def _staging(self, load: _Load, which: int, count: int) -> torch.Tensor:
        """Pinned buffer ``which`` (0 or 1) of the load, with room for ``count`` blocks;
        its previous copies are waited for first (the buffer is about to be rewritten)."""
        layout = self.io.layout
        group = max(1, self.config.staging_bytes // (2 * layout.block_nbytes))
        while len(load.staging) <= which:
            shape = (group, *layout.block_shape)
            buffer = torch.empty(shape, dtype=layout.dtype, pin_memory=cuda_available())
            load.staging.append((buffer, None))
        buffer, busy = load.staging[which]
        if busy is not None:
            busy.wait()
        return buffer[:count]

    def close(self) -> None:
        """Cancel live prefetches and stop the loader threads."""
        with self._lock:
            live = list(self._live)
        for handle in live:
            handle.cancel()
        self._pool.shutdown(wait=True)
