"""Speed probes (``kvstore/datapath/probes.py``): a few small reads of one block, the
fastest of each size kept (noise only adds time), with no wait for a quiet machine."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.config import StoreConfig
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.restore.speeds import PROBE_READS
from kvstore.testing.data import random_blocks
from kvstore.testing.faults import FaultyTier
from kvstore.tiers import create_tier
from kvstore.tiers.base import LayerRange

# 3 MiB blocks of 12 layers (bench_restore's chunks): big enough that a read's bytes, not
# its call, set the time, so the fit tells bandwidth from latency.
LAYOUT = KVLayout(num_layers=12, num_kv_heads=2, head_dim=64, block_tokens=256, dtype=torch.float32)


def _config(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"kind": "host", "capacity": 64 * LAYOUT.block_nbytes},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
        ],
        "restore": {"prefill_tokens_per_s": 1e5},
    }


def _disk(store: KVStore) -> dict[str, Any]:
    return store.stats()["tiers"][1]


def _stored(tmp_path: Path, n: int = 4) -> list[BlockKey]:
    with KVStore(LAYOUT, _config(tmp_path)) as store:
        keys = [bytes([i + 1]) * 16 for i in range(n)]
        store.put(keys, random_blocks(LAYOUT, n))
        store.flush()
    return keys


class _Jittery(FaultyTier):
    """A disk whose first read of every three waits ``stall_s`` first (other work on
    the cores, a busy GIL: noise that only adds time)."""

    def __init__(self, inner: Any, stall_s: float) -> None:
        super().__init__(inner)
        self.stall_s = stall_s
        self.reads = 0

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        self.reads += 1
        if self.reads % 3 == 1:
            time.sleep(self.stall_s)
        return super().get(keys, outs, layers)


def test_a_probe_keeps_the_fastest_of_its_reads(tmp_path: Path) -> None:
    _stored(tmp_path)
    config = _config(tmp_path)
    host_config, disk_config = StoreConfig.load(config).tiers
    disk = _Jittery(create_tier(disk_config, LAYOUT), 0.5)
    tiers = [create_tier(host_config, LAYOUT), disk]
    with KVStore(LAYOUT, config, tiers=tiers) as store:  # probes the disk at open
        assert store.drain(30.0)
        speed = _disk(store)
        # Two sizes, three reads each (a third size, the whole block, where the second's
        # bytes did not show yet).
        sizes, rest = divmod(disk.reads, PROBE_READS)
        assert sizes in (2, 3) and rest == 0
        assert speed["read_speed_source"] == "measured"
        assert speed["read_speed_samples"] == pytest.approx(sizes, rel=1e-3)
        # Each size's stalled read (0.5 s) left out: a page-cached disk reads 3 MiB in
        # milliseconds, not in half a second.
        assert speed["read_gbps_estimate"] * 1e9 * 0.25 > LAYOUT.block_nbytes
        assert store.stats()["blocks_read"] == disk.reads  # probes' reads count


def test_a_probe_measures_at_once_however_busy_its_process_is(tmp_path: Path) -> None:
    """Two busy Python threads kept the old probe waiting for a quiet process for up to
    20 s; a probe now reads at once (its fastest reads are its figures)."""
    _stored(tmp_path)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    busy = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
    for thread in busy:
        thread.start()
    try:
        with KVStore(LAYOUT, _config(tmp_path)) as store:
            assert store.drain(30.0)
            assert _disk(store)["read_speed_source"] == "measured"
    finally:
        stop.set()
        for thread in busy:
            thread.join(5)


def test_a_probe_of_a_block_gone_meanwhile_measures_nothing(tmp_path: Path) -> None:
    key = _stored(tmp_path, 1)[0]
    with KVStore(LAYOUT, {**_config(tmp_path), "restore": {}}) as store:  # no probe at open
        store.delete([key])
        probe = store.engine.datapath.probes
        assert not probe.probe(key)  # not stored: nothing to read, nothing queued
        assert probe.probe_tier([key], 1)  # the tier is asked for it in the background
        store.drain(5.0)
        assert _disk(store)["read_speed_source"] == "configured"


def test_one_probe_of_a_tier_at_a_time_and_one_found_in_the_background(tmp_path: Path) -> None:
    """Two plans in a row of a stale tier queued two probes of it (one per prompt), which
    read it side by side on the link the engine's own loads share; now the second is
    refused while the first is queued or runs. A probe of a tier the plan did not ask
    finds a chunk there itself, off the caller's thread."""
    keys = _stored(tmp_path, 2)
    config = _config(tmp_path)
    host_config, disk_config = StoreConfig.load(config).tiers
    disk = _Jittery(create_tier(disk_config, LAYOUT), 0.2)  # the first read waits 0.2 s
    tiers = [create_tier(host_config, LAYOUT), disk]
    with KVStore(LAYOUT, {**config, "restore": {}}, tiers=tiers) as store:  # none at open
        probe = store.engine.datapath.probes
        assert store.engine.datapath.where(keys[0]) == [1]
        assert probe.probe(keys[0])
        assert not probe.probe(keys[1]) and not probe.probe_tier(keys, 1)  # one at a time
        assert store.drain(30.0)
        first = disk.reads
        assert _disk(store)["read_speed_source"] == "measured"
        store.engine.datapath.io.speeds[1].stale_s = 0.0  # stale at once: probed again
        assert probe.probe_tier(keys, 1) and store.drain(30.0)
        assert disk.reads > first and _disk(store)["read_speed_source"] == "stale"


def test_a_speed_declared_in_tier_speeds_counts_as_declared(tmp_path: Path) -> None:
    """``restore.tier_speeds`` (what ``kvstore calibrate-tiers`` prints) is the disk's
    starting estimate, and like a declared ``read_gbps`` it is not probed at open."""
    _stored(tmp_path)
    config = _config(tmp_path)
    config["restore"]["tier_speeds"] = {"disk:0": [0.25, 3.0]}
    with KVStore(LAYOUT, config) as store:
        time.sleep(0.2)
        store.drain(5.0)
        speed = _disk(store)
        assert speed["read_speed_source"] == "configured"
        assert (speed["read_gbps_estimate"], speed["read_latency_ms_estimate"]) == (0.25, 3.0)
