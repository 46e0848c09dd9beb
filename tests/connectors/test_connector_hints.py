"""Session hints through a request's kv_transfer_params: parsed on the scheduler side,
applied to the shared tiers at once and shipped to the workers with the next step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvstore import KVStore
from kvstore.connectors.hints import PARAM, apply_hints, finish_with_hint, request_hint
from kvstore.connectors.plan import Found, Planner
from kvstore.connectors.settings import Counters
from kvstore.keys import BlockKey
from kvstore.testing.data import random_blocks, small_layout

LAYOUT = small_layout()
C = LAYOUT.block_tokens


def request(params: Any, req_id: str = "r") -> Any:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params)


def test_a_request_hint_is_parsed_or_counted_as_rejected() -> None:
    counters = Counters("scheduler")
    hint, rejected = request_hint(request({PARAM: {"retain_s": 60, "session": "s1"}}), counters)
    assert hint is not None and hint[0].retain_s == 60 and hint[1] == "s1" and rejected is None
    assert request_hint(request({"other": 1}), counters) == (None, None)
    assert request_hint(request(None), counters) == (None, None)
    hint, rejected = request_hint(request({PARAM: {"retain_s": -5}}), counters)
    assert hint is None and rejected is not None and rejected["status"] == "rejected"
    assert "retain_s" in rejected["reason"]
    assert counters.snapshot() == {"hints_received": 1, "hints_rejected": 1}


def test_a_malformed_hint_is_answered_with_why_and_changes_nothing(tmp_path: Path) -> None:
    planner = Planner(C, C, lambda t, a, s: {0: []}, lambda k, n, c: Found(0, 0))
    planner.match("r", list(range(C + 2)), 0)
    counters = Counters("scheduler")
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "8MiB"}]}
    with KVStore(LAYOUT, config) as store:
        keep, answer = finish_with_hint(planner, request({PARAM: ["retain"]}), store, counters)
        assert not keep
        assert store.stats()["hints"]["blocks_retained"] == 0
    assert answer is not None and answer[PARAM]["status"] == "rejected"
    assert "mapping" in answer[PARAM]["reason"]
    assert not planner.step([]).hints
    assert finish_with_hint(planner, request(None, "other"), None, counters) == (False, None)


def test_a_finished_requests_hint_reaches_the_shared_store_and_the_workers(
    tmp_path: Path,
) -> None:
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "8MiB"}]}
    with KVStore(LAYOUT, config) as store:
        keys = store.hash_tokens(list(range(3 * C)), namespace="m")
        store.put(keys, random_blocks(LAYOUT, 3))
        by_rank: dict[int, list[BlockKey]] = {0: keys}
        planner = Planner(C, C, lambda t, a, s: by_rank, lambda k, n, c: Found(3, 3))
        planner.match("r", list(range(3 * C + 2)), 0)
        counters = Counters("scheduler")
        params = {PARAM: {"retain_s": 30, "priority": 3, "session": "agent"}}
        keep, answer = finish_with_hint(planner, request(params), store, counters)
        assert not keep  # no output to save: vLLM frees the blocks at once
        assert counters.snapshot()["hints_accepted"] == 1  # the shared tiers retain them
        assert answer is not None  # ... and say so with the request's output
        assert answer[PARAM]["status"] == "accepted" and answer[PARAM]["blocks"] == 3
        assert answer[PARAM]["retain_s"] == 30
        assert store.stats()["hints"]["blocks_retained"] == 3
        (spec,) = planner.step([]).hints  # ... and the next step tells the workers
        assert spec.keys == by_rank and spec.session == "agent" and spec.hint.priority == 3
        assert not planner.step([]).hints
        worker = Counters("worker")
        assert [a.status for a in apply_hints(store, 0, [spec], worker)] == ["accepted"]
        assert apply_hints(store, 1, [spec], worker) == []  # a rank with no keys: nothing
        assert worker.snapshot() == {"hints_accepted": 1}
        # the session can now be named alone, e.g. to demote it when it goes idle
        assert store.hint(session="agent", retain_s=5).status == "accepted"
