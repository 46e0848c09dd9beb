"""Run-time administration of a kvstore-server: its tenants and tokens.

>>> admin = AdminClient(ClientOptions(address="127.0.0.1:7070", token=OPS_TOKEN))
>>> admin.put_tenant("team-c", namespaces=["team-c"],
...                  tokens=[{"name": "c", "token": C_TOKEN, "scopes": ["read", "write"]}])
>>> admin.tenants()["tenants"]["team-c"]["namespaces"]
['team-c']

Every request needs a token with the ``admin`` scope (the operator's), except
two that a tenant's ``manage`` token may send for its own tenant: ``tenants()``
(which then lists that tenant alone) and ``put_tokens(tokens)`` (inline secrets,
no ``admin`` scope granted, one ``manage`` token kept); anything else is a
:class:`~kvstore.errors.ScopeError`. A malformed change is refused in one line
(:class:`~kvstore.errors.InvalidInputError`) and changes nothing.
Each call is one short connection that opens no store.
:class:`AsyncAdminClient` makes the same requests from asyncio (``await
admin.tenants()``), over the async client's connections.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvstore.client._common import ClientOptions, refused
from kvstore.client.aio import open_connection
from kvstore.client.connection import Connection
from kvstore.errors import AccessDeniedError, TierError
from kvstore.wire import Op, encode_json

__all__ = ["AdminClient", "AsyncAdminClient"]


def _tenant(
    name: str,
    namespaces: Sequence[str],
    tokens: Sequence[dict[str, Any]],
    quotas: dict[str, dict[str, Any]] | None,
) -> dict[str, Any]:
    """The ``tenant`` field of a ``put_tenant`` request."""
    body = {"name": name, "namespaces": list(namespaces), "tokens": list(tokens)}
    return {**body, "quotas": quotas or {}}


def _named(tenant: str | None) -> dict[str, str]:
    """The ``tenant`` field of a request that defaults to the caller's own tenant."""
    return {} if tenant is None else {"tenant": tenant}


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

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """The server's ``STATS`` as this token sees them (a tenant's: its own stores
        and figures; the operator's: every one), over a connection that opens no store.

        ``namespace``: the namespace the caller means to see; a token that does not
        open it is refused (AccessDeniedError naming the server, that namespace and the
        ones the token opens) rather than shown a server with no store of its own."""
        meta = b"" if namespace is None else encode_json({"namespace": namespace})
        conn = Connection(self.options, None)
        try:
            return conn.call_json(Op.STATS, meta)
        except AccessDeniedError as exc:
            if namespace is None:
                raise
            raise refused(replace(self.options, namespace=namespace), exc) from None
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
        return self.request("put_tenant", tenant=_tenant(name, namespaces, tokens, quotas))

    def put_tokens(
        self, tokens: Sequence[dict[str, Any]], tenant: str | None = None
    ) -> dict[str, Any]:
        """Replace a tenant's tokens (each ``{name, token, scopes}``) and keep the rest
        of it: a token rotation. ``tenant``: whose (None: the caller's own, the form a
        ``manage`` token uses); the tenants the caller sees, as they stand after."""
        return self.request("put_tokens", tokens=list(tokens), **_named(tenant))

    def remove_tenant(self, name: str) -> dict[str, Any]:
        """Remove tenant ``name`` and its tokens (its blocks stay in its namespaces)."""
        return self.request("remove_tenant", name=name)

    def reload(self) -> dict[str, Any]:
        """Re-read the server's config file for its tenants and tokens (like SIGHUP)."""
        return self.request("reload")


class AsyncAdminClient:
    """:class:`AdminClient`'s ADMIN requests as coroutines (see the module docstring):
    the same answers and errors, each request one short asyncio control connection
    under ``options.timeout``."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options

    async def request(self, action: str, **fields: Any) -> dict[str, Any]:
        """One ADMIN request and its JSON answer."""
        meta = encode_json({"action": action, **fields})

        async def exchange() -> dict[str, Any]:
            conn = await open_connection(self.options, None)
            try:
                return await conn.call_json(Op.ADMIN, meta)
            finally:
                conn.close()

        try:
            return await asyncio.wait_for(exchange(), self.options.timeout)
        except TimeoutError:
            raise TierError(f"kvstore-server at {self.options.address} did not answer") from None

    async def tenants(self) -> dict[str, Any]:
        """The tenants (namespaces, token names and scopes; never secrets) and older tokens."""
        return await self.request("tenants")

    async def put_tenant(
        self,
        name: str,
        namespaces: Sequence[str],
        tokens: Sequence[dict[str, Any]],
        quotas: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Add tenant ``name`` or replace it whole (as :meth:`AdminClient.put_tenant`);
        the tenants as they stand after."""
        return await self.request("put_tenant", tenant=_tenant(name, namespaces, tokens, quotas))

    async def put_tokens(
        self, tokens: Sequence[dict[str, Any]], tenant: str | None = None
    ) -> dict[str, Any]:
        """Replace a tenant's tokens (as :meth:`AdminClient.put_tokens`)."""
        return await self.request("put_tokens", tokens=list(tokens), **_named(tenant))

    async def remove_tenant(self, name: str) -> dict[str, Any]:
        """Remove tenant ``name`` and its tokens (its blocks stay in its namespaces)."""
        return await self.request("remove_tenant", name=name)

    async def reload(self) -> dict[str, Any]:
        """Re-read the server's config file for its tenants and tokens (like SIGHUP)."""
        return await self.request("reload")
