"""The ``server:`` section: how ``kvstore-server`` listens, authenticates and limits clients.

Read from the same YAML / env as the store config (``KVSTORE_SERVER_LISTEN``,
``KVSTORE_SERVER_TOKEN``, ...); the command line overrides it. Tokens are
secrets: a token is given inline (``token``), or better in a file
(``token_file``, first line, whitespace stripped), and each extra token in
``tokens`` may be limited to some namespaces::

    server:
      listen: 0.0.0.0:7070
      token_file: /etc/kvstore/admin.token       # every namespace
      tokens:
        - {name: team-a, token_file: /etc/kvstore/a.token, namespaces: [team-a]}
        - {name: team-b, token_file: /etc/kvstore/b.token, namespaces: [team-b, shared]}

Tenants (``tenants``, :mod:`kvstore.config.tenants`) own namespaces and tokens
with scopes. The older forms map onto them: ``token`` / ``token_file`` is the
operator's token (tenant ``default``, every namespace, scopes read, write and
admin); each ``tokens`` entry is a tenant of its own named after the token
(scopes read and write) whose namespaces are those it lists, or, when it lists
none, every namespace no tenant of ``tenants`` owns.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config._fields import build, check_positive, opt
from kvstore.config.tenants import SCOPES, TenantConfig, check_unique, parse_tenants
from kvstore.config.tiers import check_address, check_namespace
from kvstore.config.values import (
    parse_bool,
    parse_float,
    parse_int,
    parse_optional_secret,
    parse_optional_str,
    parse_size,
    parse_str,
)
from kvstore.errors import ConfigError

__all__ = ["Credential", "ServerConfig", "TokenConfig", "is_loopback"]

MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Credential:
    """A token the server accepts: its secret, the namespaces it opens (None: every
    namespace no tenant owns, or every one with the admin scope), its tenant and scopes."""

    name: str
    secret: bytes
    namespaces: frozenset[str] | None
    tenant: str = "default"
    scopes: frozenset[str] = frozenset({"read", "write"})

    def may(self, scope: str) -> bool:
        """Whether this token carries ``scope`` (``admin``, the operator's, includes a
        tenant's ``manage``)."""
        return scope in self.scopes or (scope == "manage" and "admin" in self.scopes)


@dataclass(frozen=True)
class TokenConfig:
    """One client token: inline or in a file, limited to ``namespaces`` (empty: all).

    ``name``: what the server calls the token (it answers the name to a client
    that authenticates with it); default: its place, ``server.tokens[i]``.

    ``token`` / ``token_file``: the secret, inline or in a file (its first
    line, whitespace stripped): exactly one of the two, at least 16 characters.

    ``namespaces``: the namespaces the token opens; empty: every namespace.
    """

    name: str = opt("", parse_str)
    token: str | None = opt(None, parse_optional_secret)
    token_file: str | None = opt(None, parse_optional_str)
    namespaces: tuple[str, ...] = ()

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for a token given twice or not at all."""
        if (self.token is None) == (self.token_file is None):
            raise ConfigError(f"{path}: give exactly one of token and token_file")
        for i, ns in enumerate(self.namespaces):
            check_namespace(ns, f"{path}.namespaces[{i}]")

    def credential(self, path: str) -> Credential:
        """Read the secret (from the file if one is named)."""
        secret = _read_secret(self.token, self.token_file, path)
        name = self.name or path
        return Credential(name, secret, frozenset(self.namespaces) or None, tenant=name)


def _read_secret(token: str | None, token_file: str | None, path: str) -> bytes:
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as exc:
            raise ConfigError(f"{path}.token_file {token_file!r}: {exc.strerror}") from None
    assert token is not None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{path}: a token must have at least {MIN_TOKEN_CHARS} characters "
            "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token.encode()


def _parse_tokens(value: Any, path: str) -> tuple[TokenConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of tokens, got {type(value).__name__}")
    tokens = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(item).__name__}")
        namespaces = item.get("namespaces") or []
        if not isinstance(namespaces, (list, tuple)):
            raise ConfigError(f"{where}.namespaces: expected a list of names")
        rest = {k: v for k, v in item.items() if k != "namespaces"}
        token: TokenConfig = build(TokenConfig, rest, where)
        token = TokenConfig(token.name, token.token, token.token_file, tuple(namespaces))
        token.validate(where)
        tokens.append(token)
    return tuple(tokens)


def is_loopback(address: str) -> bool:
    """True for a Unix socket or a TCP address only this host can reach."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``kvstore-server`` (docs/server.md shows them in context).

    ``listen``: TCP ``HOST:PORT`` (port 0 picks a free one); None: no TCP.

    ``unix_socket``: also listen on this Unix socket path (created mode 0600:
    this user only).

    ``metrics_listen``: HTTP ``HOST:PORT`` serving Prometheus ``/metrics`` and
    ``/healthz``; None: no metrics endpoint.

    ``token`` / ``token_file``: a token that opens every namespace, inline or
    in a file (its first line); at least 16 characters. A server listening
    beyond loopback with no token refuses to start.

    ``tokens``: more tokens, each limited to some namespaces.

    ``tenants``: tenants owning namespaces and tokens with scopes
    (:mod:`kvstore.config.tenants`); changed at run time by an admin request
    or a reload (SIGHUP).

    ``tls_cert`` / ``tls_key``: a PEM certificate chain and its private key:
    TCP connections then use TLS.

    ``shared_memory``: offer same-host clients the host tier's memory
    directly (a memfd they map) instead of copying blocks over the socket.

    ``max_frame_bytes``: the largest payload of one request.

    ``max_batch_blocks``: the most keys in one request.

    ``max_inflight_requests``: requests served at once per connection (and
    its open loans and reservations).

    ``max_inflight_bytes``: payload bytes in flight across the whole server;
    requests past it wait.

    ``max_connections``: connections past this are closed at once.

    ``max_stores``: (namespace, layout) stores clients may open; each has
    the configured tiers, so this bounds the server's memory.

    ``idle_timeout_s``: a connection silent this long is closed.

    ``io_timeout_s`` / ``min_rate``: a frame must arrive whole within
    ``io_timeout_s`` plus its size at ``min_rate`` bytes per second, or the
    connection is closed (slow clients hold nothing for long).

    ``reservation_hold_s``: a RESERVE dropped before its COMMIT (not committed
    within ``io_timeout_s``, or its connection ended) keeps its shared-memory slots
    reserved until its client's late COMMIT says the copies ended, the client
    process exits, or this long: a writer frozen mid-copy must not write into
    slots given to other blocks.

    ``drain_timeout_s``: how long SIGTERM waits for requests in flight before
    it closes connections and flushes memory to disk.

    ``threads``: worker threads for store operations (copies, checksums,
    disk reads).
    """

    listen: str | None = opt("127.0.0.1:7070", parse_optional_str)
    unix_socket: str | None = opt(None, parse_optional_str)
    metrics_listen: str | None = opt(None, parse_optional_str)
    token: str | None = opt(None, parse_optional_secret)
    token_file: str | None = opt(None, parse_optional_str)
    tokens: tuple[TokenConfig, ...] = opt((), _parse_tokens)
    tenants: tuple[TenantConfig, ...] = opt((), parse_tenants)
    tls_cert: str | None = opt(None, parse_optional_str)
    tls_key: str | None = opt(None, parse_optional_str)
    shared_memory: bool = opt(True, parse_bool)
    max_frame_bytes: int = opt(2 * 1024**3, parse_size)
    max_batch_blocks: int = opt(1024, parse_int)
    max_inflight_requests: int = opt(16, parse_int)
    max_inflight_bytes: int = opt(2 * 1024**3, parse_size)
    max_connections: int = opt(1024, parse_int)
    max_stores: int = opt(8, parse_int)
    idle_timeout_s: float = opt(600.0, parse_float)
    io_timeout_s: float = opt(30.0, parse_float)
    min_rate: int = opt(1024**2, parse_size)
    reservation_hold_s: float = opt(600.0, parse_float)
    drain_timeout_s: float = opt(30.0, parse_float)
    threads: int = opt(8, parse_int)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` (naming ``path.key``) for impossible values."""
        if self.listen:
            check_address(self.listen, f"{path}.listen", any_port=True)
            if self.listen.startswith("unix:"):
                raise ConfigError(f"{path}.listen: use unix_socket for a Unix socket")
        if self.metrics_listen:
            check_address(self.metrics_listen, f"{path}.metrics_listen", True, url="http")
        if not self.listen and not self.unix_socket:
            raise ConfigError(f"{path}: give listen or unix_socket (or both)")
        if self.token is not None and self.token_file is not None:
            raise ConfigError(f"{path}.token_file: give token or token_file, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"{path}.tls_key: TLS needs both tls_cert and tls_key")
        for i, token in enumerate(self.tokens):
            token.validate(f"{path}.tokens[{i}]")
        self._check_tenants(path)
        check_positive(
            self,
            path,
            "max_frame_bytes",
            "max_batch_blocks",
            "max_inflight_requests",
            "max_inflight_bytes",
            "max_connections",
            "max_stores",
            "idle_timeout_s",
            "io_timeout_s",
            "min_rate",
            "reservation_hold_s",
            "drain_timeout_s",
            "threads",
        )

    def _check_tenants(self, path: str) -> None:
        """Tenants valid and apart; no older token names a namespace a tenant owns."""
        for tenant in self.tenants:
            tenant.validate(f"{path}.tenants.{tenant.name}")
        check_unique(self.tenants, f"{path}.tenants")
        owned = self.owners()
        for i, token in enumerate(self.tokens):
            for ns in token.namespaces:
                if ns in owned:
                    raise ConfigError(
                        f"{path}.tokens[{i}].namespaces: {ns!r} belongs to tenant "
                        f"{owned[ns]!r}; give the token to that tenant instead"
                    )

    def owners(self) -> dict[str, str]:
        """The tenant that owns each namespace named in ``tenants``."""
        return {ns: t.name for t in self.tenants for ns in t.namespaces}

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-friendly dict that the config reads back to an equal section."""
        data = dataclasses.asdict(self)
        data["tokens"] = [{**t, "namespaces": list(t["namespaces"])} for t in data["tokens"]]
        data["tenants"] = {t.name: t.to_dict() for t in self.tenants}
        return data

    def credentials(self) -> list[Credential]:
        """Every accepted token, secrets read from their files (ConfigError if unreadable)."""
        creds = []
        if self.token is not None or self.token_file is not None:
            secret = _read_secret(self.token, self.token_file, "server.token")
            creds.append(Credential("default", secret, None, "default", frozenset(SCOPES)))
        creds += [t.credential(f"server.tokens[{i}]") for i, t in enumerate(self.tokens)]
        for tenant in self.tenants:
            for i, token in enumerate(tenant.tokens):
                where = f"server.tenants.{tenant.name}.tokens[{i}]"
                secret = _read_secret(token.token, token.token_file, where)
                name = token.name or where
                opens = frozenset(tenant.namespaces)
                creds.append(Credential(name, secret, opens, tenant.name, frozenset(token.scopes)))
        secrets = [c.secret for c in creds]
        if len(set(secrets)) != len(secrets):
            raise ConfigError("server.tokens: two entries have the same token")
        return creds

    def exposure(self) -> str | None:
        """Why this config must not start without a token (None when it may)."""
        # Metrics carry counters, never block data: they may be scraped from outside.
        if self.listen and not is_loopback(self.listen):
            return f"listen {self.listen} is reachable from other hosts"
        return None

    def check_startable(self) -> None:
        """Refuse (ConfigError, saying why) an exposed server with no token, a TLS file
        that is not there, or a token that cannot be read (before anything is opened)."""
        why = self.exposure()
        has_token = self.token is not None or self.token_file is not None or bool(self.tokens)
        has_token = has_token or any(t.tokens for t in self.tenants)
        if why and not has_token:
            raise ConfigError(
                f"refusing to start: {why} and no token is set. Set server.token_file "
                "(or --token-file, or KVSTORE_SERVER_TOKEN), or listen on 127.0.0.1 / a Unix socket"
            )
        if self.tls_cert is not None:
            for name in ("tls_cert", "tls_key"):
                file = getattr(self, name)
                if not os.path.isfile(file):
                    raise ConfigError(f"server.{name}: {file!r} is not a readable file")
        self.credentials()  # a token file missing or too short: said now, not after set-up
