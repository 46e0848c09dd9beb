"""The ``server.tenants`` section: who shares a kvstore-server, with which tokens and scopes.

A tenant owns namespaces (no two tenants own the same one) and tokens; each
token maps to that one tenant and carries scopes among ``read`` (OPEN, GET,
EXISTS, LOOKUP, LIST, STATS), ``write`` (PUT, RESERVE/COMMIT, DELETE, TOKENS,
HINT, shared memory), ``manage`` (the tenant's own administration: list its
tenant and replace its tokens, nothing else) and ``admin`` (the operator's: the
ADMIN request over every tenant; list, change and reload tenants and tokens)::

    server:
      tenants:
        team-a:
          namespaces: [team-a]
          tokens:
            - {name: a-engine, token_file: /etc/kvstore/a.token}           # read, write
            - {name: a-reader, token_file: /etc/kvstore/a-ro.token, scopes: [read]}
            - {name: a-lead, token_file: /etc/kvstore/a-lead.token, scopes: [manage]}
          quotas:
            host: {share: 4GiB, limit: 6GiB}
            disk: {share: 100GiB, limit: 200GiB}
        ops:
          tokens:
            - {name: ops, token_file: /etc/kvstore/ops.token, scopes: [read, write, admin]}

``quotas``: per tier kind, the bytes the tenant is guaranteed (``share``) and
may never pass (``limit``), across all its namespaces; the tier's configured
capacity is the pool tenants share (:mod:`kvstore.datapath.quota` says how it is kept).

A tenant's token opens only the tenant's namespaces. ``admin`` is the
operator's scope: it manages every tenant and opens every namespace; ``manage``
lets a tenant rotate its own tokens without the operator. The list form (``- {name: team-a,
...}``) is accepted too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config._fields import build, opt
from kvstore.config.events import EventsConfig
from kvstore.config.kinds import tier_kinds
from kvstore.config.tiers import check_namespace
from kvstore.config.values import (
    parse_bool,
    parse_optional_secret,
    parse_optional_str,
    parse_size,
    parse_str,
)
from kvstore.errors import ConfigError

__all__ = [
    "DEFAULT_SCOPES",
    "SCOPES",
    "TenantConfig",
    "TenantToken",
    "TierQuotaConfig",
    "check_tenant_name",
    "parse_tenant",
    "parse_tenants",
    "parse_token",
]

#: Every scope a token may carry.
SCOPES = ("read", "write", "manage", "admin")
#: A token's scopes when its entry names none.
DEFAULT_SCOPES = ("read", "write")


def check_tenant_name(name: object, path: str) -> str:
    """``name`` if it may name a tenant (a namespace's rules), else ConfigError."""
    return check_namespace(name, path)


def _scopes(value: Any, path: str) -> tuple[str, ...]:
    if value is None:
        return DEFAULT_SCOPES
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{path}: expected a list of scopes among {', '.join(SCOPES)}")
    for scope in value:
        if scope not in SCOPES:
            raise ConfigError(f"{path}: unknown scope {scope!r}; scopes: {', '.join(SCOPES)}")
    return tuple(s for s in SCOPES if s in value)


@dataclass(frozen=True)
class TenantToken:
    """One token of a tenant: its secret (inline or in a file) and its scopes.

    ``name``: what the server calls it (logs, the AUTH reply); default
    ``server.tenants.<tenant>.tokens[i]``.

    ``token`` / ``token_file``: the secret, inline or in a file (its first
    line, whitespace stripped): exactly one of the two, at least 16 characters.

    ``scopes``: among ``read``, ``write``, ``manage`` and ``admin`` (default read,
    write).
    """

    name: str = opt("", parse_str)
    token: str | None = opt(None, parse_optional_secret)
    token_file: str | None = opt(None, parse_optional_str)
    scopes: tuple[str, ...] = DEFAULT_SCOPES

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for a secret given twice or not at all."""
        if (self.token is None) == (self.token_file is None):
            raise ConfigError(f"{path}: give exactly one of token and token_file")
        _scopes(list(self.scopes), f"{path}.scopes")


@dataclass(frozen=True)
class TierQuotaConfig:
    """A tenant's bytes in one tier kind.

    ``tier``: the tier kind (``host``, ``disk``, ...).

    ``share``: bytes guaranteed: blocks within it are never evicted for others.

    ``limit``: bytes the tenant may never pass (its own blocks go first, or a put
    is refused); default: no limit but the tier's.
    """

    tier: str = opt("", parse_str)
    share: int = opt(0, parse_size)
    limit: int | None = opt(None, lambda v, k: None if v is None else parse_size(v, k))

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for a limit below the share."""
        if self.share < 0:
            raise ConfigError(f"{path}.share: must be >= 0, got {self.share}")
        if self.limit is not None and self.limit < self.share:
            raise ConfigError(f"{path}.limit: {self.limit} is below the share {self.share}")


@dataclass(frozen=True)
class TenantConfig:
    """A tenant: the namespaces it owns and the tokens that act for it.

    ``name``: the tenant's name (the key of its entry in ``server.tenants``):
    1-64 letters, digits, ``-``, ``_`` or ``.``.

    ``namespaces``: the namespaces it owns (no other tenant may own one); its
    tokens open these and no others (a token with the admin scope opens all).

    ``tokens``: the tokens that act for it, each with its scopes.

    ``quotas``: its share and limit per tier kind (none: unbounded, and it
    yields nothing to others).

    ``events_endpoint`` / ``events_replay_endpoint``: with ``events.enabled``,
    the ZMQ sockets (PUB, and ROUTER for replays) that carry this tenant's KV
    events, and only its: its stores publish there instead of on ``events.endpoint``.
    None: its events go out with the server's.

    ``events_auth``: subscribers of those sockets must authenticate (ZMQ PLAIN: user
    the tenant's name, password one of its tokens with the ``read`` scope, or the
    operator's), checked against the tokens as they stand at each connection. Off by
    default: consumers such as Dynamo's indexer connect without credentials. PLAIN
    sends the token as it is: keep such an endpoint on ``ipc://`` or behind a tunnel.
    """

    name: str
    namespaces: tuple[str, ...] = ()
    tokens: tuple[TenantToken, ...] = ()
    quotas: tuple[TierQuotaConfig, ...] = ()
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_auth: bool = False

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` naming ``path`` for a bad name, namespace or token."""
        check_tenant_name(self.name, f"{path}.name")
        for i, ns in enumerate(self.namespaces):
            check_namespace(ns, f"{path}.namespaces[{i}]")
        if len(set(self.namespaces)) != len(self.namespaces):
            raise ConfigError(f"{path}.namespaces: a namespace is listed twice")
        for i, token in enumerate(self.tokens):
            token.validate(f"{path}.tokens[{i}]")
        for quota in self.quotas:
            quota.validate(f"{path}.quotas.{quota.tier}")
        for name in ("events_replay_endpoint", "events_auth"):
            if getattr(self, name) and self.events_endpoint is None:
                raise ConfigError(f"{path}.{name}: give events_endpoint too")
        if self.events_endpoint is not None:
            self.events(EventsConfig(), path)

    def events(self, base: EventsConfig, path: str = "") -> EventsConfig:
        """``base`` (the server's ``events``) with this tenant's endpoints."""
        assert self.events_endpoint is not None
        try:
            return dataclasses.replace(
                base, endpoint=self.events_endpoint, replay_endpoint=self.events_replay_endpoint
            )
        except ConfigError as exc:  # named as the tenant's keys
            message = str(exc).replace("events.", f"{path}.events_")
            raise ConfigError(message) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-friendly form (secrets included: for config files, not replies)."""
        return {
            "namespaces": list(self.namespaces),
            "tokens": [_token_dict(t) for t in self.tokens],
            "quotas": {q.tier: {"share": q.share, "limit": q.limit} for q in self.quotas},
            "events_endpoint": self.events_endpoint,
            "events_replay_endpoint": self.events_replay_endpoint,
            "events_auth": self.events_auth,
        }


def _token_dict(token: TenantToken) -> dict[str, Any]:
    named = {"name": token.name} if token.name else {}  # unnamed: named by its place
    secret = {"token": token.token, "token_file": token.token_file}
    return {**named, **secret, "scopes": list(token.scopes)}


def _names(value: Any, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of names, got {type(value).__name__}")
    return tuple(value)


def parse_token(item: Any, path: str) -> TenantToken:
    """One tenant token from its mapping (``name``, ``token`` or ``token_file``,
    ``scopes``); ConfigError naming ``path`` if malformed."""
    if not isinstance(item, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(item).__name__}")
    rest = {k: v for k, v in item.items() if k != "scopes"}
    token: TenantToken = build(TenantToken, rest, path)
    scopes = _scopes(item.get("scopes"), f"{path}.scopes")
    checked = TenantToken(token.name, token.token, token.token_file, scopes)
    checked.validate(path)
    return checked


def _quotas(value: Any, path: str) -> tuple[TierQuotaConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping of tier kind to {{share, limit}}")
    out = []
    for kind, body in value.items():
        if kind not in tier_kinds():
            raise ConfigError(f"{path}.{kind}: unknown tier kind; kinds: {', '.join(tier_kinds())}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{path}.{kind}: expected a mapping with share and limit")
        quota: TierQuotaConfig = build(TierQuotaConfig, {**body, "tier": kind}, f"{path}.{kind}")
        quota.validate(f"{path}.{kind}")
        out.append(quota)
    return tuple(out)


def parse_tenant(name: str, body: Any, path: str) -> TenantConfig:
    """One tenant from its mapping (``namespaces``, ``tokens``); ConfigError if malformed."""
    if not isinstance(body, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(body).__name__}")
    keys = {"namespaces", "tokens", "quotas", "events_endpoint", "events_replay_endpoint"}
    keys.add("events_auth")
    unknown = set(body) - {"name", *keys}
    if unknown:
        allowed = ", ".join(sorted(keys))
        raise ConfigError(f"{path}.{sorted(unknown)[0]}: unknown key; allowed: {allowed}")
    namespaces = _names(body.get("namespaces"), f"{path}.namespaces")
    raw = body.get("tokens") or []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{path}.tokens: expected a list of tokens")
    tokens = tuple(parse_token(t, f"{path}.tokens[{i}]") for i, t in enumerate(raw))
    quotas = _quotas(body.get("quotas"), f"{path}.quotas")
    endpoint, replay = (
        parse_optional_str(body.get(k), f"{path}.{k}")
        for k in ("events_endpoint", "events_replay_endpoint")
    )
    auth = parse_bool(body.get("events_auth", False), f"{path}.events_auth")
    tenant = TenantConfig(name, namespaces, tokens, quotas, endpoint, replay, auth)
    tenant.validate(path)
    return tenant


def parse_tenants(value: Any, path: str) -> tuple[TenantConfig, ...]:
    """``server.tenants`` as a mapping (name: body) or a list of bodies with ``name``."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = [(str(k), v, f"{path}.{k}") for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = []
        for i, body in enumerate(value):
            name = body.get("name") if isinstance(body, Mapping) else None
            items.append((check_tenant_name(name, f"{path}[{i}].name"), body, f"{path}[{i}]"))
    else:
        raise ConfigError(f"{path}: expected a mapping of tenants, got {type(value).__name__}")
    tenants = tuple(parse_tenant(name, body, where) for name, body, where in items)
    check_unique(tenants, path)
    return tenants


def check_unique(tenants: tuple[TenantConfig, ...], path: str) -> None:
    """Raise ConfigError for two tenants of one name or one namespace owned twice."""
    owner: dict[str, str] = {}
    seen: set[str] = set()
    for tenant in tenants:
        if tenant.name in seen:
            raise ConfigError(f"{path}: tenant {tenant.name!r} is given twice")
        seen.add(tenant.name)
        for ns in tenant.namespaces:
            if ns in owner:
                raise ConfigError(
                    f"{path}.{tenant.name}.namespaces: namespace {ns!r} "
                    f"already belongs to tenant {owner[ns]!r}"
                )
            owner[ns] = tenant.name
