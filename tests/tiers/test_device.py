"""Device tier: conformance on cpu (always) and on cuda (where present)."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import DeviceTierConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.testing.conformance import TierConformance
from kvstore.testing.data import small_layout
from kvstore.tiers.device import DeviceTier


class TestDeviceTierOnCPU(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DeviceTier:
        config = DeviceTierConfig(device="cpu", capacity=capacity_blocks * layout.block_nbytes)
        return DeviceTier(config, layout)


@pytest.mark.cuda
class TestDeviceTierOnCUDA(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DeviceTier:
        config = DeviceTierConfig(device="cuda:0", capacity=capacity_blocks * layout.block_nbytes)
        return DeviceTier(config, layout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_clear_config_error() -> None:
    layout = small_layout()
    with pytest.raises(ConfigError, match="CUDA is not available"):
        DeviceTier(DeviceTierConfig(device="cuda:0", capacity=layout.block_nbytes), layout)


def test_device_tier_memory_lives_on_its_device() -> None:
    layout = small_layout()
    tier = DeviceTier(DeviceTierConfig(device="cpu", capacity=2 * layout.block_nbytes), layout)
    assert tier.device == torch.device("cpu")
    tier.close()
