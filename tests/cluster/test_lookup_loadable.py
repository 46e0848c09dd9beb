"""A lookup that says "held" must be loadable: a real node process, a real redis-server
and an in-process member with no S3 behind it, while the member's copy of the index
trails what Redis holds (issue 32's intermittent after ``FLUSHALL``)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from cluster_nodes import LAYOUT, blocks, eventually

from kvstore import KVStore
from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.cli.servers import RedisServer
from kvstore.client import Client, ClientOptions
from kvstore.cluster import ClusterIndex, ClusterTier
from kvstore.config import ClusterConfig
from kvstore.testing.conformance import make_keys

_names = itertools.count()
FP = LAYOUT.fingerprint_hex


@pytest.fixture
def node_a(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[ClusterConfig, Client]]:
    """Node a (host memory only, no S3 in this cluster) and a client of it."""
    cluster = ClusterConfig(
        redis_url=redis_server.url,
        name=f"loadable{next(_names)}-{os.getpid()}",
        heartbeat_s=0.3,
        lease_heartbeats=3,
        hot_threshold=1000,  # no replica: the blocks stay a's alone
        peer_timeout_s=2.0,
    )
    config = {
        "tiers": [{"kind": "host", "capacity": "8MiB"}],
        "cluster": {**cluster.to_dict(), "node_id": "a"},
    }
    with (
        KVStoreServerProcess(config, tmp_path / "a") as proc,
        Client(LAYOUT, ClientOptions(proc.address, shared_memory=False)) as client,
    ):
        yield cluster, client


def _member(cluster: ClusterConfig) -> KVStore:
    config = {
        "tiers": [{"kind": "host", "capacity": "4MiB"}],
        "cluster": {**cluster.to_dict(), "node_id": "c"},
    }
    return KVStore(LAYOUT, config)


def test_a_lookup_hit_stays_loadable_while_the_copy_reads_a_reregistration(
    node_a: tuple[ClusterConfig, Client], redis_server: RedisServer
) -> None:
    """After Redis lost the index, a node writes its list again: a reset entry (its old
    entries void), then its keys in the entries after it. A member whose copy has read
    the reset but not yet the keys finds no holder for blocks its lookup just called
    held; its get asks Redis, which lists a, and loads them."""
    cluster, a = node_a
    keys, data = make_keys(8, salt=3201), blocks(8, seed=3201)
    assert all(a.put(keys, data))
    with contextlib.closing(ClusterIndex(cluster)) as index:
        assert eventually(lambda: index.locate("default", FP, keys, ["a"])["a"] == [True] * 8)
        stream = index.stream_key("default", FP)
    with _member(cluster) as member:
        assert eventually(lambda: member.lookup(keys) == 8)
        assert member.lookup(keys, recheck=True) == 8
        tier = next(t for t in member.engine.datapath.tiers if isinstance(t, ClusterTier))
        raw = redis.Redis.from_url(redis_server.url)
        try:  # the first entry a re-registration writes, as the copy reads it alone
            raw.xadd(stream, {"n": "a", "r": "1"})
        finally:
            raw.close()
        assert eventually(lambda: tier.index_view().holders(keys) == [[]] * 8)
        out = torch.empty(LAYOUT.tensor_shape(8), dtype=LAYOUT.dtype)
        member.get(keys, out)  # all or nothing: raised BlockNotFoundError before
        assert torch.equal(out, torch.cat(data, dim=2))
        assert tier.stats()["redis_rechecks"] >= 1
