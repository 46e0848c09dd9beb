"""Least-recently-used eviction."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.policy.base import Clock, EvictionPolicy, register_policy

if TYPE_CHECKING:  # keys import torch; policies need only the type
    from kvstore.keys import BlockKey

__all__ = ["LRUPolicy"]


@register_policy
class LRUPolicy(EvictionPolicy):
    """Evicts the key least recently inserted or touched."""

    name = "lru"

    def __init__(self, capacity: int = 0, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity, clock)
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[BlockKey]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
