"""Prefill/decode split with vLLM through a kvstore-server (a ``remote`` tier).

A prefill-only vLLM process stores the prompts' KV on the server, a decode-only vLLM
process loads it from there and decodes.

Runs with the vLLM virtualenv (``bash scripts/setup-vllm.sh`` creates it)::

    .venv-vllm/bin/python examples/server_prefill_decode.py --workdir /tmp/spd

It starts a ``kvstore-server`` (host memory over a disk tier in ``<workdir>/server``)
for the two processes and stops it at the end; with ``--address HOST:PORT`` (or
``unix:/path``) it uses a server that already runs, e.g. ``kvstore-server
--listen 127.0.0.1:7070``. The processes share nothing but the server: each one's
store is its own host memory over a ``remote`` tier naming the server --
``{"kind": "remote", "address": ..., "namespace": ..., "shared_memory": true}``
(through the server's shared memory on its host, over the socket otherwise or with
``--no-shared-memory``) --
where examples/prefill_decode_split.py shares a disk directory. The prefill
process is a ``kv_producer`` (saves, never loads) that generates one token per
prompt; the decode process a ``kv_consumer`` (loads, never saves) that computes
only each prompt's tail and decodes.

Each process is examples/vllm_offline.py (its small random model and prompts);
their JSON results land in ``<workdir>/prefill.json`` and ``<workdir>/decode.json``,
their logs next to them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DRIVER = Path(__file__).resolve().parent / "vllm_offline.py"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# The server's own tiers (only when this example starts it): per namespace and KV layout.
SERVER_TIERS = [{"kind": "host", "capacity": "512MiB"}, {"kind": "disk", "capacity": "4GiB"}]


@contextlib.contextmanager
def kvstore_server(args: argparse.Namespace) -> Iterator[str]:
    """The server's address: ``--address``, else a ``kvstore-server`` started for the run."""
    if args.address:
        yield args.address
        return
    from kvstore.cli import KVStoreServerProcess

    work = Path(args.workdir) / "server"
    tiers = [dict(t) for t in SERVER_TIERS]
    tiers[1]["path"] = str(work / "disk")
    with KVStoreServerProcess({"tiers": tiers}, work) as server:
        print(f"kvstore-server at {server.address} (pid {server.pid}, log {server.log_path})")
        yield server.address


def store_config(args: argparse.Namespace, address: str) -> dict[str, Any]:
    """Each vLLM worker's store: its own host memory over the server (the shared tier)."""
    remote = {
        "kind": "remote",
        "address": address,
        "namespace": args.namespace,
        "shared_memory": args.shared_memory,
    }
    return {"tiers": [{"kind": "host", "capacity": "512MiB"}, remote]}


def run_role(
    args: argparse.Namespace, role: str, address: str, python: str = sys.executable
) -> dict[str, Any]:
    """One vLLM process (examples/vllm_offline.py, run by ``python``) playing ``role`` on
    the server at ``address``; its JSON result."""
    work = Path(args.workdir)
    out, log = work / f"{role}.json", work / f"{role}.log"
    cmd = [python, str(DRIVER), "--workdir", str(work), "--prompts", "first"]
    cmd += ["--prefix-tokens", str(args.prefix_tokens), "--logprobs"]
    cmd += ["--store-config", json.dumps(store_config(args, address))]
    cmd += ["--kv-role", ROLES[role], "--stats-dir", str(work / f"stats-{role}")]
    cmd += ["--max-tokens", "1" if role == "prefill" else str(args.max_tokens), "--out", str(out)]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{role} process failed (rc {proc.returncode}):\n{log.read_text()[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def show(role: str, result: dict[str, Any]) -> None:
    """Print what one process did: its external hits per prompt, and its counters."""
    print(f"{role} process ({result['wall_s']:.0f} s):")
    for r in result["results"]:
        print(
            f"  {r['prompt_tokens']} prompt tokens, {r['num_cached_tokens']} hit in kvstore, "
            f"TTFT {r['ttft_s'] * 1000:.0f} ms, output {r['output'][:8]}"
        )
    stats = result["stats"]
    worker, scheduler = stats.get("worker", {}), stats.get("scheduler", {})
    if role == "prefill":
        print(f"  chunks stored on the server: {worker.get('save_chunks_stored', 0):.0f}")
        return
    failed = worker.get("load_failed_blocks", 0)
    print(
        f"  external hits: {scheduler.get('lookup_hit_tokens', 0):.0f} tokens "
        f"({scheduler.get('lookup_hit_requests', 0):.0f} requests); loaded "
        f"{worker.get('load_tokens', 0):.0f} tokens in {worker.get('load_chunks', 0):.0f} "
        f"chunks, {failed:.0f} vLLM blocks failed"
    )
    if failed:
        print(
            f"  WARNING: {worker.get('load_failed_tokens', 0):.0f} hit tokens failed to load "
            f"and were recomputed by vLLM (see {role}.log)"
        )


def main() -> None:
    """Run the prefill process, then the decode process, on one kvstore-server."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="model, results, logs (and server)")
    parser.add_argument("--address", help="a running kvstore-server (default: start one)")
    parser.add_argument("--namespace", default="default", help="the server-side namespace")
    parser.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="move blocks through the server's shared memory when on its host (default)",
    )
    parser.add_argument("--prefix-tokens", type=int, default=3300)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens the decode side makes")
    args = parser.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with kvstore_server(args) as address:
        for role in ROLES:
            show(role, run_role(args, role, address))


if __name__ == "__main__":
    main()
