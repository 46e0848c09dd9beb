"""``kvstore-server``'s configuration: one type per role, read from one file.

A server's YAML file holds the hosted stores' keys (``tiers``, ``cluster``, ``events``,
``encryption``, ...) and the daemon's own ``server:`` section (listeners, tokens,
tenants, quotas, limits). :class:`DaemonConfig` holds them apart: ``store``, the
:class:`~kvstore.config.StoreConfig` every hosted store opens with, and ``server``, the
:class:`~kvstore.config.server.ServerConfig` only the daemon reads.
:func:`kvstore.config.load_daemon_config` reads one from a file (environment overrides
apply, as to any file).

``StoreConfig.server`` still carries the section for one release, so existing files and
code keep working; the daemon reads :attr:`DaemonConfig.server` only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.config.cluster import ClusterConfig
from kvstore.config.events import EventsConfig
from kvstore.config.server import ServerConfig

if TYPE_CHECKING:
    from kvstore.config import StoreConfig

__all__ = ["DaemonConfig"]


@dataclass(frozen=True)
class DaemonConfig:
    """A server's configuration, by role.

    ``store``: what each hosted store opens with; its ``cluster`` section already
    carries the token peers are reached with (the server's, when the cluster names
    none: the same on every node).

    ``server``: the daemon's own settings (listeners, tokens, tenants, limits).
    """

    store: StoreConfig
    server: ServerConfig

    @classmethod
    def of(cls, config: StoreConfig | DaemonConfig) -> DaemonConfig:
        """Split a whole-file :class:`StoreConfig` (as read before this type) by role."""
        if isinstance(config, DaemonConfig):
            return config
        store = dataclasses.replace(config, cluster=config.peer_cluster())
        return cls(store=store, server=config.server)

    @property
    def cluster(self) -> ClusterConfig:
        """The node's membership in a cluster (the hosted stores' ``cluster`` section)."""
        return self.store.cluster

    @property
    def events(self) -> EventsConfig:
        """KV events of the hosted stores (their ``events`` section)."""
        return self.store.events

    def with_server(self, server: ServerConfig) -> DaemonConfig:
        """This config with new daemon settings (a reload's tenants and tokens)."""
        return dataclasses.replace(self, server=server)
