"""The shared index in Redis: which node holds which blocks, who is alive, what is hot.

Keys (``P`` is the cluster ``name``; ``ns`` a namespace, ``fp`` a layout fingerprint)::

    P:node:<id>              HASH    {advertise, load, blocks, speeds}   PEXPIRE lease
    P:nodes                  ZSET    node id -> last heartbeat (for enumeration)
    P:<ns>:<fp>:held:<id>    HASH    raw 16-byte key -> medium ("m" memory, "d" disk)
                                                                         PEXPIRE lease
    P:<ns>:<fp>:shared       SET     keys some node wrote to, or found in, shared storage
                                     (S3): a block enters it when it lands in the bucket
    P:<ns>:<fp>:changes      STREAM  every change of the two above, in order (trimmed)
    P:<ns>:<fp>:heat         ZSET    key -> fetches by other nodes (halved periodically)
    P:<ns>:<fp>:layout       STRING  the layout's description (``KVLayout.describe()``, JSON)

The layout's description is written with a node's full list and never expires (a few
hundred bytes per layout ever used): with it, a reader that knows only what the index
holds -- ``kvstore route`` -- learns each layout's geometry (:meth:`ClusterIndex.stores`).

A node refreshes its hash and its sets every heartbeat; when it dies they
expire ``lease`` seconds later (Redis's own clock: node clocks may differ), so
its entries vanish within a few heartbeats with nobody cleaning up.

Every write to a ``held`` hash or the ``shared`` set is also appended to the
``changes`` stream in the same pipeline (:meth:`ClusterIndex.publish`), so a
reader keeps a copy of the whole index in memory by reading the stream
(:class:`~kvstore.cluster.view.IndexView`) and looks keys up without a round
trip. Redis stays the durable source: a reader that fell behind (the stream
was trimmed past it) or saw Redis restart loads a :meth:`ClusterIndex.snapshot`.

The index is a hint, never the data: a fetch verifies every block, and a node
that turns out not to hold a block it was listed with is removed from that
entry (:meth:`ClusterIndex.forget`). The ``shared`` set is a routing hint
too: it is never used to delete anything.

Every method raises :class:`~kvstore.errors.TierError` when Redis is
unreachable; callers degrade to their own tiers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.cluster
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.cluster.speeds import NodeSpeeds
from kvstore.config import ClusterConfig
from kvstore.datapath.contracts import Medium
from kvstore.errors import TierError
from kvstore.keys import BlockKey
from kvstore.runtime import mask_text

__all__ = ["Change", "ClusterIndex", "IndexedStore", "NodeInfo", "Snapshot", "decode_change"]

log = logging.getLogger(__name__)

_BATCH = 1000  # keys per HSET / HDEL / SADD / SREM / HMGET command, and per stream entry
_TIMEOUT = 2.0
#: Stream entries kept (about; ``MAXLEN ~``): a reader further behind reloads a snapshot.
STREAM_ENTRIES = 100_000
#: A key's byte in a stream entry: the node's medium in the low two bits (0: the node
#: dropped it), and whether the key entered or left the ``shared`` set.
_SHARED_ADD, _SHARED_DEL = 4, 8
_HELD_CODE = {Medium.MEMORY: b"m", Medium.DISK: b"d"}
_CODE_MEDIUM = {b"m": Medium.MEMORY, b"d": Medium.DISK}


@dataclass(frozen=True)
class NodeInfo:
    """A live node: its id, where its server listens (None: serves nothing), its load,
    and its read and prefill speeds (what routers turn into milliseconds)."""

    node_id: str
    advertise: str | None
    load: float = 0.0
    blocks: int = 0
    speeds: NodeSpeeds = field(default_factory=NodeSpeeds)


@dataclass(frozen=True)
class Change:
    """One stream entry: node ``node`` now holds ``keys[i]`` in ``media[i]`` (NONE:
    not any more); ``shared[i]`` +1 / -1 where the key entered / left the shared set.
    ``reset``: the node's entries were replaced (everything before is void)."""

    node: str
    keys: list[BlockKey]
    media: list[Medium]
    shared: list[int]
    reset: bool = False


@dataclass
class Snapshot:
    """The index of one store as Redis holds it: ``held[node][key] = medium``,
    the shared set, and the stream position it is consistent with."""

    position: str
    held: dict[str, dict[BlockKey, Medium]] = field(default_factory=dict)
    shared: set[BlockKey] = field(default_factory=set)


@dataclass(frozen=True)
class IndexedStore:
    """A (namespace, layout) whose blocks live nodes list in the index: per node, how
    many; ``layout``: its description as the nodes wrote it (None: not written, by a
    node older than this field)."""

    namespace: str
    fingerprint: str
    blocks: dict[str, int]
    layout: dict[str, Any] | None = None


def decode_change(fields: Mapping[bytes, bytes]) -> Change:
    """A :class:`Change` from a stream entry's fields (as :meth:`ClusterIndex.publish`
    wrote them)."""
    blob, codes = fields.get(b"k", b""), fields.get(b"c", b"")
    keys = [BlockKey(blob[i : i + 16]) for i in range(0, len(blob), 16)]
    media = [Medium(c & 3) for c in codes]
    shared = [1 if c & _SHARED_ADD else -1 if c & _SHARED_DEL else 0 for c in codes]
    node = fields.get(b"n", b"").decode()
    return Change(node, keys, media, shared, reset=fields.get(b"r") == b"1")


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
        self._check_credentials()

    # -- names ------------------------------------------------------------------
    def _node_key(self, node: str) -> str:
        return f"{self._prefix}:node:{node}"

    def _held_key(self, namespace: str, fp: str, node: str) -> str:
        return f"{self._prefix}:{namespace}:{fp}:held:{node}"

    def _heat_key(self, namespace: str, fp: str) -> str:
        return f"{self._prefix}:{namespace}:{fp}:heat"

    def _shared_key(self, namespace: str, fp: str) -> str:
        return f"{self._prefix}:{namespace}:{fp}:shared"

    def _layout_key(self, namespace: str, fp: str) -> str:
        return f"{self._prefix}:{namespace}:{fp}:layout"

    def stream_key(self, namespace: str, fp: str) -> str:
        """The name of a store's change stream (readers follow it)."""
        return f"{self._prefix}:{namespace}:{fp}:changes"

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

    def _check_credentials(self) -> None:
        """One PING at open: a Redis that refuses the user or password is a TierError now
        (a misconfiguration is loud); one that does not answer is not (nodes serve from
        their own tiers until it is back; the calls that fail then say so)."""
        try:
            self._connection().ping()
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
            self.close()
            parts = urllib.parse.urlsplit(self.config.redis_url or "")
            why = "wants a password and the url has none" if parts.password is None else exc
            why = mask_text(str(why))
            raise TierError(
                f"cluster.redis_url: Redis at {parts.hostname}:{parts.port or 6379} refused "
                f"the credentials ({why}); put the right user / password in the url"
            ) from None
        except (redis.exceptions.RedisError, OSError) as exc:
            why = mask_text(str(exc))
            log.info("cluster: Redis unavailable at open (%s); serving from this node", why)

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
            raise TierError(f"cluster index (Redis) unavailable: {mask_text(str(exc))}") from None

    # -- a node's own entries ---------------------------------------------------------
    def heartbeat(self, node: NodeInfo) -> None:
        """Say ``node`` is alive (for another lease), with its address and load."""
        fields = {
            "advertise": node.advertise or "",
            "load": node.load,
            "blocks": node.blocks,
            "speeds": node.speeds.encode(),
        }
        key = self._node_key(node.node_id)
        self._pipeline(
            [
                ("HSET", key, *[x for kv in fields.items() for x in kv]),
                ("PEXPIRE", key, self._lease_ms),
                ("ZADD", self._nodes_key, time.time(), node.node_id),
            ]
        )

    def publish(
        self,
        namespace: str,
        fp: str,
        node: str,
        changes: Mapping[BlockKey, tuple[Medium, Medium]],
        shared: Mapping[BlockKey, int] | None = None,
    ) -> None:
        """Record that the nearest copy of each key on ``node`` went from one
        :class:`~kvstore.datapath.contracts.Medium` to another (the node's change feed), in the
        node's hash, the shared set and the change stream, in one pipeline.

        ``shared``: keys of ``changes`` that gained (+1) or lost (-1) their copy in the
        shared tier whatever their nearest copy (``ChangeFeed.drain_shared``): a block
        written through to S3 enters the shared set when it lands there, not only once
        the node drops its own copy. Without it, a key enters the set when its nearest
        copy becomes ``SHARED`` and leaves it when it goes from ``SHARED`` to none."""
        items = list(changes.items())
        commands: list[tuple[Any, ...]] = []
        for start in range(0, len(items), _BATCH):
            chunk = items[start : start + _BATCH]
            commands += self._publish_chunk(namespace, fp, node, chunk, shared or {})
        commands.append(("PEXPIRE", self._held_key(namespace, fp, node), self._lease_ms))
        self._pipeline(commands)

    def _publish_chunk(
        self,
        namespace: str,
        fp: str,
        node: str,
        items: Sequence[tuple[BlockKey, tuple[Medium, Medium]]],
        copies: Mapping[BlockKey, int],
    ) -> list[tuple[Any, ...]]:
        held, shared = self._held_key(namespace, fp, node), self._shared_key(namespace, fp)
        sets: list[bytes] = []
        dels, adds, gone = [], [], []
        codes = bytearray()
        for key, (before, now) in items:
            code = int(now) if now in _HELD_CODE else 0
            if now in _HELD_CODE:
                sets += [key, _HELD_CODE[now]]
            elif before in _HELD_CODE:
                dels.append(key)
            moved = copies.get(key, _shared_move(before, now))
            if moved > 0:
                adds.append(key)
                code |= _SHARED_ADD
            elif moved < 0:
                gone.append(key)  # the block itself left the bucket (deleted)
                code |= _SHARED_DEL
            codes.append(code)
        commands: list[tuple[Any, ...]] = []
        for command, name, args in (
            ("HSET", held, sets),
            ("HDEL", held, dels),
            ("SADD", shared, adds),
            ("SREM", shared, gone),
        ):
            if args:
                commands.append((command, name, *args))
        keys = b"".join(key for key, _ in items)
        commands.append(self._xadd(namespace, fp, {"n": node, "k": keys, "c": bytes(codes)}))
        return commands

    def _xadd(self, namespace: str, fp: str, fields: Mapping[str, Any]) -> tuple[Any, ...]:
        stream = self.stream_key(namespace, fp)
        flat = [x for kv in fields.items() for x in kv]
        return ("XADD", stream, "MAXLEN", "~", STREAM_ENTRIES, "*", *flat)

    def add(
        self,
        namespace: str,
        fp: str,
        node: str,
        keys: Sequence[BlockKey],
        medium: Medium = Medium.MEMORY,
    ) -> None:
        """Record that ``node`` holds ``keys`` in ``medium`` (and refresh its lease)."""
        self.publish(namespace, fp, node, {k: (Medium.NONE, medium) for k in keys})

    def remove(self, namespace: str, fp: str, node: str, keys: Sequence[BlockKey]) -> None:
        """Record that ``node`` no longer holds ``keys`` (the shared set is left alone)."""
        self.publish(namespace, fp, node, {k: (Medium.MEMORY, Medium.NONE) for k in keys})

    def replace(
        self,
        namespace: str,
        fp: str,
        node: str,
        keys: Sequence[BlockKey] | Sequence[tuple[BlockKey, Medium]],
        layout: Mapping[str, Any] | None = None,
        shared: Sequence[BlockKey] = (),
    ) -> None:
        """``node`` holds exactly ``keys`` (each a key, held in memory, or a ``(key,
        medium)`` pair): written again after Redis came back or lost the node's hash.
        ``layout``: the layout's description, written beside them (for readers that
        find layouts in the index). ``shared``: keys the node knows the shared tier
        holds (added to the shared set, whatever their nearest copy)."""
        media = [k if isinstance(k, tuple) else (k, Medium.MEMORY) for k in keys]
        commands: list[tuple[Any, ...]] = [
            ("DEL", self._held_key(namespace, fp, node)),
            self._xadd(namespace, fp, {"n": node, "r": "1"}),
        ]
        if layout is not None:
            commands.append(("SET", self._layout_key(namespace, fp), json.dumps(dict(layout))))
        changes = [(BlockKey(k), (Medium.NONE, m)) for k, m in media]
        copies = dict.fromkeys(shared, 1)
        for start in range(0, len(changes), _BATCH):
            chunk = changes[start : start + _BATCH]
            commands += self._publish_chunk(namespace, fp, node, chunk, copies)
        commands.append(("PEXPIRE", self._held_key(namespace, fp, node), self._lease_ms))
        self._pipeline(commands)

    def refresh(self, namespace: str, fp: str, node: str) -> bool:
        """Extend the lease of ``node``'s entries; False if Redis has none of them (it
        restarted empty, say: the node must write them all again)."""
        (found,) = self._pipeline(
            [("PEXPIRE", self._held_key(namespace, fp, node), self._lease_ms)]
        )
        return bool(found)

    def leave(self, node: str, stores: Sequence[tuple[str, str]]) -> None:
        """``node`` is leaving: its entries go now rather than at the end of the lease."""
        commands: list[tuple[Any, ...]] = []
        for ns, fp in stores:
            commands += [
                ("DEL", self._held_key(ns, fp, node)),
                self._xadd(ns, fp, {"n": node, "r": "1"}),
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
                NodeSpeeds.decode(fields.get("speeds")),
            )
        if gone:  # leases that ran out: tidy the enumeration (the entries expired already)
            self._pipeline([("ZREM", self._nodes_key, *gone)])
        return live

    def stores(self) -> list[IndexedStore]:
        """Every (namespace, layout) some node lists blocks of, with its blocks per node
        and its layout's description; read-only (``SCAN``, ``HLEN``, ``GET``)."""
        pattern = f"{_glob_escape(self._prefix)}:*:held:*"
        try:
            names = list(self._connection().scan_iter(match=pattern, count=_BATCH))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TierError(f"cluster index (Redis) unavailable: {mask_text(str(exc))}") from None
        held: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for raw in names:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            parts = name[len(self._prefix) + 1 :].split(":", 3)  # ns, fp, "held", node
            if len(parts) == 4 and parts[2] == "held":
                held.setdefault((parts[0], parts[1]), []).append((name, parts[3]))
        order = sorted(held)
        lengths = iter(self._pipeline([("HLEN", name) for k in order for name, _ in held[k]]))
        layouts = self._pipeline([("GET", self._layout_key(ns, fp)) for ns, fp in order])
        out = []
        for (ns, fp), layout in zip(order, layouts, strict=True):
            blocks = {node: int(next(lengths)) for _, node in held[(ns, fp)]}
            out.append(IndexedStore(ns, fp, blocks, _description(layout)))
        return out

    def locate(
        self, namespace: str, fp: str, keys: Sequence[BlockKey], nodes: Sequence[str]
    ) -> dict[str, list[bool]]:
        """For each of ``nodes``: which of ``keys`` it holds, asked of Redis (one
        ``HMGET`` per node, pipelined; readers that look up often keep an
        :class:`~kvstore.cluster.view.IndexView` instead)."""
        if not keys or not nodes:
            return {n: [False] * len(keys) for n in nodes}
        chunks = list(_chunks(keys))
        commands = [
            ("HMGET", self._held_key(namespace, fp, node), *chunk)
            for node in nodes
            for chunk in chunks
        ]
        replies = iter(self._pipeline(commands))
        found: dict[str, list[bool]] = {}
        for node in nodes:
            flags: list[bool] = []
            for _ in chunks:
                flags += [x is not None for x in next(replies)]
            found[node] = flags
        return found

    # -- readers of the whole index ---------------------------------------------------
    def snapshot(self, namespace: str, fp: str, nodes: Sequence[str]) -> Snapshot:
        """What Redis holds for one store now, and the stream position to follow from
        (taken first: a change made while the snapshot is read is then read twice,
        which applying changes in order makes harmless)."""
        (last,) = self._pipeline(
            [("XREVRANGE", self.stream_key(namespace, fp), "+", "-", "COUNT", 1)]
        )
        snap = Snapshot(_entry_id(last[0][0]) if last else "0-0")
        replies = self._pipeline(
            [("HGETALL", self._held_key(namespace, fp, n)) for n in nodes]
            + [("SMEMBERS", self._shared_key(namespace, fp))]
        )
        for node, held in zip(nodes, replies, strict=False):
            snap.held[node] = {
                BlockKey(bytes(k)): _CODE_MEDIUM.get(bytes(v), Medium.MEMORY)
                for k, v in _mapping(held).items()
            }
        snap.shared = {BlockKey(bytes(k)) for k in replies[-1]}
        return snap

    def read_changes(
        self, namespace: str, fp: str, after: str, block_ms: int, count: int = 256
    ) -> list[tuple[str, Change]]:
        """Stream entries after position ``after``, waiting up to ``block_ms`` for the
        first; ``(position, change)`` each."""
        assert block_ms < _TIMEOUT * 1000, "a blocking read must end before the socket timeout"
        stream = self.stream_key(namespace, fp)
        try:
            reply = self._connection().xread({stream: after}, count=count, block=block_ms)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise TierError(f"cluster index (Redis) unavailable: {mask_text(str(exc))}") from None
        out: list[tuple[str, Change]] = []
        for _, entries in _stream_rows(reply):
            for entry_id, fields in entries:
                out.append((_entry_id(entry_id), decode_change(_mapping(fields))))
        return out

    def stream_start(self, namespace: str, fp: str) -> str | None:
        """The position of the oldest entry the stream keeps (``"0-0"``: it is empty),
        or None when there is no stream (Redis restarted empty)."""
        stream = self.stream_key(namespace, fp)
        exists, first = self._pipeline(
            [("EXISTS", stream), ("XRANGE", stream, "-", "+", "COUNT", 1)]
        )
        if not exists:
            return None
        return _entry_id(first[0][0]) if first else "0-0"

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


def _shared_move(before: Medium, now: Medium) -> int:
    """Whether a key entered (+1) or left (-1) the shared set by its nearest copy alone
    (a change published without shared copies): it is ``SHARED`` now and was not, or
    was ``SHARED`` and has no copy left."""
    if now == Medium.SHARED and before != Medium.SHARED:
        return 1
    return -1 if now == Medium.NONE and before == Medium.SHARED else 0


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a ``SCAN MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _description(raw: Any) -> dict[str, Any] | None:
    """A layout description written by :meth:`ClusterIndex.replace` (None: absent or
    unreadable: a reader then asks for the layout's flags)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


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


def _entry_id(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _mapping(raw: Any) -> dict[bytes, bytes]:
    """A hash reply as a dict, whether redis-py parsed it (dict) or not (flat list)."""
    if isinstance(raw, dict):
        return raw
    items = list(raw or [])
    return dict(zip(items[0::2], items[1::2], strict=True))


def _stream_rows(reply: Any) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """``XREAD``'s reply as ``[(stream, [(id, fields), ...])]`` (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(name, list(rows)) for name, rows in reply.items()]
    return [(row[0], list(row[1])) for row in reply]
