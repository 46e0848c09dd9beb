"""kvstore: a tiered, content-addressed KV-cache block store for LLM serving.

Public API::

    from kvstore import KVStore, StoreConfig, KVLayout

``KVStore``'s methods are what an application calls; what only integrations (the
connectors, the server, a cluster node) use sits behind ``store.engine`` (the
:class:`EngineSide` protocol). Every type a public method returns is exported here
(docs/architecture.md, "The public face").

Names are imported on first use, so ``import kvstore`` is cheap and pulls in
no optional dependency (boto3, redis, ...).

The top of the package is its public face: this module, :mod:`kvstore.store`
(``KVStore``), :mod:`kvstore.layout`, :mod:`kvstore.keys`, :mod:`kvstore.errors`,
:mod:`kvstore.hints`, :mod:`kvstore.plugins` and :mod:`kvstore.version`; everything else
lives in a package named for its feature (docs/architecture.md). Module paths that moved
there keep working for one release, with a :class:`DeprecationWarning`
(:mod:`kvstore.runtime.aliases`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import install_aliases, load_export
from kvstore.version import __version__

install_aliases()

_EXPORTS = {
    "KVStore": "kvstore.store",
    "StoreConfig": "kvstore.config",
    "TierConfig": "kvstore.config",
    "HostTierConfig": "kvstore.config",
    "DeviceTierConfig": "kvstore.config",
    "DiskTierConfig": "kvstore.config",
    "S3TierConfig": "kvstore.config",
    "RedisTierConfig": "kvstore.config",
    "RemoteTierConfig": "kvstore.config",
    "KVLayout": "kvstore.layout",
    "BlockKey": "kvstore.keys",
    "Namespace": "kvstore.keys",
    "ChunkTokens": "kvstore.keys",
    "Hint": "kvstore.hints",
    "HintAnswer": "kvstore.hints",
    "RestorePlan": "kvstore.restore",
    "PlannedLoad": "kvstore.restore",
    "LoadSample": "kvstore.restore",
    "Pin": "kvstore.datapath",
    "PrefetchHandle": "kvstore.datapath",
    "Loan": "kvstore.datapath",
    "PendingPut": "kvstore.datapath",
    "EngineSide": "kvstore.datapath",
    "DataPath": "kvstore.datapath",
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
    "ChunkTokens",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DataPath",
    "DeviceTierConfig",
    "DiskTierConfig",
    "EngineSide",
    "Hint",
    "HintAnswer",
    "HostTierConfig",
    "InvalidInputError",
    "KVLayout",
    "KVStore",
    "KVStoreError",
    "LayoutMismatchError",
    "LoadSample",
    "Loan",
    "Namespace",
    "PendingPut",
    "Pin",
    "PlannedLoad",
    "PrefetchHandle",
    "ProtocolError",
    "RedisTierConfig",
    "RemoteTierConfig",
    "RestorePlan",
    "S3TierConfig",
    "StoreConfig",
    "TierConfig",
    "TierError",
]

if TYPE_CHECKING:
    from kvstore.config import (
        DeviceTierConfig,
        DiskTierConfig,
        HostTierConfig,
        RedisTierConfig,
        RemoteTierConfig,
        S3TierConfig,
        StoreConfig,
        TierConfig,
    )
    from kvstore.datapath import DataPath, EngineSide, Loan, PendingPut, Pin, PrefetchHandle
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
    from kvstore.hints import Hint, HintAnswer
    from kvstore.keys import BlockKey, ChunkTokens, Namespace
    from kvstore.layout import KVLayout
    from kvstore.restore import LoadSample, PlannedLoad, RestorePlan
    from kvstore.store import KVStore


def __getattr__(name: str) -> Any:
    """The public names, imported on first use."""
    return load_export(globals(), _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
