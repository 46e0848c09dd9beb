"""Room and eviction: two evictions of one block (from two tiers) must never wait for
each other.

Found by the memory soak (issue 32): a demotion (a session hint) chose its blocks one
by one, waiting for each block in use; a block chosen before such a wait could be
claimed meanwhile by an eviction of the disk tier, then claimed again by the demotion.
Each eviction then waited for the other's pin to drop, forever: both mover threads
stuck, every put waiting for room behind them, the kvstore-server answering nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvstore import KVStore, StoreConfig
from kvstore.config import DiskTierConfig, HostTierConfig
from kvstore.keys import BlockKey
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.lockcheck import LockCheckedTier
from kvstore.tiers import create_tier
from kvstore.tiers.base import Tier

_HANG_S = 20.0  # far beyond the operations' own length: not done by then means hung


class StalledTier(LockCheckedTier):
    """A real tier whose writes stop while ``stalled`` is set (a medium that stalls,
    which a real disk does not do on demand); ``entered`` is set by a stalled write."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.stalled = threading.Event()
        self.entered = threading.Event()
        self.resume = threading.Event()

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        if self.stalled.is_set():
            self.entered.set()
            self.resume.wait(_HANG_S)
        return super().put(keys, blocks)


def _until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until true; fail (naming ``what``) if it never gets there."""
    end = time.monotonic() + _HANG_S
    while not check():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


def test_a_demotion_and_a_disk_eviction_of_one_block_do_not_wait_for_each_other(
    tmp_path: Path,
) -> None:
    layout = small_layout()
    configs = (
        HostTierConfig(capacity=8 * layout.block_nbytes, prefault=False),
        DiskTierConfig(path=str(tmp_path / "a"), capacity=64 << 20),
        DiskTierConfig(path=str(tmp_path / "b"), capacity=64 << 20),
    )
    tiers = [StalledTier(create_tier(c, layout)) for c in configs]
    store = KVStore(layout, StoreConfig(tiers=configs, lease_s=60.0), tiers=tiers)
    keys = [bytes([i]) * 16 for i in (1, 3)]
    first, pinned = keys
    assert store.put(keys, random_blocks(layout, 2)) == 2
    pin = store.pin([pinned])  # a reader holds the second block
    assert store.hint(keys, demote=True).demoted == 2  # waits for that reader
    _until(lambda: all(1 in store.engine.datapath.where(k) for k in keys), "the demotion's copies")

    tiers[2].stalled.set()  # the disk eviction below stops mid-way, its victim claimed
    evicted: list[list[BlockKey]] = []
    disk_eviction = threading.Thread(target=lambda: evicted.append(store.evict(1, tier=1)))
    disk_eviction.start()
    _until(tiers[2].entered.is_set, "the disk eviction's copy further down")
    pin.release()  # the demotion goes on while the disk eviction holds the first block
    time.sleep(0.3)  # room for the demotion to claim its blocks (the bug: both of them)
    tiers[2].resume.set()

    disk_eviction.join(_HANG_S)
    assert not disk_eviction.is_alive(), "the disk eviction hung (a demotion holds its block)"
    assert evicted == [[first]]
    _until(lambda: store.stats()["moves_pending"] == 0, "the demotion's end")
    assert 0 not in store.engine.datapath.where(first)  # demoted out of memory after all
    assert store.get(keys).shape == layout.tensor_shape(2)  # both still stored
    store.close()
