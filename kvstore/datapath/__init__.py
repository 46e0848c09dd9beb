"""The data path: how one store keeps its blocks in its tiers.

Everything here is internal to a :class:`~kvstore.KVStore`; the store is its public face.
The modules form a staircase, each importing only those below it::

    manager          the façade a store drives (BlockManager)
    prefetch · lending · layerwrites · migrations · reader
    writer · finder  where a block goes, what is where
    tierio · mover   every tier call (timed, failure → miss); background jobs
    books            the index, THE lock, levels, heat, leases, partial writes (room,
                     partials, index, leases, guard, counters, progress)

docs/architecture.md draws the pieces and the path of each operation. Importing this
package imports none of its modules.
"""
