"""What the log says of a remote tier whose server is down: that it is unavailable, once,
and that it answers again only once it does (a stats call or a listing that hid the
failure used to log "tier remote answers again" while the server was still down)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from kvstore import KVStore
from kvstore.server import ServerThread
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()


def store_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The store side's warnings that contain ``text`` (the in-process server logs too)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and not r.name.startswith("kvstore.server")
        and text in r.getMessage()
    ]


def test_a_server_that_is_down_is_not_said_to_answer_again(
    kv_server: Start, caplog: pytest.LogCaptureFixture
) -> None:
    server = kv_server()
    address = server.address
    remote = {
        "kind": "remote",
        "address": address,
        "namespace": "outage",
        "connect_timeout": 0.5,
        "timeout": 1.0,
        "retry_interval": 0.1,
    }
    config = {"tiers": [{"kind": "host", "capacity": 8 * LAYOUT.block_nbytes}, remote]}
    kv = random_blocks(LAYOUT, 2, seed=1)
    with KVStore(LAYOUT, config) as store:
        keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), namespace="m")
        unknown = store.hash_tokens(list(range(500, 500 + LAYOUT.block_tokens)), namespace="m")
        assert store.put(keys, kv) == 2
        assert store.flush() == 2
        store.evict(2)
        server.stop()
        caplog.clear()
        out = kv.clone()
        assert store.get_prefix(keys, out) == 0  # the server is down: a miss
        for _ in range(3):  # calls that do not reach the server prove nothing
            assert store.stats()["tiers"][1]["available"] is False
            assert store.lookup(unknown) == 0
        assert store_lines(caplog, "answers again") == []
        assert len(store_lines(caplog, "tier remote unavailable")) == 1

        kv_server(listen=address)  # back (empty: another directory)
        deadline = time.monotonic() + 10
        while store.stats()["tiers"][1]["available"] is False and time.monotonic() < deadline:
            store.lookup(unknown)  # reaches the server once the client's breaker lets it
            time.sleep(0.05)
        assert store.stats()["tiers"][1]["available"] is True
    assert store_lines(caplog, "tier remote answers again") == ["tier remote answers again"]


def test_a_server_down_at_open_is_a_miss_and_its_stats_say_why(kv_server: Start) -> None:
    server = kv_server()
    address = server.address
    remote = {"kind": "remote", "address": address, "namespace": "outage", "connect_timeout": 0.5}
    with KVStore(LAYOUT, {"tiers": [remote]}) as store:  # the server answers
        assert store.stats()["tiers"][0]["unreachable_at_open"] == ""
    server.stop()
    with KVStore(LAYOUT, {"tiers": [remote]}) as store:  # it does not: the store still opens
        keys = store.hash_tokens(list(range(LAYOUT.block_tokens)), namespace="m")
        assert store.lookup(keys) == 0
        assert store.stats()["tiers"][0]["unreachable_at_open"] != ""
