"""The books: the lock rule (no tier call under the books' lock), the lock's holder,
and the running count of blocks only memory holds."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch

from kvstore import KVStore, StoreConfig
from kvstore.config import DiskTierConfig, HostTierConfig
from kvstore.datapath.guard import Guard
from kvstore.errors import CapacityError
from kvstore.layout import KVLayout
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.lockcheck import LockCheckedTier
from kvstore.tiers import create_tier

EVERY_CALL = {
    "put",
    "get",
    "delete",
    "contains",
    "stored_keys",
    "view",
    "reserve",
    "commit",
    "abort",
    "stats",
    "prepare_close",
    "close",
}


def checked_store(
    layout: KVLayout, path: Path, host_blocks: int = 4
) -> tuple[KVStore, list[LockCheckedTier]]:
    """A host tier over a (shared, persistent) disk tier, both lock-checked."""
    configs = (
        HostTierConfig(capacity=host_blocks * layout.block_nbytes, prefault=False),
        DiskTierConfig(path=str(path), capacity=64 << 20),
    )
    tiers = [LockCheckedTier(create_tier(c, layout)) for c in configs]
    store = KVStore(layout, StoreConfig(tiers=configs, lease_s=5.0), tiers=tiers)
    for tier in tiers:
        tier.held = store.engine.datapath.books.held_by_me
    return store, tiers


def workload(store: KVStore, other: KVStore, seed: int) -> None:
    """Every operation of the data path once: puts that evict and demote, gets that
    promote, discovery and rechecks, prefetches, layerwise and in-place writes, loans,
    pins, evictions, deletes, persist, flush, stats."""
    layout = store.layout
    keys = store.hash_tokens(torch.arange(8 * layout.block_tokens) + 1000 * seed, f"m{seed}")
    kv = random_blocks(layout, 8, seed=seed)
    assert store.put(keys, kv) == 8  # 4 host slots: evictions demote to the disk
    assert torch.equal(store.get(keys), kv)
    assert store.lookup(keys, recheck=True) == 8
    theirs = other.hash_tokens(torch.arange(2 * layout.block_tokens) + 1000 * seed, f"o{seed}")
    other.put(theirs, random_blocks(layout, 2, seed=seed + 50))
    other.flush()
    assert store.lookup(theirs) == 2  # discovered in the shared disk tier
    for order in ("layer", "block"):
        with store.prefetch(keys, order=order) as handle:
            assert handle.wait(timeout=30) and handle.valid_blocks == 8
            assert handle.out is not None and torch.equal(handle.out, kv)
    layered = store.hash_tokens(torch.arange(2 * layout.block_tokens) + 5000 + seed, "layers")
    fresh = random_blocks(layout, 2, seed=seed + 100)
    for layer in range(layout.num_layers):
        store.put_layer(layered, layer, fresh[layer])
    assert store.lookup(layered) == 2
    abandoned = store.hash_tokens(torch.arange(layout.block_tokens) + 9000 + seed, "gone")
    store.put_layer(abandoned, 0, fresh[0][:, : layout.block_tokens])
    assert store.abort_layers(abandoned) == 1
    in_place = store.hash_tokens(torch.arange(2 * layout.block_tokens) + 7000 + seed, "p")
    with store.engine.begin_put(in_place) as pending:
        step = layout.block_tokens
        for i, view in enumerate(pending.views):
            assert view is not None
            view.copy_(fresh[:, :, i * step : (i + 1) * step])
        assert pending.commit([True, False]) == 1
    with store.engine.lend(keys[:4]) as loan:
        out = torch.empty(layout.block_shape, dtype=layout.dtype)
        assert loan.read_into(3, out)
    with store.pin(keys[:1]), contextlib.suppress(CapacityError):
        store.evict(1, tier=0)  # (others' prefetches may pin every host block right now)
    assert store.delete(keys[6:]) == 2
    assert all(store.engine.datapath.persist(keys[:2]))
    store.flush()
    assert store.stats()["blocks"] > 0
    assert store.stored_keys(rescan=True)


def test_no_tier_call_ever_runs_under_the_books_lock(tmp_path: Path) -> None:
    layout = small_layout()
    store, tiers = checked_store(layout, tmp_path)
    other = KVStore(
        layout, {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}]}
    )
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            workload(store, other, seed)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run(0)  # once alone, then four at once
    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    other.close()
    assert errors == []
    assert [v for tier in tiers for v in tier.violations] == []
    seen = set().union(*(tier.calls for tier in tiers))
    assert seen >= EVERY_CALL, f"the workload never made {sorted(EVERY_CALL - seen)}"


def test_the_check_sees_a_tier_call_made_under_the_lock(tmp_path: Path) -> None:
    layout = small_layout()
    store, tiers = checked_store(layout, tmp_path)
    keys = store.hash_tokens(torch.arange(layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 1))

    def calls_the_tier(entry: object) -> bool:  # runs under the books' lock
        tiers[0].view(keys[0])
        return False

    store.engine.datapath.books.pins.pin_where(keys, calls_the_tier)
    assert len(tiers[0].violations) == 1 and "view under the books' lock" in tiers[0].violations[0]
    store.close()


def test_guard_knows_its_holder_across_waits() -> None:
    guard = Guard()
    seen: list[bool] = []
    assert not guard.held_by_me()
    with guard.locked():
        assert guard.held_by_me()
        other = threading.Thread(target=lambda: seen.append(guard.held_by_me()))
        other.start()
        other.join()
        guard.wait(0.01)
        assert guard.held_by_me()  # the holder again after waiting
    assert not guard.held_by_me() and seen == [False]


def test_memory_only_count_follows_every_change(tmp_path: Path) -> None:
    layout = small_layout()
    store, _ = checked_store(layout, tmp_path, host_blocks=8)
    books = store.engine.datapath.books

    def only_in_memory() -> int:  # what a scan of the index says
        return sum(1 for k in store.stored_keys() if store.engine.datapath.where(k) == [0])

    keys = store.hash_tokens(torch.arange(6 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 6))
    store.drain()  # (the host tier writes back ahead of eviction, in the background)
    before = only_in_memory()
    assert books.queries.unpersisted() == before > 0
    store.engine.datapath.persist(keys[:2])
    store.drain()
    assert books.queries.unpersisted() == only_in_memory() < before
    store.delete(keys[2:3])
    store.evict(1, tier=0)
    store.drain()
    assert books.queries.unpersisted() == only_in_memory()
    assert store.stats()["blocks_memory_only"] == books.queries.unpersisted()
    store.flush()
    assert books.queries.unpersisted() == only_in_memory() == 0
    store.close()


def test_tierio_refuses_a_call_under_the_lock(tmp_path: Path) -> None:
    layout = small_layout()
    store, _ = checked_store(layout, tmp_path)
    keys = store.hash_tokens(torch.arange(layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 1))
    io = store.engine.datapath.io

    def through_tierio(entry: object) -> bool:  # runs under the books' lock
        io.view(0, keys[0])
        return False

    with pytest.raises(AssertionError, match="under the books' lock"):
        store.engine.datapath.books.pins.pin_where(keys, through_tierio)
    assert store.lookup(keys) == 1  # the lock was released on the way out
    store.close()
