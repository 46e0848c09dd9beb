"""``kvstore demo`` as a user runs it: what memory it needs at its peak, where it writes its
disk tier, and a last line that names only a directory that is still there."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

# The README promises the demo fits in 2 GB of memory; a run of the default KV geometry
# (Llama-3-8B, 32 MiB chunks) must stay under it. Before the host tier was sized to the demo,
# 2 sessions x 2 turns took 4.4 GB (the default 4 GiB host tier, committed at open).
PEAK_RSS_BOUND = 2_000_000_000
SMALL = ["--sessions", "2", "--turns", "2"]


def _env(tmp_path: Path) -> dict[str, str]:
    """HOME, the XDG cache and TMPDIR under ``tmp_path``: the demo's writes land there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    for name, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "xdg-cache"), ("TMPDIR", "tmp")):
        path = tmp_path / sub
        path.mkdir()
        env[name] = str(path)
    return env


def _run_demo(
    args: list[str], env: dict[str, str], out: Path
) -> tuple[int, str, str, resource.struct_rusage]:
    """Run ``kvstore demo ARGS`` (as ``python -m kvstore.cli``); its exit code, stdout,
    stderr and its own rusage (wait4 on its pid: not the maximum over every child this
    test process ever had)."""
    stdout, stderr = out / "demo.out", out / "demo.err"
    with stdout.open("w") as so, stderr.open("w") as se:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "demo", *args],
            stdout=so,
            stderr=se,
            env=env,
            cwd=out,
        )
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            proc.returncode = -1  # reaped above: Popen must not wait for it again
    return os.waitstatus_to_exitcode(status), stdout.read_text(), stderr.read_text(), usage


def _disk_line(report: str) -> str:
    lines = [line for line in report.splitlines() if line.strip().startswith("disk tier ")]
    assert len(lines) == 1, report
    return lines[0]


def test_demo_fits_in_2_gb_and_says_its_scratch_directory_is_gone(tmp_path: Path) -> None:
    env = _env(tmp_path)
    code, out, err, usage = _run_demo(SMALL, env, tmp_path)
    assert code == 0, err
    assert "KV 32 MiB per 256-token chunk" in out, out  # the default geometry
    peak = usage.ru_maxrss * 1024  # KiB on Linux
    assert peak < PEAK_RSS_BOUND, f"the demo peaked at {peak / 1e9:.2f} GB"
    # The host tier commits its whole capacity in the background from the moment it opens
    # (prefault), so a short run may end before it has: its capacity is what the demo needs
    # at its peak, 16 chunks here, whatever this run's timing.
    host = [line for line in out.splitlines() if line.strip().startswith("tier host")]
    assert len(host) == 1 and "of 512.00 MiB," in host[0], out

    # The disk tier was a scratch directory beside the user's cache (a disk, not /tmp),
    # removed at the end: the last line says so, and names no directory as if it were there.
    line = _disk_line(out)
    assert f"in a scratch directory under {env['XDG_CACHE_HOME']}, now removed" in line, line
    assert "--cache-dir" in line
    for name in ("XDG_CACHE_HOME", "TMPDIR", "HOME"):
        assert sorted(Path(env[name]).iterdir()) == [], f"the demo left files in {name}"


def test_demo_with_a_cache_dir_names_the_directory_it_kept(tmp_path: Path) -> None:
    env = _env(tmp_path)
    cache = tmp_path / "kept"
    args = [*SMALL, "--layers", "2", "--cache-dir", str(cache)]
    code, out, err, _ = _run_demo(args, env, tmp_path)
    assert code == 0, err
    line = _disk_line(out)
    assert f"in {cache} (kept" in line, line
    assert list(cache.rglob("*.kvb")), "the named directory holds the blocks"
