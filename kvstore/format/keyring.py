"""Tenants' keys, as the format's sealing takes them (no cipher here: imports no torch
and no ``cryptography``, so a config that names a keyring stays light).

:func:`kvstore.config.encryption.parse_keyring` reads them from a key file or the
environment; :class:`~kvstore.format.sealing.BlockCipher` seals with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.errors import ConfigError

__all__ = ["Keyring", "KeyringSource", "TenantKeys"]


@dataclass(frozen=True)
class TenantKeys:
    """One tenant's keys by id, and the id of the key that seals new blocks."""

    active: str
    keys: Mapping[str, bytes] = field(repr=False)


@dataclass(frozen=True)
class Keyring:
    """Every tenant's keys (read from a key file or the environment:
    :func:`kvstore.config.encryption.parse_keyring`)."""

    tenants: Mapping[str, TenantKeys] = field(repr=False)

    def tenant(self, name: str) -> TenantKeys:
        """The keys of tenant ``name``; :class:`ConfigError` if the keyring has none."""
        try:
            return self.tenants[name]
        except KeyError:
            have = ", ".join(sorted(self.tenants)) or "none"
            raise ConfigError(
                f"encryption: the keyring has no keys for tenant {name!r} (it has: {have})"
            ) from None


class KeyringSource(Protocol):
    """Where a keyring comes from (the config's ``encryption`` section,
    :class:`~kvstore.config.encryption.EncryptionConfig`)."""

    def keyring(self) -> Keyring:
        """The keyring, read now."""
