"""The closed loop that prices a tier (kvstore/restore/speeds.py): each restore corrects the
tier's price by what its reads cost against what the fit says; a probe finds a tier
again once it got faster; the correction stays within its bounds whatever the noise."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVStore
from kvstore.config import DiskTierConfig
from kvstore.restore.planner import RestorePlan
from kvstore.restore.speeds import CORRECTION_BOUNDS, PROBE_READS, ReadSpeed, fastest_reads
from kvstore.restore.stats import LoadSample, PlannedLoad
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import FaultyTier
from kvstore.tiers import create_tier

LAYOUT = small_layout()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def model_wait(load: PlannedLoad[Any], x: float) -> float:
    """What the plan's model says the engine waits when every read takes ``x`` times its
    priced seconds (the function :meth:`PlannedLoad.scale` inverts)."""
    assert load.compute_s is not None
    g = load.groups
    piped = (load.load_s - load.staged_s) * x
    return load.staged_s * x + max(piped - load.compute_s * (1 - 1 / g), piped / g)


def test_a_tier_three_times_slower_than_its_fit_is_priced_right_after_a_few_restores() -> None:
    speed = ReadSpeed(1.0, 1.0, half_life_s=30.0, stale_s=300.0, clock=Clock())
    nbytes = 8e6
    fit_s = speed.fitted().seconds_for(nbytes)
    for _ in range(4):
        planned = speed.estimate().seconds_for(nbytes)
        speed.correct(3 * fit_s, nbytes, 1, planned)
    assert speed.estimate().seconds_for(nbytes) == pytest.approx(3 * fit_s, rel=0.1)
    assert speed.estimate().correction == pytest.approx(3.0, rel=0.1)
    assert speed.stats()["read_estimate_error"] < 0  # the plans were too hopeful


def _disk_store(tmp_path: Path, **restore: Any) -> tuple[KVStore, FaultyTier, Clock]:
    clock = Clock()
    disk = FaultyTier(create_tier(DiskTierConfig(path=str(tmp_path), capacity=1 << 26), LAYOUT))
    config = {"tiers": [disk.config.to_dict()], "restore": restore}
    return KVStore(LAYOUT, config, tiers=[disk], clock=clock), disk, clock


def test_the_engines_wait_under_compute_prices_the_tier(tmp_path: Path) -> None:
    """A load under compute the engine waits three times as long for as the plan
    expected (the plan's model: its reads three times as slow) prices the tier at three
    times its fit within a few restores: the next plans expect what the engine saw."""
    # Declared with no latency a call: read a layer a call, in a pipeline of 3 groups.
    store, _, _ = _disk_store(
        tmp_path, prefill_tokens_per_s=2000, tier_speeds={"disk:0": [0.01, 0.0]}
    )
    with store:
        keys = store.hash_tokens(list(range(4 * LAYOUT.block_tokens)), namespace="m")
        store.put(keys, random_blocks(LAYOUT, 4))
        first = store.plan(keys, prompt_tokens=8 * LAYOUT.block_tokens, overlap=True)
        assert (first.load, first.groups) == (4, 3) and first.compute_s
        shipped = store.engine.planned_load(first)  # what a loading process is handed: tier ids
        assert set(shipped.tiers) == {"disk:0"} and shipped.load_s == first.load_s
        for _ in range(5):
            plan = store.plan(keys, prompt_tokens=8 * LAYOUT.block_tokens, overlap=True)
            k = store.stats()["tiers"][0]["read_correction"]
            load = PlannedLoad.of(plan, LAYOUT.block_nbytes)
            store.engine.waited(plan, model_wait(load, 3.0 / k))  # reads 3x their fit
        tier = store.stats()["tiers"][0]
        assert tier["read_correction"] == pytest.approx(3.0, rel=0.1)
        assert tier["read_estimate_error"] < 0
        again = store.plan(keys, prompt_tokens=8 * LAYOUT.block_tokens, overlap=True)
        assert again.load_s == pytest.approx(3 * first.load_s, rel=0.1)
        restore = store.stats()["restore"]
        assert restore["restores_timed"] == 5 and restore["load_actual_s_tier0"] > 0


def test_a_tier_priced_out_that_got_faster_is_found_again_by_its_probe(tmp_path: Path) -> None:
    """Reads that took 0.2 s a call price the disk out (4 chunks recompute in 40 ms);
    nothing reads it after that, so only a probe can see it recover: the first plan
    after its estimate goes stale probes it, and the plan after the probe loads."""
    store, disk, clock = _disk_store(
        tmp_path, prefill_tokens_per_s=800, speed_stale_s=60, speed_half_life_s=10
    )
    out = torch.empty(LAYOUT.tensor_shape(4), dtype=LAYOUT.dtype)
    with store:
        keys = store.hash_tokens(list(range(4 * LAYOUT.block_tokens)), namespace="m")
        store.put(keys, random_blocks(LAYOUT, 4))
        disk.delay_s = 0.2
        assert store.get_prefix(keys, out) == 4  # planned on the prior: loaded, slowly
        clock.now += 1
        assert store.plan(keys).load == 0  # priced out
        disk.delay_s = 0.0  # the disk recovers; no plan reads it
        clock.now += 30
        assert store.plan(keys).load == 0 and store.stats()["restore"].get("stale_probes", 0) == 0
        clock.now += 31  # 61 s without a read: stale
        assert store.plan(keys).load == 0
        assert store.stats()["restore"]["stale_probes"] == 1
        assert store.drain(10.0)
        assert store.plan(keys).load == 4
        tier = store.stats()["tiers"][0]
        assert tier["read_speed_source"] == "measured" and tier["read_correction"] == 1.0


def test_a_probe_of_a_stale_tier_starts_its_price_over() -> None:
    clock = Clock()
    speed = ReadSpeed(1.0, 1.0, half_life_s=10.0, stale_s=60.0, clock=clock)
    speed.observe(1e6, 1.0)  # slow reads ...
    speed.correct(20.0, 1e6, 1, 1.0)  # ... and slower restores
    assert speed.estimate().correction > 2
    clock.now = 30.0
    speed.probed([(1e6, 0.001)])  # a fresh estimate: the probe joins it
    assert speed.estimate().correction > 2 and speed.fitted().samples > 1
    clock.now = 100.0  # stale: the probe alone stands
    speed.probed([(1e6, 0.001), (4e6, 0.004)])
    est = speed.estimate()
    assert (est.correction, est.source) == (1.0, "measured")
    assert est.gbps == pytest.approx(1.0, rel=1e-6)


def test_a_probe_that_finds_the_medium_as_it_was_keeps_half_the_correction() -> None:
    """Restores that cost three times their reads priced the tier out; its stale probe
    finds the medium as the fit had it, so the correction moves halfway (in log space)
    towards 1, not back to 1: the next plan does not load the tier at once again (before,
    every stale probe threw the restores' evidence away)."""
    clock = Clock()
    speed = ReadSpeed(1.0, 1.0, half_life_s=10.0, stale_s=60.0, clock=clock)
    for _ in range(6):
        speed.observe(1e6, 0.002)
        speed.correct(3 * speed.fitted().seconds_for(1e6), 1e6, 1, 0.002)
    k = speed.estimate().correction
    assert k == pytest.approx(3.0, rel=0.05)
    clock.now = 100.0  # stale
    speed.probed([(1e6, 0.002), (4e6, 0.0051)])  # the same medium, read again
    est = speed.estimate()
    assert est.source == "measured"
    assert est.correction == pytest.approx(math.sqrt(k), rel=1e-6)


def test_a_probe_behind_a_links_latency_sees_its_bandwidth() -> None:
    """bench_restore's drift at 200 MB/s behind 50 ms: a probe's layer (256 KiB) and
    four layers took 76 and 70 ms. The fit made that an 18 MB/s link (the bytes given
    all the time but the prior's latency), and the plans never loaded it; sizes four
    times apart that cost the same say the bytes are cheap."""
    clock = Clock()
    speed = ReadSpeed(0.02, 50.0, half_life_s=30.0, stale_s=5.0, clock=clock)
    clock.now = 10.0  # never read: stale
    speed.probed([(262144.0, 0.0759), (1048576.0, 0.0696)])
    est = speed.estimate()
    assert est.gbps > 0.05 and 50 < est.latency_ms < 80  # not 0.018
    # What a restore of 9 chunks of 3 MiB then costs: under half a second (at the old
    # figures, 1.5 s: more than the 1 s prefill it replaces).
    assert est.seconds_for(9 * 3 * 2**20) < 0.5


def test_a_probe_reads_a_whole_block_where_its_sizes_took_about_as_long() -> None:
    """Behind 20 ms a call, a layer (1 ms) and four take 21 and 24 ms: the bytes do not
    show, so the probe reads the whole block too, and the fit sees the bandwidth."""
    sizes: list[int] = []

    def read(layers: int) -> bool:
        sizes.append(layers)
        time.sleep(0.02 + 0.001 * layers)
        return True

    samples = fastest_reads(read, [1, 4, 12], layer_nbytes=10**6, until_seen=True)
    assert samples is not None and [int(n) // 10**6 for n, _ in samples] == [1, 4, 12]
    assert sizes == [1] * PROBE_READS + [4] * PROBE_READS + [12] * PROBE_READS
    speed = ReadSpeed(0.001, 1.0, half_life_s=30.0, stale_s=300.0, clock=Clock())
    speed.probed(samples)
    assert 0.5 < speed.estimate().gbps < 1.5  # 1 GB/s: a layer of 1 MB a millisecond
    # Where the second size's bytes show (a call's latency 1 ms), the third is not read.
    sizes.clear()
    slow = fastest_reads(
        lambda n: time.sleep(0.001 + 0.004 * n) is None, [1, 4, 12], 10**6, 1, True
    )
    assert slow is not None and len(slow) == 2


def test_a_tier_never_read_goes_stale_on_the_same_timer() -> None:
    clock = Clock()
    speed = ReadSpeed(1.0, 1.0, half_life_s=10.0, stale_s=60.0, clock=clock)
    assert speed.estimate().source == "configured"
    clock.now = 61.0
    assert speed.estimate().source == "stale" and speed.estimate().gbps == 1.0


ratios = st.floats(min_value=1e-4, max_value=1e4, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    noise=st.lists(st.tuples(ratios, st.floats(1e3, 1e9), st.integers(1, 64)), max_size=60),
    reads=st.lists(st.tuples(st.floats(1e3, 1e9), st.floats(1e-6, 10.0)), max_size=10),
)
def test_the_correction_stays_within_its_bounds_under_any_noise(
    noise: list[tuple[float, float, int]], reads: list[tuple[float, float]]
) -> None:
    low, high = CORRECTION_BOUNDS
    speed = ReadSpeed(2.0, 0.5, half_life_s=10.0, stale_s=60.0, clock=Clock())
    for nbytes, seconds in reads:
        speed.observe(nbytes, seconds)
    for ratio, nbytes, calls in noise:
        fit = speed.fitted().seconds_for(nbytes, calls)
        speed.correct(ratio * fit, nbytes, calls, speed.estimate().seconds_for(nbytes))
        est = speed.estimate()
        assert low * (1 - 1e-9) <= est.correction <= high * (1 + 1e-9)
        assert math.isfinite(est.gbps) and est.gbps > 0 and est.latency_ms >= 0


@settings(max_examples=300, deadline=None)
@given(
    load=st.floats(1e-4, 100.0),
    staged=st.floats(0.0, 1.0),
    compute=st.floats(0.0, 100.0),
    groups=st.integers(1, 80),
    x=st.floats(0.01, 100.0),
)
def test_the_engines_wait_is_read_back_as_the_loads_scale(
    load: float, staged: float, compute: float, groups: int, x: float
) -> None:
    """:meth:`PlannedLoad.scale` inverts the plan's model of the engine's wait."""
    planned = PlannedLoad({0: (load, 1e6, 1)}, load, compute, groups, staged * load)
    assert planned.scale(model_wait(planned, x)) == pytest.approx(x, rel=1e-6)
    assert planned.samples(x)[0] == LoadSample(x * load, 1e6, 1, load)


def test_a_load_before_compute_scales_by_its_own_seconds() -> None:
    plan = RestorePlan(4, 0, 4, 0.2, 0.1, 0.3, 0.4, 0, "all", {1: 4}, (), {1: 0.2}, {1: 1}, 0.1)
    load = PlannedLoad.of(plan, 1000)
    assert (load.groups, load.tiers) == (1, {1: (0.2, 4000, 1)})
    assert load.scale(0.6) == pytest.approx(3.0)
    assert load.named(["host:0", "disk:0"]).tiers == {"disk:0": (0.2, 4000, 1)}
    assert PlannedLoad({}, 0.2, None).scale(0.6) is None  # no compute estimate
