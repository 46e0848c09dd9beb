"""A FIFO of keys whose oldest end an eviction sweep has already offered.

Queue-based policies (S3-FIFO, ARC) hand keys to the manager one at a time
from a generator, and the manager may skip any of them (pinned) or stop
early, without saying which it took. So an offered key must stay tracked,
at the oldest end of its queue, while the sweep moves past it -- and the
state must be whole at every ``yield``, since the sweep may be abandoned
there. A :class:`OfferQueue` keeps the keys offered during the current sweep
in a separate ``offered`` segment that logically sits before the ``body``
(oldest first); :meth:`OfferQueue.restore` folds it back before the next
sweep. Both are insertion-ordered dicts, so every operation is O(1) and a
key costs one dict slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keys import torch; policies need only the type
    from kvstore.keys import BlockKey

__all__ = ["OfferQueue"]


class OfferQueue:
    """Keys oldest first, each with a small int (a policy's per-key counter)."""

    __slots__ = ("body", "offered")

    def __init__(self) -> None:
        # Not yet examined by the current sweep, oldest first.
        self.body: OrderedDict[BlockKey, int] = OrderedDict()
        # Offered by the current sweep, oldest first; they precede ``body``.
        self.offered: OrderedDict[BlockKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.body) + len(self.offered)

    def __contains__(self, key: object) -> bool:
        return key in self.body or key in self.offered

    def __iter__(self) -> Iterator[BlockKey]:
        """Keys in queue order, oldest first."""
        yield from self.offered
        yield from self.body

    def push(self, key: BlockKey, value: int = 0) -> None:
        """Append ``key`` at the newest end (the caller knows it is absent)."""
        self.body[key] = value

    def get(self, key: BlockKey) -> int | None:
        """The value of ``key``, or None when absent."""
        value = self.body.get(key)
        return self.offered.get(key) if value is None else value

    def set(self, key: BlockKey, value: int) -> bool:
        """Change the value of ``key`` in place; False when absent."""
        for part in (self.body, self.offered):
            if key in part:
                part[key] = value
                return True
        return False

    def pop(self, key: BlockKey) -> int | None:
        """Remove ``key``; its value, or None when absent."""
        value = self.body.pop(key, None)
        return self.offered.pop(key, None) if value is None else value

    def take(self) -> tuple[BlockKey, int]:
        """Remove and return the oldest unexamined key (``body`` must not be empty)."""
        return self.body.popitem(last=False)

    def offer(self, key: BlockKey, value: int) -> None:
        """Park a key just taken in the offered segment (it stays tracked)."""
        self.offered[key] = value

    def restore(self) -> None:
        """Fold the offered keys back to the oldest end of ``body``, in order.

        Costs O(keys offered and still tracked): those the manager skipped
        (pinned) or has not removed yet, plus the one it may read past.
        """
        body = self.body
        for key, value in reversed(self.offered.items()):
            body[key] = value
            body.move_to_end(key, last=False)
        self.offered.clear()
