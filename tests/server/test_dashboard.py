"""The Grafana dashboard in docs/grafana: a well-formed dashboard, and every metric its
panels and variables query is one a live kvstore-server serves on ``/metrics``.

The metric names are read out of the dashboard's PromQL, never listed here: a panel that
queries a name the server does not serve (a typo, a renamed counter) fails the test.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.cli.servers import RedisServer
from kvstore.client import Client, ClientOptions
from kvstore.errors import AccessDeniedError
from kvstore.format.codec import Codec, encode_block
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import (
    FRAME,
    Frame,
    Op,
    SlotStatus,
    Status,
    decode_put_reply,
    encode_keys,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvstore-dashboard.json"
LAYOUT = small_layout()
TOKEN = "dashboard-test-token-0123456789"
MAX_CONNECTIONS = 8  # room for the clients' connections that are still closing


def words(text: str) -> frozenset[str]:
    """The space-separated words of ``text``."""
    return frozenset(text.split())


# PromQL's vocabulary (prometheus/promql/parser): what is not a metric name.
AGGREGATIONS = words(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile "
    "limitk limit_ratio"
)
FUNCTIONS = words(
    "abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month "
    "day_of_week day_of_year days_in_month delta deriv exp floor histogram_avg "
    "histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar "
    "histogram_sum holt_winters double_exponential_smoothing hour idelta increase irate "
    "label_join label_replace ln log2 log10 minute month predict_linear rate resets round "
    "scalar sgn sort sort_desc sort_by_label sort_by_label_desc sqrt time timestamp vector "
    "year avg_over_time min_over_time max_over_time sum_over_time count_over_time "
    "quantile_over_time stddev_over_time stdvar_over_time last_over_time present_over_time "
    "mad_over_time acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh deg pi rad "
    "info"
)
KEYWORDS = words("and or unless bool offset atan2 inf nan start end")
LABEL_LISTS = words("by without on ignoring group_left group_right")
GRAFANA_VARIABLES = words("__rate_interval __interval __interval_ms __range __range_s __range_ms")

TOKEN_RE = re.compile(
    r"""(?P<space>\s+)
    |(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    |(?P<variable>\$\{?[A-Za-z_]\w*(?::\w+)?\}?)
    |(?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)
    |(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
CLOSING = {"(": ")", "{": "}", "[": "]"}


def tokens(expr: str) -> list[tuple[str, str]]:
    """``(kind, text)`` of each token of ``expr``, spaces left out."""
    found = []
    for match in TOKEN_RE.finditer(expr):
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            found.append((kind, match.group()))
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` queries: every bare name that is not a function, an
    aggregation, a keyword, or inside a label matcher ``{...}``, a range ``[...]`` or a
    ``by (...)``-style label list. Raises AssertionError on unbalanced brackets or a call
    of a function PromQL does not have."""
    toks = tokens(expr)
    names: set[str] = set()
    stack: list[str] = []
    skip_depth: int | None = None  # inside {...}, [...] or a label list: no names
    pending_labels = False
    for i, (kind, text) in enumerate(toks):
        if kind == "other" and text in CLOSING:
            if skip_depth is None and (text != "(" or pending_labels):
                skip_depth = len(stack)
            pending_labels = False
            stack.append(CLOSING[text])
            continue
        if kind == "other" and text in CLOSING.values():
            assert stack and stack.pop() == text, f"unbalanced {text!r} in {expr!r}"
            if skip_depth == len(stack):
                skip_depth = None
            continue
        if skip_depth is not None or kind != "name":
            continue
        following = toks[i + 1][1] if i + 1 < len(toks) else ""
        if text in LABEL_LISTS:
            pending_labels = following == "("
        elif following == "(" and text not in KEYWORDS:
            assert text in FUNCTIONS | AGGREGATIONS, f"no PromQL function {text!r} in {expr!r}"
        elif text not in AGGREGATIONS | KEYWORDS:
            names.add(text)
    assert not stack, f"unclosed {stack} in {expr!r}"
    return names


def variable_query_names(query: str) -> set[str]:
    """The metric names a Prometheus variable query reads (``label_values(expr, label)``,
    ``query_result(expr)``, ``metrics(regex)`` reads none by name)."""
    query = query.strip()
    call = re.fullmatch(r"(label_values|query_result)\((.*)\)", query, re.DOTALL)
    if call is None:
        return set()
    body = call.group(2)
    if call.group(1) == "label_values":
        head, comma, _label = body.rpartition(",")
        body = head if comma else ""  # label_values(label) alone reads no metric
    return metric_names(body) if body.strip() else set()


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, set[str]]]:
    """``(where, PromQL, metric names)`` of every panel target and every variable query."""
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} target {target['refId']}"
            yield where, target["expr"], metric_names(target["expr"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            yield f"variable {var['name']!r}", query, variable_query_names(query)


def served_names(text: str) -> set[str]:
    """The sample names of a Prometheus text exposition (``foo_bucket``, ``foo_sum``,
    ``foo_count`` of a histogram, ``foo_total`` of a counter): what PromQL can select."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line)
            assert match is not None, f"not a sample line: {line!r}"
            names.add(match.group())
    return names


def load_dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


# --- the extraction itself, on the forms dashboards use ---------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('rate(kvstore_x_total{job=~"$job", op!="get"}[$__rate_interval])', {"kvstore_x_total"}),
        ("sum by (op, le) (rate(a_total[5m])) / ignoring(op) group_left b", {"a_total", "b"}),
        (
            "histogram_quantile(0.99, sum by (le) (rate(lat_seconds_bucket{a='}'}[1m])))",
            {"lat_seconds_bucket"},
        ),
        (
            "rate(lat_seconds_sum[5m]) / rate(lat_seconds_count[5m])",
            {"lat_seconds_sum", "lat_seconds_count"},
        ),
        ('max(rpc{quantile="0.99"}) * 1e9 + 0x1f - .5e-3', {"rpc"}),
        ("sum without (instance) (a) and on (job) b offset 5m or vector(0)", {"a", "b"}),
        ("topk(3, sum(rate(a[1h:5m])))", {"a"}),
        ('count(up{job="kvstore"} == bool 1) > 0', {"up"}),
    ],
)
def test_metric_names_are_read_out_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", ["rat(a[5m])", "sum(a", 'a{b="c"]', "a)"])
def test_malformed_promql_is_caught(expr: str) -> None:
    with pytest.raises(AssertionError):
        metric_names(expr)


def test_variable_queries_name_their_metric() -> None:
    assert variable_query_names('label_values(up{job=~"$job"}, instance)') == {"up"}
    assert variable_query_names("label_values(job)") == set()
    assert variable_query_names("query_result(sum by (x) (rate(a_total[5m])))") == {"a_total"}


# --- the dashboard's shape ---------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = load_dashboard()
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["schemaVersion"] >= 36  # Grafana 10's importer takes it as is
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    panels = list(all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    for panel in panels:
        check_grid(panel)
        if panel["type"] == "row":
            assert "targets" not in panel
            continue
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}
        assert panel["title"] and panel.get("description"), panel["id"]
        check_targets(panel, variables.keys())
    check_no_overlap([p for p in dashboard["panels"]])


def check_grid(panel: dict[str, Any]) -> None:
    grid = panel["gridPos"]
    assert {"h", "w", "x", "y"} <= grid.keys(), panel["id"]
    assert all(isinstance(grid[k], int) and grid[k] >= 0 for k in "hwxy"), grid
    assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, grid


def check_targets(panel: dict[str, Any], variables: Any) -> None:
    """Prometheus targets on the ``$datasource`` variable, unique refIds, variables that
    exist, and at least one metric read by each."""
    prometheus = {"type": "prometheus", "uid": "${datasource}"}
    assert panel["datasource"] == prometheus, panel["title"]
    targets = panel["targets"]
    assert targets, f"panel {panel['title']!r} has no targets"
    ref_ids = [t["refId"] for t in targets]
    assert len(set(ref_ids)) == len(ref_ids), panel["title"]
    for target in targets:
        assert target["datasource"] == prometheus, panel["title"]
        assert metric_names(target["expr"]), f"{panel['title']!r} reads no metric"
        for kind, text in tokens(target["expr"]):
            if kind == "variable":
                name = text.strip("${}").split(":")[0]
                assert name in variables or name in GRAFANA_VARIABLES, (panel["title"], name)


def check_no_overlap(panels: list[dict[str, Any]]) -> None:
    boxes = [(p["id"], p["gridPos"]) for p in panels]
    for i, (a_id, a) in enumerate(boxes):
        for b_id, b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"panels {a_id} and {b_id} overlap"


# --- against a live server ----------------------------------------------------------------


def hello(address: str) -> socket.socket | None:
    """A connection that got its HELLO answered, or None if the server closed it."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(Frame(Op.HELLO, 0, 0, 1, 2, 0).pack() + b"{}")
        head = sock.recv(FRAME.size, socket.MSG_WAITALL)
    except ConnectionError:
        head = b""
    if len(head) < FRAME.size:
        sock.close()
        return None
    meta = sock.recv(Frame.unpack(head).meta_len, socket.MSG_WAITALL)
    assert meta, "the server answered HELLO with nothing"
    return sock


def refuse_one_connection(address: str) -> None:
    """Open connections until the server refuses one (over ``max_connections``)."""
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS + 1):
            sock = hello(address)
            if sock is None:
                return
            held.append(sock)
        pytest.fail(f"{MAX_CONNECTIONS + 1} connections and none refused")
    finally:
        for sock in held:
            sock.close()


def put_a_damaged_block(conn: Any) -> None:
    """Over a raw connection: a put whose second block was damaged on the way (the
    server drops that block alone)."""
    keys = make_keys(2, salt=7)
    kv = random_blocks(LAYOUT, 2, seed=7)
    step = LAYOUT.block_tokens
    data = [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(2)]
    wire = b"".join(
        encode_block(k, LAYOUT, b, Codec.RAW).tobytes() for k, b in zip(keys, data, strict=True)
    )
    body = bytearray(wire)
    body[-5] ^= 0xFF  # a payload byte of the last block: its layer checksum fails
    frame, meta, _ = conn.call(Op.PUT, encode_keys(keys), bytes(body))
    assert frame.status == Status.OK, meta
    assert decode_put_reply(meta, 2) == [SlotStatus.STORED, SlotStatus.CORRUPT]


def serve_some_traffic(server: KVStoreServerProcess, raw: Any) -> None:
    """What a day brings: a damaged block, puts, lookups and gets through the client, a
    wrong token, and last (closed connections leave the server's count a moment later) a
    connection over the limit."""
    conn = raw(server.address)
    conn.handshake(LAYOUT, token=TOKEN.encode())
    put_a_damaged_block(conn)
    conn.close()
    keys = make_keys(4, salt=3)
    kv = random_blocks(LAYOUT, 4, seed=3)
    step = LAYOUT.block_tokens
    data = [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(4)]
    for shared_memory in (True, False):  # blocks lent through memory, and over the socket
        options = ClientOptions(server.address, token=TOKEN.encode(), shared_memory=shared_memory)
        with Client(LAYOUT, options) as client:
            assert all(client.put(keys, data))
            assert client.lookup(keys + make_keys(2, salt=4)) == 4
            outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
            assert client.get(keys, outs) == [True] * 4
            assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
    wrong = ClientOptions(server.address, token=b"not-the-token-000000")
    with pytest.raises(AccessDeniedError), Client(LAYOUT, wrong) as client:
        client.lookup(keys)
    refuse_one_connection(server.address)


def scrape(server: KVStoreServerProcess) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        return str(reply.read().decode())


def test_every_metric_the_dashboard_queries_is_served(
    tmp_path: Path, redis_server: RedisServer, raw: Any
) -> None:
    """A server with memory, disk and a cluster tier (so the cluster's counters exist),
    some traffic, then each name in each panel's PromQL is looked up in its /metrics."""
    config = server_test_config(tmp_path, token=TOKEN, max_connections=MAX_CONNECTIONS)
    config["cluster"] = {"redis_url": redis_server.url, "name": f"dash-{tmp_path.name}"}
    with KVStoreServerProcess(config, tmp_path / "server", metrics=True) as server:
        serve_some_traffic(server, raw)
        served = served_names(scrape(server))
    read = list(queries(load_dashboard()))
    assert len(read) > 20, "the dashboard has (almost) no queries"
    missing = [f"{where}: {sorted(names - served)}" for where, _, names in read if names - served]
    assert not missing, "not served by kvstore-server:\n" + "\n".join(missing)
