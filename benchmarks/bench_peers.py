"""Every peer installable here side by side with kvstore, in one command (kvstore bench --peers).

Peers, each in its own venv set up by a script of ours (``--setup`` runs them first):

- **Mooncake Store** (``.venv-mooncake``, ``benchmarks/peers/setup_mooncake.sh``):
  ``mooncake_master`` and its store process on 127.0.0.1 (protocol ``tcp``, metadata
  ``P2PHANDSHAKE``) against a ``kvstore-server`` holding the same bytes in host memory,
  over TCP loopback (``tcp``) and on the same host (``shm``: Mooncake's ``setup_dummy``
  client, buffers from ``alloc_from_mem_pool``, vs kvstore's shared-memory path); put,
  get, first fill, lookup; 32 MiB and 1 MiB blocks; 1 and ``--clients`` client processes
  (see ``_peers_mooncake.py``);
- **vLLM's own fs offloading tier** (``.venv-vllm``, ``scripts/setup-vllm.sh``) vs
  ``KVStoreTier``: ``bench_vllm_tier.py`` at both block sizes (store, cold load, lookup);
- **LMCache 0.5.6** (``.venv-lmcache``, ``benchmarks/peers/setup_lmcache.sh``):
  ``bench_lmcache.py`` at both block sizes (host put, get, first fill; disk get cold and
  warm; lookup).

Every row is kvstore / the peer (> 1: kvstore ahead; lookups in keys/s), each figure a
median over interleaved reps with a 90% interval (``_intervals.py``), plus both sides'
raw figures. Every byte read back is checked against the byte written, on both sides; a
wrong byte fails its row, loudly (stderr, the table, exit status 1). A peer that cannot
be installed or started is reported as skipped, with why.

Output: one JSON object (``--json``) or a table; ``--out DIR`` also writes ``peers.json``
and one plot per operation (``peers_put.png`` ...) there.

Run: ``python benchmarks/bench_peers.py [--json] [--quick] [--only mooncake,vllm_fs,lmcache]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import base_parser, emit, environment
from _intervals import ratio_summary, summary
from _peer_procs import ROOT, say
from _peers_mooncake import PATHS, ServerPlan, row_keys, run_mooncake, samples
from _peers_plots import draw_peer_plots
from _peers_scripts import (
    LMCACHE_ROWS,
    lmcache_lookup_samples,
    lmcache_samples,
    run_lmcache,
    run_vllm,
    vllm_samples,
)

from kvstore.config import parse_size

MiB = 1 << 20
PEERS = ("mooncake", "vllm_fs", "lmcache")
#: Each set-up script of ours, and what it makes.
SETUP = {
    "mooncake": ["bash", "benchmarks/peers/setup_mooncake.sh"],
    "vllm_fs": ["bash", "scripts/setup-vllm.sh"],
    "lmcache": ["bash", "benchmarks/peers/setup_lmcache.sh"],
}
TARGET = 1.0  #: every row: kvstore >= the peer (issue 53)
MEMCPY_TARGET = 0.8  #: the same-host 1 MiB path >= 0.8x memcpy
WHAT = {
    ("mooncake", "tcp"): "kvstore-server (TCP) vs Mooncake Store (TCP transport)",
    ("mooncake", "shm"): "kvstore-server shared memory vs Mooncake setup_dummy + mem pool",
    ("vllm_fs", "disk"): "KVStoreTier (disk) vs vLLM's fs tier; get = cold load",
    ("lmcache", "host"): "kvstore host tier vs LMCache LocalCPUBackend",
    ("lmcache", "disk_cold"): "kvstore disk tier vs LMCache LocalDiskBackend, cold",
    ("lmcache", "disk_warm"): "kvstore disk tier vs LMCache LocalDiskBackend, page cache",
}


# -- rows --------------------------------------------------------------------------------------
def make_row(
    peer: str,
    key: tuple[str, str, str, int],
    sides: dict[str, list[float]],
    unit: str,
    wrong: list[str] | None = None,
) -> dict[str, Any]:
    """One row: both sides' figures per rep summarized, their ratio, its status."""
    path, op, block, clients = key
    row: dict[str, Any] = {
        "id": f"{peer}_{path}_{op}_{block}_c{clients}",
        "peer": peer,
        "path": path,
        "op": op,
        "block": block,
        "clients": clients,
        "unit": unit,
        "what": WHAT.get((peer, path), ""),
        "kvstore": summary(sides["kvstore"]),
        "baseline": summary(sides["peer"]),
        "ratio": ratio_summary(sides["kvstore"], sides["peer"]),
        "status": "ok",
    }
    if wrong:
        row.update(status="failed", error="wrong bytes read back: " + "; ".join(wrong[:4]))
        row["ratio"] = None
    return row


def mooncake_rows(plan: ServerPlan, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The server rows from the timed reps; same-host rows carry memcpy for scale."""
    rows = []
    times, wrong = data["times"], data["wrong"]
    for key in row_keys(plan):
        path, op, size, clients = key
        of = samples(plan, times, key)
        unit = "keys/s" if op == "lookup" else "GB/s"
        sides = {"kvstore": of("kvstore"), "peer": of("mooncake")}
        row = make_row("mooncake", key, sides, unit, wrong_for(wrong, key))
        if path == "shm" and op in ("put", "get"):
            memcpy = of_memcpy(plan, times, size, clients)
            row["memcpy"] = summary(memcpy)
            row["kvstore_vs_memcpy"] = ratio_summary(sides["kvstore"], memcpy)
            row["baseline_vs_memcpy"] = ratio_summary(sides["peer"], memcpy)
        rows.append(row)
    return rows


def wrong_for(wrong: dict[str, list[str]], key: tuple[str, str, str, int]) -> list[str]:
    """The byte checks' findings that fail a row (``system path op: where``): its own reps,
    and for put and get rows the fill and the final verify of the same path and size."""
    path, op, size, clients = key
    found = []
    for name, items in wrong.items():
        system, wpath, wop, wsize, wclients = name.split("/")
        if wpath != path or wsize != size:
            continue
        if (wop, wclients) == (op, f"c{clients}") or (
            wop in ("fill", "verify") and op in ("put", "get")
        ):
            found += [f"{system} {wpath} {wop} {wsize} {wclients}: {w}" for w in items]
    return sorted(set(found))  # a warm-up rep and a timed one may find the same byte


def of_memcpy(
    plan: ServerPlan, times: dict[str, list[float]], size: str, clients: int
) -> list[float]:
    """The memcpy subject's GB/s per rep."""
    moved = plan.nbytes(size, clients)
    return [moved / t / 1e9 for t in times[f"kvstore/local/memcpy/{size}/c{clients}"]]


def script_rows(peer: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The vLLM fs tier's or LMCache's rows."""
    rows = []
    for size, result in data["by_size"].items():
        if peer == "vllm_fs":
            for op, metric in (("put", "store_gbps"), ("get", "load_gbps")):
                rows.append(
                    make_row(peer, ("disk", op, size, 1), vllm_samples(result, metric), "GB/s")
                )
            sides = vllm_samples(result, "lookups_per_s")
            rows.append(make_row(peer, ("disk", "lookup", size, 1), sides, "keys/s"))
            continue
        for op, path, kv, lmc in LMCACHE_ROWS:
            rows.append(
                make_row(peer, (path, op, size, 1), lmcache_samples(result, kv, lmc), "GB/s")
            )
        if size == "32MiB":
            key = ("host", "lookup", f"{result['lookup_keys']}keys", 1)
            rows.append(make_row(peer, key, lmcache_lookup_samples(result), "keys/s"))
    return rows


# -- the run -----------------------------------------------------------------------------------
def setup_peers(peers: list[str], args: Any) -> dict[str, str]:
    """Run our set-up script of each peer, into the venvs the arguments name; the peers
    whose set-up failed, and why."""
    env = {
        **os.environ,
        "KVSTORE_MOONCAKE_VENV": args.mooncake_venv,
        "KVSTORE_LMCACHE_VENV": args.lmcache_venv,
        "KVSTORE_VLLM_VENV": str(Path(args.vllm_python).parent.parent),
    }
    failed = {}
    for peer in peers:
        say(f"setting up {peer}: {' '.join(SETUP[peer])}")
        proc = subprocess.run(SETUP[peer], cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            failed[peer] = f"set-up failed ({' '.join(SETUP[peer])}):\n{proc.stderr[-2000:]}"
    return failed


def run_peer(peer: str, args: Any, plan: ServerPlan, workdir: Path) -> dict[str, Any]:
    """One peer's section: its raw result (``status`` ok, skipped or failed)."""
    rep = args.rep_mib * MiB
    if peer == "mooncake":
        return run_mooncake(plan, Path(args.mooncake_venv), workdir)
    if peer == "vllm_fs":
        return run_vllm(Path(args.vllm_python), rep, args.vllm_reps, args.script_timeout)
    return run_lmcache(
        Path(args.lmcache_venv), rep, args.lmcache_rounds, args.quick, args.script_timeout
    )


def collect(args: Any, plan: ServerPlan) -> dict[str, Any]:
    """Run every chosen peer; rows, skipped and failed peers, versions."""
    peers = args.peers
    skipped = setup_peers(peers, args) if args.setup else {}
    out: dict[str, Any] = {"rows": [], "skipped": {}, "failed": {}, "versions": {}, "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-peers-") as tmp:
        for peer in peers:
            if peer in skipped:
                out["skipped"][peer] = skipped[peer]
                continue
            start = time.perf_counter()
            data = run_peer(peer, args, plan, Path(tmp))
            out["seconds"][peer] = round(time.perf_counter() - start, 1)
            add_section(out, peer, plan, data)
    return out


def add_section(out: dict[str, Any], peer: str, plan: ServerPlan, data: dict[str, Any]) -> None:
    """Fold one peer's raw result into ``out`` (its rows, or why there are none)."""
    if data["status"] == "skipped":
        out["skipped"][peer] = data["reason"]
        say(f"skipped: {peer}: {data['reason']}")
        return
    if data["status"] == "failed":
        out["failed"][peer] = data["error"]
        say(f"FAILED: {peer}: {data['error']}")
        return
    if peer == "mooncake":
        out["versions"]["mooncake"] = data["version"]
        out["rows"] += mooncake_rows(plan, data)
    else:
        out["rows"] += script_rows(peer, data)
        first = next(iter(data["by_size"].values()))
        out["versions"][peer] = first.get("lmcache_version") or first.get("vllm_version")


def build_result(args: Any, plan: ServerPlan, out: dict[str, Any]) -> dict[str, Any]:
    """The JSON object."""
    rows = out["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    same_host_1mib = [r for r in ok if "kvstore_vs_memcpy" in r and r["block"] == "1MiB"]
    same_host_1mib = [r for r in same_host_1mib if r["clients"] == 1]
    return {
        "benchmark": "peers",
        "quick": bool(args.quick),
        "ratios": {r["id"]: r["ratio"]["median"] for r in ok},
        "vs_memcpy": {r["id"]: r["kvstore_vs_memcpy"]["median"] for r in same_host_1mib},
        "rows": rows,
        "skipped": out["skipped"],
        "failed": out["failed"],
        "failed_rows": [r["id"] for r in rows if r["status"] == "failed"],
        "targets": {"ratio": TARGET, "same_host_1MiB_vs_memcpy": MEMCPY_TARGET},
        "meets_target": {r["id"]: r["ratio"]["median"] >= TARGET for r in ok},
        "behind": sorted(r["id"] for r in ok if r["ratio"]["median"] < TARGET),
        "versions": out["versions"],
        "seconds": out["seconds"],
        "settings": settings(args, plan),
        "environment": environment(),
    }


def settings(args: Any, plan: ServerPlan) -> dict[str, Any]:
    """How the figures were taken."""
    return {
        "rep_bytes": plan.rep_bytes,
        "clients": plan.clients,
        "capacity_per_block_size": plan.capacity,
        "mooncake_segment": 2 * plan.capacity,
        "rounds": plan.rounds,
        "reps_per_round": plan.reps,
        "first_fill_reps": plan.first_fill_reps,
        "lookup_reps": plan.lookup_reps,
        "vllm_reps": args.vllm_reps,
        "lmcache_rounds": args.lmcache_rounds,
        "paths": PATHS,
        "interval": "90%, percentile bootstrap of the median (2000 resamples)",
    }


def cell(stats: dict[str, Any] | None) -> str:
    """``3.06 [2.91, 3.2]``."""
    if not stats:
        return "-"
    return f"{stats['median']:.3g} [{stats['lo']:.3g}, {stats['hi']:.3g}]"


HEADER = (
    "peer",
    "path",
    "op",
    "block",
    "clients",
    "kvstore",
    "peer",
    "unit",
    "kvstore/peer [90%]",
    ">= 1",
    "kvstore/memcpy",
)


def verdict(row: dict[str, Any]) -> str:
    """``yes`` (kvstore >= the peer), ``NO``, or ``FAILED`` (a wrong byte)."""
    if row["status"] != "ok":
        return str(row["status"]).upper()
    return "yes" if row["ratio"]["median"] >= TARGET else "NO"


def table(result: dict[str, Any]) -> list[list[object]]:
    """The header, then a line per row (both figures, the ratio, the verdict and, on the
    same-host path, kvstore against memcpy), then a line per skipped or failed peer."""
    lines: list[list[object]] = [list(HEADER)]
    for r in result["rows"]:
        lines.append(
            [
                r["peer"],
                r["path"],
                r["op"],
                r["block"],
                r["clients"],
                cell(r["kvstore"]),
                cell(r["baseline"]),
                r["unit"],
                cell(r["ratio"]),
                verdict(r),
                cell(r.get("kvstore_vs_memcpy")),
            ]
        )
    for peer, why in {**result["skipped"], **result["failed"]}.items():
        verb = "skipped" if peer in result["skipped"] else "FAILED"
        lines.append([peer, *["-"] * (len(HEADER) - 2), f"{verb}: {why.splitlines()[0]}"])
    return lines


# -- the command line --------------------------------------------------------------------------
def chosen_peers(only: str | None, parser: Any) -> list[str]:
    """``--only``'s peers in the order of :data:`PEERS` (all without it); a one-line error
    (exit status 2) for a name that is not a peer."""
    if not only:
        return list(PEERS)
    names = {p.strip() for p in only.split(",") if p.strip()}
    unknown = sorted(names - set(PEERS))
    if unknown or not names:
        parser.error(f"--only: unknown peer(s) {unknown or [only]}; choose from {', '.join(PEERS)}")
    return [p for p in PEERS if p in names]


def make_plan(args: Any) -> ServerPlan:
    """The server rows' plan; checked only where the Mooncake rows run (the other peers'
    scripts size their own runs from ``--rep-mib``)."""
    plan = ServerPlan(
        rep_bytes=args.rep_mib * MiB,
        clients=args.clients,
        capacity=args.capacity,
        rounds=args.rounds,
        reps=args.reps,
        first_fill_reps=args.first_fill_reps,
        lookup_reps=args.lookup_reps,
        plant=args.plant_wrong_byte,
    )
    problem = plan.problem() if "mooncake" in args.peers else None
    if problem:
        raise SystemExit(f"bench_peers: {problem}")
    return plan


def parse_args(argv: list[str] | None) -> Any:
    """Flags; ``--quick`` moves 128 MiB per rep, one round, one first fill per system."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated peers of {', '.join(PEERS)} (all)")
    parser.add_argument("--setup", action="store_true", help="run the peers' set-up scripts first")
    parser.add_argument("--out", type=Path, help="also write peers.json and the plots here")
    parser.add_argument("--rep-mib", type=int, default=None, help="MiB per rep (256; quick 128)")
    parser.add_argument("--clients", type=int, default=4, help="client processes (4)")
    parser.add_argument("--capacity", default=None, help="kvstore host tier per block size (1GiB)")
    parser.add_argument("--reps", type=int, default=1, help="server reps per subject per round")
    parser.add_argument(
        "--first-fill-reps", type=int, default=None, help="fresh starts (3; quick 1)"
    )
    parser.add_argument("--lookup-reps", type=int, default=20, help="lookups per lookup rep")
    parser.add_argument("--vllm-reps", type=int, default=None, help="vLLM tier reps (5; quick 2)")
    parser.add_argument(
        "--lmcache-rounds", type=int, default=None, help="LMCache rounds (5; quick 1)"
    )
    parser.add_argument(
        "--script-timeout", type=float, default=1200, help="per peer script run (s)"
    )
    parser.add_argument(
        "--mooncake-venv",
        default=os.environ.get("KVSTORE_MOONCAKE_VENV", str(ROOT / ".venv-mooncake")),
        help="Mooncake's venv ($KVSTORE_MOONCAKE_VENV; setup_mooncake.sh makes it)",
    )
    parser.add_argument(
        "--lmcache-venv",
        default=os.environ.get("KVSTORE_LMCACHE_VENV", str(ROOT / ".venv-lmcache")),
        help="LMCache's venv ($KVSTORE_LMCACHE_VENV; setup_lmcache.sh makes it)",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("KVSTORE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
        help="vLLM's Python ($KVSTORE_VLLM_PYTHON; scripts/setup-vllm.sh makes it)",
    )
    parser.add_argument(
        "--plant-wrong-byte",
        choices=("kvstore", "mooncake"),
        help="(tests) that system's server gets hand back one wrong byte each: the check must fail",
    )
    args = parser.parse_args(argv)
    args.peers = chosen_peers(args.only, parser)
    return fill_defaults(args)


def fill_defaults(args: Any) -> Any:
    """The settings left unset: a full run's, or ``--quick``'s (smaller, one round)."""
    quick = args.quick
    args.rep_mib = args.rep_mib or (128 if quick else 256)
    args.rounds = args.rounds or (1 if quick else 6)
    args.first_fill_reps = args.first_fill_reps or (1 if quick else 3)
    args.vllm_reps = args.vllm_reps or (2 if quick else 5)
    args.lmcache_rounds = args.lmcache_rounds or (1 if quick else 5)
    args.capacity = parse_size(args.capacity or ("512MiB" if quick else "1GiB"))
    if quick:
        args.lookup_reps = min(args.lookup_reps, 5)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every peer; print the table or one JSON object; 1 if a row or a peer failed."""
    args = parse_args(argv)
    # SIGTERM unwinds like an exception, so the servers and workers started get stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = make_plan(args)
    result = build_result(args, plan, collect(args, plan))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result["plots"] = draw_peer_plots(result, args.out)
        (args.out / "peers.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in result["rows"]:
        if row["status"] == "failed":
            say(f"FAILED ROW {row['id']}: {row['error']}")
    emit(result, args.json, table(result))
    return 1 if result["failed_rows"] or result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
