"""Fixtures of the cluster tests: groups of node processes (see ``cluster_nodes.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_nodes import Nodes

from kvstore.cli.servers import RedisCluster, RedisServer, S3Server


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def nodes(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    redis_cluster: RedisCluster,
    s3_server: S3Server,
) -> Iterator[Nodes]:
    clustered = request.param == "redis-cluster"
    url = redis_cluster.url if clustered else redis_server.url
    group = Nodes(tmp_path_factory.mktemp("nodes"), url, clustered, s3_server).start()
    yield group
    group.stop()


@pytest.fixture
def own_nodes(tmp_path: Path, s3_server: S3Server) -> Iterator[tuple[Nodes, RedisServer]]:
    """Nodes with a Redis of their own, for tests that kill things."""
    with RedisServer() as redis:
        group = Nodes(tmp_path, redis.url, False, s3_server).start()
        try:
            yield group, redis
        finally:
            group.stop()
