"""Child processes for crash and sharing tests: ``python -m kvharness.workers``.

``churn DIR``   put and delete blocks on a disk tier in a tight loop, forever
                (the parent ``kill -9``\\ s it at random moments).
``zygote``      read commands on stdin: ``churn DIR`` forks a churn child and
                prints its pid, ``reap PID`` waits for it and prints its exit
                status. Forking skips a fresh interpreter's seconds of imports,
                so a test can kill and restart a writer many times.
``write DIR N`` write blocks 0..N-1 to a disk-only store, rewriting them until
                killed, printing ``wrote`` after the first pass.

Block ``i`` has key :func:`key_for` (i) and content :func:`block_for` (layout, i),
so any process can check what it reads.
"""

from __future__ import annotations

import os
import random
import resource
import sys

import torch

from kvstore.config import DiskTierConfig
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.store import KVStore
from kvstore.tiers import DiskTier

__all__ = ["WORKER_LAYOUT", "block_for", "key_for"]

#: 1 MiB blocks: big enough that a kill often lands in the middle of a write.
WORKER_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, block_tokens=64)


def key_for(i: int) -> BlockKey:
    """The key of test block ``i``."""
    return BlockKey(i.to_bytes(16, "little"))


def block_for(layout: KVLayout, i: int) -> torch.Tensor:
    """The content of test block ``i`` (reproducible in any process)."""
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(layout.block_shape, generator=gen).to(layout.dtype)


def _churn(path: str, blocks: list[torch.Tensor]) -> None:
    layout = WORKER_LAYOUT
    universe = len(blocks)
    tier = DiskTier(DiskTierConfig(path=path, capacity=1 << 30, io_threads=4), layout)
    rng = random.Random()
    while True:
        ids = rng.sample(range(universe), 8)
        if rng.random() < 0.75:
            tier.put([key_for(i) for i in ids], [blocks[i] for i in ids])
        else:
            tier.delete([key_for(i) for i in ids])


def _write(path: str, count: int) -> None:
    layout = WORKER_LAYOUT
    config = {"tiers": [{"kind": "disk", "path": path, "capacity": "1GiB"}]}
    store = KVStore(layout, config)
    step = layout.block_tokens
    kv = torch.empty(layout.tensor_shape(count), dtype=layout.dtype)
    for i in range(count):
        kv[:, :, i * step : (i + 1) * step] = block_for(layout, i)
    keys = [key_for(i) for i in range(count)]
    first = True
    while True:
        for i in range(count):
            store.put(keys[i : i + 1], kv[:, :, i * step : (i + 1) * step])
        if first:
            print("wrote", flush=True)
            first = False
        store.delete(keys)


def _die() -> None:
    """End a forked child now: no atexit handlers, no flush of the stdio buffers it
    inherited, no return into the zygote's loop. SIGABRT, without a core file: the
    parent, which ends children with SIGKILL, sees that this one failed by itself."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def _zygote(universe: int = 48) -> None:
    # Computed once here, inherited by every forked child (which runs no torch kernels).
    blocks = [block_for(WORKER_LAYOUT, i) for i in range(universe)]
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "churn":
            pid = os.fork()
            if pid == 0:  # the child: churn until killed, never return into the loop
                try:
                    sys.stdin.close()
                    _churn(arg, blocks)
                finally:
                    _die()
            print(pid, flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(arg), 0)
            print(status, flush=True)


def main(argv: list[str]) -> None:
    """Run the worker named by ``argv[0]``."""
    if argv[0] == "churn":
        blocks = [block_for(WORKER_LAYOUT, i) for i in range(48)]
        print("ready", flush=True)
        _churn(argv[1], blocks)
    elif argv[0] == "write":
        _write(argv[1], int(argv[2]))
    elif argv[0] == "zygote":
        _zygote()
    else:
        raise SystemExit(f"unknown worker {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
