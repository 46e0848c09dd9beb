"""``kvstore route`` finds the layout its namespace holds in the cluster's index (each
node writes its layouts' descriptions there), and says what the index holds when the
layout flags name another one -- instead of ranking every node at 0 chunks."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvstore import KVLayout, KVStore
from kvstore.cli.servers import RedisServer
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.node import ClusterNode
from kvstore.config import StoreConfig
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import small_layout

SMALL = small_layout()  # 3 layers x 2 KV heads x 16, 8 tokens, bfloat16
OTHER = small_layout(num_layers=2)
KVSTORE = str(Path(sys.executable).with_name("kvstore"))
_names = itertools.count()


def kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``kvstore`` console script, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [KVSTORE, *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


@pytest.fixture
def cluster(redis_server: RedisServer, tmp_path: Path) -> dict[str, Any]:
    """A cluster section of its own (a name no other test uses) on the shared Redis; a
    lease (90 s) that outlives the test, so that one heartbeat keeps the node listed."""
    name = f"catalog{next(_names)}"
    return {"redis_url": redis_server.url, "name": name, "node_id": "n1", "heartbeat_s": 30}


class Published:
    """Stores whose blocks an in-process cluster node publishes in the index."""

    def __init__(self, cluster: dict[str, Any]) -> None:
        self.node = ClusterNode(StoreConfig.from_dict({"cluster": cluster}).cluster)
        self.stores: list[KVStore] = []

    def add(self, layout: KVLayout, n: int, namespace: str = "default") -> list[bytes]:
        store = KVStore(layout, {"tiers": [{"kind": "host", "capacity": "4MiB"}]})
        self.stores.append(store)
        keys = make_keys(n, salt=len(self.stores))
        assert store.put(keys, torch.zeros(layout.tensor_shape(n), dtype=layout.dtype)) == n
        self.node.track(namespace, store)
        self.node.beat()
        return keys

    def close(self) -> None:
        self.node.stop()
        for store in self.stores:
            store.close()


@pytest.fixture
def published(cluster: dict[str, Any]) -> Iterator[Published]:
    group = Published(cluster)
    yield group
    group.close()


def files(tmp_path: Path, cluster: dict[str, Any], keys: list[bytes]) -> tuple[str, str]:
    config, keyfile = tmp_path / "cluster.yaml", tmp_path / "keys.txt"
    config.write_text(yaml.safe_dump({"cluster": cluster}))
    keyfile.write_text("\n".join(bytes(k).hex() for k in keys))
    return str(config), str(keyfile)


def test_route_takes_the_one_layout_the_namespace_holds(
    tmp_path: Path, cluster: dict[str, Any], published: Published
) -> None:
    keys = published.add(SMALL, 3)
    config, keyfile = files(tmp_path, cluster, keys)
    result = kvstore("route", "--config", config, "--keys", keyfile, "--json")  # no layout flags
    assert result.returncode == 0, result.stderr
    ranked = json.loads(result.stdout)
    assert (ranked[0]["node_id"], ranked[0]["prefix_blocks"]) == ("n1", 3)
    assert result.stderr == ""


def test_route_says_what_the_index_holds_when_the_flags_name_another_layout(
    tmp_path: Path, cluster: dict[str, Any], published: Published
) -> None:
    keys = published.add(SMALL, 3)
    config, keyfile = files(tmp_path, cluster, keys)
    llama = KVLayout(32, 8, 128).fingerprint_hex
    result = kvstore("route", "--config", config, "--keys", keyfile, "--layers", "32")
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        f"kvstore: note: no node lists blocks of layout {llama} in namespace default; the "
        f"index holds: namespace default: layout {SMALL.fingerprint_hex} (3 layers x 2 KV "
        "heads x 16, 8 tokens, bfloat16; 3 blocks on 1 node)\n"
    )
    other = kvstore("route", "--config", config, "--keys", keyfile, "--namespace", "nobody")
    assert other.returncode == 0, other.stderr
    assert other.stderr.startswith("kvstore: note: the index holds no blocks in namespace nobody")
    assert "(pass --namespace)" in other.stderr and other.stderr.count("\n") == 1


def test_route_asks_for_the_layout_when_the_namespace_holds_several(
    tmp_path: Path, cluster: dict[str, Any], published: Published
) -> None:
    keys = published.add(SMALL, 3)
    published.add(OTHER, 2)
    config, keyfile = files(tmp_path, cluster, keys)
    result = kvstore("route", "--config", config, "--keys", keyfile)
    assert result.returncode == 2
    assert result.stderr.startswith("kvstore: error: namespace default holds 2 layouts")
    assert result.stderr.rstrip().endswith("pass --layout FINGERPRINT")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    chosen = kvstore(
        "route", "--config", config, "--keys", keyfile, "--layout", SMALL.fingerprint_hex[:5]
    )
    assert chosen.returncode == 0, chosen.stderr
    assert "n1" in chosen.stdout.splitlines()[1]


def test_index_lists_stores_with_their_layouts(
    cluster: dict[str, Any], published: Published
) -> None:
    published.add(SMALL, 3, namespace="team-a")
    published.add(OTHER, 2, namespace="team-b")
    index = ClusterIndex(StoreConfig.from_dict({"cluster": cluster}).cluster)
    try:
        found = {(s.namespace, s.fingerprint): s for s in index.stores()}
    finally:
        index.close()
    assert sorted(found) == [
        ("team-a", SMALL.fingerprint_hex),
        ("team-b", OTHER.fingerprint_hex),
    ]
    a = found[("team-a", SMALL.fingerprint_hex)]
    assert a.blocks == {"n1": 3} and a.layout == SMALL.describe()
