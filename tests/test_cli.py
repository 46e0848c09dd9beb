"""The kvstore command: demo, stats, config, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_demo_small_run_reports_hits_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--sessions", "3", "--turns", "3", "--layers", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 9
    # Every request after the first shares the 2048-token system prompt (8 chunks).
    assert report["prefill_tokens_saved"] >= 8 * 8 * 256
    assert report["chunks_loaded_and_verified"] == report["prefill_tokens_saved"] // 256
    assert 0 < report["chunk_hit_rate"] <= 1
    assert [t["kind"] for t in report["tiers"]] == ["host", "disk"]
    # put/get throughput as the engine sees it; what close() wrote, and how fast
    assert report["put_gbps"] > 0 and report["get_gbps"] > 0
    assert report["put_seconds"] > 0 and report["get_seconds"] > 0
    nb = report["block_mib"] * 2**20
    host = report["tiers"][0]
    # close() writes the host tier's blocks that only memory held: whole blocks, at most all
    # of them (the demo's small host tier writes some back to disk ahead of eviction)
    assert report["close_flush_bytes"] % nb == 0
    assert report["close_flush_bytes"] <= host["blocks"] * nb
    assert report["close_flush_seconds"] <= report["close_seconds"]
    restart = report["after_restart"]  # reopened: everything is found again on disk
    assert restart["blocks_on_disk"] == report["chunks_stored"]
    assert restart["last_prompt_chunks_found"] == restart["last_prompt_chunks"] > 0
    assert restart["sessions_verified_from_disk"] == 3


def test_demo_with_a_cache_dir_hits_from_disk_on_the_second_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--sessions", "2", "--turns", "1", "--layers", "1", "--json"]
    assert main([*args, "--cache-dir", str(tmp_path)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*args, "--cache-dir", str(tmp_path)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["disk_path"] == second["disk_path"] == str(tmp_path)
    assert second["chunk_hit_rate"] == 1.0  # every chunk came back from the first run's disk
    assert second["chunks_stored"] == 0
    assert list(tmp_path.rglob("*.kvb"))


def test_demo_human_report(tmp_path: Path) -> None:
    result = run_cli("demo", "--sessions", "2", "--turns", "2", "--layers", "1")
    assert result.returncode == 0, result.stderr
    assert "prefill tokens saved" in result.stdout
    assert "tier host" in result.stdout
    assert "requests [" in result.stderr  # the progress bar
    # Not a terminal: close() says what it writes, and when it is done, in log lines.
    assert "close: writing" in result.stderr and "to the disk tier" in result.stderr
    assert "close: wrote" in result.stderr
    assert "close()" in result.stdout and "GB/s" in result.stdout


def test_config_prints_resolved_yaml(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: host\n    capacity: 1GiB\n")
    result = run_cli("config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert "capacity: 1073741824" in result.stdout


def test_bad_config_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: host\n    capacity: lots\n")
    result = run_cli("stats", "--config", str(path), "--layers", "1")
    assert result.returncode == 2
    assert "tiers[0].capacity" in result.stderr
    assert "Traceback" not in result.stderr


def test_stats_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: host\n    capacity: 64MiB\n")
    assert main(["stats", "--config", str(path), "--layers", "2", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    [store] = stats["stores"]
    assert store["blocks"] == 0
    assert store["tiers"][0]["capacity_blocks"] == 64 // 2  # 2 MiB blocks at 2 layers
    assert store["tiers"][0]["read_speed_source"] == "configured"
    assert stats["restore"]["planning"] is True and stats["restore"]["prefill_source"] == "unknown"
    assert main(["stats", "--config", str(path), "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "reads 10.00 GB/s, 0.01 ms a call (configured)" in out
    assert "restore planning on; prefill not known yet (every stored chunk loads) (unknown)" in out
    path.write_text(path.read_text() + "restore:\n  planning: off\n  prefill_tokens_per_s: 9000\n")
    assert main(["stats", "--config", str(path), "--layers", "2"]) == 0
    assert (
        "restore planning off (every stored chunk loads); prefill 9,000 tokens/s (configured)"
        in (capsys.readouterr().out)
    )
