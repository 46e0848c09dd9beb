"""Device memory tier: one slab on a torch device (``cuda:N``; ``cpu`` in tests)."""

from __future__ import annotations

import torch

from kvstore.config import DeviceTierConfig, TierConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.tiers.slab import SlabTier

__all__ = ["DeviceTier"]


class DeviceTier(SlabTier):
    """Blocks in accelerator memory, the fastest tier when an engine runs on a GPU."""

    kind = "device"

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        if not isinstance(config, DeviceTierConfig):
            raise ConfigError(f"device tier needs a DeviceTierConfig, got {type(config).__name__}")
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device tier: {config.device} requested but CUDA is not available")
        super().__init__(config, layout, device, pinned=False)
