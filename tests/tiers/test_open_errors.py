"""Mistakes a store finds when it opens: one clear error naming the thing, nothing written.

Everything is real: a disk path under a regular file, a read-only tmpfs mount (where
this machine lets the tests mount one), moto's S3 with a bucket that does not exist,
with its credential checks on (so it refuses ours) or with no credentials at all, and
``redis-server --requirepass``. One fault is injected (EROFS on creating files, for
machines that cannot mount). What is an outage rather than a mistake -- an endpoint or
a Redis that does not answer -- opens, as docs/operations.md says, and shows as
unavailable.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharness.mounts import remount_read_only
from kvstore import ConfigError, KVLayout, KVStore, TierError
from kvstore.cli.servers import DUMMY_AWS_ENV, RedisServer, S3Server, free_port
from kvstore.config import DiskTierConfig
from kvstore.testing.data import random_blocks, small_layout
from kvstore.testing.faults import FaultyFileOps
from kvstore.tiers.disk import DiskTier

PASSWORD = "right-password-for-the-test"


def disk_tier(path: Path, layout: KVLayout) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity": 8 * (layout.block_nbytes + 4096)}


def host_and(layout: KVLayout, tier: dict[str, Any]) -> dict[str, Any]:
    return {"tiers": [{"kind": "host", "capacity": 4 * layout.block_nbytes}, tier]}


def tree(path: Path) -> list[str]:
    """Every path under ``path`` (what a failed open must leave as it was)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def put_some(store: KVStore, n: int, salt: int = 0) -> tuple[list[bytes], torch.Tensor]:
    layout = store.layout
    tokens = torch.arange(salt * 10_000, salt * 10_000 + n * layout.block_tokens)
    keys, kv = store.hash_tokens(tokens, "open-errors"), random_blocks(layout, n, seed=salt)
    return keys, kv


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvstore") and r.levelno >= logging.WARNING
    ]


def new_threads(before: set[threading.Thread], timeout: float = 2.0) -> set[threading.Thread]:
    """Threads started since ``before`` that are still alive after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        alive = {t for t in threading.enumerate() if t not in before and t.is_alive()}
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.02)


# -- disk ----------------------------------------------------------------------------------------
@pytest.fixture
def read_only_fs(tmpfs: Callable[[str, str], Path]) -> Path:
    """A real tmpfs, mounted read-write; ``remount_read_only(path)`` makes it read-only."""
    return tmpfs("mnt", "4m")


def test_disk_path_under_a_regular_file_is_one_config_error(tmp_path: Path) -> None:
    layout = small_layout()
    afile = tmp_path / "hostname"
    afile.write_text("not a directory\n")
    before = tree(tmp_path)
    with pytest.raises(ConfigError) as caught:
        KVStore(layout, host_and(layout, disk_tier(afile / "kv", layout)))
    message = str(caught.value)
    assert "\n" not in message
    assert f"disk tier path {afile / 'kv'}" in message
    assert f"{afile} is a file, not a directory" in message
    assert tree(tmp_path) == before and afile.read_text() == "not a directory\n"


def test_disk_path_that_cannot_be_created_on_a_read_only_mount(read_only_fs: Path) -> None:
    layout = small_layout()
    remount_read_only(read_only_fs)
    with pytest.raises(ConfigError, match="cannot create it: Read-only file system"):
        KVStore(layout, host_and(layout, disk_tier(read_only_fs / "kv", layout)))
    assert tree(read_only_fs) == []


def test_read_only_directory_opens_read_only_and_says_so(
    read_only_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = small_layout()
    config = DiskTierConfig(path=str(read_only_fs), capacity=8 * (layout.block_nbytes + 4096))
    with KVStore(layout, tiers=[DiskTier(config, layout)]) as store:
        keys, kv = put_some(store, 3)
        assert store.put(keys[:2], kv[:, :, : 2 * layout.block_tokens]) == 2
        assert store.stats()["tiers"][0]["writable"] is True
    remount_read_only(read_only_fs)
    caplog.set_level(logging.WARNING)
    with KVStore(layout, tiers=[DiskTier(config, layout)]) as store:
        disk = store.stats()["tiers"][0]
        assert disk["writable"] is False and disk["write_error"] == "Read-only file system"
        assert torch.equal(store.get(keys[:2]), kv[:, :, : 2 * layout.block_tokens])
        for _ in range(3):  # stores nothing, and does not say so once per block
            assert store.put(keys[2:], kv[:, :, 2 * layout.block_tokens :]) == 0
    warnings = our_warnings(caplog)
    assert len([w for w in warnings if "cannot write" in w]) == 1, warnings


def test_directory_refusing_writes_at_open_is_marked_until_a_write_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = small_layout()
    ops = FaultyFileOps()
    ops.fail["open"], ops.only = errno.EROFS, ".tmp"  # creating files fails, reading works
    config = DiskTierConfig(path=str(tmp_path), capacity=8 * (layout.block_nbytes + 4096))
    caplog.set_level(logging.WARNING)
    with KVStore(layout, tiers=[DiskTier(config, layout, ops)]) as store:
        assert store.stats()["tiers"][0]["writable"] is False
        keys, kv = put_some(store, 2)
        assert store.put(keys, kv) == 0
        assert store.put(keys, kv) == 0
        assert len(our_warnings(caplog)) == 1, our_warnings(caplog)  # said once, at open
        del ops.fail["open"]  # remounted read-write
        assert store.put(keys, kv) == 2
        assert store.stats()["tiers"][0]["writable"] is True
        assert torch.equal(store.get(keys), kv)


# -- S3 ------------------------------------------------------------------------------------------
def s3_tier(server: S3Server, bucket: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "s3",
        "bucket": bucket or server.bucket,
        "prefix": f"open-{uuid.uuid4().hex[:12]}",
        "endpoint_url": server.url,
        "region": "us-east-1",
        "connect_timeout": 1.0,
        "read_timeout": 2.0,
        "deadline": 3.0,
        **extra,
    }


@pytest.fixture(scope="module")
def refusing_s3() -> Iterator[S3Server]:
    """moto with its credential checks on: the bucket exists, our credentials do not."""
    with S3Server(mode="process", refuse_credentials=True) as server:
        yield server


def test_missing_bucket_fails_the_open_naming_bucket_and_endpoint(
    s3_server: S3Server, aws_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    layout = small_layout()
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    before = set(threading.enumerate())
    caplog.set_level(logging.WARNING)
    with pytest.raises(TierError) as caught:
        KVStore(layout, host_and(layout, s3_tier(s3_server, bucket)))
    message = str(caught.value)
    assert "\n" not in message
    assert f"bucket {bucket!r} at {s3_server.url} does not exist" in message
    assert our_warnings(caplog) == []  # the error is the one line
    buckets = [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    assert bucket not in buckets  # nothing made, nothing written
    assert new_threads(before) == set()  # the tier's pool went with it


def test_refused_credentials_fail_the_open(refusing_s3: S3Server, aws_env: None) -> None:
    layout = small_layout()
    with pytest.raises(TierError) as caught:
        KVStore(layout, host_and(layout, s3_tier(refusing_s3)))
    message = str(caught.value)
    assert f"bucket {refusing_s3.bucket!r} at {refusing_s3.url}" in message
    assert "refused the credentials (InvalidAccessKeyId)" in message
    for value in DUMMY_AWS_ENV.values():
        if value.startswith("kvstore-test"):
            assert value not in message


def test_missing_credentials_fail_the_open(
    s3_server: S3Server, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    layout = small_layout()
    with pytest.raises(TierError) as caught:
        KVStore(layout, host_and(layout, s3_tier(s3_server)))
    message = str(caught.value)
    assert f"no AWS credentials found for bucket {s3_server.bucket!r} at {s3_server.url}" in message


def test_unreachable_endpoint_opens_and_shows_unavailable(
    s3_server: S3Server, aws_env: None
) -> None:
    layout = small_layout()
    down = {**s3_tier(s3_server), "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    down["max_attempts"] = 2
    with KVStore(layout, host_and(layout, down)) as store:  # an outage, not a mistake
        assert store.stats()["tiers"][1]["available"] is False
        keys, kv = put_some(store, 1)
        assert store.put(keys, kv) == 1  # the host tier serves
        assert torch.equal(store.get(keys), kv)


# -- Redis ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def locked_redis() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--requirepass", PASSWORD]) as server:
        yield server


@pytest.mark.parametrize(
    ("password", "says"),
    [
        (None, "wants a password and the tier's url has none"),
        ("wrong-password", "refused the credentials"),
    ],
)
def test_redis_refusing_the_password_fails_the_open(
    locked_redis: RedisServer, password: str | None, says: str
) -> None:
    layout = small_layout()
    auth = "" if password is None else f":{password}@"
    url = f"redis://{auth}127.0.0.1:{locked_redis.port}/0"
    with pytest.raises(TierError) as caught:
        KVStore(layout, host_and(layout, {"kind": "redis", "url": url}))
    message = str(caught.value)
    assert says in message and f"127.0.0.1:{locked_redis.port}" in message
    assert "wrong-password" not in message  # the url is shown redacted


def test_redis_with_the_right_password_opens(locked_redis: RedisServer) -> None:
    layout = small_layout()
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked_redis.port}/0"
    with KVStore(layout, host_and(layout, {"kind": "redis", "url": url})) as store:
        assert store.stats()["tiers"][1]["available"] is True


def test_redis_down_at_open_opens_and_shows_unavailable() -> None:
    layout = small_layout()
    url = f"redis://127.0.0.1:{free_port()}/0"
    with KVStore(layout, host_and(layout, {"kind": "redis", "url": url})) as store:
        assert store.stats()["tiers"][1]["available"] is False


def test_cluster_redis_refusing_the_password_fails_the_open(locked_redis: RedisServer) -> None:
    layout = small_layout()
    config = {
        "tiers": [{"kind": "host", "capacity": 4 * layout.block_nbytes}],
        "cluster": {"redis_url": f"redis://:wrong-password@127.0.0.1:{locked_redis.port}/0"},
    }
    with pytest.raises(TierError, match=r"cluster\.redis_url: Redis at 127\.0\.0\.1:\d+ refused"):
        KVStore(layout, config)
