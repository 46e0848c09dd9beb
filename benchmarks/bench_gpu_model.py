"""Time to first token on a real model architecture: full prefill vs a kvstore prefix hit.

A Llama with Llama-3.1-8B's shapes (random bf16 weights made on the GPU, HF transformers,
SDPA) prefills prompts of ``--lengths`` tokens (medians of ``--repeats``, after a warm-up):
``ttft_full_ms``, all T tokens; ``ttft_hit_host_ms`` / ``ttft_hit_disk_ms``, the prefix P
(whole chunks below T) from a store of one host / one disk tier: ``store.prefetch(keys,
out=gpu_buffer, order="layer")``, then the T-P suffix over a ``DynamicCache`` of views of
``gpu_buffer``, a pre-hook on decoder layer i calling ``handle.wait_layer_on(i)`` (the GPU
waits for layer i while later layers load), timed to the first token on the CPU;
``save_overhead``, prefill that ``put_layer``-s each layer over prefill without; raw rates;
``ttft_planned_disk_ms``, the disk hit with restore planning (a fresh host-over-disk store
after a restart, declared the prefill rate this prompt measured, loads what pays and
recomputes the rest: ``planned_vs_best`` against the better of the two) and
``ttft_next_turn_ms``, the same prompt once the plans' warming has brought it to host memory
(``turns_to_host``: the planned restores that took, usually 1).
The hit must equal an oracle (the same suffix forward over an in-memory copy of the stored
KV) bit for bit, with the same 16 greedy tokens. One JSON line on stdout; ``{"skipped":
true, ...}`` (exit 0) without CUDA (unless ``--device cpu``; ``--tiny`` for the CPU smoke
test) or transformers. Run: ``python benchmarks/bench_gpu_model.py [--lengths 4096]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _common import base_parser, log, median
from _gpu_llama import (
    LLAMA_8B,
    TINY,
    Spec,
    build_model,
    cache_over,
    forward,
    greedy,
    layer_hooks,
    new_cache,
    sync,
)
from _gpu_rates import disk_raw_read, drop_page_cache, h2d_gbps

try:
    import torch
except ImportError:  # reported as a skip, not a crash
    torch = None  # type: ignore[assignment]

NAMESPACE = "llama-bench"
MAX_TURNS = 3  # planned restores of one prompt before it must be in host memory
TARGET_TOKENS = 16384
TARGETS = {
    "at_tokens": TARGET_TOKENS,  # the three hit targets; the other two hold at every length
    "hit_speedup_host_min": 4.0,
    "hit_vs_link_limit_max": 1.25,
    "hit_speedup_disk_min": 1.5,
    "save_overhead_max": 1.05,
    "greedy_identical": True,  # hit vs oracle, host and disk
    "logits_exact": True,  # the same, first-token logits bit for bit
    # A planned restore from disk (load what pays, recompute the rest) against the better
    # of loading every chunk and recomputing all, at every length; and its next turn (the
    # warmed chunks from host memory) equal to the oracle.
    "planned_vs_best_max": 1.05,
    "next_turn_exact": True,
}


@dataclass
class Bench:
    """What every measurement needs: the model, where it runs, the store's layout."""

    model: Any
    spec: Spec
    device: Any  # torch.device
    layout: Any  # kvstore.KVLayout
    repeats: int
    drop_cache: bool
    disk_root: Path


# -- measurements ---------------------------------------------------------------------------
def open_store(bench: Bench, blocks: int, disk_dir: Path | None = None) -> Any:
    """A store of one host tier, or one disk tier (``page_cache: bypass``) in ``disk_dir``."""
    from kvstore import KVStore

    # Room for ``blocks`` below the 0.9 high watermark, so nothing is ever evicted.
    room = f"{math.ceil((blocks / 0.8 + 2) * bench.layout.block_nbytes / 2**20)}MiB"
    tier: dict[str, Any] = {"kind": "host", "capacity": room}
    if disk_dir is not None:
        tier.update(kind="disk", path=str(disk_dir), page_cache="bypass")
    return KVStore(bench.layout, {"tiers": [tier]})


def time_prefill(bench: Bench, ids: Any, save: Callable[[int, Any], None] | None) -> float:
    """Milliseconds from the call to the first token on the CPU, for a full prefill."""
    with layer_hooks(bench.model, post=save):
        sync(bench.device)
        start = time.perf_counter()
        int(forward(bench.model, ids, 0, new_cache(bench.model)).argmax())
        sync(bench.device)
        return (time.perf_counter() - start) * 1e3


def saver(store: Any, keys: list[Any], prefix: int) -> Callable[[int, Any], None]:
    """A post-layer hook: store layer i's first ``prefix`` tokens, as kvstore's (2, P, H, D)."""

    def save(i: int, cache: Any) -> None:
        layer = cache.layers[i]
        k, v = layer.keys[0, :, :prefix], layer.values[0, :, :prefix]  # (H, P, D)
        kv = torch.stack((k.transpose(0, 1), v.transpose(0, 1)))  # a fresh tensor: donated
        store.put_layer(keys, i, kv, donate=True)

    return save


@dataclass
class Case:
    """One prompt: its token ids (on the device), the prefix's keys and reference KV, the
    engine's buffer for hits, and the (first-token logits, greedy tokens) to compare."""

    ids: Any
    keys: list[Any]
    ref: Any
    buf: Any
    oracle: tuple[Any, list[int]]
    full: tuple[Any, list[int]]


def full_and_saves(bench: Bench, store: Any, case: Case) -> dict[str, Any]:
    """(a) full prefill and (d) full prefill with layerwise saves, interleaved rep by rep."""
    pairs, found = [], []
    save = saver(store, case.keys, case.ref.shape[2])
    for _ in range(bench.repeats + 1):  # the first: the warm-up of both
        store.clear()  # so that every rep really saves
        pairs.append((time_prefill(bench, case.ids, None), time_prefill(bench, case.ids, save)))
        store.drain()  # the background copies of the saves
        found.append(store.lookup(case.keys))
    plain, saved = (list(t) for t in zip(*pairs[1:], strict=True))
    # What the background saves stored, byte for byte.
    loaded = found[-1] == len(case.keys) and store.get(case.keys, out=case.buf)
    return {
        "ttft_full_ms": median(plain),
        "ttft_full_with_saves_ms": median(saved),
        "save_overhead": median(saved) / median(plain),
        "saved_blocks_found": min(found),
        "saved_kv_equal_reference": loaded is not False and bool(torch.equal(loaded, case.ref)),
        "ttft_full_ms_all": plain,
        "ttft_full_with_saves_ms_all": saved,
    }


def timed_hit(bench: Bench, store: Any, case: Case) -> tuple[float, Any, Any]:
    """One hit: prefetch into ``case.buf``, the suffix forward waiting for each layer.

    Returns (milliseconds, first-token logits, the cache after the forward).
    """
    prefix, handle = case.buf.shape[2], None
    try:
        with layer_hooks(bench.model, pre=lambda i: wait(i)):
            sync(bench.device)
            start = time.perf_counter()
            handle = store.prefetch(case.keys, out=case.buf, order="layer")
            # On the GPU where the handle can: the CPU only waits until the copies are queued.
            wait = getattr(handle, "wait_layer_on", handle.wait_layer)
            cache = cache_over(bench.model, case.buf)
            logits = forward(bench.model, case.ids[prefix:], prefix, cache)
            int(logits.argmax())
            sync(bench.device)
            ms = (time.perf_counter() - start) * 1e3
    finally:
        if handle is not None:  # never leave a load writing into a buffer being freed
            handle.wait()
    if handle.valid_blocks != len(case.keys):
        raise RuntimeError(f"prefetch found {handle.valid_blocks} of {len(case.keys)} blocks")
    return ms, logits, cache


def hits(bench: Bench, store: Any, case: Case, disk_dir: Path | None = None) -> Any:
    """A warm-up and ``repeats`` timed hits; the last one checked, exactly against the
    oracle, informationally against the full prefill. Returns (times, page cache dropped
    before every hit: None without ``disk_dir``, the checks)."""
    times, dropped, last = [], [], None
    for _ in range(bench.repeats + 1):
        last = None  # frees the previous hit's cache before the next one grows its own
        case.buf.fill_(float("nan"))  # a block that never arrives cannot pass for stale data
        sync(bench.device)
        if disk_dir is not None:
            dropped.append(drop_page_cache(sorted(disk_dir.rglob("*.kvb")), bench.drop_cache))
        last = timed_hit(bench, store, case)
        times.append(last[0])
    _, logits, cache = last
    tokens = greedy(bench.model, cache, logits, case.ids.shape[0])
    check: dict[str, Any] = {"greedy_tokens": tokens}
    for name, (ref_logits, ref_tokens) in (("oracle", case.oracle), ("full", case.full)):
        diff = (logits.float() - ref_logits.float()).abs().max()
        check[f"logits_max_abs_diff_vs_{name}"] = float(diff)
        check[f"greedy_match_{name}"] = tokens == ref_tokens
    return times[1:], (all(dropped) if dropped else None), check


def open_planned_store(
    bench: Bench, blocks: int, disk_dir: Path, rate: float, warm: bool = True
) -> Any:
    """A host tier over the disk tier in ``disk_dir`` (its chunks found again at open, as
    after a restart), planning restores with the engine's prefill rate ``rate`` (tokens/s);
    with ``warm``, what a plan leaves on disk is warmed once the prefill it expects ended."""
    from kvstore import KVStore

    room = f"{math.ceil((blocks / 0.8 + 2) * bench.layout.block_nbytes / 2**20)}MiB"
    tiers = [
        {"kind": "host", "capacity": room},
        {"kind": "disk", "path": str(disk_dir), "page_cache": "bypass"},
    ]
    restore = {"prefill_tokens_per_s": rate, "warm": warm}
    store = KVStore(bench.layout, {"tiers": tiers, "restore": restore})
    # The probe of the disk's speed that a store opened over stored chunks queues: an
    # engine's start (seconds, loading weights) gives it the time it takes (~0.1 s).
    store.drain()
    return store


def timed_planned(bench: Bench, store: Any, case: Case) -> tuple[float, Any, Any, Any]:
    """One restore as the plan says: load its chunks (a hit over them), prefill the rest.

    Timed from the plan to the first token. Returns (milliseconds, first-token logits,
    the plan's milliseconds, the plan).
    """
    total, prefix_blocks = case.ids.shape[0], len(case.keys)
    sync(bench.device)
    start = time.perf_counter()
    plan = store.plan(case.keys, prompt_tokens=total, overlap=True)
    if plan.first != 0 or not 0 <= plan.load <= prefix_blocks:
        raise RuntimeError(f"unexpected plan {plan.as_dict()}")
    plan_ms = (time.perf_counter() - start) * 1e3
    if plan.load == 0:  # recompute all of it
        cache = new_cache(bench.model)
        logits = forward(bench.model, case.ids, 0, cache)
        int(logits.argmax())
        sync(bench.device)
        return (time.perf_counter() - start) * 1e3, logits, plan_ms, plan
    # The leading plan.load chunks, contiguous at the start of the engine's buffer.
    shape = bench.layout.tensor_shape(plan.load)
    part = case.buf.view(-1)[: math.prod(shape)].view(shape)
    loaded = replace(case, keys=case.keys[: plan.load], buf=part)
    hit_ms, logits, _ = timed_hit(bench, store, loaded)
    return plan_ms + hit_ms, logits, plan_ms, plan


def planned_restores(bench: Bench, case: Case, disk_dir: Path, full_ms: float) -> dict[str, Any]:
    """The disk hit again, with restore planning at the prefill rate this prompt measured.

    A store reopened over the disk tier (as after a restart; warming off, so that every
    rep finds the chunks on disk; page cache dropped before each): its first restore
    plans with the disk's speed as the store's probe at open measured it
    (``ttft_planned_first_ms``), the next ones with the speed its reads measured too
    (``ttft_planned_disk_ms``, the median). Then, in a
    store that warms, the *next turn*: the same prompt once the warming its first plan
    queued has landed in host memory. Checked: a plan that loads nothing gives the full
    prefill's logits, one that loads every chunk (and the next turn) the oracle's."""
    total = case.ids.shape[0]
    rate = total / (full_ms / 1e3)
    times, plan_times, row = [], [], {"planned_prefill_tokens_per_s": rate}
    paths = sorted(disk_dir.rglob("*.kvb"))
    with open_planned_store(bench, len(case.keys), disk_dir, rate, warm=False) as store:
        for rep in range(bench.repeats + 1):
            case.buf.fill_(float("nan"))
            drop_page_cache(paths, bench.drop_cache)
            ms, logits, plan_ms, plan = timed_planned(bench, store, case)
            times.append(ms)
            plan_times.append(plan_ms)
            if rep == 0:
                row.update(ttft_planned_first_ms=ms, planned_first=plan.as_dict())
        row.update(planned_load_chunks=plan.load, plan=plan.as_dict())
        row["planned_check"] = compare(logits, case.oracle if plan.load else case.full)
        row["disk_speed"] = store.engine.restore_speeds()
    row.update(ttft_planned_disk_ms=median(times[1:]), ttft_planned_disk_ms_all=times[1:])
    row["plan_ms"] = median(plan_times[1:])
    with open_planned_store(bench, len(case.keys), disk_dir, rate) as store:
        row.update(turns_to_host(bench, store, case, paths))
        row.update(next_turn(bench, store, case))
    return row


def turns_to_host(bench: Bench, store: Any, case: Case, paths: list[Path]) -> dict[str, Any]:
    """Planned restores of the prompt, each followed by the warming it queued, until the
    host tier holds every chunk (at most ``MAX_TURNS``). One turn is the rule: a plan that
    leaves chunks on disk warms them, and those it loaded from there. Not always: a plan
    that loads every chunk from disk (the estimate at open said the disk pays) warms
    nothing, and the next plan, weighing the disk's speed its reads measured, may then
    leave some behind (heat promotes the rest). ``turns_to_host``: the restores it took;
    ``warmed_s``: the wait for the last one's warming (None if it did not land in 20 s)."""
    row: dict[str, Any] = {"turns_to_host": None}
    for turn in range(1, MAX_TURNS + 1):
        drop_page_cache(paths, bench.drop_cache)
        _, _, _, plan = timed_planned(bench, store, case)
        row[f"turn_{turn}_plan"] = plan.as_dict()
        row["warmed_s"] = wait_warmed(store, len(case.keys))
        if row["warmed_s"] is not None:
            row["turns_to_host"] = turn
            break
    return row


def wait_warmed(store: Any, blocks: int, timeout: float = 20.0) -> float | None:
    """Seconds until the warming queued so far has landed, if the host tier then holds
    ``blocks`` blocks; None if it does not (or the drain took over ``timeout``): a drain
    starts the jobs that wait for the compute a plan expects and waits for them all."""
    start = time.perf_counter()
    drained = store.drain(timeout=timeout)
    if drained and store.stats()["tiers"][0]["blocks"] >= blocks:
        return time.perf_counter() - start
    return None


def next_turn(bench: Bench, store: Any, case: Case) -> dict[str, Any]:
    """The same prompt once the warming has landed: the plan's chunks, the timed hits."""
    plan = store.plan(case.keys, prompt_tokens=case.ids.shape[0], overlap=True)
    row: dict[str, Any] = {"next_turn_plan": plan.as_dict()}
    if plan.load != len(case.keys):
        return row  # reported as is: the warming did not bring every chunk up
    times, _, check = hits(bench, store, case)
    row.update(ttft_next_turn_ms=median(times), ttft_next_turn_ms_all=times, next_turn=check)
    return row


def compare(logits: Any, reference: tuple[Any, list[int]]) -> dict[str, Any]:
    """First-token logits against a reference's: the largest difference, and the argmax."""
    diff = float((logits.float() - reference[0].float()).abs().max())
    return {
        "logits_max_abs_diff": diff,
        "first_token_match": int(logits.argmax()) == reference[1][0],
    }


def references(bench: Bench, ids: Any, prefix: int) -> tuple[Any, Any, Any, bool]:
    """(prefix KV of a full prefill, that prefill's (logits, tokens), the oracle's, and
    whether the oracle run twice gave the same logits and tokens).

    The oracle: the suffix forward over an in-memory cache of those same prefix bytes
    (a clone of what gets stored), without kvstore.
    """
    model, total = bench.model, ids.shape[0]
    cache = new_cache(model)
    logits = forward(model, ids, 0, cache)  # also the warm-up
    shape = bench.layout.tensor_shape(prefix // bench.spec.block_tokens)
    ref = torch.empty(shape, dtype=torch.bfloat16, device=bench.device)
    for i, layer in enumerate(cache.layers):
        ref[i, 0].copy_(layer.keys[0, :, :prefix].transpose(0, 1))
        ref[i, 1].copy_(layer.values[0, :, :prefix].transpose(0, 1))
    full = (logits, greedy(model, cache, logits, total))
    del cache
    runs = []
    for _ in range(2):  # twice: is greedy decoding itself repeatable on this machine?
        cache = cache_over(model, ref.clone())
        logits = forward(model, ids[prefix:], prefix, cache)
        runs.append((logits, greedy(model, cache, logits, total)))
        del cache
    repeatable = runs[0][1] == runs[1][1] and bool(torch.equal(runs[0][0], runs[1][0]))
    return ref, full, runs[0], repeatable


def measure(bench: Bench, total: int) -> dict[str, Any]:
    """Every figure for a prompt of ``total`` random tokens."""
    bt = bench.spec.block_tokens
    prefix = (total - 1) // bt * bt
    blocks = prefix // bt
    if blocks < 1:
        raise ValueError(f"{total} tokens: no full chunk of {bt} below it")
    gen = torch.Generator().manual_seed(total)
    tokens = torch.randint(0, bench.spec.vocab, (total,), generator=gen)
    ids = tokens.to(bench.device)
    ref, full, oracle, repeatable = references(bench, ids, prefix)
    nbytes = ref.numel() * ref.element_size()
    row: dict[str, Any] = {"tokens": total, "prefix_tokens": prefix, "prefix_blocks": blocks}
    row.update(suffix_tokens=total - prefix, prefix_kv_bytes=nbytes)
    row["oracle_repeatable"] = repeatable
    with open_store(bench, blocks) as store:
        keys = store.hash_tokens(tokens.tolist(), namespace=NAMESPACE)[:blocks]
        # The engine's own cache for hits: allocated outside every timing.
        case = Case(ids, keys, ref, torch.empty_like(ref), oracle, full)
        row.update(full_and_saves(bench, store, case))
        store.clear()
        store.put(keys, ref)
        store.drain()
        times, _, row["host"] = hits(bench, store, case)
    row.update(ttft_hit_host_ms=median(times), ttft_hit_host_ms_all=times)
    row["h2d_raw_gbps"] = h2d_gbps(nbytes, bench.device)
    disk_dir = Path(tempfile.mkdtemp(prefix="disk-", dir=bench.disk_root))
    try:
        with open_store(bench, blocks, disk_dir) as store:
            store.put(keys, ref)
            store.drain()
            row.update(disk_raw_read(sorted(disk_dir.rglob("*.kvb")), bench.drop_cache))
            times, row["disk_cache_dropped"], row["disk"] = hits(bench, store, case, disk_dir)
        row.update(planned_restores(bench, case, disk_dir, row["ttft_full_ms"]))
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    row.update(ttft_hit_disk_ms=median(times), ttft_hit_disk_ms_all=times)
    row.update(greedy_tokens_oracle=oracle[1], greedy_tokens_full=full[1])
    derive(row)
    return row


def derive(row: dict[str, Any]) -> None:
    """The ratios, from one length's measured figures."""
    nbytes = row["prefix_kv_bytes"]
    row["link_limit_ms"] = nbytes / (row["h2d_raw_gbps"] * 1e9) * 1e3
    row["hit_vs_link_limit"] = row["ttft_hit_host_ms"] / row["link_limit_ms"]
    row["disk_read_limit_ms"] = nbytes / (row["disk_raw_read_gbps"] * 1e9) * 1e3
    row["hit_disk_vs_read_limit"] = row["ttft_hit_disk_ms"] / row["disk_read_limit_ms"]
    row["hit_speedup_host"] = row["ttft_full_ms"] / row["ttft_hit_host_ms"]
    row["hit_speedup_disk"] = row["ttft_full_ms"] / row["ttft_hit_disk_ms"]
    best = min(row["ttft_full_ms"], row["ttft_hit_disk_ms"])
    row["planned_vs_best"] = row["ttft_planned_disk_ms"] / best
    row["planned_first_vs_best"] = row["ttft_planned_first_ms"] / best
    if "ttft_next_turn_ms" in row:
        row["next_turn_speedup"] = row["ttft_full_ms"] / row["ttft_next_turn_ms"]


def measure_safely(bench: Bench, total: int) -> dict[str, Any]:
    """:func:`measure`, an error reported in the row rather than raised."""
    log(f"{total} tokens")
    cuda = bench.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(bench.device)
    start = time.perf_counter()
    try:
        row = measure(bench, total)
    except Exception as exc:  # one failing length must not hide the others
        log(traceback.format_exc())
        row = {"tokens": total, "error": f"{type(exc).__name__}: {exc}"}
    gc.collect()
    if cuda:
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated(bench.device) / 2**30
        torch.cuda.empty_cache()
    row["seconds"] = time.perf_counter() - start
    names = ("ttft_full_ms", "ttft_hit_host_ms", "ttft_hit_disk_ms", "ttft_planned_disk_ms")
    names += ("planned_load_chunks", "ttft_next_turn_ms", "save_overhead", "error")
    log("  " + ", ".join(f"{n}={row[n]}" for n in names if n in row))
    return row


def verdict(rows: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """Each target met (None: its length was not measured); ``all``: every one met."""
    at = rows.get(str(TARGET_TOKENS))
    good = [r for r in rows.values() if "error" not in r]
    complete = bool(rows) and len(good) == len(rows)
    limit = TARGETS["save_overhead_max"]
    checks = [r[tier] for r in good for tier in ("host", "disk")]

    def at_target(name: str, low: float = -math.inf, high: float = math.inf) -> bool | None:
        return None if at is None else "error" not in at and low <= at[name] <= high

    result = {
        "hit_speedup_host": at_target("hit_speedup_host", low=TARGETS["hit_speedup_host_min"]),
        "hit_vs_link_limit": at_target("hit_vs_link_limit", high=TARGETS["hit_vs_link_limit_max"]),
        "hit_speedup_disk": at_target("hit_speedup_disk", low=TARGETS["hit_speedup_disk_min"]),
        "save_overhead": complete and all(r["save_overhead"] <= limit for r in good),
        "greedy_identical": complete and all(c["greedy_match_oracle"] for c in checks),
        "logits_exact": complete and all(c["logits_max_abs_diff_vs_oracle"] == 0 for c in checks),
        # Greedy decoding compared with itself (the oracle run twice): where it is not
        # repeatable, a greedy mismatch says nothing about the loaded KV.
        "oracle_repeatable": complete and all(r["oracle_repeatable"] for r in good),
        "planned_vs_best": complete
        and all(r["planned_vs_best"] <= TARGETS["planned_vs_best_max"] for r in good),
        "next_turn_exact": complete
        and all(r.get("next_turn", {}).get("logits_max_abs_diff_vs_oracle") == 0 for r in good),
    }
    result["all"] = all(v is True for k, v in result.items() if k != "oracle_repeatable")
    return result


# -- the command line -----------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    # --json, --quick and --rounds, as every benchmark (run_all.py passes --json): the output
    # is the one JSON line either way; --quick is 4096 tokens, once; --rounds N is --repeats N.
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", help="prompt tokens, commas (default: 4096,16384,32768; --quick: 4096)"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed reps, medians reported (default: 3; --quick: 1)"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU smoke test)")
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--disk-dir", help="where the disk tier's files go (default: $TMPDIR)")
    parser.add_argument("--no-drop-cache", dest="drop_cache", action="store_false")
    args = parser.parse_args(argv)
    lengths = args.lengths or ("4096" if args.quick else "4096,16384,32768")
    args.lengths = [int(x) for x in lengths.split(",") if x.strip()]
    if args.repeats is None:
        args.repeats = args.rounds if args.rounds is not None else 1 if args.quick else 3
    if args.repeats < 1 or not args.lengths or min(args.lengths) < 2:
        parser.error("--repeats must be >= 1 and --lengths token counts >= 2")
    return args


def skip_reason(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if torch is None:
        return "torch is not installed"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (--device cpu runs the CPU smoke mode)"
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"needs transformers >= 5 (its cache layers API), found {transformers.__version__}"
    return None


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Build the model, measure every length; (the JSON object, exit status)."""
    import transformers

    from kvstore import KVLayout
    from kvstore.datapath.contracts import PrefetchHandle

    device, spec = torch.device(args.device), TINY if args.tiny else LLAMA_8B
    cpu = f"cpu ({platform.processor() or platform.machine()})"
    result: dict[str, Any] = {
        "benchmark": "gpu_model_ttft",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": spec.name,
        "repeats": args.repeats,
        "block_tokens": spec.block_tokens,
        "gpu_side_wait": hasattr(PrefetchHandle, "wait_layer_on"),
    }
    shape = (spec.layers, spec.kv_heads, spec.head_dim, spec.block_tokens)
    layout = KVLayout(*shape, dtype=torch.bfloat16)
    start, rows, rc = time.perf_counter(), {}, 0
    disk_root = Path(tempfile.mkdtemp(prefix="kvstore-bench-gpu-", dir=args.disk_dir))
    try:
        with torch.inference_mode():
            model = build_model(spec, device)
            bench = Bench(model, spec, device, layout, args.repeats, args.drop_cache, disk_root)
            for total in args.lengths:
                rows[str(total)] = measure_safely(bench, total)
    except Exception as exc:  # e.g. the model does not fit: still one JSON line
        log(traceback.format_exc())
        result["error"], rc = f"{type(exc).__name__}: {exc}", 1
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    result.update(lengths=rows, targets=TARGETS, total_s=time.perf_counter() - start)
    result["pass"] = verdict(rows)
    return result, rc


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print exactly one JSON line on stdout."""
    args = parse_args(argv)
    reason = skip_reason(args)
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the one JSON line
        result, rc = run(args) if reason is None else ({"skipped": True, "reason": reason}, 0)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
