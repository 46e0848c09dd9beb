"""Live tier read speeds: the fit, its decay, staleness, and the figures a store shows."""

from __future__ import annotations

import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvstore import KVStore
from kvstore.errors import ConfigError
from kvstore.pools import map_or_inline
from kvstore.speeds import ReadSpeed, RunShare, runqueue_wait_s
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import cpu_starved


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


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_a_read_starved_of_cpu_is_timed_without_its_wait_to_run() -> None:
    """Three busy processes on the reading thread's one CPU make its work take about
    four times as long on the wall clock; less the run-queue wait, the time is the
    work's own (what a read sample of a tier keeps: kvstore.datapath.tierio)."""
    cpu = min(os.sched_getaffinity(0))

    def work() -> tuple[float, float]:
        waited, start = runqueue_wait_s(), time.perf_counter()
        total = 0
        for i in range(3_000_000):
            total += i
        return time.perf_counter() - start, runqueue_wait_s() - waited

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # this thread only
    try:
        quiet, _ = work()
        with cpu_starved(cpu):
            wall, waited = work()
    finally:
        os.sched_setaffinity(0, before)
    assert wall > 2 * quiet  # starved
    assert wall - waited < 1.6 * quiet  # its own time, the wait taken out


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_a_read_spread_over_pool_threads_is_timed_by_the_share_of_them_that_ran() -> None:
    """The disk and S3 tiers read on pools of their own (kvstore.pools.map_or_inline):
    the caller only waits for them, so its own run-queue wait says nothing. Each task
    adds its time and its wait to the caller's RunShare, and the call's seconds are
    scaled by the share of the tasks' time that ran."""
    cpu = min(os.sched_getaffinity(0))

    def work(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    def timed(pool: ThreadPoolExecutor) -> tuple[float, float]:
        with RunShare.timing() as share:
            start = time.perf_counter()
            map_or_inline(pool, work, [1_000_000] * 3)
            elapsed = time.perf_counter() - start
            return elapsed, share.running(elapsed, 0.0)

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # the pool's threads, made by this one, inherit it
    pool = ThreadPoolExecutor(1)
    try:
        quiet, _ = timed(pool)
        with cpu_starved(cpu):
            wall, running = timed(pool)
    finally:
        pool.shutdown()
        os.sched_setaffinity(0, before)
    assert wall > 2 * quiet  # the pool's thread was starved
    assert running < 1.6 * quiet  # what ran, the waits taken out
    assert RunShare.current() is None  # the share was this call's alone


def test_a_run_share_takes_the_callers_own_wait_then_scales_by_its_tasks_share() -> None:
    share = RunShare()
    assert share.running(1.0, 0.25) == pytest.approx(0.75)  # no pool tasks
    share.add(2.0, 1.5)
    share.add(2.0, 0.5)  # half of the tasks' time waited
    assert share.running(1.0, 0.0) == pytest.approx(0.5)
    # The caller waited 0.25 s to run once the tasks ended (it sleeps while they run):
    # of the other 0.75 s, half ran.
    assert share.running(1.0, 0.25) == pytest.approx(0.375)
    assert share.running(1.0, 2.0) == pytest.approx(1e-9)  # never 0 or less


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_a_stopped_pools_threads_leave_no_open_file_behind() -> None:
    """The run-queue reading keeps one file open per thread; a pool stopped while a
    reference cycle holds it (as a restarted store's does) must not keep them open until
    the garbage collector runs."""

    class Holder:
        def __init__(self) -> None:
            self.pool = ThreadPoolExecutor(4)
            self.me = self  # a cycle: only the collector frees it

    runqueue_wait_s()
    before = len(os.listdir("/proc/self/fd"))
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(10):
            holder = Holder()
            waits = list(holder.pool.map(lambda _: runqueue_wait_s(), range(16)))
            holder.pool.shutdown(wait=True)
            assert all(w >= 0.0 for w in waits)
            del holder
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        if gc_was:
            gc.enable()


def test_a_share_inside_another_passes_its_tasks_on() -> None:
    """A caller timing several tier reads (a speed probe) sees their pools' waits."""
    with RunShare.timed() as took, RunShare.timing() as inner:
        inner.add(2.0, 1.5)  # a pool task of a read inside: three quarters waited
    assert took.running_s == pytest.approx(took.wall_s * 0.25)
    assert RunShare.current() is None
