"""Chunk hashing: ``KVStore.hash_tokens`` vs vLLM's sha256-of-pickle scheme, same tokens.

Both hash the same 131072 random token ids in chunks of 256 (512 chained
keys). vLLM's scheme is reimplemented here (vllm is not imported): per full
block, ``sha256(pickle.dumps((parent, tuple(block_tokens), None)))``, chained
from a fixed 32-byte NONE_HASH, over a Python list of ints (what vLLM holds).
kvstore gets the tokens as a numpy int32 array (what an engine holds as a
tensor); it is also timed with the same Python list as input, reported apart.

At vLLM's default 16-token blocks too: the same tokens, kvstore with a layout
of 16-token chunks (8192 keys) against the same reimplemented scheme with
``block_size=16``: ``ratio_block16`` (``ms_per_128k_block16``,
``vllm_ms_per_128k_block16``). ``chain_impl`` says which ``chain_keys`` ran:
``"c"`` (the compiled ``kvstore.native._chain``) or ``"python"`` (the fallback).

Timing: interleaved rounds; each round runs a block of reps of each subject
(kvstore, list input, vLLM; then kvstore and vLLM at 16-token blocks), in
reverse order on odd rounds. Every figure is the median over all reps of that
subject.

vLLM's real hashing: where ``.venv-vllm/bin/python`` exists (``--vllm-python``;
``bash scripts/setup-vllm.sh`` makes it), ``peers/vllm_hash_worker.py`` runs
there and times vLLM 0.32's own ``get_request_block_hasher`` with the default
``prefix_caching_hash_algo`` (``sha256``; ``sha256_cbor`` too) on the same
131072 tokens at block sizes 16 (vLLM's default) and 256, interleaved with
kvstore's ``hash_tokens`` at the same block sizes in that process:
``vllm_real_ms_per_128k`` and ``ratio_vs_vllm_real`` (vLLM ms / kvstore ms),
keyed by block size; ``ratio_vs_vllm_real_kvstore_256``: vLLM at each block size
over kvstore at 256 (its chunk size, whatever the engine's block size). Without
the venv (or with ``--no-vllm-real``) those are null and ``vllm_real_skipped``
says why.

``--scaling`` adds the prefix lookup: hashing a 128K-token prompt and
``store.lookup`` of its 512 keys (all stored), with 10K, 100K and 1M blocks
in the store, to show the cost is flat in the number of stored blocks.

Run: ``python benchmarks/bench_hash.py [--json] [--quick] [--scaling]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds, timed

from kvstore import BlockKey, KVLayout, KVStore, StoreConfig
from kvstore.keys import CHAIN_IMPL

NUM_TOKENS = 131072
BLOCK_TOKENS = 256
#: vLLM's default block size: ``ratio_block16`` compares both at it.
SMALL_BLOCK_TOKENS = 16
TARGET_RATIO = 30.0
TARGET_MS_PER_128K = 0.5
TARGET_LOOKUP_MS = 1.0
NAMESPACE = "bench/llama-3-8b@rev"
#: vLLM seeds its chain with a fixed 32-byte NONE_HASH (random or from PYTHONHASHSEED).
NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()
ROOT = Path(__file__).resolve().parents[1]
VLLM_WORKER = Path(__file__).resolve().parent / "peers" / "vllm_hash_worker.py"
VLLM_BLOCK_SIZES = (16, 256)


def vllm_block_hashes(
    token_ids: list[int], block_size: int = BLOCK_TOKENS, none_hash: bytes = NONE_HASH
) -> list[bytes]:
    """vLLM's prefix-cache block hashes (``hash_block_tokens`` with ``sha256``), chained.

    ``none_hash``: the chain's seed (vLLM's own is ``sha256(pickle("vllm-none-hash"))``;
    peers/vllm_hash_worker.py checks that with it these are vLLM's hashes).
    """
    hashes: list[bytes] = []
    parent = none_hash
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(
            pickle.dumps((parent, tuple(block), None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        hashes.append(parent)
    return hashes


def small_store(
    capacity: str = "1MiB", dtype: torch.dtype = torch.bfloat16, block_tokens: int = BLOCK_TOKENS
) -> KVStore:
    """A store with a tiny layout and one small host tier (hashing needs no bytes)."""
    layout = KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=32, block_tokens=block_tokens, dtype=dtype
    )
    config = StoreConfig.from_dict({"tiers": [{"kind": "host", "capacity": capacity}]}, environ={})
    return KVStore(layout, config)


def _check_keys(
    store: KVStore, store16: KVStore, tokens_np: np.ndarray, tokens_list: list[int]
) -> None:
    """Both stores give one key per full chunk, the same for array and list input."""
    keys_np = store.hash_tokens(tokens_np, NAMESPACE)
    assert len(keys_np) == len(vllm_block_hashes(tokens_list)) == NUM_TOKENS // BLOCK_TOKENS
    assert keys_np == store.hash_tokens(tokens_list, NAMESPACE), "list and array must agree"
    keys16 = store16.hash_tokens(tokens_np, NAMESPACE)
    assert len(keys16) == NUM_TOKENS // SMALL_BLOCK_TOKENS
    assert keys16 == store16.hash_tokens(tokens_list, NAMESPACE), "list and array must agree"


def _subjects(
    store: KVStore,
    store16: KVStore,
    tokens_np: np.ndarray,
    tokens_list: list[int],
    reps: tuple[int, int],
) -> dict[str, tuple[Rep, int]]:
    """The timed subjects: kvstore (array, list) and vLLM's scheme, at 256 and 16 tokens."""
    kv_reps, slow_reps = reps
    small = SMALL_BLOCK_TOKENS
    return {
        "kvstore": (timed(lambda: store.hash_tokens(tokens_np, NAMESPACE)), kv_reps),
        "kvstore_list": (timed(lambda: store.hash_tokens(tokens_list, NAMESPACE)), slow_reps),
        "vllm_sha256": (timed(lambda: vllm_block_hashes(tokens_list)), slow_reps),
        "kvstore_block16": (timed(lambda: store16.hash_tokens(tokens_np, NAMESPACE)), kv_reps),
        "vllm_sha256_block16": (timed(lambda: vllm_block_hashes(tokens_list, small)), slow_reps),
    }


def bench_hashing(rounds: int, kv_reps: int, slow_reps: int) -> dict[str, Any]:
    """kvstore (numpy and list input) vs vLLM's scheme, at 256- and 16-token blocks, interleaved."""
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 128_256, NUM_TOKENS, dtype=np.int32)
    tokens_list = tokens_np.tolist()
    with small_store() as store, small_store(block_tokens=SMALL_BLOCK_TOKENS) as store16:
        _check_keys(store, store16, tokens_np, tokens_list)
        subjects = _subjects(store, store16, tokens_np, tokens_list, (kv_reps, slow_reps))
        times = run_rounds(subjects, rounds)
    med = {name: median(values) for name, values in times.items()}
    return {**_figures(med), "reps": {name: len(values) for name, values in times.items()}}


def _figures(med: dict[str, float]) -> dict[str, Any]:
    """The JSON figures from the median seconds of each subject."""
    kv_s, kv_list_s, vllm_s = med["kvstore"], med["kvstore_list"], med["vllm_sha256"]
    kv16_s, vllm16_s = med["kvstore_block16"], med["vllm_sha256_block16"]
    ratio, ratio16, ms = vllm_s / kv_s, vllm16_s / kv16_s, kv_s * 1e3
    return {
        "num_tokens": NUM_TOKENS,
        "block_tokens": BLOCK_TOKENS,
        "num_keys": NUM_TOKENS // BLOCK_TOKENS,
        "chain_impl": CHAIN_IMPL,
        "kvstore_tokens_per_s": NUM_TOKENS / kv_s,
        "vllm_sha256_tokens_per_s": NUM_TOKENS / vllm_s,
        "ratio": ratio,
        "ms_per_128k": ms,
        "vllm_ms_per_128k": vllm_s * 1e3,
        "ratio_block16": ratio16,
        "ms_per_128k_block16": kv16_s * 1e3,
        "vllm_ms_per_128k_block16": vllm16_s * 1e3,
        "kvstore_list_tokens_per_s": NUM_TOKENS / kv_list_s,
        "kvstore_list_ms_per_128k": kv_list_s * 1e3,
        "ratio_list_input": vllm_s / kv_list_s,
        "target_ratio": TARGET_RATIO,
        "target_ms_per_128k": TARGET_MS_PER_128K,
        "meets_target": {
            "ratio": ratio >= TARGET_RATIO,
            "ratio_block16": ratio16 >= TARGET_RATIO,
            "ms_per_128k": ms <= TARGET_MS_PER_128K,
            "ratio_list_input": vllm_s / kv_list_s >= TARGET_RATIO,
        },
    }


def _fill(store: KVStore, n: int, rng: np.random.Generator, batch: int = 4096) -> None:
    """Store ``n`` more blocks under random keys (their content is irrelevant here)."""
    layout = store.layout
    kv = torch.zeros(layout.tensor_shape(batch), dtype=layout.dtype)
    left = n
    while left:
        k = min(batch, left)
        raw = rng.bytes(16 * k)
        keys = [BlockKey(raw[i : i + 16]) for i in range(0, 16 * k, 16)]
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


def vllm_real(python: Path, rounds: int, kv_reps: int, slow_reps: int) -> dict[str, Any]:
    """vLLM's own block hashing, timed in ``python`` (.venv-vllm) by the worker script."""
    if not python.exists():
        return _vllm_real_skipped(f"{python} does not exist (bash scripts/setup-vllm.sh)")
    cmd = [str(python), str(VLLM_WORKER), "--rounds", str(rounds)]
    cmd += ["--kv-reps", str(kv_reps), "--slow-reps", str(slow_reps)]
    cmd += ["--block-sizes", ",".join(map(str, VLLM_BLOCK_SIZES))]
    log(f"vLLM's own hashing in {python} ({rounds} rounds)")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return _vllm_real_skipped("the vLLM worker ran past 900 s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-3:]
        return _vllm_real_skipped(f"the vLLM worker failed (rc {proc.returncode}): {tail}")
    data = json.loads(lines[-1])
    algo = data["hash_algo"]
    vllm_ms, kv_ms = data["ms_per_128k"][algo], data["kvstore_ms_per_128k"]
    ratio = {size: vllm_ms[size] / kv_ms[size] for size in vllm_ms}
    return {
        "vllm_real_ms_per_128k": vllm_ms,
        "ratio_vs_vllm_real": ratio,
        "vllm_real_kvstore_ms_per_128k": kv_ms,
        # kvstore hashes 256-token chunks whatever the engine's block size: vLLM at each
        # block size over kvstore at 256 (what an engine with the connector pays for each).
        "ratio_vs_vllm_real_kvstore_256": (
            {size: ms / kv_ms["256"] for size, ms in vllm_ms.items()} if "256" in kv_ms else None
        ),
        "vllm_real_meets_target": {size: r >= TARGET_RATIO for size, r in ratio.items()},
        "vllm_real_hash_algo": algo,
        "vllm_real_other_algos_ms_per_128k": {
            a: ms for a, ms in data["ms_per_128k"].items() if a != algo
        },
        "vllm_real_function": data["function"],
        "vllm_real_version": data["vllm_version"],
        "vllm_real_reimplementation_matches": data["reimplementation_matches"],
        "vllm_real_reps": data["reps"],
        "vllm_real_skipped": None,
    }


def _vllm_real_skipped(reason: str) -> dict[str, Any]:
    """The vLLM-real fields when that part cannot run: null, with the reason."""
    log(f"vLLM's own hashing skipped: {reason}")
    names = (
        *("ms_per_128k", "kvstore_ms_per_128k", "meets_target", "hash_algo"),
        *("other_algos_ms_per_128k", "function", "version", "reimplementation_matches"),
    )
    return {
        "ratio_vs_vllm_real": None,
        "ratio_vs_vllm_real_kvstore_256": None,
        **{f"vllm_real_{name}": None for name in (*names, "reps")},
        "vllm_real_skipped": reason,
    }


def _vllm_rows(result: dict[str, Any]) -> list[list[object]]:
    """Table rows of vLLM's own hashing (one per block size), or why it was skipped."""
    if result["vllm_real_skipped"] is not None:
        return [["vLLM real hashing", "skipped", "", result["vllm_real_skipped"]]]
    rows: list[list[object]] = []
    for size, ms in result["vllm_real_ms_per_128k"].items():
        kv_ms, ratio = (
            result["vllm_real_kvstore_ms_per_128k"][size],
            result["ratio_vs_vllm_real"][size],
        )
        rows.append([f"vLLM real ({result['vllm_real_hash_algo']}), block {size}, ms", ms, "", ""])
        rows.append([f"  kvstore, block {size}, same process, ms", kv_ms, "", ""])
        rows.append(
            [f"  ratio vLLM real / kvstore, block {size}", ratio, ">= 30", ratio >= TARGET_RATIO]
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags (``--rounds`` defaults to 4 with ``--quick``, else 40)."""
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
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("KVSTORE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
        help="python of the venv with vLLM, for its own hashing ($KVSTORE_VLLM_PYTHON)",
    )
    parser.add_argument("--no-vllm-real", action="store_true", help="skip vLLM's own hashing")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 40)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table or (``--json``) one JSON object."""
    args = parse_args(argv)
    rounds = args.rounds
    log(f"hashing: {rounds} rounds x ({args.kv_reps} kvstore, {args.slow_reps} vLLM) reps")
    result: dict[str, Any] = {
        "benchmark": "hash",
        **bench_hashing(rounds, args.kv_reps, args.slow_reps),
    }
    if args.scaling:
        sizes = args.sizes or ([1_000, 10_000] if args.quick else [10_000, 100_000, 1_000_000])
        log(f"prefix lookup at {sizes} stored blocks")
        result.update(bench_prefix_lookup(sizes, 3 if args.quick else 20, 20))
    if args.no_vllm_real:
        result.update(_vllm_real_skipped("--no-vllm-real"))
    else:
        result.update(vllm_real(Path(args.vllm_python), rounds, args.kv_reps, args.slow_reps))
    result["environment"] = environment()
    emit(result, args.json, _rows(result, args.scaling))
    return 0


def _rows(result: dict[str, Any], scaling: bool) -> list[list[object]]:
    """The human table."""
    mt = result["meets_target"]
    rows: list[list[object]] = [
        ["what", "median", "target", "meets"],
        ["kvstore (np int32) ms / 128K tokens", result["ms_per_128k"], "<= 0.5", mt["ms_per_128k"]],
        ["vLLM sha256+pickle ms / 128K tokens", result["vllm_ms_per_128k"], "", ""],
        ["ratio vLLM / kvstore", result["ratio"], ">= 30", mt["ratio"]],
        ["kvstore, 16-token blocks, ms / 128K", result["ms_per_128k_block16"], "", ""],
        ["vLLM sha256+pickle, 16-token blocks, ms", result["vllm_ms_per_128k_block16"], "", ""],
        [
            "ratio vLLM / kvstore, 16-token blocks",
            result["ratio_block16"],
            ">= 30",
            mt["ratio_block16"],
        ],
        ["chain_keys implementation", result["chain_impl"], "", ""],
        ["kvstore (list input) ms / 128K", result["kvstore_list_ms_per_128k"], "", ""],
        [
            "ratio vLLM / kvstore (list input)",
            result["ratio_list_input"],
            ">= 30",
            mt["ratio_list_input"],
        ],
    ]
    rows += _vllm_rows(result)
    if scaling:
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
    return rows


if __name__ == "__main__":
    sys.exit(main())
