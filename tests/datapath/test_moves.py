"""Background moves: write-through, promotion on hit, admission, hot replication, flush."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.config import StoreConfig, format_size
from kvstore.datapath import BlockManager
from kvstore.layout import KVLayout
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import FaultyTier
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
    assert [store.engine.datapath.where(k) for k in keys] == [[0, 1]] * 3
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
    assert [store.engine.datapath.where(k) for k in keys] == [[0]] * 3
    store.evict(3)
    assert [store.engine.datapath.where(k) for k in keys] == [[1]] * 3  # demoted, not dropped
    store.close()


@pytest.mark.parametrize("read", ["get", "prefetch-layer", "prefetch-block"])
def test_promotion_after_the_nth_hit(tmp_path: Path, read: str) -> None:
    # Prefetches promote as gets do: an engine's connector loads with prefetch, never
    # get, and a prefix read from disk a thousand times stayed on disk.
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {"promote_after": 3}, {}))
    keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
    kv = random_blocks(layout, 2)
    store.put(keys, kv)  # access 1
    store.evict(2)  # now only on disk

    def load() -> None:
        if read == "get":
            assert torch.equal(store.get(keys), kv)
        else:
            out = torch.full_like(kv, float("nan"))
            with store.prefetch(keys, out=out, order=read.split("-")[1]) as handle:
                assert handle.wait(timeout=30) and handle.blocks_ready == 2
            assert torch.equal(out, kv)
        assert store.drain(timeout=30)

    load()  # access 2: read from disk, not promoted yet
    assert [store.engine.datapath.where(k) for k in keys] == [[1], [1]]
    load()  # access 3: promoted in the background
    assert [store.engine.datapath.where(k) for k in keys] == [[0, 1], [0, 1]]
    assert store.stats()["promotions"] == [2, 0]
    load()  # now served from memory: nothing more to promote
    assert store.stats()["promotions"] == [2, 0]
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
    assert store.engine.datapath.where(keys[0]) == [1]  # admitted to disk
    assert store.engine.datapath.where(keys[1]) == []  # a one-off: dropped, not written to disk
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
    assert store.engine.datapath.pinned_blocks() == 0
    store.close()


def test_flush_waits_for_background_moves_then_persists(tmp_path: Path) -> None:
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {"write_policy": "write_through"}, {}))
    keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 4))
    store.flush()  # drains the write-through jobs first: nothing left to persist twice
    assert all(1 in store.engine.datapath.where(k) for k in keys)
    assert store.stats()["moves_pending"] == 0
    store.close()


class RecordingTier(FaultyTier):
    """A tier that records which thread each put ran on."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.put_threads: list[str] = []

    def put(self, keys, blocks):  # type: ignore[no-untyped-def]
        self.put_threads.append(threading.current_thread().name)
        return super().put(keys, blocks)


def host_over_recorded_disk(path: Path, layout: KVLayout) -> tuple[KVStore, RecordingTier]:
    config = StoreConfig.from_dict(two_tiers(path, layout, {}, {}), environ={})
    host, disk = (create_tier(t, layout) for t in config.tiers)
    recorded = RecordingTier(disk)
    return KVStore(layout, config, tiers=[host, recorded]), recorded


def test_write_back_ahead_of_eviction_keeps_puts_off_the_disk(tmp_path: Path) -> None:
    """Past its low watermark (5 of 8 blocks) the host tier copies its oldest blocks to
    disk in the background; evictions then find them there: no put waits for the disk."""
    layout = small_layout()
    store, disk = host_over_recorded_disk(tmp_path, layout)
    keys = store.hash_tokens(torch.arange(12 * layout.block_tokens), "m")
    kv = random_blocks(layout, 12)
    for i, key in enumerate(keys):
        assert store.put([key], chunk(kv, layout, i)) == 1
        assert store.drain(timeout=30)  # a disk that keeps up
        only_memory = [k for k in keys[: i + 1] if store.engine.datapath.where(k) == [0]]
        assert len(only_memory) <= 5
    assert disk.put_threads and all(n.startswith("kvstore-mover") for n in disk.put_threads)
    stats = store.stats()
    assert stats["evictions"][0] > 0
    # Copied ahead of eviction (a background eviction may still demote a block the
    # write-back had not reached: also off the put's path).
    assert stats["tiers"][0]["writebacks"] == stats["writebacks"][0] > 0
    assert torch.equal(store.get(keys), kv)
    store.close()


def test_puts_that_outrun_the_disk_still_store_every_block(tmp_path: Path) -> None:
    """With a slow disk the write-back falls behind: evictions then demote on the put's
    path (the old way), and nothing is lost."""
    layout = small_layout()
    store, disk = host_over_recorded_disk(tmp_path, layout)
    disk.delay_s = 0.02
    keys = store.hash_tokens(torch.arange(20 * layout.block_tokens), "m")
    kv = random_blocks(layout, 20)
    for i in range(0, 20, 4):
        step = layout.block_tokens
        assert store.put(keys[i : i + 4], kv[:, :, i * step : (i + 4) * step]) == 4
    assert store.lookup(keys) == 20
    assert torch.equal(store.get(keys), kv)
    store.close()
    assert store.engine.datapath.close_flush is not None
    assert (
        store.engine.datapath.close_flush["bytes_written"]
        == store.engine.datapath.close_flush["bytes"]
    )


def test_close_says_what_it_writes_and_how_long_it_took(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {}, {}))
    keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 3))  # 3 of 8: under the low watermark, memory only
    with caplog.at_level(logging.INFO, logger="kvstore.close"):
        store.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.close"]
    assert lines[0].startswith(f"close: writing {format_size(3 * layout.block_nbytes)}")
    assert "disk tier" in lines[0] and str(tmp_path) in lines[0]
    assert lines[-1].startswith("close: wrote") and " in " in lines[-1]
    report = store.engine.datapath.close_flush
    assert (
        report is not None and report["bytes"] == report["bytes_written"] == 3 * layout.block_nbytes
    )
    assert report["seconds"] is not None and report["seconds"] >= 0
    reopened = KVStore(layout, two_tiers(tmp_path, layout, {}, {}))
    assert reopened.lookup(keys) == 3  # on disk
    reopened.close()


def test_close_with_nothing_to_write_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {"write_policy": "write_through"}, {}))
    keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 2))
    store.drain(timeout=30)
    with caplog.at_level(logging.INFO, logger="kvstore.close"):
        store.close()
    assert not [r for r in caplog.records if r.name == "kvstore.close"]
    report = store.engine.datapath.close_flush
    assert report is not None and report["bytes"] == report["bytes_written"] == 0


def test_write_back_goes_least_recently_used_first_and_keeps_the_policy_order(
    tmp_path: Path,
) -> None:
    """The write-back takes the least recently used dirty block (a read moves a block to
    the back); a written-back block keeps its place in LRU order: it is not an extra
    copy to evict first, as a replica copied up from disk is."""
    layout = small_layout()
    store = KVStore(layout, two_tiers(tmp_path, layout, {}, {}))  # 8 blocks, low watermark 5
    keys = store.hash_tokens(torch.arange(6 * layout.block_tokens), "m")
    kv = random_blocks(layout, 6)
    for i in range(5):
        store.put(keys[i : i + 1], chunk(kv, layout, i))
    store.get(keys[:1])  # k0 is now the most recently used
    store.put(keys[5:6], chunk(kv, layout, 5))  # 6 dirty > 5: one is written back
    assert store.drain(timeout=30)
    assert [store.engine.datapath.where(k) for k in keys] == [[0], [0, 1]] + [[0]] * 4
    store.get(keys[1:2])  # the written-back block is used again: k2 is the LRU now
    assert store.evict(1) == [keys[2]]  # not k1, although k1 would free its slot for free
    assert store.engine.datapath.where(keys[1]) == [0, 1] and store.engine.datapath.where(
        keys[2]
    ) == [1]
    assert torch.equal(store.get(keys), kv)
    store.close()


def test_promotions_of_the_same_blocks_at_once_copy_each_once(tmp_path: Path) -> None:
    """Warming from several threads at once (a plan's warming beside a deferred search's,
    and a hint's): each block is copied up once, and the memory tier keeps every one.
    Before, both copies passed the "not there yet" check and claimed room, and the tier,
    charged twice, evicted what it held (15 blocks into room for 20 left 0 to 3)."""
    layout = small_layout()
    nb = layout.block_nbytes
    kv = random_blocks(layout, 15)
    disk = {"kind": "disk", "path": str(tmp_path), "capacity": 64 * (nb + 4096)}
    with KVStore(layout, {"tiers": [disk]}) as store:
        keys = store.hash_tokens(list(range(15 * layout.block_tokens)), namespace="m")
        store.put(keys, kv)
    config = {"tiers": [{"kind": "host", "capacity": 20 * nb}, disk]}
    with KVStore(layout, config) as store:
        datapath, start = store.engine.datapath, threading.Barrier(3)

        def warm_now() -> None:
            start.wait()
            datapath.warm_now(keys)

        threads = [threading.Thread(target=warm_now) for _ in range(2)]
        for thread in threads:
            thread.start()
        start.wait()
        datapath.warm(keys)
        for thread in threads:
            thread.join()
        assert store.drain(10.0)
        stats = store.stats()
        assert stats["promotions"][0] == 15 and stats["evictions"][0] == 0, stats
        assert stats["tiers"][0]["blocks"] == 15
        assert all(0 in datapath.where(k) for k in keys)
        assert torch.equal(store.get(keys), kv)
