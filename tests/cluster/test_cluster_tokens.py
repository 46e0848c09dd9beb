"""A cluster node whose token a peer accepts but which does not open the namespace: the
node says so in one log line; a get of the blocks is a miss (it comes back short, as a
refused remote tier's is: issue 50), and a get into a buffer that found no other copy
says the peer refused the token (never "not stored"). A real redis-server holds the
index, a real kvstore-server is the peer."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable

import pytest
import torch
from cluster_nodes import eventually

from kvstore import KVStore
from kvstore.cli.servers import RedisServer
from kvstore.cluster import ClusterIndex
from kvstore.cluster.index import NodeInfo
from kvstore.config import ClusterConfig
from kvstore.errors import BlockNotFoundError
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
ADMIN = "admin-token-0123456789abcdef"
NODE_TOKEN = "node-token-0123456789abcdef"
_names = itertools.count()


def test_a_peer_that_refuses_the_namespace_is_named_in_the_log_and_in_get(
    kv_server: Start, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # The peer accepts NODE_TOKEN, for namespace "other" only; the node reads "default".
    peer = kv_server(
        token=ADMIN, tokens=[{"name": "node", "token": NODE_TOKEN, "namespaces": ["other"]}]
    )
    cluster = ClusterConfig(
        redis_url=redis_server.url, name=f"tokens{next(_names)}-{os.getpid()}", heartbeat_s=30.0
    )
    keys = make_keys(2, salt=31)
    index = ClusterIndex(cluster)
    try:
        index.heartbeat(NodeInfo("peer", peer.address))
        index.add("default", LAYOUT.fingerprint_hex, "peer", keys)
        node = {**cluster.to_dict(), "node_id": "reader", "token": NODE_TOKEN}
        config = {"tiers": [{"kind": "host", "capacity": "4MiB"}], "cluster": node}
        with KVStore(LAYOUT, config) as store:
            assert eventually(lambda: store.lookup(keys) == 2)  # the index lists them
            assert store.get(keys).shape[2] == 0  # a miss, not an error
            out = torch.empty(LAYOUT.tensor_shape(len(keys)), dtype=LAYOUT.dtype)
            for _ in range(2):
                with pytest.raises(BlockNotFoundError) as raised:
                    store.get(keys, out=out)
                message = str(raised.value)
                assert "not stored" not in message and "\n" not in message
                assert "cluster peer peer: " in message and peer.address in message
                assert "does not open namespace 'default'" in message
            tier = next(t for t in store.stats()["tiers"] if t["kind"] == "cluster")
            assert tier["unreachable_peers"] == ["peer"] and tier["peer_auth_failures"] >= 1
    finally:
        index.close()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and not r.name.startswith("kvstore.server")
    ]
    assert len(lines) == 1, lines
    assert "refused this node's token" in lines[0] and "cluster.token" in lines[0]
    assert "namespace 'default'" in lines[0]
