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

from kvstore._values import (
    parse_bool,
    parse_float,
    parse_int,
    parse_optional_str,
    parse_str,
)
from kvstore.config._fields import check_positive, opt
from kvstore.config.tiers import check_address, check_namespace
from kvstore.errors import ConfigError

__all__ = ["ClusterConfig"]


@dataclass(frozen=True)
class ClusterConfig:
    """Membership in a cluster of kvstore nodes (see the module docstring).

    ``node_id`` (default: the host name) names this node; ``advertise`` is the
    ``HOST:PORT`` of its kvstore-server (None: this node fetches from the others
    but serves nothing to them). ``redis_url`` (``redis://`` or ``rediss://``;
    ``redis_cluster`` for Redis Cluster) holds the shared index under ``name``.
    A node's entries live ``heartbeat_s * lease_heartbeats`` seconds past its
    last heartbeat. Blocks fetched at least ``hot_threshold`` times by other
    nodes (a count halved every ``heat_half_life_s``) get copies on up to
    ``replicas`` nodes; a copy whose heat fell below half the threshold goes.
    A peer that has not answered in ``peer_timeout_s`` is skipped.
    ``namespace`` and ``token`` / ``token_file`` are what this node uses on its
    peers' servers.
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
    token: str | None = opt(None, parse_optional_str)
    token_file: str | None = opt(None, parse_optional_str)

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
