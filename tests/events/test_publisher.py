"""EventPublisher on real ZMQ sockets: sequence numbers, replay, snapshots for late subscribers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("zmq", reason="pip install 'kvstore-tiers[events]'")
pytest.importorskip("msgspec", reason="pip install 'kvstore-tiers[events]'")

from kvstore.config.events import EventsConfig
from kvstore.errors import ClosedError, ConfigError
from kvstore.events.format import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.events.publisher import SNAPSHOT_BATCH_EVENTS, EventPublisher


def removed(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i], medium="CPU")


def stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[0] * 16, block_size=16,
        lora_id=None, medium="CPU", lora_name=None,
    )  # fmt: skip


def test_batches_arrive_in_order_with_gapless_sequence_numbers(
    events_config: EventsConfig, subscribe: Callable[..., Any]
) -> None:
    config = dataclasses.replace(events_config, topic="kv@w1", data_parallel_rank=3)
    with EventPublisher(config) as pub:
        assert pub.bound_endpoint is not None and not pub.bound_endpoint.endswith(":0")
        sub = subscribe(pub.bound_endpoint, b"kv@w1")
        last = sub.join(pub)
        for i in range(50):
            pub.publish([removed(i)])
        got = sub.until(lambda m: len(m) == 50)
    assert [seq for seq, _ in got] == list(range(last + 1, last + 51))
    assert [b.events[0].block_hashes[0] for _, b in got] == list(range(50))
    assert {b.data_parallel_rank for _, b in got} == {3} and set(sub.topics) == {b"kv@w1"}
    assert pub.stats()["batches"] == last + 51 - pub.first_seq


def test_replay_sends_buffered_batches_then_the_end_marker(
    events_config: EventsConfig, replay: Callable[..., Any]
) -> None:
    with EventPublisher(events_config) as pub:
        for i in range(5):
            pub.publish([removed(i)])
        endpoint = pub.bound_replay_endpoint
        first = pub.first_seq
        got = replay(endpoint, 0)
        assert [seq for seq, _ in got] == [first + i for i in range(6)]
        assert got[0][1].events == [AllBlocksCleared()]  # the first batch: the publisher started
        assert [seq for seq, _ in replay(endpoint, first + 4)] == [first + 4, first + 5]
        assert replay(endpoint, first + 99) == []
        assert pub.stats()["replays"] == 3


def test_a_replay_older_than_the_buffer_starts_with_a_snapshot(
    events_config: EventsConfig, replay: Callable[..., Any]
) -> None:
    config = dataclasses.replace(events_config, buffer_steps=3)
    with EventPublisher(config) as pub:
        pub.add_source(lambda: [stored(100), stored(101)])
        for i in range(6):
            pub.publish([removed(i)])
        got = replay(pub.bound_replay_endpoint, 0)  # a subscriber that just started
        # the snapshot (labelled just before the buffer), then batches 4, 5, 6
        first = pub.first_seq
        assert [seq for seq, _ in got] == [first + i for i in (3, 4, 5, 6)]
        assert got[0][1].events == [AllBlocksCleared(), stored(100), stored(101)]
        assert [seq for seq, _ in replay(pub.bound_replay_endpoint, first + 5)] == [
            first + 5,
            first + 6,
        ]
        assert pub.stats()["snapshots"] == 1


def test_a_snapshot_of_more_blocks_than_a_batch_holds_replays_whole(
    events_config: EventsConfig, replay: Callable[..., Any]
) -> None:
    """The snapshot has one sequence number, so it goes in one batch: a subscriber drops a
    second batch of a number it applied, and every block past the first chunk's was lost
    (phantoms and misses in the chaos soak's event views)."""
    config = dataclasses.replace(events_config, buffer_steps=3)
    n = SNAPSHOT_BATCH_EVENTS * 2 + 7
    with EventPublisher(config) as pub:
        pub.add_source(lambda: [stored(100 + i) for i in range(n)])
        for i in range(6):
            pub.publish([removed(i)])
        got = replay(pub.bound_replay_endpoint, 0)
        seqs = [seq for seq, _ in got]
        assert len(seqs) == len(set(seqs))  # no number twice: nothing a subscriber drops
        assert got[0][1].events == [AllBlocksCleared(), *(stored(100 + i) for i in range(n))]


def test_publish_snapshot_goes_out_live_and_a_failing_source_is_skipped(
    events_config: EventsConfig, subscribe: Callable[..., Any]
) -> None:
    def broken() -> list[BlockStored]:
        raise RuntimeError("store closed")

    with EventPublisher(events_config) as pub:
        pub.add_source(broken)
        pub.add_source(lambda: [stored(7)])
        sub = subscribe(pub.bound_endpoint)
        last = sub.join(pub)
        pub.publish_snapshot()
        ((seq, batch),) = sub.until(lambda m: len(m) == 1)
    assert seq == last + 1 and batch.events == [AllBlocksCleared(), stored(7)]


def test_lifecycle_errors(events_config: EventsConfig) -> None:
    pub = EventPublisher(events_config).start()
    assert pub.start() is pub
    taken = dataclasses.replace(events_config, endpoint=pub.bound_endpoint, replay_endpoint=None)
    with pytest.raises(ConfigError, match=r"events\.endpoint"):
        EventPublisher(taken).start()  # address in use
    pub.close()
    pub.close()
    with pytest.raises(ClosedError):
        pub.publish([])
    with pytest.raises(ClosedError):
        pub.start()


def test_a_restarted_publisher_numbers_its_batches_above_the_last_run(
    events_config: EventsConfig,
) -> None:
    """Dynamo's indexer drops a batch whose sequence is not above the last it applied:
    a publisher started again (a restarted server) must go on above the old one."""
    with EventPublisher(events_config) as first:
        first.publish([removed(1)])
        last = first.stats()["next_seq"] - 1
    with EventPublisher(events_config) as second:
        assert second.first_seq > last


def test_an_idle_publisher_sends_empty_heartbeat_batches(
    events_config: EventsConfig, subscribe: Callable[..., Any]
) -> None:
    """A subscriber that missed batches learns of the gap from the next heartbeat."""
    config = dataclasses.replace(events_config, heartbeat_s=0.05)
    with EventPublisher(config) as pub:
        sub = subscribe(pub.bound_endpoint)
        last = sub.join(pub)
        got = sub.until(lambda m: len(m) >= 3, timeout=5.0)
    assert [seq for seq, _ in got] == [last + 1, last + 2, last + 3]
    assert all(batch.events == [] for _, batch in got)


def test_a_socket_bound_beyond_loopback_without_authentication_warns_once(
    events_config: EventsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 50, item 14: the events carry the prompts' token ids, and a wildcard endpoint
    hands them to anyone who reaches the port. A kvstore-server refuses to listen beyond
    loopback without a token; a publisher that binds there unauthenticated says so, once
    (loopback, ``ipc://`` and authenticated publishers say nothing)."""
    exposed = dataclasses.replace(
        events_config, endpoint="tcp://*:0", replay_endpoint="tcp://0.0.0.0:0"
    )
    with caplog.at_level("WARNING", logger="kvstore.events.publisher"):
        with EventPublisher(exposed) as pub:
            pub.publish([removed(1)])
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(said) == 1, said
        assert said[0].startswith("KV events on tcp://*:0 and tcp://0.0.0.0:0 reach every host")
        assert "unauthenticated" in said[0] and "token ids" in said[0]
        assert "tcp://127.0.0.1" in said[0]  # what to bind instead
        caplog.clear()
        with EventPublisher(events_config):  # loopback
            pass
        with EventPublisher(exposed, authenticate=lambda user, secret: False):
            pass
        assert [r for r in caplog.records if r.levelname == "WARNING"] == []
