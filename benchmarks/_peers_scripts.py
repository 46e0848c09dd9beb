"""bench_peers.py's rows from the scripts that already drive a peer: vLLM's fs tier and LMCache.

- vLLM's own ``fs`` offloading tier vs kvstore's ``KVStoreTier``: ``bench_vllm_tier.py``,
  run with ``.venv-vllm``'s Python (``--vllm-python``), once per block size (chunks of 32
  and 1 MiB, ``rep_bytes`` each); its ``per_rep`` figures (store GB/s, cold load GB/s,
  lookups/s; the two tiers take turns within each repetition) give the rows.
- LMCache 0.5.6: ``bench_lmcache.py`` (it re-runs itself under ``.venv-lmcache``), once per
  block size (32 MiB chunks: 32 layers; 1 MiB: one layer of 256 tokens); its ``times``
  (every rep's seconds, interleaved rounds) give the rows: host put, get, first fill,
  disk get cold and warm, and lookup (512 keys; from the 32 MiB run).

Both scripts check the bytes they read back (vLLM's tier: every load; LMCache: both
sides after the rounds) and exit non-zero when a byte differs: that peer's rows fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _peer_procs import ROOT, say

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
BLOCKS_MIB = {"32MiB": 32, "1MiB": 1}


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a benchmark script; its JSON object, or ``{"status": "failed", ...}``."""
    say(" ".join(Path(c).name if c.endswith(".py") else c for c in cmd[1:]))
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s: {cmd}"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    if proc.returncode != 0 or not isinstance(result, dict):
        why = f"exit status {proc.returncode}" if proc.returncode else "no JSON on stdout"
        return {"status": "failed", "error": f"{why}:\n{proc.stderr[-3000:]}"}
    if result.get("skipped"):
        return {"status": "skipped", "reason": str(result.get("reason") or result["skipped"])}
    return {"status": "ok", "result": result}


# -- vLLM's fs tier ----------------------------------------------------------------------------
def vllm_args(size: str, rep_bytes: int, reps: int) -> list[str]:
    """bench_vllm_tier.py's arguments for one block size (no S3 figures)."""
    mib = BLOCKS_MIB[size]
    chunks = max(2, rep_bytes // (mib * MiB))
    return [
        "--json",
        "--chunk-mib",
        str(mib),
        "--chunks",
        str(chunks),
        "--job-chunks",
        str(min(8, chunks)),
        "--reps",
        str(reps),
        "--moto-python",
        "",  # not a file: no S3 figures (vLLM's object tier needs NIXL anyway)
    ]


def run_vllm(python: Path, rep_bytes: int, reps: int, timeout: float) -> dict[str, Any]:
    """Per block size: bench_vllm_tier.py's result; or why the peer was skipped or failed."""
    if not python.exists():
        return {
            "status": "skipped",
            "reason": f"no vLLM venv ({python} does not exist): bash scripts/setup-vllm.sh",
        }
    script = str(HERE / "bench_vllm_tier.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    by_size: dict[str, Any] = {}
    for size in BLOCKS_MIB:
        out = run_json([str(python), script, *vllm_args(size, rep_bytes, reps)], timeout, env)
        if out["status"] != "ok":
            return out
        by_size[size] = out["result"]
    return {"status": "ok", "by_size": by_size}


def vllm_samples(result: dict[str, Any], metric: str) -> dict[str, list[float]]:
    """Per side (kvstore, peer): ``metric`` per repetition."""
    reps = result["per_rep"]
    return {
        "kvstore": [r[metric] for r in reps["kvstore_disk"]],
        "peer": [r[metric] for r in reps["vllm_fs"]],
    }


# -- LMCache -----------------------------------------------------------------------------------
def lmcache_args(size: str, rep_bytes: int, rounds: int, quick: bool) -> list[str]:
    """bench_lmcache.py's arguments for one block size."""
    layers, mib = (32, 32) if size == "32MiB" else (1, 1)
    blocks = max(2, rep_bytes // (mib * MiB))
    capacity = max(256 * MiB, 4 * blocks * mib * MiB)
    args = ["--json", "--layers", str(layers), "--blocks", str(blocks)]
    args += [
        "--capacity",
        f"{capacity // MiB}MiB",
        "--first-fill-capacity",
        f"{capacity // MiB}MiB",
    ]
    args += ["--rounds", str(rounds)]
    return args + (["--quick"] if quick else [])


def run_lmcache(
    venv: Path, rep_bytes: int, rounds: int, quick: bool, timeout: float
) -> dict[str, Any]:
    """Per block size: bench_lmcache.py's result; or why the peer was skipped or failed."""
    script = str(HERE / "bench_lmcache.py")
    by_size: dict[str, Any] = {}
    for size in BLOCKS_MIB:
        args = lmcache_args(size, rep_bytes, rounds, quick)
        cmd = [sys.executable, script, *args, "--lmcache-venv", str(venv)]
        out = run_json(cmd, timeout, {**os.environ, "BENCH_LMCACHE_REEXEC": ""})
        if out["status"] != "ok":
            return out
        by_size[size] = out["result"]
    return {"status": "ok", "by_size": by_size}


#: (op, path, bench_lmcache.py's kvstore subject, its LMCache subject)
LMCACHE_ROWS = (
    ("put", "host", "kv_put", "lmc_put"),
    ("get", "host", "kv_get", "lmc_get"),
    ("first_fill", "host", "kv_first_fill", "lmc_first_fill"),
    ("get", "disk_cold", "kv_disk_cold", "lmc_disk_cold"),
    ("get", "disk_warm", "kv_disk_warm", "lmc_disk_warm"),
)


def lmcache_samples(result: dict[str, Any], kv: str, lmc: str) -> dict[str, list[float]]:
    """GB/s per rep of both sides of one row."""
    nbytes, times = result["bytes_per_rep"], result["times"]
    return {
        "kvstore": [nbytes / t / 1e9 for t in times[kv]],
        "peer": [nbytes / t / 1e9 for t in times[lmc]],
    }


def lmcache_lookup_samples(result: dict[str, Any]) -> dict[str, list[float]]:
    """Keys/s per rep: kvstore ``lookup`` vs LMCache's faster way (batched or a loop)."""
    keys, times = result["lookup_keys"], result["times"]
    batched, loop = times["lmc_lookup_batched"], times["lmc_lookup_loop"]
    theirs = batched if sorted(batched)[len(batched) // 2] <= sorted(loop)[len(loop) // 2] else loop
    return {"kvstore": [keys / t for t in times["kv_lookup"]], "peer": [keys / t for t in theirs]}
