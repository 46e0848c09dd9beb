"""Deterministic KV data for tests, demos and benchmarks."""

from __future__ import annotations

import torch

from kvstore.layout import KVLayout

__all__ = ["block_list", "empty_blocks", "host_config", "random_blocks", "small_layout"]


def small_layout(**overrides: object) -> KVLayout:
    """A tiny layout (a few KiB per block) for fast tests."""
    fields: dict[str, object] = {
        "num_layers": 3,
        "num_kv_heads": 2,
        "head_dim": 16,
        "block_tokens": 8,
        "dtype": torch.bfloat16,
    }
    fields.update(overrides)
    return KVLayout(**fields)  # type: ignore[arg-type]


def random_blocks(layout: KVLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """KV for ``num_blocks`` chunks (``layout.tensor_shape``), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    shape = layout.tensor_shape(num_blocks)
    if layout.dtype.is_floating_point and layout.itemsize >= 2:
        return torch.randn(shape, generator=gen).to(layout.dtype)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * layout.itemsize), generator=gen)
    return raw.to(torch.uint8).view(layout.dtype)


def block_list(layout: KVLayout, n: int, seed: int = 0) -> list[torch.Tensor]:
    """:func:`random_blocks` cut into ``n`` contiguous blocks (``layout.block_shape``), as a
    tier's ``put`` takes them."""
    kv = random_blocks(layout, n, seed)
    step = layout.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def empty_blocks(
    layout: KVLayout, n: int = 1, layers: tuple[int, int] | None = None
) -> list[torch.Tensor]:
    """``n`` zeroed blocks to read into: whole, or only ``layers`` (first, end)."""
    first, last = layers or (0, layout.num_layers)
    shape = (last - first, *layout.block_shape[1:])
    return [torch.zeros(shape, dtype=layout.dtype) for _ in range(n)]


def host_config(layout: KVLayout, blocks: int, **extra: object) -> dict[str, object]:
    """A config dict with one host tier holding exactly ``blocks`` blocks of ``layout``."""
    return {"tiers": [{"kind": "host", "capacity": blocks * layout.block_nbytes, **extra}]}
