"""Driving an eviction policy the way the data path does, for policy tests.

A policy only orders keys; the data path decides what goes. These helpers play the data
path's part so that a test states what a policy does under real use:

- :func:`evict`: take the first ``n`` candidates that are not pinned, then remove them;
- :func:`access`: one cache access (a hit touches; a miss evicts one key when full, then
  inserts);
- :func:`policy_key`, :func:`key_ids`, :func:`queue_ids`: small integer keys, and the
  policy's queues (``policy.queues()``) written back as those integers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from kvstore.keys import BlockKey
from kvstore.policy import EvictionPolicy

__all__ = ["access", "evict", "key_ids", "policy_key", "queue_ids"]


class _Queued(Protocol):
    """A policy that shows its queues (S3-FIFO, ARC)."""

    def queues(self) -> Mapping[str, Iterable[bytes]]: ...


def policy_key(i: int) -> BlockKey:
    """The 16-byte key numbered ``i``."""
    return BlockKey(i.to_bytes(16, "little"))


def key_ids(keys: Iterable[bytes]) -> list[int]:
    """The numbers of keys made by :func:`policy_key`, in order."""
    return [int.from_bytes(key, "little") for key in keys]


def queue_ids(policy: _Queued) -> dict[str, list[int]]:
    """Each of the policy's queues (``policy.queues()``) as :func:`key_ids`."""
    return {name: key_ids(keys) for name, keys in policy.queues().items()}


def evict(policy: EvictionPolicy, n: int, pinned: frozenset[bytes] = frozenset()) -> list[BlockKey]:
    """What the data path does: take the first ``n`` unpinned candidates, then remove them."""
    victims: list[BlockKey] = []
    for key in policy.candidates():
        if len(victims) >= n:
            break
        if key not in pinned:
            victims.append(key)
    for key in victims:
        policy.remove(key)
    return victims


def access(policy: EvictionPolicy, key: BlockKey, capacity: int) -> bool:
    """One cache access: a hit touches, a miss evicts one block if full and inserts.
    True for a hit."""
    if key in policy:
        policy.touch(key)
        return True
    if len(policy) >= capacity:
        assert len(evict(policy, 1)) == 1
    policy.insert(key)
    return False
