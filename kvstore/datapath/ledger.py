"""What the books hand the ledgers that pin, lease, make room and write layer by layer
(:mod:`kvstore.datapath.books`): the same four parts, so each takes them as one."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.datapath.counters import ManagerCounters
from kvstore.datapath.guard import Guard
from kvstore.datapath.index import HeatClock, Index

__all__ = ["LedgerParts"]


@dataclass(frozen=True)
class LedgerParts:
    """The books' lock (``guard``: every ledger works under it), their entry ``index``,
    ``heat`` clock and ``counters``. Each ledger keeps its own state beside them."""

    guard: Guard
    index: Index
    heat: HeatClock
    counters: ManagerCounters
