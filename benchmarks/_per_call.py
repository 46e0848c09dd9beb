"""Per-call costs on the engine's thread (bench_prefetch.py ``--per-call``), on the CPU.

Two figures of issue 54, each beside a raw copy of the same bytes timed in the same run,
interleaved, medians over rounds:

- ``put_layer``: a prefill of ``layers`` x ``blocks`` saved with ``store.put_layer`` one
  layer at a time (new keys each prefill, a host tier); ``caller_ms_per_call`` is the wall
  time of one call on the caller's thread, ``caller_cpu_ms_per_call`` that thread's CPU
  time (steady on a loaded machine); the raw baseline is one ``copy_`` of the layer into
  a slab-like buffer (the bytes put_layer moves). ``ratio`` = caller ÷ raw.
- ``prefetch_first_layer``: ``store.prefetch`` of ``blocks`` blocks until
  ``wait_layer(0)`` returns, against one raw copy of one layer of those blocks.

The geometry is small (``--per-call-heads`` heads x 128, 16-token blocks) so that the
Python on the path, not the memcpy, is what is measured. On a GPU the same two figures
are bench_gpu.py's ``put_layer_caller_ms`` and ``prefetch_first_layer_vs_raw``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _common import median, run_rounds

from kvstore import KVLayout, KVStore


def per_call(layers: int, blocks: int, heads: int, rounds: int) -> dict[str, Any]:
    """Both figures (see the module docstring)."""
    torch.set_grad_enabled(False)
    layout = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=128, block_tokens=16)
    kv = torch.randn(layout.tensor_shape(blocks)).to(layout.dtype)
    capacity = (8 + 4 * rounds) * blocks * 4
    config = {"tiers": [{"kind": "host", "capacity": capacity * layout.block_nbytes}]}
    slab = torch.empty((blocks, *layout.block_shape), dtype=layout.dtype)
    counter = iter(range(1, 1 << 30))
    with KVStore(layout, config) as store:

        def prefill_wall() -> float:
            keys = store.hash_tokens(
                [next(counter) * 100_000 + t for t in range(blocks * 16)], "per-call"
            )
            t0, c0 = time.perf_counter(), time.thread_time()
            for layer in range(layers):
                store.put_layer(keys, layer, kv[layer])
            cpu.append((time.thread_time() - c0) / layers)
            took = (time.perf_counter() - t0) / layers
            store.delete(keys)
            return took

        def raw_layer() -> float:
            t0 = time.perf_counter()
            for layer in range(layers):  # the bytes of one put_layer call, as one copy
                slab[:, layer].copy_(kv[layer].unflatten(1, (blocks, 16)).transpose(0, 1))
            return (time.perf_counter() - t0) / layers

        keys = store.hash_tokens(list(range(blocks * 16)), "per-call-stored")
        store.put(keys, kv)
        out = torch.empty_like(kv)

        def first_layer() -> float:
            t0 = time.perf_counter()
            handle = store.prefetch(keys, out)
            handle.wait_layer(0)
            took = time.perf_counter() - t0
            handle.wait()
            return took

        def raw_one_layer() -> float:
            t0 = time.perf_counter()
            out[0].copy_(kv[0])
            return time.perf_counter() - t0

        cpu: list[float] = []
        times = run_rounds(
            {
                "put_layer": (prefill_wall, 2),
                "raw_layer": (raw_layer, 2),
                "first_layer": (first_layer, 5),
                "raw_one_layer": (raw_one_layer, 5),
            },
            rounds,
        )
    ms = {name: median(values) * 1e3 for name, values in times.items()}
    return {
        "geometry": {
            "layers": layers,
            "blocks": blocks,
            "heads": heads,
            "head_dim": 128,
            "block_tokens": 16,
            "layer_kib": layout.layer_nbytes * blocks / 1024,
        },
        "put_layer": {
            "caller_ms_per_call": ms["put_layer"],
            "caller_cpu_ms_per_call": median(cpu) * 1e3,
            "raw_ms_per_call": ms["raw_layer"],
            "ratio": ms["put_layer"] / ms["raw_layer"],
        },
        "prefetch_first_layer": {
            "first_layer_ms": ms["first_layer"],
            "raw_layer_ms": ms["raw_one_layer"],
            "ratio": ms["first_layer"] / ms["raw_one_layer"],
        },
        "threads": torch.get_num_threads(),
    }
