"""bench_restore's figures from its runs: the estimate checks (the planner's cost model
against TTFTs, the connector's own planned-vs-actual load times), the tier speeds the
planner used, and the headline rows printed on stderr."""

from __future__ import annotations

import json
from typing import Any

from _common import median
from _restore_runs import (
    CHUNK,
    S3_DEFAULT_PRIOR,
    driver_module,
    learned_speed,
    rounded,
    tier_reads,
)


def estimate_errors(
    conf: dict[str, dict[str, Any]],
    prefixes: list[list[int]],
    declared: tuple[float, float],
    lookup_ms: float | None,
) -> dict[str, Any]:
    """Per slow_unplanned prompt: the planner's cost model at the declared S3 speed against
    the load time the slow tier added (its TTFT minus fast_unplanned's, minus the slow
    lookup ``lookup_ms`` measured in this process); see the module docstring."""
    from kvstore.restore import SpeedEstimate

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


def tier_speeds(bench: Any) -> dict[str, Any]:
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


def table_rows(result: dict[str, Any]) -> list[str]:
    """Headline figures, one line each (stderr)."""
    lines = []
    for name in (
        "ttft_nocache_ms",
        "slow_unplanned_vs_nocache",
        "slow_planned_vs_nocache",
        "slow_planned_vs_nocache_ci90",
        "slow_planned_vs_nocache_unpaired",
        "slow_planned_vs_nocache_all_reps",
        "slow_second_request_vs_nocache",
        "slow_planned_undeclared_vs_nocache",
        "fast_planned_vs_unplanned",
        "fast_planned_vs_unplanned_ci90",
        "fast_planned_vs_nocache",
        "contended_planned_vs_nocache",
        "contended_planned_vs_nocache_ci90",
        "drift_planned_vs_best",
        "drift_follow_requests",
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
