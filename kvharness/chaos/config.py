"""What a chaos soak runs (:class:`SoakConfig`) and the faults it knows (:data:`FAULT_KINDS`).

Kept apart from :mod:`kvharness.chaos.run` so that the cluster, workload and fault
modules it drives import their settings from here, and nothing imports back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FAULT_KINDS", "SoakConfig"]

#: Every fault a soak can inject: a node SIGKILLed (restarted on its disk later), Redis
#: killed and started empty, S3 answering 5xx, stalling past the read timeout, or
#: returning damaged bodies.
FAULT_KINDS: tuple[str, ...] = ("node_kill", "redis_restart", "s3_error", "s3_stall", "s3_corrupt")


@dataclass(frozen=True)
class SoakConfig:
    """What a soak runs, and for how long (every random choice follows from ``seed``).

    ``seconds``: the workload's duration (faults are injected during all of it).
    ``nodes`` server processes and ``members`` in-process stores, ``workers`` workload
    threads. ``fault_interval_s``: mean seconds between two fault injections (the first
    ``len(fault_kinds)`` injections go through every kind once, in a seeded order);
    ``fault_s``: how long a fault lasts (a node or Redis stays down, S3 misbehaves),
    drawn uniformly from the range. ``fault_weights``: relative odds of each kind after
    the first round. ``hot_fraction``: share of reads that go to a small set of hot
    blocks (rotated every ``hot_period_s``), so that replicas are made and cool down.
    Capacities are small on purpose: blocks leave the nodes' own tiers during the run,
    so that S3 is often a block's only copy and a wrong delete there is a lost block.
    ``heartbeat_s``, ``hot_threshold`` and ``heat_half_life_s`` go to the nodes'
    ``cluster:`` section (short, so that heat rises and falls within the run).
    ``settle_s``: how long the cluster is left alone after the faults end, before the
    final check (leases of entries a killed node left run out).
    """

    seconds: float = 60.0
    seed: int = 0
    nodes: int = 3
    members: int = 1
    workers: int = 3
    fault_interval_s: float = 5.0
    fault_s: tuple[float, float] = (1.0, 3.0)
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    fault_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    hot_fraction: float = 0.3
    hot_period_s: float = 10.0
    heartbeat_s: float = 0.3
    hot_threshold: int = 2
    heat_half_life_s: float = 1.0
    host_capacity: str = "192KiB"
    disk_capacity: str = "768KiB"
    member_capacity: str = "1MiB"
    settle_s: float = 3.0

    @classmethod
    def minutes(cls, minutes: float, **overrides: Any) -> SoakConfig:
        """A soak of ``minutes`` minutes (the benchmark's long form)."""
        return cls(seconds=60.0 * minutes, **overrides)

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.members < 0 or self.workers < 1 or self.seconds <= 0:
            raise ValueError("a soak needs >= 2 nodes, >= 0 members, >= 1 worker, seconds > 0")
        if len(self.fault_weights) != len(self.fault_kinds):
            raise ValueError("fault_weights needs one weight per fault kind")
        unknown = set(self.fault_kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
