"""The restorer: restore planning for one store, and the warming of what plans leave.

:class:`Restorer` plans with :func:`~kvstore.restore.planner.plan_restore` over the
store's live tier speeds and the engine's prefill speed, counts what it planned and what
the loads cost (:class:`~kvstore.restore.stats.RestoreStats`), and corrects the tiers'
prices by it. It reaches the data path only through
:class:`~kvstore.restore.contracts.RestorerParts`.

Stored chunks a plan leaves behind on slow tiers are *warmed*: copied up in the
background so the next request finds them fast; so are those it loads from a slow tier
(another machine's storage always; below memory when it leaves chunks behind), or the
next request would find the prompt's head on the slow tier again.

A shared tier so slow that even a prompt stored whole on it would be recomputed is not
asked during the plan at all: asking costs a round trip over the same slow link, and the
answer could not change the plan. It is asked in the background instead, and what it
holds is warmed (``lookups_deferred``); where its estimate is stale, a background probe
looks for one of the prompt's chunks there and measures the tier with it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.keys import BlockKey
from kvstore.restore.contracts import RestorerParts
from kvstore.restore.planner import (
    TIE,
    RestoreCosts,
    RestorePlan,
    RestoreRequest,
    plan_restore,
)
from kvstore.restore.prefill import PrefillSpeed
from kvstore.restore.stats import LoadMark, PlannedLoad, RestoreStats

__all__ = ["Restorer", "Warming"]


@dataclass(frozen=True)
class Warming:
    """When the background warming runs (``restore.warm*`` in the config).

    ``enabled``: warm at all. ``wait_s``: a copy waits for the compute the plans expect to
    end, but no longer than this (0: copies start at once, all queued together).
    ``settle_s``: and starts only once no compute has been expected for this long (or
    for as long as the last expected compute, if that was shorter), so that a prompt
    arriving right after the last one ended (back-to-back requests, or a prefill running
    past its estimate) finds no copy under way."""

    enabled: bool = True
    wait_s: float = 0.0
    settle_s: float = 0.0


class Restorer:
    """Plans restores for one store: its tiers' live speeds, the engine's prefill speed,
    counters, and the background warming of what a plan leaves on slow tiers."""

    def __init__(
        self,
        parts: RestorerParts,
        prefill: PrefillSpeed,
        chunk: tuple[int, int, int],
        planning: bool = True,
        warming: Warming = Warming(),
    ) -> None:
        self.parts = parts
        self.prefill = prefill
        self.chunk_tokens, self.chunk_bytes, self.num_layers = chunk
        self.planning = planning
        self.warming = warming.enabled
        self.warm_wait_s = warming.wait_s
        self.warm_settle_s = warming.settle_s
        self.stats = RestoreStats()
        # When the compute that plans expect ends, and the engine has settled after it
        # (time.monotonic()): warming waits for it. Written by plan() callers, read by
        # the mover's timer; a float swap, no lock.
        self._busy_until = 0.0
        # First keys of the prompts whose deferred search is queued or running (a prompt
        # planned again meanwhile is not searched twice). Guarded by _lock, owned here.
        self._searching: set[BlockKey] = set()
        self._lock = threading.Lock()

    def costs(self) -> RestoreCosts:
        """The costs a plan made now would weigh."""
        return RestoreCosts(
            self.chunk_tokens,
            self.chunk_bytes,
            self.parts.speeds(),
            self.parts.fast,
            self.prefill,
            self.num_layers,
            self.parts.staged,
        )

    def plan(self, keys: Sequence[BlockKey], request: RestoreRequest) -> RestorePlan:
        """Plan ``keys``' restore (``request.levels`` is filled in from the store) and
        warm what it leaves on slow tiers."""
        costs = self.costs()
        if request.chunk_tokens is not None:
            costs = dataclasses.replace(costs, chunk_tokens=request.chunk_tokens)
        hopeless = self._hopeless(len(keys), request, costs) if self.planning else 0
        stored = self.parts.lookup(keys, True, hopeless)
        levels = []
        for key in keys[:stored]:
            where = self.parts.where(key)
            if not where:  # evicted since the lookup: the prefix ends here
                break
            levels.append(where[0])
        request = dataclasses.replace(
            request, levels=levels, planning=request.planning and self.planning
        )
        plan = plan_restore(request, costs)
        self.stats.planned(plan, costs.chunk_tokens)
        if plan.ready_s is not None:
            # The engine counts as busy past the compute for a settle time (as long as
            # that compute, at most warm_settle_s): a short plan barely defers warming.
            settle = min(self.warm_settle_s, plan.ready_s)
            self._busy_until = max(self._busy_until, time.monotonic() + plan.ready_s + settle)
        warm = [*self._loaded_slow(levels, plan, costs), *plan.warm]
        if warm and self.warming:
            self._after_compute(self._warm_job([keys[i] for i in warm]))
        if hopeless and self.warming and self._search_later(list(keys), hopeless):
            self.stats.add("lookups_deferred")
        self._probe_stale(keys, levels, plan, (costs, hopeless))
        return plan

    def observe_prefill_step(self, tokens: int, seconds: float) -> None:
        """One engine step computed ``tokens`` in ``seconds`` (what a learned prefill
        speed is fitted to)."""
        self.prefill.observe_step(tokens, seconds)

    def load_started(self) -> LoadMark:
        """Start timing a restore this thread is about to load (:meth:`loaded`)."""
        return LoadMark.now(self.parts.thread_reads())

    def loaded(self, plan: RestorePlan, mark: LoadMark) -> None:
        """The restore timed from ``mark`` on this thread loaded ``plan`` whole: count its
        planned against its actual load seconds, in all and per tier (the tiers' reads
        on this thread since the mark), and correct the tiers' prices by them."""
        actual_s, reads = mark.since(self.parts.thread_reads())
        tiers = {
            level: (plan.tier_load_s.get(level, 0.0), reads.get(level, 0.0))
            for level in plan.tier_load_s.keys() | reads.keys()
        }
        self.stats.loaded(plan.load_s, actual_s, tiers)
        self.parts.observe_loads(PlannedLoad.of(plan, self.chunk_bytes).samples(reads))

    def waited(self, plan: RestorePlan, waited_s: float) -> None:
        """The engine waited ``waited_s`` for a load of ``plan`` under compute: counted as
        :meth:`loaded`, at the seconds the plan's model needs for that wait."""
        load = PlannedLoad.of(plan, self.chunk_bytes)
        scale = load.scale(waited_s)
        if scale is None:
            return
        tiers = {level: (t, scale * t) for level, t in plan.tier_load_s.items()}
        self.stats.loaded(plan.load_s, scale * plan.load_s, tiers)
        self.parts.observe_loads(load.samples(scale))

    def _loaded_slow(
        self, levels: Sequence[int], plan: RestorePlan, costs: RestoreCosts
    ) -> list[int]:
        """Chunks the plan loads that the next request would find on a slow tier again.

        Those from another machine's storage (a bucket, Redis, a peer): the engine reads
        them into its own memory, which no tier of this store sees. And, where the plan
        leaves chunks behind (a local disk too slow for the whole prefix), those it loads
        from any tier below memory: warming only the tail would leave the head on disk,
        where the next plan, its estimate now measured, would recompute it and with it
        the warmed tail behind it (seen on an H200: a 4K prompt planned 5 chunks from
        disk, its next turn recomputed all 15)."""
        media = self.parts.media
        partial = plan.load < plan.stored
        return [
            i
            for i in range(plan.first, plan.load)
            if levels[i] not in costs.fast
            and (partial or (levels[i] < len(media) and media[levels[i]] not in ("memory", "disk")))
        ]

    def _warm_job(self, keys: list[BlockKey]) -> Callable[[], None]:
        """The job that warms ``keys``. Where the store can copy on the job's thread, it
        copies a chunk at a time, and when a plan made since expects the engine to compute
        again, the rest waits for that compute to end (and ``warm_settle_s``): prompts that
        come back to back would otherwise find the first one's warming competing with
        their prefills."""

        def job() -> None:
            if not self.parts.warms_in_place or self.warm_wait_s <= 0:
                self.stats.add("chunks_warming", self.parts.warm(keys))
                return
            for i, key in enumerate(keys):
                if i and time.monotonic() < self._busy_until:
                    self.stats.add("warming_yields")
                    self._after_compute(self._warm_job(keys[i:]))
                    return
                self.stats.add("chunks_warming", self.parts.warm_now([key]))

        return job

    def _search_later(self, keys: list[BlockKey], levels: int) -> bool:
        """Once the compute the plans expect has ended, ask the tiers in ``levels`` (which
        the plan skipped) for ``keys``, then warm what they hold as a plan's warming does:
        a chunk at a time, yielding to the next prefill (all at once, those copies would
        compete with every prefill that follows). False if a search is queued already."""
        with self._lock:
            if keys[0] in self._searching:
                return False
            self._searching.add(keys[0])

        def job() -> None:
            try:
                held = self.parts.find(keys, levels)
            finally:
                with self._lock:
                    self._searching.discard(keys[0])
            if held:
                self._warm_job(keys[:held])()

        # With no wait, still not on the planning thread: the search is a slow round trip.
        queued = (
            self._after_compute(job) if self.warm_wait_s > 0 else self.parts.later(job, lambda: 0.0)
        )
        if not queued:
            with self._lock:
                self._searching.discard(keys[0])
        return queued

    def _after_compute(self, job: Callable[[], object]) -> bool:
        """Queue ``job`` (copies that compete with the engine for cores, memory bandwidth
        and, in its process, the GIL) to start ``warm_settle_s`` after the compute the
        plans made so far expect has ended (a plan made meanwhile pushes it back), or
        ``warm_wait_s`` from now at the latest."""
        if self.warm_wait_s <= 0:
            return bool(job())
        latest = time.monotonic() + self.warm_wait_s
        return self.parts.later(job, lambda: min(self._busy_until, latest))

    def _hopeless(self, n: int, request: RestoreRequest, costs: RestoreCosts) -> int:
        """Bit mask of the slow tiers from which no load of these ``n`` chunks pays: a
        plan with all ``n`` stored there would recompute them all. A stale estimate
        counts as it stands (the plan would price the tier by it anyway); its probe finds
        a chunk there in the background (:meth:`_probe_stale`). A load that gains
        anything at all keeps the tier asked: what asking costs is not a read's latency
        (a local disk answers from a stat, a bucket from a HEAD), so it is not weighed
        against the gain."""
        mask = 0
        if not request.planning or n == 0:
            return 0
        for level in range(len(costs.speeds)):
            if level in costs.fast:
                continue
            plan = plan_restore(dataclasses.replace(request, levels=(level,) * n), costs)
            if plan.reason == "pays" and plan.load == plan.first:
                mask |= 1 << level
        return mask

    def _probe_stale(
        self,
        keys: Sequence[BlockKey],
        levels: list[int],
        plan: RestorePlan,
        priced: tuple[RestoreCosts, int],
    ) -> None:
        """A tier the plan skipped on an estimate nobody refreshed for ``speed_stale_s``
        (no read since): read one of its chunks in the background, so the next plan
        weighs what the tier does now, not what it did then. ``priced``: the costs the
        plan weighed and the tiers it did not ask (:meth:`_hopeless`), whose chunk the
        probe looks for there itself."""
        costs, unasked = priced
        stale = {level for level, s in enumerate(costs.speeds) if s.source == "stale"}
        probed: set[int] = set()
        for i in range(plan.load, len(levels)):
            level = levels[i]
            if level in stale and level not in probed:
                probed.add(level)
                if self.parts.probe(keys[i]):
                    self.stats.add("stale_probes")
        for level in sorted(stale - probed):
            if unasked >> level & 1 and self.parts.probe_tier(keys, level):
                self.stats.add("stale_probes")

    def chunk_pays(self, level: int, nbytes: int, tokens: tuple[int, int]) -> bool | None:
        """Whether reading one chunk of ``nbytes`` from tier ``level`` beats recomputing
        its prompt tokens ``[start, end)`` (engines that look chunks up one at a time, in
        order); None when planning is off or the prefill speed is unknown (load it)."""
        if not self.planning:
            return None
        compute = self.prefill.seconds(*tokens)
        if compute is None:
            return None
        speeds = self.parts.speeds()
        if not 0 <= level < len(speeds) or level in self.parts.fast:
            return True
        pays = speeds[level].seconds_for(nbytes) <= compute * (1 + TIE)
        self.stats.add("chunks_checked")
        if not pays:
            self.stats.add("chunks_planned_recompute")
            self.stats.add("tokens_planned_recompute", tokens[1] - tokens[0])
        return pays

    def published_speeds(self) -> dict[str, Any]:
        """Per medium, the live ``[GB/s, ms a call]`` of the fastest tier of that medium,
        and the prefill speed (what a cluster node publishes for routers)."""
        out: dict[str, Any] = {}
        for medium, speed in zip(self.parts.media, self.parts.speeds(), strict=False):
            if medium is not None:
                out.setdefault(medium, [speed.gbps, speed.latency_ms])
        out["prefill_tokens_per_s"] = self.prefill.estimate().tokens_per_s
        return out

    def snapshot(self) -> dict[str, Any]:
        """Counters, estimate error and the prefill speed, as ``stats()`` shows them."""
        out = self.stats.snapshot()
        out.update(self.prefill.estimate().as_stats())
        out["planning"] = self.planning
        return out
