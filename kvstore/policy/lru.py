"""Least-recently-used eviction."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.policy.base import Clock, EvictionPolicy, register_policy

if TYPE_CHECKING:  # keys import torch; policies need only the type
    from kvstore.keys import BlockKey

__all__ = ["LRUPolicy"]

#: Rebuild the order once this many removals (plus a quarter of the keys) left holes.
COMPACT_AFTER = 4096


@register_policy
class LRUPolicy(EvictionPolicy):
    """Evicts the key least recently inserted or touched.

    The order is a plain ``dict`` (insertion-ordered; a touch moves a key to the
    end by re-inserting it), not an ``OrderedDict``: that saves the linked-list
    node an ``OrderedDict`` keeps per key (about 50 bytes, a fifth of the index's
    memory per block). Removals leave holes that :meth:`candidates` would step
    over from the front, so the dict is rebuilt once holes outnumber a quarter
    of the keys (amortised O(1) per removal).
    """

    name = "lru"

    def __init__(self, capacity: int = 0, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity, clock)
        self._order: dict[BlockKey, None] = {}
        self._holes = 0

    def insert(self, key: BlockKey) -> None:
        if key in self._order:
            self.touch(key)
        else:
            self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            del self._order[key]
            self._order[key] = None
            self._holes += 1

    def remove(self, key: BlockKey) -> None:
        if self._order.pop(key, 0) is None:
            self._holes += 1

    def candidates(self) -> Iterator[BlockKey]:
        if self._holes > COMPACT_AFTER + len(self._order) // 4:
            self._order = dict(self._order)
            self._holes = 0
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
