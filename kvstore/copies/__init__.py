"""The copy engine: the one place where bytes move between memories.

Reads, moves, prefetch, layer writes, lending and the slab hand their copies
to a :class:`CopyEngine` as ``(dst, src)`` pairs, so batching (coalescing),
ordering (lanes, events) and asynchrony live here and nowhere else.

- ``base.py``: the contract (:class:`CopyEngine`, :class:`Lane`, :class:`Event`).
- ``coalescing.py``: :func:`coalesce` (runs of pairs become one strided copy) and
  :func:`copy_pairs` (what every engine runs a batch with; contiguous host copies
  left over go to C in one call, ``kvstore._memcopy``).
- ``threads.py``: :class:`ThreadCopyEngine`, a worker thread per lane (CPU).
- ``cuda.py`` (to come): persistent CUDA streams per device and direction,
  ``non_blocking`` copies from pinned memory, CUDA events, GPU-side waits.

Use :func:`engine_for` to get the process's engine for a device.
"""

from __future__ import annotations

import os
import threading

import torch

from kvstore.copies.base import CopyEngine, Event, Lane, OnDone
from kvstore.copies.coalescing import CopyPair, coalesce, copy_pairs, needs_inference_mode
from kvstore.copies.threads import ThreadCopyEngine, ThreadEvent, ThreadLane

__all__ = [
    "CopyEngine",
    "CopyPair",
    "Event",
    "Lane",
    "OnDone",
    "ThreadCopyEngine",
    "ThreadEvent",
    "ThreadLane",
    "coalesce",
    "copy_pairs",
    "engine_for",
    "needs_inference_mode",
]


class _Shared:
    """The process's engines, one per key, made on first use.

    ``_lock`` guards ``_engines``. A forked child gets a fresh lock (the
    parent's may have been held by a thread that did not survive the fork);
    the engines themselves reset their workers in the child (``threads.py``),
    so the child keeps using the same objects.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, CopyEngine] = {}

    def get(self, key: str) -> CopyEngine:
        """The engine for ``key``; a new one if there is none or it was closed."""
        with self._lock:
            engine = self._engines.get(key)
            if engine is None or engine.closed:
                engine = self._engines[key] = ThreadCopyEngine()
            return engine

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


_SHARED = _Shared()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SHARED.after_fork_in_child)


def engine_for(device: torch.device | str) -> CopyEngine:
    """The process's copy engine for ``device``: created on first use, then shared.

    Thread-safe; nothing is created at import. Today every device -- CPU and,
    until ``cuda.py`` exists, CUDA too -- gets the one shared
    :class:`ThreadCopyEngine` (its copies of CUDA tensors are synchronous on
    the worker's default stream, so its events are still exact). The CUDA
    engine will be one per CUDA device, keyed by device index. An engine that
    was closed is replaced by a new one on the next call. A forked child may
    call this and copy at once (the workers are reset in the child).
    """
    torch.device(device)  # a clear error for a malformed device string
    return _SHARED.get("threads")
