"""Block codec: compression ratio and encode/decode GB/s of RAW, LZ4 and SHUFFLE_LZ4 on KV.

For each KV dtype (bf16, fp16, fp8_e4m3) and value distribution, one block
(an 8B-Llama-like layout: 8 KV heads, head_dim 128, 256 tokens, ``--layers``
layers) is encoded with each codec through ``kvstore.format.codec.encode_block`` and
decoded with ``decode_block``; the script reports ratio = encoded bytes (with
header) / raw bytes, encode and decode GB/s of raw bytes, and what
``choose_codec`` picks. Decoding is checked to be bit-exact (untimed).

Distributions:

- ``normal``: i.i.d. N(0, 1).
- ``realish``: N(0, 1) with a per-channel scale -- every (layer, k/v, head,
  dim) channel multiplied by exp(N(0, 1)) -- and, in K only, 2% outlier
  channels scaled 8x more (real K caches have a few huge channels).

fp8 values are the same numbers cast with ``.to(torch.float8_e4m3fn)`` after
clamping to +-448 (what a unit-scale fp8 KV cache holds).

Timing: for each case, interleaved rounds over the six encode/decode
subjects; every figure is a median over reps.

Run: ``python benchmarks/bench_codec.py [--json] [--quick]``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed

from kvstore import KVLayout
from kvstore.format import Codec, choose_codec, decode_block, encode_block

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
DISTRIBUTIONS = ("normal", "realish")
CODECS = (Codec.RAW, Codec.LZ4, Codec.SHUFFLE_LZ4)
FP8_MAX = 448.0
KEY = bytes(range(16))


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
    if layout.dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(layout.dtype).contiguous()


def bench_case(
    dtype_name: str, dist: str, layers: int, rounds: int, reps: int
) -> list[dict[str, Any]]:
    """Ratio and encode/decode GB/s of every codec for one (dtype, distribution)."""
    layout = KVLayout(
        num_layers=layers, num_kv_heads=8, head_dim=128, block_tokens=256, dtype=DTYPES[dtype_name]
    )
    block = make_block(layout, dist)
    picked = choose_codec(block, layout)
    out = torch.ones(layout.block_shape).to(layout.dtype)  # prefaulted decode target
    encoded = {codec: encode_block(KEY, layout, block, codec) for codec in CODECS}
    data = {codec: enc.tobytes() for codec, enc in encoded.items()}
    raw_bytes = block.view(torch.uint8)
    for codec in CODECS:
        decode_block(data[codec], layout, KEY, out=out)
        assert torch.equal(out.view(torch.uint8), raw_bytes), f"{codec.name} round trip differs"
    subjects: dict[str, tuple[Rep, int]] = {}
    for codec in CODECS:
        subjects[f"encode_{codec.name}"] = (
            timed(partial(encode_block, KEY, layout, block, codec)),
            reps,
        )
        subjects[f"decode_{codec.name}"] = (
            timed(partial(decode_block, data[codec], layout, KEY, out=out)),
            reps,
        )
    times = run_rounds(subjects, rounds)
    nbytes = layout.block_nbytes
    return [
        {
            "dtype": dtype_name,
            "distribution": dist,
            "codec": codec.name,
            "ratio": encoded[codec].nbytes / nbytes,
            "payload_ratio": encoded[codec].header.payload_nbytes / nbytes,
            "encode_gbps": nbytes / median(times[f"encode_{codec.name}"]) / 1e9,
            "decode_gbps": nbytes / median(times[f"decode_{codec.name}"]) / 1e9,
            "choose_codec": picked.name,
            "block_mib": nbytes / 2**20,
            "reps": len(times[f"encode_{codec.name}"]),
        }
        for codec in CODECS
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="layers per block (8)")
    parser.add_argument("--reps", type=int, default=3, help="reps per subject per round")
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 8)
    rounds = args.rounds or (1 if args.quick else 6)
    reps = 1 if args.quick else args.reps
    results: list[dict[str, Any]] = []
    for dtype_name in DTYPES:
        for dist in DISTRIBUTIONS:
            log(f"codec: {dtype_name} {dist}, {layers} layers, {rounds} rounds x {reps} reps")
            results.extend(bench_case(dtype_name, dist, layers, rounds, reps))
    result = {"benchmark": "codec", "results": results, "environment": environment()}
    rows: list[list[object]] = [
        ["dtype", "distribution", "codec", "ratio", "encode GB/s", "decode GB/s", "choose_codec"]
    ]
    rows += [
        [
            r["dtype"],
            r["distribution"],
            r["codec"],
            r["ratio"],
            r["encode_gbps"],
            r["decode_gbps"],
            r["choose_codec"],
        ]
        for r in results
    ]
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
