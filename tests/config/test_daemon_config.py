"""One config per role: a server's single YAML file loads into a StoreConfig (what each
hosted store opens with) and a ServerConfig (the daemon's own settings)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.config import (
    ClusterConfig,
    DaemonConfig,
    EventsConfig,
    ServerConfig,
    StoreConfig,
    load_daemon_config,
)

TOKEN = "server-token-0123456789"

FILE = f"""\
tiers: [{{kind: host, capacity: 16MiB}}]
lease_s: 7
server: {{listen: "127.0.0.1:7171", token: {TOKEN}, max_stores: 3}}
cluster: {{redis_url: "redis://127.0.0.1:6379/0", name: c1, node_id: n1}}
events: {{enabled: true, endpoint: "tcp://127.0.0.1:5557"}}
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)


def test_one_file_loads_into_a_type_per_role(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(FILE)
    daemon = load_daemon_config(path)
    assert isinstance(daemon.store, StoreConfig) and isinstance(daemon.server, ServerConfig)
    assert daemon.store.lease_s == 7 and daemon.store.tiers[0].capacity == 16 << 20
    assert (daemon.server.listen, daemon.server.max_stores) == ("127.0.0.1:7171", 3)
    assert isinstance(daemon.cluster, ClusterConfig) and daemon.cluster.name == "c1"
    assert isinstance(daemon.events, EventsConfig) and daemon.events.enabled
    # peers are reached with the server's token when the cluster names none
    assert daemon.store.cluster.token == TOKEN
    # the same file still reads as one StoreConfig (existing code keeps working)
    assert StoreConfig.load(path).server == daemon.server
    assert load_daemon_config(daemon) is daemon


def test_env_overrides_the_servers_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(FILE)
    monkeypatch.setenv("KVSTORE_SERVER_MAX_STORES", "9")
    monkeypatch.setenv("KVSTORE_HOST_CAPACITY", "8MiB")
    daemon = load_daemon_config(path)
    assert daemon.server.max_stores == 9 and daemon.store.tiers[0].capacity == 8 << 20


def test_a_server_runs_from_a_daemon_config(tmp_path: Path) -> None:
    from kvstore.server import ServerThread

    store = StoreConfig.from_dict(
        {"tiers": [{"kind": "host", "capacity": "8MiB", "pinned": False, "prefault": False}]},
        environ={},
    )
    daemon = DaemonConfig(store=store, server=ServerConfig(listen="127.0.0.1:0", max_stores=1))
    with ServerThread(daemon) as thread:
        assert thread.server.settings.server.max_stores == 1
        assert thread.server.config is store
        assert thread.address.startswith("127.0.0.1:")
