"""One client process of bench_peers.py: a kvstore client or a Mooncake Store client.

Run as ``python store_worker.py kvstore`` (kvstore's venv) or ``python store_worker.py
mooncake`` (``.venv-mooncake``, where only numpy and Mooncake are: nothing here imports
torch or kvstore at the top). The parent drives it with one JSON object per line on stdin
and reads one per line on stdout (``{"ok": true, "value": ...}`` or ``{"ok": false,
"error": ...}``); everything else the process or its libraries print goes to stderr.

Each worker holds, per block size, the blocks it puts (``src``) and the buffers it gets
into (``dst``). Block ``g`` of a size is the same random bytes in every process of both
systems (:func:`block_bytes`), so the two stores move the same bytes and any worker can
check what it read. Worker 0 holds the whole get set (the 1-client reps); worker ``w`` of
``N`` holds the blocks ``[w * n_N, (w + 1) * n_N)`` (its share of an N-client rep), which
for worker 0 are its first ``n_N``.

Paths: ``tcp`` -- kvstore ``Client`` over TCP loopback (``shared_memory=False``); Mooncake
a client from ``setup(..., protocol="tcp", metadata "P2PHANDSHAKE")`` that contributes no
segment, its buffers registered (``register_buffer``): the store process's segment is the
other end. ``shm`` -- kvstore ``Client`` over the Unix socket with shared memory;
Mooncake a client from ``setup_dummy`` whose buffers come from ``alloc_from_mem_pool``
(shared with the store process, which does the copies) and are registered too.

Every get is checked, untimed, byte for byte against the bytes that were put: the
destination is zeroed before the rep and compared after it. ``--plant-wrong-byte``
wraps the store client so that each get flips one byte it returned (the check must
catch it; the peer itself is not touched).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

PATHS = ("tcp", "shm")


# -- the bytes ---------------------------------------------------------------------------------
def block_bytes(size_name: str, nbytes: int, index: int) -> np.ndarray:
    """Block ``index`` of size ``size_name``: random bytes, the same in every process."""
    salt = int.from_bytes(hashlib.blake2b(size_name.encode(), digest_size=4).digest(), "little")
    words = np.random.PCG64([salt, index]).random_raw(nbytes // 8)  # fast; nbytes % 8 == 0
    return words.view(np.uint8)


def first_difference(got: np.ndarray, want: np.ndarray) -> int | None:
    """The first offset where ``got`` and ``want`` differ, or None."""
    if np.array_equal(got, want):
        return None
    return int(np.flatnonzero(got != want)[0])


def check_blocks(dst: list[np.ndarray], src: list[np.ndarray], first: int) -> str | None:
    """None if every ``dst[i]`` equals ``src[i]``; else where the first wrong byte is."""
    for i, (got, want) in enumerate(zip(dst, src, strict=True)):
        at = first_difference(got, want)
        if at is not None:
            return (
                f"block {first + i} byte {at}: read 0x{int(got[at]):02x}, "
                f"wrote 0x{int(want[at]):02x}"
            )
    return None


# -- the plan the parent sends -----------------------------------------------------------------
class Plan:
    """What this worker holds: its index, the client count, the block sizes and counts."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.index: int = raw["index"]
        self.clients: int = raw["clients"]
        self.sizes: dict[str, int] = raw["sizes"]  # name -> bytes per block
        self.counts: dict[str, dict[str, int]] = raw["counts"]  # name -> {"1": n1, "N": nN}
        self.layouts: dict[str, dict[str, Any]] = raw.get("layouts", {})
        self.ends: dict[str, str] = raw["ends"]

    def held(self, size: str) -> int:
        """Blocks this worker holds of ``size``."""
        return self.counts[size]["1"] if self.index == 0 else self.counts[size]["N"]

    def first_block(self, size: str) -> int:
        """The global index of this worker's first block."""
        return 0 if self.index == 0 else self.index * self.counts[size]["N"]

    def share(self, size: str, clients: int) -> int:
        """Blocks this worker moves in a rep of ``clients`` clients."""
        return self.counts[size]["1"] if clients == 1 else self.counts[size]["N"]


def get_key(size: str, g: int) -> str:
    """The name of block ``g`` of the get set."""
    return f"get/{size}/{g}"


# -- the two systems ---------------------------------------------------------------------------
class Side(ABC):
    """What both systems' workers do; subclasses move the bytes."""

    name = ""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.src: dict[str, list[np.ndarray]] = {}
        self.dst: dict[str, list[np.ndarray]] = {}
        self._fresh = 0

    def fill_blocks(self) -> None:
        """Write this worker's blocks into ``src`` and touch ``dst`` (untimed)."""
        for size, nbytes in self.plan.sizes.items():
            first = self.plan.first_block(size)
            for i, block in enumerate(self.src[size]):
                block[:] = block_bytes(size, nbytes, first + i)
            for block in self.dst[size]:
                block[:] = 1

    # The moves (keys are names; ``first``: the global index of the first block moved).
    @abstractmethod
    def put(self, path: str, size: str, keys: list[str], first: int) -> None:
        """Store ``src[size][:len(keys)]`` under ``keys``; raises unless all were stored."""

    @abstractmethod
    def get(self, path: str, size: str, keys: list[str], first: int) -> None:
        """Read ``keys`` into ``dst[size][:len(keys)]``; raises if one is missing."""

    @abstractmethod
    def delete(self, path: str, size: str, keys: list[str]) -> None:
        """Remove ``keys``."""

    @abstractmethod
    def lookup(self, path: str, size: str, keys: list[str]) -> int:
        """How many leading ``keys`` are stored."""

    @abstractmethod
    def close(self) -> None:
        """Close the clients."""

    def fresh_keys(self, size: str, n: int) -> list[str]:
        """``n`` names never put before by any worker."""
        self._fresh += 1
        return [f"put/{size}/{self.plan.index}/{self._fresh}/{i}" for i in range(n)]


class KVStoreSide(Side):
    """kvstore ``Client``s of a ``kvstore-server``: TCP and Unix socket + shared memory."""

    name = "kvstore"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        import torch

        from kvstore import KVLayout
        from kvstore.client import Client, ClientOptions

        self.torch = torch
        self.threads = torch.get_num_threads()
        self.clients: dict[tuple[str, str], Any] = {}
        self.tensors: dict[str, tuple[list[Any], list[Any]]] = {}
        layouts = {
            size: KVLayout(**{**geometry, "dtype": getattr(torch, geometry["dtype"])})
            for size, geometry in plan.layouts.items()
        }
        for size, layout in layouts.items():
            n = plan.held(size)
            src = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in range(n)]
            dst = [torch.empty(layout.block_shape, dtype=layout.dtype) for _ in range(n)]
            self.tensors[size] = (src, dst)
            self.src[size] = [t.view(torch.uint8).reshape(-1).numpy() for t in src]
            self.dst[size] = [t.view(torch.uint8).reshape(-1).numpy() for t in dst]
        # The bytes first, then connect: a first fill starts right after the server's
        # stores open (their memory prefaults from there; Mooncake's segment from its start).
        self.fill_blocks()
        for size, layout in layouts.items():
            for path in PATHS:
                address = plan.ends["kvstore_tcp"] if path == "tcp" else plan.ends["kvstore_unix"]
                options = ClientOptions(address=address, shared_memory=path == "shm")
                client = self.clients[(path, size)] = Client(layout, options)
                client.ping()  # connect (and map the shared memory) now, not in a timed rep
                if path == "shm" and not client.shared_memory:
                    raise RuntimeError("the kvstore client did not attach shared memory")

    @staticmethod
    def key(name: str) -> bytes:
        return hashlib.blake2b(name.encode(), digest_size=16).digest()

    def set_threads(self, clients: int) -> None:
        """Torch's default threads alone; the cores shared out when ``clients`` run at once
        (as bench_server.py: spinning OpenMP threads of 4 processes on 2 cores starve)."""
        want = self.threads if clients == 1 else max(1, (os.cpu_count() or 1) // clients)
        if self.torch.get_num_threads() != want:
            self.torch.set_num_threads(want)

    def put(self, path: str, size: str, keys: list[str], first: int) -> None:
        blocks = self.tensors[size][0][: len(keys)]
        stored = self.clients[(path, size)].put([self.key(k) for k in keys], blocks)
        if not all(stored):
            raise RuntimeError(f"kvstore: {stored.count(False)} of {len(keys)} blocks not stored")

    def get(self, path: str, size: str, keys: list[str], first: int) -> None:
        outs = self.tensors[size][1][: len(keys)]
        found = self.clients[(path, size)].get([self.key(k) for k in keys], outs)
        if not all(found):
            raise RuntimeError(f"kvstore: {found.count(False)} of {len(keys)} blocks missed")

    def delete(self, path: str, size: str, keys: list[str]) -> None:
        self.clients[(path, size)].delete([self.key(k) for k in keys])

    def lookup(self, path: str, size: str, keys: list[str]) -> int:
        return int(self.clients[(path, size)].lookup([self.key(k) for k in keys]))

    def memcpy(self, size: str, n: int) -> None:
        """The shared-memory path's floor: the copy kvstore's client makes for a batch."""
        src, dst = self.tensors[size]
        self.torch._foreach_copy_(dst[:n], src[:n])

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


class MooncakeSide(Side):
    """Mooncake Store clients: ``setup`` over TCP and ``setup_dummy`` (same host)."""

    name = "mooncake"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        from mooncake.store import MooncakeDistributedStore

        total = sum(2 * plan.held(s) * n for s, n in plan.sizes.items())
        self.stores: dict[str, Any] = {"tcp": MooncakeDistributedStore()}
        self.stores["shm"] = MooncakeDistributedStore()
        master, real = plan.ends["mooncake_master"], plan.ends["mooncake_client"]
        rc = self.stores["tcp"].setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup (tcp, master {master}) returned {rc}")
        rc = self.stores["shm"].setup_dummy(total, 16 << 20, real)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup_dummy (store process {real}) returned {rc}")
        self.ptrs: dict[str, tuple[list[int], list[int]]] = {}
        for size, nbytes in plan.sizes.items():
            self.ptrs[size] = (
                self._pool(nbytes, plan.held(size)),
                self._pool(nbytes, plan.held(size)),
            )
            self.src[size] = [self._array(p, nbytes) for p in self.ptrs[size][0]]
            self.dst[size] = [self._array(p, nbytes) for p in self.ptrs[size][1]]
        self.fill_blocks()

    def _pool(self, nbytes: int, n: int) -> list[int]:
        """``n`` block addresses in one region of the dummy client's pool, registered with
        both clients."""
        base = self.stores["shm"].alloc_from_mem_pool(nbytes * n)
        if not base:
            raise RuntimeError(f"Mooncake alloc_from_mem_pool({nbytes * n}) failed")
        for store in self.stores.values():
            rc = store.register_buffer(base, nbytes * n)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer returned {rc}")
        return [base + i * nbytes for i in range(n)]

    @staticmethod
    def _array(ptr: int, nbytes: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def put(self, path: str, size: str, keys: list[str], first: int) -> None:
        nbytes, ptrs = self.plan.sizes[size], self.ptrs[size][0][: len(keys)]
        codes = self.stores[path].batch_put_from(keys, ptrs, [nbytes] * len(keys))
        if any(c != 0 for c in codes):
            raise RuntimeError(f"Mooncake batch_put_from ({path}) returned {sorted(set(codes))}")

    def get(self, path: str, size: str, keys: list[str], first: int) -> None:
        nbytes, ptrs = self.plan.sizes[size], self.ptrs[size][1][: len(keys)]
        got = self.stores[path].batch_get_into(keys, ptrs, [nbytes] * len(keys))
        if any(n != nbytes for n in got):
            raise RuntimeError(f"Mooncake batch_get_into ({path}) returned {sorted(set(got))}")

    def delete(self, path: str, size: str, keys: list[str]) -> None:
        self.stores[path].batch_remove(keys, force=True)

    def lookup(self, path: str, size: str, keys: list[str]) -> int:
        found = self.stores[path].batch_is_exist(keys)
        return next((i for i, f in enumerate(found) if f != 1), len(found))

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


class WrongByte:
    """A side whose every get hands back one wrong byte (the check must catch it)."""

    def __init__(self, side: Side) -> None:
        self.side = side

    def __getattr__(self, name: str) -> Any:
        return getattr(self.side, name)

    def get(self, path: str, size: str, keys: list[str], first: int) -> None:
        self.side.get(path, size, keys, first)
        last = self.side.dst[size][len(keys) - 1]
        last[len(last) // 2] ^= 0x5A


def checked_get(side: Any, path: str, size: str, keys: list[str], first: int) -> str | None:
    """Zero the destination, get ``keys`` into it (through ``side``, which may be a
    :class:`WrongByte`), compare with the bytes put: None, or where the first wrong one is."""
    for block in side.dst[size][: len(keys)]:
        block.fill(0)
    side.get(path, size, keys, first)
    return check_blocks(side.dst[size][: len(keys)], side.src[size][: len(keys)], first)


# -- the commands ------------------------------------------------------------------------------
class Worker:
    """The commands the parent sends (``cmd`` names a method)."""

    def __init__(self, side_name: str, plant: bool) -> None:
        self.side_name, self.plant = side_name, plant
        self.side: Any = None
        self.pending: Callable[[], str | None] | None = None

    def setup(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Connect and make the blocks."""
        p = Plan(plan)
        side: Side = KVStoreSide(p) if self.side_name == "kvstore" else MooncakeSide(p)
        self.side = WrongByte(side) if self.plant else side
        return {"pid": os.getpid()}

    def fill(self, path: str, size: str) -> dict[str, Any]:
        """(Worker 0) put the get set of ``size``; its seconds; then read it back, checked."""
        side, n = self.side, self.side.plan.held(size)
        keys = [get_key(size, g) for g in range(n)]
        start = time.perf_counter()
        side.put(path, size, keys, 0)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "wrong": checked_get(side, path, size, keys, 0)}

    def touch(self, path: str, size: str, nbytes: int) -> int:
        """(Worker 0) put ``nbytes`` of throwaway blocks, all held at once, then remove them:
        the store's memory has been written once before anything is timed (Mooncake's
        segment is touched lazily). Stops early if the store refuses a put; bytes put."""
        side, per = self.side, self.side.plan.held(size)
        want = nbytes // side.plan.sizes[size]  # never past nbytes: the rest stays stored
        held: list[str] = []
        try:
            while len(held) < want:
                keys = side.fresh_keys(size, min(per, want - len(held)))
                held += keys
                side.put(path, size, keys, 0)
        except RuntimeError as exc:
            print(f"touch stopped early: {exc}", file=sys.stderr)
        for i in range(0, len(held), per):
            side.delete(path, size, held[i : i + per])
        return len(held) * side.plan.sizes[size]

    def verify(self, path: str, size: str) -> str | None:
        """Put fresh keys, read them back, compare, delete: None if every byte came back."""
        side, n = self.side, self.side.plan.held(size)
        keys = side.fresh_keys(size, n)
        side.put(path, size, keys, 0)
        try:
            return checked_get(side, path, size, keys, 0)
        finally:
            side.delete(path, size, keys)

    def prepare(self, op: str, path: str, size: str, clients: int, reps: int = 1) -> None:
        """Get one rep of ``op`` ready (untimed); ``go`` runs it."""
        side, plan = self.side, self.side.plan
        n, first = plan.share(size, clients), plan.first_block(size)
        if hasattr(side, "set_threads"):
            side.set_threads(clients)
        if op == "put":
            keys = side.fresh_keys(size, n)
            self.pending = self._timed(lambda: side.put(path, size, keys, first))
            self.cleanup: Callable[[], object] = lambda: side.delete(path, size, keys)
        elif op == "get":
            keys = [get_key(size, first + i) for i in range(n)]
            for block in side.dst[size][:n]:
                block.fill(0)
            self.pending = self._timed(lambda: side.get(path, size, keys, first))
            self.cleanup = lambda: check_blocks(side.dst[size][:n], side.src[size][:n], first)
        elif op == "lookup":
            keys = [get_key(size, g) for g in range(plan.counts[size]["1"])]
            self.pending = self._timed(lambda: self._lookups(path, size, keys, reps))
            self.cleanup = lambda: None
        elif op == "memcpy":
            self.pending = self._timed(lambda: side.memcpy(size, n))
            self.cleanup = lambda: None
        else:
            raise ValueError(f"unknown op {op!r}")

    def _lookups(self, path: str, size: str, keys: list[str], reps: int) -> None:
        for _ in range(reps):
            found = self.side.lookup(path, size, keys)
            if found != len(keys):
                raise RuntimeError(f"lookup found {found} of {len(keys)} stored keys")

    @staticmethod
    def _timed(fn: Callable[[], object]) -> Callable[[], Any]:
        def run() -> tuple[float, float]:
            start = time.perf_counter()
            fn()
            return start, time.perf_counter()

        return run

    def go(self) -> dict[str, Any]:
        """Run the prepared rep; its start and end (``perf_counter``, one clock in every
        process) and the byte check's finding (None: every byte right)."""
        assert self.pending is not None, "go without prepare"
        run, self.pending = self.pending, None
        start, end = run()
        wrong = self.cleanup()
        return {"start": start, "end": end, "wrong": wrong if isinstance(wrong, str) else None}

    def close(self) -> None:
        if self.side is not None:
            self.side.close()


def serve(worker: Worker, requests: Any, replies: Any) -> None:
    """Answer one JSON request per line until ``stop`` or end of input."""
    for line in requests:
        request = json.loads(line)
        cmd = request.pop("cmd")
        if cmd == "stop":
            break
        try:
            reply = {"ok": True, "value": getattr(worker, cmd)(**request)}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", choices=("kvstore", "mooncake"))
    parser.add_argument("--plant-wrong-byte", action="store_true", help="flip a byte per get")
    args = parser.parse_args()
    # The replies get the real stdout; anything a library prints goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    worker = Worker(args.side, args.plant_wrong_byte)
    try:
        serve(worker, sys.stdin, replies)
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
