"""Leases: pins that end when released or expired (injected clock), and Pin handles."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from kvstore.config import HostTierConfig, StoreConfig
from kvstore.datapath import BlockManager
from kvstore.datapath.index import Entry
from kvstore.datapath.leases import LeaseTable
from kvstore.errors import CapacityError, InvalidInputError
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import host_config, random_blocks, small_layout
from kvstore.tiers.host import HostTier


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_table_expires_releases_and_renews() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    a, b = table.add([Entry(1)], 10), table.add([Entry(1)], 20)
    assert len(table) == 2 and table.next_expiry() == 1010
    clock.now += 11
    assert table.expired() == [a] and a.released and len(table) == 1
    assert table.renew(b, 30)  # now expires at 1041
    clock.now += 15
    assert table.expired() == []  # the old expiry (1020) no longer counts
    assert table.release(b) == b.entries and table.release(b) == []
    assert not table.renew(b, 5)
    assert table.expired_all() == [] and table.next_expiry() is None


def manager_with_clock(
    blocks: int = 4,
) -> tuple[BlockManager, FakeClock, list[bytes], list[torch.Tensor]]:
    layout = small_layout()
    clock = FakeClock()
    config = HostTierConfig(
        capacity=blocks * layout.block_nbytes, high_watermark=1.0, low_watermark=0.5
    )
    store_config = StoreConfig(tiers=(config,), lease_s=5.0)
    manager = BlockManager(layout, [HostTier(config, layout)], store_config, clock)
    kv = random_blocks(layout, blocks)
    step = layout.block_tokens
    keys = make_keys(blocks)
    manager.put(keys, [kv[:, :, i * step : (i + 1) * step] for i in range(blocks)])
    return manager, clock, keys, [kv[:, :, i * step : (i + 1) * step] for i in range(blocks)]


def test_a_leased_block_is_never_evicted_and_an_expired_lease_is_reaped() -> None:
    manager, clock, keys, _ = manager_with_clock()
    lease = manager.pin(keys[:4])
    assert len(lease.entries) == 4 and manager.pinned_blocks() == 4
    with pytest.raises(CapacityError):
        manager.evict(0, 1)  # everything is pinned: nothing moves
    assert len(manager) == 4
    clock.now += 6  # the holder died: the lease runs out
    assert manager.evict(0, 1)  # and the blocks can go
    assert manager.counters.leases_expired == 1
    assert manager.pinned_blocks() == 0
    manager.close()


def test_release_and_renew_through_the_manager() -> None:
    manager, clock, keys, _ = manager_with_clock()
    lease = manager.pin(keys[:2], duration=2.0)
    clock.now += 1.5
    assert manager.renew(lease, 2.0)
    clock.now += 1.5  # 3 s after pinning, but renewed: still held
    assert manager.pinned_blocks() == 2
    manager.release(lease)
    manager.release(lease)  # idempotent
    assert manager.pinned_blocks() == 0 and manager.counters.leases_expired == 0
    assert not manager.renew(lease)
    manager.close()


def test_delete_waits_out_an_abandoned_lease() -> None:
    manager, clock, keys, _ = manager_with_clock()
    manager.pin(keys[:1])
    clock.now += 10  # expired, not yet reaped: delete reaps it instead of hanging
    assert manager.delete(keys[:1]) == 1
    manager.close()


def test_store_pin_handle() -> None:
    layout = small_layout()
    with KVStore(layout, host_config(layout, 8)) as store:
        keys = store.hash_tokens(torch.arange(3 * layout.block_tokens), "m")
        store.put(keys[:2], random_blocks(layout, 2))
        with store.pin(keys, lease_s=30) as pin:
            assert pin.count == 2 and pin.active  # the stored prefix
            assert store.engine.datapath.pinned_blocks() == 2
            assert pin.renew(60)
        assert not pin.active and store.engine.datapath.pinned_blocks() == 0
        with pytest.raises(InvalidInputError):
            store.pin(keys, lease_s=0)
