"""What publishing KV events costs a writer: ``KVStore.put`` throughput with events on vs off.

A host tier of 4 MiB blocks (4 layers, 8 KV heads, head_dim 128, 256 tokens
per block, bf16). Each rep puts ``--batch-blocks`` NEW chunks (keys from fresh
tokens; the previous rep's keys are deleted outside the timed region):

- ``off``: a plain store, no events;
- ``on``: a store whose config turns ``events`` on (a real ZMQ PUB socket,
  batches every 10 ms), with a subscriber in another process decoding every
  batch; each put passes the chunks' tokens (``put(keys, kv, tokens=...)``,
  a Python list, as engines hold them), so the timed region includes
  recording them.

Reps of the two alternate in rounds (order reversed on odd rounds); figures
are medians. ``put_ratio_events_on_vs_off`` = median put throughput on /
off (target >= 0.95). Also: events per second and bytes per event the
publisher sent over the run (16 published blocks of 16 tokens per chunk).

Run: ``python benchmarks/bench_events.py [--json] [--quick]``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import torch
from _common import base_parser, emit, environment, log, median, run_rounds

from kvstore import KVLayout, KVStore

TARGET_RATIO = 0.95


def layout() -> KVLayout:
    """4 MiB per 256-token block."""
    return KVLayout(
        num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=256, dtype=torch.bfloat16
    )


#: The subscriber: another process, as a router is (decoding in the writer's process would
#: measure the GIL, not publishing). Prints the batches and events it decoded at EOF of stdin.
SUBSCRIBER = """
import sys, threading, zmq
from kvstore.events.format import decode_batch
ctx = zmq.Context(); sock = ctx.socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b""); sock.connect(sys.argv[1])
counts = [0, 0]; stop = threading.Event()
def run():
    while not stop.is_set():
        if sock.poll(50):
            counts[0] += 1
            counts[1] += len(decode_batch(sock.recv_multipart()[2]).events)
t = threading.Thread(target=run); t.start()
print("ready", flush=True); sys.stdin.read(); stop.set(); t.join()
print(counts[0], counts[1], flush=True)
"""


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Subject:
    """A store (with or without events) and its put rep: ``put(keys, kv, tokens=...)``,
    the public API a writer uses to have its chunks published with their tokens."""

    def __init__(self, lay: KVLayout, batch: int, events: bool) -> None:
        self.lay, self.batch = lay, batch
        capacity = 4 * batch * lay.block_nbytes
        config: dict[str, Any] = {"tiers": [{"kind": "host", "capacity": capacity}]}
        self.sub: subprocess.Popen[str] | None = None
        if events:
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            config["events"] = {"enabled": True, "endpoint": endpoint}
        self.store = KVStore(lay, config)
        if events:
            self._subscribe(endpoint)
        self.kv = torch.randn(lay.tensor_shape(batch)).to(lay.dtype)
        self.next = 0
        self.keys: list[bytes] = []

    def _subscribe(self, endpoint: str) -> None:
        self.sub = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.sub.stdout is not None
        self.sub.stdout.readline()  # "ready"
        time.sleep(0.5)  # the subscription reaches the publisher

    def rep(self) -> float:
        if self.keys:
            self.store.delete(self.keys)
        self.next += 1
        first = self.next * 1_000_000
        tokens = list(range(first, first + self.batch * self.lay.block_tokens))
        keys = self.store.hash_tokens(tokens, "bench")
        start = time.perf_counter()
        self.store.put(keys, self.kv, tokens=tokens)
        elapsed = time.perf_counter() - start
        self.keys = keys
        return elapsed

    def close(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self.store.stats().get("events", {}))
        self.store.close()
        if self.sub is not None:
            time.sleep(0.3)
            out, _ = self.sub.communicate("", timeout=30)
            batches, events = out.split()[-2:]
            stats["received_batches"], stats["received_events"] = int(batches), int(events)
        return stats


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-blocks", type=int, default=8, help="chunks per put")
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 20)
    lay = layout()
    off = Subject(lay, args.batch_blocks, events=False)
    on = Subject(lay, args.batch_blocks, events=True)
    log(f"bench_events: {rounds} rounds of {args.batch_blocks} x 4 MiB puts, events on vs off")
    started = time.perf_counter()
    times = run_rounds({"off": (off.rep, 3), "on": (on.rep, 3)}, rounds, warmup=2)
    wall = time.perf_counter() - started
    stats = on.close()
    off.close()
    nbytes = args.batch_blocks * lay.block_nbytes
    put_off = nbytes / median(times["off"]) / 2**30
    put_on = nbytes / median(times["on"]) / 2**30
    events = stats.get("events_published", 0)
    result = {
        "bench": "events",
        "block_mib": lay.block_nbytes / 2**20,
        "batch_blocks": args.batch_blocks,
        "put_gib_s_events_off": round(put_off, 3),
        "put_gib_s_events_on": round(put_on, 3),
        "put_ratio_events_on_vs_off": round(put_on / put_off, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": put_on / put_off >= TARGET_RATIO,
        "events_published": events,
        "events_received": stats.get("received_events", 0),
        "events_per_s": round(events / wall, 1),
        "bytes_per_event": round(stats.get("bytes", 0) / max(1, events), 1),
        "environment": environment(),
    }
    rows = [
        ["subject", "put GiB/s"],
        ["events off", put_off],
        ["events on", put_on],
        ["ratio on/off", put_on / put_off],
        ["events/s", result["events_per_s"]],
        ["bytes/event", result["bytes_per_event"]],
    ]
    emit(result, args.json, rows)


if __name__ == "__main__":
    main()
