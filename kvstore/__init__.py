"""kvstore: a tiered, content-addressed KV-cache block store for LLM serving.

Public API::

    from kvstore import KVStore, StoreConfig, KVLayout

Names are imported on first use, so ``import kvstore`` is cheap and pulls in
no optional dependency (boto3, redis, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.version import __version__

_EXPORTS = {
    "KVStore": "kvstore.store",
    "StoreConfig": "kvstore.config",
    "TierConfig": "kvstore.config",
    "HostTierConfig": "kvstore.config",
    "DeviceTierConfig": "kvstore.config",
    "KVLayout": "kvstore.layout",
    "BlockKey": "kvstore.keys",
    "Namespace": "kvstore.keys",
    "KVStoreError": "kvstore.errors",
    "ConfigError": "kvstore.errors",
    "InvalidInputError": "kvstore.errors",
    "LayoutMismatchError": "kvstore.errors",
    "BlockNotFoundError": "kvstore.errors",
    "CorruptBlockError": "kvstore.errors",
    "TierError": "kvstore.errors",
    "CapacityError": "kvstore.errors",
    "ClosedError": "kvstore.errors",
    "AccessDeniedError": "kvstore.errors",
    "ProtocolError": "kvstore.errors",
}

__all__ = [
    "__version__",
    "AccessDeniedError",
    "BlockKey",
    "BlockNotFoundError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DeviceTierConfig",
    "HostTierConfig",
    "InvalidInputError",
    "KVLayout",
    "KVStore",
    "KVStoreError",
    "LayoutMismatchError",
    "Namespace",
    "ProtocolError",
    "StoreConfig",
    "TierConfig",
    "TierError",
]

if TYPE_CHECKING:
    from kvstore.config import DeviceTierConfig, HostTierConfig, StoreConfig, TierConfig
    from kvstore.errors import (
        AccessDeniedError,
        BlockNotFoundError,
        CapacityError,
        ClosedError,
        ConfigError,
        CorruptBlockError,
        InvalidInputError,
        KVStoreError,
        LayoutMismatchError,
        ProtocolError,
        TierError,
    )
    from kvstore.keys import BlockKey, Namespace
    from kvstore.layout import KVLayout
    from kvstore.store import KVStore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
