"""Noisy neighbour: a quiet tenant's hit rate while another floods the same server.

A ``kvstore-server`` (in this process, host tier only: its capacity is the pool)
serves two tenants. The quiet one replays a working set of prompts (each a
LOOKUP, and a PUT of what missed); between two of its prompts the noisy one
puts ``--flood`` prompts of unique blocks (never read again). The two take
turns on one thread, so the flood's rate per quiet prompt is the same in
every run, whatever the machine's load. The quiet tenant's hit rate (blocks
found / blocks looked up, after a first pass that fills its set) is measured:

- ``alone``: the quiet tenant by itself, with quotas;
- ``with_quotas``: both, each in its namespace, shares within the pool
  (quiet: ``--quiet-share`` of the pool, noisy: the rest, limit: the pool);
- ``shared_no_quotas``: both in one namespace, no quotas (one cache for all:
  what a flood does to a shared LRU);
- ``separate_no_quotas``: both in namespaces of their own, no quotas (each
  store has the whole capacity: no interference, but the two hold up to twice
  the pool: ``host_bytes_vs_pool``).

``quiet_hit_ratio_vs_alone``: the quiet hit rate of ``with_quotas`` and of
``shared_no_quotas`` over ``alone``; target >= 0.95 with quotas.

Run: ``python benchmarks/bench_tenants.py [--json] [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from _common import base_parser, emit, environment, log

from kvstore import KVLayout
from kvstore.cli import server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.config import StoreConfig
from kvstore.server import ServerThread
from kvstore.testing import make_keys

TARGET = 0.95
OPS = "bench-ops-token-0123456789"
QUIET = "bench-quiet-token-0123456789"
NOISY = "bench-noisy-token-0123456789"
CONFIGS = ("alone", "with_quotas", "shared_no_quotas", "separate_no_quotas")


@dataclass(frozen=True)
class Plan:
    """The workload: sizes in blocks."""

    pool_blocks: int
    prompt_blocks: int
    quiet_prompts: int
    flood_prompts: int
    noisy_prompt_blocks: int
    passes: int
    quiet_share: float


def bench_layout() -> KVLayout:
    return KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16)


def tenants(plan: Plan, block: int, quotas: bool) -> dict[str, Any]:
    pool = plan.pool_blocks * block
    quiet_share = int(pool * plan.quiet_share)

    def quota(share: int) -> dict[str, Any]:
        return {"quotas": {"host": {"share": share, "limit": pool}}} if quotas else {}

    admin = ["read", "write", "admin"]
    return {
        "ops": {"tokens": [{"name": "ops", "token": OPS, "scopes": admin}]},
        "quiet": {"namespaces": ["quiet"], "tokens": [{"token": QUIET}], **quota(quiet_share)},
        "noisy": {
            "namespaces": ["noisy"],
            "tokens": [{"token": NOISY}],
            **quota(pool - quiet_share),
        },
    }


@contextmanager
def serving(plan: Plan, block: int, name: str) -> Iterator[ServerThread]:
    work = tempfile.mkdtemp(prefix="kvs-bench-")
    tiers = [{"kind": "host", "capacity": plan.pool_blocks * block}]
    server: dict[str, Any] = {}
    if name != "shared_no_quotas":  # an admin token sees every tenant's figures
        server["tenants"] = tenants(plan, block, quotas=name != "separate_no_quotas")
    config = StoreConfig.from_dict(server_test_config(work, tiers, **server), environ={})
    thread = ServerThread(config).start()
    try:
        yield thread
    finally:
        thread.stop()
        shutil.rmtree(work, ignore_errors=True)


def client(server: ServerThread, layout: KVLayout, token: str | None, namespace: str) -> Client:
    secret = token.encode() if token else None
    return Client(layout, ClientOptions(server.address, namespace, secret))


def blocks(layout: KVLayout, n: int) -> list[torch.Tensor]:
    one = torch.randn(layout.block_shape).to(layout.dtype)
    return [one] * n


def run_config(plan: Plan, layout: KVLayout, name: str) -> dict[str, Any]:
    """The quiet tenant's hit rate in one configuration (see the module docstring)."""
    shared = name == "shared_no_quotas"
    q_ns, n_ns = ("shared", "shared") if shared else ("quiet", "noisy")
    q_token, n_token = (None, None) if shared else (QUIET, NOISY)
    prompts = [make_keys(plan.prompt_blocks, salt=1 + i) for i in range(plan.quiet_prompts)]
    filler = blocks(layout, max(plan.prompt_blocks, plan.noisy_prompt_blocks))
    hit = looked = flood = 0
    with serving(plan, layout.block_nbytes, name) as server:
        with (
            client(server, layout, q_token, q_ns) as quiet,
            client(server, layout, n_token, n_ns) as noisy,
        ):
            for rnd in range(plan.passes + 1):
                for keys in prompts:
                    found = quiet.lookup(keys)
                    if rnd:  # the first pass fills the working set
                        hit, looked = hit + found, looked + len(keys)
                    if found < len(keys):
                        quiet.put(keys[found:], filler[: len(keys) - found])
                    if name == "alone":
                        continue
                    for _ in range(plan.flood_prompts):
                        flood += 1
                        keys_n = make_keys(plan.noisy_prompt_blocks, salt=1_000_000 + flood)
                        noisy.put(keys_n, filler[: plan.noisy_prompt_blocks])
        held = host_bytes(server, layout, shared)
    rate = hit / looked if looked else 0.0
    pool = plan.pool_blocks * layout.block_nbytes
    log(f"{name}: quiet hit rate {rate:.3f}, host bytes {held / pool:.2f} x the pool")
    return {
        "quiet_hit_rate": round(rate, 4),
        "host_bytes_vs_pool": round(held / pool, 3),
        "noisy_blocks_put": flood * plan.noisy_prompt_blocks,
    }


def host_bytes(server: ServerThread, layout: KVLayout, shared: bool) -> int:
    """Blocks both tenants hold in the host tier, in bytes."""
    if shared:
        with client(server, layout, None, "shared") as c:
            stores = c.server_stats()["stores"]
        return sum(t["blocks"] for s in stores for t in s["tiers"]) * layout.block_nbytes
    with client(server, layout, OPS, "quiet") as c:
        figures = c.server_stats()["tenants"]
    return sum(f["tiers"].get("host", {}).get("bytes", 0) for f in figures.values())


def parse_args(argv: list[str] | None) -> Any:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--pool-blocks", type=int, default=512, help="host capacity, in blocks")
    parser.add_argument("--prompt-blocks", type=int, default=4)
    parser.add_argument("--quiet-prompts", type=int, default=48, help="the quiet working set")
    parser.add_argument("--flood", type=int, default=2, help="noisy prompts per quiet prompt")
    parser.add_argument("--noisy-prompt-blocks", type=int, default=16)
    parser.add_argument("--passes", type=int, default=2, help="measured passes over the set")
    parser.add_argument("--quiet-share", type=float, default=0.5, help="of the pool")
    args = parser.parse_args(argv)
    if args.quick:
        args.pool_blocks, args.quiet_prompts, args.passes = 128, 12, 1
    return args


def run(args: Any) -> dict[str, Any]:
    plan = Plan(
        args.pool_blocks,
        args.prompt_blocks,
        args.quiet_prompts,
        args.flood,
        args.noisy_prompt_blocks,
        args.passes,
        args.quiet_share,
    )
    layout = bench_layout()
    load_before = os.getloadavg()[0]
    runs = {name: run_config(plan, layout, name) for name in CONFIGS}
    alone = runs["alone"]["quiet_hit_rate"] or 1.0
    ratios = {
        "with_quotas": round(runs["with_quotas"]["quiet_hit_rate"] / alone, 4),
        "without_quotas": round(runs["shared_no_quotas"]["quiet_hit_rate"] / alone, 4),
    }
    return {
        "benchmark": "tenants",
        "quick": bool(args.quick),
        "quiet_hit_ratio_vs_alone": ratios,
        "target_ratio": TARGET,
        "meets_target": ratios["with_quotas"] >= TARGET,
        "runs": runs,
        "plan": plan.__dict__,
        "block_nbytes": layout.block_nbytes,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "environment": environment(),
    }


def table(result: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = [["config", "quiet hit rate", "host bytes / pool"]]
    for name in CONFIGS:
        r = result["runs"][name]
        rows.append([name, r["quiet_hit_rate"], r["host_bytes_vs_pool"]])
    for name, ratio in result["quiet_hit_ratio_vs_alone"].items():
        rows.append([f"ratio vs alone, {name}", ratio, ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit(result, args.json, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
