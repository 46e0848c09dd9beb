"""Restore planning: how much of a stored prefix is worth loading.

A lookup says which leading chunks of a prompt are stored and where; a
:class:`RestorePlan` says how many of them to load. Loading chunks
``[first, n)`` from their tiers costs ``load(n)`` (each tier's live read speed:
its latency a call plus its bytes over its bandwidth, tiers one after another; one
call per tier, or, for a load that runs layer by layer, one per group of layers read
together: a layer for a fast tier, a whole chunk behind a slow link); recomputing what
is not loaded costs the engine's prefill of tokens ``[n * chunk_tokens, prompt_tokens)``
(:class:`~kvstore.speeds.PrefillSpeed`).
The plan picks the ``n`` with the least time to a ready prompt:

    load(n) + prefill(n)                                     loads before compute
    max(load(n) + prefill(n) / g, prefill(n) + load(n) / g)  loads under compute, in g groups

so a hit is never expected to be slower than a miss. Ties go to the longer load;
a plan never loads less than the leading chunks in the store's fast (memory) tiers;
with planning off, or no known prefill speed, every stored chunk is loaded.
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

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidInputError
from kvstore.keys import BlockKey
from kvstore.restore_stats import LoadMark, LoadSample, PlannedLoad, RestoreStats
from kvstore.speeds import PrefillSpeed, SpeedEstimate
from kvstore.tiers.base import Tier

__all__ = [
    "LoadMark",
    "PlannedLoad",
    "RestoreCosts",
    "RestorePlan",
    "RestoreRequest",
    "RestoreStats",
    "Restorer",
    "TIE",
    "RestorerParts",
    "Warming",
    "medium_of",
    "plan_restore",
    "restore_request",
]

#: Relative slack within which a longer load counts as no slower (ties go to loading).
TIE = 1e-6


@dataclass(frozen=True)
class RestoreCosts:
    """What a plan weighs: chunk size, each tier level's read speed, which levels are
    fast (always loaded), the engine's prefill speed and the model's layer count."""

    chunk_tokens: int
    chunk_bytes: int
    speeds: Sequence[SpeedEstimate]
    fast: frozenset[int]
    prefill: PrefillSpeed
    num_layers: int = 1
    #: Chunks from tiers below memory are read whole before the first layer reaches the
    #: engine (a GPU destination: the prefetcher stages them in pinned memory), so under
    #: a layer-by-layer load they do not overlap compute; memory tiers' chunks still do.
    staged: bool = False


@dataclass(frozen=True)
class RestoreRequest:
    """One prompt's restore: ``levels[i]`` is the fastest tier level holding leading
    stored chunk ``i``; the engine already holds ``computed_tokens`` (its own cache);
    ``prompt_tokens`` is the whole prompt (None: the stored chunks' tokens);
    ``overlap`` says the load runs layer by layer under compute; ``chunk_tokens``
    overrides the tokens a chunk holds (an engine whose pages the store keeps as
    opaque blocks)."""

    levels: Sequence[int]
    prompt_tokens: int | None = None
    computed_tokens: int = 0
    overlap: bool = False
    planning: bool = True
    chunk_tokens: int | None = None  # an engine's page when blocks are opaque (None: layout)


@dataclass(frozen=True)
class RestorePlan:
    """The answer: load chunks ``[first, load)`` of the ``stored`` leading ones.

    ``load_s``: expected seconds to load them; ``recompute_s``: to prefill the same
    tokens instead (None: prefill speed unknown); ``ready_s`` / ``nocache_s``: expected
    seconds to a ready prompt with this plan / loading nothing. ``tier_chunks``: chunks
    loaded per tier level; ``tier_load_s``: the seconds of ``load_s`` each level takes.
    ``warm``: indexes of stored chunks left on slow tiers.
    ``reason``: ``pays`` (planned), ``all`` (every stored chunk pays), ``off``
    (planning off), ``unknown`` (no prefill speed yet), ``none`` (nothing stored).
    The pipeline the engine waits in (:class:`~kvstore.restore_stats.PlannedLoad`): read
    ``tier_calls`` per level; ``compute_s``, the prefill after the load (None: unknown),
    in ``groups`` of layers (1: after the load) behind ``staged_s`` read up front.
    """

    stored: int
    first: int
    load: int
    load_s: float
    recompute_s: float | None
    ready_s: float | None
    nocache_s: float | None
    floor: int
    reason: str
    tier_chunks: dict[int, int] = field(default_factory=dict)
    warm: tuple[int, ...] = ()
    tier_load_s: dict[int, float] = field(default_factory=dict)
    tier_calls: dict[int, int] = field(default_factory=dict)
    compute_s: float | None = None
    groups: int = 1
    staged_s: float = 0.0

    @property
    def skipped(self) -> int:
        """Stored chunks the plan leaves to recompute."""
        return self.stored - self.load

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain values (logs, the server protocol, benchmarks)."""
        return {
            "stored": self.stored,
            "first": self.first,
            "load": self.load,
            "load_ms": self.load_s * 1e3,
            "recompute_ms": None if self.recompute_s is None else self.recompute_s * 1e3,
            "ready_ms": None if self.ready_s is None else self.ready_s * 1e3,
            "nocache_ms": None if self.nocache_s is None else self.nocache_s * 1e3,
            "floor": self.floor,
            "reason": self.reason,
            "tier_chunks": dict(self.tier_chunks),
            "tier_load_ms": {level: t * 1e3 for level, t in self.tier_load_s.items()},
            "warm": len(self.warm),
        }


def medium_of(tier: Tier) -> str | None:
    """The kind of medium a router tells apart: this process's ``memory``, a local
    ``disk``, or ``shared`` storage every node reads (None: a peer cluster, say)."""
    if tier.device is not None:
        return "memory"
    if tier.kind == "disk":
        return "disk"
    return "shared" if not tier.local and tier.kind != "cluster" else None


def restore_request(
    prompt_tokens: int | None, computed_tokens: int, overlap: bool, chunk_tokens: int | None
) -> RestoreRequest:
    """A :class:`RestoreRequest` (levels filled in by the store) from a caller's
    arguments, or :class:`InvalidInputError` naming the bad one."""
    for name, value in (("prompt_tokens", prompt_tokens), ("computed_tokens", computed_tokens)):
        if value is not None and (type(value) is not int or value < 0):
            raise InvalidInputError(f"plan: {name} must be an int >= 0, got {value!r}")
    if chunk_tokens is not None and (type(chunk_tokens) is not int or chunk_tokens <= 0):
        raise InvalidInputError(f"plan: chunk_tokens must be an int > 0, got {chunk_tokens!r}")
    return RestoreRequest((), prompt_tokens, computed_tokens, bool(overlap), True, chunk_tokens)


def _calls(level: int, costs: RestoreCosts, overlap: bool) -> int:
    """Calls a load makes to read a chunk from ``level``: one for a whole read; for a load
    that runs layer by layer, one per group of layers the prefetcher reads together from
    that tier (:meth:`SpeedEstimate.layers_per_call`: a slow link's latency is paid once
    a chunk, a fast tier's a layer)."""
    layers = max(1, costs.num_layers)
    if not overlap or _staged(level, costs):
        return 1
    per_call = costs.speeds[level].layers_per_call(costs.chunk_bytes // layers, layers)
    return -(-layers // per_call)


def _staged(level: int, costs: RestoreCosts) -> bool:
    """Whether chunks of ``level`` are read whole before compute starts
    (:attr:`RestoreCosts.staged`)."""
    return costs.staged and level not in costs.fast


def _load_seconds(
    per_level: dict[int, int], costs: RestoreCosts, overlap: bool, staged: bool | None = None
) -> float:
    """Seconds to read ``per_level[level]`` chunks from each level (the levels one after
    another, each level's chunks read side by side); only the staged levels, or only the
    others, where ``staged`` says which."""
    return sum(
        costs.speeds[level].seconds_for(n * costs.chunk_bytes, _calls(level, costs, overlap))
        for level, n in per_level.items()
        if staged is None or _staged(level, costs) == staged
    )


def plan_restore(request: RestoreRequest, costs: RestoreCosts) -> RestorePlan:
    """The plan for ``request`` under ``costs`` (see the module docstring)."""
    ct, stored = costs.chunk_tokens, len(request.levels)
    first = min(request.computed_tokens // ct, stored)
    total = request.prompt_tokens if request.prompt_tokens is not None else stored * ct
    total = max(total, stored * ct)
    floor = first
    while floor < stored and request.levels[floor] in costs.fast:
        floor += 1
    loads, before = [0.0], [0.0]  # all of a load; its part read before compute (staged)
    groups, per_level = [max(1, costs.num_layers)], dict[int, int]()
    for i in range(first, stored):
        level = request.levels[i]
        per_level[level] = per_level.get(level, 0) + 1
        loads.append(_load_seconds(per_level, costs, request.overlap))
        staged = request.overlap and _staged(level, costs)
        before.append(_load_seconds(per_level, costs, True, True) if staged else before[-1])
        if not staged:
            groups.append(min(groups[-1], _calls(level, costs, request.overlap)))
        else:
            groups.append(groups[-1])
    prefill = costs.prefill

    def ready(n: int) -> float | None:
        compute = prefill.seconds(n * ct, total)
        if compute is None:
            return None
        load = loads[n - first]
        if request.overlap:
            # A pipeline of ``g`` groups of layers: the engine computes a group once it
            # has arrived, so the slower side runs whole and the other adds one group.
            # Staged chunks are read before the pipeline starts.
            g, staged = groups[n - first], before[n - first]
            load -= staged
            return staged + max(load + compute / g, compute + load / g)
        return load + compute

    def pipeline(n: int) -> tuple[float | None, int, float]:  # compute, groups, staged
        piped = (groups[n - first], before[n - first]) if request.overlap else (1, 0.0)
        return prefill.seconds(n * ct, total), *piped

    nocache = ready(first)
    if stored == first:
        reason = "none"
        best = first
    elif not request.planning or nocache is None:
        reason, best = ("off" if not request.planning else "unknown"), stored
    else:
        best, best_s = first, nocache
        for n in range(first + 1, stored + 1):
            t = ready(n)
            assert t is not None
            if t <= best_s * (1 + TIE):
                best, best_s = n, min(t, best_s)
        best = max(best, floor)
        reason = "all" if best == stored else "pays"
    load_s = loads[best - first]
    plan = RestorePlan(stored, first, best, load_s, None, ready(best), nocache, floor, reason)
    return _filled(plan, request, costs, pipeline(best))


def _filled(
    plan: RestorePlan,
    request: RestoreRequest,
    costs: RestoreCosts,
    pipeline: tuple[float | None, int, float],
) -> RestorePlan:
    """``plan`` with what follows from its load: recompute, per-tier figures, warming."""
    ct, first, best = costs.chunk_tokens, plan.first, plan.load
    tier_chunks = dict(collections.Counter(request.levels[first:best]))
    warm = tuple(i for i in range(best, plan.stored) if request.levels[i] not in costs.fast)
    # load_s is a sum over levels (_load_seconds): each level's own share of it.
    tier_load_s = {
        level: _load_seconds({level: n}, costs, request.overlap) for level, n in tier_chunks.items()
    }
    tier_calls = {level: _calls(level, costs, request.overlap) for level in tier_chunks}
    return dataclasses.replace(
        plan,
        recompute_s=costs.prefill.seconds(first * ct, best * ct),
        tier_chunks=tier_chunks,
        warm=warm,
        tier_load_s=tier_load_s,
        tier_calls=tier_calls,
        compute_s=pipeline[0],
        groups=pipeline[1],
        staged_s=pipeline[2],
    )


def _run_now(job: Callable[[], object]) -> bool:
    job()
    return True


@dataclass(frozen=True)
class RestorerParts:
    """The narrow view of the data path a :class:`Restorer` needs."""

    #: ``lookup(keys, recheck, skip)``: leading stored keys, not asking the tiers in the
    #: bit mask ``skip``.
    lookup: Callable[[Sequence[BlockKey], bool, int], int]
    where: Callable[[BlockKey], list[int]]
    speeds: Callable[[], list[SpeedEstimate]]
    fast: frozenset[int]
    #: ``warm(keys)``: queue copies of those of ``keys`` the fastest tier lacks into it.
    warm: Callable[[Sequence[BlockKey]], int]
    #: Per tier level, the medium routers tell apart: memory, disk, shared (None: other).
    media: tuple[str | None, ...] = ()
    #: Read one block in the background (refreshes a stale or unread estimate of its tier).
    probe: Callable[[BlockKey], bool] = lambda key: False
    #: ``probe_tier(keys, level)``: the same for tier ``level`` with one of ``keys`` it
    #: holds, which the background job asks it for (a tier the plan did not ask).
    probe_tier: Callable[[Sequence[BlockKey], int], bool] = lambda keys, level: False
    #: ``find(keys, levels)``: ask the tiers in the bit mask ``levels`` which of ``keys``
    #: they hold (on the caller's thread); how many leading ``keys`` are stored after.
    find: Callable[[Sequence[BlockKey], int], int] = lambda keys, levels: 0
    #: ``later(job, not_before)``: run ``job`` in the background once ``time.monotonic()``
    #: reaches ``not_before()`` (asked again then); False if not queued.
    later: Callable[[Callable[[], object], Callable[[], float]], bool] = lambda job, when: _run_now(
        job
    )
    #: ``warm_now(keys)``: :attr:`warm` on the caller's thread; how many copies landed
    #: (None: warming queues every copy at once and cannot yield to the engine).
    warm_now: Callable[[Sequence[BlockKey]], int] | None = None
    #: Loads go to a GPU, which reads chunks below memory whole first
    #: (:attr:`RestoreCosts.staged`).
    staged: bool = False
    #: Per tier level, the seconds the calling thread's reads of it have taken so far
    #: (:meth:`ReadSpeed.thread_seconds <kvstore.speeds.ReadSpeed.thread_seconds>`): a
    #: restore's actual load time per tier. Empty: not kept.
    thread_reads: Callable[[], Sequence[float]] = lambda: ()
    #: Correct the tiers' prices by what a restore's reads of each level cost.
    observe_loads: Callable[[dict[int, LoadSample]], None] = lambda loads: None


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
            if self.parts.warm_now is None or self.warm_wait_s <= 0:
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
