"""The short form of the memory soak (``benchmarks/bench_soak.py``, issue 32): one
minute of mixed load at capacity on one store and one kvstore-server, sampled every
five seconds. Memory gets a loose bound (a short run still sees allocator warm-up);
counts must not move at all, and no byte may be wrong. A subscriber of the server's KV
events, restarted now and then, ends with exactly what the server holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_soak.py"


@pytest.mark.slow  # a minute of load and more
@pytest.mark.timeout(420)
def test_soak_short_keeps_memory_and_counts_flat() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--minutes",
            "1",
            "--warmup-minutes",
            "0.25",
            "--interval",
            "5",
            "--max-growth",
            "0.25",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.stdout.count("\n") == 1, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert proc.returncode == 0, (result["targets_missed"], result["examples"])
    assert result["errors"] == 0, result["examples"]
    assert result["wrong_bytes"] == 0, result["examples"]
    assert result["rss_growth"] <= 0.25
    for field in ("threads", "slots", "index", "pinned"):
        seen = [(s["t"], s["store"].get(field), s["server"].get(field)) for s in result["samples"]]
        assert result[f"{field}_growth"] == 0, (field, seen)
    # A socket of a killed client may close a moment late; 2 of ~24 fds at most.
    assert result["fds_growth"] <= 0.1, result["growth_by_process"]
    assert result["shared_growth"] <= 0.02, result["growth_by_process"]
    assert result["slots_unbacked_last"] == 0 and result["leases_live_last"] == 0
    assert result["samples_measured"] >= 6
    ops = result["ops"]
    for op in ("store.put", "store.prefetch", "store.put_layer", "store.lease", "client.get"):
        assert ops[f"ops.{op}"] > 0, op
    assert ops["store_restarts"] >= 1 and ops["clients_vanished"] >= 1
    assert ops["blocks_read.store.get"] > 0 and ops["blocks_read.client.get"] > 0
    events = {k: v for k, v in result.items() if k.startswith("events_")}
    for field in ("phantom", "missed", "wrong_medium", "unanswered"):
        assert result[f"events_{field}"] == 0, events
    assert result["events_blocks"] > 0 and ops["puts_with_tokens"] > 0, events
    assert result["events_view_restarts"] >= 1, events
