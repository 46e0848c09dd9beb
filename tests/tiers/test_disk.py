"""Disk tier: conformance, persistence, atomicity, verification and faults on real files."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.config import DiskTierConfig, HostTierConfig
from kvstore.errors import ConfigError
from kvstore.format.codec import Codec, parse_header
from kvstore.layout import KVLayout
from kvstore.testing.conformance import TierConformance, make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers import disk as disk_module
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier


def disk_tier(path: Path, layout: KVLayout, blocks: int = 16, **extra: object) -> DiskTier:
    probe = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 30), layout)
    file_nbytes = probe.file_nbytes
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
        return disk_tier(self.path, layout, capacity_blocks, page_cache="bypass", fsync=True)


class TestDiskTierBypass(TestDiskTier):
    def make_tier(self, layout: KVLayout, capacity_blocks: int) -> DiskTier:
        return disk_tier(self.path, layout, capacity_blocks, page_cache="bypass")


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
    file_nbytes = probe.file_nbytes
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
    # The prefix stays in DRAM (the oldest blocks past the host's low watermark may also
    # have a copy on disk already: written back ahead of their eviction).
    assert [store.engine.datapath.where(k)[0] for k in keys[:4]] == [0] * 4
    assert [store.engine.datapath.where(k) for k in keys[4:8]] == [[1]] * 4  # the rest went to disk
    assert store.put(keys[8:], kv[:, :, 8 * layout.block_tokens :]) == 8
    store.engine.datapath.drain()  # background evictions (down to the low watermarks) finish
    stats = store.stats()
    assert stats["tiers"][0]["demotions"] > 0  # host evictions were demoted to disk
    assert stats["tiers"][1]["evictions"] > 0  # and the disk evicted too
    on_disk = block_files(tmp_path)
    assert len(on_disk) == stats["tiers"][1]["blocks"] <= 10  # evicted files are removed
    n = store.lookup(keys[::-1][:1])
    assert n == 1  # the newest block is stored
    for i, key in enumerate(keys):
        if store.engine.datapath.contains(key):
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


# -- the page cache ------------------------------------------------------------------
#: 4 KiB per (layer, kv) piece: every piece of a page-aligned slot is page-aligned.
ALIGNED = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, block_tokens=16)


def cached_bytes(path: str) -> int:
    """How many bytes of ``path`` the page cache holds, by ``mincore`` on a mapping.

    Not a ``preadv(RWF_NOWAIT)`` probe: a NOWAIT read of an uncached file still
    starts readahead, and on a loaded machine that I/O can finish before the read
    looks again, so the probe itself filled the cache it was measuring.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        try:
            assert libc.mincore(addr, size, pages) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
        resident = sum(b & 1 for b in pages.raw)
        return min(size, resident * mmap.PAGESIZE)
    finally:
        os.close(fd)


def misaligned(block: torch.Tensor) -> torch.Tensor:
    """A copy of ``block`` starting 64 bytes past a page boundary."""
    nbytes = block.numel() * block.element_size()
    raw = torch.empty(nbytes + 2 * 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096 + 64
    copy = raw[start : start + nbytes].view(block.dtype).view(block.shape)
    return copy.copy_(block)


def block_file(tier: DiskTier, key: bytes) -> str:
    return tier.block_path(key)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs mincore")
@pytest.mark.parametrize("mode", ["keep", "bypass"])
def test_page_cache_setting(tmp_path: Path, mode: str) -> None:
    """keep: a block written (or read) stays in the page cache and reads back the same
    bytes; bypass: neither the write nor a read leaves it there."""
    layout = ALIGNED
    tier = disk_tier(tmp_path, layout, page_cache=mode)
    if mode == "bypass" and not tier.stats()["o_direct"]:
        tier.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    keys, blocks = make_keys(3), blocks_of(layout, 3)
    assert all(tier.put(keys, blocks))
    sizes = [os.path.getsize(block_file(tier, k)) for k in keys]
    after_write = [cached_bytes(block_file(tier, k)) for k in keys]
    outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert all(tier.get(keys, outs))
    for out, block in zip(outs, blocks, strict=True):
        assert torch.equal(out, block)
    after_read = [cached_bytes(block_file(tier, k)) for k in keys]
    assert tier.stats()["page_cache"] == mode
    tier.close()
    if mode == "keep":
        assert after_write == sizes and after_read == sizes
    else:
        assert after_write == [0, 0, 0] and after_read == [0, 0, 0]


def test_bypass_writes_page_aligned_blocks_without_staging(tmp_path: Path) -> None:
    """Blocks from page-aligned memory (the host tier's slots) go to O_DIRECT as they are;
    others are copied into the staging buffer first. Both read back the same."""
    layout = ALIGNED
    tier = disk_tier(tmp_path, layout, page_cache="bypass")
    if not tier.stats()["o_direct"]:
        tier.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    host = HostTier(HostTierConfig(capacity=4 * layout.block_nbytes), layout)
    keys, blocks = make_keys(4), blocks_of(layout, 4)
    host.put(keys[:2], blocks[:2])
    slots = [host.view(k) for k in keys[:2]]
    assert all(tier.put(keys[:2], slots))
    assert tier.stats().get("staged_writes", 0) == 0  # page-aligned slots: no copy
    assert all(tier.put(keys[2:], [misaligned(b) for b in blocks[2:]]))
    assert tier.stats()["staged_writes"] == 2
    outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert all(tier.get(keys, outs))
    for out, block in zip(outs, blocks, strict=True):
        assert torch.equal(out, block)
    host.close()
    tier.close()


def aligned_empty(layout: KVLayout) -> torch.Tensor:
    """An empty block starting on a page boundary (as vLLM's primary rows do)."""
    nbytes = layout.block_nbytes
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start : start + nbytes].view(layout.dtype).view(layout.block_shape)


def test_bypass_reads_whole_raw_blocks_into_aligned_memory_with_o_direct(
    tmp_path: Path,
) -> None:
    """No page cache and no copy: the bytes land in the caller's pages and are verified
    there; a damaged block is a miss (and deleted), a compressed one written by another
    writer of the directory is read through the page cache instead, and ranged or
    misaligned reads keep the buffered path."""
    layout = ALIGNED
    tier = disk_tier(tmp_path, layout, page_cache="bypass")
    if not tier.stats()["o_direct"]:
        tier.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    keys, blocks = make_keys(4), blocks_of(layout, 4)
    assert all(tier.put(keys[:3], blocks[:3]))
    squeezed = disk_tier(tmp_path, layout, codec="shuffle-lz4")  # another writer
    assert squeezed.put(keys[3:], blocks[3:]) == [True]
    squeezed.close()
    outs = [aligned_empty(layout) for _ in keys]
    assert tier.get(keys, outs) == [True] * 4
    for out, block in zip(outs, blocks, strict=True):
        assert torch.equal(out, block)
    assert tier.stats()["direct_reads"] == 3  # the compressed one went buffered
    assert cached_bytes(block_file(tier, keys[0])) == 0
    part = torch.empty((2, *layout.block_shape[1:]), dtype=layout.dtype)
    assert tier.get(keys[:1], [part], layers=(1, 3)) == [True]
    assert torch.equal(part, blocks[0][1:3]) and tier.stats()["direct_reads"] == 3
    path = block_file(tier, keys[1])
    with open(path, "r+b") as f:  # one flipped byte in the payload
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert tier.get(keys[1:2], [aligned_empty(layout)]) == [False]
    assert tier.stats()["corrupt"] == 1 and not os.path.exists(path)
    tier.close()


def test_reads_verify_each_group_of_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads come in groups of layers, each verified: damage in any layer is caught,
    and ranged reads that start or end inside a group read exactly their layers."""
    monkeypatch.setattr(disk_module, "READ_GROUP_NBYTES", 2 * ALIGNED.layer_nbytes)
    layout = KVLayout(num_layers=7, num_kv_heads=4, head_dim=32, block_tokens=16)
    tier = disk_tier(tmp_path, layout)
    keys, blocks = make_keys(2), blocks_of(layout, 2)
    assert all(tier.put(keys, blocks))
    for first, last in [(0, 7), (1, 6), (3, 4), (5, 7)]:
        out = torch.empty((last - first, *layout.block_shape[1:]), dtype=layout.dtype)
        assert tier.get(keys[:1], [out], layers=(first, last)) == [True]
        assert torch.equal(out, blocks[0][first:last])
    path = block_file(tier, keys[1])
    with open(path, "r+b") as f:  # one flipped byte in the last layer
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = torch.empty(layout.block_shape, dtype=layout.dtype)
    assert tier.get(keys[1:], [out]) == [False]
    assert tier.stats()["corrupt"] == 1 and not os.path.exists(path)
    tier.close()


@pytest.mark.parametrize(("codec", "stored"), [("raw", Codec.RAW), ("auto", Codec.SHUFFLE_LZ4)])
def test_codec_raw_stores_raw_even_where_compression_would_pay(
    tmp_path: Path, codec: str, stored: Codec
) -> None:
    """bf16 N(0,1) KV shrinks ~16% with shuffle+lz4, so ``auto`` compresses it; ``raw``
    must not (Codec.RAW is 0: a truthiness test once made raw behave like auto)."""
    layout = small_layout(num_layers=2, num_kv_heads=8, head_dim=128, block_tokens=64)
    tier = disk_tier(tmp_path, layout, codec=codec)
    key = make_keys(1)
    block = torch.randn(layout.block_shape).to(layout.dtype)
    assert tier.put(key, [block]) == [True]
    with open(block_file(tier, key[0]), "rb") as f:
        head = f.read(tier.data_offset)
    assert parse_header(head, layout, key[0]).codec == stored
    out = torch.empty_like(block)
    assert tier.get(key, [out]) == [True] and torch.equal(out, block)
    tier.close()
