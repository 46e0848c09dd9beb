"""The data path's front door: the value types that code outside it (the server, cluster,
events and connectors) may hold. Like vLLM's ``kv_offload/base.py``, this module holds only
such types; nothing here reaches into a store.

- :class:`Medium`: where the nearest copy of a block is, as a cluster publishes it.
- :class:`ChangeFeed`: the keys whose :class:`Medium` changed, for a watcher outside the
  store (``store.datapath.watch()``).
- :class:`DataPath`: what such code may ask of a store's data path (``KVStore.datapath``):
  its tiers, what is where, the change feed, moves between tiers, and the engine-facing
  reads and writes that skip the store's argument checks.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.keys import BlockKey

if TYPE_CHECKING:
    import torch

    from kvstore.layout import KVLayout
    from kvstore.quota import QuotaHook, QuotaLedger
    from kvstore.tiers.base import LayerRange, Tier

__all__ = ["ChangeFeed", "DataPath", "Medium"]


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


class DataPath(Protocol):
    """What code outside the data path (the server, cluster, events, connectors) may ask of
    a store's: ``KVStore.datapath``. Keys are the store's; nothing here checks arguments
    as :class:`~kvstore.KVStore` does, so callers hand well-formed keys and views."""

    @property
    def layout(self) -> KVLayout:
        """The store's KV layout."""

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""

    @property
    def close_flush(self) -> dict[str, Any] | None:
        """What the close's flush did (None before a close)."""

    def __len__(self) -> int:
        """Blocks stored."""

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored."""

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether it is stored (anywhere, not only as a prefix)."""

    def where(self, key: BlockKey) -> list[int]:
        """The tiers (levels, fastest first) that hold ``key``."""

    def stored_keys(self, local: bool = False) -> list[BlockKey]:
        """Every stored key (``local``: only those with a copy in this machine's tiers)."""

    def stored_media(self) -> list[tuple[BlockKey, Medium]]:
        """Each key held here or in a shared tier, with the :class:`Medium` of its nearest
        copy."""

    def watch(self) -> ChangeFeed:
        """A new :class:`ChangeFeed` of this store's changes (one per watcher)."""

    def unwatch(self, feed: ChangeFeed) -> None:
        """Stop ``feed``."""

    def promote(self, keys: Sequence[BlockKey], tier: int = 0) -> int:
        """Copy ``keys`` into tier ``tier`` now; how many landed."""

    def drop_local(self, keys: Sequence[BlockKey]) -> int:
        """Give up this machine's copies of ``keys`` (shared tiers keep theirs); how many."""

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
        prefix: bool = False,
        partial: bool = False,
    ) -> int:
        """Copy blocks into ``outs``; how many leading blocks were loaded."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Store ``blocks`` under ``keys``; how many were stored."""

    def chunk_pays(self, level: int, nbytes: int, tokens: tuple[int, int]) -> bool | None:
        """Whether reading one chunk from tier ``level`` beats recomputing ``tokens``;
        None when restore planning cannot tell."""

    def use_quota(self, ledger: QuotaLedger, owner: str) -> QuotaHook:
        """Grant room in every tier through ``owner``'s seat at ``ledger`` from now on."""
