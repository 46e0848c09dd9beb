"""kvstore as a secondary tier of vLLM's offloading connector, driven by vLLM's own
``TieringOffloadingManager`` (CPU primary) in .venv-vllm.

One run of tests/connectors/vllm_offload_driver.py (vLLM installed there) does every
scenario and prints its findings as JSON; each test checks one scenario. The S3
scenario runs moto's server from this venv (the engine venv has boto3, from
scripts/setup-vllm.sh, but no moto).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_venv import ROOT, VLLM_PYTHON, vllm_marks

pytestmark = vllm_marks(300)

DRIVER = Path(__file__).with_name("vllm_offload_driver.py")


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-offload")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    cmd = [str(VLLM_PYTHON), str(DRIVER), str(work)]
    try:
        import moto  # noqa: F401

        cmd += ["--moto-python", sys.executable]
    except ImportError:
        pass
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, result in out.items():
        assert "error" not in result, f"{name}: {result['error']}"
    return out


def test_store_cascades_and_load_promotes_the_same_bytes(findings: dict[str, Any]) -> None:
    r = findings["roundtrip"]
    assert r["store_jobs_ok"] == [True]
    assert r["events"] == [[False, "LOCAL", [1, 2, 3]]]
    assert r["lookups"] == ["HIT", "HIT", "HIT", "MISS"]
    assert r["equal"] == [True, True, True]


def test_each_kv_cache_groups_chunk_of_a_block_is_its_own(findings: dict[str, Any]) -> None:
    """A hybrid's blocks (attention KV and recurrent state groups of one block hash, as
    vLLM's offloading connector keys them): stored, found and loaded group by group."""
    r = findings["groups"]
    assert r["store_jobs_ok"] and all(r["store_jobs_ok"])
    assert r["lookups"] == ["HIT"] * 8 + ["MISS"]
    assert r["equal"] == [True] * 8


def test_metrics_reach_vllm_stats(findings: dict[str, Any]) -> None:
    stats = findings["roundtrip"]["stats"]
    label = "('KVStoreTier',)"
    assert stats[f"vllm:kv_offload_kvstore_write_bytes:{label}"] == 3 * 64 * 1024
    assert stats[f"vllm:kv_offload_kvstore_read_bytes:{label}"] == 3 * 64 * 1024
    assert stats[f"vllm:kv_offload_kvstore_lookup_hits:{label}"] == 3
    assert stats[f"vllm:kv_offload_kvstore_stored_blocks:{label}"] == 3
    assert stats["vllm:kv_offload_tiering_read_bytes:('1:KVStoreTier',)"] == 3 * 64 * 1024


def test_eviction_reports_removals_and_misses(findings: dict[str, Any]) -> None:
    r = findings["eviction"]
    stored = sorted(n for removed, _, keys in r["events"] if not removed for n in keys)
    dropped = sorted(n for removed, _, keys in r["events"] if removed for n in keys)
    assert stored == list(range(10, 18))
    assert dropped and set(dropped) < set(stored)
    hits = [n for n, res in zip(range(10, 18), r["lookups"], strict=True) if res == "HIT"]
    assert set(hits) == set(range(10, 18)) - set(dropped)
    assert all(res in ("HIT", "MISS") for res in r["lookups"])


def test_a_new_tier_on_the_same_directory_reloads(findings: dict[str, Any]) -> None:
    r = findings["restart"]
    assert r["lookups"] == ["HIT", "HIT"]
    assert r["equal"] == [True, True]


def test_a_corrupt_block_fails_its_job_and_is_not_loaded(findings: dict[str, Any]) -> None:
    r = findings["corrupt"]
    assert r["loads"] == [[False, [7]]]  # one job: 8 failed, 7 kept
    assert r["lookups"] == ["HIT", "MISS"]
    assert r["equal_good"] == [True]
    assert r["again"] == ["MISS"] and not r["file_left"]


def test_s3_fetch_and_s3_down(findings: dict[str, Any]) -> None:
    r = findings["s3"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["events"] == [[False, "REMOTE", [21, 22]]]
    assert r["dropped_local"] == 2
    assert r["fetch_lookups"] == ["HIT", "HIT"] and r["fetch_equal"] == [True, True]
    assert r["down_store_ok"] == [True]
    assert r["down_lookups"] == ["MISS", "MISS", "MISS"]
    assert r["down_seconds"] < 10
    assert not any(r["down_loads"])


def test_a_slow_remote_chunk_is_recomputed_and_warmed(findings: dict[str, Any]) -> None:
    r = findings["planned"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["dropped_local"] == 2
    # S3 declared at 1 KB/s and 5 s a call; 16 tokens recompute in 16 us: MISS at once
    assert r["planned_lookups"] == ["MISS", "MISS"] and r["planned_seconds"] < 5
    assert r["warmed"] == [True, True]  # the background fetch landed in host memory
    assert r["next_lookups"] == ["HIT", "HIT"] and r["next_equal"] == [True, True]
    assert r["restore"]["chunks_planned_recompute"] >= 1
    assert r["off_lookups"] == ["HIT"]  # planning off: the slow chunk is loaded
