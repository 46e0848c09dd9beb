"""ARC eviction (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03).

Two LRU lists of resident keys and two ghost lists of keys only:

- **T1**: keys seen once recently (recency); **T2**: keys used again since
  they arrived (frequency). A hit moves a key to T2's most recent end.
- **B1** / **B2**: keys recently evicted from T1 / T2.
- **p**: the adaptive target size of T1. A miss that B1 remembers says T1
  was evicted too eagerly: p grows (by max(1, |B2|/|B1|)); a miss that B2
  remembers shrinks it (by max(1, |B1|/|B2|)). Such a key goes straight
  into T2.

Eviction takes T1's least recent key while ``|T1| > p``, else T2's. A scan of
one-off keys fills only T1 and B1 and cannot push out what T2 holds, unless
B1 hits show recency pays -- then p grows and T1 gets more room.

Fitted to the manager's interface (documented deviations):

- The manager asks for candidates without naming the block about to
  arrive, so REPLACE's tie-break (``x in B2 and |T1| == p``) is dropped:
  T1 goes first only when strictly over its target.
- Ghost bounds follow the paper (``|T1| + |B1| <= c`` and the four lists
  together ``<= 2c``, with c the tier's capacity in blocks, or the keys
  resident when it is unknown); they are enforced when a ghost grows.
- Like S3-FIFO, :meth:`~ARCPolicy.remove` remembers a key in B1/B2 only if
  :meth:`~ARCPolicy.candidates` offered it (an eviction); a delete or a
  lost copy leaves no ghost. A use clears the "offered" mark.
- Offered keys stay tracked at the old end of their list while the sweep
  moves past them, so the sweep offers each key once and ends after
  ``|T1| + |T2|`` steps even if the manager skips every key (all pinned).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.policy._queue import OfferQueue
from kvstore.policy.base import Clock, EvictionPolicy, register_policy

if TYPE_CHECKING:  # keys import torch; policies need only the type
    from kvstore.keys import BlockKey

__all__ = ["ARCPolicy"]


@register_policy
class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache: recency and frequency lists with an adaptive split."""

    name = "arc"

    def __init__(self, capacity: int = 0, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity, clock)
        self._t1 = OfferQueue()
        self._t2 = OfferQueue()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._p = 0.0
        # Keys offered by a sweep and not used since: removing one is an eviction.
        self._evicting: set[BlockKey] = set()

    @property
    def target(self) -> float:
        """p: the current target size of T1, in blocks."""
        return self._p

    def _c(self) -> int:
        return self.capacity if self.capacity > 0 else max(1, len(self))

    # -- events -------------------------------------------------------------
    def insert(self, key: BlockKey) -> None:
        """New key: into T2 (adapting p) if a ghost remembers it, else into T1."""
        if key in self:
            self.touch(key)
            return
        c = self._c()
        if key in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            self._p = min(float(c), self._p + step)
            del self._b1[key]
            self._t2.push(key)
        elif key in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            self._p = max(0.0, self._p - step)
            del self._b2[key]
            self._t2.push(key)
        else:
            self._t1.push(key)
        self._trim_ghosts()

    def touch(self, key: BlockKey) -> None:
        """A use: the key moves to T2's most recent end."""
        if self._t1.pop(key) is None and self._t2.pop(key) is None:
            return
        self._evicting.discard(key)
        self._t2.push(key)

    def remove(self, key: BlockKey) -> None:
        """Forget ``key``; remember it in B1/B2 only if a sweep offered it."""
        if self._t1.pop(key) is not None:
            ghost = self._b1
        elif self._t2.pop(key) is not None:
            ghost = self._b2
        else:
            return
        if key in self._evicting:
            self._evicting.discard(key)
            ghost[key] = None
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self._c()
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b1 or self._b2:
            if len(self) + len(self._b1) + len(self._b2) <= 2 * c:
                break
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    # -- eviction -----------------------------------------------------------
    def candidates(self) -> Iterator[BlockKey]:
        """Keys to evict: T1's least recent while T1 is over p, else T2's."""
        self._t1.restore()
        self._t2.restore()
        return self._sweep()

    def _sweep(self) -> Iterator[BlockKey]:
        t1, t2 = self._t1, self._t2
        while t1.body or t2.body:
            # Keys already offered this sweep are on their way out: T1's size is the rest.
            queue = t1 if t1.body and (len(t1.body) > self._p or not t2.body) else t2
            key, value = queue.take()
            queue.offer(key, value)
            self._evicting.add(key)
            yield key

    # -- state --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def queues(self) -> dict[str, list[BlockKey]]:
        """The keys of T1, T2, B1 and B2, least recent first (for tests and debugging)."""
        return {
            "t1": list(self._t1),
            "t2": list(self._t2),
            "b1": list(self._b1),
            "b2": list(self._b2),
        }
