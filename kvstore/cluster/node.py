"""A kvstore-server's membership in the cluster: heartbeat, registration, replication.

One thread, once per ``heartbeat_s``:

1. **Heartbeat**: the node's address and load, under a lease.
2. **Registration**: for each store the server hosts, the keys whose nearest copy
   changed medium since the last beat (the manager's change feed: gained a copy in
   the node's memory or disk, moved between them, lost them), and those that
   reached S3 or left it (whatever the node itself still holds: a block written
   through to the bucket is in the shared set a beat after it lands there) are
   published to the node's hash in Redis, the shared set and the change stream,
   and the lease is extended. Right after start -- and after Redis was unreachable
   -- the whole hash is written again: entries lost while Redis was down come back
   by themselves.
3. **Replication**: keys this node fetched from peers that turned hot cluster-wide
   (see :class:`~kvstore.cluster.tier.ClusterTier`) are copied into its fastest
   tier while fewer than ``replicas`` live nodes hold them; a copy made that way
   leaves the node's own tiers again once its heat fell below half the threshold
   and another node still holds the block. Only the node's own copies go: the
   block's copy in the shared S3 tier stays (it goes only on an explicit
   ``delete``), so a replica cooling down -- or heat reset by a Redis restart --
   never loses data. Heat is halved every ``heat_half_life_s`` cluster-wide.

Redis being down never stops the node: its own tiers serve on, and it catches up
when Redis is back. ``stop(leave=True)`` removes its entries at once (a SIGTERM'd
server); a killed one's entries expire with their lease.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.cluster.speeds import NodeSpeeds
from kvstore.cluster.tier import ClusterTier
from kvstore.config import ClusterConfig
from kvstore.datapath.contracts import ChangeFeed, Medium
from kvstore.errors import KVStoreError, TierError
from kvstore.keys import BlockKey
from kvstore.store import KVStore

__all__ = ["ClusterNode"]

log = logging.getLogger(__name__)

_HELD = (Medium.MEMORY, Medium.DISK)  # media a node's own hash lists


@dataclass
class _Tracked:
    """A store this node publishes."""

    namespace: str
    store: KVStore
    feed: ChangeFeed
    full_sync: bool = True
    registered: int = 0  # keys in the node's set, as far as this node knows
    replicas: set[BlockKey] = field(default_factory=set)

    @property
    def fp(self) -> str:
        return self.store.layout.fingerprint_hex

    @property
    def cluster_tier(self) -> ClusterTier | None:
        return next(
            (t for t in self.store.engine.datapath.tiers if isinstance(t, ClusterTier)), None
        )


def _speeds(tracked: list[_Tracked]) -> NodeSpeeds:
    """The node's speeds: each figure from the first store that has it."""
    report: dict[str, Any] = {}
    for t in tracked:
        for name, value in t.store.engine.restore_speeds().items():
            if report.get(name) is None:
                report[name] = value
    return NodeSpeeds.of(report)


class ClusterNode:
    """Publishes one server's blocks and keeps their replicas (module docstring)."""

    def __init__(self, config: ClusterConfig, load: Callable[[], float] = lambda: 0.0) -> None:
        self.config = config
        self.index = ClusterIndex(config)
        self._load = load
        self._tracked: list[_Tracked] = []
        self._lock = threading.Lock()  # guards _tracked
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._redis_ok = True
        self.beats = 0

    def track(self, namespace: str, store: KVStore) -> None:
        """Publish ``store``'s blocks (all of them at the next beat, then changes)."""
        tracked = _Tracked(namespace, store, store.engine.datapath.watch(shared_copies=True))
        with self._lock:
            self._tracked.append(tracked)

    def start(self) -> None:
        """Beat now (a new node is visible at once), then every ``heartbeat_s``."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="kvstore-cluster", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self.beat()

    def beat(self) -> None:
        """One heartbeat: liveness, registration, replication. Never raises."""
        with self._lock:
            tracked = list(self._tracked)
        try:
            blocks = sum(len(t.store.engine.datapath) for t in tracked)
            info = NodeInfo(
                self.config.node, self.config.advertise, self._load(), blocks, _speeds(tracked)
            )
            self.index.heartbeat(info)
            for t in tracked:
                self._register(t)
            self._redis_back()
        except TierError as exc:
            self._redis_down(tracked, exc)
            return
        for t in tracked:
            try:
                self._replicate(t)
            except KVStoreError as exc:  # a replication missed is a missed optimisation
                log.warning("cluster: replication in %s failed: %s", t.namespace, exc)
        self.beats += 1

    def _register(self, t: _Tracked) -> None:
        node = self.config.node
        if not t.full_sync and t.registered and not self.index.refresh(t.namespace, t.fp, node):
            t.full_sync = True  # Redis lost the set (restarted empty between two beats)
        if t.full_sync:
            t.feed.drain()  # the full list below includes whatever the feed holds
            media = t.store.engine.datapath.stored_media()
            in_bucket = t.store.engine.datapath.shared_keys()
            layout = t.store.layout.describe()
            self.index.replace(t.namespace, t.fp, node, media, layout, in_bucket)
            t.full_sync = False
            t.registered = sum(1 for _, m in media if m in _HELD)
            return
        changes, shared = t.feed.drain_shared()
        if not changes:
            return
        try:
            self.index.publish(t.namespace, t.fp, node, changes, shared)
        except TierError:
            t.full_sync = True  # the drained changes are lost: write everything next time
            raise
        delta = sum((now in _HELD) - (before in _HELD) for before, now in changes.values())
        t.registered = max(0, t.registered + delta)

    def _redis_down(self, tracked: list[_Tracked], exc: TierError) -> None:
        for t in tracked:
            t.full_sync = True
        if self._redis_ok:
            log.warning("cluster: Redis unreachable (%s); serving from own tiers", exc)
        self._redis_ok = False

    def _redis_back(self) -> None:
        if not self._redis_ok:
            log.info("cluster: Redis is back; this node's blocks are registered again")
        self._redis_ok = True

    # -- replication ----------------------------------------------------------------
    def _replicate(self, t: _Tracked) -> None:
        tier = t.cluster_tier
        if tier is None:
            return
        self.index.decay(t.namespace, t.fp, self.config.heat_half_life_s)
        hot = [k for k in tier.take_hot() if k not in t.replicas]
        if hot:
            holders = [len(h) for h in tier.holders(hot, fresh=True)]
            room = {k: self.config.replicas - n for k, n in zip(hot, holders, strict=True) if n}
            candidates = [k for k, free in room.items() if free > 0]
            won = self.index.claim_replicas(
                t.namespace,
                t.fp,
                candidates,
                [room[k] for k in candidates],
                self.config.heat_half_life_s,
            )
            wanted = [k for k, ok in zip(candidates, won, strict=True) if ok]
            if wanted and t.store.engine.datapath.promote(wanted, 0):
                t.replicas.update(k for k in wanted if 0 in t.store.engine.datapath.where(k))
        self._cool_down(t, tier)

    def _cool_down(self, t: _Tracked, tier: ClusterTier) -> None:
        """Drop replicas that cooled down, where another node still holds the block."""
        if not t.replicas:
            return
        keys = list(t.replicas)
        heat = self.index.heat_of(t.namespace, t.fp, keys)
        cold = [k for k, h in zip(keys, heat, strict=True) if h < self.config.hot_threshold / 2]
        if not cold:
            return
        elsewhere = [k for k, h in zip(cold, tier.holders(cold, fresh=True), strict=True) if h]
        if elsewhere:
            t.store.engine.datapath.drop_local(elsewhere)  # never store.delete: S3's copy stays
        t.replicas.difference_update(cold)

    def replicas(self, namespace: str) -> set[BlockKey]:
        """The copies this node made of other nodes' hot blocks in ``namespace``."""
        with self._lock:
            return {k for t in self._tracked if t.namespace == namespace for k in t.replicas}

    def stop(self, leave: bool = True) -> None:
        """Stop beating; with ``leave``, remove this node's entries now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if leave:
            with self._lock:
                stores = [(t.namespace, t.fp) for t in self._tracked]
            try:
                self.index.leave(self.config.node, stores)
            except TierError as exc:
                log.warning("cluster: could not leave cleanly (%s); entries expire by lease", exc)
        self.index.close()
