"""Disk faults: each is a miss or a clear per-block failure, counted, and the store keeps working.

ENOSPC and a read-only filesystem are real (a tiny tmpfs, where this machine lets
the tests mount one) and also injected; EIO is injected (no real disk here fails
on demand); a vanished directory and damaged files are real.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvharness.mounts import remount_read_only
from kvstore import BlockNotFoundError, KVStore
from kvstore.config import DiskTierConfig, HostTierConfig
from kvstore.layout import KVLayout
from kvstore.testing.data import random_blocks
from kvstore.testing.faults import FaultyFileOps
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=64)  # 256 KiB


@pytest.fixture
def tiny_fs(tmpfs: Callable[[str, str], Path]) -> Path:
    """A real 1 MiB filesystem (room for 3 blocks of LAYOUT)."""
    return tmpfs("tiny", "1m")


def disk_store(path: Path, ops: FaultyFileOps | None = None, blocks: int = 64) -> KVStore:
    config = DiskTierConfig(path=str(path), capacity=blocks * (LAYOUT.block_nbytes + 4096))
    return KVStore(LAYOUT, tiers=[DiskTier(config, LAYOUT, ops)])


def keys_and_kv(store: KVStore, n: int, salt: int = 0) -> tuple[list[bytes], torch.Tensor]:
    tokens = torch.arange(salt * 10_000, salt * 10_000 + n * LAYOUT.block_tokens)
    return store.hash_tokens(tokens, "faults"), random_blocks(LAYOUT, n, seed=salt)


def disk_stats(store: KVStore) -> dict[str, object]:
    return store.stats()["tiers"][-1]


# -- disk full -----------------------------------------------------------------
def test_capacity_is_clamped_to_the_free_space(tiny_fs: Path) -> None:
    store = disk_store(tiny_fs, blocks=64)  # the config claims more room than the disk has
    assert store.stats()["tiers"][0]["capacity_blocks"] == 3
    keys, kv = keys_and_kv(store, 6)
    assert store.put(keys, kv) == 3  # the manager evicts within the real room
    assert disk_stats(store).get("enospc", 0) == 0
    store.close()


def test_real_enospc_fails_only_the_blocks_that_do_not_fit(tiny_fs: Path) -> None:
    store = disk_store(tiny_fs, blocks=64)
    # Someone else fills the disk after the store opened: room is left for one block.
    (tiny_fs / "filler").write_bytes(bytes(1024 * 1024 - 2 * (LAYOUT.block_nbytes + 8192)))
    keys, kv = keys_and_kv(store, 3)
    stored = store.put(keys, kv)
    assert 1 <= stored < 3
    assert disk_stats(store).get("enospc", 0) >= 1
    assert not [p for p in tiny_fs.rglob("*.tmp")]  # failed writes leave no temp files
    n = store.lookup(keys)
    out = store.get(keys[:n])
    assert torch.equal(out, kv[:, :, : n * LAYOUT.block_tokens])
    (tiny_fs / "filler").unlink()  # room again: the store keeps working
    more, kv2 = keys_and_kv(store, 2, salt=1)
    assert store.put(more, kv2) == 2
    store.close()


def test_injected_enospc(tmp_path: Path) -> None:
    ops = FaultyFileOps()
    store = disk_store(tmp_path, ops)
    keys, kv = keys_and_kv(store, 3)
    ops.fail["pwritev"] = errno.ENOSPC
    assert store.put(keys, kv) == 0
    assert disk_stats(store)["enospc"] == 3
    assert not [p for p in tmp_path.rglob("*.tmp")]
    del ops.fail["pwritev"]
    assert store.put(keys, kv) == 3
    store.close()


def test_host_over_a_full_disk_keeps_serving_from_memory(tmp_path: Path) -> None:
    ops = FaultyFileOps()
    ops.fail["pwritev"] = errno.ENOSPC
    host = HostTier(HostTierConfig(capacity=2 * LAYOUT.block_nbytes), LAYOUT)
    disk = DiskTier(DiskTierConfig(path=str(tmp_path), capacity=1 << 30), LAYOUT, ops)
    store = KVStore(LAYOUT, tiers=[host, disk])
    keys, kv = keys_and_kv(store, 4)
    assert store.put(keys, kv) == 2  # the host tier takes what it can; the disk refuses
    assert store.lookup(keys) == 2
    assert torch.equal(store.get(keys[:2]), kv[:, :, : 2 * LAYOUT.block_tokens])
    store.close()


# -- I/O errors and read-only media ---------------------------------------------
def test_injected_eio_on_read_is_a_counted_miss(tmp_path: Path) -> None:
    ops = FaultyFileOps()
    store = disk_store(tmp_path, ops)
    keys, kv = keys_and_kv(store, 3)
    store.put(keys, kv)
    ops.fail["preadv"] = errno.EIO
    out = torch.zeros_like(kv)
    assert store.get_prefix(keys, out) == 0
    assert store.get(keys).shape == LAYOUT.tensor_shape(0)  # a miss: nothing loaded
    with pytest.raises(BlockNotFoundError):
        store.get(keys, out=out)  # into a buffer: all or nothing
    assert disk_stats(store)["read_errors"] >= 1
    assert store.stats()["copies_lost"] >= 1
    del ops.fail["preadv"]
    assert store.put(keys, kv) == 3  # rewritten; the store works again
    assert torch.equal(store.get(keys), kv)
    store.close()


def test_real_read_only_filesystem(tiny_fs: Path) -> None:
    store = disk_store(tiny_fs)
    keys, kv = keys_and_kv(store, 2)
    assert store.put(keys[:1], kv[:, :, : LAYOUT.block_tokens]) == 1
    remount_read_only(tiny_fs)
    assert store.put(keys[1:], kv[:, :, LAYOUT.block_tokens :]) == 0  # EROFS: not stored
    assert disk_stats(store)["write_errors"] >= 1
    assert torch.equal(store.get(keys[:1]), kv[:, :, : LAYOUT.block_tokens])  # reads still work
    store.close()
    reopened = disk_store(tiny_fs)  # and a store opens on a read-only directory
    assert reopened.lookup(keys) == 1
    reopened.close()


def test_injected_read_only_directory(tmp_path: Path) -> None:
    ops = FaultyFileOps()
    store = disk_store(tmp_path, ops)
    keys, kv = keys_and_kv(store, 2)
    ops.fail["open"] = errno.EROFS
    ops.only = ".tmp"  # creating files fails, opening existing ones for reading works
    assert store.put(keys, kv) == 0
    assert disk_stats(store)["write_errors"] == 2
    store.close()


# -- the directory vanishes, files are damaged ----------------------------------
def test_vanished_directory(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    keys, kv = keys_and_kv(store, 3)
    store.put(keys, kv)
    shutil.rmtree(tmp_path / "kvstore-v1")
    assert store.get_prefix(keys, torch.zeros_like(kv)) == 0  # misses, not a crash
    assert store.lookup(keys) == 0  # the index forgot the lost blocks
    assert store.put(keys, kv) == 3  # writes recreate the directories
    assert torch.equal(store.get(keys), kv)
    store.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "empty", "swap"])
def test_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = disk_store(tmp_path)
    keys, kv = keys_and_kv(store, 2)
    store.put(keys, kv)
    files = {k: Path(store.engine.datapath.tiers[0].block_path(k)) for k in keys}
    victim = files[keys[0]]
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_payload":
        data[-100] ^= 0x40
    elif damage == "flip_header":
        data[30] ^= 0x01
    elif damage == "empty":
        data = bytearray()
    else:  # another block's file under this key's name
        data = bytearray(files[keys[1]].read_bytes())
    victim.write_bytes(bytes(data))
    out = torch.zeros_like(kv)
    assert store.get_prefix(keys, out) == 0
    assert disk_stats(store)["corrupt"] == 1
    assert not victim.exists()  # a corrupt file is deleted
    assert store.lookup(keys) == 0
    assert torch.equal(store.get(keys[1:]), kv[:, :, LAYOUT.block_tokens :])  # others unharmed
    store.close()
