"""KV layout: the geometry that fixes the bytes of one chunk of KV cache.

A *block* holds the KV of ``block_tokens`` consecutive tokens for every layer.
The store keeps a block as one contiguous run of bytes ordered
``(layer, kv, token, head, dim)``, so layer ``l`` of a block is the contiguous
byte range :meth:`KVLayout.layer_range` -- a block can move whole or one
layer at a time.

Tensors handed to the store use :meth:`KVLayout.tensor_shape`:
``(num_layers, kv_factor, n * block_tokens, num_kv_heads, head_dim)``. The
``kv_factor`` is 2 for separate K and V, 1 for MLA-style latent caches.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import xxhash

from kvstore.errors import InvalidInputError, LayoutMismatchError

__all__ = ["KVLayout", "parse_dtype"]

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype named by ``value`` ("bfloat16", "fp8", ...)."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES.values():
            raise InvalidInputError(f"dtype {value} is not supported for KV blocks")
        return value
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    allowed = ", ".join(sorted(_DTYPE_NAMES))
    raise InvalidInputError(f"unknown dtype {value!r}; expected one of: {allowed}")


_ORDER = "layer,kv,token,head,dim"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of the KV cache of one model (per tensor-parallel rank).

    Args:
        num_layers: attention layers whose KV is stored.
        num_kv_heads: KV heads held by this rank.
        head_dim: size of one head (for MLA, the latent width).
        block_tokens: tokens per chunk; a key is made per full chunk.
        dtype: element type of the cache (torch dtype or its name).
        kv_factor: 2 for K and V, 1 for a single latent (MLA) cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int = 256
    dtype: torch.dtype = field(default=torch.bfloat16)
    kv_factor: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"KVLayout.{name} must be a positive int, got {value!r}")
            if value >= 2**32:  # the fingerprint packs each as a u32
                raise InvalidInputError(f"KVLayout.{name} must be below 2**32, got {value}")
        if type(self.kv_factor) is not int or self.kv_factor not in (1, 2):
            raise InvalidInputError(f"KVLayout.kv_factor must be 1 or 2, got {self.kv_factor!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    # -- shapes and sizes -------------------------------------------------
    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return int(self.dtype.itemsize)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(layers, kv_factor, block_tokens, heads, head_dim)``."""
        return (
            self.num_layers,
            self.kv_factor,
            self.block_tokens,
            self.num_kv_heads,
            self.head_dim,
        )

    def tensor_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of ``num_blocks`` consecutive blocks."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidInputError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        return (
            self.num_layers,
            self.kv_factor,
            num_blocks * self.block_tokens,
            self.num_kv_heads,
            self.head_dim,
        )

    @cached_property
    def layer_nbytes(self) -> int:
        """Bytes of one layer of one block."""
        return (
            self.kv_factor * self.block_tokens * self.num_kv_heads * self.head_dim * self.itemsize
        )

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one whole block (all layers)."""
        return self.num_layers * self.layer_nbytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of ``layer`` inside a block's bytes."""
        if not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer {layer} out of range [0, {self.num_layers})")
        return layer * self.layer_nbytes, self.layer_nbytes

    def tokens_to_blocks(self, num_tokens: int) -> int:
        """Number of *full* blocks in ``num_tokens`` tokens."""
        return num_tokens // self.block_tokens

    # -- identity ---------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """A plain, JSON-friendly description (also what the fingerprint covers)."""
        return {
            "num_layers": self.num_layers,
            "kv_factor": self.kv_factor,
            "block_tokens": self.block_tokens,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": _dtype_name(self.dtype),
            "order": _ORDER,
        }

    @classmethod
    def from_description(cls, desc: Any) -> KVLayout:
        """The layout :meth:`describe` described (e.g. read off a wire); InvalidInputError
        for anything else."""
        if not isinstance(desc, dict):
            raise InvalidInputError(f"a layout description is a mapping, got {type(desc).__name__}")
        fields = ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "dtype", "kv_factor")
        missing = [f for f in fields if f not in desc]
        if missing:
            raise InvalidInputError(f"layout description lacks {', '.join(missing)}")
        order = desc.get("order", _ORDER)
        if order != _ORDER:
            raise InvalidInputError(f"layout order {order!r} is not supported")
        if not isinstance(desc["dtype"], str):
            raise InvalidInputError(f"layout dtype must be a name, got {desc['dtype']!r}")
        return cls(**{f: desc[f] for f in fields})

    @cached_property
    def fingerprint(self) -> bytes:
        """8-byte xxh3-64 of the layout; stored in every key seed and block header."""
        desc = self.describe()
        packed = struct.pack(
            "<6I",
            desc["num_layers"],
            desc["kv_factor"],
            desc["block_tokens"],
            desc["num_kv_heads"],
            desc["head_dim"],
            self.itemsize,
        )
        tail = f"{desc['dtype']}|{desc['order']}".encode()
        return xxhash.xxh3_64_digest(b"kvstore.layout.v1|" + packed + tail)

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as 16 hex digits."""
        return self.fingerprint.hex()

    # -- validation -------------------------------------------------------
    def check_tensor(self, kv: Any, num_blocks: int, what: str = "kv") -> torch.Tensor:
        """Check ``kv`` is a tensor of ``tensor_shape(num_blocks)`` in this dtype.

        Raises :class:`InvalidInputError` (wrong type, shape or device) or
        :class:`LayoutMismatchError` (right rank, wrong dtype or geometry).
        """
        if not isinstance(kv, torch.Tensor):
            raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
        if kv.device.type not in ("cpu", "cuda"):
            raise InvalidInputError(
                f"{what} is on device {kv.device}; only cpu and cuda tensors can be stored"
            )
        expected = self.tensor_shape(num_blocks)
        if kv.dtype != self.dtype:
            got, want = _dtype_name(kv.dtype), _dtype_name(self.dtype)
            raise LayoutMismatchError(f"{what} has dtype {got}, layout expects {want}")
        if tuple(kv.shape) != expected:
            err = LayoutMismatchError if kv.dim() == len(expected) else InvalidInputError
            raise err(
                f"{what} has shape {tuple(kv.shape)}, expected {expected} "
                f"(layers, kv, {num_blocks} blocks x {self.block_tokens} tokens, heads, head_dim)"
            )
        return kv

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer of ``num_blocks`` blocks: ``tensor_shape(n)[1:]``."""
        return self.tensor_shape(num_blocks)[1:]

    def check_layer(self, kv_layer: Any, num_blocks: int, what: str = "kv_layer") -> torch.Tensor:
        """Check ``kv_layer`` is one layer of ``num_blocks`` blocks (:meth:`layer_shape`)."""
        if not isinstance(kv_layer, torch.Tensor):
            raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(kv_layer).__name__}")
        if kv_layer.device.type not in ("cpu", "cuda"):
            raise InvalidInputError(f"{what} is on device {kv_layer.device}; use cpu or cuda")
        if kv_layer.dtype != self.dtype:
            got, want = _dtype_name(kv_layer.dtype), _dtype_name(self.dtype)
            raise LayoutMismatchError(f"{what} has dtype {got}, layout expects {want}")
        expected = self.layer_shape(num_blocks)
        if tuple(kv_layer.shape) != expected:
            raise LayoutMismatchError(
                f"{what} has shape {tuple(kv_layer.shape)}, expected {expected} "
                f"(kv, {num_blocks} blocks x {self.block_tokens} tokens, heads, head_dim)"
            )
        return kv_layer

    def check_same(self, other: KVLayout) -> None:
        """Raise :class:`LayoutMismatchError` unless ``other`` equals this layout."""
        if other.fingerprint != self.fingerprint:
            raise LayoutMismatchError(
                f"layout mismatch: {other.describe()} is not the store's {self.describe()}"
            )
