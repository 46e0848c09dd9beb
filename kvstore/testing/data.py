"""Deterministic KV data for tests, demos and benchmarks."""

from __future__ import annotations

import torch

from kvstore.layout import KVLayout

__all__ = ["host_config", "random_blocks", "small_layout"]


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


def host_config(layout: KVLayout, blocks: int, **extra: object) -> dict[str, object]:
    """A config dict with one host tier holding exactly ``blocks`` blocks of ``layout``."""
    return {"tiers": [{"kind": "host", "capacity": blocks * layout.block_nbytes, **extra}]}
