"""Restore planning counts what an encoded tier moves (issue 55): its reads are priced on
the encoded bytes plus the decode time measured on this machine, so the same slow tier
holding fp8 blocks is loaded where holding plain ones it is recomputed."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.config import DiskTierConfig
from kvstore.restore.planner import RestoreCosts, RestoreRequest, plan_restore
from kvstore.restore.prefill import PrefillSpeed
from kvstore.restore.speeds import ReadSpeed, SpeedEstimate
from kvstore.testing.data import small_layout
from kvstore.tiers.disk import DiskTier

MB = 1_000_000
CT = 256


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def disk_tier(path: Path, encoding: str) -> DiskTier:
    layout = small_layout(block_tokens=64, head_dim=128, num_kv_heads=8)
    return DiskTier(DiskTierConfig(path=str(path), capacity=1 << 26, encoding=encoding), layout)


def bucket(gbps: float, stored: tuple[float, float]) -> ReadSpeed:
    """A slow bucket of ``gbps``, as configured; its calls' latency left out (it is the
    same plain or encoded, and paid once a load: it would blur what this compares)."""
    return ReadSpeed(gbps, 0.0, half_life_s=10.0, stale_s=1e9, clock=Clock(), stored=stored)


def costs(slow: SpeedEstimate, tokens_per_s: float) -> RestoreCosts:
    memory = SpeedEstimate(10.0, 0.0, "configured", 0.0, None)
    return RestoreCosts(
        chunk_tokens=CT,
        chunk_bytes=32 * MB,
        speeds=[memory, slow],
        fast=frozenset({0}),
        prefill=PrefillSpeed(None, tokens_per_s, False, 30.0, time.monotonic),
    )


def test_the_same_slow_tier_with_fp8_is_loaded_where_plain_is_recomputed(tmp_path: Path):
    plain_tier, fp8_tier = disk_tier(tmp_path / "a", "none"), disk_tier(tmp_path / "b", "fp8_e4m3")
    ratio, decode = fp8_tier.stored_bytes()  # measured decode on this machine
    assert plain_tier.stored_bytes() == (1.0, 0.0)
    assert 0.5 < ratio < 0.55 and decode > 0
    # A bucket slow enough for half its bytes to pay for the decoding as measured here
    # (on a quiet core fp8 decodes at ~0.3 GB/s: a 20 MB/s bucket is far slower; a busy
    # machine measures its decoding slower, and the same holds for a slower bucket).
    gbps = (1 - ratio) / (decode * 1e9) / 4
    plain, fp8 = bucket(gbps, plain_tier.stored_bytes()), bucket(gbps, (ratio, decode))
    plain_s, fp8_s = plain.estimate().seconds_for(32 * MB), fp8.estimate().seconds_for(32 * MB)
    assert plain_s == pytest.approx(32 * MB / (gbps * 1e9))
    assert fp8_s == pytest.approx(32 * MB * (ratio / (gbps * 1e9) + decode))
    assert fp8_s < 0.7 * plain_s
    # an engine that recomputes a chunk in between the two
    recompute_s = (plain_s + fp8_s) / 2
    request = RestoreRequest([1] * 4, prompt_tokens=4 * CT)
    plain_plan = plan_restore(request, costs(plain.estimate(), CT / recompute_s))
    fp8_plan = plan_restore(request, costs(fp8.estimate(), CT / recompute_s))
    assert plain_plan.load == 0 and plain_plan.reason == "pays"
    assert fp8_plan.load == 4 and fp8_plan.reason == "all"
    assert fp8_plan.ready_s is not None and plain_plan.ready_s is not None
    assert fp8_plan.ready_s < plain_plan.ready_s
    plain_tier.close()
    fp8_tier.close()


def test_the_fit_is_of_the_medium_fed_the_encoded_bytes_and_seconds_less_decoding():
    clock = Clock()
    ratio, decode = 0.5, 1e-9  # half the bytes; 1 GB/s of decoding
    speed = ReadSpeed(1.0, 1.0, half_life_s=10.0, stale_s=60.0, clock=clock, stored=(ratio, decode))
    for i, nbytes in enumerate([1e6, 8e6, 32e6, 4e6, 16e6] * 4):
        clock.now = i * 0.1
        # reads of layout bytes: 3 ms a call, the medium at 5 GB/s moving half of them
        speed.observe(nbytes, 0.003 + nbytes * ratio / 5e9 + nbytes * decode)
    est = speed.estimate()
    assert est.gbps == pytest.approx(5.0, rel=1e-6)  # the medium's own bandwidth
    assert est.latency_ms == pytest.approx(3.0, rel=1e-6)
    assert (est.stored_ratio, est.decode_s_per_byte) == (ratio, decode)
    assert est.seconds_for(10e6) == pytest.approx(0.003 + 10e6 * ratio / 5e9 + 10e6 * decode)
    # the same reads, priced as a plain tier's, would fit a slower medium
    plain = ReadSpeed(1.0, 1.0, half_life_s=10.0, stale_s=60.0, clock=clock)
    plain.observe(32e6, 0.003 + 32e6 * ratio / 5e9 + 32e6 * decode)
    assert plain.estimate().gbps < est.gbps


def test_probes_and_corrections_price_the_encoded_reads_alike():
    clock = Clock()
    speed = ReadSpeed(1.0, 1.0, half_life_s=10.0, stale_s=60.0, clock=clock, stored=(0.3, 2e-9))
    layer = 256 * 1024
    speed.probed([(n, 0.001 + n * 0.3 / 2e9 + n * 2e-9) for n in (layer, 4 * layer)])
    est = speed.estimate()
    assert est.gbps == pytest.approx(2.0, rel=1e-6)
    # a restore whose reads cost twice the fit: the price, decoding included, doubles
    planned = est.seconds_for(8 * layer)
    for _ in range(30):
        speed.correct(2 * speed.fitted().seconds_for(8 * layer), 8 * layer, 1, planned)
    assert speed.estimate().seconds_for(8 * layer) == pytest.approx(2 * planned, rel=1e-3)


def test_an_unencoded_tier_is_priced_as_before():
    est = SpeedEstimate(2.0, 0.5, "configured", 0.0, None)
    assert est.seconds_for(2e9, calls=2) == pytest.approx(1.001)
    assert replace(est, stored_ratio=0.5).seconds_for(2e9, calls=2) == pytest.approx(0.501)
