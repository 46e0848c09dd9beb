"""Region tables: a batch of copies within one device as rows of bytes, for the rows kernel.

A device-to-device batch of the HBM tier is many strided views: a ``get(out=gpu)``
gathers each slab slot (one contiguous run) into an engine tensor's chunk view (``2 * L``
rows scattered across the tensor); a ``put`` scatters the other way. torch's strided
copy kernel computes an offset per element and reaches a third of the device's copy
speed on them; DMA row copies cost a call per 2-D copy. The rows kernel
(``kernel.py``) instead copies every row of the batch in one launch, each program a
slice of one row, with loads and stores as wide as the rows' alignment allows.

:func:`plan_regions` builds what that launch needs -- a table of ``(dst offset, src
offset, width)`` per row, in units of the widest integer (8, 4, 2 or 1 bytes) that
divides every offset and width -- or None where the kernel must not take the batch:

- a pair that is not a plain strided tensor on both sides (subclass, conjugate or
  negative view, quantized, nested), or that converts (dtype) or broadcasts (shape);
- tensors on different devices, or on a device other than the batch's;
- a destination byte written twice, or a byte written that the batch also reads (the
  kernel copies every row at once, so the copies one by one in order would differ);
- more than ``max_rows`` rows.

It is plain arithmetic on shapes, strides and addresses (no CUDA, no Triton), so CI
checks it on CPU tensors, and the kernel under Triton's interpreter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstore.copies.rows import collapse_dims, plain_strided

__all__ = ["MAX_ROWS", "RegionGroup", "Regions", "plan_regions"]

#: A batch of more rows than this goes the old way (the table would cost more than it saves).
MAX_ROWS = 1 << 20
#: The integer dtypes the kernel moves bytes as, widest first.
UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class RegionGroup:
    """The rows of a batch between one destination storage and one source storage.

    ``dst`` and ``src`` are the two storages as flat tensors of ``unit``-byte integers;
    ``table`` is ``(rows, 3)`` int64 on the CPU: destination offset, source offset and
    width of each row, in units; ``max_width`` is the widest row; ``align`` the largest
    power of two (up to 16 bytes' worth of units) dividing every offset and width.
    """

    dst: torch.Tensor
    src: torch.Tensor
    table: torch.Tensor
    max_width: int
    align: int

    @property
    def rows(self) -> int:
        """How many rows the group copies."""
        return int(self.table.shape[0])


@dataclass(frozen=True)
class Regions:
    """A batch as row groups (one per pair of storages), safe to copy all at once."""

    groups: tuple[RegionGroup, ...]
    unit: int
    nbytes: int

    @property
    def rows(self) -> int:
        """How many rows the batch copies, over all groups."""
        return sum(g.rows for g in self.groups)


@dataclass
class _Rows:
    """One pair's rows: absolute byte addresses of each row on both sides, and its width."""

    dst: torch.Tensor
    src: torch.Tensor
    width: int
    dst_storage: torch.UntypedStorage
    src_storage: torch.UntypedStorage


def _row_count(dst: torch.Tensor, src: torch.Tensor) -> int:
    dims = collapse_dims(dst, src)
    if dims and dims[-1][1] == 1 and dims[-1][2] == 1:
        dims = dims[:-1]
    return math.prod(size for size, _, _ in dims)


def _pair_rows(dst: torch.Tensor, src: torch.Tensor) -> _Rows:
    """The rows of one pair (the innermost dim where it is contiguous on both sides,
    else single elements)."""
    item = dst.element_size()
    dims = collapse_dims(dst, src)
    width = item
    if dims and dims[-1][1] == 1 and dims[-1][2] == 1:
        width = dims[-1][0] * item
        dims = dims[:-1]
    doffs = torch.tensor([dst.data_ptr()], dtype=torch.int64)
    soffs = torch.tensor([src.data_ptr()], dtype=torch.int64)
    for size, ds, ss in dims:
        steps = torch.arange(size, dtype=torch.int64)
        doffs = (doffs[:, None] + steps * (ds * item)).reshape(-1)
        soffs = (soffs[:, None] + steps * (ss * item)).reshape(-1)
    return _Rows(doffs, soffs, width, dst.untyped_storage(), src.untyped_storage())


def _eligible(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> bool:
    return (
        plain_strided(dst)
        and plain_strided(src)
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.device == device
        and src.device == device
        and all(s >= 0 for s in dst.stride())
        and all(s >= 0 for s in src.stride())
    )


def _disjoint(rows: list[_Rows]) -> bool:
    """True when no destination byte is written twice and none is read by the batch."""
    dlo = torch.cat([r.dst for r in rows])
    dhi = torch.cat([r.dst + r.width for r in rows])
    order = torch.argsort(dlo)
    dlo, dhi = dlo[order], dhi[order]
    if dlo.numel() > 1 and bool(torch.any(dlo[1:] < dhi[:-1])):
        return False  # destinations overlap (sorted and disjoint from here on)
    slo = torch.cat([r.src for r in rows])
    shi = torch.cat([r.src + r.width for r in rows])
    # the destination starting last before a source's end is the only one that may meet it
    at = torch.searchsorted(dlo, shi, side="left") - 1
    hit = (at >= 0) & (dhi[at.clamp(min=0)] > slo)
    return not bool(torch.any(hit))


def _unit(values: list[int], rows: list[_Rows]) -> int:
    """The widest unit (8, 4, 2, 1 bytes) dividing every address and width."""
    for unit in (8, 4, 2):
        if any(v % unit for v in values):
            continue
        if all(
            not bool(torch.any(r.dst % unit)) and not bool(torch.any(r.src % unit)) for r in rows
        ):
            return unit
    return 1


def _flat(storage: torch.UntypedStorage, unit: int, device: torch.device) -> torch.Tensor:
    """``storage`` as a flat tensor of ``unit``-byte integers (an alias, no copy)."""
    with torch.no_grad():
        base = torch.empty(0, dtype=UNITS[unit], device=device)
        return base.set_(storage, 0, (storage.nbytes() // unit,), (1,))


def _align(group: torch.Tensor) -> int:
    """The largest power of two up to 16 dividing every entry of ``group`` (in units)."""
    for align in (16, 8, 4, 2):
        if not bool(torch.any(group % align)):
            return align
    return 1


def _group(rows: list[_Rows], unit: int, device: torch.device) -> RegionGroup:
    dst_base, src_base = rows[0].dst_storage.data_ptr(), rows[0].src_storage.data_ptr()
    table = torch.stack(
        [
            torch.cat([(r.dst - dst_base) // unit for r in rows]),
            torch.cat([(r.src - src_base) // unit for r in rows]),
            torch.cat([torch.full_like(r.dst, r.width // unit) for r in rows]),
        ],
        dim=1,
    )
    max_width = max(r.width for r in rows) // unit
    align = min(_align(table), max(1, 16 // unit))
    dst = _flat(rows[0].dst_storage, unit, device)
    src = _flat(rows[0].src_storage, unit, device)
    return RegionGroup(dst, src, table.contiguous(), max_width, align)


def plan_regions(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], *, max_rows: int = MAX_ROWS
) -> Regions | None:
    """The batch ``dst.copy_(src)`` for each pair as row groups for one launch each, or
    None where the rows kernel must not take it (see the module's docstring). Empty
    pairs copy nothing and are left out; an empty batch plans to no groups."""
    pairs = [(d, s) for d, s in pairs if d.numel() > 0 or d.shape != s.shape]
    if not pairs:
        return Regions((), 1, 0)
    device = pairs[0][0].device
    if not all(_eligible(d, s, device) for d, s in pairs):
        return None
    if sum(_row_count(d, s) for d, s in pairs) > max_rows:
        return None
    rows = [_pair_rows(d, s) for d, s in pairs]
    if not _disjoint(rows):
        return None
    bases = [r.dst_storage.data_ptr() for r in rows] + [r.src_storage.data_ptr() for r in rows]
    unit = _unit(bases + [r.width for r in rows], rows)
    by_storage: dict[tuple[int, int], list[_Rows]] = {}
    for r in rows:
        key = (r.dst_storage.data_ptr(), r.src_storage.data_ptr())
        by_storage.setdefault(key, []).append(r)
    groups = tuple(_group(g, unit, device) for g in by_storage.values())
    nbytes = sum(r.width * r.dst.numel() for r in rows)
    return Regions(groups, unit, nbytes)
