"""How a store's tiers are opened: the config's tiers in order, the cluster's peers placed
after this machine's own tiers and before shared remote media, and encryption at rest
installed on the kinds it names. The keyring is read before any tier opens (a bad one
changes nothing); tiers already opened are closed again when a later one fails."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.config import StoreConfig, peer_tier_class
from kvstore.layout import KVLayout
from kvstore.tiers import create_tier
from kvstore.tiers.base import Tier
from kvstore.tiers.encryption import encrypt_tiers, store_keys

__all__ = ["OpenedTiers", "open_tiers"]


@dataclass(frozen=True)
class OpenedTiers:
    """A store's tiers, fastest first, and whether they encrypt (a keyring is set)."""

    tiers: list[Tier]
    encrypted: bool


def open_tiers(
    layout: KVLayout, config: StoreConfig, given: Sequence[Tier] | None = None
) -> OpenedTiers:
    """Open ``config``'s tiers for ``layout`` (or take ``given``, ready-made, after checking
    their layout), with the cluster's peers and encryption as the config says."""
    keys = store_keys(config.encryption, config.cluster.namespace)
    built: list[Tier] = list(given) if given is not None else []
    try:
        for tier in built:
            layout.check_same(tier.layout)
        if given is None:
            for tier_config in config.tiers:
                built.append(create_tier(tier_config, layout))
            if config.cluster.enabled:  # peers answer faster than S3 or Redis
                at = next((i for i, t in enumerate(built) if not t.local), len(built))
                built.insert(at, _cluster_tier(layout, config))
        if keys is not None:
            encrypt_tiers(built, config.encryption, keys)
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return OpenedTiers(built, keys is not None)


def _cluster_tier(layout: KVLayout, config: StoreConfig) -> Tier:
    """The other nodes of the cluster, as a tier (its class is imported only when used:
    it needs redis, and the cluster package builds on the store)."""
    tier: Tier = peer_tier_class()(layout, config.peer_cluster(), config.cluster.namespace)
    return tier
