"""The real-server helpers: they start what they say, and stop everything they started."""

from __future__ import annotations

import http.client
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvharness.proxies.fault import FaultProxy
from kvstore.cli.servers import RedisServer, S3Server, free_port, redis_command
from kvstore.errors import ConfigError


def _threads_settle(before: set[threading.Thread], timeout: float = 3.0) -> set[threading.Thread]:
    """Threads started since ``before`` that are still alive after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        extra = {t for t in threading.enumerate() if t not in before and t.is_alive()}
        if not extra or time.monotonic() > end:
            return extra
        time.sleep(0.05)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_free_port_is_bindable_with_offsets():
    port = free_port(also_free=(10000,))
    for p in (port, port + 10000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", p))  # raises if taken
            assert sock.getsockname()[1] == p


def test_redis_server_kill_and_restart_on_the_same_port():
    with RedisServer() as server:
        assert redis_command(server.port, "SET", "k", "v") == b"+OK\r\n"
        server.kill()
        assert not server.running and not _port_open(server.port)
        server.start()
        assert server.running
        assert redis_command(server.port, "GET", "k") == b"$-1\r\n"  # nothing was saved
        port = server.port
    assert not server.running and not _port_open(port)


def test_missing_redis_server_is_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"redis-server is not installed.*install-servers"):
        RedisServer()


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        body = b"hello from upstream"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join()


def _get(port: int, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/x")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_fault_proxy_forwards_fails_and_stalls_then_leaves_no_threads(upstream: int):
    before = set(threading.enumerate())
    with FaultProxy(upstream) as proxy:
        assert _get(proxy.port) == (200, b"hello from upstream")
        proxy.fail_next(2, 503, "SlowDown")
        status, body = _get(proxy.port)
        assert status == 503 and b"<Code>SlowDown</Code>" in body
        assert _get(proxy.port)[0] == 503
        assert _get(proxy.port)[0] == 200
        proxy.stall_next(1, 30.0)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            _get(proxy.port, timeout=0.3)
        assert time.monotonic() - start < 1.0
        assert proxy.requests == 5 and proxy.faults == 3
    # stop() woke the stalled handler and joined every thread it started
    assert _threads_settle(before, timeout=0.5) == set()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_s3_server_starts_with_its_bucket_and_stops(mode: str):
    before = set(threading.enumerate())
    with S3Server(bucket="helper-test", mode=mode) as server:
        buckets = server.client().list_buckets()["Buckets"]
        assert "helper-test" in [b["Name"] for b in buckets]
        port = server.port
    assert not _port_open(port)
    assert _threads_settle(before) == set()
