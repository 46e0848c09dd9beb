"""kvstore-server's log says the server's news, not its libraries' (issue 50: with an S3
tier it printed ``INFO botocore.credentials: Found credentials in environment variables.``
at start and at each store's open). ``--log-level`` is the kvstore loggers' level; the
libraries under them say warnings and above (everything at ``DEBUG``)."""

from __future__ import annotations

from pathlib import Path

from kvstore import KVStore
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.cli.servers import DUMMY_AWS_ENV, S3Server
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()


def served_log(work: Path, s3: S3Server) -> str:
    """The log of a server over a host and an S3 tier (credentials in its environment, as
    an operator sets them) that stored two blocks from a client, then stopped."""
    s3_tier = {"kind": "s3", "bucket": s3.bucket, "endpoint_url": s3.url, "region": "us-east-1"}
    tiers = [{"kind": "host", "capacity": "1MiB"}, s3_tier]
    config = server_test_config(work, tiers)
    with KVStoreServerProcess(config, work, DUMMY_AWS_ENV) as process:
        remote = {"kind": "remote", "address": process.address}
        with KVStore(LAYOUT, {"tiers": [remote]}) as store:
            keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), "noise")
            assert store.put(keys, random_blocks(LAYOUT, 2)) == 2
    return process.log_path.read_text()


def test_an_s3_tier_adds_no_library_info_line(tmp_path: Path, s3_server: S3Server) -> None:
    log = served_log(tmp_path / "work", s3_server)
    assert "connect a store" in log  # the banner
    assert "INFO kvstore.server.stores: opened store default/" in log  # the server's INFO
    assert "tiers host, s3" in log
    assert "botocore" not in log and "Found credentials" not in log, log
