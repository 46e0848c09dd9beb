"""`kvstore demo`: a multi-turn chat serving workload driven through the store.

Many chat sessions share one system prompt; each turn sends the whole
conversation so far plus a new user message. For every request the "engine"
hashes the prompt, looks up the stored prefix, loads it (verifying every
byte), "prefills" only the chunks that missed, and stores them. The KV has
the geometry of a real model (Llama-3-8B: 32 layers, 8 KV heads, head_dim
128, bf16, 256-token chunks = 32 MiB per chunk).

The "prefill" does not run a model: the KV of a chunk is a slice of a random
pool chosen by the chunk's key, so a load can be checked bit for bit.

What it needs, with the defaults: about 1.6 GB of memory at its peak (the host
tier, sized by ``host_chunks``, the "engine" buffer of the longest prompt, the
random pool and torch itself) and 4.6 GiB of disk for the disk tier, in a
scratch directory beside the default cache (``$XDG_CACHE_HOME``, else
``~/.cache``: on disk, where ``/tmp`` is often memory) that is removed at the
end, unless ``cache_dir`` names one to keep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from kvstore.config import (
    DiskTierConfig,
    HostTierConfig,
    StoreConfig,
    TierConfig,
    default_cache_dir,
    format_size,
)
from kvstore.keys import BlockKey, Namespace
from kvstore.layout import KVLayout
from kvstore.store import ConfigSource, KVStore

__all__ = [
    "DemoInterrupted",
    "DemoSettings",
    "ProgressBar",
    "copies_summary",
    "disk_shortfall",
    "disk_summary",
    "run_demo",
]


class DemoInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the demo; the store is closed, the scratch directory removed, and the
    message says what was left where (``kvstore demo`` prints it as its one line)."""


@dataclass(frozen=True)
class DemoSettings:
    """Size of the simulated workload and the model geometry.

    ``host_chunks``: the host tier of the embedded default config holds this many
    chunks (512 MiB of Llama-3-8B KV), not the default 4 GiB, which the tier commits
    when it opens: the demo fits in 2 GB of memory and still shows blocks moving
    from memory to disk. A capacity set by ``config`` or ``KVSTORE_HOST_CAPACITY``
    is used as given.
    """

    sessions: int = 16
    turns: int = 4
    system_tokens: int = 2048
    user_tokens: tuple[int, int] = (150, 700)
    reply_tokens: tuple[int, int] = (80, 300)
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_tokens: int = 256
    model: str = "meta-llama/Llama-3.1-8B@demo"
    seed: int = 0
    config: ConfigSource = None
    cache_dir: str | None = None
    host_chunks: int = 16

    def layout(self) -> KVLayout:
        """The KV layout of the simulated model."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_tokens=self.block_tokens,
            dtype=torch.bfloat16,
        )


class ProgressBar:
    """A one-line progress bar on a stream (stderr by default)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()

    def advance(self, note: str = "") -> None:
        """Count one step and redraw (on a terminal; every 10% in a log)."""
        self.done += 1
        tty = self.stream.isatty()
        tenth = max(1, self.total // 10)
        if not tty and self.done % tenth and self.done != self.total:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        rate = self.done / max(1e-9, time.perf_counter() - self.start)
        bar = "#" * filled + "." * (width - filled)
        end = "\n" if self.done >= self.total or not tty else ""
        start = "\r" if tty else ""
        line = f"{start}{self.label} [{bar}] {self.done}/{self.total} {rate:5.1f}/s {note}"
        self.stream.write(line + end)
        self.stream.flush()


@dataclass
class _Tally:
    requests: int = 0
    prompt_tokens: int = 0
    cacheable_chunks: int = 0
    hit_chunks: int = 0
    verified_chunks: int = 0
    stored_chunks: int = 0
    seconds: float = 0.0
    # Time spent in store.put / store.get_prefix, as the engine sees it, and their bytes.
    put_seconds: float = 0.0
    put_bytes: int = 0
    get_seconds: float = 0.0
    get_bytes: int = 0
    per_turn_hits: dict[int, list[int]] = field(default_factory=dict)


class _Pool:
    """Random KV from which each chunk's content is cut, chosen by its key."""

    def __init__(self, layout: KVLayout, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.span = 4 * layout.block_tokens
        shape = layout.tensor_shape(4)
        # Drawn in the layout's dtype: no float32 copy twice its size on the way.
        self.kv = torch.randn(shape, generator=gen, dtype=layout.dtype)

    def chunk(self, key: BlockKey) -> torch.Tensor:
        offset = int.from_bytes(key[:4], "little") % (self.span - self.layout.block_tokens)
        return self.kv[:, :, offset : offset + self.layout.block_tokens]


def _request(
    store: KVStore,
    pool: _Pool,
    namespace: Namespace,
    tokens: list[int],
    buffer: torch.Tensor,
    tally: _Tally,
) -> int:
    """Serve one request; return the number of chunks that hit."""
    step = store.layout.block_tokens
    keys = store.hash_tokens(tokens, namespace)
    hit = store.lookup(keys)
    out = buffer[:, :, : len(keys) * step]
    if hit:
        start = time.perf_counter()
        hit = store.get_prefix(keys[:hit], out[:, :, : hit * step])
        tally.get_seconds += time.perf_counter() - start
        tally.get_bytes += hit * store.layout.block_nbytes
        for i in range(hit):
            if not torch.equal(out[:, :, i * step : (i + 1) * step], pool.chunk(keys[i])):
                raise AssertionError(f"demo: chunk {i} loaded from the store is wrong")
        tally.verified_chunks += hit
    for i in range(hit, len(keys)):  # "prefill" what missed
        out[:, :, i * step : (i + 1) * step].copy_(pool.chunk(keys[i]))
    if hit < len(keys):
        start = time.perf_counter()
        tally.stored_chunks += store.put(keys[hit:], out[:, :, hit * step :])
        tally.put_seconds += time.perf_counter() - start
        tally.put_bytes += (len(keys) - hit) * store.layout.block_nbytes
    tally.requests += 1
    tally.prompt_tokens += len(tokens)
    tally.cacheable_chunks += len(keys)
    tally.hit_chunks += hit
    return hit


def _demo_config(settings: DemoSettings, scratch: str) -> StoreConfig:
    """The config to run: the user's, else the embedded default with its disk
    tier in ``cache_dir`` -- or in a scratch directory, so a demo leaves no
    gigabytes behind in the user's real cache -- and its host tier sized to
    ``host_chunks`` unless its capacity was set."""
    if settings.config is not None:
        return StoreConfig.load(settings.config)
    base = StoreConfig.default()
    path = settings.cache_dir or scratch
    host_bytes = settings.host_chunks * settings.layout().block_nbytes
    return StoreConfig(tiers=tuple(_demo_tier(t, path, host_bytes) for t in base.tiers))


def _demo_tier(tier: TierConfig, disk_path: str, host_bytes: int) -> TierConfig:
    """A tier of the embedded default as the demo runs it."""
    if isinstance(tier, DiskTierConfig):
        return dataclasses.replace(tier, path=disk_path)
    if isinstance(tier, HostTierConfig) and tier.capacity == HostTierConfig().capacity:
        return dataclasses.replace(tier, capacity=min(tier.capacity, host_bytes))
    return tier


@contextlib.contextmanager
def _scratch_dir() -> Iterator[str]:
    """A directory removed on exit, beside the default disk cache (``~/.cache``):
    a disk, where the temp directory is often memory (tmpfs) that the demo's
    gigabytes would fill. The temp directory when the cache's parent cannot be made."""
    parent = os.path.dirname(default_cache_dir())
    made = not os.path.isdir(parent)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError:
        parent, made = tempfile.gettempdir(), False
    try:
        with tempfile.TemporaryDirectory(prefix="kvstore-demo-", dir=parent) as scratch:
            yield scratch
    finally:
        if made:  # leave no empty ~/.cache that the demo alone created
            with contextlib.suppress(OSError):
                os.rmdir(parent)


def run_demo(
    settings: DemoSettings, progress: Callable[[int], ProgressBar] | None = None
) -> dict[str, Any]:
    """Run the workload, then reopen the store as a restarted server would; return the report.

    ``disk_path`` is the disk tier's directory; ``disk_kept`` says whether it is still
    there (false for the scratch directory, removed before this returns);
    ``disk_shortfall``, what it could not keep (:func:`disk_shortfall`). Ctrl-C closes the
    store, removes the scratch directory and raises :class:`DemoInterrupted`.
    """
    disk = scratch = None
    try:
        with _scratch_dir() as scratch:
            config = _demo_config(settings, scratch)
            disk = next((t.path for t in config.tiers if isinstance(t, DiskTierConfig)), None)
            free = _free_bytes(disk)
            report = _serve(settings, config, progress)
            report["after_restart"] = _restart(settings, config)
            report["disk_path"] = disk
    except KeyboardInterrupt:
        kept = disk is not None and disk != scratch
        where = f"what was stored stays in {disk}" if kept else "its scratch directory is removed"
        raise DemoInterrupted(
            f"demo interrupted (Ctrl-C): the store is closed and {where}"
        ) from None
    report["disk_kept"] = disk is not None and disk != scratch
    report["disk_free_at_start"] = free
    report["disk_shortfall"] = disk_shortfall(report)
    return report


def _free_bytes(path: str | None) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest existing parent: the demo makes
    it), or None without a path."""
    if path is None:
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


@contextlib.contextmanager
def _quiet_close() -> Iterator[None]:
    """The close's progress lines held back (its warnings still say what did not fit)."""
    logger = logging.getLogger("kvstore.close")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def disk_summary(report: dict[str, Any]) -> str:
    """What the disk tier held after the run, and where it is -- or that it was a
    scratch directory, already removed (never a path that is gone as if it were there)."""
    size = format_size(report["after_restart"]["bytes_on_disk"])
    short = report.get("disk_shortfall")
    missing = (
        f"; {short['chunks_missing']} of {short['chunks_held']} chunks did not fit" if short else ""
    )
    if report["disk_kept"]:
        return f"{size} in {report['disk_path']} (kept: run again to hit from disk){missing}"
    parent = os.path.dirname(report["disk_path"])
    return (
        f"{size} in a scratch directory under {parent}, now removed (--cache-dir DIR keeps "
        f"it){missing}"
    )


def copies_summary(report: dict[str, Any]) -> str:
    """What the tiers' block counts add up to: copies of the chunks held at the end (a
    chunk written to disk ahead of its eviction from memory has a copy in each)."""
    tiers = report["tiers"]
    copies = sum(t["blocks"] for t in tiers)
    held = report["chunks_held"]
    line = " + ".join(f"{t['kind']} {t['blocks']}" for t in tiers)
    line += f" = {copies:,} copies of {held:,} chunks"
    if copies > held and len(tiers) == 2:
        line += f" ({copies - held:,} chunks are in both)"
    elif copies > held:
        line += f" ({copies - held:,} extra copies of chunks in more than one tier)"
    return line


def disk_shortfall(report: dict[str, Any]) -> dict[str, Any] | None:
    """What the disk tier could not keep, and why: None when the restart found every chunk
    of every session's last prompt (or there is no disk tier)."""
    restart = report["after_restart"]
    missing = report["chunks_held"] - restart["blocks_on_disk"]
    unfound = restart["last_prompt_chunks"] - restart["last_prompt_chunks_found"]
    if not report.get("disk_path") or (missing <= 0 and unfound <= 0):
        return None
    block = report["block_mib"] * 2**20
    needed = int(report["chunks_held"] * block)
    free = report.get("disk_free_at_start")
    disk = next((t for t in report["tiers"] if t["kind"] == "disk"), None)
    if free is not None and free < needed:
        why = f"its filesystem had {format_size(free)} free, the cache needs {format_size(needed)}"
    elif disk is not None:
        why = f"its capacity is {format_size(disk['capacity_bytes'])}"
        why += f", the cache needs {format_size(needed)}"
    else:
        why = f"the cache needs {format_size(needed)}"
    return {
        "chunks_missing": max(0, missing),
        "chunks_held": report["chunks_held"],
        "bytes_needed": needed,
        "bytes_on_disk": restart["bytes_on_disk"],
        "last_prompt_chunks_missing": unfound,
        "why": why,
    }


def _histories(settings: DemoSettings) -> list[tuple[list[int], list[list[int]]]]:
    """Per session: the prompt of each turn (deterministic from the seed)."""
    rng = random.Random(settings.seed)
    vocab = 128_000
    system = [rng.randrange(vocab) for _ in range(settings.system_tokens)]
    sessions: list[tuple[list[int], list[list[int]]]] = []
    for _ in range(settings.sessions):
        history, prompts = list(system), []
        for _ in range(settings.turns):
            prompt = history + [
                rng.randrange(vocab) for _ in range(rng.randint(*settings.user_tokens))
            ]
            prompts.append(prompt)
            reply = [rng.randrange(vocab) for _ in range(rng.randint(*settings.reply_tokens))]
            history = prompt + reply
        sessions.append((system, prompts))
    return sessions


def _serve(
    settings: DemoSettings, config: StoreConfig, progress: Callable[[int], ProgressBar] | None
) -> dict[str, Any]:
    layout = settings.layout()
    rng = random.Random(settings.seed + 1)
    sessions = _histories(settings)
    pool = _Pool(layout, settings.seed)
    tally = _Tally()
    total = settings.sessions * settings.turns
    bar = progress(total) if progress else None
    with KVStore(layout, config) as store:
        namespace = store.namespace(settings.model)
        # The "engine's" KV buffer, as long as the longest prompt's full chunks.
        longest = max(len(p) for _, prompts in sessions for p in prompts)
        buffer = torch.empty(
            layout.tensor_shape(max(1, longest // layout.block_tokens)), dtype=layout.dtype
        )
        start = time.perf_counter()
        try:
            for turn in range(settings.turns):
                order = list(range(settings.sessions))
                rng.shuffle(order)  # sessions interleave, as on a real server
                for s in order:
                    hit = _request(store, pool, namespace, sessions[s][1][turn], buffer, tally)
                    tally.per_turn_hits.setdefault(turn, []).append(hit)
                    if bar:
                        bar.advance(f"hit {hit} chunks")
        except KeyboardInterrupt:  # the same close, without its progress lines
            with _quiet_close():
                store.close()
            raise
        tally.seconds = time.perf_counter() - start
        stats = store.stats()
        flush_start = time.perf_counter()
    report = _report(settings, layout, tally, stats)
    report["close_seconds"] = time.perf_counter() - flush_start
    flush = store.engine.datapath.close_flush or {}
    report["close_flush_bytes"] = flush.get("bytes_written", 0)
    report["close_flush_left_bytes"] = flush.get("bytes", 0) - report["close_flush_bytes"]
    report["close_flush_seconds"] = flush.get("seconds") or 0.0
    seconds = report["close_flush_seconds"]
    report["close_flush_gbps"] = report["close_flush_bytes"] / seconds / 1e9 if seconds else 0.0
    return report


def _restart(settings: DemoSettings, config: StoreConfig) -> dict[str, Any]:
    """Reopen the store (a new process would do the same) and replay each
    session's last prompt: its whole history is found again, on disk."""
    layout = settings.layout()
    pool = _Pool(layout, settings.seed)
    start = time.perf_counter()
    with KVStore(layout, config) as store:
        opened = time.perf_counter() - start
        namespace = store.namespace(settings.model)
        found = total = verified = 0
        for _, prompts in _histories(settings):
            keys = store.hash_tokens(prompts[-1], namespace)
            hit = store.lookup(keys)
            found, total = found + hit, total + len(keys)
            if hit:
                out = store.get(keys[:1])  # load the first chunk back from disk and check it
                verified += int(torch.equal(out, pool.chunk(keys[0])))
        stats = store.stats()
    return {
        "open_seconds": opened,
        "blocks_on_disk": stats["blocks"],
        "bytes_on_disk": sum(t["bytes"] for t in stats["tiers"] if t["kind"] == "disk"),
        "last_prompt_chunks_found": found,
        "last_prompt_chunks": total,
        "sessions_verified_from_disk": verified,
    }


def _report(
    settings: DemoSettings, layout: KVLayout, tally: _Tally, stats: dict[str, Any]
) -> dict[str, Any]:
    saved_tokens = tally.hit_chunks * layout.block_tokens
    return {
        "model_layout": layout.describe(),
        "block_mib": layout.block_nbytes / 2**20,
        "sessions": settings.sessions,
        "turns": settings.turns,
        "requests": tally.requests,
        "prompt_tokens": tally.prompt_tokens,
        "prefill_tokens_saved": saved_tokens,
        "prefill_saved_fraction": saved_tokens / max(1, tally.prompt_tokens),
        "chunk_hit_rate": tally.hit_chunks / max(1, tally.cacheable_chunks),
        "hit_chunks_per_request_by_turn": {
            str(turn + 1): sum(hits) / max(1, len(hits))
            for turn, hits in tally.per_turn_hits.items()
        },
        "chunks_loaded_and_verified": tally.verified_chunks,
        "chunks_stored": tally.stored_chunks,
        "chunks_held": stats["blocks"],  # distinct chunks in the store at the end
        "seconds": tally.seconds,
        # As the engine sees them: bytes over the seconds spent inside put / get_prefix.
        "put_gbps": tally.put_bytes / tally.put_seconds / 1e9 if tally.put_seconds else 0.0,
        "get_gbps": tally.get_bytes / tally.get_seconds / 1e9 if tally.get_seconds else 0.0,
        "put_seconds": tally.put_seconds,
        "get_seconds": tally.get_seconds,
        # Every tier write and read, background moves included (the store's counters).
        "tier_write_gbps": stats["write_gbps"],
        "tier_read_gbps": stats["read_gbps"],
        "evictions": sum(t["evictions"] for t in stats["tiers"]),
        "tiers": [
            {
                k: t[k]
                for k in (
                    "kind",
                    "blocks",
                    "bytes",
                    "capacity_bytes",
                    "evictions",
                    "demotions",
                    "writebacks",
                )
            }
            for t in stats["tiers"]
        ],
    }
