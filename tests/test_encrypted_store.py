"""Encryption at rest through a whole store: config, keyring files, rotation with the
background re-encryption, a restart, and a kvstore-server with an encrypted disk tier."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharness.keyring import encryption_section, new_key, write_keyring
from kvstore import KVStore, StoreConfig
from kvstore.errors import ConfigError
from kvstore.format.codec import read_header
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers.files import BLOCK_SUFFIX


def disk_config(
    path: Path, key_file: str | None, encryption: dict[str, Any] | None = None
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tiers": [{"kind": "disk", "path": str(path), "capacity": "16MiB", "codec": "raw"}]
    }
    if key_file is not None:
        config["encryption"] = {**encryption_section(key_file), **(encryption or {})}
    return config


def key_ids(path: Path) -> list[str]:
    """The key id of every block file under ``path``."""
    return sorted(read_header(p.read_bytes()).key_id for p in path.rglob(f"*{BLOCK_SUFFIX}"))


def wait_until(check: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_round_trip_restart_and_rotation(tmp_path: Path) -> None:
    layout = small_layout()
    k1, k2 = new_key(), new_key()
    key_file = write_keyring(tmp_path / "keys.json", {"k1": k1}, "k1")
    kv = random_blocks(layout, 4)
    with KVStore(layout, disk_config(tmp_path / "d", key_file)) as store:
        keys = store.hash_tokens(list(range(4 * layout.block_tokens)), "m")
        assert store.put(keys, kv) == 4
    assert key_ids(tmp_path / "d") == ["k1"] * 4
    # Restart: the blocks come back from disk, opened with the key.
    with KVStore(layout, disk_config(tmp_path / "d", key_file)) as store:
        assert store.lookup(keys) == 4
        assert torch.equal(store.get(keys), kv)
    # Rotation: k2 becomes active, k1 stays readable; the store rewrites k1's blocks.
    write_keyring(key_file, {"k1": k1, "k2": k2}, "k2")
    with KVStore(layout, disk_config(tmp_path / "d", key_file)) as store:
        more = store.hash_tokens(list(range(100, 100 + 2 * layout.block_tokens)), "m")
        store.put(more, random_blocks(layout, 2, seed=5))
        assert torch.equal(store.get(keys), kv)  # old blocks, read under k1
        assert store.drain(timeout=10)
        disk = store.stats()["tiers"][0]
        assert disk["reencrypted"] == 4 and disk["reencrypt_pending"] == 0
    assert key_ids(tmp_path / "d") == ["k2"] * 6
    # k1 removed: everything is under k2 now, nothing lost.
    write_keyring(key_file, {"k2": k2}, "k2")
    with KVStore(layout, disk_config(tmp_path / "d", key_file)) as store:
        assert torch.equal(store.get(keys), kv)
        assert store.stats()["tiers"][0]["decrypt_failures"] == 0


def test_removed_key_is_a_counted_miss(tmp_path: Path) -> None:
    layout = small_layout()
    key_file = write_keyring(tmp_path / "keys.json", {"k1": new_key()}, "k1")
    kv = random_blocks(layout, 2)
    with KVStore(layout, disk_config(tmp_path / "d", key_file)) as store:
        keys = store.hash_tokens(list(range(2 * layout.block_tokens)), "m")
        store.put(keys, kv)
    write_keyring(key_file, {"k2": new_key()}, "k2")
    with KVStore(layout, disk_config(tmp_path / "d", key_file)) as store:
        assert store.lookup(keys) == 2  # indexed from the directory listing ...
        assert store.get(keys).shape[2] == 0  # ... but not data: a miss
        assert store.stats()["tiers"][0]["decrypt_failures"] >= 1
        # The engine recomputes and puts again: the blocks are sealed under k2 now.
        assert store.put(keys, kv) == 2
        assert torch.equal(store.get(keys), kv)
    assert key_ids(tmp_path / "d") == ["k2"] * 2


def test_key_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = small_layout()
    monkeypatch.setenv("TEST_KEYRING", f'{{"active": "e1", "keys": {{"e1": "{new_key()}"}}}}')
    config = disk_config(tmp_path / "d", None)
    config["encryption"] = {"key_env": "TEST_KEYRING", "tiers": ["disk"]}
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(list(range(layout.block_tokens)), "m")
        store.put(keys, random_blocks(layout, 1))
    assert key_ids(tmp_path / "d") == ["e1"]


@pytest.mark.parametrize(
    ("encryption", "keys", "mode", "message"),
    [
        ({"tiers": ["host"]}, {"k1": "00" * 32}, 0o600, "cannot be encrypted"),
        ({"tiers": ["cluster"]}, {"k1": "00" * 32}, 0o600, "cannot be encrypted"),
        ({}, {"k1": "00" * 16}, 0o600, "must be 32 bytes"),
        ({}, {"k1": "zz" * 32}, 0o600, "must be 32 bytes"),
        ({}, {"k1": "00" * 32}, 0o644, "readable by every user"),
        ({"key_file": "/nonexistent/keys.json"}, {"k1": "00" * 32}, 0o600, "No such file"),
        ({"key_env": "X"}, {"k1": "00" * 32}, 0o600, "not both"),
    ],
)
def test_bad_config_is_one_line_and_changes_nothing(
    tmp_path: Path, encryption: dict[str, Any], keys: dict[str, str], mode: int, message: str
) -> None:
    key_file = write_keyring(tmp_path / "keys.json", keys, "k1")
    os.chmod(key_file, mode)
    config = disk_config(tmp_path / "d", key_file, encryption)
    with pytest.raises(ConfigError, match=message) as caught:
        KVStore(small_layout(), StoreConfig.from_dict(config, environ={}))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "d").exists()  # no tier opened


def test_unknown_active_key_is_refused(tmp_path: Path) -> None:
    key_file = write_keyring(tmp_path / "keys.json", {"k1": new_key()}, "k9")
    with pytest.raises(ConfigError, match="active key 'k9'"):
        KVStore(small_layout(), disk_config(tmp_path / "d", key_file))


def test_encryption_env_overrides(tmp_path: Path) -> None:
    env = {"KVSTORE_ENCRYPTION_KEY_FILE": "/k.json", "KVSTORE_ENCRYPTION_TIERS": "disk,s3"}
    config = StoreConfig.from_dict({}, environ=env)
    assert config.encryption.key_file == "/k.json"
    assert config.encryption.tiers == ("disk", "s3")
    assert StoreConfig.from_dict(config.to_dict(), environ={}) == config
    assert not StoreConfig.from_dict({}, environ={}).encryption.enabled


def test_server_with_encrypted_disk(tmp_path: Path) -> None:
    """A kvstore-server seals what its disk tier keeps; its clients see plain KV."""
    from kvstore.cli.kvserver import server_test_config
    from kvstore.client import Client, ClientOptions
    from kvstore.keys import BlockKey
    from kvstore.server import ServerThread

    layout = small_layout()
    key_file = write_keyring(tmp_path / "keys.json", {"s1": new_key()}, "s1")
    work = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")  # a short Unix socket path
    config = server_test_config(work, [{"kind": "disk", "capacity": "256MiB"}])
    config["encryption"] = encryption_section(key_file, "disk")
    config["server"]["metrics_listen"] = "127.0.0.1:0"
    server = ServerThread(StoreConfig.from_dict(config, environ={})).start()
    kv = random_blocks(layout, 4)
    step = layout.block_tokens
    blocks = [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(4)]
    keys = [BlockKey(bytes([i + 1]) * 16) for i in range(4)]
    try:
        options = ClientOptions(address=server.address, namespace="team")
        with Client(layout, options) as client:
            assert client.put(keys, blocks, durable=True) == [True] * 4
            outs = [torch.empty_like(b) for b in blocks]
            assert client.get(keys, outs) == [True] * 4
            assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
            assert key_ids(Path(work) / "disk") == ["s1"] * 4
            # A flipped ciphertext byte on the server's disk: a miss, counted in /metrics.
            path = next(Path(work).rglob(f"{keys[0].hex()}{BLOCK_SUFFIX}"))
            data = bytearray(path.read_bytes())
            data[4096 + 10] ^= 1
            path.write_bytes(data)
            assert client.get(keys, outs) == [False, True, True, True]
        url = f"http://{server.server.addresses['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        failures = [
            line
            for line in text.splitlines()
            if line.startswith("kvstore_tier_decrypt_failures_total{") and 'kind="disk"' in line
        ]
        assert failures and failures[0].endswith(" 1"), failures
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_shared_bucket_needs_the_same_keyring(
    tmp_path: Path, s3_server: Any, aws_env: None
) -> None:
    """Nodes sharing an S3 cold tier (a cluster's) read each other's sealed blocks when
    they hold the same keyring; a node with another keyring counts misses and deletes
    nothing, so the others still read them."""
    layout = small_layout()
    key_file = write_keyring(tmp_path / "keys.json", {"k1": new_key()}, "k1")
    s3 = {
        "kind": "s3",
        "bucket": s3_server.bucket,
        "prefix": f"shared-{uuid.uuid4().hex[:10]}",
        "endpoint_url": s3_server.url,
        "region": "us-east-1",
        "capacity": "64MiB",
    }
    config = {"tiers": [s3], "encryption": encryption_section(key_file, "s3")}
    kv = random_blocks(layout, 2)
    with KVStore(layout, config) as a:
        keys = a.hash_tokens(list(range(2 * layout.block_tokens)), "m")
        assert a.put(keys, kv) == 2
    with KVStore(layout, config) as b:
        assert torch.equal(b.get(keys), kv)
    other = write_keyring(tmp_path / "other.json", {"k1": new_key()}, "k1")
    with KVStore(layout, {**config, "encryption": encryption_section(other, "s3")}) as c:
        assert c.get(keys).shape[2] == 0
        assert c.stats()["tiers"][0]["decrypt_failures"] >= 1
    with KVStore(layout, config) as b:
        assert torch.equal(b.get(keys), kv)


def test_missing_cryptography_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the package (hidden here: it is installed), one line names the extra."""
    import sys

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    key_file = write_keyring(tmp_path / "keys.json", {"k1": new_key()}, "k1")
    with pytest.raises(ConfigError, match=r"kvstore-tiers\[encrypt\]"):
        KVStore(small_layout(), disk_config(tmp_path / "d", key_file))
    assert not (tmp_path / "d").exists()


def test_rotation_rewrites_redis_blocks(tmp_path: Path, redis_server: Any) -> None:
    """The background re-encryption works on a shared tier too (Redis here)."""
    import redis

    layout = small_layout()
    k1, k2 = new_key(), new_key()
    key_file = write_keyring(tmp_path / "keys.json", {"k1": k1}, "k1")
    prefix = f"enc{uuid.uuid4().hex[:10]}"
    tier = {"kind": "redis", "url": redis_server.url, "key_prefix": prefix, "capacity": "16MiB"}
    config = {"tiers": [tier], "encryption": encryption_section(key_file, "redis")}
    kv = random_blocks(layout, 3)
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(list(range(3 * layout.block_tokens)), "m")
        assert store.put(keys, kv) == 3
    write_keyring(key_file, {"k1": k1, "k2": k2}, "k2")
    with KVStore(layout, config) as store:
        assert store.drain(timeout=10)
        stats = store.stats()["tiers"][0]
        assert stats["reencrypted"] == 3 and stats["reencrypt_pending"] == 0
    client = redis.Redis.from_url(redis_server.url)
    values = [client.get(n) for n in client.scan_iter(match=f"{prefix}:*")]
    client.close()
    assert sorted(read_header(v).key_id for v in values if v) == ["k2"] * 3
    write_keyring(key_file, {"k2": k2}, "k2")
    with KVStore(layout, config) as store:
        assert torch.equal(store.get(keys), kv)


def test_server_refuses_a_bad_keyring_at_start(tmp_path: Path) -> None:
    from kvstore.cli.kvserver import server_test_config
    from kvstore.server import ServerThread

    key_file = write_keyring(tmp_path / "keys.json", {"k1": new_key()}, "k1")
    os.chmod(key_file, 0o604)
    config = server_test_config(str(tmp_path), [{"kind": "disk", "capacity": "256MiB"}])
    config["encryption"] = encryption_section(key_file, "disk")
    with pytest.raises(ConfigError, match="readable by every user"):
        ServerThread(StoreConfig.from_dict(config, environ={}))
