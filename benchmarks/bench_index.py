"""In-process index memory: bytes per stored block at 10K, 100K and 1M blocks.

A store with one host tier of tiny blocks (1 layer x 1 KV head x head_dim 1
x 256 tokens, uint8: 512 bytes of KV each, so 1M blocks fit in ~0.6 GiB) is
filled with random 16-byte keys in puts of 4096 blocks, as ``bench_hash.py
--scaling`` fills it. What the store keeps per block besides the KV bytes --
the key, the manager's index entry, the eviction policy's and the tier's
maps -- is measured two ways, each in its own fill:

- ``traced``: :mod:`tracemalloc`, Python allocations made during the fill
  and still alive after it (the caller's references to the keys are gone),
  per block. Independent of the allocator; the headline figure,
  ``index_bytes_per_block`` (at the largest size; target <= 256).
- ``rss``: growth of the process's resident memory during the fill, minus
  the KV bytes the slab's pages hold (``prefault: false``, so only pages the
  blocks use are touched), per block. Adds what the allocators keep around
  (pymalloc arenas, dict over-allocation); noisier.

Each size is a point of one growing store (the fill goes on from the last
size). The Redis index of a cluster is measured by ``bench_cluster.py``
(``redis_bytes_per_block``).

Run: ``python benchmarks/bench_index.py [--json] [--quick] [--sizes 10000,100000]``.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import base_parser, emit, environment, log

from kvstore import KVLayout, KVStore, StoreConfig

TARGET_BYTES_PER_BLOCK = 256.0
BATCH = 4096


def tiny_layout() -> KVLayout:
    """512 bytes of KV per 256-token block."""
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=256, dtype=torch.uint8)


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def open_store(layout: KVLayout, blocks: int) -> KVStore:
    """A host tier with room for ``blocks`` under its high watermark, not prefaulted."""
    slots = int(blocks / 0.85) + 1
    tier = {"kind": "host", "capacity": slots * layout.block_nbytes, "prefault": False}
    return KVStore(layout, StoreConfig.from_dict({"tiers": [tier]}, environ={}))


def fill(store: KVStore, n: int, rng: np.random.Generator) -> None:
    """Store ``n`` more blocks under random keys (the caller keeps no reference to them)."""
    layout = store.layout
    kv = torch.zeros(layout.tensor_shape(BATCH), dtype=layout.dtype)
    left = n
    while left:
        k = min(BATCH, left)
        raw = rng.bytes(16 * k)
        keys = [raw[i : i + 16] for i in range(0, 16 * k, 16)]
        chunk = kv if k == BATCH else kv[:, :, : k * layout.block_tokens]
        stored = store.put(keys, chunk)
        assert stored == k, f"put stored {stored} of {k}"
        left -= k


def measure(sizes: list[int], probe: Callable[[], int], traced: bool) -> list[dict[str, Any]]:
    """Fill one store through ``sizes``; ``probe()`` bytes at each size minus at the start."""
    layout = tiny_layout()
    rng = np.random.default_rng(0)
    points: list[dict[str, Any]] = []
    with open_store(layout, max(sizes)) as store:
        gc.collect()
        if traced:
            tracemalloc.start()
        base, stored = probe(), 0
        try:
            for size in sizes:
                start = time.perf_counter()
                fill(store, size - stored, rng)
                stored = size
                gc.collect()
                grown = probe() - base
                if not traced:  # the slab pages the KV bytes themselves occupy
                    grown -= size * layout.block_nbytes
                seconds = time.perf_counter() - start
                log(f"  {size} blocks: {grown / size:.0f} B/block ({seconds:.1f} s to fill)")
                points.append({"stored_blocks": size, "bytes_per_block": grown / size})
        finally:
            if traced:
                tracemalloc.stop()
    return points


def traced_bytes() -> int:
    """Python allocations alive now, as traced since :func:`tracemalloc.start`."""
    return tracemalloc.get_traced_memory()[0]


def run(sizes: list[int]) -> dict[str, Any]:
    """Both measurements at every size, and the headline figures."""
    log(f"index memory, RSS growth: {sizes} blocks")
    rss = measure(sizes, rss_bytes, traced=False)
    log(f"index memory, tracemalloc: {sizes} blocks")
    traced = measure(sizes, traced_bytes, traced=True)
    scaling = [
        {
            "stored_blocks": t["stored_blocks"],
            "traced_bytes_per_block": t["bytes_per_block"],
            "rss_bytes_per_block": r["bytes_per_block"],
        }
        for t, r in zip(traced, rss, strict=True)
    ]
    top = scaling[-1]
    value = top["traced_bytes_per_block"]
    return {
        "benchmark": "index",
        "index_bytes_per_block": value,
        "rss_bytes_per_block": top["rss_bytes_per_block"],
        "index_bytes_per_block_at": top["stored_blocks"],
        "target_bytes_per_block": TARGET_BYTES_PER_BLOCK,
        "meets_target": value <= TARGET_BYTES_PER_BLOCK,
        "kv_bytes_per_block": tiny_layout().block_nbytes,
        "index_scaling": scaling,
        "environment": environment(),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="stored-block counts, ascending (default 10000,100000,1000000; quick: up to 100K)",
    )
    args = parser.parse_args(argv)
    sizes = sorted(
        args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    )
    result = run(sizes)
    rows: list[list[object]] = [["stored blocks", "traced B/block", "RSS B/block", "target"]]
    for p in result["index_scaling"]:
        rows.append(
            [p["stored_blocks"], p["traced_bytes_per_block"], p["rss_bytes_per_block"], "<= 256"]
        )
    rows.append(["meets target (traced, largest)", result["meets_target"], "", ""])
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
