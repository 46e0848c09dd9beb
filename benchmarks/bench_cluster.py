"""Three kvstore-server nodes sharing one Redis index: peer fetch, routing, index cost.

Everything runs on 127.0.0.1 and is started (and stopped) by the script: one
``redis-server`` (no persistence) and, per phase, three ``kvstore-server``
processes (:class:`~kvstore.cli.kvserver.KVStoreServerProcess`) whose config
has a ``cluster:`` section naming that Redis, ``node_id`` a / b / c and no
``advertise`` (it defaults to the TCP address, 127.0.0.1:PORT). Each store has
one host tier and nothing else (no S3): a block lives on the nodes that stored it.

1. **Peer fetch** (``peer_fetch_gbps``, ``peer_fetch_ratio_vs_local``): node a
   stores ``--fetch-blocks`` (8) blocks of Llama-3-8B geometry (32 layers x 8 KV
   heads x 128 x 256 tokens, bf16: 32 MiB; 256 MiB per rep -- this 24 GiB VM has
   room, see ``--fetch-tokens``). Subject: a client of node b gets them (b's
   server finds them in the index and fetches them from a through its cluster
   tier); baseline: a client of node a gets the same blocks. Both clients use TCP
   without shared memory (``tcp``, the headline); ``shm`` repeats both with
   ``shared_memory=True`` (a's client then copies out of a's memory, while b's
   blocks come over the socket: b holds them in staging buffers, not in its
   shared slab). The cluster's ``hot_threshold`` is out of reach, so b never
   keeps a copy: every peer rep fetches from a (checked with b's cluster tier
   ``fetched`` counter and the index; ``a_requests_per_peer_get`` counts the
   requests a answers per peer get). Bytes are verified after timing.
2. **Routing** (``routed_hit_rate``, ``random_hit_rate``): the multi-turn chat
   trace of :mod:`kvharness.traces` (sessions behind a shared system
   prompt, each turn extending the last; no document bursts) with tiny blocks.
   ``routed`` sends each request to ``Router.rank(keys)[0]``, ``random`` to a
   random node; each mode has its own namespace (empty stores). A request asks
   its node ``client.lookup(keys)``, gets that prefix (as an engine loads it)
   and puts its new chunks there. A cluster member's lookup also counts chunks
   only its *peers* hold (its cluster tier), so the hit rate counts the chunks
   the node served from its own tiers: looked-up prefix minus the blocks its
   cluster tier fetched (``fetched`` counter); ``*_cluster_hit_rate`` is the
   plain lookup count; ``*_busiest_node_share`` the share of requests the
   busiest node got. Cluster defaults otherwise (replicas 2, hot_threshold 8):
   random routing gets copies of hot blocks. Before a request the script waits
   until the index lists the earlier puts its prompt builds on (turns of a chat
   are seconds apart, more than a heartbeat of 0.1 s).
3. **Index lookup** (``index_lookup_ms_p50`` / ``_p99``): ``Router.rank`` of a
   128K-token prompt (512 keys of 256-token chunks) with the three nodes live
   (a holds 384 leading chunks, b 128, c none), answered from the router's
   in-memory copy of the index (fed by the Redis change stream: no round trip);
   ``index_locate_ms_*`` is ``ClusterIndex.locate``, the same question asked of
   Redis (one ``HMGET`` per node, pipelined: what every lookup cost before the
   copy). Interleaved rounds; percentiles over all reps.
4. **Index scaling** (``index_scaling``, ``redis_bytes_per_block``): no servers.
   ``ClusterIndex.add`` registers N random keys for one node (10K, 100K, 1M);
   Redis memory per block from ``INFO memory`` ``used_memory`` before / after
   (``MEMORY USAGE`` of the set too), and ``locate`` of 512 keys (256 held, 256
   not) over three nodes. The headline is at the largest N.

5. **Ranking scaling** (``rank_scaling``, ``rank_ms_p50_at_100_nodes``): no servers.
   ``Router.rank`` of the same 512-key prompt over N simulated live nodes (10, 100,
   1000: heartbeats and index entries only), each publishing read speeds and a prefill
   rate, so every node is given a ``ready_ms`` (its restore plan's ready time, in closed
   form: ``NodeSpeeds.ready_ms``); three of them hold the prompt as in 3 (384 leading
   chunks in memory, 128 on disk, none). The bars: at most 1 ms at 100 nodes, and no
   worse than linear (the time per node at 1000 at most 1.5x that at 100).

``--quick``: 128 KiB blocks, 1 round, 6 sessions, N up to 10K, 10 and 100 nodes (about
20 s here);
the default run takes about 1.5 minutes on this 2-core VM. Where ``redis-server``
is not installed the script says so and prints a JSON object with ``skipped``.
Run: ``python benchmarks/bench_cluster.py [--json] [--quick]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed

from kvharness import TraceSpec, generate_trace, trace_layout
from kvstore.cli import KVStoreServerProcess, RedisServer
from kvstore.client import Client, ClientOptions
from kvstore.cluster import ClusterIndex, NodeInfo, NodeSpeeds, Router
from kvstore.config import ClusterConfig
from kvstore.datapath.contracts import Medium
from kvstore.keys import BlockKey, Namespace, chain_keys, tokens_to_bytes
from kvstore.layout import KVLayout
from kvstore.testing import make_keys

NODES = ("a", "b", "c")
VARIANTS = ("tcp", "shm")
MODES = ("routed", "random")
NEVER_HOT = 1 << 30  # a hot_threshold no block reaches: peers never keep copies
MODEL = "bench-cluster-model"
GB = 1e9
MiB = 1024**2
#: Bars: ratio and margin at least, latencies at most.
TARGETS: dict[str, float] = {
    "peer_fetch_ratio_vs_local": 0.5,
    "routing_margin": 0.2,
    "index_lookup_ms_p50": 0.1,
    "index_lookup_ms_p99": 1.0,
    "rank_ms_p50_at_100_nodes": 1.0,
    "rank_ms_per_node_growth": 1.5,
}


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them all)."""

    quick: bool
    rounds: int
    fetch_layers: int
    fetch_tokens: int
    fetch_blocks: int
    fetch_reps: int
    trace: TraceSpec
    lookup_reps: int
    scale_sizes: tuple[int, ...]
    scale_reps: int
    rank_nodes: tuple[int, ...]
    seed: int


def make_plan(args: Any) -> Plan:
    """The run's sizes from the command line."""
    quick = bool(args.quick)
    trace = TraceSpec(
        seed=args.seed,
        sessions=args.sessions or (6 if quick else 48),
        active_sessions=3 if quick else 16,
        turns=(2, 4) if quick else (4, 16),
        burst_probability=0.0,  # one-off documents have no prefix to route on
    )
    sizes = args.scale_sizes or ("1000,10000" if quick else "10000,100000,1000000")
    return Plan(
        quick=quick,
        rounds=args.rounds or (1 if quick else 7),
        fetch_layers=args.fetch_layers or (2 if quick else 32),
        fetch_tokens=args.fetch_tokens or (16 if quick else 256),
        fetch_blocks=args.fetch_blocks or (4 if quick else 8),
        fetch_reps=1 if quick else 2,
        trace=trace,
        lookup_reps=10 if quick else 50,
        scale_sizes=tuple(int(n) for n in sizes.split(",")),
        scale_reps=20 if quick else 200,
        rank_nodes=(10, 100) if quick else (10, 100, 1000),
        seed=args.seed,
    )


# -- servers ------------------------------------------------------------------------


def node_config(cluster: ClusterConfig, node: str, capacity: int) -> dict[str, Any]:
    """A node's server config: one host tier of ``capacity`` bytes per store."""
    return {
        "tiers": [{"kind": "host", "capacity": capacity}],
        "cluster": {**cluster.to_dict(), "node_id": node},
        "server": {"max_stores": 16},
    }


class Nodes:
    """Three kvstore-server processes (a, b, c) in one cluster; a context manager."""

    def __init__(self, cluster: ClusterConfig, workdir: Path, capacity: int) -> None:
        self.cluster = cluster
        self.procs = {
            n: KVStoreServerProcess(node_config(cluster, n, capacity), workdir / n) for n in NODES
        }

    def __enter__(self) -> Nodes:
        try:
            with ThreadPoolExecutor(len(self.procs)) as pool:  # imports overlap
                list(pool.map(KVStoreServerProcess.start, self.procs.values()))
            self._wait_live()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_live(self, timeout: float = 90.0) -> None:
        """Wait until every node has joined (a server accepts before it joins)."""
        with contextlib.closing(ClusterIndex(self.cluster)) as index:
            end = time.monotonic() + timeout
            while set(index.live_nodes()) != set(NODES):
                if time.monotonic() > end:
                    raise RuntimeError(f"the nodes did not all join within {timeout:g} s")
                time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM every node (then SIGKILL); idempotent."""
        for proc in self.procs.values():
            try:
                proc.stop()
            finally:
                proc.kill()

    def client(
        self, node: str, layout: KVLayout, namespace: str = "default", shm: bool = False
    ) -> Client:
        """A client of ``node``'s server over TCP."""
        options = ClientOptions(
            self.procs[node].address, namespace=namespace, shared_memory=shm, timeout=300.0
        )
        return Client(layout, options)


def wait_registered(
    index: ClusterIndex, namespace: str, fp: str, node: str, keys: Sequence[BlockKey]
) -> float:
    """Wait until the index lists ``node`` as holding every key; the seconds waited."""
    start = time.perf_counter()
    while not all(index.locate(namespace, fp, keys, [node])[node]):
        if time.perf_counter() - start > 30.0:
            raise RuntimeError(f"node {node} did not register its blocks within 30 s")
        time.sleep(0.005)
    return time.perf_counter() - start


def cluster_counter(client: Client, namespace: str, name: str) -> int:
    """Counter ``name`` of the cluster tier of the client's store on its server."""
    describe = client.layout.describe()
    for store in client.server_stats()["stores"]:
        if store["namespace"] == namespace and store["layout"] == describe:
            tier = next(t for t in store["tiers"] if t["kind"] == "cluster")
            return int(tier[name])
    raise RuntimeError(f"the server has no store for {namespace} / {describe}")


def server_requests(client: Client, op: str) -> int:
    """How many ``op`` requests the client's server has answered."""
    return int(client.server_stats()["server"]["requests"].get(op, 0))


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``seconds``, in milliseconds."""
    return float(np.percentile(np.asarray(seconds), q)) * 1000.0


# -- 1. peer fetch --------------------------------------------------------------------


def fetch_layout(layers: int, tokens: int) -> KVLayout:
    """Llama-3-8B geometry (8 KV heads, head_dim 128, bf16) with ``layers`` x ``tokens``."""
    return KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_tokens=tokens)


class FetchBench:
    """Blocks only node a holds, read through a (local) and through b (peer fetch)."""

    def __init__(self, nodes: Nodes, index: ClusterIndex, plan: Plan) -> None:
        layout = self.layout = fetch_layout(plan.fetch_layers, plan.fetch_tokens)
        gen = torch.Generator().manual_seed(plan.seed)
        n = plan.fetch_blocks
        self.keys = make_keys(n, salt=plan.seed + 1)
        self.blocks = [
            torch.randn(layout.block_shape, generator=gen).to(layout.dtype) for _ in range(n)
        ]
        self.outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in range(n)]
        self.nbytes = n * layout.block_nbytes
        self.clients = {
            f"{side}_{v}": nodes.client(node, layout, shm=v == "shm")
            for side, node in (("local", "a"), ("peer", "b"))
            for v in VARIANTS
        }
        self.gets: Counter[str] = Counter()
        if not all(self.clients["local_tcp"].put(self.keys, self.blocks)):
            raise RuntimeError("node a did not store the blocks")
        wait_registered(index, "default", layout.fingerprint_hex, "a", self.keys)

    def rep(self, name: str) -> Rep:
        """One timed get of every block through subject ``name``."""
        client = self.clients[name]

        def get() -> None:
            self.gets[name] += 1
            if not all(client.get(self.keys, self.outs)):
                raise RuntimeError(f"{name}: a block was missing")

        return timed(get)

    def verify(self) -> bool:
        """Every subject returns the exact bytes stored."""
        ok = True
        for name in self.clients:
            for out in self.outs:
                out.zero_()
            self.rep(name)()
            ok &= all(torch.equal(o, b) for o, b in zip(self.outs, self.blocks, strict=True))
        return ok

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def peer_requests_per_get(bench: FetchBench) -> dict[str, float]:
    """Requests node a answers for one peer get of the batch through b (diagnostic)."""
    a = bench.clients["local_tcp"]
    before = {op: server_requests(a, op) for op in ("get", "release")}
    bench.rep("peer_tcp")()
    after = {op: server_requests(a, op) for op in ("get", "release")}
    return {op: float(after[op] - before[op]) for op in before}


def bench_peer_fetch(redis_url: str, plan: Plan, workdir: Path) -> dict[str, Any]:
    """Peer get through b vs local get from a, interleaved, per variant."""
    cluster = ClusterConfig(
        redis_url=redis_url,
        name=f"bench-fetch-{os.getpid()}",
        heartbeat_s=0.2,
        lease_heartbeats=25,
        hot_threshold=NEVER_HOT,
        peer_timeout_s=300.0,
    )
    layout = fetch_layout(plan.fetch_layers, plan.fetch_tokens)
    capacity = 2 * plan.fetch_blocks * layout.block_nbytes
    with (
        Nodes(cluster, workdir / "fetch", capacity) as nodes,
        contextlib.closing(ClusterIndex(cluster)) as index,
    ):
        bench = FetchBench(nodes, index, plan)
        try:
            fetched0 = cluster_counter(bench.clients["peer_tcp"], "default", "fetched")
            subjects = {name: (bench.rep(name), plan.fetch_reps) for name in bench.clients}
            times = run_rounds(subjects, plan.rounds)
            verified = bench.verify()
            per_get = peer_requests_per_get(bench)
            fetched = cluster_counter(bench.clients["peer_tcp"], "default", "fetched") - fetched0
            held = index.locate("default", layout.fingerprint_hex, bench.keys, ["b", "c"])
            shm = {v: bench.clients[f"local_{v}"].shared_memory for v in VARIANTS}
        finally:
            bench.close()
    peer_gets = bench.gets["peer_tcp"] + bench.gets["peer_shm"]
    return {
        "block_mib": layout.block_nbytes / MiB,
        "blocks_per_rep": plan.fetch_blocks,
        "gbps": {name: bench.nbytes / median(t) / GB for name, t in times.items()},
        "fetched_blocks": fetched,
        "fetched_expected": peer_gets * plan.fetch_blocks,
        "copies_on_b_or_c": sum(sum(flags) for flags in held.values()),
        "verified": verified,
        "client_shared_memory": shm,
        "a_requests_per_peer_get": per_get,
        "reps": {name: len(t) for name, t in times.items()},
    }


# -- 2. routing -----------------------------------------------------------------------


class Replay:
    """One routing mode replaying the trace against the three nodes."""

    def __init__(
        self, mode: str, nodes: Nodes, index: ClusterIndex, layout: KVLayout, seed: int
    ) -> None:
        self.mode = mode
        self.layout = layout
        self.clients = {n: nodes.client(n, layout, namespace=mode) for n in NODES}
        self.router = Router(nodes.cluster, layout, namespace=mode, index=index)
        self.index = index
        self.fp = layout.fingerprint_hex
        self.rng = random.Random(seed)
        self.block = torch.zeros(layout.block_shape, dtype=layout.dtype)
        self.pending: dict[BlockKey, tuple[str, BlockKey]] = {}  # first key -> (node, last)
        self.fetched = dict.fromkeys(NODES, 0)
        self.counts: Counter[str] = Counter()
        self.by_node: Counter[str] = Counter()
        self.route_s: list[float] = []
        self.wait_s = 0.0

    def choose(self, keys: list[BlockKey]) -> str:
        """The node this mode sends the request to."""
        if self.mode == "random":
            return self.rng.choice(NODES)
        start = time.perf_counter()
        best = self.router.rank(keys)[0].node_id
        self.route_s.append(time.perf_counter() - start)
        return best

    def settle(self, keys: list[BlockKey]) -> None:
        """Wait until the index lists the earlier puts this prompt builds on."""
        for key in keys:
            put = self.pending.pop(key, None)
            if put is not None:
                self.wait_s += wait_registered(self.index, self.mode, self.fp, put[0], [put[1]])

    def request(self, keys: list[BlockKey]) -> None:
        """Look up, load the prefix, put the new chunks; count what came from where."""
        self.settle(keys)
        node = self.choose(keys)
        client = self.clients[node]
        found = client.lookup(keys)
        outs = [torch.empty(self.layout.block_shape, dtype=self.layout.dtype) for _ in range(found)]
        got = client.get(keys[:found], outs) if found else []
        loaded = next((i for i, ok in enumerate(got) if not ok), found)
        fetched = cluster_counter(client, self.mode, "fetched")
        peer, self.fetched[node] = fetched - self.fetched[node], fetched
        new = keys[found:]
        if new:
            if not all(client.put(new, [self.block] * len(new))):
                raise RuntimeError(f"node {node} did not store new chunks")
            self.pending[new[0]] = (node, new[-1])
        self.counts.update(asked=len(keys), found=loaded, local=loaded - peer, peer=peer)
        self.by_node[node] += 1

    def result(self, seconds: float) -> dict[str, Any]:
        """This mode's figures."""
        c = self.counts
        return {
            "hit_rate": c["local"] / c["asked"] if c["asked"] else 0.0,
            "cluster_hit_rate": c["found"] / c["asked"] if c["asked"] else 0.0,
            "chunks_asked": c["asked"],
            "chunks_local": c["local"],
            "chunks_from_peers": c["peer"],
            "requests_by_node": {n: self.by_node[n] for n in NODES},
            "busiest_node_share": max(self.by_node.values()) / sum(self.by_node.values()),
            "route_ms_p50": percentile_ms(self.route_s, 50) if self.route_s else None,
            "replay_s": seconds,
            "registration_wait_s": self.wait_s,
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def replay_mode(mode: str, nodes: Nodes, index: ClusterIndex, plan: Plan) -> dict[str, Any]:
    """Replay the whole trace in ``mode``; its figures."""
    replay = Replay(mode, nodes, index, trace_layout(plan.trace), plan.seed)
    trace = generate_trace(plan.trace)
    seed = Namespace(MODEL, replay.layout).seed
    start = time.perf_counter()
    try:
        for req in trace.requests:
            replay.request(
                chain_keys(tokens_to_bytes(req.tokens), replay.layout.block_tokens, seed)
            )
        result = replay.result(time.perf_counter() - start)
        hot = sum(cluster_counter(c, mode, "hot") for c in replay.clients.values())
    finally:
        replay.close()
    return {**result, "blocks_turned_hot": hot}


def trace_summary(plan: Plan) -> dict[str, Any]:
    """What the routing trace is, and the best any single cache could do on it."""
    trace = generate_trace(plan.trace)
    layout = trace_layout(plan.trace)
    seed = Namespace(MODEL, layout).seed
    keys = [
        chain_keys(tokens_to_bytes(r.tokens), layout.block_tokens, seed) for r in trace.requests
    ]
    asked = sum(len(k) for k in keys)
    distinct = len({key for ks in keys for key in ks})
    spec = plan.trace
    return {
        "requests": len(trace.requests),
        "sessions": spec.sessions,
        "active_sessions": spec.active_sessions,
        "turns": list(spec.turns),
        "system_chunks": spec.system_chunks,
        "block_tokens": spec.block_tokens,
        "chunks_asked": asked,
        "infinite_cache_hit_rate": 1 - distinct / asked if asked else 0.0,
    }


# -- 3. index lookup ---------------------------------------------------------------------


def bench_index_lookup(nodes: Nodes, index: ClusterIndex, plan: Plan) -> dict[str, Any]:
    """Router.rank and ClusterIndex.locate of a 128K-token prompt, 3 live nodes."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=256)
    tokens = np.random.default_rng(plan.seed).integers(0, 32_000, 131_072, dtype=np.int32)
    keys = chain_keys(tokens_to_bytes(tokens), 256, Namespace(MODEL, layout).seed)
    block, fp = torch.zeros(layout.block_shape, dtype=layout.dtype), layout.fingerprint_hex
    for node, held in (("a", 384), ("b", 128)):
        with nodes.client(node, layout, namespace="lookup") as client:
            if not all(client.put(keys[:held], [block] * held)):
                raise RuntimeError(f"node {node} did not store the prompt's chunks")
        wait_registered(index, "lookup", fp, node, keys[:held])
    router = Router(nodes.cluster, layout, namespace="lookup", index=index)
    live = sorted(index.live_nodes())
    subjects: dict[str, tuple[Rep, int]] = {
        "rank": (timed(lambda: router.rank(keys)), plan.lookup_reps),
        "locate": (timed(lambda: index.locate("lookup", fp, keys, live)), plan.lookup_reps),
    }
    times = run_rounds(subjects, 2 if plan.quick else 10, warmup=3)
    ranked = [[r.node_id, r.prefix_blocks, r.merit] for r in router.rank(keys)]
    router.close()
    return {
        "keys": len(keys),
        "live_nodes": live,
        "ranked": ranked,
        "rank_ms_p50": percentile_ms(times["rank"], 50),
        "rank_ms_p99": percentile_ms(times["rank"], 99),
        "locate_ms_p50": percentile_ms(times["locate"], 50),
        "locate_ms_p99": percentile_ms(times["locate"], 99),
        "reps": {name: len(t) for name, t in times.items()},
    }


def bench_routing(redis_url: str, plan: Plan, workdir: Path) -> dict[str, Any]:
    """Routed vs random on the trace, then the index lookup, on one set of nodes."""
    cluster = ClusterConfig(
        redis_url=redis_url, name=f"bench-route-{os.getpid()}", heartbeat_s=0.1, lease_heartbeats=30
    )
    out: dict[str, Any] = {"trace": trace_summary(plan), "cluster": cluster.to_dict()}
    with (
        Nodes(cluster, workdir / "route", 256 * MiB) as nodes,
        contextlib.closing(ClusterIndex(cluster)) as index,
    ):
        for mode in MODES:
            log(f"routing: {mode}, {out['trace']['requests']} requests")
            out[mode] = replay_mode(mode, nodes, index, plan)
        log("index lookup: Router.rank / ClusterIndex.locate of 512 keys, 3 live nodes")
        out["lookup"] = bench_index_lookup(nodes, index, plan)
    return out


# -- 5. ranking over many nodes ---------------------------------------------------------

#: What each simulated node publishes: memory, disk and S3 read speeds, a prefill rate.
SIMULATED_SPEEDS = NodeSpeeds(
    (("memory", 20.0, 0.01), ("disk", 2.0, 0.2), ("shared", 0.5, 30.0)), 20_000.0
)


def rank_point(redis_url: str, nodes: int, plan: Plan) -> dict[str, Any]:
    """Router.rank of a 512-key prompt over ``nodes`` simulated live nodes."""
    cluster = ClusterConfig(
        redis_url=redis_url, name=f"bench-rank-{os.getpid()}-{nodes}", heartbeat_s=3600
    )
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=256)
    tokens = np.random.default_rng(plan.seed).integers(0, 32_000, 131_072, dtype=np.int32)
    keys = chain_keys(tokens_to_bytes(tokens), 256, Namespace(MODEL, layout).seed)
    fp = layout.fingerprint_hex
    with contextlib.closing(ClusterIndex(cluster)) as index:
        for i in range(nodes):
            address = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:7070"
            index.heartbeat(NodeInfo(f"n{i}", address, speeds=SIMULATED_SPEEDS))
        index.add("rank", fp, "n0", keys[:384], Medium.MEMORY)
        index.add("rank", fp, "n1", keys[:128], Medium.DISK)
        with Router(cluster, layout, namespace="rank", index=index) as router:
            ranked = router.rank(keys)
            if len(ranked) != nodes or any(r.ready_ms is None for r in ranked):
                raise RuntimeError(f"{nodes} nodes: not every node was ranked by time")
            reps = plan.lookup_reps * (2 if nodes <= 100 else 1)
            times = run_rounds({"rank": (timed(lambda: router.rank(keys)), reps)}, 5, warmup=3)
    p50 = percentile_ms(times["rank"], 50)
    return {
        "nodes": nodes,
        "rank_ms_p50": p50,
        "rank_ms_p99": percentile_ms(times["rank"], 99),
        "rank_us_per_node_p50": p50 * 1e3 / nodes,
        "best": [ranked[0].node_id, ranked[0].ready_ms],
        "reps": len(times["rank"]),
    }


def bench_rank_scaling(redis_url: str, plan: Plan) -> list[dict[str, Any]]:
    """The ranking's time at each cluster size."""
    points = []
    for nodes in plan.rank_nodes:
        log(f"ranking scaling: Router.rank of 512 keys over {nodes} simulated nodes")
        points.append(rank_point(redis_url, nodes, plan))
    return points


# -- 4. index scaling ------------------------------------------------------------------


def random_keys(n: int, seed: int, salt: int) -> list[BlockKey]:
    """``n`` random 16-byte keys (one set per ``seed`` and ``salt``)."""
    raw = np.random.default_rng((seed, salt)).bytes(16 * n)
    return [BlockKey(raw[i : i + 16]) for i in range(0, len(raw), 16)]


def used_memory(client: Any) -> int:
    """Redis's ``used_memory`` (bytes allocated)."""
    return int(client.info("memory")["used_memory"])


def scale_point(index: ClusterIndex, raw: Any, n: int, plan: Plan) -> dict[str, Any]:
    """Register ``n`` keys for node s0; memory and locate latency; then remove them."""
    ns, fp = "scale", "0" * 16
    keys = random_keys(n, plan.seed, n)
    before = used_memory(raw)
    start = time.perf_counter()
    index.add(ns, fp, "s0", keys)
    add_s = time.perf_counter() - start
    grown = used_memory(raw) - before
    usage = index.memory_usage(ns, fp, "s0")
    probe = keys[:256] + random_keys(256, plan.seed, 0)  # never registered
    nodes = ["s0", "s1", "s2"]
    for _ in range(5):
        found = index.locate(ns, fp, probe, nodes)["s0"]
    if sum(found[:256]) != 256 or any(found[256:]):
        raise RuntimeError("locate did not find exactly the registered keys")
    times = [timed(lambda: index.locate(ns, fp, probe, nodes))() for _ in range(plan.scale_reps)]
    encoding = raw.object("encoding", f"{index.config.name}:{ns}:{fp}:held:s0")
    index.leave("s0", [(ns, fp)])
    return {
        "blocks": n,
        "add_s": add_s,
        "add_keys_per_s": n / add_s,
        "redis_bytes_per_block": grown / n,
        "memory_usage_bytes_per_block": usage / n,
        "set_encoding": encoding.decode() if isinstance(encoding, bytes) else str(encoding),
        "locate_ms_p50": percentile_ms(times, 50),
        "locate_ms_p99": percentile_ms(times, 99),
    }


def bench_scaling(redis_url: str, plan: Plan) -> list[dict[str, Any]]:
    """Index memory and locate latency at each registered size."""
    cluster = ClusterConfig(
        redis_url=redis_url, name=f"bench-scale-{os.getpid()}", heartbeat_s=3600
    )
    with (
        contextlib.closing(ClusterIndex(cluster)) as index,
        contextlib.closing(redis.Redis.from_url(redis_url)) as raw,
    ):
        points = []
        for n in plan.scale_sizes:
            log(f"index scaling: {n} blocks")
            points.append(scale_point(index, raw, n, plan))
    return points


# -- results ---------------------------------------------------------------------------


def redis_info() -> dict[str, Any]:
    """Versions of the Redis side (hiredis speeds up redis-py's parsing and packing)."""
    version = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        version = next((w[2:] for w in out.split() if w.startswith("v=")), out.strip())
    return {
        "redis_server": version,
        "redis_py": redis.__version__,
        "hiredis": importlib.util.find_spec("hiredis") is not None,
    }


def meets(result: dict[str, Any]) -> dict[str, bool]:
    """Each bar: met or not."""
    return {
        "peer_fetch_ratio_vs_local": result["peer_fetch_ratio_vs_local"]
        >= TARGETS["peer_fetch_ratio_vs_local"],
        "routing_margin": result["routing_margin"] >= TARGETS["routing_margin"],
        "index_lookup_ms_p50": result["index_lookup_ms_p50"] <= TARGETS["index_lookup_ms_p50"],
        "index_lookup_ms_p99": result["index_lookup_ms_p99"] <= TARGETS["index_lookup_ms_p99"],
        "rank_ms_p50_at_100_nodes": result["rank_ms_p50_at_100_nodes"] is not None
        and result["rank_ms_p50_at_100_nodes"] <= TARGETS["rank_ms_p50_at_100_nodes"],
        "rank_ms_per_node_growth": result["rank_ms_per_node_growth"] is None
        or result["rank_ms_per_node_growth"] <= TARGETS["rank_ms_per_node_growth"],
    }


def rank_growth(points: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The ranking's p50 at 100 nodes, and its time per node at the largest size over
    that at 100 (None: not measured)."""
    by = {p["nodes"]: p for p in points}
    at_100 = by.get(100)
    top = by[max(by)] if by else None
    if at_100 is None or top is None or top["nodes"] <= 100:
        return (at_100["rank_ms_p50"] if at_100 else None), None
    return at_100["rank_ms_p50"], top["rank_us_per_node_p50"] / at_100["rank_us_per_node_p50"]


def summarize(
    plan: Plan,
    fetch: dict[str, Any],
    routing: dict[str, Any],
    scaling: list[dict[str, Any]],
    ranks: list[dict[str, Any]],
) -> dict[str, Any]:
    """The one JSON object."""
    g, lookup, top = fetch["gbps"], routing["lookup"], scaling[-1]
    at_100, growth = rank_growth(ranks)
    result: dict[str, Any] = {
        "benchmark": "cluster",
        "quick": plan.quick,
        "peer_fetch_gbps": g["peer_tcp"],
        "local_fetch_gbps": g["local_tcp"],
        "peer_fetch_ratio_vs_local": g["peer_tcp"] / g["local_tcp"],
        "peer_fetch_shm_ratio_vs_local": g["peer_shm"] / g["local_shm"],
        "routed_hit_rate": routing["routed"]["hit_rate"],
        "random_hit_rate": routing["random"]["hit_rate"],
        "routing_margin": routing["routed"]["hit_rate"] - routing["random"]["hit_rate"],
        "routed_busiest_node_share": routing["routed"]["busiest_node_share"],
        "random_busiest_node_share": routing["random"]["busiest_node_share"],
        "routed_cluster_hit_rate": routing["routed"]["cluster_hit_rate"],
        "random_cluster_hit_rate": routing["random"]["cluster_hit_rate"],
        "index_lookup_ms_p50": lookup["rank_ms_p50"],
        "index_lookup_ms_p99": lookup["rank_ms_p99"],
        "index_locate_ms_p50": lookup["locate_ms_p50"],
        "index_locate_ms_p99": lookup["locate_ms_p99"],
        "redis_bytes_per_block": top["redis_bytes_per_block"],
        "redis_bytes_per_block_at": top["blocks"],
        "rank_ms_p50_at_100_nodes": at_100,
        "rank_ms_per_node_growth": growth,
        "rank_scaling": ranks,
        "index_scaling": scaling,
        "peer_fetch": fetch,
        "routing": {k: v for k, v in routing.items() if k != "lookup"},
        "index_lookup": lookup,
        "targets": TARGETS,
    }
    result["meets_target"] = meets(result)
    result["reps"] = {**fetch["reps"], **{f"index_{k}": v for k, v in lookup["reps"].items()}}
    result["environment"] = {**environment(), **redis_info()}
    return result


def table(result: dict[str, Any]) -> list[list[object]]:
    """Rows for the human-readable output."""
    mt = result["meets_target"]
    rows: list[list[object]] = [["figure", "value", "bar", "met"]]
    rows.append(["peer_fetch_gbps (b fetches from a)", result["peer_fetch_gbps"], "", ""])
    rows.append(["local_fetch_gbps (a serves)", result["local_fetch_gbps"], "", ""])
    for key, bar in (("peer_fetch_ratio_vs_local", ">= 0.5"), ("routing_margin", ">= 0.2")):
        rows.append([key, result[key], bar, mt[key]])
    rows.append(["peer_fetch_shm_ratio_vs_local", result["peer_fetch_shm_ratio_vs_local"], "", ""])
    for key in ("routed_hit_rate", "random_hit_rate"):
        rows.append([key, result[key], "", ""])
    for key in ("routed_cluster_hit_rate", "random_cluster_hit_rate"):
        rows.append([key, result[key], "", ""])
    rows.append(
        ["index_lookup_ms_p50", result["index_lookup_ms_p50"], "<= 0.1", mt["index_lookup_ms_p50"]]
    )
    rows.append(
        ["index_lookup_ms_p99", result["index_lookup_ms_p99"], "<= 1", mt["index_lookup_ms_p99"]]
    )
    for point in result["rank_scaling"]:
        rows.append(
            [
                f"rank over {point['nodes']} nodes: p50 / p99 ms",
                f"{point['rank_ms_p50']:.3f} / {point['rank_ms_p99']:.3f}",
                "<= 1 at 100" if point["nodes"] == 100 else "",
                mt["rank_ms_p50_at_100_nodes"] if point["nodes"] == 100 else "",
            ]
        )
    if result["rank_ms_per_node_growth"] is not None:
        rows.append(
            [
                "rank time per node, largest / 100 nodes",
                round(result["rank_ms_per_node_growth"], 3),
                "<= 1.5",
                mt["rank_ms_per_node_growth"],
            ]
        )
    for point in result["index_scaling"]:
        rows.append(
            [
                f"{point['blocks']} blocks: bytes/block, locate p50 / p99 ms",
                point["redis_bytes_per_block"],
                f"{point['locate_ms_p50']:.3f} / {point['locate_ms_p99']:.3f}",
                "",
            ]
        )
    return rows


def parse_args(argv: list[str] | None) -> Any:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--fetch-layers", type=int, default=None, help="layers per block (32)")
    parser.add_argument("--fetch-tokens", type=int, default=None, help="tokens per block (256)")
    parser.add_argument("--fetch-blocks", type=int, default=None, help="blocks per get (8)")
    parser.add_argument("--sessions", type=int, default=None, help="chat sessions (48)")
    parser.add_argument("--scale-sizes", default=None, help="blocks registered, comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="trace and data seed")
    parser.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="MINUTES",
        help="instead: the chaos soak (kvharness.chaos.run) for MINUTES; exit 1 if it "
        "served a wrong byte or lost or deleted a block of S3",
    )
    return parser.parse_args(argv)


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A temp directory for the nodes' configs and logs."""
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-cluster-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    args = parse_args(argv)
    plan = make_plan(args)
    if shutil.which("redis-server") is None:
        reason = "redis-server is not installed; run scripts/install-servers.sh"
        log(f"bench_cluster: skipped: {reason}")
        emit(
            {"benchmark": "cluster", "quick": plan.quick, "skipped": reason}, args.json, [[reason]]
        )
        return 0
    if args.soak is not None:  # 3 nodes, 1 member, faults injected: every byte checked
        from kvharness import ChaosSoakConfig, run_chaos_soak

        log(f"chaos soak: {args.soak:g} min, seed {args.seed}")
        with workdir() as tmp:
            report = run_chaos_soak(ChaosSoakConfig.minutes(args.soak, seed=args.seed), tmp)
        log(report.summary())
        emit({"benchmark": "cluster-soak", **report.to_json()}, args.json, report.rows())
        return 0 if report.ok else 1
    with RedisServer() as server, workdir() as tmp:
        log(f"index scaling: {list(plan.scale_sizes)} blocks, {plan.scale_reps} locates each")
        scaling = bench_scaling(server.url, plan)
        log(f"peer fetch: {plan.fetch_blocks} blocks per get, {plan.rounds} rounds")
        fetch = bench_peer_fetch(server.url, plan, tmp)
        routing = bench_routing(server.url, plan, tmp)
        ranks = bench_rank_scaling(server.url, plan)
    result = summarize(plan, fetch, routing, scaling, ranks)
    emit(result, args.json, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
