"""The engine-step part of bench_gpu.py: vLLM's connector hooks on a CUDA paged cache.

A ``TransferWorker`` (what the vLLM connector runs in each worker) is registered
on 32 per-layer paged caches on the GPU (vLLM's layout: ``[blocks, heads, 16,
2 * head_dim]``, K then V). A step calls the hooks in vLLM's order -- start_load,
then per layer wait_layer, the layer's compute, save_layer; then finish_save --
and is timed with the GPU synchronised at its end (what the engine sees: the
saves' copies to host memory may still be landing; they are drained, untimed,
after each rep).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvstore import KVLayout, KVStore
from kvstore.connectors import ConnectorSettings, PagedKV, PageMap, TransferSpec, TransferWorker

PAGE = 16  # vLLM's block size on GPUs
TOKENS = 4096


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def engine_step(
    layout: KVLayout,
    full: Callable[[], object],
    suffix: Callable[[], object],
    reps: int,
    loads: bool = True,
) -> dict[str, Any]:
    """Time a step without transfers, with every layer saved, and (``loads``) one that
    loads a cached 4096-token prefix and computes only ``suffix`` per layer."""
    blocks = TOKENS // PAGE
    shape = (2 * blocks + 1, layout.num_kv_heads, PAGE, 2 * layout.head_dim)
    caches = [torch.randn(shape, device="cuda").to(layout.dtype) for _ in range(layout.num_layers)]
    paged = PagedKV(caches, PageMap.joined_last(PAGE, layout.head_dim), PAGE)
    config = {"tiers": [{"kind": "host", "capacity": "4GiB"}], "saves": {"staging_bytes": "1GiB"}}
    store = KVStore(layout, config)
    worker = TransferWorker(store, 0, PAGE, ConnectorSettings(flush="close"))
    worker.register(paged)
    first = list(range(1, blocks + 1))
    second = list(range(blocks + 1, 2 * blocks + 1))
    try:
        return _measure(worker, store, (full, suffix), (first, second), reps, loads)
    finally:
        worker.close()


def _step(
    worker: TransferWorker,
    loads: list[TransferSpec],
    saves: list[TransferSpec],
    compute: Callable[[], object],
) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    worker.start_load(loads)
    for layer in range(worker.layout.num_layers):
        worker.wait_layer(layer)
        compute()
        worker.save_layer(layer, saves)
    worker.finish_save(saves)
    errors = worker.take_load_errors()
    torch.cuda.synchronize()
    assert not errors, f"load errors: {sorted(errors)[:4]}"
    return time.perf_counter() - t0


def _measure(
    worker: TransferWorker,
    store: KVStore,
    computes: tuple[Callable[[], object], Callable[[], object]],
    tables: tuple[list[int], list[int]],
    reps: int,
    loads: bool,
) -> dict[str, Any]:
    full, suffix = computes
    first, second = tables
    layout = store.layout
    plain = [_step(worker, [], [], full) for _ in range(reps + 1)][1:]
    saved, keys = [], []
    for rep in range(reps + 1):
        keys = store.hash_tokens(list(range(TOKENS)), namespace=f"step-{rep}")
        spec = TransferSpec(f"s{rep}", {0: keys}, 0, 0, TOKENS, (first,))
        t = _step(worker, [], [spec], full)
        store.drain()  # untimed: the next step starts with the copies landed
        if rep:
            saved.append(t)
    out: dict[str, Any] = {
        "step_ms": _median(plain) * 1e3,
        "step_with_saves_ms": _median(saved) * 1e3,
        "engine_step_save_overhead": _median(saved) / _median(plain),
        "chunks_stored": store.lookup(keys),
    }
    if not loads:
        return out
    loaded = []
    for rep in range(reps + 1):
        spec = TransferSpec(f"l{rep}", {0: keys}, 0, 0, TOKENS, (second,))
        t = _step(worker, [spec], [], suffix)
        if rep:
            loaded.append(t)
    a = worker.paged
    assert a is not None
    for layer in (0, layout.num_layers - 1):  # the loaded KV is the saved KV
        mine = a.caches[layer][first[0] : first[-1] + 1]
        theirs = a.caches[layer][second[0] : second[-1] + 1]
        assert torch.equal(mine, theirs), f"layer {layer}: loaded KV differs"
    out["step_load_ms"] = _median(loaded) * 1e3
    out["engine_step_load_speedup"] = _median(plain) / _median(loaded)
    return out
