"""The router against a real redis-server: prefix first, then load; load_weight trades them."""

from __future__ import annotations

import itertools

from kvstore.cluster import ClusterIndex, NodeInfo, Router
from kvstore.config import ClusterConfig
from kvstore.keys import Namespace, chain_keys, tokens_to_bytes
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import small_layout
from kvstore.testing.servers import RedisServer

LAYOUT = small_layout()
_names = itertools.count()


def cluster(redis_server: RedisServer) -> tuple[ClusterConfig, ClusterIndex]:
    config = ClusterConfig(redis_url=redis_server.url, name=f"r{next(_names)}", heartbeat_s=0.01)
    return config, ClusterIndex(config)


def test_prefix_first_then_load_then_weight(redis_server: RedisServer) -> None:
    config, index = cluster(redis_server)
    keys = make_keys(10)
    fp = LAYOUT.fingerprint_hex
    index.heartbeat(NodeInfo("busy", "127.0.0.1:1", load=50.0))
    index.heartbeat(NodeInfo("idle", "127.0.0.1:2", load=1.0))
    index.heartbeat(NodeInfo("empty", "127.0.0.1:3", load=0.0))
    index.add("default", fp, "busy", keys)  # the whole prompt
    index.add("default", fp, "idle", keys[:8])  # most of it
    with Router(config, LAYOUT) as router:
        ranked = router.rank(keys)
        assert [(r.node_id, r.prefix_blocks) for r in ranked] == [
            ("busy", 10),
            ("idle", 8),
            ("empty", 0),
        ]
        assert router.best(make_keys(3, salt=5)).node_id == "empty"  # a tie: least load
    with Router(config, LAYOUT, load_weight=0.1) as balanced:  # 50 req/s cost 5 chunks
        assert [r.node_id for r in balanced.rank(keys)] == ["idle", "busy", "empty"]
    index.close()


def test_rank_tokens_hashes_as_the_engines_do(redis_server: RedisServer) -> None:
    config, index = cluster(redis_server)
    namespace = Namespace(model="m", layout=LAYOUT)
    tokens = list(range(5 * LAYOUT.block_tokens + 3))  # a partial chunk at the end
    keys = chain_keys(tokens_to_bytes(tokens[: 5 * LAYOUT.block_tokens]), 8, namespace.seed)
    index.heartbeat(NodeInfo("a", "127.0.0.1:1"))
    index.add("default", LAYOUT.fingerprint_hex, "a", keys[:4])
    with Router(config, LAYOUT) as router:
        assert router.rank_tokens(tokens, namespace)[0].prefix_blocks == 4
    index.close()
