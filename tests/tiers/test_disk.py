"""Disk tier: conformance, persistence, atomicity, verification and faults on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.config import DiskTierConfig
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers.disk import DiskTier


def disk_tier(path: Path, layout: KVLayout, blocks: int = 16, **extra: object) -> DiskTier:
    probe = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 30), layout)
    file_nbytes = probe._file_nbytes
    probe.close()
    config = DiskTierConfig(path=str(path), capacity=blocks * file_nbytes, **extra)  # type: ignore[arg-type]
    return DiskTier(config, layout)


class TestDiskTier(TierConformance):
    bounded = False  # files have no slots: the manager enforces capacity

    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path: Path) -> None:
        self.path = tmp_path / "disk"

    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DiskTier:
        return disk_tier(self.path, layout, capacity_blocks)


class TestDiskTierCompressed(TestDiskTier):
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DiskTier:
        return disk_tier(self.path, layout, capacity_blocks, codec="shuffle-lz4")


class TestDiskTierODirect(TestDiskTier):
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DiskTier:
        return disk_tier(self.path, layout, capacity_blocks, o_direct=True, fsync=True)


def blocks_of(layout: KVLayout, n: int, seed: int = 0) -> list[torch.Tensor]:
    kv = random_blocks(layout, n, seed)
    step = layout.block_tokens
    return [kv[:, :, i * step : (i + 1) * step] for i in range(n)]


def test_capacity_counts_whole_files(tmp_path: Path) -> None:
    layout = small_layout()
    tier = disk_tier(tmp_path, layout, 5)
    assert tier.capacity_blocks == 5
    tier.close()
    with pytest.raises(ConfigError, match="smaller than one block"):
        DiskTier(DiskTierConfig(path=str(tmp_path), capacity=100), layout)


def test_blocks_survive_a_new_tier_on_the_same_directory(tmp_path: Path) -> None:
    layout = small_layout()
    keys, blocks = make_keys(6), blocks_of(layout, 6)
    first = disk_tier(tmp_path, layout)
    assert all(first.put(keys, blocks))
    first.close()
    second = disk_tier(tmp_path, layout)
    assert sorted(second.stored_keys()) == sorted(keys)
    outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert all(second.get(keys, outs))
    for out, block in zip(outs, blocks, strict=True):
        assert torch.equal(out, block)
    second.close()


def test_other_layouts_in_the_same_directory_are_ignored(tmp_path: Path) -> None:
    layout, other = small_layout(), small_layout(head_dim=32)
    keys = make_keys(3)
    mine = disk_tier(tmp_path, layout)
    mine.put(keys, blocks_of(layout, 3))
    theirs = disk_tier(tmp_path, other)
    assert list(theirs.stored_keys()) == []
    assert (
        theirs.get(keys, [torch.empty(other.block_shape, dtype=other.dtype) for _ in keys])
        == [False] * 3
    )
    mine.close()
    theirs.close()
