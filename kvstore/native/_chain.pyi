"""Types of the compiled ``kvstore.native._chain`` (csrc/chain.c), built by the install."""

from _typeshed import ReadableBuffer

def chain_keys(data: ReadableBuffer, step: int, parent: ReadableBuffer, /) -> list[bytes]:
    """Chained keys of the full ``step``-byte chunks of ``data``, from ``parent``."""
