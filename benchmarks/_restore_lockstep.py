"""bench_restore's comparisons measured in paired rounds: two engines alive at once (a
*base* configuration and a *test* one: nocache and slow_planned, or fast_unplanned and
fast_planned), taking turns batch by batch.

Why: on this shared VM the same prefill takes 290-500 ms from one second to the next,
and a whole vLLM process runs 10-30% faster or slower than the next one (two identical
nocache engines in rounds like these: per-round medians 0.90 to 1.24); one slow_planned
process against one nocache process (the benchmark until 2026-12-01) showed 0.95 in one
run and 2.05 in the next with the same code. In a round both engines start together
(``examples/vllm_offline.py --lockstep``: each request waits for its turn), then take
turns: each engine's warm-up prompt twice, then each engine's measured prompts back to
back (so a planned engine's warming meets its own next prefills, as it would in
service), the order of the two engines alternating between rounds. After an engine's
batch the other waits 1.2 s (vLLM's idle worker spins for a second after its last step)
and, after the test engine's first batch, for its background warming to land where it
warms (at most ``--gap-s``): neither engine's background work runs under the other's
prefills. Every round's engines are new (slow_planned's disk tier a new directory, so
each round's planned engine finds the prefixes on the bucket only). Ratios: per (round,
prompt) pair, the test engine's TTFT over the base engine's at the same place in its
process's life (``first``: the first request of each prompt; ``second``: the second,
after the warming); the median over every pair, with a 90% bootstrap interval and each
round's own median. The rounds narrow the noise but do not remove it: report the
interval with the median.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import log, median
from _restore_runs import WARMUP, Run, RunFailed, collect, launch, rounded

#: vLLM 0.32's idle worker spins (sched_yield) for one second after its last step
#: (``SpinCondition.busy_loop_s``): the next engine's turn waits past it.
SPIN_S = 1.2


@dataclass
class Engine:
    """One driver process in lockstep: its run, process, directory and next request."""

    run: Run
    proc: Any
    directory: Path
    n: int = 0

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RunFailed(f"{self.run.name}: exited with {self.proc.returncode} before its turn")
        return (self.directory / "ready").exists()

    def take(self, count: int, timeout: float) -> None:
        """Let ``count`` requests run, one after another; return when the last is done."""
        for _ in range(count):
            (self.directory / f"go-{self.n}").write_text("")
            done, began = self.directory / f"done-{self.n}", time.monotonic()
            while not done.exists():
                if self.proc.poll() is not None or time.monotonic() - began > timeout:
                    raise RunFailed(f"{self.run.name}: request {self.n} never finished")
                time.sleep(0.002)
            self.n += 1


@dataclass(frozen=True)
class Pair:
    """Two configurations measured in rounds: ``base`` and ``test`` (names), each round's
    store config of each (``config(name, r)``; None: no connector), the phase whose
    prompts they ask, and, for ``test``, the disk tier whose warming a round waits for
    (``warmed(r)``; None: no warming to wait for)."""

    base: str
    test: str
    config: Callable[[str, int], dict[str, Any] | None]
    phase: str
    warmed: Callable[[int], Path] | None = None


def paired_rounds(bench: Any, pair: Pair, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of ``pair`` (see the module docstring): each configuration's
    results, round by round, the paired figures, the test engine's idle seconds before
    its second repetition."""
    results: dict[str, list[dict[str, Any]]] = {pair.base: [], pair.test: []}
    idle: list[float] = []
    for r in range(rounds):
        label = f"{pair.test} round {r + 1} of {rounds}"
        log(f"bench_restore: {label} ...")
        began = time.perf_counter()
        try:
            out, idle_s = _round(bench, pair, r)
        except RunFailed as exc:
            log(f"bench_restore: {label} FAILED: {exc}")
            bench.errors[label] = str(exc)
            continue
        idle.append(idle_s)
        for name, result in out.items():
            results[name].append(result)
        log(f"bench_restore: {label} done in {time.perf_counter() - began:.0f} s")
    return {
        "results": results,
        "figures": paired_figures(results[pair.test], results[pair.base]),
        "idle_before_second_s": idle,
    }


def _round(bench: Any, pair: Pair, r: int) -> tuple[dict[str, Any], float]:
    """One round: both engines started, their turns taken, their results collected."""
    args, work = bench.args, bench.work
    runs = []
    for name in (pair.base, pair.test):
        run_name = f"{name}.{r}"
        requests = bench.requests(run_name, pair.phase)
        runs.append(Run(run_name, requests, pair.config(name, r), 2))
    engines = []
    began = time.perf_counter()
    try:
        for run in runs:
            directory = work / f"lockstep-{run.name}"
            engines.append(Engine(run, launch(run, work, args, directory), directory))
        deadline = time.monotonic() + args.timeout
        while not all(e.ready() for e in engines):
            if time.monotonic() > deadline:
                raise RunFailed(f"round {r + 1}: the engines were not ready in time")
            time.sleep(0.2)
        warmed = pair.warmed(r) if pair.warmed is not None else None
        order = engines if r % 2 == 0 else engines[::-1]
        idle = _turns(bench, order, engines[1], warmed)
        out = {e.run.name.split(".")[0]: collect(e.run, e.proc, work, 120) for e in engines}
        for result in out.values():
            result["process_s"] = round(time.perf_counter() - began, 1)  # the round's
        return out, idle
    finally:
        for e in engines:  # a round that failed: no engine of it survives
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.proc.pid, signal.SIGKILL)


def _turns(bench: Any, order: list[Engine], test: Engine, warmed: Path | None) -> float:
    """Both repetitions' turns; the test engine's idle seconds before its second."""
    args, prompts = bench.args, len(bench.workload.prefixes)
    keys = bench.prefix_keys()
    idle_from = idle = 0.0
    for rep in range(2):
        for engine in order:
            engine.take(WARMUP, args.timeout)
            time.sleep(SPIN_S)
        for engine in order:
            if engine is test and rep == 1:
                idle = time.monotonic() - idle_from
            engine.take(prompts, args.timeout)
            time.sleep(SPIN_S)
            if engine is test and rep == 0:
                idle_from = time.monotonic() - SPIN_S
                if warmed is not None:
                    _await_warming(bench, warmed, keys, idle_from + args.gap_s)
    return idle


def _await_warming(bench: Any, disk: Path, keys: list[Any], until: float) -> None:
    """Wait until the planned engine's warming has copied every prefix chunk to its disk
    tier, or until ``until`` (``time.monotonic()``)."""
    while time.monotonic() < until and bench.keys.on_disk(disk, keys) < len(keys):
        time.sleep(0.1)


def paired_figures(test: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """The paired ratios of ``test``'s rounds over ``base``'s (the module docstring), for
    the first repetition, the second, and both."""
    out: dict[str, Any] = {"rounds": min(len(test), len(base))}
    for reps, name in (((0,), "first"), ((1,), "second"), ((0, 1), "all")):
        per_round = [
            [x for rep in reps for x in _ratios(t, b, rep)] for t, b in zip(test, base, strict=True)
        ]
        pairs = [x for rs in per_round for x in rs]
        out[name] = rounded(median(pairs)) if pairs else None
        out[f"{name}_ci90"] = _bootstrap(pairs)
        out[f"{name}_per_round"] = [rounded(median(rs)) for rs in per_round if rs]
        out[f"{name}_pairs"] = [rounded(x) for x in pairs]
    return out


def _ratios(planned: dict[str, Any], nocache: dict[str, Any], rep: int) -> list[float]:
    a = planned["repetitions"][rep][WARMUP:]
    b = nocache["repetitions"][rep][WARMUP:]
    return [x["ttft_s"] / y["ttft_s"] for x, y in zip(a, b, strict=True) if y["ttft_s"] > 0]


def _bootstrap(values: list[float], draws: int = 2000) -> list[float | None] | None:
    """A 90% interval of the median of ``values`` (resampled with a fixed seed)."""
    if len(values) < 4:
        return None
    rng = random.Random(0)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [rounded(medians[int(0.05 * draws)]), rounded(medians[int(0.95 * draws) - 1])]
