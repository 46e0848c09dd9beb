"""Shared fixtures: CUDA tests skipped where no GPU exists; real servers (kvstore-server,
redis-server, a 3-node Redis Cluster, moto S3) on free ports, stopped at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharness.mounts import mount_tmpfs, unmount
from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.cli.kvserver import server_test_config
from kvstore.cli.servers import DUMMY_AWS_ENV, RedisCluster, RedisServer, S3Server
from kvstore.server import ServerThread
from kvstore.testing.data import host_config, small_layout

#: Modules besides those marked ``slow`` that take half a minute or more on two cores.
LONG_MODULES = frozenset(
    {
        "test_soak_short.py",
        "test_docs_snippets.py",
        "test_limits.py",
        "test_bench_peers.py",
        "test_bench_gpu_model.py",
        "test_bench_cluster.py",
        "test_run_all.py",
        "test_trust.py",
        "test_nodes.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not in pyproject.toml: its hash is the set-up scripts' stamp, and a
    # change there rebuilds the engines' venv.
    config.addinivalue_line(
        "markers",
        "engine: runs an engine's virtualenv (.venv-vllm, .venv-dynamo, .venv-lmcache); "
        "scripts/test.sh --fast leaves it out, as it does slow",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Long modules first (a stable sort keeps the order within each): with ``--dist
    # loadfile`` a module runs on one worker, and a long one handed out last leaves the
    # other worker idle at the end.
    long = {item.path for item in items if item.get_closest_marker("slow")}
    long |= {item.path for item in items if item.path.name in LONG_MODULES}
    items.sort(key=lambda item: item.path not in long)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Tests see no KVSTORE_* variables, and the default disk tier lives in a temp dir."""
    import os

    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture
def layout() -> KVLayout:
    return small_layout()


@pytest.fixture
def store(layout: KVLayout) -> Iterator[KVStore]:
    with KVStore(layout, host_config(layout, 64)) as s:
        yield s


@pytest.fixture
def kv_server() -> Iterator[Callable[..., ServerThread]]:
    """Start in-process kvstore-servers (``kv_server(tiers=None, **server_settings)``);
    each gets a short scratch directory (Unix socket paths are limited to 107 bytes)
    and is drained and removed at the end of the test."""
    started: list[tuple[ServerThread, str]] = []

    def start(tiers: list[dict[str, Any]] | None = None, **server: Any) -> ServerThread:
        work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
        config = StoreConfig.from_dict(server_test_config(work, tiers, **server), environ={})
        thread = ServerThread(config)
        started.append((thread, work))
        return thread.start()

    yield start
    for thread, work in started:
        thread.stop()
        shutil.rmtree(work, ignore_errors=True)


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


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``tmpfs(name, size)``: a real tmpfs of ``size`` at ``tmp_path / name``, unmounted
    after the test; the test skips where this machine lets it mount none."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        path = tmp_path / name
        if not mount_tmpfs(path, size):
            pytest.skip("this machine does not let the tests mount a tmpfs")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        unmount(path)
