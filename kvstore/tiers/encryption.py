"""Which tiers of a store seal their blocks, and with whose keys.

The format's side of encryption at rest (the cipher, sealing and opening a block) is
:mod:`kvstore.format.sealing`; this module reads a store's ``encryption`` section
(:class:`~kvstore.config.encryption.EncryptionConfig`) and hands each at-rest tier it
names a cipher of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvstore.config import EncryptionConfig
from kvstore.format import BlockCipher, TenantKeys, aead_module, tenant_of

__all__ = ["StoreKeys", "encrypt_tiers", "store_keys"]


@dataclasses.dataclass(frozen=True)
class StoreKeys:
    """What seals a store's blocks: its namespace, its tenant and the tenant's keys."""

    namespace: str
    tenant: str
    keys: TenantKeys


def store_keys(config: EncryptionConfig, namespace: str) -> StoreKeys | None:
    """The tenant of a store of ``namespace`` and its keys (the keyring is read now,
    before any tier opens: a bad one is a :class:`ConfigError` that changed nothing);
    None when encryption is off."""
    if not config.enabled:
        return None
    aead_module()  # a missing package is said before anything is made
    tenant = tenant_of(namespace)
    return StoreKeys(namespace, tenant, config.keyring().tenant(tenant))


def encrypt_tiers(tiers: Sequence[Any], config: EncryptionConfig, keys: StoreKeys) -> int:
    """Give each of ``tiers`` whose kind ``config.tiers`` names a cipher of its own (its
    own record of blocks read under older keys); how many tiers encrypt."""
    wanted = [t for t in tiers if t.kind in config.tiers]
    for tier in wanted:
        tier.encrypt_with(BlockCipher(keys.tenant, keys.keys, keys.namespace))
    return len(wanted)
