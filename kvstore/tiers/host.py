"""Host DRAM tier: one slab of (pinned, when CUDA exists) host memory."""

from __future__ import annotations

from kvstore.config import HostTierConfig, TierConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.runtime import cuda_available
from kvstore.tiers.slab import SlabTier

__all__ = ["HostTier"]


class HostTier(SlabTier):
    """Blocks in host memory. Pinned (page-locked) when ``pinned`` is true or,
    with ``pinned: null`` (the default), when a CUDA device exists, so copies
    to and from the GPU run at full PCIe speed without a bounce buffer.

    Memory that is not pinned is faulted in on a background thread from open
    (``prefault: true``, the default): see :class:`~kvstore.runtime.memory.SlabAllocator`."""

    kind = "host"

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        if not isinstance(config, HostTierConfig):
            raise ConfigError(f"host tier needs a HostTierConfig, got {type(config).__name__}")
        if config.shared_memory:
            pinned = False
        else:
            pinned = cuda_available() if config.pinned is None else config.pinned
        if pinned and not cuda_available():
            raise ConfigError("host tier: pinned: true needs a CUDA device; use pinned: null")
        super().__init__(
            config, layout, "cpu", pinned, shared=config.shared_memory, prefault=config.prefault
        )
