"""The data path as restore planning sees it, and the restorer a manager builds.

:class:`RestoreSide` implements :class:`~kvstore.restore.contracts.RestorerParts`: the
narrow view of one store's data path a :class:`~kvstore.restore.Restorer` plans over
(its lookups, the tiers' live read speeds, the background jobs that warm and probe).
The lookups are the manager's own (:class:`Lookups`, which the façade satisfies), so
this module needs nothing above the pieces it names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.config import StoreConfig
from kvstore.datapath.mover import Mover
from kvstore.datapath.probes import SpeedProbes
from kvstore.datapath.tierio import TierIO
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.restore import (
    LoadSample,
    PrefillSpeed,
    Restorer,
    SpeedEstimate,
    Warming,
    medium_of,
)
from kvstore.runtime import cuda_available
from kvstore.tiers.base import Tier

__all__ = ["Lookups", "RestoreSide", "build_restorer"]


class Lookups(Protocol):
    """What of the manager's façade restore planning uses (the manager is one)."""

    def lookup(self, keys: Sequence[BlockKey], recheck: bool = False, skip: int = 0) -> int:
        """Leading stored ``keys``, not asking the tiers in the bit mask ``skip``."""

    def where(self, key: BlockKey) -> list[int]:
        """The tier levels holding ``key``, fastest first."""

    def warm(self, keys: Sequence[BlockKey]) -> int:
        """Queue copies of those of ``keys`` the fastest tier lacks into it."""

    def warm_now(self, keys: Sequence[BlockKey]) -> int:
        """:meth:`warm` on the caller's thread."""

    def find(self, keys: Sequence[BlockKey], levels: int) -> int:
        """Ask the tiers in the bit mask ``levels`` for ``keys``; leading stored after."""


class RestoreSide:
    """:class:`~kvstore.restore.contracts.RestorerParts` over one store's data path."""

    def __init__(
        self,
        lookups: Lookups,
        io: TierIO,
        mover: Mover,
        probes: SpeedProbes,
        tiers: Sequence[Tier],
    ) -> None:
        self._lookups = lookups
        self._io = io
        self._mover = mover
        self._probes = probes
        self._fast = frozenset(i for i, t in enumerate(tiers) if t.device is not None)
        self._media = tuple(medium_of(t) for t in tiers)
        # Where CUDA exists the engine's KV is on the GPU, and a prefetch into it reads
        # the chunks of tiers below memory whole before the first layer is handed over.
        self._staged = cuda_available()

    @property
    def fast(self) -> frozenset[int]:
        """The memory tiers' levels."""
        return self._fast

    @property
    def media(self) -> tuple[str | None, ...]:
        """Per level, the medium routers tell apart."""
        return self._media

    @property
    def staged(self) -> bool:
        """Loads go to a GPU (CUDA exists here)."""
        return self._staged

    @property
    def warms_in_place(self) -> bool:
        """The manager warms on the caller's thread too (:meth:`warm_now`)."""
        return True

    def lookup(self, keys: Sequence[BlockKey], recheck: bool, skip: int) -> int:
        """The manager's lookup."""
        return self._lookups.lookup(keys, recheck, skip)

    def where(self, key: BlockKey) -> list[int]:
        """The manager's where."""
        return self._lookups.where(key)

    def speeds(self) -> list[SpeedEstimate]:
        """Every tier's read speed now."""
        return self._io.speeds_now()

    def warm(self, keys: Sequence[BlockKey]) -> int:
        """The manager's warm (in the background)."""
        return self._lookups.warm(keys)

    def warm_now(self, keys: Sequence[BlockKey]) -> int:
        """The manager's warm on the caller's thread."""
        return self._lookups.warm_now(keys)

    def probe(self, key: BlockKey) -> bool:
        """A background read of ``key`` that measures its tier."""
        return self._probes.probe(key)

    def probe_tier(self, keys: Sequence[BlockKey], level: int) -> bool:
        """A background probe of tier ``level`` with one of ``keys`` it holds."""
        return self._probes.probe_tier(keys, level)

    def find(self, keys: Sequence[BlockKey], levels: int) -> int:
        """The manager's find."""
        return self._lookups.find(keys, levels)

    def later(self, job: Callable[[], object], not_before: Callable[[], float]) -> bool:
        """``job`` on the mover once ``not_before()`` has passed."""
        return self._mover.submit_later(job, not_before)

    def thread_reads(self) -> Sequence[float]:
        """Per level, this thread's read seconds so far."""
        return [speed.thread_seconds() for speed in self._io.speeds]

    def observe_loads(self, loads: dict[int, LoadSample]) -> None:
        """Correct the tiers' prices by a restore's reads."""
        self._io.observe_loads(loads)


def build_restorer(
    side: RestoreSide, config: StoreConfig, layout: KVLayout, clock: Callable[[], float]
) -> Restorer:
    """A store's restore planner over ``side``, as its config's ``restore`` section says."""
    restore = config.restore
    prefill = PrefillSpeed(
        restore.prefill_table,
        restore.prefill_tokens_per_s,
        restore.learn_prefill,
        restore.speed_half_life_s,
        clock,
    )
    chunk = (layout.block_tokens, layout.block_nbytes, layout.num_layers)
    warming = Warming(restore.warm, restore.warm_wait_s, restore.warm_settle_s)
    return Restorer(side, prefill, chunk, planning=restore.planning, warming=warming)
