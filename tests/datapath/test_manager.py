"""Block manager: watermarks, hysteresis, pins, all-or-nothing evict, demotion, faults."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvstore import KVStore
from kvstore.cli.servers import RedisServer
from kvstore.config import DeviceTierConfig, HostTierConfig
from kvstore.datapath import BlockManager
from kvstore.datapath.contracts import Medium
from kvstore.errors import BlockNotFoundError, CapacityError, ClosedError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import FaultyTier
from kvstore.tiers.base import LayerRange
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.host import HostTier


def host(layout: KVLayout, blocks: int, high: float = 0.9, low: float = 0.7) -> HostTier:
    config = HostTierConfig(
        capacity=blocks * layout.block_nbytes, high_watermark=high, low_watermark=low
    )
    return HostTier(config, layout)


def device(layout: KVLayout, blocks: int, high: float = 0.9, low: float = 0.7) -> DeviceTier:
    config = DeviceTierConfig(
        device="cpu", capacity=blocks * layout.block_nbytes, high_watermark=high, low_watermark=low
    )
    return DeviceTier(config, layout)


def chunks(layout: KVLayout, n: int, seed: int = 0) -> list[torch.Tensor]:
    kv = random_blocks(layout, n, seed)
    step = layout.block_tokens
    return [kv[:, :, i * step : (i + 1) * step] for i in range(n)]


def read(manager: BlockManager, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
    layout = manager.layout
    outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in keys]
    manager.get(keys, outs)
    return outs


class GatedTier(HostTier):
    """A host tier whose get() waits at a gate: holds pins open deterministically."""

    def __init__(self, layout: KVLayout, blocks: int) -> None:
        # High watermark 1.0: a full tier does not evict in the background by itself.
        config = HostTierConfig(
            capacity=blocks * layout.block_nbytes, high_watermark=1.0, low_watermark=0.5
        )
        super().__init__(config, layout)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        return super().get(keys, outs, layers)


@dataclass
class HeldRead:
    """A manager over one :class:`GatedTier` with a get of ``keys[:reading]`` stuck in the
    tier, so their pins stay held until :meth:`finish`."""

    gated: GatedTier
    manager: BlockManager
    keys: list[BlockKey]
    blocks: list[torch.Tensor]
    outs: list[torch.Tensor]
    reader: threading.Thread

    def finish(self) -> None:
        """Open the gate and wait for the get to end."""
        self.gated.gate.set()
        self.reader.join()


def hold_a_read(layout: KVLayout, capacity: int, stored: int, reading: int) -> HeldRead:
    """Store ``stored`` blocks in a gated tier of ``capacity``; start reading the first
    ``reading`` and return once that get is in the tier."""
    gated = GatedTier(layout, capacity)
    manager = BlockManager(layout, [gated])
    keys, blocks = make_keys(stored), chunks(layout, stored)
    manager.put(keys, blocks)
    outs: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: outs.extend(read(manager, keys[:reading])))
    reader.start()
    assert gated.entered.wait(10)
    return HeldRead(gated, manager, keys, blocks, outs, reader)


@pytest.fixture
def layout() -> KVLayout:
    return small_layout()


def test_watermark_hysteresis_evicts_down_to_low(layout: KVLayout) -> None:
    manager = BlockManager(layout, [host(layout, 10, high=0.9, low=0.5)])
    keys, blocks = make_keys(10), chunks(layout, 10)
    for key, block in zip(keys[:9], blocks[:9], strict=True):
        assert manager.put([key], [block]) == 1
    assert manager.counters.evictions == [0]
    assert manager.put(keys[9:], blocks[9:]) == 1  # passes the high mark (9 blocks)
    manager.drain()  # the hysteresis eviction runs in the background, off the put's path
    assert manager.counters.evictions == [5]  # 10 after the put -> down to low (5)
    assert len(manager) == 5
    assert manager.lookup(keys[5:]) == 5  # the newest survived
    assert manager.lookup(keys[:5]) == 0
    manager.close()


def test_lru_keeps_recently_read_blocks(layout: KVLayout) -> None:
    manager = BlockManager(layout, [host(layout, 4, high=1.0, low=0.75)])
    keys, blocks = make_keys(5), chunks(layout, 5)
    manager.put(keys[:4], blocks[:4])
    read(manager, keys[:1])  # key 0 becomes most recently used
    # A full tier frees just the room the put needs, on the put's path: the LRU block.
    manager.put(keys[4:], blocks[4:])
    assert [manager.contains(k) for k in keys] == [True, False, True, True, True]
    manager.drain()  # at the high mark (4), not past it: no background eviction
    assert len(manager) == 4
    manager.close()


def test_capacity_returns_exactly_after_deletes_and_evictions(layout: KVLayout) -> None:
    tier = host(layout, 6)
    manager = BlockManager(layout, [tier])
    for round_ in range(4):
        keys, blocks = make_keys(6, salt=round_), chunks(layout, 6, seed=round_)
        assert manager.put(keys, blocks) == 6
        if round_ % 2:
            manager.delete(keys)
        else:
            manager.evict(0, 6)
        assert tier.free_blocks == 6
        assert len(manager) == 0
    manager.close()


def test_evict_is_all_or_nothing(layout: KVLayout) -> None:
    held = hold_a_read(layout, capacity=8, stored=4, reading=2)
    manager = held.manager
    assert manager.pinned_blocks() == 2
    with pytest.raises(CapacityError, match="only 2 are unpinned"):
        manager.evict(0, 3)
    assert len(manager) == 4  # nothing was evicted
    held.finish()
    evicted = manager.evict(0, 3)
    assert len(evicted) == 3 and len(manager) == 1
    manager.close()


def test_a_block_being_read_is_never_evicted(layout: KVLayout) -> None:
    held = hold_a_read(layout, capacity=4, stored=4, reading=1)
    manager = held.manager
    # Fill the tier with new blocks: everything but the pinned block may go.
    new_keys, new_blocks = make_keys(4, salt=1), chunks(layout, 4, seed=1)
    stored = manager.put(new_keys, new_blocks)
    assert stored == 3
    assert manager.contains(held.keys[0])
    held.finish()
    assert torch.equal(held.outs[0], held.blocks[0])
    manager.close()


def test_demotion_from_device_to_host(layout: KVLayout) -> None:
    manager = BlockManager(layout, [device(layout, 4, high=1.0, low=0.5), host(layout, 16)])
    keys, blocks = make_keys(8), chunks(layout, 8)
    manager.put(keys[:4], blocks[:4])
    assert all(manager.where(k) == [0] for k in keys[:4])
    manager.put(keys[4:], blocks[4:])
    assert manager.counters.demotions[0] >= 2
    assert manager.counters.blocks_dropped == 0
    assert len(manager) == 8
    where = [manager.where(k) for k in keys]
    assert sum(w == [1] for w in where) >= 2  # demoted blocks now live on host
    for out, block in zip(read(manager, keys), blocks, strict=True):
        assert torch.equal(out, block)
    manager.close()


def test_put_overflow_lands_in_lower_tier_in_prefix_order(layout: KVLayout) -> None:
    manager = BlockManager(layout, [device(layout, 3), host(layout, 10)])
    keys, blocks = make_keys(8), chunks(layout, 8)
    assert manager.put(keys, blocks) == 8
    assert [manager.where(k) for k in keys[:3]] == [[0]] * 3  # the prefix is in the fast tier
    assert [manager.where(k) for k in keys[3:]] == [[1]] * 5
    manager.close()


def test_last_tier_eviction_drops_blocks(layout: KVLayout) -> None:
    manager = BlockManager(
        layout, [device(layout, 2, high=1.0, low=0.5), host(layout, 2, high=1.0, low=0.5)]
    )
    keys, blocks = make_keys(6), chunks(layout, 6)
    for key, block in zip(keys, blocks, strict=True):
        manager.put([key], [block])
    assert manager.counters.blocks_dropped > 0
    assert len(manager) <= 4
    assert manager.contains(keys[-1])
    manager.close()


def test_failing_top_tier_degrades_to_the_next(layout: KVLayout) -> None:
    faulty = FaultyTier(device(layout, 8))
    faulty.put_error = 1.0
    manager = BlockManager(layout, [faulty, host(layout, 8)])
    keys, blocks = make_keys(3), chunks(layout, 3)
    assert manager.put(keys, blocks) == 3
    assert [manager.where(k) for k in keys] == [[1]] * 3
    assert manager.counters.tier_errors == 1
    for out, block in zip(read(manager, keys), blocks, strict=True):
        assert torch.equal(out, block)
    manager.close()


def test_lost_copy_is_a_miss_not_wrong_data(layout: KVLayout) -> None:
    faulty = FaultyTier(host(layout, 8))
    manager = BlockManager(layout, [faulty])
    keys, blocks = make_keys(4), chunks(layout, 4)
    manager.put(keys, blocks)
    faulty.get_miss = 1.0
    outs = [torch.zeros(layout.block_shape, dtype=layout.dtype) for _ in keys]
    with pytest.raises(BlockNotFoundError):
        manager.get(keys, outs)
    assert manager.counters.copies_lost == 4
    assert manager.lookup(keys) == 0  # the index forgot the lost blocks
    faulty.get_miss = 0.0
    assert manager.put(keys, blocks) == 4  # and the store keeps working
    assert manager.get(keys, outs) == 4
    manager.close()


def test_tier_down_gives_misses_and_prefix_reads(layout: KVLayout) -> None:
    faulty = FaultyTier(host(layout, 8))
    manager = BlockManager(layout, [faulty])
    keys, blocks = make_keys(3), chunks(layout, 3)
    manager.put(keys, blocks)
    faulty.down = True
    outs = [torch.zeros(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert manager.get(keys, outs, prefix=True) == 0
    assert manager.put(make_keys(2, salt=1), chunks(layout, 2)) == 0
    assert manager.counters.tier_errors >= 2
    faulty.down = False
    assert manager.put(keys, blocks) == 3
    manager.close()


def test_a_dead_medium_keeps_its_copies_for_when_it_is_back(layout: KVLayout) -> None:
    faulty = FaultyTier(host(layout, 8))
    manager = BlockManager(layout, [faulty])
    keys, blocks = make_keys(3), chunks(layout, 3)
    manager.put(keys, blocks)
    faulty.down = True  # the medium raises TierError: unreachable, not empty
    outs = [torch.zeros(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert manager.get(keys, outs, prefix=True) == 0
    assert manager.counters.copies_lost == 0
    assert manager.lookup(keys) == 3  # the books still know where the blocks are
    faulty.down = False
    assert manager.get(keys, outs) == 3  # and they are readable again, without a re-put
    for out, block in zip(outs, blocks, strict=True):
        assert torch.equal(out, block)
    manager.close()


def test_read_falls_back_to_a_slower_copy(layout: KVLayout) -> None:
    keys, blocks = make_keys(2), chunks(layout, 2)
    top, bottom = FaultyTier(device(layout, 4)), FaultyTier(host(layout, 4))
    for tier in (top, bottom):  # both media already hold both blocks (as after a restart)
        tier.persistent = True
        tier.inner.put(keys, blocks)
    manager = BlockManager(layout, [top, bottom])
    assert [manager.where(k) for k in keys] == [[0, 1], [0, 1]]
    top.get_miss = 1.0
    for out, block in zip(read(manager, keys), blocks, strict=True):
        assert torch.equal(out, block)
    assert manager.counters.copies_lost == 2
    assert [manager.where(k) for k in keys] == [[1], [1]]
    manager.close()


def test_evict_demotes_and_blocks_stay_readable(layout: KVLayout) -> None:
    manager = BlockManager(layout, [device(layout, 4), host(layout, 4)])
    keys, blocks = make_keys(2), chunks(layout, 2)
    manager.put(keys, blocks)
    assert sorted(manager.evict(0, 2)) == sorted(keys)
    assert [manager.where(k) for k in keys] == [[1], [1]]
    assert manager.counters.demotions == [2, 0]
    for out, block in zip(read(manager, keys), blocks, strict=True):
        assert torch.equal(out, block)
    manager.close()


def test_delete_waits_for_readers(layout: KVLayout) -> None:
    held = hold_a_read(layout, capacity=4, stored=1, reading=1)
    manager, keys = held.manager, held.keys
    deleted: list[int] = []
    deleter = threading.Thread(target=lambda: deleted.append(manager.delete(keys)))
    deleter.start()
    deleter.join(0.2)
    assert deleter.is_alive()  # waits for the reader's pin
    assert not manager.contains(keys[0])  # but the block is already invisible
    held.finish()
    deleter.join(10)
    assert deleted == [1]
    assert torch.equal(held.outs[0], held.blocks[0])  # the reader got whole, correct data
    manager.close()


def test_concurrent_put_of_same_key_stores_once(layout: KVLayout) -> None:
    tier = host(layout, 8)
    manager = BlockManager(layout, [tier])
    keys, blocks = make_keys(1), chunks(layout, 1)
    threads = [threading.Thread(target=manager.put, args=(keys, blocks)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(manager) == 1
    assert tier.capacity_blocks - tier.free_blocks == 1  # one slot used
    manager.close()


def test_closed_manager_raises(layout: KVLayout) -> None:
    manager = BlockManager(layout, [host(layout, 2)])
    manager.close()
    manager.close()
    with pytest.raises(ClosedError):
        manager.lookup(make_keys(1))


def test_the_change_feed_and_drop_local_keep_the_shared_copy(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """What a cluster node publishes: the medium of each block's nearest copy as it
    changes; and a replica's cool-down (``drop_local``) removes only this machine's
    copies, never the one in a shared remote tier (here Redis; S3 in a cluster)."""
    layout = small_layout()
    tiers = [
        {"kind": "host", "capacity": "1MiB", "write_policy": "write_through"},
        {
            "kind": "disk",
            "path": str(tmp_path),
            "capacity": "4MiB",
            "write_policy": "write_through",
        },
        {"kind": "redis", "url": redis_server.url, "key_prefix": f"feed-{os.getpid()}"},
    ]
    with KVStore(layout, {"tiers": tiers}) as store:
        feed, other = store.engine.datapath.watch(), store.engine.datapath.watch()
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "feed")
        data = random_blocks(layout, 3)
        assert store.put(keys, data) == 3
        store.flush()
        assert feed.drain() == dict.fromkeys(keys, (Medium.NONE, Medium.MEMORY))
        # each watcher drains its own feed; one that stopped records nothing more
        assert other.drain() == dict.fromkeys(keys, (Medium.NONE, Medium.MEMORY))
        store.engine.datapath.unwatch(other)
        assert store.engine.datapath.drop_local(keys[:2]) == 4  # host and disk copies of two
        assert store.engine.datapath.where(keys[0]) == [2]
        assert feed.drain() == dict.fromkeys(keys[:2], (Medium.MEMORY, Medium.SHARED))
        store.delete(keys[:1])
        assert feed.drain() == {keys[0]: (Medium.SHARED, Medium.NONE)}
        assert other.drain() == {}
        assert sorted(store.engine.datapath.stored_media()) == sorted(
            [(keys[1], Medium.SHARED), (keys[2], Medium.MEMORY)]
        )
        step = layout.block_tokens
        assert torch.equal(store.get(keys[1:2]), data[:, :, step : 2 * step])  # from Redis


def test_a_failed_read_forgets_a_shared_copy_without_deleting_it(layout: KVLayout) -> None:
    """Other processes read a shared tier too: one read that failed there (a request
    that gave up, bytes damaged on the way) must not delete the object for everyone."""
    keys, blocks = make_keys(2), chunks(layout, 2)
    top, shared = FaultyTier(device(layout, 4)), FaultyTier(host(layout, 4))
    top.persistent = shared.shared = shared.persistent = True  # both indexed at open
    for tier in (top, shared):
        tier.inner.put(keys, blocks)
    manager = BlockManager(layout, [top, shared])
    top.get_miss = shared.get_miss = 1.0
    outs = [torch.zeros(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert manager.get(keys, outs, prefix=True) == 0
    assert manager.counters.copies_lost == 4
    assert shared.inner.contains(keys) == [True, True]  # forgotten here, still there
    assert top.inner.contains(keys) == [False, False]  # this process's own: deleted
    shared.get_miss = 0.0
    assert manager.lookup(keys) == 2  # found again in the shared tier
    manager.close()
