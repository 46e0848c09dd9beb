"""``kvstore-server``: a daemon holding tiers for many engine processes and hosts.

- :mod:`kvstore.server.daemon` -- :class:`Server`, :class:`ServerThread`
- :mod:`kvstore.server.cli` -- the ``kvstore-server`` command

The wire format, shared memory and auth it shares with its clients are in
:mod:`kvstore.wire` (docs/protocol.md).

Importing this package imports nothing else; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Server", "ServerThread"]

_EXPORTS = {"Server": "kvstore.server.daemon", "ServerThread": "kvstore.server.daemon"}

if TYPE_CHECKING:
    from kvstore.server.daemon import Server, ServerThread


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
