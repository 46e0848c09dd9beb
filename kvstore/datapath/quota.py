"""Owner accounting across stores that share tiers: a share and a limit per owner and tier.

Several stores (a kvstore-server's namespaces) belong to owners (tenants) and
draw on one pool per tier kind (its configured capacity). Each owner may have,
per tier kind, a guaranteed ``share`` and a ``limit`` (bytes of KV: each block
counts ``layout.block_nbytes``, whatever the medium adds).

The data path asks one question, through the hook each store's
:class:`~kvstore.datapath.room.RoomBooks` holds (:meth:`QuotaHook.must_evict`, under
the ledger's lock, while a tier grants room; the data path sees the hook as the
:class:`~kvstore.datapath.contracts.QuotaSeat` protocol and the ledger as
:class:`~kvstore.datapath.contracts.QuotaSeats`): how many of *this store's own*
blocks must go before ``n`` more fit? The answer is the largest of

- over the limit: the owner's bytes in that tier (all its stores, room
  reserved included) plus the ``n`` new blocks, past its ``limit``;
- under pressure: when the pool's bytes plus the new ones pass the pool, an
  owner past its ``share`` gives back the overflow, never going below its share.

A store never evicts another store's blocks on its own path, so an owner within
its share keeps them whatever others put. A grant that takes a pool past its
capacity while others are past their shares (an owner that flooded and went
idle) is *pressure*: the ledger calls ``on_pressure``, and whoever owns the
stores (the server's reclaimer) asks :meth:`QuotaLedger.reclaims` which blocks
those owners must give back, most over its share first, and evicts them from
their own stores, off every put's path. Blocks the store cannot free (pinned,
or the owner's bytes are in its other stores) are not stored: counted as
``refused``. Demotions and replicas reserve room in their tier like puts, so they
count against the owner too.

Lock order: a store's books lock, then the ledger's (the ledger never takes a
books lock; it reads other stores' ``resident`` counts, which grow under the
ledger's lock -- but for blocks a store finds on disk when it opens, counted
as found: an owner over its limit then frees at its next grant).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.datapath.contracts import QuotaLevel

__all__ = ["Quota", "QuotaHook", "QuotaLedger", "Reclaim"]


@dataclass(frozen=True)
class Quota:
    """One owner's bytes in one tier kind: guaranteed ``share``, hard ``limit``."""

    share: int
    limit: int


@dataclass(frozen=True)
class Reclaim:
    """Blocks one store must give back in one of its tiers (``tier``: the index in its
    hook's ``levels``): its owner is past its share of a pool over capacity."""

    hook: QuotaHook
    tier: int
    blocks: int


def _blocks_for(nbytes: int, block: int) -> int:
    """Whole blocks covering ``nbytes`` (ceil; 0 for none)."""
    return max(0, -(-nbytes // block))


class QuotaLedger:
    """The pools, the quotas and the stores (hooks) that draw on them; thread-safe."""

    def __init__(self, pools: Mapping[str, int], quotas: Mapping[tuple[str, str], Quota]) -> None:
        self.lock = threading.Lock()
        self._pools = dict(pools)
        self._quotas = dict(quotas)
        self._hooks: list[QuotaHook] = []
        #: Called under :attr:`lock` when a pool is past its capacity after a grant or a
        #: quota change (pressure): it must not block or take locks (set an event).
        self.on_pressure: Callable[[], None] | None = None

    def set_quotas(self, quotas: Mapping[tuple[str, str], Quota]) -> None:
        """New quotas from now on (owner, tier kind): applied at the next grant, and
        by the reclaimer at once where a pool is past its capacity."""
        with self.lock:
            self._quotas = dict(quotas)
            if any(self.used(kind) > pool for kind, pool in self._pools.items()):
                self._pressure()

    def _pressure(self) -> None:
        if self.on_pressure is not None:
            self.on_pressure()

    def quota(self, owner: str, kind: str) -> Quota | None:
        """``owner``'s quota in tier ``kind`` (None: unbounded there)."""
        return self._quotas.get((owner, kind))

    def hook(self, owner: str, levels: Sequence[QuotaLevel], block_nbytes: int) -> QuotaHook:
        """A hook for a store of ``owner`` whose tiers are ``levels``."""
        made = QuotaHook(self, owner, levels, block_nbytes)
        with self.lock:
            self._hooks.append(made)
        return made

    def drop(self, hook: QuotaHook) -> None:
        """Forget a closed store."""
        with self.lock:
            if hook in self._hooks:
                self._hooks.remove(hook)

    def used(self, kind: str, owner: str | None = None, *, leaving: bool = True) -> int:
        """Bytes in tier ``kind`` (of ``owner``'s stores; None: of every store);
        ``leaving=False``: less the blocks already on their way out."""
        hooks = list(self._hooks)
        return sum(h.bytes_in(kind, leaving) for h in hooks if owner in (None, h.owner))

    def overflow(self, hook: QuotaHook, level: QuotaLevel, n: int) -> int:
        """Blocks ``hook``'s store must free in ``level`` for ``n`` more (lock held).
        Where the pool stays past its capacity even so, others must give back: pressure."""
        block = hook.block_nbytes
        pool = self._pools.get(level.kind)
        total = self.used(level.kind) + n * block
        quota = self._quotas.get((hook.owner, level.kind))
        must = 0
        if quota is not None:
            mine = self.used(level.kind, hook.owner) + n * block
            must = _blocks_for(mine - quota.limit, block)
            if pool is not None and mine > quota.share:
                squeeze = min(total - pool, mine - quota.share)
                must = max(must, _blocks_for(squeeze, block))
        if pool is not None and self.used(level.kind, leaving=False) + (n - must) * block > pool:
            self._pressure()
        return must

    def reclaims(self) -> list[Reclaim]:
        """What owners past their shares must give back so that every pool fits its
        capacity again (blocks already leaving count as gone): the owner most past its
        share first, never below its share, from its biggest stores first (lock held)."""
        out: list[Reclaim] = []
        for kind, pool in self._pools.items():
            over = self.used(kind, leaving=False) - pool
            owners = {h.owner for h in self._hooks}
            past = []
            for owner in owners:
                quota = self._quotas.get((owner, kind))
                if (
                    quota is not None
                    and (extra := self.used(kind, owner, leaving=False) - quota.share) > 0
                ):
                    past.append((extra, owner))
            for extra, owner in sorted(past, reverse=True):
                if over <= 0:
                    break
                take = min(over, extra)
                out.extend(self._split(kind, owner, take))
                over -= take
        return out

    def _split(self, kind: str, owner: str, nbytes: int) -> list[Reclaim]:
        """``nbytes`` of ``owner``'s blocks in tiers of ``kind``, biggest holders first."""
        seats = [
            (len(lv.policy) - lv.leaving, i, hook)
            for hook in self._hooks
            if hook.owner == owner
            for i, lv in enumerate(hook.levels)
            if lv.kind == kind and len(lv.policy) > lv.leaving
        ]
        out = []
        for held, tier, hook in sorted(seats, key=lambda s: -s[0]):
            blocks = min(held, _blocks_for(nbytes, hook.block_nbytes))
            if blocks > 0:
                out.append(Reclaim(hook, tier, blocks))
                nbytes -= blocks * hook.block_nbytes
        return out

    def figures(self) -> dict[str, dict[str, Any]]:
        """Per owner: per tier kind bytes, blocks, share, limit; and refusals."""
        out: dict[str, dict[str, Any]] = {}
        for hook in list(self._hooks):
            mine = out.setdefault(hook.owner, {"tiers": {}, "refused": 0})
            mine["refused"] += hook.refused
            for level in hook.levels:
                tier = mine["tiers"].setdefault(level.kind, {"bytes": 0, "blocks": 0})
                tier["blocks"] += len(level.policy)
                tier["bytes"] += len(level.policy) * hook.block_nbytes
        for owner, mine in out.items():
            for kind, tier in mine["tiers"].items():
                quota = self._quotas.get((owner, kind))
                if quota is not None:
                    tier.update(share=quota.share, limit=quota.limit)
        return out


class QuotaHook:
    """One store's seat at a :class:`QuotaLedger` (see the module docstring)."""

    def __init__(
        self, ledger: QuotaLedger, owner: str, levels: Sequence[QuotaLevel], block_nbytes: int
    ) -> None:
        self.ledger = ledger
        self.owner = owner
        self.levels = list(levels)
        self.block_nbytes = block_nbytes
        #: Blocks not stored because the owner's quota left no room for them.
        self.refused = 0

    @property
    def lock(self) -> threading.Lock:
        """The ledger's lock (held while a tier grants room)."""
        return self.ledger.lock

    def bytes_in(self, kind: str, leaving: bool = True) -> int:
        """This store's bytes (held and reserved) in its tiers of ``kind``; ``leaving``
        False: less those already on their way out."""
        blocks = sum(
            lv.resident - (0 if leaving else lv.leaving) for lv in self.levels if lv.kind == kind
        )
        return blocks * self.block_nbytes

    def must_evict(self, level: QuotaLevel, n: int) -> int:
        """Own blocks of ``level`` to free before ``n`` more fit (the ledger's lock held)."""
        return self.ledger.overflow(self, level, n)

    def refuse(self, n: int) -> None:
        """Count ``n`` blocks the quota kept out (the ledger's lock held)."""
        self.refused += n
