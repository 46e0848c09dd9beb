"""Background moves: write-through, promotion on hit, admission, hot replication, flush."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstore import KVStore
from kvstore.config import StoreConfig
from kvstore.layout import KVLayout
from kvstore.manager import BlockManager
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers import create_tier


def two_tiers(path: Path, layout: KVLayout, host: dict[str, Any], disk: dict[str, Any]) -> dict:
    nb = layout.block_nbytes
    return {
        "tiers": [
            {"kind": "host", "capacity": 8 * nb, **host},
            {"kind": "disk", "path": str(path), "capacity": 64 * (nb + 4096), **disk},
        ]
    }


def chunk(kv: torch.Tensor, layout: KVLayout, i: int) -> torch.Tensor:
    return kv[:, :, i * layout.block_tokens : (i + 1) * layout.block_tokens]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_write_through_copies_down_in_the_background(tmp_path: Path) -> None:
    layout = small_layout()
    config = two_tiers(tmp_path, layout, {"write_policy": "write_through"}, {})
    store = KVStore(layout, config)
    keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
    kv = random_blocks(layout, 3)
    assert store.put(keys, kv) == 3
    assert store.drain(timeout=30)
    assert [store.manager.where(k) for k in keys] == [[0, 1]] * 3
    assert store.stats()["write_through_copies"] == [0, 3]
    # Without close() (and so without a flush), a second process already finds them on disk.
    other = KVStore(layout, config)
    assert other.lookup(keys) == 3
    assert torch.equal(other.get(keys), kv)
    other.close()
    store.close()


def test_write_back_copies_down_only_on_eviction(tmp_path: Path) -> None:
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {}, {}))
    keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 3))
    store.drain(timeout=30)
    assert [store.manager.where(k) for k in keys] == [[0]] * 3
    store.evict(3)
    assert [store.manager.where(k) for k in keys] == [[1]] * 3  # demoted, not dropped
    store.close()


def test_promotion_after_the_nth_hit(tmp_path: Path) -> None:
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {"promote_after": 3}, {}))
    keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
    kv = random_blocks(layout, 2)
    store.put(keys, kv)  # access 1
    store.evict(2)  # now only on disk
    assert torch.equal(store.get(keys), kv)  # access 2: read from disk, not promoted yet
    store.drain(timeout=30)
    assert [store.manager.where(k) for k in keys] == [[1], [1]]
    assert torch.equal(store.get(keys), kv)  # access 3: promoted in the background
    store.drain(timeout=30)
    assert [store.manager.where(k) for k in keys] == [[0, 1], [0, 1]]
    assert store.stats()["promotions"] == [2, 0]
    assert torch.equal(store.get(keys), kv)  # now served from memory
    store.close()


def test_admission_filter_spares_the_disk_one_off_blocks(tmp_path: Path) -> None:
    layout = small_layout()
    nb = layout.block_nbytes
    host = {"capacity": 2 * nb, "high_watermark": 1.0, "low_watermark": 0.5, "promote_after": 0}
    store = KVStore(layout, two_tiers(tmp_path, layout, host, {"admit_after": 2}))
    keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
    kv = random_blocks(layout, 4)
    store.put(keys[:2], kv[:, :, : 2 * layout.block_tokens])
    store.get(keys[:1])  # block 0 is seen twice; block 1 once
    store.put(keys[2:], kv[:, :, 2 * layout.block_tokens :])  # evicts blocks 0 and 1
    store.drain(timeout=30)
    assert store.manager.where(keys[0]) == [1]  # admitted to disk
    assert store.manager.where(keys[1]) == []  # a one-off: dropped, not written to disk
    assert store.stats()["admission_rejects"] == [0, 1]
    store.close()


def test_hot_block_is_replicated_up_kept_while_hot_and_goes_first_when_cold(tmp_path: Path) -> None:
    layout = small_layout()
    nb = layout.block_nbytes
    config = StoreConfig.from_dict(
        {
            **two_tiers(
                tmp_path,
                layout,
                {
                    "capacity": 4 * nb,
                    "high_watermark": 1.0,
                    "low_watermark": 0.5,
                    "promote_after": 0,
                },
                {},
            ),
            "replication": {"hot_threshold": 4, "half_life_s": 10},
        }
    )
    clock = FakeClock()
    manager = BlockManager(layout, [create_tier(t, layout) for t in config.tiers], config, clock)
    kv = random_blocks(layout, 12)
    keys = [bytes([i]) * 16 for i in range(12)]
    manager.put(keys[:1], [chunk(kv, layout, 0)])
    manager.evict(0, 1)  # the soon-to-be-hot block lives on disk only
    out = [torch.empty(layout.block_shape, dtype=layout.dtype)]
    for _ in range(3):  # heat 1 (put) + 3 reads = 4: hot
        manager.get(keys[:1], out)
    manager.drain()
    assert manager.where(keys[0]) == [0, 1]  # an extra copy in the fastest tier
    # Fill the host tier with cold blocks: the hot block stays in memory.
    for i in range(1, 8):
        manager.put(keys[i : i + 1], [chunk(kv, layout, i)])
        manager.drain()
    assert 0 in manager.where(keys[0])
    # It cools down (two half-lives); the next evictions take its extra copy first.
    clock.now += 25
    manager.put(keys[8:9], [chunk(kv, layout, 8)])
    manager.drain()
    assert manager.where(keys[0]) == [1]  # only the disk copy is left
    manager.get(keys[:1], out)
    assert torch.equal(out[0], chunk(kv, layout, 0))
    manager.close()


def test_chain_host_to_disk_and_back_is_byte_exact(tmp_path: Path) -> None:
    layout = small_layout()
    nb = layout.block_nbytes
    host = {"capacity": 4 * nb, "promote_after": 1}
    store = KVStore(layout, two_tiers(tmp_path, layout, host, {}))
    keys = store.hash_tokens(torch.arange(16 * layout.block_tokens), "m")
    kv = random_blocks(layout, 16)
    for i in range(0, 16, 2):  # more than the host holds: demotions to disk all along
        store.put(
            keys[i : i + 2], kv[:, :, i * layout.block_tokens : (i + 2) * layout.block_tokens]
        )
    store.drain(timeout=30)
    assert store.stats()["demotions"][0] > 0
    assert torch.equal(store.get(keys), kv)  # from both tiers, promoting as it goes
    store.drain(timeout=30)
    assert store.stats()["promotions"][0] > 0
    assert torch.equal(store.get(keys), kv)
    store.drain(timeout=30)  # promotions the last read started
    assert store.manager.pinned_blocks() == 0
    store.close()


def test_flush_waits_for_background_moves_then_persists(tmp_path: Path) -> None:
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {"write_policy": "write_through"}, {}))
    keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 4))
    store.flush()  # drains the write-through jobs first: nothing left to persist twice
    assert all(1 in store.manager.where(k) for k in keys)
    assert store.stats()["moves_pending"] == 0
    store.close()
