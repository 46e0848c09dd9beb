"""Shared tiers: blocks other processes add or remove (a disk directory two stores use)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore import KVStore
from kvstore.testing.data import random_blocks, small_layout


def disk_config(path: Path) -> dict[str, object]:
    return {"tiers": [{"kind": "disk", "path": str(path), "capacity": "64MiB"}]}


def test_blocks_written_after_open_are_discovered(tmp_path: Path) -> None:
    layout = small_layout()
    reader, writer = KVStore(layout, disk_config(tmp_path)), KVStore(layout, disk_config(tmp_path))
    keys = writer.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
    kv = random_blocks(layout, 4)
    writer.put(keys, kv)
    assert reader.stored_keys() == []  # not known yet ...
    assert reader.lookup(keys) == 4  # ... but a lookup asks the shared tier
    assert torch.equal(reader.get(keys), kv)
    reader.close()
    writer.close()


def test_recheck_forgets_blocks_another_process_removed(tmp_path: Path) -> None:
    layout = small_layout()
    scheduler, worker = (
        KVStore(layout, disk_config(tmp_path)),
        KVStore(layout, disk_config(tmp_path)),
    )
    keys = worker.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
    worker.put(keys, random_blocks(layout, 4))
    assert scheduler.lookup(keys) == 4
    worker.delete(keys[2:])  # the worker evicts; the scheduler's index still remembers
    assert scheduler.lookup(keys) == 4  # a stale claim without a recheck
    assert scheduler.lookup(keys, recheck=True) == 2  # confirmed with the disk
    assert scheduler.lookup(keys) == 2  # and the index forgot the gone blocks
    assert sorted(scheduler.stored_keys()) == sorted(keys[:2])
    scheduler.close()
    worker.close()


def test_a_rechecked_lookup_counts_what_it_just_discovered_past_what_it_knew(
    tmp_path: Path,
) -> None:
    """A scheduler knows a prompt's first 2 chunks; a worker stores 3 more: a lookup with
    recheck confirms the 2 and counts the 3 it discovers (not just the 2)."""
    layout = small_layout()
    scheduler, worker = (
        KVStore(layout, disk_config(tmp_path)),
        KVStore(layout, disk_config(tmp_path)),
    )
    keys = worker.hash_tokens(torch.arange(5 * layout.block_tokens), "m")
    kv = random_blocks(layout, 5)
    worker.put(keys[:2], kv[:, :, : 2 * layout.block_tokens])
    assert scheduler.lookup(keys, recheck=True) == 2
    worker.put(keys[2:], kv[:, :, 2 * layout.block_tokens :])
    assert scheduler.lookup(keys, recheck=True) == 5
    worker.delete(keys[1:2])  # a known one gone: the prefix ends there, whatever follows
    assert scheduler.lookup(keys, recheck=True) == 1
    scheduler.close()
    worker.close()


def test_recheck_trusts_copies_in_the_process_own_tiers(tmp_path: Path) -> None:
    layout = small_layout()
    nb = layout.block_nbytes
    config = {
        "tiers": [
            {"kind": "host", "capacity": 8 * nb},
            {"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"},
        ]
    }
    store = KVStore(layout, config)
    keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
    store.put(keys, random_blocks(layout, 2))  # in host memory only (write-back)
    assert store.lookup(keys, recheck=True) == 2  # no disk probe can take them away
    store.close()


def test_stored_keys_rescan_and_clear_reach_other_writers(tmp_path: Path) -> None:
    layout = small_layout()
    mine, other = KVStore(layout, disk_config(tmp_path)), KVStore(layout, disk_config(tmp_path))
    a = mine.hash_tokens(torch.arange(2 * layout.block_tokens), "a")
    b = other.hash_tokens(torch.arange(3 * layout.block_tokens), "b")
    mine.put(a, random_blocks(layout, 2))
    other.put(b, random_blocks(layout, 3))
    assert sorted(mine.stored_keys()) == sorted(a)
    assert sorted(mine.stored_keys(rescan=True)) == sorted(a + b)
    assert mine.clear() == 5
    assert list(tmp_path.rglob("*.kvb")) == []
    assert other.lookup(b, recheck=True) == 0
    mine.close()
    other.close()


def test_abort_layers_frees_the_room_at_once() -> None:
    layout = small_layout()
    store = KVStore(layout, {"tiers": [{"kind": "host", "capacity": 4 * layout.block_nbytes}]})
    keys = store.hash_tokens(torch.arange(2 * layout.block_tokens), "m")
    kv = random_blocks(layout, 2)
    store.put_layer(keys, 0, kv[0])
    tier = store.engine.datapath.tiers[0]
    assert tier.free_blocks == 2
    assert store.abort_layers(keys) == 2
    assert tier.free_blocks == 4 and store.engine.datapath.pinned_blocks() == 0
    assert store.abort_layers(keys) == 0  # nothing left to abort
    store.put_layer(keys, 0, kv[0])  # starting over works
    for layer in range(1, layout.num_layers):
        store.put_layer(keys, layer, kv[layer])
    assert torch.equal(store.get(keys), kv)
    store.close()
