"""Speed probes: background reads that measure a tier's read speed for restore planning
(a stale estimate refreshed; a local disk found holding blocks at open, measured before the
first restore after a restart weighs it)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from kvstore.config import RestoreConfig
from kvstore.datapath.books import Books
from kvstore.datapath.mover import Mover
from kvstore.datapath.reader import Reader
from kvstore.datapath.tierio import TierIO
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.speeds import RunShare, runqueue_wait_s

__all__ = [
    "BUSY_HANDOVER_S",
    "PROBE_LAYER_CALLS",
    "SpeedProbes",
    "waits_to_run",
    "declares_speed",
    "process_busy",
]

#: Calls of one layer a probe makes before reading its block whole.
PROBE_LAYER_CALLS = 4


def declares_speed(config: object) -> bool:
    """Whether a tier's config sets ``read_gbps`` or ``read_latency_ms`` to other than its
    kind's default (a value equal to the default counts as the default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    return any(
        name in defaults and getattr(config, name) != defaults[name]
        for name in ("read_gbps", "read_latency_ms")
    )


#: A hand-over of the GIL (``time.sleep(0)``) this slow means other threads of this
#: process keep it busy (a serving engine starting up): a read timed then measures them.
BUSY_HANDOVER_S = 0.001
#: Seconds of work :func:`process_busy` times, and the share of them it may wait to run:
#: a vLLM engine's OpenMP threads hold no GIL, yet on a small machine they keep the CPUs,
#: and a probe's read then waits its turn (a local disk at 0.2-0.6 GB/s against 5-11
#: quiet, with three spinning processes on the reader's CPU). Several scheduler ticks of
#: work: a CPU shared with three spinners gives 5 ms of work its 4 ms tick unbroken one
#: time in three, while 30 ms wait 0.5-0.75 of their time (0 on a free CPU).
STARVED_WORK_S, STARVED_SHARE = 0.03, 0.2
#: Seconds between tries of a probe its process was too busy for, and how many tries.
PROBE_RETRY_S, PROBE_TRIES = 0.5, 40


def process_busy(starved_ok: bool = False, tries: int = 5) -> bool:
    """Whether this process could not read at its medium's speed now: other threads of
    it hold the GIL (the median of ``tries`` hand-overs took longer than
    :data:`BUSY_HANDOVER_S`: some 10 ms with two busy Python threads, tens of
    microseconds with none), or, unless ``starved_ok``, its threads wait to run
    (:func:`waits_to_run`). The
    median, not the fastest: a busy thread the OS has not woken yet lets a hand-over
    come straight back now and then (seen in 2 of 6 runs of
    ``tests/datapath/test_probes.py``, whose probe then kept reads slowed 20-fold)."""
    if statistics.median(_handover() for _ in range(tries)) > BUSY_HANDOVER_S:
        return True
    return not starved_ok and waits_to_run()


def waits_to_run(work_s: float = STARVED_WORK_S) -> bool:
    """Whether ``work_s`` of work on this thread waited more than :data:`STARVED_SHARE` of
    its time to run (other processes, or native threads of this one, keep the CPUs).
    Work, not a sleep: a thread waking from a short sleep is run first whatever the load,
    so only a thread that keeps running shows the queue."""
    waited, start = runqueue_wait_s(), time.perf_counter()
    elapsed = 0.0
    while elapsed < work_s:  # the work: reading the clock until it has run its time
        elapsed = time.perf_counter() - start
    return runqueue_wait_s() - waited > STARVED_SHARE * elapsed


def _handover() -> float:
    """Seconds to give the GIL up and get it back (``time.sleep(0)``), less those this
    thread waited for a CPU meanwhile: waiting for the GIL it sleeps, so the rest is the
    GIL's, whatever other processes do."""
    start, waited = time.perf_counter(), runqueue_wait_s()
    time.sleep(0)
    return time.perf_counter() - start - (runqueue_wait_s() - waited)


class SpeedProbes:
    """Queues probes on the manager's mover; each reads through its reader, timing its
    own calls (less what their threads waited to run), and feeds the tier's speed only
    what it read while the process was quiet (:func:`process_busy`: two busy threads
    made a local disk that reads 1.7 GB/s look like 36 MB/s, and a vLLM engine's OpenMP
    threads starting up one that reads 2-11 GB/s look like 0.1: every restore planned
    after it recomputed)."""

    def __init__(
        self, layout: KVLayout, reader: Reader, mover: Mover, restore: RestoreConfig
    ) -> None:
        self.layout = layout
        self.reader = reader
        self.mover = mover
        self.restore = restore
        self.books: Books = reader.books
        self.io: TierIO = reader.io

    def probe(self, key: BlockKey) -> bool:
        """Read ``key`` into scratch memory in the background, refreshing its tier's read
        speed; False if a probe of it is queued already. It reads as restores do: a few
        calls of one layer, then the whole block, so that the estimate's fit tells the
        tier's latency a call from its bandwidth (a local disk under O_DIRECT: 6-7 ms a
        call of one layer of many blocks, measured on an H200 machine). While other
        threads keep the process busy it waits and tries again (:func:`process_busy`)."""
        return self.mover.submit(lambda: self._try(key, PROBE_TRIES), key=("probe", key))

    def _try(self, key: BlockKey, tries: int) -> None:
        where = self.books.queries.where(key)
        if not where:
            return  # gone meanwhile
        # The last try measures a machine that stays starved of CPU (its calls timed
        # less their threads' waits), rather than leave the tier at its kind's guess.
        starved_ok = tries <= 1
        samples = None if process_busy(starved_ok) else self._timed_reads(key)
        if samples is not None and not process_busy(starved_ok):
            if self.books.queries.where(key)[:1] == where[:1]:  # read from that tier
                for nbytes, seconds in samples:
                    self.io.observe(where[0], nbytes, seconds)
            return
        if tries > 1:
            when = time.monotonic() + PROBE_RETRY_S
            self.mover.submit_later(
                lambda: self._try(key, tries - 1), lambda: when, key=("probe", key, tries)
            )

    def _timed_reads(self, key: BlockKey) -> list[tuple[int, float]] | None:
        """``(bytes, seconds)`` of each read call of a probe of ``key``; None if one
        failed. Into memory touched first: a first touch here costs more than the read."""
        out = torch.zeros(self.layout.block_shape, dtype=self.layout.dtype)
        layers = min(PROBE_LAYER_CALLS, self.layout.num_layers)
        calls: list[tuple[tuple[int, int] | None, torch.Tensor, int]] = [
            ((layer, layer + 1), out[layer : layer + 1], self.layout.layer_nbytes)
            for layer in range(layers if self.layout.num_layers > 1 else 0)
        ]
        calls.append((None, out, self.layout.block_nbytes))
        samples: list[tuple[int, float]] = []
        with self.io.unobserved():
            for span, target, nbytes in calls:
                with RunShare.timed() as took:
                    loaded = self.reader.load([key], [target], span, True).count
                if not loaded:
                    return None
                samples.append((nbytes, took.running_s))
        return samples

    def probe_at_open(self) -> int:
        """Probe (:meth:`probe`) each tier of this machine below memory that holds blocks
        from an earlier run while its read speed is still its kind's default guess, so that
        the first restore after a restart plans with what the tier does; how many probes
        were queued. A speed the config declares for the tier stands until the workload's
        own reads measure it (an operator may declare a disk as slow as it is under load).
        Only where planning is on with a declared prefill speed: a learned one is
        unknown after a restart, so the first restores load every chunk, measuring the
        tier as they do."""
        restore = self.restore
        declared = restore.prefill_table is not None or restore.prefill_tokens_per_s is not None
        if not (restore.planning and declared):
            return 0
        speeds = self.io.speeds_now()
        unmeasured = {
            level
            for level, tier in enumerate(self.io.tiers)
            if tier.device is None
            and tier.local
            and speeds[level].source == "configured"
            and not declares_speed(tier.config)
        }
        queued = 0
        for key in self.books.queries.stored_keys(local=True) if unmeasured else ():
            where = self.books.queries.where(key)
            if where and where[0] in unmeasured:
                unmeasured.discard(where[0])
                queued += self.probe(key)
                if not unmeasured:
                    break
        return queued
