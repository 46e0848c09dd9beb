"""Tenants' quotas on a live kvstore-server: a flood cannot evict a quiet tenant within
its share, limits refuse or evict the tenant's own blocks, and per-tenant figures show
in STATS (a tenant sees only its own) and in /metrics with a tenant label."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import torch

from kvstore.client import Client, ClientOptions
from kvstore.client.admin import AdminClient
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
BLOCK = LAYOUT.block_nbytes
OPS = "ops-token-0123456789abcdef"
QUIET = "quiet-token-0123456789abcdef"
NOISY = "noisy-token-0123456789abcdef"
ALL = ["read", "write", "admin"]


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def settings(noisy_limit: int) -> dict[str, Any]:
    return {
        "metrics_listen": "127.0.0.1:0",
        "tenants": {
            "ops": {"tokens": [{"name": "ops", "token": OPS, "scopes": ALL}]},
            "quiet": {
                "namespaces": ["quiet"],
                "tokens": [{"name": "q", "token": QUIET}],
                "quotas": {"host": {"share": 60 * BLOCK, "limit": 120 * BLOCK}},
            },
            "noisy": {
                "namespaces": ["noisy", "noisy-2"],
                "tokens": [{"name": "n", "token": NOISY}],
                "quotas": {"host": {"share": 20 * BLOCK, "limit": noisy_limit}},
            },
        },
    }


def start(kv_server: Start, noisy_limit: int) -> ServerThread:
    tiers = [{"kind": "host", "capacity": 200 * BLOCK}]
    return kv_server(tiers, **settings(noisy_limit))


def client(server: ServerThread, token: str, namespace: str) -> Client:
    options = ClientOptions(server.address, namespace, token.encode(), shared_memory=False)
    return Client(LAYOUT, options)


def test_a_flood_cannot_evict_a_quiet_tenant_within_its_share(kv_server: Start) -> None:
    server = start(kv_server, noisy_limit=200 * BLOCK)
    mine = make_keys(50, salt=1)
    with client(server, QUIET, "quiet") as quiet, client(server, NOISY, "noisy") as noisy:
        assert all(quiet.put(mine, blocks(50, seed=1)))
        for i in range(40):  # 640 unique blocks: the pool three times over
            noisy.put(make_keys(16, salt=100 + i), blocks(16, seed=i))
            assert quiet.lookup(mine) == 50
        figures = quiet.server_stats()["tenants"]
        assert set(figures) == {"quiet"}  # a tenant sees its own figures only
        assert figures["quiet"]["tiers"]["host"]["blocks"] == 50
        assert figures["quiet"]["tiers"]["host"]["share"] == 60 * BLOCK
        assert figures["quiet"]["hits"] >= 50 * 40
    with client(server, OPS, "quiet") as ops:
        every = ops.server_stats()["tenants"]
    noisy_host = every["noisy"]["tiers"]["host"]
    assert 20 <= noisy_host["blocks"] <= 200 - 50  # yields to the pool, keeps its share
    assert every["noisy"]["evictions"] > 0


def test_limits_evict_own_blocks_or_refuse_and_change_at_run_time(kv_server: Start) -> None:
    server = start(kv_server, noisy_limit=40 * BLOCK)
    with client(server, NOISY, "noisy") as one, client(server, NOISY, "noisy-2") as two:
        for i in range(5):
            one.put(make_keys(16, salt=10 + i), blocks(16, seed=i))
        assert one.server_stats()["tenants"]["noisy"]["tiers"]["host"]["bytes"] <= 40 * BLOCK
        stored = two.put(make_keys(8, salt=99), blocks(8, seed=9))  # the tenant's bytes are in one
        assert not any(stored)
        admin = AdminClient(ClientOptions(server.address, "noisy", OPS.encode()))
        tenant = admin.tenants()["tenants"]["noisy"]
        admin.put_tenant(
            "noisy",
            tenant["namespaces"],
            [{"name": "n", "token": NOISY}],
            quotas={"host": {"share": 0, "limit": 16 * BLOCK}},
        )
        one.put(make_keys(1, salt=77), blocks(1, seed=7))  # the next grant applies it
        figures = one.server_stats()["tenants"]["noisy"]
        assert figures["tiers"]["host"]["bytes"] <= 16 * BLOCK
        assert figures["refused"] >= 8
    host, port = server.server.addresses["metrics"].rsplit(":", 1)
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_tenant_refusals_total{tenant="noisy"}' in text
    assert 'kvstore_tenant_bytes{tenant="noisy",tier="host"}' in text
    assert 'kvstore_tenant_limit_bytes{tenant="noisy",tier="host"} ' + str(16 * BLOCK) in text


def test_a_limit_holds_under_concurrent_puts_from_two_namespaces(kv_server: Start) -> None:
    server = start(kv_server, noisy_limit=48 * BLOCK)
    stored = [0, 0]

    def flood(n: int, namespace: str) -> None:
        with client(server, NOISY, namespace) as c:
            for i in range(20):
                stored[n] += sum(c.put(make_keys(8, salt=1000 * (n + 1) + i), blocks(8, seed=i)))

    threads = [
        threading.Thread(target=flood, args=(n, ns)) for n, ns in enumerate(["noisy", "noisy-2"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with client(server, OPS, "noisy") as ops:
        stats = ops.server_stats()
    figures = stats["tenants"]["noisy"]
    held = sum(
        t["blocks"]
        for s in stats["stores"]
        if s["namespace"].startswith("noisy")
        for t in s["tiers"]
    )
    assert figures["tiers"]["host"]["bytes"] == held * BLOCK <= 48 * BLOCK
    assert sum(stored) + figures["refused"] == 2 * 20 * 8  # each block stored or refused
    assert sum(stored) == held + figures["evictions"]  # every block stored is held or was evicted


def test_an_idle_flood_gives_back_what_a_quiet_tenant_within_its_share_needs(
    kv_server: Start,
) -> None:
    """The noisy tenant fills the pool while nobody else needs it, then stops. The quiet
    tenant's puts within its share take the pool past its capacity: the server's reclaimer
    evicts the noisy tenant's blocks until the pool fits again, keeping the noisy tenant's
    share, and counts them (``reclaimed``, ``kvstore_tenant_reclaimed_total``)."""
    server = start(kv_server, noisy_limit=200 * BLOCK)
    with client(server, NOISY, "noisy") as noisy:
        for i in range(17):  # 170 of the pool's 200 blocks (its tier's high mark: 180)
            assert all(noisy.put(make_keys(10, salt=500 + i), blocks(10, seed=i)))
    mine = make_keys(50, salt=2)
    with client(server, QUIET, "quiet") as quiet, client(server, OPS, "quiet") as ops:
        assert all(quiet.put(mine, blocks(50, seed=2)))  # within its share: 220 of 200

        def host_blocks() -> dict[str, int]:
            every = ops.server_stats()["tenants"]
            return {t: every[t]["tiers"].get("host", {}).get("blocks", 0) for t in every}

        def reclaimed() -> int:
            return int(ops.server_stats()["tenants"]["noisy"].get("reclaimed", 0))

        deadline = time.monotonic() + 20
        while reclaimed() < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = host_blocks()
        assert held["quiet"] == 50 and quiet.lookup(mine) == 50
        assert held["noisy"] == 150  # exactly the overflow went, and no more
        time.sleep(0.3)
        assert reclaimed() == 20 and host_blocks()["noisy"] == 150
    host, port = server.server.addresses["metrics"].rsplit(":", 1)
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_tenant_reclaimed_total{tenant="noisy"} 20' in text
