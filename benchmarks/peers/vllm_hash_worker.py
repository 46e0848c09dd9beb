"""vLLM's own prefix-cache block hashing beside kvstore's ``hash_tokens``, in .venv-vllm.

Run by ``benchmarks/bench_hash.py`` with ``.venv-vllm/bin/python`` (vLLM lives
only there); prints one JSON object as its last line of stdout.

vLLM's hashing, the real code (vllm 0.32, what ``EngineCore`` sets up):
``get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)`` (``sha256``,
pickle + SHA-256, by default; ``sha256_cbor`` too), ``init_none_hash`` and
``get_request_block_hasher(block_size, hash_fn)`` from
``vllm.v1.core.kv_cache_utils``, called on a ``vllm.v1.request.Request`` whose
prompt is the token list and that has no hashes yet, so each call hashes every
full block (``hash_block_tokens`` per block, chained). kvstore's
``hash_tokens`` runs in the same process, interleaved in the same rounds, with
a layout of the same block size, on the same tokens as a numpy int32 array.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common

from _common import Rep, median, run_rounds, timed

NAMESPACE = "bench/llama-3-8b@rev"
FUNCTION = "vllm.v1.core.kv_cache_utils.get_request_block_hasher"


def vllm_subjects(
    tokens: list[int], block_sizes: list[int], algos: list[str], reps: int
) -> dict[str, tuple[Rep, int]]:
    """One timed subject per (hash algorithm, block size): the request block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    request = Request("bench", tokens, SamplingParams(max_tokens=1), None)
    subjects: dict[str, tuple[Rep, int]] = {}
    for algo in algos:
        fn = get_hash_fn_by_name(algo)
        for size in block_sizes:
            hasher = kv_cache_utils.get_request_block_hasher(size, fn)
            rep = _vllm_rep(kv_cache_utils, fn, hasher, request, len(tokens) // size)
            subjects[f"vllm/{algo}/{size}"] = (rep, reps)
    return subjects


def _vllm_rep(utils: Any, fn: Any, hasher: Callable[[Any], list[Any]], request: Any, n: int) -> Rep:
    """A rep: set vLLM's chain seed for ``fn`` (untimed), then hash every block of ``request``."""

    def rep() -> float:
        utils.init_none_hash(fn)  # NONE_HASH is global and depends on the hash function
        start = time.perf_counter()
        hashes = hasher(request)
        elapsed = time.perf_counter() - start
        assert len(hashes) == n, (len(hashes), n)
        return elapsed

    return rep


def kvstore_subjects(
    tokens: np.ndarray, block_sizes: list[int], reps: int
) -> tuple[dict[str, tuple[Rep, int]], list[Any]]:
    """``store.hash_tokens`` per block size (stores with a tiny layout of that block size)."""
    from kvstore import KVLayout, KVStore, StoreConfig

    subjects: dict[str, tuple[Rep, int]] = {}
    stores = []
    for size in block_sizes:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_tokens=size)
        tier = {"kind": "host", "capacity": 1 << 20}
        store = KVStore(layout, StoreConfig.from_dict({"tiers": [tier]}, environ={}))
        assert len(store.hash_tokens(tokens, NAMESPACE)) == len(tokens) // size
        subjects[f"kvstore/{size}"] = (
            timed(functools.partial(store.hash_tokens, tokens, NAMESPACE)),
            reps,
        )
        stores.append(store)
    return subjects, stores


def reimplementation_matches(tokens: list[int], size: int) -> bool:
    """bench_hash.py's reimplementation, seeded with vLLM's NONE_HASH, gives vLLM's hashes."""
    from bench_hash import vllm_block_hashes
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    request = Request("check", tokens, SamplingParams(max_tokens=1), None)
    real = kv_cache_utils.get_request_block_hasher(size, sha256)(request)
    mine = vllm_block_hashes(tokens, size, none_hash=bytes(kv_cache_utils.NONE_HASH))
    return [bytes(h) for h in real] == mine


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time everything, interleaved; medians in ms per ``--num-tokens`` tokens."""
    import vllm
    from vllm.config.cache import CacheConfig

    default = CacheConfig().prefix_caching_hash_algo
    algos = [default, *(a for a in args.algos if a != default)]
    tokens_np = np.random.default_rng(0).integers(0, 128_256, args.num_tokens, dtype=np.int32)
    tokens = tokens_np.tolist()
    subjects, stores = kvstore_subjects(tokens_np, args.block_sizes, args.kv_reps)
    subjects.update(vllm_subjects(tokens, args.block_sizes, algos, args.slow_reps))
    try:
        times = run_rounds(subjects, args.rounds)
    finally:
        for store in stores:
            store.close()
    ms = {name: median(t) * 1e3 for name, t in times.items()}
    return {
        "vllm_version": vllm.__version__,
        "function": FUNCTION,
        "hash_algo": default,
        "num_tokens": args.num_tokens,
        "ms_per_128k": {a: {str(s): ms[f"vllm/{a}/{s}"] for s in args.block_sizes} for a in algos},
        "kvstore_ms_per_128k": {str(s): ms[f"kvstore/{s}"] for s in args.block_sizes},
        "reimplementation_matches": reimplementation_matches(tokens, 256),
        "reps": {name: len(t) for name, t in times.items()},
    }


def main() -> int:
    """Parse flags, measure, print the JSON object as the last line of stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--kv-reps", type=int, default=50)
    parser.add_argument("--slow-reps", type=int, default=5)
    parser.add_argument("--num-tokens", type=int, default=131072)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--block-sizes", type=ints, default=[16, 256])
    parser.add_argument("--algos", type=lambda s: s.split(","), default=["sha256_cbor"])
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # vLLM's import chatter stays off stdout
        result = measure(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
