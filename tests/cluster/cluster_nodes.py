"""Three kvstore-server processes (a, b, c) sharing one Redis and one S3 bucket, for the
cluster tests (``conftest.py`` hands them out as fixtures)."""

from __future__ import annotations

import itertools
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore import KVStore
from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.cli.servers import DUMMY_AWS_ENV, S3Server
from kvstore.client import Client, ClientOptions
from kvstore.cluster import ClusterIndex, Router
from kvstore.config import ClusterConfig
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout(head_dim=32)
HEARTBEAT = 0.3
_names = itertools.count()


@dataclass(frozen=True)
class NodeOptions:
    """How a group of nodes differs from the default one."""

    heartbeat_s: float = HEARTBEAT
    tokens: dict[str, str] = field(default_factory=dict)  # node -> its server token
    key_file: str | None = None  # encryption at rest of every node's disk and S3 tiers
    server: dict[str, Any] = field(default_factory=dict)  # more of every node's server section


class Nodes:
    """Node processes a, b, c sharing one Redis and one bucket."""

    def __init__(
        self,
        root: Path,
        redis_url: str,
        clustered: bool,
        s3: S3Server,
        options: NodeOptions | None = None,
    ) -> None:
        self.options = options or NodeOptions()
        self.cluster = ClusterConfig(
            redis_url=redis_url,
            redis_cluster=clustered,
            name=f"c{next(_names)}-{os.getpid()}",
            heartbeat_s=self.options.heartbeat_s,
            lease_heartbeats=3,
            replicas=2,
            hot_threshold=3,
            heat_half_life_s=1.0,
            peer_timeout_s=1.0,
        )
        self.s3 = s3
        self.procs: dict[str, KVStoreServerProcess] = {}
        env = {**DUMMY_AWS_ENV, "AWS_EC2_METADATA_DISABLED": "true"}
        for name in "abc":
            config = self._config(root, name)
            token = self.options.tokens.get(name)
            if token is not None:  # as docs/cluster.md shows it: server.token_file only
                path = root / f"{name}.token"
                path.write_text(token + "\n")
                config["server"] = {"token_file": str(path)}
            config["server"] = {**config.get("server", {}), **self.options.server}
            self.procs[name] = KVStoreServerProcess(config, root / name, env, metrics=True)

    def s3_tier(self, prefix: str) -> dict[str, Any]:
        return {
            "kind": "s3",
            "bucket": self.s3.bucket,
            "prefix": prefix,
            "endpoint_url": self.s3.url,
            "region": "us-east-1",
            "connect_timeout": 1.0,
            "read_timeout": 2.0,
            "deadline": 5.0,
        }

    def on_s3(self, keys: list[bytes]) -> bool:
        """Whether every key reached the bucket (the servers put their namespace's
        objects under ``<prefix>/ns-default``)."""
        config = {"tiers": [self.s3_tier(f"{self.cluster.name}/ns-default")]}
        with KVStore(LAYOUT, config) as probe:
            return probe.engine.datapath.exists(keys) == [True] * len(keys)

    def _config(self, root: Path, name: str) -> dict[str, Any]:
        cluster = {**self.cluster.to_dict(), "node_id": name}
        tiers = [
            {"kind": "host", "capacity": "8MiB", "write_policy": "write_through"},
            {
                "kind": "disk",
                "path": str(root / name / "disk"),
                "capacity": "64MiB",
                "write_policy": "write_through",
            },
            self.s3_tier(self.cluster.name),
        ]
        config: dict[str, Any] = {"tiers": tiers, "cluster": cluster}
        if self.options.key_file is not None:
            config["encryption"] = {"key_file": self.options.key_file}
        return config

    def start(self) -> Nodes:
        for proc in self.procs.values():
            proc.start()
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGCONT)
            proc.stop()

    def client(self, name: str) -> Client:
        token = self.options.tokens.get(name)
        options = ClientOptions(
            self.procs[name].address,
            shared_memory=False,
            token=token.encode() if token else None,
        )
        return Client(LAYOUT, options)

    def metrics(self, name: str) -> str:
        """Node ``name``'s Prometheus ``/metrics``."""
        port = self.procs[name].metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    def cluster_tier(self, name: str) -> dict[str, Any]:
        """The stats of node ``name``'s cluster tier."""
        with self.client(name) as client:
            tiers = client.server_stats()["stores"][0]["tiers"]
        return next(t for t in tiers if t["kind"] == "cluster")

    def router(self) -> Router:
        return Router(self.cluster, LAYOUT)

    def holders(self, keys: list[bytes], namespace: str = "default") -> dict[str, list[bool]]:
        index = ClusterIndex(self.cluster)
        try:
            return index.locate(namespace, LAYOUT.fingerprint_hex, keys, ["a", "b", "c"])
        finally:
            index.close()


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def read(client: Client, keys: list[bytes]) -> tuple[list[bool], list[torch.Tensor]]:
    outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
    return client.get(keys, outs), outs


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()
