"""Beyond one node: kvstore nodes sharing an index in Redis and a cold tier in S3.

- :class:`~kvstore.cluster.index.ClusterIndex` -- which node holds which blocks,
  who is alive, what is hot (Redis or Redis Cluster).
- :class:`~kvstore.cluster.tier.ClusterTier` -- the other nodes as a store's last tier.
- :class:`~kvstore.cluster.node.ClusterNode` -- a server's heartbeat, registration
  and replication.
- :class:`~kvstore.cluster.router.Router` -- rank nodes for a prompt (cache-aware routing).

Nothing here is imported by ``import kvstore``; it needs ``redis`` (``kvstore-tiers[redis]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.cluster.catalog import route_layout
    from kvstore.cluster.index import ClusterIndex, NodeInfo
    from kvstore.cluster.node import ClusterNode
    from kvstore.cluster.router import Router
    from kvstore.cluster.speeds import NodeSpeeds
    from kvstore.cluster.tier import ClusterTier

__all__ = [
    "ClusterIndex",
    "ClusterNode",
    "ClusterTier",
    "NodeInfo",
    "NodeSpeeds",
    "Router",
    "route_layout",
]

_EXPORTS = {
    "ClusterIndex": "kvstore.cluster.index",
    "ClusterNode": "kvstore.cluster.node",
    "ClusterTier": "kvstore.cluster.tier",
    "NodeInfo": "kvstore.cluster.index",
    "NodeSpeeds": "kvstore.cluster.speeds",
    "Router": "kvstore.cluster.router",
    "route_layout": "kvstore.cluster.catalog",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
