"""Speed probes (``kvstore/datapath/probes.py``): a probe keeps only what it read while its
process was quiet. A serving engine's process is busy while it starts, when a store
opened over a disk holding blocks probes it; two busy Python threads made a local disk
that reads 1.7 GB/s measure 36 MB/s here, and every restore planned after that recomputed
(bench_restore's fast_planned loaded 1 chunk of 6)."""

from __future__ import annotations

import os
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
from kvstore.testing.faults import cpu_starved

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
    assert not probes.process_busy(starved_ok=True)  # other tests may take the CPUs
    with _BusyThreads():
        time.sleep(0.05)
        assert probes.process_busy(starved_ok=True)


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


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_a_process_whose_cpu_other_processes_take_is_seen_busy() -> None:
    """A vLLM engine's OpenMP threads keep the CPUs without holding the GIL."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        with cpu_starved(cpu):
            assert probes.process_busy()
            assert probes.waits_to_run()
            assert not probes.process_busy(starved_ok=True)  # no Python thread is busy
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_a_probe_starved_of_cpu_by_other_processes_waits_then_measures_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads timed while other processes keep the reader's CPU measured a local disk at
    0.2-0.6 GB/s against 5-11 quiet (less the time their threads waited to run: that
    leaves out the copy engine's threads), and every restore planned after such a probe
    recomputed chunks a load would have served. The probe waits for its CPU instead."""
    monkeypatch.setattr(probes, "PROBE_RETRY_S", 0.05)
    monkeypatch.setattr(probes, "PROBE_TRIES", 400)  # 20 s to find the CPU free
    with KVStore(LAYOUT, _config(tmp_path)) as store:
        keys = [bytes([i]) * 16 for i in range(4)]
        store.put(keys, random_blocks(LAYOUT, 4))
        store.flush()
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # the store's threads, made from here, inherit it
    try:
        with cpu_starved(cpu):
            store = KVStore(LAYOUT, _config(tmp_path))
            time.sleep(0.5)  # several tries, every one starved
            assert _disk(store)["read_speed_source"] == "configured"
        deadline = time.monotonic() + 25
        while _disk(store)["read_speed_source"] == "configured":
            assert time.monotonic() < deadline, _disk(store)
            time.sleep(0.02)
        assert _disk(store)["read_gbps_estimate"] > 0.8  # a page-cached local disk: 5-11
    finally:
        store.close()
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_a_probe_whose_cpu_stays_taken_measures_on_its_last_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probes, "PROBE_RETRY_S", 0.05)
    monkeypatch.setattr(probes, "PROBE_TRIES", 3)
    with KVStore(LAYOUT, _config(tmp_path)) as store:
        store.put([bytes([1]) * 16], random_blocks(LAYOUT, 1))
        store.flush()
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        with cpu_starved(cpu), KVStore(LAYOUT, _config(tmp_path)) as store:
            # Seldom asked: this thread, starved too, would hold the GIL the probe checks.
            deadline = time.monotonic() + 20
            while _disk(store)["read_speed_source"] == "configured":
                assert time.monotonic() < deadline, _disk(store)
                time.sleep(0.5)
            assert _disk(store)["read_speed_samples"] > 0
    finally:
        os.sched_setaffinity(0, before)
