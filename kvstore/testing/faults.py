"""Fault injection around real tiers and real files.

:class:`FaultyTier` forwards every call to a real tier and, as its switches
say, raises :class:`~kvstore.errors.TierError`, reports per-block failures
(a lost or unreadable copy), or adds latency. It produces the faults a real
medium rarely produces on demand (a dead server mid-batch, an I/O error on
one block); everything else still goes through the real tier.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvstore.errors import TierError
from kvstore.keys import BlockKey
from kvstore.tiers import Buffer, FileOps
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["DAMAGES", "FaultyFileOps", "FaultyTier", "wait_for_tier"]


class FaultyTier(Tier):
    """A real tier with switchable faults.

    Switches (plain attributes, change them at any time):
        down: every call raises TierError (the medium is gone).
        put_error / get_error / delete_error: probability that a whole batch
            call raises TierError.
        put_drop / get_miss: probability that one block of a batch fails
            (put returns False for it / get returns False without data).
        delay_s: sleep before each call.
    ``injected`` counts the faults produced, by kind.
    """

    def __init__(self, inner: Tier, seed: int = 0) -> None:
        super().__init__(inner.config, inner.layout)
        self.inner = inner
        self.kind = inner.kind
        self.persistent = inner.persistent
        self.shared = inner.shared
        self.down = False
        self.put_error = 0.0
        self.get_error = 0.0
        self.delete_error = 0.0
        self.put_drop = 0.0
        self.get_miss = 0.0
        self.delay_s = 0.0
        self.injected: dict[str, int] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # guards _rng and injected

    def _roll(self, probability: float, what: str) -> bool:
        if probability <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < probability
            if hit:
                self.injected[what] = self.injected.get(what, 0) + 1
        return hit

    def _enter(self, op: str, error_probability: float) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.down and self._roll(1.0, "down"):
            raise TierError(f"{self.kind} tier is down (injected)")
        if self._roll(error_probability, f"{op}_error"):
            raise TierError(f"{self.kind} tier {op} failed (injected)")

    @property
    def capacity_blocks(self) -> int:
        return self.inner.capacity_blocks

    @property
    def device(self) -> torch.device | None:
        return self.inner.device

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        self._enter("put", self.put_error)
        keep = [not self._roll(self.put_drop, "put_drop") for _ in keys]
        chosen = [i for i, k in enumerate(keep) if k]
        stored = self.inner.put([keys[i] for i in chosen], [blocks[i] for i in chosen])
        result = [False] * len(keys)
        for i, ok in zip(chosen, stored, strict=True):
            result[i] = ok
        return result

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
    ) -> list[bool]:
        self._enter("get", self.get_error)
        keep = [not self._roll(self.get_miss, "get_miss") for _ in keys]
        chosen = [i for i, k in enumerate(keep) if k]
        got = self.inner.get([keys[i] for i in chosen], [outs[i] for i in chosen], layers)
        result = [False] * len(keys)
        for i, ok in zip(chosen, got, strict=True):
            result[i] = ok
        return result

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self._enter("delete", self.delete_error)
        self.inner.delete(keys)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._enter("contains", 0.0)
        return self.inner.contains(keys)

    def stored_keys(self) -> Iterator[BlockKey]:
        self._enter("stored_keys", 0.0)
        return self.inner.stored_keys()

    def view(self, key: BlockKey) -> torch.Tensor | None:
        # No zero-copy path: demotions must go through get() and meet the faults.
        return None

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "injected": dict(self.injected)}

    def close(self) -> None:
        self.inner.close()


class FaultyFileOps(FileOps):
    """The disk tier's syscalls with errors injected by operation (and path).

    ``fail["preadv"] = errno.EIO`` makes every read fail with EIO; ``only``
    limits faults to paths containing that substring (reads and writes are
    matched through the path their descriptor was opened with).
    ``injected`` counts the faults produced.
    """

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.only: str | None = None
        self.injected: dict[str, int] = {}
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()  # guards _paths and injected

    def _maybe_fail(self, op: str, path: str) -> None:
        code = self.fail.get(op)
        if code is None or (self.only is not None and self.only not in path):
            return
        with self._lock:
            self.injected[op] = self.injected.get(op, 0) + 1
        raise OSError(code, f"{os.strerror(code)} (injected)", path)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._maybe_fail("open", path)
        fd = super().open(path, flags, mode)
        with self._lock:
            self._paths[fd] = path
        return fd

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        self._maybe_fail("pwritev", self._paths.get(fd, ""))
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        self._maybe_fail("preadv", self._paths.get(fd, ""))
        return super().preadv(fd, buffers, offset)

    def close(self, fd: int) -> None:
        with self._lock:
            self._paths.pop(fd, None)
        super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        self._maybe_fail("rename", dst)
        super().rename(src, dst)


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "garbage": lambda good: b"not a kvstore block" * 50,
    "truncated": lambda good: good[: len(good) - 10],
    "flipped": lambda good: good[:-1] + bytes([good[-1] ^ 0x40]),
    "empty": lambda good: b"",
    "extended": lambda good: good + b"tail",
}
"""Ways someone else can damage a stored value (a remote object, a Redis string): each
maps the good bytes to the damaged ones. Every one must read as a miss, never as data."""


def wait_for_tier(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``check`` until it is true (a :class:`TierError` counts as not yet: the
    medium is still down); False after ``timeout`` seconds. For tests that bring a
    server back under a tier."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(TierError):  # still down: try again
            if check():
                return True
        time.sleep(0.05)
    return False
