"""Disk tier: conformance, persistence, atomicity, verification and faults on real files."""

from __future__ import annotations

import subprocess
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


# -- through KVStore -------------------------------------------------------------
def two_tier_config(path: Path, layout: KVLayout, host_blocks: int, disk_blocks: int) -> dict:
    probe = disk_tier(path, layout, 1)
    file_nbytes = probe._file_nbytes
    probe.close()
    return {
        "tiers": [
            {"kind": "host", "capacity": host_blocks * layout.block_nbytes},
            {"kind": "disk", "path": str(path), "capacity": disk_blocks * file_nbytes},
        ]
    }


def block_files(path: Path) -> list[Path]:
    return list(path.rglob("*.kvb"))


def test_overflow_and_eviction_flow_down_to_disk_and_back(tmp_path: Path) -> None:
    from kvstore import KVStore

    layout = small_layout()
    config = two_tier_config(tmp_path, layout, host_blocks=4, disk_blocks=10)
    store = KVStore(layout, config)
    kv = random_blocks(layout, 16, seed=3)
    keys = store.hash_tokens(torch.arange(16 * layout.block_tokens), "m")
    assert store.put(keys[:8], kv[:, :, : 8 * layout.block_tokens]) == 8
    assert [store.manager.where(k) for k in keys[:4]] == [[0]] * 4  # the prefix stays in DRAM
    assert [store.manager.where(k) for k in keys[4:8]] == [[1]] * 4  # the rest went to disk
    assert store.put(keys[8:], kv[:, :, 8 * layout.block_tokens :]) == 8
    store.manager.drain()  # background evictions (down to the low watermarks) finish
    stats = store.stats()
    assert stats["tiers"][0]["demotions"] > 0  # host evictions were demoted to disk
    assert stats["tiers"][1]["evictions"] > 0  # and the disk evicted too
    on_disk = block_files(tmp_path)
    assert len(on_disk) == stats["tiers"][1]["blocks"] <= 10  # evicted files are removed
    n = store.lookup(keys[::-1][:1])
    assert n == 1  # the newest block is stored
    for i, key in enumerate(keys):
        if store.contains(key):
            got = store.get([key])
            assert torch.equal(
                got, kv[:, :, i * layout.block_tokens : (i + 1) * layout.block_tokens]
            )
    store.close()


def test_restart_finds_thousands_of_blocks(tmp_path: Path) -> None:
    from kvstore import KVStore

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_tokens=16)  # 2 KiB
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "1GiB"}]}
    n = 3000
    kv = random_blocks(layout, n, seed=9)
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(torch.arange(n * layout.block_tokens), "m")
        assert store.put(keys, kv) == n
    dead = subprocess.Popen(["true"])
    dead.wait()  # a writer that died mid-write left a temp file behind
    name = f".{keys[0].hex()}.{dead.pid}.7.tmp"
    (tmp_path / "kvstore-v1" / layout.fingerprint_hex / "00" / name).write_bytes(b"half")
    with KVStore(layout, config) as again:
        assert again.lookup(keys) == n
        assert torch.equal(again.get(keys), kv)
        assert again.stats()["tiers"][0]["stale_temps_removed"] == 1
