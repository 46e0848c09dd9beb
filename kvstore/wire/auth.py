"""Token authentication by challenge and response, and what each token may open.

The server sends a fresh random nonce in its HELLO reply; the client answers
with ``HMAC-SHA256(token, "kvstore-auth-v1|" + nonce)``. The token never
crosses the wire, a captured answer is useless on another connection, and
the server compares with :func:`hmac.compare_digest` (constant time) against
every configured token, so timing tells nothing about which one nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from kvstore.config import Credential

__all__ = ["NONCE_BYTES", "Authenticator", "answer", "new_nonce"]

NONCE_BYTES = 32
_CONTEXT = b"kvstore-auth-v1|"


def new_nonce() -> bytes:
    """A challenge for one connection."""
    return secrets.token_bytes(NONCE_BYTES)


def answer(token: bytes, nonce: bytes) -> bytes:
    """The client's response to ``nonce`` with ``token``."""
    return hmac.new(token, _CONTEXT + nonce, hashlib.sha256).digest()


class Authenticator:
    """The tokens a server accepts (none: every client is trusted, all namespaces).

    ``owned``: namespaces that tenants own (namespace: tenant); a token without a
    namespace list opens none of them. A token with the admin scope opens every one. The tokens
    change at run time with :meth:`replace` (connections re-check theirs with
    :meth:`current` on every request).
    """

    def __init__(
        self, credentials: Sequence[Credential], owned: dict[str, str] | None = None
    ) -> None:
        self._credentials = list(credentials)
        self._by_secret = {c.secret: c for c in self._credentials}
        self._owned = dict(owned or {})

    def replace(self, credentials: Sequence[Credential], owned: dict[str, str]) -> None:
        """Accept these tokens from now on (swapped whole: no request sees half)."""
        by_secret = {c.secret: c for c in credentials}
        self._credentials, self._by_secret, self._owned = list(credentials), by_secret, dict(owned)

    def current(self, credential: Credential) -> Credential | None:
        """``credential`` as the tokens stand now: changed scopes or namespaces, or None
        when its token was removed."""
        return self._by_secret.get(credential.secret)

    def tenant_of(self, namespace: str) -> str:
        """The tenant owning ``namespace`` (``default`` when none does)."""
        return self._owned.get(namespace, "default")

    @property
    def required(self) -> bool:
        """True when clients must authenticate."""
        return bool(self._credentials)

    def verify(self, nonce: bytes, response: bytes) -> Credential | None:
        """The credential whose token produced ``response``, or None."""
        found = None
        for cred in self._credentials:  # no early exit: the time taken is the same
            if hmac.compare_digest(answer(cred.secret, nonce), response):
                found = cred
        return found

    def reads_events_of(self, tenant: str, user: str, secret: bytes) -> bool:
        """Whether ``secret`` is, as the tokens stand now, a token that may read
        ``tenant``'s KV events: one of that tenant's with the read scope (``user`` names
        the tenant), or the operator's (admin scope). Compared with every token in
        constant time, as :meth:`verify` does."""
        found = None
        for cred in self._credentials:
            if hmac.compare_digest(cred.secret, secret):
                found = cred
        if found is None:
            return False
        if found.may("admin"):
            return True
        return user == tenant == found.tenant and found.may("read")

    def reach(self, credential: Credential | None) -> str:
        """The namespaces ``credential`` opens, in words (for a refusal that says which
        namespace to ask for instead)."""
        if credential is None or credential.may("admin"):
            return "every namespace"
        if credential.namespaces is None:
            return "every namespace no tenant owns"
        names = sorted(credential.namespaces)
        if not names:
            return "no namespace"
        listed = ", ".join(repr(n) for n in names)
        return f"namespace {listed}" if len(names) == 1 else f"namespaces {listed}"

    def refusal(self, credential: Credential | None, namespace: str) -> str:
        """The one line that refuses ``namespace`` to ``credential``: which it does open."""
        opens = self.reach(credential)
        return f"this token does not open namespace {namespace!r}; it opens {opens}"

    def allows(self, credential: Credential | None, namespace: str) -> bool:
        """Whether ``credential`` (None: an unauthenticated server) opens ``namespace``."""
        if credential is None or credential.may("admin"):  # the operator opens them all
            return True
        if credential.namespaces is None:
            return namespace not in self._owned
        return namespace in credential.namespaces
