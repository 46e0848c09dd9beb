"""Host DRAM tier put/get throughput through ``KVStore`` vs a raw memcpy of the same bytes.

Geometry: an 8B Llama (32 layers, 8 KV heads, head_dim 128, 256 tokens per
block, bf16): 32 MiB per block. Each rep moves ``--blocks`` blocks in calls
of ``--batch-blocks`` (default 16 and 16: one 512 MiB call).

- put: ``store.put(keys, kv)`` with NEW keys every rep (the previous rep's
  keys are deleted outside the timed region; otherwise put dedups and copies
  nothing). Freed slots are reused, so the tier's memory is already touched.
- get: ``store.get(keys, out=buf)`` into a prefaulted ``buf``.
- baseline: the faster of torch ``dst.copy_(src)`` and ``ctypes.memmove`` on
  contiguous buffers of the same size, per batch (both are reported).
- first fill: the same puts into a host tier opened just before (a new store
  per rep, ``--first-fill-capacity``, 4 GiB by default like the embedded
  default), whose memory no block has touched yet: right after open (the
  prefault thread, ``prefault: true``, runs beside the puts and competes with
  them for memory bandwidth), after waiting for the prefault to finish
  (``first_fill_after_prefault``), and with ``prefault: false``
  (``first_fill_no_prefault``: every page faults on the put's copy, the
  behaviour before the prefault existed). Two baselines: steady ``memcpy``
  (above; the target: first fill / steady memcpy == ``put_ratio``) and
  ``first_touch_memcpy``, the same copies into a freshly mapped region
  (``mmap`` + ``MADV_HUGEPAGE``, as the slab), i.e. what page faults cost;
  and ``prefaulted_copy``, the same copies into a region mapped *and
  prefaulted* as the slab is (``MADV_POPULATE_WRITE`` over the whole
  capacity, then the copies): what a fresh slab's first fill can reach on
  this machine (``put_first_fill_after_prefault_ratio_vs_prefaulted``).
  Each of these reps first pauses ``--settle-s`` (3 s) untimed, so memory the
  previous rep freed goes back to the host (free page reporting) and is cold
  again, as at a process's start.
- diagnostics (not baselines): ``blockwise_copy`` is ``slot.copy_(chunk)`` per
  32 MiB block from the same ``kv`` into a slab -- the copies the tier itself
  makes, without the store around them -- and ``blockwise_memmove`` makes the
  same per-block copies with ``ctypes.memmove`` per contiguous run. They show
  whether a shortfall is the store's bookkeeping or the per-block copy calls.

Timing: interleaved rounds (a block of reps of each subject per round,
order reversed on odd rounds); every figure is a median over reps.
``--profile`` runs cProfile over extra put and get reps and prints the top
entries to stderr.

Run: ``python benchmarks/bench_host_tier.py [--json] [--quick]``.
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import io
import itertools
import mmap
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.config import parse_size

TARGET_RATIO = 0.8


def llama8b_layout(num_layers: int = 32) -> KVLayout:
    """The KV layout of Llama-3-8B (GQA, 8 KV heads), bf16, 256-token blocks."""
    return KVLayout(
        num_layers=num_layers,
        num_kv_heads=8,
        head_dim=128,
        block_tokens=256,
        dtype=torch.bfloat16,
    )


class HostTierBench:
    """Buffers, store and the timed reps of one configuration."""

    def __init__(
        self, layout: KVLayout, blocks: int, batch: int, capacity: int, prefault: bool = True
    ) -> None:
        if blocks % batch:
            raise SystemExit(f"--blocks ({blocks}) must be a multiple of --batch-blocks ({batch})")
        slots = capacity // layout.block_nbytes
        if 2 * blocks > 0.9 * slots:  # get set + put set must stay under the high watermark
            raise SystemExit(f"--capacity holds {slots} blocks; need > {2 * blocks / 0.9:.0f}")
        self.layout, self.blocks, self.batch = layout, blocks, batch
        self.nbytes = blocks * layout.block_nbytes
        self.nbatches = blocks // batch
        gen = torch.Generator().manual_seed(0)
        shape = layout.tensor_shape(batch)
        # The data to store: one contiguous tensor per call, random (incompressible) bytes.
        self.kv = [
            torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype)
            for _ in range(self.nbatches)
        ]
        # Destinations, written once so every page is committed before timing.
        self.out = [torch.full(shape, 1.0, dtype=layout.dtype) for _ in range(self.nbatches)]
        self.dst = [torch.full(shape, 1.0, dtype=layout.dtype) for _ in range(self.nbatches)]
        self.slab = torch.full((batch, *layout.block_shape), 1.0, dtype=layout.dtype)
        tier = {"kind": "host", "capacity": capacity, "prefault": prefault}
        self.store = KVStore(layout, StoreConfig.from_dict({"tiers": [tier]}, environ={}))
        # Steady state: every page the reps touch is committed before timing.
        self.store.engine.datapath.tiers[0].wait_prefault()  # type: ignore[attr-defined]
        self._counter = itertools.count()
        self.get_keys = [self._fresh_keys() for _ in range(self.nbatches)]
        for keys, kv in zip(self.get_keys, self.kv, strict=True):
            assert self.store.put(keys, kv) == batch
        self.put_keys: list[list[bytes]] = []

    def _fresh_keys(self) -> list[bytes]:
        n = next(self._counter)
        return [n.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(self.batch)]

    # -- reps (each returns the seconds it timed) ----------------------------
    def put(self) -> float:
        """Store every batch under new keys (the previous rep's are deleted first, untimed)."""
        for keys in self.put_keys:
            self.store.delete(keys)
        self.put_keys = [self._fresh_keys() for _ in range(self.nbatches)]
        start = time.perf_counter()
        for keys, kv in zip(self.put_keys, self.kv, strict=True):
            self.store.put(keys, kv)
        elapsed = time.perf_counter() - start
        return elapsed

    def get(self) -> float:
        """Load every batch into its prefaulted ``out`` tensor."""
        start = time.perf_counter()
        for keys, out in zip(self.get_keys, self.out, strict=True):
            self.store.get(keys, out=out)
        return time.perf_counter() - start

    def torch_copy(self) -> None:
        """Baseline: contiguous ``dst.copy_(src)`` per batch."""
        for dst, src in zip(self.dst, self.kv, strict=True):
            dst.copy_(src)

    def memmove(self) -> None:
        """Baseline: ``ctypes.memmove`` of the same bytes per batch."""
        for dst, src in zip(self.dst, self.kv, strict=True):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())

    def blockwise_copy(self) -> None:
        """Diagnostic: the tier's own copy pattern, ``slot.copy_(chunk)`` per block."""
        step = self.layout.block_tokens
        for kv in self.kv:
            for i in range(self.batch):
                self.slab[i].copy_(kv[:, :, i * step : (i + 1) * step])

    def blockwise_memmove(self) -> None:
        """Diagnostic: the same per-block copies as ``ctypes.memmove`` per contiguous run."""
        step = self.layout.block_tokens
        for kv in self.kv:
            for i in range(self.batch):
                src = kv[:, :, i * step : (i + 1) * step].flatten(0, 1)  # (layers * kv, ...)
                dst = self.slab[i].flatten(0, 1)
                run = src[0].numel() * src.element_size()
                for j in range(src.shape[0]):
                    ctypes.memmove(dst[j].data_ptr(), src[j].data_ptr(), run)

    def check(self) -> None:
        """The store handed back exactly what was put (checked outside any timing)."""
        for keys, kv, out in zip(self.get_keys, self.kv, self.out, strict=True):
            out.zero_()
            self.store.get(keys, out=out)
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), "get returned wrong KV"
        for keys in self.put_keys:
            assert self.store.lookup(keys) == self.batch, "put did not store its blocks"

    def close(self) -> None:
        """Release the store."""
        self.store.close()


class FirstFill:
    """Puts into a freshly opened host tier, and the same copies into fresh memory.

    Every rep opens a new store (untimed), times its puts of new keys, and
    closes it (untimed). Before that, untimed: ``gc.collect()``, so the previous
    rep's slab is unmapped, then ``settle_s`` of sleep: in a VM with free page
    reporting (virtio-balloon, as here) the guest hands freed memory back to
    the host after ~2 s, and the next first touch of it faults on the host too
    -- what a process starting on a fresh machine meets. Without the pause a
    rep would reuse pages the previous one just freed, still backed.
    """

    def __init__(self, bench: HostTierBench, capacity: int, settle_s: float) -> None:
        self.bench, self.capacity, self.settle_s = bench, capacity, settle_s
        self._counter = itertools.count()

    def _settle(self) -> None:
        gc.collect()
        time.sleep(self.settle_s)

    def put(self, prefault: bool, wait: bool) -> Rep:
        """A rep: open a store (``prefault``; ``wait`` for it to finish), time the puts."""

        def rep() -> float:
            self._settle()
            tier = {"kind": "host", "capacity": self.capacity, "prefault": prefault}
            store = KVStore(self.bench.layout, StoreConfig.from_dict({"tiers": [tier]}, environ={}))
            try:
                if wait:
                    store.engine.datapath.tiers[0].wait_prefault()  # type: ignore[attr-defined]
                batches = [self._fresh_keys() for _ in self.bench.kv]
                start = time.perf_counter()
                for keys, kv in zip(batches, self.bench.kv, strict=True):
                    store.put(keys, kv)
                elapsed = time.perf_counter() - start
                assert store.lookup(batches[-1]) == self.bench.batch, "first fill lost blocks"
                return elapsed
            finally:
                store.close()

        return rep

    def _fresh_keys(self) -> list[bytes]:
        n = next(self._counter)
        return [
            b"ff" + n.to_bytes(6, "little") + i.to_bytes(8, "little")
            for i in range(self.bench.batch)
        ]

    def prefaulted_copy(self) -> float:
        """Baseline: the same copies into a region mapped and prefaulted as the slab is
        (``capacity`` bytes, ``MADV_HUGEPAGE``, ``MADV_POPULATE_WRITE`` in 8 MiB steps),
        timed once the prefault is done: what a fresh slab's first fill can reach."""
        self._settle()
        region = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            region.madvise(advice)
        buf = torch.frombuffer(region, dtype=torch.uint8)
        _populate(buf.data_ptr(), self.capacity)
        step = self.bench.nbytes // self.bench.nbatches
        dsts = [buf[i * step : (i + 1) * step] for i in range(self.bench.nbatches)]
        try:
            start = time.perf_counter()
            for dst, src in zip(dsts, self.bench.kv, strict=True):
                dst.copy_(src.view(-1).view(torch.uint8))
            return time.perf_counter() - start
        finally:
            del buf, dsts
            region.close()

    def first_touch(self, use_memmove: bool) -> float:
        """Baseline: copy the batches into a freshly mapped region (as the slab is mapped)."""
        self._settle()
        region = mmap.mmap(-1, self.bench.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            region.madvise(advice)
        buf = torch.frombuffer(region, dtype=torch.uint8)
        step = self.bench.nbytes // self.bench.nbatches
        dsts = [buf[i * step : (i + 1) * step] for i in range(self.bench.nbatches)]
        try:
            start = time.perf_counter()
            for dst, src in zip(dsts, self.bench.kv, strict=True):
                if use_memmove:
                    ctypes.memmove(dst.data_ptr(), src.data_ptr(), step)
                else:
                    dst.copy_(src.view(-1).view(torch.uint8))
            return time.perf_counter() - start
        finally:
            del buf, dsts
            region.close()


def _populate(address: int, nbytes: int, step: int = 8 << 20) -> None:
    """``madvise(MADV_POPULATE_WRITE)`` over ``nbytes`` from ``address``, in steps (Linux >= 5.14;
    elsewhere the pages are left to fault on the copy)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for offset in range(0, nbytes, step):
        if madvise(address + offset, min(step, nbytes - offset), 23) != 0:
            return


def profile(fn: Callable[[], object], reps: int, top: int = 12) -> str:
    """cProfile ``reps`` calls of ``fn``; the top entries by total time, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=None, help="blocks moved per rep (16)")
    parser.add_argument("--batch-blocks", type=int, default=None, help="blocks per call (16)")
    parser.add_argument("--layers", type=int, default=32, help="layers per block (32: 32 MiB)")
    parser.add_argument("--capacity", default="4GiB", help="host tier capacity (steady state)")
    parser.add_argument(
        "--first-fill-capacity", default=None, help="host tier of the first-fill reps (4GiB)"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="untimed pause before each first-fill rep, for freed memory to go back to the "
        "host (3; --quick: 0)",
    )
    parser.add_argument("--reps", type=int, default=3, help="reps per subject per round")
    parser.add_argument("--profile", action="store_true", help="cProfile put/get to stderr")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    batch = args.batch_blocks or (2 if args.quick else 16)
    blocks = args.blocks or batch
    rounds = args.rounds or (2 if args.quick else 12)
    layout = llama8b_layout(args.layers)
    fill_capacity = parse_size(args.first_fill_capacity or ("1GiB" if args.quick else "4GiB"))
    log(
        f"host tier: {blocks} x {layout.block_nbytes / 2**20:.0f} MiB blocks per rep, "
        f"{batch} per call, {rounds} rounds x {args.reps} reps; first fill into "
        f"{fill_capacity / 2**30:.1f} GiB tiers"
    )
    bench = HostTierBench(layout, blocks, batch, parse_size(args.capacity))
    try:
        settle = args.settle_s if args.settle_s is not None else (0.0 if args.quick else 3.0)
        fill = FirstFill(bench, fill_capacity, settle)
        times = run_rounds(_subjects(bench, fill, args.reps), rounds)
        bench.check()
        if args.profile:
            log(profile(bench.put, 3))
            log(profile(bench.get, 3))
        stats = bench.store.stats()
    finally:
        bench.close()
    result, rows = _report(bench, layout, times, stats)
    result["first_fill_capacity"] = fill_capacity
    result["first_fill_settle_s"] = fill.settle_s
    emit(result, args.json, rows)
    return 0


def _subjects(bench: HostTierBench, fill: FirstFill, reps: int) -> dict[str, tuple[Rep, int]]:
    """Every timed subject: (rep, reps per round). First-fill reps open a store each: 1."""
    return {
        "put": (bench.put, reps),
        "torch_copy": (timed(bench.torch_copy), reps),
        "get": (bench.get, reps),
        "memmove": (timed(bench.memmove), reps),
        "blockwise_copy": (timed(bench.blockwise_copy), reps),
        "blockwise_memmove": (timed(bench.blockwise_memmove), reps),
        "first_fill": (fill.put(prefault=True, wait=False), 1),
        "first_fill_after_prefault": (fill.put(prefault=True, wait=True), 1),
        "first_fill_no_prefault": (fill.put(prefault=False, wait=False), 1),
        "prefaulted_copy": (fill.prefaulted_copy, 1),
        "first_touch_copy": (lambda: fill.first_touch(use_memmove=False), 1),
        "first_touch_memmove": (lambda: fill.first_touch(use_memmove=True), 1),
    }


def _report(
    bench: HostTierBench, layout: KVLayout, times: dict[str, list[float]], stats: dict[str, Any]
) -> tuple[dict[str, Any], list[list[object]]]:
    """The JSON object and the table rows (every ratio's baseline: the steady memcpy)."""
    gbps = {name: bench.nbytes / median(t) / 1e9 for name, t in times.items()}
    memcpy = max(gbps["torch_copy"], gbps["memmove"])
    first_touch = max(gbps["first_touch_copy"], gbps["first_touch_memmove"])
    put_ratio, get_ratio = gbps["put"] / memcpy, gbps["get"] / memcpy
    fills = ("first_fill", "first_fill_after_prefault", "first_fill_no_prefault")
    result: dict[str, Any] = {
        "benchmark": "host_tier",
        "put_gbps": gbps["put"],
        "get_gbps": gbps["get"],
        "memcpy_gbps": memcpy,
        "put_ratio": put_ratio,
        "get_ratio": get_ratio,
        # First fill, baseline: the steady memcpy (target: the same as put_ratio) ...
        **{f"put_{f}_ratio": gbps[f] / memcpy for f in fills},
        # ... and the same copies into freshly mapped memory (what faults cost).
        **{f"put_{f}_ratio_vs_first_touch": gbps[f] / first_touch for f in fills},
        **{f"put_{f}_gbps": gbps[f] for f in fills},
        # ... and the same copies into memory mapped and prefaulted as the slab is, at
        # once: what the medium allows a first fill on this machine.
        "put_first_fill_after_prefault_ratio_vs_prefaulted": (
            gbps["first_fill_after_prefault"] / gbps["prefaulted_copy"]
        ),
        "prefaulted_copy_gbps": gbps["prefaulted_copy"],
        "first_touch_memcpy_gbps": first_touch,
        "first_touch_copy_gbps": gbps["first_touch_copy"],
        "first_touch_memmove_gbps": gbps["first_touch_memmove"],
        "first_fill_baseline": "memcpy_gbps (steady); *_vs_first_touch: first_touch_memcpy_gbps",
        "torch_copy_gbps": gbps["torch_copy"],
        "memmove_gbps": gbps["memmove"],
        "blockwise_copy_gbps": gbps["blockwise_copy"],
        "blockwise_memmove_gbps": gbps["blockwise_memmove"],
        "block_mib": layout.block_nbytes / 2**20,
        "batch_blocks": bench.batch,
        "blocks_per_rep": bench.blocks,
        "bytes_per_rep": bench.nbytes,
        "target_ratio": TARGET_RATIO,
        "meets_target": {"put": put_ratio >= TARGET_RATIO, "get": get_ratio >= TARGET_RATIO},
        "reps": {name: len(t) for name, t in times.items()},
        "tier_pinned": stats["tiers"][0]["pinned"],
        "environment": environment(),
    }
    return result, _rows(gbps, memcpy, first_touch, result["meets_target"])


def _rows(
    gbps: dict[str, float], memcpy: float, first_touch: float, meets: dict[str, bool]
) -> list[list[object]]:
    """The human table: GB/s and the ratio to the steady memcpy of every subject."""
    rows: list[list[object]] = [
        ["what", "GB/s (median)", "ratio to memcpy", "target", "meets"],
        ["store.put", gbps["put"], gbps["put"] / memcpy, ">= 0.8", meets["put"]],
        ["store.get(out=)", gbps["get"], gbps["get"] / memcpy, ">= 0.8", meets["get"]],
    ]
    for label, name in (
        ("first fill, right after open", "first_fill"),
        ("first fill, prefault done", "first_fill_after_prefault"),
        ("first fill, prefault: false", "first_fill_no_prefault"),
    ):
        rows.append([label, gbps[name], gbps[name] / memcpy])
    rows.append(["first-touch memcpy (baseline)", first_touch, first_touch / memcpy])
    prefaulted = gbps["prefaulted_copy"]
    rows.append(["copy into prefaulted fresh memory (baseline)", prefaulted, prefaulted / memcpy])
    for label, name in (
        ("torch copy_ (baseline)", "torch_copy"),
        ("ctypes.memmove (baseline)", "memmove"),
        ("per-block copy_ (diagnostic)", "blockwise_copy"),
        ("per-block memmove (diagnostic)", "blockwise_memmove"),
    ):
        rows.append([label, gbps[name], gbps[name] / memcpy])
    return rows


if __name__ == "__main__":
    sys.exit(main())
