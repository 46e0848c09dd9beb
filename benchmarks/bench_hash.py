"""Chunk hashing: ``KVStore.hash_tokens`` vs vLLM's sha256-of-pickle scheme, same tokens.

Both hash the same 131072 random token ids in chunks of 256 (512 chained
keys). vLLM's scheme is reimplemented here (vllm is not imported): per full
block, ``sha256(pickle.dumps((parent, tuple(block_tokens), None)))``, chained
from a fixed 32-byte NONE_HASH, over a Python list of ints (what vLLM holds).
kvstore gets the tokens as a numpy int32 array (what an engine holds as a
tensor); it is also timed with the same Python list as input, reported apart.

Timing: interleaved rounds; each round runs a block of kvstore reps, then a
block of list-input reps, then a block of vLLM reps (order reversed on odd
rounds). Every figure is the median over all reps of that subject.

``--scaling`` adds the prefix lookup: hashing a 128K-token prompt and
``store.lookup`` of its 512 keys (all stored), with 10K, 100K and 1M blocks
in the store, to show the cost is flat in the number of stored blocks.

Run: ``python benchmarks/bench_hash.py [--json] [--quick] [--scaling]``.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import time
from typing import Any

import numpy as np
import torch
from _common import base_parser, emit, environment, log, median, run_rounds, timed

from kvstore import KVLayout, KVStore, StoreConfig

NUM_TOKENS = 131072
BLOCK_TOKENS = 256
TARGET_RATIO = 30.0
TARGET_MS_PER_128K = 0.5
TARGET_LOOKUP_MS = 1.0
NAMESPACE = "bench/llama-3-8b@rev"
#: vLLM seeds its chain with a fixed 32-byte NONE_HASH (random or from PYTHONHASHSEED).
NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()


def vllm_block_hashes(token_ids: list[int], block_size: int = BLOCK_TOKENS) -> list[bytes]:
    """vLLM's prefix-cache block hashes (``hash_block_tokens`` with ``sha256``), chained."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(
            pickle.dumps((parent, tuple(block), None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        hashes.append(parent)
    return hashes


def small_store(capacity: str = "1MiB", dtype: torch.dtype = torch.bfloat16) -> KVStore:
    """A store with a tiny layout and one small host tier (hashing needs no bytes)."""
    layout = KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=32, block_tokens=BLOCK_TOKENS, dtype=dtype
    )
    config = StoreConfig.from_dict({"tiers": [{"kind": "host", "capacity": capacity}]}, environ={})
    return KVStore(layout, config)


def bench_hashing(rounds: int, kv_reps: int, slow_reps: int) -> dict[str, Any]:
    """kvstore (numpy and list input) vs vLLM's scheme, interleaved."""
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 128_256, NUM_TOKENS, dtype=np.int32)
    tokens_list = tokens_np.tolist()
    with small_store() as store:
        keys_np = store.hash_tokens(tokens_np, NAMESPACE)
        keys_list = store.hash_tokens(tokens_list, NAMESPACE)
        vllm = vllm_block_hashes(tokens_list)
        n_keys = NUM_TOKENS // BLOCK_TOKENS
        assert len(keys_np) == len(vllm) == n_keys, (len(keys_np), len(vllm))
        assert keys_np == keys_list, "list and array input must give the same keys"
        times = run_rounds(
            {
                "kvstore": (timed(lambda: store.hash_tokens(tokens_np, NAMESPACE)), kv_reps),
                "kvstore_list": (
                    timed(lambda: store.hash_tokens(tokens_list, NAMESPACE)),
                    slow_reps,
                ),
                "vllm_sha256": (timed(lambda: vllm_block_hashes(tokens_list)), slow_reps),
            },
            rounds,
        )
    kv_s, kv_list_s, vllm_s = (median(times[k]) for k in ("kvstore", "kvstore_list", "vllm_sha256"))
    ratio = vllm_s / kv_s
    ms = kv_s * 1e3
    return {
        "num_tokens": NUM_TOKENS,
        "block_tokens": BLOCK_TOKENS,
        "num_keys": n_keys,
        "kvstore_tokens_per_s": NUM_TOKENS / kv_s,
        "vllm_sha256_tokens_per_s": NUM_TOKENS / vllm_s,
        "ratio": ratio,
        "ms_per_128k": ms,
        "vllm_ms_per_128k": vllm_s * 1e3,
        "kvstore_list_tokens_per_s": NUM_TOKENS / kv_list_s,
        "kvstore_list_ms_per_128k": kv_list_s * 1e3,
        "ratio_list_input": vllm_s / kv_list_s,
        "target_ratio": TARGET_RATIO,
        "target_ms_per_128k": TARGET_MS_PER_128K,
        "meets_target": {
            "ratio": ratio >= TARGET_RATIO,
            "ms_per_128k": ms <= TARGET_MS_PER_128K,
            "ratio_list_input": vllm_s / kv_list_s >= TARGET_RATIO,
        },
        "reps": {name: len(values) for name, values in times.items()},
    }


def _fill(store: KVStore, n: int, rng: np.random.Generator, batch: int = 4096) -> None:
    """Store ``n`` more blocks under random keys (their content is irrelevant here)."""
    layout = store.layout
    kv = torch.zeros(layout.tensor_shape(batch), dtype=layout.dtype)
    left = n
    while left:
        k = min(batch, left)
        raw = rng.bytes(16 * k)
        keys = [raw[i : i + 16] for i in range(0, 16 * k, 16)]
        chunk = kv if k == batch else kv[:, :, : k * layout.block_tokens]
        stored = store.put(keys, chunk)
        assert stored == k, f"filler put stored {stored} of {k}"
        left -= k


def bench_prefix_lookup(sizes: list[int], rounds: int, reps: int) -> dict[str, Any]:
    """Hash a 128K-token prompt and look up its 512 (stored) keys, at each store size."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128_256, NUM_TOKENS, dtype=np.int32)
    # One uint8 element per (token, kv): 512-byte blocks, so 1M blocks fit in ~0.5 GiB.
    layout = KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=BLOCK_TOKENS, dtype=torch.uint8
    )
    n_keys = NUM_TOKENS // BLOCK_TOKENS
    slots = int((max(sizes) + n_keys) / 0.85) + 1  # stay under the 0.9 high watermark
    config = StoreConfig.from_dict(
        {"tiers": [{"kind": "host", "capacity": slots * layout.block_nbytes}]}, environ={}
    )
    points = []
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(tokens, NAMESPACE)
        store.put(keys, torch.zeros(layout.tensor_shape(n_keys), dtype=layout.dtype))
        stored = n_keys
        for size in sizes:
            start = time.perf_counter()
            _fill(store, size - stored, rng)
            stored = size
            log(f"  {size} blocks stored ({time.perf_counter() - start:.1f} s to fill)")
            assert store.lookup(store.hash_tokens(tokens, NAMESPACE)) == n_keys
            times = run_rounds(
                {
                    "hash_and_lookup": (
                        timed(lambda: store.lookup(store.hash_tokens(tokens, NAMESPACE))),
                        reps,
                    ),
                    "lookup_only": (timed(lambda: store.lookup(keys)), reps),
                },
                rounds,
            )
            points.append(
                {
                    "stored_blocks": size,
                    "hash_and_lookup_ms": median(times["hash_and_lookup"]) * 1e3,
                    "lookup_only_ms": median(times["lookup_only"]) * 1e3,
                    "reps": len(times["hash_and_lookup"]),
                }
            )
    ms = max(p["hash_and_lookup_ms"] for p in points)
    return {
        "prefix_lookup_ms_128k": ms,
        "prefix_lookup_target_ms": TARGET_LOOKUP_MS,
        "prefix_lookup_meets_target": ms <= TARGET_LOOKUP_MS,
        "prefix_lookup_flatness": points[-1]["hash_and_lookup_ms"]
        / points[0]["hash_and_lookup_ms"],
        "prefix_lookup_scaling": points,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--kv-reps", type=int, default=50, help="kvstore reps per round")
    parser.add_argument("--slow-reps", type=int, default=5, help="vLLM / list-input reps per round")
    parser.add_argument("--scaling", action="store_true", help="also time the prefix lookup")
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="stored-block counts for --scaling (default 10000,100000,1000000)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 40)
    log(f"hashing: {rounds} rounds x ({args.kv_reps} kvstore, {args.slow_reps} vLLM) reps")
    result: dict[str, Any] = {
        "benchmark": "hash",
        **bench_hashing(rounds, args.kv_reps, args.slow_reps),
    }
    if args.scaling:
        sizes = args.sizes or ([1_000, 10_000] if args.quick else [10_000, 100_000, 1_000_000])
        log(f"prefix lookup at {sizes} stored blocks")
        result.update(bench_prefix_lookup(sizes, 3 if args.quick else 20, 20))
    result["environment"] = environment()
    mt = result["meets_target"]
    rows: list[list[object]] = [
        ["what", "median", "target", "meets"],
        ["kvstore (np int32) ms / 128K tokens", result["ms_per_128k"], "<= 0.5", mt["ms_per_128k"]],
        ["vLLM sha256+pickle ms / 128K tokens", result["vllm_ms_per_128k"], "", ""],
        ["ratio vLLM / kvstore", result["ratio"], ">= 30", mt["ratio"]],
        ["kvstore (list input) ms / 128K", result["kvstore_list_ms_per_128k"], "", ""],
        [
            "ratio vLLM / kvstore (list input)",
            result["ratio_list_input"],
            ">= 30",
            mt["ratio_list_input"],
        ],
    ]
    if args.scaling:
        for p in result["prefix_lookup_scaling"]:
            rows.append(
                [
                    f"hash+lookup 128K, {p['stored_blocks']} stored (ms)",
                    p["hash_and_lookup_ms"],
                    "<= 1",
                    p["hash_and_lookup_ms"] <= TARGET_LOOKUP_MS,
                ]
            )
            rows.append(
                [f"  lookup only, {p['stored_blocks']} stored (ms)", p["lookup_only_ms"], "", ""]
            )
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
