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

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ClusterIndex", "ClusterNode", "ClusterTier", "NodeInfo", "NodeSpeeds", "Router"]

_EXPORTS = {
    "ClusterIndex": "kvstore.cluster.index",
    "NodeInfo": "kvstore.cluster.index",
    "NodeSpeeds": "kvstore.cluster.speeds",
    "ClusterTier": "kvstore.cluster.tier",
    "ClusterNode": "kvstore.cluster.node",
    "Router": "kvstore.cluster.router",
}

if TYPE_CHECKING:
    from kvstore.cluster.index import ClusterIndex, NodeInfo
    from kvstore.cluster.node import ClusterNode
    from kvstore.cluster.router import Router
    from kvstore.cluster.speeds import NodeSpeeds
    from kvstore.cluster.tier import ClusterTier


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
