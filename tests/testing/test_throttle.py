"""ThrottlingProxy: bytes intact, bandwidth and latency as set (and reset at run time),
and the S3 tier's measured read speed following a throttled link to a real moto server."""

from __future__ import annotations

import functools
import random
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvharness.proxies.throttle import ThrottlingProxy
from kvstore import KVLayout, KVStore
from kvstore.cli.servers import S3Server
from kvstore.testing.data import random_blocks, small_layout

MB = 1_000_000


@functools.lru_cache(maxsize=4)
def payload(n: int) -> bytes:
    """``n`` reproducible bytes (a download's body), made once (not in a timed window)."""
    return random.Random(n).randbytes(n)


class _Handler(socketserver.StreamRequestHandler):
    """``ECHO n\\n`` + n bytes: answers the n bytes; ``GET n\\n``: answers payload(n)."""

    def handle(self) -> None:
        while line := self.rfile.readline():
            verb, size = line.split()
            n = int(size)
            body = self.rfile.read(n) if verb == b"ECHO" else payload(n)
            self.wfile.write(body)
            self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = False
    block_on_close = True  # server_close joins the handlers (the proxy cut them first)


@pytest.fixture
def server() -> Iterator[str]:
    for n in (2 * MB, 4 * MB):
        payload(n)
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    thread.join()


def new_threads(before: set[threading.Thread], timeout: float = 2.0) -> set[threading.Thread]:
    """Threads started since ``before`` still alive after up to ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        extra = {t for t in threading.enumerate() if t not in before and t.is_alive()}
        if not extra or time.monotonic() > end:
            return extra
        time.sleep(0.02)


@pytest.fixture
def proxy(server: str) -> Iterator[ThrottlingProxy]:
    before = set(threading.enumerate())
    with ThrottlingProxy(server) as p:
        yield p
    assert new_threads(before) == set()  # pumps joined; the server's handlers saw EOF


def connect(proxy: ThrottlingProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=5)


def recv_exactly(sock: socket.socket, n: int, on_progress: Any = None) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(1 << 16, n - got))
        assert chunk, "connection closed early"
        parts.append(chunk)
        got += len(chunk)
        if on_progress is not None:
            on_progress(got)
    return b"".join(parts)


def download(sock: socket.socket, n: int, on_progress: Any = None) -> float:
    """Seconds to GET ``n`` bytes over ``sock`` (checked intact)."""
    start = time.perf_counter()
    sock.sendall(b"GET %d\n" % n)
    assert recv_exactly(sock, n, on_progress) == payload(n)
    return time.perf_counter() - start


def test_bytes_intact_both_ways_and_download_paced(proxy: ThrottlingProxy):
    assert proxy.url == f"http://{proxy.address}"
    data = random.Random(1).randbytes(300_000)
    with connect(proxy) as sock:
        sock.sendall(b"ECHO %d\n" % len(data) + data)
        assert recv_exactly(sock, len(data)) == data
        fast = download(sock, 4 * MB)
        proxy.set(gbps=0.02)
        slow = download(sock, 4 * MB)
    assert 0.17 <= slow <= 0.35, slow  # 4 MB at 20 MB/s: 0.2 s
    assert fast < slow / 4, (fast, slow)
    assert proxy.bytes_up == len(data) + len(b"ECHO 300000\n") + 2 * len(b"GET 4000000\n")
    assert proxy.bytes_down == len(data) + 8 * MB
    assert proxy.connections == 1


def test_bandwidth_is_shared_by_connections(proxy: ThrottlingProxy):
    proxy.gbps = 0.02
    socks = [connect(proxy) for _ in range(2)]
    threads = [threading.Thread(target=download, args=(s, 2 * MB)) for s in socks]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for s in socks:
        s.close()
    assert 0.17 <= elapsed <= 0.35, elapsed  # 2 x 2 MB on one 20 MB/s link
    assert proxy.connections == 2


def test_latency_is_added_once_per_request(proxy: ThrottlingProxy):
    proxy.set(latency_ms=50)
    with connect(proxy) as sock:
        for _ in range(2):  # every request on a kept-alive connection pays it
            start = time.perf_counter()
            sock.sendall(b"ECHO 5\nhello")
            assert recv_exactly(sock, 5) == b"hello"
            assert time.perf_counter() - start >= 0.05
        data = random.Random(2).randbytes(1 << 20)  # 16 chunks or more: the latency once
        start = time.perf_counter()
        sock.sendall(b"ECHO %d\n" % len(data) + data)
        assert recv_exactly(sock, len(data)) == data
        assert 0.05 <= time.perf_counter() - start < 0.3
        proxy.latency_ms = 0
        start = time.perf_counter()
        sock.sendall(b"ECHO 5\nhello")
        assert recv_exactly(sock, 5) == b"hello"
        assert time.perf_counter() - start < 0.04


def test_bandwidth_change_reaches_an_open_transfer(proxy: ThrottlingProxy):
    proxy.set(gbps=0.005)  # 4 MB would take 0.8 s at 5 MB/s

    def unthrottle(got: int) -> None:
        if got >= MB // 2 and proxy.gbps is not None:
            proxy.set(gbps=None)

    with connect(proxy) as sock:
        elapsed = download(sock, 4 * MB, on_progress=unthrottle)
        assert 0.09 <= elapsed < 0.3, elapsed  # 0.5 MB slow (0.1 s), the rest at once
        proxy.set(gbps=0.05)  # and back down, on the same connection
        assert 0.075 <= download(sock, 4 * MB) <= 0.14  # 4 MB at 50 MB/s: 0.08 s


def test_bad_settings_are_refused(server: str):
    with ThrottlingProxy(server) as p:
        for bad in (0, -1.0, float("nan")):
            with pytest.raises(ValueError):
                p.set(gbps=bad)
        with pytest.raises(ValueError):
            p.latency_ms = -1
        assert p.gbps is None and p.latency_ms == 0.0
    p.close()  # idempotent


# -- the S3 tier through a throttled link ---------------------------------------------------------
def _s3_store_config(server: S3Server, proxy: ThrottlingProxy) -> dict[str, Any]:
    tier = {
        "kind": "s3",
        "bucket": server.bucket,
        "prefix": f"throttle-{uuid.uuid4().hex[:12]}",
        "endpoint_url": proxy.url,
        "region": "us-east-1",
        "codec": "raw",  # the bytes on the wire are the block bytes
        "read_latency_ms": 1.0,
        "read_timeout": 5.0,
        "deadline": 10.0,
    }
    return {"tiers": [tier], "restore": {"speed_half_life_s": 0.02}}


def _timed_get(store: KVStore, keys: list[Any], kv: torch.Tensor) -> tuple[float, float]:
    """Seconds to get ``keys`` (checked byte-exact), and the tier's read speed after it."""
    start = time.perf_counter()
    assert torch.equal(store.get(keys), kv)
    elapsed = time.perf_counter() - start
    return elapsed, store.stats()["tiers"][0]["read_gbps_estimate"]


def test_s3_tier_reads_at_the_throttled_speed(s3_server: S3Server, aws_env: None):
    layout: KVLayout = small_layout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=32)
    n = 4  # 4 blocks of 512 KiB: 2 MiB
    kv = random_blocks(layout, n, seed=3)
    nbytes = n * layout.block_nbytes
    before = set(threading.enumerate())
    with (
        ThrottlingProxy(f"127.0.0.1:{s3_server.port}") as proxy,
        KVStore(layout, _s3_store_config(s3_server, proxy)) as store,
    ):
        keys = store.hash_tokens(list(range(n * layout.block_tokens)), namespace="throttle")
        assert store.put(keys, kv) == n
        _timed_get(store, keys, kv)  # warm the connections
        fast, fast_gbps = _timed_get(store, keys, kv)
        proxy.set(gbps=0.002)
        down = proxy.bytes_down
        slow, slow_gbps = _timed_get(store, keys, kv)
        assert proxy.bytes_down - down >= nbytes  # the blocks came through the proxy
        proxy.set(gbps=None)
        _timed_get(store, keys, kv)
        _, again_gbps = _timed_get(store, keys, kv)
    assert new_threads(before) == set()
    # 2 MiB at 2 MB/s: 1.05 s, against ~0.02 s unthrottled on a quiet machine and up to
    # ~0.12 s seen while other tests loaded both cores
    assert slow >= nbytes / 0.002e9 > 2 * fast, (slow, fast)
    assert slow_gbps < 0.0025, slow_gbps  # the estimate follows the throttle down ...
    assert fast_gbps > 2 * slow_gbps and again_gbps > 2 * slow_gbps, (fast_gbps, again_gbps)
