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
the engines taking turns phase by phase. Per phase: the planned engine's median TTFT over
the better of the other two engines' medians (``planned_vs_best``, the bar 1.10; the
figure is the worst phase), which of loading or recomputing was right (the faster of the
unplanned and the no-cache engine) and after how many requests every plan of the planned
engine made that choice (``follow_requests``, the bar 10).
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
from _restore_runs import WARMUP, Run, RunFailed, collect, launch, rounded

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


def drift_round(bench: Any, configs: dict[str, Any], speeds: list[float]) -> dict[str, Any]:
    """The three engines (``configs``: name -> store config, None: no connector) through
    the phases of ``speeds`` (GB/s of the link); each engine's result."""
    args, work, proxy = bench.args, bench.work, bench.proxy
    per_phase = args.drift_requests
    engines, began = [], time.perf_counter()
    try:
        for name in DRIFT_ENGINES:
            run = Run(name, drift_requests(bench, name, len(speeds), per_phase), configs[name])
            directory = work / f"lockstep-{name}"
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
        for p, gbps in enumerate(speeds):
            proxy.set(gbps=gbps, latency_ms=args.slow_latency_ms)
            log(f"bench_restore: drift phase {p + 1} of {len(speeds)}: {gbps * 1e3:g} MB/s")
            for engine in engines[p % 3 :] + engines[: p % 3]:  # who goes first rotates
                engine.take(per_phase, args.timeout)
                time.sleep(SPIN_S)
        out = {e.run.name: collect(e.run, e.proc, work, 120) for e in engines}
        for result in out.values():
            result["process_s"] = round(time.perf_counter() - began, 1)  # the round's
        return out
    finally:
        for e in engines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.proc.pid, signal.SIGKILL)


def drift_figures(results: dict[str, Any], speeds: list[float], per_phase: int) -> dict[str, Any]:
    """Per phase: the engines' median TTFTs, the planned engine's over the better other,
    the right choice and after how many requests the planned engine kept to it; the
    worst phase's ratio and the slowest follow after a change."""
    phases = []
    for p, gbps in enumerate(speeds):
        lo = WARMUP + p * per_phase
        ttft = {
            name: [r["ttft_s"] for r in results[name]["repetitions"][0][lo : lo + per_phase]]
            for name in DRIFT_ENGINES
        }
        med = {name: median(values) for name, values in ttft.items()}
        load_pays = med["unplanned_drift"] < med["nocache_drift"]
        planned = results["planned_drift"]["repetitions"][0][lo : lo + per_phase]
        right = [(r["num_cached_tokens"] > 0) == load_pays for r in planned]
        follow = next((i for i in range(len(right) + 1) if all(right[i:])), len(right))
        best = min(med["unplanned_drift"], med["nocache_drift"])
        phases.append(
            {
                "gbps": gbps,
                "ttft_ms_median": {name: round(m * 1e3, 1) for name, m in med.items()},
                "planned_vs_best": rounded(med["planned_drift"] / best),
                "load_pays": load_pays,
                "planned_loaded": [r["num_cached_tokens"] for r in planned],
                "follow_requests": follow,
            }
        )
    return {
        "phases": phases,
        "planned_vs_best_worst_phase": max(p["planned_vs_best"] for p in phases),
        "follow_requests_worst": max(p["follow_requests"] for p in phases[1:] or phases),
        "requests_per_phase": per_phase,
    }


def run_drift(bench: Any, table: list[list[float]], restore_section: Any, s3_tier: Any) -> None:
    """The drift round (the module docstring): its figures in ``bench.extra["drift"]``,
    each engine's result in ``bench.results``."""
    args, proxy = bench.args, bench.proxy
    speeds = args.drift_gbps
    declared = (speeds[0], args.slow_latency_ms)
    planned = {**restore_section(table), "warm": False, "speed_stale_s": args.drift_stale_s}
    configs = {
        "nocache_drift": None,
        "unplanned_drift": {"tiers": [s3_tier(proxy.url, declared)], **_off(restore_section)},
        "planned_drift": {"tiers": [s3_tier(proxy.url, declared)], "restore": planned},
    }
    began = time.perf_counter()
    log(f"bench_restore: drift over {[f'{g * 1e3:g} MB/s' for g in speeds]} ...")
    try:
        results = drift_round(bench, configs, speeds)
    except RunFailed as exc:
        log(f"bench_restore: drift FAILED: {exc}")
        bench.errors["drift"] = str(exc)
        return
    bench.results.update(results)
    bench.extra["drift"] = {
        **drift_figures(results, speeds, args.drift_requests),
        "speed_stale_s": args.drift_stale_s,
    }
    log(f"bench_restore: drift done in {time.perf_counter() - began:.0f} s")


def _off(restore_section: Any) -> dict[str, Any]:
    return {"restore": {**restore_section(None), "warm": False}}
