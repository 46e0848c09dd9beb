"""``kvstore-server``: a daemon holding tiers for many engine processes and hosts.

- :mod:`kvstore.server.daemon` -- :class:`Server`, :class:`ServerThread`
- :mod:`kvstore.server.cli` -- the ``kvstore-server`` command

The wire format, shared memory and auth it shares with its clients are in
:mod:`kvstore.wire` (docs/protocol.md).

Importing this package imports nothing else; names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.server.cli import add_arguments, main, run
    from kvstore.server.daemon import Server, ServerThread

__all__ = [
    "Server",
    "ServerThread",
    "add_arguments",
    "main",
    "run",
]

_EXPORTS = {
    "Server": "kvstore.server.daemon",
    "ServerThread": "kvstore.server.daemon",
    "add_arguments": "kvstore.server.cli",
    "main": "kvstore.server.cli",
    "run": "kvstore.server.cli",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
