"""A trace-driven model of a kvstore cluster at 10, 100 and 1000 nodes: hit rate and sizing.

No servers, no network: a seeded trace (:mod:`_sim_trace`: Zipf-popular system prompts
and documents, multi-turn sessions) is replayed through a model of the cluster
(:mod:`_sim_replay`: per-node LRU memory and disk tiers, write-through to S3, the shared
index every node holds in memory, fed by a Redis stream at each heartbeat, peer fetch and
hot-block replicas, and a cache-aware router -- or random routing, for comparison). What
the replay counts is turned into what a cluster of N nodes asks of Redis (commands/s,
memory, bytes/s, and so the Redis Cluster shards it needs), of S3 (requests and egress per
hit) and of the network between nodes (peer bytes/s).

**Sampling.** A 1000-node cluster cannot be replayed request by request in a minute of
Python, so each node count replays one **cell** of ``--cell-nodes`` nodes (all of them
when N is smaller) carrying that cell's share of the traffic, with real per-node
capacities, for long enough to fill the disks (the first ``warmup`` half is not counted).
The other N - cell nodes appear through S3: each shared system prompt and document is in
S3 from the time some node outside the cell first used it (drawn from its popularity and
their request rate). Rates are then scaled by N / cell. Not modelled: a block held only by
a node outside the cell counts as an S3 read, not a peer read (so for N > cell, S3 GETs
are an upper bound and peer traffic and the local hit rate lower bounds), and the router
only chooses within the cell.

Each per-operation cost is read from this machine's measured benchmarks
(``docs/benchmarks/results.json``, ``--results``) where one exists, else an assumed
constant; the output says which (``calibration``). ``docs/scale.md`` describes the model.

Run: ``python benchmarks/sim_cluster.py [--nodes 10,100,1000] [--requests N] [--seed S]
[--quick] [--json]``. The default run takes about 30 s on a 2-core VM, ``--quick`` (a
smoke run: caches do not fill) a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from _common import emit, log
from _sim_replay import ClusterModel, Tally, replay
from _sim_trace import CellSpec, TraceConfig, generate

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "results.json"
GIB = 1 << 30


@dataclass(frozen=True)
class Cal:
    """One per-operation cost: its value, and whether it was measured here or assumed."""

    value: float
    unit: str
    source: str
    measured: bool


#: name -> (path in results.json under ``benchmarks``, scale, fallback, unit, what it is)
MEASURABLE: dict[str, tuple[tuple[str | int, ...], float, float, str, str]] = {
    "redis_bytes_per_block": (
        ("cluster", "result", "redis_bytes_per_block"),
        1,
        80.0,
        "B",
        "Redis used_memory per 16-byte key in a node's index set, 1M keys",
    ),
    "redis_fields_per_s": (
        ("cluster", "result", "index_scaling", -1, "add_keys_per_s"),
        1,
        500e3,
        "1/s",
        "keys one redis-server adds per second (pipelined, 1M keys)",
    ),
    "redis_shard_bytes_per_s": (
        ("server", "result", "gbps", "large", "redis", "tcp", "get", "c1"),
        1e9,
        0.5e9,
        "B/s",
        "bytes/s one redis-server returns (GET of 32 MiB values, 1 client)",
    ),
    "roundtrip_locate_ms": (
        ("cluster", "result", "index_locate_ms_p50"),
        1,
        1.0,
        "ms",
        "today's index lookup over Redis: 512 keys, 3 live nodes (p50)",
    ),
    "roundtrip_rank_ms": (
        ("cluster", "result", "index_lookup_ms_p50"),
        1,
        1.1,
        "ms",
        "today's Router.rank: that locate plus 2 round trips (p50)",
    ),
    "hash_ms_per_128k": (
        ("hash", "result", "ms_per_128k"),
        1,
        0.06,
        "ms",
        "chained hashing of a 128K-token prompt",
    ),
    "memory_lookup_ms_512": (
        ("hash", "result", "prefix_lookup_scaling", -1, "lookup_only_ms"),
        1,
        0.15,
        "ms",
        "in-memory lookup of 512 keys among 1M (stands in for the index copy)",
    ),
    "index_copy_bytes_per_block": (
        ("index", "result", "index_bytes_per_block"),
        1,
        256.0,
        "B",
        "process memory per indexed block (stands in for the index copy)",
    ),
    "host_gbps": (("host_tier", "result", "get_gbps"), 1, 10.0, "GB/s", "host tier get"),
    "disk_gbps": (
        ("disk_tier", "result", "tier_read_cold_gbps"),
        1,
        1.5,
        "GB/s",
        "disk tier get, cold",
    ),
    "peer_gbps": (("cluster", "result", "peer_fetch_gbps"), 1, 1.2, "GB/s", "peer fetch over TCP"),
    "s3_get_gbps": (
        ("remote_tiers", "result", "s3_get_mbps"),
        1e-3,
        0.1,
        "GB/s",
        "S3 tier get, concurrency 8 (a moto server on loopback: real S3 differs)",
    ),
    "s3_put_gbps": (
        ("remote_tiers", "result", "s3_put_mbps"),
        1e-3,
        0.1,
        "GB/s",
        "S3 tier put, concurrency 8 (moto on loopback)",
    ),
}

#: name -> (value, unit, why): costs no benchmark here measures
ASSUMED: dict[str, tuple[float, str, str]] = {
    "shard_ops_per_s": (100e3, "1/s", "commands/s one Redis shard sustains (typical)"),
    "shard_memory_bytes": (25e9, "B", "usable memory per Redis shard"),
    "hash_value_bytes": (8.0, "B", "the medium value of a hash entry, over a set member"),
    "stream_entry_overhead_bytes": (64.0, "B", "stream entry ID and listpack framing"),
    "stream_retain_s": (60.0, "s", "stream window kept (MAXLEN); a reader further behind reloads"),
    "node_key_bytes": (512.0, "B", "per node: node hash, live-set member, held-hash header"),
    "heat_entry_bytes": (128.0, "B", "per block in the heat sorted set"),
    "command_bytes": (48.0, "B", "RESP framing and key name per command"),
    "s3_puts_per_prefix_s": (3500.0, "1/s", "S3 PUT rate per key prefix (AWS's documented)"),
    "s3_gets_per_prefix_s": (5500.0, "1/s", "S3 GET rate per key prefix (AWS's documented)"),
}


def lookup(tree: Any, path: tuple[str | int, ...]) -> float | None:
    """The number at ``path`` in ``tree``, or None."""
    for step in path:
        try:
            tree = tree[step]
        except (KeyError, IndexError, TypeError):
            return None
    ok = isinstance(tree, (int, float)) and not isinstance(tree, bool) and math.isfinite(tree)
    return float(tree) if ok else None


def calibrate(results: Path) -> dict[str, Cal]:
    """Every cost the model uses, measured from ``results`` where it holds one."""
    try:
        benches = json.loads(results.read_text()).get("benchmarks", {})
    except (OSError, ValueError):
        benches = {}
    cal: dict[str, Cal] = {}
    for name, (path, scale, fallback, unit, what) in MEASURABLE.items():
        found = lookup(benches, path)
        where = "benchmarks." + ".".join(str(p) for p in path)
        if found is None:
            cal[name] = Cal(fallback, unit, f"assumed ({what}; not in results.json)", False)
        else:
            cal[name] = Cal(found * scale, unit, f"measured: {what} [{where}]", True)
    for name, (value, unit, why) in ASSUMED.items():
        cal[name] = Cal(value, unit, f"assumed: {why}", False)
    return cal


@dataclass(frozen=True)
class Setup:
    """Everything one run fixes: workload, cluster model, geometry, costs, sampling."""

    trace: TraceConfig
    model: ClusterModel
    block_bytes: int
    cal: dict[str, Cal]
    requests: int
    cell_nodes: int
    routers: int
    seed: int


def trace_config(args: argparse.Namespace) -> TraceConfig:
    """The workload: the named flags, then any ``--trace FIELD=VALUE``."""
    values: dict[str, Any] = {
        "block_tokens": args.block_tokens,
        "rate_per_node": args.rate,
        "system_zipf": args.system_zipf,
        "doc_zipf": args.doc_zipf,
        "docs": args.docs,
    }
    kinds = {f.name: type(getattr(TraceConfig(), f.name)) for f in fields(TraceConfig)}
    for item in args.trace:
        name, _, value = item.partition("=")
        if name not in kinds or not value:
            raise SystemExit(f"--trace {item!r}: expected FIELD=VALUE, FIELD one of {list(kinds)}")
        values[name] = kinds[name](value)
    return TraceConfig(**values)


def make_setup(args: argparse.Namespace) -> Setup:
    """The run's settings from the command line (``--quick``: a short smoke run)."""
    block_bytes = args.layers * 2 * args.kv_heads * args.head_dim * args.dtype_bytes
    block_bytes *= args.block_tokens
    cal = calibrate(Path(args.results))
    ms = tuple(block_bytes / (cal[k].value * 1e9) * 1e3 for k in ("host_gbps", "disk_gbps"))
    ms += tuple(block_bytes / (cal[k].value * 1e9) * 1e3 for k in ("peer_gbps", "s3_get_gbps"))
    model = ClusterModel(
        host_blocks=int(args.host_gib * GIB // block_bytes),
        disk_blocks=int(args.disk_gib * GIB // block_bytes),
        heartbeat_s=args.heartbeat_s,
        ms_per_block=(ms[0], ms[1], ms[2], ms[3]),
    )
    trace = trace_config(args)
    requests = args.requests or (6_000 if args.quick else 48_000)
    cell = args.cell_nodes or (8 if args.quick else 16)
    return Setup(trace, model, block_bytes, cal, requests, cell, args.routers, args.seed)


def rates(tally: Tally) -> dict[str, float]:
    """Shares of prompt blocks by where they came from."""
    b = max(tally.blocks, 1)
    return {
        "host": tally.host / b,
        "disk": tally.disk / b,
        "peer": tally.peer / b,
        "s3": tally.s3 / b,
        "computed": tally.miss / b,
    }


def redis_commands(n: int, setup: Setup, t: Tally, shards: int) -> dict[str, float]:
    """Commands/s the whole cluster sends Redis (the cell's rates times n / cell)."""
    scale, hb = n / t.nodes / t.measured_s, setup.model.heartbeat_s
    return {
        "heartbeat": t.heartbeat_commands * scale,
        # every node and router reads the stream once a heartbeat, once per partition
        "xread": (n + setup.routers) * shards / hb,
        "zincrby": t.zincrby * scale,
        "replica_claims": 2 * t.claims * scale,  # claim, later release
        "heat_decay": 1 / setup.model.heat_half_life_s,
    }


def redis_bytes(n: int, setup: Setup, t: Tally, commands: float) -> dict[str, float]:
    """Bytes/s written to Redis and read back from its stream by every reader."""
    cal, scale = setup.cal, n / t.nodes / t.measured_s
    fields = (t.gained + t.changed + t.lost) * scale  # 16-byte key + 1-byte medium each
    entries = t.heartbeats * scale
    stream = fields * 17 + entries * cal["stream_entry_overhead_bytes"].value
    write = stream + fields * 17 + commands * cal["command_bytes"].value + t.zincrby * scale * 16
    return {
        "fields": fields,
        "entries": entries,
        "stream": stream,
        "write": write,
        "fanout": stream * (n + setup.routers),
    }


def redis_memory(n: int, setup: Setup, t: Tally, stream: dict[str, float]) -> dict[str, float]:
    """Redis memory: the index (tiers full, and as simulated), stream window, heat, nodes."""
    cal = setup.cal
    held = statistics.fmean(t.held_blocks)
    per_entry = cal["redis_bytes_per_block"].value + cal["hash_value_bytes"].value
    entries_full = n * max(held, setup.model.disk_blocks)
    heat_window = min(1.0, 5 * setup.model.heat_half_life_s / t.measured_s)
    heat = sum(t.peer_segments.values()) * n / t.nodes * heat_window
    mean_entry = stream["stream"] / max(stream["entries"], 1e-9)
    other = (
        stream["entries"] * cal["stream_retain_s"].value * mean_entry
        + heat * cal["heat_entry_bytes"].value
        + n * cal["node_key_bytes"].value
    )
    return {
        "entries": entries_full,
        "index": entries_full * per_entry,
        "stream_window": stream["entries"] * cal["stream_retain_s"].value * mean_entry,
        "heat": heat * cal["heat_entry_bytes"].value,
        "total": entries_full * per_entry + other,
        "total_sim": n * held * per_entry + other,
    }


def shards_needed(need: dict[str, float], setup: Setup) -> dict[str, int]:
    """Shards each budget asks for (ops, field writes, memory, bytes/s), at least 1."""
    cal = setup.cal
    return {
        "ops": math.ceil(need["ops"] / cal["shard_ops_per_s"].value),
        "fields": math.ceil(need["fields"] / cal["redis_fields_per_s"].value),
        "memory": math.ceil(need["memory"] / cal["shard_memory_bytes"].value),
        "bandwidth": math.ceil(need["bytes"] / cal["redis_shard_bytes_per_s"].value),
    }


def redis_sizing(n: int, setup: Setup, t: Tally) -> dict[str, Any]:
    """What ``n`` nodes ask of Redis, and the shards that hold it."""
    shards = 1
    for _ in range(8):  # XREADs grow with the partitions: settle the fixed point
        commands = redis_commands(n, setup, t, shards)
        ops = sum(commands.values())
        traffic = redis_bytes(n, setup, t, ops)
        memory = redis_memory(n, setup, t, traffic)
        by = shards_needed(
            {
                "ops": ops,
                "fields": traffic["fields"] + commands["zincrby"],
                "memory": memory["total"],
                "bytes": traffic["write"] + traffic["fanout"],
            },
            setup,
        )
        if max(1, *by.values()) == shards:
            break
        shards = max(1, *by.values())
    return {
        "redis_ops_per_s": ops,
        "redis_ops": commands,
        "redis_field_writes_per_s": traffic["fields"] + commands["zincrby"],
        "redis_write_bytes_per_s": traffic["write"],
        "index_fanout_bytes_per_s": traffic["fanout"],
        "redis_memory_bytes": memory["total"],
        "redis_memory_bytes_sim": memory["total_sim"],
        "redis_memory": {k: memory[k] for k in ("index", "stream_window", "heat")},
        "redis_index_entries": memory["entries"],
        "redis_shards": shards,
        "redis_shards_by": by,
        "index_copy_bytes_per_node": memory["entries"]
        * setup.cal["index_copy_bytes_per_block"].value,
    }


def traffic(n: int, setup: Setup, t: Tally) -> dict[str, float]:
    """S3 requests and egress, peer bytes: the cell's counts scaled to ``n`` nodes."""
    scale, bb = n / t.nodes / t.measured_s, setup.block_bytes
    hits = max(t.host + t.disk + t.peer + t.s3, 1)
    return {
        "s3_requests_per_hit": (t.s3 + t.miss) / hits,
        "s3_egress_bytes_per_hit": t.s3 * bb / hits,
        "s3_get_per_s": t.s3 * scale,
        "s3_put_per_s": t.miss * scale,
        "s3_egress_bytes_per_s": t.s3 * bb * scale,
        "s3_put_bytes_per_node_s": t.miss * bb / t.nodes / t.measured_s,
        "peer_bytes_per_s": t.peer * bb * scale,
        "s3_prefixes": max(
            math.ceil(t.miss * scale / setup.cal["s3_puts_per_prefix_s"].value),
            math.ceil(t.s3 * scale / setup.cal["s3_gets_per_prefix_s"].value),
            1,
        ),
    }


def lookups(n: int, setup: Setup, t: Tally) -> dict[str, float]:
    """A prompt's index lookup: in memory (the design), and over Redis (today's)."""
    cal = setup.cal
    per_block = cal["hash_ms_per_128k"].value / (131072 / setup.trace.block_tokens)
    per_block += cal["memory_lookup_ms_512"].value / 512
    blocks = statistics.median(t.prompt_blocks) if t.prompt_blocks else 0
    # Today: one round trip carrying one SMISMEMBER per live node. The round trip is what
    # rank adds to locate per extra trip; the rest is assumed linear in keys x nodes.
    locate = cal["roundtrip_locate_ms"].value
    trip = max(0.0, (cal["roundtrip_rank_ms"].value - locate) / 2)
    roundtrip = trip + max(0.0, locate - trip) * blocks / 512 * n / 3
    return {"lookup_ms_p50": blocks * per_block, "roundtrip_lookup_ms_p50": roundtrip}


def simulate(n: int, setup: Setup) -> dict[str, Any]:
    """Replay one cell for an ``n``-node cluster (routed and random) and size it."""
    start = time.perf_counter()
    trace = generate(setup.trace, CellSpec(n, setup.cell_nodes, setup.requests, setup.seed))
    cell = min(n, setup.cell_nodes)
    routed = replay(trace, setup.model, cell, True, setup.seed)
    rand = replay(trace, setup.model, cell, False, setup.seed)
    r, x = rates(routed), rates(rand)
    out: dict[str, Any] = {
        "nodes": n,
        "cell_nodes": cell,
        "requests_measured": routed.requests,
        "measured_s": routed.measured_s,
        # steady state: the disks filled before the end (else the churn is a fill's)
        "disks_full": statistics.fmean(routed.held_blocks) >= 0.95 * setup.model.disk_blocks,
        # As bench_cluster.py means it: blocks the chosen node had in its own tiers.
        "routed_hit_rate": r["host"] + r["disk"],
        "random_hit_rate": x["host"] + x["disk"],
        # Blocks found anywhere (own tiers, a peer, S3): the trace's reuse, the same
        # however requests are routed, since S3 holds every block computed.
        "routed_found_rate": 1 - r["computed"],
        "random_found_rate": 1 - x["computed"],
        "routed_sources": r,
        "random_sources": x,
    }
    out.update(redis_sizing(n, setup, routed))
    out.update(traffic(n, setup, routed))
    out["random_peer_bytes_per_s"] = traffic(n, setup, rand)["peer_bytes_per_s"]
    out["index_changes_per_node_s"] = (
        (routed.gained + routed.changed + routed.lost) / routed.nodes / routed.measured_s
    )
    out["stale_hints_per_s"] = routed.stale_hints * n / cell / routed.measured_s
    out.update(lookups(n, setup, routed))
    out["load_ms_p50"] = statistics.median(routed.load_ms) if routed.load_ms else 0.0
    out["random_load_ms_p50"] = statistics.median(rand.load_ms) if rand.load_ms else 0.0
    out["routed_busiest_node_share"] = max(routed.by_node) / max(routed.requests, 1)
    out["sim_seconds"] = time.perf_counter() - start
    return out


def human(value: float, unit: str) -> str:
    """``value`` with an SI prefix: 1.5e9, "B" -> "1.5 GB"."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def table(result: dict[str, Any]) -> list[list[object]]:
    """The sizing table: one row per node count."""
    rows: list[list[object]] = [
        [
            "nodes", "hit rate (routed/random)", "own node (routed/random)", "Redis shards",
            "Redis memory", "Redis ops/s", "stream fan-out", "S3 req/hit", "S3 egress/hit",
            "S3 GET+PUT/s", "S3 prefixes", "peer traffic",
        ]
    ]  # fmt: skip
    for p in result["results"]:
        rows.append(
            [
                p["nodes"],
                f"{p['routed_found_rate']:.3f} / {p['random_found_rate']:.3f}",
                f"{p['routed_hit_rate']:.3f} / {p['random_hit_rate']:.3f}",
                p["redis_shards"],
                human(p["redis_memory_bytes"], "B"),
                human(p["redis_ops_per_s"], ""),
                human(p["index_fanout_bytes_per_s"], "B/s"),
                f"{p['s3_requests_per_hit']:.3f}",
                human(p["s3_egress_bytes_per_hit"], "B"),
                human(p["s3_get_per_s"] + p["s3_put_per_s"], ""),
                p["s3_prefixes"],
                human(p["peer_bytes_per_s"], "B/s"),
            ]
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (every knob has a documented default)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", default="10,100,1000", help="node counts, comma-separated")
    p.add_argument("--requests", type=int, default=None, help="requests replayed per count")
    p.add_argument("--seed", type=int, default=0, help="trace and routing seed")
    p.add_argument("--quick", action="store_true", help="smoke run (caches do not fill)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--cell-nodes", type=int, default=None, help="nodes replayed (16)")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s per node")
    p.add_argument("--host-gib", type=float, default=64.0, help="host memory tier per node")
    p.add_argument("--disk-gib", type=float, default=256.0, help="disk tier per node")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="cluster heartbeat_s")
    p.add_argument("--routers", type=int, default=2, help="routers reading the index")
    p.add_argument("--system-zipf", type=float, default=1.0, help="system prompt skew")
    p.add_argument("--doc-zipf", type=float, default=0.9, help="document skew")
    p.add_argument("--docs", type=int, default=20_000, help="shared documents")
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other trace knob (docs/scale.md), e.g. doc_share=0.5; repeatable",
    )
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block")
    p.add_argument("--layers", type=int, default=32, help="KV layout: layers")
    p.add_argument("--kv-heads", type=int, default=8, help="KV layout: KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="KV layout: head dim")
    p.add_argument("--dtype-bytes", type=int, default=2, help="KV layout: bytes per value")
    p.add_argument("--results", default=str(RESULTS), help="measured benchmarks (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the simulation; print the sizing table or (``--json``) one JSON object."""
    args = parse_args(argv)
    setup = make_setup(args)
    started = time.perf_counter()
    points = []
    for n in (int(x) for x in args.nodes.split(",") if x.strip()):
        log(f"sim_cluster: {n} nodes (cell of {min(n, setup.cell_nodes)})")
        points.append(simulate(n, setup))
    result: dict[str, Any] = {
        "benchmark": "sim_cluster",
        "quick": bool(args.quick),
        "seed": setup.seed,
        "requests": setup.requests,
        "cell_nodes": setup.cell_nodes,
        "block_bytes": setup.block_bytes,
        "trace": asdict(setup.trace),
        "cluster": {**asdict(setup.model), "routers": setup.routers},
        "calibration": {k: asdict(v) for k, v in setup.cal.items()},
        "results": points,
        "seconds": time.perf_counter() - started,
    }
    emit(result, args.json, table(result))
    if not args.json:
        print()
        for name, c in setup.cal.items():
            print(f"{name:28} {c.value:12.4g} {c.unit:5} {c.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
