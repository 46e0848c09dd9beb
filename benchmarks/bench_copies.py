"""The copy engine (kvstore.copies) against one raw ``dst.copy_(src)`` of the same bytes.

Subjects, each timed per call and reported as a ratio of throughput to a single
raw ``dst.copy_(src)`` of the same number of bytes between two contiguous
buffers, measured in the same run (interleaved rounds, medians over reps):

- ``copy_all_adjacent``: ``engine.copy_all`` of ``--blocks`` (16) adjacent
  ``--block-mib`` (32) MiB blocks, block ``i`` of one buffer into block ``i`` of
  another: coalesced into one copy (``adjacent_copies``).
- ``per_pair_adjacent`` (diagnostic): the same pairs, one ``copy_`` each, no engine.
- ``copy_all_scattered``: the same blocks between shuffled slots of both buffers
  (``scattered_copies``: what is left after coalescing; a run of two pairs in
  rising order on both sides still merges into a strided copy).
- ``lane_submit_wait``: ``lane.submit(adjacent pairs).wait()`` on a lane's worker
  thread: coalescing, the hand-off and the wake-up included.
- ``small_blocks``: ``--small-blocks`` (1024) adjacent ``--small-kib`` (16) KiB blocks
  through ``copy_all`` and one ``copy_`` per pair, against a raw copy of the same bytes:
  where the per-call overhead coalescing removes is most of the cost.
- ``layer_slices``: layer ``l`` of 16 consecutive slab slots (32 layers a slot):
  coalesced into one strided copy, and one ``copy_`` per slot, against a raw
  contiguous copy of the same bytes.

Coalescing inspects every pair in Python (~1.5-2 us a pair here), about what a
``copy_`` call of a small tensor costs: on a CPU it pays where one copy runs in
parallel instead of many small single-threaded ones and releases the GIL once;
on a GPU, where each copy is a launch, it pays far more.

Run: ``python benchmarks/bench_copies.py [--json] [--quick]``.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed

from kvstore.copies import CopyPair, ThreadCopyEngine, coalesce

TARGET_RATIO = 0.95  # a copy can't beat the copy it is made of; DESIGN.md's memory-tier bar


def blocks_of(buf: torch.Tensor, count: int) -> list[torch.Tensor]:
    return list(buf.view(count, -1).unbind(0))


def one_by_one(pairs: list[CopyPair]) -> Callable[[], None]:
    def run() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    return run


class CopiesBench:
    """Buffers, pairs and the timed reps."""

    def __init__(self, blocks: int, block_bytes: int, small: tuple[int, int]) -> None:
        self.blocks, self.block_bytes = blocks, block_bytes
        self.nbytes = blocks * block_bytes
        self.src = torch.randn(self.nbytes // 4)  # fp32: every page touched
        self.dst = torch.zeros(self.nbytes // 4)
        srcs, dsts = blocks_of(self.src, blocks), blocks_of(self.dst, blocks)
        self.adjacent = list(zip(dsts, srcs, strict=True))
        rng = random.Random(0)
        dslots, sslots = list(range(blocks)), list(range(blocks))
        rng.shuffle(dslots)
        rng.shuffle(sslots)
        self.scattered = [(dsts[d], srcs[s]) for d, s in zip(dslots, sslots, strict=True)]
        self.engine = ThreadCopyEngine()
        self.lane = self.engine.lane("bench")
        count, kib = small
        self.small_nbytes = count * kib * 1024
        self.small_src, self.small_dst = (
            self.src[: self.small_nbytes // 4],
            self.dst[: self.small_nbytes // 4],
        )
        self.small = list(
            zip(blocks_of(self.small_dst, count), blocks_of(self.small_src, count), strict=True)
        )
        # A slab of 16 slots x 32 layers over ``dst``: layer 5 of every slot, from ``src``.
        layer_elems = self.nbytes // 4 // (blocks * 32)
        slab = self.dst.view(blocks, 32, layer_elems)
        self.layer_nbytes = blocks * layer_elems * 4
        layer_src = self.src[: blocks * layer_elems].view(blocks, layer_elems)
        self.layers = [(slab[i, 5], layer_src[i]) for i in range(blocks)]
        self.layer_raw = (self.dst[-blocks * layer_elems :], layer_src.flatten())  # same source

    def raw(self) -> None:
        self.dst.copy_(self.src)

    def raw_small(self) -> None:
        self.small_dst.copy_(self.small_src)

    def raw_layer(self) -> None:
        self.layer_raw[0].copy_(self.layer_raw[1])

    def lane_submit_wait(self) -> None:
        event = self.lane.submit(self.adjacent)
        event.wait()
        if event.error is not None:
            raise event.error

    def check(self) -> None:
        """The copies landed where they should (outside the timed region)."""
        for pairs in (self.adjacent, self.scattered, self.small, self.layers):
            self.dst.zero_()
            self.engine.copy_all(pairs)
            assert all(torch.equal(d, s) for d, s in pairs)

    def close(self) -> None:
        self.engine.close()

    def subjects(self, reps: int) -> dict[str, tuple[Rep, int]]:
        copy_all = self.engine.copy_all
        return {
            "raw": (timed(self.raw), reps),
            "copy_all_adjacent": (timed(lambda: copy_all(self.adjacent)), reps),
            "per_pair_adjacent": (timed(one_by_one(self.adjacent)), reps),
            "copy_all_scattered": (timed(lambda: copy_all(self.scattered)), reps),
            "lane_submit_wait": (timed(self.lane_submit_wait), reps),
            "raw_small": (timed(self.raw_small), 4 * reps),
            "copy_all_small": (timed(lambda: copy_all(self.small)), 4 * reps),
            "per_pair_small": (timed(one_by_one(self.small)), 4 * reps),
            "raw_layer": (timed(self.raw_layer), 4 * reps),
            "copy_all_layer": (timed(lambda: copy_all(self.layers)), 4 * reps),
            "per_pair_layer": (timed(one_by_one(self.layers)), 4 * reps),
        }


def report(bench: CopiesBench, times: dict[str, list[float]]) -> dict[str, Any]:
    """The JSON object: GB/s and ratios to the raw copy of the same bytes."""
    size = {"small": bench.small_nbytes, "layer": bench.layer_nbytes}
    gbps = {
        name: size.get(name.rsplit("_", 1)[-1], bench.nbytes) / median(t) / 1e9
        for name, t in times.items()
    }
    raw = gbps["raw"]
    result: dict[str, Any] = {"benchmark": "copies", "raw_gbps": raw}
    for name in (
        "copy_all_adjacent",
        "per_pair_adjacent",
        "copy_all_scattered",
        "lane_submit_wait",
    ):
        result[f"{name}_gbps"] = gbps[name]
        result[f"{name}_ratio"] = gbps[name] / raw
    result["adjacent_copies"] = len(coalesce(bench.adjacent))
    result["scattered_copies"] = len(coalesce(bench.scattered))
    result["small_blocks"], result["layer_slices"] = _small_and_layers(bench, gbps)
    result.update(
        blocks=bench.blocks,
        block_mib=bench.block_bytes / 2**20,
        bytes_per_rep=bench.nbytes,
        target_ratio=TARGET_RATIO,
        meets_target={
            "copy_all_adjacent": result["copy_all_adjacent_ratio"] >= TARGET_RATIO,
            "lane_submit_wait": result["lane_submit_wait_ratio"] >= TARGET_RATIO,
        },
        reps={name: len(t) for name, t in times.items()},
        environment=environment(),
    )
    return result


def _small_and_layers(
    bench: CopiesBench, gbps: dict[str, float]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The small-block and layer-slice figures, each against its own raw copy."""
    raw_small, raw_layer = gbps["raw_small"], gbps["raw_layer"]
    small = {
        "blocks": len(bench.small),
        "block_kib": bench.small_nbytes // len(bench.small) // 1024,
        "raw_gbps": raw_small,
        "copy_all_gbps": gbps["copy_all_small"],
        "per_pair_gbps": gbps["per_pair_small"],
        "copy_all_ratio": gbps["copy_all_small"] / raw_small,
        "per_pair_ratio": gbps["per_pair_small"] / raw_small,
        "copies": len(coalesce(bench.small)),
    }
    layer = {
        "slots": len(bench.layers),
        "layer_kib": bench.layer_nbytes // len(bench.layers) // 1024,
        "raw_gbps": raw_layer,
        "copy_all_gbps": gbps["copy_all_layer"],
        "copy_all_ratio": gbps["copy_all_layer"] / raw_layer,
        "per_pair_gbps": gbps["per_pair_layer"],
        "per_pair_ratio": gbps["per_pair_layer"] / raw_layer,
        "copies": len(coalesce(bench.layers)),
    }
    return small, layer


def rows(result: dict[str, Any]) -> list[list[object]]:
    """The human table."""
    out: list[list[object]] = [["what", "GB/s (median)", "ratio to raw copy_", "copies"]]
    out.append(["raw dst.copy_(src)", result["raw_gbps"], 1.0, 1])
    for label, name, copies in (
        ("copy_all, adjacent blocks", "copy_all_adjacent", result["adjacent_copies"]),
        ("copy_ per pair, adjacent (diagnostic)", "per_pair_adjacent", result["blocks"]),
        ("copy_all, scattered blocks", "copy_all_scattered", result["scattered_copies"]),
        ("lane submit + wait, adjacent", "lane_submit_wait", result["adjacent_copies"]),
    ):
        out.append([label, result[f"{name}_gbps"], result[f"{name}_ratio"], copies])
    small, layer = result["small_blocks"], result["layer_slices"]
    tag = f"{small['blocks']} x {small['block_kib']} KiB"
    out.append(
        [f"copy_all, {tag}", small["copy_all_gbps"], small["copy_all_ratio"], small["copies"]]
    )
    out.append(
        [f"copy_ per pair, {tag}", small["per_pair_gbps"], small["per_pair_ratio"], small["blocks"]]
    )
    tag = f"layer of {layer['slots']} slots x {layer['layer_kib']} KiB"
    out.append(
        [f"copy_all, {tag}", layer["copy_all_gbps"], layer["copy_all_ratio"], layer["copies"]]
    )
    out.append([f"copy_ per pair, {tag}", layer["per_pair_gbps"], layer["per_pair_ratio"], 16])
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="blocks per batch (16)")
    parser.add_argument("--block-mib", type=int, default=None, help="MiB per block (32)")
    parser.add_argument("--small-blocks", type=int, default=1024, help="small blocks (1024)")
    parser.add_argument("--small-kib", type=int, default=16, help="KiB per small block (16)")
    parser.add_argument("--reps", type=int, default=3, help="reps per subject per round")
    args = parser.parse_args(argv)
    block_mib = args.block_mib or (2 if args.quick else 32)
    rounds = args.rounds or (2 if args.quick else 10)
    small = (args.small_blocks // 4 if args.quick else args.small_blocks, args.small_kib)
    if small[0] * small[1] * 1024 > args.blocks * block_mib * 2**20:
        raise SystemExit("the small blocks must fit in the big buffer (--small-blocks/--small-kib)")
    log(f"copies: {args.blocks} x {block_mib} MiB, {rounds} rounds x {args.reps} reps")
    bench = CopiesBench(args.blocks, block_mib * 2**20, small)
    try:
        bench.check()
        times = run_rounds(bench.subjects(args.reps), rounds)
    finally:
        bench.close()
    result = report(bench, times)
    result["quick"] = args.quick
    emit(result, args.json, rows(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
