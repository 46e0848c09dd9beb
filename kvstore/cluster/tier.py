"""The other nodes of a cluster as a store's last tier.

``contains`` asks the shared index which live peers hold the keys; ``get``
fetches each block from the least-loaded peer that holds it, through that
peer's kvstore-server (shared memory when the peer runs on this host, layer
ranges when the consumer asks for layers), and falls back to the next holder
when one fails or answers too slowly (``peer_timeout_s``). Every block is
verified on arrival by the client; a peer that turns out not to hold a block
it was listed with is removed from the index (the hint is repaired). Fetches
count towards the block's cluster-wide heat; keys that get hot are offered to
the node's replicator (:attr:`ClusterTier.hot`).

The tier never stores or deletes anything on a peer: ``put`` stores nothing
(the store keeps new blocks in its own tiers, and in S3), ``delete`` only
forgets. It is ``shared`` (the manager asks it about keys its index lacks),
not ``local`` (its blocks are not this node's to publish) and not
``promotable`` (copies of other nodes' blocks are the replicator's call).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvstore.client import Client, ClientOptions
from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.config import ClusterConfig
from kvstore.config.tiers import ClusterTierConfig
from kvstore.errors import AccessDeniedError, TierError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import LayerRange, Tier
from kvstore.tiers.remote_common import Counters, check_get_args

__all__ = ["ClusterTier"]

log = logging.getLogger(__name__)

_WHERE_ENTRIES = 65536  # recent index answers kept (expired ones are dropped past this)
_COUNTERS = (
    "lookups",
    "fetched",
    "layer_requests",
    "fetch_failures",
    "stale_hints",
    "peer_errors",
    "hot",
)


class ClusterTier(Tier):
    """Blocks held by the other live nodes of a cluster (see the module docstring)."""

    kind = "cluster"
    persistent = False
    shared = True
    local = False
    promotable = False

    def __init__(
        self,
        layout: KVLayout,
        cluster: ClusterConfig,
        namespace: str,
        index: ClusterIndex | None = None,
    ) -> None:
        super().__init__(ClusterTierConfig(), layout)
        self.cluster = cluster
        self.namespace = namespace
        self.index = index if index is not None else ClusterIndex(cluster)
        self._owns_index = index is None
        self._fp = layout.fingerprint_hex
        self._secret = cluster.secret()
        self._peers: dict[str, Client] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = -1e9
        # key -> (expiry, holders): recent answers of the index (see holders()).
        self._where: dict[BlockKey, tuple[float, list[NodeInfo]]] = {}
        self._lock = threading.Lock()  # guards _peers, _nodes, _nodes_at, _where and hot
        self._counters = Counters(_COUNTERS)
        #: Keys fetched that are hot cluster-wide (drained by the node's replicator).
        self.hot: set[BlockKey] = set()
        self._closed = False

    @property
    def capacity_blocks(self) -> int:
        return self.config.capacity // self.layout.block_nbytes

    # -- peers --------------------------------------------------------------------
    def peers(self) -> dict[str, NodeInfo]:
        """Live nodes other than this one that serve blocks (refreshed once a heartbeat)."""
        now = time.monotonic()
        with self._lock:
            if now - self._nodes_at < self.cluster.heartbeat_s:
                return dict(self._nodes)
        live = self.index.live_nodes()
        me = self.cluster.node
        nodes = {n: info for n, info in live.items() if n != me and info.advertise}
        with self._lock:
            self._nodes, self._nodes_at = nodes, now
        return dict(nodes)

    def _client(self, info: NodeInfo) -> Client:
        assert info.advertise is not None
        with self._lock:
            client = self._peers.get(info.advertise)
            if client is None:
                timeout = self.cluster.peer_timeout_s
                options = ClientOptions(
                    address=info.advertise,
                    namespace=self.namespace,
                    token=self._secret,
                    pool_size=4,
                    connect_timeout=min(timeout, 2.0),
                    timeout=timeout,
                    retry_interval=max(1.0, self.cluster.heartbeat_s),
                )
                client = self._peers[info.advertise] = Client(self.layout, options)
            return client

    def holders(self, keys: Sequence[BlockKey], fresh: bool = False) -> list[list[NodeInfo]]:
        """For each key, the live peers listed as holding it, least loaded first.

        Answers found in the last ``heartbeat_s`` are reused (a layer-by-layer load
        asks for the same blocks once per layer); ``fresh`` asks Redis regardless.
        """
        now = time.monotonic()
        with self._lock:
            known = (
                {} if fresh else {k: v for k in keys if (v := self._where.get(k)) and v[0] > now}
            )
        missing = [k for k in dict.fromkeys(keys) if k not in known]
        if missing:
            nodes = self.peers()
            found = self.index.locate(self.namespace, self._fp, missing, list(nodes))
            ranked = sorted(nodes.values(), key=lambda n: (n.load, n.node_id))
            expiry = now + self.cluster.heartbeat_s
            for i, key in enumerate(missing):
                known[key] = (expiry, [n for n in ranked if found[n.node_id][i]])
            with self._lock:
                if len(self._where) > _WHERE_ENTRIES:
                    self._where = {k: v for k, v in self._where.items() if v[0] > now}
                self._where.update((k, known[k]) for k in missing)
        return [known[k][1] for k in keys]

    def _forget_where(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._where.pop(key, None)

    # -- the primitives -------------------------------------------------------------
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._counters.add("lookups")
        return [bool(h) for h in self.holders(keys)]

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        check_get_args(self.layout, keys, outs, layers)
        holders = self.holders(keys)
        done = [False] * len(keys)
        tried: list[set[str]] = [set() for _ in keys]
        while True:
            plan = self._next_round(holders, tried, done)
            if not plan:
                break
            for node, idxs in plan.items():
                self._fetch(
                    node, [keys[i] for i in idxs], [outs[i] for i in idxs], layers, idxs, done
                )
        fetched = [k for k, ok in zip(keys, done, strict=True) if ok]
        self._counters.add("fetch_failures", len(keys) - len(fetched))
        if layers is not None:
            self._counters.add("layer_requests", len(fetched))
        # A block loaded layer by layer is one fetch (counted at its first layer), not one
        # per layer: heat counts loads of a block, whatever their granularity.
        if layers is None or layers[0] == 0:
            self._counters.add("fetched", len(fetched))
            self._note_heat(fetched)
        return done

    @staticmethod
    def _next_round(
        holders: list[list[NodeInfo]], tried: list[set[str]], done: list[bool]
    ) -> dict[NodeInfo, list[int]]:
        """Each key not yet fetched, to its next untried holder."""
        plan: dict[NodeInfo, list[int]] = {}
        for i, nodes in enumerate(holders):
            if done[i]:
                continue
            node = next((n for n in nodes if n.node_id not in tried[i]), None)
            if node is not None:
                tried[i].add(node.node_id)
                plan.setdefault(node, []).append(i)
        return plan

    def _fetch(
        self,
        node: NodeInfo,
        keys: list[BlockKey],
        outs: list[torch.Tensor],
        layers: LayerRange,
        idxs: list[int],
        done: list[bool],
    ) -> None:
        """Fetch ``keys`` from ``node``; mark ``done``; repair stale hints."""
        try:
            got = self._client(node).get(keys, outs, layers)
        except (TierError, AccessDeniedError) as exc:  # down, slow, or refusing: next holder
            self._forget_where(keys)
            self._counters.add("peer_errors")
            log.warning("cluster: peer %s (%s) failed: %s", node.node_id, node.advertise, exc)
            return
        stale = [k for k, ok in zip(keys, got, strict=True) if not ok]
        for i, ok in zip(idxs, got, strict=True):
            done[i] = ok
        if stale:
            self._forget_where(stale)
            self._counters.add("stale_hints", len(stale))
            # A hint left stale (Redis away) costs one more failed fetch, nothing more.
            with contextlib.suppress(TierError):
                self.index.forget(self.namespace, self._fp, node.node_id, stale)

    def _note_heat(self, keys: list[BlockKey]) -> None:
        if not keys:
            return
        try:
            heat = self.index.heat(self.namespace, self._fp, keys)
        except TierError:
            return
        hot = [k for k, h in zip(keys, heat, strict=True) if h >= self.cluster.hot_threshold]
        if hot:
            self._counters.add("hot", len(hot))
            with self._lock:
                self.hot.update(hot)

    def take_hot(self) -> list[BlockKey]:
        """Keys that became hot since the last call (for the replicator)."""
        with self._lock:
            hot, self.hot = list(self.hot), set()
        return hot

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        return [False] * len(keys)  # peers' tiers are theirs: nothing is pushed to them

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Nothing to delete on peers (their blocks are theirs)."""

    def stored_keys(self) -> Iterator[BlockKey]:
        return iter([])

    def stats(self) -> dict[str, Any]:
        with self._lock:
            peers = sorted(self._nodes)
        return {**self._counters.snapshot(), "node": self.cluster.node, "peers": peers}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for client in peers:
            client.close()
        if self._owns_index:
            self.index.close()
