"""kvstore chunks as the blocks of KV events.

A kvstore key covers ``block_tokens`` tokens (often 256); consumers of KV
events (Dynamo's router, llm-d's scorer) hash blocks of ``block_size`` tokens
(often 16) themselves from ``token_ids``. So each stored chunk becomes
``block_tokens / block_size`` event blocks, sub-block ``i`` named by::

    hash(key, i) = signed int64 of xxh3_64(key + i as 4 little-endian bytes)

stable in every process (no ``hash()``, no random seed). The first sub-block's
``parent_block_hash`` is the last sub-block hash of the parent chunk (None for
a prompt's first chunk); sub-blocks chain in order inside one ``BlockStored``.

Where the nearest copy is (:class:`~kvstore.datapath.contracts.Medium`) maps to vLLM's
``medium`` and ``locality``: MEMORY -> ``CPU``/``LOCAL``, DISK ->
``STORAGE``/``LOCAL``, SHARED (only a shared tier such as S3 or a server) ->
``STORAGE``/``REMOTE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import xxhash

from kvstore.config import EventsConfig
from kvstore.datapath.contracts import Medium
from kvstore.events.format import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from kvstore.keys import BlockKey

__all__ = ["LOCAL", "REMOTE", "BlockMapper", "medium_of", "parent_first"]

LOCAL = "LOCAL"
REMOTE = "REMOTE"

_MEDIA: dict[Medium, tuple[str, str]] = {
    Medium.MEMORY: (MEDIUM_CPU, LOCAL),
    Medium.DISK: (MEDIUM_STORAGE, LOCAL),
    Medium.SHARED: (MEDIUM_STORAGE, REMOTE),
}
_SIGN = 1 << 63
_WRAP = 1 << 64


def medium_of(medium: Medium) -> tuple[str, str]:
    """``(medium, locality)`` of the events for a copy in ``medium`` (not NONE)."""
    return _MEDIA[medium]


def sub_block_hash(key: bytes, index: int) -> int:
    """The signed 64-bit hash of sub-block ``index`` of the chunk ``key``."""
    value = xxhash.xxh3_64_intdigest(key + index.to_bytes(4, "little"))
    return value - _WRAP if value >= _SIGN else value


class BlockMapper:
    """Builds the events of chunks of ``block_tokens`` tokens cut into ``block_size`` blocks.

    Raises :class:`~kvstore.errors.ConfigError` (at start-up) unless
    ``config.block_size`` divides ``block_tokens``.
    """

    def __init__(self, block_tokens: int, config: EventsConfig) -> None:
        self.per_chunk = config.check_block_tokens(block_tokens)
        self.block_tokens = block_tokens
        self.block_size = config.block_size
        self._suffixes = [i.to_bytes(4, "little") for i in range(self.per_chunk)]

    def hashes(self, key: bytes) -> list[int | bytes]:
        """The hashes of the chunk's sub-blocks, in token order."""
        digest = xxhash.xxh3_64_intdigest
        return [v - _WRAP if v >= _SIGN else v for v in (digest(key + s) for s in self._suffixes)]

    def last_hash(self, key: bytes) -> int:
        """The hash of the chunk's last sub-block (what its child names as parent)."""
        return sub_block_hash(key, self.per_chunk - 1)

    def stored(
        self, key: bytes, parent: bytes | None, tokens: list[int], medium: Medium
    ) -> BlockStored:
        """``BlockStored`` for the chunk ``key`` holding ``tokens``, child of ``parent``."""
        name, locality = medium_of(medium)
        return BlockStored(
            block_hashes=self.hashes(key),
            parent_block_hash=None if parent is None else self.last_hash(parent),
            token_ids=tokens,
            block_size=self.block_size,
            lora_id=None,
            medium=name,
            lora_name=None,
            locality=locality,
        )

    def removed(self, keys: Iterable[bytes], medium: Medium) -> BlockRemoved:
        """One ``BlockRemoved`` for every sub-block of ``keys``, no longer in ``medium``."""
        name, locality = medium_of(medium)
        hashes: list[int | bytes] = []
        for key in keys:
            hashes.extend(self.hashes(key))
        return BlockRemoved(block_hashes=hashes, medium=name, locality=locality)


def parent_first(
    keys: Sequence[BlockKey], parent_of: Callable[[BlockKey], BlockKey | None]
) -> list[BlockKey]:
    """``keys`` reordered so that a key whose parent is among them comes after it
    (a consumer drops a block whose parent it does not know yet)."""
    members = set(keys)
    done: set[BlockKey] = set()
    order: list[BlockKey] = []
    for key in keys:
        chain: list[BlockKey] = []
        node: BlockKey | None = key
        while node is not None and node in members and node not in done:
            done.add(node)
            chain.append(node)
            node = parent_of(node)
        order.extend(reversed(chain))
    return order
