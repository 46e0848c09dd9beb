"""The self-describing block format used wherever a block leaves process memory.

Layout of an encoded block (all integers little-endian)::

    offset  size  field
    0       4     magic  b"KVSB"
    4       2     format version (1)
    6       1     codec (0 raw, 1 lz4, 2 byte-shuffle + lz4)
    7       1     flags (reserved, 0)
    8       4     num_layers
    12      8     layout fingerprint (xxh3-64 of the KVLayout)
    20      16    block key
    36      8     raw payload bytes (uncompressed)
    44      8     stored payload bytes
    52      12*L  per layer: stored bytes (u32), xxh3-64 of the stored bytes (u64)
    52+12L  8     xxh3-64 of everything above (header checksum)
    ...           zero padding to a multiple of 64
    H             payload: layer 0, layer 1, ... (each compressed on its own)

An encrypted block (:mod:`kvstore.crypt`, encryption at rest) has format
version 2 and flag bit 0 set; 44 more bytes follow the layer table, before
the header checksum::

    52+12L  32    key id (ASCII, zero-padded): which key of the keyring sealed it
    84+12L  12    the block's nonce (layer i is sealed under it with i folded in)

and each layer's stored bytes are its AES-256-GCM ciphertext followed by its
16-byte tag, so a layer (or a range of layers) is read and opened on its own.
The per-layer checksums stay the plaintext's (the stored bytes before sealing),
checked after opening. Plain blocks are unchanged (version 1).

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

import enum
import struct
from dataclasses import dataclass
from typing import Any

import lz4.block
import numpy as np
import torch
import xxhash

from kvstore.codecs import CODECS, LayerCodec, codec_numbered, plugin_codec
from kvstore.copies import engine_for
from kvstore.errors import (
    ConfigError,
    CorruptBlockError,
    DecryptError,
    InvalidInputError,
    LayoutMismatchError,
)
from kvstore.layout import KVLayout

__all__ = [
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

MAGIC = b"KVSB"
VERSION = 1
#: The format version of encrypted blocks (the key id and nonce follow the layer table).
SEALED_VERSION = 2
FLAG_SEALED = 1
KEY_ID_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_SEALED = struct.Struct(f"<{KEY_ID_BYTES}s{NONCE_BYTES}s")
HEADER_ALIGN = 64
_FIXED = struct.Struct("<4sHBBI8s16sQQ")
_LAYER = struct.Struct("<IQ")
_CHECK = struct.Struct("<Q")
_MAX_LAYERS = 4096


class Codec(enum.IntEnum):
    """How a block's payload is stored."""

    RAW = 0
    LZ4 = 1
    SHUFFLE_LZ4 = 2

    @classmethod
    def parse(cls, name: str | int | Codec) -> Codec:
        """Codec from its name ("raw", "lz4", "shuffle-lz4") or number."""
        if isinstance(name, Codec):
            return name
        if isinstance(name, int) and not isinstance(name, bool):
            try:
                return cls(name)
            except ValueError:
                raise InvalidInputError(f"unknown codec number {name}") from None
        if not isinstance(name, str):
            raise InvalidInputError(f"codec must be a name or number, got {name!r}")
        key = name.lower().replace("-", "_").replace("+", "_")
        aliases = {"none": "raw", "shuffle_lz4": "shuffle_lz4", "shuffle": "shuffle_lz4"}
        key = aliases.get(key, key)
        try:
            return cls[key.upper()]
        except KeyError:
            raise InvalidInputError(
                f"unknown codec {name!r}; use raw, lz4 or shuffle-lz4"
            ) from None


def header_size(num_layers: int, sealed: bool = False) -> int:
    """Bytes of the (padded) header of a block with ``num_layers`` layers (``sealed``:
    of an encrypted block)."""
    raw = _FIXED.size + _LAYER.size * num_layers + _CHECK.size + (_SEALED.size if sealed else 0)
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


@dataclass(frozen=True)
class BlockHeader:
    """A parsed, verified block header (``codec``: a :class:`Codec`, or a plug-in
    codec's number: :mod:`kvstore.codecs`)."""

    codec: int
    layout_fp: bytes
    key: bytes
    raw_nbytes: int
    payload_nbytes: int
    layer_nbytes: tuple[int, ...]
    layer_checksums: tuple[int, ...]
    #: Encrypted blocks: the id of the key that sealed it ("" for a plain block) ...
    key_id: str = ""
    #: ... and the block's nonce.
    nonce: bytes = b""

    @property
    def sealed(self) -> bool:
        """Whether the payload is encrypted (each stored layer: ciphertext, then tag)."""
        return bool(self.key_id)

    @property
    def num_layers(self) -> int:
        """Number of layers in the block."""
        return len(self.layer_nbytes)

    @property
    def header_nbytes(self) -> int:
        """Size of the encoded header, padding included."""
        return header_size(self.num_layers, self.sealed)

    @property
    def total_nbytes(self) -> int:
        """Header plus payload: the size of the whole encoded block."""
        return self.header_nbytes + self.payload_nbytes

    def layer_span(self, first: int, last: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of layers ``[first, last)`` within the payload."""
        if not 0 <= first < last <= self.num_layers:
            raise InvalidInputError(f"layer range [{first}, {last}) outside [0, {self.num_layers})")
        offset = sum(self.layer_nbytes[:first])
        return offset, sum(self.layer_nbytes[first:last])

    def pack(self) -> bytes:
        """Encode this header (with checksum and padding)."""
        fixed = _FIXED.pack(
            MAGIC,
            SEALED_VERSION if self.sealed else VERSION,
            int(self.codec),
            FLAG_SEALED if self.sealed else 0,
            self.num_layers,
            self.layout_fp,
            self.key,
            self.raw_nbytes,
            self.payload_nbytes,
        )
        table = b"".join(
            _LAYER.pack(n, c) for n, c in zip(self.layer_nbytes, self.layer_checksums, strict=True)
        )
        body = fixed + table
        if self.sealed:
            body += _SEALED.pack(self.key_id.encode("ascii"), self.nonce)
        body += _CHECK.pack(xxhash.xxh3_64_intdigest(body))
        return body + bytes(self.header_nbytes - len(body))


def parse_header(
    data: bytes | bytearray | memoryview, layout: KVLayout, key: bytes | None = None
) -> BlockHeader:
    """Parse and verify a header; check it belongs to ``layout`` (and ``key``).

    ``data`` must hold at least the header (``header_size(layout.num_layers)``
    bytes); extra bytes are ignored.
    """
    header = read_header(data)
    _check_header(header, layout, key)
    return header


def read_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse a header and verify it is whole (magic, version, checksum), whatever
    layout it was written for: what a block says about itself (its layout's
    fingerprint, layer count and size), for tools that find blocks of layouts they
    do not know (``kvstore stats``). :func:`parse_header` also checks the layout.
    """
    view = memoryview(data).cast("B")
    if len(view) < _FIXED.size:
        raise CorruptBlockError(f"block truncated: {len(view)} bytes is shorter than a header")
    magic, version, codec, flags, nlayers, layout_fp, bkey, raw_n, payload_n = _FIXED.unpack_from(
        view
    )
    if magic != MAGIC:
        raise CorruptBlockError(f"not a kvstore block (magic {bytes(magic)!r})")
    sealed = version == SEALED_VERSION and flags & FLAG_SEALED
    if version != VERSION and not sealed:
        raise CorruptBlockError(f"unsupported block format version {version}")
    if not 0 < nlayers <= _MAX_LAYERS:
        raise CorruptBlockError(f"implausible layer count {nlayers} in header")
    table_end = _FIXED.size + _LAYER.size * nlayers + (_SEALED.size if sealed else 0)
    if len(view) < table_end + _CHECK.size:
        if sealed:  # read as far as a plain header goes: a store without its key
            raise DecryptError("the block is encrypted; this store reads it without a key")
        raise CorruptBlockError("block truncated inside its header")
    (stored_check,) = _CHECK.unpack_from(view, table_end)
    if xxhash.xxh3_64_intdigest(view[:table_end]) != stored_check:
        raise CorruptBlockError("block header checksum mismatch")
    layers = [_LAYER.unpack_from(view, _FIXED.size + i * _LAYER.size) for i in range(nlayers)]
    key_id, nonce = "", b""
    if sealed:
        raw_id, nonce = _SEALED.unpack_from(view, _FIXED.size + _LAYER.size * nlayers)
        key_id = raw_id.rstrip(b"\0").decode("ascii", "replace") or "?"
    header = BlockHeader(
        codec=_codec_or_corrupt(codec),
        layout_fp=bytes(layout_fp),
        key=bytes(bkey),
        raw_nbytes=raw_n,
        payload_nbytes=payload_n,
        layer_nbytes=tuple(n for n, _ in layers),
        layer_checksums=tuple(c for _, c in layers),
        key_id=key_id,
        nonce=bytes(nonce),
    )
    return header


def _codec_or_corrupt(value: int) -> int:
    try:
        return Codec(value)
    except ValueError:
        if codec_numbered(value) is not None:
            return value
        raise CorruptBlockError(f"unknown codec {value} in header") from None


def codec_number(codec: str | int | Codec) -> int:
    """The number a block's header gives ``codec``: a built-in one's :class:`Codec`
    (see :meth:`Codec.parse`), or a registered plug-in codec's number
    (:mod:`kvstore.codecs`). Unknown: :class:`InvalidInputError`."""
    try:
        return Codec.parse(codec)
    except InvalidInputError:
        if isinstance(codec, bool) or not isinstance(codec, (str, int)):
            raise
        if isinstance(codec, str) and not CODECS.has(codec.lower()):
            raise
    if isinstance(codec, str):
        try:
            return plugin_codec(codec.lower()).number
        except ConfigError as exc:
            raise InvalidInputError(str(exc)) from None
    if codec_numbered(codec) is None:
        raise InvalidInputError(f"unknown codec number {codec}")
    return codec


def _check_header(header: BlockHeader, layout: KVLayout, key: bytes | None) -> None:
    if header.layout_fp != layout.fingerprint:
        raise LayoutMismatchError(
            f"block was written for layout {header.layout_fp.hex()}, "
            f"this store's layout is {layout.fingerprint_hex}"
        )
    if key is not None and header.key != bytes(key):
        raise CorruptBlockError(f"block holds key {header.key.hex()}, expected {bytes(key).hex()}")
    if (
        header.num_layers != layout.num_layers
        or header.raw_nbytes != layout.block_nbytes
        or sum(header.layer_nbytes) != header.payload_nbytes
    ):
        raise CorruptBlockError("block header sizes are inconsistent with its layout")
    tags = TAG_BYTES * header.num_layers if header.sealed else 0
    if header.codec == Codec.RAW and header.payload_nbytes != header.raw_nbytes + tags:
        raise CorruptBlockError("raw block payload size differs from the layout's block size")


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
    key: bytes, layout: KVLayout, block: torch.Tensor, codec: Codec | str | int = Codec.RAW
) -> EncodedBlock:
    """Encode one block (a tensor of ``layout.block_shape``) with ``codec``.

    For RAW the payload aliases ``block`` (no copy) when it is a CPU tensor
    that is contiguous per ``(layer, kv)`` -- including the engine's chunk
    views; keep ``block`` unchanged until the bytes are written.
    """
    if tuple(block.shape) != layout.block_shape or block.dtype != layout.dtype:
        raise LayoutMismatchError(
            f"block of shape {tuple(block.shape)} / {block.dtype} does not match layout "
            f"{layout.block_shape} / {layout.dtype}"
        )
    codec = codec_number(codec)
    step = layout.layer_nbytes
    pieces = layer_pieces(block) if codec == Codec.RAW else None
    if pieces is not None:  # no copy: the payload aliases the caller's tensor
        stored: list[memoryview] = [piece for layer in pieces for piece in layer]
        sizes = [step] * layout.num_layers
        sums = [checksum_pieces(layer) for layer in pieces]
    elif codec == Codec.RAW:
        data = _host_bytes(block)
        stored = [data.data]
        sizes = [step] * layout.num_layers
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
    offset = 0
    for i in range(first, last):
        n = header.layer_nbytes[i]
        decode_layer(header, i, view[offset : offset + n], layout, out[i - first])
        offset += n
    return out


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


#: The built-in codecs, as :data:`kvstore.codecs.CODECS` names them.
RAW_CODEC = LayerCodec(int(Codec.RAW), _raw_compress, _raw_decompress)
LZ4_CODEC = _builtin(Codec.LZ4)
SHUFFLE_LZ4_CODEC = _builtin(Codec.SHUFFLE_LZ4)
