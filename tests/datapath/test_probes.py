"""Speed probes (``kvstore/datapath/probes.py``): a probe keeps only what it read while its
process was quiet. A serving engine's process is busy while it starts, when a store
opened over a disk holding blocks probes it; two busy Python threads made a local disk
that reads 1.7 GB/s measure 36 MB/s here, and every restore planned after that recomputed
(bench_restore's fast_planned loaded 1 chunk of 6)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.datapath import probes
from kvstore.layout import KVLayout
from kvstore.testing.data import random_blocks

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


class _BusyThreads:
    """Python threads that keep the GIL busy until stopped."""

    def __init__(self, n: int = 2) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(n)]

    def _spin(self) -> None:
        while not self.stop.is_set():
            sum(range(1000))

    def __enter__(self) -> _BusyThreads:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


def test_a_process_with_busy_threads_is_seen_busy() -> None:
    assert not probes.process_busy()
    with _BusyThreads():
        time.sleep(0.05)
        assert probes.process_busy()


def test_a_probe_waits_for_a_quiet_process_then_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probes, "PROBE_RETRY_S", 0.05)
    with KVStore(LAYOUT, _config(tmp_path)) as store:
        keys = [bytes([i]) * 16 for i in range(4)]
        store.put(keys, random_blocks(LAYOUT, 4))
        store.flush()
    with _BusyThreads():
        store = KVStore(LAYOUT, _config(tmp_path))
        time.sleep(0.5)  # several tries, every one too busy to measure
        assert _disk(store)["read_speed_source"] == "configured"
    try:
        deadline = time.monotonic() + 10
        while _disk(store)["read_speed_source"] == "configured":
            assert time.monotonic() < deadline, _disk(store)
            time.sleep(0.02)
        # A page-cached local disk: far above the tens of MB/s a busy process measured.
        assert _disk(store)["read_gbps_estimate"] > 0.3
        assert store.stats()["blocks_read"] >= 2  # the probe's reads count as reads
    finally:
        store.close()


def test_a_probe_of_a_block_gone_meanwhile_measures_nothing(tmp_path: Path) -> None:
    with KVStore(LAYOUT, _config(tmp_path)) as store:
        key = bytes([9]) * 16
        store.put([key], random_blocks(LAYOUT, 1))
        store.flush()
    with KVStore(LAYOUT, {**_config(tmp_path), "restore": {}}) as store:  # no probe at open
        store.delete([key])
        probe = store.datapath.probes
        assert probe.probe(key)
        store.drain(5.0)
        assert _disk(store)["read_speed_source"] == "configured"
