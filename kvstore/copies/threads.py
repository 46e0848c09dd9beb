"""The thread copy engine: the contract of ``base.py`` on CPU threads.

Each lane is one daemon worker thread (``kvstore-copy-<lane>``), started on
the lane's first use, that takes batches from a FIFO queue and runs them one
at a time: coalesced copies (:func:`~kvstore.copies.coalescing.copy_pairs`,
which releases the GIL for each copy), then the batch's ``on_done``, then
its event. Events are ``threading.Event`` s: waits sleep, nobody spins.
:meth:`ThreadLane.after` queues a wait for another lane's event, so the
worker sleeps there before it starts the next batch -- the CPU twin of
``stream.wait_event``. An event only ever stands for work queued before it,
so waits between lanes cannot form a cycle.

The CUDA engine (``cuda.py``) keeps this shape: a lane's stream replaces the
worker's queue, CUDA events replace ``threading.Event`` and a completion
thread runs ``on_done``. :func:`~kvstore.copies.engine_for` hands CUDA work
to it; a batch with CUDA tensors submitted to a lane here fails (its event
carries a :class:`~kvstore.errors.KVStoreError` saying so).

Fork: a forked child has only the thread that forked. ``os.register_at_fork``
resets every engine of this module in the child: fresh locks, no workers
(they start again on the next submit), and each batch that was queued or
running in the parent gets its event done with a
:class:`~kvstore.errors.KVStoreError` in the child (its ``on_done`` is not
called there). The parent is untouched. One hazard is torch's, not ours:
with GNU OpenMP (torch's CPU wheels), a parallel kernel -- a ``copy_`` of
more than ~32K elements -- hangs in the child *on the thread that forked*
once the parent has run any parallel kernel. Lane workers are new threads in
the child and copy at full speed; ``copy_all`` on the forking thread needs
``torch.set_num_threads(1)`` in the child first (what torch's DataLoader
workers do), or a ``spawn`` child.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.copies.base import CopyEngine, Event, Lane, OnDone, WorkerLane
from kvstore.copies.coalescing import CopyPair, copy_pairs, touches_cuda
from kvstore.errors import KVStoreError

__all__ = ["ThreadCopyEngine", "ThreadEvent", "ThreadLane"]

logger = logging.getLogger(__name__)


class ThreadEvent(Event):
    """An :class:`~kvstore.copies.base.Event` backed by a ``threading.Event``.

    Set once, by the lane's worker: ``_error`` is written before the flag is
    set, and read only after it is, so it needs no lock of its own.
    """

    def __init__(self, done: bool = False) -> None:
        self._flag = threading.Event()
        self._error: BaseException | None = None
        if done:
            self._flag.set()

    def _set(self, error: BaseException | None) -> None:
        """Mark the event done (the lane's worker calls this once)."""
        self._error = error
        self._flag.set()

    def _lost_in_fork(self, error: BaseException) -> None:
        """In a forked child: done with ``error``, on a new flag (the old one's lock
        may have been held by a thread that did not survive the fork)."""
        self._flag = threading.Event()
        self._set(error)

    def wait(self, timeout: float | None = None) -> bool:
        return self._flag.wait(timeout)

    def done(self) -> bool:
        return self._flag.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error if self._flag.is_set() else None

    def wait_stream(self, stream: object | None = None) -> None:
        """No streams here: the calling thread waits until the event is done."""
        self._flag.wait()


@dataclass(eq=False)
class _Batch:
    """Copies to make, then ``on_done``, then ``event``."""

    pairs: list[CopyPair]
    on_done: OnDone | None
    event: ThreadEvent


@dataclass(eq=False)
class _Mark:
    """A recorded event: set when the worker gets to it."""

    event: ThreadEvent


@dataclass(eq=False)
class _Wait:
    """Hold the lane until another event is done (:meth:`ThreadLane.after`)."""

    event: Event


_Item = _Batch | _Mark | _Wait


class ThreadLane(WorkerLane):
    """An ordered queue of copy batches run by one daemon worker thread.

    Locking (see :class:`~kvstore.copies.base.WorkerLane`): ``_cond`` also guards
    ``_queue`` and ``_busy``. The worker never holds it while it copies, runs
    ``on_done`` or waits for another lane's event, so submitters are blocked only
    for a queue append.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name, "kvstore-copy")
        self._queue: deque[_Item] = deque()
        self._busy: _Item | None = None  # the item the worker is running

    def __repr__(self) -> str:
        return f"ThreadLane({self.name!r})"

    # -- the caller's side ---------------------------------------------------
    def submit(self, pairs: Sequence[CopyPair], on_done: OnDone | None = None) -> Event:
        event = ThreadEvent()
        self._put(_Batch(list(pairs), on_done, event))
        return event

    def record(self) -> Event:
        with self._cond:
            self._check_open()
            if self._finished == self._queued:  # idle: nothing to wait for
                return ThreadEvent(done=True)
            event = ThreadEvent()
            self._append(_Mark(event))
        return event

    def after(self, event: Event) -> None:
        if event.done():  # nothing to hold the lane for
            with self._cond:
                self._check_open()
            return
        self._put(_Wait(event))

    def _put(self, item: _Item) -> None:
        with self._cond:
            self._check_open()
            self._append(item)

    def _append(self, item: _Item) -> None:
        """Queue ``item`` (the worker starts on first use). ``_cond`` held."""
        self._queue.append(item)
        self._counted()

    # -- the worker ------------------------------------------------------------
    def _work(self) -> None:
        """Run queued items in order until the lane is closed and its queue empty."""
        torch.set_grad_enabled(False)  # per thread: copies are not part of any graph
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                item = self._busy = self._queue.popleft()
            self._run(item)
            with self._cond:
                self._busy = None
                self._finished += 1
                self._cond.notify_all()

    def _run(self, item: _Item) -> None:
        """Run one item; never raises (a failure belongs to the item's event)."""
        if isinstance(item, _Wait):
            try:
                item.event.wait()
            except BaseException:  # a foreign Event that fails to wait: do not hold the lane
                logger.exception("copy lane %r: waiting for %r raised", self.name, item.event)
            return
        if isinstance(item, _Mark):
            item.event._set(None)
            return
        error: BaseException | None = None
        try:
            self._copy(item.pairs)
        except BaseException as exc:  # the worker outlives any batch
            error = exc
        item.pairs = []  # let the tensors go before anyone is told
        if item.on_done is not None:
            try:
                item.on_done(error)
            except BaseException:
                logger.exception("copy lane %r: on_done callback raised", self.name)
        item.event._set(error)

    def _copy(self, pairs: Sequence[CopyPair]) -> None:
        """Run a batch of host copies. GPU copies belong to the CUDA engine
        (``engine_for`` hands them there): here a batch with a GPU tensor fails."""
        if touches_cuda(pairs):
            raise KVStoreError(
                f"copy lane {self.name!r}: GPU tensors go through the CUDA engine "
                "(kvstore.copies.engine_for(device))"
            )
        copy_pairs(pairs)

    # -- the engine's side -----------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """The worker did not survive the fork: forget it, fail what it had to do."""
        self._cond = threading.Condition()
        lost = [self._busy, *self._queue]
        self._queue.clear()
        self._busy = None
        self._worker = None
        self._finished = self._queued
        error = KVStoreError(
            f"copy lane {self.name!r}: batch queued before fork() did not run in this process"
        )
        for item in lost:
            if isinstance(item, (_Batch, _Mark)) and not item.event.done():
                item.event._lost_in_fork(error)


class ThreadCopyEngine(CopyEngine):
    """The copy engine on threads: ``copy_all`` on the caller's thread, lanes on workers.

    The lanes are kept by the base class; each lane has its own lock (:class:`ThreadLane`).
    """

    def __init__(self) -> None:
        super().__init__()
        _ENGINES.add(self)

    def __repr__(self) -> str:
        return f"ThreadCopyEngine(lanes={sorted(self._lanes)}, closed={self._closed})"

    def copy_all(self, pairs: Sequence[CopyPair]) -> None:
        copy_pairs(pairs)

    def mark(self) -> Event:
        """Done already: without streams, the caller's work is over when it calls."""
        return ThreadEvent(done=True)

    def _make_lane(self, name: str) -> Lane:
        return ThreadLane(name)

    def _after_fork_in_child(self) -> None:
        """A fresh lock (the old one may have been held by a thread now gone); reset lanes."""
        self._lock = threading.Lock()
        for lane in self._lanes.values():
            assert isinstance(lane, ThreadLane)
            lane._after_fork_in_child()


#: Every live engine of this module, reset in a forked child (their workers are gone).
_ENGINES: weakref.WeakSet[ThreadCopyEngine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for engine in list(_ENGINES):
        engine._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
