"""Smoke test of benchmarks/bench_copies.py: one JSON object with its documented fields."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@pytest.mark.timeout(120)
def test_bench_copies_quick_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_copies.py"), "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert result["benchmark"] == "copies" and result["quick"] is True
    for name in (
        "copy_all_adjacent",
        "per_pair_adjacent",
        "copy_all_scattered",
        "lane_submit_wait",
    ):
        assert positive(result[f"{name}_gbps"]), name
        ratio = result[f"{name}_ratio"]
        assert math.isclose(ratio, result[f"{name}_gbps"] / result["raw_gbps"]), name
    assert result["adjacent_copies"] == 1  # 16 adjacent blocks: one copy
    assert 1 < result["scattered_copies"] <= result["blocks"] == 16
    small, layer = result["small_blocks"], result["layer_slices"]
    assert small["copies"] == 1 and layer["copies"] == 1
    for row in (small, layer):
        assert all(positive(row[k]) for k in ("raw_gbps", "copy_all_gbps", "per_pair_gbps"))
    assert set(result["meets_target"]) == {"copy_all_adjacent", "lane_submit_wait"}
    assert all(isinstance(n, int) and n > 0 for n in result["reps"].values())
    assert result["environment"]["torch"]
