"""Real servers for the remote-tier tests: moto S3, redis-server, a 3-node Redis Cluster.

Servers are started once per session on free 127.0.0.1 ports and stopped at
the end; tests keep apart by using a fresh prefix each. A server that cannot
start fails the tests that need it (nothing is skipped). AWS credentials are
dummy values set per test with monkeypatch, so no other test sees them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.testing.servers import DUMMY_AWS_ENV, RedisCluster, RedisServer, S3Server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials for moto; no profile, config file or endpoint from outside."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/kvstore-test-aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/kvstore-test-aws-creds")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:
        yield cluster
