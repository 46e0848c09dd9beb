"""Shared fixtures; CUDA tests are skipped cleanly where no GPU exists."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvstore import KVLayout, KVStore
from kvstore.testing.data import host_config, small_layout


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
