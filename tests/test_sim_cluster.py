"""Tests of ``benchmarks/sim_cluster.py``, the cluster sizing simulation: ``--quick --json``
prints one JSON object whose figures are sane and relate as they must (routing beats random,
Redis load grows with the node count), and the trace generator is deterministic and
responds to its popularity knobs. No Redis, no network: the simulation is pure Python."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from _sim_trace import CellSpec, TraceConfig, generate, infinite_hit_rate  # noqa: E402
from sim_cluster import calibrate  # noqa: E402

#: the fields issue 24 fixes, so that runs can be compared
FIELDS = (
    "nodes",
    "routed_hit_rate",
    "redis_ops_per_s",
    "redis_memory_bytes",
    "redis_shards",
    "s3_requests_per_hit",
    "s3_egress_bytes_per_hit",
    "peer_bytes_per_s",
)


def number(value: Any) -> float:
    """``value`` as a finite number (not a bool)."""
    assert isinstance(value, (int, float)) and not isinstance(value, bool), value
    assert math.isfinite(value), value
    return float(value)


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    """One ``--quick --json`` run at 10, 100 and 1000 nodes."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "sim_cluster.py"), "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"sim_cluster.py failed:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)  # the whole of stdout is exactly one JSON document
    assert isinstance(result, dict)
    assert result["benchmark"] == "sim_cluster"
    return result


def test_quick_run_has_the_fields(quick: dict[str, Any]) -> None:
    points = quick["results"]
    assert [p["nodes"] for p in points] == [10, 100, 1000]
    for point in points:
        for name in FIELDS:
            assert name in point, f"missing field {name!r}"
            assert number(point[name]) >= 0, (name, point[name])
        assert isinstance(point["redis_shards"], int) and point["redis_shards"] >= 1
        for name in ("random_hit_rate", "routed_found_rate", "random_found_rate"):
            assert 0.0 <= number(point[name]) <= 1.0, (name, point[name])
        assert 0.0 < point["routed_hit_rate"] <= 1.0
        shares = point["routed_sources"]
        assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
        assert math.isclose(point["routed_found_rate"], 1 - shares["computed"], rel_tol=1e-9)


def test_quick_run_relations(quick: dict[str, Any]) -> None:
    """Routing keeps prompts where their prefix is; Redis load and memory grow with nodes."""
    points = quick["results"]
    for point in points:
        # S3 holds every computed block, so the anywhere-hit rate is routing-independent...
        assert point["routed_found_rate"] >= point["random_found_rate"] - 1e-12
        # ...while what a node finds in its own tiers is not
        assert point["routed_hit_rate"] > point["random_hit_rate"] + 0.2
        assert point["peer_bytes_per_s"] < point["random_peer_bytes_per_s"]
        assert point["lookup_ms_p50"] < point["roundtrip_lookup_ms_p50"]
    for small, big in itertools.pairwise(points):
        assert big["redis_ops_per_s"] > small["redis_ops_per_s"]
        assert big["redis_memory_bytes"] > small["redis_memory_bytes"]
        assert big["index_fanout_bytes_per_s"] > small["index_fanout_bytes_per_s"]
        assert big["redis_shards"] >= small["redis_shards"]
        assert big["peer_bytes_per_s"] > small["peer_bytes_per_s"]


def test_quick_run_says_what_is_measured(quick: dict[str, Any]) -> None:
    cal = quick["calibration"]
    assert cal["shard_ops_per_s"]["measured"] is False
    for entry in cal.values():
        assert entry["source"].startswith("measured" if entry["measured"] else "assumed")
    if (ROOT / "docs" / "benchmarks" / "results.json").exists():
        assert cal["redis_bytes_per_block"]["measured"] is True


def test_missing_results_fall_back_to_assumed(tmp_path: Path) -> None:
    cal = calibrate(tmp_path / "absent.json")
    assert cal and not any(c.measured for c in cal.values())
    assert all(c.value > 0 for c in cal.values())


def test_trace_is_deterministic() -> None:
    spec = CellSpec(nodes=100, cell_nodes=4, requests=2000, seed=7)
    one, two = generate(TraceConfig(), spec), generate(TraceConfig(), spec)
    for name in ("time", "session", "turn", "turn_blocks", "doc_blocks", "others_doc"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    other = generate(TraceConfig(), CellSpec(nodes=100, cell_nodes=4, requests=2000, seed=8))
    assert not np.array_equal(one.time[:100], other.time[:100])
    assert len(one.time) > 1000 and np.all(np.diff(one.time) >= 0)


def test_skewed_popularity_shares_more() -> None:
    """A steeper Zipf over system prompts and documents makes more of each prompt a hit."""
    spec = CellSpec(nodes=10, cell_nodes=4, requests=3000, seed=1)
    flat = infinite_hit_rate(generate(TraceConfig(system_zipf=0.5, doc_zipf=0.5), spec))
    steep = infinite_hit_rate(generate(TraceConfig(system_zipf=1.5, doc_zipf=1.5), spec))
    assert 0.0 < flat < steep < 1.0
