"""The block header: how an encoded block describes itself, parsed and checked.

Apart from :mod:`kvstore.format.codec` (which encodes and decodes the payload) because
readers that only look at what a block says about itself (sizes, layout, key,
codec number, encryption) need the header and nothing of the payload transforms.

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

An encrypted block (:mod:`kvstore.format.sealing`, encryption at rest) has format
version 3 and flag bit 0 set; 44 more bytes follow the layer table, before
the header checksum::

    52+12L  32    key id (ASCII, zero-padded): which key of the keyring sealed it
    84+12L  12    the block's nonce (layer i is sealed under it with i folded in)

and each layer's stored bytes are its AES-256-GCM ciphertext followed by its
16-byte tag, so a layer (or a range of layers) is read and opened on its own.
The per-layer checksums stay the plaintext's (the stored bytes before sealing),
checked after opening. Plain blocks are unchanged (version 1).

A block in a lossy encoding (:mod:`kvstore.format.encodings`: ``fp8_e4m3``, ``int8``,
``int4``) has format version 4, plain or sealed (flag bit 0, the sealed fields as in
version 3): its codec byte names the encoding (3, 4, 5), the flags' high four bits
carry ``log2(group_size)`` (int4; 0 otherwise), ``raw payload bytes`` stays the
layout's block size and each layer's stored bytes are its encoded bytes (their
checksum is of those; sealed, of those before sealing). The header's size is that of
version 1 (3 when sealed). Blocks in encoding ``none`` are written as before (version
1 or 3), so readers from before version 4 read them; such a reader finds a version 4
block unsupported: a miss.

Version 2 was the first encrypted format: the same header, but its layers'
associated data did not bind the store's namespace. Such a block is still
parsed (``sealed_version`` 2) and :class:`DecryptError` when a cipher checks
it: a counted miss, never data (a later put of its key overwrites it). An
encrypted block found under another key than the one it names is a
:class:`DecryptError` too (moved or copied there), not rot.

A failure to parse or verify raises :class:`CorruptBlockError` (or
:class:`LayoutMismatchError` for a whole, valid header of another layout).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from kvstore.errors import (
    ConfigError,
    CorruptBlockError,
    DecryptError,
    InvalidInputError,
    LayoutMismatchError,
)
from kvstore.format.codecs import CODECS, codec_numbered, plugin_codec
from kvstore.format.encodings import BlockEncoding
from kvstore.layout import KVLayout

__all__ = [
    "FLAG_SEALED",
    "HEADER_ALIGN",
    "KEY_ID_BYTES",
    "MAGIC",
    "NONCE_BYTES",
    "SEALED_VERSION",
    "SEALED_VERSIONS",
    "TAG_BYTES",
    "VERSION",
    "ENCODED_VERSION",
    "BlockHeader",
    "Codec",
    "codec_number",
    "header_size",
    "parse_header",
    "read_header",
]

MAGIC = b"KVSB"
VERSION = 1
#: The format version of encrypted blocks (the key id and nonce follow the layer table;
#: each layer's associated data binds the namespace: :mod:`kvstore.format.sealing`).
SEALED_VERSION = 3
#: The encrypted formats whose headers parse: 2 (no namespace in the associated data,
#: refused by the cipher) and the current one.
SEALED_VERSIONS = (2, SEALED_VERSION)
#: The format version of blocks in a lossy encoding (plain or sealed; see above).
ENCODED_VERSION = 4
FLAG_SEALED = 1
_GROUP_SHIFT = 4
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
    codec's number: :mod:`kvstore.format.codecs`)."""

    codec: int
    layout_fp: bytes
    key: bytes
    raw_nbytes: int
    payload_nbytes: int
    layer_nbytes: tuple[int, ...]
    layer_checksums: tuple[int, ...]
    #: Encrypted blocks: the id of the key that sealed it ("" for a plain block) ...
    key_id: str = ""
    #: ... the block's nonce ...
    nonce: bytes = b""
    #: ... and the format version it was sealed in (:data:`SEALED_VERSIONS`; a sealed
    #: block in an encoding binds what version 3 binds, and says 3 here).
    sealed_version: int = SEALED_VERSION
    #: int4's group size (0: no group; see :mod:`kvstore.format.encodings`).
    group_size: int = 0

    @property
    def encoding(self) -> BlockEncoding | None:
        """The lossy encoding of the stored layers (None: the layout's own bytes)."""
        if not _is_encoding(self.codec):
            return None
        log2 = self.group_size.bit_length() - 1 if self.group_size else 0
        return BlockEncoding.from_header(self.codec, log2)

    @property
    def version(self) -> int:
        """The format version this header is written in."""
        if _is_encoding(self.codec):
            return ENCODED_VERSION
        return self.sealed_version if self.sealed else VERSION

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
        encoding = self.encoding
        flags = FLAG_SEALED if self.sealed else 0
        if encoding is not None:
            flags |= encoding.group_log2 << _GROUP_SHIFT
        fixed = _FIXED.pack(
            MAGIC,
            self.version,
            int(self.codec),
            flags,
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
    sealed, encoded = _variant(version, flags)
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
    group_log2 = flags >> _GROUP_SHIFT if encoded else 0
    if encoded:  # the codec byte names an encoding: checked (CorruptBlockError) here
        BlockEncoding.from_header(codec, group_log2)
    return BlockHeader(
        codec=codec if encoded else _codec_or_corrupt(codec),
        layout_fp=bytes(layout_fp),
        key=bytes(bkey),
        raw_nbytes=raw_n,
        payload_nbytes=payload_n,
        layer_nbytes=tuple(n for n, _ in layers),
        layer_checksums=tuple(c for _, c in layers),
        key_id=key_id,
        nonce=bytes(nonce),
        sealed_version=version if sealed and not encoded else SEALED_VERSION,
        group_size=1 << group_log2 if group_log2 else 0,
    )


def _variant(version: int, flags: int) -> tuple[bool, bool]:
    """``(sealed, encoded)`` for a header's version and flags; CorruptBlockError for a
    version or flags this reader does not know."""
    encoded = version == ENCODED_VERSION
    sealed = bool((version in SEALED_VERSIONS or encoded) and flags & FLAG_SEALED)
    if version != VERSION and not sealed and not encoded:
        raise CorruptBlockError(f"unsupported block format version {version}")
    if flags & ~(FLAG_SEALED | (0xF << _GROUP_SHIFT) if encoded else FLAG_SEALED):
        raise CorruptBlockError(f"unknown flags {flags:#x} in a version {version} header")
    return sealed, encoded


def _is_encoding(codec: int) -> bool:
    """Whether a header's codec number is a lossy encoding's (3-5)."""
    return 3 <= codec <= 5


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
    (:mod:`kvstore.format.codecs`). Unknown: :class:`InvalidInputError`."""
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
        if header.sealed:  # a whole, sealed header under another name: moved, not rot
            raise DecryptError(
                f"encrypted block {header.key.hex()} is stored as {bytes(key).hex()} (moved "
                "or copied there); it is not opened"
            )
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
    encoding = header.encoding
    if encoding is not None:
        try:
            encoding.check(layout)
        except ConfigError as exc:
            raise CorruptBlockError(f"block encoding does not fit its layout: {exc}") from None
        each = encoding.layer_nbytes(layout) + (TAG_BYTES if header.sealed else 0)
        if any(n != each for n in header.layer_nbytes):
            raise CorruptBlockError(f"{encoding.name} block layers have the wrong size")
