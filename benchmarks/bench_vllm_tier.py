"""vLLM's file-system secondary tier against kvstore's (``KVStoreTier``), same bytes, same disk.

Both tiers are built the way vLLM's ``SecondaryTierFactory`` builds them, over the same
primary memory (``--chunks`` chunks of ``--chunk-mib`` MiB, random bytes) and driven
with the same jobs (``--job-chunks`` chunks each, all submitted at once):

- store: every chunk into a fresh directory; seconds from the first submit until every
  job reported success (what vLLM waits for before the primary may evict).
- load, cold: the files are fsynced and dropped from the page cache
  (``posix_fadvise(DONTNEED)``), then every chunk is loaded back into the primary; the
  bytes are checked.
- lookups: every key of a new request until each answers HIT, re-asking after each
  ``on_schedule_end`` (vLLM's fs tier answers RETRY first and checks the files on its
  own thread; kvstore answers from its index); then 20 passes over every key, timed
  (the scheduler asks for each chunk every step).

vLLM's tier: ``fs`` with its defaults (O_DIRECT where the directory allows it, C I/O
threads). kvstore: one disk tier with ``page_cache: bypass`` (O_DIRECT writes: vLLM's CPU
primary is the memory cache, as docs/vllm.md recommends), checksums always on. The two
take turns within each repetition; figures are medians over ``--reps``, ratios the
median of the per-repetition ratios kvstore / vLLM (> 1: kvstore faster). kvstore's S3 tier is
measured on moto (a child process of ``--moto-python``), without a ratio: vLLM's object
tier needs NIXL.

Run: ``python benchmarks/bench_vllm_tier.py [--json] [--quick]`` (it re-runs itself with
``.venv-vllm``'s Python, where vLLM is).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
try:  # run from any venv (run_all.py): vLLM lives in the engines' own
    import vllm
except ImportError:
    if not VLLM_PYTHON.exists():  # an optional baseline: skipped, and why (exit 0)
        reason = "needs vLLM (neither here nor in .venv-vllm: bash scripts/setup-vllm.sh)"
        print(f"bench_vllm_tier: skipped: {reason}", file=sys.stderr)
        print(json.dumps({"bench": "vllm_tier", "skipped": True, "reason": reason}))
        sys.exit(0)
    os.execv(str(VLLM_PYTHON), [str(VLLM_PYTHON), __file__, *sys.argv[1:]])
sys.path.insert(0, str(ROOT / "tests" / "connectors"))

from _common import drop_cache  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm_offload_driver import END, MODULE, MotoProcess, key, make_spec  # noqa: E402

#: Passes over a request's chunks when timing lookups.
LOOKUP_PASSES = 200


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Primary:
    """Page-aligned primary memory: ``chunks`` rows of ``size`` random bytes."""

    def __init__(self, chunks: int, size: int) -> None:
        self.mm = mmap.mmap(-1, chunks * size)
        self.rows = np.frombuffer(self.mm, dtype=np.uint8).reshape(chunks, size)
        self.rows[:] = np.random.default_rng(0).integers(0, 256, self.rows.shape, np.uint8)
        self.expected = self.rows.copy()
        self.view = memoryview(self.rows)


def jobs(first_id: int, chunks: int, per_job: int, load: bool) -> list[TransferJob]:
    ctx = ReqContext(req_id="bench")
    return [
        TransferJob(
            job_id=first_id + i,
            keys=[key(c) for c in range(start, min(start + per_job, chunks))],
            chunk_ids=np.arange(start, min(start + per_job, chunks), dtype=np.int64),
            is_promotion=load,
            req_context=ctx,
        )
        for i, start in enumerate(range(0, chunks, per_job))
    ]


def run_jobs(tier: SecondaryTierManager, batch: list[TransferJob], load: bool) -> float:
    """Submit every job, wait until each reported; seconds. Raises on a failed job."""
    submit = tier.submit_load if load else tier.submit_store
    pending = {job.job_id for job in batch}
    start = time.perf_counter()
    for job in batch:
        submit(job)
    while pending:
        for result in tier.get_finished_jobs():
            if not result.success:
                raise RuntimeError(f"job {result.job_id} failed")
            pending.discard(result.job_id)
        time.sleep(0.0005)
    return time.perf_counter() - start


def drop_tree(path: Path) -> None:
    """Every file under ``path``, fsynced and dropped from the page cache."""
    os.sync()
    drop_cache([f for f in path.rglob("*") if f.is_file()])


def lookups(tier: SecondaryTierManager, chunks: int, rep: int) -> float:
    """Lookups per second of a request's every chunk, once each answers HIT (the
    scheduler asks each step), over ``LOOKUP_PASSES`` passes."""
    ctx = ReqContext(req_id=f"lookup-{rep}")
    tier.on_new_request(ctx)
    todo = [key(c) for c in range(chunks)]
    deadline = time.monotonic() + 30
    while todo:  # the first answers may be RETRY while a tier checks its medium
        results = [tier.lookup(k, ctx) for k in todo]
        if LookupResult.MISS in results or time.monotonic() > deadline:
            raise RuntimeError("a stored chunk was a miss")
        todo = [k for k, r in zip(todo, results, strict=True) if r is not LookupResult.HIT]
        tier.on_schedule_end(END)
        if todo:
            time.sleep(0.0002)
    every = [key(c) for c in range(chunks)]
    start = time.perf_counter()
    for _ in range(LOOKUP_PASSES):
        for k in every:
            tier.lookup(k, ctx)
    seconds = time.perf_counter() - start
    tier.on_request_finished(ctx)
    return LOOKUP_PASSES * chunks / seconds


def one_rep(
    config: dict[str, Any], primary: Primary, args: argparse.Namespace, rep: int, cold: bool
) -> dict[str, float]:
    chunks, nbytes = args.chunks, primary.rows.nbytes
    tier = SecondaryTierFactory.create_secondary_tier(dict(config), primary.view, make_spec())
    try:
        store_s = run_jobs(tier, jobs(0, chunks, args.job_chunks, False), load=False)
        if cold:
            drop_tree(Path(config.get("root_dir") or config["tiers"][0]["path"]))
        primary.rows[:] = 0
        load_s = run_jobs(tier, jobs(10_000, chunks, args.job_chunks, True), load=True)
        if not np.array_equal(primary.rows, primary.expected):
            raise RuntimeError("loaded bytes differ")
        rate = statistics.median(lookups(tier, chunks, rep * 10 + i) for i in range(3))
    finally:
        tier.shutdown()
    return {
        "store_gbps": nbytes / store_s / 1e9,
        "load_gbps": nbytes / load_s / 1e9,
        "lookups_per_s": rate,
    }


def measure(
    contenders: dict[str, Callable[[Path], dict[str, Any]]],
    primary: Primary,
    args: argparse.Namespace,
    base: Path,
    cold: bool = True,
) -> dict[str, list[dict[str, float]]]:
    """Each contender's figures per repetition; the contenders take turns within each
    repetition (first one, then the other), so drift on a shared machine hits both."""
    reps: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for rep in range(args.reps):
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        for name in order:
            work = base / f"{name}-{rep}"
            work.mkdir(parents=True)
            try:
                reps[name].append(one_rep(contenders[name](work), primary, args, rep, cold))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            log(f"{name} rep {rep}: {reps[name][-1]}")
    return reps


def medians(reps: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over repetitions."""
    return {k: statistics.median(r[k] for r in reps) for k in reps[0]}


def kvstore_disk(path: Path) -> dict[str, Any]:
    # vLLM's CPU primary tier is the memory cache here: kvstore's disk tier should not keep
    # a second copy in the page cache (docs/vllm.md recommends bypass), as vLLM's fs tier
    # writes with O_DIRECT too.
    disk = {
        "kind": "disk",
        "path": str(path),
        "capacity": "8GiB",
        "page_cache": "bypass",
        "io_threads": 16,  # reads and writes in flight: vLLM's tier runs 16 + 16 threads
    }
    return {"type": "KVStoreTier", "module_path": MODULE, "tiers": [disk], "discover": False}


def vllm_fs(path: Path) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(path)}


def s3_figures(primary: Primary, args: argparse.Namespace, base: Path) -> dict[str, float]:
    server = MotoProcess(args.moto_python)
    try:

        def make(path: Path) -> dict[str, Any]:
            s3 = {
                "kind": "s3",
                "bucket": server.bucket,
                "endpoint_url": server.url,
                "prefix": path.name,
                "codec": "raw",
            }
            return {"type": "KVStoreTier", "module_path": MODULE, "tiers": [s3]}

        return medians(measure({"kvstore_s3": make}, primary, args, base, cold=False)["kvstore_s3"])
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")
    parser.add_argument("--quick", action="store_true", help="16 chunks, 2 reps")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--job-chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: /var/tmp)")
    parser.add_argument("--moto-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--rounds", type=int, default=None, help="the same as --reps")
    args = parser.parse_args()
    if args.rounds:
        args.reps = args.rounds
    if args.quick:
        args.chunks, args.reps = 16, 2
    size = int(args.chunk_mib * 2**20) // mmap.PAGESIZE * mmap.PAGESIZE
    primary = Primary(args.chunks, size)
    base = Path(tempfile.mkdtemp(prefix="bench-vllm-tier-", dir=args.dir or "/var/tmp"))
    try:
        reps = measure({"vllm_fs": vllm_fs, "kvstore_disk": kvstore_disk}, primary, args, base)
        fs, kv = medians(reps["vllm_fs"]), medians(reps["kvstore_disk"])
        result: dict[str, Any] = {
            "bench": "vllm_tier",
            "vllm_version": vllm.__version__,
            "chunks": args.chunks,
            "chunk_bytes": size,
            "job_chunks": args.job_chunks,
            "reps": args.reps,
            "per_rep": reps,  # every repetition's figures (bench_peers.py's intervals)
        }
        for metric, ratio in (
            ("store_gbps", "store"),
            ("load_gbps", "load"),
            ("lookups_per_s", "lookup"),
        ):
            result[f"vllm_fs_{metric}"] = round(fs[metric], 3)
            result[f"kvstore_{metric}"] = round(kv[metric], 3)
            per_rep = [
                k[metric] / f[metric]
                for k, f in zip(reps["kvstore_disk"], reps["vllm_fs"], strict=True)
            ]
            result[f"{ratio}_ratio_vs_vllm_fs"] = round(statistics.median(per_rep), 3)
        if os.path.exists(args.moto_python):
            s3 = s3_figures(primary, args, base)
            result.update({f"kvstore_s3_{k}": round(v, 3) for k, v in s3.items()})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
