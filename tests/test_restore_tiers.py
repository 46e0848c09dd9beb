"""Planned against actual load time per tier: a plan's seconds split by tier level, and a
restore from two tiers (host memory and a disk of real files) timed per tier in
``stats()["restore"]``, with only the restoring thread's own reads counted."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.restore.planner import RestoreCosts, RestoreRequest, plan_restore
from kvstore.restore.prefill import PrefillSpeed
from kvstore.restore.speeds import ReadSpeed, SpeedEstimate
from kvstore.restore.stats import LoadMark
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()
N = 4


def two_tiers(tmp_path: Path) -> dict[str, Any]:
    """Host memory over a disk of real files; a prefill so slow that every load pays."""
    return {
        "tiers": [
            {"kind": "host", "capacity": 64 * LAYOUT.block_nbytes},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
        ],
        "restore": {"prefill_tokens_per_s": 1.0},
    }


def split(store: KVStore, kv: torch.Tensor, head: int) -> list[Any]:
    """``N`` chunks on disk, the first ``head`` of them in host memory too."""
    keys = store.hash_tokens(list(range(N * LAYOUT.block_tokens)), namespace="m")
    assert store.put(keys, kv) == N
    store.flush()
    assert store.evict(N, tier=0)
    assert store.engine.datapath.promote(keys[:head], tier=0) == head
    assert [store.engine.datapath.where(k)[0] for k in keys] == [0] * head + [1] * (N - head)
    return keys


def test_a_plans_load_time_splits_by_tier() -> None:
    def speed(gbps: float, ms: float) -> SpeedEstimate:
        return SpeedEstimate(gbps, ms, "configured", 0.0, None)

    rate = PrefillSpeed(None, 100.0, False, 30.0, time.monotonic)
    costs = RestoreCosts(256, 32_000_000, [speed(10, 0), speed(1, 1)], frozenset({0}), rate)
    plan = plan_restore(RestoreRequest([0, 0, 1, 1, 1]), costs)
    assert plan.load == 5 and plan.tier_chunks == {0: 2, 1: 3}
    assert plan.tier_load_s[0] == pytest.approx(2 * 32e6 / 10e9)
    assert plan.tier_load_s[1] == pytest.approx(1e-3 + 3 * 32e6 / 1e9)
    assert sum(plan.tier_load_s.values()) == pytest.approx(plan.load_s)
    assert plan.as_dict()["tier_load_ms"][1] == pytest.approx(plan.tier_load_s[1] * 1e3)


def test_a_restore_from_two_tiers_is_timed_per_tier(tmp_path: Path) -> None:
    kv = random_blocks(LAYOUT, N, seed=3)
    out = torch.empty(LAYOUT.tensor_shape(N), dtype=LAYOUT.dtype)
    with KVStore(LAYOUT, two_tiers(tmp_path)) as store:
        keys = split(store, kv, head=2)
        store.drain()
        plan = store.plan(keys)
        assert (plan.load, plan.tier_chunks) == (N, {0: 2, 1: 2})
        assert store.get_prefix(keys, out) == N and torch.equal(out, kv)
        restore = store.stats()["restore"]
        assert restore["restores_timed"] == 1
        for level in (0, 1):  # both tiers' planned and actual seconds, each above zero
            assert restore[f"load_planned_s_tier{level}"] > 0
            assert restore[f"load_actual_s_tier{level}"] > 0
        planned = restore["load_planned_s_tier0"] + restore["load_planned_s_tier1"]
        assert planned == pytest.approx(restore["load_planned_s"])
        # The tiers' reads ran inside the timed restore: their seconds are part of it.
        actual = restore["load_actual_s_tier0"] + restore["load_actual_s_tier1"]
        assert actual <= restore["load_actual_s"]
        assert store.get_prefix(keys, out) == N  # the second restore adds to the same figures
        again = store.stats()["restore"]
        assert again["restores_timed"] == 2
        assert again["load_actual_s_tier0"] > restore["load_actual_s_tier0"]


def test_only_the_restoring_threads_reads_count() -> None:
    speed = ReadSpeed(1.0, 1.0, 30.0, 300.0, time.monotonic)
    mark = LoadMark.now([speed.thread_seconds()])
    elsewhere = threading.Thread(target=speed.observe, args=(1e6, 5.0))  # warming, a probe
    elsewhere.start()
    elsewhere.join()
    speed.observe(1e6, 0.25)  # the restore's own read
    _, tiers = mark.since([speed.thread_seconds()])
    assert tiers == {0: pytest.approx(0.25)}
    assert LoadMark.now([]).since([])[1] == {}  # speeds not kept: no tier figures
