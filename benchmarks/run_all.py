"""Run every benchmark script, then write their JSON, a table of the figures and the plots.

Each script of :data:`REGISTRY` runs as a subprocess (this interpreter,
``--json`` and the entry's arguments for a full run or for ``--quick``), one
after another, with a progress line on stderr. A script that fails or runs past
its timeout is recorded with its error and the tail of its stderr, and the run
goes on; one that prints ``{"skipped": ...}`` is recorded as skipped, and so is one
that stops on an optional dependency it lacks (``No module named 'vllm'``): skipped,
with the reason. Only failures and timeouts make the exit status 1.

Written to ``--out`` (default ``kvstore-bench/`` in the current directory, said at the
start and the end; the committed figures are ``--out docs/benchmarks``):

- ``results.json``: the machine (no host name), the mode, and per benchmark its
  status, seconds and whole JSON;
- ``README.md``: per figure of the registry its value, baseline, target and
  pass / fail, the machine, and the plots;
- the PNG plots of :mod:`_plots` (one whose data is missing is not drawn, and
  the README says why).

``--from-json results.json`` re-renders the table and the plots without running
anything; ``--only NAME --merge`` re-runs one benchmark into an existing
``results.json`` (marked as re-run); ``--peers`` runs only bench_peers.py (every peer
side by side), after the peers' set-up scripts. ``kvstore bench`` runs this script with
the same arguments.

Run: ``python benchmarks/run_all.py [--quick] [--only hash,codec] [--out DIR]``
(``kvstore bench`` runs it under that name, given as ``--prog``: an argument, not a
``KVSTORE_*`` variable, which every script's store would read as a setting).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from _report import Bench, Figure, machine, minutes, render

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Where the outputs go by default: not the checkout's tracked docs/benchmarks/.
DEFAULT_OUT = Path("kvstore-bench")
#: A script that stopped on a module it could not import.
_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
#: ... or on a server binary it could not find (kvstore.cli.servers.require_binary).
_NO_BINARY = re.compile(r"ConfigError: ([\w.-]+) is not installed; run scripts/install-servers")


# -- the registry: data only -------------------------------------------------------------------
def _ratio(path: str, baseline: str, target: str = "", base: str = "", unit: str = "") -> Figure:
    return Figure(path, baseline, target, "x", base, unit)


REGISTRY: tuple[Bench, ...] = (
    Bench(
        "hash",
        "bench_hash.py",
        (
            _ratio("ratio", "vLLM's scheme (sha256 of pickle)", ">= 30", "vllm_ms_per_128k", "ms"),
            Figure("ms_per_128k", "", "<= 0.5", "ms"),
            _ratio(
                "ratio_block16",
                "vLLM's scheme, 16-token blocks (both sides)",
                ">= 30",
                "vllm_ms_per_128k_block16",
                "ms",
            ),
            _ratio(
                "ratio_vs_vllm_real.256",
                "vLLM's own block hasher, 256-token blocks",
                ">= 30",
                "vllm_real_ms_per_128k.256",
                "ms",
            ),
            _ratio(
                "ratio_vs_vllm_real.16",
                "vLLM's own block hasher, 16-token blocks (both sides)",
                ">= 30",
                "vllm_real_ms_per_128k.16",
                "ms",
            ),
            _ratio("ratio_list_input", "vLLM's scheme; kvstore given a Python list"),
            Figure("prefix_lookup_ms_128k", "worst of the stored-block counts", "<= 1", "ms"),
            _ratio("prefix_lookup_flatness", "the smallest store (largest / smallest)"),
        ),
        args=("--scaling",),
        quick_args=("--quick", "--scaling", "--sizes", "10000,100000"),
        timeout_s=900,
    ),
    Bench(
        "index",
        "bench_index.py",
        (
            Figure("index_bytes_per_block", "tracemalloc, at the largest size", "<= 256", "B"),
            Figure("rss_bytes_per_block", "RSS growth minus the KV bytes", "", "B"),
        ),
        timeout_s=600,
    ),
    Bench(
        "codec",
        "bench_codec.py",
        (
            _ratio(
                "results[dtype=bf16,distribution=normal,codec=SHUFFLE_LZ4].ratio",
                "RAW (stored / raw bytes)",
            ),
            _ratio(
                "results[dtype=bf16,distribution=realish,codec=SHUFFLE_LZ4].ratio",
                "RAW (stored / raw bytes)",
            ),
            Figure(
                "results[dtype=bf16,distribution=normal,codec=SHUFFLE_LZ4].decode_gbps",
                "",
                "",
                "GB/s",
            ),
        ),
    ),
    Bench(
        "encodings",
        "bench_encodings.py",
        (
            Figure(
                "results[dtype=bf16,distribution=normal,encoding=fp8_e4m3].encode_gbps",
                "",
                ">= 2",
                "GB/s",
            ),
            Figure(
                "results[dtype=bf16,distribution=normal,encoding=fp8_e4m3].decode_gbps",
                "",
                ">= 2",
                "GB/s",
            ),
            _ratio(
                "results[dtype=bf16,distribution=normal,encoding=fp8_e4m3].decode_vs_memcpy",
                "memcpy of the block",
                "",
                "results[dtype=bf16,distribution=normal,encoding=fp8_e4m3].memcpy_gbps",
                "GB/s",
            ),
            Figure(
                "results[dtype=bf16,distribution=normal,encoding=int8].decode_gbps",
                "",
                ">= 2",
                "GB/s",
            ),
            Figure(
                "results[dtype=bf16,distribution=normal,encoding=int4].decode_gbps",
                "",
                ">= 2",
                "GB/s",
            ),
            _ratio(
                "results[dtype=bf16,distribution=normal,encoding=fp8_e4m3].stored_ratio",
                "raw (stored / layout bytes)",
            ),
            _ratio(
                "results[dtype=bf16,distribution=normal,encoding=int4].stored_ratio",
                "raw (stored / layout bytes)",
            ),
        ),
    ),
    Bench(
        "host_tier",
        "bench_host_tier.py",
        (
            _ratio("put_ratio", "memcpy", ">= 0.8", "memcpy_gbps", "GB/s"),
            _ratio("get_ratio", "memcpy", ">= 0.8", "memcpy_gbps", "GB/s"),
            _ratio(
                "put_first_fill_after_prefault_ratio",
                "memcpy (bar: as put_ratio)",
                ">= 0.8",
                "memcpy_gbps",
                "GB/s",
            ),
            _ratio(
                "put_first_fill_after_prefault_ratio_vs_prefaulted",
                "the same copies into fresh memory prefaulted as the slab is",
                "",
                "prefaulted_copy_gbps",
                "GB/s",
            ),
            _ratio(
                "put_first_fill_ratio",
                "memcpy (fresh tier, right after open)",
                "",
                "memcpy_gbps",
                "GB/s",
            ),
        ),
        timeout_s=1200,
    ),
    Bench(
        "disk_tier",
        "bench_disk_tier.py",
        (
            _ratio("write_ratio", "os.pwrite, 1 thread", ">= 0.8", "raw_write_gbps", "GB/s"),
            _ratio("read_ratio_cold", "os.preadv, cold", ">= 0.8", "raw_read_cold_gbps", "GB/s"),
            _ratio("read_ratio_warm", "os.preadv, warm", ">= 0.9", "raw_read_warm_gbps", "GB/s"),
            _ratio(
                "read_after_write_ratio.keep", "os.preadv, warm", "", "raw_read_warm_gbps", "GB/s"
            ),
            Figure("recovery_s_100k", "reopen 100K blocks (full run only)", "<= 2", "s"),
        ),
        timeout_s=1200,
    ),
    Bench(
        "prefetch",
        "bench_prefetch.py",
        (
            _ratio("overlap_efficiency", "max(load only, compute only)", ">= 0.87"),
            _ratio(
                "speedup_vs_serial", "load, then compute (GPU bar: >= 1.3)", "", "serial_s", "s"
            ),
        ),
        timeout_s=600,
    ),
    Bench(
        "policies",
        "bench_policies.py",
        (
            Figure("chat_hit_rate.lru.0.05", "cache of 5% of the distinct chunks"),
            Figure("chat_hit_rate.s3fifo.0.05", "lru", "", "", "chat_hit_rate.lru.0.05"),
            Figure("chat_hit_rate.arc.0.05", "lru", "", "", "chat_hit_rate.lru.0.05"),
        ),
        args=("--plot", "{tmp}/policies.png"),  # docs/benchmarks/policies.png stays as it is
        timeout_s=900,
    ),
    Bench(
        "remote_tiers",
        "bench_remote_tiers.py",
        (
            _ratio("s3_put_ratio", "boto3 put_object", ">= 0.9", "s3_raw_put_mbps", "MB/s"),
            _ratio("s3_get_ratio", "boto3 get_object", ">= 0.9", "s3_raw_get_mbps", "MB/s"),
            _ratio("redis_put_ratio", "redis-py SET", ">= 0.9", "redis_raw_put_mbps", "MB/s"),
            _ratio("redis_get_ratio", "redis-py GET", ">= 0.9", "redis_raw_get_mbps", "MB/s"),
        ),
    ),
    Bench(
        "encrypt",
        "bench_encrypt.py",
        tuple(
            _ratio(
                f"encrypt_{op}_ratio.{medium}",
                f"{what}, plain",
                ">= 0.8",
                f"{medium}.plain_{op}_gbps",
                "GB/s",
            )
            for medium, what in (
                ("disk", "disk tier (O_DIRECT)"),
                ("s3", "S3 tier (moto)"),
                ("server", "kvstore-server, disk tier"),
            )
            for op in ("put", "get")
        ),
        quick_timeout_s=240,
    ),
    Bench(
        "server",
        "bench_server.py",
        (
            _ratio(
                "tcp_get_ratio_vs_socket", "raw TCP socket", ">= 0.6", "socket_tcp_get_gbps", "GB/s"
            ),
            _ratio("tcp_ratio_vs_redis", "redis-server SET/GET (redis-py)", ">= 4"),
            _ratio("shm_get_ratio_vs_memcpy", "memcpy", ">= 0.7", "memcpy_gbps", "GB/s"),
            _ratio("clients8_scaling", "1 client", ">= 1.5"),
        ),
        timeout_s=900,
        quick_timeout_s=240,
    ),
    Bench(
        "cluster",
        "bench_cluster.py",
        (
            _ratio(
                "peer_fetch_ratio_vs_local",
                "the holding node itself",
                ">= 0.5",
                "local_fetch_gbps",
                "GB/s",
            ),
            Figure("routing_margin", "random routing (hit rate)", ">= 0.2", "", "random_hit_rate"),
            Figure("index_lookup_ms_p50", "", "<= 0.1", "ms"),
            Figure("index_lookup_ms_p99", "", "<= 1", "ms"),
            Figure("redis_bytes_per_block", "Redis used_memory, at the largest size", "", "B"),
        ),
        timeout_s=900,
    ),
    Bench(
        "events",
        "bench_events.py",
        (
            _ratio(
                "put_ratio_events_on_vs_off",
                "the same puts, events off",
                ">= 0.95",
                "put_gib_s_events_off",
                "GiB/s",
            ),
            Figure("events_per_s", "", "", "events/s"),
            Figure("bytes_per_event", "", "", "B"),
        ),
    ),
    Bench(
        "agentic",
        "bench_agentic.py",
        (
            _ratio(
                "turn_ttft_p99_hinted_vs_plain",
                "no hints, same schedule (TTFT p99)",
                "<= 0.7",
                "ttft_ms.plain.p99",
                "ms",
            ),
            _ratio(
                "turn_ttft_p50_hinted_vs_plain",
                "no hints, same schedule (TTFT p50)",
                "",
                "ttft_ms.plain.p50",
                "ms",
            ),
            _ratio(
                "restore_p99_hinted_vs_plain",
                "no hints (the restore alone, p99)",
                "",
                "restore_ms.plain.p99",
                "ms",
            ),
            Figure("fast_tier_hit_rate_hinted", "no hints", "", "", "fast_tier_hit_rate_plain"),
        ),
        timeout_s=600,
        quick_timeout_s=120,
    ),
    Bench(
        "vllm_tier",
        "bench_vllm_tier.py",
        (
            _ratio(
                "store_ratio_vs_vllm_fs",
                "vLLM's fs secondary tier, store",
                ">= 1",
                "vllm_fs_store_gbps",
                "GB/s",
            ),
            _ratio(
                "load_ratio_vs_vllm_fs",
                "vLLM's fs secondary tier, cold load",
                ">= 1",
                "vllm_fs_load_gbps",
                "GB/s",
            ),
            _ratio(
                "lookup_ratio_vs_vllm_fs",
                "vLLM's fs secondary tier, lookups",
                ">= 1",
                "vllm_fs_lookups_per_s",
                "/s",
            ),
            Figure("kvstore_s3_load_gbps", "", "", "GB/s"),
        ),
        timeout_s=900,
        quick_timeout_s=240,
    ),
    Bench(
        "lmcache",
        "bench_lmcache.py",
        (
            _ratio("lmcache_put_ratio", "LMCache put", ">= 3", "lmcache_put_gbps", "GB/s"),
            _ratio(
                "lmcache_put_first_fill_ratio",
                "LMCache put, fresh store",
                ">= 3",
                "lmcache_put_first_fill_gbps",
                "GB/s",
            ),
            _ratio("lmcache_get_ratio", "LMCache get", ">= 1.5", "lmcache_get_gbps", "GB/s"),
            _ratio(
                "lmcache_disk_get_cold_ratio",
                "LMCache disk read, cold",
                ">= 1",
                "lmcache_disk_get_cold_gbps",
                "GB/s",
            ),
            _ratio(
                "lmcache_disk_get_warm_ratio",
                "LMCache disk read, warm",
                ">= 1",
                "lmcache_disk_get_warm_gbps",
                "GB/s",
            ),
            _ratio("lmcache_lookup_ratio", "LMCache lookup", "", "lmcache_lookup_ms", "ms"),
        ),
        timeout_s=1200,
        quick_timeout_s=240,
    ),
    Bench(
        "peers",
        "bench_peers.py",
        (
            _ratio(
                "ratios.mooncake_shm_put_1MiB_c1",
                "Mooncake same-host path (setup_dummy), put, 1 MiB blocks",
                ">= 1",
            ),
            _ratio(
                "ratios.mooncake_shm_get_1MiB_c1",
                "Mooncake same-host path (setup_dummy), get, 1 MiB blocks",
                ">= 1",
            ),
            _ratio(
                "ratios.mooncake_shm_put_32MiB_c1",
                "Mooncake same-host path (setup_dummy), put, 32 MiB blocks",
                ">= 1",
            ),
            _ratio(
                "ratios.mooncake_shm_get_32MiB_c1",
                "Mooncake same-host path (setup_dummy), get, 32 MiB blocks",
                ">= 1",
            ),
            _ratio(
                "vs_memcpy.mooncake_shm_get_1MiB_c1",
                "memcpy (kvstore-server same-host get, 1 MiB blocks)",
                ">= 0.8",
            ),
            _ratio("ratios.mooncake_tcp_get_32MiB_c4", "Mooncake over TCP, get, 4 clients", ">= 1"),
            _ratio("ratios.vllm_fs_disk_put_32MiB_c1", "vLLM's fs tier, store", ">= 1"),
            _ratio("ratios.vllm_fs_disk_get_32MiB_c1", "vLLM's fs tier, cold load", ">= 1"),
            _ratio("ratios.lmcache_host_put_32MiB_c1", "LMCache host put", ">= 1"),
            _ratio("ratios.lmcache_host_get_32MiB_c1", "LMCache host get", ">= 1"),
            _ratio("ratios.lmcache_host_first_fill_32MiB_c1", "LMCache first fill", ">= 1"),
        ),
        timeout_s=2700,
        # Three peers' venvs and ~10 min even when quick: `kvstore bench --peers --quick`.
        quick_args=None,
        quick_timeout_s=1200,
        note="every row and its 90% interval: the benchmark's JSON and peers_*.png; "
        "`kvstore bench --peers [--quick]` runs only this one, after the peers' set-up scripts",
    ),
    Bench(
        "gpu",
        "bench_gpu.py",
        (
            Figure("host_put_ratio", "pinned non_blocking copy, device to host", ">= 0.95", "x"),
            Figure("host_get_ratio", "pinned non_blocking copy, host to device", ">= 0.95", "x"),
            Figure("hbm_get_ratio", "device-to-device copy", ">= 0.8", "x"),
            Figure("get_then_cuda_ratio", "pinned host to device copy", ">= 0.8", "x"),
            Figure("prefetch_overlap", "", ">= 0.9", "x"),
            Figure("prefetch_speedup", "load, then compute", ">= 1.6", "x"),
            Figure("prefetch_first_layer_vs_raw", "one raw layer copy", "<= 2", "x"),
            Figure("prefetch_concurrent4_ratio", "pinned host to device copy", ">= 0.9", "x"),
            Figure("put_layer_ratio", "raw async copies", ">= 0.85", "x"),
            Figure("put_layer_caller_ms", "", "<= 0.05", "ms"),
            Figure("engine_step_save_overhead", "the step without saves", "<= 1.05", "x"),
            Figure("engine_step_load_speedup", "recomputing the prefix", ">= 5", "x"),
        ),
        note="needs a CUDA GPU (skipped without one); figures from an H100: "
        "docs/benchmarks/gpu-h100.json",
    ),
    Bench(
        "gpu_model",
        "bench_gpu_model.py",
        (
            Figure("lengths.16384.hit_speedup_host", "full prefill (TTFT)", ">= 4", "x"),
            Figure(
                "lengths.16384.hit_vs_link_limit", "prefix bytes / pinned H2D rate", "<= 1.25", "x"
            ),
            Figure("lengths.16384.hit_speedup_disk", "full prefill (TTFT)", ">= 1.5", "x"),
            Figure("lengths.16384.save_overhead", "full prefill without saves", "<= 1.05", "x"),
        ),
        timeout_s=900,
        note="needs a CUDA GPU and transformers (skipped without); figures from an H100: "
        "docs/benchmarks/gpu-model-h100.json",
    ),
    Bench(
        "vllm",
        "bench_vllm.py",
        (
            _ratio(
                "hit_vs_nocache",
                "no connector: full prefill (TTFT)",
                "<= 0.5",
                "ttft_nocache_s",
                "s",
            ),
            _ratio(
                "hit_vs_offload",
                "vLLM OffloadingConnector (TTFT; null: it did not run, see offload_error)",
                "<= 1",
                "ttft_offload_s",
                "s",
            ),
            Figure("ttft_hit_s", "", "", "s"),
            _ratio("ttft_speedup", "no connector"),
        ),
        quick_args=None,
        timeout_s=2400,
        note="not part of --quick: its own --quick takes 2-4 minutes here, more than half "
        "the quick budget; run it with `--only vllm --quick`",
    ),
    Bench(
        "restore",
        "bench_restore.py",
        (
            _ratio(
                "slow_planned_vs_nocache",
                "no connector (TTFT); S3 over a 20 MB/s, 50 ms link, planning on",
                "<= 1.05",
                "ttft_nocache_ms",
                "ms",
            ),
            _ratio(
                "slow_unplanned_vs_nocache",
                "no connector (TTFT); the same link, planning off (expected > 1)",
                "> 1",
            ),
            _ratio(
                "slow_second_request_vs_nocache",
                "no connector (TTFT); the same prompts again after the warming",
            ),
            _ratio(
                "fast_planned_vs_unplanned", "planning off (TTFT), chunks on host + disk", "<= 1.02"
            ),
            _ratio("fast_planned_vs_nocache", "no connector (TTFT), chunks on host + disk"),
            Figure("estimate_error_median", "planned / actual S3 load time - 1 (vLLM loads)"),
            Figure("estimate_error_get_prefix_median", "the same, store.get_prefix loads"),
        ),
        quick_args=None,
        timeout_s=1200,
        note="not part of --quick: nine vLLM processes (~9.5 minutes here; its own --quick, "
        "three processes, ~3); run `python benchmarks/bench_restore.py --quick`",
    ),
)


# -- running the scripts ----------------------------------------------------------------------
def script_path(bench: Bench) -> Path:
    """The script's file (a name is looked up in benchmarks/)."""
    path = Path(bench.script)
    return path if path.is_absolute() else HERE / path


def parse_json(stdout: str) -> dict[str, Any] | None:
    """The one JSON object a script printed (the last ``{...}`` line if stdout has more)."""
    text = stdout.strip()
    candidates = [text] + [ln for ln in reversed(text.splitlines()) if ln.startswith("{")]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _tail(stream: IO[bytes], lines: int = 40, chars: int = 4000) -> str:
    stream.seek(0)
    text = stream.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the script's process group (scripts stop their servers on it), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_script(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own process group: (exit status, None on timeout; stdout; stderr tail)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            _stop(proc)
            out, _ = proc.communicate()
            rc = None
        except BaseException:  # Ctrl-C: take the script's servers down with it
            _stop(proc)
            raise
        return rc, out.decode("utf-8", "replace"), _tail(err)


def run_bench(bench: Bench, quick: bool, scratch: Path) -> dict[str, Any]:
    """Run one script; its entry of ``results.json``."""
    script = script_path(bench)
    template = (bench.quick_args if quick else bench.args) or ()
    args = [a.format(tmp=scratch) for a in template]
    shown = [a.format(tmp="<tmp>") for a in template]
    entry: dict[str, Any] = {"script": script.name, "args": ["--json", *shown]}
    if not script.exists():
        return {**entry, "status": "missing", "seconds": 0.0, "error": f"{script} not found"}
    timeout = bench.quick_timeout_s if quick else bench.timeout_s
    start = time.perf_counter()
    rc, stdout, stderr = run_script([sys.executable, str(script), "--json", *args], timeout)
    entry["seconds"] = round(time.perf_counter() - start, 1)
    result = parse_json(stdout)
    if rc is None:
        error = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        error = f"exit status {rc}"
    elif result is None:
        error = "no JSON object on stdout"
    else:
        error = None
    missing = missing_dependency(stderr) if rc not in (None, 0) else None
    if missing is not None:
        return {**entry, "status": "skipped", "reason": f"needs {missing} (not installed)"}
    if error is not None:
        return {
            **entry,
            "status": "timeout" if rc is None else "failed",
            "error": error,
            "stderr_tail": stderr,
            "result": result,
        }
    if result and result.get("skipped"):
        reason = result.get("reason") or result["skipped"]
        return {**entry, "status": "skipped", "reason": str(reason), "result": result}
    return {**entry, "status": "ok", "result": result}


def missing_dependency(stderr: str) -> str | None:
    """The optional dependency a script stopped on -- a module (its last ``No module
    named`` line) or a server binary -- or None: None too for this repository's own
    modules, whose absence is a failure."""
    binary = _NO_BINARY.findall(stderr)
    if binary:
        return binary[-1]
    found = _NO_MODULE.findall(stderr)
    if not found:
        return None
    top = found[-1].split(".")[0]
    own = top == "kvstore" or top.startswith(("_", "bench_")) or (HERE / f"{top}.py").exists()
    return None if own else top


class Progress:
    """A progress line on stderr: a bar redrawn every half second on a terminal, else lines."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.total, self.stream = total, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _line(self, i: int, name: str, began: float) -> str:
        done = int(24 * (i - 1) / max(1, self.total))
        now = time.monotonic()
        return (
            f"[{'#' * done}{'.' * (24 - done)}] {i}/{self.total} {name} "
            f"{now - began:5.0f} s (all: {minutes(now - self.start)})"
        )

    @contextlib.contextmanager
    def step(self, i: int, name: str) -> Iterator[dict[str, Any]]:
        """Show script ``i`` of ``total`` while the block runs; it fills in ``status``."""
        began, outcome = time.monotonic(), {"status": "?"}
        if self.tty:
            self._stop.clear()
            self._thread = threading.Thread(target=self._redraw, args=(i, name, began), daemon=True)
            self._thread.start()
        else:
            print(f"[{i}/{self.total}] {name}: running", file=self.stream, flush=True)
        try:
            yield outcome
        finally:
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
                self._thread = None
            clear = "\r\033[K" if self.tty else ""
            took = time.monotonic() - began
            why = f" ({outcome['why']})" if outcome.get("why") else ""
            msg = f"{clear}[{i}/{self.total}] {name}: {outcome['status']}{why} in {took:.0f} s"
            print(msg, file=self.stream, flush=True)

    def _redraw(self, i: int, name: str, began: float) -> None:
        while True:
            self.stream.write("\r\033[K" + self._line(i, name, began))
            self.stream.flush()
            if self._stop.wait(0.5):
                return


def run_all(benches: Sequence[Bench], quick: bool) -> dict[str, Any]:
    """Run ``benches`` one after another; the ``results.json`` document."""
    doc: dict[str, Any] = {
        "generated_by": "benchmarks/run_all.py",
        "mode": "quick" if quick else "full",
        "machine": machine(),
        "benchmarks": {},
        "not_run": {},
    }
    todo = [b for b in benches if not quick or b.quick_args is not None]
    for b in benches:
        if b not in todo:
            doc["not_run"][b.name] = b.note or "not part of --quick"
    progress = Progress(len(todo))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-run-all-") as tmp:
        for i, bench in enumerate(todo, 1):
            with progress.step(i, bench.name) as outcome:
                entry = run_bench(bench, quick, Path(tmp))
                outcome.update(status=entry["status"], why=entry.get("reason"))
            doc["benchmarks"][bench.name] = entry
    doc["seconds"] = round(time.perf_counter() - start, 1)
    return doc


# -- the command line --------------------------------------------------------------------------
def select(only: str | None) -> list[Bench]:
    """The registry entries ``--only`` names (``hash`` or ``bench_hash.py``), in registry order."""
    if not only:
        return list(REGISTRY)
    names = {n.strip().removesuffix(".py").removeprefix("bench_") for n in only.split(",")}
    unknown = names - {b.name for b in REGISTRY}
    if unknown:
        known = ", ".join(b.name for b in REGISTRY)
        raise SystemExit(f"run_all: unknown benchmark(s) {sorted(unknown)}; choose from {known}")
    return [b for b in REGISTRY if b.name in names]


def peers_only() -> list[Bench]:
    """``--peers``: bench_peers.py alone, its peers set up first (``--setup``); with
    ``--quick`` its quick run (not part of a plain ``--quick``)."""
    bench = next(b for b in REGISTRY if b.name == "peers")
    args, quick = (*bench.args, "--setup"), ("--quick", "--setup")
    return [dataclasses.replace(bench, args=args, quick_args=quick)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    # The command's name in the usage line: ``kvstore bench`` passes ``--prog`` (hidden).
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--prog")
    prog = first.parse_known_args(argv)[0].prog
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--prog", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="every script's --quick run")
    parser.add_argument("--only", help="comma-separated benchmarks (e.g. hash,disk_tier)")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="only the peers side by side (bench_peers.py), after running the peers' set-up "
        "scripts (Mooncake, vLLM, LMCache; each into its own venv)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory of the outputs (default: {DEFAULT_OUT}/ in the current directory; "
        "the committed figures: docs/benchmarks)",
    )
    parser.add_argument(
        "--from-json", type=Path, help="re-render the table and plots from this results.json"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="put the benchmarks run (--only) in place of theirs in OUT/results.json, keep the "
        "others (to re-run one that failed); each is marked as re-run",
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.peers and args.only:
        parser.error("--peers runs bench_peers.py alone (--only peers: without the set-up)")
    return args


def merge(doc: dict[str, Any], into: Path) -> dict[str, Any]:
    """The results in ``into`` (same mode) with ``doc``'s benchmarks in place of theirs."""
    old = json.loads(into.read_text())
    if old.get("mode") != doc["mode"]:
        raise SystemExit(f"run_all: --merge: {into} is a {old.get('mode')} run, not {doc['mode']}")
    when = f"{doc['machine']['date']}, commit {doc['machine']['git_commit']}"
    runs = {**old["benchmarks"], **{n: {**e, "rerun": when} for n, e in doc["benchmarks"].items()}}
    order = [b.name for b in REGISTRY if b.name in runs]
    old["benchmarks"] = {n: runs[n] for n in [*order, *(n for n in runs if n not in order)]}
    for name in doc["benchmarks"]:
        old.get("not_run", {}).pop(name, None)
    return old


def say_skipped(doc: dict[str, Any]) -> None:
    """One stderr line per benchmark that was skipped or not run, and why (no GPU, no vLLM,
    not part of --quick): a run that exits 0 still says what it did not measure."""
    skipped = {
        n: e.get("reason", "") for n, e in doc["benchmarks"].items() if e["status"] == "skipped"
    }
    for name, why in {**skipped, **doc.get("not_run", {})}.items():
        verb = "skipped" if name in skipped else "not run"
        print(f"run_all: {verb}: {name}: {why}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or re-render), write the outputs; 1 if a script failed or timed out."""
    args = parse_args(argv)
    if args.list:
        for b in REGISTRY:
            quick = " ".join(b.quick_args) if b.quick_args is not None else "(not in --quick)"
            print(f"{b.name:13} {b.script:22} full: {' '.join(b.args) or '-'}; quick: {quick}")
        return 0
    out = args.out.resolve()
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        print(f"run_all: writing to {out}", file=sys.stderr)
        doc = run_all(peers_only() if args.peers else select(args.only), args.quick)
        if args.merge:
            doc = merge(doc, args.out / "results.json")
    plots = render(doc, args.out, REGISTRY)
    drawn = sum(p["drawn"] for p in plots)
    print(f"run_all: wrote {out}/README.md, results.json and {drawn} plots", file=sys.stderr)
    say_skipped(doc)
    bad = [n for n, e in doc["benchmarks"].items() if e["status"] in ("failed", "timeout")]
    if bad:
        print(f"run_all: failed: {', '.join(bad)} (see results.json)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
