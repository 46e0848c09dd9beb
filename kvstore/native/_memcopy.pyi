"""Types of the compiled ``kvstore.native._memcopy`` (csrc/memcopy.c), built by the install."""

from _typeshed import ReadableBuffer

def copy_regions(table: ReadableBuffer, threads: int, /) -> None:
    """memcpy every (dst, src, nbytes) uint64 triple of ``table``, the GIL released once."""
