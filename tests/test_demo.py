"""``kvstore demo`` as a user runs it: what memory it needs at its peak, where it writes its
disk tier, a last line that names only a directory that is still there, a summary whose
figures add up, Ctrl-C (one line, the same clean-up) and a disk too small for the cache (it
says what did not fit and why, and exits 1)."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

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
    check_the_counts_add_up(out)

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


def count(pattern: str, text: str) -> int:
    """The number ``pattern``'s group matches in ``text``."""
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return int(found[1])


def check_the_counts_add_up(out: str) -> None:
    """The tiers' block counts, the copies and the chunks of the summary add up (issue 50:
    "host 14 + disk 138 blocks ... stored 146" said nothing of the chunks in both)."""
    tiers = {m[0]: int(m[1]) for m in re.findall(r"tier (\w+)\s*:\s*(\d+) blocks", out)}
    held = re.search(r"held at the end\s*: (.*)", out)
    assert held, out
    terms = " + ".join(f"{kind} {n}" for kind, n in tiers.items())
    copies = sum(tiers.values())
    stored = count(r"stored\s*: (\d+) chunks", out)
    expect = f"{terms} = {copies} copies of {stored} chunks"
    if copies > stored:
        expect += f" ({copies - stored} chunks are in both)"
    assert held[1] == expect, (held[1], expect)


def first_line(stream: IO[str] | None, starting: str, limit: int = 400) -> str:
    """Read ``stream`` line by line until one starts with ``starting``; that line."""
    assert stream is not None
    for _ in range(limit):
        line = stream.readline()
        assert line, f"the demo ended before printing {starting!r}"
        if line.startswith(starting):
            return line
    raise AssertionError(f"no {starting!r} in {limit} lines")


@pytest.mark.parametrize("where", ["scratch", "cache-dir"])
def test_ctrl_c_is_one_line_and_the_same_clean_up(tmp_path: Path, where: str) -> None:
    """SIGINT while the demo serves: exit 130, one line saying what was cleaned up (before:
    a 17-line traceback); the scratch directory removed, or the named one kept with the
    blocks the store held (its close still writes what memory held)."""
    env = _env(tmp_path)
    cache = tmp_path / "kept"
    args = ["--sessions", "4", "--turns", "4", "--layers", "8"]
    args += ["--cache-dir", str(cache)] if where == "cache-dir" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        first_line(proc.stderr, "requests [")  # it serves: the first request is done
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    said = [line for line in err.splitlines() if line.strip() and "requests [" not in line]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and out == "", err
    if where == "scratch":
        assert said == [
            "kvstore: demo interrupted (Ctrl-C): the store is closed and its scratch "
            "directory is removed"
        ], err
    else:
        assert said == [
            f"kvstore: demo interrupted (Ctrl-C): the store is closed and what was stored "
            f"stays in {cache}"
        ], err
        assert list(cache.rglob("*.kvb")), "the named directory keeps what was stored"
    for name in ("XDG_CACHE_HOME", "TMPDIR", "HOME"):
        assert sorted(Path(env[name]).iterdir()) == [], f"the demo left files in {name}"


def test_a_disk_too_small_for_the_cache_says_what_did_not_fit_and_exits_1(
    tmpfs: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """Issue 50: on a full disk the demo exited 0 with "close: writing 480 MiB ... wrote 160
    MiB", never saying the rest did not fit. 2 sessions x 2 turns of a 2-layer model store
    16 chunks of 2 MiB; a 20 MiB filesystem keeps fewer."""
    env = _env(tmp_path)
    cache = tmpfs("small", "20m") / "cache"
    args = [*SMALL, "--layers", "2", "--cache-dir", str(cache)]
    code, out, err, _ = _run_demo(args, env, tmp_path)
    assert code == 1, (out, err)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("kvstore: error:")]
    assert len(errors) == 1, err
    stored = count(r"stored\s*: (\d+) chunks", out)
    lost = stored - count(r"after a restart .* with (\d+) blocks on disk", out)
    assert lost > 0, out
    # What did not fit, where, why, and what to do: in the one error line ...
    assert f"{lost} of the {stored} chunks did not fit" in errors[0], errors[0]
    assert "its filesystem had" in errors[0] and "free" in errors[0], errors[0]
    assert "--cache-dir" in errors[0], errors[0]
    # ... in the summary (its figures agree) ...
    assert f"; {lost} of {stored} chunks did not fit" in _disk_line(out), out
    assert f"; {lost * 2}.00 MiB did not fit" in out, out
    # ... and in the close's own warning, which a server's log gets too.
    close = [line for line in err.splitlines() if line.startswith("close: ")]
    assert any(
        f"close: {lost * 2}.00 MiB did not fit in the disk tier ({cache}" in line
        and "it is full" in line
        for line in close
    ), err
    check_the_counts_add_up(out)
