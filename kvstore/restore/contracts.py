"""What restore planning asks of the data path, and what a store asks of restore planning.

The restore package sits below the data path: it never imports it. A
:class:`~kvstore.restore.restorer.Restorer` reaches a store's tiers, index and background
jobs only through :class:`RestorerParts`, which the data path implements
(:mod:`kvstore.datapath`); a :class:`~kvstore.KVStore` talks to its restorer only through
:class:`Restoring`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvstore.keys import BlockKey
from kvstore.restore.planner import RestorePlan, RestoreRequest
from kvstore.restore.speeds import SpeedEstimate
from kvstore.restore.stats import LoadMark, LoadSample

__all__ = ["RestorerParts", "Restoring"]


class RestorerParts(Protocol):
    """The narrow view of the data path a restorer needs."""

    @property
    def fast(self) -> frozenset[int]:
        """Tier levels always loaded (memory tiers)."""

    @property
    def media(self) -> tuple[str | None, ...]:
        """Per tier level, the medium routers tell apart: ``memory``, ``disk``, ``shared``
        (None: other; :func:`~kvstore.restore.planner.medium_of`)."""

    @property
    def staged(self) -> bool:
        """Loads go to a GPU, which reads chunks below memory whole first
        (:attr:`RestoreCosts.staged <kvstore.restore.planner.RestoreCosts.staged>`)."""

    @property
    def warms_in_place(self) -> bool:
        """Whether :meth:`warm_now` copies on the caller's thread (False: warming queues
        every copy at once and cannot yield to the engine)."""

    def lookup(self, keys: Sequence[BlockKey], recheck: bool, skip: int) -> int:
        """Leading stored ``keys``, not asking the tiers in the bit mask ``skip``."""

    def where(self, key: BlockKey) -> list[int]:
        """The tier levels holding ``key``, fastest first."""

    def speeds(self) -> list[SpeedEstimate]:
        """Each tier level's read speed now."""

    def warm(self, keys: Sequence[BlockKey]) -> int:
        """Queue copies of those of ``keys`` the fastest tier lacks into it; how many."""

    def warm_now(self, keys: Sequence[BlockKey]) -> int:
        """:meth:`warm` on the caller's thread; how many copies landed."""

    def probe(self, key: BlockKey) -> bool:
        """Read one block in the background (refreshes a stale or unread estimate of its
        tier); False if not queued."""

    def probe_tier(self, keys: Sequence[BlockKey], level: int) -> bool:
        """:meth:`probe` of tier ``level`` with the first of ``keys`` it holds, which the
        background job asks it for (a tier the plan did not ask); False if a probe of it
        is queued or running already."""

    def find(self, keys: Sequence[BlockKey], levels: int) -> int:
        """Ask the tiers in the bit mask ``levels`` which of ``keys`` they hold (on the
        caller's thread); how many leading ``keys`` are stored after."""

    def later(self, job: Callable[[], object], not_before: Callable[[], float]) -> bool:
        """Run ``job`` in the background once ``time.monotonic()`` reaches
        ``not_before()`` (asked again then); False if not queued."""

    def thread_reads(self) -> Sequence[float]:
        """Per tier level, the seconds the calling thread's reads of it have taken so far
        (:meth:`ReadSpeed.thread_seconds <kvstore.restore.speeds.ReadSpeed.thread_seconds>`):
        a restore's actual load time per tier. Empty: not kept."""

    def observe_loads(self, loads: dict[int, LoadSample]) -> None:
        """Correct the tiers' prices by what a restore's reads of each level cost."""


class Restoring(Protocol):
    """What a store asks of its restorer (:class:`~kvstore.restore.restorer.Restorer`)."""

    def plan(self, keys: Sequence[BlockKey], request: RestoreRequest) -> RestorePlan:
        """Plan ``keys``' restore and warm what it leaves on slow tiers."""

    def load_started(self) -> LoadMark:
        """Start timing a restore this thread is about to load."""

    def loaded(self, plan: RestorePlan, mark: LoadMark) -> None:
        """The restore timed from ``mark`` loaded ``plan`` whole: count it, correct prices."""

    def waited(self, plan: RestorePlan, waited_s: float) -> None:
        """The engine waited ``waited_s`` for a load of ``plan`` under compute."""

    def observe_prefill_step(self, tokens: int, seconds: float) -> None:
        """One engine step computed ``tokens`` in ``seconds``."""

    def published_speeds(self) -> dict[str, Any]:
        """Per medium the live ``[GB/s, ms a call]``, and the prefill speed."""

    def snapshot(self) -> dict[str, Any]:
        """Counters, estimate error and the prefill speed, as ``stats()`` shows them."""
