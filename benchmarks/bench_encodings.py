"""Block encodings: encode/decode GB/s a core against a memcpy, bytes saved, error on random KV.

For each lossy encoding of :mod:`kvstore.format.encodings` (``fp8_e4m3``, ``int8``,
``int4``) and each KV dtype (bf16, fp16), one block of an 8B-Llama-like layout (8 KV
heads, head_dim 128, 256 tokens, ``--layers`` layers) of random KV is encoded with
``encode_block(..., encoding=...)`` and decoded with ``decode_block`` into a prefaulted
tensor of the layout's dtype. Reported per case:

- ``encode_gbps`` / ``decode_gbps``: layout bytes a second, torch on one thread (a core's
  rate: the issue's bar is 2 GB/s a core);
- ``encode_vs_memcpy`` / ``decode_vs_memcpy``: those over ``memcpy_gbps``, a copy of
  the same block's bytes into a prefaulted tensor measured in the same rounds;
- ``stored_ratio``: the encoded block (header included) over the layout's bytes, and
  ``saved``: 1 minus it;
- ``max_abs_error`` / ``mean_abs_error``: of the decoded values against the original
  ones, and ``mean_abs_value`` beside them (the errors' scale).

Distributions: ``normal`` (i.i.d. N(0, 1)) and ``realish`` (per-channel scales
exp(N(0, 1)), and in K 2% outlier channels 8x larger: real K caches have a few huge
channels, which is why int4 quantizes keys per channel). Random KV measures the
encodings' perturbation of numbers, not a model's quality: the logprob comparison
against vLLM's own fp8 KV cache on real models is a separate measurement
(docs/encodings.md says where it stands).

Timing: interleaved rounds over the subjects; every figure is a median over reps.

Run: ``python benchmarks/bench_encodings.py [--json] [--quick] [--layers N]``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed

from kvstore import KVLayout
from kvstore.format import BlockEncoding, decode_block, encode_block

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DISTRIBUTIONS = ("normal", "realish")
ENCODINGS = ("fp8_e4m3", "int8", "int4")
GROUP_SIZE = 32
KEY = bytes(range(16))
#: The issue's bar: encoding and decoding at this many GB/s a core.
TARGET_GBPS = 2.0


def make_block(layout: KVLayout, dist: str, seed: int = 0) -> torch.Tensor:
    """One block of synthetic KV of ``layout.block_shape`` in ``layout.dtype``."""
    gen = torch.Generator().manual_seed(seed)
    layers, kv, _tokens, heads, dim = layout.block_shape
    x = torch.randn(layout.block_shape, generator=gen)
    if dist == "realish":
        scale = torch.randn((layers, kv, 1, heads, dim), generator=gen).exp()
        outliers = torch.rand((layers, 1, 1, heads, dim), generator=gen) < 0.02
        scale[:, :1] *= torch.where(outliers, 8.0, 1.0)  # K only
        x *= scale
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return x.to(layout.dtype).contiguous()


def bench_case(
    dtype_name: str, dist: str, layers: int, rounds: int, reps: int
) -> list[dict[str, Any]]:
    """Speed, size and error of every encoding for one (dtype, distribution)."""
    layout = KVLayout(
        num_layers=layers, num_kv_heads=8, head_dim=128, block_tokens=256, dtype=DTYPES[dtype_name]
    )
    block = make_block(layout, dist)
    out = torch.ones(layout.block_shape).to(layout.dtype)  # prefaulted decode target
    copy_target = torch.ones(layout.block_shape).to(layout.dtype)
    encodings = {name: BlockEncoding.parse(name, GROUP_SIZE) for name in ENCODINGS}
    data = {
        name: encode_block(KEY, layout, block, encoding=enc).tobytes()
        for name, enc in encodings.items()
    }
    errors = {}
    for name in ENCODINGS:
        diff = (decode_block(data[name], layout, KEY, out=out).float() - block.float()).abs()
        errors[name] = (float(diff.max()), float(diff.mean()))
    subjects: dict[str, tuple[Rep, int]] = {
        "memcpy": (timed(partial(copy_target.copy_, block)), reps)
    }
    for name, enc in encodings.items():
        subjects[f"encode_{name}"] = (
            timed(partial(encode_block, KEY, layout, block, "raw", enc)),
            reps,
        )
        subjects[f"decode_{name}"] = (
            timed(partial(decode_block, data[name], layout, KEY, out=out)),
            reps,
        )
    times = run_rounds(subjects, rounds)
    nbytes = layout.block_nbytes
    memcpy = nbytes / median(times["memcpy"]) / 1e9
    rows = []
    for name in ENCODINGS:
        enc_gbps = nbytes / median(times[f"encode_{name}"]) / 1e9
        dec_gbps = nbytes / median(times[f"decode_{name}"]) / 1e9
        rows.append(
            {
                "dtype": dtype_name,
                "distribution": dist,
                "encoding": name,
                "group_size": encodings[name].group_size or None,
                "stored_ratio": len(data[name]) / nbytes,
                "saved": 1 - len(data[name]) / nbytes,
                "encode_gbps": enc_gbps,
                "decode_gbps": dec_gbps,
                "memcpy_gbps": memcpy,
                "encode_vs_memcpy": enc_gbps / memcpy,
                "decode_vs_memcpy": dec_gbps / memcpy,
                "meets_target": min(enc_gbps, dec_gbps) >= TARGET_GBPS,
                "max_abs_error": errors[name][0],
                "mean_abs_error": errors[name][1],
                "mean_abs_value": float(block.float().abs().mean()),
                "block_mib": nbytes / 2**20,
                "reps": len(times[f"encode_{name}"]),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="layers per block (8)")
    parser.add_argument("--reps", type=int, default=3, help="reps per subject per round")
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 8)
    rounds = args.rounds or (1 if args.quick else 5)
    reps = 1 if args.quick else args.reps
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core's rate
    try:
        results: list[dict[str, Any]] = []
        for dtype_name in DTYPES:
            for dist in DISTRIBUTIONS:
                log(f"encodings: {dtype_name} {dist}, {layers} layers, {rounds} rounds x {reps}")
                results.extend(bench_case(dtype_name, dist, layers, rounds, reps))
    finally:
        torch.set_num_threads(threads)
    result = {
        "benchmark": "encodings",
        "target_gbps": TARGET_GBPS,
        "threads": 1,
        "results": results,
        "environment": environment(),
    }
    header = ["dtype", "dist", "encoding", "stored", "enc GB/s", "dec GB/s", "memcpy GB/s"]
    table: list[list[object]] = [[*header, "max err", "mean err", "mean |x|"]]
    table += [
        [
            r["dtype"],
            r["distribution"],
            r["encoding"],
            r["stored_ratio"],
            r["encode_gbps"],
            r["decode_gbps"],
            r["memcpy_gbps"],
            r["max_abs_error"],
            r["mean_abs_error"],
            r["mean_abs_value"],
        ]
        for r in results
    ]
    emit(result, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
