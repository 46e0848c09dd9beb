"""Tier kinds from installed packages: the ``kvstore.tiers`` entry-point group.

A package that brings tier kinds declares, in its packaging metadata::

    [project.entry-points."kvstore.tiers"]
    mem2 = "mypkg.kvstore_tiers:register"

where ``register()`` (no arguments) calls :func:`kvstore.tiers.register_tier` for its
kinds. kvstore runs each such function once, the first time a config names a kind it does
not know; importing kvstore runs none. A kind a plugin registers that is registered
already is refused as :func:`~kvstore.tiers.register_tier` refuses it.
"""

from __future__ import annotations

import importlib.metadata
import threading

from kvstore.errors import ConfigError

__all__ = ["TIER_PLUGIN_GROUP", "load_tier_plugins"]

#: The entry-point group of tier plugins.
TIER_PLUGIN_GROUP = "kvstore.tiers"

_lock = threading.Lock()  # owned here: one thread runs the plugins, others wait for it
_ran: set[str] = set()  # "name=value" of each entry point run (or tried) already


def load_tier_plugins() -> list[str]:
    """Run the registration function of each ``kvstore.tiers`` entry point not run yet;
    the names of those that ran. One that fails to import or to register is a
    :class:`ConfigError` naming it (and is not tried again)."""
    ran: list[str] = []
    with _lock:
        for point in importlib.metadata.entry_points(group=TIER_PLUGIN_GROUP):
            ident = f"{point.name}={point.value}"
            if ident in _ran:
                continue
            _ran.add(ident)
            try:
                point.load()()
            except Exception as exc:
                raise ConfigError(
                    f"tier plugin {point.name!r} ({point.value}) failed to register: {exc}"
                ) from exc
            ran.append(point.name)
    return ran
