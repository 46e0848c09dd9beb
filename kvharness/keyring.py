"""Keyrings for tests and benchmarks of encryption at rest (:mod:`kvstore.format.sealing`)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

__all__ = ["encryption_section", "new_key", "write_keyring"]


def new_key() -> str:
    """A fresh 32-byte key as 64 hex digits."""
    return secrets.token_hex(32)


def write_keyring(
    path: str | os.PathLike[str], keys: dict[str, str], active: str, tenant: str = "default"
) -> str:
    """Write a key file (mode 0600) holding ``keys`` (id: hex) of ``tenant``; its path."""
    target = Path(path)
    document = {"tenants": {tenant: {"active": active, "keys": keys}}}
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(document, f)
    os.chmod(target, 0o600)
    return str(target)


def encryption_section(key_file: str, *tiers: str) -> dict[str, object]:
    """The ``encryption`` config section for ``key_file`` (``tiers``: default all)."""
    section: dict[str, object] = {"key_file": key_file}
    if tiers:
        section["tiers"] = list(tiers)
    return section
