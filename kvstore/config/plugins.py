"""Tier kinds from installed packages: the ``kvstore.tiers`` entry-point group.

A package that brings tier kinds declares, in its packaging metadata::

    [project.entry-points."kvstore.tiers"]
    mem2 = "mypkg.kvstore_tiers:register"

where ``register()`` (no arguments) calls :func:`kvstore.tiers.register_tier` for its
kinds. kvstore runs each such function once, the first time a config names a kind it does
not know; importing kvstore runs none. Policies and codecs have groups of their own; all
three are read by their registries (:mod:`kvstore.runtime.registry`).
"""

from __future__ import annotations

from kvstore.config.kinds import TIERS

__all__ = ["TIER_PLUGIN_GROUP", "load_tier_plugins"]

#: The entry-point group of tier plugins.
TIER_PLUGIN_GROUP = TIERS.group


def load_tier_plugins() -> list[str]:
    """Run the registration function of each ``kvstore.tiers`` entry point not run yet;
    the names of those that ran. One that fails to import or to register is a
    :class:`~kvstore.errors.ConfigError` naming it (and is not tried again)."""
    return TIERS.load_plugins()
