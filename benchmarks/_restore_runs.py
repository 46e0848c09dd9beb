"""The pieces of bench_restore.py that run and read vLLM: the driver's environment, the
connector's logged metrics, the workload and its keys, one vLLM process, the prefill
calibration, the tiers' configs and the store-side estimate check."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import median, wait_then_kill

if TYPE_CHECKING:
    from kvstore.keys import BlockKey

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
EXAMPLES = ROOT / "examples"
DRIVER = EXAMPLES / "vllm_offline.py"
BUCKET = "kvstore-bench-restore"
S3_PREFIX = "bench-restore"
CHUNK = 256  #: the connector's chunk for the driver's model (its default)
WARMUP = 2  #: requests before the measured ones in every process (one prompt, twice)
S3_DEFAULT_PRIOR = (0.1, 30.0)  #: S3TierConfig's read_gbps / read_latency_ms defaults
QUICK_SKIPS = ("slow_unplanned", "slow_planned_undeclared", "fast_unplanned", "fast_planned")

TARGETS = {
    "slow_planned_vs_nocache": "<= 1.05",
    "fast_planned_vs_unplanned": "<= 1.02",
    "slow_unplanned_vs_nocache": "> 1 (expected: the slow load must cost more than the prefill)",
    "contended_planned_vs_nocache": "<= 1.05 (slow_planned with busy processes throughout)",
    "drift_planned_vs_best": "<= 1.10 (the worst phase of the drift)",
    "drift_follow_requests": "<= 10 (requests after a change before every plan follows it)",
}
DEFINITIONS = {
    "ttft_nocache_ms": "median over prompts of each prompt's median TTFT, no connector",
    "ratios": "median over prompts of (the prompt's median TTFT / its nocache TTFT)",
    "slow_unplanned_vs_nocache": "S3 over the slow link, planning off: every chunk loaded",
    "slow_planned_vs_nocache": (
        "S3 over the slow link, planning on, table and S3 speed declared; its process's first "
        "repetition against nocache's first (slow_planned_undeclared too; the second request "
        "against nocache's second)"
    ),
    "slow_planned_vs_nocache_all_reps": "the same against every nocache repetition",
    "slow_second_request_vs_nocache": (
        "the same prompts again, later in the slow_planned process (after the warming)"
    ),
    "slow_planned_undeclared_vs_nocache": "planning on, S3 at its default prior (optimistic)",
    "fast_planned_vs_unplanned": "host + disk holding the chunks: planning on / off",
    "contended_planned_vs_nocache": (
        "slow_planned_vs_nocache measured again in paired rounds with --busy processes "
        "spinning on the CPUs throughout (both engines under the same contention)"
    ),
    "drift_planned_vs_best": (
        "per drift phase (the link's speed changed): the median over every (round, request) "
        "of the planned engine's TTFT over that of the engine that was right at the same "
        "place (the unplanned or the no-cache one, whichever has the lower median TTFT in "
        "the phase); the worst phase (each phase's planned_vs_best_of_medians is the ratio "
        "of the two engines' median TTFTs)"
    ),
    "drift_follow_requests": (
        "per drift phase after the first: how many requests of the planned engine came "
        "before every later one loaded (or recomputed) as the faster of the other two "
        "engines did; the most over the phases"
    ),
    "fast_planned_vs_nocache": "host + disk holding the chunks, planning on",
    "estimate_error_median": (
        "the connector's workers: restore_planned_s / restore_actual_s - 1 of slow_unplanned's "
        "loads (S3 over the slow link), per logged one-second interval; median"
    ),
    "estimate_error_ttft_median": (
        "per slow_unplanned prompt: the planner's cost model at the declared S3 speed / (its "
        "TTFT - its fast_unplanned TTFT - the S3 lookup) - 1; median"
    ),
    "estimate_error_get_prefix_median": (
        "RestoreStats.estimate_error_median of a store in the benchmark process loading "
        "the prefixes over the same slow link with get_prefix"
    ),
}


# --------------------------------------------------------------------------- helpers


def driver_module() -> Any:
    """``examples/vllm_offline.py`` (it imports vLLM lazily: its model is used here)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("vllm_offline")


def rounded(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded, None kept."""
    return None if value is None else round(value, digits)


def child_env() -> dict[str, str]:
    """vLLM processes: no stray KVSTORE_* settings, a 1 GiB KV cache, moto's credentials,
    vLLM's stats logged every second (its "KV Transfer metrics" carry the workers' reads)."""
    from kvstore.cli import DUMMY_AWS_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(DUMMY_AWS_ENV)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOG_STATS_INTERVAL="1", AWS_EC2_METADATA_DISABLED="true"
    )
    return env


_METRICS = re.compile(r"(\d\d):(\d\d):(\d\d)\S* \[[^\]]*\] KV Transfer metrics: (.*)$")


def kv_metrics(log_text: str) -> list[tuple[float, dict[str, float]]]:
    """The connector stats vLLM logged, one ``(seconds of the day, {name: delta})`` per
    interval ("KV Transfer metrics: name=value, ..."; the last interval may be missing)."""
    out: list[tuple[float, dict[str, float]]] = []
    for line in log_text.splitlines():
        m = _METRICS.search(line)
        if not m:
            continue
        t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
        if out and t < out[-1][0]:  # past midnight
            t += 86400
        data: dict[str, float] = {}
        for part in m.group(4).split(", "):
            name, _, value = part.partition("=")
            with contextlib.suppress(ValueError):
                data[name.strip()] = float(value)
        out.append((float(t), data))
    return out


def tier_reads(intervals: list[tuple[float, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per tier id, the workers' reads summed: bytes, seconds, calls, and per call."""
    out: dict[str, dict[str, float]] = {}
    for _, data in intervals:
        for name, value in data.items():
            if name.startswith("tier_reads/"):
                tier, _, what = name[len("tier_reads/") :].rpartition("/")
                row = out.setdefault(tier, {})
                row[what] = row.get(what, 0.0) + value
    for r in out.values():
        if r.get("seconds") and r.get("calls"):
            r["gbps"] = round(r.get("bytes", 0.0) / r["seconds"] / 1e9, 4)
            r["ms_per_call"] = round(r["seconds"] / r["calls"] * 1e3, 1)
            r["mib_per_call"] = round(r.get("bytes", 0.0) / r["calls"] / 2**20, 3)
    return out


def learned_speed(
    intervals: list[tuple[float, dict[str, float]]], tier: str, prior: tuple[float, float]
) -> dict[str, Any] | None:
    """The read speed the scheduler would have fitted to these reads (kvstore's own
    ``ReadSpeed``, fed once per logged interval instead of once per step: approximate)."""
    from kvstore.restore import ReadSpeed

    now = [0.0]
    speed = ReadSpeed(prior[0], prior[1], 30.0, 300.0, lambda: now[0])
    fed = 0
    for t, data in intervals:
        calls = data.get(f"tier_reads/{tier}/calls", 0.0)
        if calls:
            now[0] = t
            nbytes = data.get(f"tier_reads/{tier}/bytes", 0.0)
            speed.observe(nbytes, data.get(f"tier_reads/{tier}/seconds", 0.0), int(calls))
            fed += 1
    if not fed:
        return None
    est = speed.estimate()
    return {
        "read_gbps": round(est.gbps, 5),
        "read_latency_ms": round(est.latency_ms, 2),
        "intervals": fed,
    }


def read_counters(stats_dir: Path) -> dict[str, dict[str, float]]:
    """The connector's counter files (one per process and role), summed by role."""
    totals: dict[str, dict[str, float]] = {}
    for path in sorted(stats_dir.glob("kvstore-*.json")):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            role = totals.setdefault(str(data.pop("role")), {})
            for name, value in data.items():
                if isinstance(value, (int, float)):
                    role[name] = round(role.get(name, 0) + value, 6)
    return totals


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log (what a failed run reports)."""
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --------------------------------------------------------------------------- the workload


@dataclass
class Workload:
    """The prompts: prefixes (whole chunks), a suffix per phase, a warm-up per process."""

    prefixes: list[list[int]]
    suffix_tokens: int
    vocab: int
    seed: int
    suffixes: dict[str, list[list[int]]] = field(default_factory=dict)

    def prompts(self, phase: str) -> list[list[int]]:
        """Every prefix with this phase's suffix (drawn once per phase)."""
        if phase not in self.suffixes:
            rng = random.Random(f"{self.seed}-{phase}")
            self.suffixes[phase] = [
                [rng.randrange(3, self.vocab) for _ in range(self.suffix_tokens)]
                for _ in self.prefixes
            ]
        return [p + s for p, s in zip(self.prefixes, self.suffixes[phase], strict=True)]

    def warmup(self, name: str, tokens: int) -> list[int]:
        """A prompt of one process's own: a miss everywhere, so it teaches no S3 speed."""
        rng = random.Random(f"{self.seed}-warmup-{name}")
        return [rng.randrange(3, self.vocab) for _ in range(tokens)]


def build_workload(args: argparse.Namespace) -> Workload:
    """Random prefixes of ``--prefix-tokens`` tokens over the driver's vocabulary."""
    vocab = int(driver_module().MODEL["vocab_size"])
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in args.prefix_tokens]
    return Workload(prefixes, args.suffix_tokens, vocab, args.seed)


class Keys:
    """The connector's chunk keys and layout for the driver's model (TP 1): what this
    process needs to read the bucket and the disk directories vLLM wrote."""

    def __init__(self) -> None:
        import torch

        from kvstore import KVLayout, Namespace

        driver = driver_module()
        model = driver.MODEL
        self.layout = KVLayout(
            num_layers=model["num_hidden_layers"],
            num_kv_heads=model["num_key_value_heads"],
            head_dim=model["head_dim"],
            block_tokens=CHUNK,
            dtype=torch.float32,  # the driver's default dtype
        )
        ns = Namespace(model=driver.MODEL_IDS["llama"], layout=self.layout, tp_rank=0, tp_size=1)
        self.seed = ns.seed

    def of(self, tokens: Sequence[int]) -> list[BlockKey]:
        """The keys of ``tokens``' full chunks."""
        from kvstore.keys import chain_keys, tokens_to_bytes

        return list(chain_keys(tokens_to_bytes(list(tokens)), CHUNK, self.seed))

    def on_disk(self, directory: Path, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys`` a disk tier at ``directory`` holds (its file layout)."""
        base = directory / "kvstore-v1" / self.layout.fingerprint_hex
        return sum((base / k.hex()[:2] / f"{k.hex()}.kvb").exists() for k in keys)


# --------------------------------------------------------------------------- vLLM runs


@dataclass
class Run:
    """One vLLM process: its name, requests, store config (None: no connector)."""

    name: str
    requests: list[list[int]]
    store_config: dict[str, Any] | None
    repeat: int = 1
    gap_s: float = 0.0  # idle seconds between repetitions (a user's think or tool time)


class RunFailed(RuntimeError):
    """A vLLM process failed; the message has the tail of its log."""


def launch(run: Run, work: Path, args: argparse.Namespace, lockstep: Path | None = None) -> Any:
    """Start the driver on ``run`` in a new process (its own session); its ``Popen``.
    ``lockstep``: the driver's ``--lockstep`` directory (each request waits its turn)."""
    prompts_file = work / f"{run.name}-prompts.json"
    prompts_file.write_text(json.dumps(run.requests))
    out, log_path = work / f"{run.name}.json", work / f"{run.name}.log"
    stats_dir = work / f"{run.name}-stats"
    cmd = [str(VLLM_PYTHON), str(DRIVER), "--workdir", str(work), "--model", "llama"]
    cmd += ["--prompts-file", str(prompts_file), "--max-tokens", str(args.max_tokens)]
    cmd += ["--repeat", str(run.repeat), "--gap-s", str(run.gap_s), "--out", str(out)]
    if run.store_config is not None:
        cmd += ["--store-config", json.dumps(run.store_config), "--stats-dir", str(stats_dir)]
    if lockstep is not None:
        cmd += ["--lockstep", str(lockstep)]
    with open(log_path, "w") as logf:
        return subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=child_env(),
            cwd=ROOT,
            start_new_session=True,
        )


def collect(run: Run, proc: Any, work: Path, timeout: float | None) -> dict[str, Any]:
    """Wait for ``proc`` (``run``'s driver; killed whole at the end, vLLM's engine and
    worker processes too); its JSON result with its counters and logged metrics."""
    out, log_path = work / f"{run.name}.json", work / f"{run.name}.log"
    rc = wait_then_kill(proc, timeout)
    if rc != 0 or not out.exists():
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
        raise RunFailed(f"{run.name}: {why}\n{tail(log_path)}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["counters"] = read_counters(work / f"{run.name}-stats")
    result["kv_metrics"] = kv_metrics(log_path.read_text(errors="replace"))
    return result


def drive(run: Run, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run the driver on ``run`` to its end; its JSON result with the process's seconds,
    counters and logged metrics (:func:`launch`, :func:`collect`)."""
    start = time.perf_counter()
    result = collect(run, launch(run, work, args), work, args.timeout)
    result["process_s"] = round(time.perf_counter() - start, 1)
    return result


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several processes of one configuration as one result: their repetitions in turn,
    their counters and metrics side by side (``processes``)."""
    return {
        "repetitions": [rep for r in parts for rep in r["repetitions"]],
        "process_s": [r["process_s"] for r in parts],
        "counters": [r["counters"] for r in parts],
        "kv_metrics": [x for r in parts for x in r["kv_metrics"]],
        "processes": len(parts),
    }


def summarize(result: dict[str, Any], reps: Sequence[int] | None = None) -> dict[str, Any]:
    """A configuration's figures from its repetitions ``reps`` (default: all), warm-up
    requests left out: TTFT per request and per prompt, tokens vLLM reported cached."""
    repetitions = result["repetitions"]
    chosen = [repetitions[r][WARMUP:] for r in (reps or range(len(repetitions)))]
    prompt_s = [median([rep[i]["ttft_s"] for rep in chosen]) for i in range(len(chosen[0]))]
    return {
        "ttft_ms": round(median(prompt_s) * 1e3, 1),
        "ttft_ms_per_prompt": [round(t * 1e3, 1) for t in prompt_s],
        "ttft_ms_per_request": [[round(r["ttft_s"] * 1e3, 1) for r in rep] for rep in chosen],
        "cached_tokens": [[r["num_cached_tokens"] for r in rep] for rep in chosen],
        "prompt_tokens": [r["prompt_tokens"] for r in chosen[0]],
        "_prompt_s": prompt_s,
    }


def versus(config: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    """Median over prompts of ``config``'s TTFT / ``base``'s for the same prompt."""
    if not config or not base:
        return None
    pairs = zip(config["_prompt_s"], base["_prompt_s"], strict=True)
    return rounded(median([a / b for a, b in pairs]))


def prefill_samples(result: dict[str, Any]) -> list[tuple[int, float]]:
    """Every full prefill of the nocache process but its very first (cold) request:
    ``(prompt tokens, TTFT seconds)`` of the warm-up prompt and of the measured ones."""
    samples = []
    for r, rep in enumerate(result["repetitions"]):
        for i, req in enumerate(rep):
            if r or i:
                samples.append((int(req["prompt_tokens"]), float(req["ttft_s"])))
    return samples


def calibration(samples: list[tuple[int, float]]) -> tuple[list[list[float]], dict[str, Any]]:
    """The planner's ``prefill_table`` from nocache's TTFTs, and the fit behind it.

    TTFT = c + a * tokens + b * tokens^2 (least squares, no coefficient negative: the
    best such subset of the three terms); the table is ``[tokens, a*t + b*t^2]`` at each
    prompt length measured. A fit, not the raw medians: the same prompt's TTFT varies by
    +-30% between requests on this VM, and raw medians of nearby lengths can fall or stay
    flat, which tells the planner that the tokens between them cost nothing. The
    constant c (per-request overhead, paid loaded or not) is left out of the table: the
    plan weighs differences of it, and the curve starts at (0, 0).
    """
    import numpy as np

    n = np.array([t for t, _ in samples], dtype=float)
    y = np.array([s for _, s in samples], dtype=float)
    columns = {"c": np.ones_like(n), "a": n, "b": n * n}
    best: tuple[float, dict[str, float]] | None = None
    for terms in (("c", "a", "b"), ("c", "a"), ("c", "b"), ("a", "b"), ("a",), ("b",)):
        x = np.stack([columns[k] for k in terms], axis=1)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if (coef < 0).any():
            continue
        rss = float(((x @ coef - y) ** 2).sum())
        if best is None or rss < best[0]:
            best = (rss, {k: float(v) for k, v in zip(terms, coef, strict=True)})
    assert best is not None  # ("a",) alone is >= 0 for positive TTFTs
    fit = best[1]
    a, b = fit.get("a", 0.0), fit.get("b", 0.0)
    table = [[t, round(a * t + b * t * t, 4)] for t in sorted({int(t) for t in n})]
    summary = {
        "intercept_ms": round(fit.get("c", 0.0) * 1e3, 2),
        "ms_per_token": round(a * 1e3, 6),
        "ms_per_token_squared": round(b * 1e3, 10),
        "samples": len(samples),
        "rms_error_ms": round((best[0] / len(samples)) ** 0.5 * 1e3, 1),
        "by_length_median_ms": {
            str(t): round(median([s for u, s in samples if u == t]) * 1e3, 1)
            for t in sorted({t for t, _ in samples})
        },
    }
    return table, summary


# --------------------------------------------------------------------------- store configs


def s3_tier(url: str, declared: tuple[float, float] | None) -> dict[str, Any]:
    """The bucket as a tier (raw codec: the link carries exactly the planner's bytes)."""
    tier: dict[str, Any] = {
        "kind": "s3",
        "bucket": BUCKET,
        "prefix": S3_PREFIX,
        "endpoint_url": url,
        "region": "us-east-1",
        "addressing_style": "path",
        "codec": "raw",
    }
    if declared is not None:
        tier["read_gbps"], tier["read_latency_ms"] = declared
    return tier


def disk_tier(path: Path) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity": "4GiB"}


def restore_section(table: list[list[float]] | None) -> dict[str, Any]:
    """Planning on with the calibrated table, or off (None)."""
    return {"planning": False} if table is None else {"prefill_table": table}


# --------------------------------------------------------------------------- this process's store


def get_prefix_errors(
    url: str, keys: Keys, prefixes: list[list[int]], declared: tuple[float, float], passes: int
) -> dict[str, Any]:
    """Load every stored prefix ``passes`` times with ``get_prefix`` from a store whose
    only tier is the bucket at ``url`` (declared speed; planning off, so every load is
    timed against its plan): its restore statistics and learned S3 speed."""
    import torch

    from kvstore import KVStore
    from kvstore.config import StoreConfig

    config = StoreConfig.load({"tiers": [s3_tier(url, declared)], "restore": {"planning": False}})
    loads: list[dict[str, Any]] = []
    with KVStore(keys.layout, config) as store:
        for p in range(passes):
            for i, prefix in enumerate(prefixes):
                ks = keys.of(prefix)
                out = torch.empty(keys.layout.tensor_shape(len(ks)), dtype=keys.layout.dtype)
                start = time.perf_counter()
                planned = store.plan(ks, prompt_tokens=len(prefix)).load_s
                lookup = time.perf_counter() - start
                start = time.perf_counter()
                n = store.get_prefix(ks, out, prompt_tokens=len(prefix))
                actual = time.perf_counter() - start
                loads.append(
                    {
                        "pass": p,
                        "prompt": i,
                        "chunks": n,
                        "stored": len(ks),
                        "planned_ms": round(planned * 1e3, 1),
                        "get_prefix_ms": round(actual * 1e3, 1),
                        "plan_ms": round(lookup * 1e3, 1),
                        # get_prefix plans (a lookup: ~plan_ms) before it loads
                        "load_ms": round((actual - lookup) * 1e3, 1),
                    }
                )
        stats = store.stats()
    restore = stats.get("restore", {})
    tiers = stats.get("tiers") or [{}]
    s3 = tiers[0] if isinstance(tiers, list) else next(iter(tiers.values()), {})
    found = all(x["chunks"] == x["stored"] for x in loads)
    return {
        "median": rounded(restore.get("estimate_error_median")) if found else None,
        "found_every_chunk": found,
        "plan_ms_median": round(median([x["plan_ms"] for x in loads]), 1),
        "loads": loads,
        "learned": {
            k: s3.get(k)
            for k in ("read_gbps_estimate", "read_latency_ms_estimate", "read_speed_source")
        },
    }


def top_up(url: str, keys: Keys, directory: Path, all_keys: list[BlockKey]) -> int:
    """Copy into the disk tier at ``directory`` the chunks of ``all_keys`` it lacks, from
    the bucket; how many it holds afterwards."""
    from kvstore import KVStore
    from kvstore.config import StoreConfig

    config = StoreConfig.load({"tiers": [disk_tier(directory), s3_tier(url, None)]})
    with KVStore(keys.layout, config) as store:
        store.hint(all_keys, prefetch=True)
        store.drain(timeout=120)
    return keys.on_disk(directory, all_keys)
