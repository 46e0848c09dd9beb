"""Server counters, rendered as Prometheus text, and the small HTTP endpoint serving them.

``GET /metrics`` answers the Prometheus text format (version 0.0.4);
``GET /healthz`` answers 200 while the server serves and 503 while it drains.
Everything else gets 404. The endpoint reads only a request line and headers
(bounded), never a body, and carries counters only -- never block data.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["LATENCY_BUCKETS", "LatencyHistogram", "MetricsEndpoint", "ServerMetrics"]

_MAX_REQUEST = 8192

#: Upper bounds (seconds) of the request-latency buckets: 100 µs (a PING, a LOOKUP served
#: from memory) to 10 s (a GET waiting on S3), about three to a decade.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

_REQUEST_DURATION = "kvstore_server_request_duration_seconds"
_REQUEST_DURATION_ABOUT = (
    "Seconds from a request's header arriving to its reply sent (waits for a slot under "
    "max_inflight_requests included), by op and status (ok, an error reply's status, or "
    "aborted when the connection broke first)."
)


class _Series:
    """One histogram series: per-bucket (not cumulative) counts, the last one +Inf's."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.total = 0.0


class LatencyHistogram:
    """Request latencies by ``op`` and ``status``, as a Prometheus histogram.

    Lock ownership: none is taken. The server's event loop owns the histogram: every
    request is served on the loop, so :meth:`observe` is only ever called from that one
    thread and needs no lock (it costs a bisect, two dict lookups and two additions; a
    series' list is allocated once, at its first request). :meth:`render` normally runs on
    the loop as well (``/metrics`` is served there) and then sees a consistent picture. A
    render from another thread copies each series' counts in one step (a list copy under
    the GIL), so its buckets stay cumulative and its ``_count`` equals its ``+Inf`` bucket;
    only its ``_sum`` may miss the one observation being made at that instant.
    """

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        assert bounds and list(bounds) == sorted(set(bounds)), bounds  # strictly increasing
        self._bounds = bounds
        self._les = (*(repr(float(b)) for b in bounds), "+Inf")
        self._series: dict[str, dict[str, _Series]] = {}

    def observe(self, op: str, status: str, seconds: float) -> None:
        """Count one request of ``op`` that ended in ``status`` after ``seconds``.
        Loop thread only (see the class)."""
        by_status = self._series.get(op)
        if by_status is None:
            by_status = self._series[op] = {}
        series = by_status.get(status)
        if series is None:
            series = by_status[status] = _Series(len(self._les))
        series.counts[bisect_left(self._bounds, seconds)] += 1  # le: value <= bound
        series.total += seconds

    def render(self, lines: list[str], name: str, about: str = "") -> None:
        """Append the ``name_bucket`` (cumulative), ``name_sum`` and ``name_count`` samples
        of every series to ``lines`` (nothing before the first request)."""
        taken = [
            (op, status, list(series.counts), series.total)
            for op, by_status in sorted(dict(self._series).items())
            for status, series in sorted(dict(by_status).items())
        ]
        if not taken:
            return
        if about:
            lines.append(f"# HELP {name} {about}")
        lines.append(f"# TYPE {name} histogram")
        for op, status, counts, total in taken:
            labels = f'op="{op}",status="{status}"'
            running = 0
            for le, count in zip(self._les, counts, strict=True):
                running += count
                lines.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
            lines.append(f"{name}_sum{{{labels}}} {_number(total)}")
            lines.append(f"{name}_count{{{labels}}} {running}")


class ServerMetrics:
    """Counters of a server. Thread-safe: ``_lock`` guards every field but ``latency``,
    which the server's event loop owns (see :class:`LatencyHistogram`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(float)
        self._requests: dict[str, int] = defaultdict(int)
        self._errors: dict[str, int] = defaultdict(int)
        self._gauges: dict[str, float] = defaultdict(float)
        #: Request latency by op and status; observed on the loop, without a lock.
        self.latency = LatencyHistogram()

    def add(self, name: str, value: float = 1) -> None:
        """Add to counter ``name`` (``kvstore_server_<name>_total``)."""
        with self._lock:
            self._counters[name] += value

    def request(self, op: str) -> None:
        """Count one request of ``op``."""
        with self._lock:
            self._requests[op] += 1

    def error(self, status: str) -> None:
        """Count one error reply of ``status``."""
        with self._lock:
            self._errors[status] += 1

    def gauge(self, name: str, delta: float) -> None:
        """Move gauge ``name`` (``kvstore_server_<name>``) by ``delta``."""
        with self._lock:
            self._gauges[name] += delta

    def snapshot(self) -> dict[str, Any]:
        """Everything, as a JSON-friendly dict."""
        with self._lock:
            return {
                **{k: v for k, v in self._counters.items()},
                **{k: v for k, v in self._gauges.items()},
                "requests": dict(self._requests),
                "errors": dict(self._errors),
            }

    def render(self, stores: list[dict[str, Any]]) -> str:
        """Prometheus text: server counters, then per-store gauges."""
        with self._lock:
            counters = dict(self._counters)
            gauges = dict(self._gauges)
            requests = dict(self._requests)
            errors = dict(self._errors)
        lines: list[str] = []
        for name, value in sorted(counters.items()):
            _metric(lines, f"kvstore_server_{name}_total", "counter", [("", value)])
        for name, value in sorted(gauges.items()):
            _metric(lines, f"kvstore_server_{name}", "gauge", [("", value)])
        _metric(
            lines,
            "kvstore_server_requests_total",
            "counter",
            [(f'op="{op}"', n) for op, n in sorted(requests.items())],
        )
        self.latency.render(lines, _REQUEST_DURATION, _REQUEST_DURATION_ABOUT)
        _metric(
            lines,
            "kvstore_server_errors_total",
            "counter",
            [(f'status="{s}"', n) for s, n in sorted(errors.items())],
        )
        _store_metrics(lines, stores)
        return "\n".join(lines) + "\n"


def _metric(
    lines: list[str], name: str, kind: str, samples: list[tuple[str, float]], about: str = ""
) -> None:
    if not samples:
        return
    if about:
        lines.append(f"# HELP {name} {about}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        number = _number(value)
        lines.append(f"{name}{{{labels}}} {number}" if labels else f"{name} {number}")


def _number(value: float) -> str:
    """A sample value as the text format writes it: whole numbers in full (``:g`` would
    round a byte counter past a million to six digits), others as Python's shortest
    round-tripping form, and ``+Inf``, ``-Inf``, ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


#: HELP text of the metrics that count blocks and bytes: a capacity is configured in bytes
#: and counted in blocks, the same way in the server's banner and in ``kvstore stats``.
_ABOUT = {
    "kvstore_store_blocks": "Blocks the store holds (each counted once, in whichever tiers).",
    "kvstore_store_block_bytes": "Bytes of KV in one block (chunk) of the store's layout.",
    "kvstore_tier_blocks": (
        'Blocks a tier holds (what="blocks") and has room for (what="capacity_blocks"): its '
        "configured capacity in bytes divided by the bytes a block takes there, the chunk "
        "(kvstore_store_block_bytes) in memory, Redis and S3, the chunk plus its 4 KiB header "
        "in a disk tier's block file (which also clamps to 95% of the free space at open)."
    ),
    "kvstore_tier_read_correction": (
        "The factor a tier's fitted read speed is priced at for restore planning: restores "
        "move it towards what their reads of the tier cost the engine over what the fit "
        "says (1: restores cost what the reads measure; kept within [0.5, 20])."
    ),
    "kvstore_tier_read_estimate_error": (
        "Median over a tier's recent restores of its planned / actual load seconds - 1 "
        "(below 0: plans were too hopeful of the tier)."
    ),
}

_STORE_GAUGES = (
    ("blocks", "gauge", "blocks"),
    ("block_nbytes", "gauge", "block_bytes"),
    ("lookup_hit_rate", "gauge", "lookup_hit_rate"),
    ("bytes_written", "counter", "bytes_written_total"),
    ("bytes_written_in_place", "counter", "bytes_written_in_place_total"),
    ("bytes_read", "counter", "bytes_read_total"),
    ("evictions_total", "counter", "evictions_total"),
)


#: A tier's live read-speed estimate (kvstore/restore/speeds.py): stats key, label.
_SPEEDS = (("read_gbps_estimate", "gbps"), ("read_latency_ms_estimate", "latency_ms"))


def _store_metrics(lines: list[str], stores: list[dict[str, Any]]) -> None:
    for field, kind, name in _STORE_GAUGES:
        samples = []
        for stats in stores:
            value = stats.get(field)
            if field == "evictions_total":
                value = sum(stats.get("evictions", []) or [0])
            if isinstance(value, (int, float)):
                labels = f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}"'
                samples.append((labels, float(value)))
        metric = f"kvstore_store_{name}"
        _metric(lines, metric, kind, samples, _ABOUT.get(metric, ""))
    tier_samples, speed_samples = [], []
    for stats in stores:
        for i, tier in enumerate(stats.get("tiers", [])):
            labels = (
                f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}",'
                f'tier="{i}",kind="{tier.get("kind", "")}"'
            )
            for key in ("blocks", "capacity_blocks"):
                if isinstance(tier.get(key), (int, float)):
                    tier_samples.append((labels + f',what="{key}"', float(tier[key])))
            for key, what in _SPEEDS:
                if isinstance(tier.get(key), (int, float)):
                    source = tier.get("read_speed_source", "")
                    speed_labels = labels + f',what="{what}",source="{source}"'
                    speed_samples.append((speed_labels, float(tier[key])))
    _metric(lines, "kvstore_tier_blocks", "gauge", tier_samples, _ABOUT["kvstore_tier_blocks"])
    _metric(lines, "kvstore_tier_read_speed", "gauge", speed_samples)
    for key, name in _LOOP:
        _metric(lines, name, "gauge", _tier_figures(stores, key), _ABOUT.get(name, ""))
    _restore_metrics(lines, stores)
    _cluster_metrics(lines, stores)
    _crypt_metrics(lines, stores)


#: The closed loop that prices each tier (kvstore/restore/speeds.py): stats key, metric name.
_LOOP = (
    ("read_correction", "kvstore_tier_read_correction"),
    ("read_estimate_error", "kvstore_tier_read_estimate_error"),
)


def _tier_figures(stores: list[dict[str, Any]], key: str) -> list[tuple[str, float]]:
    """``(labels, value)`` of one numeric figure of every store's tiers."""
    samples = []
    for stats in stores:
        for i, tier in enumerate(stats.get("tiers", [])):
            value = tier.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                labels = (
                    f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}",'
                    f'tier="{i}",kind="{tier.get("kind", "")}"'
                )
                samples.append((labels, float(value)))
    return samples


#: Restore planning counters (kvstore/restore/planner.py): stats key, metric name.
_RESTORE = (
    ("plans", "kvstore_restore_plans_total"),
    ("tokens_planned_load", "kvstore_restore_tokens_planned_load_total"),
    ("tokens_planned_recompute", "kvstore_restore_tokens_planned_recompute_total"),
    ("chunks_warming", "kvstore_restore_chunks_warmed_total"),
    ("lookups_deferred", "kvstore_restore_lookups_deferred_total"),
    ("warming_yields", "kvstore_restore_warming_yields_total"),
    ("load_planned_s", "kvstore_restore_load_planned_seconds_total"),
    ("load_actual_s", "kvstore_restore_load_actual_seconds_total"),
    ("estimate_error_median", "kvstore_restore_estimate_error_median"),
)


#: The same per tier level (a ``tier`` label): stats key before the level, metric name.
_RESTORE_PER_TIER = (
    ("tokens_planned_load_tier", "kvstore_restore_tier_tokens_planned_load_total"),
    ("load_planned_s_tier", "kvstore_restore_tier_load_planned_seconds_total"),
    ("load_actual_s_tier", "kvstore_restore_tier_load_actual_seconds_total"),
)


def _restore_metrics(lines: list[str], stores: list[dict[str, Any]]) -> None:
    """Tokens each store planned to load vs recompute, and planned vs actual load
    seconds, so a wrong speed estimate shows; both also per tier (``tier`` label)."""
    for key, name in _RESTORE:
        samples = []
        for stats in stores:
            restore = stats.get("restore") or {}
            labels = f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}"'
            if isinstance(restore.get(key), (int, float)):
                samples.append((labels, float(restore[key])))
        kind = "gauge" if key == "estimate_error_median" else "counter"
        _metric(lines, name, kind, samples)
    for prefix, name in _RESTORE_PER_TIER:
        per_tier = []
        for stats in stores:
            restore = stats.get("restore") or {}
            labels = f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}"'
            for key, value in restore.items():
                if key.startswith(prefix) and isinstance(value, (int, float)):
                    tier = key.removeprefix(prefix)
                    per_tier.append((labels + f',tier="{tier}"', float(value)))
        _metric(lines, name, "counter", per_tier)


def _cluster_metrics(lines: list[str], stores: list[dict[str, Any]]) -> None:
    """A cluster tier's failures to reach its peers (down, or refusing the token)."""
    errors, unreachable = [], []
    for stats in stores:
        labels = f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}"'
        for tier in stats.get("tiers", []):
            if tier.get("kind") != "cluster":
                continue
            for key, what in (("peer_errors", "unreachable"), ("peer_auth_failures", "auth")):
                errors.append((labels + f',what="{what}"', float(tier.get(key, 0))))
            unreachable.append((labels, float(len(tier.get("unreachable_peers", [])))))
    _metric(lines, "kvstore_cluster_peer_errors_total", "counter", errors)
    _metric(lines, "kvstore_cluster_unreachable_peers", "gauge", unreachable)


#: Encryption at rest (kvstore/format/sealing.py), per tier: stats key, metric name, about.
_CRYPT = (
    (
        "decrypt_failures",
        "kvstore_tier_decrypt_failures_total",
        "Blocks a tier could not open (tampered, or no key for them): misses.",
    ),
    (
        "reencrypted",
        "kvstore_tier_reencrypted_total",
        "Blocks rewritten under the active key by the background re-encryption.",
    ),
    (
        "reencrypt_pending",
        "kvstore_tier_reencrypt_pending",
        "Blocks the background re-encryption has still to check.",
    ),
)


def _crypt_metrics(lines: list[str], stores: list[dict[str, Any]]) -> None:
    """Each encrypting (or once-encrypted) tier's decrypt failures and re-encryption."""
    for key, name, about in _CRYPT:
        samples = []
        for stats in stores:
            for i, tier in enumerate(stats.get("tiers", [])):
                if isinstance(tier.get(key), (int, float)):
                    labels = (
                        f'namespace="{stats["namespace"]}",layout="{stats["layout_fp"]}",'
                        f'tier="{i}",kind="{tier.get("kind", "")}"'
                    )
                    samples.append((labels, float(tier[key])))
        kind = "gauge" if key == "reencrypt_pending" else "counter"
        _metric(lines, name, kind, samples, about)


class MetricsEndpoint:
    """``/metrics`` and ``/healthz`` over HTTP/1.0 on the server's loop."""

    def __init__(self, render: Callable[[], str], healthy: Callable[[], bool]) -> None:
        self._render = render
        self._healthy = healthy
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; return the bound address."""
        self._server = await asyncio.start_server(self._handle, host, port)
        sockname = self._server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            status, ctype, body = self._answer(head[:_MAX_REQUEST])
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError):
            status, ctype, body = "400 Bad Request", "text/plain", "bad request\n"
        except ConnectionError:
            writer.close()
            return
        data = body.encode()
        writer.write(
            f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def _answer(self, head: bytes) -> tuple[str, str, str]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or parts[0] != b"GET":
            return "405 Method Not Allowed", "text/plain", "only GET\n"
        path = parts[1].split(b"?", 1)[0]
        if path == b"/metrics":
            return "200 OK", "text/plain; version=0.0.4", self._render()
        if path == b"/healthz":
            if self._healthy():
                return "200 OK", "text/plain", "ok\n"
            return "503 Service Unavailable", "text/plain", "draining\n"
        return "404 Not Found", "text/plain", "not found\n"

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
