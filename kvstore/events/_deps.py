"""The optional dependencies of :mod:`kvstore.events` (``pip install 'kvstore-tiers[events]'``)."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvstore.errors import ConfigError
from kvstore.runtime import install_hint

__all__ = ["EventsUnavailableError", "require"]

INSTALL_HINT = install_hint("events")


class EventsUnavailableError(ConfigError):
    """KV events are configured but pyzmq or msgspec is not installed."""


def require(module: str) -> ModuleType:
    """Import ``module`` (``zmq``, ``msgspec``), or raise :class:`EventsUnavailableError`
    saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EventsUnavailableError(
            f"events: publishing KV events needs {module.split('.')[0]!r} "
            f"({exc}); install it with: {INSTALL_HINT}"
        ) from None
