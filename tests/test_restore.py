"""Restore planning: exact plans from given speeds and prefill rates, and the store
following them (get_prefix, warming, stats, the off switch)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.restore.planner import RestoreCosts, RestoreRequest, plan_restore, restore_request
from kvstore.restore.prefill import PrefillSpeed
from kvstore.restore.restorer import Restorer, Warming
from kvstore.restore.speeds import ReadSpeed, SpeedEstimate
from kvstore.testing.data import random_blocks, small_layout

CT = 256  # tokens a chunk
MB = 1_000_000


def _run_now(job: Callable[[], object]) -> bool:
    job()
    return True


@dataclass(frozen=True)
class Parts:
    """The data path as a restorer sees it (:class:`kvstore.restore.RestorerParts`),
    made of the callables a test gives: what a data path would do, and what it saw."""

    lookup: Callable[[Sequence[bytes], bool, int], int]
    where: Callable[[bytes], list[int]]
    speeds: Callable[[], list[SpeedEstimate]]
    fast: frozenset[int]
    warm: Callable[[Sequence[bytes]], int]
    media: tuple[str | None, ...] = ()
    probe: Callable[[bytes], bool] = lambda key: False
    find: Callable[[Sequence[bytes], int], int] = lambda keys, levels: 0
    later: Callable[[Callable[[], object], Callable[[], float]], bool] = lambda job, when: _run_now(
        job
    )
    #: None: this data path cannot warm on the caller's thread (``warms_in_place`` False).
    warm_now: Callable[[Sequence[bytes]], int] | None = None
    staged: bool = False
    thread_reads: Callable[[], Sequence[float]] = lambda: ()
    observe_loads: Callable[[dict[int, Any]], None] = lambda loads: None

    @property
    def warms_in_place(self) -> bool:
        return self.warm_now is not None


def speed(gbps: float, latency_ms: float = 0.0) -> SpeedEstimate:
    return SpeedEstimate(gbps, latency_ms, "configured", 0.0, None)


def prefill(tokens_per_s: float | None = 10_000, table: Any = None) -> PrefillSpeed:
    return PrefillSpeed(table, tokens_per_s, False, 30.0, time.monotonic)


#: Level 0: memory at 10 GB/s; 1: disk at 1 GB/s + 1 ms; 2: a slow bucket, 0.02 GB/s + 50 ms.
SPEEDS = [speed(10.0), speed(1.0, 1.0), speed(0.02, 50.0)]


def costs(rate: float | None = 10_000, overlap_layers: int = 1, **kw: Any) -> RestoreCosts:
    fields: dict[str, Any] = {
        "chunk_tokens": CT,
        "chunk_bytes": 32 * MB,  # 32 MB a chunk: a chunk recomputes in 25.6 ms at 10K tok/s
        "speeds": SPEEDS,
        "fast": frozenset({0}),
        "prefill": prefill(rate),
        "num_layers": overlap_layers,
    }
    fields.update(kw)
    return RestoreCosts(**fields)


def test_all_fast_loads_everything() -> None:
    plan = plan_restore(RestoreRequest([0] * 8), costs())
    assert (plan.load, plan.reason, plan.first, plan.floor) == (8, "all", 0, 8)
    assert plan.load_s == pytest.approx(8 * 32 * MB / 10e9)
    assert plan.recompute_s == pytest.approx(8 * CT / 10_000)
    assert plan.tier_chunks == {0: 8} and plan.warm == ()


def test_a_slow_tail_is_recomputed_and_warmed() -> None:
    # 4 chunks in memory, then 4 only in the slow bucket (1.6 s each to read, 25.6 ms to compute)
    plan = plan_restore(RestoreRequest([0, 0, 0, 0, 2, 2, 2, 2]), costs())
    assert (plan.load, plan.reason) == (4, "pays")
    assert plan.warm == (4, 5, 6, 7)
    assert plan.ready_s is not None and plan.nocache_s is not None
    assert plan.ready_s < plan.nocache_s
    assert plan.tier_chunks == {0: 4}


def test_a_disk_tail_that_pays_is_loaded() -> None:
    # disk: 1 ms + 32 ms a chunk is slower than 25.6 ms of compute: it does not pay...
    assert plan_restore(RestoreRequest([0, 0, 1, 1]), costs()).load == 2
    # ... at 2K tokens a second (128 ms a chunk) it does
    plan = plan_restore(RestoreRequest([0, 0, 1, 1]), costs(rate=2_000))
    assert (plan.load, plan.reason) == (4, "all")
    assert plan.load_s == pytest.approx(2 * 32 * MB / 10e9 + 0.001 + 2 * 32 * MB / 1e9)


def test_a_slow_head_makes_the_whole_prefix_a_miss() -> None:
    plan = plan_restore(RestoreRequest([2, 0, 0, 0]), costs())
    assert (plan.load, plan.floor, plan.reason) == (0, 0, "pays")
    assert plan.warm == (0,)  # only the slow chunk needs warming
    assert plan.ready_s == plan.nocache_s


def test_a_plan_never_loads_less_than_the_fast_tiers_hold() -> None:
    # memory at a (made up) crawl: loading loses, yet what memory holds is loaded
    crawl = [speed(0.001), *SPEEDS[1:]]
    plan = plan_restore(RestoreRequest([0, 0, 2]), costs(speeds=crawl))
    assert (plan.load, plan.floor) == (2, 2)


def test_overlap_counts_loads_under_compute() -> None:
    # 4 disk chunks (33 ms each to read) before an 8-chunk suffix; at 10K tok/s a chunk
    # computes in 25.6 ms. Serially the load loses; layer by layer under the suffix's
    # compute (205 ms) the whole load hides.
    request = RestoreRequest([1] * 4, prompt_tokens=12 * CT)
    assert plan_restore(request, costs()).load == 0
    overlapped = RestoreRequest([1] * 4, prompt_tokens=12 * CT, overlap=True)
    plan = plan_restore(overlapped, costs(overlap_layers=32))
    assert plan.load == 4
    # A layer (1 MB) reads in 1 ms behind 1 ms of latency: 3 layers a call keep the
    # latency to a quarter of it, so 11 calls a chunk, the chunks read side by side; the
    # compute runs whole and waits for the last group of layers only.
    assert plan.load_s == pytest.approx(11 * 0.001 + 4 * 32 * MB / 1e9)
    assert plan.ready_s == pytest.approx(8 * 0.0256 + plan.load_s / 11)


def test_a_load_under_compute_reads_a_slow_link_a_whole_chunk_a_call() -> None:
    # The bucket (50 ms a call, 1 MB a layer in 50 ms at 0.02 GB/s) is read 3 layers a call;
    # one a layer would pay 32 latencies a chunk. With layers of 0.25 MB, 12.5 ms each, a
    # call takes 12 layers: a 128-layer chunk in 11 calls, not 128.
    slow = speed(0.02, 50.0)
    assert slow.layers_per_call(1 * MB, 32) == 3
    assert slow.layers_per_call(MB // 4, 32) == 12
    assert slow.layers_per_call(MB // 100, 32) == 32  # never more than the block
    assert speed(10.0).layers_per_call(1 * MB, 32) == 1  # memory: a layer a call
    assert speed(10.0).layers_per_call(1 * MB, 32, least=4) == 4
    request = RestoreRequest([2], prompt_tokens=CT, overlap=True)
    plan = plan_restore(request, costs(rate=100, overlap_layers=128))  # 2.56 s to compute
    assert plan.load == 1  # 11 calls: 2.15 s; one a layer, 8 s
    assert plan.load_s == pytest.approx(11 * 0.05 + 32 * MB / 0.02e9)


def test_tokens_the_engine_holds_are_neither_loaded_nor_counted() -> None:
    plan = plan_restore(RestoreRequest([0] * 6, computed_tokens=2 * CT + 5), costs())
    assert (plan.first, plan.load) == (2, 6)
    assert plan.tier_chunks == {0: 4}
    assert plan.load_s == pytest.approx(4 * 32 * MB / 10e9)


def test_off_and_unknown_prefill_load_every_stored_chunk() -> None:
    levels = [0, 2, 2]
    off = plan_restore(RestoreRequest(levels, planning=False), costs())
    assert (off.load, off.reason) == (3, "off")
    unknown = plan_restore(RestoreRequest(levels), costs(rate=None))
    assert (unknown.load, unknown.reason, unknown.nocache_s) == (3, "unknown", None)
    assert unknown.ready_s == unknown.load_s  # nothing left to compute
    assert plan_restore(RestoreRequest([]), costs()).reason == "none"


def test_a_prefill_table_prices_long_prompts_higher() -> None:
    # quadratic-ish: 1K tokens in 0.1 s, 8K in 2 s, 16K in 6 s
    table = [(1024, 0.1), (8192, 2.0), (16384, 6.0)]
    p = prefill(None, table)
    assert p.seconds(0, 1024) == pytest.approx(0.1)
    assert p.seconds(8192, 16384) == pytest.approx(4.0)
    assert p.seconds(16384, 20480) == pytest.approx(2.0)  # past the table: its last slope
    assert p.estimate().source == "table"
    # chunks on a slow-ish disk (0.4 GB/s: 80 ms each) pay over a long prompt (64
    # chunks: 5.1 s against 6 s) and not over a short one (4: 0.32 s against 0.1 s)
    slow_disk = [SPEEDS[0], speed(0.4, 1.0), SPEEDS[2]]
    long_request = RestoreRequest([1] * 64, prompt_tokens=64 * CT)
    c = costs(speeds=slow_disk, prefill=p)
    assert plan_restore(long_request, c).load == 64
    assert plan_restore(RestoreRequest([1] * 4), c).load == 0


def test_a_learned_prefill_follows_the_engine_steps() -> None:
    clock = [0.0]
    p = PrefillSpeed(None, None, True, 10.0, lambda: clock[0])
    assert p.seconds(0, 100) is None and p.estimate().source == "unknown"
    for i, tokens in enumerate([512, 2048, 1024, 4096, 256, 8192]):
        clock[0] = float(i)
        p.observe_step(tokens, 0.004 + tokens / 20_000)  # 4 ms a step, 20K tok/s
    est = p.estimate()
    assert est.source == "learned" and est.tokens_per_s == pytest.approx(20_000)
    assert p.seconds(0, 20_000) == pytest.approx(1.0)


def test_a_tier_that_becomes_slow_is_planned_around_as_its_estimate_follows() -> None:
    clock = [0.0]
    disk = ReadSpeed(1.0, 1.0, half_life_s=5.0, stale_s=60.0, clock=lambda: clock[0])

    def plan_now() -> int:
        c = costs(speeds=[SPEEDS[0], disk.estimate(), SPEEDS[2]], rate=2_000)
        return plan_restore(RestoreRequest([0, 1, 1, 1]), c).load

    for i in range(10):  # 1 GB/s reads: loads pay (32 ms a chunk against 128 ms)
        clock[0] = float(i)
        disk.observe(32 * MB * (1 + i % 3), 0.001 + 32 * MB * (1 + i % 3) / 1e9)
    assert plan_now() == 4
    for i in range(10, 40):  # the disk drops to 0.1 GB/s (320 ms a chunk)
        clock[0] = float(i)
        disk.observe(32 * MB * (1 + i % 3), 0.001 + 32 * MB * (1 + i % 3) / 0.1e9)
    assert disk.estimate().gbps < 0.15
    assert plan_now() == 1


# -- the store ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("latency_ms", "skipped"),
    [(2.0, False), (20.0, True)],
    ids=["a-load-from-it-pays", "no-load-from-it-pays"],
)
def test_a_tier_is_asked_only_when_a_load_from_it_could_pay(
    latency_ms: float, skipped: bool
) -> None:
    """8 chunks of 16 tokens at 10K tokens/s: 12.8 ms of prefill. All 8 on a 1 GB/s tier
    of 2 ms a call load in ~2.3 ms: it pays, the tier is asked. At 20 ms a call no load
    from it beats the prefill: it is not asked, but searched in the background."""
    asked: list[int] = []
    later: list[int] = []

    def lookup(keys: Any, recheck: bool, skip: int) -> int:
        asked.append(skip)
        return 0

    def find(keys: Any, levels: int) -> int:
        later.append(levels)
        return 0

    speeds = [speed(10.0), speed(1.0, latency_ms)]
    parts = Parts(
        lookup,
        lambda key: [],
        lambda: speeds,
        frozenset({0}),
        lambda keys: 0,
        find=find,
    )
    restorer = Restorer(parts, prefill(10_000), (16, 32 * 1024, 1))
    keys = [bytes([i]) * 16 for i in range(8)]
    plan = restorer.plan(keys, restore_request(None, 0, False, None))
    assert plan.load == 0 and asked == [0b10 if skipped else 0]
    assert later == ([0b10] if skipped else [])
    assert restorer.snapshot()["lookups_deferred"] == (1 if skipped else 0)


def test_warming_waits_for_the_compute_the_plans_expect() -> None:
    """A slow tail is warmed, but only once the prefill the plan expects has ended (a
    later plan pushes it back, ``warm_wait_s`` bounds the wait): the copy would compete
    with that prefill for the cores."""
    queued: list[tuple[Any, Any]] = []
    warmed: list[int] = []

    def later(job: Any, not_before: Any) -> bool:
        queued.append((job, not_before))
        return True

    def warm(keys: Any) -> int:
        warmed.append(len(keys))
        return len(keys)

    speeds = [speed(10.0), speed(0.0001, 500.0)]
    levels = {bytes([i]) * 16: [0 if i < 2 else 1] for i in range(6)}
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: levels[key],
        lambda: speeds,
        frozenset({0}),
        warm,
        later=later,
    )
    restorer = Restorer(parts, prefill(1_000), (CT, MB, 1), warming=Warming(wait_s=10.0))
    keys = list(levels)
    began = time.monotonic()
    plan = restorer.plan(keys, restore_request(None, 0, False, None))
    assert plan.load == 2 and plan.warm == (2, 3, 4, 5) and plan.ready_s is not None
    # nothing copied while the prefill runs; the search of the slow tier waits too
    assert warmed == [] and len(queued) == 2
    assert restorer.snapshot()["lookups_deferred"] == 1
    job, not_before = queued[0]
    first = not_before()
    assert began + plan.ready_s <= first <= time.monotonic() + plan.ready_s
    restorer.plan(keys, restore_request(None, 0, False, None))  # another prompt's prefill
    assert not_before() > first  # pushed back behind it
    assert not_before() <= began + 10.0 + (time.monotonic() - began)  # never past the bound
    job()
    assert warmed == [4] and restorer.snapshot()["chunks_warming"] == 4


def test_warming_yields_to_a_prefill_a_later_plan_expects() -> None:
    """Where the store copies on the warming's thread, it copies a chunk at a time, and
    stops when a plan made since expects the engine to compute: the rest waits for that
    compute (prompts back to back would otherwise find the warming competing with them)."""
    queued: list[tuple[Any, Any]] = []
    copied: list[Any] = []
    speeds = [speed(10.0), speed(0.0001, 500.0)]
    levels = {bytes([i]) * 16: [0 if i < 2 else 1] for i in range(6)}
    restorer: Restorer

    def warm_now(keys: Any) -> int:
        copied.extend(keys)
        if len(copied) == 2:  # meanwhile, the next prompt's plan
            restorer.plan(list(levels), restore_request(None, 0, False, None))
        return len(keys)

    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: levels[key],
        lambda: speeds,
        frozenset({0}),
        lambda keys: pytest.fail("warming queued every copy at once"),
        later=lambda job, not_before: bool(queued.append((job, not_before))) or True,
        warm_now=warm_now,
    )
    restorer = Restorer(parts, prefill(20_000), (CT, MB, 1), warming=Warming(wait_s=10.0))
    keys = list(levels)
    restorer.plan(keys, restore_request(None, 0, False, None))
    assert len(queued) == 2 and copied == []  # the warming and the deferred search wait
    job, not_before = queued[0]
    time.sleep(max(0.0, not_before() - time.monotonic()))
    job()  # its time came: copies until the next plan, then waits again
    assert copied == keys[2:4]
    rest, not_before = queued[-1]
    assert not_before() > time.monotonic()  # behind the next prompt's compute
    assert restorer.snapshot()["warming_yields"] == 1
    time.sleep(max(0.0, not_before() - time.monotonic()))
    rest()
    assert copied[2:] == keys[4:]
    assert restorer.snapshot()["chunks_warming"] == 4


def test_warming_waits_for_the_engine_to_settle_after_the_compute_it_expects() -> None:
    """A copy starts only ``settle_s`` after the expected compute has ended: a prompt that
    arrives right after the last one ended (back to back, as a busy engine takes them)
    pushes the warming behind its own prefill before any copy has begun (it began at once
    before, and ran under that prefill); an engine left idle that long gets its warming."""
    queued: list[tuple[Any, Any]] = []
    copied: list[Any] = []
    speeds = [speed(10.0), speed(0.0001, 500.0)]
    levels = {bytes([i]) * 16: [0 if i < 2 else 1] for i in range(6)}
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: levels[key],
        lambda: speeds,
        frozenset({0}),
        lambda keys: pytest.fail("warming queued every copy at once"),
        later=lambda job, not_before: bool(queued.append((job, not_before))) or True,
        warm_now=lambda keys: copied.extend(keys) or len(keys),
    )
    settle = 0.05
    restorer = Restorer(parts, prefill(20_000), (CT, MB, 1), warming=Warming(True, 10.0, settle))
    keys = list(levels)
    began = time.monotonic()
    plan = restorer.plan(keys, restore_request(None, 0, False, None))
    assert plan.ready_s is not None
    assert plan.ready_s > settle  # settles for warm_settle_s (a shorter compute: its own)
    _, not_before = queued[0]
    ends = began + plan.ready_s
    assert ends + settle <= not_before() <= time.monotonic() + plan.ready_s + settle
    # The next prompt arrives as the first one's compute ends, within the settle time:
    time.sleep(max(0.0, ends - time.monotonic()))
    assert not_before() > time.monotonic()  # not due as the compute ends: no copy begins
    again = restorer.plan(keys, restore_request(None, 0, False, None))
    assert again.ready_s is not None
    assert not_before() >= time.monotonic() + again.ready_s  # behind the new prefill
    assert copied == []
    job, not_before = queued[0]
    time.sleep(max(0.0, not_before() - time.monotonic()))
    job()  # the engine has been idle for the settle time: every chunk is copied
    assert copied == keys[2:]
    assert restorer.snapshot()["warming_yields"] == 0


def test_a_short_compute_settles_for_as_long_as_itself() -> None:
    """A plan expecting microseconds of compute defers warming by as much, not by the whole
    settle time: a caller that plans every few milliseconds (SGLang polling
    ``batch_exists``) would otherwise never let the warming start."""
    queued: list[tuple[Any, Any]] = []
    speeds = [speed(10.0), speed(0.0001, 500.0)]
    levels = {bytes([i]) * 16: [0 if i < 2 else 1] for i in range(6)}
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: levels[key],
        lambda: speeds,
        frozenset({0}),
        lambda keys: len(keys),
        later=lambda job, not_before: bool(queued.append((job, not_before))) or True,
        warm_now=lambda keys: len(keys),
    )
    restorer = Restorer(parts, prefill(1e9), (CT, MB, 1), warming=Warming(True, 10.0, 5.0))
    plan = restorer.plan(list(levels), restore_request(None, 0, False, None))
    assert plan.ready_s is not None and plan.ready_s < 1e-3
    _, not_before = queued[0]
    assert not_before() < time.monotonic() + 0.01  # due at once, not 5 s from now


def test_what_a_deferred_search_finds_is_warmed_a_chunk_at_a_time() -> None:
    """A bucket too slow to ask during the plan is searched once the prefill has ended,
    and what it holds is warmed as a plan's warming is: a chunk at a time, yielding to the
    next prompt's prefill (queued all at once, the copies competed with every prefill that
    followed: bench_restore's slow_planned)."""
    queued: list[tuple[Any, Any]] = []
    copied: list[Any] = []
    searched: list[int] = []
    speeds = [speed(10.0), speed(0.0001, 500.0)]
    keys = [bytes([i]) * 16 for i in range(4)]
    held: dict[Any, list[int]] = {}
    restorer: Restorer

    def find(found: Any, levels: int) -> int:
        searched.append(levels)
        held.update({k: [1] for k in found})
        return len(found)

    def warm_now(some: Any) -> int:
        copied.extend(some)
        if len(copied) == 2:  # meanwhile, the next prompt's plan: a prefill of 2048 tokens
            restorer.plan([bytes([9]) * 16], restore_request(2048, 0, False, None))
        return len(some)

    parts = Parts(
        lambda ks, recheck, skip: len(list(itertools.takewhile(held.__contains__, ks))),
        lambda key: held.get(key, []),
        lambda: speeds,
        frozenset({0}),
        lambda some: pytest.fail("warming queued every copy at once"),
        find=find,
        later=lambda job, not_before: bool(queued.append((job, not_before))) or True,
        warm_now=warm_now,
    )
    restorer = Restorer(parts, prefill(20_000), (CT, MB, 1), warming=Warming(wait_s=10.0))
    plan = restorer.plan(keys, restore_request(None, 0, False, None))
    assert plan.stored == 0 and len(queued) == 1 and searched == []  # asked later
    assert not restorer.plan(keys, restore_request(None, 0, False, None)).stored
    assert len(queued) == 1  # the same prompt again: one search
    job, not_before = queued[0]
    time.sleep(max(0.0, not_before() - time.monotonic()))
    job()
    assert searched == [0b10] and copied == keys[:2]  # then the next plan came
    assert restorer.snapshot()["warming_yields"] == 1
    rest, not_before = queued[-1]
    assert not_before() > time.monotonic()  # behind the next prompt's compute
    time.sleep(max(0.0, not_before() - time.monotonic()))
    rest()
    assert copied == keys and restorer.snapshot()["chunks_warming"] == 4


def test_chunks_loaded_from_another_machines_storage_are_warmed_too() -> None:
    """A bucket fast enough to pay: its chunks are loaded, and copied up as well (the
    engine's copy is not the store's), so that the next request finds the head local."""
    warmed: list[list[Any]] = []
    speeds = [speed(1.0, 1.0), speed(10.0, 1.0)]
    where = {bytes([i]) * 16: [1] if i < 2 else [0] for i in range(4)}
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: where[key],
        lambda: speeds,
        frozenset(),
        lambda keys: warmed.append(list(keys)) or len(keys),
        media=("disk", "shared"),
    )
    restorer = Restorer(parts, prefill(1_000), (CT, MB, 1))
    keys = list(where)
    plan = restorer.plan(keys, restore_request(None, 0, False, None))
    assert (plan.load, plan.warm) == (4, ())  # every chunk pays; none left behind
    assert warmed == [keys[:2]]  # the two the bucket held, not the two on local disk


def test_warming_starts_at_once_with_no_wait() -> None:
    queued: list[Any] = []
    speeds = [speed(10.0), speed(0.0001, 500.0)]
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: [0 if key[0] < 1 else 1],
        lambda: speeds,
        frozenset({0}),
        lambda keys: len(keys),
        later=lambda job, when: queued.append(when()) is None,
    )
    restorer = Restorer(parts, prefill(1_000), (CT, MB, 1), warming=Warming(wait_s=0.0))
    restorer.plan([bytes([i]) * 16 for i in range(3)], restore_request(None, 0, False, None))
    assert restorer.snapshot()["chunks_warming"] == 2  # copies queued at once
    # the search of the slow tier, a round trip, still leaves the planning thread: at once
    assert queued == [0.0] and restorer.snapshot()["lookups_deferred"] == 1


def store_config(tmp_path: Path, host_blocks: int = 64, **restore: Any) -> dict[str, Any]:
    layout = small_layout()
    return {
        "tiers": [
            {"kind": "host", "capacity": host_blocks * layout.block_nbytes},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
        ],
        "restore": restore,
    }


def keys_of(store: KVStore, n: int) -> list[Any]:
    tokens = list(range(n * store.layout.block_tokens))
    return store.hash_tokens(tokens, namespace="m")


def on_disk_only(store: KVStore, keys: list[Any], kv: torch.Tensor, head: int) -> None:
    """Store every chunk on disk, and only the first ``head`` in memory too."""
    store.put(keys, kv)
    store.flush()
    assert store.evict(len(keys), tier=0)
    assert store.engine.datapath.promote(keys[:head], tier=0) == head  # back into memory
    assert [0 in store.engine.datapath.where(k) for k in keys] == [
        i < head for i in range(len(keys))
    ]
    assert all(1 in store.engine.datapath.where(k) for k in keys)


def test_get_prefix_follows_the_plan_and_warms_what_it_skips(tmp_path: Path) -> None:
    layout = small_layout()
    # the disk tier declared absurdly slow: a chunk of it never pays against the
    # declared prefill rate, and nothing reads it (which would measure it) before the plan
    config = store_config(tmp_path, prefill_tokens_per_s=1e6)
    config["tiers"][1].update(read_gbps=1e-6, read_latency_ms=1000)
    kv = random_blocks(layout, 6)
    with KVStore(layout, config) as store:
        keys = keys_of(store, 6)
        on_disk_only(store, keys, kv, 3)
        out = torch.empty(layout.tensor_shape(6), dtype=layout.dtype)
        assert store.get_prefix(keys, out) == 3  # plans, loads 3, warms 3..5
        assert torch.equal(
            out[:, :, : 3 * layout.block_tokens], kv[:, :, : 3 * layout.block_tokens]
        )
        store.drain(5.0)
        assert all(0 in store.engine.datapath.where(k) for k in keys)  # warmed into memory
        assert store.plan(keys).load == 6  # the next request finds them fast
        stats = store.stats()["restore"]
        assert stats["plans_pays"] == 1 and stats["plans_all"] == 1
        assert stats["tokens_planned_recompute"] == 3 * layout.block_tokens
        # At least one copy queued by the plan's warming (once, in a clean-clone CI run on
        # a machine loaded far past its cores, the other two were already queued or done
        # when the warming job ran); all three are in memory, asserted above.
        assert stats["chunks_warming"] >= 1
        assert stats["prefill_source"] == "configured"


def test_planning_off_loads_every_stored_chunk(tmp_path: Path) -> None:
    layout = small_layout()
    config = store_config(tmp_path, prefill_tokens_per_s=1e6, planning="off")
    config["tiers"][1].update(read_gbps=1e-6, read_latency_ms=1000)
    kv = random_blocks(layout, 4)
    with KVStore(layout, config) as store:
        keys = keys_of(store, 4)
        on_disk_only(store, keys, kv, 1)
        out = torch.empty(layout.tensor_shape(4), dtype=layout.dtype)
        assert store.plan(keys).reason == "off"
        assert store.get_prefix(keys, out) == 4
        assert torch.equal(out, kv)


def test_without_a_prefill_speed_every_stored_chunk_is_a_hit(tmp_path: Path) -> None:
    layout = small_layout()
    kv = random_blocks(layout, 4)
    with KVStore(layout, store_config(tmp_path)) as store:
        keys = keys_of(store, 4)
        store.put(keys, kv)
        out = torch.empty(layout.tensor_shape(4), dtype=layout.dtype)
        assert store.get_prefix(keys, out) == 4
        restore = store.stats()["restore"]
        assert restore["plans_unknown"] == 1 and restore["prefill_source"] == "unknown"
        store.engine.note_prefill_step(512, 0.05)  # the store learns the engine's rate
        for tokens in (1024, 256, 2048):
            store.engine.note_prefill_step(tokens, tokens / 10_000)
        assert store.stats()["restore"]["prefill_source"] == "learned"
        assert store.plan(keys).reason == "all"  # memory always pays


def test_planned_and_actual_load_times_are_compared(tmp_path: Path) -> None:
    layout = small_layout()
    kv = random_blocks(layout, 4)
    with KVStore(layout, store_config(tmp_path, prefill_tokens_per_s=1.0)) as store:
        keys = keys_of(store, 4)
        store.put(keys, kv)
        out = torch.empty(layout.tensor_shape(4), dtype=layout.dtype)
        for _ in range(3):
            assert store.get_prefix(keys, out) == 4
        restore = store.stats()["restore"]
        assert restore["restores_timed"] == 3
        assert restore["estimate_error_median"] is not None
        assert restore["load_planned_s"] > 0 and restore["load_actual_s"] > 0


def test_bad_plan_input_is_refused(tmp_path: Path) -> None:
    layout = small_layout()
    with KVStore(layout, store_config(tmp_path)) as store:
        keys = keys_of(store, 2)
        with pytest.raises(InvalidInputError):
            store.plan(keys, prompt_tokens=-1)
        with pytest.raises(InvalidInputError):
            store.plan(keys, computed_tokens=1.5)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            store.plan(["nope"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("restore", "message"),
    [
        ({"prefill_tokens_per_s": 0}, "restore.prefill_tokens_per_s: must be > 0"),
        ({"prefill_table": [[512, 0.1], [512, 0.2]]}, "tokens must be > 0 and rise"),
        ({"prefill_table": [[512, 0.5], [1024, 0.1]]}, "seconds must be > 0 and never fall"),
        ({"prefill_table": [[512]]}, "expected [tokens, seconds]"),
        ({"prefill_table": "[[1, 2"}, "not valid YAML"),
        ({"planning": "maybe"}, "restore.planning: expected true or false"),
        ({"warm_wait_s": -1}, "restore.warm_wait_s: must be >= 0"),
        ({"warm_settle_s": -0.5}, "restore.warm_settle_s: must be >= 0"),
    ],
)
def test_bad_restore_config_is_a_clear_error(restore: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVStore(
            small_layout(), {"tiers": [{"kind": "host", "capacity": "1MiB"}], "restore": restore}
        )
    assert message in str(info.value)


def test_a_partial_plan_warms_the_disk_chunks_it_loads_too() -> None:
    """A disk head that pays before a bucket tail that does not: the tail is warmed, and so
    is the head it loads, or the next plan (its disk estimate now measured) could find the
    head on disk, recompute it and with it the warmed tail behind it."""
    warmed: list[list[Any]] = []
    where = {bytes([i]) * 16: [1] if i < 2 else [2] for i in range(4)}
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: where[key],
        lambda: SPEEDS,
        frozenset({0}),
        lambda keys: warmed.append(list(keys)) or len(keys),
        media=("memory", "disk", "shared"),
    )
    restorer = Restorer(parts, prefill(2_000), (CT, 32 * MB, 1), warming=Warming(wait_s=0.0))
    keys = list(where)
    plan = restorer.plan(keys, restore_request(None, 0, False, None))
    assert (plan.load, plan.warm) == (2, (2, 3))  # the disk pays at 2K tokens/s; the bucket not
    assert warmed == [keys]  # the loaded disk head and the bucket tail


def test_a_plan_that_loads_all_from_disk_warms_nothing() -> None:
    """Every chunk pays from the local disk: nothing is left behind, nothing copied up."""
    warmed: list[list[Any]] = []
    parts = Parts(
        lambda keys, recheck, skip: len(keys),
        lambda key: [1],
        lambda: SPEEDS,
        frozenset({0}),
        lambda keys: warmed.append(list(keys)) or len(keys),
        media=("memory", "disk", "shared"),
    )
    restorer = Restorer(parts, prefill(2_000), (CT, 32 * MB, 1), warming=Warming(wait_s=0.0))
    plan = restorer.plan([bytes([i]) * 16 for i in range(3)], restore_request(None, 0, False, None))
    assert (plan.load, plan.reason, warmed) == (3, "all", [])


def _disk_speed(store: KVStore) -> dict[str, Any]:
    return store.stats()["tiers"][1]


@pytest.mark.parametrize("declared", [True, False])
def test_a_restart_probes_the_disk_it_finds_blocks_on(tmp_path: Path, declared: bool) -> None:
    """Reopened over a disk holding blocks, with a declared prefill speed, the store reads
    one of them in the background (single layers, then whole), so that the first plan
    weighs the disk's measured speed, not its configured guess. With a learned prefill
    speed nothing is probed: the first plans load every chunk and measure the disk."""
    layout = small_layout()
    restore: dict[str, Any] = {"prefill_tokens_per_s": 1e5} if declared else {}
    config = store_config(tmp_path, **restore)
    with KVStore(layout, config) as store:
        keys = keys_of(store, 4)
        store.put(keys, random_blocks(layout, 4))
        store.flush()
    with KVStore(layout, config) as store:
        if declared:
            # The probe reads at once, in the background (no wait for a quiet machine).
            deadline = time.monotonic() + 10
            while _disk_speed(store)["read_speed_source"] == "configured":
                assert time.monotonic() < deadline, _disk_speed(store)
                time.sleep(0.02)
            store.drain(5.0)
            assert _disk_speed(store)["read_speed_samples"] > 0
            assert store.stats()["tiers"][0]["read_speed_source"] == "configured"  # memory
        else:
            time.sleep(0.2)
            assert _disk_speed(store)["read_speed_source"] == "configured"
        assert store.get(keys).shape == layout.tensor_shape(4)  # nothing else changed


def test_an_empty_disk_is_not_probed(tmp_path: Path) -> None:
    with KVStore(small_layout(), store_config(tmp_path, prefill_tokens_per_s=1e5)) as store:
        time.sleep(0.2)
        assert _disk_speed(store)["read_speed_source"] == "configured"
        assert store.stats()["blocks_read"] == 0


def test_staged_chunks_are_read_before_the_pipeline_starts() -> None:
    """Into a GPU, chunks below memory are read whole before the first layer is handed
    over: a layer-by-layer load does not hide them under compute. A disk that would pay
    in a pipeline (its reads hidden under 32 layers of compute) does not pay staged."""
    # 4 disk chunks, 33 ms each to read; 25.6 ms each to compute; 8 chunks in all.
    levels = [1, 1, 1, 1]
    piped = plan_restore(RestoreRequest(levels, 8 * CT, overlap=True), costs(overlap_layers=32))
    staged = plan_restore(
        RestoreRequest(levels, 8 * CT, overlap=True), costs(overlap_layers=32, staged=True)
    )
    assert piped.load > 0 and piped.ready_s is not None and piped.nocache_s is not None
    assert piped.ready_s < piped.nocache_s
    assert (staged.load, staged.ready_s) == (0, staged.nocache_s)
    # Memory chunks still overlap: staged or not, the same plan and the same estimate.
    mem = [0, 0, 0, 0]
    a = plan_restore(RestoreRequest(mem, 8 * CT, overlap=True), costs(overlap_layers=32))
    b = plan_restore(
        RestoreRequest(mem, 8 * CT, overlap=True), costs(overlap_layers=32, staged=True)
    )
    assert (a.load, a.ready_s) == (b.load, b.ready_s) == (4, a.ready_s)
    # Staged chunks before memory ones: the disk's read time adds up front.
    mixed = plan_restore(
        RestoreRequest([1, 0], 2 * CT, overlap=True, planning=True),
        costs(rate=1_000, overlap_layers=32, staged=True),
    )
    assert mixed.load == 2 and mixed.ready_s is not None
    disk_s = SPEEDS[1].seconds_for(32 * MB, 1)
    assert mixed.ready_s >= disk_s


def test_a_declared_disk_speed_is_not_probed_at_open(tmp_path: Path) -> None:
    """A read speed the config declares stands until the workload reads the tier: the
    store probes only a disk whose speed is its kind's default guess."""
    layout = small_layout()
    config = store_config(tmp_path, prefill_tokens_per_s=1e5)
    config["tiers"][1].update(read_gbps=1e-6, read_latency_ms=5000)  # declared hopeless
    with KVStore(layout, config) as store:
        keys = keys_of(store, 4)
        store.put(keys, random_blocks(layout, 4))
        store.flush()
    with KVStore(layout, config) as store:
        time.sleep(0.2)
        assert _disk_speed(store)["read_speed_source"] == "configured"
        assert store.plan(keys).load == 0  # still planned around, as declared
