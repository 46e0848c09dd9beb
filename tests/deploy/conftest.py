"""The deploy tests: the files under deploy/ checked where they run here.

Tests marked ``containers`` build deploy/Dockerfile and run the image, and the compose
file's cluster, with podman (tests/deploy/deploy_podman.py says how, without a registry).
They need root, podman, runc, mmdebstrap and podman-compose (scripts/install-containers.sh
installs them) and minutes for a first build, so they run only when asked for:

    bash scripts/test-deploy.sh            # installs the tools, then runs tests/deploy
    pytest -m containers tests/deploy      # the same, where the tools are installed

Asked for where a tool is missing, they are skipped with the reason, except under CI
(``CI`` set), where that fails: a green run must not hide an install step that is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from deploy_podman import Podman, missing_tools

MARKER = "containers"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: builds and runs deploy/'s images with podman (minutes); "
        f"run with -m {MARKER} (scripts/test-deploy.sh)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MARKER in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(
        reason=f"container tests run with -m {MARKER}: bash scripts/test-deploy.sh"
    )
    for item in items:
        if MARKER in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    """podman on the tests' own storage (tests/deploy/deploy_podman.py)."""
    missing = missing_tools()
    if missing:
        why = f"needs {', '.join(missing)}: bash scripts/install-containers.sh"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    yield Podman()
