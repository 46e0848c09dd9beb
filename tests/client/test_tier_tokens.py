"""A remote tier's token, as a user meets it: a token the server refuses is an
AccessDeniedError in one line when the store opens; a token refused later (the server
restarted with other tokens, or reloaded its token file) makes misses: one logged line,
lookups that stop counting what cannot be read, gets that come back short (and a get
into a buffer, all or nothing, that says why)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.errors import AccessDeniedError, BlockNotFoundError
from kvstore.server import ServerThread
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
ADMIN = "admin-token-0123456789abcdef"
TEAM_A = "team-a-token-0123456789abcdef"
OTHER = "other-token-0123456789abcdef"


def tokens() -> dict[str, Any]:
    """An admin token, and one that opens namespace team-a only."""
    return {"token": ADMIN, "tokens": [{"name": "a", "token": TEAM_A, "namespaces": ["team-a"]}]}


def store_config(address: str, namespace: str, token: str | None) -> dict[str, Any]:
    remote: dict[str, Any] = {"kind": "remote", "address": address, "namespace": namespace}
    if token is not None:
        remote["token"] = token
    # A short retry_interval: after a refusal, the client asks again soon.
    remote["retry_interval"] = 0.1
    return {"tiers": [{"kind": "host", "capacity": 8 * LAYOUT.block_nbytes}, remote]}


def client_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Warnings and errors of the store's side (the in-process server logs too)."""
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and not r.name.startswith("kvstore.server")
    ]


@pytest.mark.parametrize(
    ("namespace", "token", "why"),
    [
        ("team-a", "wrong-token-0123456789abcdef", "authentication failed"),
        ("team-a", None, "requires a token"),
        ("team-b", TEAM_A, "does not open namespace 'team-b'"),
    ],
    ids=["wrong", "missing", "namespace-not-opened"],
)
def test_a_refused_token_is_one_line_when_the_store_opens(
    kv_server: Start,
    caplog: pytest.LogCaptureFixture,
    namespace: str,
    token: str | None,
    why: str,
) -> None:
    server = kv_server(**tokens())
    with pytest.raises(AccessDeniedError) as raised:
        KVStore(LAYOUT, store_config(server.address, namespace, token))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"kvstore-server at {server.address} refused ")
    assert why in message and f"namespace {namespace!r}" in message
    assert ("token or token_file" if token is None else "use a token") in message
    assert all(r.exc_info is None for r in caplog.records)  # no traceback anywhere
    assert client_lines(caplog) == []  # the error says it all


def test_a_token_that_opens_the_namespace_opens_the_store(kv_server: Start) -> None:
    server = kv_server(**tokens())
    kv = random_blocks(LAYOUT, 2, seed=1)
    with KVStore(LAYOUT, store_config(server.address, "team-a", TEAM_A)) as store:
        keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), namespace="m")
        assert store.put(keys, kv) == 2


def test_a_token_revoked_later_is_a_miss_logged_once_and_gets_say_refused(
    kv_server: Start, caplog: pytest.LogCaptureFixture
) -> None:
    first = kv_server(token=ADMIN)
    address = first.address
    kv = random_blocks(LAYOUT, 4, seed=2)
    with KVStore(LAYOUT, store_config(address, "default", ADMIN)) as store:
        keys = store.hash_tokens(list(range(4 * LAYOUT.block_tokens)), namespace="m")
        others = store.hash_tokens(list(range(1000, 1000 + LAYOUT.block_tokens)), namespace="m")
        assert store.put(keys, kv) == 4
        assert store.flush() == 4
        store.evict(4)  # now only the server holds them
        first.stop()
        kv_server(listen=address, token=OTHER)  # the same server, restarted: ADMIN revoked
        caplog.clear()

        out = kv.clone()
        assert store.get_prefix(keys, out) == 0  # a miss, not a crash
        assert store.lookup(others) == 0
        assert store.put(others, random_blocks(LAYOUT, 1, seed=3)) == 1  # host memory
        n = store.lookup(others + keys)  # what only the server holds is not counted
        assert n == 1 and store.get((others + keys)[:n]).shape[2] == LAYOUT.block_tokens
        for wanted in (keys, others + keys):  # keys the index does not hold (any more)
            with pytest.raises(BlockNotFoundError) as raised:
                store.get(wanted)
            message = str(raised.value)
            assert "refused the token" in message and address in message
            assert "not stored" not in message and "\n" not in message
        remote = store.stats()["tiers"][1]
        assert remote["available"] is False and "refused the token" in remote["refused"]

        lines = client_lines(caplog)
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "tier remote refused access" in lines[0].getMessage()
        assert address in lines[0].getMessage() and lines[0].exc_info is None


def test_the_tier_answers_again_once_the_server_accepts_the_token(
    kv_server: Start, caplog: pytest.LogCaptureFixture
) -> None:
    first = kv_server(token=ADMIN)
    address = first.address
    with KVStore(LAYOUT, store_config(address, "default", ADMIN)) as store:
        unknown = store.hash_tokens(list(range(LAYOUT.block_tokens)), namespace="m")
        first.stop()
        second = kv_server(listen=address, token=OTHER)
        assert store.lookup(unknown) == 0  # asks the server: refused
        assert store.stats()["tiers"][1]["available"] is False
        second.stop()
        kv_server(listen=address, token=ADMIN)  # the token is good again
        deadline = time.monotonic() + 10
        while store.stats()["tiers"][1]["available"] is False and time.monotonic() < deadline:
            store.lookup(unknown)  # asks the server, once the client's breaker lets it
            time.sleep(0.05)
        assert store.stats()["tiers"][1]["available"] is True
    messages = [r.getMessage() for r in client_lines(caplog)]
    assert sum("tier remote refused access" in m for m in messages) == 1
    assert sum("tier remote accepts the token again" in m for m in messages) == 1


def test_a_token_file_changed_while_a_client_runs_is_a_miss_for_lookup_then_get(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 50, item 7: a real kvstore-server whose token file is changed and reloaded
    (SIGHUP) under a running client. The README's pattern -- ``n = lookup(keys)``, then
    ``get(keys[:n])`` -- never raises: the first get after the change is a miss (the
    refusal logged once, counted), lookups then count 0, and once the old token is back
    they count every block again and the get reads them bit-exact."""
    token = tmp_path / "server.token"
    token.write_text(ADMIN + "\n")
    tiers = [{"kind": "host", "capacity": "16MiB"}]
    config = {"tiers": tiers, "server": {"token_file": str(token)}}
    kv = random_blocks(LAYOUT, 6, seed=7)
    with KVStoreServerProcess(config, tmp_path / "server") as server:
        assert server.pid is not None
        remote = {**store_config(server.address, "default", ADMIN)["tiers"][1]}
        with KVStore(LAYOUT, {"tiers": [remote]}) as store:
            keys = store.hash_tokens(list(range(6 * LAYOUT.block_tokens)), namespace="m")
            assert store.put(keys, kv) == 6 and store.lookup(keys) == 6

            def reload(secret: str) -> None:
                reloads = server.log_tail(100_000).count("reloaded tenants and tokens")
                token.write_text(secret + "\n")
                os.kill(server.pid or 0, signal.SIGHUP)
                deadline = time.monotonic() + 20
                while server.log_tail(100_000).count("reloaded tenants and tokens") == reloads:
                    assert time.monotonic() < deadline, server.log_tail()
                    time.sleep(0.05)

            reload(OTHER)  # the client's token is no longer accepted
            caplog.clear()
            for _ in range(3):  # the README's lookup-then-get, as an engine repeats it
                n = store.lookup(keys)
                past = store.get(keys[:n])  # never raises
                assert past.shape[2] == 0  # nothing could be read: a miss
            assert store.lookup(keys) == 0  # it stopped counting what cannot be read
            stats = store.stats()
            assert stats["tier_errors"] >= 1 and stats["blocks_missed"] >= 6  # counted
            assert "no longer accepted" in stats["tiers"][0]["refused"]
            lines = [r.getMessage() for r in client_lines(caplog)]
            assert len(lines) == 1 and "tier remote refused access" in lines[0], lines

            reload(ADMIN)  # the token is good again: its blocks count again
            deadline = time.monotonic() + 20
            while store.lookup(keys) < 6:
                assert time.monotonic() < deadline, store.stats()["tiers"]
                time.sleep(0.05)
            assert torch.equal(store.get(keys), kv)
            assert "refused" not in store.stats()["tiers"][0]
    lines = [r.getMessage() for r in client_lines(caplog)]
    assert sum("tier remote accepts the token again" in m for m in lines) == 1, lines
