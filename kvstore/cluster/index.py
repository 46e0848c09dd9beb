"""The shared index in Redis: which node holds which blocks, who is alive, what is hot.

Keys (``P`` is the cluster ``name``; ``ns`` a namespace, ``fp`` a layout fingerprint)::

    P:node:<id>              HASH  {advertise, load, blocks}    PEXPIRE lease
    P:nodes                  ZSET  node id -> last heartbeat (for enumeration)
    P:<ns>:<fp>:held:<id>    SET   raw 16-byte keys node <id> holds   PEXPIRE lease
    P:<ns>:<fp>:heat         ZSET  key -> fetches by other nodes (halved periodically)

A node refreshes its hash and its sets every heartbeat; when it dies they
expire ``lease`` seconds later (Redis's own clock: node clocks may differ), so
its entries vanish within a few heartbeats with nobody cleaning up. Lookups ask
every live node's set with one ``SMISMEMBER`` each, pipelined: the cost grows
with the nodes, not with the blocks stored (a set lookup is O(1) per key).

The index is a hint, never the data: a fetch verifies every block, and a node
that turns out not to hold a block it was listed with is removed from that
entry (:meth:`ClusterIndex.forget`).

Every method raises :class:`~kvstore.errors.TierError` when Redis is
unreachable; callers degrade to their own tiers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.cluster
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.config import ClusterConfig
from kvstore.errors import TierError
from kvstore.keys import BlockKey

__all__ = ["ClusterIndex", "NodeInfo"]

log = logging.getLogger(__name__)

_BATCH = 1000  # keys per SADD / SREM / SMISMEMBER command
_TIMEOUT = 2.0


@dataclass(frozen=True)
class NodeInfo:
    """A live node: its id, where its server listens (None: serves nothing), its load."""

    node_id: str
    advertise: str | None
    load: float = 0.0
    blocks: int = 0


class ClusterIndex:
    """The Redis side of a cluster (see the module docstring). Thread-safe."""

    def __init__(self, config: ClusterConfig) -> None:
        if config.redis_url is None:
            raise TierError("the cluster needs a redis_url")
        self.config = config
        self._prefix = config.name
        self._lease_ms = max(1, round(config.lease_s * 1000))
        self._lock = threading.Lock()  # guards _client
        self._client: Any = None

    # -- names ------------------------------------------------------------------
    def _node_key(self, node: str) -> str:
        return f"{self._prefix}:node:{node}"

    def _held_key(self, namespace: str, fp: str, node: str) -> str:
        return f"{self._prefix}:{namespace}:{fp}:held:{node}"

    def _heat_key(self, namespace: str, fp: str) -> str:
        return f"{self._prefix}:{namespace}:{fp}:heat"

    @property
    def _nodes_key(self) -> str:
        return f"{self._prefix}:nodes"

    # -- plumbing -----------------------------------------------------------------
    def _connection(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        url = self.config.redis_url or ""
        opts: dict[str, Any] = {
            "socket_timeout": _TIMEOUT,
            "socket_connect_timeout": _TIMEOUT,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.config.redis_cluster:
            return redis.cluster.RedisCluster.from_url(url, **opts)
        return redis.Redis.from_url(url, **opts)

    def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``commands`` in one pipeline (TierError when Redis is unreachable)."""
        if not commands:
            return []
        try:
            client = self._connection()
            pipe = client.pipeline() if self.config.redis_cluster else client.pipeline(False)
            for command in commands:
                pipe.execute_command(*command)
            replies: list[Any] = pipe.execute(raise_on_error=True)
            return replies
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TierError(f"cluster index (Redis) unavailable: {exc}") from None

    # -- a node's own entries ---------------------------------------------------------
    def heartbeat(self, node: NodeInfo) -> None:
        """Say ``node`` is alive (for another lease), with its address and load."""
        fields = {"advertise": node.advertise or "", "load": node.load, "blocks": node.blocks}
        key = self._node_key(node.node_id)
        self._pipeline(
            [
                ("HSET", key, *[x for kv in fields.items() for x in kv]),
                ("PEXPIRE", key, self._lease_ms),
                ("ZADD", self._nodes_key, time.time(), node.node_id),
            ]
        )

    def add(self, namespace: str, fp: str, node: str, keys: Sequence[BlockKey]) -> None:
        """Record that ``node`` holds ``keys`` (and refresh its lease)."""
        held = self._held_key(namespace, fp, node)
        commands: list[tuple[Any, ...]] = [("SADD", held, *chunk) for chunk in _chunks(keys)]
        self._pipeline([*commands, ("PEXPIRE", held, self._lease_ms)])

    def remove(self, namespace: str, fp: str, node: str, keys: Sequence[BlockKey]) -> None:
        """Record that ``node`` no longer holds ``keys``."""
        held = self._held_key(namespace, fp, node)
        self._pipeline([("SREM", held, *chunk) for chunk in _chunks(keys)])

    def replace(self, namespace: str, fp: str, node: str, keys: Sequence[BlockKey]) -> None:
        """``node`` holds exactly ``keys`` (re-registering after Redis came back)."""
        held = self._held_key(namespace, fp, node)
        commands: list[tuple[Any, ...]] = [("DEL", held)]
        commands += [("SADD", held, *chunk) for chunk in _chunks(keys)]
        self._pipeline([*commands, ("PEXPIRE", held, self._lease_ms)])

    def refresh(self, namespace: str, fp: str, node: str) -> bool:
        """Extend the lease of ``node``'s entries; False if Redis has none of them (it
        restarted empty, say: the node must write them all again)."""
        (found,) = self._pipeline(
            [("PEXPIRE", self._held_key(namespace, fp, node), self._lease_ms)]
        )
        return bool(found)

    def leave(self, node: str, stores: Sequence[tuple[str, str]]) -> None:
        """``node`` is leaving: its entries go now rather than at the end of the lease."""
        commands: list[tuple[Any, ...]] = [
            ("DEL", self._held_key(ns, fp, node)) for ns, fp in stores
        ]
        self._pipeline([*commands, ("DEL", self._node_key(node)), ("ZREM", self._nodes_key, node)])

    # -- everyone's entries -----------------------------------------------------------
    def live_nodes(self) -> dict[str, NodeInfo]:
        """The nodes whose lease has not run out, by id."""
        (members,) = self._pipeline([("ZRANGE", self._nodes_key, 0, -1)])
        names = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        infos = self._pipeline([("HGETALL", self._node_key(n)) for n in names])
        live: dict[str, NodeInfo] = {}
        gone: list[str] = []
        for name, info in zip(names, infos, strict=True):
            if not info:
                gone.append(name)
                continue
            fields = {k.decode(): v.decode() for k, v in info.items()}
            live[name] = NodeInfo(
                name,
                fields.get("advertise") or None,
                float(fields.get("load") or 0.0),
                int(float(fields.get("blocks") or 0)),
            )
        if gone:  # leases that ran out: tidy the enumeration (the entries expired already)
            self._pipeline([("ZREM", self._nodes_key, *gone)])
        return live

    def locate(
        self, namespace: str, fp: str, keys: Sequence[BlockKey], nodes: Sequence[str]
    ) -> dict[str, list[bool]]:
        """For each of ``nodes``: which of ``keys`` it holds (one SMISMEMBER per node)."""
        if not keys or not nodes:
            return {n: [False] * len(keys) for n in nodes}
        chunks = list(_chunks(keys))
        commands = [
            ("SMISMEMBER", self._held_key(namespace, fp, node), *chunk)
            for node in nodes
            for chunk in chunks
        ]
        replies = iter(self._pipeline(commands))
        found: dict[str, list[bool]] = {}
        for node in nodes:
            flags: list[bool] = []
            for _ in chunks:
                flags += [bool(x) for x in next(replies)]
            found[node] = flags
        return found

    def forget(self, namespace: str, fp: str, node: str, keys: Sequence[BlockKey]) -> None:
        """``node`` was listed with ``keys`` but does not hold them: repair the hint."""
        self.remove(namespace, fp, node, keys)

    # -- heat ---------------------------------------------------------------------------
    def heat(self, namespace: str, fp: str, keys: Sequence[BlockKey]) -> list[float]:
        """Count one fetch of each of ``keys`` by another node; their heat now."""
        heat = self._heat_key(namespace, fp)
        replies = self._pipeline([("ZINCRBY", heat, 1, key) for key in keys])
        return [float(r) for r in replies]

    def hottest(
        self, namespace: str, fp: str, threshold: float, limit: int = 256
    ) -> list[tuple[BlockKey, float]]:
        """Keys whose heat is at least ``threshold``, hottest first."""
        heat = self._heat_key(namespace, fp)
        (rows,) = self._pipeline(
            [("ZREVRANGEBYSCORE", heat, "+inf", threshold, "WITHSCORES", "LIMIT", 0, limit)]
        )
        return [(BlockKey(bytes(k)), float(s)) for k, s in _pairs(rows)]

    def heat_of(self, namespace: str, fp: str, keys: Sequence[BlockKey]) -> list[float]:
        """The heat of each of ``keys`` (0 when never fetched)."""
        (scores,) = self._pipeline([("ZMSCORE", self._heat_key(namespace, fp), *keys)])
        return [float(s) if s is not None else 0.0 for s in scores]

    def decay(self, namespace: str, fp: str, period_s: float) -> bool:
        """Halve every heat once per ``period_s`` cluster-wide (whichever node comes
        first does it); True if this call did."""
        heat = self._heat_key(namespace, fp)
        lock = f"{heat}:decayed"
        (took,) = self._pipeline([("SET", lock, "1", "NX", "PX", max(1, round(period_s * 1000)))])
        if not took:
            return False
        self._pipeline(
            [
                ("ZUNIONSTORE", heat, 1, heat, "WEIGHTS", 0.5),
                ("ZREMRANGEBYSCORE", heat, "-inf", "(0.5"),
            ]
        )
        return True

    def claim_replicas(
        self,
        namespace: str,
        fp: str,
        keys: Sequence[BlockKey],
        allowed: Sequence[int],
        ttl_s: float,
    ) -> list[bool]:
        """Take one of ``allowed[i]`` replica slots of each key; True where this caller
        got one. Claims are counted atomically (``INCR``), so nodes deciding at once
        never make more copies than allowed; the count expires after ``ttl_s``."""
        ttl = max(1, round(ttl_s * 1000))
        commands: list[tuple[Any, ...]] = []
        for key in keys:
            name = f"{self._heat_key(namespace, fp)}:claim:{bytes(key).hex()}"
            commands += [("INCR", name), ("PEXPIRE", name, ttl)]
        counts = self._pipeline(commands)[0::2]
        return [int(n) <= most for n, most in zip(counts, allowed, strict=True)]

    def memory_usage(self, namespace: str, fp: str, node: str) -> int:
        """Bytes Redis uses for ``node``'s entries (for sizing and benchmarks)."""
        (used,) = self._pipeline([("MEMORY", "USAGE", self._held_key(namespace, fp, node))])
        return int(used or 0)

    def close(self) -> None:
        """Drop the connections (idempotent)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _chunks(keys: Sequence[BlockKey]) -> Iterator[list[BlockKey]]:
    for start in range(0, len(keys), _BATCH):
        yield list(keys[start : start + _BATCH])


def _pairs(rows: Any) -> Iterator[tuple[bytes, float]]:
    """(member, score) pairs of a WITHSCORES reply, flat (RESP2) or paired (RESP3)."""
    rows = list(rows)
    if rows and isinstance(rows[0], (list, tuple)):
        for member, score in rows:
            yield member, float(score)
        return
    for i in range(0, len(rows) - 1, 2):
        yield rows[i], float(rows[i + 1])
