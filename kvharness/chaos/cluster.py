"""The cluster a chaos soak runs on (see :mod:`kvharness.chaos.run`).

:class:`SoakCluster` starts, in order, one ``redis-server``, an S3 endpoint (moto, unless
one is given), a :class:`~kvharness.proxies.fault.FaultProxy` in front of it, the node
processes (their S3 tier goes through the proxy), the in-process members and a probe
store that reads the bucket directly. ``stop`` (or leaving the ``with``) stops all of it
in reverse order, also after a failed start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvharness.chaos.events import event_ports, node_events_config
from kvharness.proxies.fault import FaultProxy
from kvstore.cli import DUMMY_AWS_ENV, KVStoreServerProcess, RedisServer, S3Server
from kvstore.client import Client, ClientOptions
from kvstore.cluster import ClusterIndex
from kvstore.config import ClusterConfig
from kvstore.errors import KVStoreError, TierError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.store import KVStore
from kvstore.testing import small_layout

if TYPE_CHECKING:
    from kvharness.chaos.config import SoakConfig

__all__ = ["LAYOUT", "SoakCluster"]

#: Small blocks (6 KiB): many of them, so capacities churn within a short run.
LAYOUT: KVLayout = small_layout(head_dim=32)
_NAMESPACE = "default"
_PROBE_BATCH = 256


class SoakCluster:
    """Redis, S3 behind a fault proxy, ``config.nodes`` node processes and
    ``config.members`` in-process stores; a context manager."""

    def __init__(self, config: SoakConfig, workdir: Path, s3: S3Server | None = None) -> None:
        self.config = config
        self.workdir = workdir
        self.names = [chr(ord("a") + i) for i in range(config.nodes)]
        self.cluster = ClusterConfig(
            redis_url="redis://127.0.0.1:1/0",  # the real port is known once Redis runs
            name=f"chaos{config.seed}-{os.getpid()}-{time.monotonic_ns() % 10**6}",
            heartbeat_s=config.heartbeat_s,
            lease_heartbeats=3,
            replicas=2,
            hot_threshold=config.hot_threshold,
            heat_half_life_s=config.heat_half_life_s,
            peer_timeout_s=1.0,
        )
        self._given_s3 = s3
        self.s3: S3Server | None = s3
        self.redis: RedisServer | None = None
        self.proxy = FaultProxy(0)
        self.procs: dict[str, KVStoreServerProcess] = {}
        self.members: list[KVStore] = []
        self._clients: dict[str, Client] = {}
        self._probe: KVStore | None = None
        #: Each node's KV events: (PUB, replay) ports, kept across its restarts.
        self.event_ports = dict(zip(self.names, event_ports(len(self.names)), strict=True))

    # -- start / stop ------------------------------------------------------------------
    def __enter__(self) -> SoakCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        self.redis = RedisServer().start()
        self.cluster = dataclasses.replace(self.cluster, redis_url=self.redis.url)
        if self.s3 is None:  # its own process: moto must not share the workload's GIL
            self.s3 = S3Server(bucket="kvstore-chaos", mode="process").start()
        self.proxy = FaultProxy(self.s3.port).start()
        env = {**DUMMY_AWS_ENV, "AWS_EC2_METADATA_DISABLED": "true"}
        for name in self.names:
            self.procs[name] = KVStoreServerProcess(
                self._node_config(name), self.workdir / name, env
            )
        with ThreadPoolExecutor(len(self.procs)) as pool:  # their imports overlap
            list(pool.map(KVStoreServerProcess.start, self.procs.values()))
        self.settle(timeout=60.0)
        for name in self.names:
            options = ClientOptions(
                self.procs[name].address, shared_memory=False, connect_timeout=1.0, timeout=15.0
            )
            self._clients[name] = Client(LAYOUT, options)
        for i in range(self.config.members):
            self.members.append(KVStore(LAYOUT, self._member_config(i)))
        self._probe = KVStore(LAYOUT, {"tiers": [self._s3_tier(self.s3.url, probe=True)]})

    def stop(self) -> None:
        """Stop everything started, in reverse order; idempotent, never raises."""
        closers: list[Any] = [self._probe, *self.members, *self._clients.values()]
        for thing in closers:
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()
        self._probe, self.members, self._clients = None, [], {}
        if self.procs:
            with ThreadPoolExecutor(len(self.procs)) as pool:  # their drains overlap
                list(pool.map(_stop_node, self.procs.values()))
        self.procs = {}
        self.proxy.stop()
        if self.s3 is not None and self.s3 is not self._given_s3:
            self.s3.stop()
        self.s3 = self._given_s3
        if self.redis is not None:
            self.redis.close()
            self.redis = None

    # -- configs -------------------------------------------------------------------------
    def _s3_tier(self, url: str, probe: bool = False) -> dict[str, Any]:
        """The nodes' S3 tier (through the proxy), or the probe's (direct, under the
        prefix where a server puts its default namespace's objects, with patient
        timeouts: it must not mistake a slow answer for a missing object)."""
        assert self.s3 is not None
        tier: dict[str, Any] = {
            "kind": "s3",
            "bucket": self.s3.bucket,
            "prefix": self.cluster.name,
            "endpoint_url": url,
            "region": "us-east-1",
            "connect_timeout": 1.0,
            "read_timeout": 2.0,
            "deadline": 5.0,
        }
        if probe:
            tier["prefix"] = f"{self.cluster.name}/ns-{_NAMESPACE}"
            tier.update(connect_timeout=5.0, read_timeout=10.0, deadline=30.0, retry_interval=0.1)
        return tier

    def _node_config(self, name: str) -> dict[str, Any]:
        cfg = self.config
        tiers = [
            {"kind": "host", "capacity": cfg.host_capacity, "write_policy": "write_through"},
            {
                "kind": "disk",
                "path": str(self.workdir / name / "disk"),
                "capacity": cfg.disk_capacity,
                "write_policy": "write_through",
            },
            self._s3_tier(self.proxy.url),
        ]
        events = node_events_config(
            self.event_ports[name], self.workdir / name, LAYOUT.block_tokens
        )
        return {
            "tiers": tiers,
            "cluster": {**self.cluster.to_dict(), "node_id": name},
            "events": events,
        }

    def event_endpoints(self) -> dict[str, tuple[str, str]]:
        """Each node's KV event endpoints: (PUB, replay)."""
        return {
            name: (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
            for name, (pub, replay) in self.event_ports.items()
        }

    def _member_config(self, i: int) -> dict[str, Any]:
        return {
            "tiers": [{"kind": "host", "capacity": self.config.member_capacity}],
            "cluster": {**self.cluster.to_dict(), "node_id": f"member-{i}"},
            # A prefetch waits for a slow peer at most this long, never forever.
            "prefetch": {"policy": "timeout", "timeout_base_s": 10.0, "timeout_max_s": 10.0},
        }

    # -- use -----------------------------------------------------------------------------
    def client(self, name: str) -> Client:
        """The (shared, thread-safe) client of node ``name``."""
        return self._clients[name]

    def running(self) -> list[str]:
        """The nodes whose process is alive."""
        return [n for n in self.names if self.procs[n].running]

    def on_s3(self, keys: Sequence[BlockKey], confirm: int = 0) -> list[bool]:
        """Which ``keys`` the bucket holds, asked directly (HEADs, not through the proxy).

        A HEAD that failed (a timeout on a loaded machine) reads as absent: with
        ``confirm``, keys found absent are asked about again, up to that many times."""
        found = self._heads(keys)
        for _ in range(confirm):
            absent = [i for i, ok in enumerate(found) if not ok]
            if not absent:
                break
            time.sleep(0.5)
            for i, ok in zip(absent, self._heads([keys[i] for i in absent]), strict=True):
                found[i] = ok
        return found

    def _heads(self, keys: Sequence[BlockKey]) -> list[bool]:
        assert self._probe is not None
        tier = self._probe.engine.datapath.tiers[0]
        found: list[bool] = []
        for start in range(0, len(keys), _PROBE_BATCH):
            batch = list(keys[start : start + _PROBE_BATCH])
            try:
                found += tier.contains(batch)
            except TierError:  # the probe's endpoint timed out: unknown, read as absent
                found += [False] * len(batch)
        return found

    def settle(self, timeout: float) -> None:
        """Wait until every node process is up and has joined the index."""
        end = time.monotonic() + timeout
        with contextlib.closing(ClusterIndex(self.cluster)) as index:
            while True:
                try:
                    live = set(index.live_nodes())
                except KVStoreError:
                    live = set()
                if set(self.names) <= live and len(self.running()) == len(self.names):
                    return
                if time.monotonic() > end:
                    raise TierError(f"nodes {sorted(set(self.names) - live)} did not join")
                time.sleep(0.05)

    def node_counters(self, name: str) -> dict[str, int]:
        """The cluster and S3 tier counters of node ``name``'s store (since its start)."""
        out: dict[str, int] = {}
        for store in self.client(name).server_stats()["stores"]:
            tiers = [t for t in store["tiers"] if t["kind"] in ("cluster", "s3")]
            for tier, (key, value) in ((t, kv) for t in tiers for kv in t.items()):
                if isinstance(value, int) and not isinstance(value, bool):
                    name_ = f"{tier['kind']}.{key}"
                    out[name_] = out.get(name_, 0) + value
        return out


def _stop_node(proc: KVStoreServerProcess) -> None:
    """SIGTERM (the node drains and leaves the index), SIGKILL if that fails."""
    with contextlib.suppress(Exception):
        if proc.pid is not None:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        proc.stop(timeout=20.0)
    with contextlib.suppress(Exception):
        proc.kill()
