"""bench_restore's rounds under changing conditions: ``contended`` (the paired slow rounds
again with busy processes on the machine for the whole round) and ``drift`` (the slow
tier's link changes speed in the middle of the run).

**Drift.** Three engines alive at once, in lockstep (``_restore_lockstep.Engine``): no
cache, the connector with planning off (every stored chunk loaded), and with planning on;
the connector's only tier is the bucket behind the throttling proxy, declared at the
first phase's speed as an operator would, warming off (so every request finds its
prefix on the bucket again), and a short ``restore.speed_stale_s`` (``--drift-stale-s``):
a tier the plans price out is probed again once its estimate is that old, which is how
the plans find it faster. The run is cut in phases (``--drift-gbps``, default 20 MB/s,
then 200 MB/s, then 20 MB/s, 50 ms a request throughout); in each, every engine asks the
same ``--drift-requests`` prompts (the stored prefixes in turn, each with a new suffix),
the engines taking turns a cycle of prompts at a time (one prompt of each prefix; who
goes first rotates every cycle), so that a spell of a slower machine falls on all three.
``--drift-rounds`` rounds (2) of new engines: a vLLM process runs 10-30% faster or slower
than the next one, and two identical no-cache engines in the planned engine's place
differed by 0.75x-0.89x in a phase (2026-12-08). Per phase: the engine that was right
(the unplanned or the no-cache one, whichever has the lower median TTFT over the rounds)
and the planned engine's TTFT over that engine's at the same place (round and request),
the median over those pairs (``planned_vs_best``, the bar 1.10; the figure is the worst
phase; ``planned_vs_best_of_medians``, the ratio of the two medians, is kept beside it),
and after how many requests every plan of the planned engine made the right choice
(``follow_requests``, the most over the rounds; the bar 10).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from _common import log, median
from _restore_lockstep import SPIN_S, Engine
from _restore_runs import WARMUP, Run, RunFailed, collect, launch, merged, rounded

#: Engines of the drift round: no cache, planning off, planning on.
DRIFT_ENGINES = ("nocache_drift", "unplanned_drift", "planned_drift")


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[int]]:
    """``n`` processes spinning on the CPUs (not pinned: the OS spreads them as it would
    other work on the host) while the block runs; their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def drift_requests(bench: Any, name: str, phases: int, per_phase: int) -> list[list[int]]:
    """An engine's requests: its warm-up prompt twice, then per phase ``per_phase``
    prompts: the stored prefixes in turn, each with a suffix of its own (the same for
    every engine)."""
    args, workload = bench.args, bench.workload
    warm = workload.warmup(name, args.warmup_tokens)
    requests = [warm, warm]
    for p in range(phases):
        rng = random.Random(f"{args.seed}-drift-{p}")
        for i in range(per_phase):
            prefix = workload.prefixes[i % len(workload.prefixes)]
            suffix = [rng.randrange(3, workload.vocab) for _ in range(args.suffix_tokens)]
            requests.append(prefix + suffix)
    return requests


def drift_round(bench: Any, configs: dict[str, Any], speeds: list[float], r: int) -> dict[str, Any]:
    """Round ``r``: the three engines (``configs``: name -> store config, None: no
    connector) through the phases of ``speeds`` (GB/s of the link); each engine's
    result."""
    args, work, proxy = bench.args, bench.work, bench.proxy
    per_phase = args.drift_requests
    cycle = max(1, min(len(bench.workload.prefixes), per_phase))
    engines, began = [], time.perf_counter()
    try:
        for name in DRIFT_ENGINES:
            # The round's own warm-up prompt: a miss everywhere, so it teaches no S3 speed.
            requests = drift_requests(bench, f"{name}.{r}", len(speeds), per_phase)
            run = Run(f"{name}.{r}", requests, configs[name])
            directory = work / f"lockstep-{run.name}"
            engines.append(Engine(run, launch(run, work, args, directory), directory))
        deadline = time.monotonic() + 2 * args.timeout  # three engines start at once
        while not all(e.ready() for e in engines):
            if time.monotonic() > deadline:
                raise RunFailed("drift: the engines were not ready in time")
            time.sleep(0.2)
        proxy.set(gbps=speeds[0], latency_ms=args.slow_latency_ms)
        for engine in engines:
            engine.take(WARMUP, args.timeout)
            time.sleep(SPIN_S)
        turn = r
        for p, gbps in enumerate(speeds):
            proxy.set(gbps=gbps, latency_ms=args.slow_latency_ms)
            log(f"bench_restore: drift round {r + 1}, phase {p + 1}: {gbps * 1e3:g} MB/s")
            for first in range(0, per_phase, cycle):
                for engine in engines[turn % 3 :] + engines[: turn % 3]:  # who goes first
                    engine.take(min(cycle, per_phase - first), args.timeout)
                    time.sleep(SPIN_S)
                turn += 1
        out = {e.run.name.split(".")[0]: collect(e.run, e.proc, work, 120) for e in engines}
        for result in out.values():
            result["process_s"] = round(time.perf_counter() - began, 1)  # the round's
        return out
    finally:
        for e in engines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.proc.pid, signal.SIGKILL)


def drift_figures(
    rounds: list[dict[str, Any]], speeds: list[float], per_phase: int
) -> dict[str, Any]:
    """Per phase, over the rounds (each a name -> result of :func:`drift_round`): the
    engines' median TTFTs, the engine that was right, the planned engine's TTFT over its
    at the same place (median of the pairs; and the ratio of the medians), after how
    many requests the planned engine kept to the right choice in each round; the worst
    phase's ratio and the slowest follow after a change."""
    phases = [_phase(rounds, p, gbps, per_phase) for p, gbps in enumerate(speeds)]
    return {
        "phases": phases,
        "planned_vs_best_worst_phase": max(p["planned_vs_best"] for p in phases),
        "follow_requests_worst": max(p["follow_requests"] for p in phases[1:] or phases),
        "requests_per_phase": per_phase,
        "rounds": len(rounds),
    }


def _phase(rounds: list[dict[str, Any]], p: int, gbps: float, per_phase: int) -> dict[str, Any]:
    """Phase ``p``'s figures (see :func:`drift_figures`)."""
    lo = WARMUP + p * per_phase

    def requests(result: dict[str, Any]) -> list[dict[str, Any]]:
        return list(result["repetitions"][0][lo : lo + per_phase])

    ttft = {
        name: [[x["ttft_s"] for x in requests(out[name])] for out in rounds]
        for name in DRIFT_ENGINES
    }
    med = {name: median([t for rs in runs for t in rs]) for name, runs in ttft.items()}
    load_pays = med["unplanned_drift"] < med["nocache_drift"]
    best = "unplanned_drift" if load_pays else "nocache_drift"
    pairs = [
        a / b
        for planned, other in zip(ttft["planned_drift"], ttft[best], strict=True)
        for a, b in zip(planned, other, strict=True)
        if b > 0
    ]
    loaded = [[x["num_cached_tokens"] for x in requests(out["planned_drift"])] for out in rounds]
    follows = []
    for tokens in loaded:
        right = [(n > 0) == load_pays for n in tokens]
        follows.append(next((i for i in range(len(right) + 1) if all(right[i:])), len(right)))
    return {
        "gbps": gbps,
        "ttft_ms_median": {name: round(m * 1e3, 1) for name, m in med.items()},
        "load_pays": load_pays,
        "planned_vs_best": rounded(median(pairs)),
        "planned_vs_best_of_medians": rounded(med["planned_drift"] / med[best]),
        "planned_vs_best_pairs": [rounded(x) for x in pairs],
        "planned_loaded": loaded,
        "follow_requests": max(follows),
        "follow_requests_per_round": follows,
    }


def run_drift(bench: Any, table: list[list[float]], restore_section: Any, s3_tier: Any) -> None:
    """The drift rounds (the module docstring): their figures in ``bench.extra["drift"]``,
    each engine's results, merged over the rounds, in ``bench.results``."""
    args, proxy = bench.args, bench.proxy
    speeds = args.drift_gbps
    declared = (speeds[0], args.slow_latency_ms)
    planned = {**restore_section(table), "warm": False, "speed_stale_s": args.drift_stale_s}
    configs = {
        "nocache_drift": None,
        "unplanned_drift": {"tiers": [s3_tier(proxy.url, declared)], **_off(restore_section)},
        "planned_drift": {"tiers": [s3_tier(proxy.url, declared)], "restore": planned},
    }
    rounds = []
    for r in range(args.drift_rounds):
        began = time.perf_counter()
        log(f"bench_restore: drift round {r + 1} of {args.drift_rounds} over {speeds} GB/s ...")
        try:
            rounds.append(drift_round(bench, configs, speeds, r))
        except RunFailed as exc:
            log(f"bench_restore: drift round {r + 1} FAILED: {exc}")
            bench.errors[f"drift round {r + 1}"] = str(exc)
            continue
        log(f"bench_restore: drift round {r + 1} done in {time.perf_counter() - began:.0f} s")
    if not rounds:
        return
    for name in DRIFT_ENGINES:
        bench.results[name] = merged([out[name] for out in rounds])
    bench.extra["drift"] = {
        **drift_figures(rounds, speeds, args.drift_requests),
        "speed_stale_s": args.drift_stale_s,
    }


def _off(restore_section: Any) -> dict[str, Any]:
    return {"restore": {**restore_section(None), "warm": False}}
