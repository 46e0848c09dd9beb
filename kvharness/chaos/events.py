"""The KV events of a chaos soak's nodes, and whether a subscriber's view converges.

Each node publishes KV events (``events:`` in its config: a small replay buffer, so a
subscriber that comes back after a gap is sent a snapshot as often as the buffer).
:class:`EventWatch` keeps one :class:`~kvharness.event_view.EventView` per node
for the whole run and restarts them at seeded random moments (a router restarting),
while nodes are killed and restarted under them. At the end, after the faults and
the settle, :meth:`EventWatch.check` asks each running node afresh: a new subscriber
replays from 0 and gets a snapshot built from the node's index *now*; the long-lived
view, built from the event stream alone, must equal it block by block and medium by
medium (no phantom, no missed block). The single store and the server are checked
against their tiers' own listings in ``tests/events/test_convergence*.py``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvharness.event_view import EventView, compare
from kvstore.cli import free_port
from kvstore.keys import BlockKey, ChunkTokens

__all__ = ["EventWatch", "chunk_tokens", "node_events_config"]

#: Batches a node keeps for replay: small, so a returning subscriber gets snapshots.
_BUFFER_STEPS = 64
#: Seconds between two heartbeats of a node's publisher.
_HEARTBEAT_S = 0.5


def node_events_config(ports: tuple[int, int], workdir: Path, block_tokens: int) -> dict[str, Any]:
    """A node's ``events:`` section on ``ports`` (PUB, replay), its token journal in
    ``workdir`` (kept across its restarts), one published block per chunk."""
    return {
        "enabled": True,
        "endpoint": f"tcp://127.0.0.1:{ports[0]}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}",
        "block_size": block_tokens,
        "heartbeat_s": _HEARTBEAT_S,
        "buffer_steps": _BUFFER_STEPS,
        "token_journal": str(workdir / "tokens.journal"),
    }


def event_ports(n: int) -> list[tuple[int, int]]:
    """``n`` pairs of distinct free ports."""
    taken: set[int] = set()
    out = []
    for _ in range(n):
        pair: list[int] = []
        while len(pair) < 2:
            port = free_port()
            if port not in taken:
                taken.add(port)
                pair.append(port)
        out.append((pair[0], pair[1]))
    return out


def chunk_tokens(keys: Sequence[BlockKey], first: int, block_tokens: int) -> ChunkTokens:
    """Made-up tokens for a put of ``keys`` (block indices from ``first``): events carry
    a chunk's tokens, and a node announces only chunks whose tokens it was told."""
    ids = [(first * block_tokens + j) % 2_000_000_000 for j in range(len(keys) * block_tokens)]
    return ChunkTokens.of(keys, ids, None, block_tokens)


class EventWatch:
    """One long-lived view per node, restarted at random moments during the run."""

    def __init__(self, endpoints: dict[str, tuple[str, str]], seed: int, every_s: float) -> None:
        self.endpoints = endpoints
        self.views = {name: EventView(*ends) for name, ends in endpoints.items()}
        self._rng = random.Random(f"{seed}:events")
        self._every_s = every_s

    def start(self) -> EventWatch:
        """Subscribe every view."""
        for view in self.views.values():
            view.start()
        return self

    def close(self) -> None:
        """Stop every view."""
        for view in self.views.values():
            view.close()

    def run(self, stop: threading.Event) -> None:
        """Until ``stop``: every ``every_s`` (on average) one random view restarts."""
        while not stop.wait(self._rng.expovariate(1.0 / self._every_s)):
            self.views[self._rng.choice(sorted(self.views))].restart()

    def check(self, running: Sequence[str], timeout: float = 30.0) -> dict[str, Any]:
        """Each running node's long-lived view against a fresh one (its snapshot):
        phantom, missed and wrong-medium blocks summed, and the views' counters."""
        out: dict[str, Any] = {"phantom": 0, "missed": 0, "wrong_medium": 0, "blocks": 0}
        examples: list[str] = []
        for name in running:
            live = self.views[name]
            with EventView(*self.endpoints[name]) as fresh:
                diff = _settled(live, fresh, timeout)
                if any(diff.get(k) for k in ("phantom", "missed", "wrong_medium")):
                    examples.append(_example(name, live.view(), fresh.view()))
            for what, n in diff.items():
                out[what] = out.get(what, 0) + n
        if examples:  # what the next chase of a divergence starts from
            out["examples"] = examples
        for view in self.views.values():
            for what, n in view.stats().items():
                out[f"view_{what}"] = out.get(f"view_{what}", 0) + n
        return out


def _example(name: str, live: dict[int | bytes, str], fresh: dict[int | bytes, str]) -> str:
    """One node's divergence in a line: how many of each kind, and the media involved
    (a phantom's medium in the long-lived view; a missed block's in the fresh one)."""
    diff = compare(live, fresh)
    phantom = Counter(live[h] for h in diff.phantom)
    missed = Counter(fresh[h] for h in diff.missed)
    wrong = Counter(f"{live[h]}->{fresh[h]}" for h in diff.wrong_medium)
    return (
        f"node {name}: phantom {dict(phantom)}, missed {dict(missed)}, "
        f"wrong medium {dict(wrong)} (view {len(live)} blocks, fresh {len(fresh)})"
    )


def _settled(live: EventView, fresh: EventView, timeout: float) -> dict[str, int]:
    """Compare until the views agree (both past the same heartbeat) or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        seen = fresh.last_seq
        if seen is not None and (live.last_seq or 0) >= seen:
            diff = compare(live.view(), fresh.view())
            if diff.none or time.monotonic() > deadline:
                return {**diff.counts(), "blocks": len(fresh.view())}
        elif time.monotonic() > deadline:
            return {"phantom": 0, "missed": 0, "wrong_medium": 0, "blocks": 0, "unanswered": 1}
        time.sleep(0.1)
