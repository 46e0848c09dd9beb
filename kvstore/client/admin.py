"""Run-time administration of a kvstore-server: its tenants and tokens.

>>> admin = AdminClient(ClientOptions(address="127.0.0.1:7070", token=OPS_TOKEN))
>>> admin.put_tenant("team-c", namespaces=["team-c"],
...                  tokens=[{"name": "c", "token": C_TOKEN, "scopes": ["read", "write"]}])
>>> admin.tenants()["tenants"]["team-c"]["namespaces"]
['team-c']

Every request needs a token with the ``admin`` scope (else
:class:`~kvstore.errors.AccessDeniedError`); a malformed change is refused in
one line (:class:`~kvstore.errors.InvalidInputError`) and changes nothing.
Each call is one short connection that opens no store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.client._common import ClientOptions
from kvstore.client.connection import Connection
from kvstore.wire.protocol import Op, encode_json

__all__ = ["AdminClient"]


class AdminClient:
    """ADMIN requests to one server (see the module docstring)."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options

    def request(self, action: str, **fields: Any) -> dict[str, Any]:
        """One ADMIN request and its JSON answer."""
        conn = Connection(self.options, None)
        try:
            return conn.call_json(Op.ADMIN, encode_json({"action": action, **fields}))
        finally:
            conn.close()

    def tenants(self) -> dict[str, Any]:
        """The tenants (namespaces, token names and scopes; never secrets) and older tokens."""
        return self.request("tenants")

    def put_tenant(
        self,
        name: str,
        namespaces: Sequence[str],
        tokens: Sequence[dict[str, Any]],
        quotas: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Add tenant ``name`` or replace it whole (its namespaces, tokens: each
        ``{name, token | token_file, scopes}``, and quotas: tier kind to ``{share,
        limit}``); the tenants as they stand after."""
        body = {"name": name, "namespaces": list(namespaces), "tokens": list(tokens)}
        return self.request("put_tenant", tenant={**body, "quotas": quotas or {}})

    def remove_tenant(self, name: str) -> dict[str, Any]:
        """Remove tenant ``name`` and its tokens (its blocks stay in its namespaces)."""
        return self.request("remove_tenant", name=name)

    def reload(self) -> dict[str, Any]:
        """Re-read the server's config file for its tenants and tokens (like SIGHUP)."""
        return self.request("reload")
