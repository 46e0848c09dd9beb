"""The data path: how one store keeps its blocks in its tiers.

Everything here is internal to a :class:`~kvstore.KVStore`; the store is its public face.
The front door, for code outside this package, is this package's names (below) and
:mod:`kvstore.datapath.contracts`: the value types and protocols a store hands out
(``Medium``, ``ChangeFeed``, ``DataPath``, ``Pin``, ``Loan``, ``PendingPut``,
``PrefetchHandle``, ``Step``; ``QuotaSeat``, ``QuotaSeats``, ``Hinting``), ``BlockManager``,
the façade ``KVStore`` builds, and the owner accounting across stores that share tiers
(``QuotaLedger``, ``QuotaHook``, ``Quota``, ``Reclaim``: :mod:`kvstore.datapath.quota`).
No module outside imports another of this package's modules
(tests/datapath/test_front_door.py).

The modules form a staircase, each importing only those below it::

    manager          the façade a store drives (BlockManager)
    restoring        the data path as restore planning sees it (RestoreSide)
    prefetch · lending · layerwrites · migrations · reader · probes
    writer · finder  where a block goes, what is where
    tierio · mover   every tier call (timed, failure → miss); background jobs
    books            the index, THE lock, levels, heat, counters, and its ledgers
                     (pins, leases, queries, removals, discovery, room, partials;
                     index, guard, counters, progress)
    quota · hints    owner accounting across stores; session hints carried out
    contracts        the front door's types (imports nothing of the data path)

docs/architecture.md draws the pieces and the path of each operation. Importing this
package imports only ``contracts``; the other names import the rest on first use (a
module below the data path that holds a ``Medium`` must not load the data path above it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.datapath.contracts import (
    ChangeFeed,
    DataPath,
    EngineSide,
    Hinting,
    Loan,
    Medium,
    PendingPut,
    Pin,
    PrefetchHandle,
    QuotaLevel,
    QuotaSeat,
    QuotaSeats,
    Step,
)
from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.datapath.engine import Engine
    from kvstore.datapath.manager import BlockManager
    from kvstore.datapath.quota import Quota, QuotaHook, QuotaLedger, Reclaim

__all__ = [
    "BlockManager",
    "ChangeFeed",
    "DataPath",
    "EngineSide",
    "Engine",
    "Hinting",
    "Loan",
    "Medium",
    "PendingPut",
    "Pin",
    "PrefetchHandle",
    "Quota",
    "QuotaHook",
    "QuotaLedger",
    "QuotaLevel",
    "QuotaSeat",
    "QuotaSeats",
    "Reclaim",
    "Step",
]

_EXPORTS = {
    "BlockManager": "kvstore.datapath.manager",
    "Engine": "kvstore.datapath.engine",
    "Quota": "kvstore.datapath.quota",
    "QuotaHook": "kvstore.datapath.quota",
    "QuotaLedger": "kvstore.datapath.quota",
    "Reclaim": "kvstore.datapath.quota",
}


def __getattr__(name: str) -> Any:
    """``BlockManager`` and the quota ledger, imported on first use (see the module
    docstring)."""
    return load_export(globals(), _EXPORTS, name)
