"""Tier kinds by name, imported on first use.

``import kvstore`` imports no tier module; a kind's module (and its optional
dependencies, such as boto3 for ``s3``) is imported when a store that uses it
is opened. A missing optional dependency gives a :class:`ConfigError` that
says what to install.

A tier of your own: subclass :class:`~kvstore.tiers.base.Tier` (pass
:class:`kvstore.testing.conformance.TierConformance`), declare its settings as a
frozen dataclass subclassing :class:`~kvstore.config.TierConfig`, and register
both before the config is read::

    register_tier("mem2", "mypkg.tiers:Mem2Tier", options=Mem2Config)
    KVStore(layout, {"tiers": [{"kind": "mem2", "capacity": "1GiB", "my_setting": 3}]})

The kinds live in one registry, :data:`kvstore.config.kinds.TIERS` (each name pairs the
tier class with its config class; :mod:`kvstore.runtime.registry`). An installed package
registers its kinds in every process through the ``kvstore.tiers`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.config import TIERS
from kvstore.errors import ConfigError
from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.config import TierConfig
    from kvstore.layout import KVLayout
    from kvstore.tiers.base import Tier
    from kvstore.tiers.device import DeviceTier
    from kvstore.tiers.disk import DiskTier, check_path, unusable_path
    from kvstore.tiers.disk_lock import LOCK_NAME, DirectoryLock
    from kvstore.tiers.encryption import StoreKeys, encrypt_tiers, store_keys
    from kvstore.tiers.files import FORMAT_DIR, Buffer, FileOps, Tree
    from kvstore.tiers.host import HostTier
    from kvstore.tiers.opening import OpenedTiers, open_tiers
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.remote_common import (
        Counters,
        ValueTier,
        check_get_args,
        check_put_args,
        decode_value,
        encode_value,
    )
    from kvstore.tiers.s3 import S3Tier
    from kvstore.tiers.slab import SharedSegment, SlabTier

__all__ = [
    "Buffer",
    "Counters",
    "DeviceTier",
    "DirectoryLock",
    "DiskTier",
    "FORMAT_DIR",
    "FileOps",
    "HostTier",
    "LOCK_NAME",
    "OpenedTiers",
    "RedisTier",
    "S3Tier",
    "SharedSegment",
    "SlabTier",
    "StoreKeys",
    "TIERS",
    "Tree",
    "ValueTier",
    "check_get_args",
    "check_path",
    "check_put_args",
    "create_tier",
    "decode_value",
    "encode_value",
    "encrypt_tiers",
    "open_tiers",
    "register_tier",
    "registered_kinds",
    "store_keys",
    "tier_class",
    "unusable_path",
]

_EXPORTS = {
    "Buffer": "kvstore.tiers.files",
    "Counters": "kvstore.tiers.remote_common",
    "DeviceTier": "kvstore.tiers.device",
    "DirectoryLock": "kvstore.tiers.disk_lock",
    "DiskTier": "kvstore.tiers.disk",
    "FORMAT_DIR": "kvstore.tiers.files",
    "FileOps": "kvstore.tiers.files",
    "HostTier": "kvstore.tiers.host",
    "LOCK_NAME": "kvstore.tiers.disk_lock",
    "OpenedTiers": "kvstore.tiers.opening",
    "RedisTier": "kvstore.tiers.redis",
    "S3Tier": "kvstore.tiers.s3",
    "SharedSegment": "kvstore.tiers.slab",
    "SlabTier": "kvstore.tiers.slab",
    "StoreKeys": "kvstore.tiers.encryption",
    "Tree": "kvstore.tiers.files",
    "ValueTier": "kvstore.tiers.remote_common",
    "check_get_args": "kvstore.tiers.remote_common",
    "check_path": "kvstore.tiers.disk",
    "check_put_args": "kvstore.tiers.remote_common",
    "decode_value": "kvstore.tiers.remote_common",
    "encode_value": "kvstore.tiers.remote_common",
    "encrypt_tiers": "kvstore.tiers.encryption",
    "open_tiers": "kvstore.tiers.opening",
    "store_keys": "kvstore.tiers.encryption",
    "unusable_path": "kvstore.tiers.disk",
}


def __getattr__(name: str) -> Any:
    """The tier classes and what code outside uses of their modules, imported on first
    use (a kind's module may need an optional dependency)."""
    return load_export(globals(), _EXPORTS, name)


def register_tier(
    kind: str,
    target: str | type[Tier],
    install_hint: str | None = None,
    *,
    options: type[TierConfig] | None = None,
    replace: bool = False,
    clobber: bool = False,
) -> None:
    """Register tier ``kind`` as ``"package.module:ClassName"`` (imported lazily, when
    a store with such a tier opens) or as the class itself, so configs may name it in
    ``tiers``.

    ``options``: the kind's settings, a frozen dataclass subclassing
    :class:`~kvstore.config.TierConfig` (whose fields every tier has); a config of
    ``kind`` accepts its fields (a field whose ``metadata`` has ``"parse"``, a
    function ``(value, key path) -> value``, reads strings such as ``"1GiB"`` and
    ``KVSTORE_<KIND>_<FIELD>`` overrides: :func:`kvstore.config.parse_size`) and the
    tier is handed an instance. None: only the common settings. ``install_hint``: what
    the error says when the module's import fails.

    A kind registered already (the built-in ones included) raises
    :class:`ConfigError` unless ``clobber=True`` (``replace`` is the older spelling);
    ``options=None`` then keeps the kind's settings and swaps only its implementation.
    """
    TIERS.register(
        kind,
        target,
        install_hint=install_hint or "",
        options=options,
        clobber=replace or clobber,
    )


def registered_kinds() -> list[str]:
    """Names of every registered tier kind."""
    return TIERS.names()


def tier_class(kind: str) -> type[Tier]:
    """Import and return the class implementing tier ``kind``."""
    if not isinstance(kind, str) or kind not in TIERS:
        raise ConfigError(f"unknown tier kind {kind!r}; known: {', '.join(registered_kinds())}")
    cls: type[Tier] = TIERS.load(kind)
    return cls


def create_tier(config: TierConfig, layout: KVLayout) -> Tier:
    """Instantiate the tier described by ``config`` for ``layout``."""
    return tier_class(config.kind)(config, layout)
