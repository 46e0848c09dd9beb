"""Smoke tests of ``benchmarks/bench_gpu_model.py`` (TTFT on a Llama architecture).

The CPU smoke mode (``--device cpu --tiny``) runs the whole benchmark on a small random
Llama: a hit from a host tier and from a disk tier must reproduce the oracle's logits
bit for bit, and the layerwise saves must store every chunk. It needs a Python with
transformers >= 5: ``$BENCH_TRANSFORMERS_PYTHON`` (not a ``KVSTORE_*`` name: conftest
clears those), this one, ``.venv`` or ``.venv-vllm``, whichever has it first. No timing
assertions (the machines are noisy).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gpu_model.py"
LENGTHS = (200, 512)  # 200: a prompt that is not a whole number of chunks
TINY_BLOCK_TOKENS = 32
# Prints the transformers major version if this Python can run the benchmark.
PROBE = "import torch, kvstore, transformers; print(transformers.__version__.split('.')[0])"


def _env() -> dict[str, str]:
    """The repository first on the path, so kvstore imports in any of the virtualenvs."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@functools.cache
def transformers_python() -> str | None:
    """The first Python that has torch, kvstore and transformers >= 5, or None."""
    candidates = [
        os.environ.get("BENCH_TRANSFORMERS_PYTHON"),
        sys.executable,
        str(ROOT / ".venv" / "bin" / "python"),
        str(ROOT / ".venv-vllm" / "bin" / "python"),
    ]
    for python in candidates:
        if not python or not Path(python).exists():
            continue
        try:
            proc = subprocess.run(
                [python, "-c", PROBE], env=_env(), capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0 and proc.stdout.strip().isdigit() and int(proc.stdout) >= 5:
            return python
    return None


def run_bench(python: str, *args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """Run the benchmark; return the one JSON object it prints, and its stdout."""
    proc = subprocess.run(
        [python, str(SCRIPT), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"bench_gpu_model.py failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("\n") == 1, f"not exactly one line on stdout:\n{proc.stdout[:2000]}"
    result = json.loads(proc.stdout)
    assert isinstance(result, dict), result
    return result, proc.stdout


def check_hit(row: dict[str, Any], tier: str) -> None:
    """The hit from ``tier`` reproduced the oracle exactly (informational fields present)."""
    check = row[tier]
    assert check["logits_max_abs_diff_vs_oracle"] == 0.0, (tier, check)
    assert check["greedy_match_oracle"] is True, (tier, check)
    assert check["greedy_tokens"] == row["greedy_tokens_oracle"], (tier, check)
    assert len(check["greedy_tokens"]) == 16
    assert isinstance(check["greedy_match_full"], bool)
    assert check["logits_max_abs_diff_vs_full"] >= 0.0


def check_planned(row: dict[str, Any]) -> None:
    """The planned restore loaded what its plan said and gave the right logits; the
    warming its turns queued brought every chunk to host memory, and the next turn then
    reproduced the oracle exactly."""
    plan, load = row["plan"], row["planned_load_chunks"]
    assert plan["stored"] == row["prefix_blocks"] and 0 <= load <= row["prefix_blocks"], plan
    assert plan["load"] == load and row["planned_prefill_tokens_per_s"] > 0
    if load in (0, row["prefix_blocks"]):  # all recomputed (the full prefill's) or all loaded
        assert row["planned_check"]["logits_max_abs_diff"] == 0.0, row["planned_check"]
    assert row["ttft_planned_disk_ms"] > 0 and row["planned_vs_best"] > 0
    # Warmed to host memory within the benchmark's turns (one where the first plan left
    # chunks on disk; up to three where it loaded them all from there).
    turns = [row.get(f"turn_{n}_plan") for n in (1, 2, 3)]
    assert row["turns_to_host"] in (1, 2, 3), (row["warmed_s"], turns)
    assert row["next_turn_plan"]["load"] == row["prefix_blocks"], row["next_turn_plan"]
    assert row["next_turn"]["logits_max_abs_diff_vs_oracle"] == 0.0, row["next_turn"]
    assert row["next_turn"]["greedy_tokens"] == row["greedy_tokens_oracle"]
    assert row["ttft_next_turn_ms"] > 0


@pytest.mark.engine  # transformers >= 5: here only .venv-vllm has it
@pytest.mark.timeout(300)
def test_bench_gpu_model_cpu_smoke(tmp_path: Path) -> None:
    python = transformers_python()
    if python is None:
        pytest.skip(
            "no Python with transformers >= 5 (set BENCH_TRANSFORMERS_PYTHON, or run "
            "`bash scripts/setup-vllm.sh` for .venv-vllm)"
        )
    out = tmp_path / "result.json"
    args = ["--device", "cpu", "--tiny", "--repeats", "1", "--no-drop-cache"]
    args += ["--lengths", ",".join(map(str, LENGTHS)), "--disk-dir", str(tmp_path)]
    result, stdout = run_bench(python, *args, "--out", str(out), timeout=270)
    assert "skipped" not in result, result
    assert "error" not in result, result["error"]
    assert out.read_text() == stdout  # --out writes the same line
    assert result["block_tokens"] == TINY_BLOCK_TOKENS
    assert set(result["lengths"]) == {str(n) for n in LENGTHS}
    for total in LENGTHS:
        row = result["lengths"][str(total)]
        assert "error" not in row, row["error"]
        prefix = (total - 1) // TINY_BLOCK_TOKENS * TINY_BLOCK_TOKENS
        assert (row["prefix_tokens"], row["suffix_tokens"]) == (prefix, total - prefix)
        assert row["prefix_blocks"] == prefix // TINY_BLOCK_TOKENS
        check_hit(row, "host")
        check_hit(row, "disk")
        # The layerwise saves stored every chunk, and the right bytes.
        assert row["saved_blocks_found"] == row["prefix_blocks"]
        assert row["saved_kv_equal_reference"] is True
        for name in ("ttft_full_ms", "ttft_hit_host_ms", "ttft_hit_disk_ms", "save_overhead"):
            assert row[name] > 0, (name, row[name])
        assert row["disk_raw_read_bytes"] >= row["prefix_kv_bytes"]
        assert row["disk_cache_dropped"] is False  # --no-drop-cache
        check_planned(row)
    assert result["pass"]["greedy_identical"] is True
    assert result["pass"]["logits_exact"] is True
    assert result["pass"]["next_turn_exact"] is True
    assert result["pass"]["hit_speedup_host"] is None  # 16K tokens not measured


@pytest.mark.timeout(120)
def test_bench_gpu_model_skips_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run for real")
    result, _ = run_bench(sys.executable, "--lengths", "4096", timeout=100)
    assert result["skipped"] is True
    assert isinstance(result["reason"], str) and result["reason"]
