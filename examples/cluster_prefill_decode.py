"""Prefill/decode split with vLLM across two nodes of a kvstore cluster.

A prefill-only vLLM process stores the prompts' KV on node A, a decode-only vLLM process
loads it from node B: B's kvstore-server finds the blocks in the cluster's shared index
(Redis) and fetches them from A through its cluster tier, and the decode process never
knows. Each process's workers name one node only: host memory over
``{"kind": "remote", "address": <its node>, ...}``, as in examples/server_prefill_decode.py
(whose pieces this reuses), where both processes share one server.

The nodes need redis-py, the vLLM processes vLLM: run this with an interpreter that has
kvstore and redis-py, and point ``--vllm-python`` at the vLLM virtualenv
(``bash scripts/setup-vllm.sh`` creates it)::

    .venv/bin/python examples/cluster_prefill_decode.py --workdir /tmp/cpd \\
        --vllm-python .venv-vllm/bin/python

It starts a ``redis-server`` (or uses ``--redis-url``) and two ``kvstore-server`` nodes,
``a`` for the prefill process and ``b`` for the decode process (each host memory over a
disk tier in ``<workdir>/node-<id>``, both in the cluster ``--cluster-name``), and stops
them at the end. With ``--prefill-address`` and ``--decode-address`` it uses two nodes of
a cluster that already runs, e.g. two ``kvstore-server --config node.yaml`` whose YAML has
``cluster: {redis_url: ..., node_id: a}``; then no interpreter here needs redis-py.

Each process is examples/vllm_offline.py (its small random model and prompts); their JSON
results land in ``<workdir>/prefill.json`` and ``<workdir>/decode.json``, their logs next
to them. At the end it prints what node B's cluster tier fetched from its peers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# examples/ is on sys.path when this runs as a script (and when a test imports it).
from server_prefill_decode import ROLES, SERVER_TIERS, run_role, show

ROOT = Path(__file__).resolve().parents[1]
NODES = {"prefill": "a", "decode": "b"}
# A cluster tier's counters (per block, and per layer range when a load asks for layers).
CLUSTER_COUNTERS = (
    "lookups",
    "fetched",
    "layer_requests",
    "fetch_failures",
    "stale_hints",
    "peer_errors",
    "hot",
)


def default_vllm_python() -> str:
    """This interpreter if it has vLLM, else the repository's .venv-vllm (if present)."""
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    if importlib.util.find_spec("vllm") is None and venv.exists():
        return str(venv)
    return sys.executable


def node_config(args: argparse.Namespace, redis_url: str, node_id: str) -> dict[str, Any]:
    """A node's server config: host memory over its own disk tier, in the cluster."""
    tiers = [dict(t) for t in SERVER_TIERS]
    tiers[1]["path"] = str(Path(args.workdir) / f"node-{node_id}" / "disk")
    cluster = {
        "redis_url": redis_url,
        "name": args.cluster_name,
        "node_id": node_id,
        "heartbeat_s": args.heartbeat,
    }
    return {"tiers": tiers, "cluster": cluster}


@contextlib.contextmanager
def redis_url(args: argparse.Namespace) -> Iterator[str]:
    """The cluster's Redis: ``--redis-url``, else a ``redis-server`` started for the run."""
    if args.redis_url:
        yield args.redis_url
        return
    from kvstore.cli import RedisServer

    with RedisServer() as redis:
        print(f"redis-server at {redis.url}")
        yield redis.url


@contextlib.contextmanager
def cluster_nodes(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Each role's node address: ``--prefill-address`` / ``--decode-address``, else two
    nodes (``a``, ``b``) started for the run, in one cluster."""
    if args.prefill_address:
        yield {"prefill": args.prefill_address, "decode": args.decode_address}
        return
    if importlib.util.find_spec("redis") is None:
        sys.exit(
            "the cluster nodes need redis-py, which this interpreter lacks: run this example "
            "with one that has it (.venv/bin/python ... --vllm-python .venv-vllm/bin/python), "
            "or give the addresses of running nodes (--prefill-address, --decode-address)"
        )
    from kvstore.cli import KVStoreServerProcess

    work = Path(args.workdir)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_url(args))
        addresses = {}
        for role, node_id in NODES.items():
            node = KVStoreServerProcess(node_config(args, url, node_id), work / f"node-{node_id}")
            stack.enter_context(node)
            print(
                f"node {node_id} ({role}) at {node.address} in cluster {args.cluster_name!r} "
                f"(pid {node.pid}, log {node.log_path})"
            )
            addresses[role] = node.address
        yield addresses


def node_store(address: str, namespace: str) -> dict[str, Any]:
    """A node's store for the model's KV in ``namespace``: its counters and its tiers'
    (asked over the socket; the client maps no shared memory)."""
    import torch

    from kvstore import KVLayout
    from kvstore.client import Client, ClientOptions

    # The connector's layout of examples/vllm_offline.py's model (fp32, 256-token chunks).
    layout = KVLayout(
        num_layers=12, num_kv_heads=2, head_dim=64, block_tokens=256, dtype=torch.float32
    )
    options = ClientOptions(address=address, namespace=namespace, shared_memory=False)
    with Client(layout, options) as client:
        stats = client.server_stats()
    (store,) = [s for s in stats["stores"] if s["block_nbytes"] == layout.block_nbytes]
    return {"server": stats["server"], "store": store}


def show_cluster(addresses: dict[str, str], namespace: str) -> None:
    """Print what each node holds in its own tiers, and what its cluster tier fetched
    from its peers."""
    for role, node_id in NODES.items():
        view = node_store(addresses[role], namespace)
        tiers = view["store"]["tiers"]
        held = ", ".join(f"{t['kind']} {t['blocks']}" for t in tiers if t["kind"] != "cluster")
        served = view["server"].get("blocks_served", 0)
        print(f"node {node_id}: blocks held: {held}; {served:.0f} blocks served")
        for tier in tiers:
            if tier["kind"] == "cluster":
                counters = {k: tier.get(k, 0) for k in CLUSTER_COUNTERS}
                print(f"  its cluster tier (peers {tier.get('peers')}): {json.dumps(counters)}")


def main() -> None:
    """Run the prefill process on node A, then the decode process on node B."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="model, results, logs (and nodes)")
    parser.add_argument("--prefill-address", help="node A, a running cluster node")
    parser.add_argument("--decode-address", help="node B, a running node of A's cluster")
    parser.add_argument("--redis-url", help="the cluster's Redis (default: start one)")
    parser.add_argument(
        "--cluster-name",
        default=f"pd-{os.getpid()}",
        help="the cluster of the nodes started here (its keys' prefix in Redis)",
    )
    parser.add_argument("--heartbeat", type=float, default=0.5, help="nodes started here")
    parser.add_argument("--namespace", default="default", help="the server-side namespace")
    parser.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="move blocks through each node's shared memory when on its host (default)",
    )
    parser.add_argument("--prefix-tokens", type=int, default=3300)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens the decode side makes")
    parser.add_argument(
        "--vllm-python",
        default=default_vllm_python(),
        help="the interpreter of the vLLM processes (default: this one if it has vLLM, "
        "else .venv-vllm's)",
    )
    args = parser.parse_args()
    if bool(args.prefill_address) != bool(args.decode_address):
        parser.error("give both --prefill-address and --decode-address, or neither")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with cluster_nodes(args) as addresses:
        results = {}
        for role in ROLES:
            results[role] = run_role(args, role, addresses[role], args.vllm_python)
            print(f"{role} process on node {NODES[role]} ({addresses[role]}):")
            show(role, results[role])
        show_cluster(addresses, args.namespace)
    stored = results["prefill"]["stats"].get("worker", {}).get("save_chunks_stored", 0)
    hits = results["decode"]["stats"].get("scheduler", {}).get("lookup_hit_tokens", 0)
    print(f"the decode process hit {hits:.0f} tokens on node b; node a got {stored:.0f} chunks")


if __name__ == "__main__":
    main()
