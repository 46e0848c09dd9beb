"""Prometheus metrics and the health check over HTTP."""

from __future__ import annotations

import asyncio
import math
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.client import Client, ClientOptions
from kvstore.restore.stats import LoadSample
from kvstore.server import ServerThread
from kvstore.server.metrics import LATENCY_BUCKETS, MetricsEndpoint, ServerMetrics
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import Op, Status

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
    # Its price's correction (restores move it), 1 before any; no restore: no error yet.
    assert f'kvstore_tier_read_correction{{{labels},tier="0",kind="host"}} 1' in text
    assert "kvstore_tier_read_estimate_error{" not in text
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


# --- the request-latency histogram ---------------------------------------------------------

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(
    rf"(?P<name>{METRIC_NAME})"
    r"(?:\{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*=\"(?:\\[\\\"n]|[^\\\"\n])*\",?)*)\})?"
    r" (?P<value>\S+)(?: (?P<timestamp>-?\d+))?"
)
LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)=\"((?:\\[\\\"n]|[^\\\"\n])*)\",?")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
Labels = tuple[tuple[str, str], ...]


def sample_value(text: str) -> float:
    """A sample value as Go's ParseFloat (and so Prometheus) reads it."""
    if text in ("+Inf", "-Inf", "NaN"):
        return float(text.replace("+", ""))
    assert re.fullmatch(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", text), text
    return float(text)


def family_of(name: str, types: dict[str, str]) -> str:
    """The metric family a sample name belongs to (``x_bucket`` of histogram ``x``)."""
    for family, kind in types.items():
        for suffix in SUFFIXES.get(kind, ()):
            if name == family + suffix:
                return family
    return name


def parse_exposition(text: str) -> tuple[dict[str, str], dict[tuple[str, Labels], float]]:
    """Metric types and samples of a Prometheus text exposition (format 0.0.4), checking
    its rules: HELP and TYPE at most once per family and TYPE before its samples, each
    family's lines together, well-formed names, labels and values, no sample twice, and for
    a histogram cumulative buckets ending at ``le="+Inf"`` equal to its ``_count``."""
    assert text.endswith("\n"), "the exposition ends with a line feed"
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[tuple[str, Labels], float] = {}
    done: set[str] = set()  # families whose lines have ended
    current = ""
    for line in text[:-1].split("\n"):
        if not line:
            continue  # empty lines are ignored
        if line.startswith("#"):
            words = line.split(" ", 3)
            if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                assert re.fullmatch(METRIC_NAME, words[2]), line
                family, seen = words[2], helps if words[1] == "HELP" else set(types)
                assert family not in seen and family not in done, f"second {line!r}"
                if words[1] == "TYPE":
                    assert words[3] in TYPES and not any(
                        family_of(n, {family: words[3]}) == family for n, _ in samples
                    ), line
                    types[family] = words[3]
                else:
                    helps.add(family)
                if family != current:
                    done.add(current)
                    current = family
            continue
        match = SAMPLE.fullmatch(line)
        assert match is not None, f"not a sample line: {line!r}"
        family = family_of(match["name"], types)
        if family != current:
            assert family not in done, f"{family}'s lines are not together"
            done.add(current)
            current = family
        labels = tuple(LABEL.findall(match["labels"] or ""))
        assert len({k for k, _ in labels}) == len(labels), line
        key = (match["name"], labels)
        assert key not in samples, f"sample twice: {line!r}"
        samples[key] = sample_value(match["value"])
    for family, kind in types.items():
        if kind == "histogram":
            check_histogram(family, samples)
    return types, samples


def check_histogram(family: str, samples: dict[tuple[str, Labels], float]) -> None:
    """Each series of histogram ``family``: buckets in order of ``le``, cumulative, the last
    ``+Inf`` and equal to ``_count``; a ``_sum`` beside it."""
    buckets: dict[Labels, list[tuple[float, float]]] = {}
    for (name, labels), value in samples.items():
        if name == family + "_bucket":
            rest = tuple(kv for kv in labels if kv[0] != "le")
            le = dict(labels)["le"]
            buckets.setdefault(rest, []).append((sample_value(le), value))
    assert buckets, f"histogram {family} has no buckets"
    for labels, series in buckets.items():
        bounds = [le for le, _ in series]
        counts = [n for _, n in series]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf, (family, labels, bounds)
        assert counts == sorted(counts), f"{family}{labels}: buckets not cumulative: {counts}"
        assert samples[(family + "_count", labels)] == counts[-1], (family, labels)
        assert (family + "_sum", labels) in samples, (family, labels)


def series(
    samples: dict[tuple[str, Labels], float], name: str, **labels: str
) -> dict[Labels, float]:
    """The samples of ``name`` whose labels include ``labels``."""
    return {
        got: value
        for (n, got), value in samples.items()
        if n == name and labels.items() <= dict(got).items()
    }


DURATION = "kvstore_server_request_duration_seconds"


def test_latency_histogram_counts_into_cumulative_buckets() -> None:
    metrics = ServerMetrics()
    for seconds in (0.00005, 0.0001, 0.0003, 0.002, 0.002, 0.7, 30.0):
        metrics.latency.observe("get", "ok", seconds)
    metrics.latency.observe("lookup", "bad_request", 0.001)
    types, samples = parse_exposition(metrics.render([]))
    assert types[DURATION] == "histogram"
    buckets = {
        dict(labels)["le"]: n
        for labels, n in series(samples, DURATION + "_bucket", op="get", status="ok").items()
    }
    assert list(buckets) == [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    assert buckets["0.0001"] == 2  # le is "less than or equal": 0.0001 itself counts
    assert buckets["0.00025"] == 2
    assert buckets["0.0005"] == 3
    assert buckets["0.0025"] == 5
    assert buckets["0.5"] == 5
    assert buckets["1.0"] == 6
    assert buckets["10.0"] == 6
    assert buckets["+Inf"] == 7  # 30 s: over the last bound
    get = (("op", "get"), ("status", "ok"))
    assert samples[(DURATION + "_count", get)] == 7
    assert samples[(DURATION + "_sum", get)] == pytest.approx(30.70445)
    lookup = (("op", "lookup"), ("status", "bad_request"))
    assert samples[(DURATION + "_count", lookup)] == 1
    assert samples[(DURATION + "_bucket", (*lookup, ("le", "0.001")))] == 1
    assert samples[(DURATION + "_bucket", (*lookup, ("le", "0.0005")))] == 0


def test_no_latency_histogram_before_a_request() -> None:
    types, _ = parse_exposition(ServerMetrics().render([]))
    assert DURATION not in types


def test_counters_past_a_million_are_written_in_full() -> None:
    metrics = ServerMetrics()
    metrics.add("bytes_sent", 1_234_567_891)
    metrics.gauge("connections_open", 0.5)
    _, samples = parse_exposition(metrics.render([]))
    assert samples[("kvstore_server_bytes_sent_total", ())] == 1_234_567_891  # not 1.23457e+09
    assert samples[("kvstore_server_connections_open", ())] == 0.5


def test_parser_refuses_what_prometheus_refuses() -> None:
    good = '# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 3\n'
    parse_exposition(good + "h_sum 4.5\nh_count 3\n")
    for bad in (
        good + "h_sum 4.5\nh_count 4\n",  # +Inf bucket differs from _count
        good.replace("} 2", "} 5") + "h_sum 1\nh_count 3\n",  # not cumulative
        'a 1\nb 2\na{x="y"} 3\n',  # a's lines apart
        "a 1\n# TYPE a counter\n",  # TYPE after a sample
        "a{x=y} 1\n",  # label value unquoted
        "a 1,5\n",  # not a number
    ):
        with pytest.raises(AssertionError):
            parse_exposition(bad)


def test_live_server_times_every_request_by_op(kv_server: Start, raw: Any) -> None:
    """N gets through the client, then /metrics: at least N GETs answered ok, every series
    of the histogram cumulative; a malformed request is timed under its error status."""
    server = kv_server(metrics_listen="127.0.0.1:0")
    gets = 25
    keys = make_keys(2)
    kv = random_blocks(LAYOUT, 2, seed=2)
    data = [kv[:, :, :8].contiguous(), kv[:, :, 8:].contiguous()]
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as client:
        assert all(client.put(keys, data))
        outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
        for _ in range(gets):
            assert client.get(keys, outs) == [True, True]
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    frame, _, _ = conn.call(Op.LOOKUP, b"\x05")  # no whole count of keys
    assert frame.status == Status.BAD_REQUEST
    status, text = fetch(f"http://{server.server.addresses['metrics']}/metrics")
    assert status == 200
    types, samples = parse_exposition(text)  # checks every histogram's buckets too
    assert types[DURATION] == "histogram"
    get = (("op", "get"), ("status", "ok"))
    assert samples[(DURATION + "_count", get)] >= gets
    assert samples[(DURATION + "_sum", get)] > 0
    buckets = series(samples, DURATION + "_bucket", op="get", status="ok")
    counts = [buckets[(*get, ("le", le))] for le in [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]]
    assert counts == sorted(counts) and counts[-1] == samples[(DURATION + "_count", get)]
    assert samples[(DURATION + "_count", (("op", "lookup"), ("status", "bad_request")))] == 1
    assert samples[(DURATION + "_count", (("op", "put"), ("status", "ok")))] >= 1
    # Each op's requests counter and its histogram's counts agree (nothing is in flight).
    for (name, labels), value in samples.items():
        if name == "kvstore_server_requests_total":
            timed = series(samples, DURATION + "_count", op=dict(labels)["op"])
            assert sum(timed.values()) == value, labels


def test_the_server_gives_its_free_heap_back_periodically(
    kv_server: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker, copy and ZMQ threads free into glibc's per-thread arenas, which keep
    it: the server trims them every ``_TRIM_S`` (the 60-minute soak's server grew 3.4%)."""
    import time

    import kvstore.server.daemon as daemon
    from kvstore.runtime.memory import trim_heap

    if not trim_heap():
        pytest.skip("no malloc_trim in this C library")
    monkeypatch.setattr(daemon, "_TRIM_S", 0.0)
    server = kv_server()
    deadline = time.monotonic() + 10
    while server.stats().get("heap_trims", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["heap_trims"] >= 2


def test_restore_load_times_per_tier_are_on_metrics(tmp_path: Any) -> None:
    """A restore from host memory and a disk of real files: /metrics shows its planned and
    actual load seconds per tier, as ``stats()["restore"]`` counts them."""
    from kvstore import KVStore

    host = {"kind": "host", "capacity": 64 * LAYOUT.block_nbytes}
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}
    config = {"tiers": [host, disk], "restore": {"prefill_tokens_per_s": 1.0}}
    kv = random_blocks(LAYOUT, 4, seed=2)
    with KVStore(LAYOUT, config) as store:
        keys = store.hash_tokens(list(range(4 * LAYOUT.block_tokens)), namespace="m")
        assert store.put(keys, kv) == 4
        store.flush()
        assert store.evict(4, tier=0) and store.engine.datapath.promote(keys[:2], tier=0) == 2
        assert store.get_prefix(keys, torch.empty(LAYOUT.tensor_shape(4), dtype=LAYOUT.dtype)) == 4
        stats = {"namespace": "t", "layout_fp": LAYOUT.fingerprint_hex, **store.stats()}
    types, samples = parse_exposition(ServerMetrics().render([stats]))
    for what in ("planned", "actual"):
        name = f"kvstore_restore_tier_load_{what}_seconds_total"
        assert types[name] == "counter"
        for tier in ("0", "1"):
            labels = (("namespace", "t"), ("layout", LAYOUT.fingerprint_hex), ("tier", tier))
            value = samples[(name, labels)]
            assert value > 0 and value == stats["restore"][f"load_{what}_s_tier{tier}"]


def test_each_tiers_price_correction_and_plan_error_are_gauges(tmp_path: Any) -> None:
    """A store whose restores corrected a tier's price shows it per tier on /metrics."""
    with KVStore(LAYOUT, {"tiers": [{"kind": "disk", "path": str(tmp_path)}]}) as store:
        store.engine.observe_loads({"disk:0": LoadSample(0.09, 3e6, 1, 0.03)})  # 3x its price
        stats = {**store.stats(), "namespace": "n", "layout_fp": "f"}
    text = ServerMetrics().render([stats])
    labels = 'namespace="n",layout="f",tier="0",kind="disk"'
    line = next(x for x in text.splitlines() if x.startswith("kvstore_tier_read_correction{"))
    assert line.startswith(f"kvstore_tier_read_correction{{{labels}}} ")
    assert float(line.split()[-1]) > 1  # priced above its fit now
    error = next(x for x in text.splitlines() if x.startswith("kvstore_tier_read_estimate_error{"))
    assert error.startswith(f"kvstore_tier_read_estimate_error{{{labels}}} ")
    assert float(error.split()[-1]) == pytest.approx(0.03 / 0.09 - 1)
