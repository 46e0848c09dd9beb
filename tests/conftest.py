"""Shared fixtures; CUDA tests are skipped cleanly where no GPU exists."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.server import ServerThread
from kvstore.testing.data import host_config, small_layout
from kvstore.testing.kvserver import server_test_config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
