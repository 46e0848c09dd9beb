"""Tenants at run time: what each request's token may do, and the ADMIN request.

Every request past AUTH is checked here (:func:`check_scope`): the token is
looked up again among the tokens the server accepts *now* (a token removed at
run time stops working on its open connections at their next request), then
the request's op must be within its scopes (:data:`OP_SCOPES`). A connection
that opened a namespace its token no longer opens is refused too.

The ADMIN request (admin scope) lists the tenants, adds or replaces one,
replaces one's tokens, removes one, or reloads them from the config file (what
SIGHUP does). A token with a tenant's ``manage`` scope may send two of these,
for its own tenant only: ``tenants`` (which lists just that tenant) and
``put_tokens`` (its secrets inline, never a server file; no ``admin`` scope
granted; a ``manage`` token kept, so the tenant cannot lock itself out). A change
swaps the server's tokens whole (:meth:`Authenticator.replace`); stores and
their blocks are untouched: a removed tenant's blocks stay in its namespaces,
readable again once a tenant owns them. Changes made by ADMIN last until the
next reload or restart, which read the config file: put them there to keep them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from kvstore.config import (
    Credential,
    DaemonConfig,
    ServerConfig,
    StoreConfig,
    TenantConfig,
    TenantToken,
    check_tenant_name,
    parse_tenant,
    parse_token,
)
from kvstore.errors import AccessDeniedError, ConfigError, InvalidInputError, ScopeError
from kvstore.wire import Authenticator, Op

__all__ = ["OP_SCOPES", "AdminDesk", "check_scope", "describe"]

log = logging.getLogger(__name__)

#: The scope each op needs. PING, HELLO and AUTH need none; shared memory is
#: writable by whoever maps it, so attaching it needs ``write``.
OP_SCOPES: dict[int, str] = {
    Op.OPEN: "read",
    Op.STATS: "read",
    Op.GET: "read",
    Op.RELEASE: "read",
    Op.EXISTS: "read",
    Op.LOOKUP: "read",
    Op.LIST: "read",
    Op.PUT: "write",
    Op.RESERVE: "write",
    Op.COMMIT: "write",
    Op.DELETE: "write",
    Op.TOKENS: "write",
    Op.HINT: "write",
    Op.SHM_ATTACH: "write",
    Op.ADMIN: "manage",  # admin includes it; AdminDesk sorts out what each may do
}


def check_scope(auth: Authenticator, credential: Credential, op: int) -> Credential:
    """``credential`` as it stands now, if it may send ``op``; else AccessDeniedError
    (a removed token: the caller closes the connection)."""
    now = auth.current(credential)
    if now is None:
        raise AccessDeniedError("this token is no longer accepted")
    scope = OP_SCOPES.get(op)
    if scope is not None and not now.may(scope):
        raise AccessDeniedError(
            f"token {now.name!r} lacks the {scope} scope needed by {Op(op).name} "
            f"(it has: {', '.join(sorted(now.scopes))})"
        )
    return now


def describe(server: ServerConfig, only: str | None = None) -> dict[str, Any]:
    """The tenants and tokens, without their secrets (the ``tenants`` admin answer);
    ``only``: that tenant alone, as its manager sees it (no other tenant, no server token)."""
    tenants = {
        t.name: {
            "namespaces": list(t.namespaces),
            "tokens": [{"name": k.name, "scopes": list(k.scopes)} for k in t.tokens],
            "quotas": {q.tier: {"share": q.share, "limit": q.limit} for q in t.quotas},
            "events_endpoint": t.events_endpoint,
            "events_auth": t.events_auth,
        }
        for t in server.tenants
        if only is None or t.name == only
    }
    if only is not None:
        return {"tenants": tenants}
    tokens = [
        {"name": t.name or f"tokens[{i}]", "namespaces": list(t.namespaces)}
        for i, t in enumerate(server.tokens)
    ]
    has_default = server.token is not None or server.token_file is not None
    return {"tenants": tenants, "tokens": tokens, "operator_token": has_default}


Reloader = Callable[[], StoreConfig | DaemonConfig]

_ACTIONS = ("tenants", "put_tenant", "put_tokens", "remove_tenant", "reload")
_ACTIONS_TEXT = ", ".join(_ACTIONS)


def _check_managed(tokens: tuple[TenantToken, ...]) -> None:
    """Refuse (ScopeError) tokens a tenant's manager may not set: a secret read
    from a file (the server's files are the operator's), the admin scope (the operator
    grants it), or none left with ``manage`` (the tenant would lock itself out)."""
    for token in tokens:
        if token.token_file is not None:
            raise ScopeError(
                f"admin put_tokens: {token.name or 'a token'}: a tenant's manager gives "
                "secrets inline ('token'); token files are the operator's"
            )
        if "admin" in token.scopes:
            raise ScopeError(
                f"admin put_tokens: {token.name or 'a token'}: only the operator grants "
                "the admin scope"
            )
    if not any("manage" in t.scopes for t in tokens):
        raise InvalidInputError(
            "admin put_tokens: keep one token with the manage scope, or the tenant could "
            "not manage its tokens again (the operator can)"
        )


class AdminDesk:
    """Serves ADMIN requests and reloads; holds the server section in force now.

    ``config``: the server's config by role, at start. ``auth``: the authenticator whose
    tokens change. ``reloader``: reads the config file again (None: nothing to
    reload). Loop-only: no lock.
    """

    def __init__(
        self, config: DaemonConfig, auth: Authenticator, reloader: Reloader | None
    ) -> None:
        self.server = config.server
        self._auth = auth
        self._reloader = reloader
        #: Called with the new server section after each change (the context follows it).
        self.on_change: Callable[[ServerConfig], None] | None = None
        #: Checks a new server section against the rest of the server (the tiers the
        #: quotas name); raises ConfigError to refuse it.
        self.check: Callable[[ServerConfig], None] | None = None

    def handle(self, request: dict[str, Any], caller: Credential | None = None) -> dict[str, Any]:
        """One ADMIN request: ``{"action": tenants | put_tenant | put_tokens |
        remove_tenant | reload}``. ``caller``: the token that sent it (None: a server
        without tokens, whose every client is its operator)."""
        action = request.get("action")
        if action not in _ACTIONS:
            raise InvalidInputError(f"admin: unknown action {action!r}; actions: {_ACTIONS_TEXT}")
        if caller is not None and not caller.may("admin"):
            return self._manage(action, request, caller)
        if action == "tenants":
            return describe(self.server)
        if action == "put_tenant":
            return self._put(request.get("tenant"))
        if action == "put_tokens":
            return self._put_tokens(request.get("tenant"), request.get("tokens"), manager=False)
        if action == "remove_tenant":
            return self._remove(request.get("name"))
        return self.reload()

    def _manage(self, action: str, request: dict[str, Any], caller: Credential) -> dict[str, Any]:
        """What a tenant's ``manage`` token may do: see its tenant, replace its tokens."""
        own = caller.tenant
        if action not in ("tenants", "put_tokens"):
            raise ScopeError(
                f"admin {action}: needs the admin scope; token {caller.name!r} manages only "
                f"its tenant {own!r} (tenants, put_tokens)"
            )
        named = request.get("tenant", own)
        if named != own:
            raise ScopeError(
                f"admin {action}: token {caller.name!r} manages only its tenant {own!r}"
            )
        if action == "put_tokens":
            self._put_tokens(own, request.get("tokens"), manager=True)
        return describe(self.server, only=own)

    def _put_tokens(self, name: Any, raw: Any, *, manager: bool) -> dict[str, Any]:
        """Replace tenant ``name``'s tokens with ``raw`` (the tenant's other settings and
        blocks stay); a ``manager`` is held to :func:`_check_managed`."""
        tenant = next((t for t in self.server.tenants if t.name == name), None)
        if tenant is None:
            raise InvalidInputError(f"admin put_tokens: no tenant {name!r}")
        if not isinstance(raw, list) or not raw:
            raise InvalidInputError(
                "admin put_tokens: give 'tokens': [{name, token, scopes}, ...] (at least one)"
            )
        try:
            tokens = tuple(parse_token(t, f"tokens[{i}]") for i, t in enumerate(raw))
        except ConfigError as exc:
            raise InvalidInputError(f"admin put_tokens: {exc}") from None
        if manager:
            _check_managed(tokens)
        changed = dataclasses.replace(tenant, tokens=tokens)
        kept = tuple(changed if t.name == name else t for t in self.server.tenants)
        self._apply(dataclasses.replace(self.server, tenants=kept))
        log.info("admin: tenant %r tokens replaced (%d tokens)", name, len(tokens))
        return describe(self.server)

    def _put(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise InvalidInputError("admin put_tenant: give 'tenant': {name, namespaces, tokens}")
        name = check_tenant_name(body.get("name"), "tenant.name")
        tenant = parse_tenant(name, body, f"tenant {name}")
        kept = tuple(t for t in self.server.tenants if t.name != name)
        self._apply(dataclasses.replace(self.server, tenants=(*kept, tenant)))
        log.info("admin: tenant %r set (%d tokens)", name, len(tenant.tokens))
        return describe(self.server)

    def _remove(self, name: Any) -> dict[str, Any]:
        kept: tuple[TenantConfig, ...] = tuple(t for t in self.server.tenants if t.name != name)
        if len(kept) == len(self.server.tenants):
            raise InvalidInputError(f"admin remove_tenant: no tenant {name!r}")
        self._apply(dataclasses.replace(self.server, tenants=kept))
        log.info("admin: tenant %r removed (its blocks stay)", name)
        return describe(self.server)

    def reload(self) -> dict[str, Any]:
        """Read the config file again and take its tokens and tenants (nothing else:
        other settings need a restart). A bad file changes nothing (ConfigError)."""
        if self._reloader is None:
            raise InvalidInputError("admin reload: this server was not started from a config file")
        fresh = DaemonConfig.of(self._reloader()).server
        fields = ("token", "token_file", "tokens", "tenants")
        changes = {name: getattr(fresh, name) for name in fields}
        self._apply(dataclasses.replace(self.server, **changes))
        log.info("reloaded tenants and tokens: %d tenants", len(self.server.tenants))
        return describe(self.server)

    def _apply(self, server: ServerConfig) -> None:
        """Check ``server`` whole, read its secrets, then swap (or raise, changing nothing)."""
        try:
            server.validate("server")
            server.check_startable()
            credentials = server.credentials()
            if self.check is not None:
                self.check(server)
        except ConfigError as exc:
            raise InvalidInputError(f"admin: {exc}") from None
        self._auth.replace(credentials, server.owners())
        self.server = server
        if self.on_change is not None:
            self.on_change(server)
