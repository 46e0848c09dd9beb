"""Secrets out of everything kvstore prints: one helper for configs, reports, logs, errors.

A secret is a password in a URL (``redis://:PASSWORD@host``, ``rediss://user:PASSWORD@``,
an S3 ``endpoint_url`` with credentials), a ``password=`` / ``token=`` in a URL's query,
or the value of a key that holds one in a config or a report (``token``, ``password``,
``secret_key``, ...). Whatever prints a URL, a config, or an error or exception whose
text may hold one passes it through :func:`mask_text` or :func:`mask_config` first:
``kvstore config``, the server's banner, the tiers' logs and errors, the cluster index.

The user part of a URL is not a secret (it stays, so a reader can tell which account is
meant); the password becomes ``***``. Tokens are never formatted into messages in the
first place (the config parsers of secret fields never echo a value they refuse).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "SECRET_KEYS", "mask_config", "mask_text", "mask_url"]

#: What a secret is replaced by.
MASK = "***"

#: Keys whose values are secrets wherever they appear (a config section, a report, a
#: URL's query string).
SECRET_KEYS = frozenset(
    {
        "token",
        "password",
        "passwd",
        "secret",
        "secret_key",
        "secret_access_key",
        "aws_secret_access_key",
        "aws_session_token",
        "session_token",
        "api_key",
        "access_token",
    }
)

#: ``scheme://user:password@``: the password is group ``password``, up to the last ``@``
#: before a space (a password with an ``@`` not percent-encoded is still hidden whole); a
#: user part alone, ``scheme://user@``, holds no password.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)(?P<password>\S*)(?=@)"
)
#: ``?password=...`` / ``&token=...`` in a URL's query string.
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:" + "|".join(sorted(SECRET_KEYS)) + r")=)(?P<value>[^&#\s]*)",
    re.IGNORECASE,
)


def mask_text(text: str) -> str:
    """``text`` with every URL password and every secret query parameter in it replaced
    by ``***`` (a log line, an error message, an exception's text, a URL)."""
    if "://" not in text and "=" not in text:
        return text
    text = _URL_PASSWORD.sub(lambda m: m["head"] + (MASK if m["password"] else ""), text)
    return _QUERY_SECRET.sub(lambda m: m["head"] + (MASK if m["value"] else ""), text)


def mask_url(url: str, userinfo: bool = True) -> str:
    """``url`` without its secrets (:func:`mask_text`); ``userinfo=False`` also drops the
    ``user:password@`` part whole (``redis://host:6379/0``: where, not who)."""
    if userinfo:
        return mask_text(url)
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return mask_text(
        urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    )


def mask_config(value: Any) -> Any:
    """A plain config or report (dicts, lists, scalars) with its secrets hidden: the
    value of every key of :data:`SECRET_KEYS` that is set becomes ``***``, and every
    string is :func:`mask_text`-ed (URLs with passwords, wherever they sit)."""
    if isinstance(value, Mapping):
        return {
            key: MASK if _secret_key(key) and item not in (None, "") else mask_config(item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [mask_config(item) for item in value]
    if isinstance(value, str):
        return mask_text(value)
    return value


def _secret_key(key: Any) -> bool:
    return isinstance(key, str) and key.lower() in SECRET_KEYS
