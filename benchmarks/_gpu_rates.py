"""The raw rates ``bench_gpu_model.py`` compares kvstore with: the cold read rate of the
disk tier's own files (O_DIRECT where the filesystem takes it, page cache dropped first)
and one pinned host -> device copy."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import median
from _gpu_llama import sync

try:
    import torch
except ImportError:  # bench_gpu_model reports it as a skip
    torch = None  # type: ignore[assignment]


# -- raw rates ------------------------------------------------------------------------------
def drop_page_cache(paths: list[Path], enabled: bool) -> bool:
    """Evict the page cache (all of it where allowed, else ``paths``'); True if all of it."""
    if not enabled:
        return False
    os.sync()
    dropped = False
    with contextlib.suppress(OSError):  # root only (and not in every container)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        dropped = True
    for path in paths:  # the clean pages of our own files go without privileges
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return dropped


def _read_files(paths: list[Path], buf: mmap.mmap) -> tuple[int, bool]:
    """Read each file whole into ``buf`` (O_DIRECT where the filesystem takes it)."""
    total, direct = 0, True
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:  # tmpfs and some overlays refuse O_DIRECT
            fd, direct = os.open(path, os.O_RDONLY), False
        try:
            size = os.fstat(fd).st_size
            with memoryview(buf) as view:
                done = 0
                while done < size and (n := os.preadv(fd, [view[done:]], done)) > 0:
                    done += n
            total += done
        finally:
            os.close(fd)
    return total, direct


def disk_raw_read(paths: list[Path], enabled: bool, threads: int = 4) -> dict[str, Any]:
    """Cold read rate of ``paths``: each file whole, in ``threads`` threads as the tier reads."""
    size = -(-max(p.stat().st_size for p in paths) // 4096) * 4096
    bufs = [mmap.mmap(-1, size) for _ in range(threads)]  # page-aligned, for O_DIRECT
    dropped = drop_page_cache(paths, enabled)
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        results = list(pool.map(_read_files, [paths[i::threads] for i in range(threads)], bufs))
        seconds = time.perf_counter() - start
    for buf in bufs:
        buf.close()
    nbytes = sum(n for n, _ in results)
    return {
        "disk_raw_read_gbps": nbytes / seconds / 1e9,
        "disk_raw_read_bytes": nbytes,
        "disk_raw_read_o_direct": all(d for _, d in results),
        "disk_raw_read_cache_dropped": dropped,
    }


def h2d_gbps(nbytes: int, device: Any, reps: int = 3) -> float:
    """Rate of one pinned host -> device ``copy_`` of ``nbytes`` (median of ``reps``)."""
    pinned = device.type == "cuda"  # without CUDA: a plain CPU copy, the smoke mode's stand-in
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        sync(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return nbytes / median(times[1:]) / 1e9
