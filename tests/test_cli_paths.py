"""The command line over tiers that cannot work as configured: one line, a non-zero exit.

Each case runs ``kvstore`` as a process against real parts: a disk path under a
regular file, a read-only tmpfs mount (where this machine lets the tests mount one),
moto's S3 without the bucket, refusing our credentials, or with no credentials at
all, and ``redis-server --requirepass``. A mistake is ``kvstore: error: ...`` and exit
2 with nothing written, from ``kvstore stats``, ``kvstore demo`` and ``kvstore server``
(which checks its tiers at start, before any client opens a store); a disk tier that
can be read but not written is marked in ``kvstore stats``, which then exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvharness.mounts import remount_read_only
from kvstore.cli.servers import RedisServer, S3Server, free_port

#: A small layout for ``kvstore stats`` (a 16 KiB chunk), so tiny capacities fit.
LAYOUT_ARGS = ["--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--block-tokens", "32"]
HOST = {"kind": "host", "capacity": "1MiB"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def write_config(path: Path, *tiers: dict[str, Any], **sections: Any) -> str:
    path.write_text(yaml.safe_dump({"tiers": [HOST, *tiers], **sections}))
    return str(path)


def stats(config: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("stats", "--config", config, *LAYOUT_ARGS, *extra)


def one_error_line(result: subprocess.CompletedProcess[str], prog: str = "kvstore") -> str:
    """The run failed with exit 2 and said why in exactly one line, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# -- a disk path under a regular file ------------------------------------------------------------
@pytest.fixture
def under_a_file(tmp_path: Path) -> Path:
    """``<tmp>/hostname/kv``: a disk path whose parent is a regular file."""
    (tmp_path / "hostname").write_text("box\n")
    return tmp_path / "hostname" / "kv"


def test_stats_on_a_disk_path_under_a_file(tmp_path: Path, under_a_file: Path) -> None:
    config = write_config(
        tmp_path / "x.yaml", {"kind": "disk", "path": str(under_a_file), "capacity": "1MiB"}
    )
    before = tree(tmp_path)
    line = one_error_line(stats(config))
    assert f"disk tier path {under_a_file}: {under_a_file.parent} is a file" in line
    assert tree(tmp_path) == before


def test_demo_with_a_cache_dir_under_a_file(tmp_path: Path, under_a_file: Path) -> None:
    before = tree(tmp_path)
    args = ["--sessions", "1", "--turns", "1", "--layers", "2", "--cache-dir", str(under_a_file)]
    line = one_error_line(run_cli("demo", *args))
    assert f"{under_a_file.parent} is a file, not a directory" in line
    assert tree(tmp_path) == before


def test_server_refuses_to_start_on_a_disk_path_under_a_file(
    tmp_path: Path, under_a_file: Path
) -> None:
    config = write_config(
        tmp_path / "server.yaml",
        {"kind": "disk", "path": str(under_a_file), "capacity": "1MiB"},
        server={"listen": f"127.0.0.1:{free_port()}"},
    )
    before = tree(tmp_path)
    line = one_error_line(run_cli("server", "--config", config), prog="kvstore-server")
    assert f"disk tier path {under_a_file}: {under_a_file.parent} is a file" in line
    assert tree(tmp_path) == before


# -- a read-only disk path -----------------------------------------------------------------------
@pytest.fixture
def mount(tmpfs: Callable[[str, str], Path]) -> Path:
    return tmpfs("mnt", "4m")


def test_stats_marks_a_read_only_disk_tier_and_exits_1(tmp_path: Path, mount: Path) -> None:
    config = write_config(
        tmp_path / "ro.yaml", {"kind": "disk", "path": str(mount), "capacity": "1MiB"}
    )
    assert stats(config).returncode == 0  # writable: all is well
    remount_read_only(mount)
    result = stats(config)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    disk_line = next(x for x in result.stdout.splitlines() if x.startswith("  disk "))
    assert "[READ-ONLY]" in disk_line
    errors = [x for x in result.stderr.splitlines() if x.startswith("kvstore: error:")]
    assert len(errors) == 1
    assert f"tier disk ({mount}) is read-only (Read-only file system): it serves" in errors[0]
    as_json = stats(config, "--json")
    assert as_json.returncode == 1
    tiers = [t for s in json.loads(as_json.stdout)["stores"] for t in s["tiers"]]
    disk = next(t for t in tiers if t["kind"] == "disk")
    assert disk["writable"] is False and disk["write_error"] == "Read-only file system"


def test_stats_on_a_read_only_mount_without_the_directory(tmp_path: Path, mount: Path) -> None:
    remount_read_only(mount)
    config = write_config(
        tmp_path / "ro.yaml", {"kind": "disk", "path": str(mount / "kv"), "capacity": "1MiB"}
    )
    line = one_error_line(stats(config))
    assert f"disk tier path {mount / 'kv'}: cannot create it: Read-only file system" in line


# -- S3 and Redis: the demo and the server open them -------------------------------------------
def demo(config: str) -> subprocess.CompletedProcess[str]:
    return run_cli("demo", "--config", config, "--sessions", "1", "--turns", "1", "--layers", "2")


def server(config: str) -> str:
    """``kvstore server`` refused to start: the last line of what it said (its log's INFO
    lines may come before it), exit 2, no traceback."""
    result = run_cli("server", "--config", config)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstore-server: error: ")
    return last


def remote_config(path: Path, tier: dict[str, Any]) -> str:
    host = {"kind": "host", "capacity": "64MiB"}  # a chunk of the demo's 2 layers fits
    listen = {"listen": f"127.0.0.1:{free_port()}"}
    path.write_text(yaml.safe_dump({"tiers": [host, tier], "server": listen}))
    return str(path)


def s3_tier(server: S3Server, bucket: str | None = None) -> dict[str, Any]:
    return {
        "kind": "s3",
        "bucket": bucket or server.bucket,
        "prefix": f"cli-{uuid.uuid4().hex[:12]}",
        "endpoint_url": server.url,
        "region": "us-east-1",
        "deadline": 3.0,
    }


def test_a_missing_bucket(tmp_path: Path, s3_server: S3Server, aws_env: None) -> None:
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    config = remote_config(tmp_path / "s3.yaml", s3_tier(s3_server, bucket))
    says = f"bucket {bucket!r} at {s3_server.url} does not exist"
    assert says in one_error_line(demo(config))
    assert says in server(config)
    buckets = [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    assert bucket not in buckets


def test_refused_credentials(tmp_path: Path, aws_env: None) -> None:
    with S3Server(mode="process", refuse_credentials=True) as refusing:
        config = remote_config(tmp_path / "s3.yaml", s3_tier(refusing))
        says = f"bucket {refusing.bucket!r} at {refusing.url} refused the credentials"
        assert says in one_error_line(demo(config))
        assert says in server(config)


def test_no_credentials(
    tmp_path: Path, s3_server: S3Server, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    config = remote_config(tmp_path / "s3.yaml", s3_tier(s3_server))
    says = f"no AWS credentials found for bucket {s3_server.bucket!r} at {s3_server.url}"
    assert says in one_error_line(demo(config))
    assert says in server(config)


def test_a_wrong_redis_password(tmp_path: Path) -> None:
    with RedisServer(extra_args=["--requirepass", "the-right-one-0123"]) as redis:
        url = f"redis://:not-it@127.0.0.1:{redis.port}/0"
        config = remote_config(tmp_path / "r.yaml", {"kind": "redis", "url": url})
        says = f"redis://:***@127.0.0.1:{redis.port}/0 refused the credentials"
        assert says in one_error_line(demo(config))
        assert says in server(config)
