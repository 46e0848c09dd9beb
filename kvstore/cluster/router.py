"""Cache-aware routing: send a prompt to the node that already holds its prefix.

>>> router = Router(store_config.cluster, layout)
>>> ranked = router.rank(keys)          # or router.rank_tokens(token_ids, namespace)
>>> ranked[0].node_id, ranked[0].prefix_blocks

Nodes are ranked by the number of leading chunks of the prompt they hold (the
prefill they would skip), then by the load each reported in its last heartbeat,
then by id. ``load_weight`` trades the two: a node's score is its prefix minus
``load_weight`` times its load (requests per second), so a busy node holding a
long prefix can lose to an idle one holding a slightly shorter one (0, the
default: the longest prefix always wins, load breaks ties). One ``SMISMEMBER``
per live node, pipelined: a 128K-token prompt (512 chunks) on a handful of
nodes is one Redis round trip; the list of live nodes is read once a heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.config import ClusterConfig
from kvstore.keys import BlockKey, Namespace, chain_keys, check_keys, tokens_to_bytes
from kvstore.layout import KVLayout

__all__ = ["NodeRank", "Router"]


@dataclass(frozen=True)
class NodeRank:
    """One node's standing for a prompt."""

    node_id: str
    advertise: str | None
    prefix_blocks: int
    load: float


class Router:
    """Ranks the live nodes of a cluster for prompts of one layout and namespace."""

    def __init__(
        self,
        cluster: ClusterConfig,
        layout: KVLayout,
        namespace: str | None = None,
        index: ClusterIndex | None = None,
        load_weight: float = 0.0,
    ) -> None:
        self.cluster = cluster
        self.layout = layout
        self.namespace = namespace or cluster.namespace
        self.index = index if index is not None else ClusterIndex(cluster)
        self.load_weight = load_weight
        self._owns_index = index is None
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = -1e9

    def _live(self) -> dict[str, NodeInfo]:
        now = time.monotonic()
        if now - self._nodes_at >= self.cluster.heartbeat_s:
            self._nodes, self._nodes_at = self.index.live_nodes(), now
        return self._nodes

    def rank(self, keys: Sequence[BlockKey]) -> list[NodeRank]:
        """Every live node, best first (see the module docstring)."""
        keys = check_keys(keys)
        nodes = self._live()
        fp = self.layout.fingerprint_hex
        found = self.index.locate(self.namespace, fp, keys, list(nodes))
        ranks = [
            NodeRank(name, info.advertise, _leading(found[name]), info.load)
            for name, info in nodes.items()
        ]
        weight = self.load_weight
        return sorted(
            ranks, key=lambda r: (-(r.prefix_blocks - weight * r.load), r.load, r.node_id)
        )

    def rank_tokens(self, token_ids: Any, namespace: Namespace) -> list[NodeRank]:
        """:meth:`rank` for a prompt's tokens, hashed as the engines hash them in
        ``namespace`` (a trailing partial chunk has no key)."""
        namespace.check_layout(self.layout)
        step = self.layout.block_tokens
        full = None
        if isinstance(token_ids, (list, tuple)):
            full = len(token_ids) - len(token_ids) % step
        return self.rank(chain_keys(tokens_to_bytes(token_ids, limit=full), step, namespace.seed))

    def best(self, keys: Sequence[BlockKey]) -> NodeRank | None:
        """The node to send the prompt to (None: no node is alive)."""
        ranked = self.rank(keys)
        return ranked[0] if ranked else None

    def close(self) -> None:
        """Drop the Redis connections (idempotent)."""
        if self._owns_index:
            self.index.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leading(flags: list[bool]) -> int:
    return next((i for i, held in enumerate(flags) if not held), len(flags))
