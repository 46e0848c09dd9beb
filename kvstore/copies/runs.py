"""Runs of blocks: many blocks whose views lie a constant step apart, as one view.

An engine's per-chunk views of one tensor, and a memory tier's consecutive slots,
are evenly spaced; a step of a layerwise load over them is then one copy per run
of adjacent blocks (a view with a block dimension), built with a few ``as_strided``
calls instead of a copy per block for the coalescer to merge again. The loader
queues steps faster than the link moves them this way.
"""

from __future__ import annotations

import torch

__all__ = ["BlockRun", "block_runs"]
#: ``(first block, end block, destination view, source view)``: see :func:`block_runs`.
BlockRun = tuple[int, int, torch.Tensor, torch.Tensor]


def block_runs(
    views: list[torch.Tensor], sources: list[torch.Tensor | None], valid: int
) -> list[BlockRun]:
    """The memory-tier blocks of ``[0, valid)`` as runs ``(first, end, dst, src)`` of
    blocks whose destination views and source slots each lie a constant step apart;
    ``dst`` / ``src`` are those blocks as one view with a block dimension at index 2
    (``(L, 2, blocks, tokens, ...)``). A step of a layerwise load is then one copy per
    run (a few views), not one per block: the loader queues steps faster than the
    link moves them, so the copies never wait for Python."""
    runs: list[BlockRun] = []
    i = 0
    while i < valid:
        first = sources[i]
        if first is None:
            i += 1
            continue
        steps = _steps(views, sources, i) if i + 1 < valid else None
        end = i + 1
        if steps is not None:
            while end < valid and _continues(views, sources, i, end, steps):
                end += 1
        dstep, sstep = steps if steps is not None else (0, 0)
        runs.append((i, end, _stacked(views[i], end - i, dstep), _stacked(first, end - i, sstep)))
        i = end
    return runs


def _steps(
    views: list[torch.Tensor], sources: list[torch.Tensor | None], i: int
) -> tuple[int, int] | None:
    """Elements from block ``i`` to block ``i + 1`` on each side, if a run may go on."""
    src, nxt = sources[i], sources[i + 1]
    if src is None or nxt is None:
        return None
    item = src.element_size()
    dstep = views[i + 1].data_ptr() - views[i].data_ptr()
    sstep = nxt.data_ptr() - src.data_ptr()
    if dstep <= 0 or sstep <= 0 or dstep % item or sstep % item:
        return None
    return dstep // item, sstep // item


def _continues(
    views: list[torch.Tensor],
    sources: list[torch.Tensor | None],
    i: int,
    k: int,
    steps: tuple[int, int],
) -> bool:
    """Whether block ``k`` lies where the run from block ``i`` puts it, on both sides."""
    src0, src = sources[i], sources[k]
    if src is None or src0 is None:
        return False
    if src.stride() != src0.stride() or views[k].stride() != views[i].stride():
        return False
    item = src0.element_size()
    if views[k].data_ptr() != views[i].data_ptr() + (k - i) * steps[0] * item:
        return False
    return src.data_ptr() == src0.data_ptr() + (k - i) * steps[1] * item


def _stacked(first: torch.Tensor, count: int, step: int) -> torch.Tensor:
    """``count`` blocks like ``first``, ``step`` elements apart, as one view
    ``(L, 2, count, ...)`` (inside ``first``'s storage: as_strided checks it)."""
    return first.as_strided(
        (first.shape[0], first.shape[1], count, *first.shape[2:]),
        (first.stride(0), first.stride(1), step, *first.stride()[2:]),
        first.storage_offset(),
    )
