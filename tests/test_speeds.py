"""Live tier read speeds: the fit, its decay, staleness, and the figures a store shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore import KVStore
from kvstore.errors import ConfigError
from kvstore.restore.speeds import ReadSpeed
from kvstore.testing.data import random_blocks, small_layout


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def speed(clock: Clock, gbps: float = 2.0, latency_ms: float = 0.5) -> ReadSpeed:
    return ReadSpeed(gbps, latency_ms, half_life_s=10.0, stale_s=60.0, clock=clock)


def test_the_configured_figures_stand_until_a_read_is_seen() -> None:
    est = speed(Clock()).estimate()
    assert (est.gbps, est.latency_ms, est.source, est.age_s) == (2.0, 0.5, "configured", None)
    assert est.seconds_for(2e9, calls=2) == pytest.approx(1.001)


def test_reads_of_several_sizes_give_latency_and_bandwidth() -> None:
    clock = Clock()
    s = speed(clock)
    for i, nbytes in enumerate([1e6, 8e6, 32e6, 4e6, 16e6] * 4):
        clock.now = i * 0.1
        s.observe(nbytes, 0.003 + nbytes / 5e9)  # 3 ms a call, 5 GB/s
    est = s.estimate()
    assert est.source == "measured"
    assert est.gbps == pytest.approx(5.0, rel=1e-6)
    assert est.latency_ms == pytest.approx(3.0, rel=1e-6)


def test_reads_of_one_size_keep_the_configured_latency() -> None:
    s = speed(Clock(), latency_ms=1.0)
    for _ in range(5):
        s.observe(1e9, 0.101)  # 1 GB in 101 ms
    est = s.estimate()
    assert est.latency_ms == pytest.approx(1.0)
    assert est.gbps == pytest.approx(10.0)
    tiny = speed(Clock(), latency_ms=50.0)
    tiny.observe(1e6, 0.004)  # a call faster than the configured latency: at most half of it
    assert tiny.estimate().latency_ms == pytest.approx(2.0)


def test_a_tier_that_slows_down_is_seen_within_a_few_half_lives() -> None:
    clock = Clock()
    s = speed(clock, latency_ms=0.0)
    for i in range(50):
        clock.now = i
        s.observe(1e9, 0.5)  # 2 GB/s
    assert s.estimate().gbps == pytest.approx(2.0)
    for i in range(50, 80):  # 30 s (three half-lives) at 0.2 GB/s
        clock.now = i
        s.observe(1e9, 5.0)
    assert 0.2 <= s.estimate().gbps < 0.25


def test_an_estimate_without_reads_goes_stale() -> None:
    clock = Clock()
    s = speed(clock)
    s.observe(1e6, 0.01)
    clock.now = 59.0
    assert s.estimate().source == "measured"
    clock.now = 61.0
    est = s.estimate()
    assert est.source == "stale" and est.age_s == pytest.approx(61.0)
    s.observe(0, 0.01)  # a read that found nothing is no observation
    assert s.estimate().source == "stale"


def test_a_store_shows_what_its_reads_measured(tmp_path: Path) -> None:
    layout = small_layout()
    config = {
        "tiers": [{"kind": "disk", "path": str(tmp_path), "read_gbps": 0.5, "read_latency_ms": 2}]
    }
    with KVStore(layout, config) as store:
        before = store.stats()["tiers"][0]
        assert before["read_speed_source"] == "configured"
        assert (before["read_gbps_estimate"], before["read_latency_ms_estimate"]) == (0.5, 2.0)
        keys = store.hash_tokens(torch.arange(4 * layout.block_tokens), "m")
        store.put(keys, random_blocks(layout, 4))
        for n in (1, 4, 2):
            store.get(keys[:n])
        after = store.stats()["tiers"][0]
        assert after["read_speed_source"] == "measured" and after["read_speed_samples"] > 2
        assert after["read_gbps_estimate"] > 0 and after["read_latency_ms_estimate"] >= 0


def test_speed_settings_are_checked() -> None:
    layout = small_layout()
    with pytest.raises(ConfigError, match="read_gbps"):
        KVStore(layout, {"tiers": [{"kind": "host", "capacity": "1MiB", "read_gbps": 0}]})
    with pytest.raises(ConfigError, match="speed_half_life_s"):
        KVStore(layout, {"restore": {"speed_half_life_s": 0}})
