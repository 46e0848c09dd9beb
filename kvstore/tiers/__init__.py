"""Tier registry: tier kinds by name, imported on first use.

``import kvstore`` imports no tier module; a kind's module (and its optional
dependencies, such as boto3 for ``s3``) is imported when a store that uses it
is opened. A missing optional dependency gives a :class:`ConfigError` that
says what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.config import TierConfig
    from kvstore.layout import KVLayout
    from kvstore.tiers.base import Tier

__all__ = ["create_tier", "register_tier", "registered_kinds", "tier_class"]

_REGISTRY: dict[str, str] = {
    "host": "kvstore.tiers.host:HostTier",
    "device": "kvstore.tiers.device:DeviceTier",
    "disk": "kvstore.tiers.disk:DiskTier",
    "s3": "kvstore.tiers.s3:S3Tier",
    "redis": "kvstore.tiers.redis:RedisTier",
    "remote": "kvstore.client.tier:RemoteTier",
}
_INSTALL_HINTS: dict[str, str] = {
    "s3": "install it with: pip install 'kvstore[s3]'",
    "redis": "install it with: pip install 'kvstore[redis]'",
}


def register_tier(kind: str, target: str, install_hint: str | None = None) -> None:
    """Register tier ``kind`` as ``"package.module:ClassName"`` (imported lazily)."""
    _REGISTRY[kind] = target
    if install_hint:
        _INSTALL_HINTS[kind] = install_hint


def registered_kinds() -> list[str]:
    """Names of every registered tier kind."""
    return sorted(_REGISTRY)


def tier_class(kind: str) -> type[Tier]:
    """Import and return the class implementing tier ``kind``."""
    try:
        target = _REGISTRY[kind]
    except KeyError:
        raise ConfigError(
            f"unknown tier kind {kind!r}; known: {', '.join(registered_kinds())}"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(kind, "")
        raise ConfigError(
            f"tier kind {kind!r} needs a missing dependency ({exc.name}); {hint}".rstrip("; ")
        ) from exc
    cls: type[Tier] = getattr(module, class_name)
    return cls


def create_tier(config: TierConfig, layout: KVLayout) -> Tier:
    """Instantiate the tier described by ``config`` for ``layout``."""
    return tier_class(config.kind)(config, layout)
