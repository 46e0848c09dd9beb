"""Clients of ``kvstore-server``: :class:`Client` (blocking, thread-safe) and
:class:`AsyncClient` (asyncio), both bound to one (namespace, layout) store.

>>> from kvstore.client import Client, ClientOptions
>>> with Client(layout, ClientOptions(address="127.0.0.1:7070")) as client:
...     client.put(keys, blocks)
...     client.get(keys, outs)

Most users never touch these directly: a ``remote`` tier in a store config
(``{"kind": "remote", "address": ...}``) makes any :class:`~kvstore.KVStore`,
the vLLM connector or the SGLang backend use a server; that tier is
:class:`kvstore.client.tier.RemoteTier`. :class:`AdminClient` and
:class:`AsyncAdminClient` administer a server's tenants and tokens at run time.
Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.client._common import ClientOptions
    from kvstore.client.admin import AdminClient, AsyncAdminClient
    from kvstore.client.aio import AsyncClient
    from kvstore.client.sync import Client
    from kvstore.client.tier import RemoteTier

__all__ = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncClient",
    "Client",
    "ClientOptions",
    "RemoteTier",
]

_EXPORTS = {
    "AdminClient": "kvstore.client.admin",
    "AsyncAdminClient": "kvstore.client.admin",
    "AsyncClient": "kvstore.client.aio",
    "Client": "kvstore.client.sync",
    "ClientOptions": "kvstore.client._common",
    "RemoteTier": "kvstore.client.tier",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
