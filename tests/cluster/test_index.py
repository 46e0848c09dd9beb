"""The shared index against a real redis-server and a real 3-node Redis Cluster: node sets,
leases that expire, lookups, repairs, heat and replica claims."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator

import pytest

from kvstore.cli.servers import RedisCluster, RedisServer
from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.config import ClusterConfig
from kvstore.errors import TierError
from kvstore.testing.conformance import make_keys

_names = itertools.count()
FP = "0123456789abcdef"


@pytest.fixture(params=["standalone", "cluster"])
def index(
    request: pytest.FixtureRequest, redis_server: RedisServer, redis_cluster: RedisCluster
) -> Iterator[ClusterIndex]:
    clustered = request.param == "cluster"
    url = redis_cluster.url if clustered else redis_server.url
    config = ClusterConfig(
        redis_url=url,
        redis_cluster=clustered,
        name=f"t{next(_names)}",
        heartbeat_s=0.2,
        lease_heartbeats=2,
    )
    idx = ClusterIndex(config)
    yield idx
    idx.close()


@pytest.fixture
def short(index: ClusterIndex) -> ClusterIndex:
    """The fixture's index (0.4 s lease), by another name."""
    return index


def test_nodes_come_and_go_with_their_lease(index: ClusterIndex) -> None:
    index.heartbeat(NodeInfo("a", "127.0.0.1:1", load=2.5, blocks=7))
    index.heartbeat(NodeInfo("b", None))
    live = index.live_nodes()
    assert live["a"] == NodeInfo("a", "127.0.0.1:1", 2.5, 7)
    assert live["b"].advertise is None
    time.sleep(0.2)
    index.heartbeat(NodeInfo("b", None))
    time.sleep(0.3)  # a's lease (0.4 s) ran out, b renewed
    assert set(index.live_nodes()) == {"b"}


def test_sets_locate_repair_and_expire(short: ClusterIndex) -> None:
    # The same index with a lease long enough for 2500 keys on a loaded 2-core machine;
    # the fixture's 0.4 s lease is checked at the end.
    index = ClusterIndex(dataclasses.replace(short.config, heartbeat_s=5.0))
    keys = make_keys(2500)  # more than one SADD / SMISMEMBER batch
    index.add("ns", FP, "a", keys[:2000])
    index.add("ns", FP, "b", keys[1000:])
    found = index.locate("ns", FP, keys, ["a", "b", "c"])
    assert found["a"] == [True] * 2000 + [False] * 500
    assert found["b"] == [False] * 1000 + [True] * 1500
    assert found["c"] == [False] * 2500
    assert index.locate("other", FP, keys[:3], ["a"])["a"] == [False] * 3  # namespaces apart
    index.forget("ns", FP, "a", keys[:10])
    index.remove("ns", FP, "b", keys[1000:1010])
    found = index.locate("ns", FP, keys[:20] + keys[1000:1020], ["a", "b"])
    assert found["a"] == [False] * 10 + [True] * 30
    assert found["b"] == [False] * 20 + [False] * 10 + [True] * 10
    index.replace("ns", FP, "a", keys[:5])
    assert index.locate("ns", FP, keys[:6], ["a"])["a"] == [True] * 5 + [False]
    index.close()
    short.replace("ns", FP, "a", keys[:5])  # under the fixture's short lease
    short.remove("ns", FP, "b", keys[1010:])
    assert short.locate("ns", FP, keys[:6], ["a"])["a"] == [True] * 5 + [False]
    time.sleep(0.5)  # nobody refreshed: the sets expired
    assert short.locate("ns", FP, keys[:6], ["a", "b"]) == {"a": [False] * 6, "b": [False] * 6}


def test_refresh_keeps_entries_and_leave_drops_them(index: ClusterIndex) -> None:
    keys = make_keys(3)
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.add("ns", FP, "a", keys)
    for _ in range(3):
        time.sleep(0.2)
        index.refresh("ns", FP, "a")
    assert index.locate("ns", FP, keys, ["a"])["a"] == [True] * 3
    index.leave("a", [("ns", FP)])
    assert index.locate("ns", FP, keys, ["a"])["a"] == [False] * 3
    assert "a" not in index.live_nodes()


def test_heat_decay_and_replica_claims(index: ClusterIndex) -> None:
    keys = make_keys(3)
    for _ in range(4):
        index.heat("ns", FP, keys[:2])
    index.heat("ns", FP, keys[:1])
    assert index.heat_of("ns", FP, keys) == [5.0, 4.0, 0.0]
    assert [k for k, _ in index.hottest("ns", FP, 4)] == keys[:2]
    assert index.decay("ns", FP, period_s=60) is True
    assert index.decay("ns", FP, period_s=60) is False  # once per period, cluster-wide
    assert index.heat_of("ns", FP, keys) == [2.5, 2.0, 0.0]
    first = index.claim_replicas("ns", FP, keys[:2], [1, 2], ttl_s=60)
    second = index.claim_replicas("ns", FP, keys[:2], [1, 2], ttl_s=60)
    assert first == [True, True] and second == [False, True]


def test_an_unreachable_redis_is_a_tier_error() -> None:
    index = ClusterIndex(ClusterConfig(redis_url="redis://127.0.0.1:1/0"))
    with pytest.raises(TierError, match="unavailable"):
        index.live_nodes()
