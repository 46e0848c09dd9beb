"""The peer benchmarks: LMCache side by side (bench_lmcache.py) and vLLM's own hashing
(bench_hash.py's ``vllm_real_*`` fields). Structure only, no timing assertions.

LMCache needs its own venv (``bash benchmarks/peers/setup_lmcache.sh``); its real run is
opt-in (``KVSTORE_BENCH_LMCACHE=1``). vLLM's hashing runs where ``.venv-vllm`` exists.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LMCACHE_VENV = Path(os.environ.get("KVSTORE_LMCACHE_VENV", ROOT / ".venv-lmcache"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LMCACHE_HERE = importlib.util.find_spec("lmcache") is not None


def run_script(
    script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``benchmarks/<script> --json *args``; return the one JSON object it prints."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)  # the whole of stdout is exactly one JSON document
    assert isinstance(result, dict), f"{script} printed {type(result).__name__}, not an object"
    return result


def assert_number(value: Any, name: str, positive: bool = True) -> None:
    """``value`` is a finite int/float (and > 0 with ``positive``)."""
    assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
    assert math.isfinite(value), (name, value)
    assert value > 0 or not positive, (name, value)


# -- bench_lmcache.py ------------------------------------------------------------
@pytest.mark.skipif(LMCACHE_HERE, reason="lmcache imports in this interpreter: nothing to skip")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_bench_lmcache_skips_without_lmcache(tmp_path: Path, how: str) -> None:
    missing = tmp_path / "no-venv"
    args = ["--quick", "--lmcache-venv", str(missing)] if how == "flag" else ["--quick"]
    env = {"KVSTORE_LMCACHE_VENV": str(missing)} if how == "env" else {}
    env["BENCH_LMCACHE_REEXEC"] = ""  # a re-run (set by a parent) would skip too
    result = run_script("bench_lmcache.py", *args, timeout=60, env=env)
    assert result["benchmark"] == "lmcache"
    assert result["skipped"] is True
    assert "setup_lmcache.sh" in result["reason"] and str(missing) in result["reason"]


LMCACHE_RATIOS = (
    "lmcache_put_ratio",
    "lmcache_put_first_fill_ratio",
    "lmcache_get_ratio",
    "lmcache_disk_get_cold_ratio",
    "lmcache_disk_get_warm_ratio",
    "lmcache_lookup_ratio",
)
LMCACHE_RAW = tuple(
    f"{side}_{figure}"
    for side in ("kvstore", "lmcache")
    for figure in (
        "put_gbps",
        "put_first_fill_gbps",
        "get_gbps",
        "disk_get_cold_gbps",
        "disk_get_warm_gbps",
        "lookup_ms",
        "open_s",
    )
)


@pytest.mark.skipif(
    os.environ.get("KVSTORE_BENCH_LMCACHE") != "1",
    reason="LMCache side by side is opt-in: KVSTORE_BENCH_LMCACHE=1 (after "
    "bash benchmarks/peers/setup_lmcache.sh)",
)
@pytest.mark.engine
@pytest.mark.timeout(300)
def test_bench_lmcache_quick_run() -> None:
    if not LMCACHE_HERE and not (LMCACHE_VENV / "bin" / "python").exists():
        pytest.skip(f"no {LMCACHE_VENV}: run bash benchmarks/peers/setup_lmcache.sh")
    result = run_script("bench_lmcache.py", "--quick", timeout=300)
    assert result["benchmark"] == "lmcache"
    assert "skipped" not in result, result.get("reason")
    assert result["lmcache_version"] == "0.5.6"
    for name in (*LMCACHE_RATIOS, *LMCACHE_RAW, "memcpy_gbps", "lmcache_get_nocopy_ms"):
        assert name in result, f"missing field {name!r}"
        assert_number(result[name], name)
    assert result["lmcache_put_ratio"] == pytest.approx(
        result["kvstore_put_gbps"] / result["lmcache_put_gbps"]
    )
    assert result["lmcache_lookup_ratio"] == pytest.approx(
        result["lmcache_lookup_ms"] / result["kvstore_lookup_ms"]
    )
    assert result["targets"] == {
        "put": 3,
        "put_first_fill": 3,
        "get": 1.5,
        "disk_get_cold": 1,
        "disk_get_warm": 1,
    }
    assert set(result["meets_target"]) == set(result["targets"])
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    assert all(isinstance(n, int) and n > 0 for n in result["reps"].values())


# -- bench_hash.py: vLLM's own hashing ---------------------------------------------
HASH_TINY = ("--quick", "--kv-reps", "2", "--slow-reps", "1", "--rounds", "1")
VLLM_FIELDS = (
    "vllm_real_ms_per_128k",
    "ratio_vs_vllm_real",
    "ratio_vs_vllm_real_kvstore_256",
    "vllm_real_kvstore_ms_per_128k",
    "vllm_real_hash_algo",
    "vllm_real_version",
)


def assert_hash_fields_unchanged(result: dict[str, Any]) -> None:
    """The fields bench_hash.py had before the vLLM-real part are still there."""
    assert result["benchmark"] == "hash"
    for name in ("kvstore_tokens_per_s", "vllm_sha256_tokens_per_s", "ratio", "ms_per_128k"):
        assert_number(result[name], name)
    assert result["target_ratio"] == 30 and result["num_keys"] == 512
    assert set(result["meets_target"]) == {
        "ratio",
        "ratio_block16",
        "ms_per_128k",
        "ratio_list_input",
    }


@pytest.mark.timeout(120)
def test_bench_hash_vllm_real_skipped(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    result = run_script("bench_hash.py", *HASH_TINY, "--vllm-python", str(missing))
    assert_hash_fields_unchanged(result)
    for name in VLLM_FIELDS:
        assert name in result and result[name] is None, (name, result.get(name))
    assert str(missing) in result["vllm_real_skipped"]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (bash scripts/setup-vllm.sh)")
@pytest.mark.engine
@pytest.mark.timeout(300)
def test_bench_hash_vllm_real() -> None:
    result = run_script("bench_hash.py", *HASH_TINY, timeout=300)
    assert_hash_fields_unchanged(result)
    assert result["vllm_real_skipped"] is None
    assert result["vllm_real_hash_algo"] == "sha256"  # vLLM 0.32's default
    assert result["vllm_real_version"].startswith("0.32")
    for name in VLLM_FIELDS[:4]:
        assert set(result[name]) == {"16", "256"}, (name, result[name])
        for size, value in result[name].items():
            assert_number(value, f"{name}[{size}]")
    ms, kv = result["vllm_real_ms_per_128k"], result["vllm_real_kvstore_ms_per_128k"]
    assert result["ratio_vs_vllm_real"]["16"] == pytest.approx(ms["16"] / kv["16"])
    assert set(result["vllm_real_other_algos_ms_per_128k"]) == {"sha256_cbor"}
    # bench_hash.py's reimplementation, seeded as vLLM seeds it, gives vLLM's own hashes.
    assert result["vllm_real_reimplementation_matches"] is True


# -- setup_lmcache.sh ----------------------------------------------------------------
@pytest.mark.timeout(60)
def test_setup_lmcache_fails_clearly(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": str(tmp_path / "no-python"),
        "KVSTORE_LMCACHE_VENV": str(tmp_path / "v"),
    }
    proc = subprocess.run(
        ["bash", str(BENCH / "peers" / "setup_lmcache.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode != 0
    assert "setup_lmcache: FAILED" in proc.stderr
