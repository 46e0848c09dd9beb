"""A store left open, or closed from an ``atexit`` handler, still flushes what only
memory held: the next process finds every block on disk."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstore.cli.servers import S3Server

SCRIPT = """
import atexit, sys, torch
from kvstore import KVLayout, KVStore
layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                  dtype=torch.float16)
config = {{"tiers": [{{"kind": "host", "capacity": "64MiB"}}, {lower}]}}
store = KVStore(layout, config)
keys = store.hash_tokens(list(range(96)), namespace="m")
if sys.argv[1] == "check":
    print("found", store.lookup(keys))
    store.close()
else:
    store.put(keys, torch.randn(layout.tensor_shape(len(keys)), dtype=layout.dtype))
    if sys.argv[1] == "atexit":
        atexit.register(store.close)
    elif sys.argv[1] == "twice":
        store.close()
        store.close()
"""


def run(tmp_path: Path, how: str, lower: str = "") -> subprocess.CompletedProcess[str]:
    lower = lower or repr({"kind": "disk", "path": str(tmp_path / "kv"), "capacity": "256MiB"})
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(lower=lower)))
    return subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("how", ["left-open", "atexit", "twice"])
def test_what_memory_held_is_on_disk_for_the_next_process(tmp_path: Path, how: str) -> None:
    done = run(tmp_path, how)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert run(tmp_path, "check").stdout.split() == ["found", "6"]


def test_a_store_left_open_flushes_to_s3_at_exit(
    tmp_path: Path, s3_server: S3Server, aws_env: None
) -> None:
    """The S3 tier's pooled uploads run in the exiting thread too."""
    s3 = {
        "kind": "s3",
        "bucket": s3_server.bucket,
        "prefix": f"lifetimes-{tmp_path.name}",
        "endpoint_url": f"http://127.0.0.1:{s3_server.port}",
        "region": "us-east-1",
    }
    done = run(tmp_path, "left-open", repr(s3))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert run(tmp_path, "check", repr(s3)).stdout.split() == ["found", "6"]


FULL_DISK_SCRIPT = """
import sys, torch
from kvstore import KVLayout, KVStore
layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                  dtype=torch.float16)
config = {"tiers": [{"kind": "host", "capacity": "2MiB"},
                    {"kind": "disk", "path": sys.argv[1], "capacity": "4MiB"}]}
store = KVStore(layout, config)
chains = [store.hash_tokens(list(range(i, i + 64)), namespace="m") for i in range(40)]
if sys.argv[2] == "check":
    print("found", store.lookup(chains[-1]))
    store.close()
else:
    for keys in chains:
        store.put(keys, torch.randn(layout.tensor_shape(len(keys)), dtype=layout.dtype))
"""


def test_a_store_left_open_over_a_full_disk_tier_exits(tmp_path: Path) -> None:
    """The flush at exit fills the disk tier past its watermark, which queues an
    eviction after the interpreter has shut thread pools down: the eviction runs in
    the exiting thread, and the process ends (it used to hang, the flush cut short)."""
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(FULL_DISK_SCRIPT))
    disk = str(tmp_path / "kv")
    done = subprocess.run(
        [sys.executable, str(script), disk, "put"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    check = subprocess.run(
        [sys.executable, str(script), disk, "check"], capture_output=True, text=True, timeout=120
    )
    assert check.stdout.split() == ["found", "4"], check.stderr
