"""Smoke test of ``benchmarks/bench_cluster.py``: ``--quick --json`` on three local nodes
prints one JSON object with its documented fields, as sane numbers. No timing or target
assertions (the machines are noisy); the skip path runs without ``redis-server``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_cluster.py"


def run_bench(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the script with ``--quick --json``; the one JSON object it prints."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert proc.returncode == 0, f"bench_cluster.py failed:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)  # the whole of stdout is exactly one JSON document
    assert isinstance(result, dict)
    assert result["benchmark"] == "cluster"
    return result


def number(value: Any) -> float:
    """``value`` as a finite number (not a bool)."""
    assert isinstance(value, (int, float)) and not isinstance(value, bool), value
    assert math.isfinite(value), value
    return float(value)


def check_positive(result: dict[str, Any], *fields: str) -> None:
    for name in fields:
        assert name in result, f"missing field {name!r}"
        assert number(result[name]) > 0, (name, result[name])


def check_rates(result: dict[str, Any], *fields: str) -> None:
    for name in fields:
        assert 0.0 <= number(result[name]) <= 1.0, (name, result[name])


def check_peer_fetch(fetch: dict[str, Any]) -> None:
    """Every peer rep really fetched from a; nobody else kept a copy; bytes exact."""
    assert fetch["verified"] is True
    assert fetch["fetched_blocks"] == fetch["fetched_expected"] > 0
    assert fetch["copies_on_b_or_c"] == 0
    assert set(fetch["gbps"]) == {"local_tcp", "local_shm", "peer_tcp", "peer_shm"}
    assert all(number(v) > 0 for v in fetch["gbps"].values())
    assert all(isinstance(n, int) and n > 0 for n in fetch["reps"].values())


def check_routing(result: dict[str, Any]) -> None:
    routing = result["routing"]
    asked = routing["trace"]["chunks_asked"]
    for mode in ("routed", "random"):
        figures = routing[mode]
        assert figures["chunks_asked"] == asked > 0
        assert figures["chunks_local"] + figures["chunks_from_peers"] <= asked
        assert sum(figures["requests_by_node"].values()) == routing["trace"]["requests"]
        assert figures["hit_rate"] <= figures["cluster_hit_rate"] + 1e-9
    margin = result["routed_hit_rate"] - result["random_hit_rate"]
    assert math.isclose(number(result["routing_margin"]), margin)
    assert routing["routed"]["chunks_from_peers"] >= 0


def check_index(result: dict[str, Any]) -> None:
    lookup = result["index_lookup"]
    assert lookup["keys"] == 512
    assert lookup["live_nodes"] == ["a", "b", "c"]
    assert [r[:2] for r in lookup["ranked"]] == [["a", 384], ["b", 128], ["c", 0]]
    assert lookup["ranked"][0][2] > lookup["ranked"][1][2] > 0  # the figure of merit
    assert result["index_lookup_ms_p99"] >= result["index_lookup_ms_p50"]
    points = result["index_scaling"]
    sizes = [p["blocks"] for p in points]
    assert sizes == sorted(sizes) and len(sizes) >= 2 and sizes[-1] <= 10_000
    for point in points:
        for name in ("add_s", "redis_bytes_per_block", "memory_usage_bytes_per_block"):
            assert number(point[name]) > 0, (name, point)
        assert 0 < number(point["locate_ms_p50"]) <= number(point["locate_ms_p99"])
    assert result["redis_bytes_per_block"] == points[-1]["redis_bytes_per_block"]


def check_ranks(result: dict[str, Any]) -> None:
    """Router.rank over simulated clusters: every size ranked, the memory holder first."""
    points = result["rank_scaling"]
    assert [p["nodes"] for p in points] == [10, 100]  # --quick; 1000 too in a full run
    for point in points:
        assert 0 < number(point["rank_ms_p50"]) <= number(point["rank_ms_p99"])
        assert point["best"][0] == "n0" and number(point["best"][1]) > 0
    assert result["rank_ms_p50_at_100_nodes"] == points[1]["rank_ms_p50"]
    assert result["rank_ms_per_node_growth"] is None  # no size past 100 in --quick


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_bench_cluster_quick() -> None:
    result = run_bench()
    assert result["quick"] is True
    check_positive(
        result,
        "peer_fetch_gbps",
        "local_fetch_gbps",
        "peer_fetch_ratio_vs_local",
        "peer_fetch_shm_ratio_vs_local",
        "index_lookup_ms_p50",
        "index_lookup_ms_p99",
        "index_locate_ms_p50",
        "index_locate_ms_p99",
        "redis_bytes_per_block",
    )
    check_rates(
        result,
        "routed_hit_rate",
        "random_hit_rate",
        "routed_cluster_hit_rate",
        "random_cluster_hit_rate",
        "routed_busiest_node_share",
        "random_busiest_node_share",
    )
    check_peer_fetch(result["peer_fetch"])
    check_routing(result)
    check_index(result)
    check_ranks(result)
    assert set(result["targets"]) == set(result["meets_target"])
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    assert result["environment"]["cpus"] > 0 and "hiredis" in result["environment"]


@pytest.mark.timeout(60)
def test_bench_cluster_without_redis_server_is_skipped(tmp_path: Path) -> None:
    """No redis-server on PATH: a clear message and a JSON object saying ``skipped``."""
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty directory: nothing to find
    result = run_bench(env)
    assert "redis-server" in result["skipped"]
    assert "install-servers.sh" in result["skipped"]
