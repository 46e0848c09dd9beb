"""Eviction policies on a replayed serving trace: chunk hit rate per policy and cache size.

The trace (:mod:`kvharness.traces`, deterministic from ``--seed``) is a
multi-turn chat workload -- 32 concurrent sessions with growing histories
behind one shared 8-chunk system prompt -- mixed with bursts of one-off long
documents (64-256 chunks each, never sent again): the scan that pushes
LRU's working set out of the cache. Each request goes through a real
:class:`KVStore` exactly like an engine: ``hash_tokens``, ``lookup``,
``get_prefix`` of the hit, ``put`` of the rest in pieces of 16 chunks.

One host tier holds ``fraction`` x the trace's distinct chunks (store
default watermarks, 0.9 / 0.7). Per policy and size it reports the hit rate
(chunks hit / chunks looked up) overall, of chat requests, of the system
prompt's chunks, and the bound an infinite cache would reach
(``1 - distinct / looked up``: every chunk's first sight is a miss).

The main figures run with hot-block replication off, so the eviction order
is the policy's alone. ``with_replication`` (full runs) repeats them with the
store default (replication on): the manager then evicts blocks whose decayed
access count reaches ``hot_threshold`` last, whatever the policy says. The
replay compresses hours of traffic into seconds of wall clock, so that heat
hardly decays (half-life 300 s) -- read those rows as a caveat, not a figure.

Run: ``python benchmarks/bench_policies.py [--json] [--quick] [--plot PATH]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from _common import base_parser, emit, environment, log

from kvharness import (
    ReplayResult,
    Trace,
    TraceSpec,
    distinct_chunks,
    generate_trace,
    replay,
    trace_layout,
)
from kvstore import KVStore, StoreConfig
from kvstore.layout import KVLayout

POLICIES = ("lru", "s3fifo", "arc")
FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.4)
QUICK_FRACTIONS = (0.05, 0.2)
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLOT = ROOT / "docs" / "benchmarks" / "policies.png"


def make_store(layout: KVLayout, policy: str, blocks: int, replication: bool) -> KVStore:
    """One host tier of ``blocks`` blocks under ``policy`` (environment ignored)."""
    config = StoreConfig.from_dict(
        {
            "tiers": [{"kind": "host", "capacity": blocks * layout.block_nbytes, "policy": policy}],
            "replication": {"enabled": replication},
        },
        environ={},
    )
    return KVStore(layout, config)


def run_one(
    trace: Trace, policy: str, fraction: float, distinct: int, replication: bool
) -> dict[str, Any]:
    """Replay ``trace`` into a fresh store; the row of figures."""
    layout = trace_layout(trace.spec)
    blocks = max(1, int(distinct * fraction))
    start = time.perf_counter()
    with make_store(layout, policy, blocks, replication) as store:
        result: ReplayResult = replay(store, trace)
        stats = store.stats()
    elapsed = time.perf_counter() - start
    looked = result.looked_up["chat"] + result.looked_up["doc"]
    return {
        "policy": policy,
        "fraction": fraction,
        "capacity_blocks": blocks,
        "hit_rate": result.hit_rate(),
        "chat_hit_rate": result.hit_rate("chat"),
        "system_hit_rate": result.hit_rate("system"),
        "chunks_looked_up": looked,
        "chunks_hit": result.hit["chat"] + result.hit["doc"],
        "evictions": sum(stats["evictions"]),
        "blocks_not_stored": stats["blocks_not_stored"],
        "replay_s": elapsed,
    }


def sweep(
    trace: Trace, fractions: tuple[float, ...], distinct: int, replication: bool
) -> list[dict[str, Any]]:
    """Every policy at every size."""
    rows = []
    for fraction in fractions:
        for policy in POLICIES:
            row = run_one(trace, policy, fraction, distinct, replication)
            log(
                f"  {policy:7s} {fraction:5.0%} ({row['capacity_blocks']} blocks): "
                f"hit {row['hit_rate']:.3f}  chat {row['chat_hit_rate']:.3f}  "
                f"system {row['system_hit_rate']:.3f}  [{row['replay_s']:.1f} s]"
            )
            rows.append(row)
    return rows


def describe(trace: Trace, distinct: int) -> dict[str, Any]:
    """The trace's shape, for the JSON."""
    spec = trace.spec
    chat = [r for r in trace.requests if r.kind == "chat"]
    looked = trace.chunks()
    return {
        "seed": spec.seed,
        "block_tokens": spec.block_tokens,
        "system_chunks": spec.system_chunks,
        "sessions": spec.sessions,
        "active_sessions": spec.active_sessions,
        "doc_chunks": list(spec.doc_chunks),
        "requests": len(trace.requests),
        "chat_requests": len(chat),
        "doc_requests": len(trace.requests) - len(chat),
        "chunks_looked_up": looked,
        "distinct_chunks": distinct,
        "max_hit_rate": 1 - distinct / looked if looked else 0.0,
    }


def by_policy(rows: list[dict[str, Any]], field: str) -> dict[str, dict[str, float]]:
    """``{policy: {fraction: rows[field]}}`` (fractions as strings, for JSON)."""
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        table.setdefault(row["policy"], {})[str(row["fraction"])] = row[field]
    return table


def plot(rows: list[dict[str, Any]], repl: list[dict[str, Any]], bound: float, path: Path) -> None:
    """Hit rate vs cache size, one line per policy (dashed: with hot-block replication)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    fig = hit_rate_figure(rows, repl, bound, plt)
    fig.suptitle("Eviction policies: multi-turn chat + one-off document scans")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hit_rate_figure(
    rows: list[dict[str, Any]], repl: list[dict[str, Any]], bound: float | None, plt: Any
) -> Any:
    """The figure of :func:`plot` (also drawn by ``run_all.py`` from this script's JSON):
    all chunks and chat requests side by side, a line per policy in ``rows``."""
    panels = (("hit_rate", "all chunks"), ("chat_hit_rate", "chat requests"))
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4.2), sharex=True)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for ax, (field, title) in zip(axes, panels, strict=True):
        for i, policy in enumerate(policies):
            for data, style, suffix in ((rows, "-o", ""), (repl, ":x", " + replication")):
                mine = [r for r in data if r["policy"] == policy]
                if mine:
                    xs = [r["fraction"] * 100 for r in mine]
                    ys = [r[field] for r in mine]
                    ax.plot(xs, ys, style, color=f"C{i}", label=policy + suffix)
        if field == "hit_rate" and isinstance(bound, float):
            ax.axhline(bound, color="grey", lw=0.8, ls="--", label="infinite cache")
        ax.set_xscale("log")
        sizes = sorted({r["fraction"] * 100 for r in rows})
        ax.set_xticks(sizes, [f"{x:g}%" for x in sizes])
        ax.minorticks_off()
        ax.set_xlabel("cache size, % of the trace's distinct chunks")
        ax.set_ylabel("chunk hit rate")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return fig


def table_rows(rows: list[dict[str, Any]], repl: list[dict[str, Any]]) -> list[list[object]]:
    """The human table: header, then one row per policy, size and replication setting."""
    table: list[list[object]] = [
        ["policy", "size", "blocks", "hit", "chat hit", "system hit", "replication"]
    ]
    for data, flag in ((rows, "off"), (repl, "on")):
        for r in data:
            size, rates = f"{r['fraction']:.0%}", [r["hit_rate"], r["chat_hit_rate"]]
            table.append(
                [r["policy"], size, r["capacity_blocks"], *rates, r["system_hit_rate"], flag]
            )
    return table


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument(
        "--plot", type=Path, default=None, help=f"write the plot here (full runs: {DEFAULT_PLOT})"
    )
    parser.add_argument(
        "--no-replication-rows", action="store_true", help="skip the store-default rows"
    )
    args = parser.parse_args(argv)
    spec = TraceSpec(seed=args.seed)
    spec = spec.quick() if args.quick else spec
    fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    trace = generate_trace(spec)
    with make_store(trace_layout(spec), "lru", 1, False) as store:
        distinct = distinct_chunks(trace, store)
    shape = describe(trace, distinct)
    log(
        f"trace: {shape['requests']} requests ({shape['doc_requests']} documents), "
        f"{shape['chunks_looked_up']} chunks looked up, {distinct} distinct"
    )
    log("policy alone (hot-block replication off):")
    rows = sweep(trace, fractions, distinct, replication=False)
    repl: list[dict[str, Any]] = []
    if not (args.quick or args.no_replication_rows):
        log("store default (hot-block replication on):")
        repl = sweep(trace, fractions, distinct, replication=True)
    plot_path = args.plot or (None if args.quick else DEFAULT_PLOT)
    if plot_path is not None:
        plot(rows, repl, shape["max_hit_rate"], plot_path)
        log(f"plot: {plot_path}")
    result = {
        "benchmark": "policies",
        "policies": list(POLICIES),
        "fractions": list(fractions),
        "trace": shape,
        "hit_rate": by_policy(rows, "hit_rate"),
        "chat_hit_rate": by_policy(rows, "chat_hit_rate"),
        "system_hit_rate": by_policy(rows, "system_hit_rate"),
        "results": rows,
        "with_replication": repl,
        "plot": str(plot_path) if plot_path is not None else None,
        "environment": environment(),
    }
    emit(result, args.json, table_rows(rows, repl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
