"""Coalescing: many ``dst.copy_(src)`` calls become few, without changing a byte.

A batch of copies that walk two memories in step -- block ``i`` of a run of
adjacent blocks into slot ``i`` of a slab, layer ``l`` of consecutive slots,
chunk ``i`` of a ``(L, 2, n * bt, H, D)`` tensor -- is one copy of two strided
views with an extra leading dimension. One ``copy_`` call releases the GIL
once and starts one parallel loop (on a GPU: one kernel or one DMA) instead of
``N``; for small blocks the per-call overhead is most of the cost.

:func:`coalesce` only merges what it can prove gives the same bytes as the
copies one by one, in order (see :func:`coalesce` for the rules). Every
engine (``threads.py`` here, ``cuda.py`` later) runs its batches through
:func:`copy_pairs`, which also enters inference mode where a destination
needs it. What is left after coalescing -- blocks of separate host tensors,
say -- goes to C in one call (``kvstore.native._memcopy``, csrc/memcopy.c: the GIL
released once for the batch, the bytes split over torch's thread count)
wherever one ``memcpy`` per pair is provably the same as the ``copy_`` calls.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

# The compiled batch copier (``kvstore.native._memcopy``, csrc/memcopy.c: its
# ``copy_regions(table, threads)`` memcpys every ``(dst, src, nbytes)`` uint64 triple
# of ``table`` with the GIL released once), or None where the install did not build
# it. :func:`copy_pairs` looks this name up at each batch, so setting it to None
# makes every pair a ``copy_``.
from kvstore.native import memcopy

__all__ = [
    "CopyPair",
    "coalesce",
    "copy_pairs",
    "memcopy",
    "needs_inference_mode",
    "touches_cuda",
]

#: One copy: ``(dst, src)`` means ``dst.copy_(src)``.
CopyPair = tuple[torch.Tensor, torch.Tensor]


def _mergeable(t: object) -> bool:
    """True for a plain, dense-storage tensor with elements that a view may address.

    Subclasses, autograd-tracked tensors, lazily conjugated or negated views,
    quantized, nested, sparse and meta tensors, and empty tensors always stay
    single pairs: for them a merged view could mean something else than the
    copies one by one (or is not worth it).
    """
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_nested
        and not t.is_quantized
        and t.device.type != "meta"
        and t.numel() > 0
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


class _Shape(NamedTuple):
    """What the checks of a run need about one side's tensors (the same for all of them)."""

    reach: int  # elements from a tensor's first to its last addressed element
    item: int  # bytes per element
    dims: list[tuple[int, int]]  # (stride, size) of the dimensions of size > 1, by stride
    dense: bool  # contiguous, and the step that makes a run contiguous is numel


def _shape(t: torch.Tensor) -> _Shape:
    sizes, strides = t.shape, t.stride()
    reach = sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    dims = sorted((s, n) for n, s in zip(sizes, strides, strict=True) if n > 1)
    return _Shape(reach, t.element_size(), dims, t.is_contiguous())


def _injective(dims: list[tuple[int, int]], count: int, step: int) -> bool:
    """True when no two elements of the view share an address (a sufficient test).

    ``dims`` are a tensor's (stride, size), sorted, plus a new dimension of
    ``count`` at ``step``. With the dimensions sorted by stride, each stride must
    exceed the farthest offset the smaller dimensions reach: then the largest
    dimension in which two indices differ decides their offsets apart, and they
    never meet.
    """
    reach = 0
    for stride, size in sorted([*dims, (step, count)]):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _span(t: torch.Tensor, shape: _Shape, count: int, step: int) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` of ``count`` views like ``t``, ``step`` elements apart
    from ``t`` on; None if it leaves ``t``'s storage."""
    lo = t.data_ptr()
    hi = lo + (shape.reach + (count - 1) * step + 1) * shape.item
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return (lo, hi) if lo >= start and hi <= start + storage.nbytes() else None


def _valid(
    base: CopyPair, count: int, steps: tuple[int, int], shapes: tuple[_Shape, _Shape], strided: bool
) -> bool:
    """True when ``count`` pairs from ``base`` (lowest addresses) on may be one copy.

    The merged destination must address every element once, both merged views
    must stay in their storages, and the bytes written must not meet the bytes
    read (then the order of the single copies cannot matter). With
    ``strided=False`` both merged views must also be contiguous.
    """
    (dst, src), (dstep, sstep), (dshape, sshape) = base, steps, shapes
    if not strided and not (
        dshape.dense and sshape.dense and dstep == dst.numel() and sstep == src.numel()
    ):
        return False
    if not _injective(dshape.dims, count, dstep):
        return False
    dspan = _span(dst, dshape, count, dstep)
    sspan = _span(src, sshape, count, sstep)
    if dspan is None or sspan is None:
        return False
    return not (dspan[0] < sspan[1] and sspan[0] < dspan[1])


def _first_steps(pairs: Sequence[CopyPair], start: int) -> tuple[int, int] | None:
    """Bytes from pair ``start`` to the next, per side, if a run could start there.

    The cheap test first: two plain tensors on each side, moving the same way
    (the destination must move; the source may stay).
    """
    if start + 1 >= len(pairs):
        return None
    (dst, src), (d, s) = pairs[start], pairs[start + 1]
    plain = torch.Tensor
    if type(dst) is not plain or type(src) is not plain or type(d) is not plain:
        return None
    if type(s) is not plain:
        return None
    try:
        steps = (d.data_ptr() - dst.data_ptr(), s.data_ptr() - src.data_ptr())
        # Separate allocations (blocks of their own) may lie at a constant distance: they
        # can never merge, and finding that out at each start of a long batch would cost
        # a scan of the rest of it every time.
        if not (_inside(dst, d) and _inside(src, s)):
            return None
    except RuntimeError:  # no storage (sparse, nested): nothing to merge
        return None
    rising = steps[0] > 0 and steps[1] >= 0
    falling = steps[0] < 0 and steps[1] <= 0
    return steps if rising or falling else None


def _inside(base: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``other`` starts inside the memory of ``base``'s storage."""
    storage = base.untyped_storage()
    first = storage.data_ptr()
    return first <= other.data_ptr() < first + storage.nbytes()


def _scan(pairs: Sequence[CopyPair], start: int, steps: tuple[int, int]) -> int:
    """How many pairs from ``start`` on (at least 1) are like pair ``start``, ``steps``
    bytes apart: same shapes, strides, dtypes, devices, and no autograd or lazy bits."""
    dst, src = pairs[start]
    dshape, dstride, ddtype, ddevice = dst.shape, dst.stride(), dst.dtype, dst.device
    sshape, sstride, sdtype, sdevice = src.shape, src.stride(), src.dtype, src.device
    conj = ddtype.is_complex or sdtype.is_complex
    (dptr, sptr), (dstep, sstep), plain = (dst.data_ptr(), src.data_ptr()), steps, torch.Tensor
    count = 1
    # A tensor without strides (sparse, nested) raises RuntimeError: it ends the run.
    with contextlib.suppress(RuntimeError):  # the cheapest and likeliest to differ first
        for d, s in itertools.islice(pairs, start + 1, None):
            dptr, sptr = dptr + dstep, sptr + sstep
            if type(d) is not plain or type(s) is not plain:
                break
            if d.data_ptr() != dptr or s.data_ptr() != sptr:
                break
            if d.stride() != dstride or s.stride() != sstride:
                break
            if d.shape != dshape or s.shape != sshape or d.dtype != ddtype or s.dtype != sdtype:
                break
            if d.device != ddevice or s.device != sdevice or d.requires_grad or s.requires_grad:
                break
            if d.is_neg() or s.is_neg() or (conj and (d.is_conj() or s.is_conj())):
                break
            count += 1
    return count


def _run_length(pairs: Sequence[CopyPair], start: int) -> tuple[int, int, int]:
    """The longest run from ``start`` whose pairs advance by one constant step.

    Returns ``(count, dst_step, src_step)`` (steps in elements, either both
    >= 0 or both <= 0); ``count`` is 1 when nothing merges. The first pair
    gets the full :func:`_mergeable` test; the others (:func:`_scan`) only
    what can differ between tensors of the same kind, so that scanning costs
    about what the ``copy_`` calls it saves do. Storages are not compared
    here: :func:`_valid` makes sure the merged view lies inside the base
    tensor's storage, so a tensor can only be in the run if it lies there too
    (the same bytes, whatever storage object it came from).
    """
    steps = _first_steps(pairs, start)
    dst, src = pairs[start]
    if steps is None or not (_mergeable(dst) and _mergeable(src)) or dst.dim() != src.dim():
        return 1, 0, 0  # (a source broadcast from fewer dims would line up wrong)
    count = _scan(pairs, start, steps)
    dsize, ssize = dst.element_size(), src.element_size()
    if count == 1 or steps[0] % dsize or steps[1] % ssize:  # not whole elements apart
        return 1, 0, 0
    return count, steps[0] // dsize, steps[1] // ssize


def _longest_valid(
    pairs: Sequence[CopyPair], start: int, count: int, steps: tuple[int, int], strided: bool
) -> tuple[int, CopyPair, tuple[int, int]]:
    """Shorten a run of ``count`` pairs to the longest prefix that is safe to merge.

    Returns ``(length, base pair, (dst step, src step))`` with non-negative
    steps: a run in falling addresses (both steps < 0, or dst < 0 and src 0)
    is merged from its last pair, whose tensors lie lowest. Every check in
    :func:`_valid` only gets harder as a run grows, so a binary search finds
    the longest safe prefix. Length 1 means: no merge.
    """
    flip = steps[0] < 0  # (_run_length returns steps of one sign)
    steps = (abs(steps[0]), abs(steps[1]))
    shapes = (_shape(pairs[start][0]), _shape(pairs[start][1]))
    good, bad = 1, count + 1
    while bad - good > 1:
        mid = bad - 1 if good == 1 and bad == count + 1 else (good + bad) // 2  # all, first
        base = pairs[start + mid - 1] if flip else pairs[start]
        if _valid(base, mid, steps, shapes, strided):
            good = mid
        else:
            bad = mid
    base = pairs[start + good - 1] if flip else pairs[start]
    return good, base, steps


def _merged(base: CopyPair, count: int, steps: tuple[int, int]) -> CopyPair:
    """``count`` pairs from ``base`` on as one pair of views with a leading dimension."""
    (dst, src), (dstep, sstep) = base, steps
    return (
        dst.as_strided((count, *dst.shape), (dstep, *dst.stride()), dst.storage_offset()),
        src.as_strided((count, *src.shape), (sstep, *src.stride()), src.storage_offset()),
    )


def _next_copy(pairs: Sequence[CopyPair], start: int, strided: bool) -> tuple[int, CopyPair]:
    """How many pairs from ``start`` on make the next copy, and that copy."""
    count, dstep, sstep = _run_length(pairs, start)
    if count > 1:
        count, base, steps = _longest_valid(pairs, start, count, (dstep, sstep), strided)
        if count > 1:
            return count, _merged(base, count, steps)
    return 1, pairs[start]


def coalesce(pairs: Sequence[CopyPair], *, strided: bool = True) -> list[CopyPair]:
    """Merge runs of consecutive pairs into single copies; the bytes written are the same.

    A run is a sequence of consecutive pairs in which, on each side (all the
    destinations; all the sources):

    - every tensor is a plain strided tensor (see ``_mergeable``: not empty,
      not tracked by autograd, not a subclass, conjugate/negative view,
      quantized, nested or meta tensor) with the same shape, strides, dtype
      and device; the source has as many dimensions as the destination (a
      source broadcast from fewer dimensions would align its new leading
      dimension wrongly);
    - each tensor starts a constant number of bytes after the previous one,
      a whole number of elements (the step; the source's may be 0: one
      source copied to many destinations).

    A run becomes ``(dst0.as_strided((n, *shape), (dst_step, *strides),
    offset), <the same for src>)`` -- the first pair's tensors, or the last
    pair's for a run in falling addresses (both steps negative) -- and only if

    - the merged destination addresses no element twice (so no single copy
      overwrites another, and each destination is itself free of overlap);
    - both merged views stay inside the storage of the tensor they are made
      from: so every tensor of the run lies in that storage (tensors of
      different allocations never merge; a tensor of another storage object
      that aliases the same memory may, as its bytes are the view's bytes);
    - the byte range written does not meet the byte range read (then no copy
      reads what an earlier one wrote, and the order cannot matter);
    - with ``strided=False``: both merged views are contiguous (adjacent
      contiguous blocks). The CUDA engine asks for this on copies between
      host and device, where ``copy_`` of non-contiguous views would stage
      through a temporary instead of one DMA.

    A run that fails a check is cut to its longest prefix that passes; what
    is left starts the next run. Pairs that merge with nothing are returned
    as given (so ``copy_`` raises for them exactly as it would have), in the
    original order. So: adjacent contiguous blocks become one contiguous
    copy; layer ``l`` of consecutive slab slots becomes one strided copy;
    shuffled slots, different storages, mixed dtypes or devices, overlapping
    or opposite-direction runs stay apart.
    """
    out: list[CopyPair] = []
    i = 0
    while i < len(pairs):
        count, pair = _next_copy(pairs, i, strided)
        out.append(pair)
        i += count
    return out


def touches_cuda(pairs: Sequence[CopyPair]) -> bool:
    """True when a tensor of the batch lives on a CUDA device."""
    return any(dst.is_cuda or src.is_cuda for dst, src in pairs)


def needs_inference_mode(pairs: Sequence[CopyPair]) -> bool:
    """True when a destination is an inference tensor and this thread is not in that mode.

    An engine (vLLM does) that makes its KV cache under ``torch.inference_mode()``
    gets inference tensors, and views of them are inference tensors too:
    writing into one outside that mode raises. The mode is per thread, so a
    worker thread must enter it for such a batch (in-place copies into
    normal tensors are allowed inside it, so one mode serves a mixed batch).
    """
    if torch.is_inference_mode_enabled():
        return False
    return any(isinstance(dst, torch.Tensor) and dst.is_inference() for dst, _ in pairs)


def copy_pairs(
    pairs: Sequence[CopyPair], *, non_blocking: bool = False, strided: bool = True
) -> int:
    """``dst.copy_(src)`` for every pair, coalesced, in order; return the copies made.

    Runs on the calling thread, in inference mode when a destination needs it
    (:func:`needs_inference_mode`), otherwise in the caller's autograd mode.
    Raises what ``copy_`` raises; the pairs before the failing copy are done.
    ``non_blocking`` and ``strided`` are for the CUDA engine (asynchronous
    copies from pinned memory; no strided merges across devices).
    """
    merged = coalesce(pairs, strided=strided)
    if memcopy is not None and _host_memcpy_safe(merged):
        table = array.array("Q")
        for dst, src in merged:
            table.extend((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
        memcopy.copy_regions(table, torch.get_num_threads())
        return len(merged)
    mode = torch.inference_mode() if needs_inference_mode(merged) else contextlib.nullcontext()
    with mode:
        for dst, src in merged:
            dst.copy_(src, non_blocking=non_blocking)
    return len(merged)


def plain_bytes(t: torch.Tensor) -> bool:
    """A host tensor whose elements are its bytes, in order: a plain memcpy reads or
    writes it exactly as ``copy_`` would."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


def _host_memcpy_safe(pairs: Sequence[CopyPair]) -> bool:
    """True when every pair is a same-dtype, same-shape copy between contiguous host
    tensors and no destination overlaps another pair's destination or any source:
    then one ``memcpy`` per pair, in any order, gives what the ``copy_`` calls give.

    This batch goes to C (``kvstore.native._memcopy``) in one call with the GIL released
    once: a ``copy_`` per pair gives the GIL back and takes it again each time, and
    a thread running Python beside the copies then holds it for its whole switch
    interval (5 ms) between two of them (measured: 256 copies of 1 MiB ran at
    0.08 GB/s beside a busy Python thread, against 3.7 in one call).
    """
    if len(pairs) < 2:
        return False  # one copy: torch's copy_ releases the GIL once too
    dsts: list[tuple[int, int]] = []
    srcs: list[tuple[int, int]] = []
    for dst, src in pairs:
        if not (plain_bytes(dst) and plain_bytes(src)):
            return False
        if dst.dtype != src.dtype or dst.shape != src.shape:
            return False
        nbytes = dst.numel() * dst.element_size()
        dsts.append((dst.data_ptr(), dst.data_ptr() + nbytes))
        srcs.append((src.data_ptr(), src.data_ptr() + nbytes))
    dsts.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(dsts)):
        return False  # destinations overlap: the order of the copies would matter
    starts = [lo for lo, _ in dsts]
    for lo, hi in srcs:  # the destination starting last before hi may reach into [lo, hi)
        i = bisect.bisect_left(starts, hi) - 1
        if i >= 0 and dsts[i][1] > lo:
            return False
    return True
