"""The registry of tier kinds: each name pairs a tier class with its config dataclass.

:data:`TIERS` holds the built-in kinds, those :func:`kvstore.tiers.register_tier` adds, and
(read the first time a config names a kind it does not know) those installed packages
declare in the ``kvstore.tiers`` entry-point group (:mod:`kvstore.runtime.registry`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kvstore.config._fields import build as _build
from kvstore.config.tiers import (
    ClusterTierConfig,
    DeviceTierConfig,
    DiskTierConfig,
    HostTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
    TierConfig,
)
from kvstore.errors import ConfigError
from kvstore.runtime import Entry, Registry, import_target, install_hint

__all__ = [
    "KIND_PATTERN",
    "PEER_TIER",
    "TIERS",
    "TierKinds",
    "build_tier",
    "check_kind_name",
    "peer_tier_class",
    "register_tier_config",
    "tier_config_class",
    "tier_kinds",
]


#: What a registered kind may be called: lowercase letters and digits, so that
#: ``KVSTORE_<KIND>_<FIELD>`` overrides (split at the first ``_``) can name it.
KIND_PATTERN = r"[a-z][a-z0-9]{0,31}"


def _is_tier_class(obj: object) -> bool:
    """Whether ``obj`` is a class deriving from :class:`kvstore.tiers.base.Tier` (named,
    not imported: the tiers import the config)."""
    return isinstance(obj, type) and any(
        (c.__module__, c.__qualname__) == ("kvstore.tiers.base", "Tier") for c in obj.__mro__
    )


class TierKinds(Registry[type]):
    """The tier kinds: each name pairs a tier class (``target``, imported when a store
    with such a tier opens) with its config dataclass (``options``), so a new kind is one
    :meth:`register` call (:func:`kvstore.tiers.register_tier`)."""

    def register(
        self,
        name: str,
        target: type | str,
        *,
        install_hint: str = "",
        options: Any = None,
        clobber: bool = False,
    ) -> Entry[type]:
        """Register tier kind ``name``; ``options`` (a frozen dataclass subclassing
        :class:`TierConfig`, subclassed with ``kind`` set when its ``kind`` differs) are
        its settings. None: the settings the kind has already, else those every tier has."""
        check_kind_name(name)
        if name == ClusterTierConfig.kind:
            raise ConfigError(
                f"tier kind {name!r} is reserved: the store makes it from the cluster: section"
            )
        known = self.view.get(name)
        if options is None:
            options = known.options if known is not None else TierConfig
        cls = _options_class(name, options)
        return super().register(
            name, target, install_hint=install_hint, options=cls, clobber=clobber
        )


def register_tier_config(
    kind: str, options: type[TierConfig] | None = None, *, replace: bool = False
) -> type[TierConfig]:
    """Give the registered tier ``kind`` the settings of ``options`` (a frozen dataclass
    subclassing :class:`TierConfig`; None: keep those it has) and return the config
    class that configs of ``kind`` build. It has them already: :class:`ConfigError`
    unless ``replace``. A kind not registered yet comes with its tier class:
    :func:`kvstore.tiers.register_tier`.
    """
    check_kind_name(kind)
    known = TIERS.view.get(kind)
    if known is None:
        raise ConfigError(
            f"tier kind {kind!r} is not registered; kvstore.tiers.register_tier registers "
            "a kind with its tier class and settings"
        )
    entry = TIERS.register(
        kind,
        known.target,
        install_hint=known.install_hint,
        options=options,
        clobber=replace,
    )
    cls: type[TierConfig] = entry.options
    return cls


def check_kind_name(kind: object) -> str:
    """``kind`` if it can name a registered tier kind, else :class:`ConfigError`."""
    if not isinstance(kind, str) or not re.fullmatch(KIND_PATTERN, kind):
        raise ConfigError(
            f"tier kind {kind!r}: use 1-32 lowercase letters and digits, starting with a "
            "letter (environment overrides name it as KVSTORE_<KIND>_<FIELD>)"
        )
    return kind


def _options_class(kind: str, options: object) -> type[TierConfig]:
    """``options`` as the config class of ``kind`` (subclassed when its kind differs)."""
    if not (
        isinstance(options, type)
        and issubclass(options, TierConfig)
        and dataclasses.is_dataclass(options)
    ):
        raise ConfigError(
            f"tier kind {kind!r}: options must be a dataclass subclassing TierConfig, "
            f"got {options!r}"
        )
    if options.kind == kind:
        return options
    # A plain subclass is still a frozen dataclass with the same fields and checks;
    # only the kind (a ClassVar, so no field) differs.
    name = f"{kind.capitalize()}TierConfig"
    derived: type[TierConfig] = type(
        name, (options,), {"kind": kind, "__doc__": options.__doc__, "__module__": __name__}
    )
    return derived


def tier_config_class(kind: str, path: str = "kind") -> type[TierConfig]:
    """The config dataclass of tier ``kind`` (a kind not registered yet may come from an
    installed package's ``kvstore.tiers`` entry point: :mod:`kvstore.runtime.registry`)."""
    if not isinstance(kind, str) or not TIERS.has(kind):
        raise ConfigError(
            f"{path}: unknown tier kind {kind!r}; known kinds: {', '.join(TIERS.names())} "
            "(a kind of your own: kvstore.tiers.register_tier before the config is read, "
            "or a package's 'kvstore.tiers' entry point)"
        )
    cls: type[TierConfig] = TIERS.view[kind].options
    return cls


def tier_kinds() -> list[str]:
    """Every tier kind the config knows."""
    return TIERS.names()


def build_tier(data: Any, path: str) -> TierConfig:
    """A validated tier config from a mapping with a ``kind``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with a 'kind', got {type(data).__name__}")
    if "kind" not in data:
        raise ConfigError(f"{path}.kind: missing; every tier needs a kind")
    rest = {k: v for k, v in data.items() if k != "kind"}
    tier: TierConfig = _build(tier_config_class(data["kind"], f"{path}.kind"), rest, path)
    tier.validate(path)
    return tier


#: Every tier kind: the built-in ones, those registered, and (once a config names a kind
#: not registered) those installed packages declare in the ``kvstore.tiers`` entry points.
TIERS = TierKinds("tier kind", "kvstore.tiers", _is_tier_class)
for _cls, _target, _extra in (
    (HostTierConfig, "kvstore.tiers.host:HostTier", ""),
    (DeviceTierConfig, "kvstore.tiers.device:DeviceTier", ""),
    (DiskTierConfig, "kvstore.tiers.disk:DiskTier", ""),
    (S3TierConfig, "kvstore.tiers.s3:S3Tier", "s3"),
    (RedisTierConfig, "kvstore.tiers.redis:RedisTier", "redis"),
    (RemoteTierConfig, "kvstore.client.tier:RemoteTier", ""),
):
    TIERS.register(
        _cls.kind,
        _target,
        options=_cls,
        install_hint=f"install it with: {install_hint(_extra)}" if _extra else "",
    )


#: The cluster's peers as a tier: made by the store from the ``cluster:`` section, never
#: listed in ``tiers``, so no kind of :data:`TIERS` (whose ``cluster`` name is reserved
#: for it). Named, not imported: the cluster package builds on the store, and needs redis.
PEER_TIER: Entry[type] = Entry(
    ClusterTierConfig.kind,
    "kvstore.cluster.tier:ClusterTier",
    f"install it with: {install_hint('redis')}",
    ClusterTierConfig,
)


def peer_tier_class() -> type:
    """The class of :data:`PEER_TIER`, imported (:class:`ConfigError` naming what to
    install when its dependencies are missing). It is built as
    ``cls(layout, cluster_config, namespace)``."""
    cls: type = import_target(TIERS.what, PEER_TIER, _is_tier_class)
    return cls
