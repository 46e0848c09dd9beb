"""A package's front door, imported on first use.

Each package of kvstore re-exports, in its ``__init__``, what code outside it may use,
so that nothing outside imports another of its modules. Where importing those modules
up front would cost (torch, an optional dependency) or would run into a module being
imported, the ``__init__`` names them in a table and imports each on first use::

    _EXPORTS = {"DiskTier": "kvstore.tiers.disk", "ShmMapping": "kvstore.wire.shm:Mapping"}

    def __getattr__(name: str) -> Any:
        return load_export(globals(), _EXPORTS, name)

(with the same names imported under ``TYPE_CHECKING``, for type checkers and readers).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["load_export"]


def load_export(namespace: MutableMapping[str, Any], table: Mapping[str, str], name: str) -> Any:
    """``name`` of the package whose globals are ``namespace``, imported from the module
    ``table`` names for it (``"module"``: the same name there; ``"module:attr"``: that
    attribute) and kept in ``namespace``, so the next use costs nothing;
    :class:`AttributeError` for a name the table lacks, as for any missing attribute."""
    target = table.get(name)
    if target is None:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    namespace[name] = value
    return value
