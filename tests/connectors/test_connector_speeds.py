"""What the vLLM scheduler side learns about speeds: the workers' tier reads shipped as
counters, and the engine's prefill speed from its own step times."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore import KVStore
from kvstore.connectors.speeds import READS_PREFIX, EngineSpeeds, ReadDeltas, reads_from
from kvstore.testing.data import random_blocks, small_layout


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def disk_store(tmp_path: Path, **disk: object) -> KVStore:
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "16MiB", **disk}]}
    return KVStore(small_layout(), config)


def test_a_workers_reads_reach_the_schedulers_estimate(tmp_path: Path) -> None:
    layout = small_layout()
    with disk_store(tmp_path) as worker, disk_store(tmp_path, read_gbps=0.001) as scheduler:
        keys = worker.hash_tokens(list(range(4 * layout.block_tokens)), namespace="m")
        worker.put(keys, random_blocks(layout, 4))
        reads = ReadDeltas(worker)
        assert reads.take() == {}  # nothing read yet
        worker.get(keys)
        worker.get(keys[:2])
        shipped = reads.take()
        assert shipped[f"{READS_PREFIX}disk:0/calls"] == 2
        assert shipped[f"{READS_PREFIX}disk:0/bytes"] == 6 * layout.block_nbytes
        assert reads.take() == {}  # deltas: each read is shipped once
        before = scheduler.stats()["tiers"][0]
        assert before["read_speed_source"] == "configured"
        speeds = EngineSpeeds(scheduler)
        speeds.step_ended(SimpleNamespace(data={**shipped, "load_chunks": 3}))
        after = scheduler.stats()["tiers"][0]
        assert after["read_speed_source"] == "measured"
        assert after["read_gbps_estimate"] > before["read_gbps_estimate"]


def test_reads_from_ignores_other_counters_and_tiers_never_read() -> None:
    data = {
        f"{READS_PREFIX}s3:0/bytes": 10.0,
        f"{READS_PREFIX}s3:0/seconds": 0.5,
        f"{READS_PREFIX}s3:0/calls": 2,
        f"{READS_PREFIX}disk:0/calls": 0,
        f"{READS_PREFIX}broken": 1,
        "load_chunks": 4,
    }
    assert reads_from(data) == {"s3:0": (10.0, 0.5, 2)}


def test_steps_that_load_nothing_teach_the_prefill_speed(tmp_path: Path) -> None:
    clock = Clock()
    with disk_store(tmp_path) as store:
        speeds = EngineSpeeds(store, clock)
        for tokens in (512, 2048, 1024, 4096):
            speeds.step_started(tokens, loads=False)
            clock.now += tokens / 8_000  # 8K tokens a second
            speeds.step_ended(None)
        speeds.step_started(4096, loads=True)  # a step that loads: not a prefill sample
        clock.now += 5.0
        speeds.step_ended(None)
        restore = store.stats()["restore"]
        assert restore["prefill_source"] == "learned"
        assert restore["prefill_tokens_per_s"] == pytest.approx(8_000)


def test_overlapping_steps_are_not_learned_from(tmp_path: Path) -> None:
    clock = Clock()
    with disk_store(tmp_path) as store:
        speeds = EngineSpeeds(store, clock)
        for _ in range(5):  # asynchronous scheduling: the next step is built first
            speeds.step_started(1024, loads=False)
            speeds.step_started(1024, loads=False)
            clock.now += 0.1
            speeds.step_ended(None)
            speeds.step_ended(None)
        speeds.step_ended(None)  # a result with no step open: ignored
        assert store.stats()["restore"]["prefill_source"] == "unknown"
