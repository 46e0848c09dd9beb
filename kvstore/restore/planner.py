"""Restore planning: how much of a stored prefix is worth loading.

A lookup says which leading chunks of a prompt are stored and where; a
:class:`RestorePlan` says how many of them to load. Loading chunks
``[first, n)`` from their tiers costs ``load(n)`` (each tier's live read speed:
its latency a call plus its bytes over its bandwidth, tiers one after another; one
call per tier, or, for a load that runs layer by layer, one per group of layers read
together: a layer for a fast tier, a whole chunk behind a slow link); recomputing what
is not loaded costs the engine's prefill of tokens ``[n * chunk_tokens, prompt_tokens)``
(:class:`~kvstore.restore.prefill.PrefillSpeed`).
The plan picks the ``n`` with the least time to a ready prompt:

    load(n) + prefill(n)                                     loads before compute
    max(load(n) + prefill(n) / g, prefill(n) + load(n) / g)  loads under compute, in g groups

so a hit is never expected to be slower than a miss. Ties go to the longer load;
a plan never loads less than the leading chunks in the store's fast (memory) tiers;
with planning off, or no known prefill speed, every stored chunk is loaded.

This module is pure arithmetic (no store, no clock); :mod:`kvstore.restore.restorer`
runs it for a store and warms what a plan leaves on slow tiers (``RestorePlan.warm``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidInputError
from kvstore.restore.prefill import PrefillSpeed
from kvstore.restore.speeds import SpeedEstimate
from kvstore.tiers.base import Tier

__all__ = [
    "RestoreCosts",
    "RestorePlan",
    "RestoreRequest",
    "TIE",
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
    The pipeline the engine waits in (:class:`~kvstore.restore.stats.PlannedLoad`): read
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
