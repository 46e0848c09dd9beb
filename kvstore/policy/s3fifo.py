"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues and a 2-bit use counter per key:

- **S** (small, ~10% of the tier): every new key starts here, on probation.
- **M** (main, the rest): keys that proved themselves.
- **G** (ghost): keys only (no data) of recent evictions from S, at most
  about as many as M holds (90% of the tier's capacity).

A hit (:meth:`~S3FIFOPolicy.touch`) only bumps the key's counter, capped at
3 -- no queue surgery on the hot path. Eviction looks at S's oldest key when
S holds at least its share, else at M's oldest:

- from S: a key used at least once since it arrived (``freq >= 1``) moves
  to M instead of going; an unused one is offered for eviction and, once the
  manager removes it, remembered in G;
- from M: a used key goes round again with its counter decremented (CLOCK
  with a 2-bit counter); an unused one is offered.

A key inserted while G remembers it (it was evicted from S too early) goes
straight to M. So a scan -- a long one-off document whose chunks are never
read again -- only churns through S, while the shared system prompt and the
session histories, read again and again, sit in M out of its reach.

Design choices (documented deviations and details):

- **Move threshold 1.** The paper's Algorithm 1 moves S keys with
  ``freq > 1``; libCacheSim defaulted to ``freq >= 1`` before 2023. Here a
  touch is an engine reading the block for a request (``lookup`` does not
  touch), so one reuse already marks a shared prefix rather than noise, and
  a block in S has little time (S is 10% of the tier) to collect a second.
  On the policy benchmark's trace, 1 beats 2 by about 2.5 points of chat hit
  rate at 2-10% cache sizes (docs/benchmarks/policies.md). ``move_threshold``
  is a class attribute, for subclasses that want the other variant.
- **Moving to M resets the counter**: hits in S bought the place in M;
  staying there takes hits in M.
- **Ghost only for evictions.** :meth:`~S3FIFOPolicy.remove` puts a key in
  G only if it was offered from S by :meth:`~S3FIFOPolicy.candidates` (and
  not moved since): the manager evicted it. A delete, a lost copy, or a
  removal from M leaves no ghost -- re-inserting a deleted block is no sign
  that S was too small. (A key offered but passed over -- pinned, or read
  past -- keeps its mark; if it is later deleted it leaves a ghost, which
  at worst sends it to M should it come back.)
- **Sweeps are bounded.** The manager may skip every offered key (all
  pinned). Within one iteration no method of the policy is called, so
  counters only fall: each key moves S->M at most once and goes round M at
  most 3 times, and each key is offered at most once; the iteration ends
  after O(|S| + 4|M|) steps having offered every key. Offered keys stay
  tracked, at the old end of their queue, and are looked at first next time.
  The sweep moves and ages keys as the caller reads, so a caller that reads
  ahead of the victims it takes ages M a little early (measured: no loss).
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

__all__ = ["S3FIFOPolicy"]


@register_policy
class S3FIFOPolicy(EvictionPolicy):
    """Scan-resistant eviction with a small probation FIFO, a main FIFO and a ghost FIFO."""

    name = "s3fifo"
    #: Share of the capacity the small queue S aims at.
    small_share: float = 0.1
    #: Uses (since insertion) that move a key from S to M instead of evicting it.
    move_threshold: int = 1
    #: Cap of the per-key use counter (2 bits).
    max_freq: int = 3

    def __init__(self, capacity: int = 0, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity, clock)
        self._small = OfferQueue()
        self._main = OfferQueue()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        # Keys of S offered by a sweep and not moved since: removing one is an eviction.
        self._evicting: set[BlockKey] = set()

    # -- sizes --------------------------------------------------------------
    def _small_target(self) -> int:
        # Without a known capacity, size S against what is resident now.
        base = self.capacity if self.capacity > 0 else len(self)
        return max(1, round(base * self.small_share))

    def _ghost_limit(self) -> int:
        # About as many keys as M aims to hold: the tier's share beyond S.
        base = self.capacity if self.capacity > 0 else len(self)
        return max(1, base - self._small_target())

    # -- events -------------------------------------------------------------
    def insert(self, key: BlockKey) -> None:
        """New key: into M if the ghost remembers it, else into S (a re-insert is a use)."""
        if key in self:
            self.touch(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main.push(key)
        else:
            self._small.push(key)

    def touch(self, key: BlockKey) -> None:
        """Count a use (capped); the key stays where it is."""
        for queue in (self._small, self._main):
            freq = queue.get(key)
            if freq is not None:
                queue.set(key, min(freq + 1, self.max_freq))
                return

    def remove(self, key: BlockKey) -> None:
        """Forget ``key``; remember it in the ghost only if a sweep offered it from S."""
        if self._small.pop(key) is None:
            self._main.pop(key)
            return
        if key in self._evicting:
            self._evicting.discard(key)
            self._ghost[key] = None
            self._ghost.move_to_end(key)
            while len(self._ghost) > self._ghost_limit():
                self._ghost.popitem(last=False)

    # -- eviction -----------------------------------------------------------
    def candidates(self) -> Iterator[BlockKey]:
        """Keys to evict, first to go first; moves used keys along the way (see module doc)."""
        self._small.restore()
        self._main.restore()
        return self._sweep()

    def _sweep(self) -> Iterator[BlockKey]:
        small, main = self._small, self._main
        target = self._small_target()
        while small.body or main.body:
            # Keys already offered this sweep are on their way out: S's share is the rest.
            if small.body and (len(small.body) >= target or not main.body):
                key, freq = small.take()
                if freq >= self.move_threshold:
                    self._evicting.discard(key)
                    main.push(key)
                    continue
                small.offer(key, freq)
                self._evicting.add(key)
                yield key
            else:
                key, freq = main.take()
                if freq > 0:
                    main.push(key, freq - 1)
                    continue
                main.offer(key, freq)
                yield key

    # -- state --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def queues(self) -> dict[str, list[BlockKey]]:
        """The keys of S, M and G, oldest first (for tests, debugging and stats)."""
        return {"small": list(self._small), "main": list(self._main), "ghost": list(self._ghost)}

    def frequency(self, key: BlockKey) -> int | None:
        """The use counter of ``key`` (0..3), or None when it is not tracked."""
        freq = self._small.get(key)
        return self._main.get(key) if freq is None else freq
