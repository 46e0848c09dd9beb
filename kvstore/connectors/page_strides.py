"""One side (K or V) of an engine's KV page as a strided view of the page.

Attention kernels pack a ``(block, head)`` page in their own order (:mod:`.paged`):
GPU backends put token ``t``'s K in row ``t`` (``[t, :D]``), vLLM's CPU backend stores
K transposed (``[D, block_size]``), its AMX path tiles K and V for the matrix units.
Each of these is a *mixed-radix* layout: split the token index into digits (for AMX's
K: which tile of 16 tokens, which token in the tile) and the dim index likewise (which
pair of dims, which dim of the pair), and every digit moves the element by a stride of
its own. Such a side is an ``as_strided`` view of the flat page, so whole pages move by
one ``index_select`` and one strided copy: about 7x faster than gathering each element
by its computed (page, head, row, column) on a 2-core CPU (0.7 against 5 ms for a
2048-token fp32 layer of vLLM's CPU layout), 5x for an AMX-like tiling.

:meth:`PageSide.find` reads the digits off a calibrated position map and keeps them
only if they reproduce every position exactly; a layout they cannot describe returns
None, and the per-element path stays in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PageSide"]

#: ``(size, stride)`` of each digit of an index, the most significant first.
Digits = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PageSide:
    """Where ``X[t, d]`` (X = K or V) sits in a flat page: ``offset`` plus, for each digit
    of ``t`` and of ``d``, the digit's value times its stride."""

    offset: int
    tokens: Digits
    dims: Digits

    @classmethod
    def find(cls, pos: torch.Tensor) -> PageSide | None:
        """The strided description of ``pos`` (``[tokens, D]`` flat positions in a page),
        or None if none reproduces it exactly."""
        pos = pos.to("cpu", torch.int64)
        offset = int(pos[0, 0])
        tokens = _axis_digits((pos[:, 0] - offset).tolist())
        dims = _axis_digits((pos[0, :] - offset).tolist())
        if tokens is None or dims is None:
            return None
        rows, cols = pos.shape
        want = offset + _positions(rows, tokens).view(-1, 1) + _positions(cols, dims).view(1, -1)
        return cls(offset, tokens, dims) if torch.equal(want, pos) else None

    def sizes(self, pages: int, heads: int) -> tuple[int, ...]:
        """The shape ``(pages, *token digits, heads, *dim digits)`` of :meth:`view`; a
        contiguous ``[pages * tokens, heads, D]`` tensor reshapes to it as it is."""
        return (pages, *(n for n, _ in self.tokens), heads, *(n for n, _ in self.dims))

    def view(self, whole: torch.Tensor) -> torch.Tensor:
        """This side of ``whole`` (contiguous ``[pages, heads, page elements]``), shaped
        as :meth:`sizes`: a view, so a copy into it writes the pages."""
        pages, heads, elements = whole.shape
        assert whole.is_contiguous()
        strides = (heads * elements, *(s for _, s in self.tokens), elements)
        strides += tuple(s for _, s in self.dims)
        return whole.as_strided(
            self.sizes(pages, heads), strides, whole.storage_offset() + self.offset
        )


def _axis_digits(values: Sequence[int]) -> Digits | None:
    """The digits of an index whose positions are ``values`` (``values[0]`` is 0): runs
    of equal steps, each run a digit whose size divides the axis."""
    n, size = len(values), 1
    digits: list[tuple[int, int]] = []
    while size < n:
        stride = values[size]
        run = 1
        while size * (run + 1) <= n and values[size * run] == run * stride:
            run += 1
        while run > 1 and n % (size * run):
            run -= 1
        if run == 1:
            return None
        digits.append((run, stride))
        size *= run
    return tuple(reversed(digits))


def _positions(n: int, digits: Digits) -> torch.Tensor:
    """Offsets of indexes ``0 .. n-1`` under ``digits``."""
    out = torch.zeros(n, dtype=torch.int64)
    rest = torch.arange(n)
    for size, stride in reversed(digits):
        out += (rest % size) * stride
        rest = rest // size
    return out
