"""StoreEvents on a real KVStore (host over disk): what a subscriber decodes as blocks
are stored, demoted, deleted and cleared, and what a late or restarted one learns."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq", reason="pip install 'kvstore-tiers[events]'")
pytest.importorskip("msgspec", reason="pip install 'kvstore-tiers[events]'")

from kvstore import KVLayout, KVStore
from kvstore.config.events import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import EventPublisher, StoreEvents, TokenBook
from kvstore.events.blocks import BlockMapper
from kvstore.events.format import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout(block_tokens=32)  # 2 published blocks of 16 per chunk


def tiers(disk: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"kind": "host", "capacity": 8 * LAYOUT.block_nbytes},
            {"kind": "disk", "path": str(disk), "capacity": "4MiB"},
        ]
    }


class Rig:
    """A store, its book, a publisher and StoreEvents, started; closed in reverse."""

    def __init__(self, disk: Path, config: EventsConfig, journal: Path | None = None) -> None:
        self.store = KVStore(LAYOUT, tiers(disk))
        self.book = TokenBook(LAYOUT.block_tokens, journal=journal)
        self.pub = EventPublisher(config)
        self.events = StoreEvents(self.store, self.book, self.pub).start()
        self.mapper = BlockMapper(LAYOUT.block_tokens, config)

    def put(self, tokens: list[int], record: bool = True) -> list[bytes]:
        keys = self.store.hash_tokens(tokens, "m")
        if record:
            self.book.record(keys, tokens)
        assert self.store.put(keys, random_blocks(LAYOUT, len(keys))) == len(keys)
        return keys

    def close(self) -> None:
        self.events.close()
        self.pub.close()
        self.book.close()
        self.store.close()


@pytest.fixture
def rig(tmp_path: Path, events_config: EventsConfig) -> Iterator[Rig]:
    r = Rig(tmp_path / "disk", events_config)
    yield r
    r.close()


def flat(messages: list[tuple[int, Any]]) -> list[Any]:
    return [event for _, batch in messages for event in batch.events]


def test_stored_demoted_deleted_cleared(rig: Rig, subscribe: Callable[..., Any]) -> None:
    sub = subscribe(rig.pub.bound_endpoint)
    last = sub.join(rig.pub)
    tokens = list(range(96))
    keys = rig.put(tokens)
    got = sub.until(lambda m: len(flat(m)) >= 3)
    first, second, third = flat(got)
    assert all(isinstance(e, BlockStored) for e in (first, second, third))
    assert first.block_hashes == rig.mapper.hashes(keys[0]) and first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[-1]
    assert third.parent_block_hash == second.block_hashes[-1]
    assert first.token_ids + second.token_ids + third.token_ids == tokens
    assert {(e.medium, e.locality, e.block_size) for e in (first, second, third)} == {
        ("CPU", "LOCAL", 16)
    }

    (victim,) = rig.store.evict(1, tier=0)  # demoted to the disk tier
    rig.store.drain()
    demoted = flat(sub.until(lambda m: len(flat(m)) >= 2))
    assert demoted[0] == BlockRemoved(
        block_hashes=rig.mapper.hashes(victim), medium="CPU", locality="LOCAL"
    )  # the removal first: a consumer ignoring the medium keeps the block
    assert isinstance(demoted[1], BlockStored)
    assert (demoted[1].medium, demoted[1].locality) == ("STORAGE", "LOCAL")
    assert demoted[1].block_hashes == rig.mapper.hashes(victim)

    rig.store.delete([victim])
    (gone,) = flat(sub.until(lambda m: len(flat(m)) >= 1))
    assert gone == BlockRemoved(
        block_hashes=rig.mapper.hashes(victim), medium="STORAGE", locality="LOCAL"
    )
    # Its tokens are forgotten with it, once it has stayed gone a moment (a client
    # putting it again records them before the put lands: next test).
    deadline = time.monotonic() + 10
    while victim in rig.book:
        assert time.monotonic() < deadline, "the tokens of a deleted block stayed"
        time.sleep(0.05)

    rig.store.clear()
    rig.events.cleared()
    tail = sub.until(lambda m: bool(m) and m[-1][1].events == [AllBlocksCleared()])
    assert tail[-1][0] > last
    assert len(rig.book) == 0
    stats = rig.events.stats()
    assert stats["stored_events"] >= 4 and stats["removed_events"] >= 2
    assert stats["bytes"] > 0 and stats["skipped_without_tokens"] == 0


def test_a_block_put_again_right_after_its_delete_is_announced(
    rig: Rig, subscribe: Callable[..., Any]
) -> None:
    """A client puts a chunk again by recording its tokens, then storing it. A drain of
    the events that sees the chunk's earlier removal between the two (gone from every
    tier, its new copy not stored yet) used to forget the tokens just recorded: the chunk
    stored again was never announced, and after a restart no one announced it."""
    sub = subscribe(rig.pub.bound_endpoint)
    sub.join(rig.pub)
    tokens = list(range(500, 532))
    (key,) = rig.put(tokens)
    assert isinstance(flat(sub.until(lambda m: len(flat(m)) >= 1))[0], BlockStored)
    rig.store.delete([key])
    rig.book.record([key], tokens)  # the client's put again: tokens first ...
    rig.events.flush()  # ... a drain sees the removal, the new copy not yet stored ...
    assert rig.store.put([key], random_blocks(LAYOUT, 1)) == 1  # ... then the store lands
    rig.events.flush()
    got = flat(sub.until(lambda m: any(isinstance(e, BlockStored) for e in flat(m))))
    assert got[0] == BlockRemoved(
        block_hashes=rig.mapper.hashes(key), medium="CPU", locality="LOCAL"
    )
    stored = [e for e in got if isinstance(e, BlockStored)]
    assert stored and stored[0].block_hashes == rig.mapper.hashes(key)
    assert key in rig.book and rig.events.stats()["skipped_without_tokens"] == 0


def test_a_full_host_tier_demotes_and_sequence_numbers_have_no_gaps(
    rig: Rig, subscribe: Callable[..., Any]
) -> None:
    sub = subscribe(rig.pub.bound_endpoint)
    last = sub.join(rig.pub)
    for i in range(20):  # the host tier holds 8: the rest is demoted to disk as it fills
        rig.put([i] * 32)
        time.sleep(0.002)
    rig.store.drain()

    def count(m: list[tuple[int, Any]], kind: type, medium: str) -> int:
        return sum(isinstance(e, kind) and e.medium == medium for e in flat(m))

    got = sub.until(
        lambda m: (
            count(m, BlockStored, "CPU") == 20
            and count(m, BlockStored, "STORAGE") >= 12
            and count(m, BlockRemoved, "CPU") >= 1
        )
    )
    assert [seq for seq, _ in got] == list(range(last + 1, last + 1 + len(got)))
    demoted = {tuple(e.block_hashes) for e in flat(got) if e.medium == "STORAGE"}
    removed = {
        tuple(e.block_hashes[i : i + 2])
        for e in flat(got)
        if isinstance(e, BlockRemoved)
        for i in range(0, len(e.block_hashes), 2)
    }
    assert demoted == removed  # each demotion: stored on disk, removed from memory


def test_keys_without_tokens_wait_for_them_then_are_skipped(
    rig: Rig, subscribe: Callable[..., Any]
) -> None:
    sub = subscribe(rig.pub.bound_endpoint)
    sub.join(rig.pub)
    late = rig.put(list(range(32)), record=False)
    time.sleep(0.05)
    rig.book.record(late, list(range(32)))  # tokens told just after the put: still published
    (event,) = flat(sub.until(lambda m: len(flat(m)) >= 1))
    assert event.block_hashes == rig.mapper.hashes(late[0])
    rig.put(list(range(100, 132)), record=False)  # never told
    deadline = time.monotonic() + 5
    while rig.events.stats()["skipped_without_tokens"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rig.events.stats()["skipped_without_tokens"] == 1
    assert sub.recv(0.1) is None


def test_tokens_of_chunks_never_stored_are_dropped(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens noted for puts that stored nothing (no room, a client gone mid-put) were
    kept for ever: a server's book grew with every such put."""
    import kvstore.events.source as source

    monkeypatch.setattr(source, "_TRIM_S", 0.0)
    monkeypatch.setattr(source, "_TOKENS_GRACE_S", 0.2)
    held = rig.put(list(range(32)))
    never = rig.store.hash_tokens(list(range(500, 532)), "m")
    rig.book.record(never, list(range(500, 532)))  # the put that would follow failed
    deadline = time.monotonic() + 10
    while any(k in rig.book for k in never) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(k in rig.book for k in never)
    assert all(k in rig.book for k in held)  # the store holds these: kept


def test_a_late_subscriber_replays_a_snapshot(
    tmp_path: Path, events_config: EventsConfig, replay: Callable[..., Any]
) -> None:
    r = Rig(tmp_path / "disk", dataclasses.replace(events_config, buffer_steps=2))
    try:
        tokens = list(range(64))
        keys = r.put(tokens)
        for i in range(4):
            r.put([1000 + i] * 32)
        r.events.flush()
        time.sleep(0.2)
        got = replay(r.pub.bound_replay_endpoint, 0)
        events = flat(got)
        assert events[0] == AllBlocksCleared()
        stored = [e for e in events if isinstance(e, BlockStored)]
        hashes = [e.block_hashes for e in stored]
        assert r.mapper.hashes(keys[0]) in hashes and r.mapper.hashes(keys[1]) in hashes
        assert hashes.index(r.mapper.hashes(keys[0])) < hashes.index(r.mapper.hashes(keys[1]))
        assert len({tuple(h) for h in hashes}) == 6
    finally:
        r.close()


def test_a_restart_announces_what_the_disk_kept(
    tmp_path: Path, events_config: EventsConfig, replay: Callable[..., Any]
) -> None:
    journal = tmp_path / "tokens.journal"
    first = Rig(tmp_path / "disk", events_config, journal)
    tokens = list(range(64))
    keys = first.put(tokens)
    first.store.flush(keys)
    first.close()
    second = Rig(tmp_path / "disk", events_config, journal)
    try:
        second.events.flush()
        time.sleep(0.1)
        events = flat(replay(second.pub.bound_replay_endpoint, 0))
        assert events[0] == AllBlocksCleared()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored] == [tokens[:32], tokens[32:]]
        assert {(e.medium, e.locality) for e in stored} == {("STORAGE", "LOCAL")}
    finally:
        second.close()


def test_mismatched_sizes_are_refused_at_start_up(
    tmp_path: Path, events_config: EventsConfig
) -> None:
    layout: KVLayout = small_layout(block_tokens=24)
    with KVStore(layout, tiers(tmp_path)) as store:
        pub = EventPublisher(events_config)
        with pytest.raises(ConfigError, match="must divide"):
            StoreEvents(store, TokenBook(24), pub)
        with pytest.raises(ConfigError, match="token book"):
            StoreEvents(store, TokenBook(32), pub)
        pub.close()
