"""The self-describing block format used wherever a block leaves process memory.

An encoded block is a header (:mod:`kvstore.format.header`: its layout, the
encrypted variant, parsing and checks; re-exported here) followed by the
payload: layer 0, layer 1, ... (each compressed on its own). This module
encodes and decodes that payload.

Checksums are per layer so that a ranged read of a few layers (layerwise
loading from S3) is verified without fetching the rest. Every decode checks
the magic, the header checksum, the layout fingerprint, the key and every
layer it returns; a failure raises :class:`CorruptBlockError` (or
:class:`LayoutMismatchError` for a whole, valid block of another layout), so a
reader turns it into a miss -- never into wrong KV.

Compression pays only with byte-plane shuffling: plain lz4 leaves bf16 KV at
ratio ~1.0 because the low mantissa byte is noise, but grouping the high
bytes (sign, exponent) of all elements lets lz4 shrink that plane.
``choose_codec`` tries it on one layer and keeps it only when it saves at
least 10%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lz4.block
import numpy as np
import torch
import xxhash

from kvstore.copies import engine_for
from kvstore.errors import (
    ConfigError,
    CorruptBlockError,
    DecryptError,
    InvalidInputError,
    LayoutMismatchError,
)
from kvstore.format.codecs import LayerCodec, codec_numbered
from kvstore.format.encodings import BlockEncoding
from kvstore.format.header import (
    FLAG_SEALED,
    HEADER_ALIGN,
    KEY_ID_BYTES,
    MAGIC,
    NONCE_BYTES,
    SEALED_VERSION,
    TAG_BYTES,
    VERSION,
    BlockHeader,
    Codec,
    codec_number,
    header_size,
    parse_header,
    read_header,
)
from kvstore.layout import KVLayout
from kvstore.native import memcopy

# None without the compiled helper (or with one built before it had this function).
_COPY_VERIFIED = getattr(memcopy, "copy_verified", None)

__all__ = [
    "FLAG_SEALED",
    "KEY_ID_BYTES",
    "NONCE_BYTES",
    "SEALED_VERSION",
    "TAG_BYTES",
    "HEADER_ALIGN",
    "MAGIC",
    "VERSION",
    "BlockHeader",
    "Codec",
    "LZ4_CODEC",
    "RAW_CODEC",
    "SHUFFLE_LZ4_CODEC",
    "codec_number",
    "checksum_pieces",
    "EncodedBlock",
    "choose_codec",
    "decode_block",
    "decode_into",
    "decode_layer",
    "encode_block",
    "header_size",
    "layer_pieces",
    "parse_header",
    "read_header",
    "verify_layers",
]


# -- payload transforms ---------------------------------------------------
def layer_pieces(block: torch.Tensor) -> list[list[memoryview]] | None:
    """Per layer, the bytes of ``block`` (or of a ``(layers, ...)`` slice of one) as
    writable buffers that alias the tensor: no copy.

    The engine's per-chunk views (``kv[:, :, a:b]``) are not contiguous, but
    each ``(layer, kv)`` slab of them is, so a layer is ``kv_factor`` pieces.
    Returns None for tensors that are not on the CPU or not piecewise
    contiguous; callers then fall back to a contiguous copy.
    """
    if block.device.type != "cpu":
        return None
    if block.is_contiguous():
        flat = block.view(torch.uint8).reshape(block.shape[0], -1).numpy()
        return [[memoryview(row)] for row in flat]
    if block.dim() < 2 or block.stride(-1) != 1:
        return None
    # One strided numpy view of the whole block, then plain indexing: a torch op per
    # piece (unbind, view, reshape, numpy) cost ~0.6 ms per 64-piece block, ~15% of
    # a warm 32 MiB read.
    try:
        arr = block.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a layout torch cannot reinterpret as bytes
        return None
    pieces: list[list[memoryview]] = []
    for layer in arr:
        row = []
        for part in layer:
            if not part.flags.c_contiguous:
                return None
            row.append(memoryview(part).cast("B"))
        pieces.append(row)
    return pieces


def checksum_pieces(pieces: list[memoryview]) -> int:
    """xxh3-64 of several buffers as if concatenated (one layer's stored bytes)."""
    if len(pieces) == 1:
        return int(xxhash.xxh3_64_intdigest(pieces[0]))
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
    return int(state.intdigest())


def verify_layers(header: BlockHeader, pieces: list[list[memoryview]], first: int = 0) -> None:
    """Check raw layers ``first, first+1, ...`` held in ``pieces`` against ``header``.

    Used after reading a RAW payload straight into its destination: the
    caller must not use the destination if this raises :class:`CorruptBlockError`.
    """
    if header.sealed:
        raise DecryptError(f"block {header.key.hex()} is encrypted; open it with its key")
    if header.codec != Codec.RAW:
        raise CorruptBlockError("in-place verification needs a raw block")
    for offset, layer in enumerate(pieces):
        i = first + offset
        if checksum_pieces(layer) != header.layer_checksums[i]:
            raise CorruptBlockError(f"checksum mismatch in layer {i} of block {header.key.hex()}")


def _host_bytes(block: torch.Tensor) -> np.ndarray:
    """The block's bytes as a contiguous uint8 numpy array on the host."""
    if block.device.type != "cpu":
        block = block.cpu()
    return block.contiguous().view(torch.uint8).reshape(-1).numpy()


_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _shuffle(data: np.ndarray, itemsize: int) -> bytes:
    """Group byte ``b`` of every element together (byte planes).

    Shifts on whole little-endian words vectorize well; a transposing copy
    ran at ~0.5 GB/s here.
    """
    if itemsize == 1:
        return data.tobytes()
    words = data.view(_WORDS[itemsize])
    planes = np.empty((itemsize, words.size), dtype=np.uint8)
    for b in range(itemsize):
        np.copyto(planes[b], words >> (8 * b), casting="unsafe")  # keeps the low byte
    return planes.tobytes()


def _unshuffle(data: bytes, itemsize: int) -> np.ndarray:
    """Inverse of :func:`_shuffle`."""
    arr = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1:
        return arr
    planes = arr.reshape(itemsize, -1)
    words = planes[0].astype(_WORDS[itemsize])
    for b in range(1, itemsize):
        words |= planes[b].astype(_WORDS[itemsize]) << (8 * b)
    result: np.ndarray = words.view(np.uint8)
    return result


def _compress_layer(layer: np.ndarray, codec: int, itemsize: int) -> bytes:
    if codec == Codec.LZ4:
        return bytes(lz4.block.compress(layer, store_size=False))
    if codec == Codec.SHUFFLE_LZ4:
        return bytes(lz4.block.compress(_shuffle(layer, itemsize), store_size=False))
    return bytes(_plugin(codec).compress(layer, itemsize))


def _plugin(number: int) -> LayerCodec:
    codec = codec_numbered(number)
    if codec is None:
        raise CorruptBlockError(f"unknown codec {number}")
    return codec


def _decompress_plugin(
    stored: memoryview, number: int, raw_nbytes: int, itemsize: int
) -> np.ndarray:
    try:
        raw = np.frombuffer(
            _plugin(number).decompress(bytes(stored), raw_nbytes, itemsize), np.uint8
        )
    except CorruptBlockError:
        raise
    except Exception as exc:  # a plug-in's own failure on bad bytes: corrupt, so a miss
        raise CorruptBlockError(
            f"block payload does not decode with codec {number}: {exc}"
        ) from None
    if raw.nbytes != raw_nbytes:
        raise CorruptBlockError("block payload decompressed to the wrong size")
    return raw


def _decompress_layer(stored: memoryview, codec: int, raw_nbytes: int, itemsize: int) -> np.ndarray:
    if codec not in (Codec.LZ4, Codec.SHUFFLE_LZ4):
        return _decompress_plugin(stored, codec, raw_nbytes, itemsize)
    try:
        raw = lz4.block.decompress(stored, uncompressed_size=raw_nbytes)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptBlockError(f"block payload does not decompress: {exc}") from None
    if len(raw) != raw_nbytes:
        raise CorruptBlockError("block payload decompressed to the wrong size")
    if codec == Codec.LZ4:
        return np.frombuffer(raw, dtype=np.uint8)
    return _unshuffle(raw, itemsize)


@dataclass(frozen=True)
class EncodedBlock:
    """A block ready to leave memory: write ``header`` then each ``payload`` part."""

    header: BlockHeader
    header_bytes: bytes
    payload: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        """Total encoded size."""
        return len(self.header_bytes) + self.header.payload_nbytes

    def parts(self) -> list[memoryview]:
        """Header and payload as a list of buffers (for ``os.pwritev`` and friends)."""
        return [memoryview(self.header_bytes), *self.payload]

    def tobytes(self) -> bytes:
        """The whole encoded block as one bytes object."""
        return b"".join(self.parts())


def choose_codec(block: torch.Tensor, layout: KVLayout, min_saving: float = 0.10) -> Codec:
    """SHUFFLE_LZ4 if it shrinks layer 0 of ``block`` by ``min_saving``, else RAW."""
    layer0 = _host_bytes(block[0])
    compressed = _compress_layer(layer0, Codec.SHUFFLE_LZ4, layout.itemsize)
    return Codec.SHUFFLE_LZ4 if len(compressed) <= (1 - min_saving) * len(layer0) else Codec.RAW


def encode_block(
    key: bytes,
    layout: KVLayout,
    block: torch.Tensor,
    codec: Codec | str | int = Codec.RAW,
    encoding: BlockEncoding | None = None,
) -> EncodedBlock:
    """Encode one block (a tensor of ``layout.block_shape``) with ``codec``, or in a
    lossy ``encoding`` (:mod:`kvstore.format.encodings`; it replaces the codec). For RAW
    the payload aliases ``block`` (no copy) when it is a CPU tensor contiguous per
    ``(layer, kv)`` -- the engine's chunk views too; keep ``block`` unchanged until the
    bytes are written."""
    if tuple(block.shape) != layout.block_shape or block.dtype != layout.dtype:
        raise LayoutMismatchError(
            f"block of shape {tuple(block.shape)} / {block.dtype} does not match layout "
            f"{layout.block_shape} / {layout.dtype}"
        )
    if encoding is not None:
        return _encode_lossy(key, layout, block, encoding)
    codec = codec_number(codec)
    step = layout.layer_nbytes
    pieces = layer_pieces(block) if codec == Codec.RAW else None
    if pieces is not None:  # no copy: the payload aliases the caller's tensor
        stored: list[memoryview] = [piece for layer in pieces for piece in layer]
        sizes = [step] * layout.num_layers
        sums = [checksum_pieces(layer) for layer in pieces]
    elif codec == Codec.RAW:
        data = _host_bytes(block)
        stored, sizes = [data.data], [step] * layout.num_layers
        sums = [
            xxhash.xxh3_64_intdigest(data[i * step : (i + 1) * step].data)
            for i in range(layout.num_layers)
        ]
    else:
        data = _host_bytes(block)
        layers = [data[i * step : (i + 1) * step] for i in range(layout.num_layers)]
        blobs = [_compress_layer(layer, codec, layout.itemsize) for layer in layers]
        stored = [memoryview(b) for b in blobs]
        sizes = [len(b) for b in blobs]
        sums = [xxhash.xxh3_64_intdigest(b) for b in blobs]
    header = BlockHeader(
        codec=codec,
        layout_fp=layout.fingerprint,
        key=bytes(key),
        raw_nbytes=layout.block_nbytes,
        payload_nbytes=sum(sizes),
        layer_nbytes=tuple(sizes),
        layer_checksums=tuple(sums),
    )
    return EncodedBlock(header=header, header_bytes=header.pack(), payload=tuple(stored))


def _encode_lossy(
    key: bytes, layout: KVLayout, block: torch.Tensor, encoding: BlockEncoding
) -> EncodedBlock:
    """``block`` in ``encoding``: each layer encoded into one payload buffer, then
    checksummed (the checksums cover the encoded bytes)."""
    try:
        encoding.check(layout)
    except ConfigError as exc:
        raise InvalidInputError(str(exc)) from None
    if block.device.type != "cpu":
        block = block.cpu()
    step = encoding.layer_nbytes(layout)
    payload = np.empty(step * layout.num_layers, dtype=np.uint8)
    sums = []
    for i in range(layout.num_layers):
        layer = payload[i * step : (i + 1) * step]
        encoding.encode_layer(block[i], layer)
        sums.append(xxhash.xxh3_64_intdigest(layer.data))
    header = BlockHeader(
        codec=int(encoding.kind),
        layout_fp=layout.fingerprint,
        key=bytes(key),
        raw_nbytes=layout.block_nbytes,
        payload_nbytes=payload.nbytes,
        layer_nbytes=(step,) * layout.num_layers,
        layer_checksums=tuple(sums),
        group_size=encoding.group_size,
    )
    return EncodedBlock(header=header, header_bytes=header.pack(), payload=(payload.data,))


def decode_into(
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    layout: KVLayout,
    out: torch.Tensor,
    layers: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Verify and decode layers ``[first, last)`` of a payload into ``out``.

    ``payload`` holds exactly those layers' stored bytes (the whole payload
    when ``layers`` is None); ``out`` has shape ``(last - first, *block_shape[1:])``.
    """
    first, last = layers if layers is not None else (0, header.num_layers)
    _, span = header.layer_span(first, last)
    view = memoryview(payload).cast("B")
    if len(view) < span:
        raise CorruptBlockError(f"block payload truncated: {len(view)} of {span} bytes")
    expected_shape = (last - first, *layout.block_shape[1:])
    if tuple(out.shape) != expected_shape or out.dtype != layout.dtype:
        raise InvalidInputError(
            f"decode target has shape {tuple(out.shape)}, expected {expected_shape}"
        )
    if header.sealed:
        raise DecryptError(f"block {header.key.hex()} is encrypted; open it with its key")
    if _copy_verified(header, (first, last), view, layout, out):
        return out
    offset = 0
    for i in range(first, last):
        n = header.layer_nbytes[i]
        decode_layer(header, i, view[offset : offset + n], layout, out[i - first])
        offset += n
    return out


def _copy_verified(
    header: BlockHeader,
    layers: tuple[int, int],
    stored: memoryview,
    layout: KVLayout,
    out: torch.Tensor,
) -> bool:
    """Raw layers into a contiguous host ``out`` in one pass over the bytes: each 64 KiB
    piece hashed just before it is copied (csrc/memcopy.c), instead of a checksum pass
    then a copy pass (on the Redis tier's get, the second pass over the value cost a
    tenth of its throughput). False where this does not apply (no compiled helper, a
    compressed codec, a GPU or strided ``out``): :func:`decode_layer` does it then."""
    first, last = layers
    sizes = header.layer_nbytes[first:last]
    if (
        _COPY_VERIFIED is None
        or header.codec != Codec.RAW
        or out.device.type != "cpu"
        or not out.is_contiguous()
        or any(n != layout.layer_nbytes for n in sizes)
    ):
        return False
    target = out.view(torch.uint8).view(-1).numpy()
    bad = _COPY_VERIFIED(
        target,
        stored,
        np.array(sizes, dtype=np.uint64),
        np.array(header.layer_checksums[first:last], dtype=np.uint64),
        1,  # as the two passes were: helper threads wait for a CPU on a busy host
    )
    if bad >= 0:
        raise CorruptBlockError(
            f"checksum mismatch in layer {first + bad} of block {header.key.hex()}"
        )
    return True


def decode_layer(
    header: BlockHeader,
    index: int,
    stored: bytes | bytearray | memoryview,
    layout: KVLayout,
    out: torch.Tensor,
) -> None:
    """Verify layer ``index``'s stored (plain: decrypted) bytes against its checksum and
    decode them into ``out`` (one layer's shape)."""
    if xxhash.xxh3_64_intdigest(stored) != header.layer_checksums[index]:
        raise CorruptBlockError(f"checksum mismatch in layer {index} of block {header.key.hex()}")
    encoding = header.encoding
    if encoding is not None:  # decoded straight into ``out``, in the layout's dtype
        encoding.decode_layer(memoryview(stored).cast("B"), layout, out)
        return
    if header.codec == Codec.RAW:
        if len(stored) != layout.layer_nbytes:
            raise CorruptBlockError(f"layer {index} of block {header.key.hex()} has a wrong size")
        raw = np.frombuffer(stored, dtype=np.uint8)
    else:
        raw = _decompress_layer(
            memoryview(stored), header.codec, layout.layer_nbytes, layout.itemsize
        )
    _copy_bytes_into(out, raw)


def _copy_bytes_into(dst: torch.Tensor, src: np.ndarray) -> None:
    """Copy raw element bytes ``src`` into tensor ``dst`` (any strides, any device)."""
    if dst.device.type == "cpu" and (dst.stride(-1) == 1 or dst.element_size() == 1):
        # numpy copies into strided views and accepts read-only sources silently.
        target = dst.view(torch.uint8).numpy()
        np.copyto(target, src.reshape(target.shape))
        return
    host = torch.from_numpy(src if src.flags.writeable else src.copy())
    engine_for(dst.device).copy_all([(dst, host.view(dst.dtype).view(dst.shape))])


def decode_block(
    data: bytes | bytearray | memoryview,
    layout: KVLayout,
    key: bytes | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify and decode a whole encoded block (header + payload).

    Returns ``out`` (or a new CPU tensor of ``layout.block_shape``).
    """
    header = parse_header(data, layout, key)
    view = memoryview(data).cast("B")
    body = view[header.header_nbytes :]
    if len(body) != header.payload_nbytes:
        raise CorruptBlockError(
            f"block has {len(body)} payload bytes, its header says {header.payload_nbytes}"
        )
    target = out if out is not None else torch.empty(layout.block_shape, dtype=layout.dtype)
    return decode_into(header, body, layout, target)


def _raw_compress(layer: np.ndarray, itemsize: int) -> bytes:
    return layer.tobytes()


def _raw_decompress(stored: bytes, raw_nbytes: int, itemsize: int) -> np.ndarray:
    return np.frombuffer(stored, dtype=np.uint8)


def _builtin(codec: Codec) -> LayerCodec:
    """The built-in ``codec`` as the registry holds it (encode and decode dispatch on
    :class:`Codec` themselves; these are for callers going through the registry)."""

    def compress(layer: np.ndarray, itemsize: int) -> bytes:
        return _compress_layer(layer, codec, itemsize)

    def decompress(stored: bytes, raw_nbytes: int, itemsize: int) -> np.ndarray:
        return _decompress_layer(memoryview(stored), codec, raw_nbytes, itemsize)

    return LayerCodec(int(codec), compress, decompress)


#: The built-in codecs, as :data:`kvstore.format.codecs.CODECS` names them.
RAW_CODEC = LayerCodec(int(Codec.RAW), _raw_compress, _raw_decompress)
LZ4_CODEC = _builtin(Codec.LZ4)
SHUFFLE_LZ4_CODEC = _builtin(Codec.SHUFFLE_LZ4)
