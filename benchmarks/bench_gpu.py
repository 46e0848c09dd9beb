"""kvstore on a GPU, each figure beside the raw copy it is made of, measured in the same run.

One JSON line (``{"skipped": true, "reason": ...}`` without CUDA). Llama-3-8B blocks
(32 layers, 8 KV heads x 128, 256 tokens, bf16: 32 MiB a block). Medians of
``--reps`` repetitions; every raw baseline is timed in the same process just before.

- ``host_put_ratio`` / ``host_get_ratio``: ``put`` from and ``get(out=gpu)`` into
  a GPU tensor against one pinned ``non_blocking`` copy of the same bytes
  (``saves: sync`` for the put; ``host_put_async_ratio`` is put + drain with
  the default asynchronous saves).
- ``hbm_get_ratio`` / ``hbm_get_vs_device_copy``: a device-tier ``get(out=gpu)`` against
  one device copy of the same bytes, with the engine's default device-to-device path (the
  rows kernel, ``copies/kernel.py``, where Triton is installed); ``hbm_get_<how>_gbps``
  for each path (``dma``, ``kernel``: torch's strided copy, ``rows``), and whether the
  rows kernel ran (``rows_kernel``, ``batches_rows``).
- ``get_then_cuda_ratio``: ``get(keys)`` (pinned result) then ``.cuda()``,
  against the raw host-to-device rate.
- ``prefetch_*``: a layerwise prefetch while a matmul per layer, calibrated to
  one layer's raw copy time, consumes each layer after ``wait_layer_on``:
  ``overlap`` (the share of the shorter of load and compute hidden),
  ``speedup`` (load-then-compute / pipelined), the same with raw event-ordered
  side-stream copies (``prefetch_raw_speedup``: the limit), the first layer's
  arrival against one raw layer copy, and 4 prefetches at once against the link.
- ``put_layer_*``: a whole prefill saved layer by layer from the GPU, against
  raw asynchronous copies of the same bytes, and the caller's time per call.
- ``engine_step_*``: vLLM's hooks (``TransferWorker`` on a CUDA ``PagedKV``) in a
  32-layer step whose compute per layer is calibrated to Llama-3-8B's FLOPs
  for 4096 tokens (``..._copy_calibrated``: to one layer's copy time, the worst
  case): the step with every layer saved against without, and a cached
  4096-token prefix loaded against recomputing it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _common import base_parser, environment, median
from _gpu_engine import engine_step

from kvstore import KVLayout, KVStore

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=256)
GB = 1e9


def sync() -> None:
    torch.cuda.synchronize()


def clock(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` (the GPU synchronised before and after each rep)."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return median(times)


def kv_of(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = LAYOUT.tensor_shape(n)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(LAYOUT.dtype)


def keys_for(store: KVStore, n: int, name: str) -> list[bytes]:
    return store.hash_tokens(list(range(n * LAYOUT.block_tokens)), namespace=name)


def host_store(gib: int, **extra: Any) -> KVStore:
    return KVStore(LAYOUT, {"tiers": [{"kind": "host", "capacity": f"{gib}GiB"}], **extra})


def raw_rates(nbytes: int, reps: int) -> dict[str, float]:
    """Pinned host <-> device and device <-> device, one copy of ``nbytes`` each."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(dev)
    return {
        "h2d_gbps": nbytes / clock(lambda: dev.copy_(host, non_blocking=True), reps) / GB,
        "d2h_gbps": nbytes / clock(lambda: host.copy_(dev, non_blocking=True), reps) / GB,
        "d2d_gbps": nbytes / clock(lambda: other.copy_(dev), reps) / GB,
    }


def bench_host(n: int, reps: int, raw: dict[str, float]) -> dict[str, Any]:
    """Host tier put / get against raw pinned copies."""
    kv, nbytes = kv_of(n), n * LAYOUT.block_nbytes
    out = torch.empty_like(kv)
    res: dict[str, Any] = {}
    for mode in ("sync", "async"):
        gib = 4 * nbytes // (1 << 30) + 2
        with host_store(gib, saves={"mode": mode, "staging_bytes": "1GiB"}) as store:
            times = []
            for rep in range(reps + 1):
                keys = keys_for(store, n, f"{mode}-{rep}")
                sync()
                t0 = time.perf_counter()
                store.put(keys, kv)
                store.drain()
                times.append(time.perf_counter() - t0)
                if rep < reps:
                    store.delete(keys)
            res[f"put_{mode}_gbps"] = nbytes / median(times[1:]) / GB
            if mode == "sync":
                res["get_gbps"] = nbytes / clock(lambda k=keys: store.get(k, out=out), reps) / GB
                assert torch.equal(out, kv)
                result = store.get(keys)
                res["get_result_pinned"] = result.is_pinned()
                res["get_then_cuda_gbps"] = nbytes / clock(lambda r=result: r.cuda(), reps) / GB
                both = clock(lambda k=keys: store.get(k).cuda(), reps)
                res["get_and_cuda_gbps"] = nbytes / both / GB
                gpu = clock(lambda k=keys: store.get(k, device="cuda"), reps)
                res["get_device_cuda_gbps"] = nbytes / gpu / GB
    res["host_put_ratio"] = res["put_sync_gbps"] / raw["d2h_gbps"]
    res["host_put_async_ratio"] = res["put_async_gbps"] / raw["d2h_gbps"]
    res["host_get_ratio"] = res["get_gbps"] / raw["h2d_gbps"]
    res["get_then_cuda_ratio"] = res["get_then_cuda_gbps"] / raw["h2d_gbps"]
    res["get_and_cuda_ratio"] = res["get_and_cuda_gbps"] / raw["h2d_gbps"]
    res["get_device_cuda_ratio"] = res["get_device_cuda_gbps"] / raw["h2d_gbps"]
    return res


def bench_hbm(n: int, reps: int, raw: dict[str, float]) -> dict[str, Any]:
    kv, nbytes = kv_of(n, 1), n * LAYOUT.block_nbytes
    out = torch.empty_like(kv)
    tiers = [{"kind": "device", "device": "cuda", "capacity": 2 * nbytes}]
    from kvstore.copies import engine_for

    engine = engine_for("cuda")
    res: dict[str, Any] = {}
    with KVStore(LAYOUT, {"tiers": tiers}) as store:
        keys = keys_for(store, n, "hbm")
        store.put(keys, kv)
        store.drain()
        for how in ("dma", "kernel", "rows"):  # the default last
            engine.d2d = how  # type: ignore[attr-defined]
            out.zero_()
            store.get(keys, out=out)  # warm-up: the rows kernel compiles on its first batch
            assert torch.equal(out, kv), how
            took = clock(lambda k=keys: store.get(k, out=out), reps)
            res[f"hbm_get_{how}_gbps"] = nbytes / took / GB
            assert torch.equal(out, kv), how
        stats = engine.stats()  # type: ignore[attr-defined]
    gbps = res["hbm_get_rows_gbps"]
    return {
        **res,
        "hbm_get_gbps": gbps,
        "hbm_get_ratio": gbps / raw["d2d_gbps"],
        "hbm_get_vs_device_copy": gbps / raw["d2d_gbps"],
        "rows_kernel": stats.get("rows_kernel"),
        "batches_rows": stats.get("batches_rows"),
    }


def matmul_for(seconds: float) -> Callable[[], object]:
    """A bf16 matmul of (m x 4096) @ (4096 x 4096) taking about ``seconds``."""
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ w
    per = clock(lambda: x @ w, 5)
    m = max(64, int(4096 * seconds / per) // 64 * 64)
    a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ w


def bench_prefetch(store: KVStore, n: int, reps: int, raw: dict[str, float]) -> dict[str, Any]:
    """Layerwise prefetch of ``n`` blocks from the host tier, overlapped with compute."""
    L, layer_bytes = LAYOUT.num_layers, n * LAYOUT.layer_nbytes
    keys = keys_for(store, n, f"pf-{n}")
    kv = kv_of(n, 2)
    store.put(keys, kv)
    store.drain()
    out = torch.empty_like(kv)
    layer_s = layer_bytes / (raw["h2d_gbps"] * GB)
    compute = matmul_for(layer_s)

    def run_compute() -> None:
        for _ in range(L):
            compute()

    def load() -> None:
        store.prefetch(keys, out=out).wait()

    def serial() -> None:
        store.prefetch(keys, out=out).wait()
        run_compute()

    def pipelined() -> None:
        handle = store.prefetch(keys, out=out)
        for layer in range(L):
            handle.wait_layer_on(layer)
            compute()
        handle.wait()

    for fn in (load, serial, pipelined):
        fn()
    t = {f.__name__: clock(f, reps) for f in (load, run_compute, serial, pipelined)}
    assert torch.equal(out, kv)
    raw_t = raw_layered(n, compute, reps)

    timelines = [layer_arrivals(store, keys, out) for _ in range(reps)]
    firsts = [timeline[0] / 1e3 for timeline in timelines]
    shorter = min(t["load"], t["run_compute"])
    timeline = timelines[-1]
    return {
        "blocks": n,
        "load_ms": t["load"] * 1e3,
        "compute_ms": t["run_compute"] * 1e3,
        "serial_ms": t["serial"] * 1e3,
        "pipelined_ms": t["pipelined"] * 1e3,
        "load_gbps": n * LAYOUT.block_nbytes / t["load"] / GB,
        "prefetch_overlap": (t["load"] + t["run_compute"] - t["pipelined"]) / shorter,
        "prefetch_speedup": t["serial"] / t["pipelined"],
        "first_layer_ms": median(firsts) * 1e3,
        **raw_t,
        "prefetch_first_layer_vs_raw": median(firsts) / raw_t["raw_layer_ms"] * 1e3,
        "layer_arrival_ms": timeline,
    }


def layer_arrivals(store: KVStore, keys: list[bytes], out: torch.Tensor) -> list[float]:
    """When each layer landed on the GPU, in ms from the prefetch() call (a side stream
    waits for each layer and records a timing event): gaps show the link idling."""
    side = torch.cuda.Stream()
    start = torch.cuda.Event(enable_timing=True)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(LAYOUT.num_layers)]
    sync()
    start.record(side)
    handle = store.prefetch(keys, out=out)
    with torch.cuda.stream(side):
        for layer, event in enumerate(events):
            handle.wait_layer_on(layer)
            event.record(side)
    handle.wait()
    sync()
    return [round(start.elapsed_time(e), 3) for e in events]


def raw_layered(n: int, compute: Callable[[], object], reps: int) -> dict[str, float]:
    """The limit: raw pinned copies of each layer on a side stream, an event per layer,
    the compute stream waiting on each event (no store)."""
    L, layer_bytes = LAYOUT.num_layers, n * LAYOUT.layer_nbytes
    src = torch.empty((L, layer_bytes), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty((L, layer_bytes), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(L)]

    def copies() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for layer in range(L):
                dst[layer].copy_(src[layer], non_blocking=True)
                events[layer].record(side)

    def serial() -> None:
        copies()
        torch.cuda.current_stream().wait_event(events[-1])
        for _ in range(L):
            compute()

    def pipelined() -> None:
        copies()
        for layer in range(L):
            torch.cuda.current_stream().wait_event(events[layer])
            compute()

    one = clock(lambda: dst[0].copy_(src[0], non_blocking=True), reps)
    s, p = clock(serial, reps), clock(pipelined, reps)
    return {
        "raw_layer_ms": one * 1e3,
        "raw_serial_ms": s * 1e3,
        "raw_pipelined_ms": p * 1e3,
        "prefetch_raw_speedup": s / p,
    }


def bench_concurrent(store: KVStore, n: int, reps: int, raw: dict[str, float]) -> dict[str, Any]:
    """4 prefetches of different prefixes started at once, against the link."""
    sets = []
    for i in range(4):
        keys = keys_for(store, n, f"c4-{i}")
        store.put(keys, kv_of(n, 10 + i))
        sets.append((keys, torch.empty(LAYOUT.tensor_shape(n), dtype=LAYOUT.dtype, device="cuda")))
    store.drain()

    def four() -> None:
        handles = [store.prefetch(k, out=o) for k, o in sets]
        for h in handles:
            h.wait()

    four()
    gbps = 4 * n * LAYOUT.block_nbytes / clock(four, reps) / GB
    return {"concurrent4_gbps": gbps, "prefetch_concurrent4_ratio": gbps / raw["h2d_gbps"]}


def bench_dma(reps: int) -> dict[str, Any]:
    """Row copies against one plain copy of the same bytes, host to device: 64 rows of
    512 KiB (a block into an engine tensor) and 32 rows of 1 MiB."""
    from kvstore.copies import Rows, load_cudart

    runtime = load_cudart()
    if runtime is None:
        return {"skipped": "libcudart not found"}
    nbytes = 32 << 20
    host = torch.empty(2 * nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    out: dict[str, Any] = {}
    for rows, width in ((1, nbytes), (32, 1 << 20), (64, 512 << 10)):
        pitch = 2 * width if rows > 1 else width
        plan = Rows(dev.data_ptr(), pitch, host.data_ptr(), pitch, width, rows)
        took = clock(lambda p=plan: runtime.copy(p, stream), reps)
        out[f"h2d_rows{rows}_gbps"] = nbytes / took / GB
    return out


def bench_put_layer(n: int, reps: int) -> dict[str, Any]:
    """A prefill's layers saved as they come, against raw async copies of the same bytes."""
    L = LAYOUT.num_layers
    kv = kv_of(n, 3)
    layers = [kv[layer].contiguous() for layer in range(L)]
    pinned = torch.empty((L, *layers[0].shape), dtype=LAYOUT.dtype, pin_memory=True)

    def raw() -> None:
        for layer in range(L):
            pinned[layer].copy_(layers[layer], non_blocking=True)

    raw_s = clock(raw, reps)
    totals, callers = [], []
    gib = 2 * n * LAYOUT.block_nbytes // (1 << 30) + 2
    with host_store(gib, saves={"staging_bytes": "1GiB"}) as store:
        for rep in range(reps + 1):
            keys = keys_for(store, n, f"pl-{rep}")
            sync()
            t0 = time.perf_counter()
            calls = []
            for layer in range(L):
                c0 = time.perf_counter()
                store.put_layer(keys, layer, layers[layer])
                calls.append(time.perf_counter() - c0)
            store.drain()
            totals.append(time.perf_counter() - t0)
            callers.append(median(calls))
            assert store.lookup(keys) == n
            store.delete(keys)
    total = median(totals[1:])
    return {
        "put_layer_ms": total * 1e3,
        "raw_async_ms": raw_s * 1e3,
        "put_layer_ratio": raw_s / total,
        "put_layer_caller_ms": median(callers[1:]) * 1e3,
    }


def step_compute(tokens: int) -> Callable[[], object]:
    """One Llama-3-8B decoder layer's FLOPs for ``tokens`` tokens, as one matmul."""
    flops = 2 * 218e6 * tokens + 4 * tokens * tokens * 4096 / 2  # weights + causal attention
    m = max(64, int(flops / (2 * 4096 * 4096)) // 64 * 64)
    a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ w


def bench_engine_step(reps: int) -> dict[str, Any]:
    out = engine_step(LAYOUT, step_compute(4096), step_compute(256), reps)
    copy_cal = matmul_for(16 * LAYOUT.layer_nbytes / 50e9)
    worst = engine_step(LAYOUT, copy_cal, copy_cal, reps, loads=False)
    out["engine_step_save_overhead_copy_calibrated"] = worst["engine_step_save_overhead"]
    return out


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.quick:
        args.reps = min(args.reps, 2)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": True, "reason": "no CUDA device"}))
        return
    torch.set_grad_enabled(False)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "env": environment()}
    raw = raw_rates(args.blocks * LAYOUT.block_nbytes, args.reps)
    result["raw"] = raw
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("host", lambda: bench_host(args.blocks, args.reps, raw)),
        ("hbm", lambda: bench_hbm(args.blocks, args.reps, raw)),
        ("prefetch", lambda: prefetch_all(args.reps, raw)),
        ("put_layer", lambda: bench_put_layer(args.blocks, args.reps)),
        ("dma", lambda: bench_dma(args.reps)),
        ("engine_step", lambda: bench_engine_step(args.reps)),
    ]
    for name, run in sections:
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as exc:  # one failing section still reports the others
            result[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
            }
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    result.update(headline(result))
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


def prefetch_all(reps: int, raw: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with host_store(5, prefetch={"threads": 4}) as store:
        for n in (8, 32):
            out[f"blocks_{n}"] = bench_prefetch(store, n, reps, raw)
        out.update(bench_concurrent(store, 16, reps, raw))
    engine = store.engine.datapath.copies  # the store's host engine; the GPU one reports its path
    from kvstore.copies import engine_for

    gpu = engine_for("cuda")
    out["engine"] = getattr(gpu, "stats", lambda: {})()
    out["host_engine"] = type(engine).__name__
    return out


HEADLINE = {
    "host_put_ratio": ("host", "host_put_ratio", 0.95),
    "host_get_ratio": ("host", "host_get_ratio", 0.95),
    "hbm_get_ratio": ("hbm", "hbm_get_ratio", 0.8),
    "hbm_get_vs_device_copy": ("hbm", "hbm_get_vs_device_copy", 0.8),
    "get_then_cuda_ratio": ("host", "get_then_cuda_ratio", 0.8),
    "prefetch_concurrent4_ratio": ("prefetch", "prefetch_concurrent4_ratio", 0.9),
    "put_layer_ratio": ("put_layer", "put_layer_ratio", 0.85),
    "engine_step_load_speedup": ("engine_step", "engine_step_load_speedup", 5.0),
}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's fields at the top level, with pass/fail against their targets."""
    top: dict[str, Any] = {}
    passes: dict[str, bool | None] = {}
    for field, (section, key, bar) in HEADLINE.items():
        value = result.get(section, {}).get(key)
        top[field] = value
        passes[field] = None if value is None else value >= bar
    pf = result.get("prefetch", {}).get("blocks_32", {})
    for field, key, bar, up in (
        ("prefetch_overlap", "prefetch_overlap", 0.9, True),
        ("prefetch_speedup", "prefetch_speedup", 1.6, True),
        ("prefetch_first_layer_vs_raw", "prefetch_first_layer_vs_raw", 2.0, False),
    ):
        value = pf.get(key)
        top[field] = value
        passes[field] = None if value is None else (value >= bar if up else value <= bar)
    caller = result.get("put_layer", {}).get("put_layer_caller_ms")
    top["put_layer_caller_ms"] = caller
    passes["put_layer_caller_ms"] = None if caller is None else caller <= 0.05
    ov = result.get("engine_step", {}).get("engine_step_save_overhead")
    top["engine_step_save_overhead"] = ov
    passes["engine_step_save_overhead"] = None if ov is None else ov <= 1.05
    top["pass"] = passes
    return top


if __name__ == "__main__":
    main()
