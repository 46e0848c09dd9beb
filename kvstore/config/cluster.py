"""The ``cluster:`` section: how a node joins the others through Redis.

::

    cluster:
      node_id: node-a                 # unique in the cluster
      advertise: 10.0.0.5:7070        # where peers reach this node's kvstore-server
      redis_url: redis://10.0.0.9:6379/0
      heartbeat_s: 2.0
      replicas: 2

A store whose config has a ``redis_url`` here sees every other node's blocks
(through the shared index in Redis) as its last tier, and a kvstore-server with
one also publishes its own blocks there. The S3 tier every node lists in its
``tiers`` is the shared cold tier. Read from the same YAML / env as the rest
(``KVSTORE_CLUSTER_REDIS_URL``, ...).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from kvstore.config._fields import check_positive, opt
from kvstore.config.tiers import check_address, check_namespace
from kvstore.config.values import (
    parse_bool,
    parse_float,
    parse_int,
    parse_optional_secret,
    parse_optional_str,
    parse_str,
)
from kvstore.errors import ConfigError

__all__ = ["ClusterConfig"]


@dataclass(frozen=True)
class ClusterConfig:
    """Membership in a cluster of kvstore nodes (docs/cluster.md shows it in context).

    ``redis_url``: the Redis holding the shared index (``redis://``,
    ``rediss://`` for TLS, or ``unix://``); None: this node is standalone.

    ``redis_cluster``: ``redis_url`` names a node of a Redis Cluster.

    ``name``: the prefix of every Redis key, so several clusters can share a Redis.

    ``node_id``: this node's id, unique in the cluster (letters, digits, ``.``,
    ``_``, ``-``, ``:``); empty: the host name.

    ``advertise``: the ``HOST:PORT`` where peers reach this node's
    kvstore-server (a server defaults it to its TCP listen address unless that
    is a wildcard); None: this node fetches from the others but serves nothing
    to them.

    ``heartbeat_s``: how often a node renews its lease and publishes the blocks
    its tiers gained and lost.

    ``lease_heartbeats``: a node's entries live ``heartbeat_s *
    lease_heartbeats`` seconds past its last heartbeat, so a killed node
    leaves the index within that time.

    ``replicas``: the most nodes that hold a copy of a hot block.

    ``hot_threshold``: blocks fetched at least this many times by other nodes
    (a count halved every ``heat_half_life_s``) get copies on up to
    ``replicas`` nodes; a copy whose heat fell below half the threshold goes.

    ``heat_half_life_s``: the cluster-wide fetch count halves this often (seconds).

    ``peer_timeout_s``: a peer that has not answered within this many seconds
    is skipped; the next holder, or S3, serves.

    ``namespace``: the namespace this node uses on its peers' servers.

    ``token`` / ``token_file``: the token of the peers' servers (the same on
    every node), inline or in a file (its first line). Unset: the server's own
    ``server.token`` / ``server.token_file``, so one token setting serves both.

    ``route_memory_weight`` / ``route_disk_weight`` / ``route_shared_weight``:
    what a chunk of a prompt's prefix is worth to the router when a node would
    load it from its own memory, its own disk, or the shared S3 tier (see
    :mod:`kvstore.cluster.router`).
    """

    redis_url: str | None = opt(None, parse_optional_str)
    redis_cluster: bool = opt(False, parse_bool)
    name: str = opt("kvstore", parse_str)
    node_id: str = opt("", lambda value, key: "" if value in (None, "") else parse_str(value, key))
    advertise: str | None = opt(None, parse_optional_str)
    heartbeat_s: float = opt(2.0, parse_float)
    lease_heartbeats: int = opt(3, parse_int)
    replicas: int = opt(2, parse_int)
    hot_threshold: int = opt(8, parse_int)
    heat_half_life_s: float = opt(60.0, parse_float)
    peer_timeout_s: float = opt(2.0, parse_float)
    namespace: str = opt("default", parse_str)
    token: str | None = opt(None, parse_optional_secret)
    token_file: str | None = opt(None, parse_optional_str)
    route_memory_weight: float = opt(1.0, parse_float)
    route_disk_weight: float = opt(0.6, parse_float)
    route_shared_weight: float = opt(0.3, parse_float)

    @property
    def enabled(self) -> bool:
        """True when this node is part of a cluster (a Redis is named)."""
        return self.redis_url is not None

    @property
    def node(self) -> str:
        """This node's id (the host name when none is configured)."""
        return self.node_id or socket.gethostname()

    @property
    def lease_s(self) -> float:
        """How long a node's entries outlive its last heartbeat."""
        return self.heartbeat_s * self.lease_heartbeats

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` (naming ``path.key``) for impossible values."""
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(f"{path}.redis_url: expected redis://, rediss:// or unix://")
        if self.advertise is not None:
            check_address(self.advertise, f"{path}.advertise")
        if not all(c.isalnum() or c in "._-:" for c in self.node or "?"):
            raise ConfigError(f"{path}.node_id: letters, digits, '.', '_', '-', ':' only")
        check_namespace(self.namespace, f"{path}.namespace")
        if self.token is not None and self.token_file is not None:
            raise ConfigError(f"{path}.token_file: give token or token_file, not both")
        weights = (self.route_memory_weight, self.route_disk_weight, self.route_shared_weight)
        if not all(w >= 0 for w in weights):
            raise ConfigError(f"{path}.route_*_weight: weights must be >= 0")
        check_positive(
            self,
            path,
            "heartbeat_s",
            "lease_heartbeats",
            "replicas",
            "hot_threshold",
            "heat_half_life_s",
            "peer_timeout_s",
        )

    def secret(self) -> bytes | None:
        """The token for peers' servers (read from ``token_file`` if one is named)."""
        if self.token_file is None:
            return None if self.token is None else self.token.encode()
        try:
            with open(self.token_file, encoding="utf-8") as f:
                return f.readline().strip().encode()
        except OSError as exc:
            raise ConfigError(f"cluster.token_file {self.token_file!r}: {exc.strerror}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that the config reads back to an equal section."""
        from dataclasses import asdict

        return asdict(self)
