"""The copy engine's contract: engines, lanes and events.

Every copy between memories in kvstore (reads, moves, prefetch, layer
writes, lending, the slab) goes through a :class:`CopyEngine`, so that
batching, ordering and asynchrony live in one place:

- :meth:`CopyEngine.copy_all` copies a batch at once, on the caller's thread,
  coalesced (:func:`~kvstore.copies.coalescing.coalesce`).
- :meth:`CopyEngine.lane` is a persistent, ordered queue of batches: what is
  submitted on one lane runs in submission order, asynchronously.
  :meth:`Lane.submit` returns an :class:`Event` that completes after the
  batch (and its ``on_done`` callback); :meth:`Lane.after` orders one lane
  behind another lane's event.

Two engines fit this contract:

- ``threads.py`` (CPU, and for now every device): one worker thread per
  lane runs the batches; events are ``threading`` primitives; a wait is a
  wait of the calling thread.
- ``cuda.py``: a lane is a persistent CUDA stream of one device;
  ``submit`` queues the copies (DMA row copies from pinned memory, else
  ``copy_(non_blocking=True)``) on that stream at once and records a CUDA
  event; ``after`` is ``stream.wait_event``;
  :meth:`Event.wait_stream` makes the *engine's* stream wait on the GPU,
  not its thread; ``on_done`` runs on a completion thread once the CUDA
  event has completed, and only then is the event marked done for CPU
  waiters. Errors raised while queueing are caught and delivered through the
  event, as here.

The thread engine is the CUDA engine's CPU twin: CI, which has no GPU, proves
the contract with it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvstore.copies.coalescing import CopyPair
from kvstore.errors import ClosedError

__all__ = ["CopyEngine", "CopyPair", "Event", "Lane", "OnDone", "WorkerLane"]

#: Called once a batch's copies are over, with the exception a copy raised (else None).
OnDone = Callable[[BaseException | None], object]


class Event(ABC):
    """A point in a lane's queue: done once everything queued before it has run.

    Made by :meth:`Lane.submit` (after that batch and its ``on_done``) and
    :meth:`Lane.record` (after everything queued on the lane so far). Thread-safe.
    """

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the event is done; False on timeout.

        Once it returns True, the batch's copies and its ``on_done`` have run
        and their effects are visible to the caller.
        """

    @abstractmethod
    def done(self) -> bool:
        """True once the event is done (never blocks)."""

    @property
    @abstractmethod
    def error(self) -> BaseException | None:
        """What the batch's copy raised (None if it did not, or not done yet).

        Copies before the failing one in the batch were made; those after it
        were not. An exception in ``on_done`` is logged, not recorded here.
        Events from :meth:`Lane.record` always have None.
        """

    @abstractmethod
    def wait_stream(self, stream: object | None = None) -> None:
        """Make work queued on ``stream`` after this call start only once the event is done.

        CUDA engine: ``stream.wait_event(...)`` (``None``: the current stream):
        the GPU waits, the calling thread returns at once. Thread engine:
        there is no stream to order, so the calling thread waits for the event
        (its copies ran synchronously on the worker, so the bytes are in place
        for whatever the caller queues next); ``stream`` is ignored.
        """


class Lane(ABC):
    """An ordered queue of copy batches (a worker thread; on a GPU, a CUDA stream).

    A batch starts only after every batch submitted before it on the same
    lane has finished (copies and ``on_done``). Lanes are thread-safe; many
    threads may submit to one lane (the order is then the order in which the
    submits took the lane's lock). Lanes live as long as their engine.
    """

    #: The lane's name, unique within its engine (the worker is ``kvstore-copy-<name>``).
    name: str

    @abstractmethod
    def submit(self, pairs: Sequence[CopyPair], on_done: OnDone | None = None) -> Event:
        """Queue ``dst.copy_(src)`` for each pair behind everything already on the lane.

        The copies are coalesced and run in inference mode when a destination
        is an inference tensor. ``on_done(error)`` runs on the lane's worker
        after the copies, with the exception a copy raised or None, and
        before the returned event is done: a thread that waited for the event
        sees what ``on_done`` did. Errors never raise here: they land in the
        event's :attr:`Event.error` and in ``on_done``. The caller must keep
        the tensors alive and unchanged until the event is done. A lane does
        not wait for the caller's stream: GPU tensors that work queued there
        produces or still uses must be ordered first with
        ``lane.after(engine.mark())`` (a GPU-side wait; nothing to do on CPU).

        Raises :class:`~kvstore.errors.ClosedError` once the engine is closed.
        """

    @abstractmethod
    def record(self) -> Event:
        """An event that is done once everything queued on the lane so far has run.

        Raises :class:`~kvstore.errors.ClosedError` once the engine is closed.
        """

    @abstractmethod
    def after(self, event: Event) -> None:
        """Make batches submitted to this lane from now on start only once ``event`` is done.

        Batches already queued are not held back. This orders lanes against
        each other (CUDA: ``stream.wait_event``); ``event`` may come from any
        lane of the same engine. The wait is for completion, not success: a
        failed batch's event releases the lane too (check its ``error``).

        Raises :class:`~kvstore.errors.ClosedError` once the engine is closed.
        """

    @abstractmethod
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued on the lane so far has run; False on timeout.

        Also works after the engine is closed (then it returns True at once).
        """

    @abstractmethod
    def close(self) -> None:
        """Refuse new work, finish what is queued, stop the lane's thread (its engine's
        :meth:`CopyEngine.close` calls this). From the lane's own thread (inside
        ``on_done``) it cannot wait for itself: the thread finishes the queue and
        stops after the callback returns."""


class WorkerLane(Lane):
    """A lane whose queue one daemon thread works through, started on first use: what
    both engines' lanes share (the thread engine's worker copies; the CUDA engine's
    completion thread waits for the GPU).

    Locking: ``_cond`` guards the subclass's queue, ``_worker``, ``_closed``,
    ``_queued`` and ``_finished``, and is notified whenever an item is queued or
    finished or the lane closes. Subclasses run their queue in :meth:`_work` and
    count each finished item in ``_finished``, in queue order.
    """

    def __init__(self, name: str, thread_prefix: str) -> None:
        self.name = name
        self._thread_name = f"{thread_prefix}-{name}"
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._queued = 0  # items ever queued
        self._finished = 0  # items ever finished

    @abstractmethod
    def _work(self) -> None:
        """The thread's body: run queued items until the lane is closed and drained."""

    def _counted(self) -> None:
        """One more item was queued: start the thread on first use, else wake it.
        ``_cond`` held."""
        self._queued += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name=self._thread_name, daemon=True)
            self._worker.start()
        self._cond.notify_all()

    def _check_open(self) -> None:
        """Raise ClosedError once the engine closed the lane. ``_cond`` held."""
        if self._closed:
            raise ClosedError(f"copy lane {self.name!r}: the copy engine is closed")

    def drain(self, timeout: float | None = None) -> bool:
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()


class CopyEngine(ABC):
    """Moves bytes between memories: synchronous batches and ordered lanes.

    Get the process's engine for a device with
    :func:`kvstore.copies.engine_for` (shared, created on first use) rather
    than making one per object: lanes are meant to be few and persistent.

    The base class keeps the lanes by name (:meth:`lane`, :meth:`close`); an
    engine makes its kind of lane in :meth:`_make_lane`. Locking: ``_lock``
    guards ``_lanes`` and ``_closed``, held only to look up, create or list
    lanes, never while waiting for one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes: dict[str, Lane] = {}
        self._closed = False

    @abstractmethod
    def _make_lane(self, name: str) -> Lane:
        """A new lane called ``name`` (:meth:`lane` calls this once per name)."""

    @abstractmethod
    def copy_all(self, pairs: Sequence[CopyPair]) -> None:
        """``dst.copy_(src)`` for every pair, coalesced, on the caller's thread; wait for them.

        In inference mode where a destination needs it, otherwise in the
        caller's autograd mode. Raises what ``copy_`` raises; the copies
        before the failing one are made. Needs no worker, so it keeps working
        after :meth:`close`.
        """

    @abstractmethod
    def mark(self) -> Event:
        """An event done once the work queued so far on the calling thread's current
        stream is done: the point a GPU tensor made by the caller is ready (a source
        it produced, a destination it last used). Pass it to :meth:`Lane.after`.

        CUDA engine: a CUDA event recorded on the current stream of the engine's
        device. Thread engine: there is no stream, the caller's work is done when
        it calls, so the event is done already.
        """

    def lane(self, name: str) -> Lane:
        """The lane called ``name``: created on first use, the same object afterwards.

        Raises :class:`~kvstore.errors.ClosedError` once the engine is closed.
        """
        with self._lock:
            if self._closed:
                raise ClosedError(f"copy lane {name!r}: the copy engine is closed")
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = self._make_lane(name)
            return lane

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Finish every queued batch, then stop the lanes' threads. Idempotent.

        Afterwards ``lane``, ``submit``, ``record`` and ``after`` raise
        :class:`~kvstore.errors.ClosedError`. Called from a lane's own thread
        (inside ``on_done``), it cannot wait for that lane: that thread
        finishes its queue and stops after the callback returns.
        """
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.close()
