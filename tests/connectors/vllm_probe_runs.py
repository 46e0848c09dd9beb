"""Two vLLM processes on one model, for a kvstore hit against vLLM's own prefix-cache hit.

Both run the same two prompts one at a time (``max_num_seqs`` 1, prefill steps of one
256-token chunk): a *seed* of exactly two chunks, then a *target* that extends it by
100 tokens, so the target's full chunks are the seed.

- ``reference``: vLLM's own prefix caching with the do-nothing probe connector
  (examples/vllm_probe.py): the target is vLLM's own hit of the seed's blocks.
- ``kvstore``: kvstore's connector (with the probe), vLLM's prefix caching off: the
  seed misses and is stored, the target is a kvstore hit loaded from the store.

Each run's probe records every full block of each prompt, per KV cache group and
layer, at the step its prefill ends; :func:`compare_blocks` matches them up.

:func:`probe_run` and :func:`side_by_side` are the same runs' parts for tests that lay
out their processes otherwise (test_vllm_hybrid: a reference and a storing run side by
side, then a hit in a process of its own).
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_venv import DRIVER, VLLM_PYTHON, engine_env, run_engine

CHUNK = 256
SEED_TOKENS = 2 * CHUNK
TARGET_TOKENS = SEED_TOKENS + 100
MAX_TOKENS = 16
NAMES = ("reference", "kvstore")  # run_pair's two runs, a core each


def prompts(vocab: int = 2048) -> list[list[int]]:
    """The seed (two whole chunks) and the target (the seed and 100 more tokens)."""
    rng = random.Random(11)
    seed = [rng.randrange(3, vocab) for _ in range(SEED_TOKENS)]
    return [seed, seed + [rng.randrange(3, vocab) for _ in range(TARGET_TOKENS - SEED_TOKENS)]]


def drive(work: Path, name: str, core: str, extra: list[str]) -> dict[str, Any]:
    """One driver process (``reference`` or ``kvstore``) on the seed and the target, in
    prefill steps of one chunk; its JSON result, log and probes (:func:`probe_run`)."""
    args = [*extra, "--max-num-batched-tokens", str(CHUNK)]
    if name == "kvstore":
        args += ["--store", str(work / "store"), "--stats-dir", str(work / "stats")]
    else:
        args += ["--prefix-caching"]
    return probe_run(work, name, args, prompts(), core)


def read_probes(directory: Path) -> dict[int, dict[str, Any]]:
    """The probe's records by prompt length (each prompt's prefill is recorded once)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob("probe-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[int(record["prompt_tokens"])] = record
    return out


def run_pair(work: Path, extra: list[str]) -> dict[str, Any]:
    """The reference and kvstore runs side by side (a core each where there are two);
    a run that failed is its exception, for the tests to report with its log."""
    write_models(work, extra)  # once, before two processes would write them at once
    return side_by_side({name: functools.partial(drive, work, name, extra=extra) for name in NAMES})


def probe_run(
    work: Path,
    name: str,
    args: list[str],
    prompts: list[list[int]],
    core: str | None = None,
    timeout: float = 900,
    in_process: bool = True,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """One driver process ``name`` with the probe (``<work>/<name>-probe``) on ``prompts``,
    one at a time, ``max_tokens`` greedy tokens each with logprobs; ``args``: the model,
    the store or not (without one, the do-nothing probe connector), vLLM's settings.
    ``core``: the cores its OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``).
    ``in_process``:
    vLLM's engine core in the driver's process (steps only while a ``generate`` call
    waits), else in a process of its own (its busy loop steps while any request holds
    blocks, as ``vllm serve``'s does). Its JSON result, with ``wall_s``, ``log`` and
    ``probes`` (:func:`read_probes`)."""
    out, log, probe = work / f"{name}.json", work / f"{name}.log", work / f"{name}-probe"
    (work / f"{name}-prompts.json").write_text(json.dumps(prompts))
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), *args]
    cmd += ["--prompts-file", str(work / f"{name}-prompts.json"), "--probe-dir", str(probe)]
    cmd += ["--max-tokens", str(max_tokens), "--logprobs", "--max-num-seqs", "1"]
    cmd += ["--out", str(out)]
    bind = {"VLLM_CPU_OMP_THREADS_BIND": core} if core is not None else {}
    env = engine_env(in_process, **bind)
    start = time.perf_counter()
    rc = run_engine(cmd, env, log, timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"{name}: rc {rc}\n{log.read_text()[-6000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    result["log"] = log.read_text()
    result["probes"] = read_probes(probe)
    return result


def side_by_side(jobs: dict[str, Callable[[str], dict[str, Any]]]) -> dict[str, Any]:
    """Run each job (given the core it may use) at once, a core each where there are
    enough, else one after the other on the first core; each result by name, or the
    exception it raised (for :func:`run_of` to report)."""
    cores = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {}

    def one(name: str, core: int) -> None:
        try:
            out[name] = jobs[name](str(core))
        except Exception as exc:
            out[name] = exc

    if len(cores) >= len(jobs):
        threads = [threading.Thread(target=one, args=(n, cores[i])) for i, n in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for n in jobs:
            one(n, cores[0])
    return out


def write_models(work: Path, extra: list[str]) -> None:
    """Write the checkpoints the runs of ``extra`` use (``--model``, ``--speculative``)."""
    model = extra[extra.index("--model") + 1]
    code = "import vllm_offline as o, vllm_models as m; from pathlib import Path; w = Path(%r)\n"
    code %= str(work)
    if model == "llama":
        code += "o.write_model(w / 'model')\n"
    else:
        code += f"m.write({model!r}, w / 'model-{model}')\n"
    if "--speculative" in extra:
        code += "m.write_eagle_draft(w / 'eagle', o.MODEL)\n"
    env = dict(os.environ, PYTHONPATH=str(DRIVER.parent))
    subprocess.run([str(VLLM_PYTHON), "-c", code], check=True, env=env, timeout=300)


def compare_blocks(
    loaded: dict[str, Any], source: dict[str, Any], hit_tokens: int
) -> dict[str, dict[str, Any]]:
    """Per KV cache group of ``loaded`` (the target's probe): the blocks of the hit that
    vLLM holds, how many of them equal ``source``'s (a probe of the same tokens' blocks),
    and the layers compared. A block vLLM freed (a sliding window's) is not compared."""
    out: dict[str, dict[str, Any]] = {}
    for gid, group in loaded["groups"].items():
        size = int(group["block_size"])
        held = equal = 0
        for layer, hashes in group["layers"].items():
            theirs = source["groups"][gid]["layers"][layer]
            for j, h in enumerate(hashes[: hit_tokens // size]):
                if h is None:
                    continue
                held += 1
                equal += int(j < len(theirs) and theirs[j] == h)
        out[gid] = {
            "kind": group["kind"],
            "block_size": size,
            "layers": sorted(group["layers"]),
            "blocks_held": held,
            "blocks_equal": equal,
        }
    return out


def run_of(runs: dict[str, Any], name: str) -> dict[str, Any]:
    """Run ``name`` of :func:`run_pair`'s result; the test fails with its error if it failed."""
    got = runs[name]
    if isinstance(got, Exception):
        pytest.fail(str(got))
    return dict(got)


def assert_same_outputs(runs: dict[str, Any], label: str) -> None:
    """The kvstore hit gave vLLM's own hit's 16 greedy tokens and logprobs, request by
    request (and the two requests differ)."""
    ref, kv = run_of(runs, "reference"), run_of(runs, "kvstore")
    print(
        f"\n{label}: reference {ref['wall_s']:.0f} s, kvstore {kv['wall_s']:.0f} s; cached "
        f"{[x['num_cached_tokens'] for x in ref['results']]} vs "
        f"{[x['num_cached_tokens'] for x in kv['results']]}; worker {kv['stats'].get('worker')}"
    )
    assert [x["output"] for x in kv["results"]] == [x["output"] for x in ref["results"]]
    assert [x["logprobs"] for x in kv["results"]] == [x["logprobs"] for x in ref["results"]]
    assert all(len(x["output"]) == 16 for x in kv["results"])
    assert kv["results"][0]["output"] != kv["results"][1]["output"]
