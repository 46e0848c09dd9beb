"""Memory soak: does anything grow under sustained mixed load at capacity?

One embedded store (its own process) and one ``kvstore-server`` with ``--clients`` (8)
client threads run puts, gets, prefetches, layer writes (some abandoned), hints, pins
and loans whose leases expire, evictions and demotions through a host tier over a disk
tier (both small: they evict all the time), client processes killed mid-transfer and
store restarts, for ``--minutes``; every ``--interval`` seconds the load pauses, each
store is settled into one known state and RSS, shared memory, pinned bytes, open fds,
threads, index entries and slab slots of both processes are sampled
(:mod:`kvharness.soak.run` says exactly how).

Prints one JSON line: ``minutes``, ``rss_growth``, ``pinned_growth``, ``fds_growth``,
``threads_growth``, ``slots_growth`` (also ``shared_growth``, ``index_growth``): last ÷
first sample after ``--warmup-minutes`` - 1, the larger of the two processes';
``wrong_bytes`` (bytes of blocks read that differ from what was put), ``errors``
(operations that raised), the server's KV events (a view restarted at random moments
against a fresh one once the load stops: ``events_phantom``, ``events_missed``,
``events_wrong_medium``, ``events_unanswered``, ``events_blocks`` and the view's
``events_view_*`` counters), ``ops`` (per-operation counts) and ``samples``. Exit
status 1 when a target fails: growth ≤ ``--max-growth`` (0.02) for RSS and every count,
no error, no wrong byte, no phantom, missed or wrong-medium block (and a fresh view that
answered). Run: ``python benchmarks/bench_soak.py --minutes 60``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

from _common import environment, log

from kvharness import EVENT_FIELDS, GROWTH_FIELDS, SoakConfig, run_soak


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="whole run (default 60)")
    parser.add_argument("--warmup-minutes", type=float, default=5.0, help="not measured (5)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds per sample (60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=8, help="server client threads (8)")
    parser.add_argument("--max-growth", type=float, default=0.02, help="target (0.02)")
    parser.add_argument("--json", action="store_true", help="accepted: the output is JSON")
    args = parser.parse_args(argv)
    if args.minutes <= args.warmup_minutes or args.interval <= 0:
        parser.error("--minutes must exceed --warmup-minutes, and --interval be > 0")
    if (args.minutes - args.warmup_minutes) * 60 < 2 * args.interval:
        parser.error("the measured span must hold two samples: lengthen it or shorten --interval")
    return args


def failures(result: dict[str, Any], max_growth: float) -> list[str]:
    """The targets ``result`` misses, in words."""
    missed = [
        f"{field}_growth {result[f'{field}_growth']:.4f} > {max_growth}"
        for field in GROWTH_FIELDS
        if result[f"{field}_growth"] > max_growth
    ]
    if result["wrong_bytes"]:
        missed.append(f"wrong_bytes {result['wrong_bytes']}")
    if result["errors"]:
        missed.append(f"errors {result['errors']}")
    missed.extend(f"{field} {result[field]}" for field in EVENT_FIELDS if result.get(field))
    return missed


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print its JSON line; 1 when a target fails."""
    args = parse(argv)
    config = SoakConfig(
        minutes=args.minutes,
        warmup_minutes=args.warmup_minutes,
        interval_s=args.interval,
        seed=args.seed,
        clients=args.clients,
    )
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as workdir:
        result = run_soak(config, workdir, log=log)
    missed = failures(result, args.max_growth)
    out = {"benchmark": "soak", **result, "targets_missed": missed, "environment": environment()}
    print(json.dumps(out), flush=True)
    for line in missed:
        log(f"target missed: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
