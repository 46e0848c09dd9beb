"""What the deploy tests do to a server they started: wait for /healthz, store and read
blocks through a remote tier as an engine would, count the block files of a disk tier."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers.files import BLOCK_SUFFIX

LAYOUT = small_layout()
CHUNKS = 6


def health(url: str) -> tuple[int, str]:
    """(status, body) of ``GET url``; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status, reply.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()
    except OSError as exc:
        return 0, str(exc)


def wait_healthy(url: str, timeout: float = 180.0, context: Callable[[], str] = lambda: "") -> None:
    """Until ``url`` answers 200 ``ok``; after ``timeout``, AssertionError with the last
    answer and ``context()`` (the server's log, say)."""
    end = time.monotonic() + timeout
    answer = health(url)
    while answer[0] != 200 and time.monotonic() < end:
        time.sleep(0.5)
        answer = health(url)
    assert answer == (200, "ok"), f"{url} answered {answer} for {timeout:g} s\n{context()}"


def remote(address: str, **settings: Any) -> StoreConfig:
    """A store config whose one tier is the server at ``address`` (read from no env)."""
    tier = {"kind": "remote", "address": address, **settings}
    return StoreConfig.from_dict({"tiers": [tier]}, environ={})


def put_chunks(
    config: StoreConfig, namespace: str, layout: KVLayout = LAYOUT
) -> tuple[list[Any], torch.Tensor]:
    """Store CHUNKS chunks of a prompt in ``namespace``; their keys and KV."""
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(list(range(CHUNKS * layout.block_tokens)), namespace=namespace)
        kv = random_blocks(layout, len(keys), seed=len(namespace))
        store.put(keys, kv)
    return keys, kv


def read_chunks(
    config: StoreConfig, keys: list[Any], layout: KVLayout = LAYOUT
) -> tuple[int, torch.Tensor | None, dict[str, Any]]:
    """(chunks the server finds, what a get returns, the remote tier's stats)."""
    with KVStore(layout, config) as store:
        found = store.lookup(keys)
        got = store.get(keys[:found]) if found else None
        return found, got, store.stats()["tiers"][0]


def block_files(directory: Path) -> int:
    """Block files of the disk tiers under ``directory`` (temporary files not counted)."""
    return sum(1 for path in directory.rglob(f"*{BLOCK_SUFFIX}") if not path.name.startswith("."))
