"""What the tiers outside process memory share: counters, argument checks, value encoding.

Public helpers for tier implementations: the S3 and Redis tiers
(:mod:`kvstore.tiers.s3`, :mod:`kvstore.tiers.redis`), the ``remote`` tier
(:mod:`kvstore.client.tier`) and the cluster tier (:mod:`kvstore.cluster.tier`).

- :class:`Counters`, :class:`BufferPool`: thread-safe counters and reused buffers;
- :func:`check_put_args`, :func:`check_get_args`: bad input raises before any I/O;
- :func:`encode_value`, :func:`decode_value`, :func:`decode_span`, :func:`pack_into`:
  a block stored as one value in the self-describing format of :mod:`kvstore.format.codec`
  (header with per-layer checksums, then the payload), verified on every read;
- :func:`key_from_hex`: a key back from the hex of an object or entry name;
- :class:`ValueTier`: the base of a tier that keeps each block as one such value (S3,
  Redis): its capacity, header size (sealed or not), counters, closed state and stats.

Nothing here imports a client library.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.config import TierConfig
from kvstore.errors import ClosedError, CorruptBlockError, InvalidInputError, LayoutMismatchError
from kvstore.format import (
    BlockEncoding,
    BlockHeader,
    EncodedBlock,
    choose_codec,
    codec_number,
    decode_into,
    encode_block,
    header_size,
    parse_header,
)
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.layout import KVLayout
from kvstore.runtime import Breaker
from kvstore.tiers.base import LayerRange, Tier

if TYPE_CHECKING:
    from kvstore.format import BlockCipher

__all__ = [
    "Breaker",
    "BufferPool",
    "Counters",
    "ValueTier",
    "check_get_args",
    "check_put_args",
    "decode_layers",
    "decode_span",
    "decode_value",
    "encode_value",
    "key_from_hex",
    "pack_into",
    "value_header_size",
]


class Counters:
    """Named integer counters, safe to bump from many threads."""

    def __init__(self, names: Iterable[str]) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        """The current value of ``name``."""
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter."""
        with self._lock:
            return dict(self._values)


class BufferPool:
    """Reusable byte buffers for encoded values, bounded to ``max_bytes`` kept idle.

    Why: a fresh multi-MiB buffer page-faults on first touch. Joining an 8 MiB
    block into new ``bytes`` ran at ~1.2 GB/s on the bench machine, several
    times slower than copying it into memory already touched, and that alone
    cost a third of the Redis tier's put throughput.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._idle: list[bytearray] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, exact: bool = False) -> bytearray:
        """A buffer of at least ``nbytes`` (at most twice that; exactly that if ``exact``)."""
        most = nbytes if exact else 2 * nbytes
        with self._lock:
            for i, buf in enumerate(self._idle):
                if nbytes <= len(buf) <= most:
                    self._idle_bytes -= len(buf)
                    return self._idle.pop(i)
        return bytearray(nbytes)

    def give(self, bufs: Iterable[bytearray]) -> None:
        """Return buffers nobody reads any more; those past ``max_bytes`` are dropped."""
        with self._lock:
            for buf in bufs:
                if self._idle_bytes + len(buf) <= self._max:
                    self._idle.append(buf)
                    self._idle_bytes += len(buf)


def pack_into(block: EncodedBlock, buf: bytearray) -> memoryview:
    """Copy ``block`` (header, then payload) into ``buf``; the view of the bytes written."""
    view = memoryview(buf)
    offset = 0
    for part in block.parts():
        flat = part.cast("B") if part.format != "B" or part.ndim != 1 else part
        view[offset : offset + flat.nbytes] = flat
        offset += flat.nbytes
    return view[:offset]


def encode_value(
    key: BlockKey,
    layout: KVLayout,
    block: torch.Tensor,
    codec: str,
    encoding: BlockEncoding | None = None,
) -> EncodedBlock:
    """Encode ``block`` for a remote store with the tier's ``codec`` setting, or in its
    lossy ``encoding`` (which replaces the codec).

    ``"auto"`` asks :func:`~kvstore.format.codec.choose_codec` per block (it keeps
    byte-shuffled lz4 only where it saves at least 10%).
    """
    if encoding is not None:
        return encode_block(key, layout, block, encoding=encoding)
    chosen = choose_codec(block, layout) if codec == "auto" else codec_number(codec)
    return encode_block(key, layout, block, chosen)


def value_header_size(layout: KVLayout) -> int:
    """Bytes of the header of every block of ``layout`` (known before any read)."""
    return header_size(layout.num_layers)


def decode_value(
    data: bytes | bytearray | memoryview,
    layout: KVLayout,
    key: BlockKey,
    out: torch.Tensor,
    layers: LayerRange = None,
    cipher: BlockCipher | None = None,
) -> None:
    """Verify a whole stored value and copy it (or its ``layers``) into ``out``
    (``cipher``: the tier encrypts; the value is opened with it).

    Raises :class:`CorruptBlockError` (or ``LayoutMismatchError`` for a valid
    block of another layout; ``DecryptError`` for one that cannot be opened);
    ``out`` may be partly written when it raises.
    """
    header = parse_header(data, layout, key)
    body = memoryview(data).cast("B")[header.header_nbytes :]
    if len(body) != header.payload_nbytes:
        raise CorruptBlockError(
            f"block has {len(body)} payload bytes, its header says {header.payload_nbytes}"
        )
    decode_span(header, body, layout, out, layers, cipher)


def decode_span(
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    layout: KVLayout,
    out: torch.Tensor,
    layers: LayerRange,
    cipher: BlockCipher | None = None,
) -> None:
    """Verify and decode ``layers`` from a whole ``payload`` into ``out``."""
    view = memoryview(payload).cast("B")
    if layers is not None:
        offset, nbytes = header.layer_span(*layers)
        view = view[offset : offset + nbytes]
    decode_layers(header, view, layout, out, layers, cipher)


def decode_layers(
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    layout: KVLayout,
    out: torch.Tensor,
    layers: LayerRange,
    cipher: BlockCipher | None,
) -> None:
    """:func:`~kvstore.format.codec.decode_into` for a tier that may encrypt: ``payload``
    holds exactly ``layers``' stored bytes; a sealed one is opened with ``cipher``
    (:class:`DecryptError` without one, or for a plain block with one)."""
    if cipher is None:
        decode_into(header, payload, layout, out, layers)
        return
    from kvstore.format import open_into  # imports cryptography: only where a tier encrypts

    open_into(header, payload, layout, out, layers, cipher)


def check_put_args(
    layout: KVLayout, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]
) -> None:
    """Raise for a put that could only fail (before any I/O): bad input is an error, not a miss."""
    if len(keys) != len(blocks):
        raise InvalidInputError(f"{len(keys)} keys but {len(blocks)} blocks")
    for block in blocks:
        if tuple(block.shape) != layout.block_shape or block.dtype != layout.dtype:
            raise LayoutMismatchError(
                f"block of shape {tuple(block.shape)} / {block.dtype} does not match layout "
                f"{layout.block_shape} / {layout.dtype}"
            )


def check_get_args(
    layout: KVLayout, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange
) -> LayerRange:
    """Raise :class:`InvalidInputError` for a get that could only fail (before any I/O);
    else the layers to read: ``layers``, or None when they are every layer (a tier then
    reads whole values, as for ``layers=None``)."""
    if len(keys) != len(outs):
        raise InvalidInputError(f"{len(keys)} keys but {len(outs)} output tensors")
    if layers is None or tuple(layers) == (0, layout.num_layers):
        return None
    if not 0 <= layers[0] < layers[1] <= layout.num_layers:
        raise InvalidInputError(
            f"layer range {tuple(layers)} outside [0, {layout.num_layers}) or empty"
        )
    return layers


def key_from_hex(text: str) -> BlockKey | None:
    """The key spelled by ``text`` (32 hex digits), or None for anything else."""
    if len(text) != 2 * KEY_BYTES:
        return None
    try:
        return BlockKey(bytes.fromhex(text))
    except ValueError:
        return None


class ValueTier(Tier):
    """The part of a tier keeping each block as one value outside this process that is
    the same for every such tier (the S3 and Redis tiers): its capacity in blocks, the
    size of a value's header (larger once values are sealed), its counters
    (``counter_names``), the closed state and the stats all of them report."""

    #: What every such tier counts (a tier adds its own).
    counter_names: tuple[str, ...] = (
        "requests",
        "retries",
        "errors",
        "skipped_unavailable",
        "outages",
        "reconnects",
        "corrupt",
        "decrypt_failures",
        "misses",
        "blocks_put",
        "blocks_got",
        "bytes_out",
        "bytes_in",
    )

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self._capacity = self.blocks_in(config.capacity)
        self._header_nbytes = value_header_size(layout)
        self._counters = Counters(self.counter_names)
        self._closed = False

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    def encrypt_with(self, cipher: Any) -> None:
        """Seal values with ``cipher`` (encryption at rest, :mod:`kvstore.format.sealing`)."""
        self.cipher = cipher
        self._header_nbytes = header_size(self.layout.num_layers, sealed=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.kind} tier is closed")

    def _value_stats(self, codec: str, **fields: Any) -> dict[str, Any]:
        """The counters, then ``fields``, the ``codec`` setting and the cipher's stats."""
        cipher = self.cipher.stats() if self.cipher is not None else {}
        return {**self._counters.snapshot(), **fields, "codec": codec, **cipher}
