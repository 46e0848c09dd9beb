"""Prometheus metrics and the health check over HTTP."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest

from kvstore.client import Client, ClientOptions
from kvstore.server import ServerThread
from kvstore.server.metrics import MetricsEndpoint, ServerMetrics
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_and_healthz(kv_server: Start) -> None:
    server = kv_server(metrics_listen="127.0.0.1:0")
    base = f"http://{server.server.addresses['metrics']}"
    kv = random_blocks(LAYOUT, 2, seed=1)
    with Client(LAYOUT, ClientOptions(server.address, namespace="team-a")) as c:
        assert all(c.put(make_keys(2), [kv[:, :, :8], kv[:, :, 8:]]))
    status, text = fetch(base + "/metrics")
    assert status == 200
    assert 'kvstore_server_requests_total{op="reserve"} 1' in text  # a put through shm
    assert 'kvstore_server_requests_total{op="commit"} 1' in text
    assert "kvstore_server_blocks_stored_total 2" in text
    assert "kvstore_server_connections_total 1" in text
    assert f'kvstore_store_blocks{{namespace="team-a",layout="{LAYOUT.fingerprint_hex}"}}' in text
    labels = f'namespace="team-a",layout="{LAYOUT.fingerprint_hex}"'
    in_place = 2 * LAYOUT.block_nbytes  # the shared-memory put copied both blocks itself
    assert f"kvstore_store_bytes_written_in_place_total{{{labels}}} {in_place:g}" in text
    assert "# TYPE kvstore_server_bytes_received_total counter" in text
    # Each tier's read speed: the configured figures until the server reads from it.
    assert "# TYPE kvstore_tier_read_speed gauge" in text
    assert f'kvstore_tier_read_speed{{{labels},tier="0",kind="host",what="gbps",' in text
    assert 'what="latency_ms",source="configured"}' in text
    # Restore planning: nothing planned yet, counted from zero.
    assert f"kvstore_restore_plans_total{{{labels}}} 0" in text
    assert f"kvstore_restore_tokens_planned_recompute_total{{{labels}}} 0" in text
    assert fetch(base + "/healthz") == (200, "ok\n")
    assert fetch(base + "/nothing")[0] == 404


def test_health_check_says_when_draining() -> None:
    async def scenario() -> tuple[int, str]:
        endpoint = MetricsEndpoint(lambda: ServerMetrics().render([]), lambda: False)
        host, port = await endpoint.start("127.0.0.1", 0)
        try:
            return await asyncio.to_thread(fetch, f"http://{host}:{port}/healthz")
        finally:
            await endpoint.close()

    assert asyncio.run(scenario()) == (503, "draining\n")


@pytest.mark.parametrize("request_line", [b"POST /metrics HTTP/1.0", b"garbage"])
def test_only_get_is_answered(kv_server: Start, request_line: bytes) -> None:
    import socket

    server = kv_server(metrics_listen="127.0.0.1:0")
    host, _, port = server.server.addresses["metrics"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request_line + b"\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.0 405")
