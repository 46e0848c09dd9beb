"""Disk tier under kill -9 and shared between processes: only whole, verified blocks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvharness import child_env
from kvharness.workers import WORKER_LAYOUT, block_for, key_for
from kvstore.config import DiskTierConfig
from kvstore.store import KVStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.files import TMP_SUFFIX


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvharness.workers", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),  # the harness is not installed: the child finds it there
    )


def wait_for(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == word, proc.stderr.read() if proc.stderr else line


def test_kill_9_at_random_moments_leaves_only_whole_blocks(tmp_path: Path) -> None:
    layout = WORKER_LAYOUT
    expected = {key_for(i): block_for(layout, i) for i in range(48)}
    rng = random.Random(7)
    seen_blocks = swept = 0
    zygote = spawn("zygote")
    wait_for(zygote, "ready")
    assert zygote.stdin is not None and zygote.stdout is not None
    try:
        round_ = 0
        # At least 20 kills; on a loaded machine keep going (up to 60) until one has
        # landed in the middle of a write, or the test would prove nothing.
        while round_ < 20 or (swept == 0 and round_ < 60):
            round_ += 1
            zygote.stdin.write(f"churn {tmp_path}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.3))
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"reap {pid}\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            found, temps = check_directory(tmp_path, expected, round_)
            seen_blocks += found
            swept += temps
    finally:
        zygote.kill()
        zygote.wait(timeout=30)
    assert seen_blocks > 0
    assert swept > 0, "no kill landed mid-write: the test proved nothing about atomicity"


def check_directory(
    path: Path, expected: dict[bytes, torch.Tensor], round_: int
) -> tuple[int, int]:
    """Reopen the directory as a restarted process would; verify all it holds.

    Returns the blocks found and the dead writer's temp files swept away.
    """
    layout = WORKER_LAYOUT
    tier = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 30), layout)
    keys = list(tier.stored_keys())
    outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in keys]
    assert tier.get(keys, outs) == [True] * len(keys), f"round {round_}: unreadable block"
    for key, out in zip(keys, outs, strict=True):
        assert torch.equal(out, expected[key]), f"round {round_}: wrong bytes"
    assert tier.stats().get("corrupt", 0) == 0  # no half-written block was ever visible
    temps = list(tier.path.rglob(f"*{TMP_SUFFIX}"))
    assert temps == [], "temp files of the dead writer were not cleaned up"
    swept = tier.stats().get("stale_temps_removed", 0)
    tier.close()
    return len(keys), swept


def test_one_writer_many_readers_see_only_whole_blocks(tmp_path: Path) -> None:
    layout = WORKER_LAYOUT
    count = 12
    keys = [key_for(i) for i in range(count)]
    blocks = [block_for(layout, i) for i in range(count)]
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "1GiB"}]}
    readers = [KVStore(layout, config) for _ in range(2)]  # opened before any block exists
    writer = spawn("write", str(tmp_path), str(count))
    try:
        wait_for(writer, "wrote")  # the writer now rewrites and deletes blocks in a loop
        step = layout.block_tokens
        hits = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for reader in readers:
                out = torch.empty(layout.tensor_shape(count), dtype=layout.dtype)
                n = reader.get_prefix(keys, out)
                for i in range(n):
                    assert torch.equal(out[:, :, i * step : (i + 1) * step], blocks[i])
                hits += n
        assert hits > 0  # the readers found blocks written after they opened
        for reader in readers:
            disk = reader.stats()["tiers"][0]
            assert disk.get("corrupt", 0) == 0
    finally:
        writer.kill()
        writer.wait(timeout=30)
        for reader in readers:
            reader.close()
