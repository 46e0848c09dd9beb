"""Lossy block encodings: fewer bytes for the slow tiers (a tier's ``encoding:``).

A tier that asks for an encoding stores each layer of a block quantized; a read decodes
it on the CPU into the destination, in the layout's dtype. The lossless codecs
(:mod:`kvstore.format.codec`) keep every bit; these trade a bounded error for a half or
a third of the bytes, which is what a 20 MB/s bucket or a network tier is short of.

- ``none``: the layout's bytes (the block format as before).
- ``fp8_e4m3``: each (k/v, token, head) row of ``head_dim`` values scaled by its own
  float32 scale (its largest magnitude over 448) and stored as float8 e4m3.
- ``int8``: the same rows, scaled to +-127 and rounded (symmetric, float32 scales).
- ``int4``: KIVI's scheme: keys quantized per channel (each (head, dim) channel in
  groups of ``group_size`` tokens), values per token (each (token, head) row in groups of
  ``group_size`` dims); asymmetric (a group's minimum and step, bfloat16), 4 bits a value,
  two a byte. A latent (MLA, ``kv_factor`` 1) cache is quantized per channel, like keys.

One encoded layer, as stored (the block format's per-layer checksum covers these bytes;
encryption at rest seals them)::

    fp8_e4m3 / int8:  scales (float32, kv*tokens*heads) | values (1 byte each)
    int4, per plane (k, then v):  minimums (bfloat16, groups) | steps (bfloat16,
                                  groups) | values (two 4-bit values a byte, low first)

A block in an encoding has format version 4 (:mod:`kvstore.format.header`); its codec
byte names the encoding (:class:`Encoding`, numbers 3-5 of kvstore's own 0-15) and the
header's flags byte carries ``log2(group_size)`` in its high four bits.

Speed: the kernels (:mod:`kvstore.format.quant`) are torch and numpy operations on one
layer at a time (temporaries of a layer, never of a block);
``benchmarks/bench_encodings.py`` measures them against a memcpy. Non-finite inputs do
not survive encoding (a row or group holding one decodes as NaN).
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError, CorruptBlockError

if TYPE_CHECKING:  # the kernels (kvstore.format.quant) need torch; naming one needs none
    import numpy as np
    import torch

    from kvstore.layout import KVLayout

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "ENCODING_NAMES",
    "BlockEncoding",
    "Encoding",
    "decode_seconds_per_byte",
    "check_group_size",
    "encoding_names",
]

#: int4's group: tokens a key channel's group spans, dims a value row's does.
DEFAULT_GROUP_SIZE = 32
#: Group sizes the header can say (log2 in four bits).
_MAX_LOG2_GROUP = 15


class Encoding(enum.IntEnum):
    """An encoding, by the codec number a block's header gives it (0: none)."""

    NONE = 0
    FP8_E4M3 = 3
    INT8 = 4
    INT4 = 5


#: What a tier's ``encoding:`` may say, in the order the docs list them.
ENCODING_NAMES: dict[str, Encoding] = {
    "none": Encoding.NONE,
    "fp8_e4m3": Encoding.FP8_E4M3,
    "int8": Encoding.INT8,
    "int4": Encoding.INT4,
}


def encoding_names() -> tuple[str, ...]:
    """The names a tier's ``encoding:`` may take."""
    return tuple(ENCODING_NAMES)


def check_group_size(group_size: int) -> None:
    """:class:`ConfigError` unless ``group_size`` is a power of two in 2..32768."""
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 2
        or group_size & (group_size - 1)
        or group_size.bit_length() - 1 > _MAX_LOG2_GROUP
    ):
        raise ConfigError(
            f"group_size: must be a power of two from 2 to {1 << _MAX_LOG2_GROUP}, "
            f"got {group_size!r}"
        )


@dataclass(frozen=True)
class BlockEncoding:
    """One encoding with its parameters: ``kind``, and ``group_size`` (int4 only; 0 for
    the others). :meth:`parse` makes one from a tier's settings."""

    kind: Encoding
    group_size: int = 0

    @classmethod
    def parse(cls, name: str, group_size: int = DEFAULT_GROUP_SIZE) -> BlockEncoding | None:
        """The encoding a tier's ``encoding:`` / ``group_size:`` name (None for ``none``);
        :class:`ConfigError` naming the choices for an unknown one."""
        kind = ENCODING_NAMES.get(str(name).lower())
        if kind is None:
            raise ConfigError(
                f"unknown encoding {name!r}; use one of {', '.join(encoding_names())}"
            )
        if kind == Encoding.NONE:
            return None
        if kind != Encoding.INT4:
            return cls(kind)
        check_group_size(group_size)
        return cls(kind, group_size)

    @classmethod
    def from_header(cls, number: int, group_log2: int) -> BlockEncoding:
        """The encoding a version-4 header names; :class:`CorruptBlockError` otherwise."""
        try:
            kind = Encoding(number)
        except ValueError:
            raise CorruptBlockError(f"unknown encoding {number} in header") from None
        if kind == Encoding.NONE:
            raise CorruptBlockError("a version 4 header names no encoding")
        if kind != Encoding.INT4:
            if group_log2:
                raise CorruptBlockError(f"encoding {kind.name.lower()} with a group size")
            return cls(kind)
        if group_log2 == 0:
            raise CorruptBlockError("int4 block without a group size")
        return cls(kind, 1 << group_log2)

    @property
    def name(self) -> str:
        """The encoding's name (``fp8_e4m3``, ``int8``, ``int4``)."""
        return self.kind.name.lower()

    @property
    def group_log2(self) -> int:
        """``log2(group_size)`` as the header's flags carry it (0 without a group)."""
        return self.group_size.bit_length() - 1 if self.group_size else 0

    def check(self, layout: KVLayout) -> None:
        """:class:`ConfigError` unless blocks of ``layout`` can be stored this way."""
        if layout.itemsize < 2:
            raise ConfigError(
                f"encoding {self.name}: the layout's dtype {layout.dtype} is 8-bit already"
            )
        if self.kind != Encoding.INT4:
            return
        g = self.group_size
        if layout.block_tokens % g:
            raise ConfigError(
                f"encoding int4: group_size {g} does not divide block_tokens "
                f"{layout.block_tokens} (keys are grouped along tokens)"
            )
        if layout.head_dim % 2 or (layout.kv_factor == 2 and layout.head_dim % g):
            raise ConfigError(
                f"encoding int4: group_size {g} does not divide head_dim {layout.head_dim} "
                "(values are grouped along dims; head_dim must be even)"
            )

    def layer_nbytes(self, layout: KVLayout) -> int:
        """Stored bytes of one encoded layer of ``layout``."""
        rows = layout.kv_factor * layout.block_tokens * layout.num_kv_heads
        values = rows * layout.head_dim
        if self.kind != Encoding.INT4:
            return 4 * rows + values
        return sum(4 * n + values // layout.kv_factor // 2 for n in _int4_groups(self, layout))

    def encode_layer(self, layer: torch.Tensor, dst: np.ndarray) -> None:
        """Encode one layer (``(kv, tokens, heads, dim)``, any strides, on the CPU) into
        ``dst`` (uint8, :meth:`layer_nbytes` long)."""
        from kvstore.format import quant

        if self.kind == Encoding.INT4:
            quant.encode_int4(self.group_size, layer, dst)
        else:
            quant.encode_rows(self.kind == Encoding.FP8_E4M3, layer, dst)

    def decode_layer(self, stored: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        """Decode one encoded layer (``stored``, verified already) into ``out`` (one
        layer's shape in the layout's dtype, any strides, any device)."""
        if len(stored) != self.layer_nbytes(layout):
            raise CorruptBlockError(f"an {self.name} layer has {len(stored)} bytes")
        from kvstore.format import quant

        if self.kind == Encoding.INT4:
            quant.decode_int4(self.group_size, stored, out)
        else:
            quant.decode_rows(self.kind == Encoding.FP8_E4M3, stored, out)


def _int4_groups(encoding: BlockEncoding, layout: KVLayout) -> list[int]:
    """Groups of each plane: keys (or a latent) per channel, values per token."""
    t, h, d, g = layout.block_tokens, layout.num_kv_heads, layout.head_dim, encoding.group_size
    planes = [t // g * h * d]
    if layout.kv_factor == 2:
        planes.append(t * h * (d // g))
    return planes


# -- pricing -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def decode_seconds_per_byte(encoding: BlockEncoding, layout: KVLayout) -> float:
    """Seconds this machine takes to decode one byte (of the layout's) of ``encoding``,
    measured now on random values of one layer (the fastest of five decodes; cached per
    encoding and layout): what a read from an encoded tier adds to its bytes' time."""
    import numpy as np
    import torch

    encoding.check(layout)
    gen = torch.Generator().manual_seed(0)
    layer = torch.randn(layout.block_shape[1:], generator=gen).to(layout.dtype)
    stored = np.empty(encoding.layer_nbytes(layout), dtype=np.uint8)
    encoding.encode_layer(layer, stored)
    view = stored.data  # a memoryview of the encoded layer
    encoding.decode_layer(view, layout, layer)  # untimed: first calls warm torch's kernels
    took = []
    for _ in range(5):
        start = time.perf_counter()
        encoding.decode_layer(view, layout, layer)
        took.append(time.perf_counter() - start)
    return min(took) / layout.layer_nbytes
