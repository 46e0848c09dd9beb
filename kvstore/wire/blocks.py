"""Blocks on the wire: a raw block header (:mod:`kvstore.format.codec`), then the bytes.

Both ends verify what they receive: the server checks every layer of a
block a client puts before the block becomes visible, and a client checks
the layers it asked for before it uses them. A GET of a layer range sends the
block's header with the checksums of those layers (0 for the others), then
only those layers' bytes.
"""

from __future__ import annotations

import threading

import torch

from kvstore.errors import CorruptBlockError
from kvstore.format import (
    BlockHeader,
    Codec,
    checksum_pieces,
    header_size,
    layer_pieces,
    parse_header,
    verify_layers,
)
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout

__all__ = [
    "HeaderCache",
    "encode_span",
    "pieces_of",
    "read_header",
    "verify_span",
    "wire_nbytes",
]

Span = tuple[int, int]


def wire_nbytes(layout: KVLayout, layers: Span | None = None) -> int:
    """Bytes one block (or its ``layers``) takes on the wire, header included."""
    first, last = layers if layers is not None else (0, layout.num_layers)
    return header_size(layout.num_layers) + (last - first) * layout.layer_nbytes


def pieces_of(block: torch.Tensor) -> list[list[memoryview]]:
    """Per layer, buffers aliasing ``block`` (a CPU tensor, contiguous per (layer, kv))."""
    pieces = layer_pieces(block)
    if pieces is None:
        raise ValueError("block is not a CPU tensor contiguous per layer")
    return pieces


def encode_span(
    key: BlockKey,
    layout: KVLayout,
    block: torch.Tensor,
    layers: Span | None = None,
    header: bytes | None = None,
) -> tuple[bytes, list[memoryview]]:
    """The wire header of ``block`` (checksums of ``layers`` only) and its layers'
    bytes, aliasing the tensor where it is on the CPU and contiguous per layer.

    ``header``: the block's known full header (from when it was stored): used as is,
    and a contiguous block goes out as one buffer -- no hashing, no per-layer work.
    """
    first, last = layers if layers is not None else (0, layout.num_layers)
    span = block[first:last]
    if header is not None and span.is_contiguous() and span.device.type == "cpu":
        flat = span.view(torch.uint8).reshape(-1).numpy()
        return header, [memoryview(flat)]  # type: ignore[arg-type]
    pieces = layer_pieces(span)
    if pieces is None:  # a GPU tensor or an odd view: one contiguous host copy
        host = span.detach().to("cpu", copy=True).contiguous()
        pieces = pieces_of(host)
    sums = [0] * layout.num_layers
    for offset, layer in enumerate(pieces):
        sums[first + offset] = checksum_pieces(layer)
    computed = BlockHeader(
        codec=Codec.RAW,
        layout_fp=layout.fingerprint,
        key=bytes(key),
        raw_nbytes=layout.block_nbytes,
        payload_nbytes=layout.block_nbytes,
        layer_nbytes=(layout.layer_nbytes,) * layout.num_layers,
        layer_checksums=tuple(sums),
    )
    return computed.pack(), [piece for layer in pieces for piece in layer]


def read_header(data: bytes | bytearray | memoryview, layout: KVLayout, key: bytes) -> BlockHeader:
    """Parse and check a wire header for ``key``: raw codec, this layout's sizes."""
    header = parse_header(data, layout, key)
    if header.codec != Codec.RAW or header.payload_nbytes != layout.block_nbytes:
        raise CorruptBlockError("blocks on the wire must use the raw codec")
    return header


def verify_span(header: BlockHeader, block: torch.Tensor, layers: Span | None = None) -> None:
    """Check the ``layers`` of ``block`` (a CPU tensor holding just those layers)
    against ``header``; CorruptBlockError on a mismatch."""
    first = layers[0] if layers is not None else 0
    verify_layers(header, pieces_of(block), first)


class HeaderCache:
    """Known wire headers of stored blocks, so sending a block needs no hashing.

    A key's content never changes (keys are content-addressed), so the header a
    client sent with a block -- verified against its bytes before the block was
    stored -- stays its header; a block written without one (through shared
    memory) gets its header computed once, at its first whole-block send. At most
    ``max_entries`` are kept (the oldest go first). Whatever a header says, the
    receiver verifies the bytes against it: a stale one costs a miss, never data.

    Thread-safe: ``_lock`` guards ``_headers``.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max(1, max_entries)
        self._headers: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        """The header of ``key``, if known."""
        with self._lock:
            return self._headers.get(key)

    def put(self, key: bytes, header: bytes) -> None:
        """Remember ``header`` for ``key``."""
        with self._lock:
            self._headers.pop(key, None)
            self._headers[key] = bytes(header)
            while len(self._headers) > self.max_entries:
                del self._headers[next(iter(self._headers))]

    def drop(self, key: bytes) -> None:
        """Forget ``key``'s header (its block was written without one)."""
        with self._lock:
            self._headers.pop(key, None)
