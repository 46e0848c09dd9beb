"""The kernels of the lossy encodings (:mod:`kvstore.format.encodings` says the format):
one layer at a time, on the CPU, with torch and numpy; temporaries are a layer's, never
a block's. Decoding writes the caller's tensor (``out.copy_``: its dtype, its strides,
its device)."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.errors import CorruptBlockError

__all__ = [
    "decode_int4",
    "decode_rows",
    "encode_int4",
    "encode_rows",
    "fp8_as_half",
    "write",
]

_FP8_MAX = 448.0
_INT8_MAX = 127.0
_INT4_MAX = 15.0
#: A row of zeros still gets a finite, nonzero scale (its values divide to zero).
_TINY = 2.0**-126


# -- fp8 / int8: a float32 scale per (kv, token, head) row -----------------------------------
def encode_rows(fp8: bool, layer: torch.Tensor, dst: np.ndarray) -> None:
    """Encode one layer (``(kv, tokens, heads, dim)``) as fp8 (``fp8``) or int8 rows, a
    float32 scale each, into ``dst``."""
    x = layer.to(torch.float32, copy=True)  # the working copy (never the caller's layer)
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    top = _FP8_MAX if fp8 else _INT8_MAX
    scale = x.abs().amax(-1, keepdim=True).div_(top).clamp_min_(_TINY)
    x.div_(scale)
    torch.from_numpy(dst[: 4 * rows]).view(torch.float32).copy_(scale.reshape(-1))
    values = torch.from_numpy(dst[4 * rows :]).view(x.shape)
    if fp8:
        # |x| <= 448 but for the division's rounding, which e4m3 rounds back to 448: no
        # clamping pass (an e4m3 of 464 or more would be NaN)
        values.view(torch.float8_e4m3fn).copy_(x)
    else:
        values.view(torch.int8).copy_(x.round_())  # |x| <= 127.00001: rounds to 127


def fp8_as_half(q: np.ndarray) -> np.ndarray:
    """float8 e4m3 bytes as float16 values 2**-8 times theirs: the exponent (bias 7)
    and mantissa moved into a half's places (bias 15), exact for every finite e4m3
    value, subnormals included (torch's own float8 conversion runs ~0.2 GB/s here)."""
    half = q.astype(np.uint16)
    sign = half & 0x80
    half &= 0x7F
    half <<= 7
    sign <<= 8
    half |= sign
    return half.view(np.float16)


def decode_rows(fp8: bool, stored: memoryview, out: torch.Tensor) -> None:
    """Decode one fp8 (``fp8``) or int8 layer's bytes into ``out`` (any dtype, strides)."""
    src = np.frombuffer(stored, dtype=np.uint8)
    kv, tokens, heads, dim = out.shape
    rows = kv * tokens * heads
    if len(src) != rows * (4 + dim):
        raise CorruptBlockError("encoded layer size does not match its layout")
    scale = torch.from_numpy(src[: 4 * rows].copy().view(np.float32)).view(kv, tokens, heads, 1)
    body = src[4 * rows :]
    if fp8:
        x = torch.from_numpy(fp8_as_half(body)).float()
        scale = scale * 256.0  # the halves are 2**-8 of the values
    else:
        x = torch.from_numpy(body.view(np.int8).astype(np.float32))
    x = x.view(kv, tokens, heads, dim).mul_(scale)
    write(out, x)


# -- int4 (KIVI): keys per channel, values per token --------------------------------------------
def _quantize_groups(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of ``x`` over axis ``dim``: (minimums, steps, codes); the
    minimum and step are rounded to bfloat16 first, so the codes are of what is stored."""
    low = x.amin(dim, keepdim=True).bfloat16()
    step = (x.amax(dim, keepdim=True) - low.float()).div_(_INT4_MAX).clamp_min_(_TINY).bfloat16()
    codes = (x - low.float()).div_(step.float()).round_().clamp_(0, _INT4_MAX)
    return low, step, codes


def encode_int4(group: int, layer: torch.Tensor, dst: np.ndarray) -> None:
    """Encode one layer in int4 (keys per channel, values per token) into ``dst``."""
    offset = 0
    for plane, x in enumerate(layer.float()):  # (tokens, heads, dim), float32
        tokens, heads, dim = x.shape
        if plane == 0:  # per channel: groups of ``group`` tokens
            low, step, codes = _quantize_groups(x.view(tokens // group, group, heads, dim), 1)
        else:  # per token: groups of ``group`` dims
            low, step, codes = _quantize_groups(x.view(tokens, heads, dim // group, group), 3)
        for meta in (low, step):
            n = 2 * meta.numel()
            torch.from_numpy(dst[offset : offset + n]).view(torch.bfloat16).copy_(meta.reshape(-1))
            offset += n
        pairs = codes.to(torch.uint8).view(tokens, heads, dim // 2, 2)
        n = tokens * heads * dim // 2
        packed = torch.from_numpy(dst[offset : offset + n]).view(tokens, heads, dim // 2)
        torch.bitwise_left_shift(pairs[..., 1], 4, out=packed)
        packed.bitwise_or_(pairs[..., 0])
        offset += n


def decode_int4(group: int, stored: memoryview, out: torch.Tensor) -> None:
    """Decode one int4 layer's bytes into ``out``."""
    src = np.frombuffer(stored, dtype=np.uint8)
    offset = 0
    for plane in range(out.shape[0]):
        tokens, heads, dim = out.shape[1:]
        if plane == 0:
            shape = (tokens // group, group, heads, dim)
            meta_shape = (tokens // group, 1, heads, dim)
        else:
            shape = (tokens, heads, dim // group, group)
            meta_shape = (tokens, heads, dim // group, 1)
        n_meta = 2 * int(np.prod(meta_shape))
        low = _bf16(src[offset : offset + n_meta]).view(meta_shape)
        step = _bf16(src[offset + n_meta : offset + 2 * n_meta]).view(meta_shape)
        offset += 2 * n_meta
        n = tokens * heads * dim // 2
        packed = torch.from_numpy(src[offset : offset + n].copy()).view(tokens, heads, dim // 2)
        offset += n
        codes = torch.empty((tokens, heads, dim // 2, 2), dtype=torch.uint8)
        torch.bitwise_and(packed, 15, out=codes[..., 0])
        torch.bitwise_right_shift(packed, 4, out=codes[..., 1])
        x = codes.view(shape).float().mul_(step).add_(low)
        write(out[plane], x.view(tokens, heads, dim))


def write(out: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` (float32, on the CPU) into ``out``: converted to its dtype on the CPU
    first where ``out`` is on an accelerator, so the link carries the layout's bytes."""
    if out.device.type != "cpu":
        values = values.to(out.dtype)
    out.copy_(values)


def _bf16(raw: np.ndarray) -> torch.Tensor:
    """bfloat16 bytes as float32 values (a bfloat16 is a float32's high half)."""
    wide = raw.view(np.uint16).astype(np.uint32)
    wide <<= 16
    return torch.from_numpy(wide.view(np.float32))
