"""A kvstore-server at its ``server.max_stores``, as a user meets it (issue 50, item 12).

The client used to log "...is one too many (BUSY); its blocks are misses while it is
down" -- the server is not down -- and its puts vanished. Now: one warning that says the
server refused to open the store and which setting to change on the server, the put's
result and the store's stats say nothing was stored, the server says it once too, and
once the server takes the store (its limit raised, restarted) the same store stores."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvstore import KVStore
from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()


def remote(address: str, namespace: str) -> dict[str, Any]:
    """A store config whose one tier is the server (asks again every 0.1 s)."""
    tier = {"kind": "remote", "address": address, "namespace": namespace}
    return {"tiers": [{**tier, "retry_interval": 0.1, "shared_memory": False}]}


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_store_past_max_stores_says_which_setting_and_its_puts_show_they_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"tiers": [{"kind": "host", "capacity": "16MiB"}], "server": {"max_stores": 1}}
    kv = random_blocks(LAYOUT, 6, seed=12)
    with (
        KVStoreServerProcess(config, tmp_path / "server") as server,
        KVStore(LAYOUT, remote(server.address, "team-a")) as first,
    ):
        keys = first.hash_tokens(list(range(6 * LAYOUT.block_tokens)), namespace="m")
        assert first.put(keys, kv) == 6  # the server's one store
        caplog.clear()
        with KVStore(LAYOUT, remote(server.address, "team-b")) as second:  # opens
            assert second.put(keys, kv) == 0  # nothing stored, and the result says so
            assert second.put(keys, kv) == 0
            n = second.lookup(keys)
            assert n == 0 and second.get(keys[:n]).shape[2] == 0  # a miss, no raise
            stats = second.stats()
            assert stats["blocks_not_stored"] == 12 and stats["tier_errors"] >= 2
            tier = stats["tiers"][0]
            assert tier["available"] is False
            assert "server.max_stores" in tier["refused"]
            said = warnings_of(caplog)
            assert len(said) == 1, said  # once, however many puts
            line = said[0]
            assert line.startswith("tier remote: the server refused to open this store")
            assert server.address in line and "namespace 'team-b'" in line
            assert "raise server.max_stores in that server's config" in line
            assert "down" not in line and "unavailable" not in line
            log = server.log_tail(100_000)
            assert log.count("refused to open store team-b/") == 1  # the operator's
            assert "server.max_stores is raised" in log

            # The operator raises the limit and restarts the server: the same store
            # stores there now, and says so once.
            server.stop()
            raised = {**config, "server": {**server.config["server"], "max_stores": 2}}
            server.config_path.write_text(yaml.safe_dump(raised))
            server.start()
            caplog.clear()
            deadline = time.monotonic() + 20
            while second.put(keys, kv) < 6:
                assert time.monotonic() < deadline, second.stats()["tiers"]
                time.sleep(0.1)
            assert second.lookup(keys) == 6 and torch.equal(second.get(keys), kv)
            assert "refused" not in second.stats()["tiers"][0]
            said = warnings_of(caplog)
            assert said == ["tier remote opened this store: the server took it at last"]
