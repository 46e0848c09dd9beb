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
tier class with its config class; :mod:`kvstore.registry`). An installed package
registers its kinds in every process through the ``kvstore.tiers`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.config.kinds import TIERS
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.config import TierConfig
    from kvstore.layout import KVLayout
    from kvstore.tiers.base import Tier

__all__ = ["TIERS", "create_tier", "register_tier", "registered_kinds", "tier_class"]


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
