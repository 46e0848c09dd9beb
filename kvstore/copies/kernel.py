"""The rows kernel: a batch of copies within one device as one Triton launch per storage pair.

:func:`~kvstore.copies.regions.plan_regions` turns a batch into row tables; here each
table is copied by one launch of :func:`_copy_rows`, whose programs each copy a slice of
``BLOCK`` units of one row (a row wider than that spreads over several programs), with
loads and stores as wide as the rows' alignment (``ALIGN``) lets the compiler make them.
That is the HBM tier's gather (slab slots into an engine tensor's chunk views, one
``get(out=gpu)``) and scatter (the reverse, a ``put``): hundreds of rows of up to
hundreds of KiB, where torch's strided kernel spends its time computing offsets.

Triton is optional (``pip install 'kvstore-tiers[kernels]'``) and imported on first use
(:func:`available`); without it the CUDA engine copies as before. On CPU tensors the
kernel runs under Triton's interpreter (what ``TRITON_INTERPRET=1`` does for every
kernel): that is how CI checks it, byte for byte against the thread engine.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kvstore.copies.regions import RegionGroup, Regions, plan_regions

__all__ = ["MIN_ROWS", "available", "copy_regions", "reason", "try_copy"]

log = logging.getLogger(__name__)

#: Units each program copies at most (a power of two; 4096 int64 = 32 KiB).
MAX_BLOCK = 4096
#: Units each program copies at least.
MIN_BLOCK = 16
#: A batch of fewer rows goes to ``copy_`` (one contiguous run: a plain device memcpy).
MIN_ROWS = 2
#: Programs one launch may have (CUDA's limit on a grid's first dimension).
MAX_GRID = (1 << 31) - 1


class _Loaded:
    """Triton and the kernel, loaded once (``_lock`` guards the first load)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self.compiled: Any = None
        self.interpreted: Any = None
        self.reason = "not loaded yet"
        self.broken = False  # a launch failed: the kernel is not used again

    def load(self) -> bool:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._load()
            return self.compiled is not None and not self.broken

    def disable(self, exc: BaseException) -> None:
        """A launch failed (no compiler, say): say why once, copy the old way from now on."""
        with self._lock:
            if not self.broken:
                log.warning("rows kernel disabled, copies go through copy_: %s", exc)
            self.broken = True
            self.reason = f"disabled after {type(exc).__name__}: {exc}"

    def _load(self) -> None:
        try:
            import triton

            from kvstore.copies import triton_rows
        except Exception as exc:  # ImportError, or a broken install
            self.reason = f"triton not importable: {type(exc).__name__}: {exc}"
            return
        self.compiled = triton_rows.copy_rows  # interpreted too where TRITON_INTERPRET=1
        self.interpreted = triton_rows.interpreted
        self.reason = f"triton {triton.__version__}"


_LOADED = _Loaded()


def available() -> bool:
    """True when Triton imports here (the first call imports it, ~1 s)."""
    return _LOADED.load()


def reason() -> str:
    """Why the kernel is or is not available (the Triton version, or the import error)."""
    _LOADED.load()
    return _LOADED.reason


def _block(max_width: int) -> int:
    block = MIN_BLOCK
    while block < max_width and block < MAX_BLOCK:
        block *= 2
    return block


def _align(group: RegionGroup) -> int:
    """The alignment hint the launch compiles for: 16 bytes' worth of units where every
    row is 16-byte aligned (what lets the compiler move 16 bytes a thread), else none.
    Two values, not every power of two, so that a process compiles few variants."""
    full = max(1, 16 // group.dst.element_size())
    return full if group.align >= full else 1


def _grid(group: RegionGroup) -> int:
    """Programs of the group's launch: a row's slices, for every row."""
    return group.rows * -(-group.max_width // _block(group.max_width))


def copy_regions(regions: Regions) -> int:
    """Launch the copies of ``regions`` on the current stream (CUDA; on CPU tensors, run
    them under Triton's interpreter); return the launches made.

    The caller keeps the tensors alive until the stream has run them (the CUDA engine's
    completion thread holds the batch). Raises :class:`RuntimeError` when Triton is
    missing; what Triton raises (a compile error) before a launch leaves every byte as it was.
    """
    if not _LOADED.load():
        raise RuntimeError(f"rows kernel unavailable: {_LOADED.reason}")
    launches = 0
    for group in regions.groups:
        if group.rows == 0:
            continue
        block = _block(group.max_width)
        chunks = -(-group.max_width // block)
        if _grid(group) > MAX_GRID:
            raise ValueError(f"rows kernel: {_grid(group)} programs, more than one launch has")
        cuda = group.dst.is_cuda
        fn = _LOADED.compiled if cuda else _LOADED.interpreted
        table = group.table
        if cuda:
            table = table.pin_memory().to(group.dst.device, non_blocking=True)
        grid = (group.rows * chunks,)
        fn[grid](group.dst, group.src, table, chunks, BLOCK=block, ALIGN=_align(group))
        launches += 1
    return launches


def try_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, min_rows: int = MIN_ROWS) -> int:
    """Copy the batch with the rows kernel where it may (see
    :func:`~kvstore.copies.regions.plan_regions`) and has at least ``min_rows`` rows;
    return the bytes queued, 0 where it did not take the batch (nothing copied then:
    the caller copies it the old way). A launch that fails (Triton cannot compile
    here) disables the kernel for the process and returns 0; a batch it had begun is
    then copied again in full by the caller, which its disjoint rows make safe."""
    if not _LOADED.load():
        return 0
    regions = plan_regions(pairs)
    if regions is None or regions.rows < min_rows:
        return 0
    if any(_grid(group) > MAX_GRID for group in regions.groups):
        return 0  # more programs than one launch may have
    try:
        copy_regions(regions)
    except Exception as exc:  # compile or launch errors: the old path still works
        _LOADED.disable(exc)
        return 0
    return regions.nbytes
