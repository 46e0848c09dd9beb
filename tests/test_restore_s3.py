"""Restore planning against a real S3 endpoint (moto) behind a real slow link: the plan
follows the tier's measured speed as the link slows and recovers, a stale estimate is
probed, and a tier that stalls mid-load ends the load within its deadline."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvharness.proxies.fault import FaultProxy
from kvharness.proxies.throttle import ThrottlingProxy
from kvstore import KVLayout, KVStore
from kvstore.cli.servers import S3Server
from kvstore.testing.data import random_blocks, small_layout

LAYOUT: KVLayout = small_layout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=32)
N = 4  # chunks of 512 KiB


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def s3_config(server: S3Server, url: str, **tier: Any) -> dict[str, Any]:
    s3 = {
        "kind": "s3",
        "bucket": server.bucket,
        "prefix": f"restore-{uuid.uuid4().hex[:12]}",
        "endpoint_url": url,
        "region": "us-east-1",
        "codec": "raw",
        "read_gbps": 1.0,  # what an operator would declare for a fast bucket
        "read_latency_ms": 1.0,
        **tier,
    }
    # 32 tokens a chunk at 200 tokens/s: 160 ms of prefill, against a 512 KiB read from
    # moto (~40-100 MB/s here, 5-13 ms; slower on a loaded machine) or through a 2 MB/s
    # link (350 ms)
    restore = {"prefill_tokens_per_s": 200, "speed_half_life_s": 0.05, "speed_stale_s": 60}
    return {"tiers": [s3], "restore": restore}


@pytest.fixture
def throttle(s3_server: S3Server, aws_env: None) -> Iterator[ThrottlingProxy]:
    with ThrottlingProxy(f"127.0.0.1:{s3_server.port}") as proxy:
        yield proxy


def test_the_plan_follows_a_link_that_slows_and_a_stale_estimate_is_probed(
    s3_server: S3Server, throttle: ThrottlingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    kv = random_blocks(LAYOUT, N, seed=5)
    out = torch.empty(LAYOUT.tensor_shape(N), dtype=LAYOUT.dtype)
    # A chunk's prefill takes 640 ms here (50 tokens/s), so that the probe's read of 512
    # KiB from moto pays even on a machine loaded with other tests (seen at ~200 ms).
    config = s3_config(s3_server, throttle.url)
    config["restore"]["prefill_tokens_per_s"] = 50
    with KVStore(LAYOUT, config, clock=clock) as store:
        keys = store.hash_tokens(list(range(N * LAYOUT.block_tokens)), namespace="m")
        assert store.put(keys, kv) == N
        assert store.get_prefix(keys, out) == N and torch.equal(out, kv)  # loads pay
        throttle.set(gbps=0.0006, latency_ms=50)  # the link slows to 0.6 MB/s: 0.9 s a chunk
        clock.now += 0.1
        assert store.get_prefix(keys, out) == N  # planned on the old figures: it loads ...
        slow = store.stats()["tiers"][0]
        assert slow["read_gbps_estimate"] < 0.0012  # ... and measures the slow link
        clock.now += 0.1
        plan = store.plan(keys)
        assert (plan.load, plan.reason) == (0, "pays")  # now the prompt is recomputed
        assert store.get_prefix(keys, out) == 0
        throttle.set(gbps=None, latency_ms=0)  # the link recovers; nothing reads it ...
        clock.now += 61  # ... until the estimate goes stale: the plan probes the tier
        asked = calls_by_thread(store.engine.datapath.io.tiers[0], monkeypatch)
        assert store.plan(keys).load == 0
        assert store.stats()["restore"]["stale_probes"] == 1
        # Not on the plan's own thread (a round trip over the slow link, each request the
        # estimate stayed stale): the probe asks the tier for a chunk in the background.
        me = threading.get_ident()
        assert [what for thread, what in asked if thread == me] == []
        store.plan(keys)  # one probe of a tier at a time (or none: it measured it)
        assert store.stats()["restore"]["stale_probes"] == 1
        store.drain(10.0)
        clock.now += 5  # the probe's fast read outweighs the old slow ones
        assert store.plan(keys).load == N
        restore = store.stats()["restore"]
        assert restore["restores_timed"] >= 2 and restore["estimate_error_median"] is not None


def test_a_tier_that_stalls_mid_load_ends_the_load_within_its_deadline(
    s3_server: S3Server, aws_env: None
) -> None:
    kv = random_blocks(LAYOUT, N, seed=6)
    out = torch.empty(LAYOUT.tensor_shape(N), dtype=LAYOUT.dtype)
    with FaultProxy(s3_server.port) as proxy:
        config = s3_config(s3_server, proxy.url, read_timeout=1.0, deadline=2.0)
        with KVStore(LAYOUT, config) as store:
            keys = store.hash_tokens(list(range(N * LAYOUT.block_tokens)), namespace="m")
            assert store.put(keys, kv) == N
            assert store.plan(keys).load == N  # the plan says load: the tier looks fast
            proxy.stall_next(10_000, 10.0)  # then every request hangs
            start = time.monotonic()
            loaded = store.get_prefix(keys, out)
            elapsed = time.monotonic() - start
            assert loaded == 0  # a miss: the engine recomputes, nothing wrong is served
            assert elapsed < 2.0 + 1.0 + 2.0  # the deadline, a read timeout, slack: no hang


def test_a_lookup_asks_a_slow_shared_tier_only_about_what_faster_ones_lost(
    s3_server: S3Server, aws_env: None, tmp_path: Any
) -> None:
    """Every scheduler lookup rechecks the shared tiers; a chunk the shared disk still
    holds is not asked about again on S3 (a round trip over the slow link each)."""
    kv = random_blocks(LAYOUT, N, seed=7)
    config = s3_config(s3_server, f"http://127.0.0.1:{s3_server.port}")
    config["tiers"].insert(0, {"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"})
    with KVStore(LAYOUT, config) as store:
        keys = store.hash_tokens(list(range(N * LAYOUT.block_tokens)), namespace="m")
        assert store.put(keys, kv) == N
        assert store.evict(N, tier=0)  # demoted to S3
        assert store.engine.datapath.promote(keys[:2], tier=0) == 2  # two back on disk: on both
        requests = store.stats()["tiers"][1]["requests"]
        assert store.lookup(keys, recheck=True) == N
        asked = store.stats()["tiers"][1]["requests"] - requests
        assert asked == 2  # only the two chunks no faster shared tier holds


def calls_by_thread(tier: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """From now on, each call into ``tier``'s medium (its lookups, reads and listings) as
    ``(thread id, method)``, the calling thread's: what a plan asks on its caller's thread
    told apart from the background work (searches, warming, probes) of the store's own."""
    calls: list[tuple[int, str]] = []
    for name in ("contains", "get", "stored_keys"):
        method = getattr(tier, name)

        def recorded(*args: Any, _name: str = name, _method: Any = method) -> Any:
            calls.append((threading.get_ident(), _name))
            return _method(*args)

        monkeypatch.setattr(tier, name, recorded)
    return calls


def test_a_plan_does_not_ask_a_tier_too_slow_to_pay_and_warms_what_it_holds_behind(
    s3_server: S3Server, throttle: ThrottlingProxy, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket behind a 1.5 MB/s, 50 ms link, declared so: even a prompt stored whole
    there would be recomputed, so the plan spends no round trip asking it about chunks
    another process wrote there; a background search finds them and warms them to disk."""
    kv = random_blocks(LAYOUT, N, seed=8)
    slow = s3_config(s3_server, throttle.url, read_gbps=0.0015, read_latency_ms=50)
    slow["tiers"].insert(0, {"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"})
    fast = s3_config(s3_server, f"http://127.0.0.1:{s3_server.port}")
    fast["tiers"][0]["prefix"] = slow["tiers"][1]["prefix"]
    out = torch.empty(LAYOUT.tensor_shape(N), dtype=LAYOUT.dtype)
    with KVStore(LAYOUT, slow) as store:
        with KVStore(LAYOUT, fast) as writer:  # another process writes the bucket
            keys = writer.hash_tokens(list(range(N * LAYOUT.block_tokens)), namespace="m")
            assert writer.put(keys, kv) == N
        throttle.set(gbps=0.0015, latency_ms=50)
        store.drain(30.0)  # what the store's opening queued is done
        asked = calls_by_thread(store.engine.datapath.io.tiers[1], monkeypatch)
        requests = store.stats()["tiers"][1]["requests"]
        plan = store.plan(keys)
        assert (plan.stored, plan.load) == (0, 0)  # a miss: ...
        # ... the plan's lookup did not ask the bucket. Its deferred search runs on another
        # thread, at once here (no compute to wait for) and on a loaded machine before the
        # bucket's request counter is read: only this thread's calls tell the plan's own.
        me = threading.get_ident()
        assert [what for thread, what in asked if thread == me] == []
        assert store.stats()["restore"]["lookups_deferred"] == 1
        store.drain(30.0)  # the search and the warming, in the background
        assert store.stats()["tiers"][1]["requests"] > requests
        assert any(thread != me for thread, _ in asked)  # the search: seen by the same record
        plan = store.plan(keys)
        assert (plan.load, plan.tier_chunks) == (N, {0: N})  # now on disk: loaded
        assert store.get_prefix(keys, out, plan=False) == N and torch.equal(out, kv)
