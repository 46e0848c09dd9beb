"""The data path: how one store keeps its blocks in its tiers.

Everything here is internal to a :class:`~kvstore.KVStore`; the store is its public face.
The front door, for code outside this package, is this package's names (below) and
:mod:`kvstore.datapath.contracts`: the value types and protocols a store hands out
(``Medium``, ``ChangeFeed``, ``DataPath``, ``Pin``, ``Loan``, ``PendingPut``,
``PrefetchHandle``, ``Step``), and ``BlockManager``, the façade ``KVStore`` builds. No
module outside imports another of this package's modules (tests/datapath/test_front_door.py).

The modules form a staircase, each importing only those below it::

    manager          the façade a store drives (BlockManager)
    prefetch · lending · layerwrites · migrations · reader
    writer · finder  where a block goes, what is where
    tierio · mover   every tier call (timed, failure → miss); background jobs
    books            the index, THE lock, levels, heat, counters, and its ledgers
                     (pins, leases, queries, removals, discovery, room, partials;
                     index, guard, counters, progress)
    contracts        the front door's types (imports nothing of the data path)

docs/architecture.md draws the pieces and the path of each operation. Importing this
package imports only ``contracts``; ``BlockManager`` imports the rest on first use (a
module below the data path that holds a ``Medium`` must not load the data path above it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.datapath.contracts import (
    ChangeFeed,
    DataPath,
    Loan,
    Medium,
    PendingPut,
    Pin,
    PrefetchHandle,
    Step,
)

if TYPE_CHECKING:
    from kvstore.datapath.manager import BlockManager

__all__ = [
    "BlockManager",
    "ChangeFeed",
    "DataPath",
    "Loan",
    "Medium",
    "PendingPut",
    "Pin",
    "PrefetchHandle",
    "Step",
]


def __getattr__(name: str) -> Any:
    """``BlockManager``, imported on first use (see the module docstring)."""
    if name == "BlockManager":
        from kvstore.datapath.manager import BlockManager

        return BlockManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
