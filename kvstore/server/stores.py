"""The stores a server hosts: one :class:`~kvstore.store.KVStore` per (namespace, layout).

A namespace is a tenant's partition. Each one gets stores of its own, built
from the server's tier list with the namespace folded into every place the
tiers keep blocks (``<disk path>/ns-<namespace>``, an S3 prefix, a Redis key
prefix), and its own capacity in every tier: one tenant can neither read,
list nor delete another's blocks, nor evict them by filling the cache. A
store opens on the first client that asks for it (finding what its disk tier
kept across restarts) and closes with the server (flushing to disk).

Lock ownership: ``_lock`` guards ``_stores`` and ``_closed``; opening a store
happens under it (on a worker thread, never on the event loop).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.config import (
    DaemonConfig,
    DiskTierConfig,
    HostTierConfig,
    RedisTierConfig,
    S3TierConfig,
    StoreConfig,
    TierConfig,
)
from kvstore.errors import CapacityError, ClosedError
from kvstore.layout import KVLayout
from kvstore.store import KVStore
from kvstore.tiers import SharedSegment, SlabTier
from kvstore.wire import HeaderCache

if TYPE_CHECKING:
    from kvstore.events import EventPublisher

__all__ = ["HostedStore", "StoreRegistry", "namespaced_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostedStore:
    """A store the server hosts, and the shared memory of its host tier (if any)."""

    namespace: str
    layout: KVLayout
    store: KVStore
    segment: SharedSegment | None
    #: Random per segment: a client that mapped another server's (or an earlier
    #: run's) memory sees that this is not it.
    segment_id: str = ""
    #: Wire headers of stored blocks (sending needs no hashing).
    headers: HeaderCache = field(default_factory=lambda: HeaderCache(1024))

    @property
    def label(self) -> str:
        """``namespace/fingerprint`` (for logs and metrics)."""
        return f"{self.namespace}/{self.layout.fingerprint_hex}"


def _namespaced_tier(tier: TierConfig, namespace: str, shared_memory: bool) -> TierConfig:
    if isinstance(tier, DiskTierConfig):
        return dataclasses.replace(tier, path=os.path.join(tier.path, f"ns-{namespace}"))
    if isinstance(tier, S3TierConfig):
        return dataclasses.replace(tier, prefix=f"{tier.prefix}/ns-{namespace}")
    if isinstance(tier, RedisTierConfig):
        return dataclasses.replace(tier, key_prefix=f"{tier.key_prefix}:ns-{namespace}")
    if isinstance(tier, HostTierConfig) and shared_memory:
        return dataclasses.replace(tier, shared_memory=True, pinned=None)
    return tier


def namespaced_config(config: StoreConfig, namespace: str, shared_memory: bool) -> StoreConfig:
    """``config`` with each tier's location made private to ``namespace``.

    ``shared_memory``: the first host tier's slab becomes mappable by clients.
    """
    tiers = []
    shared_done = not shared_memory
    for tier in config.tiers:
        share = not shared_done and isinstance(tier, HostTierConfig)
        shared_done = shared_done or share
        tiers.append(_namespaced_tier(tier, namespace, share))
    cluster = dataclasses.replace(config.cluster, namespace=namespace)
    events = config.events
    if events.token_journal is not None:
        events = dataclasses.replace(events, token_journal=f"{events.token_journal}.{namespace}")
    return dataclasses.replace(config, tiers=tuple(tiers), cluster=cluster, events=events)


def _with_journal(config: StoreConfig, layout: KVLayout) -> StoreConfig:
    """Each hosted store keeps its own token journal (``<journal>.<namespace>.<layout>``)."""
    events = config.events
    if events.token_journal is None:
        return config
    journal = f"{events.token_journal}.{layout.fingerprint_hex[:16]}"
    return dataclasses.replace(config, events=dataclasses.replace(events, token_journal=journal))


class StoreRegistry:
    """Opens, finds and closes the hosted stores (at most ``max_stores``)."""

    def __init__(
        self,
        config: DaemonConfig,
        on_open: Callable[[HostedStore], None] | None = None,
        events: EventPublisher | None = None,
    ) -> None:
        #: What each hosted store opens with (before its namespace is applied).
        self.config = config.store
        self._limits = config.server
        self._on_open = on_open
        #: The server's KV-event publisher, shared by every store it hosts (None: off).
        self._events = events
        #: The publisher of a namespace's store, when not the shared one (a tenant's own).
        self.events_for: Callable[[str], EventPublisher | None] | None = None
        self._stores: dict[tuple[str, bytes], HostedStore] = {}
        #: Stores refused for ``max_stores`` (each said once in the log).
        self._over_limit: set[tuple[str, bytes]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def open(self, namespace: str, layout: KVLayout) -> HostedStore:
        """The store of (``namespace``, ``layout``), opened now if it is not yet.

        Raises :class:`CapacityError` past ``server.max_stores`` and
        :class:`~kvstore.errors.ConfigError` when the layout does not fit the
        tiers (a block larger than a tier).
        """
        key = (namespace, layout.fingerprint)
        with self._lock:
            if self._closed:
                raise ClosedError("the server is shutting down")
            hosted = self._stores.get(key)
            if hosted is not None:
                return hosted
            limit = self._limits.max_stores
            if len(self._stores) >= limit:
                self._say_over_limit(key, f"{namespace}/{layout.fingerprint_hex[:16]}")
                raise CapacityError(
                    f"this server already hosts {limit} store(s), its server.max_stores; "
                    f"namespace {namespace!r} with layout {layout.fingerprint_hex} would be "
                    "one more"
                )
            share = self._limits.shared_memory
            config = _with_journal(namespaced_config(self.config, namespace, share), layout)
            events = self._events if self.events_for is None else self.events_for(namespace)
            store = KVStore(layout, config, events=events)
            first = store.engine.datapath.tiers[0]
            segment = first.segment if isinstance(first, SlabTier) else None
            ident = secrets.token_hex(16) if segment is not None else ""
            # Headers of the blocks memory can hold, twice over, and no fewer than 1024.
            headers = HeaderCache(max(1024, 2 * store.engine.datapath.tiers[0].capacity_blocks))
            hosted = HostedStore(namespace, layout, store, segment, ident, headers)
            self._stores[key] = hosted
            if self._on_open is not None:
                self._on_open(hosted)
        log.info(
            "opened store %s: %d blocks found, tiers %s",
            hosted.label,
            len(store.engine.datapath),
            ", ".join(t.kind for t in store.engine.datapath.tiers),
        )
        return hosted

    def _say_over_limit(self, key: tuple[str, bytes], label: str) -> None:
        """Tell the operator, once per store, that a client's store was refused (the
        client's tier says so too, and retries once per its ``retry_interval``)."""
        if key in self._over_limit:
            return
        self._over_limit.add(key)
        log.warning(
            "refused to open store %s: %d stores are open, server.max_stores; its clients' "
            "puts are not stored and their reads miss until server.max_stores is raised "
            "(in the config; a restart applies it)",
            label,
            len(self._stores),
        )

    def hosted(self) -> list[HostedStore]:
        """The stores open now."""
        with self._lock:
            return list(self._stores.values())

    def stats(self, namespaces: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """Each open store's stats (only ``namespaces``' when given)."""
        out = []
        for hosted in self.hosted():
            if namespaces is None or hosted.namespace in namespaces:
                stats = hosted.store.stats()
                layout_fp = hosted.store.layout.fingerprint_hex
                out.append({"namespace": hosted.namespace, "layout_fp": layout_fp, **stats})
        return out

    def close(self) -> None:
        """Close every store: flush memory to persistent tiers, release the tiers."""
        with self._lock:
            self._closed = True
            stores = list(self._stores.values())
            self._stores.clear()
        for hosted in stores:
            try:
                hosted.store.close()
            except Exception:  # one store failing to close must not keep the others open
                log.exception("closing store %s failed", hosted.label)
