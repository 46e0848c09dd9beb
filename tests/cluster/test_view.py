"""The in-memory copy of the shared index against a real redis-server and a real Redis
Cluster: it follows the change stream, drops nodes whose lease ran out, voids a node's
entries when it re-registers, and reloads when it fell behind or Redis restarted."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from kvstore.cli.servers import RedisCluster, RedisServer
from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.cluster.view import IndexView
from kvstore.config import ClusterConfig
from kvstore.datapath.contracts import Medium
from kvstore.testing.conformance import make_keys

_names = itertools.count()
FP = "0123456789abcdef"


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.01)
    return check()


def make_index(url: str, clustered: bool = False, heartbeat_s: float = 0.2) -> ClusterIndex:
    config = ClusterConfig(
        redis_url=url,
        redis_cluster=clustered,
        name=f"v{next(_names)}",
        heartbeat_s=heartbeat_s,
        lease_heartbeats=3,
    )
    return ClusterIndex(config)


@pytest.fixture(params=["standalone", "cluster"])
def index(
    request: pytest.FixtureRequest, redis_server: RedisServer, redis_cluster: RedisCluster
) -> Iterator[ClusterIndex]:
    clustered = request.param == "cluster"
    idx = make_index(redis_cluster.url if clustered else redis_server.url, clustered)
    yield idx
    idx.close()


def media(view: IndexView, keys: list[bytes]) -> list[dict[str, Medium]]:
    return [{h.node.node_id: h.medium for h in hs} for hs in view.holders(keys)]


def test_the_view_follows_changes_as_they_are_published(index: ClusterIndex) -> None:
    keys = make_keys(2100)  # more than one stream entry per change
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.heartbeat(NodeInfo("b", "127.0.0.1:2"))
    index.add("ns", FP, "a", keys[:5], Medium.DISK)  # before the view starts: the snapshot
    view = IndexView(index, "ns", FP)
    view.start()
    try:
        assert media(view, keys[:6]) == [{"a": Medium.DISK}] * 5 + [{}]
        index.add("ns", FP, "b", keys)  # after: the stream
        assert eventually(lambda: media(view, keys[-1:]) == [{"b": Medium.MEMORY}])
        assert media(view, keys[:1]) == [{"b": Medium.MEMORY, "a": Medium.DISK}]  # memory first
        changes = {keys[0]: (Medium.MEMORY, Medium.SHARED), keys[1]: (Medium.MEMORY, Medium.DISK)}
        index.publish("ns", FP, "b", changes)
        assert eventually(lambda: view.shared(keys[:1]) == [True])
        assert media(view, keys[:2]) == [{"a": Medium.DISK}, {"a": Medium.DISK, "b": Medium.DISK}]
        index.publish("ns", FP, "b", {keys[0]: (Medium.SHARED, Medium.NONE)})  # deleted
        assert eventually(lambda: view.shared(keys[:1]) == [False])
        index.replace("ns", FP, "a", [(keys[9], Medium.MEMORY)])  # a re-registered
        assert eventually(
            lambda: media(view, keys[9:10]) == [{"a": Medium.MEMORY, "b": Medium.MEMORY}]
        )
        assert media(view, keys[:1]) == [{}]  # a's old entries are void
        assert index.locate("ns", FP, keys[:10], ["a"])["a"] == [False] * 9 + [True]
        index.leave("b", [("ns", FP)])
        assert eventually(lambda: media(view, keys[9:10]) == [{"a": Medium.MEMORY}])
        assert view.synced and view.reloads == 1
    finally:
        view.close()


def test_a_node_whose_lease_ran_out_drops_out_of_every_answer(index: ClusterIndex) -> None:
    keys = make_keys(3)
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.heartbeat(NodeInfo("b", "127.0.0.1:2"))
    index.add("ns", FP, "a", keys)
    index.add("ns", FP, "b", keys)
    view = IndexView(index, "ns", FP)
    view.start()
    try:
        assert [len(h) for h in view.holders(keys)] == [2, 2, 2]
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # b beats, a does not (lease 0.6 s)
            index.heartbeat(NodeInfo("b", "127.0.0.1:2"))
            index.refresh("ns", FP, "b")
            time.sleep(0.1)
        assert [[n.node.node_id for n in h] for h in view.holders(keys)] == [["b"]] * 3
        assert set(view.nodes()) == {"b"}
    finally:
        view.close()


def test_a_view_that_fell_behind_reloads(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream keeps only the last entries: a view whose position was trimmed away
    while it was not reading loads a snapshot instead of missing changes."""
    index = make_index(redis_server.url, heartbeat_s=1.0)  # a lease of 3 s: under load too
    keys = make_keys(300)
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.add("ns", FP, "a", keys[:1])
    reading = threading.Event()
    reading.set()
    read_changes = index.read_changes

    def stalled(*args: Any, **kwargs: Any) -> Any:
        if not reading.is_set():  # a reader stuck elsewhere: it reads nothing meanwhile
            reading.wait(10)
            return []
        return read_changes(*args, **kwargs)

    monkeypatch.setattr(index, "read_changes", stalled)
    view = IndexView(index, "ns", FP)
    view.start()
    try:
        reading.clear()
        time.sleep(0.5)  # the follower is now stalled
        for key in keys[1:]:
            index.add("ns", FP, "a", [key])
        raw = redis.Redis.from_url(redis_server.url)
        raw.xtrim(index.stream_key("ns", FP), maxlen=2)  # as MAXLEN ~ does, at scale
        raw.close()
        index.heartbeat(NodeInfo("a", "127.0.0.1:1"))  # alive still, however long that took
        reading.set()
        assert eventually(lambda: [len(h) for h in view.holders(keys)] == [1] * 300, 10)
        assert view.reloads >= 2
    finally:
        view.close()
        index.close()


def test_redis_restarted_empty_the_view_reloads_what_nodes_write_again() -> None:
    keys = make_keys(4)
    with RedisServer() as redis:
        index = make_index(redis.url)
        index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
        index.add("ns", FP, "a", keys[:2])
        view = IndexView(index, "ns", FP)
        view.start()
        try:
            assert [len(h) for h in view.holders(keys)] == [1, 1, 0, 0]
            redis.kill()
            assert eventually(lambda: not view.synced, 5)
            assert [len(h) for h in view.holders(keys)] == [1, 1, 0, 0]  # the last it knew
            redis.start()
            index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
            index.replace("ns", FP, "a", keys[2:])  # a node registers everything again
            assert eventually(lambda: [len(h) for h in view.holders(keys)] == [0, 0, 1, 1], 10)
            assert view.synced and view.reloads >= 2
        finally:
            view.close()
            index.close()


def test_a_node_that_registers_while_the_view_loads_is_not_left_out(
    index: ClusterIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node a beats and writes its list just after the loading view read the live nodes
    (a was not among them) and before it read the stream's position: a is in neither
    the snapshot nor the stream after it. The view must still list a's keys (before,
    they were missing until a registered again: after Redis came back empty, for good)."""
    keys = make_keys(5)
    live_nodes = index.live_nodes
    calls = itertools.count()

    def registering_meanwhile() -> dict[str, NodeInfo]:
        live = live_nodes()
        if next(calls) == 0:  # a registers right after the view read who is live
            index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
            index.replace("ns", FP, "a", keys)
        return live

    monkeypatch.setattr(index, "live_nodes", registering_meanwhile)
    view = IndexView(index, "ns", FP)
    view.start()
    try:
        assert eventually(lambda: media(view, keys) == [{"a": Medium.MEMORY}] * 5, 3)
        assert view.synced
    finally:
        view.close()
