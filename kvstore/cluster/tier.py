"""The other nodes of a cluster as a store's last tier.

``contains`` asks this process's copy of the shared index
(:class:`~kvstore.cluster.view.IndexView`, no network round trip) which live
peers hold the keys; ``get`` fetches each block from the peer that holds it
nearest (memory before disk), least loaded first, through that peer's
kvstore-server (shared memory when the peer runs on this host, layer
ranges when the consumer asks for layers), and falls back to the next holder
when one fails or answers too slowly (``peer_timeout_s``); keys that no holder
the copy names could give are asked about in Redis itself before the get gives
up (``redis_rechecks``): the copy trails Redis by the stream's lag, and by a
node's re-registration, so a lookup's "held" stays loadable. Every block is
verified on arrival by the client; a peer that turns out not to hold a block
it was listed with is removed from the index (the hint is repaired). Fetches
count towards the block's cluster-wide heat; keys that get hot are offered to
the node's replicator (:attr:`ClusterTier.hot`). A peer that cannot be reached
(down, or refusing this node's token) is logged once until it answers again,
and counted (``peer_errors``, ``peer_auth_failures``, ``unreachable_peers``); a
refusal is also what a get that found no other copy says
(:meth:`ClusterTier.refusal`), never "not stored".

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
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvstore.client import Client, ClientOptions
from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.cluster.view import IndexView
from kvstore.config import ClusterConfig, ClusterTierConfig
from kvstore.errors import AccessDeniedError, TierError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.tiers import Counters, check_get_args
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["ClusterTier"]

log = logging.getLogger(__name__)

_COUNTERS = (
    "lookups",
    "fetched",
    "layer_requests",
    "fetch_failures",
    "stale_hints",
    "peer_errors",
    "peer_auth_failures",
    "hot",
    "redis_rechecks",
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
        self._view: IndexView | None = None
        self._failing: set[str] = set()  # peers that failed since they last answered
        self._refusals: dict[str, str] = {}  # of those, the ones refusing the token: why
        self._lock = threading.Lock()  # guards _peers, _view, _failing, _refusals and hot
        self._counters = Counters(_COUNTERS)
        #: Keys fetched that are hot cluster-wide (drained by the node's replicator).
        self.hot: set[BlockKey] = set()
        self._closed = False

    @property
    def capacity_blocks(self) -> int:
        return self.config.capacity // self.layout.block_nbytes

    # -- peers --------------------------------------------------------------------
    def index_view(self) -> IndexView:
        """This process's copy of the store's shared index (loaded on first use).
        Raises :class:`TierError` if Redis cannot be reached for the first load."""
        with self._lock:
            view = self._view
            if view is None:
                view = self._view = IndexView(self.index, self.namespace, self._fp)
                starting = True
            else:
                starting = False
        if starting:
            view.start()
        return view

    def peers(self) -> dict[str, NodeInfo]:
        """Live nodes other than this one that serve blocks."""
        me = self.cluster.node
        return {n: i for n, i in self.index_view().nodes().items() if n != me and i.advertise}

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
        """For each key, the live peers listed as holding it: those holding it in
        memory first, then on disk, each least loaded first. ``fresh`` asks Redis
        rather than the in-memory copy (the replicator's decisions)."""
        me = self.cluster.node
        if fresh:
            nodes = self.index.live_nodes()
            peers = sorted(
                (i for n, i in nodes.items() if n != me and i.advertise),
                key=lambda n: (n.load, n.node_id),
            )
            found = self.index.locate(self.namespace, self._fp, keys, [n.node_id for n in peers])
            return [[n for n in peers if found[n.node_id][i]] for i in range(len(keys))]
        out = []
        for holdings in self.index_view().holders(keys):
            usable = [h for h in holdings if h.node.node_id != me and h.node.advertise]
            usable.sort(key=lambda h: (-h.medium, h.node.load, h.node.node_id))
            out.append([h.node for h in usable])
        return out

    # -- the primitives -------------------------------------------------------------
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._counters.add("lookups")
        me = self.cluster.node
        return self.index_view().held(keys, lambda i: i.node_id != me and bool(i.advertise))

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        check_get_args(self.layout, keys, outs, layers)
        holders = self.holders(keys)
        done = [False] * len(keys)
        tried: list[set[str]] = [set() for _ in keys]
        self._fetch_all(keys, outs, layers, (holders, tried, done))
        if not all(done) and self._ask_redis(keys, holders, done):
            self._fetch_all(keys, outs, layers, (holders, tried, done))
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

    def _fetch_all(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange,
        state: tuple[list[list[NodeInfo]], list[set[str]], list[bool]],
    ) -> None:
        """Fetch each key not ``done`` from its holders in turn until one gives it
        (``state``: the holders of each key, the nodes tried for it, and ``done``)."""
        holders, tried, done = state
        while True:
            plan = self._next_round(holders, tried, done)
            if not plan:
                return
            for node, idxs in plan.items():
                self._fetch(
                    node, [keys[i] for i in idxs], [outs[i] for i in idxs], layers, idxs, done
                )

    def _ask_redis(
        self, keys: Sequence[BlockKey], holders: list[list[NodeInfo]], done: list[bool]
    ) -> bool:
        """Ask Redis itself who holds the keys not fetched (``holders`` gains them); True
        if that named a node not tried yet.

        This process's copy of the index trails Redis: by the stream's lag, and while a
        node registers again (its old entries are void from its reset entry on, its new
        ones arrive in the entries after) or the copy reloads. A lookup answered from the
        copy just before may have said "held"; the get must not fail on the copy's word
        alone while Redis still lists a live holder. Costs two round trips, on a miss only.
        """
        missing = [i for i, ok in enumerate(done) if not ok]
        try:
            fresh = self.holders([keys[i] for i in missing], fresh=True)
        except TierError:  # Redis away: the copy is all there is
            return False
        self._counters.add("redis_rechecks")
        gained = False
        for i, nodes in zip(missing, fresh, strict=True):
            known = {n.node_id for n in holders[i]}  # tried already, all of them
            new = [n for n in nodes if n.node_id not in known]
            holders[i] = holders[i] + new
            gained = gained or bool(new)
        return gained

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
            self._peer_failed(node, exc)
            return
        self._peer_answered(node)
        stale = [k for k, ok in zip(keys, got, strict=True) if not ok]
        for i, ok in zip(idxs, got, strict=True):
            done[i] = ok
        if stale:
            self._counters.add("stale_hints", len(stale))
            # A hint left stale (Redis away) costs one more failed fetch, nothing more.
            with contextlib.suppress(TierError):
                self.index.forget(self.namespace, self._fp, node.node_id, stale)

    def _peer_failed(self, node: NodeInfo, exc: Exception) -> None:
        """Count a failure; say so in the log once until the peer answers again."""
        denied = isinstance(exc, AccessDeniedError)
        self._counters.add("peer_auth_failures" if denied else "peer_errors")
        with self._lock:
            first = node.node_id not in self._failing
            self._failing.add(node.node_id)
            if denied:
                self._refusals[node.node_id] = f"cluster peer {node.node_id}: {exc}"
            else:
                self._refusals.pop(node.node_id, None)
        if first:
            why = (
                "refused this node's token (give every node the same server token, or set "
                f"cluster.token to one that opens namespace {self.namespace!r} on every node)"
                if denied
                else "cannot be reached"
            )
            log.warning(
                "cluster: peer %s (%s) %s: %s; its blocks come from other holders or S3",
                node.node_id,
                node.advertise,
                why,
                exc,
            )

    def _peer_answered(self, node: NodeInfo) -> None:
        with self._lock:
            if node.node_id not in self._failing:
                return
            self._failing.discard(node.node_id)
            self._refusals.pop(node.node_id, None)
        log.info("cluster: peer %s (%s) answers again", node.node_id, node.advertise)

    def refusal(self) -> str | None:
        """A peer that refuses this node's token, and why (one line); None if none does."""
        with self._lock:
            return next(iter(self._refusals.values()), None)

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
            view, failing = self._view, sorted(self._failing)
        peers = sorted(n for n in view.nodes() if n != self.cluster.node) if view else []
        index = {"index_synced": view.synced, "index_reloads": view.reloads} if view else {}
        return {
            **self._counters.snapshot(),
            "node": self.cluster.node,
            "peers": peers,
            "unreachable_peers": failing,
            **index,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            view, self._view = self._view, None
        for client in peers:
            client.close()
        if view is not None:
            view.close()
        if self._owns_index:
            self.index.close()
