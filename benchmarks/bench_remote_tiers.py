"""S3 and Redis tiers vs their raw clients on the same local servers, same run.

Servers: moto's S3 server in a child process (so it does not share this
process's GIL) and a ``redis-server`` (no persistence), both started by the
script on free 127.0.0.1 ports and stopped at the end.

Geometry: blocks of ``--layers`` layers x 8 KV heads x head_dim 128 x
``--tokens`` tokens, bf16 (16 layers x 128 tokens: 8 MiB). Values are
"realish" synthetic KV (per-channel scales, K outliers; see bench_codec.py).

- S3, equal concurrency C (``--concurrency``, default 8): ``tier.put`` /
  ``tier.get`` of a batch of blocks (codec raw) vs raw boto3
  ``put_object`` / ``get_object`` of the same encoded bytes, on a thread
  pool of C with a botocore client whose pool is C (same timeouts). Raw
  gets read the tier's own objects. Ratios: ``s3_put_ratio``,
  ``s3_get_ratio`` (tier MB/s over raw MB/s; target >= 0.9).
- S3 sweep: tier put/get MB/s at several concurrencies; ``s3_best`` is the
  best of each.
- S3 compression: tier put/get MB/s (of raw block bytes) and stored bytes
  with codec raw, shuffle-lz4 and auto.
- S3 large block (full mode): one block above ``multipart_threshold``
  moved whole (one PUT / GET) vs in parts (multipart / parallel ranged GETs).
- Redis: ``tier.put`` / ``tier.get`` (pipelined) vs raw redis-py pipelined
  ``SET`` / ``GET`` of the same encoded bytes. Ratios ``redis_put_ratio``,
  ``redis_get_ratio`` (target >= 0.9).

MB/s counts raw block bytes (``block_nbytes`` per block) for every subject.
Timing: interleaved rounds (order reversed on odd rounds), medians.

Run: ``python benchmarks/bench_remote_tiers.py [--json] [--quick]``.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore.config
import redis
import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed
from bench_codec import make_block

from kvstore import KVLayout
from kvstore.cli import DUMMY_AWS_ENV, RedisServer, S3Server
from kvstore.config import RedisTierConfig, S3TierConfig
from kvstore.keys import BlockKey
from kvstore.testing import make_keys
from kvstore.tiers import RedisTier, S3Tier, encode_value

TARGET_RATIO = 0.9
MB = 1e6
MiB = 1024**2


def bench_layout(layers: int, tokens: int) -> KVLayout:
    """Llama-like GQA geometry (8 KV heads, head_dim 128), bf16."""
    return KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_tokens=tokens)


def make_blocks(layout: KVLayout, n: int, seed: int) -> list[torch.Tensor]:
    return [make_block(layout, "realish", seed + i) for i in range(n)]


def encoded_values(
    keys: list[BlockKey], layout: KVLayout, blocks: list[torch.Tensor]
) -> list[bytes]:
    """What the tier stores for each block with codec raw (the raw baselines send these)."""
    return [encode_value(k, layout, b, "raw").tobytes() for k, b in zip(keys, blocks, strict=True)]


def s3_client(server: S3Server, concurrency: int) -> Any:
    """A raw boto3 client configured like the tier's (pool, timeouts, no retries)."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=server.url,
        region_name="us-east-1",
        config=botocore.config.Config(
            max_pool_connections=concurrency,
            connect_timeout=2.0,
            read_timeout=60.0,
            retries={"total_max_attempts": 1, "mode": "standard"},
        ),
    )


class S3Bench:
    """One S3 tier and the raw boto3 baseline on the same objects."""

    def __init__(
        self, server: S3Server, layout: KVLayout, blocks: list[torch.Tensor], **fields: Any
    ) -> None:
        self.layout, self.blocks, self.server = layout, blocks, server
        self.concurrency = int(fields.get("concurrency", 8))
        codec = fields.get("codec", "raw")
        config = S3TierConfig(
            bucket=server.bucket,
            prefix=f"bench-{codec}-{self.concurrency}-{id(self)}",
            endpoint_url=server.url,
            region="us-east-1",
            read_timeout=60.0,
            deadline=600.0,
            **fields,
        )
        self.tier = S3Tier(config, layout)
        self.keys = make_keys(len(blocks), salt=id(self) & 0xFFFF)
        self.outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in blocks]
        self.values = encoded_values(self.keys, layout, blocks)
        self.nbytes = len(blocks) * layout.block_nbytes
        self.client = s3_client(server, self.concurrency)
        self.pool = ThreadPoolExecutor(self.concurrency)
        assert all(self.tier.put(self.keys, blocks)), "initial put failed"

    def tier_put(self) -> None:
        assert all(self.tier.put(self.keys, self.blocks))

    def tier_get(self) -> None:
        assert all(self.tier.get(self.keys, self.outs))

    def raw_put(self) -> None:
        bucket, prefix = self.server.bucket, f"raw-{id(self)}"

        def put(i: int) -> None:
            self.client.put_object(Bucket=bucket, Key=f"{prefix}/{i}", Body=self.values[i])

        list(self.pool.map(put, range(len(self.values))))

    def raw_get(self) -> None:
        bucket = self.server.bucket

        def get(i: int) -> int:
            name = self.tier.object_name(self.keys[i])
            return len(self.client.get_object(Bucket=bucket, Key=name)["Body"].read())

        list(self.pool.map(get, range(len(self.keys))))

    def check(self) -> None:
        self.tier_get()
        for out, block in zip(self.outs, self.blocks, strict=True):
            assert torch.equal(out, block), "S3 tier returned different bytes"

    def close(self) -> None:
        self.tier.close()
        self.pool.shutdown()
        self.client.close()


def mbps(nbytes: int, times: list[float]) -> float:
    return nbytes / median(times) / MB


def bench_s3_equal(
    server: S3Server, layout: KVLayout, blocks: list[torch.Tensor], conc: int, rounds: int
) -> dict[str, Any]:
    """Tier vs raw boto3 at the same concurrency, interleaved."""
    bench = S3Bench(server, layout, blocks, concurrency=conc)
    try:
        subjects: dict[str, tuple[Rep, int]] = {
            "s3_tier_put": (timed(bench.tier_put), 2),
            "s3_raw_put": (timed(bench.raw_put), 2),
            "s3_tier_get": (timed(bench.tier_get), 3),
            "s3_raw_get": (timed(bench.raw_get), 3),
        }
        times = run_rounds(subjects, rounds)
        bench.check()
        stats = bench.tier.stats()
    finally:
        bench.close()
    figures = {name: mbps(bench.nbytes, t) for name, t in times.items()}
    return {
        "figures": figures,
        "reps": {n: len(t) for n, t in times.items()},
        "retries": stats["retries"],
    }


def bench_s3_sweep(
    server: S3Server, layout: KVLayout, blocks: list[torch.Tensor], concs: list[int], rounds: int
) -> list[dict[str, Any]]:
    """Tier put/get MB/s at each concurrency (interleaved across concurrencies)."""
    benches = {c: S3Bench(server, layout, blocks, concurrency=c) for c in concs}
    try:
        subjects: dict[str, tuple[Rep, int]] = {}
        for c, bench in benches.items():
            subjects[f"put_c{c}"] = (timed(bench.tier_put), 1)
            subjects[f"get_c{c}"] = (timed(bench.tier_get), 1)
        times = run_rounds(subjects, rounds)
    finally:
        for bench in benches.values():
            bench.close()
    nbytes = len(blocks) * layout.block_nbytes
    return [
        {
            "concurrency": c,
            "put_mbps": mbps(nbytes, times[f"put_c{c}"]),
            "get_mbps": mbps(nbytes, times[f"get_c{c}"]),
        }
        for c in concs
    ]


def bench_s3_codecs(
    server: S3Server, layout: KVLayout, blocks: list[torch.Tensor], conc: int, rounds: int
) -> list[dict[str, Any]]:
    """Does compression pay on S3 here? Put/get MB/s of raw bytes and bytes stored."""
    codecs = ("raw", "shuffle-lz4", "auto")
    benches = {c: S3Bench(server, layout, blocks, concurrency=conc, codec=c) for c in codecs}
    try:
        subjects: dict[str, tuple[Rep, int]] = {}
        for c, bench in benches.items():
            subjects[f"put_{c}"] = (timed(bench.tier_put), 1)
            subjects[f"get_{c}"] = (timed(bench.tier_get), 1)
        times = run_rounds(subjects, rounds)
        for bench in benches.values():
            bench.check()
        stored = {
            c: b.tier.stats()["bytes_out"] / b.tier.stats()["blocks_put"]
            for c, b in benches.items()
        }
    finally:
        for bench in benches.values():
            bench.close()
    nbytes = len(blocks) * layout.block_nbytes
    return [
        {
            "codec": c,
            "put_mbps": mbps(nbytes, times[f"put_{c}"]),
            "get_mbps": mbps(nbytes, times[f"get_{c}"]),
            "stored_ratio": stored[c] / layout.block_nbytes,
        }
        for c in codecs
    ]


def bench_s3_large(server: S3Server, layers: int, rounds: int) -> dict[str, Any]:
    """One block above the threshold: whole (1 PUT / 1 GET) vs parts (multipart / ranges)."""
    layout = bench_layout(layers, 256)  # 1 MiB per layer
    blocks = make_blocks(layout, 1, seed=99)
    part = 8 * MiB
    whole = S3Bench(server, layout, blocks, concurrency=8, multipart_threshold=1024 * MiB)
    parts = S3Bench(server, layout, blocks, concurrency=8, multipart_threshold=part, part_size=part)
    try:
        subjects: dict[str, tuple[Rep, int]] = {
            "whole_put": (timed(whole.tier_put), 1),
            "parts_put": (timed(parts.tier_put), 1),
            "whole_get": (timed(whole.tier_get), 1),
            "parts_get": (timed(parts.tier_get), 1),
        }
        times = run_rounds(subjects, rounds)
        parts.check()
    finally:
        whole.close()
        parts.close()
    result: dict[str, Any] = {"block_mib": layout.block_nbytes / MiB, "part_mib": part / MiB}
    for name, t in times.items():
        result[f"{name}_mbps"] = mbps(layout.block_nbytes, t)
    return result


class RedisBench:
    """The Redis tier and raw pipelined redis-py on the same values."""

    def __init__(self, server: RedisServer, layout: KVLayout, blocks: list[torch.Tensor]) -> None:
        self.layout, self.blocks = layout, blocks
        config = RedisTierConfig(
            url=server.url, key_prefix="bench", codec="raw", socket_timeout=30.0
        )
        self.tier = RedisTier(config, layout)
        self.keys = make_keys(len(blocks), salt=7)
        self.outs = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in blocks]
        self.values = encoded_values(self.keys, layout, blocks)
        self.names = [self.tier.key_name(k) for k in self.keys]
        self.raw_names = [b"raw:" + n for n in self.names]
        self.nbytes = len(blocks) * layout.block_nbytes
        pool = redis.BlockingConnectionPool.from_url(
            server.url, max_connections=16, timeout=30.0, socket_timeout=30.0
        )
        self.client = redis.Redis(connection_pool=pool)
        assert all(self.tier.put(self.keys, blocks)), "initial put failed"

    def tier_put(self) -> None:
        assert all(self.tier.put(self.keys, self.blocks))

    def tier_get(self) -> None:
        assert all(self.tier.get(self.keys, self.outs))

    def raw_put(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, value in zip(self.raw_names, self.values, strict=True):
            pipe.set(name, value)
        assert all(pipe.execute())

    def raw_get(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name in self.names:
            pipe.get(name)
        assert all(v is not None for v in pipe.execute())

    def check(self) -> None:
        self.tier_get()
        for out, block in zip(self.outs, self.blocks, strict=True):
            assert torch.equal(out, block), "Redis tier returned different bytes"

    def close(self) -> None:
        self.tier.close()
        self.client.close()


def bench_redis(
    layout: KVLayout, blocks: list[torch.Tensor], rounds: int, reps: int
) -> dict[str, Any]:
    """Tier vs raw redis-py pipelines, interleaved, on one redis-server."""
    with RedisServer() as server:
        bench = RedisBench(server, layout, blocks)
        try:
            subjects: dict[str, tuple[Rep, int]] = {
                "redis_tier_put": (timed(bench.tier_put), reps),
                "redis_raw_put": (timed(bench.raw_put), reps),
                "redis_tier_get": (timed(bench.tier_get), reps),
                "redis_raw_get": (timed(bench.raw_get), reps),
            }
            times = run_rounds(subjects, rounds)
            bench.check()
        finally:
            bench.close()
    return {
        "figures": {name: mbps(bench.nbytes, t) for name, t in times.items()},
        "reps": {n: len(t) for n, t in times.items()},
    }


def parse_args(argv: list[str] | None) -> Any:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="layers per block (16)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per block (128)")
    parser.add_argument("--blocks", type=int, default=None, help="S3 blocks per batch (8)")
    parser.add_argument("--redis-blocks", type=int, default=None, help="Redis blocks per batch")
    parser.add_argument("--concurrency", type=int, default=8, help="S3 concurrency, both sides")
    parser.add_argument("--large-layers", type=int, default=64, help="large-block layers (MiB)")
    return parser.parse_args(argv)


def run_s3(args: Any, layout: KVLayout, blocks: list[torch.Tensor], rounds: int) -> dict[str, Any]:
    """Every S3 measurement on one moto server (child process)."""
    out: dict[str, Any] = {}
    with S3Server(bucket="kvstore-bench", mode="process") as server:
        log(f"s3: tier vs boto3 at concurrency {args.concurrency}, {rounds} rounds")
        out["equal"] = bench_s3_equal(server, layout, blocks, args.concurrency, rounds)
        concs = [4, 16] if args.quick else [2, 4, 8, 16, 32]
        log(f"s3: concurrency sweep {concs}")
        out["sweep"] = bench_s3_sweep(server, layout, blocks, concs, max(2, rounds // 2))
        log("s3: codecs raw / shuffle-lz4 / auto")
        out["codecs"] = bench_s3_codecs(server, layout, blocks, args.concurrency, rounds)
        if not args.quick:
            log(f"s3: one {args.large_layers} MiB block, whole vs parts")
            out["large"] = bench_s3_large(server, args.large_layers, max(3, rounds // 2))
    return out


def summarize(
    args: Any, layout: KVLayout, s3: dict[str, Any], rd: dict[str, Any]
) -> dict[str, Any]:
    f3, fr = s3["equal"]["figures"], rd["figures"]
    ratios = {
        "s3_put_ratio": f3["s3_tier_put"] / f3["s3_raw_put"],
        "s3_get_ratio": f3["s3_tier_get"] / f3["s3_raw_get"],
        "redis_put_ratio": fr["redis_tier_put"] / fr["redis_raw_put"],
        "redis_get_ratio": fr["redis_tier_get"] / fr["redis_raw_get"],
    }
    best_put = max(s3["sweep"], key=lambda r: r["put_mbps"])
    best_get = max(s3["sweep"], key=lambda r: r["get_mbps"])
    codecs = {r["codec"]: r for r in s3["codecs"]}
    pays = (
        codecs["shuffle-lz4"]["put_mbps"] > codecs["raw"]["put_mbps"]
        and codecs["shuffle-lz4"]["get_mbps"] > codecs["raw"]["get_mbps"]
    )
    return {
        "benchmark": "remote_tiers",
        "quick": bool(args.quick),
        **ratios,
        "s3_put_mbps": f3["s3_tier_put"],
        "s3_get_mbps": f3["s3_tier_get"],
        "s3_raw_put_mbps": f3["s3_raw_put"],
        "s3_raw_get_mbps": f3["s3_raw_get"],
        "s3_concurrency": args.concurrency,
        "s3_retries": s3["equal"]["retries"],
        "s3_best": {
            "put_mbps": best_put["put_mbps"],
            "put_concurrency": best_put["concurrency"],
            "get_mbps": best_get["get_mbps"],
            "get_concurrency": best_get["concurrency"],
        },
        "s3_sweep": s3["sweep"],
        "s3_codecs": s3["codecs"],
        "s3_compression_pays": pays,
        "s3_large_block": s3.get("large"),
        "redis_put_mbps": fr["redis_tier_put"],
        "redis_get_mbps": fr["redis_tier_get"],
        "redis_raw_put_mbps": fr["redis_raw_put"],
        "redis_raw_get_mbps": fr["redis_raw_get"],
        "block_mib": layout.block_nbytes / MiB,
        "target_ratio": TARGET_RATIO,
        "meets_target": {k.removesuffix("_ratio"): v >= TARGET_RATIO for k, v in ratios.items()},
        "reps": {**s3["equal"]["reps"], **rd["reps"]},
        "environment": environment(),
    }


def table(result: dict[str, Any]) -> list[list[object]]:
    mt = result["meets_target"]
    rows: list[list[object]] = [["what", "tier MB/s", "raw MB/s", "ratio", "meets >= 0.9"]]
    for side in ("s3", "redis"):
        for op in ("put", "get"):
            key = f"{side}_{op}"
            rows.append(
                [
                    key,
                    result[f"{key}_mbps"],
                    result[f"{side}_raw_{op}_mbps"],
                    result[f"{key}_ratio"],
                    mt[key],
                ]
            )
    for row in result["s3_codecs"]:
        rows.append(
            [
                f"s3 codec {row['codec']} (stored {row['stored_ratio']:.3f})",
                row["put_mbps"],
                row["get_mbps"],
                "put / get",
                "",
            ]
        )
    best = result["s3_best"]
    rows.append([f"s3 best put (c={best['put_concurrency']})", best["put_mbps"], "", "", ""])
    rows.append([f"s3 best get (c={best['get_concurrency']})", best["get_mbps"], "", "", ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    args = parse_args(argv)
    os.environ.update(DUMMY_AWS_ENV)  # moto accepts any credentials; never real ones here
    tokens = args.tokens or (32 if args.quick else 128)
    layout = bench_layout(args.layers, tokens)
    rounds = args.rounds or (2 if args.quick else 7)
    s3_blocks = make_blocks(layout, args.blocks or (4 if args.quick else 8), seed=1)
    redis_blocks = s3_blocks[: args.redis_blocks or (4 if args.quick else 6)]
    log(
        f"blocks of {layout.block_nbytes / MiB:.1f} MiB; S3 batch {len(s3_blocks)}, "
        f"Redis batch {len(redis_blocks)}"
    )
    s3 = run_s3(args, layout, s3_blocks, rounds)
    log(f"redis: tier vs redis-py pipelines, {rounds * 2} rounds")
    rd = bench_redis(layout, redis_blocks, rounds * 2, 3 if args.quick else 5)
    result = summarize(args, layout, s3, rd)
    emit(result, args.json, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
