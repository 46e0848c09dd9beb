"""The rows kernel's Triton source (imported only by ``kernel.py``, on first use: it needs Triton).

:func:`copy_rows` copies the rows of one region table (``regions.py``): program ``p``
copies units ``[c * BLOCK, (c + 1) * BLOCK)`` of row ``p // chunks`` (``c = p % chunks``;
``chunks`` is a runtime argument, so a new row width needs no new compile), masked at
the row's width; ``ALIGN`` tells the compiler every offset and width is a multiple of
that many units, so it may load and store up to 16 bytes a thread at once.
:data:`interpreted` is the same kernel under Triton's interpreter, for CPU tensors.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["copy_rows", "interpreted"]


@triton.jit(do_not_specialize=["chunks"])  # type: ignore[untyped-decorator]
def copy_rows(dst, src, table, chunks, BLOCK: tl.constexpr, ALIGN: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton takes no annotations
    """``dst[d : d + w] = src[s : s + w]`` for each row ``(d, s, w)`` of ``table``."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // chunks
    start = (pid % chunks) * BLOCK
    dst_at = tl.multiple_of(tl.load(table + row * 3), ALIGN)
    src_at = tl.multiple_of(tl.load(table + row * 3 + 1), ALIGN)
    width = tl.multiple_of(tl.load(table + row * 3 + 2), ALIGN)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < width
    data = tl.load(src + src_at + offs, mask=mask)
    tl.store(dst + dst_at + offs, data, mask=mask)


#: The same kernel run by Triton's interpreter (CPU tensors; what TRITON_INTERPRET=1 does).
interpreted = (
    copy_rows if isinstance(copy_rows, InterpretedFunction) else InterpretedFunction(copy_rows.fn)
)
