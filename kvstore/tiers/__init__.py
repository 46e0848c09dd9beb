"""Tier registry: tier kinds by name, imported on first use.

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

An installed package registers its kinds in every process through the ``kvstore.tiers``
entry-point group (:mod:`kvstore.config.plugins`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore._dist import install_hint as _pip_install
from kvstore.config.tiers import register_tier_config
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
    "s3": f"install it with: {_pip_install('s3')}",
    "redis": f"install it with: {_pip_install('redis')}",
}


def register_tier(
    kind: str,
    target: str,
    install_hint: str | None = None,
    *,
    options: type[TierConfig] | None = None,
    replace: bool = False,
) -> None:
    """Register tier ``kind`` as ``"package.module:ClassName"`` (imported lazily, when
    a store with such a tier opens), so configs may name it in ``tiers``.

    ``options``: the kind's settings, a frozen dataclass subclassing
    :class:`~kvstore.config.TierConfig` (whose fields every tier has); a config of
    ``kind`` accepts its fields (a field whose ``metadata`` has ``"parse"``, a
    function ``(value, key path) -> value``, reads strings such as ``"1GiB"`` and
    ``KVSTORE_<KIND>_<FIELD>`` overrides: :func:`kvstore.config.parse_size`) and the
    tier is handed an instance. None: only the common settings (see
    :func:`kvstore.config.tiers.register_tier_config`). ``install_hint``: what the
    error says when the module's import fails.

    A kind registered already (the built-in ones included) raises
    :class:`ConfigError` unless ``replace=True``; ``options=None`` with ``replace``
    keeps the kind's settings and swaps only its implementation.
    """
    module, sep, name = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not (module and sep and name.isidentifier()):
        raise ConfigError(
            f"tier kind {kind!r}: target must be 'package.module:ClassName', got {target!r}"
        )
    if kind in _REGISTRY and not replace:
        raise ConfigError(
            f"tier kind {kind!r} is registered already ({_REGISTRY[kind]}); "
            "pass replace=True to replace it"
        )
    register_tier_config(kind, options, replace=replace)
    _REGISTRY[kind] = target
    if install_hint:
        _INSTALL_HINTS[kind] = install_hint
    else:
        _INSTALL_HINTS.pop(kind, None)


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
    cls: type[Tier] | None = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"tier kind {kind!r}: module {module_name} has no {class_name}")
    return cls


def create_tier(config: TierConfig, layout: KVLayout) -> Tier:
    """Instantiate the tier described by ``config`` for ``layout``."""
    return tier_class(config.kind)(config, layout)
