"""kvstore-server's start-up banner: a cluster member names its cluster, the Redis of
its index (never its password) and its node id; capacities read the same in the
banner (bytes), on /metrics (blocks, with HELP saying how one becomes the other) and in
``kvstore stats`` (both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from kvstore import KVLayout
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.cli.servers import RedisServer
from kvstore.client import Client, ClientOptions
from kvstore.testing.conformance import make_keys

TOY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.float16)
KVSTORE = str(Path(sys.executable).with_name("kvstore"))


def banner(server: KVStoreServerProcess) -> str:
    """The server's output up to the end of its banner (it prints once it listens)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = server.log_path.read_text(errors="replace")
        if "connect a store" in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"no banner in 60 s:\n{server.log_tail()}")


def test_a_cluster_member_names_its_cluster_redis_and_node(tmp_path: Path) -> None:
    with RedisServer(extra_args=["--requirepass", "s3cret-pw"]) as redis:
        url = redis.url.replace("redis://", "redis://:s3cret-pw@")
        cluster = {"redis_url": url, "name": "banner-test", "node_id": "node-x"}
        config = {**server_test_config(tmp_path / "work"), "cluster": cluster}
        with KVStoreServerProcess(config, tmp_path / "work") as server:
            text = banner(server)
    line = next(x for x in text.splitlines() if x.startswith("  cluster "))
    assert line == (
        f"  cluster banner-test: node node-x, index in Redis at redis://127.0.0.1:{redis.port}"
        f"/0; peers fetch from {server.address}"
    )
    assert "s3cret-pw" not in text


def test_capacity_reads_the_same_in_banner_metrics_and_stats(tmp_path: Path) -> None:
    work = tmp_path / "work"
    with KVStoreServerProcess(server_test_config(work), work, metrics=True) as server:
        text = banner(server)
        with Client(TOY, ClientOptions(server.address, namespace="ns1")) as client:
            data = [torch.zeros(TOY.block_shape, dtype=TOY.dtype) for _ in range(3)]
            assert all(client.put(make_keys(3, salt=7), data))
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        metrics = urllib.request.urlopen(url, timeout=30).read().decode()
    # The banner gives bytes (256 MiB of disk) and how a store counts them in blocks.
    assert "host 16.00 MiB, disk 256.00 MiB at" in text
    assert (
        "in blocks of its layout: capacity / the chunk's bytes (on disk, / the chunk + its 4 KiB"
        in text
    )
    disk_blocks = 256 * 2**20 // (32 * 1024 + 4096)  # the 32 KiB chunk and its header
    sample = (
        f'kvstore_tier_blocks{{namespace="ns1",layout="{TOY.fingerprint_hex}",tier="1",'
        f'kind="disk",what="capacity_blocks"}} {disk_blocks}'
    )
    assert sample in metrics.splitlines()
    assert "# HELP kvstore_tier_blocks Blocks a tier holds" in metrics
    assert "the chunk plus its 4 KiB header in a disk tier's block file" in metrics

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    stats = subprocess.run(
        [KVSTORE, "stats", "--config", str(server.config_path), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    [store] = json.loads(stats.stdout)["stores"]
    disk = store["tiers"][1]
    assert (store["namespace"], store["blocks"]) == ("ns1", 3)
    assert disk["capacity_blocks"] == disk_blocks and disk["capacity"] == 256 * 2**20
    assert disk["unit_nbytes"] * disk_blocks <= disk["capacity"]
