"""Row plans: a copy between two strided tensors as a few 2-D memory copies.

An engine's per-chunk view of a KV tensor (``kv[:, :, a:b]`` of a
``(L, 2, n * bt, H, D)`` tensor) is not contiguous, but it is ``2 * L`` rows of
``bt * H * D`` elements at one constant pitch; a slab slot is the same rows at
another pitch. So copying a block between them is one 2-D copy (height, width,
and a pitch on each side) -- what ``cudaMemcpy2DAsync`` moves with the GPU's
DMA engines, straight between pinned host memory and the device at link
speed. torch's ``copy_`` of the same non-contiguous views between host and
device stages through a contiguous temporary and a kernel instead.

:func:`plan_rows` finds such a description for a ``(dst, src)`` pair -- or
None, and the engine falls back to ``copy_``. It is plain arithmetic on shapes,
strides and addresses (no CUDA), so CI checks it on CPU tensors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

__all__ = ["MAX_CALLS", "MIN_WIDTH", "Rows", "plan_rows"]

#: Rows narrower than this go to ``copy_``: a DMA call per small row costs more
#: than torch's kernel does for the whole strided copy.
MIN_WIDTH = 4096
#: A plan needing more 2-D copies than this goes to ``copy_`` (one call is ~2-5 µs).
MAX_CALLS = 4096
#: cudaMemcpy2D refuses pitches past the device's maxPitch (2^31 - 1 on current GPUs).
MAX_PITCH = (1 << 31) - 1


@dataclass(frozen=True)
class Rows:
    """``height`` rows of ``width`` bytes from ``src`` (rows ``spitch`` bytes apart) to
    ``dst`` (rows ``dpitch`` bytes apart). Addresses are absolute (``data_ptr``)."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int

    @property
    def contiguous(self) -> bool:
        """True when both sides are one run of ``width * height`` bytes (a plain memcpy)."""
        return self.height == 1 or (self.dpitch == self.width and self.spitch == self.width)


_Dim = tuple[int, int, int]  # (size, dst stride, src stride), in elements


def plain_strided(t: torch.Tensor) -> bool:
    """A plain strided CPU or CUDA tensor (no subclass, conjugate or negative view,
    quantized or nested layout): its elements are where its strides say."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and not t.is_nested
        and t.device.type in ("cpu", "cuda")
    )


def collapse_dims(dst: torch.Tensor, src: torch.Tensor) -> list[_Dim]:
    """The pair's dimensions, outermost first, size-1 dims dropped and adjacent dims
    merged wherever both tensors are contiguous across them."""
    merged: list[_Dim] = []
    for size, ds, ss in zip(dst.shape, dst.stride(), src.stride(), strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == ds * size and merged[-1][2] == ss * size:
            merged[-1] = (merged[-1][0] * size, ds, ss)
        else:
            merged.append((size, ds, ss))
    return merged


def _injective(dims: list[tuple[int, int]]) -> bool:
    """True when no two indices of ``(size, stride)`` dims (strides > 0) meet: sorted by
    stride, each stride must pass the farthest offset the smaller ones reach."""
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in dims):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _apart(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when the bytes written cannot meet the bytes read (other devices, or
    disjoint byte ranges on one)."""
    if dst.device != src.device:
        return True
    item = dst.element_size()

    def span(t: torch.Tensor) -> tuple[int, int]:
        reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (reach + 1) * item

    (a, b), (c, d) = span(dst), span(src)
    return b <= c or d <= a


def plan_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    *,
    min_width: int = MIN_WIDTH,
    max_calls: int = MAX_CALLS,
) -> list[Rows] | None:
    """``dst.copy_(src)`` as a list of 2-D byte copies, or None where it is not one.

    A plan exists when both are plain strided tensors (no conjugate or negative
    views) of one shape and dtype (no conversion, no broadcast), their innermost
    collapsed dimension is contiguous on both sides and at least ``min_width``
    bytes, every outer stride is positive, the destination addresses no byte
    twice, what is written does not meet what is read, and at most ``max_calls``
    2-D copies do it. The largest outer dimension becomes the rows of each copy;
    the others are looped over.
    """
    if not (plain_strided(dst) and plain_strided(src)):
        return None
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    if dst.numel() == 0:
        return None
    dims = collapse_dims(dst, src)
    item = dst.element_size()
    if not dims:  # one element
        return None
    width_elems, dinner, sinner = dims[-1]
    width = width_elems * item
    if dinner != 1 or sinner != 1 or width < min_width:
        return None
    outer = dims[:-1]
    if any(ds <= 0 or ss <= 0 for _, ds, ss in outer):
        return None
    if not _injective([(size, ds) for size, ds, _ in dims]) or not _apart(dst, src):
        return None
    if not outer:
        return [Rows(dst.data_ptr(), width, src.data_ptr(), width, width, 1)]
    rows_at = max(range(len(outer)), key=lambda i: outer[i][0])
    height, dpitch, spitch = outer[rows_at][0], outer[rows_at][1] * item, outer[rows_at][2] * item
    if max(dpitch, spitch) > MAX_PITCH:
        return None
    loops = [d for i, d in enumerate(outer) if i != rows_at]
    if math.prod(size for size, _, _ in loops) > max_calls:
        return None
    plan = []
    dbase, sbase = dst.data_ptr(), src.data_ptr()
    for index in itertools.product(*(range(size) for size, _, _ in loops)):
        doff = sum(i * ds for i, (_, ds, _) in zip(index, loops, strict=True)) * item
        soff = sum(i * ss for i, (_, _, ss) in zip(index, loops, strict=True)) * item
        plan.append(Rows(dbase + doff, dpitch, sbase + soff, spitch, width, height))
    return plan
