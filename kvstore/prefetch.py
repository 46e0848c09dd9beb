"""Prefetch: asynchronous, layer-by-layer loads of a stored prefix.

``KVStore.prefetch(keys, out)`` pins the stored prefix of ``keys`` under a
lease and loads it into ``out`` in the background, a step of
``layers_per_step`` layers at a time for every block (``order="layer"``) --
so an engine can run layer ``i`` while layer ``i+1`` is still arriving -- or
a block at a time (``order="block"``), so a partial prefix is usable early.

Each block comes from its fastest copy. Blocks a memory tier holds are copied
straight from the tier's memory (a view, valid while the lease pins it) by
the copy engine, on the ``prefetch`` lane: the loader queues each step's copies
and the lane reports the step done when they are; with a CUDA engine (issue
17) those copies run on a persistent stream, ordered by events. Blocks only
slower tiers hold are read (verified, with fallback) by the
:class:`~kvstore.reader.Reader` on the loader's thread. At most two steps are
in flight, so a cancel takes effect after the step in flight, and the lease
ends only once the last queued copy is done.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvstore.books import Books
from kvstore.config import PrefetchConfig
from kvstore.copies import CopyEngine, Event
from kvstore.errors import BlockNotFoundError, InvalidInputError, KVStoreError
from kvstore.keys import BlockKey
from kvstore.leases import Lease
from kvstore.reader import Reader
from kvstore.tierio import TierIO

__all__ = ["PrefetchHandle", "Prefetcher", "Step"]

LANE = "prefetch"


@dataclass(frozen=True)
class Step:
    """One step of a load, as it happened: blocks ``[first_block, last_block)``,
    layers ``[first_layer, last_layer)``, and when it began and ended
    (``time.perf_counter()`` seconds)."""

    first_block: int
    last_block: int
    first_layer: int
    last_layer: int
    began: float
    ended: float


class PrefetchHandle:
    """A background load of ``len(keys)`` blocks into ``out``. Thread-safe.

    ``valid_blocks`` is the length of the prefix that can still be (or has
    been) loaded: it starts at the number of blocks stored when the prefetch
    began and drops if a block turns out missing or corrupt. ``blocks_ready``
    is how many leading blocks are fully loaded now. ``steps`` records each
    finished step (for timelines).
    """

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

    def _finish(self, layers_complete: bool) -> None:
        with self._cond:
            if layers_complete:
                self._layers_done = self.num_layers
                self._blocks_done = max(self._blocks_done, self._valid)
            self._done = True
            self._cond.notify_all()
            self._end.notify_all()

    # -- the consumer's side ---------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        with self._cond:
            return self._cancelled

    @property
    def done(self) -> bool:
        """True when the load finished (completely, after a failure, or cancelled)."""
        with self._cond:
            return self._done

    @property
    def valid_blocks(self) -> int:
        """Length of the prefix that is (or will be) loaded correctly."""
        with self._cond:
            return self._valid

    @property
    def blocks_ready(self) -> int:
        """Leading blocks fully loaded, every layer, now."""
        with self._cond:
            return self._blocks_done

    @property
    def error(self) -> KVStoreError | None:
        """Why ``valid_blocks`` is shorter than expected (a vanished or corrupt block)."""
        with self._cond:
            return self._error

    @property
    def steps(self) -> list[Step]:
        """The steps finished so far, in the order they finished."""
        with self._cond:
            return list(self._steps)

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until ``layer`` of every valid block is in place; False on timeout.

        Also returns (True) when the load ended early: check ``valid_blocks``.
        """
        if not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer {layer} out of range [0, {self.num_layers})")
        with self._cond:
            return self._cond.wait_for(lambda: self._layers_done > layer or self._done, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load ends; False on timeout."""
        with self._end:
            return self._end.wait_for(lambda: self._done, timeout)

    def cancel(self) -> None:
        """Stop loading after the step in flight; the lease is released when it ends."""
        with self._cond:
            self._cancelled = True

    def result(self, num_tokens: int | None = None) -> int:
        """Apply the store's prefetch policy; return the usable prefix, in blocks.

        ``best_effort`` takes what is ready now and cancels the rest;
        ``wait_complete`` waits for everything; ``timeout`` waits up to the
        deadline for ``num_tokens`` tokens (default: the whole prefix), then
        takes what is ready.
        """
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
    """One prefetch in progress: its handle, lease, destination views and plan."""

    handle: PrefetchHandle
    lease: Lease
    views: list[torch.Tensor]
    order: str
    step: int
    sources: list[torch.Tensor | None]  # memory views of the fastest copies, where any
    in_flight: list[Event]


class Prefetcher:
    """Runs prefetches on ``config.threads`` loader threads and the copy engine's
    ``prefetch`` lane."""

    def __init__(
        self,
        books: Books,
        io: TierIO,
        reader: Reader,
        copies: CopyEngine,
        config: PrefetchConfig,
        lease_s: float,
    ) -> None:
        self.books = books
        self.io = io
        self.reader = reader
        self.copies = copies
        self.config = config
        self.lease_s = lease_s
        self.num_layers = io.layout.num_layers
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstore-prefetch")
        self._live: set[PrefetchHandle] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()  # guards _live and _streams

    def start(
        self, keys: Sequence[BlockKey], views: list[torch.Tensor], order: str, step: int
    ) -> PrefetchHandle:
        """Pin the stored prefix of ``keys`` and load it into the block ``views``."""
        lease = self.books.lease(keys, self.lease_s)
        handle = PrefetchHandle(keys, len(lease.entries), self.num_layers, self.config)
        with self._lock:
            self._live.add(handle)
        load = _Load(handle, lease, views, order, step, [], [])
        self._pool.submit(self._run, load)
        return handle

    def _run(self, load: _Load) -> None:
        # An engine that made ``out`` under torch.inference_mode() (vLLM does) gets an
        # "inference tensor": copying into it in place is refused outside that mode, and
        # the mode is per thread. The loader runs in the mode its destination was made in.
        inference = bool(load.views) and load.views[0].is_inference()
        device = load.views[0].device if load.views else torch.device("cpu")
        complete = False
        try:
            with torch.inference_mode(inference), self._side_stream(device):
                complete = self._load(load)
        finally:
            for event in load.in_flight:  # the lease keeps the sources alive until here
                event.wait()
            self.books.release(load.lease)
            load.handle._finish(complete)
            with self._lock:
                self._live.discard(load.handle)

    def _side_stream(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        """Reads from slow tiers into a GPU run on a stream of their own (one per device,
        made once), not on the engine's."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return torch.cuda.stream(stream)

    def _load(self, load: _Load) -> bool:
        """Run every step; True if the load ran to its end (not cancelled)."""
        load.sources = self._sources(load)
        handle = load.handle
        if load.order == "layer":
            for first in range(0, self.num_layers, load.step):
                last = min(self.num_layers, first + load.step)
                if not self._step(load, (0, handle.valid_blocks), (first, last)):
                    return False
            return True
        for first in range(0, handle.valid_blocks, load.step):
            if not self._step(load, (first, min(handle.valid_blocks, first + load.step)), None):
                return False
        return True

    def _sources(self, load: _Load) -> list[torch.Tensor | None]:
        """For each pinned block, a view of its fastest copy where a memory tier holds it."""
        entries = load.lease.entries
        sources: list[torch.Tensor | None] = []
        for key, level in zip(load.handle.keys, self.books.fastest(entries), strict=False):
            sources.append(self.io.view(level, key) if level >= 0 else None)
        return sources

    def _step(self, load: _Load, blocks: tuple[int, int], layers: tuple[int, int] | None) -> bool:
        """Queue one step; False when the load must stop (cancelled or nothing left)."""
        handle = load.handle
        lo, hi = blocks[0], min(blocks[1], handle.valid_blocks)
        if handle.cancelled or lo >= hi:
            return False
        if len(load.in_flight) >= 2:  # at most two steps in flight
            load.in_flight.pop(0).wait()
        if load.lease.expiry - self.books.clock() < self.lease_s / 2:  # rarely: keep it alive
            self.books.renew(load.lease, self.lease_s)
        first, last = layers if layers is not None else (0, self.num_layers)
        began = time.perf_counter()
        pairs, bad = self._read_slow(load, lo, hi, layers)
        step = (lo, hi, first, last, began)

        def finished(error: BaseException | None) -> None:
            failed = lo if error is not None else bad
            record = Step(*step, time.perf_counter())
            handle._progress(record, failed, whole_blocks=layers is None)

        load.in_flight.append(self.copies.lane(LANE).submit(pairs, on_done=finished))
        return True

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
        if slow:
            keys = [load.handle.keys[i] for i in slow]
            entries = [load.lease.entries[i] for i in slow]
            outs = [load.views[i][first:last] for i in slow]
            ok = self.reader.read(keys, entries, outs, layers)
            bad = next((slow[n] for n, good in enumerate(ok) if not good), None)
        return pairs, bad

    def close(self) -> None:
        """Cancel live prefetches and stop the loader threads."""
        with self._lock:
            live = list(self._live)
        for handle in live:
            handle.cancel()
        self._pool.shutdown(wait=True)
