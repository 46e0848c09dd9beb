"""Shared helpers for the benchmark scripts: interleaved timing rounds, medians, output.

Every figure a benchmark reports is a median over many repetitions, and a
subject and its baseline are timed in the same run, interleaved in rounds
(round i: a block of reps of each subject in turn), so machine noise hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The repository's root, on ``sys.path`` after everything else (an installed kvstore comes
#: first): the benchmarks import the harnesses of ``kvharness/``, kept out of the wheel.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

#: One repetition: does its own untimed setup and returns the seconds it timed.
Rep = Callable[[], float]


def log(msg: str) -> None:
    """Progress goes to stderr, so ``--json`` leaves stdout to the one JSON object."""
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Callable[[], object]) -> Rep:
    """A :data:`Rep` that times one whole call of ``fn``."""

    def rep() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return rep


def run_rounds(
    subjects: Mapping[str, tuple[Rep, int]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Time ``subjects`` (name -> (rep, reps per round)) interleaved in ``rounds`` rounds.

    Each round runs a block of reps of every subject in turn; odd rounds go in
    reverse order, so no subject always follows the same neighbour. Every
    subject first runs ``warmup`` untimed reps. Returns each rep's seconds.
    """
    for rep, _ in subjects.values():
        for _ in range(warmup):
            rep()
    order = list(subjects)
    times: dict[str, list[float]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            rep, k = subjects[name]
            gc.collect()
            times[name].extend(rep() for _ in range(k))
        if rounds >= 10 and (r + 1) % max(1, rounds // 5) == 0:
            log(f"  round {r + 1}/{rounds}")
    return times


def median(values: Sequence[float]) -> float:
    """The median (the only statistic the benchmarks report)."""
    return float(statistics.median(values))


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fast smoke run (< 20 s)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default: auto)")
    return parser


def environment() -> dict[str, Any]:
    """Where the figures came from."""
    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "kvstore_commit": _kvstore_commit(),
    }


def _kvstore_commit() -> str | None:
    """The checkout's commit, ``+dirty`` if kvstore/ has local changes (read-only git)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # never touch the index
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "kvstore"],
            cwd=root,
            env=env,
            capture_output=True,
            timeout=10,
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty == 1 else "")


def emit(result: Mapping[str, Any], as_json: bool, rows: Sequence[Sequence[object]]) -> None:
    """Print ``result`` as one JSON object, or ``rows`` (header first) as a table."""
    if as_json:
        print(json.dumps(result, sort_keys=False))
        return
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(cells[0]))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def drop_cache(paths: Sequence[Path]) -> None:
    """fsync ``paths`` and evict them from the page cache (so the next read hits the disk)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def wait_then_kill(proc: subprocess.Popen[Any], timeout: float | None) -> int | None:
    """``proc``'s exit status (None: still running after ``timeout`` seconds); then its
    whole process group is killed (it was started in a session of its own, so vLLM's
    engine and worker processes go with it)."""
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return rc
