"""The data path's front door: the value types that code outside it (the server, cluster,
events and connectors) may hold. Like vLLM's ``kv_offload/base.py``, this module holds only
such types; nothing here reaches into a store.

- :class:`Medium`: where the nearest copy of a block is, as a cluster publishes it.
- :class:`ChangeFeed`: the keys whose :class:`Medium` changed, for a watcher outside the
  store (``store.manager.watch()``).
"""

from __future__ import annotations

import enum
import threading

from kvstore.keys import BlockKey

__all__ = ["ChangeFeed", "Medium"]


class Medium(enum.IntEnum):
    """Where the nearest copy of a block is, as a cluster publishes it (best last).

    ``MEMORY``: a memory tier of this machine (host DRAM, GPU); ``DISK``: a
    persistent tier of this machine; ``SHARED``: only a persistent tier of
    another machine that every node reads (S3, Redis, a server); ``NONE``: no
    copy at all.
    """

    NONE = 0
    SHARED = 1
    DISK = 2
    MEMORY = 3


class ChangeFeed:
    """Keys whose nearest copy changed :class:`Medium` (gained their first copy in a
    tier of this machine, moved between memory and disk, or lost them).

    For a watcher outside the store (a cluster node publishing what it holds):
    :class:`Index` records each change under the books' lock; :meth:`drain`
    hands over the net change since the last drain, ``(medium before, medium
    now)`` per key (a key added and removed meanwhile has equal ends). ``_lock``
    guards ``_state`` (drains come from the watcher's thread).
    """

    def __init__(self) -> None:
        self._state: dict[BlockKey, tuple[Medium, Medium]] = {}
        self._lock = threading.Lock()

    def record(self, key: BlockKey, before: Medium, now: Medium) -> None:
        """``key``'s nearest copy went from ``before`` to ``now``."""
        with self._lock:
            first = self._state.get(key)
            self._state[key] = (before if first is None else first[0], now)

    def drain(self) -> dict[BlockKey, tuple[Medium, Medium]]:
        """``(medium before, medium now)`` of each key that changed since the last drain
        (keys that came back to where they were are left out)."""
        with self._lock:
            state, self._state = self._state, {}
        return {k: v for k, v in state.items() if v[0] != v[1]}
