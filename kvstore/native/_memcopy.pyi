"""Types of the compiled ``kvstore.native._memcopy`` (csrc/memcopy.c), built by the install."""

from _typeshed import ReadableBuffer, WriteableBuffer

def copy_regions(table: ReadableBuffer, threads: int, /) -> None:
    """memcpy every (dst, src, nbytes) uint64 triple of ``table``, the GIL released once."""

def copy_verified(
    dst: WriteableBuffer,
    src: ReadableBuffer,
    sizes: ReadableBuffer,
    checksums: ReadableBuffer,
    threads: int,
    /,
) -> int:
    """Copy consecutive regions of ``src`` into ``dst`` (``sizes``: uint64 each), each
    piece XXH3-hashed just before its copy; the first region not matching its uint64
    checksum, or -1."""
