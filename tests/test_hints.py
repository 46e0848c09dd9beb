"""Session hints: retention that eviction honours, demotion of idle sessions, prefetch
before the next turn, sessions named alone, and every hint answered."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.cli.servers import S3Server
from kvstore.datapath.hints import Retention
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.hints import parse_hint
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(tmp_path: Path, host_blocks: int = 8, **hints: Any) -> dict[str, Any]:
    host = {"kind": "host", "capacity": host_blocks * LAYOUT.block_nbytes}
    host.update(high_watermark=1.0, low_watermark=0.99)
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}
    return {"tiers": [host, disk], "hints": hints}


def session(store: KVStore, n: int, seed: int) -> list[Any]:
    tokens = [seed * 100_000 + i for i in range(n * LAYOUT.block_tokens)]
    keys = store.hash_tokens(tokens, namespace="m")
    store.put(keys, random_blocks(LAYOUT, n, seed=seed))
    return keys


def in_memory(store: KVStore, keys: list[Any]) -> int:
    return sum(0 in store.engine.datapath.where(k) for k in keys)


def test_retained_blocks_are_evicted_last(tmp_path: Path) -> None:
    clock = Clock()
    with KVStore(LAYOUT, config(tmp_path), clock=clock) as store:
        agent = session(store, 4, seed=1)
        answer = store.hint(agent, retain_s=60, priority=5)
        assert (answer.status, answer.blocks, answer.retain_s) == ("accepted", 4, 60.0)
        for seed in range(2, 6):  # a flood of other prompts through an 8-block memory tier
            session(store, 4, seed=seed)
        store.drain()
        assert in_memory(store, agent) == 4  # the retained session kept its place
        clock.now += 61  # the retention ran out: the session competes like any other
        for seed in range(6, 9):
            session(store, 4, seed=seed)
        store.drain()
        assert in_memory(store, agent) == 0
        assert store.stats()["hints"]["hints_accepted"] == 1


def test_when_only_retained_blocks_are_left_the_lowest_priority_goes_first(
    tmp_path: Path,
) -> None:
    with KVStore(LAYOUT, config(tmp_path, host_blocks=4)) as store:
        low, high = session(store, 2, seed=1), session(store, 2, seed=2)
        store.hint(low, retain_s=60, priority=1)
        store.hint(high, retain_s=60, priority=9)
        store.drain()  # write-backs done: no block pinned by a copy in flight
        session(store, 2, seed=3)  # needs room: the retention is soft, the put succeeds
        store.drain()
        assert in_memory(store, high) == 2 and in_memory(store, low) == 0


def test_demote_frees_memory_and_keeps_the_blocks_on_disk(tmp_path: Path) -> None:
    with KVStore(LAYOUT, config(tmp_path)) as store:
        keys = session(store, 3, seed=1)
        answer = store.hint(keys, session="agent-1", demote=True)
        assert (answer.status, answer.demoted) == ("accepted", 3)  # queued
        store.drain(5.0)
        assert in_memory(store, keys) == 0
        assert all(1 in store.engine.datapath.where(k) for k in keys)  # on disk
        # the next turn is near: name the session alone
        answer = store.hint(session="agent-1", prefetch=True)
        assert (answer.status, answer.prefetching) == ("accepted", 3)
        store.drain(5.0)
        assert in_memory(store, keys) == 3
        assert store.get(keys).shape == LAYOUT.tensor_shape(3)
        hints = store.stats()["hints"]
        assert hints["hint_blocks_demoted"] == 3 and hints["hint_blocks_prefetched"] == 3
        # blocks in memory already are not counted as prefetched again
        assert store.hint(session="agent-1", prefetch=True).prefetching == 0


def test_demote_leaves_hot_blocks_other_sessions_read(tmp_path: Path) -> None:
    with KVStore(LAYOUT, config(tmp_path)) as store:
        keys = session(store, 3, seed=1)
        for _ in range(40):  # chunk 0 is a system prompt every session reads
            store.get(keys[:1])
        answer = store.hint(keys, demote=True)
        assert answer.demoted == 2
        store.drain(5.0)
        assert [0 in store.engine.datapath.where(k) for k in keys] == [True, False, False]


def test_retain_zero_ends_a_retention(tmp_path: Path) -> None:
    with KVStore(LAYOUT, config(tmp_path)) as store:
        keys = session(store, 2, seed=1)
        store.hint(keys, session="s", retain_s=600)
        assert store.stats()["hints"]["blocks_retained"] == 2
        assert store.hint(session="s", retain_s=0).retain_s == 0.0
        assert store.stats()["hints"]["blocks_retained"] == 0


def test_hints_are_clipped_and_rejected_with_reasons(tmp_path: Path) -> None:
    tight = config(tmp_path, max_retain_s=10, max_retained_fraction=0.0005)  # 2 of 5469
    with KVStore(LAYOUT, tight) as store:
        keys = session(store, 4, seed=1)
        other = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), namespace="nobody")
        answer = store.hint(keys + other, retain_s=3600)
        assert answer.status == "clipped" and answer.retain_s == 10.0
        assert "2 of 6 blocks are not stored" in answer.reason
        assert "retention capped at 10 s" in answer.reason
        cap = store.engine.datapath.retention.max_blocks
        assert f"retains at most {cap} blocks" in answer.reason
        assert store.hint(other, retain_s=5).as_dict()["status"] == "rejected"
        assert store.hint(session="unknown").reason == "unknown session 'unknown'"
        counts = store.stats()["hints"]
        assert (counts["hints_clipped"], counts["hints_rejected"]) == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give keys, a session, or both"),
        ({"session": ""}, "session must be a non-empty string"),
        ({"session": "s", "retain_s": -1}, "retain_s must be a number >= 0"),
        ({"session": "s", "retain_s": float("inf")}, "retain_s must be a number >= 0"),
        ({"session": "s", "priority": 101}, "priority must be an int from 0 to 100"),
        ({"session": "s", "prefetch": True, "demote": True}, "contradict"),
    ],
)
def test_malformed_hints_raise_and_change_nothing(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with KVStore(LAYOUT, config(tmp_path)) as store:
        with pytest.raises(InvalidInputError, match=message):
            store.hint(**kwargs)
        assert store.stats()["hints"]["blocks_retained"] == 0


def test_hints_from_plain_dicts() -> None:
    hint, session, problem = parse_hint({"retain_s": 30, "priority": 2, "session": "a"})
    assert problem is None and session == "a" and hint is not None and hint.retain_s == 30
    assert "unknown hint key 'ttl'" in (parse_hint({"ttl": 3})[2] or "")
    assert "a hint is a mapping" in (parse_hint([1])[2] or "")
    assert "session must be" in (parse_hint({"session": 3})[2] or "")
    assert "priority" in (parse_hint({"priority": "high"})[2] or "")


def test_retention_keeps_the_longer_and_higher_and_expires() -> None:
    clock = Clock()
    table = Retention(3, clock)
    keys = [bytes([i]) * 16 for i in range(5)]
    assert table.retain(keys[:2], 10, 1) == 2
    assert table.retain(keys[:1], 5, 7) == 1  # shorter, higher: keeps 10 s, takes 7
    assert table.priority(keys[0]) == 7 and table.priority(keys[1]) == 1
    assert table.retain(keys[2:], 10, 0) == 1  # room for one more only
    clock.now += 10.5
    assert table.priority(keys[0]) is None and len(table) == 0
    table.release(keys)


def test_bad_hints_config_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"hints\.max_retained_fraction: must be <= 1"):
        KVStore(
            LAYOUT,
            {
                "tiers": [{"kind": "host", "capacity": "1MiB"}],
                "hints": {"max_retained_fraction": 2},
            },
        )


def under_pressure(store: KVStore, bottom: int) -> tuple[list[Any], list[Any]]:
    """A retained session and a later one not retained, then a flood of six more through
    a 4-block memory tier over an 8-block tier ``bottom``: the bottom tier must evict."""
    assert store.stats()["tiers"][bottom]["capacity_blocks"] == 8
    agent, bystander = session(store, 4, seed=1), session(store, 4, seed=2)
    store.drain()
    answer = store.hint(agent, retain_s=600, priority=5)
    assert (answer.status, answer.blocks) == ("accepted", 4)
    for seed in range(3, 9):
        session(store, 4, seed=seed)
        store.drain()
    assert store.stats()["tiers"][bottom]["evictions"] >= 4 * 4  # (the last in memory only)
    return agent, bystander


def survived(store: KVStore, agent: list[Any], bystander: list[Any], bottom: int) -> None:
    """The retained session is still in tier ``bottom`` (asked of the medium itself) and
    reads back whole; the newer session nobody retained was evicted from every tier."""
    medium = store.engine.datapath.io.tiers[bottom]
    assert all(bottom in store.engine.datapath.where(k) for k in agent)
    assert medium.contains(agent) == [True] * 4
    assert medium.contains(bystander) == [False] * 4
    assert not any(store.engine.datapath.where(k) for k in bystander)
    assert torch.equal(store.get(agent), random_blocks(LAYOUT, 4, seed=1))


def test_retained_blocks_survive_pressure_on_a_capacity_limited_disk(tmp_path: Path) -> None:
    host = {"kind": "host", "capacity": 4 * LAYOUT.block_nbytes}
    disk = {
        "kind": "disk",
        "path": str(tmp_path / "disk"),
        "capacity": 8 * (LAYOUT.block_nbytes + 4096),
    }
    for tier in (host, disk):
        tier.update(high_watermark=1.0, low_watermark=0.99)
    with KVStore(LAYOUT, {"tiers": [host, disk]}) as store:
        agent, bystander = under_pressure(store, bottom=1)
        survived(store, agent, bystander, bottom=1)
        files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file()]
        assert any(bytes(agent[0]).hex() in p.name for p in files)  # a real file, by name


def test_retained_blocks_survive_pressure_on_a_capacity_limited_bucket(
    s3_server: S3Server, aws_env: None
) -> None:
    host = {"kind": "host", "capacity": 4 * LAYOUT.block_nbytes}
    s3 = {
        "kind": "s3",
        "bucket": s3_server.bucket,
        "prefix": f"hints-{uuid.uuid4().hex[:12]}",
        "endpoint_url": s3_server.url,
        "region": "us-east-1",
        "codec": "raw",
        "capacity": 8 * LAYOUT.block_nbytes,
    }
    for tier in (host, s3):
        tier.update(high_watermark=1.0, low_watermark=0.99)
    with KVStore(LAYOUT, {"tiers": [host, s3]}) as store:
        agent, bystander = under_pressure(store, bottom=1)
        survived(store, agent, bystander, bottom=1)
        bucket = store.stats()["tiers"][1]
        assert bucket["kind"] == "s3" and bucket["blocks"] <= 8  # the bucket stayed full
        assert bucket["blocks_put"] > bucket["blocks"]  # ... so others were evicted from it
