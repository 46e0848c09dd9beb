"""``kvstore stats`` with ``server.tenants``: what each tenant's namespaces hold on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()
A = "a-token-0123456789abcdef"
B = "b-token-0123456789abcdef"


def test_stats_counts_each_tenants_blocks_on_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tenants = {
        "team-a": {
            "namespaces": ["team-a"],
            "tokens": [{"token": A}],
            "quotas": {"disk": {"share": "8MiB", "limit": "64MiB"}},
        },
        "team-b": {"namespaces": ["team-b"], "tokens": [{"token": B}]},
    }
    config = server_test_config(tmp_path, tenants=tenants)
    step = LAYOUT.block_tokens
    with KVStoreServerProcess(config, tmp_path / "server") as server:
        for token, ns, n in ((A, "team-a", 5), (B, "team-b", 3)):
            kv = random_blocks(LAYOUT, n, seed=n)
            parts = [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]
            with Client(LAYOUT, ClientOptions(server.address, ns, token.encode())) as c:
                assert all(c.put(make_keys(n, salt=n), parts))
    # stopped: memory flushed to disk
    assert main(["stats", "--config", str(server.config_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["tenants"]
    assert report["team-a"]["blocks"] == 5 and report["team-b"]["blocks"] == 3
    assert report["team-a"]["share"] == 8 << 20 and report["team-a"]["limit"] == 64 << 20
    assert main(["stats", "--config", str(server.config_path)]) == 0
    out = capsys.readouterr().out
    assert "tenant team-a: 5 blocks" in out and "(share 8.00 MiB, limit 64.00 MiB)" in out
