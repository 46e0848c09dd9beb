"""NVIDIA Dynamo's indexer, fed the same KV events as a converging view (churn, disk
faults, subscriber and store restarts), answers the prefix lengths the tiers hold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from convergence_rig import BLOCK, Rig, converged, dynamo_prefix, opened_rig, soak
from dynamo_indexer import DynamoIndexer, dynamo_marks

from kvharness.event_view import EventView

pytestmark = dynamo_marks(180)

WORKER = 11


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from opened_rig(tmp_path)


def test_dynamos_indexer_answers_the_prefix_lengths_the_tiers_hold(rig: Rig) -> None:
    with DynamoIndexer(block_size=BLOCK) as idx:
        idx.register(WORKER, rig.events["endpoint"], replay_endpoint=rig.events["replay_endpoint"])
        view = EventView(rig.events["endpoint"], rig.events["replay_endpoint"]).start()
        try:
            prompts = soak(rig, [view])
            assert converged(rig, view) == {"phantom": 0, "missed": 0, "wrong_medium": 0}
        finally:
            view.close()
        expected = [dynamo_prefix(rig, p) for p in prompts]
        assert any(expected)
        for tokens, want in zip(prompts, expected, strict=True):
            got = idx.wait_for(tokens, WORKER, lambda m, w=want: m.longest_matched == w)
            assert got.longest_matched == want
