"""Secrets stay out of everything kvstore prints (issue 50, item 3).

Planted secrets -- a Redis password in a tier's url and in ``cluster.redis_url``, a
password in an S3 ``endpoint_url``, the server's and a client's tokens, the cluster's
token, an AWS secret access key and an encryption key in the environment -- and then
every output a user or an operator reads is searched for them: ``kvstore config``,
``kvstore stats`` (text and JSON), a config error that quotes a url, the server's
start-up banner and its log (a client's puts, a refused token, Redis down), its
``/metrics``, a store's warnings while Redis is down and ``kvstore route``'s error when
the cluster's Redis is down. Every one is real: processes, a redis-server, moto's S3.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvharness.commands import files_under, one_error_line, prepare_home, run_command
from kvstore import KVStore
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.cli.servers import RedisServer, S3Server, free_port
from kvstore.errors import AccessDeniedError
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()
REDIS_PASSWORD = "planted-redis-pw-7f3a9c"
CLUSTER_PASSWORD = "planted-cluster-pw-51be0d"
S3_URL_PASSWORD = "planted-s3-url-pw-0c4e"
SERVER_TOKEN = "planted-server-token-8e21c4d9"
CLUSTER_TOKEN = "planted-cluster-token-0a9b8c7d"
AWS_SECRET = "planted-aws-secret-key-44d0e1"
KEY_HEX = secrets.token_hex(32)
PLANTED = (
    REDIS_PASSWORD,
    CLUSTER_PASSWORD,
    S3_URL_PASSWORD,
    SERVER_TOKEN,
    CLUSTER_TOKEN,
    AWS_SECRET,
    KEY_HEX,
)
#: The environment the commands and the server run with: the AWS secret and the
#: keyring (the variable ``encryption.key_env`` names).
SECRET_ENV = {
    "AWS_ACCESS_KEY_ID": "kvstore-test-key",
    "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/kvstore-test-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/kvstore-test-aws-creds",
    "AWS_EC2_METADATA_DISABLED": "true",
    "KV_TEST_KEYRING": json.dumps({"active": "k1", "keys": {"k1": KEY_HEX}}),
}


def assert_no_secret(text: str, where: str) -> None:
    for secret in PLANTED:
        assert secret not in text, f"{where} shows a planted secret ({secret}):\n{text}"


def planted_config(tmp: Path, redis_port: int) -> dict[str, Any]:
    """A store config holding every kind of secret (its Redis and S3 down)."""
    return {
        "tiers": [
            {"kind": "host", "capacity": "1MiB"},
            {"kind": "disk", "path": str(tmp / "disk"), "capacity": "16MiB"},
            {"kind": "redis", "url": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0"},
            {
                "kind": "s3",
                "bucket": "kvstore-test",
                "endpoint_url": f"http://kvstore-test-key:{S3_URL_PASSWORD}@127.0.0.1:9",
            },
            {"kind": "remote", "address": "127.0.0.1:7070", "token": SERVER_TOKEN},
        ],
        "cluster": {
            "redis_url": f"redis://kv:{CLUSTER_PASSWORD}@127.0.0.1:{redis_port}/0",
            "token": CLUSTER_TOKEN,
        },
        "server": {
            "token": SERVER_TOKEN,
            "tokens": [{"name": "team", "token": SERVER_TOKEN + "-team"}],
        },
        "encryption": {"key_env": "KV_TEST_KEYRING"},
    }


def kvstore(tmp: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    return run_command([sys.executable, "-m", "kvstore", *args], tmp, {**SECRET_ENV, **(env or {})})


def test_kvstore_config_and_stats_hide_every_secret(tmp_path: Path) -> None:
    prepare_home(tmp_path)
    config = tmp_path / "store.yaml"
    config.write_text(yaml.safe_dump(planted_config(tmp_path, free_port())))
    shown = kvstore(tmp_path, "config", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert_no_secret(shown.stdout + shown.stderr, "kvstore config")
    printed = yaml.safe_load(shown.stdout)
    assert printed["tiers"][2]["url"].startswith("redis://:***@127.0.0.1:")
    assert printed["tiers"][3]["endpoint_url"] == "http://kvstore-test-key:***@127.0.0.1:9"
    assert printed["tiers"][4]["token"] == "***"
    assert printed["cluster"]["redis_url"].startswith("redis://kv:***@127.0.0.1:")
    assert printed["cluster"]["token"] == printed["server"]["token"] == "***"
    assert printed["server"]["tokens"][0]["token"] == "***"
    for form in ((), ("--json",)):
        stats = kvstore(tmp_path, "stats", "--config", str(config), "--layers", "2", *form)
        assert stats.returncode == 0, stats.stderr
        assert "disk" in stats.stdout
        assert_no_secret(stats.stdout + stats.stderr, f"kvstore stats {' '.join(form)}")


@pytest.mark.parametrize(
    ("files", "env", "says"),
    [
        (  # a url of the wrong scheme, from a variable: quoted, its password masked
            {"store.yaml": "tiers:\n  - kind: host\n  - kind: redis\n"},
            {"KVSTORE_REDIS_URL": f"http://:{REDIS_PASSWORD}@127.0.0.1:6379/0"},
            ("KVSTORE_REDIS_URL: tiers[1].url: expected redis://", "'http://:***@127.0.0.1"),
        ),
        (  # a token YAML reads as a number: not quoted at all
            {"store.yaml": "server:\n  token: 98765432109876543210\n"},
            {},
            ("server.token: expected a non-empty string, got an int", "quote a token"),
        ),
        (  # a server's address written as an HTTP URL with credentials
            {
                "store.yaml": f"tiers:\n  - kind: remote\n    address: http://u:{REDIS_PASSWORD}@h:1\n"
            },
            {},
            ("tiers[0].address: http://u:***@h:1 is an HTTP URL",),
        ),
    ],
    ids=["redis-url-of-another-scheme", "token-a-number", "address-an-http-url"],
)
def test_a_config_error_does_not_quote_a_secret(
    tmp_path: Path, files: dict[str, str], env: dict[str, str], says: tuple[str, ...]
) -> None:
    prepare_home(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = files_under(tmp_path)
    result = kvstore(tmp_path, "config", "--config", str(tmp_path / "store.yaml"), env=env)
    line = one_error_line(result, "kvstore", says)
    assert_no_secret(line, "the error")
    assert "98765432109876543210" not in line
    assert files_under(tmp_path) == before


def test_redis_down_is_said_without_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store's warning that its Redis is down, and ``kvstore route``'s error that the
    cluster's is, name the Redis (host, port, database) but not its password."""
    port = free_port()
    caplog.set_level(logging.INFO, logger="kvstore")
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    tiers = [{"kind": "host", "capacity": "1MiB"}, {"kind": "redis", "url": url}]
    with KVStore(LAYOUT, {"tiers": tiers}) as store:
        keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), "down")
        assert store.put(keys, random_blocks(LAYOUT, 2)) == 2
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"redis tier: redis://:***@127.0.0.1:{port}/0 unavailable" in said
    assert_no_secret(said, "the store's log")
    prepare_home(tmp_path)
    cluster = {"cluster": {"redis_url": f"redis://kv:{CLUSTER_PASSWORD}@127.0.0.1:{port}/0"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    (tmp_path / "keys.txt").write_text("00" * 16 + "\n")
    args = ("route", "--config", str(tmp_path / "c.yaml"), "--keys", str(tmp_path / "keys.txt"))
    line = one_error_line(kvstore(tmp_path, *args), "kvstore", ("cluster index (Redis)",))
    assert_no_secret(line, "kvstore route")


def test_the_server_hides_secrets_in_banner_log_metrics_and_refusals(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A server with a password-protected Redis for its cluster index, a Redis tier that
    is down, an S3 tier, a token and an encryption keyring: its banner and log (a client
    storing and reading, a client with a wrong token, Redis down) and ``/metrics``."""
    down = free_port()
    with RedisServer(extra_args=["--requirepass", CLUSTER_PASSWORD]) as redis:
        work = tmp_path / "server"
        config = planted_config(work, down)
        config["tiers"][3] = {
            "kind": "s3",
            "bucket": s3_server.bucket,
            "endpoint_url": s3_server.url,
            "region": "us-east-1",
        }
        del config["tiers"][4]  # the server's own remote tier: none
        config["cluster"]["redis_url"] = f"redis://:{CLUSTER_PASSWORD}@127.0.0.1:{redis.port}/0"
        config["cluster"]["node_id"] = "secrets"
        config = {**server_test_config(work, config["tiers"]), **{"cluster": config["cluster"]}}
        config["server"]["token"] = SERVER_TOKEN
        config["encryption"] = {"key_env": "KV_TEST_KEYRING"}
        with KVStoreServerProcess(config, work, SECRET_ENV, metrics=True) as server:
            remote = {"kind": "remote", "address": server.address, "token": SERVER_TOKEN}
            with KVStore(LAYOUT, {"tiers": [remote]}) as store:
                keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), "secrets")
                kv = random_blocks(LAYOUT, 2)
                assert store.put(keys, kv) == 2
                assert torch.equal(store.get(keys), kv)
            wrong = {**remote, "token": "not-the-token-0123456789"}
            with pytest.raises(AccessDeniedError):
                KVStore(LAYOUT, {"tiers": [wrong]})
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        log = server.log_path.read_text()
    assert "kvstore_tier_blocks" in metrics
    assert_no_secret(metrics, "/metrics")
    assert f"index in Redis at redis://127.0.0.1:{redis.port}/0" in log  # the banner
    assert f"redis://:***@127.0.0.1:{down}/0 unavailable" in log  # the Redis tier, down
    assert_no_secret(log, "the server's banner and log")
