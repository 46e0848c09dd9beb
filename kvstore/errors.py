"""The one exception family of kvstore.

Every error the store raises on purpose is a :class:`KVStoreError`. The few
subclasses say *what kind* of thing went wrong, so callers can react without
parsing messages:

- :class:`ConfigError` -- a configuration key or value is wrong (the message
  names the key, e.g. ``tiers[0].capacity``).
- :class:`InvalidInputError` -- an argument is wrong: shape, dtype, device,
  key count, token ids. :class:`LayoutMismatchError` is the special case of
  KV produced under a different :class:`~kvstore.layout.KVLayout`.
- :class:`BlockNotFoundError` -- a requested block is not (or no longer)
  stored. Also a ``KeyError``.
- :class:`CorruptBlockError` -- bytes read from outside process memory
  failed verification (bad magic, header or payload checksum, truncation).
  :class:`DecryptError` is the special case of an encrypted block this store
  cannot open (no key for it, a tag that does not verify, or a plain block where
  encryption is on): a miss that is counted, and that deletes nothing.
- :class:`TierError` -- a storage medium failed (I/O error, full disk,
  unreachable server). The store turns these into misses for the caller.
  :class:`StoreLimitError` is the special case of a ``kvstore-server`` that
  answers but will not open one more store (its ``server.max_stores``): a
  setting to change there, not an outage.
- :class:`CapacityError` -- no tier could make room (every candidate block
  is pinned).
- :class:`ClosedError` -- the store was used after :meth:`KVStore.close`.
- :class:`AccessDeniedError` -- a ``kvstore-server`` refused a token, or a
  namespace the token does not open. :class:`ScopeError` is the special case of
  an operation beyond the token's scopes (read, write, admin): the token itself
  is still good.
- :class:`ProtocolError` -- bytes off the wire are not a valid frame (the
  server answers with an error and changes nothing).

Bad input is rejected *before* anything is changed: an operation that raises
``InvalidInputError`` or ``ConfigError`` leaves the store as it was.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "BlockNotFoundError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DecryptError",
    "InvalidInputError",
    "KVStoreError",
    "LayoutMismatchError",
    "ProtocolError",
    "ScopeError",
    "StoreLimitError",
    "TierError",
]


class KVStoreError(Exception):
    """Base class of every error kvstore raises deliberately."""


class ConfigError(KVStoreError, ValueError):
    """A configuration key is unknown or its value is impossible."""


class InvalidInputError(KVStoreError, ValueError):
    """An argument has the wrong shape, dtype, device, length or type."""


class LayoutMismatchError(InvalidInputError):
    """KV data or a block header belongs to a different KV layout."""


class BlockNotFoundError(KVStoreError, KeyError):
    """A block asked for is not stored (or was lost to a failing tier)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "block not found"


class CorruptBlockError(KVStoreError):
    """Bytes read from outside process memory failed verification."""


class DecryptError(CorruptBlockError):
    """An encrypted block could not be opened (no key for it, or its tag does not
    verify), or a plain block was read where encryption is on."""


class TierError(KVStoreError):
    """A storage medium failed; callers see this as a miss, not as data."""


class StoreLimitError(TierError):
    """A kvstore-server refused to open one more store (namespace and layout): it hosts
    ``server.max_stores`` already. Not an outage -- the server answers -- but a setting
    to raise on the server; like any TierError, a store turns it into misses."""


class CapacityError(KVStoreError):
    """No room could be made: every eviction candidate is pinned."""


class ClosedError(KVStoreError):
    """The store (or a tier) was used after close()."""


class AccessDeniedError(KVStoreError):
    """A server refused the token, or a namespace the token does not open."""


class ProtocolError(KVStoreError):
    """A frame read off the wire is malformed, oversized or out of order."""


class ScopeError(AccessDeniedError):
    """An operation beyond the token's scopes (a read-only token's PUT, say)."""
