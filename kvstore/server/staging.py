"""Reusable block-sized host buffers for blocks that no memory tier holds.

A GET of a block only the disk holds reads it (verified) into a staging
buffer, then sends it. A fresh 32 MiB buffer costs its page faults on first
touch (~1 GB/s on a small VM, slower than the disk), so buffers are kept for
the next request, up to ``max_idle_bytes`` per server.

Thread-safe: ``_lock`` guards the idle lists (worker threads take, the loop gives).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from kvstore.layout import KVLayout

__all__ = ["StagingPool"]


class StagingPool:
    """Idle staging tensors by layout, at most ``max_idle_bytes`` in all."""

    def __init__(self, max_idle_bytes: int) -> None:
        self._max = max_idle_bytes
        self._idle: dict[bytes, list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, layout: KVLayout) -> torch.Tensor:
        """A buffer of ``layout.block_shape`` (contents undefined)."""
        with self._lock:
            idle = self._idle.get(layout.fingerprint)
            if idle:
                self._idle_bytes -= layout.block_nbytes
                return idle.pop()
        return torch.empty(layout.block_shape, dtype=layout.dtype)

    def give(self, layout: KVLayout, buffers: Iterable[torch.Tensor]) -> None:
        """Return buffers no one uses any more; those past the limit are dropped."""
        with self._lock:
            for buf in buffers:
                if self._idle_bytes + layout.block_nbytes > self._max:
                    return
                self._idle.setdefault(layout.fingerprint, []).append(buf)
                self._idle_bytes += layout.block_nbytes
