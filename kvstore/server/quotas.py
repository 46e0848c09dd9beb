"""Tenants' quotas on a kvstore-server: each hosted store's seat at one ledger, and the
per-tenant figures (stats and ``/metrics``).

The server's tiers are the pools: tier kind ``host`` of capacity 8 GiB means the
tenants' stores together hold 8 GiB of blocks there (each store still has its
own tier objects). A tenant's ``quotas`` give it a share and a limit per kind;
:mod:`kvstore.datapath.quota` keeps them as its stores grant room. The stores of a
server with ``server.tenants`` all take part (namespaces no tenant owns belong
to tenant ``default``, which has no quota: it yields nothing and is bounded
only by its tiers). A namespace keeps the tenant it had when its store opened.

Under pressure (the ledger's ``on_pressure``: a pool past its capacity while
tenants past their shares hold blocks, say one that flooded and went idle), the
*reclaimer*, a thread of this object's own, evicts those tenants' blocks from
their own stores until the pool fits, off every request's path. It also looks
every few seconds, for pressure no grant announced.

Lock ownership: ``_lock`` guards ``_hooks``, ``_stores`` and the reclaimer's start
and stop; ``reclaimed`` is written by the reclaimer alone. The ledger's lock is
taken only to plan a reclaim, never while a store evicts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvstore.config import DaemonConfig, ServerConfig, StoreConfig
from kvstore.datapath import Quota, QuotaHook, QuotaLedger, Reclaim
from kvstore.errors import CapacityError, ConfigError, KVStoreError
from kvstore.server.stores import HostedStore
from kvstore.store import KVStore

__all__ = ["TenantQuotas"]

log = logging.getLogger(__name__)

#: How often the reclaimer looks without being woken (seconds).
RECLAIM_POLL_S = 5.0

#: Per-store counters summed per tenant: stats key -> the tenant figure's name.
_COUNTS = (
    ("lookup_blocks_hit", "hits"),
    ("lookup_blocks_missed", "misses"),
    ("blocks_read", "blocks_read"),
    ("blocks_missed", "blocks_missed"),
)


def _pools(config: StoreConfig) -> dict[str, int]:
    pools: dict[str, int] = {}
    for tier in config.tiers:
        capacity = getattr(tier, "capacity", None)
        if isinstance(capacity, int):
            pools.setdefault(tier.kind, capacity)
    return pools


def _quotas(server: ServerConfig) -> dict[tuple[str, str], Quota]:
    quotas = {}
    for tenant in server.tenants:
        for q in tenant.quotas:
            limit = q.limit if q.limit is not None else 1 << 62
            quotas[(tenant.name, q.tier)] = Quota(q.share, limit)
    return quotas


class TenantQuotas:
    """The server's quota ledger and per-tenant figures (see the module docstring)."""

    def __init__(self, config: DaemonConfig, tenant_of: Callable[[str], str]) -> None:
        self.pools = _pools(config.store)
        self.check(config.server)
        self.ledger = QuotaLedger(self.pools, _quotas(config.server))
        self._tenant_of = tenant_of
        self._enabled = bool(config.server.tenants)
        self._hooks: dict[str, list[QuotaHook]] = {}
        self._stores: dict[QuotaHook, KVStore] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._reclaimer: threading.Thread | None = None
        #: Blocks the reclaimer evicted, per tenant.
        self.reclaimed: dict[str, int] = {}
        self.ledger.on_pressure = self._wake.set

    def check(self, server: ServerConfig) -> None:
        """ConfigError when shares promise more of a tier than it has."""
        promised: dict[str, int] = {}
        for tenant in server.tenants:
            for q in tenant.quotas:
                promised[q.tier] = promised.get(q.tier, 0) + q.share
        for kind, total in sorted(promised.items()):
            pool = self.pools.get(kind)
            if pool is None:
                raise ConfigError(f"server.tenants: quotas name tier {kind!r}, which is not here")
            if total > pool:
                raise ConfigError(
                    f"server.tenants: the {kind} shares add up to {total} bytes, "
                    f"more than the tier's capacity {pool}"
                )

    def update(self, server: ServerConfig) -> None:
        """Take new quotas (after a reload or an ADMIN change)."""
        self._enabled = self._enabled or bool(server.tenants)
        self.ledger.set_quotas(_quotas(server))

    def attach(self, hosted: HostedStore) -> None:
        """Give a store that just opened its seat at the ledger (its owner: the tenant
        of its namespace now)."""
        if not self._enabled:
            return
        tenant = self._tenant_of(hosted.namespace)
        hook = hosted.store.engine.datapath.use_quota(self.ledger, tenant)
        with self._lock:
            self._hooks.setdefault(hosted.namespace, []).append(hook)
            self._stores[hook] = hosted.store
            if self._reclaimer is None and not self._closing:
                self._reclaimer = threading.Thread(
                    target=self._reclaim_loop, name="kvstore-reclaim", daemon=True
                )
                self._reclaimer.start()

    def close(self) -> None:
        """Stop the reclaimer (before the stores close)."""
        with self._lock:
            self._closing = True
            thread = self._reclaimer
        self._wake.set()
        if thread is not None:
            thread.join()

    def _reclaim_loop(self) -> None:
        while not self._closing:
            self._wake.wait(RECLAIM_POLL_S)
            self._wake.clear()
            self.reclaim_until_fit()

    def reclaim_until_fit(self) -> int:
        """Reclaim passes until the pools fit, or a pass frees nothing (pinned blocks
        stay); how many blocks went in all."""
        total = 0
        while not self._closing:
            evicted = self.reclaim()
            if evicted == 0:
                break
            total += evicted
        return total

    def reclaim(self) -> int:
        """One pass: evict what tenants past their shares owe an over-full pool; how
        many blocks went."""
        with self.ledger.lock:
            plans = self.ledger.reclaims()
        evicted = 0
        for plan in plans:
            with self._lock:
                store = self._stores.get(plan.hook)
            if store is None:
                continue
            n = _evict_up_to(store, plan)
            if n:
                owner = plan.hook.owner
                self.reclaimed[owner] = self.reclaimed.get(owner, 0) + n
                evicted += n
        return evicted

    def figures(self, stores: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per tenant: per tier kind bytes, blocks (share, limit), and its stores'
        hits, misses, evictions and refusals. ``stores``: the registry's stats."""
        with self.ledger.lock:
            out = self.ledger.figures()
        for stats in stores:
            tenant = self._tenant_of(stats["namespace"])
            with self._lock:
                if stats["namespace"] in self._hooks:
                    tenant = self._hooks[stats["namespace"]][0].owner
            mine = out.setdefault(tenant, {"tiers": {}, "refused": 0})
            for key, name in _COUNTS:
                mine[name] = mine.get(name, 0) + int(stats.get(key, 0))
            mine["evictions"] = mine.get("evictions", 0) + sum(stats.get("evictions", []) or [0])
        for tenant, n in list(self.reclaimed.items()):
            out.setdefault(tenant, {"tiers": {}, "refused": 0})["reclaimed"] = n
        return out

    def render(self, stores: list[dict[str, Any]]) -> str:
        """Prometheus text of :meth:`figures`, labelled by ``tenant`` (and ``tier``)."""
        figures = self.figures(stores)
        lines: list[str] = []
        for name, key, kind in _GAUGES:
            lines.append(f"# TYPE {name} {kind}")
            for tenant, mine in sorted(figures.items()):
                for tier, values in sorted(mine["tiers"].items()):
                    if key in values:
                        label = f'tenant="{tenant}",tier="{tier}"'
                        lines.append(f"{name}{{{label}}} {values[key]}")
        for name, key in _TOTALS:
            lines.append(f"# TYPE {name} counter")
            for tenant, mine in sorted(figures.items()):
                lines.append(f'{name}{{tenant="{tenant}"}} {mine.get(key, 0)}')
        return "\n".join(lines) + "\n"


def _evict_up_to(store: KVStore, plan: Reclaim) -> int:
    """Evict up to ``plan.blocks`` of ``store``'s unpinned blocks from its tier
    ``plan.tier`` (fewer where some are pinned); how many went."""
    n = plan.blocks
    while n > 0:
        try:
            return len(store.evict(n, plan.tier))
        except CapacityError:
            n //= 2
        except KVStoreError:  # a store closing, a tier failing: the next pass retries
            log.warning("reclaiming %d blocks of tenant %s failed", n, plan.hook.owner)
            return 0
    return 0


_GAUGES = (
    ("kvstore_tenant_bytes", "bytes", "gauge"),
    ("kvstore_tenant_blocks", "blocks", "gauge"),
    ("kvstore_tenant_share_bytes", "share", "gauge"),
    ("kvstore_tenant_limit_bytes", "limit", "gauge"),
)
_TOTALS = (
    ("kvstore_tenant_hits_total", "hits"),
    ("kvstore_tenant_misses_total", "misses"),
    ("kvstore_tenant_evictions_total", "evictions"),
    ("kvstore_tenant_refusals_total", "refused"),
    ("kvstore_tenant_reclaimed_total", "reclaimed"),
)
