"""A chaos soak of a kvstore cluster: real processes, injected faults, every byte checked.

>>> report = run_soak(SoakConfig(seconds=60, seed=1), workdir)
>>> report.wrong_bytes, report.lost_blocks          # both must be 0
(0, 0)

What runs (:mod:`kvharness.chaos.cluster`): ``nodes`` kvstore-server processes
(host -> disk -> S3, written through, a shared ``cluster:`` section with a short
heartbeat and a low ``hot_threshold``, so hot blocks get replicas that cool down again
during the run), ``members`` in-process stores (a host tier and the cluster), one
``redis-server`` and one S3 endpoint (moto) that the nodes reach through a
:class:`~kvharness.proxies.fault.FaultProxy`.

A workload (:mod:`kvharness.chaos.work`) puts new blocks, whose bytes follow from
their keys, and reads existing ones through random nodes and the members (get, prefix
get, prefetch, lookup); a block returned as found must be byte-exact, a miss is allowed.
A driver (:mod:`kvharness.chaos.faults`) injects faults at seeded random moments:
a node SIGKILLed and restarted on its disk, Redis killed and started empty, S3 answering
5xx, stalling, or returning damaged bodies. A tracker asks the bucket directly (not
through the proxy) which blocks reached S3. At the end every fault is healed, the
cluster settles, and each block that reached S3 must still be readable through some
node: ``lost_blocks`` counts those that are not.

Every node publishes KV events; a subscriber per node keeps a view built from them
alone, restarted now and then (:mod:`kvharness.chaos.events`); at the end each
view must equal a fresh snapshot of its node (``events_diverged`` counts the blocks
where it does not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from kvharness.chaos.cluster import SoakCluster
from kvharness.chaos.config import FAULT_KINDS, SoakConfig
from kvharness.chaos.events import EventWatch
from kvharness.chaos.faults import FaultDriver
from kvharness.chaos.work import Ledger, Outcome, Tally, Tracker, Workload, final_check
from kvstore.cli import DUMMY_AWS_ENV, S3Server

__all__ = ["FAULT_KINDS", "SoakConfig", "SoakReport", "run_soak"]

log = logging.getLogger(__name__)


@dataclass
class SoakReport:
    """What a soak did and found. ``wrong_bytes`` and ``lost_blocks`` must be 0.

    ``wrong_bytes``: bytes of blocks returned as found that differ from what was
    written. ``lost_blocks``: blocks seen in the bucket during the run that no node
    can read at the end. ``s3_deleted``: blocks seen in the bucket that are gone from
    it at the end (nothing in the soak deletes: each one is a block some node removed
    from the shared tier). ``unexpected``: operations that raised something other than
    a :class:`~kvstore.errors.KVStoreError`. ``phases_s``: seconds spent starting the
    cluster, running, settling, checking, stopping. ``driver``: faults skipped (nothing
    to inject them on) and restarts that failed and were retried. ``diagnosis``: blocks
    gone from S3 that were in the hot set at some point (replicas made and dropped)
    or never were, and lost blocks gone from the bucket once the final reads ran (a
    node found the object bad and deleted it: what a truncated upload left there).
    ``events_diverged``: blocks where a node's long-lived event view differs from the
    node's own snapshot after the settle (phantom, missed or at another medium), plus
    nodes that did not answer; ``events``: those figures and the views' counters.
    """

    ops: int
    faults: int
    wrong_bytes: int
    lost_blocks: int
    s3_deleted: int
    unexpected: int
    ops_by_kind: dict[str, int]
    faults_by_kind: dict[str, int]
    misses_by_kind: dict[str, int]
    errors_by_kind: dict[str, int]
    blocks_put: int
    blocks_stored: int
    blocks_reached_s3: int
    proxy: dict[str, int]
    node_counters: dict[str, int]
    driver: dict[str, int]
    diagnosis: dict[str, int]
    run_s: float
    wall_s: float
    seed: int
    events_diverged: int = 0
    events: dict[str, int] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No wrong byte, no block lost or deleted from S3, no unexpected exception."""
        return not (
            self.wrong_bytes
            or self.lost_blocks
            or self.s3_deleted
            or self.unexpected
            or self.events_diverged
        )

    def rows(self) -> list[list[object]]:
        """The figures as table rows, header first (for a benchmark's human output)."""
        rows: list[list[object]] = [["figure", "value"]]
        names = ("ops", "faults", "wrong_bytes", "lost_blocks", "s3_deleted", "unexpected")
        for name in (*names, "events_diverged"):
            rows.append([f"soak_{name}", getattr(self, name)])
        for group in ("ops_by_kind", "faults_by_kind", "misses_by_kind", "errors_by_kind"):
            rows += [[f"{group[:-8]} {k}", v] for k, v in getattr(self, group).items()]
        rows += [[f"blocks {k}", getattr(self, f"blocks_{k}")] for k in ("put", "stored")]
        rows.append(["blocks reached_s3", self.blocks_reached_s3])
        rows += [[f"seconds {k}", v] for k, v in self.phases_s.items()]
        return rows

    def to_json(self) -> dict[str, Any]:
        """The report as one flat-ish JSON object, every field prefixed ``soak_``."""
        return {f"soak_{name}": value for name, value in asdict(self).items()}

    def summary(self) -> str:
        """A few lines for a human (and for assertion messages)."""
        lines = [
            f"ops {self.ops} in {self.run_s:.0f} s ({self.wall_s:.0f} s wall), "
            f"faults {self.faults}, wrong bytes {self.wrong_bytes}, "
            f"lost blocks {self.lost_blocks}, deleted from S3 {self.s3_deleted}, "
            f"events diverged {self.events_diverged}",
            f"ops: {self.ops_by_kind}",
            f"faults: {self.faults_by_kind}",
            f"misses: {self.misses_by_kind}",
            f"errors: {self.errors_by_kind}",
            f"blocks put {self.blocks_put}, stored {self.blocks_stored}, "
            f"reached S3 {self.blocks_reached_s3}; proxy {self.proxy}",
            f"nodes: {self.node_counters}",
            f"driver: {self.driver}; diagnosis: {self.diagnosis}; events: {self.events}",
            f"phases (s): {self.phases_s}",
        ]
        lines += [f"{what}: {rows}" for what, rows in self.samples.items() if rows]
        return "\n".join(lines)


@contextlib.contextmanager
def _dummy_aws_env() -> Iterator[None]:
    """moto's dummy credentials for this process's probe store, for the soak only
    (the node processes get them in their own environment)."""
    env = {**DUMMY_AWS_ENV, "AWS_EC2_METADATA_DISABLED": "true"}
    with mock.patch.dict(os.environ, env):
        yield


def run_soak(
    config: SoakConfig, workdir: str | os.PathLike[str], s3: S3Server | None = None
) -> SoakReport:
    """Run the soak in ``workdir`` (node configs, disks, logs) and report.

    ``s3``: a running S3 endpoint to use (a test fixture); None starts moto in a child
    process for the run. Everything the soak starts is stopped before it returns, also
    when it fails.
    """
    clock = _Phases()
    tally, ledger = Tally(), Ledger(config.seed)
    with _dummy_aws_env(), SoakCluster(config, Path(workdir), s3) as cluster:
        watch = EventWatch(cluster.event_endpoints(), config.seed, 2 * config.fault_interval_s)
        clock.lap("start")
        try:
            _run_phase(cluster, config, ledger, tally, watch.start())
            clock.lap("run")
            cluster.settle(timeout=60.0)
            time.sleep(config.settle_s)  # leases of entries a killed node left run out
            clock.lap("settle")
            outcome = final_check(cluster, ledger, tally)
            events = watch.check(cluster.running())
            clock.lap("check")
        finally:
            watch.close()
        proxy = {
            "requests": cluster.proxy.requests,
            "faults": cluster.proxy.faults,
            "corrupted": cluster.proxy.corrupted,
            "cut_short": cluster.proxy.cut_short,  # uploads a SIGKILL cut: S3 stores none
            **{f"requests_{k.lower()}": n for k, n in sorted(cluster.proxy.by_kind.items())},
        }
    wall_s = round(clock.lap("stop"), 2)
    report = _report(tally, ledger, outcome, proxy, config.seed, (wall_s, clock.laps))
    report.events = events
    diverged = ("phantom", "missed", "wrong_medium", "unanswered")
    report.events_diverged = sum(events.get(k, 0) for k in diverged)
    return report


def _report(
    tally: Tally,
    ledger: Ledger,
    outcome: Outcome,
    proxy: dict[str, int],
    seed: int,
    times: tuple[float, dict[str, float]],
) -> SoakReport:
    """The report from what was counted; ``times``: the wall seconds and the phases."""
    return SoakReport(
        ops=tally.total("ops"),
        faults=tally.total("faults"),
        wrong_bytes=tally.total("wrong_bytes"),
        lost_blocks=outcome.lost,
        s3_deleted=outcome.deleted,
        unexpected=tally.total("unexpected"),
        ops_by_kind=tally.group("ops"),
        faults_by_kind=tally.group("faults"),
        misses_by_kind=tally.group("misses"),
        errors_by_kind=tally.group("errors"),
        blocks_put=ledger.attempted_count(),
        blocks_stored=ledger.stored_count(),
        blocks_reached_s3=outcome.reached,
        proxy=proxy,
        node_counters=tally.group("node"),
        driver={
            **{f"skipped_{k}": n for k, n in tally.group("skipped_faults").items()},
            **{f"heal_failed_{k}": n for k, n in tally.group("heal_failures").items()},
        },
        diagnosis=tally.group("diagnosis"),
        run_s=times[1]["run"],
        wall_s=times[0],
        phases_s=times[1],
        seed=seed,
        samples=tally.samples(),
    )


class _Phases:
    """Seconds per phase of a soak, logged as each one ends."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> float:
        """Close phase ``name``; the seconds since the soak began."""
        now = time.monotonic()
        self.laps[name] = round(now - self.last, 2)
        self.last = now
        log.info("chaos soak: %s took %.1f s", name, self.laps[name])
        return now - self.start


def _run_phase(
    cluster: SoakCluster, config: SoakConfig, ledger: Ledger, tally: Tally, watch: EventWatch
) -> None:
    """The workload, the fault driver, the S3 tracker and the event views' restarts, for
    ``config.seconds``; then every fault healed."""
    stop = threading.Event()
    workload = Workload(cluster, config, ledger, tally)
    driver = FaultDriver(cluster, config, tally)
    tracker = Tracker(cluster, ledger, tally)
    threads = [
        threading.Thread(target=driver.run, args=(stop,), name="chaos-faults"),
        threading.Thread(target=tracker.run, args=(stop,), name="chaos-tracker"),
        threading.Thread(target=watch.run, args=(stop,), name="chaos-event-views"),
        *workload.threads(stop),
    ]
    for thread in threads:
        thread.start()
    try:
        stop.wait(config.seconds)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        driver.heal()  # also after a failure: no node left down or proxy left faulty
