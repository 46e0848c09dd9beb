"""The copy engine: the one place where bytes move between memories.

Reads, moves, prefetch, layer writes, lending and the slab hand their copies
to a :class:`CopyEngine` as ``(dst, src)`` pairs, so batching (coalescing),
ordering (lanes, events) and asynchrony live here and nowhere else.

- ``base.py``: the contract (:class:`CopyEngine`, :class:`Lane`, :class:`Event`).
- ``coalescing.py``: :func:`coalesce` (runs of pairs become one strided copy) and
  :func:`copy_pairs` (what every engine runs a batch with; contiguous host copies
  left over go to C in one call, ``kvstore.native._memcopy``, public there as ``memcopy``).
- ``threads.py``: :class:`ThreadCopyEngine`, a worker thread per lane (CPU).
- ``rows.py``: :func:`plan_rows`, a strided copy as a few 2-D byte copies.
- ``runs.py``: evenly spaced blocks as one view (a layerwise load's copies per run).
- ``cuda.py``: :class:`CudaCopyEngine`, persistent CUDA streams, DMA row copies
  (``cudart.py``: ``cudaMemcpy2DAsync`` through ctypes), CUDA events, GPU-side waits.
- ``regions.py`` and ``kernel.py``: the rows kernel, a device-to-device batch of many rows
  as one Triton launch (``triton_rows.py``; Triton optional, imported on first use).

Use :func:`engine_for` to get the process's engine for a device, or
:func:`engine_for_pairs` for the engine a batch of copies needs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.copies.base import CopyEngine, Event, Lane, OnDone
from kvstore.copies.coalescing import (
    CopyPair,
    coalesce,
    copy_pairs,
    needs_inference_mode,
    plain_bytes,
)
from kvstore.copies.threads import ThreadCopyEngine, ThreadEvent, ThreadLane
from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.copies.cudart import load as load_cudart
    from kvstore.copies.rows import Rows
    from kvstore.copies.runs import BlockRun, block_runs

__all__ = [
    "BlockRun",
    "CopyEngine",
    "CopyPair",
    "Event",
    "Lane",
    "OnDone",
    "Rows",
    "ThreadCopyEngine",
    "ThreadEvent",
    "ThreadLane",
    "block_runs",
    "coalesce",
    "copy_pairs",
    "engine_for",
    "engine_for_pairs",
    "load_cudart",
    "needs_inference_mode",
    "plain_bytes",
]

#: Imported on first use: the CUDA side (its runtime, 2-D row copies) and block runs.
_EXPORTS = {
    "BlockRun": "kvstore.copies.runs",
    "Rows": "kvstore.copies.rows",
    "block_runs": "kvstore.copies.runs",
    "load_cudart": "kvstore.copies.cudart:load",
}


def __getattr__(name: str) -> Any:
    """The names of :data:`_EXPORTS`, imported on first use."""
    return load_export(globals(), _EXPORTS, name)


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

    def get(self, key: str, make: Callable[[], CopyEngine]) -> CopyEngine:
        """The engine for ``key``; a new one (``make()``) if there is none or it was closed."""
        with self._lock:
            engine = self._engines.get(key)
            if engine is None or engine.closed:
                engine = self._engines[key] = make()
            return engine

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


_SHARED = _Shared()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SHARED.after_fork_in_child)


def engine_for(device: torch.device | str) -> CopyEngine:
    """The process's copy engine for ``device``: created on first use, then shared.

    A CUDA device (when CUDA is available) gets its :class:`CudaCopyEngine`,
    one per device index (``cuda`` alone means the current device); every
    other device gets the one shared :class:`ThreadCopyEngine`. Thread-safe;
    nothing is created at import. An engine that was closed is replaced by a
    new one on the next call. A forked child may call this and copy on CPU at
    once (the thread engine's workers are reset in the child).
    """
    dev = torch.device(device)  # a clear error for a malformed device string
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return _SHARED.get(f"cuda:{index}", lambda: _cuda_engine(index))
    return _SHARED.get("threads", ThreadCopyEngine)


def engine_for_pairs(pairs: Sequence[CopyPair]) -> CopyEngine:
    """The engine for a batch: that of the first CUDA device a tensor of it is on,
    else the thread engine (a host-only batch)."""
    for dst, src in pairs:
        if dst.is_cuda:
            return engine_for(dst.device)
        if src.is_cuda:
            return engine_for(src.device)
    return engine_for("cpu")


def _cuda_engine(index: int) -> CopyEngine:
    from kvstore.copies.cuda import CudaCopyEngine  # imported only where CUDA is used

    return CudaCopyEngine(torch.device("cuda", index))
