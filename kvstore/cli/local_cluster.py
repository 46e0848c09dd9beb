"""``kvstore local-cluster``: a whole cluster on this machine, for trying one.

One ``redis-server`` (the shared index), moto's S3 server in this process with one
bucket (the shared cold tier), and two or more ``kvstore-server`` nodes, every one on a
free 127.0.0.1 port and every file in one temporary directory. It prints the addresses,
client configs for each node, a script that stores through node ``a`` and finds the
chunks through node ``b``, and the ``kvstore route`` command; then it runs until
Ctrl-C, SIGTERM or SIGHUP, when it stops the nodes (they drain), Redis and S3, and
removes the directory.

The servers are started by the launchers beside it, :mod:`kvstore.cli.servers` and
:mod:`kvstore.cli.kvserver` (they start real servers on free local ports, which is what
a trial cluster is; tests and benchmarks use them too). It is part of the CLI, not of
:mod:`kvstore.cluster`: the cluster package itself never starts servers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml

from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.cli.servers import DUMMY_AWS_ENV, RedisServer, S3Server
from kvstore.errors import ConfigError, InvalidInputError

__all__ = ["LocalCluster", "LocalClusterSettings", "missing_prerequisites", "run"]

log = logging.getLogger(__name__)

NODE_IDS = "abcdefgh"
#: The bucket every node writes its cold blocks to (moto's, in this process).
BUCKET = "kvstore-local"
#: Seconds a node is given to drain at stop before it is killed.
_NODE_STOP_TIMEOUT = 30.0


@dataclass(frozen=True)
class LocalClusterSettings:
    """What ``kvstore local-cluster`` starts.

    ``nodes``: kvstore-server nodes (named a, b, c, ...). ``heartbeat_s``: how often a
    node publishes what it holds (short, so a chunk stored through one node is found
    through another within a second). ``host_capacity`` / ``disk_capacity``: each node's
    tiers (sizes as in a config file).
    """

    nodes: int = 2
    heartbeat_s: float = 0.5
    host_capacity: str = "512MiB"
    disk_capacity: str = "2GiB"

    def check(self) -> None:
        """InvalidInputError for a node count out of range."""
        if not 2 <= self.nodes <= len(NODE_IDS):
            raise InvalidInputError(f"--nodes: expected 2 to {len(NODE_IDS)}, got {self.nodes}")


def missing_prerequisites() -> list[str]:
    """What is missing to run a local cluster, each with the command that installs it."""
    missing = []
    if shutil.which("redis-server") is None:
        missing.append("redis-server (apt-get install -y redis-server)")
    # moto's server needs its [server] extra (flask, werkzeug); the nodes need boto3, redis.
    if any(importlib.util.find_spec(m) is None for m in ("moto", "flask", "werkzeug")):
        missing.append("moto's S3 server (pip install 'moto[server]')")
    if importlib.util.find_spec("boto3") is None:
        missing.append("boto3 for the S3 tier (pip install boto3)")
    if importlib.util.find_spec("redis") is None:
        missing.append("the redis client for the cluster index (pip install redis hiredis)")
    return missing


class LocalCluster:
    """Redis, S3 and ``settings.nodes`` kvstore-server nodes; a context manager."""

    def __init__(self, settings: LocalClusterSettings | None = None) -> None:
        self.settings = settings or LocalClusterSettings()
        self.settings.check()
        self.directory: Path | None = None
        self.redis: RedisServer | None = None
        self.s3: S3Server | None = None
        self.nodes: dict[str, KVStoreServerProcess] = {}

    def start(self, announce: Callable[[Path], object] | None = None) -> LocalCluster:
        """Start everything (in order: Redis, S3, the nodes); on any failure stop what
        started and raise. ``announce(directory)`` is called once the directory that
        holds every file exists, before any server starts."""
        try:
            self.directory = Path(tempfile.mkdtemp(prefix="kvstore-cluster-"))
            if announce is not None:
                announce(self.directory)
            self.redis = RedisServer().start()
            self.s3 = S3Server(bucket=BUCKET, mode="thread").start()
            for node_id in NODE_IDS[: self.settings.nodes]:
                self.nodes[node_id] = self._node(node_id)
                self.nodes[node_id].start()
            self._write_files()
        except BaseException:
            self.close()
            raise
        return self

    def _node(self, node_id: str) -> KVStoreServerProcess:
        assert self.directory is not None and self.redis is not None and self.s3 is not None
        work = self.directory / node_id
        tiers = [
            {
                "kind": "host",
                "capacity": self.settings.host_capacity,
                "write_policy": "write_through",
            },
            {
                "kind": "disk",
                "path": str(work / "disk"),
                "capacity": self.settings.disk_capacity,
                "write_policy": "write_through",
            },
            self.s3_tier(),
        ]
        cluster = {**self.cluster_section(), "node_id": node_id}
        env = {**DUMMY_AWS_ENV, "AWS_EC2_METADATA_DISABLED": "true"}
        node = KVStoreServerProcess({"tiers": tiers, "cluster": cluster}, work, env)
        # moto's dummy credentials, not whatever profile or config file the user has.
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            node.env.pop(name, None)
        node.env["AWS_CONFIG_FILE"] = node.env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        return node

    def s3_tier(self) -> dict[str, Any]:
        """The nodes' S3 tier (moto's endpoint, this cluster's bucket)."""
        assert self.s3 is not None
        return {
            "kind": "s3",
            "bucket": BUCKET,
            "prefix": "local",
            "endpoint_url": self.s3.url,
            "region": "us-east-1",
        }

    def cluster_section(self) -> dict[str, Any]:
        """The ``cluster:`` section every node shares (and ``kvstore route`` reads)."""
        assert self.redis is not None
        return {
            "redis_url": self.redis.url,
            "name": "local",
            "heartbeat_s": self.settings.heartbeat_s,
        }

    def client_config(self, node_id: str) -> dict[str, Any]:
        """A store config whose one tier is node ``node_id``."""
        return {"tiers": [{"kind": "remote", "address": self.nodes[node_id].address}]}

    def _write_files(self) -> None:
        assert self.directory is not None
        for node_id in self.nodes:
            path = self.directory / f"client-{node_id}.yaml"
            path.write_text(yaml.safe_dump(self.client_config(node_id), sort_keys=False))
        route = {"cluster": self.cluster_section()}
        (self.directory / "cluster.yaml").write_text(yaml.safe_dump(route, sort_keys=False))
        (self.directory / "try.py").write_text(TRY_SCRIPT.replace("{DIR}", str(self.directory)))

    def close(self) -> None:
        """Stop the nodes (SIGTERM: they drain), then Redis and S3; remove the directory.
        Idempotent; every step runs even when one before it fails (that one is logged)."""
        steps: list[tuple[str, Callable[[], object]]] = [
            (f"node {node_id}", functools.partial(node.stop, timeout=_NODE_STOP_TIMEOUT))
            for node_id, node in self.nodes.items()
        ]
        if self.redis is not None:
            steps.append(("redis-server", self.redis.close))
        if self.s3 is not None:
            steps.append(("the S3 server", self.s3.stop))
        if self.directory is not None:
            steps.append((str(self.directory), functools.partial(shutil.rmtree, self.directory)))
        self.nodes, self.redis, self.s3, self.directory = {}, None, None, None
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # the rest must still stop
                log.warning("local cluster: stopping %s failed: %s", what, exc)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        """How to use the cluster: addresses, a client config, what to run."""
        assert self.directory is not None and self.redis is not None and self.s3 is not None
        d = self.directory
        lines = [
            f"kvstore local cluster: Redis, S3 and {len(self.nodes)} kvstore-server nodes on "
            f"127.0.0.1 (files in {d}, removed at exit)",
            f"  redis    {self.redis.url}",
            f"  s3       {self.s3.url}  bucket {BUCKET} (moto, in this process)",
        ]
        for node_id, node in self.nodes.items():
            lines.append(
                f"  node {node_id}   {node.address}  {node.workdir}/ (server.yaml, server.log)"
            )
        snippet = yaml.safe_dump(self.client_config("a"), sort_keys=False)
        lines += [
            "",
            f"A store config whose tier is node a ({d}/client-a.yaml; client-b.yaml: node b):",
            *(f"    {line}" for line in snippet.splitlines()),
            "",
            "Store 6 chunks through node a and find them through node b (writes keys.txt):",
            f"    {sys.executable} {d}/try.py",
            "Rank the nodes for those chunks (cache-aware routing):",
            f"    kvstore route --config {d}/cluster.yaml --keys {d}/keys.txt",
            "",
            "kvstore local cluster ready; Ctrl-C (or SIGTERM) stops it",
        ]
        return "\n".join(lines)


#: The script ``describe()`` points at; ``{DIR}`` is the cluster's directory.
TRY_SCRIPT = '''\
"""Store 6 chunks (Llama-3-8B's KV geometry) through node a, find them through node b."""

import time

import torch

from kvstore import KVLayout, KVStore

layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=256,
                  dtype=torch.bfloat16)
tokens = list(range(6 * layout.block_tokens))
with KVStore(layout, "{DIR}/client-a.yaml") as a:
    keys = a.hash_tokens(tokens, namespace="llama-3-8b@rev")
    a.put(keys, torch.randn(layout.tensor_shape(len(keys)), dtype=layout.dtype))
print(f"stored {len(keys)} chunks through node a")
with KVStore(layout, "{DIR}/client-b.yaml") as b:
    for _ in range(100):  # node a publishes what it holds at its next heartbeat
        if b.lookup(keys) == len(keys):
            break
        time.sleep(0.1)
    print(f"node b finds {b.lookup(keys)} of {len(keys)} chunks")
with open("{DIR}/keys.txt", "w") as f:
    f.write("".join(key.hex() + "\\n" for key in keys))
'''


class _Stopped(Exception):
    """A stop signal arrived."""


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`_Stopped` once; from then on they are
    ignored, so that stopping the servers is not cut short (every step has a timeout)."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def stop(signum: int, frame: FrameType | None) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stray_children() -> list[int]:
    """This process's child processes (Linux /proc): any left after the helpers
    stopped theirs (a signal that arrived while a child was being spawned)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _end_strays() -> None:
    """SIGKILL and reap every child process still running."""
    for pid in _stray_children():
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def run(settings: LocalClusterSettings, out: TextIO = sys.stdout) -> int:
    """Start a local cluster, print how to use it, run until a stop signal, stop it.

    ConfigError, before anything starts, when redis-server or moto is missing.
    """
    settings.check()
    missing = missing_prerequisites()
    if missing:
        raise ConfigError("`kvstore local-cluster` needs " + "; ".join(missing))
    cluster = LocalCluster(settings)
    where: list[Path] = []

    def starting(directory: Path) -> None:
        where.append(directory)
        what = f"Redis, S3 and {settings.nodes} kvstore-server nodes"
        print(f"kvstore local cluster: starting {what} in {directory}", file=out, flush=True)

    with _stop_signals():
        try:
            with contextlib.suppress(_Stopped):  # a stop signal ends the wait (or the start)
                cluster.start(starting)
                print(cluster.describe(), file=out, flush=True)
                while True:
                    signal.pause()
        finally:
            print("kvstore local cluster: stopping", file=out, flush=True)
            cluster.close()
            _end_strays()
            gone = [str(d) for d in where if not d.exists()]
            if gone:
                print(f"kvstore local cluster: stopped; removed {gone[0]}", file=out, flush=True)
    return 0
